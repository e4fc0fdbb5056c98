"""The peers side by side: activation-memory tools against lynx at matching budgets (issue N, item 5).

    python benchmarks/bench_peers.py --quick     # gpt-tiny; eager, inductor, torch@0.5, checkpoint, SAC, torch_remat; lynx pairs (~5-10 min)
    python benchmarks/bench_peers.py             # gpt-tiny, hf-llama, tt-llama3; every peer below; lynx pairs
    python benchmarks/bench_peers.py --models hf-llama --peers inductor,sac-mm/inductor

Models (float32, dropout 0, one thread): ``gpt-tiny`` (the zoo's preset), ``hf-llama`` (HF
``LlamaForCausalLM``, ``foreign_models.hf_llama``), ``postln-gqa`` (``foreign_models.PostLNGQALM``),
all at ``bench_budget``'s shape (4 layers, batch 3 x sequence 48, built by ``bench_budget.build``:
the same weights, batch and measure, so fractions compare with ``results/budget*.md``), and
``tt-llama3``: torchtitan 0.3.0's llama3 ``debugmodel`` (dim 256, 16 heads, vocabulary 2048,
SDPA as in ``torchtitan_models``) cut to its first ``--tt-shape`` LAYERS blocks (default 2, batch 2
x sequence 128), with torchtitan's ``CrossEntropyLoss`` compiled by the same backend as the model
(torchtitan's ``BaseLoss._maybe_compile``; eager rows: eager loss).

Peers (each row its own process, cold Inductor cache, a timeout; a failure is the row's result):

- ``eager``: plain PyTorch. ``inductor``: ``torch.compile(model)``, no recompute budget: the
  reference every fraction is of.
- ``torch-budget@B``: ``torch.compile(model)`` with Inductor compiling under
  ``torch._functorch.config.activation_memory_budget = B`` (``_compat.inductor_at_activation_budget``;
  torchtitan's ``MemoryBudgetAC`` sets the same config).
- ``checkpoint-full/eager|inductor``: ``torch.utils.checkpoint.checkpoint(block, use_reentrant=False)``
  around every transformer block (the model's largest ``nn.ModuleList``), eager or compiled whole.
- ``sac-mm/eager|inductor``: the same with ``context_fn=create_selective_checkpoint_contexts(policy)``:
  the compute-intensive ops (``torch._functorch.partitioners.get_default_op_list()``, plus the CPU
  SDPA op) ``MUST_SAVE``, every other op ``PREFER_RECOMPUTE`` ("save matmuls").
- ``torch_remat-full/eager``: torch_remat 0.2.2 ``remat.checkpoint(region_name=...)(block)`` per block.
  ``torch_remat-save-attn/eager|inductor``: the same, with each block's attention module wrapped in
  ``remat.region(attn, "attn", recompute=False)`` and its output marked ``recompute_needs_tensor``:
  attention saved, the rest of the block recomputed. torch_remat takes no budget: these are its two
  natural policies, and lynx is run at the memory each of them measured.
- ``rockmate``: Rockmate 2.0.0 cannot run on this machine, and its row says why: it is CUDA-only
  (``Rockmate.__init__`` sets ``device = cuda``), and from PyPI it does not import (its dependency
  rkgb 2.0.0's sdist has no ``rkgb/core``).
- ``tt-ac-full``, ``tt-ac-selective``, ``tt-ac-memory-budget@0.5``: torchtitan's own
  ``FullAC`` / ``SelectiveAC`` (per-op; saves compute ops but every second mm) / ``MemoryBudgetAC``
  policies, ``policy.apply(model)`` then torchtitan's per-block ``apply_compile`` (Inductor), as
  its trainer orders them; ``inductor/per-block`` is that compile with no AC. torchtitan models only;
  other models get an ``n/a`` row. torchtitan 0.3.0 has no selective-layer mode (a row says so).
- ``checkpoint-full/lynx[@F]``, ``sac-mm/lynx[@F]`` (by ``--peers`` only): the checkpointed / SAC
  model compiled by lynx, with no budget or at ``F``: lynx keeps the model's own checkpointing
  (``passes/user_tags.py``), so these measure at or below the ``/inductor`` row. ``tt-ac-full/lynx``,
  ``tt-ac-selective/lynx``: torchtitan's AC applied, then its per-block compile with lynx (no budget).
- ``lynx@F``: ``torch.compile(model, backend=lynx_compile.backend(memory_budget=F))``, everything
  else lynx's defaults. ``lynx+offload@F`` (by ``--peers`` only): the same with ``offload=True``
  (a CPU's host copies are numpy's memory, outside the allocator the measure reads: device bytes
  only, as on a GPU). ``lynx/per-block@F`` (by ``--peers`` only): every block compiled apart with
  that backend (torchtitan's ``apply_compile`` on its models, ``block.compile`` on the others), the
  loss too, as torchtitan's trainer does; measured after the step is recorded and planned whole. For every peer row that measured a fraction f < 0.97 of ``inductor``'s peak
  a lynx row at F = f rounded down to 0.01 (F's within 0.05 above one lynx measured share its row:
  lynx never gets more memory than the peer it is paired with), lowest first; when lynx refuses
  (``BudgetError``: "use memory_budget >= X") the lower F's are not run (their row repeats the
  refusal) and one more row runs lynx at X (``lynx@min``).

Measures per row: ``ms_MiB``: the peak of one training step (forward + loss + backward, no
optimizer) from ``lynx_compile.memory.measure.measure_step(step, params=...)``, the allocator-event
peak ``bench_budget``'s ``ms`` column uses (every ``.grad`` allocated before the step, returned
gradients counted until added into ``.grad``; allocated before the first step too, so that lynx,
which plans for the ``.grad`` regime it compiles in, plans for the one measured); ``frac``: / the model's ``inductor`` row;
``step_ms``: median of ``--steps`` steps after ``--warmup`` (the first compiles: ``first_step_s``);
``grad_diff``: max |grad - eager grad| over every parameter after the first step from zero
gradients, the eager reference computed in the same process from a deep copy of the model taken
before any wrapping; ``grad_diff_inductor``: the model's ``inductor`` row's own, for scale.

Writes ``<out>/peers.csv``, ``.md`` and ``.png`` (``peers_quick.*`` with ``--quick``), rewritten after
every row so a stopped run keeps what it measured.
"""
from __future__ import annotations

import argparse
import contextlib
import copy
import functools
import json
import math
import os
import sys
import tempfile
import time
from typing import Any, Callable, Optional, Sequence

HERE = os.path.dirname(os.path.abspath(__file__))
if HERE not in sys.path:
    sys.path.insert(0, HERE)

import bench_budget as bb  # noqa: E402  (stdlib-only at import)

RESULTS = bb.RESULTS
MODELS = ("gpt-tiny", "hf-llama", "postln-gqa", "tt-llama3")
FULL_MODELS = ("tt-llama3", "gpt-tiny", "hf-llama")
TT_SHAPE = dict(layers=2, batch=2, seq=128)
PEERS = ("eager", "inductor", "torch-budget@0.7", "torch-budget@0.5", "torch-budget@0.3",
         "checkpoint-full/eager", "checkpoint-full/inductor", "sac-mm/eager", "sac-mm/inductor",
         "torch_remat-full/eager", "torch_remat-save-attn/eager", "rockmate",
         "inductor/per-block", "tt-ac-full", "tt-ac-selective", "tt-ac-memory-budget@0.5", "tt-ac-selective-layer")
MORE_PEERS = ("torch_remat-save-attn/inductor",  # by --peers only (one more compile per model)
              # the same checkpointing compiled by lynx (issue U): no budget, and a budget above it
              "checkpoint-full/lynx", "checkpoint-full/lynx@0.9", "sac-mm/lynx", "sac-mm/lynx@0.9",
              "tt-ac-full/lynx", "tt-ac-selective/lynx")
QUICK = dict(models=("gpt-tiny",), peers=("eager", "inductor", "torch-budget@0.5", "checkpoint-full/eager",
                                          "sac-mm/eager", "torch_remat-full/eager", "rockmate"))
TT_ONLY = ("inductor/per-block", "tt-ac-full", "tt-ac-selective", "tt-ac-memory-budget@0.5", "tt-ac-selective-layer",
           "tt-ac-full/lynx", "tt-ac-selective/lynx")
NO_PAIR_ABOVE = 0.97  # a peer at >= this fraction of inductor's peak recomputes (almost) nothing
MERGE = 0.05  # peers whose matching budgets lie this close share one lynx row (the lower budget)
MIB = 2 ** 20
COLUMNS = ["model", "peer", "budget", "result", "ms_MiB", "frac", "step_ms", "step_rel", "first_step_s",
           "grad_diff", "grad_diff_inductor", "wall_s", "tree"]
MD_COLUMNS = ["model", "peer", "ms_MiB", "frac", "step_ms", "step_rel", "first_step_s", "grad_diff",
              "grad_diff_inductor", "status"]


# ------------------------------------------------------------------------------------- models

def build(model: str) -> tuple[Any, Callable[[Any], Callable[[Callable], Any]]]:
    """(module, make_loss): ``make_loss(backend)`` -> ``loss_of(callable model) -> scalar``;
    ``backend`` compiles a loss that lives outside the model (torchtitan's), None: eager."""
    if model != "tt-llama3":
        module, loss_of = bb.build(model, "whole", "default")
        return module, lambda backend: loss_of
    import torchtitan_models as tt

    module = tt.build(model, layers=TT_SHAPE["layers"])
    tokens, labels = tt.batch(TT_SHAPE["batch"], TT_SHAPE["seq"])

    def make_loss(backend: Any) -> Callable:
        fn = tt.loss(backend)
        return lambda m: fn(m(tokens), labels)

    return module, make_loss


def blocks(module: Any) -> list:
    """The transformer blocks: torchtitan's ``layers`` (an ``nn.ModuleDict``), else the model's
    largest ``nn.ModuleList`` (``lynx_compile.tools.variants.transformer_blocks``)."""
    import torch

    from lynx_compile.tools.variants import transformer_blocks

    layers = getattr(module, "layers", None)
    if isinstance(layers, torch.nn.ModuleDict):
        return list(layers.values())
    return list(transformer_blocks(module))


def wrap_blocks(module: Any, wrap: Callable[[int, Callable], Callable]) -> None:
    """Replace every transformer block's ``forward`` by ``wrap(index, forward)``, in place
    (parameter names and order unchanged)."""
    for i, block in enumerate(blocks(module)):
        block.forward = wrap(i, block.forward)


def _checkpointed(context_fn: Optional[Callable] = None) -> Callable[[int, Callable], Callable]:
    from torch.utils.checkpoint import checkpoint

    kw = {} if context_fn is None else {"context_fn": context_fn}
    return lambda i, f: lambda *a, **k: checkpoint(f, *a, use_reentrant=False, **kw, **k)


def sac_save_matmuls() -> Callable:
    """``context_fn`` of SAC saving the compute-intensive ops, recomputing the rest."""
    import torch
    from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

    from lynx_compile import _compat

    save = {op.default for op in _compat.compute_intensive_ops()}
    save |= {torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default, torch.ops.aten.linear.default}

    def policy(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> Any:
        return CheckpointPolicy.MUST_SAVE if op in save else CheckpointPolicy.PREFER_RECOMPUTE

    return functools.partial(create_selective_checkpoint_contexts, policy)


def _attention(block: Any) -> Any:
    for name in ("attn", "self_attn", "attention"):
        if hasattr(block, name):
            return getattr(block, name)
    raise ValueError(f"{type(block).__name__}: no attn / self_attn / attention submodule")


def apply_torch_remat(module: Any, save_attn: bool) -> None:
    import torch
    import torch_remat as remat

    for i, block in enumerate(blocks(module)):
        if save_attn:
            attn = _attention(block)
            inner = attn.forward

            def saved(*a: Any, _inner: Callable = inner, **k: Any) -> Any:
                out = remat.region(_inner, "attn", recompute=False)(*a, **k)
                leaves = out if isinstance(out, (tuple, list)) else (out,)
                remat.recompute_needs_tensor(*[t for t in leaves if isinstance(t, torch.Tensor)])
                return out

            attn.forward = saved
        block.forward = remat.checkpoint(region_name=f"layers.{i}")(block.forward)


def apply_tt_ac(module: Any, mode: str) -> None:
    from torchtitan.distributed.activation_checkpoint import FullAC, MemoryBudgetAC, SelectiveAC

    if mode == "full":
        cfg = FullAC.Config()
    elif mode == "selective":
        cfg = SelectiveAC.Config()
    else:
        cfg = MemoryBudgetAC.Config(memory_budget=float(mode.split("@")[1]))
    cfg.build().apply(module)


def prepare(peer: str, model: str, module: Any, budget: Optional[float]) -> tuple[Callable, Any]:
    """(callable model, backend for a loss outside the model) of ``peer``, applied in place."""
    import torch

    import lynx_compile
    from lynx_compile import _compat

    compiled = lambda backend: (torch.compile(module, backend=backend), backend)  # noqa: E731
    if peer == "eager":
        return module, None
    if peer == "inductor":
        return compiled("inductor")
    if peer.startswith("torch-budget@"):
        return compiled(_compat.inductor_at_activation_budget(budget))
    if peer.startswith("lynx@"):
        return compiled(lynx_compile.backend(memory_budget=budget))
    if peer.startswith("lynx+offload@"):  # saved activations may also go to host memory
        return compiled(lynx_compile.backend(memory_budget=budget, offload=True))
    if peer.startswith("lynx/per-block@"):  # as torchtitan compiles: every block apart, the loss too
        backend = lynx_compile.backend(memory_budget=budget)
        if model == "tt-llama3":
            import torchtitan_models as tt

            tt.apply_compile(module, backend)
        else:
            for block in blocks(module):
                block.compile(backend=backend, fullgraph=True)
        return module, backend
    family, _, mode = peer.partition("/")
    if family == "checkpoint-full":
        wrap_blocks(module, _checkpointed())
    elif family == "sac-mm":
        wrap_blocks(module, _checkpointed(sac_save_matmuls()))
    elif family in ("torch_remat-full", "torch_remat-save-attn"):
        apply_torch_remat(module, save_attn=family.endswith("save-attn"))
    elif peer == "inductor/per-block" or peer.startswith("tt-ac-"):
        import torchtitan_models as tt

        ac, _, how = peer.partition("/")
        if ac.startswith("tt-ac-"):
            apply_tt_ac(module, ac[len("tt-ac-"):])
        # "tt-ac-<mode>/lynx": torchtitan's AC, then every block compiled by lynx (no budget)
        backend = lynx_compile.backend() if how == "lynx" else "inductor"
        tt.apply_compile(module, backend)
        return module, backend
    else:
        raise ValueError(f"unknown peer {peer!r}")
    if mode.startswith("lynx"):  # the annotated model compiled by lynx: it keeps the annotations
        return compiled(lynx_compile.backend(memory_budget=budget) if budget is not None else lynx_compile.backend())
    return compiled("inductor") if mode == "inductor" else (module, None)


def not_applicable(peer: str, model: str) -> Optional[str]:
    """Why ``peer`` has no row to measure on ``model`` (None: it runs)."""
    if peer == "tt-ac-selective-layer":
        return ("n/a: torchtitan 0.3.0 has no selective-layer mode (its ActivationCheckpointingConfig: "
                "selective (per-op), full, memory-budget, none)")
    if peer in TT_ONLY and model != "tt-llama3":
        return "n/a: torchtitan AC applies to torchtitan models"
    return None


# ------------------------------------------------------------------------------ one row (child)

def _rockmate_row(module: Any, model: str) -> dict:
    """Rockmate 2.0.0 cannot run on a CPU: say why (its import, then its device)."""
    import torch

    cuda_only = ("Rockmate 2.0.0 is CUDA-only (Rockmate.__init__ sets device = cuda and inspects on cuda; its "
                 "compiler uses torch.cuda streams and RNG state) and this machine has no GPU")
    try:
        import rockmate  # noqa: F401
    except Exception as exc:  # noqa: BLE001 - the reason is the row
        raise RuntimeError(f"cannot run here: `import rockmate` fails ({type(exc).__name__}: {exc}; the rkgb "
                           f"2.0.0 sdist on PyPI ships rkgb/__init__.py without rkgb/core), and {cuda_only}") from None
    if not torch.cuda.is_available():
        raise RuntimeError(f"cannot run here: {cuda_only}")
    raise NotImplementedError("a GPU is present: Rockmate(model, inputs, budget) is not wired in bench_peers")


def run_row(model: str, peer: str, budget: Optional[float], warmup: int, steps: int, threads: int) -> dict:
    import torch

    from lynx_compile.compiler.dynamo_backend import find_backend_error
    from lynx_compile.decisions import BudgetError
    from lynx_compile.memory.measure import measure_step
    from lynx_compile.tools.variants import describe_failure

    torch.set_num_threads(threads)
    row: dict[str, Any] = {"result": "ok"}
    try:
        module, make_loss = build(model)
        params = list(module.parameters())
        reference = copy.deepcopy(module)  # eager gradients of the same weights and batch
        make_loss(None)(reference).backward()
        ref_grads = [p.grad for p in reference.parameters()]
        del reference
        if peer == "rockmate":
            return {**row, **_rockmate_row(module, model)}
        fn, loss_backend = prepare(peer, model, module, budget)
        loss_of = make_loss(loss_backend)

        def step() -> None:
            loss_of(fn).backward()

        for p in params:  # the measured regime from the first step on: lynx plans for the one it compiles in
            if p.requires_grad:
                p.grad = torch.zeros_like(p)
        t0 = time.perf_counter()
        step()
        row["first_step_s"] = time.perf_counter() - t0
        diffs = [(g - r).abs().max().item() if g is not None and r is not None else
                 (0.0 if g is None and r is None else math.inf) for g, r in zip((p.grad for p in params), ref_grads)]
        row["grad_diff"] = max(diffs)
        for _ in range(warmup - 1):
            step()
        m = measure_step(step, device="cpu", repeats=steps, warmup=0, params=params)
        row["step_ms"] = m.step_s * 1e3
        row["ms_MiB"] = m.peak_bytes / MIB
    except Exception as exc:  # noqa: BLE001 - a failing row is a result
        refusal = find_backend_error(exc, BudgetError)
        row["result"] = ("refused: " + " ".join(str(refusal).split()) if refusal is not None
                         else describe_failure(exc))
    return row


# --------------------------------------------------------------------------- rows (parent side)

def peer_budget(peer: str) -> Optional[float]:
    return float(peer.split("@")[1]) if "@" in peer and peer != "lynx@min" else None


def measure(args: argparse.Namespace, model: str, peer: str, budget: Optional[float] = None) -> dict:
    base = {"model": model, "peer": peer, "budget": budget if budget is not None else peer_budget(peer),
            "tree": bb.tree_hash()}
    why = not_applicable(peer, model)
    if why:
        return {**base, "result": why}
    cache = tempfile.mkdtemp(prefix="bench_peers_cache_")
    env = dict(os.environ, TORCHINDUCTOR_CACHE_DIR=os.path.join(cache, "inductor"),
               TRITON_CACHE_DIR=os.path.join(cache, "triton"), TRANSFORMERS_VERBOSITY="error")
    cmd = [sys.executable, os.path.abspath(__file__), "--one",
           json.dumps({"model": model, "peer": peer, "budget": base["budget"]}),
           "--warmup", str(args.warmup), "--steps", str(args.steps), "--threads", str(args.threads),
           "--tt-shape", args.tt_shape]
    return {**base, **bb.run_json_child(cmd, env, args.timeout, cache)}


def lynx_budgets(rows: Sequence[dict], model: str) -> list[float]:
    """Budgets matching the peers' measured fractions (< NO_PAIR_ABOVE): f rounded down to 0.01,
    distinct, lowest first (``run_lynx`` lets one measured budget serve those within MERGE above it)."""
    ref = _reference(rows, model)
    if ref is None:
        return []
    return sorted(b for b in {_matching(r["ms_MiB"] / ref["ms_MiB"]) for r in rows if r["model"] == model
                              and r["result"] == "ok" and not r["peer"].startswith("lynx")} if b < NO_PAIR_ABOVE)


def _matching(frac: float) -> float:
    """lynx's budget for a peer that measured ``frac``: rounded down to 0.01."""
    return max(0.01, math.floor(frac * 100 + 1e-9) / 100)


def lynx_for(table: Sequence[dict], model: str, frac: float) -> Optional[dict]:
    """The lynx row run for a peer at ``frac``: the largest budget <= its matching one, within MERGE."""
    b = _matching(frac)
    rows = [x for x in table if x["model"] == model and x["peer"].startswith("lynx@")
            and not x["peer"].startswith("lynx@min") and b - MERGE - 1e-9 <= x["budget"] <= b + 1e-9]
    return max(rows, key=lambda x: x["budget"], default=None)


def run_lynx(args: argparse.Namespace, model: str, rows: list[dict], on_row: Callable[[dict], None]) -> None:
    """lynx at every matching budget, lowest first; below a refusal's named minimum nothing runs,
    and lynx@min runs at that minimum."""
    smallest: Optional[float] = None
    refusal = ""
    measured: Optional[float] = None  # the last budget lynx measured: it serves those within MERGE above
    for b in lynx_budgets(rows, model):
        peer = f"lynx@{b:g}"
        if measured is not None and b - measured <= MERGE + 1e-9:
            continue
        if smallest is not None and b < smallest:
            on_row({"model": model, "peer": peer, "budget": b, "tree": bb.tree_hash(),
                    "result": f"refused (not run, below the smallest reachable {smallest:g} named at {refusal})"})
            continue
        row = measure(args, model, peer, b)
        on_row(row)
        measured = b if row["result"] == "ok" else measured
        named = bb.USE_RE.search(row["result"]) if row["result"].startswith("refused") else None
        if named and smallest is None:
            smallest, refusal = float(named.group(1)), peer
    if smallest is None:
        return
    value = smallest
    for _ in range(2):  # as bench_budget's ``min``: the named minimum, + 0.001 when refused again
        row = measure(args, model, "lynx@min", value)
        if not row["result"].startswith("refused"):
            break
        value = round(value + 0.001, 3)
    on_row(row)


# ------------------------------------------------------------------------------------ reporting

def _reference(rows: Sequence[dict], model: str, peer: str = "inductor") -> Optional[dict]:
    return next((r for r in rows if r["model"] == model and r["peer"] == peer and r["result"] == "ok"), None)


def finish(rows: Sequence[dict], digits: int = 4) -> list[dict]:
    """Rows with every column: fractions of the model's ``inductor`` row, ``digits`` significant
    digits, ``status``."""
    out = []
    for r in rows:
        r = dict(r)
        ref = _reference(rows, r["model"])
        if ref is not None and r["result"] == "ok":
            r["frac"] = r["ms_MiB"] / ref["ms_MiB"]
            r["step_rel"] = r["step_ms"] / ref["step_ms"]
            r["grad_diff_inductor"] = ref.get("grad_diff")
        for k, v in list(r.items()):
            if isinstance(v, float) and k != "budget":
                r[k] = float(f"{v:.{digits}g}")
        res = r["result"]
        r["status"] = ("ok" if res == "ok" else "n/a" if res.startswith("n/a") else
                       "refused (not run)" if res.startswith("refused (not run") else res.split(":")[0])
        if r["peer"] == "lynx@min" and r.get("budget") is not None:
            r["peer"] = f"lynx@min={r['budget']:g}"
        out.append({k: r.get(k) for k in COLUMNS + ["status"]})
    return out


def pair_lines(table: Sequence[dict]) -> list[str]:
    """Per peer with a fraction < NO_PAIR_ABOVE: lynx at the matching budget (or its minimum)."""
    lines = []
    for r in table:
        if r["result"] != "ok" or r["peer"].startswith("lynx") or r["frac"] is None or r["frac"] >= NO_PAIR_ABOVE:
            continue
        lx = lynx_for(table, r["model"], r["frac"])
        head = f"{r['model']}: {lx['peer'] if lx else 'lynx'} vs {r['peer']}"
        if lx is None:
            lines.append(f"{head}: no lynx row")
            continue
        if lx["result"] != "ok":
            lx_min = next((x for x in table if x["model"] == r["model"] and x["peer"].startswith("lynx@min")
                           and x["result"] == "ok"), None)
            if lx_min is None:
                tried = [x for x in table if x["model"] == r["model"] and x["peer"].startswith("lynx@min")]
                floor = f" (lynx@min refused too, at {tried[0]['budget']:g})" if tried else ""
                lines.append(f"{r['model']}: {r['peer']} at {r['frac']:.3f}: lynx refused at {lx['budget']:g}"
                             f"{floor}: **{r['peer']} wins on memory**")
                continue
            lx, head = lx_min, (f"{r['model']}: {r['peer']} at {r['frac']:.3f} is below lynx's smallest "
                                f"reachable budget; {lx_min['peer']} vs {r['peer']}")
        mem = "lynx" if lx["ms_MiB"] < r["ms_MiB"] else ("tie" if lx["ms_MiB"] == r["ms_MiB"] else r["peer"])
        fast = "lynx" if lx["step_ms"] < r["step_ms"] else r["peer"]
        lines.append(f"{head}: memory {lx['ms_MiB']:.4g} vs {r['ms_MiB']:.4g} MiB ({lx['frac']:.3f} vs "
                     f"{r['frac']:.3f}; less: {mem}), step {lx['step_ms']:.4g} vs {r['step_ms']:.4g} ms "
                     f"(faster: {fast}), grad diff {lx['grad_diff']:.2g} vs {r['grad_diff']:.2g}")
    return lines


def tally(pairs: Sequence[str]) -> list[str]:
    """Per model: in how many pairs lynx used less memory / was faster (from ``pair_lines``)."""
    out = []
    for model in dict.fromkeys(ln.split(":")[0] for ln in pairs):
        mine = [ln for ln in pairs if ln.startswith(model + ":")]
        less = sum("less: lynx)" in ln for ln in mine)
        faster = sum("faster: lynx)" in ln for ln in mine)
        floor = sum("below lynx's smallest reachable" in ln or "wins on memory" in ln for ln in mine)
        out.append(f"{model}: {len(mine)} pairs; lynx used less memory in {less}, was faster in {faster}; "
                   f"{floor} peer(s) measured below every budget lynx accepted")
    return out


FAMILY_COLOUR = {"eager": "black", "inductor": "black", "torch-budget": "tab:orange", "checkpoint-full": "tab:blue",
                 "sac-mm": "tab:green", "torch_remat-full": "tab:purple", "torch_remat-save-attn": "tab:purple",
                 "tt-ac": "tab:brown", "lynx": "tab:red"}
PEER_MARKER = {"eager": "o", "inductor": "s", "torch-budget@0.7": "^", "torch-budget@0.5": "<",
               "torch-budget@0.3": ">", "checkpoint-full": "v", "sac-mm": "D", "torch_remat-full": "P",
               "torch_remat-save-attn": "X", "inductor/per-block": "s", "tt-ac-full": "*", "tt-ac-selective": "h",
               "tt-ac-memory-budget@0.5": "p", "lynx": "o"}


def _family(peer: str) -> str:
    if peer.startswith("tt-ac") or peer == "inductor/per-block":
        return "tt-ac"
    head = peer.split("/")[0].split("@")[0]
    return head if head in FAMILY_COLOUR else "eager"


def _style(peer: str) -> tuple[str, str, str]:
    """(marker, edge colour, face colour): colour = family, marker = peer (family for checkpoint
    wrappers), hollow = run eagerly, filled = compiled."""
    fam = _family(peer)
    colour = FAMILY_COLOUR[fam]
    marker = PEER_MARKER.get(peer) or PEER_MARKER.get(peer.split("/")[0]) or PEER_MARKER.get(fam, "o")
    eager = peer.endswith("/eager")
    return marker, colour, "white" if eager else colour


def plot(table: Sequence[dict], path: str) -> None:
    """Per model (one panel each, stacked): measured peak (fraction of inductor's) vs step time
    relative to inductor's; one marker per peer in the legend (hollow: eager, filled: compiled),
    lynx's rows joined by a line and labelled with their budget."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    models = list(dict.fromkeys(r["model"] for r in table if r["result"] == "ok" and r["frac"] is not None))
    if not models:
        return
    fig, axes = plt.subplots(len(models), 1, figsize=(10, 4.6 * len(models)), squeeze=False)
    for ax, model in zip(axes[:, 0], models):
        rs = [r for r in table if r["model"] == model and r["result"] == "ok" and r["frac"] is not None]
        lynx = sorted((r for r in rs if r["peer"].startswith("lynx")), key=lambda r: r["frac"])
        if lynx:
            ax.plot([r["frac"] for r in lynx], [r["step_rel"] for r in lynx], "-", color="tab:red", alpha=0.4)
        for i, r in enumerate(lynx):  # budget labels beside lynx's points, alternating above / below
            ax.annotate(r["peer"].replace("lynx@", ""), (r["frac"], r["step_rel"]), textcoords="offset points",
                        xytext=(6, 8 if i % 2 else -14), fontsize=8, color="tab:red", zorder=4,
                        bbox=dict(boxstyle="round,pad=0.1", fc="white", ec="none", alpha=0.75))
        for r in rs:
            marker, colour, face = _style(r["peer"])
            is_lynx = r["peer"].startswith("lynx")
            label = ("lynx@budget (labelled)" if r is lynx[0] else None) if is_lynx else r["peer"]
            ax.scatter(r["frac"], r["step_rel"], marker=marker, s=110 if marker in "*hp" else 80, edgecolors=colour,
                       facecolors=face, linewidths=1.5, zorder=3, label=label)
        if not lynx:
            ax.text(0.02, 0.03, "lynx: every budget refused (see peers.md)", transform=ax.transAxes, color="tab:red",
                    fontsize=9)
        ax.margins(x=0.06, y=0.12)
        ax.axvline(1.0, color="grey", lw=0.5, ls=":")
        ax.axhline(1.0, color="grey", lw=0.5, ls=":")
        ax.set_title(model)
        ax.set_xlabel("measured step peak / torch.compile (Inductor) peak")
        ax.set_ylabel("step time / Inductor's (loaded CPU)")
        ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0), framealpha=0.9)
        ax.grid(alpha=0.2)
    fig.suptitle("Peers vs lynx: lower-left is better (less memory, faster); hollow = eager, filled = compiled")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def write(out: str, stem: str, rows: Sequence[dict], argv: Sequence[str], notes: Sequence[str],
          env_line: str, git_state: str, pending: Sequence[tuple] = (), done: bool = False,
          command: Optional[str] = None) -> str:
    from lynx_compile.tools.report import csv_text, markdown_table

    os.makedirs(out, exist_ok=True)
    table = finish(rows)
    with open(os.path.join(out, stem + ".csv"), "w") as f:
        f.write(csv_text([{k: r[k] for k in COLUMNS} for r in finish(rows, 7)]))
    plot(table, os.path.join(out, stem + ".png"))
    lines = ["# Peers side by side: measured step peak, step time, gradients (CPU)", "", env_line,
             "Peers: torch_remat 0.2.2, Rockmate 2.0.0 (rkgb 2.0.0, pulp 2.7.0), torchtitan 0.3.0.", "",
             command or "Command: `" + " ".join(["python benchmarks/bench_peers.py", *argv]) + "`", "",
             "Code measured: " + git_state + "; `tree`: hash of lynx_compile/ and passes/ *.py per row (csv).", "",
             f"gpt-tiny / hf-llama / postln-gqa: {bb.SHAPE['layers']} layers, batch {bb.SHAPE['batch']} x seq "
             f"{bb.SHAPE['seq']} (bench_budget's shape and build); tt-llama3: torchtitan's llama3 debugmodel, "
             f"first {TT_SHAPE['layers']} layers, batch {TT_SHAPE['batch']} x seq {TT_SHAPE['seq']}, SDPA. fp32, "
             "dropout 0, one thread; step = forward + loss + backward, no optimizer; each row in its own process "
             "(cold Inductor cache). ms_MiB: `measure_step(params=...)`'s allocator-event peak (bench_budget's "
             "`ms`); frac = ms_MiB / the model's `inductor` row; step_ms: median of "
             f"{argv_steps(argv)} steps; step_rel = / inductor's; grad_diff: max |grad - eager grad| after one step; "
             "grad_diff_inductor: inductor's own (scale). Step times come from a shared, loaded 2-core machine "
             "(see the load note): they order peers roughly, they are not a speed claim. See the script's "
             "docstring for each peer.", ""]
    if not done:
        lines += ["**Partial: the run was still going (or was stopped) when this was written; rows of its "
                  "selection may be missing.**", ""]
    lines += [markdown_table(table, MD_COLUMNS), ""]
    bad = [r for r in table if r["result"] != "ok"]
    if bad:
        lines += ["Rows that did not measure (why):", ""]
        lines += [f"- {r['model']} {r['peer']}: {r['result'][:400]}" for r in bad]
        lines.append("")
    lines += ["Pairs (lynx at the budget matching each peer's measured fraction, rounded down to 0.01):", ""]
    pairs = pair_lines(table)
    lines += [f"- {ln}" for ln in pairs] or ["- (none)"]
    lines += ["", "Tally per model (pairs above; step times from a loaded machine):", ""]
    lines += [f"- {ln}" for ln in tally(pairs)] or ["- (none)"]
    if notes:
        lines += ["", *(f"Note: {n}" for n in notes)]
    text = "\n".join(lines) + "\n"
    bb.write_atomic(os.path.join(out, stem + ".md"), text)
    return text


def argv_steps(argv: Sequence[str]) -> str:
    return argv[list(argv).index("--steps") + 1] if "--steps" in argv else str(DEFAULT_STEPS)


DEFAULT_STEPS = 5


# ------------------------------------------------------------------------------------------ CLI

def parse_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="gpt-tiny; eager, inductor, torch@0.5, checkpoint, SAC, "
                   "torch_remat (eager), rockmate; lynx pairs")
    p.add_argument("--models", type=lambda v: v.split(","), default=None, help=f"comma list of {', '.join(MODELS)}")
    p.add_argument("--peers", type=lambda v: v.split(","), default=None, help=f"comma list of {', '.join(PEERS + MORE_PEERS)}, lynx/per-block@F, lynx+offload@F, torch-budget@F")
    p.add_argument("--no-lynx", action="store_true", help="peers only, no lynx rows")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--steps", type=int, default=DEFAULT_STEPS)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--timeout", type=float, default=600, help="seconds per row process")
    p.add_argument("--tt-shape", default="2,2,128", metavar="LAYERS,BATCH,SEQ",
                   help="tt-llama3: the debugmodel's first LAYERS blocks, batch x sequence (default 2,2,128)")
    p.add_argument("--out", default=RESULTS)
    p.add_argument("--stem", default=None)
    p.add_argument("--report-only", default=None, metavar="CSV", help="run nothing: rewrite the .md and .png "
                   "of an earlier run's CSV (its .md's command, code and notes kept) under --out / --stem")
    p.add_argument("--one", default=None, help=argparse.SUPPRESS)
    return p.parse_args(argv)


TEXT_COLUMNS = ("model", "peer", "result", "tree")


def report_only(args: argparse.Namespace) -> str:
    """The .md / .png of an earlier run from its CSV and .md (header lines and notes kept)."""
    import csv

    with open(args.report_only, newline="") as f:
        rows = [{k: (v if k in TEXT_COLUMNS else None if v == "" else float(v)) for k, v in r.items()}
                for r in csv.DictReader(f)]
    with open(os.path.splitext(args.report_only)[0] + ".md") as f:
        old = f.read().splitlines()
    env_line = old[2]
    command = next(ln for ln in old if ln.startswith("Command:"))
    git_state = next(ln for ln in old if ln.startswith("Code measured:")).split(": ", 1)[1].split("; `tree`")[0]
    notes = [ln[len("Note: "):] for ln in old if ln.startswith("Note: ") and "--report-only" not in ln]
    notes.append(f"this .md and .png rewritten from the CSV by `--report-only` ({bb.git_state()}); the rows are "
                 "the run's.")
    stem = args.stem or os.path.splitext(os.path.basename(args.report_only))[0]
    return write(args.out, stem, rows, [], notes, env_line, git_state, done=not any(
        ln.startswith("**Partial") for ln in old), pending=["?"], command=command)


def _is_fraction(text: str) -> bool:
    try:
        return 0 < float(text) <= 1
    except ValueError:
        return False


def main(argv: Optional[Sequence[str]] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(argv)
    TT_SHAPE.update(zip(("layers", "batch", "seq"), (int(x) for x in args.tt_shape.split(","))))
    if args.one:
        spec = json.loads(args.one)
        with contextlib.redirect_stdout(sys.stderr):
            row = run_row(spec["model"], spec["peer"], spec["budget"], args.warmup, args.steps, args.threads)
        print(json.dumps(row))
        return 0
    if args.report_only:
        print(report_only(args))
        return 0
    models = args.models or list(QUICK["models"] if args.quick else FULL_MODELS)
    peers = args.peers or list(QUICK["peers"] if args.quick else PEERS)
    for x in models:
        if x not in MODELS:
            raise SystemExit(f"unknown model {x!r}: {', '.join(MODELS)}")
    for x in peers:
        if x.startswith(("lynx/per-block@", "lynx+offload@")) and _is_fraction(x.split("@")[1]):
            continue
        if x.startswith("torch-budget@") and (x.split("@")[1] == "0" or _is_fraction(x.split("@")[1])):
            continue
        if x not in PEERS + MORE_PEERS:
            raise SystemExit(f"unknown peer {x!r}: {', '.join(PEERS + MORE_PEERS)}")
    peers = ["inductor"] + [p for p in peers if p != "inductor"]  # the reference first
    stem = args.stem or ("peers_quick" if args.quick else "peers")
    env_line, git_state = bb.environment_line(), bb.git_state()
    start, load = time.time(), os.getloadavg()
    rows: list[dict] = []

    def on_row(row: dict) -> None:
        rows.append(row)
        print(f"{row['model']} {row['peer']}: " + (row["result"][:200] if row["result"] != "ok" else
              f"{row['ms_MiB']:.4g} MiB, {row['step_ms']:.4g} ms, grad diff {row['grad_diff']:.2g}")
              + f" ({row.get('wall_s', 0):.0f} s)", file=sys.stderr, flush=True)
        write(args.out, stem, rows, argv, [], env_line, git_state, pending=["?"])

    for model in models:
        for peer in peers:
            on_row(measure(args, model, peer))
        if not args.no_lynx:
            run_lynx(args, model, rows, on_row)
    notes = [f"wall time {(time.time() - start) / 60:.1f} min; load average (1 min) before / after: "
             f"{load[0]:.2f} / {os.getloadavg()[0]:.2f} on {os.cpu_count()} CPUs (a shared machine: other processes "
             "disturb step_ms; the peaks are allocator events and do not depend on load).",
             f"code at the end of the run: {bb.git_state()}."]
    print(write(args.out, stem, rows, argv, notes, env_line, git_state, done=True))
    return 0


if __name__ == "__main__":
    sys.exit(main())
