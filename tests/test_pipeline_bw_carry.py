"""The B -> W carry of the zero-bubble schedules in the stage memory plan: how many carries a
stage holds beside its micro-batches in flight (torch's action order), how many bytes one carry
is (the traced backward, against ``WeightDeferral``'s real carry), and the plans that change."""
import dataclasses
import json

import pytest
import torch

from lynx_compile.pipelining.pipeline_costs import PipelineCosts, SegmentCost
from lynx_compile.pipelining.placement import zero_bubble_orders
from lynx_compile.pipelining.plan_stages import plan_stages
from lynx_compile.pipelining.schedule_sim import held_microbatches
from lynx_compile.pipelining.stage_plan import StagePlan, StagePlanError

MiB, ms = 2**20, 1e-3


def test_held_counts_zbv_p2_s4_m4_by_hand():
    # torch's order (tests/test_sim_zero_bubble.py draws it), (f, w) after each action of a stage:
    # rank 0: F00 F01 F02 F30 B30 W30 F31 B31 W31 F03 B00 W00 F32 B32 W32 B01 W01 F33 B33 W33 B02 W02 B03 W03
    # rank 1: F10 F20 F11 F21 B20 W20 F12 B10 W10 F22 B21 W21 F13 B11 W11 F23 B22 W22 B12 B23 B13 W12 W23 W13
    # stage 0: F00 (1,0) F01 (2,0) F02 (3,0) F03 (4,0) B00 (3,1) W00 (3,0) B01 (2,1) W01 (2,0)
    #          B02 (1,1) W02 (1,0) B03 (0,1) W03 (0,0)           undominated: (4,0) (3,1)
    # stage 1: F10 (1,0) F11 (2,0) F12 (3,0) B10 (2,1) W10 (2,0) F13 (3,0) B11 (2,1) W11 (2,0)
    #          B12 (1,1) B13 (0,2) W12 (0,1) W13 (0,0)           undominated: (3,0) (2,1) (0,2)
    # stage 2: F20 (1,0) F21 (2,0) B20 (1,1) W20 (1,0) F22 (2,0) B21 (1,1) W21 (1,0) F23 (2,0)
    #          B22 (1,1) W22 (1,0) B23 (0,1) W23 (0,0)           undominated: (2,0) (1,1)
    # stage 3: F3j (1,0) B3j (0,1) W3j (0,0), j = 0..3           undominated: (1,0) (0,1)
    held = held_microbatches(zero_bubble_orders("ZBVZeroBubble", 2, 4, 4))
    assert held == {0: ((4, 0), (3, 1)), 1: ((3, 0), (2, 1), (0, 2)), 2: ((2, 0), (1, 1)), 3: ((1, 0), (0, 1))}
    # most carries pending at once: stage 1 holds two (B12 B13 before W12), the others one
    assert [max(w for _, w in held[s]) for s in range(4)] == [1, 2, 1, 1]
    # the joint peak is not the sum of the maxima: with kept = carry = 1, stage 1 peaks at 3, not 3 + 2
    assert max(f + w for f, w in held[1]) == 3


def test_held_counts_agree_with_in_flight():
    # the f of the pairs is the planner's in-flight count (one source for both schedules)
    from lynx_compile.pipelining.placement import in_flight

    for schedule, ranks, stages, m in [("ZBVZeroBubble", 2, 4, 8), ("ZBVZeroBubble", 4, 8, 16),
                                       ("InterleavedZeroBubble", 2, 4, 4), ("InterleavedZeroBubble", 2, 6, 6)]:
        held = held_microbatches(zero_bubble_orders(schedule, ranks, stages, m))
        assert [max(f for f, _ in held[s]) for s in range(stages)] == \
            [in_flight(schedule, stages, m, s, ranks) for s in range(stages)]


def _gpt_tiny():
    from lynx_compile.models import build_model, example_batch

    torch.manual_seed(0)
    model = build_model("gpt-tiny", dropout=0.0)
    return model, example_batch(model, batch_size=2)


def _runtime_carry(stage, x):
    """One micro-batch through ``stage`` compiled by lynx (eager, nothing recomputed), its
    backward in B only: (bytes ``WeightDeferral`` holds for W, bytes the plan saves, bytes of
    the held carry that the forward saved: the rest B created).

    Measured as distinct storages' ``untyped_storage().nbytes()`` (``pending_bytes``): a carried
    view (``view``, ``t``) keeps its whole storage alive and two views of one storage hold it
    once, which numel x element_size would count wrong; parameters are not counted."""
    import lynx_compile
    from lynx_compile.runtime.prefetch import microbatch
    from lynx_compile.runtime.weight_split import defer_weights

    stage.zero_grad(set_to_none=True)  # the stages share the model's modules
    backend = lynx_compile.LynxBackend(lynx_compile.make_config({"compiler": "eager", "policy": "none"}))
    stage.compile(backend=backend)
    kept: list[torch.Tensor] = []  # what the compiled forward saves for the backward, held here so
    # that no storage B allocates can reuse one of their addresses

    def pack(t):
        kept.append(t)
        return t

    with microbatch(1), torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = stage(x)
    with microbatch(1), defer_weights(1):
        out.backward(torch.randn_like(out))
    held = sum(d.pending_bytes(1) for d in backend.runtimes.weight_deferrals if 1 in d.pending)
    params = {p.untyped_storage().data_ptr() for p in stage.parameters()}
    carried = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes()
               for d in backend.runtimes.weight_deferrals for t in d.pending.get(1, (0, 0, []))[2]}
    saved = {t.untyped_storage().data_ptr() for t in kept}
    carried_saved = sum(n for ptr, n in carried.items() if ptr in saved and ptr not in params)
    # layer norm's backward (dx, dgamma, dbeta) runs in B; W gets dgamma and dbeta, not the tuple
    assert all(isinstance(t, torch.Tensor) for d in backend.runtimes.weight_deferrals for t in d.pending.get(1, (0, 0, []))[2])
    assert all(p.grad is None for p in stage.parameters())  # W has not run: the carry is what is held
    assert backend.runtimes.run_weights(1) >= 1
    torch.compiler.reset()
    return held, backend.plans[-1].saved_bytes, carried_saved


@pytest.mark.timeout(120)
def test_carry_bytes_equal_the_runtime_carry():
    from lynx_compile.pipelining.local_pipeline import _Forward
    from lynx_compile.pipelining.weight_split_census import weight_split_census

    model, idx = _gpt_tiny()
    n = len(model.blocks)
    census = weight_split_census(_Forward(model, model.logits), (idx,), [f"_fn.__self__.blocks.{i}" for i in range(n)])
    carry, carry_saved = census.carry, census.carry_saved
    inputs = {}
    hooks = [b.register_forward_pre_hook(lambda m, a, i=i: inputs.setdefault(i, a[0].detach().clone()))
             for i, b in enumerate(model.blocks)]
    with torch.no_grad():
        model.logits(idx)
    for h in hooks:
        h.remove()
    # a middle stage (block 1 alone) and the last stage (last block + final norm and LM head,
    # whose W reads the logits' gradient): the profile's bytes are the real carry's, and so is
    # the part of it the forward saved (a B adds only the rest: StageVariant.fresh)
    middle, _, middle_saved = _runtime_carry(model.pipeline_stage(1, 2, first=False, last=False),
                                             inputs[1].requires_grad_())
    assert carry[1] == middle > 0
    assert carry_saved[1] == middle_saved and 0 < middle_saved < middle
    last, _, last_saved = _runtime_carry(model.pipeline_stage(n - 1, n, first=False, last=True),
                                         inputs[n - 1].requires_grad_())
    assert carry[n - 1] + carry[n] == last
    assert carry_saved[n - 1] + carry_saved[n] == last_saved
    # the first stage's B computes no input gradient (token ids), so W carries everything its
    # backward reads: the saved tensors, the output's gradient and the ids (the planner counts
    # the kept bytes and the gradient there)
    first, saved, _ = _runtime_carry(model.pipeline_stage(0, 1, first=True, last=False), idx)
    assert first == saved + idx.numel() * idx.element_size() + inputs[1].numel() * inputs[1].element_size()


@pytest.mark.timeout(120)
def test_profile_fills_the_carry_for_the_eager_compiler_only():
    from lynx_compile.pipelining.local_pipeline import _Forward
    from lynx_compile.pipelining.profile import _splits_weights, profile_pipeline
    from lynx_compile.pipelining.weight_split_census import carry_bytes

    model, idx = _gpt_tiny()
    wrapped = _Forward(model, model.logits)
    costs, paths = profile_pipeline(wrapped, (idx,), {"compiler": "eager", "solver": "heu"})
    want = carry_bytes(wrapped, (idx,), paths)
    assert [b.carry_bytes for b in costs.blocks] + [costs.post.carry_bytes] == want and costs.weight_split
    assert costs.pre.carry_bytes == 0  # the first stage's carry is its kept bytes (the planner's)
    # Inductor stages run B whole and W as a no-op; so does a stage with the side stream
    assert not _splits_weights({"compiler": "inductor"}) and not _splits_weights({})
    assert not _splits_weights({"compiler": "eager", "side_stream": True})


def _costs(carry, act=1.0, grad=0.5, times=(4, 4, 2, 2, 4)):
    # blocks that keep ``act`` MiB whatever the budget (no curve: no recompute, no transient),
    # carry ``carry`` MiB from B to W, send ``grad`` MiB; F + B = t ms each
    blocks = tuple(SegmentCost(name=f"blocks.{i}", forward_s=t / 3 * ms, backward_s=2 * t / 3 * ms,
                               activation_bytes=int(act * MiB), carry_bytes=int(carry * MiB),
                               output_bytes=int(grad * MiB)) for i, t in enumerate(times))
    return PipelineCosts(blocks=blocks)


def test_zbv_plan_re_split_or_refused_with_the_carry():
    """5 blocks (F + B = 4, 4, 2, 2, 4 ms) on ZBV, 2 ranks, 4 stages, 4 micro-batches; each keeps
    1 MiB, carries 3 MiB, its output gradient is 0.5 MiB, no parameters. The stages a rank holds
    share its memory (``pipeline.rank_memory``): after each action of the rank (torch's order,
    ``test_held_counts_zbv_p2_s4_m4_by_hand``), stage s holds f_s micro-batches (kept k_s) and w_s
    carries (the first stage's: its kept bytes + 0.5). With a, b, c, d blocks on stages 0..3:

      rank 0 (stages 0, 3): F30 (3,0 | 1,0) 3a + d, B30 (3,0 | 0,1) 3a + 3d, B00 (3,1 | 0,0) 4a + 0.5
                            -> max(3a + 3d, 4a + 0.5)
      rank 1 (stages 1, 2): F21 2b + 2c, B20 2b + 4c, B10 5b + c, B13 (0,2 | 0,1) 6b + 3c
                            -> max(2b + 4c, 6b + 3c)
      without the carry (B frees):  rank 0 max(3a + d, 4a),  rank 1 max(2b + 2c, 3b + c)

    split (a b c d)   with carry: rank 0 / 1   without: rank 0 / 1   slowest stage
    2 1 1 1            9 / 9                    8 / 4                8 ms
    1 2 1 1            6 / 15                   4 / 7                8 ms
    1 1 2 1            6 / 12                   4 / 6                4 ms
    1 1 1 2            9 / 9                    5 / 4                6 ms

    Without the carry 6 MiB fits 1 1 2 1 (4 ms). With it, nothing fits below 9 MiB; at 9 MiB
    1 1 1 2 (6 ms) and 2 1 1 1 (8 ms) fit, and 1 1 2 1, which fits each stage alone (stage 2: 8),
    does not fit rank 1 (12). Each stage alone would have fitted 6 MiB (needs 4.5, 6, 4, 6)."""
    plain = dataclasses.replace(_costs(3.0), weight_split=False)
    before = plan_stages(plain, 4, 4, 6 * MiB, "ZBVZeroBubble", ranks=2)
    assert before.layers_per_stage == (1, 1, 2, 1) and before.bottleneck_s == pytest.approx(4 * ms)
    assert before.rank_peak_bytes == (4 * MiB, 6 * MiB)
    after = plan_stages(_costs(3.0), 4, 4, 9 * MiB, "ZBVZeroBubble", ranks=2)
    assert after.fits and after.layers_per_stage == (1, 1, 1, 2) and after.bottleneck_s == pytest.approx(6 * ms)
    assert after.rank_peak_bytes == (9 * MiB, 9 * MiB)
    # each stage by itself, by hand: carries, pairs, peaks (kept + carried at the joint max)
    st = after.stages
    assert [s.carry_bytes for s in st] == [int(1.5 * MiB), 3 * MiB, 3 * MiB, 6 * MiB]
    # stage 0: max(4 x 1, 3 x 1 + 1.5); 1: max(3, 2 + 3, 2 x 3); 2: max(2, 1 + 3); 3: max(2, 6)
    assert [s.peak_bytes for s in st] == [int(4.5 * MiB), 6 * MiB, 4 * MiB, 6 * MiB]
    assert [s.pending_w for s in st] == [1, 2, 1, 1]
    assert st[1].held == ((3, 0), (2, 1), (0, 2))
    with pytest.raises(StagePlanError, match=rf"smallest split needs {9 * MiB} B"):
        plan_stages(_costs(3.0), 4, 4, 9 * MiB - 1, "ZBVZeroBubble", ranks=2)
    # without the carry the least is 1 1 1 2's 5 MiB
    assert plan_stages(plain, 4, 4, 5 * MiB, "ZBVZeroBubble", ranks=2).layers_per_stage == (1, 1, 1, 2)
    with pytest.raises(StagePlanError, match=rf"smallest split needs {5 * MiB} B"):
        plan_stages(plain, 4, 4, 5 * MiB - 1, "ZBVZeroBubble", ranks=2)
    # a split the user pins (the stage-by-stage one) is priced and reported as not fitting its rank
    pinned = plan_stages(_costs(3.0), 4, 4, 9 * MiB, "ZBVZeroBubble", ranks=2, pinned_cuts=[1, 2, 4])
    assert not pinned.fits and [s.fits for s in pinned.stages] == [True, False, False, True]
    assert pinned.rank_peak_bytes[1] == 12 * MiB and any("ranks [1]" in note for note in pinned.notes)


def test_one_f_one_b_plans_unchanged_by_carries():
    # no W under 1F1B / GPipe / Interleaved1F1B: the carry is 0 and the plan what it was
    from test_pipeline_plan_stages import block, brute_costs, curve

    base = brute_costs()
    carried = dataclasses.replace(base, blocks=tuple(dataclasses.replace(b, carry_bytes=5 * MiB)
                                                     for b in base.blocks))
    for schedule, mem in [("1F1B", 24 * MiB), ("1F1B", None), ("GPipe", 40 * MiB), ("Interleaved1F1B", 24 * MiB)]:
        a = plan_stages(base, 3, 3, mem, schedule)
        assert plan_stages(carried, 3, 3, mem, schedule) == a
        assert all(s.carry_bytes == 0 and s.pending_w == 0 and s.held == ((s.in_flight, 0),) for s in a.stages)
    # test_pipeline_plan_stages' hand-computed 1F1B case, carries added: still 2|2, stage 0 keeps
    # 2 MiB and peaks at static + k x kept + working + T = 8 + 2 x 2 + 0.5 + 1 = 13.5 MiB
    blocks = tuple(dataclasses.replace(block(i, cv=curve((1, 4), (2, 0)), param_mib=1), carry_bytes=3 * MiB)
                   for i in range(4))
    plan = plan_stages(PipelineCosts(blocks=blocks, working_bytes=MiB // 2), 2, 2, 15 * MiB)
    assert plan.layers_per_stage == (2, 2) and plan.stages[0].kept_bytes == 2 * MiB
    assert plan.stages[0].peak_bytes == 27 * MiB // 2 and plan.stages[0].budget_bytes == 7 * MiB // 2


def test_stage_info_round_trips_and_shows_the_carry():
    plan = plan_stages(_costs(3.0), 4, 4, 9 * MiB, "ZBVZeroBubble", ranks=2)
    back = StagePlan.from_dict(json.loads(plan.to_json()))
    assert back == plan and back.stages[1].held == ((3, 0), (2, 1), (0, 2))
    assert "W-carry 3.0 MiB/mb x2 at peak" in plan.table()
    assert "device peak per rank (its stages together): 9.0 MiB, 9.0 MiB (fit test" in plan.table()
    costs = _costs(3.0)
    assert PipelineCosts.from_dict(json.loads(json.dumps(costs.to_dict()))) == costs
    # plans written before the carry load with none
    old = json.loads(plan.to_json())
    for s in old["stages"]:
        del s["carry_bytes"], s["held"], s["pending_w"]
    assert StagePlan.from_dict(old).stages[1].carry_bytes == 0


@pytest.mark.timeout(120)
def test_recompute_only_w_needs_is_the_weight_matmuls_inputs():
    # HAL's split of the recompute: in a GPT block B computes dx = dy @ W for every linear and the
    # backward of the norms, the attention and the GeLU, none of which reads a linear's input;
    # only W (dW = dy.T @ x) does. So the storages only W reads are, per block, the inputs of
    # its four linears: ln_1's output, the attention's output, ln_2's output, the GeLU's output;
    # plus the LM head's input (the final norm's output) and the position ids (the position
    # embedding's gradient is a weight gradient). The norms' own nodes stay B's: their backward
    # reads their mean and rstd, outputs of the same op, so recomputing a norm runs in B.
    from lynx_compile.pipelining.local_pipeline import _Forward
    from lynx_compile.pipelining.profile import profile_pipeline
    from lynx_compile.pipelining.weight_split_census import weight_split_census

    model, idx = _gpt_tiny()
    n = len(model.blocks)
    wrapped = _Forward(model, model.logits)
    paths = [f"_fn.__self__.blocks.{i}" for i in range(n)]
    census = weight_split_census(wrapped, (idx,), paths)
    w_only, read_in_b = census.w_only, census.read_in_b
    storages = {k for k in w_only if not k.startswith("primals")}  # parameters are no storages of the step
    norms = {k for k in storages if k.startswith("native_layer_norm")}
    assert len(norms) == 2 * n + 1 and all(k.endswith("[0]") for k in norms)  # output 0, not mean / rstd
    assert all(k.replace("[0]", "[1]") in read_in_b for k in norms)
    assert len({k for k in storages if k.startswith("gelu")}) == n
    assert len({k for k in storages if k.startswith("_unsafe_view")}) == n  # attention output, heads merged
    assert storages - norms - {k for k in storages if k.startswith(("gelu", "_unsafe_view"))} == {"arange"}

    # the profile's curves split their exposed seconds: never more in W than in all, none when
    # everything is kept, some at the middle points (a GeLU output recomputed from the fc1 output
    # B kept; measured: block 0 at 164864 B kept, 3.74 of 16.99 us)
    costs, _ = profile_pipeline(wrapped, (idx,), {"compiler": "eager", "solver": "heu"})
    for block in costs.blocks:
        c = block.curve
        assert len(c.exposed_w_s) == len(c.exposed_s)
        assert all(0.0 <= w <= e + 1e-15 for w, e in zip(c.exposed_w_s, c.exposed_s))
        assert c.exposed_w_s[c.kept_bytes.index(c.max_bytes)] == 0.0
    assert any(w > 0 for block in costs.blocks for w in block.curve.exposed_w_s)
