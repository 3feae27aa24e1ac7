"""attn.torch: attn's fused attention as a torch.autograd.Function and as a drop-in
nn.MultiheadAttention, checked against torch's own math (attn.torch.reference_attention and
nn.MultiheadAttention), by gradcheck in float64, and by training d2l's TransformerEncoder with the
module swapped in."""

import copy

import numpy as np
import pytest

torch = pytest.importorskip("torch")

import attn  # noqa: E402
import attn.torch as at  # noqa: E402
from conftest import autograd_node_names  # noqa: E402
from d2l_reference import TransformerEncoder  # noqa: E402

nn = torch.nn


def randn(rng, *shape, dtype=torch.float64, grad=True):
    x = torch.tensor(rng.standard_normal(shape), dtype=dtype)
    return x.requires_grad_(grad)


def lens_of(rng, kind, B, T, S):
    if kind is None:
        return None
    if kind == "1d":
        return torch.tensor(rng.integers(1, S + 1, size=B))
    return torch.tensor(rng.integers(1, S + 1, size=(B, T)))


# ------------------------------------------------------------------------------------------------
# The Function


@pytest.mark.parametrize("heads", [None, 2])
@pytest.mark.parametrize("lens", [None, "1d", "2d"])
@pytest.mark.parametrize("causal", [False, True])
def test_gradcheck_float64(rng, heads, lens, causal):
    """float64 runs attn's reference kernels forward and backward: the analytic gradient is
    attn's backward, checked against finite differences of attn's forward."""
    B, T, S, D, Dv = 2, 3, 4 if not causal else 3, 3, 2
    lead = (B,) if heads is None else (B, heads)
    q, k, v = randn(rng, *lead, T, D), randn(rng, *lead, S, D), randn(rng, *lead, S, Dv)
    vl = lens_of(rng, lens, B, T, S)
    f = lambda q, k, v: at.scaled_dot_product_attention(q, k, v, valid_lens=vl,  # noqa: E731
                                                        is_causal=causal)
    assert torch.autograd.gradcheck(f, (q, k, v), eps=1e-6, atol=1e-8)
    # ... and attn's forward is torch's math
    expected = at.reference_attention(q, k, v, vl, causal=causal)
    np.testing.assert_allclose(f(q, k, v).detach(), expected.detach(), rtol=1e-12, atol=1e-13)


def test_gradcheck_float64_dropout(rng):
    """With dropout the mask must be the same on every call gradcheck makes: fix the stream
    offset. The backward redraws the forward's mask from (seed, offset)."""
    ctx = attn.Context(seed=7)
    q, k, v = randn(rng, 2, 3, 4), randn(rng, 2, 5, 4), randn(rng, 2, 5, 3)

    def f(q, k, v):
        ctx.dropout_offset = 11
        return at.scaled_dot_product_attention(q, k, v, valid_lens=torch.tensor([5, 2]),
                                               dropout_p=0.3, ctx=ctx)

    assert torch.autograd.gradcheck(f, (q, k, v), eps=1e-6, atol=1e-8)
    assert ctx.dropout_offset == 12  # one offset per call that drops


def test_masked_rows_policies(rng):
    q, k, v = randn(rng, 2, 3, 4), randn(rng, 2, 5, 4), randn(rng, 2, 5, 3)
    vl = torch.tensor([0, 3])
    for policy in ("uniform", "zero"):
        out = at.scaled_dot_product_attention(q, k, v, valid_lens=vl, masked_rows=policy)
        ref = at.reference_attention(q, k, v, vl, masked_rows=policy)
        np.testing.assert_allclose(out.detach(), ref.detach(), rtol=1e-12, atol=1e-13)
    zero = at.scaled_dot_product_attention(q, k, v, valid_lens=vl, masked_rows="zero")
    assert torch.all(zero[0] == 0)
    assert torch.isfinite(zero).all()


@pytest.mark.parametrize("layout", ["3d", "heads_view", "4d_contiguous"])
@pytest.mark.parametrize("lens", [None, "1d", "2d"])
@pytest.mark.parametrize("causal", [False, True])
def test_float32_fused_matches_torch_math(rng, layout, lens, causal):
    """float32 runs the fused kernels; torch's math in float64 on the same values is the truth."""
    B, H, T, D = 2, 3, 17, 8
    S = T if causal else 21
    if layout == "3d":
        q, k, v = (randn(rng, B, L, D, dtype=torch.float32) for L in (T, S, S))
    elif layout == "heads_view":  # the usual head split: a view of (B, L, H*D)
        q, k, v = (randn(rng, B, L, H * D, dtype=torch.float32, grad=False).view(
            B, L, H, D).transpose(1, 2).requires_grad_(True) for L in (T, S, S))
        assert at._as_heads_view(q.detach()) is not None
    else:
        q, k, v = (randn(rng, B, H, L, D, dtype=torch.float32) for L in (T, S, S))
        assert at._as_heads_view(q.detach()) is None
    vl = lens_of(rng, lens, B, T, S)
    out = at.scaled_dot_product_attention(q, k, v, valid_lens=vl, is_causal=causal)
    g = torch.tensor(rng.standard_normal(out.shape), dtype=torch.float32)
    dq, dk, dv = torch.autograd.grad(out, (q, k, v), g)

    q64, k64, v64 = (x.detach().double().requires_grad_(True) for x in (q, k, v))
    ref = at.reference_attention(q64, k64, v64, vl, causal=causal)
    rq, rk, rv = torch.autograd.grad(ref, (q64, k64, v64), g.double())
    tol = dict(rtol=1e-5, atol=2e-6)
    np.testing.assert_allclose(out.detach(), ref.detach(), **tol)
    for a, e, name in ((dq, rq, "dq"), (dk, rk, "dk"), (dv, rv, "dv")):
        assert a.shape == e.shape
        np.testing.assert_allclose(a, e, err_msg=name, **tol)


def test_float32_zero_copy_in_and_out(rng):
    """Inputs reach C++ as views of the tensor's memory (float32 through NumPy, bfloat16 as its
    int16 bits), strided views included."""
    q = torch.tensor(rng.standard_normal((2, 4, 8)), dtype=torch.float32)
    for x, dtype in ((q, "F32"), (q.transpose(1, 2), "F32"), (q.to(torch.bfloat16), "BF16")):
        info = attn._input_view(x)
        assert info["data"] == x.data_ptr() and info["dtype"] == dtype
        assert info["strides"] == list(x.stride())
    out = at.scaled_dot_product_attention(q, q, q)
    assert out.dtype == torch.float32 and out.is_contiguous()


def test_dropout_training_and_eval(rng):
    q, k, v = (randn(rng, 2, 16, 8, dtype=torch.float32) for _ in range(3))
    plain = at.scaled_dot_product_attention(q, k, v)
    ev = at.scaled_dot_product_attention(q, k, v, dropout_p=0.5, training=False)
    assert torch.equal(plain, ev)
    # Training: the fused kernel and the reference loops draw the same Philox mask.
    fused_ctx, ref_ctx = attn.Context(seed=3), attn.Context(seed=3, backend="reference")
    a = at.scaled_dot_product_attention(q, k, v, dropout_p=0.5, ctx=fused_ctx)
    b = at.scaled_dot_product_attention(q, k, v, dropout_p=0.5, ctx=ref_ctx)
    assert not torch.allclose(a, plain)
    np.testing.assert_allclose(a.detach(), b.detach(), rtol=1e-5, atol=1e-6)
    g = torch.ones_like(a)
    ga = torch.autograd.grad(a, (q, k, v), g)
    gb = torch.autograd.grad(b, (q, k, v), g)
    for x, y in zip(ga, gb):
        np.testing.assert_allclose(x, y, rtol=1e-4, atol=1e-5)
    # each call takes a fresh offset: two calls drop differently
    c = at.scaled_dot_product_attention(q, k, v, dropout_p=0.5, ctx=fused_ctx)
    assert not torch.equal(a, c)


@pytest.mark.parametrize("layout", ["3d", "heads_view", "4d_contiguous"])
def test_bfloat16_within_tolerance(rng, layout):
    B, H, T, D = 2, 2, 32, 16
    if layout == "3d":
        q32, k32, v32 = (randn(rng, B, T, D, dtype=torch.float32, grad=False) for _ in range(3))
    elif layout == "4d_contiguous":
        q32, k32, v32 = (randn(rng, B, H, T, D, dtype=torch.float32, grad=False)
                         for _ in range(3))
    else:
        q32, k32, v32 = (randn(rng, B, T, H * D, dtype=torch.float32, grad=False).view(
            B, T, H, D).transpose(1, 2) for _ in range(3))
    q, k, v = (x.to(torch.bfloat16).requires_grad_(True) for x in (q32, k32, v32))
    vl = torch.tensor([T, 9])
    out = at.scaled_dot_product_attention(q, k, v, valid_lens=vl, is_causal=True)
    assert out.dtype == torch.bfloat16
    g = torch.tensor(rng.standard_normal(out.shape), dtype=torch.float32)
    grads = torch.autograd.grad(out, (q, k, v), g.to(torch.bfloat16))
    assert all(x.dtype == torch.bfloat16 for x in grads)
    # the truth: float64 math on the bf16-rounded inputs
    q64, k64, v64 = (x.detach().double().requires_grad_(True) for x in (q, k, v))
    ref = at.reference_attention(q64, k64, v64, vl, causal=True)
    refg = torch.autograd.grad(ref, (q64, k64, v64), g.to(torch.bfloat16).double())
    np.testing.assert_allclose(out.float().detach(), ref.detach(), rtol=2e-2, atol=2e-2)
    for a, e in zip(grads, refg):
        np.testing.assert_allclose(a.float(), e, rtol=3e-2, atol=3e-2)


def test_function_errors(rng):
    q = torch.zeros(2, 3, 4)
    x = q.clone().requires_grad_(True)
    (dx,) = torch.autograd.grad(at.scaled_dot_product_attention(x, x, x).square().sum(), x,
                                create_graph=True)
    with pytest.raises(RuntimeError, match="once_differentiable|no autograd formula"):  # no 2nd
        dx.sum().backward()
    with pytest.raises(ValueError, match="expected one dtype"):
        at.scaled_dot_product_attention(q, q.double(), q)
    with pytest.raises(attn.Error, match="valid_lens"):
        at.scaled_dot_product_attention(q, q, q, valid_lens=torch.tensor([1, 2, 3]))
    with pytest.raises(ValueError, match="expected all"):
        at.scaled_dot_product_attention(q[None], q, q)
    with pytest.raises(ValueError, match="float16"):
        at.scaled_dot_product_attention(q.half(), q.half(), q.half())
    with pytest.raises(TypeError, match="torch tensors"):
        at.scaled_dot_product_attention(q.numpy(), q, q)


def test_threads_follow_torch_unless_the_context_sets_them(rng):
    """Results do not depend on the thread count (attn partitions work statically)."""
    q = randn(rng, 2, 33, 8, dtype=torch.float32, grad=False)
    one = at.scaled_dot_product_attention(q, q, q, ctx=attn.Context(threads=1))
    two = at.scaled_dot_product_attention(q, q, q, ctx=attn.Context(threads=2))
    assert torch.equal(one, two)
    assert at._threads(attn.Context(threads=3)) == 3
    # Unset: torch's count, plus one spare for the fused kernels when torch runs 2 or more.
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        assert at._threads(attn.Context()) == 1
        torch.set_num_threads(2)
        assert at._threads(attn.Context()) == 3
        assert at._threads(attn.Context(), torch.bfloat16) == 3
        assert at._threads(attn.Context(), torch.float64) == 2
        assert at._threads(attn.Context(backend="reference")) == 2
    finally:
        torch.set_num_threads(before)


# ------------------------------------------------------------------------------------------------
# MultiheadAttention


def pair(E=16, H=4, seed=0, **kw):
    """nn.MultiheadAttention and attn's, same weights (loaded through the state dict)."""
    torch.manual_seed(seed)
    ref = nn.MultiheadAttention(E, H, **kw)
    ours = at.MultiheadAttention(E, H, **kw)
    ours.load_state_dict(ref.state_dict())
    return ref, ours


def test_state_dict_and_init_match_torch():
    for kw in (dict(), dict(bias=False), dict(kdim=6, vdim=10), dict(batch_first=True)):
        torch.manual_seed(1)
        ref = nn.MultiheadAttention(16, 4, **kw)
        torch.manual_seed(1)
        ours = at.MultiheadAttention(16, 4, **kw)
        assert isinstance(ours, nn.MultiheadAttention)
        a, b = ref.state_dict(), ours.state_dict()
        assert list(a) == list(b)
        for name in a:
            assert torch.equal(a[name], b[name]), name
    assert "in_proj_weight" in a and "out_proj.weight" in a


def run_both(ref, ours, inputs, kwargs, rng, weights=False):
    """Forward and backward of both modules; returns (outputs, input grads, param grads) each."""
    results = []
    for m in (ref, ours):
        xs = [x.detach().clone().requires_grad_(True) for x in inputs]
        if inputs[0] is inputs[1] and inputs[1] is inputs[2]:
            xs = [xs[0]] * 3
        m.zero_grad()
        out, w = m(*xs, **kwargs)
        g = torch.tensor(np.random.default_rng(5).standard_normal(out.shape), dtype=out.dtype)
        loss = (out * g).sum() + (w.sum() if weights and w is not None else 0)
        loss.backward()
        grads = {n: p.grad.clone() for n, p in m.named_parameters()}
        results.append((out.detach(), w, [x.grad for x in xs], grads))
    return results


def assert_same(results, rtol=2e-5, atol=2e-6):
    (o1, w1, x1, p1), (o2, w2, x2, p2) = results
    np.testing.assert_allclose(o2, o1, rtol=rtol, atol=atol, err_msg="output")
    if w1 is not None:
        np.testing.assert_allclose(w2.detach(), w1.detach(), rtol=rtol, atol=atol, err_msg="w")
    for a, b in zip(x2, x1):
        np.testing.assert_allclose(a, b, rtol=rtol, atol=atol, err_msg="input grad")
    assert list(p1) == list(p2)
    for n in p1:
        np.testing.assert_allclose(p2[n], p1[n], rtol=rtol, atol=atol, err_msg=n)


@pytest.mark.parametrize("batch_first", [False, True])
@pytest.mark.parametrize("mask", [None, "padding", "causal_bool", "causal_float", "both"])
def test_self_attention_matches_torch(rng, batch_first, mask):
    B, T, E = 3, 7, 16
    ref, ours = pair(E, 4, batch_first=batch_first)
    x = torch.tensor(rng.standard_normal((B, T, E) if batch_first else (T, B, E)),
                     dtype=torch.float32)
    kwargs = dict(need_weights=mask == "both")  # weights: with both masks
    if mask in ("padding", "both"):
        lens = torch.tensor([7, 3, 5])
        kwargs["key_padding_mask"] = torch.arange(T)[None, :] >= lens[:, None]
    if mask in ("causal_bool", "both"):
        kwargs["attn_mask"] = torch.ones(T, T, dtype=torch.bool).triu(1)
    if mask == "causal_float":
        kwargs["attn_mask"] = nn.Transformer.generate_square_subsequent_mask(T)
    assert_same(run_both(ref, ours, [x, x, x], kwargs, rng, weights=True))


@pytest.mark.parametrize("batch_first", [False, True])
def test_cross_attention_and_weights_match_torch(rng, batch_first):
    """query differs from key/value (three projections); need_weights=True returns torch's
    weights (eval mode: pre- and post-dropout weights agree), averaged or per head."""
    B, T, S, E = 2, 5, 6, 12
    ref, ours = pair(E, 3, batch_first=batch_first)
    shape = lambda L: (B, L, E) if batch_first else (L, B, E)  # noqa: E731
    q = torch.tensor(rng.standard_normal(shape(T)), dtype=torch.float32)
    kv = torch.tensor(rng.standard_normal(shape(S)), dtype=torch.float32)
    pad = torch.tensor([[False] * 6, [False] * 4 + [True] * 2])
    for average in (True, False):
        kwargs = dict(key_padding_mask=pad, need_weights=True, average_attn_weights=average)
        res = run_both(ref, ours, [q, kv, kv], kwargs, rng, weights=True)
        assert res[1][1].shape == ((B, T, S) if average else (B, 3, T, S))
        assert_same(res)


def test_kdim_vdim_unbatched_and_float_padding_mask(rng):
    ref, ours = pair(8, 2, kdim=5, vdim=3)
    q = torch.tensor(rng.standard_normal((4, 8)), dtype=torch.float32)  # unbatched (L, E)
    k = torch.tensor(rng.standard_normal((6, 5)), dtype=torch.float32)
    v = torch.tensor(rng.standard_normal((6, 3)), dtype=torch.float32)
    pad = torch.tensor([0.0] * 4 + [float("-inf")] * 2)
    assert_same(run_both(ref, ours, [q, k, v], dict(key_padding_mask=pad), rng))


def test_float64_module_runs_the_reference_path(rng):
    ref, ours = pair(8, 2, dtype=torch.float64)
    x = torch.tensor(rng.standard_normal((5, 2, 8)))
    pad = torch.tensor([[False] * 5, [False] * 3 + [True] * 2])
    assert_same(run_both(ref, ours, [x, x, x], dict(key_padding_mask=pad), rng), rtol=1e-10,
                atol=1e-12)


def test_module_dropout_train_and_eval(rng):
    torch.manual_seed(0)
    m = at.MultiheadAttention(16, 4, dropout=0.5, batch_first=True)
    x = torch.tensor(rng.standard_normal((2, 9, 16)), dtype=torch.float32)
    m.eval()
    e1, _ = m(x, x, x, need_weights=False)
    e2, _ = m(x, x, x, need_weights=False)
    assert torch.equal(e1, e2)
    m.train()
    t1, _ = m(x, x, x, need_weights=False)
    t2, _ = m(x, x, x, need_weights=False)
    assert not torch.equal(t1, t2) and not torch.allclose(t1, e1)
    # the same seed and offset replay the same masks
    m2 = copy.deepcopy(m)
    m2.context.dropout_offset = m.context.dropout_offset = 0
    assert torch.equal(m(x, x, x, need_weights=False)[0], m2(x, x, x, need_weights=False)[0])


@pytest.mark.parametrize("packed", [True, False])
def test_module_dropout_fused_matches_reference_backend(rng, packed):
    """With dropout on, the head-strided fused kernels and the reference loops on (B*H, T, D)
    draw the same Philox mask (batch row b*H + h), forward and backward."""
    torch.manual_seed(0)
    fused = at.MultiheadAttention(16, 4, dropout=0.3, batch_first=True,
                                  ctx=attn.Context(seed=5))
    ref = at.MultiheadAttention(16, 4, dropout=0.3, batch_first=True,
                                ctx=attn.Context(seed=5, backend="reference"))
    ref.load_state_dict(fused.state_dict())
    x = torch.tensor(rng.standard_normal((2, 7, 16)), dtype=torch.float32)
    pad = torch.tensor([[False] * 7, [False] * 5 + [True] * 2])
    res = []
    for m in (fused, ref):
        xs = [x.clone().requires_grad_(True) for _ in range(1 if packed else 3)]
        q, k, v = (xs * 3) if packed else xs
        out, _ = m(q, k, v, key_padding_mask=pad, need_weights=False)
        out.square().sum().backward()
        res.append((out.detach(), [t.grad for t in xs], m.in_proj_weight.grad))
    np.testing.assert_allclose(res[0][0], res[1][0], rtol=1e-5, atol=1e-6)
    for a, b in zip(res[0][1], res[1][1]):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(res[0][2], res[1][2], rtol=1e-4, atol=1e-5)


def test_bfloat16_module_within_tolerance(rng):
    ref, ours = pair(32, 4, batch_first=True)
    ours = ours.to(torch.bfloat16)
    x = torch.tensor(rng.standard_normal((2, 24, 32)), dtype=torch.float32)
    pad = torch.arange(24)[None, :] >= torch.tensor([24, 10])[:, None]
    expected, _ = ref(x, x, x, key_padding_mask=pad, need_weights=False)
    xb = x.to(torch.bfloat16).requires_grad_(True)
    out, _ = ours(xb, xb, xb, key_padding_mask=pad, need_weights=False)
    assert out.dtype == torch.bfloat16
    np.testing.assert_allclose(out.float().detach(), expected.detach(), rtol=5e-2, atol=5e-2)
    out.float().sum().backward()
    assert xb.grad.dtype == torch.bfloat16 and torch.isfinite(xb.grad.float()).all()
    assert ours.in_proj_weight.grad.dtype == torch.bfloat16


def test_swapped_into_nn_transformer_encoder_layer(rng):
    """torch's own encoder layer with self_attn replaced (its call passes need_weights=False,
    the causal src_mask and the padding mask), training mode, dropout off."""
    torch.manual_seed(0)
    layer = nn.TransformerEncoderLayer(16, 4, 32, dropout=0.0, batch_first=True)
    swapped = copy.deepcopy(layer)
    swapped.self_attn = at.MultiheadAttention(16, 4, dropout=0.0, batch_first=True)
    swapped.load_state_dict(layer.state_dict())
    x = torch.tensor(rng.standard_normal((2, 6, 16)), dtype=torch.float32)
    kwargs = dict(src_mask=nn.Transformer.generate_square_subsequent_mask(6),
                  src_key_padding_mask=torch.tensor([[False] * 6, [False] * 4 + [True] * 2]))
    res = []
    for m in (layer, swapped):
        xi = x.clone().requires_grad_(True)
        m(xi, **kwargs).square().sum().backward()
        res.append((m(x, **kwargs).detach(), xi.grad))
    np.testing.assert_allclose(res[1][0], res[0][0], rtol=2e-5, atol=2e-6)
    np.testing.assert_allclose(res[1][1], res[0][1], rtol=2e-5, atol=2e-5)
    for (n, p), (_, q) in zip(layer.named_parameters(), swapped.named_parameters()):
        np.testing.assert_allclose(q.grad, p.grad, rtol=2e-5, atol=2e-5, err_msg=n)


@pytest.mark.parametrize("B, T, S", [(0, 3, 3), (2, 0, 3), (2, 3, 0)])
def test_empty_inputs(B, T, S):
    """Empty batches and sequences give empty results and gradients (no error, no NaN)."""
    q = torch.randn(B, 2, T, 4, requires_grad=True)
    k = torch.randn(B, 2, S, 4, requires_grad=True)
    out = at.scaled_dot_product_attention(q, k, k)
    out.sum().backward()
    assert out.shape == (B, 2, T, 4) and q.grad.shape == q.shape and k.grad.shape == k.shape
    m = at.MultiheadAttention(8, 2, batch_first=True)
    x, kv = torch.randn(B, T, 8, requires_grad=True), torch.randn(B, S, 8)
    y, _ = m(x, kv, kv, need_weights=False)
    y.sum().backward()
    assert y.shape == (B, T, 8) and x.grad.shape == x.shape and torch.isfinite(y).all()


def test_fully_padded_rows_are_zero_not_nan(rng):
    """torch 1.13 gives NaN for a sequence whose keys are all padded; attn.torch's default
    masked_rows='zero' gives a zero attention output (so out_proj's bias), and zero gradients."""
    ref, ours = pair(8, 2, batch_first=True)
    x = torch.tensor(rng.standard_normal((2, 3, 8)), dtype=torch.float32, requires_grad=True)
    pad = torch.tensor([[False] * 3, [True] * 3])
    assert torch.isnan(ref(x, x, x, key_padding_mask=pad)[0][1]).all()
    out, _ = ours(x, x, x, key_padding_mask=pad, need_weights=False)
    assert torch.allclose(out[1], ours.out_proj.bias.expand(3, 8))
    out.sum().backward()
    assert torch.isfinite(x.grad).all() and torch.all(x.grad[1] == 0)


def test_module_errors():
    m = at.MultiheadAttention(8, 2)
    x = torch.zeros(4, 2, 8)
    with pytest.raises(ValueError, match="causal mask"):
        m(x, x, x, attn_mask=torch.ones(4, 4, dtype=torch.bool).tril(-1))
    with pytest.raises(ValueError, match="attn_mask has shape"):
        m(x, x, x, attn_mask=torch.zeros(3, 4, 4, dtype=torch.bool))
    with pytest.raises(ValueError, match="additive"):
        m(x, x, x, attn_mask=torch.full((4, 4), 0.5))
    with pytest.raises(ValueError, match="suffix"):
        m(x, x, x, key_padding_mask=torch.tensor([[True, False, False, False]] * 2))
    with pytest.raises(ValueError, match="add_bias_kv"):
        at.MultiheadAttention(8, 2, add_bias_kv=True)
    # an all-keep mask is no mask
    y, _ = m(x, x, x, attn_mask=torch.zeros(4, 4, dtype=torch.bool), need_weights=False)
    assert torch.equal(y, m(x, x, x, need_weights=False)[0])


# ------------------------------------------------------------------------------------------------
# d2l's TransformerEncoder trained with the module swapped in


class _Weights(nn.Module):
    attention_weights = None  # d2l's encoder reads blk.attention.attention.attention_weights


class TorchMHA(nn.Module):
    """d2l's MultiHeadAttention interface (queries, keys, values, valid_lens) over an
    nn.MultiheadAttention-like module with batch_first=True: valid_lens become a padding mask."""

    def __init__(self, mha):
        super().__init__()
        self.mha = mha
        self.attention = _Weights()

    def forward(self, queries, keys, values, valid_lens):
        mask = None
        if valid_lens is not None:
            mask = torch.arange(keys.shape[1])[None, :] >= valid_lens[:, None]
        return self.mha(queries, keys, values, key_padding_mask=mask, need_weights=False)[0]


def swap_attention(encoder, cls, E, H, dropout):
    for blk in encoder.blks:
        blk.attention = TorchMHA(cls(E, H, dropout=dropout, bias=False, batch_first=True))
    return encoder


def test_d2l_encoder_trains_to_the_same_loss_curve(rng):
    V, E, F, H, blocks, B, T = 50, 32, 64, 4, 2, 8, 12
    ids = torch.tensor(rng.integers(0, V, size=(B, T)))
    lens = torch.tensor(rng.integers(4, T + 1, size=B))
    targets = torch.tensor(rng.integers(0, 3, size=B))

    def build(cls):
        torch.manual_seed(0)
        enc = swap_attention(TransformerEncoder(V, E, F, H, blocks, 0.0), cls, E, H, 0.0)
        head = nn.Linear(E, 3)
        model = nn.ModuleDict(dict(enc=enc, head=head))
        enc(ids, lens)  # materialise the lazy layers
        return model

    ref, ours = build(nn.MultiheadAttention), build(at.MultiheadAttention)
    ours.load_state_dict(ref.state_dict())
    keep = (torch.arange(T)[None, :] < lens[:, None]).float()

    def losses(model):
        opt = torch.optim.Adam(model.parameters(), lr=3e-3)
        curve = []
        for _ in range(30):
            opt.zero_grad()
            X = model["enc"](ids, lens)
            pooled = (X * keep[..., None]).sum(1) / keep.sum(1, keepdim=True)
            loss = nn.functional.cross_entropy(model["head"](pooled), targets)
            loss.backward()
            opt.step()
            curve.append(loss.item())
        return np.array(curve)

    a, b = losses(ref), losses(ours)
    assert a[-1] < 0.5 * a[0]  # it learns
    np.testing.assert_allclose(b, a, rtol=1e-4, atol=1e-5)  # measured: within 3e-6
    # the attn run really went through attn's Functions (the output is kept alive: a Python
    # Function's graph node lives only as long as the tensors it made)
    x = torch.zeros(1, 2, E)
    out = ours["enc"].blks[0].attention.mha(x, x, x, need_weights=False)[0]
    nodes = autograd_node_names(out)
    assert any("HeadsAttention" in n for n in nodes)
    assert nodes.count("_LinearBackward") == 2  # packed in-proj., out-proj.


def test_mask_helpers_no_mask():
    m = at.MultiheadAttention(4, 2)
    assert m._masks(torch.zeros(2, 3, dtype=torch.bool), None, False, 2, 3, 3) == (None, False)
    assert m._masks(None, None, False, 2, 3, 3) == (None, False)
    causal = torch.ones(3, 3, dtype=torch.bool).triu(1)  # nn.MultiheadAttention's: True = masked
    assert m._masks(None, causal, False, 2, 3, 3) == (None, True)
    lens = at._mask_lens(torch.zeros(2, 3, dtype=torch.bool), None, 2, 3, 3, 1, False, "op")
    assert lens.tolist() == [3, 3]


@pytest.mark.skipif(at._OPS is not None, reason=f"PyTorch {torch.__version__} runs attn.torch's "
                    "custom operators (test_torch2.py); the autograd Functions serve < 2.4")
def test_autograd_functions_serve_torch_before_2_4():
    q = torch.zeros(2, 3, 4, requires_grad=True)
    out = at.scaled_dot_product_attention(q, q, q)
    assert type(out.grad_fn).__name__ == "_AttentionBackward"
