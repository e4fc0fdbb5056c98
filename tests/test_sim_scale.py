"""Paper-scale evaluation (``lynx_compile.sim.scale`` / ``sim.layer_profile``, ``lynx simulate``):
strategies priced against hand-computed iterations and memory, OOM reported with its need."""
import json
import subprocess
import sys

import pytest

from lynx_compile.sim.layer_profile import LayerPoint, LayerProfile
from lynx_compile.sim.scale import CLUSTERS, STATE_BYTES_PER_PARAM_BYTE, Cluster, Layout, evaluate, model_flops

MB = 1 << 20
NONE = LayerPoint(label="none", kept_bytes=100 * MB)
FULL = LayerPoint(label="full", kept_bytes=10 * MB, demand_s=0.4, transient_bytes=90 * MB)
HIDDEN = LayerPoint(label="lynx", kept_bytes=40 * MB, demand_s=0.0, window_s=(0.1, 0.1), transient_bytes=60 * MB)


def _profile(n_layers=4, **points) -> LayerProfile:
    pts = {"none": (NONE,), "full": (FULL,), "selective": (NONE,), "torch": (NONE,), "checkmate": (FULL,),
           "lynx-heu": (HIDDEN, NONE), "lynx-opt": (HIDDEN, NONE)}
    pts.update(points)
    return LayerProfile(model="toy", hardware="a100-sxm4-80gb", link="nvlink3", tp=2, microbatch=1, seq_len=8,
                        hidden=4, vocab=16, n_layers=n_layers, forward_s=1.0, backward_s=2.0, comm_s=(0.25, 0.25),
                        pre_s=(0.5, 0.5), post_s=(0.5, 1.0), pre_bytes=0, post_bytes=0,
                        layer_param_bytes=MB, pre_param_bytes=0, post_param_bytes=0, points=pts)


def _cluster(memory_mib: int) -> Cluster:
    return Cluster(name="toy", hardware="a100-sxm4-80gb", devices=2, devices_per_node=2, intra_link="nvlink3",
                   inter_link="nvlink3", memory_bytes=memory_mib * MB, kappa=1.0)


LAYOUT = Layout(tp=2, pp=1, dp=1, microbatch=1, global_batch=3)
LOGITS = 1 * 8 * 16 * 4  # fp32 logits of the last stage


def test_iteration_and_memory_match_hand_computation():
    prof, cl = _profile(), _cluster(10_000)
    per_mb = 0.5 + 0.5 + 4 * (1 + 2 + 4 * 0.25) + 0.5 + 1.0  # embed, layers (F + B + 4 collectives), head
    none = evaluate(prof, "none", cl, LAYOUT)
    assert none.iteration_s == pytest.approx(3 * per_mb)
    static = 4 * MB * STATE_BYTES_PER_PARAM_BYTE
    assert none.peak_bytes[0] == static + 4 * 100 * MB + LOGITS  # one stage: one micro-batch in flight
    full = evaluate(prof, "full", cl, LAYOUT)
    assert full.iteration_s == pytest.approx(3 * (per_mb + 4 * 0.4))
    # recompute inside the windows hides behind the collectives (kappa 1: 0.1 <= 0.25)
    lynx = evaluate(prof, "lynx-opt", cl, LAYOUT)
    assert lynx.choices == ("lynx",) and lynx.iteration_s == pytest.approx(none.iteration_s)
    assert lynx.peak_bytes[0] < none.peak_bytes[0]


def test_each_strategy_takes_the_cheapest_decision_that_fits():
    prof = _profile()
    static = 4 * MB * STATE_BYTES_PER_PARAM_BYTE
    # room for the lynx point (4 x 40 MiB + 60 MiB) but not for no recompute (400 MiB)
    cl = _cluster((static + 4 * 40 * MB + 60 * MB + LOGITS) // MB + 1)
    assert not evaluate(prof, "none", cl, LAYOUT).fits
    assert evaluate(prof, "lynx-heu", cl, LAYOUT).choices == ("lynx",)
    uniform = evaluate(prof, "uniform", cl, LAYOUT)  # fewest fully recomputed layers that fit
    # r full layers: r * 10 + (4 - r) * 100 + 90 <= 160 + 60 (+ < 1 MiB)  ->  r = 3
    assert uniform.fits and uniform.choices == ("full+none",)
    assert evaluate(prof, "full", cl, LAYOUT).iteration_s > evaluate(prof, "lynx-heu", cl, LAYOUT).iteration_s


def test_a_configuration_that_cannot_fit_is_oom_with_the_memory_it_needs():
    prof, cl = _profile(), _cluster(1)
    for strategy in ("none", "full", "lynx-opt"):
        out = evaluate(prof, strategy, cl, LAYOUT)
        assert not out.fits and out.need_bytes > cl.memory_bytes
    assert evaluate(prof, "full", cl, LAYOUT).need_bytes < evaluate(prof, "none", cl, LAYOUT).need_bytes


def test_pipeline_layout_and_lynx_stage_planner():
    prof = _profile(n_layers=8)
    cl = Cluster(name="toy4", hardware="a100-sxm4-80gb", devices=4, devices_per_node=4, intra_link="nvlink3",
                 inter_link="nvlink3", memory_bytes=10_000 * MB, kappa=1.0)
    layout = Layout(tp=2, pp=2, dp=1, microbatch=1, global_batch=4)
    out = evaluate(prof, "lynx-opt", cl, layout)
    assert sum(out.layers_per_stage) == 8 and len(out.layers_per_stage) == 2 and out.fits
    assert evaluate(prof, "none", cl, layout).layers_per_stage == (4, 4)


def test_bad_layouts_name_the_fix():
    prof, cl = _profile(), _cluster(10_000)
    with pytest.raises(ValueError, match="devices"):
        evaluate(prof, "none", cl, Layout(tp=4, pp=1, dp=1, microbatch=1, global_batch=4))
    with pytest.raises(ValueError, match="strategy"):
        evaluate(prof, "magic", cl, LAYOUT)
    with pytest.raises(ValueError, match="micro-batches"):
        evaluate(prof, "none", cl, Layout(tp=2, pp=1, dp=1, microbatch=2, global_batch=3))


def test_model_flops_is_megatrons_formula():
    prof = _profile()
    B, s, L, h, V = 2, 8, 4, 4, 16
    assert model_flops(prof, B) == pytest.approx(72 * B * s * L * h * h * (1 + s / (6 * h) + V / (12 * h * L)))


def test_profile_round_trips_through_json():
    prof = _profile()
    assert LayerProfile.from_dict(json.loads(json.dumps(prof.to_dict()))) == prof
    assert set(CLUSTERS) >= {"a100-nvlink-8", "a100-pcie-8", "ascend-910b-8", "a100-nvlink-32"}


def test_lynx_simulate_cli_profiles_a_model_with_a_fake_tp_group(tmp_path):
    """The CLI in its own process (the fake process group must not leak into this one)."""
    out = tmp_path / "sim.json"
    proc = subprocess.run([sys.executable, "-m", "lynx_compile.tools.cli", "simulate", "--model", "gpt-tiny", "--tp", "2",
                           "--global-batch", "8", "--json", str(out), "--trace", str(tmp_path / "t.json")],
                          capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "| lynx-opt |" in proc.stdout and "| full |" in proc.stdout
    data = json.loads(out.read_text())
    prof = LayerProfile.from_dict(data["profile"])
    assert prof.tp == 2 and len(prof.comm_s) == 2 and all(c > 0 for c in prof.comm_s)
    assert prof.points["full"][0].kept_bytes < prof.points["none"][0].kept_bytes
    assert {"lynx-heu", "lynx-opt", "checkmate", "torch"} <= set(prof.points)
    strategies = {o["strategy"]: o for o in data["outcomes"]}
    assert strategies["full"]["iteration_s"] >= strategies["none"]["iteration_s"]
    assert json.loads((tmp_path / "t.json").read_text())["traceEvents"]


def test_fsdp_shards_the_state_and_hides_recompute_in_its_collectives():
    """Layout.fsdp over dp = 2 (nvlink3: α = 3.4 µs, 300 GB/s): per layer an all-gather of its
    1 MiB of bf16 parameters in the forward, that plus a reduce-scatter of 2 MiB of fp32
    gradients in the backward (α–β formula); parameters and optimizer state sharded in two,
    plus two gathered layers; no all-reduce at the end. The layers compute 1 µs each way, so a
    10 µs recompute per layer fits in the ~13 µs the collectives take beyond it: hidden."""
    import dataclasses

    from lynx_compile.costs.comm import LINKS, collective_time
    from lynx_compile.sim.scale import fsdp_comm_s

    cheap = LayerPoint(label="full", kept_bytes=10 * MB, demand_s=1e-5, transient_bytes=90 * MB)
    prof = dataclasses.replace(_profile(full=(cheap,)), comm_s=(), forward_s=1e-6, backward_s=1e-6,
                               pre_s=(0.0, 0.0), post_s=(0.0, 0.0))
    cl = Cluster(name="toy", hardware="a100-sxm4-80gb", devices=2, devices_per_node=2, intra_link="nvlink3",
                 inter_link="nvlink3", memory_bytes=10_000 * MB, kappa=1.0)
    fsdp = Layout(tp=1, pp=1, dp=2, microbatch=1, global_batch=2, fsdp=True)
    ddp = dataclasses.replace(fsdp, fsdp=False)
    gather = collective_time("all_gather", MB, 2, LINKS["nvlink3"])
    backward = gather + collective_time("reduce_scatter", 2 * MB, 2, LINKS["nvlink3"])
    assert fsdp_comm_s(prof, fsdp, LINKS["nvlink3"]) == pytest.approx((gather, backward))
    assert backward - 1e-6 > 1e-5  # the slack holds the recompute
    none, plain = evaluate(prof, "none", cl, fsdp), evaluate(prof, "none", cl, ddp)
    assert none.iteration_s == pytest.approx(4 * (gather + backward))  # every layer waits on FSDP
    static = 4 * MB * STATE_BYTES_PER_PARAM_BYTE
    assert none.peak_bytes[0] - (static // 2 + 2 * MB) == plain.peak_bytes[0] - static
    assert evaluate(prof, "full", cl, fsdp).iteration_s == pytest.approx(none.iteration_s)  # hidden
    assert evaluate(prof, "full", cl, ddp).iteration_s == pytest.approx(plain.iteration_s + 4 * 1e-5)  # exposed
