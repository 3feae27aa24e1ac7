"""attn.Linear and attn.cross_entropy against torch.nn.Linear and F.cross_entropy (values and
gradients), and a whole training loop in Python: encoder, head, loss, optimiser."""

import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F

import attn
from conftest import assert_close


# ------------------------------------------------------------------------------------------------
# Linear


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("bias", [True, False])
def test_linear_matches_torch(rng, dtype, bias):
    tdtype = torch.float32 if dtype == np.float32 else torch.float64
    lin = attn.Linear(7, 5, bias=bias, dtype=dtype, seed=3)
    ref = torch.nn.Linear(7, 5, bias=bias).to(tdtype)
    ref.load_state_dict({k: torch.from_numpy(np.array(v)) for k, v in lin.state_dict().items()})
    X = rng.standard_normal((2, 3, 7)).astype(dtype)
    dY = rng.standard_normal((2, 3, 5)).astype(dtype)
    Xt = torch.from_numpy(X.copy()).requires_grad_()
    Yt = ref(Xt)
    Yt.backward(torch.from_numpy(dY))
    Y = lin(X)
    dX = lin.backward(dY)
    assert Y.dtype == dtype and dX.dtype == dtype
    assert_close(Y, Yt.detach().numpy(), dtype, "Y")
    assert_close(dX, Xt.grad.numpy(), dtype, "dX")
    assert_close(lin.grads["weight"], ref.weight.grad.numpy(), dtype, "dW")
    if bias:
        assert_close(lin.grads["bias"], ref.bias.grad.numpy(), dtype, "db")
    else:
        assert "bias" not in lin.state_dict()


def test_linear_init_follows_pytorch_bounds():
    lin = attn.Linear(64, 32, seed=1)
    w, b = lin.state_dict()["weight"], lin.state_dict()["bias"]
    assert w.shape == (32, 64) and b.shape == (32,)
    bound = 1 / math.sqrt(64)
    assert np.abs(w).max() <= bound and np.abs(b).max() <= bound
    assert np.abs(w).max() > 0.9 * bound  # uniform over the whole range, not a narrow one


def test_lazy_linear_takes_its_width_from_the_first_input(rng):
    lin = attn.Linear(None, 4)
    assert lin.in_features is None and lin.state_dict() == {}
    assert repr(lin) == "Linear(in_features=None, out_features=4, bias=True)"
    lin(rng.standard_normal((3, 6)).astype(np.float32))
    assert lin.in_features == 6 and lin.state_dict()["weight"].shape == (4, 6)
    assert repr(lin) == "Linear(in_features=6, out_features=4, bias=True)"
    with pytest.raises(attn.Error, match="expected last dimension 6"):
        lin(np.zeros((3, 5), np.float32))


def test_linear_errors():
    with pytest.raises(attn.Error, match="in_features must be positive or None"):
        attn.Linear(0, 3)
    with pytest.raises(attn.Error, match="out_features must be positive"):
        attn.Linear(3, 0)
    with pytest.raises(attn.Error, match="bfloat16"):
        attn.Linear(3, 3, dtype="bfloat16")


# ------------------------------------------------------------------------------------------------
# cross_entropy


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_cross_entropy_matches_torch(rng, dtype, reduction):
    logits = rng.standard_normal((3, 4, 6)).astype(dtype) * 3
    targets = rng.integers(0, 6, size=(3, 4))
    targets[0, 1] = targets[2, 3] = -100  # ignored, as PyTorch's default ignore_index
    lt = torch.from_numpy(logits.copy()).requires_grad_()
    loss_t = F.cross_entropy(lt.reshape(-1, 6), torch.from_numpy(targets).reshape(-1),
                             reduction=reduction)
    (loss_t * 0.5).backward()
    loss = attn.cross_entropy(logits, targets, reduction=reduction)
    grad = attn.cross_entropy_backward(logits, targets, reduction=reduction, grad_loss=0.5)
    assert isinstance(loss, float)
    assert loss == pytest.approx(float(loss_t), rel=1e-6 if dtype == np.float32 else 1e-12)
    assert grad.dtype == dtype and grad.shape == logits.shape
    assert_close(grad, lt.grad.numpy(), dtype, "dlogits")
    assert not grad[0, 1].any() and not grad[2, 3].any()


def test_cross_entropy_valid_lens_leave_out_the_padding(rng):
    logits = rng.standard_normal((2, 5, 4))
    targets = rng.integers(0, 4, size=(2, 5))
    lens = np.array([3, 5])
    # The same loss as PyTorch's with the padded targets ignored.
    ignored = targets.copy()
    ignored[0, 3:] = -100
    lt = torch.from_numpy(logits.copy()).requires_grad_()
    loss_t = F.cross_entropy(lt.reshape(-1, 4), torch.from_numpy(ignored).reshape(-1))
    loss_t.backward()
    assert attn.cross_entropy(logits, targets, lens) == pytest.approx(float(loss_t), rel=1e-12)
    np.testing.assert_allclose(attn.cross_entropy_backward(logits, targets, lens),
                               lt.grad.numpy(), rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_cross_entropy_with_grad_is_the_loss_and_the_gradient(rng, dtype, reduction):
    # A vocabulary past the vector widths, padded rows, an ignored target: the one-pass op gives
    # the two calls' values bit for bit.
    logits = (rng.standard_normal((3, 5, 37)) * 4).astype(dtype)
    targets = rng.integers(0, 37, size=(3, 5))
    targets[1, 2] = -100
    lens = np.array([5, 2, 4])
    loss, grad = attn.cross_entropy_with_grad(logits, targets, lens, reduction=reduction,
                                              grad_loss=0.25)
    assert loss == attn.cross_entropy(logits, targets, lens, reduction=reduction)
    want = attn.cross_entropy_backward(logits, targets, lens, reduction=reduction, grad_loss=0.25)
    assert grad.dtype == dtype and grad.shape == logits.shape
    np.testing.assert_array_equal(grad, want)
    with pytest.raises(attn.Error, match="cross_entropy_with_grad"):
        attn.cross_entropy_with_grad(logits, targets[:, :4])


def test_cross_entropy_edge_cases_and_errors():
    logits = np.zeros((2, 3))
    assert math.isnan(attn.cross_entropy(logits, np.array([-100, -100])))  # 0/0, as PyTorch
    assert not attn.cross_entropy_backward(logits, np.array([-100, -100])).any()
    assert attn.cross_entropy(logits, np.array([7, 7]), ignore_index=7, reduction="sum") == 0
    with pytest.raises(attn.Error, match=r"expected a class in \[0, 3\)"):
        attn.cross_entropy(logits, np.array([0, 3]))
    with pytest.raises(attn.Error, match="reduction 'max' unsupported"):
        attn.cross_entropy(logits, np.array([0, 1]), reduction="max")
    with pytest.raises(attn.Error):
        attn.cross_entropy(logits, np.array([0.5, 1.0]))  # targets must be integers


# ------------------------------------------------------------------------------------------------
# A training loop in Python


def test_encoder_head_loss_and_optimizer_learn_a_task(rng):
    # Every position predicts its sequence's first token: only attention carries it there. The
    # loss falls from chance (ln 8) to near 0 within 500 steps (0.01-0.10 over six data seeds when
    # this test was written; a rate of 3e-3 reached lower on most seeds but spiked on some).
    vocab, T, B = 8, 6, 32
    enc = attn.TransformerEncoder(vocab, 32, 64, 4, 1, 0.0, seed=1)
    head = attn.Linear(32, vocab, seed=2)
    opts = [attn.optim.AdamW(enc, lr=1e-3, weight_decay=0.0),
            attn.optim.AdamW(head, lr=1e-3, weight_decay=0.0)]
    losses = []
    for _ in range(500):
        tokens = rng.integers(0, vocab, size=(B, T))
        targets = np.repeat(tokens[:, :1], T, axis=1)
        logits = head(enc(tokens))
        losses.append(attn.cross_entropy(logits, targets))
        enc.backward(head.backward(attn.cross_entropy_backward(logits, targets)))
        for opt in opts:
            opt.step()
            opt.zero_grad()
    chance = math.log(vocab)
    assert np.mean(losses[:5]) > 0.8 * chance
    assert np.mean(losses[-10:]) < 0.25 * chance, losses[::50]
