"""The programs a user runs; the library imports none of them.

- ``cli``: the ``lynx`` console script (``lynx plan``, ``demo``, ``simulate``, ``train``, ``cache``).
- ``demo``: ``lynx demo``.
- ``train`` and ``train_setup``: ``lynx train`` (``python -m lynx_compile.train`` runs it too).
- ``torchtitan_train``: torchtitan's training step compiled by a named backend
  (``python -m lynx_compile.torchtitan_train``).
"""
