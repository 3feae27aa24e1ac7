"""attn.torch.MultiheadAttention's projections on attn's GEMM: the _Linear autograd Function
(over the _linear_forward / _linear_backward bindings) against torch's F.linear, and the module's
parameter gradients against nn.MultiheadAttention (accumulation, frozen parameters, no_grad,
inference mode, both layouts, bias on and off, kdim/vdim, fp32 and bf16), and which paths keep
torch's F.linear (float64, backend='reference')."""

import numpy as np
import pytest

torch = pytest.importorskip("torch")

import attn  # noqa: E402
import attn.torch as at  # noqa: E402
from attn import _attn  # noqa: E402
from conftest import autograd_node_names  # noqa: E402

nn = torch.nn
F = torch.nn.functional


def tensor(rng, *shape, dtype=torch.float32):
    return torch.tensor(rng.standard_normal(shape), dtype=torch.float32).to(dtype)


def views(rng, layout, dtype):
    """x (2, 5, 12) in a layout attn's GEMM reads in place or has to copy once."""
    if layout == "contiguous":
        return tensor(rng, 2, 5, 12, dtype=dtype)
    if layout == "column_slice":  # a third of a packed (B, T, 3E) tensor: row stride 36
        return tensor(rng, 2, 5, 36, dtype=dtype)[..., 12:24]
    if layout == "seq_first_rows":  # (T, B, E) seen as (B, T, E): leading axes do not merge
        return tensor(rng, 5, 2, 12, dtype=dtype).transpose(0, 1)
    raise ValueError(layout)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("layout", ["contiguous", "column_slice", "seq_first_rows"])
def test_linear_matches_torch(rng, dtype, bias, layout):
    """y, dx, dW, db against F.linear in float64 on the same values; W a row slice of a bigger
    matrix (as in_proj_weight[E:2E]); dy with zero strides (from .sum())."""
    x = views(rng, layout, dtype).requires_grad_(True)
    big = tensor(rng, 24, 12, dtype=dtype).requires_grad_(True)
    w = big[8:17]  # (9, 12), a view with unit column stride
    b = tensor(rng, 9, dtype=dtype).requires_grad_(True) if bias else None
    y = at._Linear.apply(x, w, b, 2)
    assert y.dtype == dtype and y.shape == (2, 5, 9) and y.is_contiguous()
    g = tensor(rng, 2, 5, 9, dtype=dtype)
    ((y * g).sum() + y.sum()).backward()  # y.sum()'s gradient arrives expanded (zero strides)
    x64 = x.detach().double().requires_grad_(True)
    w64 = w.detach().double().requires_grad_(True)
    b64 = b.detach().double().requires_grad_(True) if bias else None
    y64 = F.linear(x64, w64, b64)
    ((y64 * g.double()).sum() + y64.sum()).backward()
    tol = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=2e-2, atol=5e-2)
    np.testing.assert_allclose(y.detach().double(), y64.detach(), **tol, err_msg="y")
    np.testing.assert_allclose(x.grad.double(), x64.grad, **tol, err_msg="dx")
    assert x.grad.dtype == dtype and big.grad.dtype == dtype
    np.testing.assert_allclose(big.grad[8:17].double(), w64.grad, **tol, err_msg="dW")
    assert torch.all(big.grad[:8] == 0) and torch.all(big.grad[17:] == 0)
    if bias:
        np.testing.assert_allclose(b.grad.double(), b64.grad, **tol, err_msg="db")


def test_linear_fp32_agrees_with_f_linear_closely(rng):
    """float32 against torch's own float32 F.linear (both f32 accumulation): within 1e-5
    relative, and 1e-6 of the largest element absolute (dW sums 64 products of magnitude ~100 into
    elements near 1 at places, where the summation order alone moves the last 1e-4: seen with
    Debian torch 1.13's OpenBLAS)."""
    x = tensor(rng, 64, 32).requires_grad_(True)
    w = tensor(rng, 48, 32).requires_grad_(True)
    b = tensor(rng, 48).requires_grad_(True)
    res = []
    for f in (lambda: F.linear(x, w, b), lambda: at._Linear.apply(x, w, b, 1)):
        x.grad = w.grad = b.grad = None
        y = f()
        y.square().sum().backward()
        res.append([t.detach().clone() for t in (y, x.grad, w.grad, b.grad)])
    for a, e, name in zip(res[1], res[0], ("y", "dx", "dW", "db")):
        atol = max(1e-5, 1e-6 * float(e.abs().max()))
        np.testing.assert_allclose(a, e, rtol=1e-5, atol=atol, err_msg=name)


def test_linear_grads_only_where_needed_and_no_graph_without_grad(rng):
    x = tensor(rng, 3, 4, 8)
    w = tensor(rng, 6, 8).requires_grad_(True)
    b = tensor(rng, 6)  # frozen
    y = at._Linear.apply(x, w, b, 2)
    y.sum().backward()
    assert w.grad is not None and b.grad is None and x.grad is None
    with torch.no_grad():
        assert at._Linear.apply(x, w, b, 2).grad_fn is None
    with torch.inference_mode():
        z = at._Linear.apply(x, w, b, 2)
    np.testing.assert_allclose(z, F.linear(x, w, b).detach(), rtol=1e-5, atol=1e-5)


def test_linear_double_backward_is_refused(rng):
    x = tensor(rng, 3, 8).requires_grad_(True)
    w = tensor(rng, 6, 8).requires_grad_(True)
    (gx,) = torch.autograd.grad(at._Linear.apply(x, w, None, 2).square().sum(), x,
                                create_graph=True)
    with pytest.raises(RuntimeError, match="once_differentiable"):
        gx.sum().backward()


def test_linear_binding_errors():
    x, w = torch.zeros(3, 4), torch.zeros(5, 4)
    with pytest.raises(attn.Error, match=r"attn.torch linear: x is \(3, 4\) and W \(5, 6\)"):
        _attn._linear_forward(x, torch.zeros(5, 6), None, torch.empty(3, 5), 1)
    with pytest.raises(attn.Error, match=r"y is \(3, 4\), expected"):
        _attn._linear_forward(x, w, None, torch.empty(3, 4), 1)
    with pytest.raises(attn.Error, match="column stride"):
        _attn._linear_forward(x, w, None, torch.empty(5, 3).t(), 1)
    with pytest.raises(attn.Error, match="W .* has dtype bfloat16, expected float32"):
        _attn._linear_forward(x, w.bfloat16(), None, torch.empty(3, 5), 1)
    with pytest.raises(attn.Error, match="float64 runs torch's F.linear"):
        _attn._linear_forward(x.double(), w.double(), None, torch.empty(3, 5).double(), 1)
    with pytest.raises(attn.Error, match=r"b has shape \(4\), expected \(out\) = \(5\)"):
        _attn._linear_forward(x, w, torch.zeros(4), torch.empty(3, 5), 1)
    with pytest.raises(attn.Error, match="threads is 0"):
        _attn._linear_forward(x, w, None, torch.empty(3, 5), 0)
    with pytest.raises(attn.Error, match=r"attn.torch linear backward: dW is \(4, 5\)"):
        _attn._linear_backward(torch.zeros(3, 5), x, w, None, torch.empty(4, 5), None, 1)
    with pytest.raises(attn.Error, match=r"dx \(3, 4\) has dtype float64, expected float32"):
        _attn._linear_backward(torch.zeros(3, 5), x, w, torch.empty(3, 4).double(), None, None,
                               1)
    with pytest.raises(attn.Error, match=r"dx \(3, 4\) has dtype int32, expected float32"):
        _attn._linear_backward(torch.zeros(3, 5), x, w, torch.empty(3, 4, dtype=torch.int32),
                               None, None, 1)


# ------------------------------------------------------------------------------------------------
# The module's projections


def pair(E, H, dtype=torch.float32, **kw):
    torch.manual_seed(0)
    ref = nn.MultiheadAttention(E, H, **kw)
    ours = at.MultiheadAttention(E, H, **kw)
    ours.load_state_dict(ref.state_dict())
    return ref, ours.to(dtype)


def step(m, q, k, v, pad, causal, g, dtype=torch.float32):
    """One forward and backward of (out * g).sum(); returns out and the gradients of the distinct
    inputs (query is key is value stays so: the packed self-attention path)."""
    distinct = list({id(t): t for t in (q, k, v)}.values())
    xs = [t.detach().to(dtype).requires_grad_(True) for t in distinct]
    leaf = {id(t): x for t, x in zip(distinct, xs)}
    q_, k_, v_ = (leaf[id(t)] for t in (q, k, v))
    kw = dict(key_padding_mask=pad, need_weights=False)
    if causal:
        T = q.shape[1] if m.batch_first else q.shape[0]
        kw["attn_mask"] = torch.ones(T, T, dtype=torch.bool).triu(1)
    out, _ = m(q_, k_, v_, **kw)
    (out.float() * g).sum().backward()
    return out, [t.grad for t in xs]


@pytest.mark.parametrize("batch_first", [False, True])
@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("kind", ["self", "cross", "kdim_vdim"])
def test_module_gradients_match_torch_and_accumulate(rng, batch_first, bias, kind):
    """Two calls (the second causal for self-attention): parameter gradients accumulate across
    them as torch's do; outputs and input gradients of each call match."""
    B, T, S, E, H = 3, 6, 5, 16, 4
    kw = dict(bias=bias, batch_first=batch_first)
    if kind == "kdim_vdim":
        kw.update(kdim=7, vdim=9)
    ref, ours = pair(E, H, **kw)
    shape = lambda L, D: (B, L, D) if batch_first else (L, B, D)  # noqa: E731
    q = tensor(rng, *shape(T, E))
    if kind == "self":
        k = v = q
        S = T
    elif kind == "cross":
        k = v = tensor(rng, *shape(S, E))
    else:
        k, v = tensor(rng, *shape(S, 7)), tensor(rng, *shape(S, 9))
    pad = torch.arange(S)[None, :] >= torch.tensor([S, S - 2, 1])[:, None]
    g = tensor(rng, *shape(T, E))
    for causal in (False, kind == "self"):
        (o1, gx1), (o2, gx2) = (step(m, q, k, v, pad, causal, g) for m in (ref, ours))
        np.testing.assert_allclose(o2.detach(), o1.detach(), rtol=2e-5, atol=2e-6)
        for a, e in zip(gx2, gx1):
            np.testing.assert_allclose(a, e, rtol=2e-5, atol=5e-6, err_msg="input grad")
    out, _ = ours(q, k, v, key_padding_mask=pad, need_weights=False)
    assert autograd_node_names(out).count("_LinearBackward") == (2 if kind == "self" else 4)
    for (n, p), (_, r) in zip(ours.named_parameters(), ref.named_parameters()):
        np.testing.assert_allclose(p.grad, r.grad, rtol=2e-5, atol=5e-6, err_msg=n)


def test_module_bfloat16_gradients_within_tolerance(rng):
    """bf16 module (projections and core in bf16) against torch's float32 module on the same
    bf16-rounded inputs and weights: outputs and every gradient within bf16's tolerance."""
    ref, ours = pair(32, 4, dtype=torch.bfloat16, batch_first=True)
    ref.load_state_dict({n: t.float() for n, t in ours.state_dict().items()})
    x = tensor(rng, 2, 24, 32).bfloat16().float()
    pad = torch.arange(24)[None, :] >= torch.tensor([24, 10])[:, None]
    g = tensor(rng, 2, 24, 32)
    (o1, gx1), (o2, gx2) = step(ref, x, x, x, pad, False, g), \
        step(ours, x, x, x, pad, False, g, dtype=torch.bfloat16)
    assert o2.dtype == torch.bfloat16 and gx2[0].dtype == torch.bfloat16
    rel = lambda a, e: float((a.float() - e).norm() / e.norm())  # noqa: E731
    assert rel(o2.detach(), o1.detach()) < 2e-2
    assert rel(gx2[0], gx1[0]) < 3e-2
    for (n, p), (_, r) in zip(ours.named_parameters(), ref.named_parameters()):
        assert p.grad.dtype == torch.bfloat16
        assert rel(p.grad, r.grad) < 3e-2, n
    xb = x.bfloat16()
    out, _ = ours(xb, xb, xb, need_weights=False)
    assert autograd_node_names(out).count("_LinearBackward") == 2


def test_module_frozen_projection_no_grad_and_inference(rng):
    ref, ours = pair(16, 4, batch_first=True)
    for m in (ref, ours):
        m.in_proj_weight.requires_grad_(False)
    x = tensor(rng, 2, 5, 16)
    g = tensor(rng, 2, 5, 16)
    (o1, gx1), (o2, gx2) = (step(m, x, x, x, None, False, g) for m in (ref, ours))
    np.testing.assert_allclose(gx2[0], gx1[0], rtol=2e-5, atol=5e-6)
    assert ours.in_proj_weight.grad is None
    np.testing.assert_allclose(ours.out_proj.weight.grad, ref.out_proj.weight.grad, rtol=2e-5,
                               atol=5e-6)
    np.testing.assert_allclose(ours.in_proj_bias.grad, ref.in_proj_bias.grad, rtol=2e-5,
                               atol=5e-6)
    with torch.no_grad():
        y, _ = ours(x, x, x, need_weights=False)
    assert y.grad_fn is None
    with torch.inference_mode():
        z, _ = ours(x, x, x, need_weights=False)
    np.testing.assert_allclose(z, y, rtol=1e-6, atol=1e-7)
    np.testing.assert_allclose(y, o1.detach(), rtol=2e-5, atol=2e-6)


def test_module_float64_and_reference_backend_keep_torch_linear(rng):
    x = tensor(rng, 2, 5, 8)
    m64 = at.MultiheadAttention(8, 2, batch_first=True, dtype=torch.float64)
    out, _ = m64(x.double(), x.double(), x.double(), need_weights=False)
    assert "_LinearBackward" not in autograd_node_names(out)
    ref = at.MultiheadAttention(8, 2, batch_first=True, ctx=attn.Context(backend="reference"))
    out, _ = ref(x, x, x, need_weights=False)
    assert "_LinearBackward" not in autograd_node_names(out)
    fused = at.MultiheadAttention(8, 2, batch_first=True)
    fused.load_state_dict(ref.state_dict())
    np.testing.assert_allclose(fused(x, x, x, need_weights=False)[0].detach(), out.detach(),
                               rtol=2e-5, atol=2e-6)


def test_module_dropout_statistics_unchanged(rng):
    """Inverted dropout in the core, projections around it: the mean of many training outputs
    is the eval output (E[mask / (1 - p)] = 1), and about p of the weights are dropped."""
    torch.manual_seed(0)
    p = 0.3
    m = at.MultiheadAttention(8, 2, dropout=p, batch_first=True, bias=False)
    x = tensor(rng, 1, 4, 8)
    with torch.no_grad():
        expected = m.eval()(x, x, x, need_weights=False)[0]
        m.train()
        draws = torch.stack([m(x, x, x, need_weights=False)[0] for _ in range(2000)])
    # the core's output o -> out_proj(o) is linear, so the means agree up to sampling error
    err = (draws.mean(0) - expected).abs().max() / expected.abs().max()
    assert err < 0.05, float(err)
    assert not torch.allclose(draws[0], draws[1])


def test_module_under_cpu_autocast_follows_torch(rng):
    """Inside torch.autocast('cpu', bfloat16) the projections stay torch's F.linear (autocast
    casts them to bf16; a custom Function would run float32): output dtype as torch's module."""
    ref, ours = pair(16, 4, batch_first=True)
    x = tensor(rng, 2, 5, 16)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        expected, _ = ref(x, x, x, need_weights=False)
        out, _ = ours(x, x, x, need_weights=False)
    assert out.dtype == expected.dtype == torch.bfloat16
    assert "_LinearBackward" not in autograd_node_names(out)
    np.testing.assert_allclose(out.float().detach(), expected.float().detach(), rtol=5e-2,
                               atol=5e-2)
