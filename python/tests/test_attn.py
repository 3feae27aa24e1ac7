"""attn's Python module against PyTorch running the d2l code (d2l_reference.py), on random cases.

Float32 comparisons use rtol 1e-5 / atol 1e-6, float64 rtol 1e-10 / atol 1e-12 (conftest.py).
Gradients come from torch.autograd on loss = sum(output * G) for a random G, which is what
attn's backward(G) computes.
"""

import copy

import numpy as np
import pytest
import torch

import attn
import d2l_reference as d2l
from conftest import assert_close, assert_close_f32
from d2l_reference import n, t

DTYPES = [np.float32, np.float64]


def random_lens(rng, B, S, T=None, kind="int", allow_zero=True):
    """valid_lens (B,) or (B, T): ints in [0 or 1, S + 1] (S + 1 = no masking), or floats."""
    shape = (B,) if T is None else (B, T)
    low = 0 if allow_zero else 1
    if kind == "float":
        return rng.uniform(low, S + 1, size=shape).astype(np.float32)
    return rng.integers(low, S + 2, size=shape).astype(np.int64)


# ------------------------------------------------------------------------------------------------
# masked_softmax


def test_masked_softmax_semantics_vectors():
    # The reference notes' vectors: X = arange(16).reshape(2, 2, 4) / 10.
    X = np.arange(16, dtype=np.float32).reshape(2, 2, 4) / 10
    Y = attn.masked_softmax(X, np.array([2, 3]))
    assert_close(Y[0, 0], [0.47502080, 0.52497917, 0, 0], np.float32)
    assert_close(Y[1, 1], [0.30060959, 0.33222497, 0.36716539, 0], np.float32)
    Y = attn.masked_softmax(X, np.array([[1, 3], [2, 4]]))
    assert_close(Y[1, 1], [0.21383823, 0.23632777, 0.26118258, 0.28865141], np.float32)
    assert np.array_equal(Y[0, 0], [1, 0, 0, 0])
    # A row with no valid key is uniform over every key, padding included (d2l), exactly.
    Y = attn.masked_softmax(X, np.array([0, 4]))
    assert np.array_equal(Y[0], np.full((2, 4), 0.25, np.float32))
    assert np.array_equal(attn.masked_softmax(X, np.array([-1, 4])), Y)
    # Float lengths: 2.5 keeps keys 0, 1, 2.
    Y = attn.masked_softmax(X, np.array([2.5, 1.0]))
    assert (Y[0, :, :3] > 0).all() and (Y[0, :, 3] == 0).all()
    assert np.array_equal(Y[1], [[1, 0, 0, 0]] * 2)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("lens_kind", ["none", "1d", "2d", "float1d", "float2d"])
@pytest.mark.parametrize("shape", [(2, 3, 5), (1, 1, 1), (4, 7, 3), (3, 2, 17)])
def test_masked_softmax_matches_d2l(rng, dtype, lens_kind, shape):
    B, T, S = shape
    X = (rng.standard_normal(shape) * 3).astype(dtype)
    X_before = X.copy()
    lens = None
    if lens_kind != "none":
        lens = random_lens(rng, B, S, T if lens_kind.endswith("2d") else None,
                           "float" if lens_kind.startswith("float") else "int")
    expected = d2l.masked_softmax(t(X), None if lens is None else t(lens))
    actual = attn.masked_softmax(X, lens)
    assert actual.dtype == dtype and actual.shape == shape
    assert_close(actual, n(expected), dtype)
    assert np.array_equal(X, X_before), "attn must not write -1e6 into its input (d2l does)"


@pytest.mark.parametrize("lens_dtype", [np.int32, np.int64, np.float32, np.float64, np.uint8])
def test_masked_softmax_valid_lens_dtypes(rng, lens_dtype):
    X = rng.standard_normal((3, 2, 6)).astype(np.float32)
    lens = np.array([0, 2, 6], dtype=lens_dtype)
    expected = d2l.masked_softmax(t(X), t(lens.astype(np.int64)))
    assert_close(attn.masked_softmax(X, lens), n(expected), np.float32)
    # Python lists work too.
    assert_close(attn.masked_softmax(X, [0, 2, 6]), n(expected), np.float32)


def test_masked_softmax_zero_policy_and_causal(rng):
    X = rng.standard_normal((2, 4, 4)).astype(np.float32)
    Y = attn.masked_softmax(X, np.array([0, 3]), masked_rows="zero")
    assert np.array_equal(Y[0], np.zeros((4, 4), np.float32))
    # causal: query t sees keys 0..t, as torch's tril mask with -inf defines it.
    allowed = torch.ones(4, 4, dtype=torch.bool).tril()
    expected = torch.softmax(t(X).masked_fill(~allowed, float("-inf")), dim=-1)
    assert_close(attn.masked_softmax(X, causal=True), n(expected), np.float32)


def test_masked_softmax_backward_matches_autograd(rng):
    X = rng.standard_normal((2, 3, 5))
    lens = np.array([[2, 5, 0], [1, 3, 4]])
    G = rng.standard_normal(X.shape)
    Xt = t(X, grad=True)
    (d2l.masked_softmax(Xt, t(lens)) * t(G)).sum().backward()
    Y = attn.masked_softmax(X, lens)
    dX = attn.masked_softmax_backward(G, Y, lens)
    # d2l's row with no valid key is the constant uniform: zero gradient, as attn documents.
    assert_close(dX, n(Xt.grad), np.float64)


# ------------------------------------------------------------------------------------------------
# scaled_dot_product_attention


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("lens_kind", ["none", "1d", "2d"])
@pytest.mark.parametrize("B,T,S,D,Dv", [(2, 4, 6, 8, 3), (1, 1, 1, 1, 1), (3, 5, 2, 7, 9)])
def test_scaled_dot_product_attention_matches_d2l(rng, dtype, lens_kind, B, T, S, D, Dv):
    q = rng.standard_normal((B, T, D)).astype(dtype)
    k = rng.standard_normal((B, S, D)).astype(dtype)
    v = rng.standard_normal((B, S, Dv)).astype(dtype)
    lens = None if lens_kind == "none" else random_lens(rng, B, S, T if lens_kind == "2d" else None)
    ref = d2l.DotProductAttention(0.5).eval()
    expected = ref(t(q), t(k), t(v), None if lens is None else t(lens))
    out, weights = attn.scaled_dot_product_attention(q, k, v, lens, need_weights=True)
    assert out.shape == (B, T, Dv) and out.dtype == dtype
    assert_close(out, n(expected), dtype, "output")
    assert_close(weights, n(ref.attention_weights), dtype, "weights")
    assert_close(attn.scaled_dot_product_attention(q, k, v, lens), out, dtype)


@pytest.mark.parametrize("T,S", [(4, 4), (4, 2), (3, 5)])
def test_scaled_dot_product_attention_causal_matches_tril_mask(rng, T, S):
    q = rng.standard_normal((2, T, 4)).astype(np.float32)
    k = rng.standard_normal((2, S, 4)).astype(np.float32)
    v = rng.standard_normal((2, S, 3)).astype(np.float32)
    expected, expected_w = d2l.causal_attention(t(q), t(k), t(v))
    out, w = attn.scaled_dot_product_attention(q, k, v, causal=True, need_weights=True)
    assert_close(out, n(expected), np.float32)
    assert_close(w, n(expected_w), np.float32)


def test_scaled_dot_product_attention_strided_inputs_match_contiguous(rng):
    base = rng.standard_normal((3, 6, 10)).astype(np.float32)
    q = base[:, :4, ::2]                  # (3, 4, 5), element strides (60, 10, 2)
    k = np.swapaxes(base[:, :5, :6], 1, 2)[:, :5, :5].transpose(0, 2, 1)  # transposed view
    v = base[:, 1:6, 5:]
    lens = np.array([5, 2, 3])
    expected = attn.scaled_dot_product_attention(*(np.ascontiguousarray(a) for a in (q, k, v)), lens)
    assert_close(attn.scaled_dot_product_attention(q, k, v, lens), expected, np.float32)


def test_scaled_dot_product_attention_dropout_and_scale(rng):
    q, k, v = (rng.standard_normal((2, 3, 4)).astype(np.float32) for _ in range(3))
    assert not attn.scaled_dot_product_attention(q, k, v, dropout=1.0).any()
    # scale replaces 1/sqrt(D): scale = 1 equals pre-multiplying q by sqrt(D).
    assert_close(attn.scaled_dot_product_attention(q, k, v, scale=1.0),
                 attn.scaled_dot_product_attention(q * 2, k, v), np.float32)
    # A row with no valid key: d2l averages all values, PyTorch SDPA gives zeros.
    out = attn.scaled_dot_product_attention(q, k, v, np.array([0, 3]))
    assert_close(out[0], np.broadcast_to(v[0].mean(0), (3, 4)), np.float32)
    out = attn.scaled_dot_product_attention(q, k, v, np.array([0, 3]), masked_rows="zero")
    assert not out[0].any()


# ------------------------------------------------------------------------------------------------
# The dropout stream: attn's Philox 4x32-10 restated in NumPy (the convention in
# attn/core/rng.hpp), so train-mode outputs can be checked exactly.

def philox_uniform(seed, offset, count):
    mask32 = np.uint64(0xFFFFFFFF)
    i = np.arange(count, dtype=np.uint64)
    block = i >> np.uint64(2)
    c = [block & mask32, block >> np.uint64(32),
         np.full_like(i, offset & 0xFFFFFFFF), np.full_like(i, offset >> 32)]
    k0, k1 = np.uint64(seed & 0xFFFFFFFF), np.uint64(seed >> 32)
    for _ in range(10):
        p0, p1 = np.uint64(0xD2511F53) * c[0], np.uint64(0xCD9E8D57) * c[2]
        c = [(p1 >> np.uint64(32)) ^ c[1] ^ k0, p1 & mask32, (p0 >> np.uint64(32)) ^ c[3] ^ k1,
             p0 & mask32]
        k0 = (k0 + np.uint64(0x9E3779B9)) & mask32
        k1 = (k1 + np.uint64(0xBB67AE85)) & mask32
    words = np.stack(c)[(i & np.uint64(3)).astype(np.intp), np.arange(count)]
    return (words >> np.uint64(8)).astype(np.float32) * np.float32(2.0**-24)


def test_dropout_follows_the_philox_stream(rng):
    x = rng.standard_normal((3, 5, 7)).astype(np.float32)
    p, seed, offset = 0.3, 1234567890123, 5
    keep = (philox_uniform(seed, offset, x.size) >= np.float32(p)).reshape(x.shape)
    assert_close(attn.dropout(x, p, seed=seed, offset=offset), np.where(keep, x / (1 - p), 0),
                 np.float32)
    assert 0.5 < keep.mean() < 0.9


def test_dot_product_attention_train_mode_drops_weights(rng):
    q, k, v = (rng.standard_normal((2, 4, 3)).astype(np.float32) for _ in range(3))
    layer = attn.DotProductAttention(0.5, seed=7)  # training mode, as PyTorch modules start
    out = layer(q, k, v)
    w = layer.attention_weights  # pre-dropout
    keep = (philox_uniform(7, 0, w.size) >= 0.5).reshape(w.shape)  # first call: offset 0
    assert_close(out, np.matmul(np.where(keep, w / 0.5, 0), v), np.float32)
    assert_close(layer.eval()(q, k, v), np.matmul(w, v), np.float32)


# ------------------------------------------------------------------------------------------------
# Layers against d2l's modules: forward, attention weights, input and parameter gradients


def run_torch(module, inputs, lens, G):
    """Forward + backward of a torch module; returns (output, [input grads])."""
    tensors = [t(a, grad=True) for a in inputs]
    out = module(*tensors, None if lens is None else t(lens))
    (out * t(G)).sum().backward()
    return n(out), [n(x.grad) for x in tensors]


@pytest.mark.parametrize("dtype", DTYPES)
def test_dot_product_attention_module_matches_d2l(rng, dtype):
    B, T, S, D, Dv = 3, 4, 5, 6, 2
    q, k, v = (rng.standard_normal(s).astype(dtype) for s in [(B, T, D), (B, S, D), (B, S, Dv)])
    lens = random_lens(rng, B, S, T)
    G = rng.standard_normal((B, T, Dv)).astype(dtype)
    ref = d2l.DotProductAttention(0.1).eval()
    expected, expected_grads = run_torch(ref, [q, k, v], lens, G)
    layer = attn.DotProductAttention(0.1, dtype=dtype).eval()
    assert_close(layer(q, k, v, lens), expected, dtype, "output")
    assert_close(layer.attention_weights, n(ref.attention_weights), dtype, "weights")
    for name, got, want in zip("qkv", layer.backward(G), expected_grads):
        assert_close(got, want, dtype, "d" + name)
    assert layer.state_dict() == {} and layer.grads == {}


def torch_d2l_mha(E, H, bias, widths, dtype):
    """d2l's MultiHeadAttention with its lazy projections materialised, in eval mode."""
    ref = d2l.MultiHeadAttention(E, H, 0.2, bias=bias)
    ref(*(torch.zeros(1, 1, w) for w in widths), None)
    return (ref.double() if dtype == np.float64 else ref).eval()


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("lens_kind", ["none", "1d", "2d"])
@pytest.mark.parametrize("B,T,S,E,H,widths", [
    (2, 4, 6, 8, 2, (8, 8, 8)),      # D = 4
    (3, 5, 3, 10, 2, (7, 3, 5)),     # D = 5, every input width different (lazy projections)
    (1, 1, 1, 6, 6, (2, 2, 2)),      # D = 1
])
def test_multihead_attention_with_d2l_weights(rng, dtype, bias, lens_kind, B, T, S, E, H, widths):
    ref = torch_d2l_mha(E, H, bias, widths, dtype)
    layer = attn.MultiHeadAttention(E, H, 0.2, bias=bias, dtype=dtype)
    layer.load_state_dict(d2l.state_dict_numpy(ref))
    layer.eval()
    Dq, Dk, Dv = widths
    q, k, v = (rng.standard_normal(s).astype(dtype) for s in [(B, T, Dq), (B, S, Dk), (B, S, Dv)])
    lens = None if lens_kind == "none" else random_lens(rng, B, S, T if lens_kind == "2d" else None)
    G = rng.standard_normal((B, T, E)).astype(dtype)
    expected, expected_grads = run_torch(ref, [q, k, v], lens, G)

    out = layer(q, k, v, lens)
    assert out.shape == (B, T, E) and out.dtype == dtype
    assert_close(out, expected, dtype, "output")
    assert_close(layer.attention_weights, n(ref.attention.attention_weights), dtype, "weights")
    for name, got, want in zip(["queries", "keys", "values"], layer.backward(G), expected_grads):
        assert_close(got, want, dtype, "d " + name)
    grads = layer.grads
    assert list(grads) == list(ref.state_dict())
    for name, p in ref.named_parameters():
        assert_close(grads[name], n(p.grad), dtype, "grad " + name)


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("B,T,E,H", [(2, 5, 8, 2), (3, 4, 12, 3), (1, 6, 4, 1)])
def test_multihead_attention_with_torch_multihead_weights(rng, bias, B, T, E, H):
    ref = torch.nn.MultiheadAttention(E, H, dropout=0.0, bias=bias, batch_first=True)
    if bias:  # torch initialises the biases to zero; make them matter
        with torch.no_grad():
            ref.in_proj_bias.normal_()
            ref.out_proj.bias.normal_()
    # The reference backend (double accumulation): the fast paths' float32 accuracy has its own
    # tests (test_kernels_matmul_cpu, test_kernels_flash_cpu); this one is about names and
    # semantics.
    layer = attn.MultiHeadAttention(E, H, 0.0, bias=bias, backend="reference").eval()
    layer.load_state_dict(ref.state_dict())  # torch tensors and torch names, as they come
    X = rng.standard_normal((B, T, E)).astype(np.float32)
    lens = rng.integers(1, T + 1, size=B)  # torch gives NaN for rows with no valid key
    G = rng.standard_normal((B, T, E)).astype(np.float32)

    padding = torch.arange(T)[None, :] >= torch.tensor(lens)[:, None]
    ref64 = copy.deepcopy(ref).double()  # the truth that forgives torch's float32 rounding
    for model in (ref64, ref):
        Xt = t(X.astype(np.float64) if model is ref64 else X, grad=True)
        out, weights = model(Xt, Xt, Xt, key_padding_mask=padding, need_weights=True,
                             average_attn_weights=False)
        (out * t(G.astype(np.float64) if model is ref64 else G)).sum().backward()

    assert_close(layer(X, X, X, lens), n(out), np.float32, "output")
    assert_close(layer.attention_weights.reshape(B, H, T, T), n(weights), np.float32, "weights")
    dq, dk, dv = layer.backward(G)
    assert_close(dq + dk + dv, n(Xt.grad), np.float32, "dX (self-attention: sum of the three)")
    g = layer.grads
    assert_close_f32(np.concatenate([g["W_q.weight"], g["W_k.weight"], g["W_v.weight"]]),
                     n(ref.in_proj_weight.grad), n(ref64.in_proj_weight.grad), "in_proj_weight")
    assert_close_f32(g["W_o.weight"], n(ref.out_proj.weight.grad),
                     n(ref64.out_proj.weight.grad), "out_proj.weight")
    if bias:
        assert_close_f32(np.concatenate([g["W_q.bias"], g["W_k.bias"], g["W_v.bias"]]),
                         n(ref.in_proj_bias.grad), n(ref64.in_proj_bias.grad), "in_proj_bias")
        assert_close_f32(g["W_o.bias"], n(ref.out_proj.bias.grad),
                         n(ref64.out_proj.bias.grad), "out_proj.bias")


def test_multihead_attention_with_torch_separate_projection_weights(rng):
    # kdim/vdim != embed_dim: torch stores q_proj_weight, k_proj_weight, v_proj_weight.
    E, H, B, T, S = 6, 3, 2, 3, 4
    ref = torch.nn.MultiheadAttention(E, H, bias=False, kdim=5, vdim=2, batch_first=True)
    layer = attn.MultiHeadAttention(E, H, 0.0).eval()
    layer.load_state_dict({k: n(v) for k, v in ref.state_dict().items()})
    q, k, v = (rng.standard_normal(s).astype(np.float32) for s in [(B, T, E), (B, S, 5), (B, S, 2)])
    expected, _ = ref(t(q), t(k), t(v), need_weights=False)
    assert_close(layer(q, k, v), n(expected), np.float32)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("lens_kind", ["1d", "2d"])
def test_additive_attention_matches_d2l(rng, dtype, lens_kind):
    B, T, S, Dq, Dk, Dv, h = 2, 3, 5, 4, 6, 2, 7
    ref = d2l.AdditiveAttention(h, 0.1)
    ref(torch.zeros(1, 1, Dq), torch.zeros(1, 1, Dk), torch.zeros(1, 1, Dv), None)
    ref = (ref.double() if dtype == np.float64 else ref).eval()
    layer = attn.AdditiveAttention(h, 0.1, dtype=dtype).eval()
    layer.load_state_dict(d2l.state_dict_numpy(ref))
    q, k, v = (rng.standard_normal(s).astype(dtype) for s in [(B, T, Dq), (B, S, Dk), (B, S, Dv)])
    lens = random_lens(rng, B, S, T if lens_kind == "2d" else None)
    G = rng.standard_normal((B, T, Dv)).astype(dtype)
    expected, expected_grads = run_torch(ref, [q, k, v], lens, G)
    assert_close(layer(q, k, v, lens), expected, dtype, "output")
    assert_close(layer.attention_weights, n(ref.attention_weights), dtype, "weights")
    for name, got, want in zip("qkv", layer.backward(G), expected_grads):
        assert_close(got, want, dtype, "d" + name)
    for name, p in ref.named_parameters():
        assert_close(layer.grads[name], n(p.grad), dtype, "grad " + name)


def test_additive_attention_book_example():
    # Old edition's deterministic example: all keys equal, so all scores tie.
    keys = np.ones((2, 10, 2), np.float32)
    values = np.tile(np.arange(40, dtype=np.float32).reshape(1, 10, 4), (2, 1, 1))
    queries = np.random.default_rng(0).normal(size=(2, 1, 20)).astype(np.float32)
    layer = attn.AdditiveAttention(8, 0.1).eval()
    out = layer(queries, keys, values, np.array([2, 6]))
    assert_close(out, [[[2, 3, 4, 5]], [[10, 11, 12, 13]]], np.float32)
    assert_close(layer.attention_weights[1, 0], [1 / 6] * 6 + [0] * 4, np.float32)


# ------------------------------------------------------------------------------------------------
# Positional encoding


@pytest.mark.parametrize("num_hiddens", [4, 8, 32, 100])
def test_sinusoidal_encoding_matches_d2l(num_hiddens):
    P = attn.sinusoidal_encoding(1000, num_hiddens)
    assert P.shape == (1000, num_hiddens) and P.dtype == np.float32
    # Torch's float32 pow is not correctly rounded, so its 10000^(2j/d) can be 1 ulp away from
    # attn's (semantics notes, section 4); the angle i / den then moves by ~i * 2^-24 relative,
    # i.e. by up to ~i * 2^-22 radians here, and sin/cos with it. Beyond that, fp32 tolerance.
    reference = n(d2l.PositionalEncoding(num_hiddens, 0).P[0])
    position = np.arange(1000, dtype=np.float64)[:, None]
    assert (np.abs(P - reference) <= 1e-6 + 1e-5 * np.abs(reference) + position * 2.0**-22).all()
    assert_close(P[:8], reference[:8], np.float32)  # small angles: plain fp32 tolerance
    assert np.array_equal(P[0], np.tile([0, 1], num_hiddens // 2).astype(np.float32))


def test_sinusoidal_encoding_exact_and_odd_widths():
    i = np.arange(1500)[:, None]
    j = np.arange(7)
    angle = i / np.power(10000.0, (j - j % 2) / 7)
    truth = np.where(j % 2 == 0, np.sin(angle), np.cos(angle))
    assert_close(attn.sinusoidal_encoding(1500, 7, np.float64), truth, np.float64)
    exact32 = attn.sinusoidal_encoding(1500, 7, exact=True)
    np.testing.assert_allclose(exact32, truth, rtol=0, atol=6e-8)  # rounded once to float32


@pytest.mark.parametrize("num_hiddens,T", [(8, 5), (20, 60), (6, 1)])
def test_positional_encoding_matches_d2l(rng, num_hiddens, T):
    X = rng.standard_normal((2, T, num_hiddens)).astype(np.float32)
    ref = d2l.PositionalEncoding(num_hiddens, 0.5).eval()
    layer = attn.PositionalEncoding(num_hiddens, 0.5).eval()
    assert_close(layer(X), n(ref(t(X))), np.float32)
    assert_close(layer.P, n(ref.P), np.float32)
    G = rng.standard_normal(X.shape).astype(np.float32)
    assert_close(layer.backward(G), G, np.float32)  # eval: out = X + P, so dX = G
    assert layer.state_dict() == {}


def test_positional_encoding_beyond_d2l_limits(rng):
    # d2l fails for odd widths and for sequences longer than max_len; attn does not.
    layer = attn.PositionalEncoding(5, 0.0, max_len=10).eval()
    X = np.zeros((1, 25, 5), np.float32)
    assert_close(layer(X)[0], attn.sinusoidal_encoding(25, 5), np.float32)


def test_positional_encoding_train_mode_dropout(rng):
    X = rng.standard_normal((2, 6, 8)).astype(np.float32)
    layer = attn.PositionalEncoding(8, 0.25, seed=3)
    out = layer(X)
    keep = (philox_uniform(3, 0, X.size) >= np.float32(0.25)).reshape(X.shape)
    assert_close(out, np.where(keep, (X + layer.P[:, :6]) / 0.75, 0), np.float32)
    G = np.ones_like(X)
    assert_close(layer.backward(G), np.where(keep, G / 0.75, 0), np.float32)


# ------------------------------------------------------------------------------------------------
# Transformer encoder (d2l 11.7)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("use_bias", [False, True])
def test_transformer_encoder_block_matches_d2l(rng, dtype, use_bias):
    B, T, E, F, H = 2, 5, 8, 12, 2
    ref = d2l.TransformerEncoderBlock(E, F, H, 0.3, use_bias)
    ref(torch.zeros(1, 1, E), None)  # materialise the lazy layers
    ref = (ref.double() if dtype == np.float64 else ref).eval()
    layer = attn.TransformerEncoderBlock(E, F, H, 0.3, use_bias, dtype=dtype).eval()
    layer.load_state_dict(d2l.state_dict_numpy(ref))
    assert list(layer.state_dict()) == list(ref.state_dict())
    X = rng.standard_normal((B, T, E)).astype(dtype)
    lens = np.array([3, 5])
    G = rng.standard_normal((B, T, E)).astype(dtype)
    expected, (expected_dX,) = run_torch(lambda x, l: ref(x, l), [X], lens, G)
    assert_close(layer(X, lens), expected, dtype, "output")
    assert_close(layer.attention_weights, n(ref.attention.attention.attention_weights), dtype)
    assert_close(layer.backward(G), expected_dX, dtype, "dX")
    for name, p in ref.named_parameters():
        assert_close(layer.grads[name], n(p.grad), dtype, "grad " + name)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("lens_kind", ["none", "1d", "2d"])
def test_transformer_encoder_matches_d2l(rng, dtype, lens_kind):
    V, B, T, E, F, H, L = 20, 2, 6, 8, 16, 2, 2
    ref = d2l.TransformerEncoder(V, E, F, H, L, 0.2)
    ref(torch.zeros(1, 1, dtype=torch.long), None)
    ref = (ref.double() if dtype == np.float64 else ref).eval()
    if dtype == np.float64:
        ref.pos_encoding.P = ref.pos_encoding.P.double()
    layer = attn.TransformerEncoder(V, E, F, H, L, 0.2, dtype=dtype, backend="reference").eval()
    layer.load_state_dict(d2l.state_dict_numpy(ref))
    assert list(layer.state_dict()) == list(ref.state_dict())
    ids = rng.integers(0, V, size=(B, T))
    lens = None if lens_kind == "none" else random_lens(
        rng, B, T, T if lens_kind == "2d" else None, allow_zero=False)
    G = rng.standard_normal((B, T, E)).astype(dtype)

    out = ref(torch.tensor(ids), None if lens is None else t(lens))
    (out * t(G)).sum().backward()
    # The same weights in float64: forgives torch's float32 rounding in the gradients.
    ref64 = d2l.TransformerEncoder(V, E, F, H, L, 0.2)
    ref64(torch.zeros(1, 1, dtype=torch.long), None)
    ref64 = ref64.double().eval()
    ref64.load_state_dict(ref.state_dict())
    ref64.pos_encoding.P = ref64.pos_encoding.P.double()
    out64 = ref64(torch.tensor(ids), None if lens is None else t(lens))
    (out64 * t(G.astype(np.float64))).sum().backward()
    grads64 = dict(ref64.named_parameters())
    # float64: attn's P is exact in double, d2l's is float32 widened (differs by ~1e-7 at these
    # few positions), so the float64 case compares at float32 tolerance.
    tol_dtype = np.float32
    assert_close(layer(ids, lens), n(out), tol_dtype, "output")
    for i, w in enumerate(layer.attention_weights):
        assert_close(w, n(ref.attention_weights[i]), tol_dtype, f"block {i} weights")
    assert layer.backward(G) is None
    for name, p in ref.named_parameters():
        assert_close_f32(layer.grads[name], n(p.grad), n(grads64[name].grad), "grad " + name)


def test_transformer_encoder_rejects_float_ids():
    layer = attn.TransformerEncoder(10, 4, 8, 2, 1, 0.0)
    with pytest.raises(attn.Error, match="integer token ids"):
        layer(np.zeros((1, 3), np.float32))
    out = layer(np.zeros((1, 3), np.int32))
    assert out.shape == (1, 3, 4)
