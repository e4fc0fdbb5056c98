import logging
import os
import sys
from pathlib import Path

# The repository's root is on sys.path under `python -m pytest` (the working directory), where
# its top-level `kernels/` folder (installed as `lynx_compile.kernels`) shadows Hugging Face's
# `kernels` package, which transformers >= 5 imports: "cannot import name 'CUDAProperties' from
# 'kernels'". lynx is installed (`pip install -e .`), so the root is not needed: drop it before
# anything imports transformers (children of tests/_dist.py take this sys.path too).
_ROOT = Path(__file__).resolve().parent.parent
sys.path[:] = [p for p in sys.path if Path(p or os.getcwd()).resolve() != _ROOT]

import pytest  # noqa: E402
import torch  # noqa: E402

# Kernel tests need TRITON_INTERPRET=1 before triton is imported; test_kernels_interpreted.py
# runs them in their own process with it set.
collect_ignore = [] if os.environ.get("TRITON_INTERPRET", "") not in ("", "0") else ["kernels"]


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    """Each test compiles from scratch: no cached graphs or recompile limits carried over."""
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


@pytest.fixture(autouse=True)
def _torch_threads():
    """Each test starts with the worker's thread count: a test that sets one thread (bitwise
    stable reductions) and fails or forgets to set it back would change what later tests in the
    same worker measure (gpt-tiny per block at 0.5 on one thread measures 64 KiB above lynx's
    model of a candidate that did not run, 0.533 of torch.compile's step where four threads
    measure 0.509: session 36, ``test_per_block_budget_holds_on_the_measured_whole_step`` failing
    in full runs only)."""
    threads = torch.get_num_threads()
    yield
    if torch.get_num_threads() != threads:
        torch.set_num_threads(threads)


@pytest.fixture
def lynx_log(caplog):
    caplog.set_level(logging.INFO, logger="lynx_compile")
    return caplog


def pytest_collection_modifyitems(config, items):
    """Test files longest first (``tests/file_seconds.json``, measured; files not in it after, in
    their own order): with ``--no-loadscope-reorder`` pytest-xdist hands them out in this order."""
    from _file_seconds import load  # (tests/ is on sys.path, as for _steps and _dist)

    seconds = load()
    items.sort(key=lambda item: -seconds.get(item.path.name, 0.0))  # stable: a file stays whole
