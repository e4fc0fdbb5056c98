"""The programs a user runs. The library imports none of them.

- ``cli``: the ``lynx`` console script (``lynx plan``, ``demo``, ``simulate``, ``train``, ``cache``).
- ``demo``: ``lynx demo``; its table in ``demo_table``, its plot in ``demo_plot``.
- ``train``: ``lynx train`` (also ``python -m lynx_compile.train``, what ``torchrun`` launches);
  what it builds first in ``train_setup``, what it measures and prints in ``train_result``,
  its pipeline-parallel loop (``lynx train --pp``) in ``train_pp``.
- ``torchtitan_train``: torchtitan's training step compiled by a named backend
  (``python -m lynx_compile.torchtitan_train``); torchtitan's models as lynx builds them in
  ``torchtitan_models``.
"""
