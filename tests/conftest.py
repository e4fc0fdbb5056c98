import logging
import os

import pytest
import torch

# Kernel tests need TRITON_INTERPRET=1 before triton is imported; test_kernels_interpreted.py
# runs them in their own process with it set.
collect_ignore = [] if os.environ.get("TRITON_INTERPRET", "") not in ("", "0") else ["kernels"]


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    """Each test compiles from scratch: no cached graphs or recompile limits carried over."""
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


@pytest.fixture
def lynx_log(caplog):
    caplog.set_level(logging.INFO, logger="lynx_compile")
    return caplog
