#!/usr/bin/env bash
# Smoke test on torch 2.11 (the GPU machines' torch; the main suite runs on 2.13).
#
# Creates, or reuses, a virtualenv holding torch==2.11.0 (pinned: pip never resolves torch on its
# own), installs the project's dependencies into it without letting them replace that torch,
# installs the project (editable, --no-deps; the "lynx" backend is found through its entry point)
# and runs tests/test_smoke_versions.py: import, then one training step of gpt-tiny under every
# policy and both compilers, loss and gradients equal to eager; and one ZBV pipeline of 2 gloo
# ranks (tests/test_pipeline_per_microbatch.py); the step's pieces (tests/test_step_pieces.py);
# the recompute priced by kernel against Inductor's scheduler (tests/test_kernel_pricing.py);
# data-dependent sizes read from AOTAutograd's backward node (tests/test_unbacked_sizes.py).
#
#   LYNX_TORCH211_VENV      the virtualenv (default $HOME/.cache/lynx/venv-torch2.11); reused
#                           when it already has torch 2.11
#   LYNX_TORCH211_INDEX_URL optional index for the torch wheel (e.g. the CPU-only
#                           https://download.pytorch.org/whl/cpu); default: pip's own (PyPI's
#                           torch 2.11.0 is the CUDA 13 build the GPU machines run, ~5 GB)
#   PYTHON                  interpreter that creates the virtualenv (default python3)
set -euo pipefail
cd "$(dirname "$0")/.."

TORCH_VERSION=2.11.0
TRITON_VERSION=3.6.0  # torch 2.11's own pin
VENV="${LYNX_TORCH211_VENV:-$HOME/.cache/lynx/venv-torch2.11}"
PY="$VENV/bin/python"
start=$(date +%s)

has_torch211() {
    [ -x "$PY" ] && "$PY" -c "import sys, torch; sys.exit(0 if torch.__version__.split('+')[0] == '$TORCH_VERSION' else 1)" 2>/dev/null
}

if has_torch211; then
    echo "smoke_torch211: reusing $VENV ($("$PY" -c 'import torch; print(torch.__version__)'))"
else
    if [ ! -x "$PY" ]; then
        mkdir -p "$(dirname "$VENV")"
        "${PYTHON:-python3}" -m venv "$VENV"
    fi
    "$PY" -m pip install -q --upgrade pip >/dev/null 2>&1 || true
    echo "smoke_torch211: installing torch==$TORCH_VERSION into $VENV"
    "$PY" -m pip install -q ${LYNX_TORCH211_INDEX_URL:+--index-url "$LYNX_TORCH211_INDEX_URL"} "torch==$TORCH_VERSION"
fi
installed=$(date +%s)

# Everything else, with torch held at the installed version.
constraints="$(mktemp)"
trap 'rm -f "$constraints"' EXIT
echo "torch==$("$PY" -c 'import torch; print(torch.__version__)')" > "$constraints"
"$PY" -m pip install -q -c "$constraints" numpy "pyomo>=6.7" "highspy>=1.7" "pytest>=7" "pytest-timeout>=2" \
    "matplotlib>=3.7" "triton==$TRITON_VERSION"
"$PY" -m pip install -q --no-deps -e .
has_torch211 || { echo "smoke_torch211: torch in $VENV is not $TORCH_VERSION after installing the deps" >&2; exit 1; }
deps=$(date +%s)

# plus the pieces of a step planned together (autograd hooks, profiler marks: step.recorder), and
# one ZBV pipeline on 2 gloo ranks with per-micro-batch variants: torch 2.11's multi-stage
# schedules differ from 2.13's (their warm-up sent to the rank's own other stage)
"$PY" -m pytest -q -p no:cacheprovider --timeout 600 tests/test_smoke_versions.py tests/test_pipeline_per_microbatch.py \
    tests/test_step_pieces.py tests/test_kernel_pricing.py tests/test_unbacked_sizes.py
end=$(date +%s)
echo "smoke_torch211: torch $((installed - start)) s, deps+project $((deps - installed)) s, tests $((end - deps)) s, total $((end - start)) s"
