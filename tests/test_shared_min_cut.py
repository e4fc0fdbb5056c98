"""``_compat.shared_min_cut_solves``: torch's min-cut partitions of one joint share their solves
(issue P item 3) and give the partitions torch gives without sharing; ``_compat.min_cut_partition``
remembers its choices of saved values in the process (issue T: one graph decided again is not
chosen again).

Reference: torch's own ``min_cut_rematerialization_partition`` on a fresh copy of the joint for
each setting, the memos emptied (``_compat.clear_min_cut_memos``). The shared run partitions the
same joint at every setting in one context, as lynx's planning does (reference at 1.0, then its
candidates), and must produce the same forward and backward graphs, with fewer solves."""
import copy
import functools

import pytest
import torch
from functorch.compile import aot_function, make_boxed_func
from torch._functorch import partitioners

from lynx_compile import _compat
from lynx_compile.recompute.seeds import TORCH_SETTINGS
from lynx_compile.models import build_model, example_batch

SETTINGS = (1.0, *TORCH_SETTINGS)


def _joint():
    """(the joint graph of gpt-tiny's training step, the partitioner's keyword arguments)."""
    captured = {}
    torch.manual_seed(0)
    model = build_model("gpt-tiny", dropout=0.0)
    x = example_batch(model, 2, generator=torch.Generator().manual_seed(1))
    params = dict(model.named_parameters())

    def fn(p, x):
        return torch.func.functional_call(model, p, (x,)).loss

    def partition(joint, inputs, **kw):
        captured["joint"], captured["inputs"], captured["kw"] = copy.deepcopy(joint), inputs, kw
        return partitioners.default_partition(joint, inputs, **kw)

    boxed = lambda gm, _inputs: make_boxed_func(gm)  # noqa: E731
    aot_function(fn, fw_compiler=boxed, bw_compiler=boxed, partition_fn=partition)(params, x).backward()
    kw = {k: v for k, v in captured["kw"].items() if k in ("num_fwd_outputs", "static_lifetime_input_indices")}
    return captured["joint"], captured["inputs"], kw


def _code(joint, inputs, kw, setting, *, fresh: bool = False):
    """The forward's and backward's code of ``joint`` partitioned at ``setting`` (a copy of it);
    ``fresh``: nothing remembered from earlier partitions (torch's own partition)."""
    if fresh:
        _compat.clear_min_cut_memos()
    fw, bw = _compat.min_cut_partition(copy.deepcopy(joint), inputs, memory_budget=setting, **kw)
    return fw.code, bw.code


def test_shared_solves_give_torchs_partitions_with_fewer_solves(monkeypatch):
    joint, inputs, kw = _joint()
    fresh = {s: _code(joint, inputs, kw, s, fresh=True) for s in SETTINGS}
    solves = []
    original = partitioners.solve_min_cut

    def counted(*args, **kwargs):
        solves.append(1)
        return original(*args, **kwargs)

    monkeypatch.setattr(partitioners, "solve_min_cut", counted)
    for s in SETTINGS:
        _code(joint, inputs, kw, s, fresh=True)
    unshared = len(solves)
    solves.clear()
    _compat.clear_min_cut_memos()
    with _compat.shared_min_cut_solves():
        with _compat.shared_min_cut_solves():  # nested: the outer memo serves
            shared = {s: _code(joint, inputs, kw, s) for s in SETTINGS}
    assert partitioners.solve_min_cut is counted  # restored on exit
    assert shared == fresh
    # every setting below 1 repeats the three budget-independent solves of the first
    assert 0 < len(solves) < unshared, (len(solves), unshared)
    assert len({c for c in fresh.values()}) > 1, "the settings should not all partition alike"


def test_a_tagged_joint_is_not_served_the_untagged_solve():
    """The recompute tags are part of what is solved: MUST_SAVE on every forward matmul changes
    the cut, and the shared run must see it."""
    joint, inputs, kw = _joint()
    tagged = copy.deepcopy(joint)
    mms = [n for n in tagged.graph.nodes if n.target == torch.ops.aten.mm.default][:4]
    assert mms
    for n in mms:
        n.meta["recompute"] = torch.utils.checkpoint.CheckpointPolicy.MUST_RECOMPUTE
        n.meta["ac_graph_id"] = 0
    fresh = _code(tagged, inputs, kw, 1.0, fresh=True)
    _compat.clear_min_cut_memos()
    with _compat.shared_min_cut_solves():
        untagged = _code(joint, inputs, kw, 1.0)
        shared = _code(tagged, inputs, kw, 1.0)
    assert shared == fresh
    assert shared != untagged, "the tags should change this partition"


def test_the_patch_is_undone_when_a_partition_raises():
    original = partitioners.solve_min_cut
    with pytest.raises(RuntimeError):
        with _compat.shared_min_cut_solves():
            raise RuntimeError("a partition failed")
    assert partitioners.solve_min_cut is original


def test_a_merged_joint_is_not_merged_again(monkeypatch):
    """``canonicalize_joint`` merges common subexpressions once; ``min_cut_partition`` then skips
    torch's own merge (a rebuild of the whole graph on every call) and partitions exactly as
    torch does with it. Reference: a fresh copy of the unmerged joint per setting (torch merges)."""
    joint, inputs, kw = _joint()
    settings = SETTINGS[:4]
    fresh = {s: _code(joint, inputs, kw, s, fresh=True) for s in settings}
    merged = _compat.canonicalize_joint(copy.deepcopy(joint))
    merges = []
    original = partitioners.fx_graph_cse

    def counted(graph):
        merges.append(1)
        return original(graph)

    monkeypatch.setattr(partitioners, "fx_graph_cse", counted)
    got = {}
    for s in settings:  # one joint partitioned at every setting, as lynx's planning does
        fw, bw = _compat.min_cut_partition(merged, inputs, memory_budget=s, **kw)
        got[s] = (fw.code, bw.code)
    assert merges == []
    assert got == fresh
    _code(joint, inputs, kw, 1.0)  # a copy is not marked: torch merges it
    assert merges == [1]


def test_the_same_graph_partitioned_again_is_not_chosen_again(monkeypatch):
    """A joint equal to one partitioned before (a copy: lynx decides one graph at step 1, in the
    step's plan and again when a piece is compiled at step 3) gets torch's partition at every
    setting without torch choosing its saved values again; the checks of
    ``min_cut_checks_choice`` still see each choice. A change of functorch's config, which
    torch's choice reads, is chosen afresh."""
    joint, inputs, kw = _joint()
    settings = SETTINGS[:5]
    first = {s: _code(joint, inputs, kw, s, fresh=True) for s in settings}
    _compat.clear_min_cut_memos()
    for s in settings:
        _code(joint, inputs, kw, s)
    chosen, seen = [], []
    original = partitioners.choose_saved_values_set

    @functools.wraps(original)  # its signature: what the memo binds the arguments by
    def counted(*args, **kwargs):
        chosen.append(1)
        return original(*args, **kwargs)

    monkeypatch.setattr(partitioners, "choose_saved_values_set", counted)
    with _compat.min_cut_checks_choice(seen.append):
        again = {s: _code(joint, inputs, kw, s) for s in settings}
    assert again == first
    assert chosen == [] and len(seen) == len(settings) and all(isinstance(c, frozenset) and c for c in seen)
    from torch._functorch import config as functorch_config

    with functorch_config.patch(ban_recompute_reductions=not functorch_config.ban_recompute_reductions):
        _code(joint, inputs, kw, 0.5)
    assert chosen == [1]
