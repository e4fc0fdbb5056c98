"""``lynx_compile.kernels.activations`` (bias_gelu, swiglu) under the Triton interpreter
(``TRITON_INTERPRET=1``, set by ``tests/test_kernels_interpreted.py`` before this process imports
triton) against the reference and against ``torch.nn.functional``.

Tolerances: kernel and reference both compute in fp32 and round once to the output dtype, so
outputs agree to fp32 noise (fp32: 1e-5) or one rounding of the output dtype (fp16: 1e-3,
bf16: 8e-3). ``torch.nn.functional`` in fp16/bf16 rounds twice (x + bias, or silu(g) before the
product), so it is compared at twice the tolerance. Gradients are torch math, compared relative
to their scale (the bias gradient is a sum over rows)."""
import warnings

import pytest
import torch
import torch.nn.functional as F

from lynx_compile.kernels import reference
from lynx_compile.kernels.activations import bias_gelu, swiglu

COLS = [1, 9, 41, 341, 4231]
DTYPES = [(torch.float32, 1e-5), (torch.float16, 1e-3), (torch.bfloat16, 8e-3)]


def _close(a, b, tol):
    """Compare relative to b's scale (at least 1), as the gradients are."""
    scale = b.float().abs().max().clamp_min(1.0)
    torch.testing.assert_close(a.float() / scale, b.float() / scale, atol=tol * 4, rtol=tol)


def _grads(y, inputs, dy):
    return torch.autograd.grad(y, inputs, dy)


@pytest.mark.parametrize("cols", COLS)
@pytest.mark.parametrize("dtype,tol", DTYPES)
@pytest.mark.parametrize("approximate", ["none", "tanh"])
@pytest.mark.parametrize("with_bias", [True, False])
def test_bias_gelu_matches_reference_and_functional(cols, dtype, tol, approximate, with_bias):
    g = torch.Generator().manual_seed(cols)
    x = (2 * torch.randn(3, cols, generator=g)).to(dtype).requires_grad_()
    b = torch.randn(cols, generator=g).to(dtype).requires_grad_() if with_bias else None
    inputs = (x, b) if with_bias else (x,)
    y = bias_gelu(x, b, approximate)
    assert y.dtype == dtype and y.shape == x.shape
    want = reference.bias_gelu(x, b, approximate)
    torch.testing.assert_close(y.float(), want.float(), atol=tol * 4, rtol=tol)
    func = F.gelu(x + b if with_bias else x, approximate=approximate)
    torch.testing.assert_close(y.float(), func.float(), atol=tol * 8, rtol=tol * 2)

    dy = torch.randn(y.shape, generator=g).to(dtype)
    got = _grads(y, inputs, dy)
    for ref in (_grads(want, inputs, dy), _grads(func, inputs, dy)):
        for a, r in zip(got, ref):
            assert a.dtype == r.dtype
            _close(a, r, tol * 2)


@pytest.mark.parametrize("cols", COLS)
@pytest.mark.parametrize("dtype,tol", DTYPES)
def test_swiglu_matches_reference_and_functional(cols, dtype, tol):
    g = torch.Generator().manual_seed(cols)
    gate = (2 * torch.randn(3, cols, generator=g)).to(dtype).requires_grad_()
    up = torch.randn(3, cols, generator=g).to(dtype).requires_grad_()
    y = swiglu(gate, up)
    assert y.dtype == dtype and y.shape == gate.shape
    want = reference.swiglu(gate, up)
    torch.testing.assert_close(y.float(), want.float(), atol=tol * 4, rtol=tol)
    func = F.silu(gate) * up
    torch.testing.assert_close(y.float(), func.float(), atol=tol * 8, rtol=tol * 2)

    dy = torch.randn(y.shape, generator=g).to(dtype)
    got = _grads(y, (gate, up), dy)
    for ref in (_grads(want, (gate, up), dy), _grads(func, (gate, up), dy)):
        for a, r in zip(got, ref):
            _close(a, r, tol * 2)


# The interpreter's numpy warns when exp(-z) overflows inside tl.sigmoid for z < -88; the result
# (sigmoid -> 0) is right, and CUDA is silent about it.
@pytest.mark.filterwarnings("ignore:overflow encountered in exp:RuntimeWarning")
def test_leading_dims_large_values_and_empty():
    x = torch.randn(2, 5, 64) * 20  # tails: gelu -> 0 (erf -> -1, sigmoid -> 0) and -> v
    b = torch.randn(64)
    for approximate in ("none", "tanh"):
        y = torch.ops.lynx.bias_gelu(x, b, approximate)
        torch.testing.assert_close(y, F.gelu(x + b, approximate=approximate))
        assert torch.isfinite(y).all()
    torch.testing.assert_close(swiglu(x, b.expand_as(x).contiguous()), F.silu(x) * b)
    e = torch.empty(0, 7)
    assert bias_gelu(e, torch.zeros(7)).shape == (0, 7) and swiglu(e, e).shape == (0, 7)


def test_shape_and_argument_errors():
    x = torch.randn(4, 8)
    with pytest.raises(ValueError, match="bias"):
        bias_gelu(x, torch.randn(7))
    with pytest.raises(ValueError, match="approximate"):
        bias_gelu(x, None, "erf")
    with pytest.raises(ValueError, match="shape"):
        swiglu(x, torch.randn(8, 4))


def test_work_inside_torch_compile_with_gradients():
    def f(x, b, gate, up):
        return bias_gelu(x, b, "tanh") * 2 + bias_gelu(x) + swiglu(gate, up)

    def ref(x, b, gate, up):
        return (F.gelu(x + b, approximate="tanh") * 2 + F.gelu(x) + F.silu(gate) * up)

    args = [torch.randn(4, 96), torch.randn(96), torch.randn(4, 96), torch.randn(4, 96)]
    args = [a.requires_grad_() for a in args]
    compiled = torch.compile(f, backend="aot_eager", fullgraph=True)
    y, want = compiled(*args), ref(*args)
    torch.testing.assert_close(y, want)
    dy = torch.randn(y.shape)
    for a, r in zip(torch.autograd.grad(y, args, dy), torch.autograd.grad(want, args, dy)):
        torch.testing.assert_close(a, r, atol=1e-5, rtol=1e-5)


def test_non_contiguous_falls_back_with_one_warning():
    x = torch.randn(64, 8).t()  # (8, 64), not contiguous
    b = torch.randn(64)
    u = torch.randn(8, 64)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        y1, y2 = bias_gelu(x, b), bias_gelu(x, b)
        s1, s2 = swiglu(x, u), swiglu(u, x)
    torch.testing.assert_close(y1, reference.bias_gelu(x, b))
    torch.testing.assert_close(y2, y1)
    torch.testing.assert_close(s1, reference.swiglu(x, u))
    torch.testing.assert_close(s2, reference.swiglu(u, x))
    messages = [str(c.message) for c in caught if "non-contiguous" in str(c.message)]
    assert sum("bias_gelu" in m for m in messages) == 1
    assert sum("swiglu" in m for m in messages) == 1


def test_unsupported_dtype_falls_back():
    # The reference computes in fp32 even for float64 input: equal to it, and to
    # torch.nn.functional at fp32 tolerance.
    g = torch.Generator().manual_seed(0)
    x = torch.randn(2, 16, generator=g, dtype=torch.float64)
    b = torch.randn(16, generator=g, dtype=torch.float64)
    with pytest.warns(UserWarning, match="float64"):
        y = bias_gelu(x, b)
    assert y.dtype == torch.float64
    torch.testing.assert_close(y, reference.bias_gelu(x, b))
    torch.testing.assert_close(y, F.gelu(x + b), atol=1e-5, rtol=1e-5)
    with pytest.warns(UserWarning, match="float64"):
        s = swiglu(x, x)
    torch.testing.assert_close(s, reference.swiglu(x, x))
    torch.testing.assert_close(s, F.silu(x) * x, atol=1e-5, rtol=1e-5)
