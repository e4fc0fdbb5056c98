"""``forward_census``: one forward of the model, counting per segment its parameters and the
weight-gradient share of its backward (for ``profile.profile_pipeline``).

Parameters are attributed by module path (blocks) and by call order (modules called before the
first block are ``pre``, after the last ``post``; a tied weight counts on both sides, because
both end stages hold a copy).

Each segment's ``weight_backward_s`` (the W of a zero-bubble schedule) is its ``backward_s`` times
the weight-gradient share of its matmul FLOPs, counted in the same forward run: every forward
matmul has one backward matmul of its own size per operand it differentiates, and for an
operand that is a parameter (``x @ W.T``) that matmul is W (``dW = dy.T @ x``), the rest is B::

    share = FLOPs(forward matmuls reading a parameter) / (2 x FLOPs(all forward matmuls))

A GPT block: 24Bsh^2 / (48Bsh^2 + 8Bs^2h) = 3h / (6h + s). Memory-bound backward work
(norms, softmax, dropout) is scaled with the matmuls, not attributed op by op; the
embedding's scatter-add (a weight gradient without a matmul) counts as B.
"""
from __future__ import annotations

from typing import Any, Callable, Sequence

import torch
from torch import nn
from torch.utils.flop_counter import flop_registry

from lynx_compile import _compat
from lynx_compile.costs.analytic import FLOP_FORMULA_ALIASES


def param_bytes(module: nn.Module, example_inputs: Sequence[Any], block_paths: list[str]) -> dict[str, int]:
    """Parameter bytes per block path, plus ``<pre>`` / ``<post>`` by module call order."""
    return forward_census(module, example_inputs, block_paths)[0]


def forward_census(module: nn.Module, example_inputs: Sequence[Any],
                   block_paths: list[str]) -> tuple[dict[str, int], dict[str, float]]:
    """One forward of ``module`` (no grad): per block path and ``<pre>`` / ``<post>`` (module
    call order), its parameter bytes and the weight-gradient share of its backward (module
    docstring)."""
    names = {m: name for name, m in module.named_modules()}
    order: list[str] = []
    matmuls: list[tuple[int, float, bool]] = []  # (index in ``order`` of the module running, FLOPs, reads a parameter)

    def hook(mod: nn.Module, args: Any) -> None:
        if mod in names:
            order.append(names[mod])

    handle = nn.modules.module.register_module_forward_pre_hook(hook)
    try:
        with torch.no_grad(), _MatmulCensus({id(p) for p in module.parameters()},
                                            lambda flops, param: matmuls.append((len(order) - 1, flops, param))):
            module(*example_inputs)
    finally:
        handle.remove()

    # the traced paths (``_fn.__self__.blocks.3`` when the forward is a bound method of the
    # model) name the block modules as dynamo reached them; match them by module
    named = {b: names.get(_resolve(module, b), b) for b in block_paths}

    def block_of(path: str) -> str | None:
        return next((b for b, m in named.items() if path == m or path.startswith(m + ".")), None)

    first = next((i for i, p in enumerate(order) if block_of(p)), 0)
    last = max((i for i, p in enumerate(order) if block_of(p)), default=len(order))

    def side(i: int) -> str:
        blk = block_of(order[i]) if 0 <= i < len(order) else None
        return blk if blk else ("<pre>" if i < first else "<post>" if i > last else "<pre>")

    sides: dict[int, set[str]] = {}
    owner: dict[int, nn.Parameter] = {}
    for i, path in enumerate(order):
        mod = module.get_submodule(path) if path else module
        for p in mod.parameters(recurse=False):
            sides.setdefault(id(p), set()).add(side(i))
            owner[id(p)] = p
    params = {p: 0 for p in block_paths}
    params["<pre>"] = params["<post>"] = 0
    for pid, where in sides.items():
        p = owner[pid]
        for s in where:
            params[s] += p.numel() * p.element_size()
    flops = {s: [0.0, 0.0] for s in params}  # [all matmuls, those reading a parameter]
    for i, f, reads_param in matmuls:
        flops[side(i)][0] += f
        flops[side(i)][1] += f if reads_param else 0.0
    share = {s: w / (2 * total) if total else 0.0 for s, (total, w) in flops.items()}
    return params, share


class _MatmulCensus(_compat.dispatch_mode_base()):
    """Reports the FLOPs of every matmul-like aten op (torch's flop formulas) a forward runs and
    whether an operand is a parameter or a view of one (``W.t()``)."""

    def __init__(self, param_ids: set[int], report: Callable[[float, bool], None]):
        super().__init__()
        self.param_ids, self.report = param_ids, report

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        packet = func.overloadpacket
        formula = flop_registry.get(FLOP_FORMULA_ALIASES.get(packet, packet))
        if formula is not None:
            try:
                flops = float(formula(*args, **kwargs, out_val=out))
            except Exception:  # noqa: BLE001 - a formula this op's arguments do not fit: not a matmul here
                return out
            self.report(flops, any(self._is_param(a) for a in args))
        return out

    def _is_param(self, t: Any) -> bool:
        return isinstance(t, torch.Tensor) and (id(t) in self.param_ids or
                                                (t._base is not None and id(t._base) in self.param_ids))


def _resolve(module: nn.Module, path: str) -> Any:
    """The object at dotted ``path`` from ``module`` (attributes and module-list indices), or None."""
    obj: Any = module
    for part in path.split("."):
        obj = getattr(obj, part, None)
        if obj is None:
            return None
    return obj
