"""Synthetic transformer-like ``RematProblem``s for tests and solver benchmarks.

``synthetic_problem(n_blocks, units_per_block, n_windows_per_block, seed)`` builds the problem a
GPT stack of ``n_blocks`` identical blocks would give, without any graph:

    embed -> [ ln1 -> qkv -> scores -> softmax -> attn_v -> proj -> add1
               -> ln2 -> fc1 -> gelu -> fc2 -> add2 ] x n_blocks -> lnf -> logits -> loss

One forward event per unit (in id order), one backward event per unit (reverse order). A
backward op reads what its PyTorch derivative reads: matmuls/LN/GELU their inputs, softmax its
output, adds nothing; so ``scores``, ``proj`` and ``fc2`` are intermediates (needed only to
recompute a consumer). Each block's output ``add2`` is pinned (``must_keep``, the checkpoint
boundary of the residual stream; the loss is pinned too): without it every ``need_start`` would
chain back to the loss through the residual stream, since an input must exist whenever a
consumer might be recomputed. Bytes and times follow bf16 activations: one (B, S, H) tensor is T bytes,
an attention matrix (B, heads, S, S) is S' bytes; matmul time = flops / 300 TFLOP/s, elementwise
time = bytes moved / 2 TB/s; each template position gets a seeded ±25% jitter shared by every
block, so the blocks stay identical (``block_groups`` = one group). ``units_per_block`` other
than 12 truncates the template, or repeats it as sub-layers (each repetition's residual input
is the previous repetition's output). Each block's backward has ``n_windows_per_block``
collectives (same offsets and durations in every block), a few events long, and when there
are any, the head's gradient collective opens the backward.
"""
from __future__ import annotations

import dataclasses
import time
from typing import Callable

import numpy as np

from .evaluate import evaluate
from .problem import CommWindow, RematProblem, RematSolution, Unit

# unit records: [name, bytes, secs, input ids, block, bw reads, pinned (must_keep)]
# (name, bytes kind, time kind, inputs relative to the sub-layer (index or "res"), what the op's
# backward reads: its "inputs", its output ("self") or nothing)
TEMPLATE: tuple[tuple[str, str, str, tuple, str], ...] = (
    ("ln1", "T", "ew3", ("res",), "inputs"),
    ("qkv", "3T", "mm_qkv", (0,), "inputs"),
    ("scores", "S", "mm_att", (1,), "inputs"),
    ("softmax", "S", "ew_s", (2,), "self"),
    ("attn_v", "T", "mm_att", (3, 1), "inputs"),
    ("proj", "T", "mm_proj", (4,), "inputs"),
    ("add1", "T", "ew3", (5, "res"), "none"),
    ("ln2", "T", "ew3", (6,), "inputs"),
    ("fc1", "4T", "mm_fc", (7,), "inputs"),
    ("gelu", "4T", "ew_4", (8,), "inputs"),
    ("fc2", "T", "mm_fc", (9,), "inputs"),
    ("add2", "T", "ew3", (10, 6), "none"),
)
FLOPS, BANDWIDTH = 300e12, 2e12


def _sizes(batch: int, seq: int, hidden: int, heads: int) -> tuple[dict, dict]:
    t, s = 2 * batch * seq * hidden, 2 * batch * heads * seq * seq
    nbytes = {"T": t, "3T": 3 * t, "4T": 4 * t, "S": s}
    secs = {"ew3": 3 * t / BANDWIDTH, "ew_s": 2 * s / BANDWIDTH, "ew_4": 8 * t / BANDWIDTH,
            "mm_qkv": 2 * batch * seq * hidden * 3 * hidden / FLOPS,
            "mm_att": 2 * batch * seq * seq * hidden / FLOPS,
            "mm_proj": 2 * batch * seq * hidden * hidden / FLOPS,
            "mm_fc": 2 * batch * seq * hidden * 4 * hidden / FLOPS}
    return nbytes, secs


def synthetic_problem(n_blocks: int = 4, units_per_block: int = 12, n_windows_per_block: int = 1,
                      seed: int = 0, *, batch: int = 1, seq: int = 1024, hidden: int = 2048,
                      heads: int = 16, kappa: float = 1.1) -> RematProblem:
    """A deterministic (for a seed) transformer-like problem; see the module docstring."""
    rng = np.random.default_rng(seed)
    nbytes, secs = _sizes(batch, seq, hidden, heads)
    jit_b = rng.uniform(0.8, 1.25, units_per_block)
    jit_t = rng.uniform(0.8, 1.25, units_per_block)
    recs: list[list] = [["embed", nbytes["T"], nbytes["T"] / BANDWIDTH, (), None, "none", False]]
    res = 0
    for j in range(n_blocks):
        base = len(recs)
        for k in range(units_per_block):
            sub, pos = divmod(k, len(TEMPLATE))
            name, bk, tk, rel, reads = TEMPLATE[pos]
            first = base + sub * len(TEMPLATE)
            sub_res = res if sub == 0 else first - 1
            ins = tuple(sub_res if r == "res" else first + r for r in rel)
            b = int(nbytes[bk] * jit_b[k]) // 512 * 512
            pinned = name == "add2" or k == units_per_block - 1
            recs.append([f"b{j}.{name}{sub or ''}", b, secs[tk] * jit_t[k], ins, j, reads, pinned])
        res = len(recs) - 1
    vocab_bytes = 2 * batch * seq * 8192
    recs.append(["lnf", nbytes["T"], 3 * nbytes["T"] / BANDWIDTH, (res,), None, "inputs", False])
    recs.append(["logits", vocab_bytes, 2 * batch * seq * hidden * 8192 / FLOPS,
                 (len(recs) - 1,), None, "inputs", False])
    recs.append(["loss", 4, 2 * vocab_bytes / BANDWIDTH, (len(recs) - 1,), None, "inputs", True])
    return _assemble(recs, n_blocks, units_per_block, n_windows_per_block, rng, kappa, hidden)


def _assemble(recs, n_blocks, upb, n_win, rng, kappa, hidden) -> RematProblem:
    n = len(recs)
    consumers: list[list[int]] = [[] for _ in range(n)]
    for i, r in enumerate(recs):
        for b in r[3]:
            consumers[b].append(i)
    reads: list[list[int]] = [[] for _ in range(n)]   # bw events reading each unit directly
    for i, r in enumerate(recs):
        ev = n - 1 - i                                  # the backward runs the forward reversed
        for b in (r[3] if r[5] == "inputs" else (i,) if r[5] == "self" else ()):
            reads[b].append(ev)
    ns, ne, wanted = [0] * n, [0] * n, [False] * n
    for i in reversed(range(n)):                        # consumers first: they come later
        # a consumer that may be recomputed needs this unit at its own need_start
        evs = reads[i] + [ns[c] for c in consumers[i] if wanted[c] and not recs[c][6]]
        if evs:
            wanted[i], ns[i], ne[i] = True, min(evs), max(evs)
    units = tuple(Unit(id=i, name=r[0], nbytes=int(r[1]), compute_s=float(r[2]), inputs=r[3],
                       block=r[4], fw_pos=i, fw_last=max([i] + consumers[i]),
                       first_use=min(reads[i]) if reads[i] else None,
                       need_start=ns[i], need_end=ne[i], must_keep=r[6])
                  for i, r in enumerate(recs))
    param = 12 * hidden * hidden * 2 // 8               # one block's bf16 params, 8-way sharded
    fw_base = tuple(int(n_blocks * param + x) for x in rng.integers(0, 2**20, n))
    grad_t = 2 * units[1].nbytes if n > 1 else 0        # gradient temporaries of the backward
    bw_base = []
    for ev in range(n):
        i = n - 1 - ev
        done = sum(1 for j in range(n_blocks) if i <= 1 + j * upb)   # blocks whose grads exist
        bw_base.append(int(n_blocks * param + done * param + grad_t + rng.integers(0, 2**20)))
    windows: list[CommWindow] = []
    block_s = sum(units[1 + k].compute_s for k in range(upb))
    offs = sorted(rng.choice(max(upb - 3, 1), size=min(n_win, max(upb - 3, 1)), replace=False))
    lens = rng.integers(2, 4, len(offs))
    durs = rng.uniform(0.02, 0.08, len(offs)) * block_s
    if n_win and n > 4:                                 # the LM head's grads are reduced first
        windows.append(CommWindow(id=0, start=1, end=3, duration_s=float(durs.mean()), kind="reduce_scatter"))
    for j in reversed(range(n_blocks)):                 # backward order: last block first
        bw_first = n - 1 - (1 + j * upb + upb - 1)       # bw event of the block's last unit
        for o, ln, d in zip(offs, lens, durs):
            start = bw_first + int(o)
            windows.append(CommWindow(id=len(windows), start=start, end=min(start + int(ln), n - 1),
                                  duration_s=float(d), kind="reduce_scatter"))
    problem = RematProblem(units=units, num_fw_events=n, num_bw_events=n, fw_base=fw_base,
                           bw_base=tuple(bw_base), windows=tuple(windows),
                           block_groups=(tuple(range(n_blocks)),) if n_blocks else (),
                           kappa=kappa, graph_hash=f"synthetic-{n_blocks}x{upb}x{n_win}")
    keep = tuple(u.id for u in units if u.first_use is not None or u.must_keep)
    ref = evaluate(problem, RematSolution(keep=keep, demand=())).peak_bytes
    return dataclasses.replace(problem, reference_peak=ref)


def compare_solvers(configs=((4, 20, 1), (4, 40, 2)), *, budget_frac: float = 0.6, seed: int = 0,
                    time_limit_s: float = 60.0, solvers=("highs", "glpk", "heu"),
                    out: Callable[[str], None] | None = print) -> list[dict]:
    """Solve ``synthetic_problem(*config, seed)`` at ``budget_frac`` of its reference peak with
    each solver; one row (and, with ``out``, one printed line) per (problem, solver) with the
    MILP's size, status, exposed ms and wall seconds. A benchmark helper: it asserts nothing."""
    from .heuristic import solve_heu
    from .milp import build_model, solve_milp

    rows = []
    for nb, upb, nw in configs:
        p = synthetic_problem(nb, upb, nw, seed)
        budget = int(budget_frac * p.reference_peak)
        info = build_model(p, budget).info
        for name in solvers:
            t = time.perf_counter()
            sol = (solve_heu(p, budget) if name == "heu" else
                   solve_milp(p, budget, solver=name, time_limit_s=time_limit_s))
            row = {"problem": f"{nb}x{upb}x{nw}", "binaries": int(info.split()[0]), "solver": name,
                   "status": sol.status, "exposed_ms": sol.exposed_s * 1e3, "seconds": time.perf_counter() - t}
            rows.append(row)
            if out:
                out(f"{row['problem']:>9} {row['binaries']:5d} binaries  {name:5s} {sol.status:9s} "
                    f"exposed {row['exposed_ms']:8.4f} ms  {row['seconds']:7.2f} s")
    return rows
