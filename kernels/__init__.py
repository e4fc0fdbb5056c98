"""Fused Triton recompute kernels (``lynx_compile.kernels``), usable on their own.

Each kernel is a sandwich: ``@triton.jit`` kernel, launcher, ``torch.library`` custom op
(``lynx::<name>``, with a fake so it works inside ``torch.compile``), public function; the
pure-torch reference of each lives in ``lynx_compile.kernels.reference`` (test oracle, CPU
fallback, benchmark baseline). Without CUDA (and without ``TRITON_INTERPRET=1``), or for a
non-contiguous input or an unsupported dtype, a kernel computes the reference and warns once.

Built so far (issue E in progress): ``rms_norm``, ``causal_softmax``.
"""
from .rms_norm import rms_norm
from .softmax import causal_softmax

__all__ = ["causal_softmax", "rms_norm"]
