"""``benchmarks/gpu_session.sh``, the script a session lent a GPU runs: its usage check. Its CPU
flow (``LYNX_GPU_SESSION_DEVICE=cpu bash benchmarks/gpu_session.sh all``: the same steps with
``--device cpu --quick``, 3-4 minutes on 2 cores) is run by hand, not here: the script matters
only on a GPU, and the suite's time is better spent on lynx itself."""
import os
import subprocess
import sys

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(REPO, "benchmarks", "gpu_session.sh")


def _run(args, out, **env):
    return subprocess.run(["bash", SCRIPT, *args], cwd=REPO, capture_output=True, text=True, timeout=280,
                          env=dict(os.environ, OUT=str(out), PYTHON=sys.executable, **env))


def test_unknown_part_is_refused(tmp_path):
    proc = _run(["bogus"], tmp_path)
    assert proc.returncode == 2 and "usage" in proc.stderr
