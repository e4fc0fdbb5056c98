"""lynx's graph passes, in the order they run. Each is ``(gm, ctx) -> gm``; see README.md here.

``JOINT_PIPELINE`` analyses the aot_autograd joint graph (costs, blocks); a policy then decides
(``lynx_compile.recompute.decide``); ``APPLY_PIPELINE`` tags its ``Decisions`` on the joint graph before
each partition; ``FORWARD_PIPELINE`` / ``BACKWARD_PIPELINE`` run on the partitioned forward /
backward graphs. ``POST_GRAD_PIPELINE`` runs inside Inductor (``compiler="inductor"``), on each
graph it compiles after its own post-grad passes, for lynx's own placements
(``lynx_compile.compiler.inductor_partition.LynxPostGrad``). Disable one with
``options={"disable_passes": ("<name>",)}``.
"""
from .alias_clones import alias_clones_pass
from .annotate_costs import annotate_costs_pass
from .apply_decisions import apply_decisions_pass
from .context import GraphRecord, PassContext, graph_budget
from .find_blocks import find_blocks_pass
from .fuse_recompute import fuse_recompute_pass
from .insert_recompute import insert_recompute_pass
from .mark_recomputed import mark_recomputed_pass
from .offload import offload_backward_pass, offload_forward_pass
from .pin_windows import pin_windows_pass
from .runner import run_passes
from .side_stream import side_stream_pass
from .split_late_addmm import split_late_addmm_pass
from .split_shared_pointwise import split_shared_pointwise_pass

PREPARE_PIPELINE = (alias_clones_pass,)
"""Runs on the joint graph before anything is measured from it (the no-recompute reference)."""
JOINT_PIPELINE = (annotate_costs_pass, find_blocks_pass)
APPLY_PIPELINE = (apply_decisions_pass,)
FORWARD_PIPELINE = (offload_forward_pass,)
BACKWARD_PIPELINE = (mark_recomputed_pass, insert_recompute_pass, fuse_recompute_pass,
                     offload_backward_pass, side_stream_pass)
POST_GRAD_PIPELINE = (split_late_addmm_pass, split_shared_pointwise_pass, pin_windows_pass)
"""Inductor's post-grad graphs of lynx's own placements; ``pin_windows_pass`` last: it orders
what the others placed."""



def check_pass_names(names: tuple[str, ...]) -> None:
    """``ValueError`` naming the passes when one of ``names`` (option ``disable_passes``) is no
    pass of the ``*_PIPELINE`` tuples here."""
    known = [p.__name__ for attr, value in sorted(globals().items()) if attr.endswith("_PIPELINE") for p in value]
    unknown = [n for n in names if n not in known]
    if unknown:
        raise ValueError(f"disable_passes: unknown pass(es) {unknown}; passes are {known}")


__all__ = ["check_pass_names", "PREPARE_PIPELINE", "JOINT_PIPELINE", "APPLY_PIPELINE", "FORWARD_PIPELINE",
           "BACKWARD_PIPELINE", "POST_GRAD_PIPELINE", "GraphRecord", "PassContext", "graph_budget", "run_passes",
           "annotate_costs_pass", "find_blocks_pass", "apply_decisions_pass", "mark_recomputed_pass",
           "insert_recompute_pass", "fuse_recompute_pass", "offload_forward_pass", "offload_backward_pass",
           "side_stream_pass", "alias_clones_pass", "split_late_addmm_pass", "split_shared_pointwise_pass",
           "pin_windows_pass"]
