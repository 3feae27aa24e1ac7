"""bfloat16 through the binding: scaled_dot_product_attention(..., dtype="bfloat16") and
DotProductAttention(dtype="bfloat16") on NumPy float32 arrays, torch.bfloat16 tensors used in
place, and the errors for mixed dtypes and ops without bfloat16 kernels.

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
        "assert out.dtype == np.float32 and 'torch' not in [m for m in sys.modules if sys.modules[m]]\n"
        "print('ok')\n")
    env = dict(os.environ)
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env)
    assert r.returncode == 0 and r.stdout.strip() == "ok", r.stderr


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
    (lambda x: attn.linear(x, np.ones((2, 4), np.float32)), "linear"),
    (lambda x: attn.dropout(x, 0.5), "dropout"),
])
def test_ops_without_bf16_kernels_reject_torch_bfloat16(call, op):
    x = torch.ones((1, 3, 4), dtype=torch.bfloat16)
    with pytest.raises(attn.Error, match="is a torch.bfloat16 tensor, expected float32 or "
                                         "float64") as e:
        call(x)
    assert e.value.op == op and op + " has no bfloat16 kernel" in str(e.value)


@pytest.mark.parametrize("make,op", [
    (lambda: attn.MultiHeadAttention(8, 2, 0.0, dtype="bfloat16"), "MultiHeadAttention"),
    (lambda: attn.AdditiveAttention(8, 0.0, dtype="bfloat16"), "AdditiveAttention"),
    (lambda: attn.PositionalEncoding(8, 0.0, dtype="bfloat16"), "PositionalEncoding"),
    (lambda: attn.sinusoidal_encoding(4, 8, "bfloat16"), "sinusoidal_encoding"),
])
def test_layers_without_bf16_reject_dtype_bfloat16(make, op):
    with pytest.raises(attn.Error, match=f"dtype bfloat16 is not supported by {op}, expected "
                                         "float32 or float64") as e:
        make()
    assert e.value.op == op


def test_unknown_compute_dtype_is_an_error():
    q = np.ones((1, 2, 4), np.float32)
    with pytest.raises(attn.Error, match="dtype float16 is not supported, expected float32, "
                                         "float64 or bfloat16"):
        attn.scaled_dot_product_attention(q, q, q, dtype="float16")
