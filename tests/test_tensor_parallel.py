"""Tensor parallelism on gloo CPU ranks: the sharded model computes the single-process model.

Every rank builds the full model with the same seed, runs it as the reference, then builds it
again, shards it and checks loss and reassembled gradients against the reference. Each test is
one run of all ranks (``_dist.run_ranks``), grouping several checks.
"""
from __future__ import annotations

import collections
import time

import pytest
import torch
import torch.distributed as dist
from torch._dynamo.backends.common import aot_autograd
from torch._functorch.aot_autograd import make_boxed_func
from torch._functorch.partitioners import default_partition

import lynx_compile
from _dist import run_ranks
from lynx_compile.distributed.tensor_parallel import (
    TPShard,
    full_gradients,
    shard_tensor,
    sync_sequence_parallel_grads,
    tensor_parallelize,
    unshard_tensors,
)
from lynx_compile.models import GPTConfig, LlamaConfig, build_model

# Tiny models that shard 2 and 4 ways: Llama keeps grouped-query attention (2 query heads per
# kv head) at tp=4, and its ffn width is not a multiple of 256 on purpose.
CONFIGS = {
    "gpt": GPTConfig(vocab_size=64, seq_len=16, n_layers=2, hidden=32, n_heads=4, dropout=0.0),
    "llama": LlamaConfig(
        vocab_size=64, seq_len=16, n_layers=2, hidden=32, n_heads=8, n_kv_heads=4, ffn_hidden=48
    ),
}
BATCH, SEQ = 2, 8
RTOL, ATOL = 1e-5, 1e-6
N_LAYERS = 2

ALL_REDUCE = "_c10d_functional.all_reduce.default"
ALL_GATHER = "_c10d_functional.all_gather_into_tensor.default"
REDUCE_SCATTER = "_c10d_functional.reduce_scatter_tensor.default"
WAIT = "_c10d_functional.wait_tensor.default"


def _batch(seq: int = SEQ) -> torch.Tensor:
    return torch.randint(0, 64, (BATCH, seq), generator=torch.Generator().manual_seed(1))


def _reference(name: str, idx: torch.Tensor):
    torch.manual_seed(0)
    model = build_model(CONFIGS[name])
    loss = model(idx).loss
    loss.backward()
    return loss.detach(), {n: p.grad for n, p in model.named_parameters()}


def _tp_step(name, idx, group, *, sequence_parallel, backend=None):
    """Loss and full-layout gradients of the sharded model (compiled with ``backend`` if given)."""
    torch.manual_seed(0)
    model = build_model(CONFIGS[name])
    tensor_parallelize(model, group, sequence_parallel=sequence_parallel)
    run = model if backend is None else torch.compile(model, backend=backend, fullgraph=False)
    loss = run(idx).loss
    loss.backward()
    sync_sequence_parallel_grads(model, group)
    return model, loss.detach(), full_gradients(model, group)


def _assert_matches(loss, grads, ref_loss, ref_grads) -> None:
    torch.testing.assert_close(loss, ref_loss, rtol=RTOL, atol=ATOL)
    assert grads.keys() == ref_grads.keys()
    for name, ref in ref_grads.items():
        torch.testing.assert_close(
            grads[name], ref, rtol=RTOL, atol=ATOL,
            msg=lambda m, name=name: f"grad of {name}: {m}",
        )


def _recording_backend(seen: dict[str, collections.Counter]):
    """aot_eager that also counts the functional collectives in the joint, forward and backward
    graphs (summed over graphs)."""

    def count(tag, gm):
        targets = (str(n.target) for n in gm.graph.nodes)
        seen[tag].update(t for t in targets if t.startswith("_c10d_functional."))

    def compiler(tag):
        def compile_graph(gm, example_inputs):
            count(tag, gm)
            return make_boxed_func(gm.forward)

        return compile_graph

    def partition(joint, joint_inputs, **kwargs):
        count("joint", joint)
        return default_partition(joint, joint_inputs, **kwargs)

    return aot_autograd(
        fw_compiler=compiler("fw"), bw_compiler=compiler("bw"), partition_fn=partition
    )


# ---------------------------------------------------------------------------------------------
# Rank functions (module level: pickled by name into the spawned ranks)
# ---------------------------------------------------------------------------------------------

def _eager_ranks(rank: int, world_size: int) -> dict:
    """GPT and Llama, with and without sequence parallelism, plus the shape errors."""
    group, idx = dist.group.WORLD, _batch()
    losses = {}
    for name in CONFIGS:
        ref_loss, ref_grads = _reference(name, idx)
        for sp in (False, True):
            model, loss, grads = _tp_step(name, idx, group, sequence_parallel=sp)
            _assert_matches(loss, grads, ref_loss, ref_grads)
            losses[name, sp] = loss.item()
        hidden = CONFIGS[name].hidden
        local = {"gpt": (3 * hidden // world_size, hidden), "llama": (hidden // world_size, hidden)}
        proj = model.blocks[0].attn.c_attn if name == "gpt" else model.blocks[0].attn.wq
        assert tuple(proj.weight.shape) == local[name]
    errors = []
    bad = [("gpt", {"n_heads": 2}), ("llama", {"n_heads": 2, "n_kv_heads": 2})]
    if world_size == 4:  # the tiny configs divide by 2; these do not divide by 4
        for name, overrides in bad:
            with pytest.raises(ValueError, match=r"n_heads=2 is not divisible") as info:
                tensor_parallelize(build_model(CONFIGS[name], **overrides), group)
            errors.append(str(info.value))
    model = tensor_parallelize(build_model(CONFIGS["gpt"]), group, sequence_parallel=True)
    with pytest.raises(ValueError, match=r"T=7 to be divisible"):
        model(_batch(seq=7))
    return {"losses": losses, "errors": errors}


def _compiled_ranks(rank: int, world_size: int) -> dict:
    """GPT with and Llama without sequence parallelism under torch.compile: same numbers as the
    reference, collectives in the graphs; and lynx's block detection on the sharded graph."""
    group, idx = dist.group.WORLD, _batch()
    counts = {}
    for name, sp in (("gpt", True), ("llama", False)):
        seen = collections.defaultdict(collections.Counter)
        backend = _recording_backend(seen)
        _, loss, grads = _tp_step(name, idx, group, sequence_parallel=sp, backend=backend)
        _assert_matches(loss, grads, *_reference(name, idx))
        counts[name, sp] = {tag: dict(c) for tag, c in seen.items()}
    backend = lynx_compile.backend(policy="full", disable_passes=("annotate_costs_pass",), compiler="eager")
    _, loss, grads = _tp_step("llama", idx, group, sequence_parallel=True, backend=backend)
    _assert_matches(loss, grads, *_reference("llama", idx))
    record = backend.records[-1]
    return {"counts": counts, "blocks": record.blocks, "block_hashes": record.block_hashes}


def _dtensor_ranks(rank: int, world_size: int) -> dict:
    """Llama through parallelize_module, eager and compiled, against the reference."""
    from torch.distributed.device_mesh import init_device_mesh

    from lynx_compile.distributed.dtensor_tp import dtensor_parallelize

    idx = _batch()
    ref = _reference("llama", idx)
    mesh = init_device_mesh("cpu", (world_size,))
    seen = collections.defaultdict(collections.Counter)
    for backend in (None, _recording_backend(seen)):
        torch.manual_seed(0)
        model = dtensor_parallelize(build_model(CONFIGS["llama"]), mesh)
        run = model if backend is None else torch.compile(model, backend=backend)
        loss = run(idx).loss
        loss.backward()
        _assert_matches(loss.detach(), full_gradients(model, dist.group.WORLD), *ref)
    return {tag: dict(c) for tag, c in seen.items()}


def _raise_on_rank_1(rank: int, world_size: int) -> int:
    if rank == 1:
        raise ValueError("boom from rank 1")
    return rank


def _hang_on_rank_1(rank: int, world_size: int) -> int:
    if rank == 1:
        time.sleep(600)
    return rank


# ---------------------------------------------------------------------------------------------
# Tests
# ---------------------------------------------------------------------------------------------

def test_shard_and_unshard_are_inverse():
    full = torch.arange(3 * 8 * 2).reshape(3 * 8, 2)
    spec = TPShard(dim=0, fused=3)
    pieces = [shard_tensor(full, spec, r, 4) for r in range(4)]
    # rank 1 holds rows 2:4 of each of the three stacked 8-row matrices
    assert pieces[1][:, 0].tolist() == [4, 6, 20, 22, 36, 38]
    torch.testing.assert_close(unshard_tensors(pieces, spec), full)
    with pytest.raises(ValueError, match="not divisible"):
        shard_tensor(full, TPShard(dim=1), 0, 4)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("tp", [2, 4])
def test_eager_tensor_parallel_matches_single_process(tp):
    results = run_ranks(_eager_ranks, tp, timeout_s=100)
    assert all(r["losses"] == results[0]["losses"] for r in results)
    assert len(results[0]["losses"]) == 4
    if tp == 4:
        assert len(results[0]["errors"]) == 2


@pytest.mark.timeout(150)
def test_compiled_tensor_parallel_has_functional_collectives():
    results = run_ranks(_compiled_ranks, 2, timeout_s=130)
    counts, L = results[0]["counts"], N_LAYERS
    # Without SP: g (all-reduce) after each row-parallel layer forward, f's all-reduce backward.
    plain = counts["llama", False]
    assert plain["fw"] == {ALL_REDUCE: 2 * L, WAIT: 2 * L}
    assert plain["bw"] == {ALL_REDUCE: 2 * L, WAIT: 2 * L}
    # With SP: an all-gather before each sublayer and after the final norm, a reduce-scatter
    # after each; backward mirrors it (the final gather's backward is a local split and the
    # scatter after the embeddings becomes an all-gather).
    sp = counts["gpt", True]
    assert sp["fw"] == {ALL_GATHER: 2 * L + 1, REDUCE_SCATTER: 2 * L, WAIT: 4 * L + 1}
    assert sp["bw"] == {ALL_GATHER: 2 * L + 1, REDUCE_SCATTER: 2 * L, WAIT: 4 * L + 1}
    assert sp["joint"][ALL_GATHER] == 2 * (2 * L + 1)
    # Sharding keeps the blocks identical, so block detection still sees repeats.
    assert results[0]["blocks"] == [f"blocks.{i}" for i in range(L)]
    assert len(set(results[0]["block_hashes"])) == 1


@pytest.mark.timeout(120)
def test_dtensor_llama_matches_single_process():
    counts = run_ranks(_dtensor_ranks, 2, timeout_s=100)[0]
    # One all-reduce per RowwiseParallel output forward; backward all-reduces the input gradient
    # of every ColwiseParallel layer separately (wq, wk, wv, w1, w3), more than the hand path.
    assert counts["fw"][ALL_REDUCE] == 2 * N_LAYERS
    assert counts["bw"][ALL_REDUCE] >= 2 * N_LAYERS


@pytest.mark.timeout(60)
def test_run_ranks_reports_the_failing_rank():
    with pytest.raises(AssertionError, match=r"(?s)rank 1 failed.*boom from rank 1"):
        run_ranks(_raise_on_rank_1, 2, timeout_s=50)


@pytest.mark.timeout(60)
def test_run_ranks_kills_a_hung_rank():
    start = time.monotonic()
    # The deadline covers process start-up too, so on a slow machine rank 0 may be late as well.
    with pytest.raises(AssertionError, match=r"ranks \[(0, )?1\] did not finish in time"):
        run_ranks(_hang_on_rank_1, 2, timeout_s=6)
    assert time.monotonic() - start < 20
