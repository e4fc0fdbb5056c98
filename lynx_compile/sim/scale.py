"""One paper-scale training configuration under one recompute strategy, simulated.

``evaluate(profile, strategy, cluster, layout) -> Outcome``: picks each stage's per-layer
recompute decision from the profile's points (``sim/layer_profile.py``) under the device memory, cuts
the layers into pipeline stages, builds a ``StepSim`` and replays it (``sim/step.py``).

Strategies (``STRATEGIES``):
- ``none`` / ``full`` / ``selective``: one decision for every layer (Megatron's options);
- ``uniform``: Megatron's block method: per stage the fewest layers fully recomputed, the rest
  not at all, that fits;
- ``torch`` / ``checkmate`` / ``lynx-heu`` / ``lynx-opt``: per stage the point of that planner's
  curve with the least exposed recompute whose kept bytes fit (``checkmate`` is the MILP without
  windows: optimal recompute with no overlap; every planner may also fall back to full);
- stage cuts are uniform (what users set) except for ``lynx-heu`` / ``lynx-opt``, whose cuts come
  from lynx's recompute-aware planner ``plan_stages``; ``lynx-no-partition`` is ``lynx-heu``
  with uniform cuts.

Memory per device: parameters in bf16 with fp32 master weights and Adam (16 B per parameter,
no ZeRO; with ``Layout.fsdp`` all of it sharded over the data-parallel replicas, plus two
layers' gathered bf16 parameters), in-flight micro-batches x kept activations, the backward's recomputed bytes, and on the
last stage the logits in fp32 for the loss (b x s x V x 4 B, transient). Time: the profile's
analytic per-layer costs; recompute inside a window runs ``kappa`` times slower.

FSDP (``Layout.fsdp``, torchtitan's ``dp_shard``, ZeRO-3): every layer's parameters are
all-gathered over the data-parallel replicas before its forward and again before its backward
(prefetched one layer ahead), its gradients reduce-scattered in fp32 after its backward; no
all-reduce at the end. A layer's backward overlaps the next layer's all-gather and the previous
layer's reduce-scatter (``LayerSim.fsdp_backward_comm_s``), so recompute up to what they take
beyond the backward's compute is hidden, for every strategy alike; the lynx planners count
that slack when they choose (``_exposed``), the others do not.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

from lynx_compile.costs.comm import LINKS, collective_time

from .layer_profile import LayerPoint, LayerProfile
from .step import LayerSim, StageSim, StepResult, StepSim, simulate_iteration

STRATEGIES = ("none", "full", "selective", "uniform", "torch", "checkmate", "lynx-heu", "lynx-opt",
              "lynx-no-partition")
STATE_BYTES_PER_PARAM_BYTE = 8  # bf16 weights (2 B) + grads (2 B) + fp32 master + Adam m, v (12 B)


@dataclass(frozen=True, kw_only=True)
class Cluster:
    name: str
    hardware: str
    """``lynx_compile.costs.PROFILES`` key: per-op roofline costs and device memory."""
    devices: int
    devices_per_node: int
    intra_link: str
    inter_link: str
    memory_bytes: int
    kappa: float = 1.1
    """Slowdown of compute that runs while a collective is in flight (shared SMs / HBM)."""


GIB = 1 << 30
CLUSTERS = {
    "a100-nvlink-8": Cluster(name="a100-nvlink-8", hardware="a100-sxm4-80gb", devices=8, devices_per_node=8,
                             intra_link="nvlink3", inter_link="infiniband-hdr", memory_bytes=80 * GIB),
    "a100-pcie-8": Cluster(name="a100-pcie-8", hardware="a100-pcie-80gb", devices=8, devices_per_node=8,
                           intra_link="pcie4", inter_link="infiniband-hdr", memory_bytes=80 * GIB),
    "ascend-910b-8": Cluster(name="ascend-910b-8", hardware="ascend-910b", devices=8, devices_per_node=8,
                             intra_link="hccs", inter_link="infiniband-hdr", memory_bytes=64 * GIB),
    "a100-nvlink-32": Cluster(name="a100-nvlink-32", hardware="a100-sxm4-80gb", devices=32, devices_per_node=8,
                              intra_link="nvlink3", inter_link="infiniband-hdr", memory_bytes=80 * GIB),
}


@dataclass(frozen=True, kw_only=True)
class Layout:
    tp: int
    pp: int
    dp: int
    microbatch: int
    global_batch: int
    """Sequences per iteration over all data-parallel replicas."""
    schedule: str = "1F1B"
    fsdp: bool = False
    """Shard parameters, gradients and optimizer state over the ``dp`` replicas (FSDP2 / ZeRO-3)."""

    @property
    def num_microbatches(self) -> int:
        return self.global_batch // (self.dp * self.microbatch)


@dataclass(frozen=True, kw_only=True)
class Outcome:
    strategy: str
    layers_per_stage: tuple[int, ...]
    choices: tuple[str, ...]
    """Per stage: the decision(s) its layers got."""
    iteration_s: float
    tokens_per_s: float
    mfu: float
    peak_bytes: tuple[int, ...]
    fits: bool
    need_bytes: int
    """The largest per-device peak: what the configuration would need."""

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def evaluate(profile: LayerProfile, strategy: str, cluster: Cluster, layout: Layout,
             *, result: bool = False) -> Outcome | tuple[Outcome, StepResult]:
    """Simulate ``strategy`` as described in the module docstring."""
    if strategy not in STRATEGIES:
        raise ValueError(f"unknown strategy {strategy!r}; choose one of {list(STRATEGIES)}")
    if layout.tp * layout.pp * layout.dp != cluster.devices:
        raise ValueError(f"tp x pp x dp = {layout.tp * layout.pp * layout.dp} but {cluster.name} has "
                         f"{cluster.devices} devices")
    if layout.num_microbatches < max(1, layout.pp) or layout.global_batch % (layout.dp * layout.microbatch):
        raise ValueError(f"global batch {layout.global_batch} does not split into >= {layout.pp} micro-batches "
                         f"of {layout.microbatch} on {layout.dp} replicas")
    cuts = _cuts(profile, strategy, cluster, layout)
    stages, choices = [], []
    dp_link = LINKS[cluster.inter_link if cluster.devices > cluster.devices_per_node and layout.dp > 1
                    else cluster.intra_link]
    fsdp = fsdp_comm_s(profile, layout, dp_link)
    for i, n in enumerate(cuts):
        layers, label = _stage_layers(profile, strategy, cluster, layout, i, n, fsdp)
        stages.append(StageSim(layers=tuple(layers), static_bytes=_static(profile, layout, i, n),
                               send_bytes=layout.microbatch * profile.seq_len * profile.hidden * 2))
        choices.append(label)
    p2p = LINKS[cluster.inter_link if layout.tp * layout.pp > cluster.devices_per_node else cluster.intra_link]
    grad_bytes = max(_param_bytes(profile, layout, i, n) for i, n in enumerate(cuts))
    step = StepSim(stages=tuple(stages), num_microbatches=layout.num_microbatches, schedule=layout.schedule,
                   p2p_latency_s=p2p.alpha_s, p2p_bytes_per_s=p2p.bandwidth_bytes_per_s,
                   dp_allreduce_s=0.0 if layout.fsdp else collective_time("all_reduce", grad_bytes, layout.dp, dp_link),
                   overlap_slowdown=cluster.kappa, device_memory_bytes=cluster.memory_bytes)
    res = simulate_iteration(step)
    tokens = layout.global_batch * profile.seq_len
    out = Outcome(strategy=strategy, layers_per_stage=tuple(cuts), choices=tuple(choices),
                  iteration_s=res.iteration_s, tokens_per_s=tokens / res.iteration_s,
                  mfu=model_flops(profile, layout.global_batch) / (res.iteration_s * cluster.devices * _peak(cluster)),
                  peak_bytes=tuple(res.peak_bytes), fits=res.fits, need_bytes=max(res.peak_bytes))
    return (out, res) if result else out


def model_flops(profile: LayerProfile, batch: int) -> float:
    """Megatron's model FLOPs of one iteration without recompute:
    72 B s L h^2 (1 + s / (6 h) + V / (12 h L))."""
    B, s, L, h, V = batch, profile.seq_len, profile.n_layers, profile.hidden, profile.vocab
    return 72 * B * s * L * h * h * (1 + s / (6 * h) + V / (12 * h * L))


def _peak(cluster: Cluster) -> float:
    from lynx_compile.costs import get_profile

    return get_profile(cluster.hardware).peak_flops["bfloat16"]


def _cuts(profile: LayerProfile, strategy: str, cluster: Cluster, layout: Layout) -> list[int]:
    L, p = profile.n_layers, layout.pp
    if strategy in ("lynx-heu", "lynx-opt") and p > 1:
        return _lynx_cuts(profile, strategy, cluster, layout)
    return [L // p + (1 if i < L % p else 0) for i in range(p)]


def _lynx_cuts(profile: LayerProfile, strategy: str, cluster: Cluster, layout: Layout) -> list[int]:
    """Layers per stage from lynx's recompute-aware stage planner (``plan_stages``)."""
    from lynx_compile.pipelining.pipeline_costs import PipelineCosts, SegmentCost
    from lynx_compile.pipelining.plan_stages import plan_stages
    from lynx_compile.pipelining.recompute_curve import RecomputeCurve
    from lynx_compile.pipelining.stage_plan import StagePlanError

    pts = _candidates(profile, strategy)
    curve = RecomputeCurve(kept_bytes=tuple(q.kept_bytes for q in pts),
                           exposed_s=tuple(_exposed(q, profile, cluster) for q in pts))
    comm = 2 * sum(profile.comm_s)
    block = SegmentCost(name="layer", forward_s=profile.forward_s + comm / 2, backward_s=profile.backward_s + comm / 2,
                        param_bytes=profile.layer_param_bytes, activation_bytes=profile.points["none"][0].kept_bytes,
                        curve=curve, output_bytes=layout.microbatch * profile.seq_len * profile.hidden * 2)
    costs = PipelineCosts(
        blocks=(block,) * profile.n_layers,
        pre=SegmentCost(name="<pre>", forward_s=profile.pre_s[0], backward_s=profile.pre_s[1],
                        param_bytes=profile.pre_param_bytes, activation_bytes=profile.pre_bytes),
        post=SegmentCost(name="<post>", forward_s=profile.post_s[0], backward_s=profile.post_s[1],
                         param_bytes=profile.post_param_bytes, activation_bytes=profile.post_bytes),
        working_bytes=_logits_bytes(profile, layout), state_bytes_per_param_byte=STATE_BYTES_PER_PARAM_BYTE,
        microbatch_size=layout.microbatch)
    try:
        plan = plan_stages(costs, layout.pp, layout.num_microbatches, cluster.memory_bytes, layout.schedule)
    except StagePlanError:  # nothing fits: uniform cuts, reported as OOM by the simulation
        return _cuts(profile, "none", cluster, layout)
    return list(plan.layers_per_stage)


def _candidates(profile: LayerProfile, strategy: str) -> tuple[LayerPoint, ...]:
    key = {"lynx-no-partition": "lynx-heu"}.get(strategy, strategy)
    pts = tuple(profile.points[key]) + profile.points["full"]  # every planner can recompute everything
    return tuple(sorted(pts, key=lambda q: q.kept_bytes))


def fsdp_comm_s(profile: LayerProfile, layout: Layout, link) -> tuple[float, float]:
    """(forward, backward) FSDP communication in flight per layer: the all-gather of a layer's
    bf16 parameters; in the backward that plus the reduce-scatter of its gradients in fp32.
    (0, 0) without ``layout.fsdp`` or with one replica."""
    if not layout.fsdp or layout.dp <= 1:
        return 0.0, 0.0
    gather = collective_time("all_gather", profile.layer_param_bytes, layout.dp, link)
    return gather, gather + collective_time("reduce_scatter", 2 * profile.layer_param_bytes, layout.dp, link)


def _exposed(point: LayerPoint, profile: LayerProfile, cluster: Cluster, fsdp_slack_s: float = 0.0) -> float:
    over = sum(max(0.0, cluster.kappa * r - c) for r, c in zip(point.window_s, profile.comm_s))
    return max(0.0, point.demand_s + over - fsdp_slack_s)


def fsdp_slack_s(profile: LayerProfile, fsdp: tuple[float, float]) -> float:
    """What a layer's FSDP backward communication takes beyond its backward (compute and TP
    collectives): recompute that fits there is hidden."""
    return max(0.0, fsdp[1] - profile.backward_s - sum(profile.comm_s))


def _stage_layers(profile, strategy, cluster, layout, i, n, fsdp=(0.0, 0.0)) -> tuple[list[LayerSim], str]:
    from lynx_compile.pipelining.placement import in_flight

    k = in_flight(layout.schedule, layout.pp, layout.num_microbatches, i)
    room = cluster.memory_bytes - _static(profile, layout, i, n) - _edge_bytes(profile, layout, i, k)
    if strategy in ("none", "full", "selective"):
        points = [profile.points[strategy][0]] * n
    elif strategy == "uniform":
        none, full = profile.points["none"][0], profile.points["full"][0]
        r = next((r for r in range(n + 1) if _fits([full] * r + [none] * (n - r), k, room)), n)
        points = [full] * r + [none] * (n - r)
    else:
        cands = _candidates(profile, strategy)
        fitting = [q for q in cands if _fits([q] * n, k, room)]
        slack = fsdp_slack_s(profile, fsdp) if strategy.startswith("lynx") else 0.0
        best = min(fitting, key=lambda q: _exposed(q, profile, cluster, slack)) if fitting else cands[0]
        points = [best] * n
    layers = [_layer(profile, q, fsdp) for q in points]
    if i == 0:
        layers.insert(0, LayerSim(forward_s=profile.pre_s[0], backward_s=profile.pre_s[1],
                                  kept_bytes=profile.pre_bytes, name="embed"))
    if i == layout.pp - 1:
        layers.append(LayerSim(forward_s=profile.post_s[0], backward_s=profile.post_s[1], kept_bytes=profile.post_bytes,
                               backward_transient_bytes=_logits_bytes(profile, layout), name="head"))
    labels = sorted({q.label for q in points})
    return layers, "+".join(labels)


def _fits(points: list[LayerPoint], in_flight: int, room: int) -> bool:
    kept = sum(q.kept_bytes for q in points)
    return in_flight * kept + max((q.transient_bytes for q in points), default=0) <= room


def _layer(profile: LayerProfile, q: LayerPoint, fsdp: tuple[float, float] = (0.0, 0.0)) -> LayerSim:
    return LayerSim(forward_s=profile.forward_s, backward_s=profile.backward_s, tp_forward_comm_s=profile.comm_s,
                    tp_backward_comm_s=profile.comm_s, recompute_on_demand_s=q.demand_s,
                    recompute_in_window_s=tuple(q.window_s) if q.window_s else (), kept_bytes=q.kept_bytes,
                    backward_transient_bytes=q.transient_bytes, fsdp_forward_comm_s=fsdp[0],
                    fsdp_backward_comm_s=fsdp[1], name=q.label)


def _param_bytes(profile: LayerProfile, layout: Layout, i: int, n: int) -> int:
    extra = (profile.pre_param_bytes if i == 0 else 0) + (profile.post_param_bytes if i == layout.pp - 1 else 0)
    return n * profile.layer_param_bytes + extra


def _static(profile: LayerProfile, layout: Layout, i: int, n: int) -> int:
    if layout.fsdp:  # sharded dp ways; the layer running and the one prefetched are gathered
        return _param_bytes(profile, layout, i, n) * STATE_BYTES_PER_PARAM_BYTE // layout.dp + 2 * profile.layer_param_bytes
    return _param_bytes(profile, layout, i, n) * STATE_BYTES_PER_PARAM_BYTE


def _logits_bytes(profile: LayerProfile, layout: Layout) -> int:
    return layout.microbatch * profile.seq_len * profile.vocab * 4


def _edge_bytes(profile: LayerProfile, layout: Layout, i: int, in_flight: int) -> int:
    out = in_flight * profile.pre_bytes if i == 0 else 0
    if i == layout.pp - 1:
        out += in_flight * profile.post_bytes + _logits_bytes(profile, layout)
    return out
