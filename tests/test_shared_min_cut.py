"""``_compat.shared_min_cut_solves``: torch's min-cut partitions of one joint share their solves
(issue P item 3) and give the partitions torch gives without sharing.

Reference: torch's own ``min_cut_rematerialization_partition`` on a fresh copy of the joint for
each setting, no memo. The shared run partitions the same joint at every setting in one context,
as lynx's planning does (reference at 1.0, then its candidates), and must produce the same
forward and backward graphs, with fewer solves."""
import copy

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


def _code(joint, inputs, kw, setting):
    fw, bw = _compat.min_cut_partition(copy.deepcopy(joint), inputs, memory_budget=setting, **kw)
    return fw.code, bw.code


def test_shared_solves_give_torchs_partitions_with_fewer_solves(monkeypatch):
    joint, inputs, kw = _joint()
    fresh = {s: _code(joint, inputs, kw, s) for s in SETTINGS}
    solves = []
    original = partitioners.solve_min_cut

    def counted(*args, **kwargs):
        solves.append(1)
        return original(*args, **kwargs)

    monkeypatch.setattr(partitioners, "solve_min_cut", counted)
    for s in SETTINGS:
        _code(joint, inputs, kw, s)
    unshared = len(solves)
    solves.clear()
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
    fresh = _code(tagged, inputs, kw, 1.0)
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
    fresh = {s: _code(joint, inputs, kw, s) for s in settings}
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
