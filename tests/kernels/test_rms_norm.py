"""``lynx_compile.kernels.rms_norm`` under the Triton interpreter (``TRITON_INTERPRET=1``, set by
``tests/test_kernels_interpreted.py`` before this process imports triton) against the reference.

Tolerances: the kernel and the reference both sum in fp32 and round once to the output dtype,
so outputs agree to fp32 reduction-order noise (fp32: 1e-5) or one rounding of the output
dtype (fp16: 1e-3, bf16: 8e-3, relative to the values' scale). Gradients are torch math in
both, compared at the same tolerances."""
import warnings

import pytest
import torch

from lynx_compile.kernels import reference, rms_norm

COLS = [1, 9, 41, 341, 4231]
DTYPES = [(torch.float32, 1e-5), (torch.float16, 1e-3), (torch.bfloat16, 8e-3)]


@pytest.mark.parametrize("cols", COLS)
@pytest.mark.parametrize("dtype,tol", DTYPES)
def test_output_and_gradients_match_the_reference(cols, dtype, tol):
    g = torch.Generator().manual_seed(cols)
    x = torch.randn(3, cols, generator=g).to(dtype).requires_grad_()
    w = (1 + 0.1 * torch.randn(cols, generator=g)).to(dtype).requires_grad_()
    y = rms_norm(x, w)
    want = reference.rms_norm(x, w)[0]
    torch.testing.assert_close(y.float(), want.float(), atol=tol * 4, rtol=tol)
    dy = torch.randn(y.shape, generator=g).to(dtype)
    got = torch.autograd.grad(y, (x, w), dy)
    ref = torch.autograd.grad(want, (x, w), dy)
    for a, b in zip(got, ref):
        scale = b.float().abs().max().clamp_min(1.0)
        torch.testing.assert_close(a.float() / scale, b.float() / scale, atol=tol * 4, rtol=tol)


def test_leading_dims_and_rstd():
    x = torch.randn(2, 5, 64)
    w = torch.randn(64)
    y, rstd = torch.ops.lynx.rms_norm(x, w, 1e-6)
    want, want_rstd = reference.rms_norm(x, w, 1e-6)
    torch.testing.assert_close(y, want)
    torch.testing.assert_close(rstd, want_rstd)


def test_works_inside_torch_compile():
    x, w = torch.randn(4, 96), torch.randn(96)
    compiled = torch.compile(lambda a, b: rms_norm(a, b) * 2, backend="aot_eager", fullgraph=True)
    torch.testing.assert_close(compiled(x, w), reference.rms_norm(x, w)[0] * 2)


def test_non_contiguous_falls_back_with_one_warning():
    x = torch.randn(64, 8).t()  # (8, 64), not contiguous
    w = torch.randn(64)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        y1 = rms_norm(x, w)
        y2 = rms_norm(x, w)
    torch.testing.assert_close(y1, reference.rms_norm(x, w)[0])
    torch.testing.assert_close(y2, y1)
    assert sum("non-contiguous" in str(c.message) for c in caught) == 1


def test_unsupported_dtype_falls_back():
    x, w = torch.randn(2, 16, dtype=torch.float64), torch.randn(16, dtype=torch.float64)
    with pytest.warns(UserWarning, match="float64"):
        y = rms_norm(x, w)
    torch.testing.assert_close(y, reference.rms_norm(x, w)[0])
