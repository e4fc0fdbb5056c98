"""torchtitan 0.3.0's own trainer, ``torchrun -m torchtitan.train``, with ``--compile.backend lynx``
against ``inductor``: what `benchmarks/gpu_session.sh titan` needs besides torchtitan itself.

torchtitan's llama3 ``debugmodel`` config reads a tokenizer (``hf_assets_path``,
``./tests/assets/tokenizer``) and a data set (``c4_test`` = ``tests/assets/c4_test``) that are
files of torchtitan's repository, not of its wheel. Nothing of that repository is copied here:
``assets`` makes both at run time, and torchtitan is pointed at them on its own command line
(``--hf_assets_path DIR/tokenizer --dataloader.dataset_path DIR/c4_local``; the ``c4_test``
loader is ``datasets.load_dataset(path, split="train")``, which reads a local folder of JSON
lines).

Subcommands (``python benchmarks/torchtitan_trainer_assets.py ...``):

- ``assets DIR``: ``DIR/tokenizer/`` (``tokenizer.json``: a byte-level BPE of 2,000 tokens, the
  two special tokens included, trained with the ``tokenizers`` library on the text below, so
  every id is below the debugmodel's vocabulary of 2,048; ``tokenizer_config.json`` names its
  BOS / EOS, which torchtitan's ``HuggingFaceTokenizer`` reads) and ``DIR/c4_local/data.json``
  (C4's layout, one ``{"text": ...}`` per line: 2,400 documents of made-up English from a fixed
  word chain, seeded, ~2 MB, ~450k tokens: more than 10 steps of 8 x 2048 take, so the loader
  does not loop; the chain gives the model something to learn, so the loss falls). The same
  files every time (seeded; the BPE trainer is deterministic).
- ``report --md FILE --json FILE LABEL=RUN_DIR ...``: each run's losses, memory and step time
  per step, from torchtitan's own TensorBoard scalars (``--metrics.enable_tensorboard``: full
  precision; ``memory/max_active(GiB)`` is the allocator's active-bytes peak of that step, the
  peak is reset after each log) or, where a run left none, from its console lines (``step: 1
  loss: ... memory: ...GiB`` = max reserved, 2 decimals; step time from ``tps``); a markdown
  table comparing the runs (the first is the baseline) and the same as JSON. A few lines on stdout.
- ``train ARGS``: ``torchtitan.train.main()`` with ARGS (torchtitan's own entry point, what
  ``-m torchtitan.train`` runs), after :func:`torch_compat`, which adds two names torchtitan 0.3.0
  takes from a newer torch than the GPU machines' 2.11 (and, for the second, than 2.13):
  ``torch.distributed.fsdp.DataParallelMeshDims`` (imported by ``distributed/fsdp.py:13`` and
  ``distributed/full_dtensor.py:23``: without it ``-m torchtitan.train`` and the model
  packages, ``torchtitan.models.llama3`` among them, stop at their imports on torch 2.11) and
  ``torch.distributed.set_timeout`` (``distributed/utils.py:595``, ``set_pg_timeouts``, called
  after step 1: torch 2.11 and 2.13 have only the private ``distributed_c10d._set_pg_timeout``
  of the same signature). ``gpu_session.sh titan`` runs ``-m torchtitan.train`` itself where torch
  has both, this entry where it does not.
- ``cpu-train ARGS``: **the CPU smoke test only** (``LYNX_GPU_SESSION_DEVICE=cpu``), run under
  torchrun instead of ``-m torchtitan.train``: torchtitan 0.3.0 has no CPU device path
  (``tools/utils.py:55``: ``device_type = _get_available_device_type() or "cuda"``; the trainer
  then calls ``torch.cuda.set_device``, the metrics ``torch.cuda.memory_stats``), so this points
  the ``device_type`` / ``device_module`` globals of torchtitan's imported modules at the CPU (a
  stand-in for ``torch.cuda``'s memory and device queries), then calls ``torchtitan.train.main()``
  with ARGS. Never used on a GPU.

Config functions, for torchtitan's ``--module torchtitan_trainer_assets --config NAME``
(torchtitan imports a fully qualified module: this folder on ``PYTHONPATH``):
:func:`llama3_debugmodel_ce_loss_sdpa` (what ``gpu_session.sh titan`` runs) and
:func:`llama3_debugmodel_sdpa`.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import random
import re
import statistics
import sys
from typing import Any

VOCAB_SIZE = 2000
"""The tokenizer's size, its two special tokens included (the debugmodel's vocabulary is 2,048)."""
BOS, EOS = "<|begin_of_text|>", "<|end_of_text|>"
N_DOCS = 2400
SEED = 0


# ----------------------------------------------------------------------------- the config
def llama3_debugmodel_ce_loss_sdpa():
    """torchtitan's ``llama3_debugmodel_ce_loss()`` (its registry's "Debug model with standard
    (non-chunked) CrossEntropyLoss") with SDPA in every layer (:func:`llama3_debugmodel_sdpa`
    says why): what ``gpu_session.sh titan`` runs. Not the debugmodel's ``ChunkedLossWrapper``:
    on torch 2.11 (the GPU machines') its backward fails in eager mode already, at step 1
    (``RuntimeError: The tensor has a non-zero number of elements, but its data is not allocated
    yet``, from the engine, after the per-chunk backwards with FSDP2's ``lm_head`` unsharded by
    hand; seen on the CPU with torch 2.11.0, torchtitan 0.3.0; the same config runs on torch
    2.13). The loss is then one compiled graph on the logits, as in ``tests/test_torchtitan.py``."""
    from torchtitan.components.loss import CrossEntropyLoss
    from torchtitan.models.common.config_utils import decoder_vocab_size

    config = llama3_debugmodel_sdpa()
    config.loss = CrossEntropyLoss.Config(global_vocab_size=decoder_vocab_size(config.model_spec))
    return config


def llama3_debugmodel_sdpa():
    """torchtitan's ``llama3_debugmodel()`` (its config registry's, unchanged: 6 layers, dim 256,
    vocabulary 2,048, ChunkedLossWrapper, AdamW 8e-4, 8 x 2048 tokens a step, ...) with SDPA in
    every layer instead of FlexAttention: ``torchtitan.distributed.compile.apply_compile`` refuses
    every backend but ``inductor`` / ``aot_eager`` on a model holding FlexAttention modules, so
    ``--compile.backend lynx`` needs this, and the inductor run takes the same config so the two
    compare. The swap is torchtitan's own graph_trainer tests' (``experiments/graph_trainer/
    common_utils.build_decoder_config_for_backend``): causal, no per-document mask (the trainer
    then builds no masks; RoPE still gets each document's positions). Everything else is set on
    the command line."""
    from torchtitan.models.common.attention import ScaledDotProductAttention
    from torchtitan.models.llama3.config_registry import llama3_debugmodel

    config = llama3_debugmodel()
    for layer in config.model_spec.model.layers:
        layer.attention.inner_attention = ScaledDotProductAttention.Config()
    return config


# ----------------------------------------------------------------------------- assets
def _corpus(n_docs: int = N_DOCS, seed: int = SEED) -> list[str]:
    """Made-up English: words from syllables, each word followed by one of four likely next words
    most of the time (a fixed random chain), sentences of 6-18 words, documents of 40-300 words."""
    rng = random.Random(seed)
    syll = ["ka", "lo", "mi", "ter", "an", "sul", "ve", "ri", "do", "pen", "gra", "tho", "ne", "ba",
            "cus", "mor", "li", "fen", "ox", "ud", "sta", "qui", "zel", "har"]
    words = sorted({"".join(rng.choice(syll) for _ in range(rng.randint(1, 3))) for _ in range(900)})
    common = ["the", "a", "of", "and", "to", "in", "is", "was", "it", "that", "for", "on", "with", "as"]
    words = common + [w for w in words if w not in common]
    succ = {w: rng.sample(words, 4) for w in words}
    docs = []
    for _ in range(n_docs):
        out, w = [], rng.choice(words)
        target = rng.randint(40, 300)
        while len(out) < target:
            sent = []
            for _ in range(rng.randint(6, 18)):
                w = rng.choice(succ[w]) if rng.random() < 0.8 else rng.choice(words)
                sent.append(w)
            out += (" ".join(sent).capitalize() + rng.choice([".", ".", ".", "?", "!"])).split(" ")
        docs.append(" ".join(out))
    return docs


def make_assets(root: str) -> dict[str, Any]:
    """Write ``root/tokenizer/{tokenizer.json,tokenizer_config.json}`` and
    ``root/c4_local/data.json`` (module docstring); return a summary."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    docs = _corpus()
    data_dir, tok_dir = os.path.join(root, "c4_local"), os.path.join(root, "tokenizer")
    os.makedirs(data_dir, exist_ok=True)
    os.makedirs(tok_dir, exist_ok=True)
    with open(os.path.join(data_dir, "data.json"), "w") as f:
        for i, text in enumerate(docs):
            f.write(json.dumps({"text": text, "timestamp": "2026-01-01T00:00:00Z",
                                "url": f"local://{i}"}) + "\n")

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=VOCAB_SIZE, special_tokens=[BOS, EOS], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(docs, trainer=trainer)
    tok.save(os.path.join(tok_dir, "tokenizer.json"))
    with open(os.path.join(tok_dir, "tokenizer_config.json"), "w") as f:
        json.dump({"bos_token": BOS, "eos_token": EOS, "add_bos_token": True, "add_eos_token": False,
                   "model_max_length": 1 << 20, "tokenizer_class": "PreTrainedTokenizerFast"}, f, indent=1)
    n_tokens = sum(len(tok.encode(d).ids) + 2 for d in docs[:200]) * len(docs) / 200
    return {"root": root, "vocab": tok.get_vocab_size(), "bos_id": tok.token_to_id(BOS),
            "eos_id": tok.token_to_id(EOS), "docs": len(docs),
            "bytes": os.path.getsize(os.path.join(data_dir, "data.json")), "tokens_est": int(n_tokens)}


# ----------------------------------------------------------------------------- entry points
def torch_compat() -> list[str]:
    """What torchtitan 0.3.0 takes from torch that this torch lacks, added; the names added.

    - ``torch.distributed.fsdp.DataParallelMeshDims`` (torch >= 2.12; torch 2.11 has none): a
      stand-in that refuses to be built. torchtitan builds one only to pass ``fully_shard`` a
      mesh of more than one data-parallel rank under its ``full_dtensor`` / ``spmd_types``
      backends (``distributed/full_dtensor.py``: ``resolve_fsdp_mesh`` returns None dims for a
      one-rank mesh), which torch 2.11's ``fully_shard`` (no ``dp_mesh_dims``) could not take
      anyway; on one GPU it is only imported.
    - ``torch.distributed.set_timeout``: ``torch.distributed.distributed_c10d._set_pg_timeout``,
      the same ``(timeout, group=None)``, which torch 2.11 and 2.13 have under that name.

    Nothing is added where torch has the name."""
    import dataclasses

    import torch
    import torch.distributed as dist
    import torch.distributed.fsdp as fsdp

    added = []
    if not hasattr(dist, "set_timeout") and hasattr(dist.distributed_c10d, "_set_pg_timeout"):
        dist.set_timeout = dist.distributed_c10d._set_pg_timeout
        added.append("torch.distributed.set_timeout (= distributed_c10d._set_pg_timeout)")
    if not hasattr(fsdp, "DataParallelMeshDims"):
        version = torch.__version__

        @dataclasses.dataclass
        class DataParallelMeshDims:  # noqa: D401 - a stand-in (function docstring)
            shard: Any = None
            replicate: Any = None

            def __post_init__(self) -> None:
                raise NotImplementedError(
                    f"torch {version}'s fully_shard has no dp_mesh_dims (torch >= 2.12): torchtitan's "
                    "data-parallel meshes of more than one rank under spmd_types / full_dtensor need it "
                    "(torchtitan_trainer_assets.torch_compat)")

        DataParallelMeshDims.__module__ = "torch.distributed.fsdp"
        fsdp.DataParallelMeshDims = DataParallelMeshDims
        added.append("torch.distributed.fsdp.DataParallelMeshDims (a stand-in that refuses to be built)")
    return added


def train(argv: list[str]) -> None:
    """``torchtitan.train.main()`` with ``argv``, after :func:`torch_compat` (module docstring)."""
    import torch

    added = torch_compat()
    if added:
        print(f"torchtitan_trainer_assets train: torch {torch.__version__} lacks what torchtitan 0.3.0 "
              f"imports; added {', '.join(added)}", flush=True)
    import torchtitan.train as tt_train

    sys.argv = ["torchtitan.train", *argv]
    tt_train.main()


# ----------------------------------------------------------------------------- the CPU smoke path
class _CpuDevice:
    """What torchtitan asks ``torch.cuda`` for, answered for the CPU (no memory statistics: the
    metrics log -1 GiB); everything else from ``torch.cpu``. CPU smoke test only."""

    def __getattr__(self, name: str) -> Any:
        import torch

        return getattr(torch.cpu, name)

    def set_device(self, device: Any) -> None:
        pass

    def current_device(self) -> int:
        return 0

    def device_count(self) -> int:
        return 1

    def is_available(self) -> bool:
        return True

    def get_device_name(self, device: Any = None) -> str:
        return "cpu"

    def get_device_properties(self, device: Any = None) -> Any:
        from types import SimpleNamespace

        return SimpleNamespace(name="cpu", total_memory=os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))

    def memory_stats(self, device: Any = None) -> dict[str, int]:
        return {}

    def reset_peak_memory_stats(self, device: Any = None) -> None:
        pass

    def empty_cache(self) -> None:
        pass

    def synchronize(self, device: Any = None) -> None:
        pass


def cpu_train(argv: list[str]) -> None:
    """``torchtitan.train.main()`` on the CPU (module docstring: the smoke test only)."""
    import torch

    if torch.cuda.is_available():
        raise SystemExit("cpu-train is the CPU smoke path; on a GPU run `-m torchtitan.train`")
    added = torch_compat()
    if added:
        print(f"cpu-train: torch {torch.__version__}: added {', '.join(added)}", flush=True)
    import torchtitan.train as tt_train  # imports the trainer and every module holding the globals

    shim, patched = _CpuDevice(), []
    for name, mod in list(sys.modules.items()):
        if not name.startswith("torchtitan") or mod is None:
            continue
        if getattr(mod, "device_type", None) == "cuda":
            mod.device_type = "cpu"
            patched.append(name)
        if getattr(mod, "device_module", None) is torch.cuda:
            mod.device_module = shim
    print(f"cpu-train: torchtitan's device globals set to the CPU in {', '.join(sorted(patched))}", flush=True)
    sys.argv = ["torchtitan.train", *argv]
    tt_train.main()


# ----------------------------------------------------------------------------- report
_LINE = re.compile(r"step:\s*(\d+)\s+loss:\s*(\S+)\s+grad_norm:\s*(\S+)\s+memory:\s*(-?[\d.]+)GiB"
                   r"\(\S+\)\s+tps:\s*([\d,]+)")
_TB = {"loss": "loss_metrics/global_avg_loss", "grad_norm": "grad_norm", "step_s": "time_metrics/end_to_end(s)",
       "active_gib": "memory/max_active(GiB)", "reserved_gib": "memory/max_reserved(GiB)", "tps": "throughput(tps)"}


def _from_tensorboard(run_dir: str) -> tuple[dict[int, dict[str, float]], str]:
    rows: dict[int, dict[str, float]] = {}
    try:
        from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    except Exception as exc:  # noqa: BLE001 - any failure: fall back to the console lines
        return rows, f"tensorboard not importable ({type(exc).__name__})"
    dirs = sorted({os.path.dirname(os.path.join(d, f)) for d, _, fs in os.walk(run_dir) for f in fs
                   if "tfevents" in f})
    for d in dirs:
        acc = EventAccumulator(d, size_guidance={"scalars": 0})
        acc.Reload()
        tags = set(acc.Tags().get("scalars", []))
        for key, tag in _TB.items():
            if tag in tags:
                for ev in acc.Scalars(tag):
                    rows.setdefault(int(ev.step), {})[key] = float(ev.value)
    return rows, f"TensorBoard scalars ({len(dirs)} event folder(s))" if dirs else "no TensorBoard events"


def _from_log(log_lines: list[str], tokens_per_step: int) -> dict[int, dict[str, float]]:
    rows: dict[int, dict[str, float]] = {}
    for line in log_lines:
        m = _LINE.search(line)
        if m:
            step, loss, gn, mem, tps = m.groups()
            tps_f = float(tps.replace(",", ""))
            rows[int(step)] = {"loss": float(loss), "grad_norm": float(gn), "reserved_gib": float(mem),
                               "tps": tps_f, "step_s": tokens_per_step / tps_f if tps_f > 0 else math.nan}
    return rows


def _run(label: str, run_dir: str, tokens_per_step: int) -> dict[str, Any]:
    log_path = os.path.join(run_dir, "train.log")
    log_lines: list[str] = []  # the run's console log, read once
    if os.path.exists(log_path):
        with open(log_path, errors="replace") as f:
            log_lines = f.readlines()
    tb, source = _from_tensorboard(run_dir)
    log = _from_log(log_lines, tokens_per_step)
    steps = sorted(set(tb) | set(log))
    per_step = {s: {**log.get(s, {}), **tb.get(s, {})} for s in steps}
    status = "?"
    rc_path = os.path.join(run_dir, "rc")
    if os.path.exists(rc_path):
        rc = open(rc_path).read().split()
        status = "ok" if rc and rc[0] == "0" else f"exit {rc[0] if rc else '?'}" + (" (timed out)" if rc and rc[0] in ("124", "137") else "")
        wall = float(rc[1]) if len(rc) > 1 else math.nan
    else:
        wall = math.nan
    err = ""
    if status != "ok" and log_lines:
        lines = [ln.strip() for ln in log_lines if ln.strip()]
        errs = [ln for ln in lines if re.search(r"(Error|Exception|error:)", ln) and "Warning" not in ln]
        err = (errs[-1] if errs else (lines[-1] if lines else ""))[:300]
    lynx_lines, plan = [], None
    if log_lines:
        # lynx's own lines (its stderr handler; torchtitan's root logger repeats them, "[titan] ...")
        lines = [ln.rstrip() for ln in log_lines
                 if re.match(r"\s*lynx[ :]", ln) or "lynx_compile." in ln and not ln.startswith("[titan]")]
        key = [ln for ln in lines if re.search(r"step \d+ recorded|planned together|out of reach|BudgetError", ln)]
        lynx_lines = key[-6:] + [ln for ln in lines[-20:] if ln not in key]
        for ln in key:
            m = re.search(r"no piece recomputing peaks at (\S+);.*step peak predicted (\S+) \(budget (\S+)\)", ln)
            if m:
                plan = {"no_recompute": m.group(1), "predicted": m.group(2), "budget": m.group(3)}
    return {"label": label, "status": status, "wall_s": wall, "source": source if tb else "console lines",
            "steps": per_step, "error": err, "lynx_log_tail": lynx_lines, "lynx_step_plan": plan}


def _f(x: Any, fmt: str = "{:.4g}") -> str:
    return "-" if x is None or (isinstance(x, float) and math.isnan(x)) else fmt.format(x)


def _summary(run: dict[str, Any], from_step: int) -> dict[str, Any]:
    st = run["steps"]
    late = [v for s, v in st.items() if s >= from_step]
    early = [v for s, v in st.items() if s < from_step]

    def peak(rows, key):
        xs = [r[key] for r in rows if key in r and r[key] >= 0]
        return max(xs) * 1024 if xs else None

    times = [r["step_s"] for r in late if "step_s" in r]
    return {"steps_run": len(st), "loss_first": st[min(st)]["loss"] if st else None,
            "loss_last": st[max(st)]["loss"] if st else None,
            "active_MiB_late": peak(late, "active_gib"), "reserved_MiB_late": peak(late, "reserved_gib"),
            "active_MiB_early": peak(early, "active_gib"),
            "step1_s": st[1]["step_s"] if 1 in st and "step_s" in st[1] else None,
            "step_ms_median_late": statistics.median(times) * 1000 if times else None}


def report(md_path: str, json_path: str, specs: list[str], tokens_per_step: int, from_step: int,
           title: str, notes: list[str]) -> int:
    runs = [_run(*spec.split("=", 1), tokens_per_step) for spec in specs]
    sums = [_summary(r, from_step) for r in runs]
    base, bs = runs[0], sums[0]

    def ratio(a, b):
        return f"{a / b:.3f}" if a is not None and b else "-"

    lines = [f"# {title}", "", *notes, "",
             f"Peaks and step times over steps >= {from_step} (lynx's step plan runs from step 3 on: "
             "steps 1-2 run its provisional per-graph plans); `active`: torchtitan's "
             "`memory/max_active(GiB)` (the CUDA allocator's active-bytes peak of each step, reset after "
             "each log), `reserved`: `memory/max_reserved(GiB)`; step time: torchtitan's "
             "`time_metrics/end_to_end(s)` (log_freq 1: one step). Step 1 includes the compile.", "",
             f"| run | status | steps | loss step 1 | loss last | peak active MiB | vs {base['label']} | "
             f"peak reserved MiB | median step ms | vs {base['label']} | step 1 s | process s | data from |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r, s in zip(runs, sums):
        lines.append(f"| {r['label']} | {r['status']} | {s['steps_run']} | {_f(s['loss_first'], '{:.5f}')} | "
                     f"{_f(s['loss_last'], '{:.5f}')} | {_f(s['active_MiB_late'], '{:.1f}')} | "
                     f"{ratio(s['active_MiB_late'], bs['active_MiB_late'])} | {_f(s['reserved_MiB_late'], '{:.1f}')} | "
                     f"{_f(s['step_ms_median_late'], '{:.2f}')} | {ratio(s['step_ms_median_late'], bs['step_ms_median_late'])} | "
                     f"{_f(s['step1_s'], '{:.1f}')} | {_f(r['wall_s'], '{:.0f}')} | {r['source']} |")
    for r in runs:
        if r["lynx_step_plan"]:
            p = r["lynx_step_plan"]
            lines += ["", f"{r['label']}: lynx's step plan (its log, step 2 recorded, planned at step 3): the step "
                      f"predicted at {p['predicted']} (budget {p['budget']}) where, with no compiled piece "
                      f"recomputing, it measured {p['no_recompute']} (lynx counts the step's memory above its "
                      "start; torchtitan's peaks above count everything the process holds)."]
    all_steps = sorted({s for r in runs for s in r["steps"]})
    lines += ["", "Per step: loss (torchtitan's `global_avg_loss`), peak active MiB, step ms.", "",
              "| step | " + " | ".join(f"{r['label']} loss" for r in runs)
              + (f" | max abs loss diff vs {base['label']}" if len(runs) > 1 else "") + " | "
              + " | ".join(f"{r['label']} MiB" for r in runs) + " | " + " | ".join(f"{r['label']} ms" for r in runs) + " |",
              "|---" * (1 + 3 * len(runs) + (len(runs) > 1)) + "|"]
    for step in all_steps:
        vals = [r["steps"].get(step, {}) for r in runs]
        losses = [v.get("loss") for v in vals]
        diff = [abs(x - losses[0]) for x in losses[1:] if x is not None and losses[0] is not None]
        lines.append(f"| {step} | " + " | ".join(_f(x, "{:.6f}") for x in losses)
                     + (f" | {_f(max(diff), '{:.2e}') if diff else '-'}" if len(runs) > 1 else "") + " | "
                     + " | ".join(_f(v["active_gib"] * 1024 if v.get("active_gib", -1) >= 0 else None, "{:.1f}")
                                  for v in vals)
                     + " | " + " | ".join(_f(v.get("step_s", math.nan) * 1000 if "step_s" in v else None, "{:.2f}") for v in vals)
                     + " |")
    for r in runs:
        if r["error"]:
            lines += ["", f"{r['label']}: {r['status']}: `{r['error'].replace('`', '')}`"]
    for r in runs:
        if r["lynx_log_tail"]:
            lines += ["", f"<details><summary>{r['label']}: lynx's last log lines</summary>", "", "```",
                      *r["lynx_log_tail"], "```", "</details>"]
    with open(md_path, "w") as f:
        f.write("\n".join(lines) + "\n")
    with open(json_path, "w") as f:
        json.dump({"runs": runs, "summary": sums, "tokens_per_step": tokens_per_step, "from_step": from_step}, f,
                  indent=1, default=str)
    print(f"  {'run':<10} {'status':<18} {'steps':>5} {'loss1':>9} {'lossN':>9} {'activeMiB':>10} {'ratio':>6} "
          f"{'step_ms':>8} {'ratio':>6} {'step1_s':>7}")
    for r, s in zip(runs, sums):
        print(f"  {r['label']:<10} {r['status'][:18]:<18} {s['steps_run']:>5} {_f(s['loss_first'], '{:.5f}'):>9} "
              f"{_f(s['loss_last'], '{:.5f}'):>9} {_f(s['active_MiB_late'], '{:.1f}'):>10} "
              f"{ratio(s['active_MiB_late'], bs['active_MiB_late']):>6} {_f(s['step_ms_median_late'], '{:.2f}'):>8} "
              f"{ratio(s['step_ms_median_late'], bs['step_ms_median_late']):>6} {_f(s['step1_s'], '{:.1f}'):>7}")
        if r["error"]:
            print(f"    {r['label']}: {r['error'][:200]}")
    return 0 if all(r["status"] == "ok" for r in runs) else 1


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["cpu-train"]:
        cpu_train(argv[1:])
        return 0
    if argv[:1] == ["train"]:
        train(argv[1:])
        return 0
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    a = sub.add_parser("assets", help="write the tokenizer and the local data set under DIR")
    a.add_argument("dir")
    r = sub.add_parser("report", help="tables from the runs' TensorBoard scalars / console lines")
    r.add_argument("--md", required=True)
    r.add_argument("--json", required=True)
    r.add_argument("--tokens-per-step", type=int, required=True)
    r.add_argument("--from-step", type=int, default=4)
    r.add_argument("--title", default="torchtitan's trainer: lynx against inductor")
    r.add_argument("--note", action="append", default=[])
    r.add_argument("runs", nargs="+", help="LABEL=RUN_DIR (RUN_DIR/train.log, RUN_DIR/rc, TensorBoard events under it)")
    args = p.parse_args(argv)
    if args.cmd == "assets":
        print(json.dumps(make_assets(args.dir)))
        return 0
    return report(args.md, args.json, args.runs, args.tokens_per_step, args.from_step, args.title, args.note)


if __name__ == "__main__":
    sys.exit(main())
