"""The Transformer decoder and encoder-decoder from Python: d2l's names, forward/backward, the KV
cache against the whole-prefix forward, greedy and beam search. (The C++ suite holds the
gradchecks and the PyTorch parity: tests/test_nn_decoder.cpp,
tests/test_model_parity_seq2seq.cpp.)"""

import numpy as np
import pytest

import attn


def make_model(**kw):
    args = dict(src_vocab_size=13, tgt_vocab_size=11, num_hiddens=16, ffn_num_hiddens=32,
                num_heads=4, num_enc_blks=2, num_dec_blks=2, dropout=0.1, seed=3)
    args.update(kw)
    return attn.EncoderDecoder(**args)


def test_decoder_names_shapes_and_backward(rng):
    dec = attn.TransformerDecoder(11, 16, 32, 4, 2, 0.0, seed=1)
    names = [n for n, _ in dec.named_parameters()]
    assert len(names) == 39 and names[0] == "embedding.weight" and names[-1] == "dense.bias"
    assert "blks.block1.attention2.W_k.weight" in names
    ids = rng.integers(0, 11, size=(2, 5))
    enc = rng.standard_normal((2, 4, 16)).astype(np.float32)
    logits = dec(ids, enc, np.array([4, 2]))
    assert logits.shape == (2, 5, 11)
    denc = dec.backward(np.ones_like(logits))
    assert denc.shape == (2, 4, 16) and np.isfinite(denc).all()
    assert not np.any(denc[1, 2:])  # source padding is read by nothing
    dec.need_weights = True
    dec(ids, enc, np.array([4, 2]))
    self_w, cross_w = dec.attention_weights
    assert self_w[0].shape == (8, 5, 5) and cross_w[1].shape == (8, 5, 4)
    assert np.all(np.triu(self_w[0][0], 1) == 0)  # causal


def decode_incrementally(dec, ids, state, first=2):
    """Logits of ids (B, T) from dec.step: the first `first` positions in one step, then one a
    step (the cache grows past a small capacity)."""
    return np.concatenate([dec.step(ids[:, :first], state)] +
                          [dec.step(ids[:, t:t + 1], state) for t in range(first, ids.shape[1])],
                          axis=1)


def decoder_case(rng, num_hiddens, num_heads):
    """An eval-mode decoder, ids (3, 6), enc_outputs (3, 4, E), ragged lengths, forward's logits."""
    dec = attn.TransformerDecoder(11, num_hiddens, 32, num_heads, 2, 0.0, seed=1).eval()
    ids = rng.integers(0, 11, size=(3, 6))
    enc = rng.standard_normal((3, 4, num_hiddens)).astype(np.float32)
    lens = np.array([4, 1, 3])
    return dec, ids, enc, lens, dec(ids, enc, lens)


def test_step_with_cache_equals_forward(rng):
    dec, ids, enc, lens, want = decoder_case(rng, 16, 4)
    state = dec.init_state(enc, lens, capacity=2)
    got = decode_incrementally(dec, ids, state)
    assert state.length == 6
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-5)


def test_bf16_cache_step_and_search(rng):
    # cache_dtype='bfloat16': the cached keys and values (self-attention and encoder projections)
    # are rounded to bfloat16, attention accumulates in float32 (the decode kernel's bf16 path).
    dec, ids, enc, lens, want = decoder_case(rng, 64, 2)
    state32 = dec.init_state(enc, lens)
    state16 = dec.init_state(enc, lens, capacity=2, cache_dtype="bfloat16")
    assert state32.cache_dtype == "float32" and state16.cache_dtype == "bfloat16"
    got32 = decode_incrementally(dec, ids, state32, first=1)
    got16 = decode_incrementally(dec, ids, state16)
    np.testing.assert_allclose(got32, want, rtol=0, atol=1e-5)
    err = np.abs(got16 - want).max()
    assert 0 < err < 0.05 * np.abs(want).max()  # rounded, but close

    model = make_model()
    model.eval()
    src = rng.integers(0, 13, size=(5, 6))
    slens = np.array([6, 3, 1, 5, 2])
    for search, extra in (("greedy_search", {}), ("beam_search", {"beam_size": 3})):
        out = getattr(model, search)(src, slens, bos=0, eos=10, max_len=6,
                                     cache_dtype="bfloat16", **extra)
        assert len(out["tokens"]) == 5 and all(len(t) <= 6 for t in out["tokens"])
        assert np.all(np.isfinite(out["scores"]))
        default = getattr(model, search)(src, slens, bos=0, eos=10, max_len=6, **extra)
        same = getattr(model, search)(src, slens, bos=0, eos=10, max_len=6,
                                      cache_dtype="float32", **extra)
        assert same == default

    with pytest.raises(attn.Error, match="cache_dtype F64 for a F32 decoder"):
        dec.init_state(enc, lens, cache_dtype="float64")
    dec64 = attn.TransformerDecoder(11, 16, 32, 2, 1, 0.0, dtype="float64", seed=1).eval()
    enc64 = rng.standard_normal((3, 4, 16))
    assert dec64.init_state(enc64, lens).cache_dtype == "float64"
    with pytest.raises(attn.Error, match="cache_dtype BF16 for a F64 decoder"):
        dec64.init_state(enc64, lens, cache_dtype="bfloat16")
    with pytest.raises(attn.Error, match="not a NumPy dtype"):
        model.greedy_search(src, slens, bos=0, eos=10, cache_dtype="half-ish")


def test_encoder_decoder_state_dict_and_search(rng):
    model = make_model()
    src = rng.integers(0, 13, size=(5, 6))
    lens = np.array([6, 3, 1, 5, 2])
    dec_in = rng.integers(0, 11, size=(5, 4))
    logits = model(src, dec_in, lens)
    assert logits.shape == (5, 4, 11)
    assert len(model.state_dict()) == 64
    model.backward(np.ones_like(logits))
    assert all(np.isfinite(g).all() for g in model.grads.values())
    other = make_model(seed=99)
    other(src, dec_in, lens)  # materialise the encoder's lazy projections
    other.load_state_dict(model.state_dict())
    model.eval(), other.eval()
    np.testing.assert_array_equal(other(src, dec_in, lens), model(src, dec_in, lens))

    for search, extra in (("greedy_search", {}), ("beam_search", {"beam_size": 3})):
        cached = getattr(model, search)(src, lens, bos=0, eos=10, max_len=6, **extra)
        full = getattr(model, search)(src, lens, bos=0, eos=10, max_len=6, use_cache=False,
                                      **extra)
        assert cached["tokens"] == full["tokens"] and cached["ended"] == full["ended"]
        np.testing.assert_allclose(cached["scores"], full["scores"], rtol=0, atol=1e-5)
        assert len(cached["tokens"]) == 5
        assert all(len(t) <= 6 for t in cached["tokens"])
    with pytest.raises(attn.Error, match="beam_size"):
        model.beam_search(src, lens, bos=0, eos=10, beam_size=0)


def test_encoder_decoder_trains_in_bf16_mixed_precision(rng):
    """context.autocast_bf16: bf16 mixed precision, as `attn train --precision bf16`. The output
    layer's logits are bf16 values widened to float32 (its product is rounded once to bf16), the
    loss and gradients stay close to float32's, and the parameters stay float32."""
    fp32, bf16 = make_model(dropout=0.0), make_model(dropout=0.0)
    bf16.context.autocast_bf16 = True
    assert bf16.context.autocast_bf16 and not fp32.context.autocast_bf16
    assert "autocast_bf16=True" in repr(bf16.context)
    assert attn.Context(autocast_bf16=True).autocast_bf16
    src = rng.integers(4, 13, size=(3, 5))
    dec_in = rng.integers(4, 11, size=(3, 6))
    tgt = rng.integers(4, 11, size=(3, 6))
    src_lens, tgt_lens = np.array([5, 2, 4]), np.array([6, 3, 1])
    losses = {}
    for name, m in (("fp32", fp32), ("bf16", bf16)):
        logits = m(src, dec_in, src_lens)
        assert logits.dtype == np.float32
        if name == "bf16":
            assert not np.any(logits.view(np.uint32) & 0xFFFF), "logits are not bf16 values"
        else:
            assert np.any(logits.view(np.uint32) & 0xFFFF)
        losses[name] = attn.cross_entropy(logits, tgt, tgt_lens)
        m.backward(attn.cross_entropy_backward(logits, tgt, tgt_lens))
    assert losses["bf16"] != losses["fp32"]
    np.testing.assert_allclose(losses["bf16"], losses["fp32"], rtol=2e-2)
    for (name, g32), (_, g16) in zip(sorted(fp32.grads.items()), sorted(bf16.grads.items())):
        assert g16.dtype == np.float32 and np.isfinite(g16).all(), name
    # Close as a whole (single elements can differ more: rounding a pre-activation near 0 to
    # bf16 can flip its ReLU).
    g32 = np.concatenate([g.ravel() for _, g in sorted(fp32.grads.items())])
    g16 = np.concatenate([g.ravel() for _, g in sorted(bf16.grads.items())])
    assert np.linalg.norm(g16 - g32) <= 0.1 * np.linalg.norm(g32)
    assert np.any(g16 != g32)
    opt = attn.optim.AdamW(bf16, lr=1e-2)
    first = None
    for _ in range(30):
        opt.zero_grad()
        logits = bf16(src, dec_in, src_lens)
        loss = attn.cross_entropy(logits, tgt, tgt_lens)
        first = loss if first is None else first
        bf16.backward(attn.cross_entropy_backward(logits, tgt, tgt_lens))
        opt.step()
    assert loss < 0.5 * first
    assert all(p.dtype == np.float32 for _, p in bf16.named_parameters())
