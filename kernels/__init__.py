"""Fused Triton recompute kernels (``lynx_compile.kernels``).

Empty until issue E lands (LayerNorm/RMSNorm, bias+GeLU, SwiGLU, dropout-mask regeneration,
causal softmax and bias+dropout+residual kernels, each with a pure-torch reference).
"""
