"""attn.optim against torch.optim: the same parameters and gradients, step after step, then the
state dicts (resume bit for bit), bfloat16 layers, lazy layers, lifetimes and errors."""

import gc

import numpy as np
import pytest
import torch

import attn

E, HEADS = 16, 2


def make_layer(dtype="float64", seed=3, bias=True):
    """A MultiHeadAttention whose (lazy) projections have seen an input, so they have values."""
    layer = attn.MultiHeadAttention(E, HEADS, 0.0, bias=bias, dtype=dtype, seed=seed)
    X = np.zeros((1, 1, E), np.float32)
    layer(X, X, X)
    return layer


def torch_params(layer):
    """float64 torch copies of the layer's parameters, by name."""
    return {name: torch.tensor(np.asarray(a, np.float64), requires_grad=True)
            for name, a in layer.state_dict().items()}


def backward_step(layer, rng):
    """One forward and backward on random data; the gradients accumulate into layer.grads."""
    X = rng.standard_normal((2, 5, E)).astype(np.float64)
    Y = layer(X, X, X)
    layer.backward(rng.standard_normal(np.shape(Y)))


def run_against_torch(layer, opt, make_torch_opt, rng, steps=4, clip=None, torch_dtype=None):
    """Steps `opt` on the layer and a torch optimiser on copies of its parameters, both from the
    layer's gradients; yields after each step with (name, attn value, torch value) triples."""
    dtype = torch_dtype or torch.float64
    tp = {n: t.detach().to(dtype).requires_grad_() for n, t in torch_params(layer).items()}
    topt = make_torch_opt(list(tp.values()))
    for _ in range(steps):
        backward_step(layer, rng)
        for name, g in layer.grads.items():
            tp[name].grad = torch.from_numpy(np.array(g)).to(dtype)
        if clip is not None:
            norm = attn.optim.clip_grad_norm(layer, clip)
            tnorm = torch.nn.utils.clip_grad_norm_(list(tp.values()), clip)
            np.testing.assert_allclose(norm, float(tnorm), rtol=1e-6 if dtype == torch.float32
                                       else 1e-12)
        opt.step()
        topt.step()
        opt.zero_grad()
        topt.zero_grad()
        state = layer.state_dict()
        yield [(n, state[n], tp[n].detach().numpy()) for n in tp]


SGD_CASES = [
    dict(lr=0.1),
    dict(lr=0.05, momentum=0.9, dampening=0.1, weight_decay=0.01),
    dict(lr=0.05, momentum=0.8, weight_decay=1e-3, nesterov=True),
]
ADAMW_CASES = [
    dict(),
    dict(lr=0.01, betas=(0.8, 0.99), eps=1e-6, weight_decay=0.1),
]


@pytest.mark.parametrize("kwargs", SGD_CASES)
def test_sgd_matches_torch_float64(rng, kwargs):
    layer = make_layer()
    opt = attn.optim.SGD(layer, **kwargs)
    for params in run_against_torch(layer, opt, lambda p: torch.optim.SGD(p, **kwargs), rng):
        for name, a, t in params:
            np.testing.assert_allclose(a, t, rtol=1e-12, atol=1e-14, err_msg=name)


@pytest.mark.parametrize("kwargs", ADAMW_CASES)
def test_adamw_matches_torch_float64(rng, kwargs):
    layer = make_layer()
    opt = attn.optim.AdamW(layer, **kwargs)
    for params in run_against_torch(layer, opt, lambda p: torch.optim.AdamW(p, **kwargs), rng,
                                    clip=0.5):
        for name, a, t in params:
            np.testing.assert_allclose(a, t, rtol=1e-12, atol=1e-14, err_msg=name)


def test_float32_layers_match_torch_float32(rng):
    # torch rounds after every tensor op of the update, attn once per element: a few float32
    # ulps apart after a few steps.
    for make_opt, make_topt in [
        (lambda m: attn.optim.SGD(m, 0.05, momentum=0.9), lambda p: torch.optim.SGD(
            p, 0.05, momentum=0.9)),
        (lambda m: attn.optim.AdamW(m, lr=0.01), lambda p: torch.optim.AdamW(p, lr=0.01)),
    ]:
        layer = make_layer("float32")
        opt = make_opt(layer)
        for params in run_against_torch(layer, opt, make_topt, rng, clip=1.0,
                                        torch_dtype=torch.float32):
            for name, a, t in params:
                assert a.dtype == np.float32
                np.testing.assert_allclose(a, t, rtol=1e-5, atol=1e-6, err_msg=name)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("which", ["SGD", "AdamW"])
def test_state_dict_resumes_bit_for_bit(rng, dtype, which):
    def make_opt(layer):
        if which == "SGD":
            return attn.optim.SGD(layer, 0.05, momentum=0.9, weight_decay=0.01)
        return attn.optim.AdamW(layer, lr=0.01)

    data = [(rng.standard_normal((2, 5, E)).astype(np.float32),
             rng.standard_normal((2, 5, E)).astype(np.float32)) for _ in range(4)]

    def train(layer, opt, batches):
        for X, dY in batches:
            layer(X, X, X)
            layer.backward(dY)
            opt.step()
            opt.zero_grad()

    a = make_layer(dtype, seed=1)
    opt_a = make_opt(a)
    train(a, opt_a, data[:2])
    saved_layer, saved_opt = a.state_dict(), opt_a.state_dict()
    assert saved_opt, "the optimiser has state after two steps"
    if which == "AdamW":
        assert all(saved_opt[n + ".step"][0] == 2.0 for n in opt_a.param_names)
    if dtype == "bfloat16":  # bf16 state: float32 arrays holding bf16 values
        for name, v in saved_opt.items():
            if not name.endswith(".step"):
                assert v.dtype == np.float32
                assert not (v.view(np.uint32) & 0xFFFF).any(), name
    train(a, opt_a, data[2:])

    b = make_layer(dtype, seed=2)
    b.load_state_dict(saved_layer)
    opt_b = make_opt(b)
    opt_b.load_state_dict(saved_opt)
    train(b, opt_b, data[2:])
    for name, v in a.state_dict().items():
        np.testing.assert_array_equal(b.state_dict()[name], v, err_msg=name)
    for name, v in opt_a.state_dict().items():
        np.testing.assert_array_equal(opt_b.state_dict()[name], v, err_msg=name)


def test_bfloat16_layer_learns(rng):
    # A bf16 MultiHeadAttention fitted to a fixed target output gets closer to it.
    layer = make_layer("bfloat16", seed=5)
    opt = attn.optim.AdamW(layer, lr=0.01, weight_decay=0.0)
    X = rng.standard_normal((4, 6, E)).astype(np.float32)
    target = rng.standard_normal((4, 6, E)).astype(np.float32) * 0.1
    losses = []
    for _ in range(30):
        Y = layer(X, X, X)
        losses.append(float(((Y - target) ** 2).mean()))
        layer.backward((2.0 / Y.size) * (Y - target))
        opt.step()
        opt.zero_grad()
    assert losses[-1] < 0.5 * losses[0], losses


def test_lr_is_settable_and_zero_freezes(rng):
    layer = make_layer("float32")
    opt = attn.optim.SGD(layer, 0.1)
    opt.lr = 0.0
    assert opt.lr == 0.0
    before = layer.state_dict()
    backward_step(layer, rng)
    opt.step()
    for name, v in layer.state_dict().items():
        np.testing.assert_array_equal(v, before[name], err_msg=name)
    with pytest.raises(attn.Error, match="lr is -1"):
        opt.lr = -1.0
    assert opt.lr == 0.0


def test_zero_grad_zeroes_the_layers_gradients(rng):
    layer = make_layer("float32")
    opt = attn.optim.AdamW(layer)
    backward_step(layer, rng)
    assert any(np.abs(g).max() > 0 for g in layer.grads.values())
    opt.zero_grad()
    assert all(not np.asarray(g).any() for g in layer.grads.values())


def test_lazy_layer_parameters_join_after_the_first_input(rng):
    # AdditiveAttention's W_q and W_k take their input width from the first forward (LazyLinear).
    layer = attn.AdditiveAttention(8, 0.0, seed=1)
    opt = attn.optim.SGD(layer, 0.1)
    assert "W_q.weight" in opt.param_names
    opt.step()  # no values or gradients yet: nothing to do, no error
    q = rng.standard_normal((2, 3, 5)).astype(np.float32)
    k = rng.standard_normal((2, 4, 6)).astype(np.float32)
    v = rng.standard_normal((2, 4, 7)).astype(np.float32)
    out = layer(q, k, v)
    layer.backward(np.ones_like(out))
    before = layer.state_dict()
    grads = {n: np.array(g) for n, g in layer.grads.items()}
    opt.step()
    after = layer.state_dict()
    for name in ("W_q.weight", "W_k.weight", "w_v.weight"):
        np.testing.assert_allclose(after[name], before[name] - 0.1 * grads[name], rtol=1e-6,
                                   atol=1e-7, err_msg=name)


def test_optimizer_keeps_its_layer_alive(rng):
    opt = attn.optim.AdamW(make_layer("float32"), lr=0.01)
    gc.collect()
    layer = opt.layer
    assert isinstance(layer, attn.MultiHeadAttention)
    backward_step(layer, rng)
    del layer
    gc.collect()
    opt.step()
    assert opt.state_dict()


def test_clip_grad_norm_inf_matches_torch(rng):
    layer = make_layer()
    backward_step(layer, rng)
    grads = {n: torch.from_numpy(np.array(g)) for n, g in layer.grads.items()}
    norm = attn.optim.clip_grad_norm(layer, 0.01, norm_type=float("inf"))
    ts = [torch.zeros_like(g, requires_grad=True) for g in grads.values()]
    for t, g in zip(ts, grads.values()):
        t.grad = g.clone()
    tnorm = torch.nn.utils.clip_grad_norm_(ts, 0.01, norm_type=float("inf"))
    assert norm == pytest.approx(float(tnorm), rel=1e-12)
    for (name, g), t in zip(layer.grads.items(), ts):
        np.testing.assert_allclose(g, t.grad.numpy(), rtol=1e-12, atol=1e-15, err_msg=name)


def test_errors_name_the_operation_and_change_nothing(rng):
    layer = make_layer("float32")
    with pytest.raises(attn.Error, match="must be an attn.Module") as e:
        attn.optim.SGD(np.zeros(3), 0.1)
    assert e.value.op == "SGD"
    with pytest.raises(attn.Error, match=r"betas \(1, 0.5\) must be in \[0, 1\)"):
        attn.optim.AdamW(layer, betas=(1.0, 0.5))
    with pytest.raises(attn.Error, match="nesterov"):
        attn.optim.SGD(layer, 0.1, nesterov=True)
    with pytest.raises(attn.Error, match="norm_type 1 unsupported"):
        attn.optim.clip_grad_norm(layer, 1.0, norm_type=1.0)
    with pytest.raises(TypeError):
        attn.optim.Optimizer()

    opt = attn.optim.AdamW(layer)
    backward_step(layer, rng)
    opt.step()
    before = opt.state_dict()
    bad_shape = dict(before)
    bad_shape["W_q.weight.exp_avg"] = np.zeros((3, 3), np.float32)
    with pytest.raises(attn.Error, match=r"'W_q.weight.exp_avg' has shape \(3, 3\)") as e:
        opt.load_state_dict(bad_shape)
    assert e.value.op == "AdamW::load_state_dict"
    with pytest.raises(attn.Error, match="unexpected 'W_q.weight.momentum_buffer'"):
        opt.load_state_dict({**before, "W_q.weight.momentum_buffer": np.zeros((E, E))})
    for name, v in opt.state_dict().items():
        np.testing.assert_array_equal(v, before[name], err_msg=name)


def test_reprs():
    layer = make_layer("float32")
    assert repr(attn.optim.SGD(layer, 0.1, momentum=0.9)) == (
        "attn.optim.SGD(MultiHeadAttention, lr=0.1, momentum=0.9, dampening=0.0, "
        "weight_decay=0.0, nesterov=False)")
    assert repr(attn.optim.AdamW(layer)) == (
        "attn.optim.AdamW(MultiHeadAttention, lr=0.001, betas=(0.9, 0.999), eps=1e-08, "
        "weight_decay=0.01)")
    assert isinstance(attn.optim.AdamW(layer), attn.optim.Optimizer)
