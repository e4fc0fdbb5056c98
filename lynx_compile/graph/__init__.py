"""Facts about an FX graph's nodes that every model of it reads: the sizes of their values as
plain ints (``values``: symbolic and data-dependent sizes hinted) and which nodes are
collectives (``collectives``). Below the cost model (``costs``) and the memory model
(``memory``), which both use them; imports nothing of lynx but ``_compat``."""
