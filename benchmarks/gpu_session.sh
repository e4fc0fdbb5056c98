#!/usr/bin/env bash
# The GPU numbers issue G owes, in one or two calls of the device tool (one NVIDIA H100/H200,
# torch 2.11.0+cu130, triton 3.6, Python 3.12, no network):
#
#   bash benchmarks/gpu_session.sh [step|checks|compile|titan|all]   (default: step)
#
#   step    One training step of gpt-1.3b cut to 4 layers, batch 2 x 2048, bf16, dropout 0, with
#           explicit attention and with SDPA; variants eager, checkpoint, inductor,
#           inductor-b0.7/0.5/0.3/0.0, lynx-none, lynx-full, lynx-b0.7/0.5/0.3
#           (benchmarks/bench_step.py's measurement; step_ms from one interleaved process).
#           Writes $OUT/env.txt, step.log, step_cuda.md (both attentions), step_raw.tgz (CSV, PNG,
#           plans/: each lynx variant's plans as JSON, what it saved and recomputed).
#   checks  Correctness on the GPU: tests/test_side_stream.py's CUDA test and tests/test_inductor.py
#           (its CUDA cases: dropout-mask replay, dropout-0 gradients equal eager), tests/kernels
#           (under TRITON_INTERPRET=1, see below), a dropout-0.1 fp32 run of inductor,
#           inductor-b0.5 and lynx-b0.5 (gradients against inductor's), then
#           benchmarks/bench_kernels.py alone on the GPU. Writes $OUT/env.txt, checks.log,
#           step_cuda_dropout.md, kernels_cuda.md, checks_raw.tgz (CSV, PNG).
#   compile First-step time cold and warm (issue P) on the GPU, one process at a time, nothing
#           beside it: per variant (inductor, lynx-b0.7, inductor-b0.7, lynx-none, lynx-b0.6 on the
#           step's shape, SDPA) a fresh Inductor/Triton cache directory, the first step cold, then
#           the same process again on that directory (warm: torch's caches and lynx's plan cache).
#           Writes $OUT/compile.log, compile_cuda.md (first_step_s cold / warm, ratios to
#           inductor's, lynx's plan-cache log lines), after tests/test_plan_cache.py's CUDA test
#           (AOTAutograd's cache serves a plan that replays SDPA's dropout). About 4-5 minutes.
#   titan   torchtitan 0.3.0's own trainer, `torchrun --nproc-per-node 1 -m torchtitan.train`
#           (through the helper's `train`, the same main(), where torch lacks two names torchtitan
#           0.3.0 takes from torch >= 2.12: torch 2.11 does), on its llama3 debugmodel_ce_loss config
#           (plain CrossEntropyLoss: the default ChunkedLossWrapper fails its backward on torch 2.11)
#           with SDPA attention in place of FlexAttention (apply_compile refuses lynx on Flex;
#           --module torchtitan_trainer_assets --config llama3_debugmodel_ce_loss_sdpa, in
#           benchmarks/torchtitan_trainer_assets.py), torchtitan's shape (8 x 2048, fp32 parameters,
#           bf16 compute: FSDP2's mixed precision, which torchtitan installs on one rank too), 10 steps,
#           no torchtitan activation checkpointing (activation_checkpoint:none), CUDA graphs off
#           (--training.disable_cuda_graphs: lynx plans the step over steps 1-3), --compile.enable
#           with --compile.backend inductor, then lynx with LYNX_OPTIONS='{"memory_budget": 0.7}'
#           (TITAN_LYNX_OPTIONS), one process at a time, each on a cold Inductor/Triton cache. Its
#           tokenizer and data set are made at run time (the helper's `assets`: a 2,000-token BPE
#           and ~2,400 local documents of made-up text; torchtitan's tests/assets are not in its
#           wheel). Needs torchtitan and what torchtitan.train imports (GPU_WHEELS: datasets,
#           torchdata, ...). Writes $OUT/titan.log (both runs' logs), titan_cuda.md (per run: losses
#           per step, peak memory from torchtitan's TensorBoard scalars, step time; lynx against
#           inductor), titan_cuda.json. About 3-5 minutes; it stops at TITAN_BUDGET_S (360 s).
#   all     step, then checks: about 13-14 minutes, more than one device call may run (10 min);
#           for a machine without that limit.
#
# Files in $OUT stay at most 8 (the device tool brings back 8) and at one level. stdout is kept
# short (the tool returns its last 12,000 characters): full logs are in $OUT. OUT defaults to
# ./gpu_out when unset. Exit status 0 when the flow ran to its end (individual failures are in the
# logs and the summary), 2 on bad usage, 3 when torch sees no CUDA GPU.
#
# Set-up on the GPU machine (skipped here when already done): when .whl/ holds wheels (make
# gpu-wheels; the device call names ".whl" in carry) they are installed to /tmp/site with the
# device README's line; then lynx_compile is installed with pip install --no-deps -e . (no build
# isolation: no index there), or, failing that, copied to /tmp/lynx_shim with its entry point
# (with LYNX_GPU_SESSION_DEVICE=cpu nothing is pip-installed: the shim, if lynx is not installed).
#
# Time budget (step, on an H100; an estimate, nothing here has run on a GPU yet). From the one
# earlier GPU run (../shared/gpu-h100-2026-11-22.md, same model and shapes, cold caches): the first
# (compiling) step took 24 s for torch.compile, 36 s for torch.compile at budget 0.5, 4-6 s for lynx
# under the eager compiler; lynx now compiles through Inductor, so about 30 s; a variant process
# adds ~5 s (imports, CUDA context, model); timed steps are 20-45 ms each, so steps cost nothing.
# In sequence, with torch's usual (shared) caches warming up after the first compile: per
# attention 2 x 7 s (eager, checkpoint) + 30 s + 4 x 23 s (torch budgets) + 5 x 25 s (lynx) ~ 260 s
# of variant processes, plus the interleaved process ~90 s (12 model copies, 10 compiles served
# mostly by the caches the variant processes filled, ~5-8 s each, then 50 rounds x 12 steps x
# ~33 ms = 20 s): ~350 s per attention, ~11-12 min for both, over the 10-minute limit. So the
# variant processes of both attentions run 4 at a time (16 CPU cores, 4 compile workers each;
# ~8 GB of GPU memory each): ~520 s of work in ~175 s; the two interleaved timings then run alone
# (~90 s each): ~6-7 min in all. Deadlines keep it under 9 minutes whatever happens: variant
# processes start only until STEP_BUDGET_S - 220 s (then are recorded as not run), the
# interleaved timing of explicit attention may use all but 100 s of what is left, SDPA's the rest
# (skipped, with a note, under 60 s). Running variants concurrently disturbs only the
# own-process columns (step_ms_own_process, first_step_s), said so in the tables' notes; peaks
# are per process and lynx plans with the GPU's profile measured once before them, alone
# (hardware="auto", kept in $WORK/device_profiles.json and appended to env.txt), so neither is affected.
# checks: tests, kernel tests and the dropout run concurrently (~3-4 min: test_inductor's CPU
# cases take ~2 min on 2 cores here, its 7 CUDA cases compile ~15-30 s each over 4 xdist workers;
# the dropout run is 3 fp32 variant processes of ~40 s), then bench_kernels alone (~2-3 min: 30
# cases compiled by Inductor ~1 s each, plus the side-stream training step): ~6-7 min; it stops
# at CHECKS_BUDGET_S.
#
# Hidden overrides (for this script's own smoke test on a machine without a GPU):
#   LYNX_GPU_SESSION_DEVICE=cpu  the same flow with --device cpu --quick (gpt-tiny), 2 variants
#                                (eager,lynx-b0.5), 5 rounds, test selections cut to what runs
#                                on CPU in seconds; under 3 minutes on 2 cores. titan: batch 2 x
#                                256, 4 steps, through the helper's `cpu-train` (torchtitan has no
#                                CPU device path: its device globals pointed at the CPU, this smoke
#                                test only), when torchtitan.train imports; else the assets only,
#                                and a line saying why the runs were skipped.
#   LYNX_GPU_SESSION_VARIANTS=a,b    variant list of every bench_step run
#   LYNX_GPU_SESSION_ATTN=manual|sdpa   step: one attention only (a third call, if step ran out
#                                       of time for SDPA)
#   LYNX_GPU_SESSION_JOBS=N      variant processes at a time (1: strictly one after another)
#   STEP_BUDGET_S, CHECKS_BUDGET_S   seconds per part (default 510 / 540; CPU 170 / 170)
#   TITAN_BUDGET_S, TITAN_LYNX_OPTIONS  titan: seconds (default 360; CPU 600), lynx's LYNX_OPTIONS
#                                (default '{"memory_budget": 0.7}'; CPU 0.9)
#   ILV_RESERVE_S, KERNELS_RESERVE_S seconds kept for the interleaved timings / bench_kernels
#                                    (default 220 / 210; CPU 70 / 40): for a device budget under
#                                    15 minutes, e.g. `all` with one attention in one call
set -euo pipefail

PART=${1:-step}
case "$PART" in
    step | checks | compile | titan | all) ;;
    -h | --help) sed -n '2,50p' "$0"; exit 0 ;;
    *) echo "usage: bash benchmarks/gpu_session.sh [step|checks|compile|titan|all]" >&2; exit 2 ;;
esac

cd "$(dirname "${BASH_SOURCE[0]}")/.."
REPO=$(pwd)
OUT=${OUT:-$REPO/gpu_out}
mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)
PY=${PYTHON:-python3}
DEVICE=${LYNX_GPU_SESSION_DEVICE:-cuda}
WORK=$(mktemp -d /tmp/gpu_session.XXXXXX)
trap 'rm -rf "$WORK"' EXIT
export PYTHONUNBUFFERED=1
NCPU=$(nproc 2>/dev/null || echo 4)

if [ "$DEVICE" = cuda ]; then
    VARIANTS=${LYNX_GPU_SESSION_VARIANTS:-eager,checkpoint,inductor,inductor-b0.7,inductor-b0.5,inductor-b0.3,inductor-b0.0,lynx-none,lynx-full,lynx-b0.7,lynx-b0.5,lynx-b0.3}
    DROPOUT_VARIANTS=${LYNX_GPU_SESSION_VARIANTS:-inductor,inductor-b0.5,lynx-b0.5}
    SHAPE="--device cuda --model gpt-1.3b --layers 4 --batch 2 --seq 2048 --shared-cache"
    STEP_ARGS="$SHAPE --dtype bf16 --dropout 0 --warmup 3 --steps 20"
    DROPOUT_ARGS="$SHAPE --dtype fp32 --dropout 0.1 --warmup 2 --steps 5"
    JOBS=${LYNX_GPU_SESSION_JOBS:-4}
    ROUNDS=50
    STEP_BUDGET_S=${STEP_BUDGET_S:-510}
    CHECKS_BUDGET_S=${CHECKS_BUDGET_S:-540}
    VARIANT_CAP_S=240     # one variant process at most
    ILV_RESERVE_S=${ILV_RESERVE_S:-220}     # kept for the two interleaved timings
    ILV_TAIL_S=100        # of which explicit attention leaves this to SDPA
    ILV_MIN_S=60          # an interleaved timing is skipped with less than this left
    XDIST_N=4
    KERNEL_TESTS=tests/kernels
    INDUCTOR_TESTS=(tests/test_inductor.py)
    KERNELS_RESERVE_S=${KERNELS_RESERVE_S:-210} # kept for bench_kernels after the concurrent checks
    KERNELS_MIN_S=60      # bench_kernels is skipped with less than this left
    COMPILE_VARIANTS=${LYNX_GPU_SESSION_COMPILE_VARIANTS:-inductor,lynx-b0.7,inductor-b0.7,lynx-none,lynx-b0.6}
    COMPILE_ARGS="--device cuda --model gpt-1.3b --layers 4 --batch 2 --seq 2048 --dtype bf16 --dropout 0 --attn sdpa --warmup 2 --steps 3"
    COMPILE_BUDGET_S=${COMPILE_BUDGET_S:-240}
    TITAN_SHAPE=()        # torchtitan's debugmodel config: local batch 8 x seq 2048
    TITAN_STEPS=10
    TITAN_BUDGET_S=${TITAN_BUDGET_S:-360}
    TITAN_CAP_INDUCTOR_S=150  # one run at most: inductor's, lynx's (cold caches: ~1 / ~2-3 min expected)
    TITAN_CAP_LYNX_S=300
    TITAN_LYNX_MIN_S=150      # the inductor run stops in time to leave the lynx run this much
elif [ "$DEVICE" = cpu ]; then
    VARIANTS=${LYNX_GPU_SESSION_VARIANTS:-eager,lynx-b0.5}
    DROPOUT_VARIANTS=$VARIANTS
    STEP_ARGS="--device cpu --quick"
    DROPOUT_ARGS="--device cpu --quick --dropout 0.1"
    JOBS=${LYNX_GPU_SESSION_JOBS:-2}
    ROUNDS=5
    STEP_BUDGET_S=${STEP_BUDGET_S:-170}
    CHECKS_BUDGET_S=${CHECKS_BUDGET_S:-170}
    VARIANT_CAP_S=110
    ILV_RESERVE_S=${ILV_RESERVE_S:-70}
    ILV_TAIL_S=30
    ILV_MIN_S=20
    XDIST_N=2
    KERNEL_TESTS=tests/kernels/test_rms_norm.py
    INDUCTOR_TESTS=(tests/test_inductor.py -k cuda)  # the CUDA cases: collected, then skipped
    KERNELS_RESERVE_S=${KERNELS_RESERVE_S:-40}
    KERNELS_MIN_S=10      # (it exits at once here: no CUDA)
    COMPILE_VARIANTS=${LYNX_GPU_SESSION_COMPILE_VARIANTS:-inductor,lynx-b0.7}
    COMPILE_ARGS="--device cpu --quick --attn sdpa --warmup 1 --steps 1"
    COMPILE_BUDGET_S=${COMPILE_BUDGET_S:-150}
    TITAN_SHAPE=(--training.local_batch_size 2 --training.seq_len 256)
    TITAN_STEPS=4
    TITAN_BUDGET_S=${TITAN_BUDGET_S:-600}
    TITAN_CAP_INDUCTOR_S=240
    TITAN_CAP_LYNX_S=420
    TITAN_LYNX_MIN_S=240
else
    echo "LYNX_GPU_SESSION_DEVICE must be cuda or cpu, not $DEVICE" >&2
    exit 2
fi

say() { echo "[gpu_session $(date +%H:%M:%S) +${SECONDS}s] $*"; }

# ------------------------------------------------------------------------------------ set-up
lynx_here() {  # lynx_compile importable from elsewhere, from this checkout, with its dynamo backend
    (cd /tmp && "$PY" - "$REPO" <<'PYEOF'
import os, sys
from importlib.metadata import entry_points
import lynx_compile, lynx_compile.kernels, lynx_compile.passes  # noqa: E401
assert "lynx" in entry_points(group="torch_dynamo_backends").names, "no lynx backend entry point"
print(os.path.dirname(os.path.abspath(lynx_compile.__file__)))
PYEOF
    ) 2>/dev/null
}

install_shim() {  # lynx_compile as setup.py lays it out, plus the backend's entry point
    local shim=/tmp/lynx_shim dist=/tmp/lynx_shim/lynx_compile-0.1.0.dist-info
    rm -rf "$shim" && mkdir -p "$dist"
    cp -r lynx_compile "$shim/lynx_compile"
    cp -r passes "$shim/lynx_compile/passes"
    cp -r kernels "$shim/lynx_compile/kernels"
    printf 'Metadata-Version: 2.1\nName: lynx-compile\nVersion: 0.1.0\n' >"$dist/METADATA"
    printf '[console_scripts]\nlynx = lynx_compile.tools.cli:main\n\n[torch_dynamo_backends]\nlynx = lynx_compile.compiler.dynamo_backend:lynx_backend\n' \
        >"$dist/entry_points.txt"
    export PYTHONPATH=$shim${PYTHONPATH:+:$PYTHONPATH}
}

setup() {
    INSTALL="already installed"
    if [ "$DEVICE" = cpu ]; then
        INSTALL="no wheels installed (.whl/ is for the GPU machine's Python 3.12); "
    elif compgen -G ".whl/*.whl" >/dev/null; then
        python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site || exit 1
        INSTALL="wheels from .whl/ in /tmp/site; "
    else
        INSTALL="no .whl/ (nothing carried); "
    fi
    local where
    where=$(lynx_here || true)
    if [ "$where" = "$REPO/lynx_compile" ]; then
        INSTALL+="lynx_compile already installed from this checkout"
    elif [ "$DEVICE" = cuda ] && "$PY" -m pip install -q --no-deps --no-build-isolation -e . >"$WORK/pip.log" 2>&1 \
        && [ "$(lynx_here || true)" = "$REPO/lynx_compile" ]; then
        INSTALL+="pip install --no-deps --no-build-isolation -e ."
    else
        install_shim
        if lynx_here >/dev/null; then
            INSTALL+="no editable install ($(tail -n 1 "$WORK/pip.log" 2>/dev/null || echo "not tried on $DEVICE")); copied to /tmp/lynx_shim"
        else
            say "lynx_compile does not import; see $WORK/pip.log:"; tail -n 20 "$WORK/pip.log" || true
            exit 1
        fi
    fi
    say "set-up: $INSTALL"
}

write_env() {
    {
        echo "date: $(date -u +%Y-%m-%dT%H:%M:%SZ)"
        echo "part: $PART; device: $DEVICE; script: benchmarks/gpu_session.sh"
        if git rev-parse HEAD >/dev/null 2>&1; then
            echo "git: $(git rev-parse HEAD)$(git diff --quiet HEAD -- || echo ' (with uncommitted changes)')"
        else
            echo "git: no git metadata here (the device copy has none): see the commit the session ran from"
        fi
        echo "install: $INSTALL"
        echo "host: $(uname -srm); $NCPU CPU cores; $(free -g 2>/dev/null | awk '/Mem:/ {print $2 " GiB memory"}')"
        if command -v nvidia-smi >/dev/null 2>&1; then
            echo "nvidia-smi: $(nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv,noheader 2>&1 | head -n 4)"
        else
            echo "nvidia-smi: not found"
        fi
        "$PY" - <<'PYEOF' 2>&1
import platform, sys
from importlib.metadata import PackageNotFoundError, version
import torch
print(f"python: {platform.python_version()} ({sys.executable})")
print(f"torch: {torch.__version__}; CUDA (torch built with): {torch.version.cuda}; cuDNN: {torch.backends.cudnn.version()}")
if torch.cuda.is_available():
    p = torch.cuda.get_device_properties(0)
    print(f"GPU (torch): {p.name}, {p.multi_processor_count} SMs, {p.total_memory / 2**30:.1f} GiB, "
          f"capability {p.major}.{p.minor}")
else:
    print("GPU (torch): none")
for name in ("triton", "numpy", "pyomo", "highspy", "transformers", "pytest", "pytest-xdist", "pytest-timeout",
             "matplotlib", "torchtitan", "datasets", "torchdata", "tensorboard", "tokenizers"):
    try:
        print(f"{name}: {version(name)}")
    except PackageNotFoundError:
        print(f"{name}: not installed")
import lynx_compile
print(f"lynx_compile: {lynx_compile.__version__} from {lynx_compile.__file__}")
PYEOF
    } >"$OUT/env.txt"
    say "versions: $(grep -E '^(torch|triton|GPU \(torch\)):' "$OUT/env.txt" | tr '\n' ';')"
}

# --------------------------------------------------------------------------------------- step
# The orchestration of bench_step.py's own functions: its per-variant processes
# (run_in_subprocess) several at a time, then its interleaved timing (run_interleaved_in_subprocess)
# alone, then its tables (write_results).
STEP_PY=$(cat <<'PYEOF'
import concurrent.futures as cf
import os
import shlex
import sys
import threading
import time

out, work, log_path = sys.argv[1:4]
deadline, phase_a_end, ilv_tail, ilv_min = (float(x) for x in sys.argv[4:8])
jobs, variant_cap = int(sys.argv[8]), float(sys.argv[9])
part_label, specs = sys.argv[10], sys.argv[11:]
sys.path.insert(0, os.path.join(os.getcwd(), "benchmarks"))
import bench_step as b  # noqa: E402

t0 = time.time()
lock = threading.Lock()


def say(msg):
    line = f"[step +{time.time() - t0:4.0f}s] {msg}"
    with lock:
        print(line, flush=True)
        with open(log_path, "a") as f:
            f.write(line + "\n")


configs = []
for stem, label, argstr in zip(specs[0::3], specs[1::3], specs[2::3]):
    argv = shlex.split(argstr)
    args = b.parse_args(argv)
    model = args.model or b.QUICK_SHAPE["model"]
    configs.append(dict(stem=stem, label=label, argv=argv, args=args, s=b.settings_from(args, model),
                        shared=args.shared_cache or args.quick, rows={}, notes=[],
                        ref=os.path.join(work, stem + "_grads.pt")))


def rank(v):  # the compile-heavy first (inductor first of all: its kernels fill the cache)
    return 0 if v == "inductor" else 2 if v in ("eager", "checkpoint") else 1


chains = []
for c in configs:
    order = sorted(c["args"].variants, key=rank)
    if c["s"].dtype == "fp32":  # gradients are compared with inductor's: one chain, inductor first
        chains.append((0, [(c, v) for v in order]))
    else:
        chains += [(rank(v), [(c, v)]) for v in order]
chains = [ch for _, ch in sorted(chains, key=lambda rc: rc[0])]  # stable: configs alternate


def run_chain(chain):
    for c, v in chain:
        left = phase_a_end - time.time()
        t = time.time()
        if left < 15:
            row = {"model": c["s"].model, "variant": v,
                   "result": "error: not run: benchmarks/gpu_session.sh ran out of time"}
        else:
            row = b.run_in_subprocess(v, c["s"], timeout_s=min(variant_cap, left), ref_grads_path=c["ref"],
                                      shared_cache=c["shared"])
        c["rows"][v] = row
        say(f"{c['label']} {v}: " + (f"{row['step_ms']:.4g} ms, {row['peak_MiB']:.4g} MiB, first step "
                                     f"{row.get('first_step_s', 0):.1f} s" if row["result"] == "ok" else row["result"])
            + f" ({time.time() - t:.0f} s)")


if jobs > 1:  # compile workers per process: the machine's cores shared among the processes
    os.environ.setdefault("TORCHINDUCTOR_COMPILE_THREADS", str(max(2, (os.cpu_count() or 8) // jobs)))
say(f"{sum(len(ch) for ch in chains)} variant processes, {jobs} at a time")
with cf.ThreadPoolExecutor(max_workers=jobs) as pool:
    list(pool.map(run_chain, chains))
os.environ.pop("TORCHINDUCTOR_COMPILE_THREADS", None)
load_after_a = os.getloadavg()[0]


def combined_md():
    parts = [f"# One training step per recompute variant ({configs[0]['s'].device}), written by "
             f"`benchmarks/gpu_session.sh {part_label}`", ""]
    for c in configs:
        if "md" in c:
            parts += [f"## {c['label']}", c["md"].split("\n", 1)[1]]
    return "\n".join(parts)


for i, c in enumerate(configs):
    s, args = c["s"], c["args"]
    rows = [c["rows"][v] for v in args.variants]
    ok = [r["variant"] for r in rows if r["result"] == "ok"]
    left = deadline - time.time() - 5
    budget = left - (ilv_tail if i < len(configs) - 1 else 0)
    if args.interleave and ok:
        if budget >= ilv_min:
            say(f"{c['label']}: timing {len(ok)} variants in one process, {args.interleave} rounds "
                f"(at most {budget:.0f} s) ...")
            t = time.time()
            timed = b.run_interleaved_in_subprocess(ok, s, args.interleave, timeout_s=budget)
            c["interleaved"] = bool(timed)
            b.take_interleaved(rows, timed)
            say(f"{c['label']}: interleaved timing " + ("done" if timed else "FAILED or timed out")
                + f" ({time.time() - t:.0f} s)")
            if not timed:
                c["notes"].append("The interleaved timing failed or ran out of time: step_ms is each variant's "
                                  "own process, measured while other variant processes ran beside it.")
        else:
            c["notes"].append(f"The interleaved timing was skipped: {max(left, 0):.0f} s were left. step_ms is each "
                              "variant's own process, measured while other variant processes ran beside it.")
            say(f"{c['label']}: interleaved timing skipped, {max(left, 0):.0f} s left")
    c["notes"].append("Inductor/Triton on-disk caches: " + (
        "torch's usual ones, kept across variants and runs (first_step_s may reuse compiled kernels)."
        if c["shared"] else "a cold one per variant (first_step_s includes a cold compile)."))
    if jobs > 1:
        c["notes"].append(f"Run by benchmarks/gpu_session.sh: the variant processes of every attention setting ran "
                          f"{jobs} at a time (Inductor compile workers per process: "
                          f"{max(2, (os.cpu_count() or 8) // jobs)}), so step_ms_own_process and first_step_s were "
                          "taken under that load" + ("; step_ms comes from the interleaved process, which ran "
                                                      "alone" if c.get("interleaved") else "")
                          + ". Peaks are each variant's own process (allocator statistics are per process).")
    c["notes"].append(f"load average (1 min) after the variant processes / now: {load_after_a:.2f} / "
                      f"{os.getloadavg()[0]:.2f} on {os.cpu_count()} CPUs.")
    c["md"] = b.write_results(work, c["stem"], rows, [s], c["argv"], c["notes"])
    with open(os.path.join(out, f"{configs[0]['stem']}.md"), "w") as f:  # rewritten after each setting
        f.write(combined_md())
    table = b.finish_rows(rows)
    say(f"{c['label']} ({s.model}, {s.dtype}, batch {s.batch}):")
    print(f"  {'variant':<14} {'step_ms':>8} {'own_ms':>8} {'peak_MiB':>9} {'first_s':>7}  status", flush=True)
    for r in table:
        def f(k):
            return "-" if r.get(k) is None else f"{r[k]:.4g}"
        print(f"  {r['variant']:<14} {f('step_ms'):>8} {f('step_ms_own_process'):>8} {f('peak_MiB'):>9} "
              f"{f('first_step_s'):>7}  {r['result'][:70]}", flush=True)
    for line in b.summary(rows):
        print("  " + line, flush=True)
PYEOF
)

measure_device_profile() {  # part timeout_s: lynx's hardware="auto" profile of this GPU, measured
    # once, alone, into $WORK/device_profiles.json (LYNX_CPU_PROFILE, read by every later lynx
    # process of the part); its numbers go to env.txt
    export LYNX_CPU_PROFILE="$WORK/device_profiles.json"
    timeout "$2" "$PY" -c 'import dataclasses, json, torch
from lynx_compile.costs.hardware import calibrate_cuda_profile, _cuda_key
p = calibrate_cuda_profile()
print("lynx device profile (" + _cuda_key(torch.cuda.current_device()) + "): " + json.dumps(dataclasses.asdict(p)))' \
        >>"$OUT/env.txt" 2>&1 || say "$1: measuring the device profile failed (env.txt): lynx plans on the datasheet"
}

part_step() {
    local t0=$SECONDS
    export LYNX_BENCH_PLANS_DIR="$WORK/plans"  # bench_step: each lynx variant's plans, into step_raw.tgz
    rm -f "$OUT/step.log" "$OUT"/step_c*.md "$OUT/step_raw.tgz"
    local stem=step_$DEVICE
    if [ "$DEVICE" = cpu ]; then stem=step_cpu_quick; fi
    if [ "$DEVICE" != cpu ]; then
        # lynx's hardware="auto" measures the GPU (issue R item 2): once, alone, before the variant
        # processes (which run 4 at a time and read it from this file); its numbers go to env.txt
        say "step: measuring the device profile lynx plans with (hardware=\"auto\")"
        measure_device_profile step 120
    fi
    local specs=()
    local attn=${LYNX_GPU_SESSION_ATTN:-manual,sdpa}
    case ",$attn," in *,manual,*) specs+=("$stem" "explicit attention (--attn manual)"
        "$STEP_ARGS --attn manual --variants $VARIANTS --interleave $ROUNDS") ;; esac
    case ",$attn," in *,sdpa,*) specs+=("${stem}_sdpa" "SDPA attention (--attn sdpa)"
        "$STEP_ARGS --attn sdpa --variants $VARIANTS --interleave $ROUNDS") ;; esac
    local deadline phase_a_end
    deadline=$((PART_START + STEP_BUDGET_S))
    phase_a_end=$((deadline - ILV_RESERVE_S))
    say "step: $((${#specs[@]} / 3)) attention settings x $(tr ',' '\n' <<<"$VARIANTS" | wc -l) variants, budget ${STEP_BUDGET_S} s"
    local rc=0
    "$PY" - "$OUT" "$WORK" "$OUT/step.log" "$deadline" "$phase_a_end" "$ILV_TAIL_S" "$ILV_MIN_S" "$JOBS" "$VARIANT_CAP_S" \
        "step" "${specs[@]}" <<<"$STEP_PY" || rc=$?
    # the table of every setting is $OUT/<first stem>.md; CSV, PNG and each setting's own table: one archive
    (cd "$WORK" && ls step_*.csv step_*.png step_*.md plans/*.json 2>/dev/null | tar -czf "$OUT/step_raw.tgz" -T -) || true
    say "step: done in $((SECONDS - t0)) s (orchestrator exit $rc); files: $(cd "$OUT" && ls | tr '\n' ' ')"
}

# ------------------------------------------------------------------------------------- checks
CHECK_NAMES=()
declare -A CHECK_RC CHECK_S

run_check() {  # name timeout_s command...: runs in the background, log $OUT/checks_<name>.log
    local name=$1 limit=$2
    shift 2
    CHECK_NAMES+=("$name")
    (
        local t=$SECONDS rc=0
        echo "\$ $*" >"$OUT/checks_$name.log"
        timeout --kill-after=15 "$limit" "$@" >>"$OUT/checks_$name.log" 2>&1 || rc=$?
        echo "$rc $((SECONDS - t))" >"$WORK/rc_$name"
    ) &
}

summarize_check() {  # name: one line, plus failures
    local name=$1 log="$OUT/checks_$1.log" rc s
    read -r rc s <"$WORK/rc_$name" 2>/dev/null || { rc=none; s=?; }
    CHECK_RC[$name]=$rc
    CHECK_S[$name]=$s
    local last
    last=$(grep -E '(passed|failed|skipped|error|deselected|no tests ran)' "$log" | tail -n 1 | sed 's/=//g; s/^ *//' || true)
    say "check $name: exit $rc$([ "$rc" = 124 ] && echo ' (TIMED OUT)'), $s s: ${last:-see log}"
    grep -E '^(FAILED|ERROR) ' "$log" | head -n 15 | sed 's/^/    /' || true
}

part_checks() {
    local t0=$((SECONDS - ($(date +%s) - PART_START)))  # the budget counts from PART_START
    rm -f "$OUT"/checks*.log "$OUT/checks_raw.tgz" "$OUT/kernels_${DEVICE}.md" "$OUT/step_${DEVICE}_dropout.md"
    CHECK_NAMES=()
    local xdist=()
    if "$PY" -c "import xdist" 2>/dev/null; then xdist=(-n "$XDIST_N"); fi
    local pt=("$PY" -m pytest -p no:cacheprovider --timeout 300 -q -rfEs "${xdist[@]}")
    local first_limit=$((CHECKS_BUDGET_S - KERNELS_RESERVE_S - 10))
    say "checks: tests, kernel tests and the dropout run together (at most ${first_limit} s), then bench_kernels alone"
    run_check tests "$first_limit" "${pt[@]}" \
        tests/test_side_stream.py::test_cuda_side_stream_gradients_equal_eager "${INDUCTOR_TESTS[@]}"
    run_check kernel_tests "$first_limit" env TRITON_INTERPRET=1 "${pt[@]}" "$KERNEL_TESTS"
    # shellcheck disable=SC2086
    run_check dropout "$first_limit" "$PY" benchmarks/bench_step.py $DROPOUT_ARGS --attn manual \
        --variants "$DROPOUT_VARIANTS" --timeout 240 --out "$WORK/dropout"
    wait
    local n
    for n in tests kernel_tests dropout; do summarize_check "$n"; done
    local dmd
    dmd=$(ls "$WORK"/dropout/step_*.md 2>/dev/null | head -n 1 || true)
    if [ -n "$dmd" ]; then
        local base
        base=$(basename "$dmd" .md)
        sed "s/($base\.png)/(step_${DEVICE}_dropout.png)/" "$dmd" >"$OUT/step_${DEVICE}_dropout.md"
        for ext in csv png; do
            if [ -f "$WORK/dropout/$base.$ext" ]; then mv "$WORK/dropout/$base.$ext" "$WORK/step_${DEVICE}_dropout.$ext"; fi
        done
        "$PY" - "$WORK/step_${DEVICE}_dropout.csv" <<'PYEOF' || true
import csv, sys
for r in csv.DictReader(open(sys.argv[1])):
    print(f"    dropout 0.1 {r['variant']:<13} loss {r['loss'] or '-':<10} grad_rel_diff_vs_inductor "
          f"{r['grad_rel_diff_vs_inductor'] or '-':<12} peak_MiB {r['peak_MiB'] or '-':<8} {r['result'][:60]}")
PYEOF
    fi

    local left=$((CHECKS_BUDGET_S - (SECONDS - t0) - 5))
    if [ "$left" -lt "$KERNELS_MIN_S" ]; then
        say "bench_kernels skipped: only ${left} s left"
        echo "skipped: only ${left} s left" >"$OUT/checks_bench_kernels.log"
    else
        say "bench_kernels (alone on the GPU, at most ${left} s) ..."
        run_check bench_kernels "$left" "$PY" benchmarks/bench_kernels.py --repeats 20 --out "$WORK/kernels_${DEVICE}"
        wait
        summarize_check bench_kernels
        if [ "$DEVICE" = cpu ] && [ "${CHECK_RC[bench_kernels]}" = 2 ]; then
            say "  (exit 2 on CPU: bench_kernels needs CUDA, as expected here)"
        fi
        grep -m1 'measured HBM bandwidth' "$OUT/checks_bench_kernels.log" | sed 's/^/    /' || true
        if [ -f "$WORK/kernels_${DEVICE}.md" ]; then
            cp "$WORK/kernels_${DEVICE}.md" "$OUT/kernels_${DEVICE}.md"
            "$PY" - "$WORK/kernels_${DEVICE}.csv" <<'PYEOF' || true
import csv, sys
rows = list(csv.DictReader(open(sys.argv[1])))
bad = [r for r in rows if str(r.get("ok")).lower() not in ("yes", "true", "1")]
print(f"    kernels: {len(rows)} cases, {len(bad)} not ok")
for r in bad[:10]:
    print(f"      {r['kernel']} {r['shape']}: ok={r.get('ok')} max_abs_diff={r.get('max_abs_diff')} {r.get('error', '')[:80]}")
PYEOF
            grep -A4 '^| model | policy | side_stream' "$WORK/kernels_${DEVICE}.md" | sed 's/^/    /' || true
        fi
    fi

    # one log (each check under its header), one archive of the raw files: 8 files at most in $OUT
    {
        for n in "${CHECK_NAMES[@]}"; do
            echo "=================== $n: exit ${CHECK_RC[$n]:-?}, ${CHECK_S[$n]:-?} s"
            cat "$OUT/checks_$n.log"
        done
    } >"$WORK/checks.log"
    rm -f "$OUT"/checks_*.log
    mv "$WORK/checks.log" "$OUT/checks.log"
    (cd "$WORK" && ls kernels_${DEVICE}*.csv step_${DEVICE}_dropout.* 2>/dev/null | tar -czf "$OUT/checks_raw.tgz" -T -) || true
    say "checks: done in $((SECONDS - t0)) s; files: $(cd "$OUT" && ls | tr '\n' ' ')"
}

# ------------------------------------------------------------------------------------ compile
# First step cold and warm, one process at a time: bench_step.py --one per run (its JSON line on
# stdout, first_step_s measured in the child), stderr kept for lynx's plan-cache lines (LYNX_DEBUG=1
# in every run, inductor's too, so the two sides pay the same logging).
COMPILE_PY=$(cat <<'PYEOF'
import json, os, re, shlex, subprocess, sys, time
out, work, log_path, deadline, device = sys.argv[1], sys.argv[2], sys.argv[3], float(sys.argv[4]), sys.argv[5]
variants, args = sys.argv[6].split(","), shlex.split(sys.argv[7])
sys.path.insert(0, os.path.join(os.getcwd(), "benchmarks"))
import bench_step as b  # noqa: E402

parsed = b.parse_args(args)
one_argv = b.settings_from(parsed, parsed.model or b.QUICK_SHAPE["model"]).argv()  # what run_in_subprocess passes
t0 = time.time()


def say(msg):
    line = f"[compile +{time.time() - t0:4.0f}s] {msg}"
    print(line, flush=True)
    with open(log_path, "a") as f:
        f.write(line + "\n")


rows = []
for v in variants:
    cache = os.path.join(work, "cache_" + v)
    env = dict(os.environ, TORCHINDUCTOR_CACHE_DIR=os.path.join(cache, "inductor"),
               TRITON_CACHE_DIR=os.path.join(cache, "triton"), LYNX_DEBUG="1", PYTHONHASHSEED="0")
    row = {"variant": v}
    for phase in ("cold", "warm"):
        left = deadline - time.time()
        if left < 30:
            row[phase] = "not run: out of time"
            say(f"{v} {phase}: not run, {left:.0f} s left")
            continue
        cmd = [sys.executable, "benchmarks/bench_step.py", "--one", v, *one_argv]
        t = time.time()
        try:
            p = subprocess.run(cmd, capture_output=True, text=True, timeout=min(left, 300), env=env)
            res = next((json.loads(ln) for ln in reversed(p.stdout.splitlines()) if ln.startswith("{")), None)
            err = p.stderr
        except subprocess.TimeoutExpired as e:
            res, err = None, (e.stderr or b"").decode() if isinstance(e.stderr, bytes) else (e.stderr or "")
        wall = time.time() - t
        hits = len(re.findall(r"lynx plan cache: hit", err))
        misses = len(re.findall(r"lynx plan cache: miss", err))
        with open(os.path.join(work, f"compile_{v}_{phase}.err"), "w") as f:
            f.write(err)
        if res is None or res.get("result") != "ok":
            row[phase] = (res or {}).get("result", "error: no result (see compile_raw.tgz)")[:60].replace("|", "/")
        else:
            row[phase] = res["first_step_s"]
            row[phase + "_peak"] = res.get("peak_MiB")
        row[phase + "_wall"], row[phase + "_hits"], row[phase + "_misses"] = wall, hits, misses
        say(f"{v} {phase}: first step {row[phase] if isinstance(row[phase], str) else f'{row[phase]:.2f} s'}, "
            f"process {wall:.1f} s, plan cache hit/miss lines {hits}/{misses}")
    rows.append(row)

base = next((r for r in rows if r["variant"] == "inductor"), {})


def cell(r, k, ratio=False):
    x = r.get(k)
    if not isinstance(x, (int, float)):
        return "-" if x is None else str(x)
    if ratio:
        b = base.get(k)
        return f"{x / b:.2f}" if isinstance(b, (int, float)) and b > 0 else "-"
    return f"{x:.2f}"


lines = [f"# First training step, cold and warm caches ({device}), written by `benchmarks/gpu_session.sh compile`", "",
         f"`bench_step.py --one <variant> {' '.join(one_argv)}`, one process at a time, nothing else running. "
         "cold: a fresh TORCHINDUCTOR_CACHE_DIR / TRITON_CACHE_DIR; warm: the same process command again on "
         "that directory (torch's FX-graph/AOTAutograd caches and lynx's plan cache). first_step_s: the child's "
         "clock around the first training step (trace + plan + compile + run); process_s: the whole process "
         "(imports, CUDA context, model). Plan-cache lines: lynx's log (LYNX_DEBUG=1) lines saying hit / miss.", "",
         "| variant | cold first_step_s | vs inductor | warm first_step_s | vs inductor | cold process_s | "
         "warm process_s | warm plan-cache hit/miss | peak_MiB |",
         "|---|---|---|---|---|---|---|---|---|"]
for r in rows:
    lines.append(f"| {r['variant']} | {cell(r, 'cold')} | {cell(r, 'cold', True)} | {cell(r, 'warm')} | "
                 f"{cell(r, 'warm', True)} | {cell(r, 'cold_wall')} | {cell(r, 'warm_wall')} | "
                 f"{r.get('warm_hits', '-')}/{r.get('warm_misses', '-')} | {cell(r, 'cold_peak')} |")
with open(os.path.join(out, f"compile_{device}.md"), "w") as f:
    f.write("\n".join(lines) + "\n")
print("\n".join(lines[6:]), flush=True)
PYEOF
)

part_compile() {
    local t0=$SECONDS
    rm -f "$OUT/compile.log" "$OUT/compile_${DEVICE}.md" "$OUT/compile_raw.tgz"
    local rc=0
    if [ "$DEVICE" = cuda ]; then  # the CUDA case of the caches (RNG replay), then the timings
        say "compile: tests/test_plan_cache.py's CUDA test ..."
        timeout --kill-after=15 240 "$PY" -m pytest -p no:cacheprovider -q -rfEs \
            tests/test_plan_cache.py::test_cuda_autograd_cache_serves_a_plan_that_replays_dropout \
            >"$WORK/compile_test.log" 2>&1 || rc=$?
        say "compile: test exit $rc: $(grep -E '(passed|failed|skipped|error)' "$WORK/compile_test.log" | tail -n 1)"
        grep -E '^(E |FAILED|ERROR)' "$WORK/compile_test.log" | head -n 20 || true
        cat "$WORK/compile_test.log" >>"$OUT/compile.log"
        rc=0
    fi
    say "compile: ${COMPILE_VARIANTS} cold then warm, one at a time, budget ${COMPILE_BUDGET_S} s"
    "$PY" - "$OUT" "$WORK" "$OUT/compile.log" "$(($(date +%s) + COMPILE_BUDGET_S))" "$DEVICE" \
        "$COMPILE_VARIANTS" "$COMPILE_ARGS" <<<"$COMPILE_PY" || rc=$?
    (cd "$WORK" && ls compile_*.err 2>/dev/null | tar -czf "$OUT/compile_raw.tgz" -T -) || true
    say "compile: done in $((SECONDS - t0)) s (exit $rc)"
}

# -------------------------------------------------------------------------------------- titan
# torchtitan's own trainer, one process at a time: inductor, then lynx (header). Each run's log,
# exit status and TensorBoard scalars under $WORK/titan/<run>/; the helper's `report` reads them.
TITAN_HELPER=benchmarks/torchtitan_trainer_assets.py

titan_run() {  # label backend limit_s: one torchrun, log $WORK/titan/<label>/train.log, "rc wall_s" in rc
    local label=$1 backend=$2 limit=$3 d="$WORK/titan/$1" t=$SECONDS rc=0
    mkdir -p "$d"
    local args=(--module torchtitan_trainer_assets --config llama3_debugmodel_ce_loss_sdpa
        --hf_assets_path "$WORK/titan/assets/tokenizer" --dataloader.dataset_path "$WORK/titan/assets/c4_local"
        "${TITAN_SHAPE[@]}" --training.steps "$TITAN_STEPS" --training.disable_cuda_graphs
        --compile.enable --compile.backend "$backend"
        --metrics.log_freq 1 --metrics.enable_tensorboard --metrics.disable_color_printing
        --debug.seed 0 --dump_folder "$d/dump" activation_checkpoint:none)
    local entry=("${TITAN_ENTRY[@]}")
    (
        if [ "$backend" = lynx ]; then export LYNX_OPTIONS="$TITAN_LYNX_OPTIONS"; else unset LYNX_OPTIONS; fi
        export TORCHINDUCTOR_CACHE_DIR="$d/inductor_cache" TRITON_CACHE_DIR="$d/triton_cache" \
            HF_HOME="$WORK/titan/hf" HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 LYNX_DEBUG=1 \
            PYTHONPATH="$REPO/benchmarks${PYTHONPATH:+:$PYTHONPATH}"
        echo "\$ LYNX_OPTIONS=${LYNX_OPTIONS:-(unset)} torchrun --standalone --nproc-per-node 1 ${entry[*]} ${args[*]}"
        exec timeout --kill-after=15 "$limit" "$PY" -m torch.distributed.run --standalone --nproc-per-node 1 \
            "${entry[@]}" "${args[@]}"
    ) >"$d/train.log" 2>&1 || rc=$?
    echo "$rc $((SECONDS - t))" >"$d/rc"
    say "titan $label: exit $rc$([ "$rc" = 124 ] && echo ' (TIMED OUT)') in $((SECONDS - t)) s: $(grep -E 'step: *[0-9]+ +loss' "$d/train.log" | tail -n 1 | sed 's/.* - //' | cut -c1-110)"
    if [ "$rc" != 0 ]; then
        grep -E '(Error|Exception)' "$d/train.log" | grep -v Warning | tail -n 3 | cut -c1-240 | sed 's/^/    /' || true
    fi
}

part_titan() {
    local t0=$SECONDS deadline=$((PART_START + TITAN_BUDGET_S))
    rm -f "$OUT"/titan*
    # 0.7 on the GPU (8 x 2048; on the CPU at that shape lynx planned the step at 0.694 of its
    # no-recompute peak); 0.9 for the CPU smoke's 2 x 256, where 0.7 is refused (naming 0.811: the
    # uncompiled embedding, LM head chunks and the gradients are most of that small step)
    if [ "$DEVICE" = cpu ]; then
        TITAN_LYNX_OPTIONS=${TITAN_LYNX_OPTIONS:-'{"memory_budget": 0.9}'}
    else
        TITAN_LYNX_OPTIONS=${TITAN_LYNX_OPTIONS:-'{"memory_budget": 0.7}'}
    fi
    mkdir -p "$WORK/titan"
    local summary
    if ! summary=$("$PY" "$TITAN_HELPER" assets "$WORK/titan/assets" 2>&1); then
        say "titan: making the tokenizer and data set failed: $(tail -n 1 <<<"$summary")"
        echo "$summary" >"$OUT/titan.log"
        return 0
    fi
    say "titan: assets $(tail -n 1 <<<"$summary")"
    local imp
    if ! imp=$(cd /tmp && PYTHONPATH="$REPO/benchmarks${PYTHONPATH:+:$PYTHONPATH}" "$PY" -c '
import torch, torchtitan_trainer_assets as a
added = a.torch_compat()
if added:
    print(f"torch {torch.__version__} lacks what torchtitan imports: the helper adds {added}")
import torchtitan.train, tensorboard
from torchtitan.config import ConfigManager
c = ConfigManager().parse_args(["--module", "torchtitan_trainer_assets", "--config", "llama3_debugmodel_ce_loss_sdpa",
                                "--compile.enable", "--compile.backend", "lynx", "activation_checkpoint:none"])
att = {type(l.attention.inner_attention).__name__ for l in c.model_spec.model.layers}
print(f"torchtitan {torchtitan.__version__}: config parsed, {len(c.model_spec.model.layers)} layers, attention {att}")' 2>&1); then
        {
            echo "torchtitan.train or its config does not import / parse here:"
            echo "$imp"
            echo "checked: the tokenizer and data set were made ($summary)"
        } >"$OUT/titan.log"
        say "titan: runs SKIPPED: torchtitan.train does not import here ($(grep -E '[A-Za-z]+(Error|Exception)' <<<"$imp" | tail -n 1 | cut -c1-160)); checked: the assets only (see titan.log)"
        return 0
    fi
    say "titan: $(tail -n 1 <<<"$imp")"
    # torchtitan's own entry point where it imports as it is; else the helper's `train` (the same
    # torchtitan.train.main(), after torch_compat) or, on the CPU smoke test, `cpu-train`
    TITAN_ENTRY=(-m torchtitan.train)
    if [ "$DEVICE" = cpu ]; then
        TITAN_ENTRY=("$TITAN_HELPER" cpu-train)
    elif grep -q "lacks what torchtitan imports" <<<"$imp"; then
        TITAN_ENTRY=("$TITAN_HELPER" train)
        say "titan: $(head -n 1 <<<"$imp" | cut -c1-200): runs through the helper's \`train\`"
    fi
    if [ "$DEVICE" = cuda ]; then  # lynx's hardware="auto": the GPU measured once, alone, before the runs
        measure_device_profile titan 90
    fi
    local left
    left=$((deadline - $(date +%s)))
    say "titan: inductor, then lynx ($TITAN_LYNX_OPTIONS), $TITAN_STEPS steps each, ${left} s left of ${TITAN_BUDGET_S}"
    local limit=$((left - TITAN_LYNX_MIN_S))  # the inductor run leaves the lynx run at least TITAN_LYNX_MIN_S
    if [ "$limit" -gt "$TITAN_CAP_INDUCTOR_S" ]; then limit=$TITAN_CAP_INDUCTOR_S; fi
    if [ "$limit" -lt 30 ]; then limit=30; fi
    titan_run inductor inductor "$limit"
    left=$((deadline - $(date +%s) - 15))  # 15 s kept for the report
    if [ "$left" -lt 60 ]; then
        say "titan: lynx not run: ${left} s left"
        mkdir -p "$WORK/titan/lynx" && echo "none 0" >"$WORK/titan/lynx/rc"
    else
        titan_run lynx lynx "$(( left < TITAN_CAP_LYNX_S ? left : TITAN_CAP_LYNX_S ))"
    fi
    local tokens
    if [ "$DEVICE" = cpu ]; then tokens=$((2 * 256)); else tokens=$((8 * 2048)); fi
    "$PY" "$TITAN_HELPER" report --md "$OUT/titan_$DEVICE.md" --json "$OUT/titan_$DEVICE.json" \
        --tokens-per-step "$tokens" --from-step 4 \
        --title "torchtitan's trainer ($DEVICE): --compile.backend lynx against inductor, written by \`benchmarks/gpu_session.sh titan\`" \
        --note "\`torchrun --standalone --nproc-per-node 1 ${TITAN_ENTRY[*]} --module torchtitan_trainer_assets --config llama3_debugmodel_ce_loss_sdpa ...\` (torchtitan's llama3_debugmodel_ce_loss: the debugmodel with a plain CrossEntropyLoss, SDPA in every layer; the full command heads each run in titan.log), $([ "$DEVICE" = cpu ] && echo "batch 2 x 256 (CPU smoke: the helper's cpu-train)" || echo "torchtitan's 8 x 2048"), torchtitan's dtypes (float32 parameters; FSDP2's mixed precision, bfloat16 compute, installed on the one rank as torchtitan always does), ${TITAN_STEPS} steps, --training.disable_cuda_graphs, activation_checkpoint:none, --compile.enable (torchtitan compiles each TransformerBlock and the loss), each run on a cold Inductor/Triton cache, one after the other. lynx: LYNX_OPTIONS='$TITAN_LYNX_OPTIONS'. Tokenizer and data set made at run time (benchmarks/torchtitan_trainer_assets.py assets: $summary)." \
        inductor="$WORK/titan/inductor" lynx="$WORK/titan/lynx" || true
    {
        for label in inductor lynx; do
            echo "=================== titan $label: exit/wall_s $(cat "$WORK/titan/$label/rc" 2>/dev/null)"
            tail -c 6000000 "$WORK/titan/$label/train.log" 2>/dev/null || echo "(no log)"
        done
    } >"$OUT/titan.log"
    say "titan: done in $((SECONDS - t0)) s; files: $(cd "$OUT" && ls | tr '\n' ' ')"
}

# --------------------------------------------------------------------------------------- main
PART_START=$(date +%s)  # each part's budget counts from here: the script's start, or checks' own in all
say "part $PART on $DEVICE, OUT=$OUT"
setup
write_env
if [ "$DEVICE" = cuda ] && ! "$PY" -c "import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)"; then
    say "torch sees no CUDA GPU: nothing run (versions in $OUT/env.txt)"
    exit 3
fi
case "$PART" in
    step) part_step ;;
    checks) part_checks ;;
    compile) part_compile ;;
    titan) part_titan ;;
    all) part_step; PART_START=$(date +%s); part_checks ;;
esac
say "finished in ${SECONDS} s; $(ls "$OUT" | wc -l) files in $OUT"
