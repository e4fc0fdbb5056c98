"""``lynx_compile.kernels.causal_softmax`` under the Triton interpreter against the reference and
against the zoo's attention math (scores * scale, masked_fill(-inf), softmax). Tolerances as in
test_rms_norm.py (fp32 math in both; one rounding of the output dtype).

Fused attention dropout (p > 0): the keep-mask is compared bit for bit with ``dropout_mask`` (the
Philox convention, linear index row * T + col over the whole (..., T, T) tensor); outputs and
gradients against ``reference.causal_softmax_dropout`` = dropout(causal_softmax(...)), which rounds
the softmax to the output dtype before scaling where the kernel rounds once (within the same
tolerances; bf16 also sees the interpreter's truncating fp32 -> bf16 cast, see test_dropout.py)."""
import math
import warnings

import pytest
import torch

from lynx_compile.kernels import causal_softmax, dropout, dropout_mask
from lynx_compile.kernels.reference import causal_softmax as reference
from lynx_compile.kernels.reference import causal_softmax_dropout as reference_dropout

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


# ---------------------------------------------------------------- fused attention dropout

SEEDS = [(0, 0), (1234, 17), (2**40 + 3, 2**33 + 5)]  # the last: both key words and counter words


# Philox under the interpreter is the slow part (~3 s per (341, 341) case with the reference and
# both backwards), so T = 341 runs one (T, T) matrix for each dtype, p alternating; the full
# (T, p, dtype) product runs at T = 1, 9, 41 on (2, 2, T, T), which also covers the linear index
# across leading dims (row = (b * H + h) * T + i).
DROPOUT_CASES = [(T, p, dtype, tol) for T in (1, 9, 41) for p in (0.1, 0.5) for dtype, tol in DTYPES] + [
    (341, 0.1, torch.float32, 1e-5), (341, 0.5, torch.float16, 1e-3), (341, 0.1, torch.bfloat16, 8e-3)]


@pytest.mark.parametrize("T,p,dtype,tol", DROPOUT_CASES, ids=lambda v: str(v).replace("torch.", ""))
def test_dropout_mask_output_and_gradient_match_the_reference(T, p, dtype, tol):
    g = torch.Generator().manual_seed(T)
    shape = (2, 2, T, T) if T < 341 else (T, T)
    s = torch.randn(shape, generator=g).to(dtype).requires_grad_()
    scale, seed, offset = 1 / math.sqrt(16), 2**40 + 3, 2**33 + 5  # both key words and counter words
    y = causal_softmax(s, scale, p, seed, offset)
    assert y.dtype == dtype and y.shape == s.shape
    # the mask, bit for bit: no softmax value underflows here, so y != 0 is exactly keep on j <= i
    causal = torch.ones(T, T, dtype=torch.bool).tril()
    assert torch.equal(y != 0, dropout_mask(y, p, seed, offset) & causal)
    want = reference_dropout(s, scale, p, seed, offset)
    torch.testing.assert_close(y.float(), want.float(), atol=tol, rtol=tol)
    dy = torch.randn(y.shape, generator=g).to(dtype)
    (got,), (ref,) = torch.autograd.grad(y, (s,), dy), torch.autograd.grad(want, (s,), dy)
    torch.testing.assert_close(got.float(), ref.float(), atol=tol * 4, rtol=tol)


@pytest.mark.parametrize("T", [1, 9, 41])
@pytest.mark.parametrize("p", [0.1, 0.5])
@pytest.mark.parametrize("seed,offset", SEEDS)
def test_dropout_mask_and_kept_values_are_exact(T, p, seed, offset):
    # zero scores: the softmax before dropout is 1 / (i + 1) > 0 on j <= i, so y != 0 is the mask there
    s = torch.zeros(2, 3, T, T)
    y = causal_softmax(s, 1.0, p, seed, offset)
    causal = torch.ones(T, T, dtype=torch.bool).tril()
    want = dropout_mask(y, p, seed, offset)
    assert torch.equal(y != 0, want & causal)
    # the kept values are fp32(1 / (i + 1)) * fp32(1 / (1 - p)), rounded once
    i = torch.arange(T, dtype=torch.float32).view(T, 1)
    kept = (1.0 / (i + 1)) * torch.tensor(1 / (1 - p), dtype=torch.float32)
    torch.testing.assert_close(y, torch.where(want & causal, kept.expand(T, T), 0.0), atol=0, rtol=2e-7)


def test_dropout_equals_the_composition_of_the_kernels():
    s = torch.randn(3, 2, 37, 37, dtype=torch.float64).float()
    y = causal_softmax(s, 0.3, 0.25, 99, 1000)
    torch.testing.assert_close(y, dropout(causal_softmax(s, 0.3), 0.25, 99, 1000), atol=1e-7, rtol=1e-6)
    # another seed or offset draws another mask; offset k reads the stream shifted by k
    assert not torch.equal(y, causal_softmax(s, 0.3, 0.25, 100, 1000))
    assert not torch.equal(y, causal_softmax(s, 0.3, 0.25, 99, 1001))


def test_p_zero_is_the_plain_softmax():
    g = torch.Generator().manual_seed(0)
    s = torch.randn(2, 3, 41, 41, generator=g).requires_grad_()
    plain = causal_softmax(s, 0.5)
    for args in [(0.0,), (0.0, 7, 11), (0, 2**40, 2**33)]:
        assert torch.equal(causal_softmax(s, 0.5, *args), plain)  # seed and offset are ignored
    assert torch.equal(torch.ops.lynx.causal_softmax.default(s, 0.5), plain)  # the two-argument call
    dy = torch.randn(plain.shape, generator=g)
    (a,), (b,) = torch.autograd.grad(plain, (s,), dy), torch.autograd.grad(causal_softmax(s, 0.5, 0.0, 3, 4), (s,), dy)
    assert torch.equal(a, b)
    schema = str(torch.ops.lynx.causal_softmax.default._schema)
    assert "float p=0." in schema and "seed=0" in schema and "offset=0" in schema


def test_p_one_drops_everything():
    s = torch.randn(2, 9, 9).requires_grad_()
    y = causal_softmax(s, 1.0, 1.0, 5)
    assert (y == 0).all()
    (ds,) = torch.autograd.grad(y, (s,), torch.randn_like(y))
    assert (ds == 0).all()


def test_invalid_dropout_arguments_are_errors():
    s = torch.randn(2, 4, 4)
    with pytest.raises(ValueError, match="p must be in"):
        causal_softmax(s, 1.0, 1.5)
    with pytest.raises(ValueError, match="offset must be in"):
        causal_softmax(s, 1.0, 0.1, 0, -1)


def test_dropout_works_inside_torch_compile():
    g = torch.Generator().manual_seed(1)
    s = torch.randn(2, 2, 13, 13, generator=g)
    fn = lambda x: causal_softmax(x, 0.5, 0.3, 1234, 17) * 2  # noqa: E731
    compiled = torch.compile(fn, backend="aot_eager", fullgraph=True)
    se, sc = s.clone().requires_grad_(), s.clone().requires_grad_()
    ye, yc = fn(se), compiled(sc)
    assert torch.equal(yc, ye)
    torch.testing.assert_close(yc, reference_dropout(s, 0.5, 0.3, 1234, 17) * 2)
    dy = torch.randn(ye.shape, generator=g)
    ye.backward(dy)
    yc.backward(dy)
    torch.testing.assert_close(sc.grad, se.grad)
    ref = s.clone().requires_grad_()
    reference_dropout(ref, 0.5, 0.3, 1234, 17).mul(2).backward(dy)
    torch.testing.assert_close(sc.grad, ref.grad)


def test_dropout_non_contiguous_falls_back_with_the_same_mask():
    s = torch.randn(2, 16, 16).transpose(-1, -2)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        y = causal_softmax(s, 1.0, 0.5, 3, 8)
    assert torch.equal(y, reference_dropout(s, 1.0, 0.5, 3, 8))
    torch.testing.assert_close(y, causal_softmax(s.contiguous(), 1.0, 0.5, 3, 8))
