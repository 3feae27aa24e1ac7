#!/usr/bin/env python3
"""PyTorch baseline for bench/bench_train.cpp: the same encoder classifier trained by PyTorch.

The model is d2l's TransformerEncoder (the code in tests/fixtures/d2l_reference.py) with attn's
classification head (masked mean over the valid positions, then a Linear): E = 128, 4 heads,
2 blocks, FFN 256, vocabulary 1000, 2 classes, dropout 0.1, in train mode. One step is what
attn's model::Trainer does: zero_grad, forward, F.cross_entropy, backward,
clip_grad_norm_(1.0), AdamW(lr 1e-3) step. Batch: B = 32 sequences of T = 128 tokens, all full
length, valid_lens given (as bench_train.cpp).

PyTorch is only at its best on this machine with
  GLIBC_TUNABLES=glibc.malloc.mmap_max=0:glibc.malloc.trim_threshold=68719476736
  OMP_WAIT_POLICY=PASSIVE
and an optimised BLAS (Debian's default libblas.so.3 is the netlib reference BLAS);
bench/run_train.sh sets all three. The BLAS this process mapped is reported.

Prints one JSON object: tokens_per_second per repetition, the BLAS, the threads.
"""
import argparse
import json
import os
import sys
import time

import torch

sys.dont_write_bytecode = True
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests",
                                "fixtures"))
from d2l_reference import EncoderClassifier  # noqa: E402


def loaded_blas():
    """Paths of the BLAS libraries this process mapped."""
    found = set()
    with open("/proc/self/maps") as maps:
        for line in maps:
            name = line.split()[-1]
            if "blas" in name.lower():
                found.add(os.path.realpath(name))
    return ", ".join(sorted(found)) or "?"


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--length", type=int, default=128)
    ap.add_argument("--hiddens", type=int, default=128)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--ffn", type=int, default=256)
    ap.add_argument("--blocks", type=int, default=2)
    ap.add_argument("--vocab", type=int, default=1000)
    ap.add_argument("--classes", type=int, default=2)
    ap.add_argument("--dropout", type=float, default=0.1)
    ap.add_argument("--min-time", type=float, default=3.0, help="seconds per repetition")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--autocast", action="store_true",
                    help="torch.autocast('cpu', dtype=torch.bfloat16) around forward and loss")
    args = ap.parse_args()

    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    B, T = args.batch, args.length
    model = EncoderClassifier(args.vocab, args.hiddens, args.ffn, args.heads, args.blocks,
                              args.dropout, args.classes).train()
    adamw = torch.optim.AdamW(model.parameters(), lr=1e-3)
    ids = torch.randint(2, args.vocab, (B, T))
    valid_lens = torch.full((B,), T, dtype=torch.int64)
    targets = torch.randint(0, args.classes, (B,))

    def step():
        adamw.zero_grad()
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=args.autocast):
            loss = torch.nn.functional.cross_entropy(model(ids, valid_lens), targets)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        adamw.step()
        return loss.item()

    step()  # warm-up: allocator, thread pool, AdamW state
    step()
    rates = []
    for _ in range(args.reps):
        steps, start = 0, time.perf_counter()
        while True:
            step()
            steps += 1
            elapsed = time.perf_counter() - start
            if elapsed >= args.min_time and steps >= 3:
                break
        rates.append(steps * B * T / elapsed)
    print(json.dumps({"tokens_per_second": rates, "threads": torch.get_num_threads(),
                      "blas": loaded_blas(), "torch": torch.__version__, "autocast": args.autocast,
                      "num_threads_env": os.environ.get("OMP_NUM_THREADS", "")}))


if __name__ == "__main__":
    main()
