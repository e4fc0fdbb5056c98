"""Lynx-HEU: one representative block per group of identical blocks, solved as a small MILP
under the whole timeline's memory (the other blocks replicate its decisions, so their kept
bytes are in every row), replicated by position, then repaired on the exact model.

Same signature as ``milp.solve_milp``. Steps (each a function below; all on the (state, win)
arrays of ``evaluate.ProblemArrays``):

1. ``initial_state``: everything kept (intermediates nothing reads: none).
2. ``representative.solve_positions``: one MILP over the positions of every group (the k-th
   unit of each block) plus the units outside groups, via highspy, root node only at a 1 % gap
   (that is what keeps a 48-block problem near 0.1 s). Without highspy or ``block_groups``, HEU
   starts from step 1 and the greedy steps below do all the work. Steps 2-7 run once with
   every block of a group alike and once per ``CHUNKS`` entry with the group cut into that many
   runs of blocks (its k-th units one position per run); the plan exposing least wins. Alike,
   a deep stack keeps a tensor in all blocks or none; in runs, in some (the gpt-1.3b preset
   at budget 0.4 / 0.5 / 0.7: 1.45 / 1.96 / 1.01 x the exact MILP's exposed time alike,
   1.001 / 1.000 / 1.000 with the best of 8 and 16 runs; 48 layers: 1.002 / 1.004 / 1.000).
3. ``fix_inputs`` / ``cleanup``: make recomputes' inputs available, drop unread intermediates.
3b. ``fit_regions``: while a region with its own budget keeps more than it may, switch its kept
   unit freeing the most bytes per second of recompute to demand (or offload); later steps
   never keep more in a region than its budget.
4. ``repair``: while the peak exceeds the budget, switch the candidate with the best
   (bytes freed at the peak event) / (added exposed seconds) from keep (or window) to demand,
   with the input closure, or to offload (where offloadable; block-boundary tensors too); ties by unit id. Stuck: restart from everything on demand; still
   over: ``InfeasibleBudget`` naming the lowest peak HEU reached (HEU's bound, not the exact
   minimum, which ``milp.smallest_peak`` computes).
5. ``hide``: move demanded recomputes into windows with spare capacity where memory allows.
5b. ``prefer_offload``: demanded units that may be offloaded for less exposed time than their
   recompute are offloaded where memory allows (largest saving first).
6. ``refill``: with slack left, switch demanded units back to keep, most seconds saved per byte
   first, while the peak stays within the budget.
7. ``polish``: in groups of at most 8 blocks, re-solve the boundary blocks of the backward
   (first, last, second, second-to-last) one at a time with everything else fixed, one small
   MILP each: their memory context and windows differ most from the interior, so replication
   fits them worst. Deep stacks skip it (the interior dominates).
Deterministic: no randomness, ties broken by unit id, MILPs capped by node counts.
"""
from __future__ import annotations

import time
from typing import Callable

import numpy as np

from .evaluate import DEMAND, KEEP, NONE, OFFLOAD, WINDOW, ProblemArrays, evaluate_state, problem_arrays
from .milp_solvers import highs_installed
from .problem import InfeasibleBudget, RematProblem, RematSolution, check_region_caps
from .representative import solve_positions

TOP_K = 6              # candidates whose switch is scored exactly (closure included) per repair step
POLISH_MAX_BLOCKS = 8  # groups up to this many blocks get their boundary blocks re-solved
CHUNKS = (1, 8, 16)    # representative MILPs tried: a group's blocks all alike, or in 8 / 16 runs


def initial_state(arr: ProblemArrays) -> tuple[np.ndarray, np.ndarray]:
    used = arr.needed | arr.must
    used[arr.edge_b] = True
    return np.where(used, KEEP, NONE).astype(np.int8), np.full(arr.n, -1, dtype=np.int64)


def fix_inputs(arr: ProblemArrays, state: np.ndarray, win: np.ndarray) -> None:
    """In place: an input a demanded unit needs becomes demand when it was none; a window
    recompute whose input is not kept or in a window no later becomes demand. To a fixpoint."""
    a, b = arr.edge_a, arr.edge_b
    state[arr.must & (state != OFFLOAD)] = KEEP
    state[arr.needed & (state == NONE)] = DEMAND
    while True:
        need_b = (state[a] == DEMAND) & (state[b] == NONE)
        bad_a = (state[a] == WINDOW) & ~((state[b] == KEEP) | ((state[b] == WINDOW) & (win[b] <= win[a])))
        if not need_b.any() and not bad_a.any():
            return
        state[b[need_b]] = np.where(arr.hold[b[need_b]], KEEP, DEMAND)
        state[a[bad_a]], win[a[bad_a]] = DEMAND, -1


def cleanup(arr: ProblemArrays, state: np.ndarray, win: np.ndarray) -> None:
    """In place: intermediates that no recomputed consumer reads become none."""
    while True:
        used = np.zeros(arr.n, dtype=bool)
        rec = (state[arr.edge_a] == DEMAND) | (state[arr.edge_a] == WINDOW)
        used[arr.edge_b[rec]] = True
        drop = ~arr.needed & ~arr.must & (state != NONE) & ~used
        if not drop.any():
            return
        state[drop], win[drop] = NONE, -1


def _peak(arr, state, win):
    fw, bw = arr.profile(state, win)
    fpk, bpk = (int(fw.max()) if fw.size else -1), (int(bw.max()) if bw.size else -1)
    return fw, bw, max(fpk, bpk), ("fw", int(fw.argmax())) if fpk >= bpk else ("bw", int(bw.argmax()))


def _switch(arr, state, win, i, to=DEMAND):
    st, wn = state.copy(), win.copy()
    st[i], wn[i] = to, -1
    fix_inputs(arr, st, wn)
    cleanup(arr, st, wn)
    return st, wn


def repair(arr: ProblemArrays, budget: int, state: np.ndarray, win: np.ndarray):
    """Greedy keep/window -> demand until the peak fits; (state, win, peak) (peak > budget: stuck)."""
    exposed = arr.times(state, win)[0]
    while True:
        fw, bw, peak, (where, t) = _peak(arr, state, win)
        if peak <= budget:
            return state, win, peak
        m = arr.m.astype(np.float64)
        if where == "fw":
            freed = m * ((state == KEEP) & (arr.fw_last < t))
        else:
            ws = arr.win_start[np.maximum(win, 0)] if arr.W else np.zeros(arr.n, dtype=np.int64)
            freed = m * ((state == KEEP) & (t < arr.ns))
            freed += m * ((state == WINDOW) & (ws <= t) & (t < arr.ns))
        freed[(arr.must | arr.hold) & ~arr.can_off] = 0
        cand = np.flatnonzero(freed > 0)
        if cand.size == 0:
            return state, win, peak
        cheapest = np.where(arr.can_off[cand], np.minimum(arr.c[cand], arr.off_exposed[cand]), arr.c[cand])
        cheapest = np.where(arr.must[cand], arr.off_exposed[cand], cheapest)
        ratio = freed[cand] / np.maximum(cheapest, 1e-15)
        order = cand[np.lexsort((arr.ids[cand], -ratio))][:TOP_K]
        best = None
        for i in order:
            kinds = ([] if arr.must[i] or arr.hold[i] else [DEMAND]) + ([OFFLOAD] if arr.can_off[i] else [])
            for to in kinds:
                st, wn = _switch(arr, state, win, i, to)
                f2, b2 = arr.profile(st, wn)
                gain = peak - int((f2 if where == "fw" else b2)[t])
                cost = max(arr.times(st, wn)[0] - exposed, 1e-15)
                key = (-gain / cost, int(arr.ids[i]), to)
                if gain > 0 and (best is None or key < best[0]):
                    best = (key, st, wn)
        if best is None:
            return state, win, peak
        state, win = best[1], best[2]
        exposed = arr.times(state, win)[0]


def fit_regions(arr: ProblemArrays, state: np.ndarray, win: np.ndarray):
    """Greedy keep -> demand (or offload) inside each region over its own budget, most bytes per
    second of added recompute first (ties by unit id); (state, win). A region left over its
    budget (only must-keep units remain kept) is left as is: ``check_region_caps`` refuses it."""
    for r, units in enumerate(arr.region_units):
        while arr.kept_in_region(state, r) > arr.region_max[r]:
            cand = units[(state[units] == KEEP) & ((~arr.must[units] & ~arr.hold[units]) | arr.can_off[units])]
            if cand.size == 0:
                break
            cost = np.where(arr.must[cand], arr.off_exposed[cand], arr.c[cand])
            ratio = arr.m[cand] / np.maximum(cost, 1e-15)
            i = int(cand[np.lexsort((arr.ids[cand], -ratio))[0]])
            state, win = _switch(arr, state, win, i, OFFLOAD if arr.must[i] else DEMAND)
    return state, win


def _region_room(arr: ProblemArrays, state: np.ndarray, i: int) -> bool:
    """Whether keeping unit ``i`` too keeps its region (if any) within its own budget."""
    r = int(arr.region_of[i])
    return r < 0 or arr.kept_in_region(state, r) + int(arr.m[i]) <= arr.region_max[r]


def hide(arr: ProblemArrays, budget: int, state: np.ndarray, win: np.ndarray, tries: int = 4) -> None:
    """In place, into one of each unit's ``tries`` latest eligible windows whose inputs are kept
    or in windows no later: first demanded units (largest c first) where memory allows and the
    window's spare capacity beats (kappa - 1)·c (then the exposed time drops even if part
    overflows), then kept units (largest bytes first) where kappa·c fits whole (a window
    recompute is live over a sub-interval of a keep, so memory only drops)."""
    if not arr.W:
        return
    _, bw = arr.profile(state, win)
    left = arr.win_tau - arr.window_load(state, win)
    for kind in (DEMAND, KEEP):
        units = np.flatnonzero((state == kind) & ~arr.must & ~arr.hold)
        key = -arr.c[units] if kind == DEMAND else -arr.m[units].astype(np.float64)
        for i in units[np.lexsort((arr.ids[units], key))]:
            load, ins = arr.kappa * arr.c[i], arr.inputs[i]
            if any(state[c] == WINDOW for c in arr.consumers[i]):
                continue                           # they rely on its current state
            for w in arr.eligible[i][:tries]:
                # demand was live from need_start on (a one-event unit: in its chain's rows,
                # maybe not the largest one): the window adds it from the window's start
                s, e = int(arr.win_start[w]), int(arr.ns[i]) + int(arr.transient[i])
                # a demanded unit gains from any capacity left beyond (kappa - 1) * c (what
                # overflows is exposed, kappa times slower than on demand); a kept unit moves
                # only where it fits whole (else it adds time)
                overflow = load - max(float(left[w]), 0.0)
                full = load > left[w] if kind == KEEP else overflow >= arr.c[i]
                if full or (kind == DEMAND and e > s and bw[s:e].max() + arr.m[i] > budget):
                    continue
                if all(state[b] == KEEP or (state[b] == WINDOW and win[b] <= w) for b in ins):
                    if kind == DEMAND:
                        bw[s:e] += arr.m[i]
                    state[i], win[i] = WINDOW, w
                    left[w] -= load
                    break


def prefer_offload(arr: ProblemArrays, budget: int, state: np.ndarray, win: np.ndarray) -> None:
    """In place: demanded units whose offload exposes less time than their recompute become
    offloaded, largest saving first, where the exact peak stays within the budget (the inputs
    no recompute reads any more are dropped)."""
    dem = np.flatnonzero((state == DEMAND) & arr.can_off & (arr.off_exposed < arr.c))
    for i in dem[np.lexsort((arr.ids[dem], -(arr.c[dem] - arr.off_exposed[dem])))]:
        if state[i] != DEMAND or any(state[c] == WINDOW for c in arr.consumers[i]):
            continue                               # a window consumer needs it kept or in a window
        st, wn = state.copy(), win.copy()
        st[i] = OFFLOAD
        cleanup(arr, st, wn)
        f2, b2 = arr.profile(st, wn)
        if max(f2.max(initial=0), b2.max(initial=0)) <= budget:
            state[:], win[:] = st, wn


def refill(arr: ProblemArrays, budget: int, state: np.ndarray, win: np.ndarray) -> None:
    """In place: demanded units back to keep (most seconds per byte first) while the peak stays
    within the budget. A switch that only fits once the inputs it no longer needs are dropped
    is checked on the exact profile."""
    fw, bw = arr.profile(state, win)
    dem = np.flatnonzero((state == DEMAND) & (arr.c > arr.k))  # keeping a cheaper recompute costs time
    dens = (arr.c[dem] - arr.k[dem]) / np.maximum(arr.m[dem], 1)
    for i in dem[np.lexsort((arr.ids[dem], -dens))]:
        if state[i] != DEMAND or any(state[c] == WINDOW for c in arr.consumers[i]):
            continue                               # keeping is fine for them too, but stay simple
        if not _region_room(arr, state, i):
            continue                               # its region's own budget is spent
        m, e, f = int(arr.m[i]), int(arr.ns[i]) + int(arr.transient[i]), int(arr.fw_last[i]) + 1
        if not ((e and bw[:e].max() + m > budget) or (f < arr.F and fw[f:].max() + m > budget)):
            state[i] = KEEP
            bw[:e] += m
            fw[f:] += m
            continue
        if not any(state[b] == DEMAND and not arr.needed[b] for b in arr.inputs[i]):
            continue                               # nothing to free: it does not fit
        st, wn = state.copy(), win.copy()
        st[i] = KEEP
        cleanup(arr, st, wn)
        f2, b2 = arr.profile(st, wn)
        if max(f2.max(initial=0), b2.max(initial=0)) <= budget and arr.regions_fit(st):
            state[:], win[:], fw, bw = st, wn, f2, b2


def take_wins(arr: ProblemArrays, budget: int, state: np.ndarray, win: np.ndarray) -> None:
    """In place: kept units whose recompute costs less than the forward write it saves
    (``Unit.write_s``) recomputed on demand, the largest net saving first, where the step's
    exposed time drops and the peak stays within the budget."""
    cand = np.flatnonzero((state == KEEP) & (arr.k > arr.c) & ~arr.must & ~arr.hold)
    if cand.size == 0:
        return
    exposed = arr.times(state, win)[0]
    for i in cand[np.lexsort((arr.ids[cand], -(arr.k[cand] - arr.c[cand])))]:
        if state[i] != KEEP:
            continue
        st, wn = _switch(arr, state, win, i)
        e2 = arr.times(st, wn)[0]
        if e2 < exposed - 1e-15 and _peak(arr, st, wn)[2] <= budget and arr.regions_fit(st):
            state[:], win[:], exposed = st, wn, e2


def all_demand(arr: ProblemArrays) -> tuple[np.ndarray, np.ndarray]:
    """Everything recomputable on demand (inputs closed, unread intermediates none)."""
    state, win = initial_state(arr)
    state[(state == KEEP) & ~arr.must & ~arr.hold] = DEMAND
    fix_inputs(arr, state, win)
    cleanup(arr, state, win)
    return state, win


def heuristic_bound(problem: RematProblem) -> int:
    """The peak of recomputing everything recomputable on demand: one HEU can always reach, so
    the "smallest peak" HEU names (with its stuck repair's, if lower) and the one
    ``milp.smallest_peak`` falls back to without a MILP solver. Not the minimum (intermediates
    recomputed for their consumers can cost more than keeping the consumer; ``smallest_peak`` is
    exact); cached per problem."""
    arr = problem_arrays(problem)
    if "heuristic_bound" not in arr.cache:
        arr.cache["heuristic_bound"] = _peak(arr, *all_demand(arr))[2]
    return arr.cache["heuristic_bound"]


def block_positions(problem: RematProblem, arr: ProblemArrays) -> tuple[list[np.ndarray], list[str]]:
    """One (blocks x units-per-block) index array per usable group, and notes on unusable ones."""
    members: dict[int, list[int]] = {}
    for i, b in enumerate(arr.block.tolist()):
        if b >= 0:
            members.setdefault(b, []).append(i)
    out, notes = [], []
    for group in problem.block_groups:
        lists = [members.get(b, []) for b in group]
        if len({len(x) for x in lists}) != 1 or not lists[0]:
            notes.append(f"block group {group} skipped: blocks have different unit counts")
            continue
        out.append(np.array(lists, dtype=np.int64))
    return out, notes


def _rep_positions(arr: ProblemArrays, groups: list[np.ndarray], chunks: int = 1) -> list[np.ndarray]:
    """Positions of the representative MILP: each group's k-th units, then every other unit.
    ``chunks`` > 1: a group's blocks (in forward order) are cut into that many runs, each run's
    k-th units one position (a deep stack may then keep a tensor in some blocks and recompute
    it in others, as the exact optimum does when keeping it everywhere does not fit)."""
    out = []
    for P in groups:
        order = np.argsort(arr.fw_pos[P].mean(axis=1), kind="stable")
        for run in np.array_split(order, min(chunks, len(P))):
            out += [P[run, k] for k in range(P.shape[1])]
    inside = np.zeros(arr.n, dtype=bool)
    for P in groups:
        inside[P.ravel()] = True
    return out + [np.array([i]) for i in np.flatnonzero(~inside)]


def polish(arr: ProblemArrays, budget: int, state, win, blocks: list[np.ndarray]):
    """Re-solve each block's units exactly (singleton positions), the rest fixed; keep the
    result when it is feasible and strictly better on the exact model."""
    best = arr.times(state, win)[0]
    for units in blocks:
        out = solve_positions(arr, [np.array([i]) for i in units], budget, state, win)
        if out is None:
            continue
        st, wn, _ = out
        fix_inputs(arr, st, wn)
        cleanup(arr, st, wn)
        exp = arr.times(st, wn)[0]
        if exp < best - 1e-15 and _peak(arr, st, wn)[2] <= budget and arr.regions_fit(st):
            state, win, best = st, wn, exp
    return state, win


def boundary_blocks(arr: ProblemArrays, groups: list[np.ndarray]) -> list[np.ndarray]:
    """Blocks to polish: in each group of at most ``POLISH_MAX_BLOCKS`` blocks, the first, last,
    second and second-to-last block of the backward (at most 4). In a deep stack one block is
    1/n of the plan and replication already fits the interior: no polish, no extra MILPs."""
    out = []
    for P in groups:
        if len(P) > POLISH_MAX_BLOCKS:
            continue
        order = np.argsort(-arr.fw_pos[P].mean(axis=1), kind="stable")   # backward: last block first
        picks = dict.fromkeys(int(order[k]) for k in (0, -1, 1, -2) if -len(order) <= k < len(order))
        out += [P[k] for k in picks]
    return out


def _solve_from(problem: RematProblem, arr: ProblemArrays, budget_bytes: int, positions: list[np.ndarray],
                chunks: int) -> tuple[np.ndarray, np.ndarray, list[str]]:
    """Steps 1-7 with the representative MILP over ``chunks`` runs of blocks per group."""
    state, win = initial_state(arr)
    notes: list[str] = []
    if positions and highs_installed():
        rep = solve_positions(arr, _rep_positions(arr, positions, chunks), budget_bytes, state, win)
        if rep is not None:
            state, win, more = rep
            notes += more
            notes.append(f"{len(positions)} representative block(s) solved exactly and replicated"
                         + (f" in up to {chunks} runs of blocks" if chunks > 1 else ""))
        else:
            notes.append("representative MILP gave no answer; greedy from all-kept")
    else:
        notes.append("no block groups" if not positions else "highspy missing: greedy from all-kept")
    fix_inputs(arr, state, win)
    cleanup(arr, state, win)
    state, win = fit_regions(arr, state, win)
    state, win, peak = repair(arr, budget_bytes, state, win)
    if peak > budget_bytes:
        st2, wn2 = all_demand(arr)
        st2, wn2, peak2 = repair(arr, budget_bytes, st2, wn2)
        if peak2 > budget_bytes:
            raise InfeasibleBudget(budget_bytes, min(peak, peak2, heuristic_bound(problem)),
                                   problem.reference_peak)
        state, win = st2, wn2
        notes.append("repair from all-kept got stuck; restarted from everything on demand")
    hide(arr, budget_bytes, state, win)
    cleanup(arr, state, win)
    if arr.can_off.any():
        prefer_offload(arr, budget_bytes, state, win)
    take_wins(arr, budget_bytes, state, win)
    for _ in range(5):                             # a refill can free inputs: refill again
        before = state.copy()
        refill(arr, budget_bytes, state, win)
        cleanup(arr, state, win)
        if np.array_equal(before, state):
            break
    if positions and highs_installed():
        state, win = polish(arr, budget_bytes, state, win, boundary_blocks(arr, positions))
    return state, win, notes


def solve_heu(problem: RematProblem, budget_bytes: int, *, progress: Callable[[str], None] | None = None,
              **_) -> RematSolution:
    """Lynx-HEU (see the module docstring); same signature as ``solve_milp`` (extra keywords
    are ignored). Raises ``InfeasibleBudget`` when even the heuristic's smallest reachable peak
    (the lower of its stuck repair and everything-on-demand; a heuristic bound, not the exact
    minimum) exceeds the budget."""
    t0 = time.perf_counter()
    check_region_caps(problem)
    arr = problem_arrays(problem)
    positions, notes = block_positions(problem, arr)
    depth = max((len(P) for P in positions), default=1) if highs_installed() else 1
    best, failure = None, None
    for chunks in sorted({min(c, depth) for c in CHUNKS}):
        try:
            state, win, more = _solve_from(problem, arr, budget_bytes, positions, chunks)
        except InfeasibleBudget as e:
            failure = failure or e.with_traceback(None)  # kept past the except: no frame cycle
            continue
        exposed, peak = arr.times(state, win)[0], _peak(arr, state, win)[2]
        if peak <= budget_bytes and arr.regions_fit(state) and (best is None or exposed < best[0] - 1e-15):
            best = (exposed, state, win, more)
    if best is None:
        raise failure or InfeasibleBudget(budget_bytes, heuristic_bound(problem), problem.reference_peak)
    _, state, win, more = best
    notes += more
    ev = evaluate_state(arr, state, win)
    keep, demand, window = arr.to_sets(state, win)
    solve_s = time.perf_counter() - t0
    if progress:
        progress(f"lynx-heu: {ev.exposed_s * 1e3:.3f} ms exposed, peak {ev.peak_bytes} B "
                 f"in {solve_s * 1e3:.1f} ms ({'; '.join(notes)})")
    return RematSolution(keep=keep, demand=demand, window=window, offload=arr.offloaded(state),
                         offload_exposed_s=float(arr.off_exposed[state == OFFLOAD].sum()),
                         exposed_s=ev.exposed_s,
                         recompute_s=ev.recompute_s, peak_bytes=ev.peak_bytes, solver="heu",
                         status="heuristic", solve_s=solve_s, notes=tuple(notes))
