"""``lynx_compile.kernels.layer_norm`` under the Triton interpreter (``TRITON_INTERPRET=1``, set by
``tests/test_kernels_interpreted.py`` before this process imports triton) against the reference
and against ``torch.nn.functional.layer_norm``.

Tolerances as in test_rms_norm.py: the kernel and the reference both sum in fp32 and round once to
the output dtype, so outputs agree to fp32 reduction-order noise (fp32: 1e-5) or one rounding of
the output dtype (fp16: 1e-3, bf16: 8e-3, relative to the values' scale). Gradients are torch math
in both, compared at the same tolerances, each scaled by the larger of 1 and its max magnitude.
The F.layer_norm oracle runs in fp32 on the same (already rounded) inputs, so for fp16/bf16 it
differs from ours by that one final rounding, within the same tolerances."""
import warnings

import pytest
import torch
import torch.nn.functional as F

from lynx_compile.kernels.reference import layer_norm as reference
from lynx_compile.kernels.layer_norm import layer_norm

COLS = [1, 9, 41, 341, 4231]
DTYPES = [(torch.float32, 1e-5), (torch.float16, 1e-3), (torch.bfloat16, 8e-3)]
AFFINE = [(True, True), (True, False), (False, True), (False, False)]


def _inputs(cols, dtype, has_w, has_b, seed):
    g = torch.Generator().manual_seed(seed)
    x = (0.5 + 2 * torch.randn(3, cols, generator=g)).to(dtype).requires_grad_()  # nonzero mean
    w = (1 + 0.1 * torch.randn(cols, generator=g)).to(dtype).requires_grad_() if has_w else None
    b = (0.1 * torch.randn(cols, generator=g)).to(dtype).requires_grad_() if has_b else None
    dy = torch.randn(3, cols, generator=g).to(dtype)
    return x, w, b, dy


def _close(a, b, tol, scaled=False):
    scale = b.float().abs().max().clamp_min(1.0) if scaled else 1.0
    torch.testing.assert_close(a.float() / scale, b.float() / scale, atol=tol * 4, rtol=tol)


def _check(cols, dtype, tol, has_w, has_b):
    x, w, b, dy = _inputs(cols, dtype, has_w, has_b, seed=cols)
    leaves = [t for t in (x, w, b) if t is not None]
    y = layer_norm(x, w, b)
    assert y.dtype == dtype and y.shape == x.shape
    got = torch.autograd.grad(y, leaves, dy)
    # the reference, same dtype
    want = reference(x, w, b, 1e-5)[0]
    _close(y, want, tol)
    for a, r in zip(got, torch.autograd.grad(want, leaves, dy)):
        _close(a, r, tol, scaled=True)
    # torch.nn.functional.layer_norm in fp32 on the same inputs
    f32 = [t.detach().float().requires_grad_() for t in leaves]
    it = iter(f32)
    xf, wf, bf = next(it), (next(it) if has_w else None), (next(it) if has_b else None)
    want32 = F.layer_norm(xf, (cols,), wf, bf, 1e-5)
    _close(y, want32, tol)
    for a, r in zip(got, torch.autograd.grad(want32, f32, dy.float())):
        assert a.dtype == dtype
        _close(a, r, tol, scaled=True)


@pytest.mark.parametrize("cols", COLS)
@pytest.mark.parametrize("dtype,tol", DTYPES)
def test_output_and_gradients_match_the_reference_and_torch(cols, dtype, tol):
    _check(cols, dtype, tol, True, True)


@pytest.mark.parametrize("has_w,has_b", AFFINE[1:])
@pytest.mark.parametrize("cols", [1, 41, 341])
@pytest.mark.parametrize("dtype,tol", [DTYPES[0], DTYPES[2]])
def test_without_weight_or_bias(cols, dtype, tol, has_w, has_b):
    _check(cols, dtype, tol, has_w, has_b)


def test_leading_dims_mean_and_rstd():
    x, w, b = torch.randn(2, 5, 64) + 3, torch.randn(64), torch.randn(64)
    y, mean, rstd = torch.ops.lynx.layer_norm(x, w, b, 1e-5)
    want, want_mean, want_rstd = reference(x, w, b, 1e-5)
    assert mean.shape == rstd.shape == (2, 5) and mean.dtype == rstd.dtype == torch.float32
    torch.testing.assert_close(y, want)
    torch.testing.assert_close(mean, want_mean)
    torch.testing.assert_close(rstd, want_rstd)
    torch.testing.assert_close(y, F.layer_norm(x, (64,), w, b))


def test_half_input_fp32_stats():
    x = torch.randn(4, 33).to(torch.bfloat16)
    y, mean, rstd = torch.ops.lynx.layer_norm(x, None, None, 1e-5)
    assert y.dtype == torch.bfloat16 and mean.dtype == rstd.dtype == torch.float32


def test_weight_of_wrong_size_is_rejected():
    with pytest.raises(ValueError, match="bias has 7 elements"):
        layer_norm(torch.randn(2, 8), torch.ones(8), torch.zeros(7))


@pytest.mark.parametrize("has_w,has_b", [(True, True), (False, False)])
def test_works_inside_torch_compile(has_w, has_b):
    x = torch.randn(4, 96, requires_grad=True)
    w = torch.randn(96, requires_grad=True) if has_w else None
    b = torch.randn(96, requires_grad=True) if has_b else None
    compiled = torch.compile(lambda a, c, d: layer_norm(a, c, d) * 2, backend="aot_eager", fullgraph=True)
    y = compiled(x, w, b)
    want = reference(x, w, b, 1e-5)[0] * 2
    torch.testing.assert_close(y, want)
    leaves = [t for t in (x, w, b) if t is not None]
    dy = torch.randn_like(y)
    for a, r in zip(torch.autograd.grad(y, leaves, dy), torch.autograd.grad(want, leaves, dy)):
        torch.testing.assert_close(a, r)


def test_non_contiguous_falls_back_with_one_warning():
    x = torch.randn(64, 8).t()  # (8, 64), not contiguous
    w, b = torch.randn(64), torch.randn(64)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        y1 = layer_norm(x, w, b)
        y2 = layer_norm(x, w, b)
    torch.testing.assert_close(y1, reference(x, w, b, 1e-5)[0])
    torch.testing.assert_close(y2, y1)
    assert sum("non-contiguous" in str(c.message) for c in caught) == 1


def test_unsupported_dtype_falls_back():
    x = torch.randn(2, 16, dtype=torch.float64)
    w, b = torch.randn(16, dtype=torch.float64), torch.randn(16, dtype=torch.float64)
    with pytest.warns(UserWarning, match="float64"):
        y = layer_norm(x, w, b)
    torch.testing.assert_close(y, reference(x, w, b, 1e-5)[0])
    # the reference does fp32 math whatever the input, so a float64 result has fp32 precision
    torch.testing.assert_close(y, F.layer_norm(x, (16,), w, b), atol=1e-5, rtol=1e-5)
