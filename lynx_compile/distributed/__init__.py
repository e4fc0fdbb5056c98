"""Multi-process training support (issue C): tensor parallelism, the emulated link for CPU
benchmarks, plan agreement across ranks, failure reporting, and what a plan put in expert-parallel
all-to-all windows (``expert_parallel``)."""
