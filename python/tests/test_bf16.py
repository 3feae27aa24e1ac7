"""bfloat16 through the binding: scaled_dot_product_attention(..., dtype="bfloat16"),
DotProductAttention(dtype="bfloat16"), linear(..., dtype="bfloat16") and
MultiHeadAttention(dtype="bfloat16") on NumPy float32 arrays, torch.bfloat16 tensors used in
place, and the errors for mixed dtypes and ops without bfloat16 kernels. (The tolerances of
linear and MultiHeadAttention are derived in their own sections below.)

Accuracy is checked against a float64 NumPy reference run on the bf16-ROUNDED inputs, so the
tolerance only has to cover what the bf16 kernels themselves round, not the input rounding.

bfloat16 keeps 8 significant bits, so rounding to nearest has relative error at most
U = 2^-8 (half a unit in the last place of 2^-7). What the kernels round (kernels-cpu.md,
include/attn/ops/attention.hpp), and the bound each rounding gives:
  - the output, once: at most U * |out|;
  - the (unnormalised) weights P before P V, each by at most U relative: at most
    U * sum_s P[t, s] |V[s]|, i.e. U * (P |V|), since the weights are non-negative;
  - in the backward, each bf16 operand of a product (P, the rounded output O inside
    delta = rowsum(dO * O), dS) adds at most U relative to that product's terms, so the error of
    dV, dQ, dK is at most a few U times the same sums taken over absolute values ("magnitudes"
    below: dP - delta can cancel, so the bound is relative to the magnitude, not to the result);
  - scores, exp and every accumulation run in float32 (2^-24), negligible next to U.
So out and dV carry at most 1 rounding of U per term beyond the output's own, and dQ, dK at most
3 (P, the O inside delta, dS): MARGIN = 3. Measured on random cases (float32 N(0, 1) inputs,
T, S up to 256, D up to 128, AVX512-BF16 machine): at most 0.8 U * magnitude (dV), 0.7 (out),
0.25 (dQ, dK).
"""

import copy
import os
import subprocess
import sys

import numpy as np
import pytest

import attn

try:
    import torch
except ImportError:  # the module works without torch; the torch tests then skip, visibly
    torch = None

needs_torch = pytest.mark.skipif(torch is None, reason="torch is not installed")

U = 2.0 ** -8   # unit roundoff of bfloat16 (8 significant bits, round to nearest even)
MARGIN = 3.0    # see the module docstring


def round_bf16(x):
    """float32 -> nearest bfloat16 (ties to even), returned as float32: the library's
    float_to_bf16 (attn/core/dtype.hpp) restated; no NaNs here."""
    u = np.asarray(x, np.float32).view(np.uint32).astype(np.uint64)
    u = ((u + 0x7FFF + ((u >> 16) & 1)) >> 16) << 16
    return u.astype(np.uint32).view(np.float32)


def is_bf16_valued(x):
    return bool(np.all(np.asarray(x, np.float32).view(np.uint32) & 0xFFFF == 0))


def qkv(rng, B, T, S, D, Dv=None):
    shapes = [(B, T, D), (B, S, D), (B, S, Dv or D)]
    return tuple(rng.standard_normal(s).astype(np.float32) for s in shapes)


def reference(q, k, v, lens=None, causal=False, dout=None):
    """float64 attention (d2l masking, every row keeps >= 1 key here) and its gradients, plus
    the magnitudes the bf16 error bounds scale with."""
    q, k, v = (np.asarray(x, np.float64) for x in (q, k, v))
    B, T, D = q.shape
    S = k.shape[1]
    scale = 1.0 / np.sqrt(D)
    scores = q @ k.transpose(0, 2, 1) * scale
    keep = np.ones((B, T, S), bool)
    if lens is not None:
        keep &= np.arange(S)[None, None, :] < np.asarray(lens)[:, None, None]
    if causal:
        keep &= np.arange(S)[None, None, :] <= np.arange(T)[None, :, None]
    scores = np.where(keep, scores, -np.inf)
    P = np.exp(scores - scores.max(-1, keepdims=True))
    P /= P.sum(-1, keepdims=True)
    r = dict(out=P @ v, weights=P, mag_out=P @ np.abs(v))
    if dout is not None:
        dO = np.asarray(dout, np.float64)
        dP = dO @ v.transpose(0, 2, 1)
        delta = (dO * r["out"]).sum(-1, keepdims=True)
        dS = P * (dP - delta)
        r["dv"] = P.transpose(0, 2, 1) @ dO
        r["dq"] = scale * dS @ k
        r["dk"] = scale * dS.transpose(0, 2, 1) @ q
        mag_dS = P * (np.abs(dO) @ np.abs(v).transpose(0, 2, 1) +
                      (np.abs(dO) * r["mag_out"]).sum(-1, keepdims=True))
        r["mag_dv"] = P.transpose(0, 2, 1) @ np.abs(dO)
        r["mag_dq"] = scale * mag_dS @ np.abs(k)
        r["mag_dk"] = scale * mag_dS.transpose(0, 2, 1) @ np.abs(q)
    return r


def assert_within_bf16_bound(actual, expected, magnitude, what):
    """|actual - expected| <= U |expected| (the final rounding) + MARGIN U magnitude."""
    a = np.asarray(actual, np.float64)
    bound = U * np.abs(expected) + MARGIN * U * magnitude + 1e-6
    err = np.abs(a - expected)
    worst = np.unravel_index(np.argmax(err - bound), err.shape)
    assert np.all(err <= bound), (f"{what}: error {err[worst]:.3g} > bound {bound[worst]:.3g} at "
                                  f"{worst} (actual {a[worst]}, expected {expected[worst]})")


CASES = [  # B, T, S, D, Dv, lens, causal
    (2, 5, 7, 16, 16, None, False),
    (2, 33, 33, 64, 32, [33, 17], False),
    (3, 40, 40, 32, 32, None, True),
    (1, 1, 70, 8, 24, [1], False),
]


# ------------------------------------------------------------------------------------------------
# NumPy: dtype="bfloat16" rounds the inputs, returns float32 arrays holding bf16 values


@pytest.mark.parametrize("backend", ["auto", "cpu", "reference"])
@pytest.mark.parametrize("B,T,S,D,Dv,lens,causal", CASES)
def test_sdpa_bfloat16_matches_float64_on_rounded_inputs(rng, backend, B, T, S, D, Dv, lens,
                                                         causal):
    q, k, v = qkv(rng, B, T, S, D, Dv)
    lens_arr = None if lens is None else np.array(lens)
    ctx = attn.Context(backend=backend)
    out = attn.scaled_dot_product_attention(q, k, v, lens_arr, causal, dtype="bfloat16", ctx=ctx)
    assert isinstance(out, np.ndarray) and out.dtype == np.float32 and out.shape == (B, T, Dv or D)
    assert is_bf16_valued(out)
    ref = reference(*map(round_bf16, (q, k, v)), lens, causal)
    assert_within_bf16_bound(out, ref["out"], ref["mag_out"], f"out ({backend})")


def test_sdpa_bfloat16_weights_are_float32(rng):
    q, k, v = qkv(rng, 2, 6, 9, 16)
    out, w = attn.scaled_dot_product_attention(q, k, v, np.array([9, 4]), need_weights=True,
                                               dtype="bfloat16")
    assert out.dtype == np.float32 and w.dtype == np.float32 and w.shape == (2, 6, 9)
    ref = reference(*map(round_bf16, (q, k, v)), [9, 4])
    # The weights are computed from the bf16 inputs in float64 and stored as float32.
    np.testing.assert_allclose(w, ref["weights"], rtol=1e-6, atol=1e-7)
    # With the weights kept, the exact reference runs: only the output's rounding is left (to
    # float32 first, then bf16: at most U + 2^-24 relative).
    assert is_bf16_valued(out)
    np.testing.assert_array_less(np.abs(out - ref["out"]),
                                 (U + 2.0 ** -24) * np.abs(ref["out"]) + 1e-30)


def test_dtype_bfloat16_rounds_to_nearest_even():
    # One key: the weight is exactly 1 and out = v rounded to bfloat16. 1 + 2^-8 lies halfway
    # between 1 and 1 + 2^-7 (ties to the even 1); 1 + 3 * 2^-8 halfway between 1 + 2^-7 and
    # 1 + 2^-6 (ties to the even 1 + 2^-6); 1 + 2^-8 + 2^-20 is just above halfway.
    v = np.array([[[1 + 2.0 ** -8, 1 + 3 * 2.0 ** -8, 1 + 2.0 ** -8 + 2.0 ** -20, -2.5,
                    1e-3, 3.0e38]]], np.float32)
    q = k = np.ones((1, 1, 1), np.float32)
    for backend in ["cpu", "reference"]:
        out = attn.scaled_dot_product_attention(q, k, v, dtype="bfloat16",
                                                ctx=attn.Context(backend=backend))
        np.testing.assert_array_equal(out, round_bf16(v))
        np.testing.assert_array_equal(out[0, 0, :3], [1.0, 1 + 2.0 ** -6, 1 + 2.0 ** -7])


def test_dtype_spellings():
    q, k, v = (np.ones((1, 2, 4), np.float32),) * 3
    for spelling in ["bfloat16"] + ([torch.bfloat16] if torch is not None else []):
        out = attn.scaled_dot_product_attention(q, k, v, dtype=spelling)
        assert out.dtype == np.float32 and is_bf16_valued(out)
    # float32/float64 convert the inputs (float64 here), bf16 stays out of it.
    out = attn.scaled_dot_product_attention(q, k, v, dtype="float64")
    assert out.dtype == np.float64


@pytest.mark.parametrize("need_weights", [False, True])
@pytest.mark.parametrize("B,T,S,D,Dv,lens,causal", CASES)
def test_dot_product_attention_bfloat16_forward_backward(rng, need_weights, B, T, S, D, Dv, lens,
                                                         causal):
    q, k, v = qkv(rng, B, T, S, D, Dv)
    layer = attn.DotProductAttention(0.0, causal=causal, dtype="bfloat16").eval()
    layer.need_weights = need_weights
    assert layer.dtype == "bfloat16"
    lens_arr = None if lens is None else np.array(lens)
    out = layer(q, k, v, lens_arr)
    dout = rng.standard_normal(out.shape).astype(np.float32)
    dq, dk, dv = layer.backward(dout)
    ref = reference(*map(round_bf16, (q, k, v)), lens, causal, dout=round_bf16(dout))
    for name, got in [("out", out), ("dq", dq), ("dk", dk), ("dv", dv)]:
        assert got.dtype == np.float32 and is_bf16_valued(got), name
        assert_within_bf16_bound(got, ref[name], ref["mag_" + name], name)
    if need_weights:
        assert layer.attention_weights.dtype == np.float32
        np.testing.assert_allclose(layer.attention_weights, ref["weights"], rtol=1e-6, atol=1e-7)
    else:
        assert layer.attention_weights is None


# ------------------------------------------------------------------------------------------------
# torch.bfloat16: used in place, results come back as torch.bfloat16


def to_torch_bf16(*arrays):
    return tuple(torch.from_numpy(a).to(torch.bfloat16) for a in arrays)


@needs_torch
@pytest.mark.parametrize("make", [
    lambda t: t,                          # contiguous
    lambda t: t.transpose(1, 2),          # transposed
    lambda t: t[1:, ::2, 3:],             # storage offset and strides
    lambda t: t[:1].expand(4, -1, -1),    # zero stride
])
def test_torch_bfloat16_inputs_are_viewed_not_copied(rng, make):
    t = make(to_torch_bf16(rng.standard_normal((3, 6, 5)).astype(np.float32))[0])
    info = attn._input_view(t)
    assert info["dtype"] == "BF16" and info["from_torch"] and not info["copied"]
    assert info["data"] == t.data_ptr()
    for got, stride, size in zip(info["strides"], t.stride(), t.shape):
        assert size <= 1 or got == stride


@needs_torch
def test_torch_bfloat16_round_trip_matches_numpy_path(rng):
    q, k, v = map(round_bf16, qkv(rng, 2, 9, 11, 16))
    qt, kt, vt = to_torch_bf16(q, k, v)
    qt.requires_grad_(True)  # detached on the way in, like float tensors
    for backend in ["cpu", "reference"]:
        ctx = attn.Context(backend=backend)
        out = attn.scaled_dot_product_attention(qt, kt, vt, np.array([11, 5]), ctx=ctx)
        assert isinstance(out, torch.Tensor) and out.dtype == torch.bfloat16
        assert out.shape == (2, 9, 16) and not out.requires_grad
        # The same bf16 inputs through the NumPy path run the same kernel: bitwise equal.
        ref = attn.scaled_dot_product_attention(q, k, v, np.array([11, 5]), dtype="bfloat16",
                                                ctx=ctx)
        np.testing.assert_array_equal(out.float().numpy(), ref)
    out, w = attn.scaled_dot_product_attention(qt, kt, vt, need_weights=True)
    assert out.dtype == torch.bfloat16 and isinstance(w, torch.Tensor) and w.dtype == torch.float32
    # Strided (transposed) tensors are viewed in place and give the same result.
    qs = qt.detach().transpose(1, 2).contiguous().transpose(1, 2)
    assert not qs.is_contiguous()
    out2 = attn.scaled_dot_product_attention(qs, kt, vt, need_weights=True)[0]
    assert torch.equal(out, out2)


@needs_torch
def test_torch_bfloat16_outputs_are_attns_buffer(rng):
    qt, kt, vt = to_torch_bf16(*qkv(rng, 1, 4, 4, 8))
    out = attn.scaled_dot_product_attention(qt, kt, vt)
    # torch.from_numpy over attn's buffer (an int16 array whose base is the capsule holding the
    # C++ tensor), reinterpreted as bfloat16. torch 1.13 does not expose that chain, so this
    # checks what it can: a fresh contiguous buffer of its own, writeable like NumPy results.
    assert out.is_contiguous() and out.dtype == torch.bfloat16
    assert out.data_ptr() not in (qt.data_ptr(), kt.data_ptr(), vt.data_ptr())
    before = out.clone()
    out += 1
    assert torch.equal(out, before + 1)


@needs_torch
def test_torch_bfloat16_dot_product_attention_backward(rng):
    q, k, v = map(round_bf16, qkv(rng, 2, 7, 7, 8))
    dout = round_bf16(rng.standard_normal((2, 7, 8)).astype(np.float32))
    layer = attn.DotProductAttention(0.0, causal=True, dtype=torch.bfloat16).eval()
    out = layer(*to_torch_bf16(q, k, v))
    grads = layer.backward(to_torch_bf16(dout)[0])
    assert out.dtype == torch.bfloat16
    assert all(isinstance(g, torch.Tensor) and g.dtype == torch.bfloat16 for g in grads)
    # Same numbers as the NumPy path (the same rounded values in, the same kernels).
    ref_layer = attn.DotProductAttention(0.0, causal=True, dtype="bfloat16").eval()
    ref_out = ref_layer(q, k, v)
    ref_grads = ref_layer.backward(dout)
    np.testing.assert_array_equal(out.float().numpy(), ref_out)
    for g, r in zip(grads, ref_grads):
        np.testing.assert_array_equal(g.float().numpy(), r)


@needs_torch
def test_torch_float32_inputs_with_dtype_bfloat16_return_torch(rng):
    q, k, v = qkv(rng, 1, 3, 5, 8)
    qt = torch.from_numpy(q)  # float32 torch tensor, mixed with NumPy arrays and a bf16 tensor
    out = attn.scaled_dot_product_attention(qt, k, to_torch_bf16(v)[0], dtype="bfloat16")
    assert isinstance(out, torch.Tensor) and out.dtype == torch.bfloat16
    ref = attn.scaled_dot_product_attention(q, k, v, dtype="bfloat16")
    np.testing.assert_array_equal(out.float().numpy(), ref)


@needs_torch
def test_float_layers_widen_torch_bfloat16_inputs(rng):
    q, k, v = map(round_bf16, qkv(rng, 2, 3, 4, 8))
    layer = attn.DotProductAttention(0.0).eval()  # float32: bf16 widens exactly, as documented
    out = layer(*to_torch_bf16(q, k, v))
    assert isinstance(out, np.ndarray) and out.dtype == np.float32
    np.testing.assert_array_equal(out, layer(q, k, v))


@needs_torch
def test_load_state_dict_takes_torch_bfloat16(rng):
    # A bf16 checkpoint loads into a float32 layer, widened exactly.
    layer = attn.MultiHeadAttention(8, 2, 0.0, seed=1).eval()
    X = rng.standard_normal((1, 3, 8)).astype(np.float32)
    layer(X, X, X)  # materialises the lazy projections
    state = {name: round_bf16(w) for name, w in layer.state_dict().items()}
    other = attn.MultiHeadAttention(8, 2, 0.0, seed=2).eval()
    other.load_state_dict({name: to_torch_bf16(w)[0] for name, w in state.items()})
    for name, w in other.state_dict().items():
        np.testing.assert_array_equal(w, state[name], err_msg=name)


def test_module_works_without_torch():
    # torch stays optional: with its import blocked, the bf16 NumPy path still works.
    code = (
        "import sys; sys.modules['torch'] = None\n"
        "import numpy as np, attn\n"
        "q = np.ones((1, 2, 4), np.float32)\n"
        "out = attn.scaled_dot_product_attention(q, q, q, dtype='bfloat16')\n"
        "y = attn.linear(q, np.ones((3, 4), np.float32), dtype='bfloat16')\n"
        "mha = attn.MultiHeadAttention(4, 2, 0.0, dtype='bfloat16')\n"
        "o = mha(q, q, q); g = mha.backward(o); sd = mha.state_dict()\n"
        "assert {a.dtype for a in [out, y, o, *g, *sd.values()]} == {np.dtype(np.float32)}\n"
        "assert 'torch' not in [m for m in sys.modules if sys.modules[m]]\n"
        "print('ok')\n")
    env = dict(os.environ)
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env)
    assert r.returncode == 0 and r.stdout.strip() == "ok", r.stderr


# ------------------------------------------------------------------------------------------------
# linear: dtype="bfloat16" and torch.bfloat16
#
# Tolerance (tests/test_nn_bf16_linear_mha.cpp derives it in full). Let y* be the exact result on
# the bf16 inputs: products of bf16 numbers are exact in float32 and float64, so NumPy's float64
# sum is y* up to ~K 2^-53 of the magnitude M = |x| |W|^T + |b|, negligible. The fast path
# (auto/cpu) accumulates in float32 in any order, |y~ - y*| <= e = gamma_{K+2} M (Higham, Thm
# 3.1; gamma_n = n u32 / (1 - n u32), u32 = 2^-24; K products, the bias and one spare add), then
# rounds once to bf16: |y - y*| <= U (|y*| + e) + e. The reference backend sums in double and
# rounds once from double: exactly RN(y*), checked bitwise.

U32 = 2.0 ** -24  # unit roundoff of float32


def gamma(n):
    return n * U32 / (1 - n * U32)


def round_bf16_from_double(x):
    """float64 -> nearest bfloat16 (ties to even) in ONE rounding (not through float32, which
    would round twice): 8 significant bits of the frexp mantissa, np.round ties to even."""
    m, e = np.frexp(np.asarray(x, np.float64))
    return np.ldexp(np.round(m * 256.0) / 256.0, e)


def linear_case(rng, lead, n_in, n_out, bias=True):
    x = rng.standard_normal(lead + (n_in,)).astype(np.float32)
    W = (rng.standard_normal((n_out, n_in)) / np.sqrt(n_in)).astype(np.float32)
    b = rng.standard_normal(n_out).astype(np.float32) if bias else None
    return x, W, b


def linear_exact(x, W, b):
    """y* and its magnitude M on the bf16-rounded inputs, in float64."""
    x, W = (round_bf16(a).astype(np.float64) for a in (x, W))
    y, M = x @ W.T, np.abs(x) @ np.abs(W).T
    if b is not None:
        b = round_bf16(b).astype(np.float64)
        y, M = y + b, M + np.abs(b)
    return y, M


def assert_linear_bound(y, y_exact, M, K, what):
    e = gamma(K + 2) * M
    err = np.abs(np.asarray(y, np.float64) - y_exact)
    bound = U * (np.abs(y_exact) + e) + e
    worst = np.unravel_index(np.argmax(err - bound), err.shape)
    assert np.all(err <= bound), (f"{what}: error {err[worst]:.3g} > bound {bound[worst]:.3g} at "
                                  f"{worst}")


LINEAR_CASES = [  # leading dims, in, out, bias
    ((2, 7), 16, 24, True),
    ((33,), 64, 8, False),
    ((2, 3, 5), 130, 17, True),  # K not a multiple of the kernel's blocks
    ((1,), 1, 1, True),
]


@pytest.mark.parametrize("backend", ["auto", "cpu", "reference"])
@pytest.mark.parametrize("lead,n_in,n_out,bias", LINEAR_CASES)
def test_linear_bfloat16_matches_float64_on_rounded_inputs(rng, backend, lead, n_in, n_out, bias):
    x, W, b = linear_case(rng, lead, n_in, n_out, bias)
    y = attn.linear(x, W, b, dtype="bfloat16", ctx=attn.Context(backend=backend))
    assert isinstance(y, np.ndarray) and y.dtype == np.float32 and y.shape == lead + (n_out,)
    assert is_bf16_valued(y)
    y_exact, M = linear_exact(x, W, b)
    if backend == "reference":  # one rounding from the double sum
        np.testing.assert_array_equal(y, round_bf16_from_double(y_exact))
    else:
        assert_linear_bound(y, y_exact, M, n_in, f"linear ({backend})")


def test_round_bf16_from_double_rounds_once():
    # 1 + 2^-8 + 2^-30: just above the midpoint of 1 and 1 + 2^-7, so 1 + 2^-7; through float32
    # it would first become the midpoint 1 + 2^-8 and then tie to the even 1.
    x = 1 + 2.0 ** -8 + 2.0 ** -30
    assert round_bf16_from_double(x) == 1 + 2.0 ** -7
    assert round_bf16(np.array([x], np.float32))[0] == 1.0
    np.testing.assert_array_equal(round_bf16_from_double([1 + 2.0 ** -8, -2.5, 0.0]),
                                  [1.0, -2.5, 0.0])


def test_linear_dtype_bfloat16_converts_mixed_inputs(rng):
    x, W, b = linear_case(rng, (3,), 8, 5)
    ref = attn.linear(x, W, b, dtype="bfloat16")
    # float64 and list inputs are rounded too (float64 through float32, exact for these values).
    got = attn.linear(x.astype(np.float64), W.tolist(), b, dtype="bfloat16")
    np.testing.assert_array_equal(got, ref)
    # Without dtype= the float32 path runs as before; dtype="float64" converts to float64.
    y32 = attn.linear(x, W, b)
    assert y32.dtype == np.float32 and not is_bf16_valued(y32)
    np.testing.assert_allclose(y32, x @ W.T + b, rtol=1e-5, atol=1e-6)
    y64 = attn.linear(x, W, b, dtype="float64")
    assert y64.dtype == np.float64
    np.testing.assert_allclose(y64, x.astype(np.float64) @ W.T.astype(np.float64) + b,
                               rtol=1e-12, atol=1e-12)


def test_linear_mixed_float_dtypes_and_unknown_dtype_are_errors(rng):
    x, W, b = linear_case(rng, (2,), 4, 3)
    with pytest.raises(attn.Error, match="weight has dtype float64 but x has dtype float32.*"
                                         "dtype='float64'") as e:
        attn.linear(x, W.astype(np.float64), b)
    assert e.value.op == "linear"
    with pytest.raises(attn.Error, match="dtype float16 is not supported, expected float32, "
                                         "float64 or bfloat16"):
        attn.linear(x, W, b, dtype="float16")


@needs_torch
def test_linear_torch_bfloat16_round_trip(rng):
    x, W, b = (round_bf16(a) for a in linear_case(rng, (2, 9), 32, 12))
    xt, Wt, bt = to_torch_bf16(x, W, b)
    Wt.requires_grad_(True)  # detached on the way in
    for backend in ["cpu", "reference"]:
        ctx = attn.Context(backend=backend)
        y = attn.linear(xt, Wt, bt, ctx=ctx)
        assert isinstance(y, torch.Tensor) and y.dtype == torch.bfloat16 and y.shape == (2, 9, 12)
        assert not y.requires_grad
        # The same bf16 values through the NumPy path run the same kernel: bitwise equal.
        np.testing.assert_array_equal(y.float().numpy(),
                                      attn.linear(x, W, b, dtype="bfloat16", ctx=ctx))
    # Strided views (a transposed weight, a sliced x) are viewed in place; same numbers.
    Wtt = Wt.detach().t().contiguous().t()
    assert not Wtt.is_contiguous() and attn._input_view(Wtt)["copied"] is False
    y = attn.linear(xt, Wt, bt)
    assert torch.equal(attn.linear(xt, Wtt, bt), y)
    wide = torch.cat([xt, xt], dim=-1)[..., :32]
    assert torch.equal(attn.linear(wide, Wt, bt), y)
    # A float32 torch tensor with dtype="bfloat16" also returns torch.bfloat16.
    y2 = attn.linear(torch.from_numpy(x), W, b, dtype="bfloat16")
    assert y2.dtype == torch.bfloat16 and torch.equal(y2, y)


@needs_torch
def test_linear_bfloat16_matches_torch_f_linear(rng):
    # PyTorch's bf16 F.linear on the CPU: the same contract (float32 accumulation, one rounding),
    # so both meet the bound around the exact result; they may still round a value whose float32
    # sums straddle a rounding boundary to neighbouring bf16 numbers.
    x, W, b = (round_bf16(a) for a in linear_case(rng, (4, 16), 96, 40))
    xt, Wt, bt = to_torch_bf16(x, W, b)
    y = attn.linear(xt, Wt, bt)
    y_torch = torch.nn.functional.linear(xt, Wt, bt)
    y_exact, M = linear_exact(x, W, b)
    assert_linear_bound(y.float().numpy(), y_exact, M, 96, "attn")
    assert_linear_bound(y_torch.float().numpy(), y_exact, M, 96, "torch")


@needs_torch
def test_linear_mixed_bf16_dtypes_are_errors(rng):
    x, W, b = linear_case(rng, (2,), 4, 3)
    xt, Wt, bt = to_torch_bf16(x, W, b)
    with pytest.raises(attn.Error, match="weight has dtype float32 but x has dtype bfloat16.*"
                                         "dtype='bfloat16'") as e:
        attn.linear(xt, W, bt)
    assert e.value.op == "linear"
    with pytest.raises(attn.Error, match="bias has dtype float32 but x has dtype bfloat16"):
        attn.linear(xt, Wt, b)
    with pytest.raises(attn.Error, match="linear"):  # shapes are still checked in bf16
        attn.linear(xt, Wt[:, :3], bt)


# ------------------------------------------------------------------------------------------------
# MultiHeadAttention(dtype="bfloat16")
#
# Tolerance (derived in tests/test_nn_bf16_linear_mha.cpp, which this restates): against a float64
# module with the same bf16 weights on the same bf16 inputs, each stage of the bf16 module rounds
# its output once, a relative perturbation of at most U of that stage; with PyTorch's small init
# nothing amplifies it much (|scores| < 1, softmax Lipschitz 1). With every error lined up, first
# order: forward 6U (Q and K move the scores by 2U, then V, the weights P before P V, the output O,
# W_o's output), backward ~11U. Roundings of different elements are independent and do not line
# up in the Frobenius norm (C++ measured 0.5U forward, <= 1.6U backward), so the bounds are 5U
# forward and 8U backward in the Frobenius norm relative to the float64 result: below the aligned
# worst case, several times above independent roundings; a wrong index or a dropped term (errors
# of order 1) fails. The gradient of W_k.bias is 0 in exact arithmetic (softmax ignores a shift
# shared by all keys), so it is held to the scale of its summands instead (see the test).

MHA_FWD_TOL = 5 * U
MHA_BWD_TOL = 8 * U


def rel_error(actual, expected):
    a, e = (np.asarray(x, np.float64) for x in (actual, expected))
    return np.linalg.norm(a - e) / np.linalg.norm(e)


MHA_CASES = [  # name, B, T, S, E, H, widths (None: self-attention on one array), bias, lens, causal
    ("self_bias", 2, 37, 37, 32, 4, None, True, None, False),
    ("self_lens", 3, 20, 20, 48, 3, None, False, [20, 7, 1], False),
    ("cross_lens_widths", 2, 17, 29, 32, 2, (24, 16, 8), True, [29, 5], False),
    ("self_causal", 2, 33, 33, 64, 2, None, True, None, True),
]


def mha_inputs(rng, B, T, S, E, widths):
    if widths is None:
        X = rng.standard_normal((B, T, E)).astype(np.float32)
        return X, X, X
    Dq, Dk, Dv = widths
    return tuple(rng.standard_normal(s).astype(np.float32) for s in [(B, T, Dq), (B, S, Dk),
                                                                     (B, S, Dv)])


@pytest.mark.parametrize("backend", ["auto", "reference"])
@pytest.mark.parametrize("need_weights", [False, True])
@pytest.mark.parametrize("name,B,T,S,E,H,widths,bias,lens,causal", MHA_CASES,
                         ids=[c[0] for c in MHA_CASES])
def test_mha_bfloat16_matches_float64_module(rng, backend, need_weights, name, B, T, S, E, H,
                                             widths, bias, lens, causal):
    layer = attn.MultiHeadAttention(E, H, 0.0, bias=bias, causal=causal, dtype="bfloat16",
                                    seed=3, backend=backend).eval()
    assert layer.dtype == "bfloat16"
    layer.need_weights = need_weights
    q, k, v = mha_inputs(rng, B, T, S, E, widths)
    lens_arr = None if lens is None else np.array(lens)
    out = layer(q, k, v, lens_arr)  # materialises the lazy projections (float32 init, rounded)
    assert isinstance(out, np.ndarray) and out.dtype == np.float32 and out.shape == (B, T, E)
    assert is_bf16_valued(out)

    state = layer.state_dict()
    assert all(a.dtype == np.float32 and is_bf16_valued(a) for a in state.values())
    ref = attn.MultiHeadAttention(E, H, 0.0, bias=bias, causal=causal, dtype=np.float64,
                                  backend="reference").eval()
    ref.load_state_dict(state)  # the bf16 weights, exact in float64
    q64, k64, v64 = (round_bf16(a).astype(np.float64) for a in (q, k, v))
    if widths is None:
        k64 = v64 = q64  # self-attention stays self-attention
    expected = ref(q64, k64, v64, lens_arr)
    assert rel_error(out, expected) <= MHA_FWD_TOL, rel_error(out, expected) / U
    if need_weights:
        w = layer.attention_weights
        assert w.dtype == np.float32 and w.shape == (B * H, T, S)
        assert rel_error(w, ref.attention_weights) <= MHA_FWD_TOL

    G = rng.standard_normal((B, T, E)).astype(np.float32)
    grads = layer.backward(G)
    expected_grads = ref.backward(round_bf16(G).astype(np.float64))
    for what, got, want in zip(["dq", "dk", "dv"], grads, expected_grads):
        assert got.dtype == np.float32 and is_bf16_valued(got), what
        assert rel_error(got, want) <= MHA_BWD_TOL, (what, rel_error(got, want) / U)
    g16, g64 = layer.grads, ref.grads
    assert list(g16) == list(g64)
    for pname, g in g16.items():
        assert g.dtype == np.float32 and is_bf16_valued(g) and not g.flags.writeable, pname
        if pname == "W_k.bias":
            # 0 in exact arithmetic: the column sums of dK cancel, and what is left is the sum of
            # dK's roundings (~U of the summands). dK's rows are of the size of dQ's (dQ = dS K,
            # dK = dS^T Q), so the query bias's gradient norm stands in for the summands.
            assert np.linalg.norm(g - g64[pname]) <= MHA_BWD_TOL * np.linalg.norm(g64["W_q.bias"])
            continue
        assert rel_error(g, g64[pname]) <= MHA_BWD_TOL, (pname, rel_error(g, g64[pname]) / U)


def test_mha_bfloat16_parameters_and_gradients(rng):
    layer = attn.MultiHeadAttention(16, 2, 0.0, bias=True, dtype="bfloat16", seed=1).eval()
    X = rng.standard_normal((2, 5, 16)).astype(np.float32)
    G = rng.standard_normal((2, 5, 16)).astype(np.float32)
    layer(X, X, X)
    params = dict(layer.named_parameters())
    assert list(params) == list(layer.state_dict())
    for name, p in params.items():
        # NumPy cannot view bf16 memory: float32 copies holding the bf16 values, read-only so an
        # in-place update fails loudly instead of changing a copy.
        assert p.dtype == np.float32 and is_bf16_valued(p) and not p.flags.writeable, name
        np.testing.assert_array_equal(p, layer.state_dict()[name])
    with pytest.raises(ValueError, match="read-only"):
        params["W_o.weight"] *= 2
    # Gradients accumulate as PyTorch's bf16 grad += g (float sum, one rounding): g + g = 2g is
    # exact, so a second identical backward doubles every entry bitwise.
    layer.backward(G)
    first = {k: g.copy() for k, g in layer.grads.items()}
    layer(X, X, X)
    layer.backward(G)
    for name, g in layer.grads.items():
        np.testing.assert_array_equal(g, 2 * first[name], err_msg=name)
    layer.zero_grad()
    assert all(not g.any() for g in layer.grads.values())


def test_mha_bfloat16_state_dict_round_trip(rng):
    layer = attn.MultiHeadAttention(8, 2, 0.0, bias=True, dtype="bfloat16", seed=1).eval()
    X = rng.standard_normal((1, 4, 8)).astype(np.float32)
    out = layer(X, X, X)
    state = layer.state_dict()
    other = attn.MultiHeadAttention(8, 2, 0.0, bias=True, dtype="bfloat16", seed=2).eval()
    other.load_state_dict(state)  # float32 holding bf16 values: loads exactly
    np.testing.assert_array_equal(other(X, X, X), out)
    for name, w in other.state_dict().items():
        np.testing.assert_array_equal(w, state[name], err_msg=name)
    # Float values that are not bf16 numbers are rounded to nearest even on the way in.
    raw = {name: rng.standard_normal(w.shape).astype(np.float32) for name, w in state.items()}
    other.load_state_dict(raw)
    for name, w in other.state_dict().items():
        np.testing.assert_array_equal(w, round_bf16(raw[name]), err_msg=name)


def test_mha_bfloat16_self_attention_converts_once(rng):
    # q, k, v one float32 array: the layer still sees one tensor three times (one conversion), so
    # it takes the stacked-projection path; that gives the same numbers within rounding as three
    # separate (equal) arrays, and bitwise the same as one torch.bfloat16 tensor (tested below).
    layer = attn.MultiHeadAttention(16, 2, 0.0, dtype="bfloat16", seed=4).eval()
    X = rng.standard_normal((2, 6, 16)).astype(np.float32)
    one = layer(X, X, X)
    three = layer(X, X.copy(), X.copy())
    assert rel_error(one, three) <= 2 * U


@needs_torch
def test_mha_torch_bfloat16_round_trip(rng):
    E, H, B, T = 16, 4, 2, 9
    X = round_bf16(rng.standard_normal((B, T, E)).astype(np.float32))
    G = round_bf16(rng.standard_normal((B, T, E)).astype(np.float32))
    lens = np.array([9, 4])
    layer = attn.MultiHeadAttention(E, H, 0.0, bias=True, dtype=torch.bfloat16, seed=2).eval()
    twin = attn.MultiHeadAttention(E, H, 0.0, bias=True, dtype="bfloat16", seed=2).eval()
    for lens_arg in [None, lens]:  # self-attention: packed projection; with lens: three GEMMs
        Xt = to_torch_bf16(X)[0].requires_grad_(True)
        out = layer(Xt, Xt, Xt, lens_arg)
        assert isinstance(out, torch.Tensor) and out.dtype == torch.bfloat16
        assert out.shape == (B, T, E) and not out.requires_grad
        grads = layer.backward(to_torch_bf16(G)[0])
        assert all(isinstance(g, torch.Tensor) and g.dtype == torch.bfloat16 for g in grads)
        # The NumPy path on the same bf16 values: the same kernels, bitwise the same numbers.
        np.testing.assert_array_equal(out.float().numpy(), twin(X, X, X, lens_arg))
        for g, r in zip(grads, twin.backward(G)):
            np.testing.assert_array_equal(g.float().numpy(), r)
    for name, g in layer.grads.items():
        np.testing.assert_array_equal(g, twin.grads[name], err_msg=name)
    assert isinstance(layer.attention_weights, np.ndarray)  # weights: float32, as documented
    # State dict entries convert to torch.bfloat16 exactly.
    for name, w in layer.state_dict().items():
        back = torch.from_numpy(w).bfloat16()
        np.testing.assert_array_equal(back.float().numpy(), w, err_msg=name)


def torch_bf16_mha(E, H, bias):
    """torch.nn.MultiheadAttention(..., batch_first=True).to(torch.bfloat16), with biases that
    matter (torch initialises them to zero)."""
    ref = torch.nn.MultiheadAttention(E, H, dropout=0.0, bias=bias, batch_first=True)
    if bias:
        with torch.no_grad():
            ref.in_proj_bias.normal_(0, 0.1)
            ref.out_proj.bias.normal_(0, 0.1)
    return ref.to(torch.bfloat16)


@needs_torch
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("B,T,E,H", [(2, 13, 32, 4), (3, 8, 24, 2)])
def test_mha_bfloat16_matches_torch_multihead_attention_in_bf16(rng, bias, B, T, E, H):
    """Parity with PyTorch's bf16 module: the same bf16 weights (loaded from torch's bf16 state
    dict, torch names) and inputs. Both are held to the bound above around the float64 module
    (PyTorch rounds at other points, so the two agree within the sum of their errors, not
    bitwise)."""
    ref = torch_bf16_mha(E, H, bias)
    layer = attn.MultiHeadAttention(E, H, 0.0, bias=bias, dtype="bfloat16").eval()
    layer.load_state_dict(ref.state_dict())  # torch.bfloat16 tensors, torch's names
    sd = layer.state_dict()
    np.testing.assert_array_equal(
        np.concatenate([sd["W_q.weight"], sd["W_k.weight"], sd["W_v.weight"]]),
        ref.in_proj_weight.detach().float().numpy())
    X = round_bf16(rng.standard_normal((B, T, E)).astype(np.float32))
    G = round_bf16(rng.standard_normal((B, T, E)).astype(np.float32))
    lens = rng.integers(1, T + 1, size=B)  # >= 1 valid key: torch gives NaN for empty rows
    padding = torch.arange(T)[None, :] >= torch.tensor(lens)[:, None]

    results = {}
    for name, model in [("torch_bf16", ref), ("float64", copy.deepcopy(ref).double())]:
        dt = torch.bfloat16 if name == "torch_bf16" else torch.float64
        Xt = torch.from_numpy(X).to(dt).requires_grad_(True)
        out, _ = model(Xt, Xt, Xt, key_padding_mask=padding, need_weights=False)
        out.backward(torch.from_numpy(G).to(dt))
        results[name] = dict(out=out, dX=Xt.grad, W_in=model.in_proj_weight.grad,
                             W_out=model.out_proj.weight.grad)
    out = layer(*to_torch_bf16(X, X, X), lens)
    terms = [g.float().numpy() for g in layer.backward(to_torch_bf16(G)[0])]  # dq, dk, dv
    g = layer.grads
    ours = dict(out=out.float().numpy(), dX=sum(terms),
                W_in=np.concatenate([g["W_q.weight"], g["W_k.weight"], g["W_v.weight"]]),
                W_out=g["W_o.weight"])
    exact = {k: v.detach().numpy() for k, v in results["float64"].items()}
    theirs = {k: v.detach().float().numpy() for k, v in results["torch_bf16"].items()}
    for key in ["out", "dX", "W_in", "W_out"]:
        if key == "dX":
            # dX = dq + dk + dv: each term is within MHA_BWD_TOL of its own norm, and the terms
            # may cancel, so the bound is relative to the sum of their norms (+ U for the
            # rounding of the sum, which torch's autograd does in bf16).
            scale = MHA_BWD_TOL * sum(np.linalg.norm(t) for t in terms) + \
                U * np.linalg.norm(exact[key])
        else:
            scale = (MHA_FWD_TOL if key == "out" else MHA_BWD_TOL) * np.linalg.norm(exact[key])
        err, err_torch = (np.linalg.norm(np.asarray(a, np.float64) - exact[key])
                          for a in (ours[key], theirs[key]))
        norm = np.linalg.norm(exact[key])
        print(f"{key}: attn bf16 {err / norm / U:.2f} U, torch bf16 {err_torch / norm / U:.2f} U "
              f"from float64 (Frobenius, relative)")
        assert err <= scale, (key, err / norm / U)
        assert err_torch <= scale, (key, "torch", err_torch / norm / U)


@needs_torch
def test_float_mha_widens_torch_bfloat16_inputs(rng):
    X = round_bf16(rng.standard_normal((2, 3, 8)).astype(np.float32))
    layer = attn.MultiHeadAttention(8, 2, 0.0, seed=1).eval()  # float32
    out = layer(*to_torch_bf16(X, X, X))
    assert isinstance(out, np.ndarray) and out.dtype == np.float32
    np.testing.assert_array_equal(out, layer(X, X, X))


def test_mha_bfloat16_repr_and_errors():
    layer = attn.MultiHeadAttention(8, 2, 0.0, dtype="bfloat16")
    assert layer.dtype == "bfloat16" and repr(layer).startswith("MultiHeadAttention(")
    with pytest.raises(attn.Error, match="dtype float16 is not supported, expected float32, "
                                         "float64 or bfloat16") as e:
        attn.MultiHeadAttention(8, 2, 0.0, dtype="float16")
    assert e.value.op == "MultiHeadAttention"
    with pytest.raises(attn.Error, match="MultiHeadAttention"):  # shapes checked as in float32
        layer(np.ones((1, 2, 8), np.float32), np.ones((2, 2, 8), np.float32),
              np.ones((2, 2, 8), np.float32))
    with pytest.raises(attn.Error):  # a state dict of the wrong shape changes nothing
        layer.load_state_dict({"W_q.weight": np.ones((3, 3), np.float32)}, strict=False)


# ------------------------------------------------------------------------------------------------
# Errors


def test_mixed_dtypes_are_errors(rng):
    q, k, v = qkv(rng, 1, 2, 3, 4)
    with pytest.raises(attn.Error, match="keys has dtype float64 but queries has dtype float32") \
            as e:
        attn.scaled_dot_product_attention(q, k.astype(np.float64), v)
    assert e.value.op == "scaled_dot_product_attention"
    if torch is not None:
        with pytest.raises(attn.Error, match="keys has dtype float32 but queries has dtype "
                                             "bfloat16.*dtype='bfloat16'"):
            attn.scaled_dot_product_attention(to_torch_bf16(q)[0], k, v)


@needs_torch
@pytest.mark.parametrize("call,op", [
    (lambda x: attn.masked_softmax(x), "masked_softmax"),
    (lambda x: attn.masked_softmax_backward(x, x), "masked_softmax_backward"),
    (lambda x: attn.dropout(x, 0.5), "dropout"),
])
def test_ops_without_bf16_kernels_reject_torch_bfloat16(call, op):
    x = torch.ones((1, 3, 4), dtype=torch.bfloat16)
    with pytest.raises(attn.Error, match="is a torch.bfloat16 tensor, expected float32 or "
                                         "float64") as e:
        call(x)
    assert e.value.op == op and op + " has no bfloat16 kernel" in str(e.value)


@pytest.mark.parametrize("make,op", [
    (lambda: attn.AdditiveAttention(8, 0.0, dtype="bfloat16"), "AdditiveAttention"),
    (lambda: attn.TransformerEncoderBlock(8, 16, 2, 0.0, dtype="bfloat16"),
     "TransformerEncoderBlock"),
    (lambda: attn.PositionalEncoding(8, 0.0, dtype="bfloat16"), "PositionalEncoding"),
    (lambda: attn.sinusoidal_encoding(4, 8, "bfloat16"), "sinusoidal_encoding"),
])
def test_layers_without_bf16_reject_dtype_bfloat16(make, op):
    with pytest.raises(attn.Error, match=f"dtype bfloat16 is not supported by {op}, expected "
                                         "float32 or float64") as e:
        make()
    assert e.value.op == op
    assert "bfloat16 runs in scaled_dot_product_attention, linear, DotProductAttention and " \
        "MultiHeadAttention" in str(e.value)


def test_unknown_compute_dtype_is_an_error():
    q = np.ones((1, 2, 4), np.float32)
    with pytest.raises(attn.Error, match="dtype float16 is not supported, expected float32, "
                                         "float64 or bfloat16"):
        attn.scaled_dot_product_attention(q, q, q, dtype="float16")
