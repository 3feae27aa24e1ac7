"""Generation throughput of d2l's decoder loop in PyTorch, the other half of bench/run_decode.sh.

d2l 1.0's EncoderDecoder.predict_step (tests/fixtures/d2l_reference.py, the code the parity
tests check attn against): greedy, 256 steps, each step feeding the last token while every block
concatenates its earlier inputs and re-projects the whole prefix (and the encoder outputs) through
W_k, W_v. Same shapes as bench/bench_generate.cpp: E=512, 8 heads, FFN 2048, 6 + 6 blocks, vocab
10k, source 64, fp32, eval mode, random weights.

    python3 bench/torch_decode.py --batch B [--rounds R] [--threads N]
One JSON line per round: {"impl": "d2l-torch", "batch", "tokens", "seconds", "tok_s"}.
"""
import argparse
import json
import os
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests", "fixtures"))
import d2l_reference as d2l  # noqa: E402


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument("--threads", type=int, default=int(os.environ.get("ATTN_THREADS", "2")))
    ap.add_argument("--steps", type=int, default=256)
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    torch.manual_seed(0)
    V, E, F, H, blks, src_len = 10000, 512, 2048, 8, 6, 64
    enc = d2l.TransformerEncoder(V, E, F, H, blks, 0.1)
    dec = d2l.TransformerDecoder(V, E, F, H, blks, 0.1)  # d2l as is (P[0] every step: same cost)
    model = d2l.EncoderDecoder(enc, dec).eval()
    src = (4 + (torch.arange(a.batch * src_len) * 7919) % (V - 4)).reshape(a.batch, src_len)
    bos = torch.ones(a.batch, dtype=torch.long)
    for _ in range(a.rounds):
        t0 = time.perf_counter()
        with torch.no_grad():
            tokens, _ = model.predict_step(src, bos, None, a.steps)
        s = time.perf_counter() - t0
        n = tokens.numel()
        print(json.dumps({"impl": "d2l-torch", "batch": a.batch, "tokens": n,
                          "seconds": round(s, 4), "tok_s": round(n / s, 2)}), flush=True)


if __name__ == "__main__":
    main()
