"""lynx's fused Triton kernels against eager torch and torch.compile (Inductor) on one CUDA GPU.

Not a test: it measures and writes ``benchmarks/results/kernels.{csv,md}`` and
``benchmarks/results/kernels_overlap.csv``. Needs a CUDA GPU (exits with status 2 otherwise).

    python benchmarks/bench_kernels.py [--dtype bf16] [--kernels rms_norm,layer_norm] [--repeats 50]

1. Measures the HBM bandwidth the benchmark compares against: a ~1 GiB ``Tensor.copy_``, read +
   write, 2 x bytes / time (median of the repeats).
2. For each kernel (rms_norm, layer_norm, bias_gelu, swiglu, dropout, dropout_mask,
   bias_dropout_add at (tokens, hidden) in {4096, 16384} x {4096, 8192}; causal_softmax on
   scores (batch*heads, T, T), T in {2048, 4096}, batch*heads the largest multiple of 8 that keeps
   the case's memory under ``--softmax-mem-gib``): times the lynx kernel, the eager pure-torch
   reference (``lynx_compile.kernels.reference``) and the same reference under ``torch.compile``
   (Inductor, default mode, ``dynamic=False``; compile time reported apart, never timed); for
   dropout / dropout_mask / bias_dropout_add the baseline is torch's own dropout ops unless
   ``--dropout-baseline reference`` (Inductor cannot compile the reference's Philox emulation in
   reasonable time: its scheduler is exponential in the rounds). CUDA
   events around each call, L2 flushed before each, warm-up then the median of the repeats.
   GB/s = the bytes the kernel must read + write (``BYTES``) / its median time, and that as a
   fraction of the measured HBM bandwidth. ``ok``: the lynx output is within tolerance of the
   eager reference (``TOLERANCE``; dropout_mask exact).
3. Side-stream overlap: a recompute kernel (layer_norm by default) on a secondary
   ``torch.cuda.Stream`` while the main stream runs a large matmul (event record / wait), against
   the two run back to back on one stream. overlap = (t_serial - t_overlap) / min(t_matmul,
   t_recompute): 1 = the shorter one is hidden entirely.
4. Training step: a few layers of a GPT preset compiled by lynx (full recompute, fused kernels)
   with the recompute on the main stream and on the side stream (``side_stream=True``).

Every number is labelled with the date, the GPU, and the torch / triton / CUDA versions.
"""
from __future__ import annotations

import argparse
import csv
import math
import os
import platform
import statistics
import sys
import time
import warnings
from typing import Callable, Optional, Sequence

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
RESULTS = os.path.join(HERE, "results")
NO_CUDA_MESSAGE = "bench_kernels.py needs a CUDA GPU; none found"

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
ROW_KERNELS = ("rms_norm", "layer_norm", "bias_gelu", "swiglu", "dropout", "dropout_mask", "bias_dropout_add")
KERNELS = ROW_KERNELS + ("causal_softmax",)

# Bytes each kernel must move between HBM and the SMs (read + write), the numerator of GB/s.
# Row kernels run on (N, H) = (tokens, hidden); causal_softmax on (BH, T, T); e = bytes per
# element of the dtype; per-row statistics are fp32 (4 B); a bool mask is 1 B per element.
#   rms_norm          read x, weight;           write y, rstd            2*N*H*e + H*e + 4*N
#   layer_norm        read x, weight, bias;     write y, mean, rstd      2*N*H*e + 2*H*e + 8*N
#   bias_gelu         read x, bias;             write y                  2*N*H*e + H*e
#   swiglu            read gate, up;            write y                  3*N*H*e   (gate, up, y all (N, H))
#   dropout           read x;                   write y                  2*N*H*e   (mask regenerated, never stored)
#   dropout_mask      read nothing;             write the bool mask      N*H
#   bias_dropout_add  read x, bias, residual;   write y                  3*N*H*e + H*e
#   causal_softmax    read the causal triangle (j <= i, T(T+1)/2 per matrix: the kernel's loads
#                     are masked to it); write all of y (zeros above the diagonal)
#                                                                        BH*(T(T+1)/2 + T*T)*e
BYTES: dict[str, Callable[[tuple, int], int]] = {
    "rms_norm": lambda s, e: 2 * s[0] * s[1] * e + s[1] * e + 4 * s[0],
    "layer_norm": lambda s, e: 2 * s[0] * s[1] * e + 2 * s[1] * e + 8 * s[0],
    "bias_gelu": lambda s, e: 2 * s[0] * s[1] * e + s[1] * e,
    "swiglu": lambda s, e: 3 * s[0] * s[1] * e,
    "dropout": lambda s, e: 2 * s[0] * s[1] * e,
    "dropout_mask": lambda s, e: s[0] * s[1],
    "bias_dropout_add": lambda s, e: 3 * s[0] * s[1] * e + s[1] * e,
    "causal_softmax": lambda s, e: s[0] * (s[1] * (s[1] + 1) // 2 + s[1] * s[2]) * e,
}
BYTES_FORMULA = {  # the same formulas, for the markdown
    "rms_norm": "2·N·H·e + H·e + 4·N", "layer_norm": "2·N·H·e + 2·H·e + 8·N", "bias_gelu": "2·N·H·e + H·e",
    "swiglu": "3·N·H·e", "dropout": "2·N·H·e", "dropout_mask": "N·H",
    "bias_dropout_add": "3·N·H·e + H·e", "causal_softmax": "BH·(T(T+1)/2 + T²)·e",
}

# ok = every |lynx - reference| <= atol + rtol * |reference| (about two output ulps); masks exact.
TOLERANCE = {torch.bfloat16: (1e-2, 1.6e-2), torch.float16: (1e-3, 2e-3), torch.float32: (1e-5, 1e-5)}
EXACT = {"dropout_mask"}
DROPOUT_FAMILY = {"dropout", "dropout_mask", "bias_dropout_add"}

KEYS = ["kernel", "shape", "dtype", "ms_lynx", "ms_eager", "ms_inductor", "GB_s", "frac_of_hbm",
        "speedup_eager", "speedup_inductor", "ok"]
EXTRA_KEYS = ["baseline", "max_abs_diff", "bytes", "compile_s", "peak_GiB", "error"]
OVERLAP_KEYS = ["recompute", "recompute_shape", "matmul", "dtype", "ms_matmul", "ms_recompute", "ms_serial",
                "ms_overlap", "overlap_frac", "error"]
SOFTMAX_SCALE = 1.0 / math.sqrt(128)  # 1/sqrt(head_dim) for head_dim 128
EPS_RMS, EPS_LN = 1e-6, 1e-5
SEED, OFFSET = 1234, 0


# ----------------------------------------------------------------------------------- pure helpers

def bytes_moved(kernel: str, shape: Sequence[int], dtype: torch.dtype) -> int:
    """HBM bytes ``kernel`` must read + write on ``shape`` (formulas in ``BYTES``)."""
    return int(BYTES[kernel](tuple(shape), torch.empty((), dtype=dtype).element_size()))


def softmax_batch_heads(T: int, dtype: torch.dtype, mem_bytes: float) -> int:
    """Largest multiple of 8 (at least 1) for batch*heads with the causal-softmax case under
    ``mem_bytes``: per score element the input, the lynx output and the reference output
    (3 x e) plus the eager reference's two live fp32 temporaries (2 x 4 B)."""
    per_elem = 3 * torch.empty((), dtype=dtype).element_size() + 2 * 4
    bh = int(mem_bytes // (T * T * per_elem))
    return max(1, bh // 8 * 8 if bh >= 8 else bh)


def make_cases(kernels: Sequence[str], tokens: Sequence[int], hidden: Sequence[int], softmax_T: Sequence[int],
               dtype: torch.dtype, softmax_mem_bytes: float) -> list[tuple[str, tuple[int, ...]]]:
    """(kernel, shape) for every case: (tokens, hidden) for the row kernels, (BH, T, T) for softmax."""
    cases = []
    for k in kernels:
        if k == "causal_softmax":
            cases += [(k, (softmax_batch_heads(T, dtype, softmax_mem_bytes), T, T)) for T in softmax_T]
        else:
            cases += [(k, (n, h)) for n in tokens for h in hidden]
    return cases


def dtype_name(dtype: torch.dtype) -> str:
    return {v: k for k, v in DTYPES.items()}.get(dtype, str(dtype).replace("torch.", ""))


def shape_str(shape: Sequence[int]) -> str:
    return "x".join(str(int(d)) for d in shape)


def finish_row(kernel: str, shape: Sequence[int], dtype: torch.dtype, ms_lynx: Optional[float],
               ms_eager: Optional[float], ms_inductor: Optional[float], hbm_gbs: Optional[float],
               max_abs_diff: Optional[float], ok: Optional[bool], compile_s: Optional[float] = None,
               peak_gib: Optional[float] = None, error: str = "") -> dict:
    """One result row (numbers, not strings): GB/s, fraction of HBM and speedups derived here."""
    nbytes = bytes_moved(kernel, shape, dtype)
    gbs = nbytes / (ms_lynx * 1e-3) / 1e9 if ms_lynx else None
    return {"kernel": kernel, "shape": shape_str(shape), "dtype": dtype_name(dtype), "ms_lynx": ms_lynx,
            "ms_eager": ms_eager, "ms_inductor": ms_inductor, "GB_s": gbs,
            "frac_of_hbm": gbs / hbm_gbs if gbs and hbm_gbs else None,
            "speedup_eager": ms_eager / ms_lynx if ms_eager and ms_lynx else None,
            "speedup_inductor": ms_inductor / ms_lynx if ms_inductor and ms_lynx else None,
            "ok": ok, "max_abs_diff": max_abs_diff, "bytes": nbytes, "compile_s": compile_s,
            "peak_GiB": peak_gib, "error": error}


def overlap_fraction(t_serial: float, t_overlap: float, t_matmul: float, t_recompute: float) -> float:
    """(t_serial - t_overlap) / min(t_matmul, t_recompute): 1 = the shorter one fully hidden."""
    return (t_serial - t_overlap) / min(t_matmul, t_recompute)


def fmt(v) -> str:
    if v is None or v == "":
        return "-"
    if isinstance(v, bool):
        return "yes" if v else "NO"
    if isinstance(v, float):
        return f"{v:.4g}"
    return str(v)


def format_row(row: dict, keys: Sequence[str] = KEYS) -> str:
    """One markdown table line."""
    return "| " + " | ".join(fmt(row.get(k)) for k in keys) + " |"


def md_table(rows: Sequence[dict], keys: Sequence[str]) -> list[str]:
    return ["| " + " | ".join(keys) + " |", "|" + "---|" * len(keys)] + [format_row(r, keys) for r in rows]


def csv_value(v):
    if isinstance(v, float):
        return f"{v:.6g}"
    return "" if v is None else v


def header_line(env: dict) -> str:
    return (f"{env['date']}; GPU {env['gpu']}; torch {env['torch']}, triton {env['triton']}, "
            f"CUDA {env['cuda']}; python {env['python']}, {env['host']}.")


# ------------------------------------------------------------------------------ kernels and inputs

def make_case(kernel: str, shape: Sequence[int], dtype: torch.dtype, device, p: float = 0.1,
              gelu_approximate: str = "none") -> tuple[tuple, Callable, Callable]:
    """(inputs, lynx_fn, reference_fn) for one case; both functions take ``*inputs``. The
    reference returns what ``lynx_compile.kernels.reference`` returns (a tuple for the norms)."""
    from lynx_compile import kernels as K
    from lynx_compile.kernels import reference as R

    g = torch.Generator(device=device).manual_seed(0)

    def randn(*s, scale=1.0, shift=0.0):
        return (torch.randn(*s, generator=g, device=device, dtype=torch.float32) * scale + shift).to(dtype)

    if kernel == "causal_softmax":
        return ((randn(*shape),), lambda s: K.causal_softmax(s, SOFTMAX_SCALE),
                lambda s: R.causal_softmax(s, SOFTMAX_SCALE))
    n, h = shape
    if kernel == "rms_norm":
        return ((randn(n, h), randn(h, scale=0.1, shift=1.0)), lambda x, w: K.rms_norm(x, w, EPS_RMS),
                lambda x, w: R.rms_norm(x, w, EPS_RMS))
    if kernel == "layer_norm":
        return ((randn(n, h), randn(h, scale=0.1, shift=1.0), randn(h, scale=0.1)),
                lambda x, w, b: K.layer_norm(x, w, b, EPS_LN), lambda x, w, b: R.layer_norm(x, w, b, EPS_LN))
    if kernel == "bias_gelu":
        return ((randn(n, h), randn(h, scale=0.1)), lambda x, b: K.bias_gelu(x, b, gelu_approximate),
                lambda x, b: R.bias_gelu(x, b, gelu_approximate))
    if kernel == "swiglu":
        return (randn(n, h), randn(n, h)), K.swiglu, R.swiglu
    if kernel == "dropout":
        return ((randn(n, h),), lambda x: K.dropout(x, p, SEED, OFFSET), lambda x: R.dropout(x, p, SEED, OFFSET))
    if kernel == "dropout_mask":
        return ((randn(n, h),), lambda x: K.dropout_mask(x, p, SEED, OFFSET),
                lambda x: R.dropout_mask(x, p, SEED, OFFSET))
    if kernel == "bias_dropout_add":
        return ((randn(n, h), randn(h, scale=0.1), randn(n, h)),
                lambda x, b, r: K.bias_dropout_add(x, b, r, p, SEED, OFFSET),
                lambda x, b, r: R.bias_dropout_add(x, b, r, p, SEED, OFFSET))
    raise ValueError(f"unknown kernel {kernel!r} (known: {', '.join(KERNELS)})")


def native_baseline(kernel: str, p: float) -> Callable:
    """torch's own ops for the dropout family (torch's RNG, so not bit-comparable with lynx): the
    eager / Inductor baseline under ``--dropout-baseline native``. Inductor fuses these with its own
    in-kernel Philox, which is what a torch.compile'd model would run."""
    import torch.nn.functional as F
    if kernel == "dropout":
        return lambda x: F.dropout(x, p, training=True)
    if kernel == "dropout_mask":
        return lambda x: torch.rand(x.shape, device=x.device) >= p
    if kernel == "bias_dropout_add":
        return lambda x, b, r: r + F.dropout(x + b, p, training=True)
    raise ValueError(f"no native baseline for {kernel!r}")


def first(out):
    """The output tensor to compare: the references of the norms return (y, stats...)."""
    return out[0] if isinstance(out, (tuple, list)) else out


def compare(out: torch.Tensor, ref: torch.Tensor, atol: float, rtol: float,
            chunk: int = 1 << 26) -> tuple[float, bool]:
    """(max |out - ref|, every element within atol + rtol * |ref|), in chunks of ``chunk``
    elements so that the fp32 temporaries stay small."""
    if out.shape != ref.shape or out.dtype != ref.dtype:
        return float("inf"), False
    a, b = out.reshape(-1), ref.reshape(-1)
    worst, ok = 0.0, True
    for i in range(0, a.numel(), chunk):
        x, y = a[i:i + chunk].float(), b[i:i + chunk].float()
        d = (x - y).abs()
        if d.numel():
            worst = max(worst, float(d.max()))
            ok = ok and bool((d <= atol + rtol * y.abs()).all())
    return worst, ok


# ------------------------------------------------------------------------------------------ timing

class Timer:
    """Median wall time of ``fn()`` in ms: ``warmup`` calls, then ``repeats`` timed calls. On CUDA,
    events on the current stream around each call, an L2 flush (zeroing ``flush_bytes``) before
    each, ``torch.cuda.synchronize`` once the repeats are queued. Elsewhere (only for a dry run of
    the logic) ``time.perf_counter``."""

    def __init__(self, device, warmup: int = 10, repeats: int = 50, flush_bytes: int = 256 << 20):
        self.device = torch.device(device)
        self.cuda = self.device.type == "cuda"
        self.warmup, self.repeats = warmup, repeats
        self.flush = (torch.empty(flush_bytes, dtype=torch.uint8, device=self.device)
                      if self.cuda and flush_bytes > 0 else None)

    def sync(self) -> None:
        if self.cuda:
            torch.cuda.synchronize(self.device)

    def samples(self, fn: Callable[[], object]) -> list[float]:
        for _ in range(self.warmup):
            fn()
        self.sync()
        if not self.cuda:
            out = []
            for _ in range(self.repeats):
                t0 = time.perf_counter()
                fn()
                out.append((time.perf_counter() - t0) * 1e3)
            return out
        events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
                  for _ in range(self.repeats)]
        for start, end in events:
            if self.flush is not None:
                self.flush.zero_()  # evict L2; also keeps the GPU busy while the host launches fn
            start.record()
            fn()
            end.record()
        self.sync()
        return [start.elapsed_time(end) for start, end in events]

    def __call__(self, fn: Callable[[], object]) -> float:
        return statistics.median(self.samples(fn))


def measure_hbm(timer: Timer, nbytes: int = 1 << 30) -> float:
    """GB/s (1e9 B/s) of a ``dst.copy_(src)`` of ``nbytes``: 2 x nbytes (read + write) / time."""
    src = torch.empty(nbytes, dtype=torch.uint8, device=timer.device).random_(0, 255)
    dst = torch.empty_like(src)
    ms = timer(lambda: dst.copy_(src))
    return 2 * nbytes / (ms * 1e-3) / 1e9


def _oom(exc: BaseException) -> bool:
    return isinstance(exc, torch.cuda.OutOfMemoryError) or "out of memory" in str(exc)


def _err(what: str, exc: BaseException) -> str:
    return f"{what}: {type(exc).__name__}: {str(exc).splitlines()[0][:120] if str(exc) else ''}"


def run_case(kernel: str, shape: Sequence[int], dtype: torch.dtype, timer: Timer, hbm_gbs: Optional[float],
             inductor: bool = True, p: float = 0.1, gelu_approximate: str = "none",
             dropout_baseline: str = "native") -> dict:
    """Times lynx, the eager baseline and the Inductor-compiled baseline on one case; one result row.
    The baseline is the reference function, except for the dropout family under
    ``dropout_baseline="native"`` (``native_baseline``); ``ok`` always compares with the reference.
    Under ``dropout_baseline="reference"`` the dropout family gets no Inductor time: Inductor's
    scheduler is exponential in the Philox rounds of the reference (on torch 2.13, CPU: 5 rounds
    compile in 10 s, 7 in 67 s; the 10 rounds did not finish in 10 min and held 17 GB)."""
    dev = timer.device
    if timer.cuda:
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(dev)
    errors: list[str] = []
    ms_lynx = ms_eager = ms_ind = compile_s = diff = ok = None
    try:
        args, lynx_fn, ref_fn = make_case(kernel, shape, dtype, dev, p, gelu_approximate)
    except Exception as exc:  # noqa: BLE001 - a case that does not fit is reported, the rest run
        return finish_row(kernel, shape, dtype, None, None, None, hbm_gbs, None, None, error=_err("inputs", exc))
    native = kernel in DROPOUT_FAMILY and dropout_baseline == "native"
    base_fn = native_baseline(kernel, p) if native else ref_fn
    baseline = "torch native" if native else "reference"
    if kernel in DROPOUT_FAMILY and not native:
        inductor, errors = False, ["inductor skipped (compile of the Philox emulation is exponential)"]
    atol, rtol = (0.0, 0.0) if kernel in EXACT else TOLERANCE.get(dtype, (1e-2, 1e-2))
    try:
        out = first(lynx_fn(*args))
        ref = first(ref_fn(*args))
        diff, ok = compare(out, ref, atol, rtol)
    except Exception as exc:  # noqa: BLE001
        errors.append(_err("check", exc))
    out = ref = None  # noqa: F841 - free both before timing
    try:
        ms_lynx = timer(lambda: lynx_fn(*args))
    except Exception as exc:  # noqa: BLE001
        errors.append(_err("lynx", exc))
    try:
        ms_eager = timer(lambda: base_fn(*args))
    except Exception as exc:  # noqa: BLE001
        errors.append(_err("eager", exc))
    if inductor:
        try:
            torch._dynamo.reset()  # compile this case from scratch: no cached graph, no dynamic shapes
            compiled = torch.compile(base_fn, dynamic=False)
            timer.sync()
            t0 = time.perf_counter()
            compiled(*args)  # compiles; excluded from ms_inductor
            timer.sync()
            compile_s = time.perf_counter() - t0
            ms_ind = timer(lambda: compiled(*args))
        except Exception as exc:  # noqa: BLE001
            errors.append(_err("inductor", exc))
        finally:
            torch._dynamo.reset()
    peak = torch.cuda.max_memory_allocated(dev) / 2**30 if timer.cuda else None
    row = finish_row(kernel, shape, dtype, ms_lynx, ms_eager, ms_ind, hbm_gbs, diff, ok, compile_s, peak,
                     "; ".join(errors))
    row["baseline"] = baseline
    return row


def run_overlap(recompute: str, shape: Sequence[int], mm: int, dtype: torch.dtype, timer: Timer,
                p: float = 0.1) -> dict:
    """``recompute`` (a lynx kernel) on a side stream while the main stream runs an (mm x mm) @
    (mm x mm) matmul, against the two back to back on the main stream."""
    row = {"recompute": recompute, "recompute_shape": shape_str(shape), "matmul": f"{mm}x{mm}x{mm}",
           "dtype": dtype_name(dtype), "error": ""}
    if not timer.cuda:
        row["error"] = "needs CUDA streams"
        return row
    try:
        args, lynx_fn, _ = make_case(recompute, shape, dtype, timer.device, p)
        g = torch.Generator(device=timer.device).manual_seed(1)
        a = torch.randn(mm, mm, generator=g, device=timer.device).to(dtype)
        b = torch.randn(mm, mm, generator=g, device=timer.device).to(dtype)
        c = torch.empty(mm, mm, device=timer.device, dtype=dtype)
        main, side = torch.cuda.current_stream(timer.device), torch.cuda.Stream(timer.device)

        def matmul():
            torch.mm(a, b, out=c)

        def recompute_fn():
            return lynx_fn(*args)

        def serial():
            matmul()
            recompute_fn()

        def overlapped():
            ready = torch.cuda.Event()
            ready.record(main)  # inputs ready on the main stream
            side.wait_event(ready)
            with torch.cuda.stream(side):
                y = recompute_fn()
            matmul()  # main stream, concurrently with the side stream's recompute
            done = torch.cuda.Event()
            done.record(side)
            main.wait_event(done)  # the timer's end event (main stream) waits for both
            del y  # freed to the side stream's pool after the main stream's wait: safe

        row["ms_matmul"] = t_mm = timer(matmul)
        row["ms_recompute"] = t_rc = timer(recompute_fn)
        row["ms_serial"] = t_s = timer(serial)
        row["ms_overlap"] = t_o = timer(overlapped)
        row["overlap_frac"] = overlap_fraction(t_s, t_o, t_mm, t_rc)
    except Exception as exc:  # noqa: BLE001
        row["error"] = _err("overlap", exc)
    return row


BACKWARD_KEYS = ["model", "policy", "side_stream", "ms_step", "peak_GiB", "segments", "launched_early",
                 "speedup_vs_one_stream", "error"]


def run_backward(model: str, layers: int, batch: int, dtype: torch.dtype, timer: Timer) -> list[dict]:
    """A GPT training step (forward + backward, full recompute with the fused kernels) compiled by
    lynx with the recompute on the main stream and on the side stream launched one segment
    ahead (``side_stream_extra_bytes`` unbounded); median step time and peak allocated memory."""
    import lynx_compile
    from lynx_compile.models.presets import build_model, example_batch

    rows, base = [], None
    for side in (False, True):
        row = {"model": f"{model} ({layers} layers, batch {batch})", "policy": "full", "side_stream": side,
               "error": ""}
        try:
            torch.manual_seed(0)
            net = build_model(model, n_layers=layers, dropout=0.0, device=timer.device, dtype=dtype)
            idx = example_batch(net, batch).to(timer.device)
            options = {"policy": "full", "fuse_kernels": True, "side_stream": side,
                       "side_stream_extra_bytes": 1 << 40}
            backend = lynx_compile.LynxBackend(lynx_compile.make_config(options))
            compiled = torch.compile(net, backend=backend)

            def step():
                compiled(idx).loss.backward()

            step()
            torch.cuda.reset_peak_memory_stats(timer.device)
            row["ms_step"] = t = timer(step)
            row["peak_GiB"] = torch.cuda.max_memory_allocated(timer.device) / 2**30
            decided = backend.records[0].stats.get("side_stream", {})
            row["segments"] = decided.get("segments", 0)
            row["launched_early"] = decided.get("segments", 0) - decided.get("not_launched_early", 0)
            base = t if not side else base
            row["speedup_vs_one_stream"] = base / t if base else None
        except Exception as exc:  # noqa: BLE001
            row["error"] = _err("backward", exc)
        rows.append(row)
        del net
        torch.cuda.empty_cache()
    return rows


# -------------------------------------------------------------------------------------- reporting

def environment(device) -> dict:
    try:
        import triton
        triton_version = triton.__version__
    except Exception:  # noqa: BLE001
        triton_version = "not installed"
    if torch.cuda.is_available():
        prop = torch.cuda.get_device_properties(device)
        gpu = f"{prop.name} ({prop.multi_processor_count} SMs, {prop.total_memory / 2**30:.0f} GiB)"
    else:
        gpu = "none"
    return {"date": time.strftime("%Y-%m-%d"), "gpu": gpu, "torch": torch.__version__, "triton": triton_version,
            "cuda": torch.version.cuda, "python": platform.python_version(),
            "host": f"{platform.machine()}, {os.cpu_count()} CPU cores"}


def write_results(out: str, env: dict, argv: Sequence[str], hbm_gbs: float, settings: str, rows: Sequence[dict],
                  overlap_rows: Sequence[dict], backward_rows: Sequence[dict] = ()) -> list[str]:
    os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
    with open(out + ".csv", "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=KEYS + EXTRA_KEYS, extrasaction="ignore")
        w.writeheader()
        w.writerows({k: csv_value(r.get(k)) for k in KEYS + EXTRA_KEYS} for r in rows)
    if overlap_rows:
        with open(out + "_overlap.csv", "w", newline="") as f:
            w = csv.DictWriter(f, fieldnames=OVERLAP_KEYS, extrasaction="ignore")
            w.writeheader()
            w.writerows({k: csv_value(r.get(k)) for k in OVERLAP_KEYS} for r in overlap_rows)
    lines = [header_line(env), "",
             "Command: `" + " ".join(["python benchmarks/bench_kernels.py", *argv]) + "`", "",
             f"Measured HBM bandwidth: **{hbm_gbs:.0f} GB/s** (1 GB = 1e9 B; ~1 GiB `Tensor.copy_`, "
             "2 x bytes / median time); `frac_of_hbm` = GB_s / that.", "", settings, "",
             "## Kernels", ""]
    lines += md_table(rows, KEYS + ["baseline", "max_abs_diff", "compile_s", "peak_GiB"])
    errs = [r for r in rows if r.get("error")]
    if errs:
        lines += ["", "Errors:", ""] + [f"- {r['kernel']} {r['shape']}: {r['error']}" for r in errs]
    lines += ["", "Bytes per kernel (read + write; N = tokens, H = hidden, e = bytes per element, "
                  "BH = batch*heads; per-row statistics fp32, masks 1 B):", ""]
    lines += [f"- {k}: {BYTES_FORMULA[k]}" for k in KERNELS if any(r["kernel"] == k for r in rows)]
    if overlap_rows:
        lines += ["", "## Side stream overlap", "",
                  "Recompute kernel on a secondary `torch.cuda.Stream` (waits on an event recorded by the main "
                  "stream; the main stream waits on its completion event) while the main stream runs the matmul; "
                  "serial = both back to back on the main stream. overlap_frac = (ms_serial - ms_overlap) / "
                  "min(ms_matmul, ms_recompute).", ""]
        lines += md_table(overlap_rows, OVERLAP_KEYS)
    if backward_rows:
        lines += ["", "## Training step with the recompute on the side stream", "",
                  "lynx policy full + fuse_kernels; side_stream=False: recompute on demand on the main stream; "
                  "True: each block's recompute segment on a secondary stream, launched one segment ahead "
                  "(lynx_compile.runtime.side_stream_runner). ms_step = forward + backward, median.", ""]
        lines += md_table(backward_rows, BACKWARD_KEYS)
    with open(out + ".md", "w") as f:
        f.write("\n".join(lines) + "\n")
    return lines


def _int_list(s: str) -> list[int]:
    return [int(v) for v in s.split(",") if v.strip()]


def _kernel_list(s: str) -> list[str]:
    ks = [v.strip() for v in s.split(",") if v.strip()]
    bad = [k for k in ks if k not in KERNELS]
    if bad:
        raise argparse.ArgumentTypeError(f"unknown kernel(s) {', '.join(bad)}; known: {', '.join(KERNELS)}")
    return ks


def parse_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--dtype", default="bf16", choices=sorted(DTYPES))
    p.add_argument("--kernels", type=_kernel_list, default=list(KERNELS), help="comma list (default: all)")
    p.add_argument("--tokens", type=_int_list, default=[4096, 16384], help="rows N of the row kernels")
    p.add_argument("--hidden", type=_int_list, default=[4096, 8192], help="last dim H of the row kernels")
    p.add_argument("--softmax-T", type=_int_list, default=[2048, 4096], help="sequence lengths of causal_softmax")
    p.add_argument("--softmax-mem-gib", type=float, default=8.0,
                   help="memory cap that picks batch*heads for causal_softmax")
    p.add_argument("--warmup", type=int, default=10)
    p.add_argument("--repeats", type=int, default=50)
    p.add_argument("--flush-l2-mib", type=int, default=256, help="L2 flush before each timed call (0: none)")
    p.add_argument("--hbm-gib", type=float, default=1.0, help="size of the bandwidth-probe copy")
    p.add_argument("--p", type=float, default=0.1, help="dropout probability")
    p.add_argument("--gelu-approximate", default="none", choices=["none", "tanh"])
    p.add_argument("--no-inductor", action="store_true", help="skip the torch.compile baseline")
    p.add_argument("--dropout-baseline", default="native", choices=["native", "reference"],
                   help="eager / Inductor baseline of dropout, dropout_mask, bias_dropout_add: torch's own ops "
                        "(default), or the bit-exact Philox reference (eager only: its Inductor compile is "
                        "exponential in the Philox rounds). ok always compares with the reference")
    p.add_argument("--no-overlap", action="store_true", help="skip the side-stream overlap section")
    p.add_argument("--overlap-kernels", type=_kernel_list, default=["layer_norm"],
                   help="recompute kernels for the overlap section (row kernels)")
    p.add_argument("--overlap-tokens", type=int, default=16384)
    p.add_argument("--overlap-hidden", type=int, default=8192)
    p.add_argument("--overlap-mm", type=int, default=8192, help="square matmul size M = N = K")
    p.add_argument("--backward-model", default="gpt-1.3b", help="zoo preset of the side-stream training step")
    p.add_argument("--backward-layers", type=int, default=4, help="layers of that model (0: skip the section)")
    p.add_argument("--backward-batch", type=int, default=2)
    p.add_argument("--out", default=os.path.join(RESULTS, "kernels"),
                   help="path prefix: writes PREFIX.csv, PREFIX.md, PREFIX_overlap.csv")
    args = p.parse_args(argv)
    if "causal_softmax" in args.overlap_kernels:
        p.error("--overlap-kernels: row kernels only")
    return args


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = parse_args(argv)
    if not torch.cuda.is_available():
        print(NO_CUDA_MESSAGE, file=sys.stderr)
        return 2
    from lynx_compile.kernels import _support
    if not _support.triton_importable():
        print("bench_kernels.py needs triton (the lynx kernels would fall back to the torch reference)",
              file=sys.stderr)
        return 2
    # A lynx kernel silently replaced by its reference would make every number meaningless.
    warnings.filterwarnings("error", message=r"lynx_compile\.kernels\..*pure-torch reference")

    dtype, device = DTYPES[args.dtype], torch.device("cuda", torch.cuda.current_device())
    env = environment(device)
    print(header_line(env), flush=True)
    timer = Timer(device, args.warmup, args.repeats, args.flush_l2_mib << 20)
    hbm = measure_hbm(timer, int(args.hbm_gib * 2**30))
    print(f"measured HBM bandwidth (copy_ of {args.hbm_gib:g} GiB): {hbm:.0f} GB/s", flush=True)

    rows = []
    for kernel, shape in make_cases(args.kernels, args.tokens, args.hidden, args.softmax_T, dtype,
                                    args.softmax_mem_gib * 2**30):
        row = run_case(kernel, shape, dtype, timer, hbm, not args.no_inductor, args.p, args.gelu_approximate,
                       args.dropout_baseline)
        rows.append(row)
        print(format_row(row, KEYS + EXTRA_KEYS), flush=True)

    overlap_rows = []
    if not args.no_overlap:
        for k in args.overlap_kernels:
            row = run_overlap(k, (args.overlap_tokens, args.overlap_hidden), args.overlap_mm, dtype, timer, args.p)
            overlap_rows.append(row)
            print(format_row(row, OVERLAP_KEYS), flush=True)

    backward_rows = []
    if args.backward_layers > 0:
        backward_rows = run_backward(args.backward_model, args.backward_layers, args.backward_batch, dtype, timer)
        for row in backward_rows:
            print(format_row(row, BACKWARD_KEYS), flush=True)

    dropout_note = ("torch's own ops (F.dropout, rand >= p: torch's RNG, so not compared bit for bit)"
                    if args.dropout_baseline == "native" else
                    "that emulation, eager only (its Inductor compile is exponential in the Philox rounds)")
    settings = (f"dtype {args.dtype}; CUDA-event timing, {args.warmup} warm-up calls then the median of "
                f"{args.repeats}, L2 flushed ({args.flush_l2_mib} MiB) before each call. ms_eager = the "
                "`lynx_compile.kernels.reference` function run eagerly; ms_inductor = the same function under "
                "`torch.compile` (Inductor, default mode, dynamic=False, compiled afresh per case; compile_s = "
                "its first call, excluded from ms_inductor). speedup_* = ms_* / ms_lynx. Norm references also "
                "return their fp32 statistics, as the lynx ops write them. The dropout / dropout_mask / "
                "bias_dropout_add references emulate Triton's Philox bit for bit in int64 torch ops; their "
                f"baseline here is {dropout_note} (column baseline); ok: |lynx - reference| "
                "<= atol + rtol*|reference| everywhere (bf16 1e-2 + 1.6e-2, fp16 1e-3 + 2e-3, fp32 1e-5 + 1e-5; "
                f"dropout_mask exact). Row kernels: shape = tokens x hidden (swiglu: gate, up and y each that "
                f"shape), dropout p = {args.p}; causal_softmax: shape = batch*heads x T x T, scale 1/sqrt(128), "
                f"batch*heads the largest multiple of 8 under {args.softmax_mem_gib:g} GiB (input + 2 outputs "
                "+ 2 fp32 temporaries).")
    argv_used = list(sys.argv[1:] if argv is None else argv)
    lines = write_results(args.out, env, argv_used, hbm, settings, rows, overlap_rows, backward_rows)
    print("\n".join(lines))
    print(f"wrote {args.out}.csv, {args.out}.md" + (f", {args.out}_overlap.csv" if overlap_rows else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
