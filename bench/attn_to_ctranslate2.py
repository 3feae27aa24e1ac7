#!/usr/bin/env python3
"""Converts an attn encoder-decoder checkpoint into a CTranslate2 model directory.

    attn_to_ctranslate2.py CHECKPOINT.safetensors OUT_DIR

CHECKPOINT comes from `attn train --task dates|translate|copy|reverse --checkpoint X`
(format attn-seq2seq-checkpoint/1, docs/seq2seq.md). The model is d2l's Transformer
(docs/decoder.md): post-norm blocks (x = LayerNorm(x + sublayer(x))), embeddings scaled by
sqrt(E) plus d2l's sinusoidal table P (sin in even columns, cos in odd ones), attention
projections without bias, FFN dense1 -> ReLU -> dense2 with biases, LayerNorm eps 1e-5 (torch's
default, which attn follows), an output dense with bias. It is described to CTranslate2 through
its specification API (ctranslate2.specs.TransformerSpec), which maps one to one:

  encoder layer i    self_attention.linear[0] = [W_q; W_k; W_v], linear[1] = W_o,
                     self_attention.layer_norm = addnorm1, ffn.linear_0/1 = dense1/2,
                     ffn.layer_norm = addnorm2 (pre_norm=False: the norms follow the residuals)
  decoder layer i    self_attention as above (addnorm1); attention.linear[0] = W_q,
                     linear[1] = [W_k; W_v], linear[2] = W_o, attention.layer_norm = addnorm2;
                     ffn (addnorm3); projection = dense
  both               embeddings * sqrt(E) (scale_embeddings), position_encodings = P itself:
                     CTranslate2's own sinusoidal table puts all sines before all cosines, so it
                     is not d2l's; giving the table makes the layout a non-question
  config             layer_norm_epsilon 1e-5 (CTranslate2's default is 1e-6), <bos> as the
                     decoder start token, <eos>, <unk>; sources get no automatic <bos>/<eos>
                     (the caller appends <eos>, as attn's batches do)

What identical translations depend on (tried on the held-out dates): the positional table's
layout and the <eos> at the end of each source change translations when wrong; the LayerNorm eps
does not at this scale. Where two tokens are nearly tied, the batch's padding can decide between
them in either engine, so comparisons use the same consecutive batches on both sides rather than
CTranslate2's length-sorted batching (max_batch_size).
"""
import json
import math
import os
import sys

import numpy as np
from safetensors import safe_open

import ctranslate2
from ctranslate2.specs import common_spec, transformer_spec


def d2l_positional_table(max_len, E):
    """d2l's P: P[t, 2i] = sin(t / 10000^(2i/E)), P[t, 2i+1] = cos(same)."""
    X = np.arange(max_len, dtype=np.float32).reshape(-1, 1) / np.power(
        10000, np.arange(0, E, 2, dtype=np.float32) / E)
    P = np.zeros((max_len, E), np.float32)
    P[:, 0::2] = np.sin(X)
    P[:, 1::2] = np.cos(X)
    return P


def convert(checkpoint, out_dir):
    f = safe_open(checkpoint, "np")
    meta = f.metadata()
    if meta.get("attn.format") != "attn-seq2seq-checkpoint/1":
        sys.exit(f"attn_to_ctranslate2: {checkpoint} is a {meta.get('attn.format')!r} "
                 "checkpoint, expected attn-seq2seq-checkpoint/1 (attn train --task dates ...)")
    opts = json.loads(meta["attn.options"])
    m = opts["model"]
    pe = json.loads(meta.get("train.args", "{}")).get("pe", "sinusoidal")
    if pe != "sinusoidal":
        sys.exit(f"attn_to_ctranslate2: positional encoding {pe!r}: only sinusoidal converts")
    E, H = m["num_hiddens"], m["num_heads"]
    w = lambda name: f.get_tensor("model." + name)  # noqa: E731

    spec = transformer_spec.TransformerSpec.from_config(
        (m["num_enc_blks"], m["num_dec_blks"]), H, pre_norm=False,
        activation=common_spec.Activation.RELU)
    P = d2l_positional_table(m["max_len"], E)

    def linear(lspec, weight, bias=None):
        lspec.weight = np.ascontiguousarray(weight, np.float32)
        if bias is not None:
            lspec.bias = np.ascontiguousarray(bias, np.float32)
        elif m["use_bias"]:
            raise ValueError("use_bias checkpoints are not handled")

    def norm(nspec, prefix):
        nspec.gamma = w(prefix + ".ln.weight")
        nspec.beta = w(prefix + ".ln.bias")

    def ffn(fspec, prefix, addnorm):
        linear(fspec.linear_0, w(prefix + ".ffn.dense1.weight"), w(prefix + ".ffn.dense1.bias"))
        linear(fspec.linear_1, w(prefix + ".ffn.dense2.weight"), w(prefix + ".ffn.dense2.bias"))
        norm(fspec.layer_norm, f"{prefix}.{addnorm}")

    def self_attention(aspec, prefix, addnorm):
        linear(aspec.linear[0], np.concatenate([w(f"{prefix}.W_{x}.weight") for x in "qkv"]))
        linear(aspec.linear[1], w(prefix + ".W_o.weight"))
        norm(aspec.layer_norm, addnorm)

    enc, dec = spec.encoder, spec.decoder
    enc.embeddings[0].weight = w("encoder.embedding.weight")
    enc.scale_embeddings = True
    enc.position_encodings.encodings = P
    for i, layer in enumerate(enc.layer):
        b = f"encoder.blks.block{i}"
        self_attention(layer.self_attention, b + ".attention", b + ".addnorm1")
        ffn(layer.ffn, b, "addnorm2")
    dec.embeddings.weight = w("decoder.embedding.weight")
    dec.scale_embeddings = True
    dec.position_encodings.encodings = P
    for i, layer in enumerate(dec.layer):
        b = f"decoder.blks.block{i}"
        self_attention(layer.self_attention, b + ".attention1", b + ".addnorm1")
        linear(layer.attention.linear[0], w(b + ".attention2.W_q.weight"))
        linear(layer.attention.linear[1],
               np.concatenate([w(f"{b}.attention2.W_{x}.weight") for x in "kv"]))
        linear(layer.attention.linear[2], w(b + ".attention2.W_o.weight"))
        norm(layer.attention.layer_norm, b + ".addnorm2")
        ffn(layer.ffn, b, "addnorm3")
    linear(dec.projection, w("decoder.dense.weight"), w("decoder.dense.bias"))

    src_vocab = json.loads(meta["attn.src_vocab"])
    tgt_vocab = json.loads(meta["attn.tgt_vocab"])
    spec.register_source_vocabulary(src_vocab)
    spec.register_target_vocabulary(tgt_vocab)
    cfg = spec.config
    cfg.layer_norm_epsilon = 1e-5
    cfg.unk_token, cfg.bos_token, cfg.eos_token = "<unk>", "<bos>", "<eos>"
    cfg.decoder_start_token = "<bos>"
    cfg.add_source_bos = cfg.add_source_eos = False
    spec.validate()
    spec.optimize(quantization="float32")
    os.makedirs(out_dir, exist_ok=True)
    spec.save(out_dir)
    return dict(num_steps=opts["num_steps"], num_hiddens=E, num_heads=H,
                sqrt_E=math.sqrt(E), ctranslate2=ctranslate2.__version__)


if __name__ == "__main__":
    if len(sys.argv) != 3:
        sys.exit("usage: attn_to_ctranslate2.py CHECKPOINT.safetensors OUT_DIR")
    print(json.dumps(convert(sys.argv[1], sys.argv[2])))
