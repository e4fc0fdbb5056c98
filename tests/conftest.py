import logging

import pytest
import torch


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
