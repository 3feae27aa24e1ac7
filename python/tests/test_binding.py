"""The binding itself: arrays in and out without copies, lifetimes, the GIL, errors, state dicts,
train/eval, contexts and seeds."""

import gc
import sys
import threading
import time

import numpy as np
import pytest
import torch

import attn
from conftest import assert_close


def qkv(rng, B=2, T=3, S=4, D=8, dtype=np.float32):
    return tuple(rng.standard_normal(s).astype(dtype) for s in [(B, T, D), (B, S, D), (B, S, D)])


# ------------------------------------------------------------------------------------------------
# No copies


@pytest.mark.parametrize("make", [
    lambda a: a,                            # C-contiguous
    lambda a: a[:, ::2, 1:],                # strided view
    lambda a: a.transpose(2, 0, 1),         # transposed view
    lambda a: np.broadcast_to(a[:1], a.shape),  # zero stride
])
def test_inputs_are_viewed_not_copied(rng, make):
    arr = make(rng.standard_normal((3, 6, 5)).astype(np.float32))
    info = attn._input_view(arr)
    assert not info["copied"]
    assert info["data"] == arr.ctypes.data
    for got, stride, size in zip(info["strides"], arr.strides, arr.shape):
        assert size <= 1 or got == stride // arr.itemsize


@pytest.mark.parametrize("make,dtype", [
    (lambda a: a[:, ::-1], "F32"),                                  # negative stride
    (lambda a: a.astype(np.float16), "F32"),                         # not a compute dtype
    (lambda a: a.astype(">f4"), "F32"),                             # big-endian
    (lambda a: np.ndarray(a.shape, np.float32, np.zeros(a.nbytes + 1, np.uint8).data, 1),
     "F32"),                                                         # misaligned
    (lambda a: a.astype(np.int16), "F32"),                           # integers become float32
    (lambda a: a.tolist(), "F64"),                                   # a list of floats
])
def test_inputs_that_cannot_be_viewed_are_converted(rng, make, dtype):
    arr = make(rng.standard_normal((2, 3, 4)).astype(np.float32))
    info = attn._input_view(arr)
    assert info["copied"] and info["dtype"] == dtype


def test_outputs_own_attns_buffer(rng):
    q, k, v = qkv(rng)
    out = attn.scaled_dot_product_attention(q, k, v)
    assert type(out.base).__name__ == "PyCapsule"  # NumPy keeps attn's Tensor alive, no copy
    assert out.flags.c_contiguous and out.flags.writeable and out.flags.owndata is False
    layer = attn.DotProductAttention(0.0)
    layer(q, k, v)
    w1, w2 = layer.attention_weights, layer.attention_weights
    assert np.shares_memory(w1, w2) and not w1.flags.writeable
    del layer
    gc.collect()
    assert w1.shape == (2, 3, 4) and np.isfinite(w1).all()  # outlives the layer


def test_named_parameters_are_live_views(rng):
    layer = attn.MultiHeadAttention(8, 2, 0.0).eval()
    X = rng.standard_normal((1, 3, 8)).astype(np.float32)
    before = layer(X, X, X)
    params = dict(layer.named_parameters())
    params["W_o.weight"] *= 2  # in place, on the layer's own memory
    assert_close(layer.state_dict()["W_o.weight"], params["W_o.weight"], np.float32)
    assert_close(layer(X, X, X), 2 * before, np.float32)
    state = layer.state_dict()
    state["W_o.weight"] += 1  # a copy: the layer does not change
    assert not np.shares_memory(state["W_o.weight"], params["W_o.weight"])


# ------------------------------------------------------------------------------------------------
# Lifetimes


def test_backward_reads_inputs_the_caller_dropped(rng):
    # The layer views its inputs until the next forward; the binding keeps them alive.
    layer = attn.MultiHeadAttention(8, 2, 0.0, bias=True).eval()
    reference = attn.MultiHeadAttention(8, 2, 0.0, bias=True).eval()

    def forward_with_temporaries():
        q, k, v = qkv(rng)
        layer(q, k, v.astype(np.float64), np.array([2, 4]))  # float64 -> converted copy
        return q.copy(), k.copy(), v.copy()

    q, k, v = forward_with_temporaries()
    gc.collect()
    junk = [np.full((2, 4, 8), 1e30, np.float32) for _ in range(64)]  # reuse freed memory
    G = rng.standard_normal((2, 3, 8)).astype(np.float32)
    grads = layer.backward(G)
    reference.load_state_dict(layer.state_dict())
    reference(q, k, v, np.array([2, 4]))
    for got, want in zip(grads, reference.backward(G)):
        assert_close(got, want, np.float32)
    del junk


def test_grads_accumulate_until_zero_grad(rng):
    layer = attn.MultiHeadAttention(8, 2, 0.0).eval()
    X = rng.standard_normal((2, 3, 8)).astype(np.float32)
    G = np.ones((2, 3, 8), np.float32)
    layer(X, X, X)
    layer.backward(G)
    once = {k: v.copy() for k, v in layer.grads.items()}
    layer(X, X, X)
    layer.backward(G)
    for k, v in layer.grads.items():
        assert_close(v, 2 * once[k], np.float32, k)
    layer.zero_grad()
    assert all(not v.any() for v in layer.grads.values())


# ------------------------------------------------------------------------------------------------
# The GIL


def test_compute_releases_the_gil(rng):
    # A worker computes for ~0.6 s in calls of >= 50 ms; the main thread ticks meanwhile. Were
    # the GIL held during a call, no tick could land strictly inside one (ticks would only fall
    # between calls), whatever the machine's load.
    ctx = attn.Context(threads=1)
    B = 1
    while True:
        q = rng.standard_normal((B, 256, 64)).astype(np.float32)
        start = time.perf_counter()
        attn.scaled_dot_product_attention(q, q, q, ctx=ctx)
        if time.perf_counter() - start > 0.05 or B >= 1024:
            break
        B *= 2
    spans = []

    def work():
        stop = time.perf_counter() + 0.6
        while time.perf_counter() < stop:
            begin = time.perf_counter()
            attn.scaled_dot_product_attention(q, q, q, ctx=ctx)
            spans.append((begin, time.perf_counter()))

    ticks = []
    worker = threading.Thread(target=work)
    worker.start()
    while worker.is_alive():
        ticks.append(time.perf_counter())
        time.sleep(0.001)
    worker.join()
    # The Python lines around each call hold the GIL, and a waiting thread forces a switch after
    # sys.getswitchinterval() (5 ms): ticks that close to a call's ends do not count.
    margin = 2 * sys.getswitchinterval()
    inside = [x for x in ticks if any(b + margin < x < e - margin for b, e in spans)]
    assert len(inside) >= 5, f"{len(inside)} of {len(ticks)} ticks inside {len(spans)} calls"


def test_two_threads_share_a_layer(rng):
    layer = attn.MultiHeadAttention(16, 4, 0.0).eval()
    X = rng.standard_normal((2, 5, 16)).astype(np.float32)
    expected = layer(X, X, X)
    results = []

    def work():
        for _ in range(20):
            results.append(layer(X, X, X))

    threads = [threading.Thread(target=work) for _ in range(2)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    assert len(results) == 40
    for r in results:
        assert np.array_equal(r, expected)


# ------------------------------------------------------------------------------------------------
# Errors


def test_errors_are_attn_errors_naming_the_operation(rng):
    q, k, v = qkv(rng)
    with pytest.raises(attn.Error, match="scaled_dot_product_attention") as e:
        attn.scaled_dot_product_attention(q, k[:, :, :5], v)
    assert isinstance(e.value, ValueError) and e.value.op == "scaled_dot_product_attention"
    with pytest.raises(attn.Error, match=r"masked_softmax: valid_lens has shape \(3\)"):
        attn.masked_softmax(q, np.array([1, 2, 3]))
    with pytest.raises(attn.Error, match="masked_softmax"):
        attn.masked_softmax(np.zeros((2, 3), np.complex64))
    with pytest.raises(attn.Error, match="not divisible"):
        attn.MultiHeadAttention(10, 3, 0.0)
    with pytest.raises(attn.Error, match="called before forward"):
        attn.MultiHeadAttention(8, 2, 0.0).backward(np.zeros((1, 1, 8), np.float32))
    with pytest.raises(attn.Error, match="masked_rows"):
        attn.DotProductAttention(0.0, masked_rows="nan")
    with pytest.raises(attn.Error, match="dtype"):
        attn.PositionalEncoding(4, 0.0, dtype=np.int32)
    layer = attn.MultiHeadAttention(8, 2, 0.0)
    layer(q, k, v)
    # The lazy projections took width 8 at the first call; the projection layer reports it.
    with pytest.raises(attn.Error, match=r"Linear: input has shape \(2, 4, 4\), expected last"):
        layer(q, k[..., :4], v)


def test_load_state_dict_errors_leave_the_layer_unchanged(rng):
    layer = attn.MultiHeadAttention(8, 2, 0.0, bias=True).eval()
    X = rng.standard_normal((1, 3, 8)).astype(np.float32)
    before = layer(X, X, X)
    state = layer.state_dict()
    with pytest.raises(attn.Error, match="missing W_o.bias"):
        layer.load_state_dict({k: v * 0 for k, v in state.items() if k != "W_o.bias"})
    with pytest.raises(attn.Error, match="unexpected"):
        layer.load_state_dict({**state, "extra": np.zeros(1)})
    with pytest.raises(attn.Error, match="shape"):
        layer.load_state_dict({**state, "W_q.weight": np.zeros((8, 7))})
    assert np.array_equal(layer(X, X, X), before)
    # Non-strict: the given names only.
    layer.load_state_dict({"W_o.bias": state["W_o.bias"] + 1}, strict=False)
    assert_close(layer(X, X, X), before + 1, np.float32)


# ------------------------------------------------------------------------------------------------
# Modes, dtypes, seeds, contexts


def test_train_eval_and_repr():
    layer = attn.MultiHeadAttention(100, 5, 0.5)
    assert layer.training
    assert layer.eval() is layer and not layer.training
    assert layer.train() is layer and layer.training
    assert repr(layer) == "MultiHeadAttention(num_hiddens=100, num_heads=5, dropout=0.5, bias=False)"
    assert isinstance(layer, attn.Module)
    assert layer.num_hiddens == 100 and layer.num_heads == 5


def test_float64_inputs_to_a_float32_layer_are_converted(rng):
    layer = attn.MultiHeadAttention(8, 2, 0.0).eval()
    X = rng.standard_normal((2, 3, 8))
    out = layer(X, X, X)
    assert out.dtype == np.float32
    assert_close(out, layer(*(X.astype(np.float32),) * 3), np.float32)


def test_seeds_decide_parameters_and_dropout(rng):
    X = rng.standard_normal((1, 4, 8)).astype(np.float32)
    a, b, c = (attn.MultiHeadAttention(8, 2, 0.5, seed=s) for s in (1, 1, 2))
    assert all(np.array_equal(a.state_dict()[k], b.state_dict()[k]) for k in a.state_dict())
    a(X, X, X), c(X, X, X)  # materialise the lazy projections
    assert not np.array_equal(a.state_dict()["W_q.weight"], c.state_dict()["W_q.weight"])
    # Same seed, same dropout masks; each call takes a fresh stream offset.
    b(X, X, X)
    assert np.array_equal(a(X, X, X), b(X, X, X))
    assert a.context.dropout_offset == 2
    assert not np.array_equal(a(X, X, X), b.eval()(X, X, X))


def test_shared_context(rng):
    ctx = attn.Context(seed=5, threads=1, backend="reference")
    layer = attn.PositionalEncoding(8, 0.5, ctx=ctx)
    assert layer.context is ctx and layer.seed == 5 and ctx.backend == "reference"
    layer(np.zeros((1, 2, 8), np.float32))
    assert ctx.dropout_offset == 1
    with pytest.raises(attn.Error, match="backend"):
        ctx.backend = "gpu"


def test_state_dict_round_trip_between_attn_and_d2l_names(rng):
    a = attn.AdditiveAttention(6, 0.0, seed=1).eval()
    q, k, v = (rng.standard_normal(s).astype(np.float32) for s in [(2, 3, 4), (2, 5, 3), (2, 5, 2)])
    out = a(q, k, v, np.array([2, 5]))
    state = a.state_dict()
    assert list(state) == ["W_k.weight", "W_q.weight", "w_v.weight"]
    assert [s.shape for s in state.values()] == [(6, 3), (6, 4), (1, 6)]
    b = attn.AdditiveAttention(6, 0.0, seed=2).eval()
    b.load_state_dict({k: torch.from_numpy(v) for k, v in state.items()})  # torch tensors work
    assert np.array_equal(b(q, k, v, np.array([2, 5])), out)


# ------------------------------------------------------------------------------------------------
# The block cache behind results


def test_memory_cache_reuses_freed_results_and_obeys_its_limit(rng):
    saved = attn.memory_cache_stats()["limit_bytes"]
    try:
        attn.set_memory_cache_limit(64 << 20)
        attn.release_cached_memory()
        x = rng.standard_normal((1, 512, 1024)).astype(np.float32)  # 2 MiB results
        y = attn.dropout(x, 0.5, seed=1)
        first = y.ctypes.data
        del y
        gc.collect()
        stats = attn.memory_cache_stats()
        assert stats["cached_blocks"] == 1 and stats["cached_bytes"] >= 2 << 20
        y = attn.dropout(x, 0.5, seed=2)  # the same size: the freed block comes back
        assert y.ctypes.data == first
        assert attn.memory_cache_stats()["hits"] == stats["hits"] + 1
        assert np.array_equal(y != 0, attn.dropout(x, 0.5, seed=2) != 0)
        attn.set_memory_cache_limit(0)
        assert attn.memory_cache_stats()["cached_bytes"] == 0
        with pytest.raises(attn.Error, match="set_memory_cache_limit"):
            attn.set_memory_cache_limit(-1)
    finally:
        attn.set_memory_cache_limit(saved)
