"""``lynx_compile.kernels.dropout`` under the Triton interpreter (``TRITON_INTERPRET=1``) against the
pure-torch reference (``lynx_compile.kernels.reference``), which reimplements Triton's Philox ``tl.rand`` without triton.

Masks are compared bit for bit (torch.equal). Values: kernel and reference both compute
x * fp32(1 / (1 - p)) in fp32 and round once to the output dtype, so they agree to one rounding
of the output dtype at most (fp32: 1e-6, fp16: 1e-3, bf16: 8e-3 relative). fp32 and fp16 come out
bit-equal; bf16 differs by up to 1 ulp because the Triton interpreter casts fp32 -> bf16 by
truncation where torch rounds to nearest even (an interpreter artefact, not a mask difference). bias_dropout_add adds residual + (x + bias) * scale in fp32 in both (same tolerances,
4x absolute); dbias is an fp32 sum over rows in both (reduction-order noise, relative to its scale).
"""
import math
import warnings

import pytest
import torch

from lynx_compile.kernels import reference
from lynx_compile.kernels.dropout import bias_dropout_add, dropout, dropout_mask

SHAPES = [(1,), (9,), (41,), (341,), (4231,), (3, 4231)]
SEEDS = [(0, 0), (1234, 17), (2**40 + 3, 2**33 + 5)]  # the last: both key words and counter words
DTYPES = [(torch.float32, 1e-6), (torch.float16, 1e-3), (torch.bfloat16, 8e-3)]


@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize("p", [0.1, 0.5])
@pytest.mark.parametrize("seed,offset", SEEDS)
def test_mask_equals_the_reference_bits(shape, p, seed, offset):
    like = torch.empty(shape)
    got = dropout_mask(like, p, seed, offset)
    assert got.dtype == torch.bool and got.shape == like.shape
    assert torch.equal(got, reference.dropout_mask(like, p, seed, offset))


def test_uniforms_equal_the_reference_bits():
    """The float32 uniforms themselves, not just the thresholded mask: at p = u the mask flips."""
    idx = torch.arange(2000, dtype=torch.int64) + 77
    u = reference.philox_uniform(99, idx)
    assert u.dtype == torch.float32 and (u >= 0).all() and (u < 1).all()
    like = torch.empty(2000)
    for k in (0, 5, 1999):
        p = u[k].item()  # exactly representable in fp32: element k is kept (u >= p), barely
        m = dropout_mask(like, p, 99, 77)
        assert m[k] and torch.equal(m, u >= p)
        p_above = torch.nextafter(u[k], torch.tensor(2.0)).item()  # the next float32 up
        assert not dropout_mask(like, p_above, 99, 77)[k]


def test_offset_shifts_the_stream():
    """keep[i] depends on offset + i only: offset k is the offset-0 mask shifted by k."""
    like = torch.empty(500)
    base = dropout_mask(like, 0.5, 7, 0)
    assert torch.equal(dropout_mask(torch.empty(480), 0.5, 7, 20), base[20:])
    assert not torch.equal(dropout_mask(like, 0.5, 8, 0), base)  # another seed, another mask


@pytest.mark.parametrize("cols", [1, 41, 4231])
@pytest.mark.parametrize("p", [0.1, 0.5])
@pytest.mark.parametrize("dtype,tol", DTYPES)
def test_dropout_output_and_gradient_match_the_reference(cols, p, dtype, tol):
    g = torch.Generator().manual_seed(cols)
    x = torch.randn(3, cols, generator=g).to(dtype).requires_grad_()
    y = dropout(x, p, 1234, 17)
    want = reference.dropout(x, p, 1234, 17)
    assert y.dtype == dtype
    assert torch.equal(y == 0, want == 0)
    torch.testing.assert_close(y.float(), want.float(), atol=tol, rtol=tol)
    dy = torch.randn(y.shape, generator=g).to(dtype)
    (got,), (ref,) = torch.autograd.grad(y, (x,), dy), torch.autograd.grad(want, (x,), dy)
    torch.testing.assert_close(got.float(), ref.float(), atol=tol, rtol=tol)


@pytest.mark.parametrize("p", [0.1, 0.5])
def test_regenerated_mask_is_the_mask_the_forward_applied(p):
    x = torch.ones(3, 4231, requires_grad=True)
    packed = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: packed.append(t) or t, lambda t: t):
        y = dropout(x, p, 2024, 4231)
    assert packed == []  # nothing saved for the backward: it regenerates the mask
    mask = dropout_mask(x, p, 2024, 4231)
    assert torch.equal(y != 0, mask)
    torch.testing.assert_close(y[mask], torch.full_like(y[mask], 1 / (1 - p)))
    (dx,) = torch.autograd.grad(y.sum(), (x,))  # dy = expanded ones, not contiguous
    assert torch.equal(dx != 0, mask)
    torch.testing.assert_close(dx, y.detach())


@pytest.mark.parametrize("p", [0.1, 0.5])
def test_keep_rate_within_three_sigma(p):
    n = 3 * 4231
    kept = dropout_mask(torch.empty(3, 4231), p, 31337, 0).sum().item()
    assert abs(kept / n - (1 - p)) <= 3 * math.sqrt(p * (1 - p) / n)


def test_p_zero_and_one():
    x = torch.randn(5, 41)
    torch.testing.assert_close(dropout(x, 0.0, 3, 0), x)
    assert torch.equal(dropout(x, 1.0, 3, 0), torch.zeros_like(x))
    assert not dropout_mask(x, 1.0, 3, 0).any()
    with pytest.raises(ValueError, match="p must be"):
        dropout(x, 1.5, 3, 0)


@pytest.mark.parametrize("with_bias", [True, False])
@pytest.mark.parametrize("cols", [9, 341])
@pytest.mark.parametrize("dtype,tol", DTYPES)
def test_bias_dropout_add_output_and_gradients_match_the_reference(with_bias, cols, dtype, tol):
    g = torch.Generator().manual_seed(cols + with_bias)
    x = torch.randn(2, 3, cols, generator=g).to(dtype).requires_grad_()
    r = torch.randn(2, 3, cols, generator=g).to(dtype).requires_grad_()
    b = torch.randn(cols, generator=g).to(dtype).requires_grad_() if with_bias else None
    y = bias_dropout_add(x, b, r, 0.3, 55, 1000)
    want = reference.bias_dropout_add(x, b, r, 0.3, 55, 1000)
    assert y.dtype == dtype and y.shape == x.shape
    torch.testing.assert_close(y.float(), want.float(), atol=tol * 4, rtol=tol)
    # the dropped elements are exactly the residual
    drop = ~dropout_mask(x, 0.3, 55, 1000)
    assert torch.equal(y[drop], r[drop])
    inputs = (x, r) + ((b,) if with_bias else ())
    dy = torch.randn(y.shape, generator=g).to(dtype)
    got, ref = torch.autograd.grad(y, inputs, dy), torch.autograd.grad(want, inputs, dy)
    for a, c in zip(got, ref):
        scale = c.float().abs().max().clamp_min(1.0)
        torch.testing.assert_close(a.float() / scale, c.float() / scale, atol=tol * 4, rtol=tol)


def test_bias_dropout_add_mixed_dtypes():
    x = torch.randn(4, 64, dtype=torch.bfloat16)
    b = torch.randn(64, dtype=torch.bfloat16)
    r = torch.randn(4, 64)  # an fp32 residual stream
    y = bias_dropout_add(x, b, r, 0.2, 9, 0)
    assert y.dtype == torch.float32
    torch.testing.assert_close(y, reference.bias_dropout_add(x, b, r, 0.2, 9, 0), atol=1e-6, rtol=1e-6)


def test_works_inside_torch_compile():
    x = torch.randn(4, 96, requires_grad=True)
    b = torch.randn(96, requires_grad=True)
    r = torch.randn(4, 96, requires_grad=True)

    def f(x, b, r):
        return (dropout(x, 0.25, 42, 0) * 2 + bias_dropout_add(x, b, r, 0.1, 42, x.numel())).sum()

    def ref(x, b, r):
        return (reference.dropout(x, 0.25, 42, 0) * 2
                + reference.bias_dropout_add(x, b, r, 0.1, 42, x.numel())).sum()

    compiled = torch.compile(f, backend="aot_eager", fullgraph=True)
    got = compiled(x, b, r)
    want = ref(x, b, r)
    torch.testing.assert_close(got, want)
    for a, c in zip(torch.autograd.grad(got, (x, b, r)), torch.autograd.grad(want, (x, b, r))):
        torch.testing.assert_close(a, c)
    mask = torch.compile(lambda t: dropout_mask(t, 0.5, 1, 2), backend="aot_eager", fullgraph=True)(x)
    assert torch.equal(mask, reference.dropout_mask(x, 0.5, 1, 2))


def test_non_contiguous_falls_back_with_one_warning():
    x = torch.randn(64, 8).t().requires_grad_()  # (8, 64), not contiguous
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        y1 = dropout(x, 0.5, 5, 3)
        y2 = dropout(x, 0.5, 5, 3)
        (dx,) = torch.autograd.grad(y1.sum(), (x,))
    # the reference draws the kernel's mask: same result as the kernel on a contiguous copy
    want = dropout(x.detach().contiguous(), 0.5, 5, 3)
    assert torch.equal(y1, want) and torch.equal(y2, want)
    assert torch.equal(dx != 0, dropout_mask(x, 0.5, 5, 3))
    assert sum("non-contiguous" in str(c.message) for c in caught) == 1


def test_unsupported_dtype_falls_back():
    x = torch.randn(2, 16, dtype=torch.float64)
    with pytest.warns(UserWarning, match="float64"):
        y = dropout(x, 0.5, 1, 0)
    assert torch.equal(y, reference.dropout(x, 0.5, 1, 0))
    assert torch.equal(y != 0, dropout_mask(x, 0.5, 1, 0))
