"""The recompute core: from torch's partitioner call to the partitioned graphs.

``partition.lynx_partition`` is the entry (AOTAutograd's partitioner); it builds the optimizer's
problem from the joint graph (``problem_from_graph``), lets ``decide`` choose among lynx's optimizer
(``optimize``, over ``lynx_compile.solver``) and the baselines seeded as candidates
(``baselines``: none, full, Megatron's selective, torch's min-cut) under one budget, and applies
the chosen ``Decisions`` (``apply``: tag, partition, rewrite, simulate). Nothing here is imported
by this ``__init__``: import the module you need.
"""
