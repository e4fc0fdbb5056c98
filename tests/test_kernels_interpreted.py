"""Runs ``tests/kernels`` in its own pytest process with ``TRITON_INTERPRET=1``: the variable
must be set before triton is imported, which this process may already have done."""
import os
import subprocess
import sys

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))


@pytest.mark.timeout(900)
def test_triton_kernels_under_the_interpreter():
    pytest.importorskip("triton")
    env = dict(os.environ, TRITON_INTERPRET="1")
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                           os.path.join(HERE, "kernels")], env=env, capture_output=True, text=True, timeout=880)
    assert proc.returncode == 0, proc.stdout[-6000:] + proc.stderr[-3000:]
