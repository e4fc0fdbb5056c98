# Set-up and checks. `make demo` and `make test` install whatever is missing first.
# torch is always installed pinned, before the project, so pip never resolves a CUDA build
# on its own (the project's own pin, torch>=2.11,<2.14, is then already satisfied).
PYTHON ?= python3
TORCH_VERSION ?= 2.13.0
PYTEST_ARGS ?=
# test files spread over this many processes (pytest-xdist; a file's tests stay in one process, so
# its module fixtures are built once); 0 runs them all in this process. A crashed process is not
# replaced (--max-worker-restart 0): pytest-xdist 3.8's --dist loadfile can hang for good on a
# replacement (pytest-xdist#784, #1323), and it did for 90 min in CI (stop 67); the run ends at
# once, naming the test the process died in
PYTEST_WORKERS ?= 2

.PHONY: install install-test install-torchtitan demo test bench plan clean gpu-wheels

install:
	@$(PYTHON) -c "import torch, sys; v = tuple(map(int, torch.__version__.split('+')[0].split('.')[:2])); sys.exit(0 if (2, 11) <= v <= (2, 13) else 1)" 2>/dev/null \
		|| { echo "make: no torch 2.11-2.13 found; installing torch==$(TORCH_VERSION), pinned so pip never picks a build on its own (~1 min)"; \
		     $(PYTHON) -m pip install -q "torch==$(TORCH_VERSION)"; }
	@command -v glpsol >/dev/null 2>&1 || { \
		if [ "$$(id -u)" = 0 ]; then apt-get update -qq && apt-get install -y -qq glpk-utils; \
		elif command -v sudo >/dev/null 2>&1; then sudo apt-get update -qq && sudo apt-get install -y -qq glpk-utils; \
		else echo "warning: glpsol (GLPK) not found; install it with: apt-get install -y glpk-utils"; fi; }
	$(PYTHON) -m pip install -q -e .

install-test: install install-torchtitan
	$(PYTHON) -m pip install -q -e ".[test]"

# torchtitan (tests/test_torchtitan.py, bench_budget's tt-* models): the pyproject extra
# `torchtitan`, installed with --no-deps (pip never resolves torch or torchtitan's heavy
# requirements). torchtitan 0.3.0 needs Python >= 3.11; on older ones it is skipped, and so is
# its test file.
install-torchtitan:
	@if $(PYTHON) -c "import sys; sys.exit(0 if sys.version_info >= (3, 11) else 1)"; then \
		$(PYTHON) -m pip install -q --no-deps $$($(PYTHON) -c "import tomllib; \
			print(' '.join(tomllib.load(open('pyproject.toml', 'rb'))['project']['optional-dependencies']['torchtitan']))"); \
	else echo "torchtitan needs Python >= 3.11: not installed (tests/test_torchtitan.py skips)"; fi

demo: install
	$(PYTHON) -m pip install -q -e ".[plots]"
	lynx demo

plan: install
	lynx plan --model gpt-small --policy selective

test: install-test
	$(PYTHON) -m pytest -q $(if $(filter 0,$(PYTEST_WORKERS)),,-n $(PYTEST_WORKERS) --dist loadfile --no-loadscope-reorder --max-worker-restart 0) $(PYTEST_ARGS)

bench: install
	$(PYTHON) benchmarks/bench_policies.py

# Wheels the lent GPU machines (Python 3.12, x86-64, no network) lack, for `benchmarks/gpu_session.sh`
# (device calls name ".whl" in carry). Their only other requirement, numpy, is already there (as are
# torch, triton, pytest, pytest-timeout, pytest-xdist, matplotlib, transformers). Pinned to the
# versions installed here; one version of each, or the install there stops.
# The second line is for `gpu_session.sh titan` (torchtitan's own trainer, `-m torchtitan.train`):
# the pyproject extra `torchtitan`, then what the trainer imports beyond it and the GPU image lacks
# (the image has tensorboard, tokenizers, safetensors, pyarrow, pandas, xxhash, httpx, aiohttp,
# huggingface-hub): torchdata (its data loader), datasets with dill and multiprocess (the llama3
# config registry imports its text loader; torchtitan 0.3.0 requires datasets<4.8, so 4.7.0 and the
# dill / multiprocess / fsspec versions 4.7.0 declares). Not installed here (make install-torchtitan
# stays the model/config/loss/compile set); tried here with `pip install --target` outside the venv.
GPU_WHEELS ?= pyomo==6.10.1 highspy==1.16.0 \
	torchtitan==0.3.0 spmd_types==0.2.3 tyro==1.0.17 docstring-parser==0.18.0 typeguard==4.6.1 typing_extensions==4.16.0 \
	torchdata==0.11.0 datasets==4.7.0 dill==0.4.0 multiprocess==0.70.18 fsspec==2026.2.0

gpu-wheels:
	rm -rf .whl && mkdir -p .whl
	$(PYTHON) -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
		--platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 \
		--platform manylinux2014_x86_64 --platform manylinux1_x86_64 -d .whl $(GPU_WHEELS)
	@ls .whl && du -sh .whl

clean:
	rm -rf build dist *.egg-info .pytest_cache
