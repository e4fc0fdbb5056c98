"""The user's own recompute choices on a joint graph: ``torch.utils.checkpoint`` regions and
selective activation checkpointing (SAC) policies (issue U).

When a model wraps code in ``torch.utils.checkpoint(..., use_reentrant=False)`` (HF's
``gradient_checkpointing_enable()``, torchtitan's full AC) or gives it a SAC ``context_fn``
(torchtitan's selective AC), AOTAutograd traces it into the joint graph with torch's checkpoint
tags on each forward node: ``meta["recompute"]`` (a ``CheckpointPolicy``) and
``meta["ac_graph_id"]`` (the region). lynx writes the same tags to apply its own decisions
(``apply_decisions_pass`` clears them first), so they are read here before anything touches them:

    read(joint)            -> UserTags | None    (None: the user tagged nothing)
    tags.restore(joint)    the user's tags back on the joint, as traced (the user's partition)
    tags.pin_must_save(gm) MUST_SAVE back on the nodes the user said to save (over lynx's tags)

How they are used (``lynx_compile.recompute.partition``): with no budget the graph is partitioned
as torch.compile partitions it with the same tags; with a budget the user's partition is a
candidate and its memory the most lynx's plan may use, and MUST_SAVE values are always saved.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch.fx as fx
from torch.utils.checkpoint import CheckpointPolicy

_RECOMPUTE = (CheckpointPolicy.MUST_RECOMPUTE, CheckpointPolicy.PREFER_RECOMPUTE)


@dataclass(frozen=True)
class UserTags:
    """Per tagged node name: its ``CheckpointPolicy`` and its region (``ac_graph_id``)."""

    policy: tuple[tuple[str, CheckpointPolicy], ...]
    region: tuple[tuple[str, object], ...]

    @property
    def recompute(self) -> frozenset[str]:
        """Nodes the user's regions or SAC policy recompute (MUST_ / PREFER_RECOMPUTE)."""
        return frozenset(n for n, p in self.policy if p in _RECOMPUTE)

    @property
    def must_save(self) -> frozenset[str]:
        """Nodes a SAC policy says MUST_SAVE."""
        return frozenset(n for n, p in self.policy if p == CheckpointPolicy.MUST_SAVE)

    @property
    def regions(self) -> int:
        return len({r for _, r in self.region})

    def summary(self) -> dict:
        """What the plan record says came from the user."""
        return {"regions": self.regions, "recompute": len(self.recompute), "must_save": len(self.must_save),
                "tagged": len(self.policy)}

    def describe(self) -> str:
        s = self.summary()
        return (f"the user's checkpointing: {s['regions']} region(s), {s['recompute']} op(s) tagged to recompute, "
                f"{s['must_save']} MUST_SAVE")

    def restore(self, gm: fx.GraphModule) -> None:
        """The user's tags back on ``gm``'s nodes, as traced (other nodes' tags cleared)."""
        policy, region = dict(self.policy), dict(self.region)
        for node in gm.graph.nodes:
            node.meta.pop("recompute", None)
            node.meta.pop("ac_graph_id", None)
            if node.name in policy:
                node.meta["recompute"] = policy[node.name]
                if node.name in region:
                    node.meta["ac_graph_id"] = region[node.name]

    def pin_must_save(self, gm: fx.GraphModule) -> None:
        """``MUST_SAVE`` on every node the user said to save: the partitioner saves it whatever
        else is tagged to recompute (torch's min-cut never recomputes a MUST_SAVE node)."""
        keep = self.must_save
        if not keep:
            return
        for node in gm.graph.nodes:
            if node.name in keep:
                node.meta["recompute"] = CheckpointPolicy.MUST_SAVE


def read(gm: fx.GraphModule) -> UserTags | None:
    """The checkpoint tags on ``gm`` as traced (before lynx writes any), or None when none."""
    policy, region = [], []
    for node in gm.graph.nodes:
        p = node.meta.get("recompute")
        if isinstance(p, CheckpointPolicy):
            policy.append((node.name, p))
            if "ac_graph_id" in node.meta:
                region.append((node.name, node.meta["ac_graph_id"]))
    return UserTags(policy=tuple(policy), region=tuple(region)) if policy else None
