"""Every ``node.meta`` key lynx reads or writes, declared once.

Passes document which of these they read and write; nothing else in lynx invents meta keys.
"""

#: ``lynx_compile.costs.NodeCost`` of the node (runtime, output bytes, FLOPs, bytes moved).
COST = "lynx_cost"
#: ``int`` index of the transformer block the node belongs to (forward and backward), or absent.
BLOCK = "lynx_block"
#: ``str`` qualified module path of that block (e.g. ``"blocks.3"``).
BLOCK_PATH = "lynx_block_path"
#: ``str`` the policy whose decision tagged the node (``"full"``, ``"selective"``, ``"lynx"``...).
ROLE = "lynx_role"
#: ``lynx_compile.decisions.Demand()`` or ``Window(collective)`` on recomputed nodes (forward
#: nodes of the joint graph and their backward copies); absent on kept ones.
DECISION = "lynx_decision"
#: ``bool`` set on backward-graph nodes that are copies of forward nodes (recomputation).
RECOMPUTED = "lynx_recomputed"
#: ``str`` name of the forward node a recomputed node copies.
RECOMPUTED_FROM = "lynx_recomputed_from"
#: ``int`` side-stream segment a backward node (or its begin / end / wait marker) belongs to.
SIDE_STREAM = "lynx_side_stream"
#: ``True`` on a forward ``triu(ones(T, T), 1)`` node (a constant causal mask), set by
#: ``find_blocks_pass``; the partitioner copies it onto the backward placeholder when the mask is
#: saved (one mask that several blocks share, after CSE) so the fused causal softmax still knows it.
CAUSAL_MASK = "lynx_causal_mask"
#: ``str`` on nodes ``offload_pass`` inserts: ``"offload"`` / ``"offload_wait"`` (forward),
#: ``"host"`` (the backward input holding the host copy), ``"reload"`` / ``"reload_wait"``.
OFFLOAD = "lynx_offload"
#: ``lynx_compile.costs.HardwareProfile`` in a joint ``GraphModule``'s own ``meta`` (the graph's,
#: not a node's), set by ``annotate_costs_pass`` where Inductor compiles the graph and costs are
#: analytic: recompute is then priced by kernel (``lynx_compile.costs.inductor_kernels``).
KERNEL_PROFILE = "lynx_kernel_profile"
