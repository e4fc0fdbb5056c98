"""Every ``node.meta`` key lynx reads or writes, declared once.

Passes document which of these they read and write; nothing else in lynx invents meta keys.
"""

#: ``lynx_compile.costs.NodeCost`` of the node (runtime, output bytes, FLOPs, bytes moved).
COST = "lynx_cost"
#: ``int`` index of the transformer block the node belongs to (forward and backward), or absent.
BLOCK = "lynx_block"
#: ``str`` qualified module path of that block (e.g. ``"blocks.3"``).
BLOCK_PATH = "lynx_block_path"
#: ``str`` role inside the block as the policy sees it (e.g. ``"attn_core"``), or absent.
ROLE = "lynx_role"
#: ``str`` the policy's decision for a forward node: ``"save"`` or ``"recompute"``.
DECISION = "lynx_decision"
#: ``bool`` set on backward-graph nodes that are copies of forward nodes (recomputation).
RECOMPUTED = "lynx_recomputed"
#: ``str`` name of the forward node a recomputed node copies.
RECOMPUTED_FROM = "lynx_recomputed_from"
#: ``int`` side-stream segment a backward node (or its begin / end / wait marker) belongs to.
SIDE_STREAM = "lynx_side_stream"
