"""Fused Triton recompute kernels (``lynx_compile.kernels``), usable on their own.

Each kernel is a sandwich: ``@triton.jit`` kernel, launcher, ``torch.library`` custom op
(``lynx::<name>``, with a fake so it works inside ``torch.compile``), public function; the
pure-torch reference of each lives in ``lynx_compile.kernels.reference`` (test oracle, CPU
fallback, benchmark baseline). Without CUDA (and without ``TRITON_INTERPRET=1``), or for a
non-contiguous input or an unsupported dtype, a kernel computes the reference and warns once.

Kernels: ``rms_norm``, ``layer_norm`` (recompute a norm from its saved input), ``bias_gelu``,
``swiglu`` (activation recompute), ``dropout`` / ``dropout_mask`` / ``bias_dropout_add`` (masks
regenerated from a Philox seed and offset, bit-identical to the forward's, never saved),
``causal_softmax`` (the non-flash attention path).
"""
from .activations import bias_gelu, swiglu
from .dropout import bias_dropout_add, dropout, dropout_mask
from .layer_norm import layer_norm
from .rms_norm import rms_norm
from .softmax import causal_softmax

__all__ = ["bias_dropout_add", "bias_gelu", "causal_softmax", "dropout", "dropout_mask", "layer_norm",
           "rms_norm", "swiglu"]
