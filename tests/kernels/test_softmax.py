"""``lynx_compile.kernels.causal_softmax`` under the Triton interpreter against the reference and
against the zoo's attention math (scores * scale, masked_fill(-inf), softmax). Tolerances as in
test_rms_norm.py (fp32 math in both; one rounding of the output dtype)."""
import math
import warnings

import pytest
import torch

from lynx_compile.kernels import causal_softmax
from lynx_compile.kernels.reference import causal_softmax as reference

DTYPES = [(torch.float32, 1e-5), (torch.float16, 1e-3), (torch.bfloat16, 8e-3)]


@pytest.mark.parametrize("T", [1, 9, 41, 341])
@pytest.mark.parametrize("dtype,tol", DTYPES)
def test_output_and_gradient_match_the_reference(T, dtype, tol):
    g = torch.Generator().manual_seed(T)
    s = torch.randn(2, 2, T, T, generator=g).to(dtype).requires_grad_()
    scale = 1 / math.sqrt(16)
    y = causal_softmax(s, scale)
    want = reference(s, scale)
    torch.testing.assert_close(y.float(), want.float(), atol=tol, rtol=tol)
    assert (y.float().triu(1) == 0).all()
    dy = torch.randn(y.shape, generator=g).to(dtype)
    (got,), (ref,) = torch.autograd.grad(y, (s,), dy), torch.autograd.grad(want, (s,), dy)
    torch.testing.assert_close(got.float(), ref.float(), atol=tol * 4, rtol=tol)


def test_matches_the_zoo_attention_math():
    T = 32
    s = torch.randn(2, 4, T, T)
    future = torch.ones(T, T, dtype=torch.bool).triu(1)
    want = torch.softmax((s * 0.25).masked_fill(future, float("-inf")), dim=-1)
    torch.testing.assert_close(causal_softmax(s, 0.25), want)


def test_long_rows():
    s = torch.randn(1, 1, 4231, 4231)[..., :64, :64].contiguous()  # odd storage, contiguous copy
    torch.testing.assert_close(causal_softmax(s, 0.5), reference(s, 0.5))


def test_works_inside_torch_compile():
    s = torch.randn(2, 8, 8)
    compiled = torch.compile(lambda x: causal_softmax(x, 0.5) + 1, backend="aot_eager", fullgraph=True)
    torch.testing.assert_close(compiled(s), reference(s, 0.5) + 1)


def test_non_square_is_an_error_and_non_contiguous_falls_back_once():
    with pytest.raises(ValueError, match=r"\(\.\.\., T, T\)"):
        causal_softmax(torch.randn(2, 3, 4))
    s = torch.randn(2, 16, 16).transpose(-1, -2)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        y = causal_softmax(s)
        causal_softmax(s)
    torch.testing.assert_close(y, reference(s))
    assert sum("non-contiguous" in str(c.message) for c in caught) == 1
