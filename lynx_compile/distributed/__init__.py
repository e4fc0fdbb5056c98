"""Multi-process training support (issue C): tensor parallelism, the emulated link for CPU
benchmarks, plan agreement across ranks, and failure reporting."""
