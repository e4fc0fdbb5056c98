"""CPU unit tests for lynx_compile.costs: NodeCost, hardware profiles, the analytic roofline."""
from __future__ import annotations

import dataclasses
import json
import operator

import pytest
import torch
import torch.nn.functional as F
from torch.fx.experimental.proxy_tensor import make_fx

from lynx_compile.costs import (
    DATASHEET_PROFILES,
    PROFILES,
    HardwareProfile,
    NodeCost,
    analytic_node_cost,
    node_costs,
    calibrate_cpu_profile,
    get_profile,
    out_bytes_of,
    profile_name_for_device,
    tensor_bytes_of,
)

aten = torch.ops.aten

# A hand-computable machine: 1 TFLOP/s, 100 GB/s, no efficiency loss, 1 µs per op.
TOY = HardwareProfile(
    name="toy",
    peak_flops={"float32": 1e12, "bfloat16": 4e12, "float16": 4e12},
    memory_bandwidth_bytes_per_s=1e11,
    memory_capacity_bytes=1 << 30,
    launch_overhead_s=1e-6,
    matmul_efficiency=1.0,
    memory_efficiency=1.0,
    default_link="nvlink3",
)


def nodes_with(gm: torch.fx.GraphModule, target) -> list[torch.fx.Node]:
    return [n for n in gm.graph.nodes if n.target == target]


def joint_graph(fn, *args) -> torch.fx.GraphModule:
    """The aot_autograd joint (forward + backward) graph of ``fn`` on ``args``."""
    from functorch.compile import default_partition, make_boxed_func
    from torch._functorch.aot_autograd import aot_function

    captured = {}

    def partition(joint, inputs, **kw):
        captured["gm"] = joint
        return default_partition(joint, inputs, **kw)

    def boxed(gm, _inputs):
        return make_boxed_func(gm)

    compiled = aot_function(fn, fw_compiler=boxed, bw_compiler=boxed, partition_fn=partition)
    out = compiled(*args)
    out.sum().backward()
    return captured["gm"]


# ---- NodeCost ---------------------------------------------------------------------------------


def test_node_cost_roundtrip_and_validation():
    c = NodeCost(runtime_s=1.5e-3, out_bytes=1024, flops=2e9, bytes_moved=4096, source="analytic")
    d = c.to_dict()
    assert json.loads(json.dumps(d)) == d
    assert NodeCost.from_dict(d) == c
    assert NodeCost.zero().source == "zero" and NodeCost.zero().runtime_s == 0.0
    with pytest.raises(ValueError, match="source"):
        NodeCost(runtime_s=0.0, out_bytes=0, flops=0.0, bytes_moved=0, source="guess")


# ---- FLOPs and bytes --------------------------------------------------------------------------


@pytest.mark.parametrize("m,k,n", [(37, 41, 53), (1, 9, 341), (128, 64, 32)])
def test_mm_flops_is_2mnk(m, k, n):
    gm = make_fx(torch.mm, tracing_mode="fake")(torch.randn(m, k), torch.randn(k, n))
    (mm,) = nodes_with(gm, aten.mm.default)
    cost = analytic_node_cost(mm, TOY)
    assert cost.flops == 2 * m * n * k
    assert cost.out_bytes == m * n * 4
    assert cost.bytes_moved == (m * k + k * n + m * n) * 4
    assert cost.source == "analytic"


def test_bmm_and_addmm_use_torch_formulas():
    def f(a, b, bias, x, w):
        return torch.bmm(a, b), torch.addmm(bias, x, w)

    args = (torch.randn(3, 5, 7), torch.randn(3, 7, 9), torch.randn(11), torch.randn(4, 6), torch.randn(6, 11))
    gm = make_fx(f, tracing_mode="fake")(*args)
    assert analytic_node_cost(nodes_with(gm, aten.bmm.default)[0], TOY).flops == 2 * 3 * 5 * 7 * 9
    assert analytic_node_cost(nodes_with(gm, aten.addmm.default)[0], TOY).flops == 2 * 4 * 6 * 11


def test_cpu_sdpa_uses_torch_attention_formula():
    B, H, S, D = 2, 4, 32, 16
    q, k, v = (torch.randn(B, H, S, D, requires_grad=True) for _ in range(3))
    gm = joint_graph(lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=True), q, k, v)
    flops = {n.target: analytic_node_cost(n, TOY).flops for n in gm.graph.nodes if n.op == "call_function"}
    fwd = 4 * B * H * S * S * D  # QK^T and PV: 2 matmuls of 2·S·S·D each per (b, h)
    assert flops[aten._scaled_dot_product_flash_attention_for_cpu.default] == fwd
    assert flops[aten._scaled_dot_product_flash_attention_for_cpu_backward.default] == 2.5 * fwd


def test_symbolic_shapes_use_size_hints():
    gm = make_fx(torch.mm, tracing_mode="symbolic")(torch.randn(37, 41), torch.randn(41, 53))
    (mm,) = nodes_with(gm, aten.mm.default)
    assert isinstance(mm.meta["val"].shape[0], torch.SymInt)
    cost = analytic_node_cost(mm, TOY)
    assert cost.flops == 2 * 37 * 41 * 53
    assert cost.out_bytes == out_bytes_of(mm) == 37 * 53 * 4


def test_views_cost_nothing_and_inplace_moves_bytes():
    def f(x):
        v = x.view(6, 4).t().transpose(0, 1).unsqueeze(0).expand(3, 6, 4)
        y = x.clone()
        y.add_(1.0)
        return v, y

    gm = make_fx(f, tracing_mode="fake")(torch.randn(4, 6))
    for target in (aten.view.default, aten.t.default, aten.transpose.int, aten.unsqueeze.default, aten.expand.default):
        (node,) = nodes_with(gm, target)
        cost = analytic_node_cost(node, TOY)
        assert cost == NodeCost.zero(), target
        assert out_bytes_of(node) == 0
        assert tensor_bytes_of(node) > 0  # the value still has a size
    (add_,) = nodes_with(gm, aten.add_.Tensor)
    inplace = analytic_node_cost(add_, TOY)
    assert inplace.out_bytes == 0 and inplace.bytes_moved == 2 * 24 * 4 and inplace.runtime_s > 0
    (clone,) = nodes_with(gm, aten.clone.default)
    assert analytic_node_cost(clone, TOY).out_bytes == 24 * 4


def test_placeholders_getitem_output_are_free():
    gm = make_fx(lambda x: torch.max(x, dim=1), tracing_mode="fake")(torch.randn(5, 7))
    for node in gm.graph.nodes:
        if node.op in ("placeholder", "output") or node.target is operator.getitem:
            assert analytic_node_cost(node, TOY) == NodeCost.zero()


def test_tuple_output_bytes_are_summed():
    x, w, b = torch.randn(2, 9, 41), torch.randn(41), torch.randn(41)
    gm = make_fx(lambda x, w, b: F.layer_norm(x, (41,), w, b), tracing_mode="fake")(x, w, b)
    (ln,) = nodes_with(gm, aten.native_layer_norm.default)
    out, mean, rstd = ln.meta["val"]
    expected = sum(t.numel() * t.element_size() for t in (out, mean, rstd))
    assert expected == (2 * 9 * 41 + 2 * 2 * 9) * 4
    assert out_bytes_of(ln) == expected == analytic_node_cost(ln, TOY).out_bytes

    gm = make_fx(lambda x: torch.native_dropout(x, 0.1, True), tracing_mode="fake")(torch.randn(3, 5))
    (drop,) = nodes_with(gm, aten.native_dropout.default)
    assert out_bytes_of(drop) == 15 * 4 + 15 * 1  # fp32 output + bool mask


# ---- roofline ---------------------------------------------------------------------------------


def test_roofline_compute_vs_memory_bound():
    n = 1024

    def f(a, b):
        return torch.mm(a, b), a + b

    gm = make_fx(f, tracing_mode="fake")(torch.randn(n, n), torch.randn(n, n))
    mm = analytic_node_cost(nodes_with(gm, aten.mm.default)[0], TOY)
    add = analytic_node_cost(nodes_with(gm, aten.add.Tensor)[0], TOY)
    # mm: 2n³ = 2.147e9 FLOP / 1e12 = 2.147 ms  vs  3n²·4 B = 12.6 MB / 1e11 = 0.126 ms -> compute
    assert mm.runtime_s == pytest.approx(2 * n**3 / 1e12 + 1e-6)
    # add: n² FLOP / 1e12 = 1 µs  vs  3n²·4 B / 1e11 = 126 µs -> memory
    assert add.runtime_s == pytest.approx(3 * n * n * 4 / 1e11 + 1e-6)
    assert add.flops == n * n


def test_low_precision_matmul_uses_its_peak():
    n = 256
    a = torch.randn(n, n, dtype=torch.bfloat16)
    gm = make_fx(torch.mm, tracing_mode="fake")(a, a)
    cost = analytic_node_cost(nodes_with(gm, aten.mm.default)[0], TOY)
    assert cost.runtime_s == pytest.approx(max(2 * n**3 / 4e12, 3 * n * n * 2 / 1e11) + 1e-6)


# ---- joint graphs and node_costs ----------------------------------------------------------


def test_joint_graph_matmul_flops_are_three_forwards():
    B, I, H, O = 8, 16, 32, 4
    w1, w2 = torch.randn(H, I, requires_grad=True), torch.randn(O, H, requires_grad=True)
    x = torch.randn(B, I, requires_grad=True)
    gm = joint_graph(lambda x, w1, w2: F.linear(torch.relu(F.linear(x, w1)), w2), x, w1, w2)
    costs = node_costs(gm, TOY)
    assert set(costs) == {n.name for n in gm.graph.nodes}
    mm_flops = sum(costs[n.name].flops for n in nodes_with(gm, aten.mm.default))
    fwd = 2 * B * I * H + 2 * B * H * O
    # Every linear has a weight gradient and an input gradient (x requires grad): 3 x forward.
    assert mm_flops == 3 * fwd


def test_joint_graph_with_embedding_dropout_cross_entropy():
    def f(x, w, b, emb, idx, tgt):
        h = F.embedding(idx, emb) + x
        h = F.dropout(F.layer_norm(h, (16,), w, b), 0.1, True)
        logits = h @ emb.t()
        return F.cross_entropy(logits.view(-1, 50), tgt.view(-1))

    params = [torch.randn(2, 8, 16), torch.randn(16), torch.randn(16), torch.randn(50, 16)]
    params = [p.requires_grad_() for p in params]
    gm = joint_graph(f, *params, torch.randint(0, 50, (2, 8)), torch.randint(0, 50, (2, 8)))
    costs = node_costs(gm, PROFILES["h100-sxm"])
    for node in gm.graph.nodes:
        c = costs[node.name]
        assert c.runtime_s >= 0 and c.out_bytes >= 0 and c.bytes_moved >= 0
        if node.op == "call_function" and node.target in (aten.mm.default, aten.native_layer_norm.default):
            assert c.runtime_s >= PROFILES["h100-sxm"].launch_overhead_s and c.out_bytes > 0


def test_node_costs_rejects_unknown_source():
    gm = make_fx(torch.mm, tracing_mode="fake")(torch.randn(2, 3), torch.randn(3, 4))
    with pytest.raises(ValueError, match="analytic"):
        node_costs(gm, TOY, source="psychic")


# ---- profiles ---------------------------------------------------------------------------------


def test_datasheet_profiles_are_complete():
    from lynx_compile.costs import LINKS

    names = {"a100-sxm4-80gb", "a100-pcie-80gb", "h100-sxm", "h200", "ascend-910b"}
    assert set(DATASHEET_PROFILES) == names and set(PROFILES) == names | {"cpu"}
    for name, p in DATASHEET_PROFILES.items():
        assert p.name == name
        assert {"float32", "bfloat16", "float16"} <= set(p.peak_flops)
        assert p.peak_flops["bfloat16"] > p.peak_flops["float32"] > 0
        assert p.memory_bandwidth_bytes_per_s > 0 and p.memory_capacity_bytes > 0
        assert 0 < p.matmul_efficiency <= 1 and 0 < p.memory_efficiency <= 1
        assert p.default_link in LINKS
        assert HardwareProfile.from_dict(json.loads(json.dumps(p.to_dict()))) == p
        hash(p)


def test_get_profile_names():
    assert get_profile("h200") is PROFILES["h200"]
    with pytest.raises(ValueError, match="a100-sxm4-80gb.*cpu.*auto"):
        get_profile("tpu-v9")
    if not torch.cuda.is_available():
        assert get_profile("auto").name == "cpu"
    assert profile_name_for_device("NVIDIA A100-SXM4-80GB") == "a100-sxm4-80gb"
    assert profile_name_for_device("NVIDIA A100 80GB PCIe") == "a100-pcie-80gb"
    assert profile_name_for_device("NVIDIA H100 80GB HBM3") == "h100-sxm"
    assert profile_name_for_device("NVIDIA H200") == "h200"


def test_cpu_calibration_is_positive_and_cached(tmp_path):
    from lynx_compile.memory.measure import cpu_peak_bytes

    cache = tmp_path / "cpu_profile.json"
    p = None

    def calibrate():
        nonlocal p
        p = calibrate_cpu_profile(cache_file=cache, force=True)

    # measured in a child process: its 192 MB of bandwidth buffers are not this process's (on a
    # CPU device they would be the peak of the step that compiles first)
    assert cpu_peak_bytes(calibrate) < 1 << 20
    assert p.name == "cpu" and p.default_link == "loopback-gloo"
    assert all(v > 0 for v in p.peak_flops.values())
    assert 1e8 < p.peak_flops["float32"] < 1e14  # 0.1 GFLOP/s .. 100 TFLOP/s
    assert 1e8 < p.memory_bandwidth_bytes_per_s < 1e13
    assert 0 < p.launch_overhead_s < 1e-3
    # matmul rates by size (ascending FLOPs), the L2's bandwidth within the L2's bytes
    assert [f for f, _ in p.matmul_rates] == sorted(f for f, _ in p.matmul_rates) and len(p.matmul_rates) == 5
    assert max(r for _, r in p.matmul_rates) == p.peak_flops["float32"]
    assert p.cache_bytes >= 32 << 10 and p.cache_bandwidth_bytes_per_s > 1e8
    assert calibrate_cpu_profile() is p  # per-process cache
    stored = json.loads(cache.read_text())
    (key,) = stored
    assert torch.__version__ in key
    assert HardwareProfile.from_dict(stored[key]) == p
    assert get_profile("cpu") is p and PROFILES["cpu"] is p


def test_matmul_fraction_and_memory_rate_by_size():
    """A small matmul runs at the fraction of the peak its size measured (log-log interpolation
    between the measured points, the smallest's below them, the largest's above); bytes that
    fit in the cache move at its rate (hand-computed)."""
    import math

    from lynx_compile.costs.analytic import roofline_time

    p = dataclasses.replace(DATASHEET_PROFILES["h200"], matmul_rates=((1e3, 1e9), (1e5, 4e9), (1e7, 8e9)),
                            cache_bytes=1000, cache_bandwidth_bytes_per_s=1e12, memory_efficiency=1.0,
                            matmul_efficiency=1.0)
    assert p.matmul_fraction(10.0) == pytest.approx(1 / 8)
    assert p.matmul_fraction(1e4) == pytest.approx(2 / 8)  # halfway (in logs) from 1e9 to 4e9 FLOP/s
    assert p.matmul_fraction(1e9) == pytest.approx(1.0)
    assert DATASHEET_PROFILES["h200"].matmul_fraction(10.0) == 1.0  # no measured rates
    assert p.memory_seconds(1000) == pytest.approx(1000 / 1e12)
    assert p.memory_seconds(1001) == pytest.approx(1001 / p.memory_bandwidth_bytes_per_s)
    peak = p.peak_flops["float32"]
    t = roofline_time(1e4, 0, peak, p, matmul_flops=1e4)
    assert t == pytest.approx(1e4 / (peak * 0.25) + p.launch_overhead_s)
    assert roofline_time(1e4, 0, peak, p) == pytest.approx(1e4 / peak + p.launch_overhead_s)
    assert math.isclose(HardwareProfile.from_dict(json.loads(json.dumps(p.to_dict()))).matmul_fraction(1e4), 0.25)


def test_batched_matmul_is_priced_per_matrix():
    """A bmm of 16 small matrices runs at one small matrix's rate, not at the rate of one
    matmul of its total FLOPs."""
    from lynx_compile.costs.analytic import matrix_flops

    from torch.fx.passes.fake_tensor_prop import FakeTensorProp
    from torch._subclasses import FakeTensorMode

    with FakeTensorMode() as mode:
        a, b = torch.empty(16, 64, 32), torch.empty(16, 32, 64)
    gm = torch.fx.symbolic_trace(lambda a, b: torch.ops.aten.bmm.default(a, b))
    FakeTensorProp(gm, mode).propagate(a, b)
    node = next(n for n in gm.graph.nodes if n.op == "call_function")
    flops = 2 * 16 * 64 * 64 * 32
    assert matrix_flops(node, flops) == flops / 16


def test_cuda_profile_measured_cached_and_datasheet_fallback(tmp_path, monkeypatch, caplog):
    """A CUDA device's profile (issue R item 2) without a GPU here: the child's measurement is
    stood in for (``subprocess.run``); the profile carries its numbers on the datasheet's links,
    is kept in the machine's file and read back by a later process; a failed measurement falls
    back to the datasheet profile with a warning naming why."""
    import subprocess
    import types

    from lynx_compile.costs import cuda_measure, hardware

    assert callable(cuda_measure.measure)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda index=None: "NVIDIA H200")
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    m = {"device_name": "NVIDIA H200", "memory_capacity_bytes": 150 << 30,
         "peak_flops": {"bfloat16": 700e12, "float32": 50e12, "float16": 690e12},
         "copy_bytes_per_s": 4.0e12, "add_bytes_per_s": 4.2e12, "launch_overhead_s": 2.5e-6,
         "matmul_rates": [[2 * 256**3, 100e12], [2 * 8192**3, 700e12]], "cache_bytes": 50 << 20,
         "cache_bytes_per_s": 9e12}
    calls = []

    def fake_run(cmd, **kw):
        calls.append(cmd)
        return types.SimpleNamespace(stdout="noise\n" + json.dumps(m) + "\n")

    monkeypatch.setattr(subprocess, "run", fake_run)
    monkeypatch.setattr(hardware, "_cuda_profiles", {})
    cache = tmp_path / "profiles.json"
    p = hardware.calibrate_cuda_profile(cache_file=cache)
    assert len(calls) == 1 and p.name == "h200-measured"
    assert p.peak_flops["bfloat16"] == 700e12 and p.memory_bandwidth_bytes_per_s == 4.2e12
    assert p.default_link == DATASHEET_PROFILES["h200"].default_link and p.matmul_efficiency == 1.0
    assert p.matmul_fraction(2 * 256**3) == pytest.approx(100 / 700)
    summary = p.summary()
    assert summary["tflops"]["bfloat16"] == 700 and summary["memory_gb_s"] == 4200
    assert summary["smallest_matmul"]["fraction_of_peak"] == pytest.approx(100 / 700, abs=1e-3)
    monkeypatch.setattr(hardware, "_cuda_profiles", {})  # a later process: read back, not measured
    assert hardware.calibrate_cuda_profile(cache_file=cache) == p and len(calls) == 1

    def failing_run(cmd, **kw):
        raise subprocess.CalledProcessError(1, cmd, stderr="RuntimeError: CUDA out of memory")

    monkeypatch.setattr(subprocess, "run", failing_run)
    monkeypatch.setattr(hardware, "_cuda_profiles", {})
    with caplog.at_level("WARNING", logger="lynx_compile"):
        q = hardware.calibrate_cuda_profile(cache_file=tmp_path / "other.json")
    assert q is DATASHEET_PROFILES["h200"]
    assert "CUDA out of memory" in caplog.text and "h200 datasheet profile" in caplog.text
