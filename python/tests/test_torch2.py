"""attn.torch on PyTorch >= 2.4: the custom operators under torch.compile (no graph break,
compiled results equal to eager ones, d2l's training loop compiled), F.scaled_dot_product_attention's
arguments against torch's own SDPA, and nn.MultiheadAttention 2.x's is_causal. On older PyTorch
(Debian's 1.13) every test here is skipped, saying so; test_torch.py runs on both."""

import numpy as np
import pytest

torch = pytest.importorskip("torch")

import attn  # noqa: E402
import attn.torch as at  # noqa: E402
from conftest import autograd_node_names  # noqa: E402
from d2l_reference import TransformerEncoder  # noqa: E402
from test_torch import swap_attention  # noqa: E402

nn = torch.nn
F = nn.functional

pytestmark = pytest.mark.skipif(
    at._OPS is None, reason=f"PyTorch {torch.__version__}: attn.torch's custom operators and "
    "torch.compile need PyTorch >= 2.4 (scripts/pip-check.sh runs these in a venv with 2.x)")


def randn(rng, *shape, dtype=torch.float64, grad=True):
    return torch.tensor(rng.standard_normal(shape), dtype=dtype).requires_grad_(grad)


def graph_breaks(fn, *args, **kwargs):
    torch._dynamo.reset()
    explanation = torch._dynamo.explain(fn)(*args, **kwargs)
    return explanation.graph_break_count, [str(b.reason) for b in explanation.break_reasons]


def test_ops_are_registered_and_pass_torch_library_checks(rng):
    """torch.library.opcheck: schema, fake implementation against the real one, autograd
    registration, on the shapes the module uses."""
    q, k, v = (randn(rng, 2, 5, 8, dtype=torch.float32) for _ in range(3))
    actx = attn.Context(seed=3)  # the ops name it by id; it must stay alive
    cid = at._OPS.context_id(actx)
    lens = torch.tensor([5, 3])
    torch.library.opcheck(torch.ops.attn.sdpa.default,
                          (q, k, v, lens, 1, False, 0.0, True, None, "uniform", cid))
    torch.library.opcheck(torch.ops.attn.heads_attention.default,
                          (q, k, v, 2, lens, True, 0.0, True, None, "zero", cid))
    qkv = randn(rng, 2, 5, 24, dtype=torch.float32)
    torch.library.opcheck(torch.ops.attn.packed_heads_attention.default,
                          (qkv, 2, None, False, 0.0, True, 0.5, "zero", cid))
    w, b = randn(rng, 6, 8, dtype=torch.float32), randn(rng, 6, dtype=torch.float32)
    torch.library.opcheck(torch.ops.attn.linear.default, (q, w, b, cid))


def test_function_has_no_graph_break_and_compiles_to_eager_results(rng):
    q, k, v = (randn(rng, 2, 4, 6, 8, dtype=torch.float32) for _ in range(3))
    lens = torch.tensor([6, 2])
    mask = torch.ones(6, 6, dtype=torch.bool).tril()

    def f(q, k, v):
        a = at.scaled_dot_product_attention(q, k, v, valid_lens=lens)
        b = at.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=0.3)
        c = at.scaled_dot_product_attention(q.flatten(0, 1), k.flatten(0, 1), v.flatten(0, 1),
                                            is_causal=True)
        return a.sum() + (b * 2).sum() + c.square().sum()

    assert graph_breaks(f, q, k, v) == (0, [])
    eager = f(q, k, v)
    grads = torch.autograd.grad(eager, (q, k, v))
    compiled = torch.compile(f, backend="aot_eager", fullgraph=True)
    out = compiled(q, k, v)
    torch.testing.assert_close(out, eager, rtol=0, atol=0)
    for a, e in zip(torch.autograd.grad(out, (q, k, v)), grads):
        torch.testing.assert_close(a, e, rtol=0, atol=0)


@pytest.mark.parametrize("batch_first", [True, False])
def test_module_has_no_graph_break_and_compiles_to_eager_results(rng, batch_first):
    """Self-attention (the packed projection), cross-attention, padding and causal masks,
    need_weights both ways; aot_eager runs AOTAutograd (the fake implementations and the
    autograd formulas) without Inductor's C++ compile time."""
    torch.manual_seed(0)
    m = at.MultiheadAttention(16, 4, batch_first=batch_first)
    x = torch.tensor(rng.standard_normal((3, 5, 16)), dtype=torch.float32)
    y = torch.tensor(rng.standard_normal((3, 7, 16)), dtype=torch.float32)
    if not batch_first:
        x, y = x.transpose(0, 1), y.transpose(0, 1)
    pad = torch.arange(7)[None, :] >= torch.tensor([7, 4, 1])[:, None]
    causal = nn.Transformer.generate_square_subsequent_mask(5)

    def f(x, y):
        a, _ = m(x, x, x, attn_mask=causal, is_causal=True, need_weights=False)
        b, w = m(x, y, y, key_padding_mask=pad)
        return a.sum() + b.square().sum() + w.sum()

    assert graph_breaks(f, x, y) == (0, [])
    eager = f(x, y)
    eager_grads = torch.autograd.grad(eager, list(m.parameters()))
    compiled = torch.compile(f, backend="aot_eager", fullgraph=True)
    out = compiled(x, y)
    torch.testing.assert_close(out, eager, rtol=1e-6, atol=1e-6)
    for a, e in zip(torch.autograd.grad(out, list(m.parameters())), eager_grads):
        torch.testing.assert_close(a, e, rtol=1e-6, atol=1e-6)


def test_compiled_mask_is_checked_at_run_time():
    m = at.MultiheadAttention(8, 2, batch_first=True)
    x = torch.zeros(2, 4, 8)
    left_pad = torch.tensor([[True, False, False, False]] * 2)
    f = torch.compile(lambda x, pad: m(x, x, x, key_padding_mask=pad, need_weights=False)[0],
                      backend="aot_eager", fullgraph=True)
    with pytest.raises(Exception, match="suffix"):
        f(x, left_pad)


def d2l_losses(model, ids, lens, targets, steps, compile_backend=None):
    keep = (torch.arange(ids.shape[1])[None, :] < lens[:, None]).float()

    def loss_of(ids, lens):
        X = model["enc"](ids, lens)
        pooled = (X * keep[..., None]).sum(1) / keep.sum(1, keepdim=True)
        return F.cross_entropy(model["head"](pooled), targets)

    step = loss_of if compile_backend is None else torch.compile(loss_of, backend=compile_backend)
    opt = torch.optim.Adam(model.parameters(), lr=3e-3)
    curve = []
    for _ in range(steps):
        opt.zero_grad()
        loss = step(ids, lens)
        loss.backward()
        opt.step()
        curve.append(loss.item())
    return np.array(curve)


def test_d2l_encoder_compiled_trains_to_the_same_loss_curve(rng):
    """d2l's TransformerEncoder with attn's module swapped in, compiled by Inductor (PyTorch's
    default backend), against the same model with nn.MultiheadAttention in eager mode."""
    V, E, Fh, H, blocks, B, T = 50, 32, 64, 4, 2, 8, 12
    ids = torch.tensor(rng.integers(0, V, size=(B, T)))
    lens = torch.tensor(rng.integers(4, T + 1, size=B))
    targets = torch.tensor(rng.integers(0, 3, size=B))

    def build(cls):
        torch.manual_seed(0)
        enc = swap_attention(TransformerEncoder(V, E, Fh, H, blocks, 0.0), cls, E, H, 0.0)
        model = nn.ModuleDict(dict(enc=enc, head=nn.Linear(E, 3)))
        enc(ids, lens)  # materialise the lazy layers
        return model

    ref, ours = build(nn.MultiheadAttention), build(at.MultiheadAttention)
    ours.load_state_dict(ref.state_dict())
    torch._dynamo.reset()
    explanation = torch._dynamo.explain(lambda: ours["enc"](ids, lens))()
    assert explanation.graph_break_count == 0, explanation.break_reasons
    a = d2l_losses(ref, ids, lens, targets, 12)
    b = d2l_losses(ours, ids, lens, targets, 12, compile_backend="inductor")
    assert a[-1] < 0.7 * a[0]  # it learns
    np.testing.assert_allclose(b, a, rtol=1e-4, atol=1e-5)


# ------------------------------------------------------------------------------------------------
# F.scaled_dot_product_attention's arguments, against torch's own op (float64 math)

@pytest.mark.parametrize("mask_kind,is_causal", [(None, False), (None, True), ("bool", False),
                                                 ("float", False), ("causal_bool", False)])
@pytest.mark.parametrize("heads", [None, 3])
def test_sdpa_matches_torch_sdpa(rng, mask_kind, is_causal, heads):
    B, T, S, D = 2, 5, 5, 4
    lead = (B,) if heads is None else (B, heads)
    q, k, v = randn(rng, *lead, T, D), randn(rng, *lead, S, D), randn(rng, *lead, S, D)
    lens = torch.tensor([[5, 4, 3, 5, 2], [1, 2, 3, 4, 5]])
    keep = torch.arange(S)[None, None, :] < lens[:, :, None]  # (B, T, S), prefixes
    mask = None
    if mask_kind == "bool":
        mask = keep if heads is None else keep[:, None]
    elif mask_kind == "float":
        mask = torch.zeros(keep.shape, dtype=torch.float64).masked_fill(~keep, float("-inf"))
        mask = mask if heads is None else mask[:, None]
    elif mask_kind == "causal_bool":
        mask = torch.ones(T, S, dtype=torch.bool).tril()
    out = at.scaled_dot_product_attention(q, k, v, mask, is_causal=is_causal, scale=0.7)
    expected = F.scaled_dot_product_attention(q, k, v, mask, is_causal=is_causal, scale=0.7)
    torch.testing.assert_close(out, expected, rtol=1e-10, atol=1e-12)
    g = torch.randn(out.shape, dtype=torch.float64)
    for a, e in zip(torch.autograd.grad(out, (q, k, v), g),
                    torch.autograd.grad(expected, (q, k, v), g)):
        torch.testing.assert_close(a, e, rtol=1e-9, atol=1e-11)


def test_sdpa_mask_and_valid_lens_both_apply(rng):
    q, k, v = (randn(rng, 2, 4, 3) for _ in range(3))
    mask = torch.ones(4, 4, dtype=torch.bool).tril()
    out = at.scaled_dot_product_attention(q, k, v, mask, valid_lens=torch.tensor([4, 2]))
    lens = torch.tensor([[1, 2, 3, 4], [1, 2, 2, 2]])
    torch.testing.assert_close(out, at.reference_attention(q, k, v, lens), rtol=1e-12,
                               atol=1e-13)


def test_sdpa_gradcheck_float64_with_masks(rng):
    q, k, v = randn(rng, 2, 3, 4), randn(rng, 2, 4, 4), randn(rng, 2, 4, 2)
    mask = torch.tensor([[True, True, False, False], [True, False, False, False],
                         [True, True, True, True]])
    f = lambda q, k, v: at.scaled_dot_product_attention(q, k, v, mask, scale=0.4)  # noqa: E731
    assert torch.autograd.gradcheck(f, (q, k, v), eps=1e-6, atol=1e-8)


def test_sdpa_errors_say_what_is_unsupported():
    q = torch.zeros(2, 2, 3, 4)
    with pytest.raises(ValueError, match="additive bias"):
        at.scaled_dot_product_attention(q, q, q, torch.full((3, 3), 0.5))
    with pytest.raises(ValueError, match="prefix"):
        at.scaled_dot_product_attention(q, q, q, torch.tensor([False, True, True]))
    with pytest.raises(ValueError, match="differs between heads"):
        m = torch.ones(1, 2, 3, 3, dtype=torch.bool)
        m[0, 1, :, 2] = False
        at.scaled_dot_product_attention(q, q, q, m)
    with pytest.raises(ValueError, match="grouped-query"):
        at.scaled_dot_product_attention(q, q[:, :1], q[:, :1], enable_gqa=True)
    with pytest.raises(ValueError, match="valid_lens="):
        at.scaled_dot_product_attention(q, q, q, torch.tensor([3, 1]))
    with pytest.raises(ValueError, match="broadcasts"):
        at.scaled_dot_product_attention(q, q, q, torch.ones(4, 3, dtype=torch.bool))
    # enable_gqa with equal head counts is plain attention
    torch.testing.assert_close(at.scaled_dot_product_attention(q, q, q, enable_gqa=True),
                               at.scaled_dot_product_attention(q, q, q))


def test_sdpa_bf16_passes_head_split_views_without_copies(rng):
    """A (B, T, H*D) bf16 projection split into heads as views reaches the fused kernel through
    head strides (the heads op), as float32 does."""
    x = torch.tensor(rng.standard_normal((2, 6, 16)), dtype=torch.bfloat16, requires_grad=True)
    heads = x.view(2, 6, 4, 4).transpose(1, 2)
    out = at.scaled_dot_product_attention(heads, heads, heads, is_causal=True)
    assert out.dtype == torch.bfloat16
    assert "_HeadsAttentionBackward" in autograd_node_names(out)
    ref = F.scaled_dot_product_attention(*(heads.double(),) * 3, is_causal=True)
    torch.testing.assert_close(out.double(), ref, rtol=3e-2, atol=3e-2)


def test_module_is_causal_matches_nn_multihead_attention(rng):
    torch.manual_seed(1)
    ref = nn.MultiheadAttention(12, 3, batch_first=True)
    ours = at.MultiheadAttention(12, 3, batch_first=True)
    ours.load_state_dict(ref.state_dict())
    x = torch.tensor(rng.standard_normal((2, 5, 12)), dtype=torch.float32)
    mask = nn.Transformer.generate_square_subsequent_mask(5)
    pad = torch.tensor([[False] * 5, [False] * 3 + [True] * 2])
    e, ew = ref(x, x, x, attn_mask=mask, is_causal=True, key_padding_mask=pad)
    o, ow = ours(x, x, x, attn_mask=mask, is_causal=True, key_padding_mask=pad)
    torch.testing.assert_close(o, e, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(ow, ew, rtol=1e-5, atol=1e-6)
    # a per-query prefix mask that is not causal, as (batch * heads, L, S)
    lens = torch.tensor([[5, 1, 3, 2, 4], [2, 2, 2, 2, 2]])
    allowed = torch.arange(5)[None, None, :] < lens[:, :, None]
    mask3 = (~allowed).repeat_interleave(3, dim=0)  # True = not allowed
    e, _ = ref(x, x, x, attn_mask=mask3, need_weights=False)
    o, _ = ours(x, x, x, attn_mask=mask3, need_weights=False)
    torch.testing.assert_close(o, e, rtol=1e-5, atol=1e-6)


def test_dropout_decisions_cache_is_only_a_speed_up(rng):
    """The heads operators keep the fused kernel's dropout decisions for the backward; dropping
    them (the backward then redraws the mask from the forward's seed and offset) gives the same
    gradients."""
    x = torch.tensor(rng.standard_normal((2, 40, 16)), dtype=torch.float32)
    grads = []
    for clear in (False, True):
        torch.manual_seed(0)
        m = at.MultiheadAttention(16, 4, dropout=0.3, batch_first=True,
                                  ctx=attn.Context(seed=5))
        out, _ = m(x, x, x, need_weights=False)
        if clear:
            at._OPS._keep_cache.clear()
        out.square().sum().backward()
        grads.append([p.grad.clone() for p in m.parameters()])
    for a, b in zip(*grads):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
