"""Find the transformer blocks of a joint graph from module-stack metadata.

Reads ``nn_module_stack`` (forward nodes) and ``fwd_nn_module_stack`` (backward nodes), or a
user annotation ``torch.fx.traceback.annotate({"lynx_block": k})`` (``meta["custom"]``).
Writes ``meta.BLOCK`` (int) and ``meta.BLOCK_PATH`` (str) on every node inside a block,
``meta.CAUSAL_MASK`` on constant causal masks, and the
block list plus a structural hash per block (op sequence, shapes, dtypes; never names) into the
record.

A block is a child of a module list: a module path ending in ``.<int>``. No model class is
hard-coded: ``model.blocks.3``, ``transformer.h.3`` and ``layers.3`` are all found. When lists
nest (``layers.2.experts.5``) the outermost list wins, so a block is a whole layer.
"""
from __future__ import annotations

import hashlib
import re
from collections import defaultdict

import torch
import torch.fx as fx

from . import meta
from .context import PassContext
from .fuse_recompute import is_causal_mask

_INDEXED = re.compile(r"^(?P<parent>.*)\.(?P<index>\d+)$")


def normalize_module_path(path: str) -> str:
    """``"L['self'].blocks._modules['0'].ln"`` → ``"blocks.0.ln"`` (dynamo's spellings vary;
    modules torch.export unflattened appear as ``"getattr(L['self'].blocks, '0').ln"``)."""
    while "getattr(" in path:
        new = re.sub(r"getattr\(([^()]*?),\s*['\"]([^'\"]+)['\"]\)", r"\1.\2", path)
        if new == path:
            break
        path = new
    path = re.sub(r"^L\[['\"][^'\"]*['\"]\]\.?", "", path)
    path = re.sub(r"\.?_modules\[['\"]([^'\"]+)['\"]\]", r".\1", path)
    path = re.sub(r"\[['\"]?([^\]'\"]+)['\"]?\]", r".\1", path)
    return path.strip(".")


def module_paths(node: fx.Node) -> list[str]:
    """Module paths of the node's stack, outermost first (forward or backward node)."""
    stack = node.meta.get("nn_module_stack") or node.meta.get("fwd_nn_module_stack") or {}
    return [normalize_module_path(v[0]) for v in stack.values()]


def _block_of(paths: list[str]) -> str | None:
    """The outermost path in ``paths`` that ends in ``.<int>`` (a module-list child)."""
    for path in paths:
        for prefix in _prefixes(path):
            if _INDEXED.match(prefix):
                return prefix
    return None


def _prefixes(path: str) -> list[str]:
    parts = path.split(".")
    return [".".join(parts[: i + 1]) for i in range(len(parts))]


def find_blocks_pass(gm: fx.GraphModule, ctx: PassContext) -> fx.GraphModule:
    """Tag nodes with their block; record blocks in execution order with structural hashes."""
    for node in gm.graph.find_nodes(op="call_function", target=torch.ops.aten.triu.default):
        if is_causal_mask(node):
            node.meta[meta.CAUSAL_MASK] = True
    by_path: dict[str, list[fx.Node]] = defaultdict(list)
    for node in gm.graph.nodes:
        custom = node.meta.get("custom") or {}
        path = custom.get("lynx_block")
        path = str(path) if path is not None else _block_of(module_paths(node))
        if path is not None:
            by_path[path].append(node)
    # Keep only the most common list parent: stray indexed paths (e.g. a Sequential head)
    # must not become "blocks".
    parents: dict[str, int] = defaultdict(int)
    for path in by_path:
        m = _INDEXED.match(path)
        parents[m.group("parent") if m else ""] += 1
    if not parents:
        return _whole_graph_block(gm, ctx)
    parent = max(parents, key=lambda p: (parents[p], -len(p)))
    paths = [p for p in by_path if (_INDEXED.match(p).group("parent") if _INDEXED.match(p) else "") == parent]
    paths.sort(key=lambda p: int(_INDEXED.match(p).group("index")) if _INDEXED.match(p) else 0)
    for index, path in enumerate(paths):
        for node in by_path[path]:
            node.meta[meta.BLOCK] = index
            node.meta[meta.BLOCK_PATH] = path
    sourced = _adopt_sources(gm)
    ctx.record.blocks = paths
    # Constants and masks (computed from no activation) are left out of the hash: merged by CSE,
    # one block's causal mask serves every block, and the blocks are still the same layer.
    ctx.record.block_hashes = [structural_hash([n for n in by_path[p] if "nn_module_stack" in n.meta
                                                and not sourced[n]]) for p in paths]
    return gm


WHOLE_GRAPH = "(whole graph)"


def _whole_graph_block(gm: fx.GraphModule, ctx: PassContext) -> fx.GraphModule:
    """No module-list children: the graph is one block, or part of one (a block compiled on its
    own, torchtitan-style, or a piece between graph breaks). It may recompute everything but
    its inputs, so every node traced from the model's modules is block 0."""
    calls = [n for n in gm.graph.nodes if n.op == "call_function"]
    nodes = [n for n in calls if module_paths(n)] or calls  # (a function compiled on its own: all of it)
    for node in nodes:
        node.meta[meta.BLOCK] = 0
        node.meta[meta.BLOCK_PATH] = WHOLE_GRAPH
    sourced = _adopt_sources(gm)
    ctx.record.blocks = [WHOLE_GRAPH]
    ctx.record.block_hashes = [structural_hash([n for n in nodes if n.name in ctx.forward_names and not sourced[n]])]
    ctx.record.notes.append(
        "no module-list children (e.g. model.layers.3) in this graph: it is treated as one block "
        "(a block compiled on its own, or a piece between graph breaks); its inputs stay saved")
    return gm


def _adopt_sources(gm: fx.GraphModule) -> dict[fx.Node, bool]:
    """Give a block to the nodes computed from no activation that only that block uses; take it
    from those several blocks use (a causal mask CSE merged: it is no one block's to recompute).
    Returns, per node, whether it is computed from no activation.

    Inductor's RNG replacement inserts ``inductor_lookup_seed`` → ``inductor_random`` (and its
    comparison into a mask) with no module stack; masks built from ``arange``/``full`` can look
    the same. Without a block such a node is "outside the blocks": saved by ``full``, and a
    tensor crossing into a block for the optimizer. Its inputs are only other such nodes (or
    the shared seeds tensor, which stays outside), so it belongs to the block that reads it.
    Walked consumers first, so chains are adopted whole."""
    sourced: dict[fx.Node, bool] = {}
    for node in gm.graph.nodes:  # computed from no placeholder, directly or through others
        sourced[node] = node.op == "call_function" and all(sourced.get(a, False) for a in node.all_input_nodes)
    for node in reversed(gm.graph.nodes):
        if not sourced[node] or not node.users:
            continue
        blocks = {u.meta.get(meta.BLOCK, -1) for u in node.users}
        if len(blocks) > 1:
            node.meta.pop(meta.BLOCK, None)
            node.meta.pop(meta.BLOCK_PATH, None)
        elif meta.BLOCK not in node.meta and (block := blocks.pop()) != -1:
            user = next(iter(node.users))
            node.meta[meta.BLOCK] = block
            node.meta[meta.BLOCK_PATH] = user.meta[meta.BLOCK_PATH]
    return sourced


_ADDRESS = re.compile(r" at 0x[0-9a-fA-F]+")


def without_addresses(text: str) -> str:
    """``text`` with every object address of a ``repr`` (`` at 0x7f...``) taken out: another in
    every process, so never part of a hash or key that processes compare."""
    return _ADDRESS.sub("", text)


def structural_hash(nodes: list[fx.Node]) -> str:
    """Hash of an op sequence with shapes and dtypes (names excluded), so that identical layers
    hash equal. For blocks, only forward ops are passed in (nodes traced in the forward carry
    ``nn_module_stack``; the first block's backward lacks the input-gradient ops)."""
    h = hashlib.sha1()
    for node in nodes:
        # a plain Python function's str holds its address, another in every process (torch.sym_sum
        # in deepseek_v3's expert-parallel MoE block: its ranks' hashes differed, and so did their
        # plan fingerprints and plan-cache keys)
        h.update(without_addresses(str(node.target)).encode())
        val = node.meta.get("val")
        vals = val if isinstance(val, (tuple, list)) else (val,)
        for v in vals:
            if isinstance(v, torch.Tensor):
                h.update(f"{tuple(v.shape)}{v.dtype}".encode())
    return h.hexdigest()[:16]
