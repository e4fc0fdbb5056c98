"""Tensor parallelism for Llama through PyTorch's DTensor API, the way a user would write it.

The same sharding as ``tensor_parallel.py`` (column: wq, wk, wv, w1, w3; row: wo, w2), but
expressed as a ``parallelize_module`` plan, as torchtitan does::

    attention_norm(x) (plain, replicated)
      -> wq / wk / wv  ColwiseParallel: input hook wraps x as Replicate DTensor, weight Shard(0),
                       output to_local() -> (B, T, heads / tp * hd)      (use_local_output=True)
      -> attention on the local heads (plain tensors)
      -> wo            RowwiseParallel: input Shard(-1), weight Shard(1), output Partial
                       -> redistribute to Replicate (all-reduce) -> to_local() -> (B, T, C)

Parameters of the parallel layers become DTensors (gradients too: ``grad.full_tensor()``, or
:func:`lynx_compile.distributed.tensor_parallel.full_gradients`); everything else stays a plain
replicated tensor. Under ``torch.compile`` the DTensor redistributions lower to the same
``_c10d_functional`` collectives as the hand-written path. No sequence parallelism here.
"""
from __future__ import annotations

from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

from lynx_compile.distributed.tensor_parallel import check_tp_divisible
from lynx_compile.models.llama import Llama

LLAMA_BLOCK_PLAN = {
    "attn.wq": "colwise",
    "attn.wk": "colwise",
    "attn.wv": "colwise",
    "attn.wo": "rowwise",
    "mlp.w1": "colwise",
    "mlp.w3": "colwise",
    "mlp.w2": "rowwise",
}
"""Block-relative module path -> parallel style, for every Llama block."""


def dtensor_parallelize(model: nn.Module, mesh: DeviceMesh) -> nn.Module:
    """Shard every block of a full :class:`Llama` over the 1-D ``mesh``, in place.

    Applies ``parallelize_module`` with ``ColwiseParallel`` / ``RowwiseParallel`` (both
    ``use_local_output=True``, as torchtitan) per :data:`LLAMA_BLOCK_PLAN` and sets each
    attention's local head counts. Weights are distributed from mesh rank 0, so ranks need not
    have identical copies. Raises TypeError for other models and ValueError when the mesh size
    does not divide n_heads, n_kv_heads or the ffn width.
    """
    if not isinstance(model, Llama):
        raise TypeError(f"dtensor_parallelize supports Llama, got {type(model).__name__}")
    if mesh.ndim != 1:
        raise ValueError(f"dtensor_parallelize needs a 1-D mesh, got {mesh.ndim}-D")
    tp = mesh.size()
    check_tp_divisible(model, tp)
    styles = {"colwise": ColwiseParallel, "rowwise": RowwiseParallel}
    plan = {path: styles[style](use_local_output=True) for path, style in LLAMA_BLOCK_PLAN.items()}
    for block in model.blocks:
        parallelize_module(block, mesh, plan)
        block.attn.n_heads //= tp
        block.attn.n_kv_heads //= tp
    return model
