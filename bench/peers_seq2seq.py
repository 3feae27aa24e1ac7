#!/usr/bin/env python3
"""The seq2seq (n -> m) training step, attn or PyTorch 2.x, for bench/run_peers_seq2seq.sh.

    peers_seq2seq.py --engine attn|torch [--autocast] --threads N --shape dates|long

One step of d2l's Transformer encoder-decoder (post-norm, embeddings x sqrt(E) + sinusoidal P,
no attention biases), teacher forcing, as attn's Seq2SeqTrainer does it (docs/seq2seq.md):
forward(src, <bos> + target[:-1], src_valid_lens), the cross-entropy averaged over the target
positions < tgt_valid_lens, backward, clip_grad_norm(1.0), AdamW(lr 1e-3, weight decay 0.01).
Batches are random ids of the given shape (the cost does not depend on the ids), one fixed
batch, seeded: source lengths uniform in [S/2, S], target lengths uniform in [T/2, T], both
padded to S and T (d2l's valid_lens).
  shape dates  B 64, S = T = 11 (num_steps of the dates task), vocab 70 / 236, E 64, 4 heads,
               FFN 128, 2 + 2 blocks: the model of docs/seq2seq.md
  shape long   B 32, S = T = 64, vocab 1000 / 1000, E 128, 4 heads, FFN 256, 2 + 2 blocks
Dropout 0.1 in both. attn: the Python module (attn.EncoderDecoder, attn.cross_entropy_with_grad,
attn.optim) with numpy arrays, run by Debian's python3 with attn on PYTHONPATH; its Python glue
is a few calls per step; --autocast sets the model's context.autocast_bf16 (bf16 mixed
precision, as `attn train --precision bf16`). torch: d2l's code (tests/fixtures/d2l_reference.py)
in PyTorch 2.x, eager, fp32 or --autocast (bf16 autocast around forward and loss).
Prints one JSON object: pairs/s (sequence pairs per second) and target tokens/s (B*T per step).
"""
import argparse
import json
import os
import sys
import time

import numpy as np

SHAPES = {"dates": dict(B=64, S=11, T=11, sv=70, tv=236, E=64, H=4, F=128, L=2),
          "long": dict(B=32, S=64, T=64, sv=1000, tv=1000, E=128, H=4, F=256, L=2)}


def batch(p):
    rng = np.random.default_rng(5)
    B, S, T = p["B"], p["S"], p["T"]
    src = rng.integers(4, p["sv"], (B, S)).astype(np.int64)
    tgt = rng.integers(4, p["tv"], (B, T)).astype(np.int64)
    src_lens = rng.integers(S // 2, S + 1, B).astype(np.int64)
    tgt_lens = rng.integers(T // 2, T + 1, B).astype(np.int64)
    for b in range(B):
        src[b, src_lens[b]:] = 0  # <pad>
        tgt[b, tgt_lens[b]:] = 0
    dec_in = np.concatenate([np.full((B, 1), 2, np.int64), tgt[:, :-1]], axis=1)  # <bos> = 2
    return src, src_lens, dec_in, tgt, tgt_lens


def attn_step(p, threads, autocast):
    import attn
    m = attn.EncoderDecoder(p["sv"], p["tv"], p["E"], p["F"], p["H"], p["L"], p["L"], 0.1,
                            seed=0, threads=threads).train()
    m.context.autocast_bf16 = autocast
    opt = attn.optim.AdamW(m, lr=1e-3, weight_decay=0.01)
    src, src_lens, dec_in, tgt, tgt_lens = batch(p)

    def step():
        opt.zero_grad()
        logits = m(src, dec_in, src_lens)
        loss, dlogits = attn.cross_entropy_with_grad(logits, tgt, tgt_lens)
        m.backward(dlogits)
        attn.optim.clip_grad_norm(m, 1.0)
        opt.step()
        return loss
    return step, getattr(attn, "__version__", "?")


def torch_step(p, threads, autocast):
    import torch
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests",
                                    "fixtures"))
    from d2l_reference import EncoderDecoder, TransformerDecoder, TransformerEncoder
    torch.set_num_threads(threads)
    torch.manual_seed(0)
    m = EncoderDecoder(TransformerEncoder(p["sv"], p["E"], p["F"], p["H"], p["L"], 0.1),
                       TransformerDecoder(p["tv"], p["E"], p["F"], p["H"], p["L"], 0.1)).train()
    opt = torch.optim.AdamW(m.parameters(), lr=1e-3, weight_decay=0.01)
    src, src_lens, dec_in, tgt, tgt_lens = (torch.from_numpy(a) for a in batch(p))
    keep = (torch.arange(p["T"])[None, :] < tgt_lens[:, None]).reshape(-1).float()

    def step():
        opt.zero_grad()
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            logits = m(src, dec_in, src_lens)
            ce = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(),
                                                   tgt.reshape(-1), reduction="none")
            loss = (ce * keep).sum() / keep.sum()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(m.parameters(), 1.0)
        opt.step()
        return loss.item()
    return step, torch.__version__


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--engine", required=True, choices=["attn", "torch"])
    ap.add_argument("--autocast", action="store_true")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--shape", default="dates", choices=sorted(SHAPES))
    ap.add_argument("--min-time", type=float, default=3.0)
    args = ap.parse_args()
    p = SHAPES[args.shape]
    if args.engine == "attn":
        step, version = attn_step(p, args.threads, args.autocast)
    else:
        step, version = torch_step(p, args.threads, args.autocast)
    losses = [float(step()), float(step())]  # warm-up: allocator, thread pool, AdamW state
    steps, start = 0, time.perf_counter()
    while True:
        step()
        steps += 1
        elapsed = time.perf_counter() - start
        if elapsed >= args.min_time and steps >= 3:
            break
    print(json.dumps({"engine": args.engine, "version": version, "autocast": args.autocast,
                      "shape": args.shape, "threads": args.threads,
                      "pairs_per_second": steps * p["B"] / elapsed,
                      "tokens_per_second": steps * p["B"] * p["T"] / elapsed,
                      "first_losses": losses}))


if __name__ == "__main__":
    sys.dont_write_bytecode = True
    main()
