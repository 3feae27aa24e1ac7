#!/usr/bin/env python3
"""PyTorch 2.x side of bench/run_peers_train.sh: the d2l encoder classifier's training step.

The model and the step are bench/torch_train.py's (d2l's TransformerEncoder from
tests/fixtures/d2l_reference.py with attn's masked-mean classification head; zero_grad, forward,
cross_entropy, backward, clip_grad_norm_(1.0), AdamW(lr 1e-3)), i.e. what bench_train.cpp's
BM_TrainStep times in attn, run here by the PyPI PyTorch 2.x of bench/peers-venv.sh:

  --mode eager            fp32
  --mode autocast         torch.autocast('cpu', bfloat16) around forward and loss
  --mode compile          torch.compile(model) (inductor; needs a C++ compiler), fp32
  --mode compile-autocast both
  --padded                lengths per sequence uniform in [T/2, T] (seeded) instead of T, the
                          batch padded to its longest (as bench_train's BM_TrainStepPadded)

Tokens per second count the valid tokens, the sum of valid_lens (B*T at full length), as
bench_train does.
Prints one JSON object; a mode that cannot run prints {"skipped": reason}.
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


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--length", type=int, default=128)
    ap.add_argument("--mode", default="eager",
                    choices=["eager", "autocast", "compile", "compile-autocast"])
    ap.add_argument("--padded", action="store_true")
    ap.add_argument("--min-time", type=float, default=3.0)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    B, T = args.batch, args.length
    model = EncoderClassifier(1000, 128, 256, 4, 2, 0.1, 2).train()
    adamw = torch.optim.AdamW(model.parameters(), lr=1e-3)
    ids = torch.randint(2, 1000, (B, T))
    if args.padded:
        g = torch.Generator().manual_seed(T)
        valid_lens = torch.randint(T // 2, T + 1, (B,), generator=g)
        ids = ids[:, :int(valid_lens.max())]
    else:
        valid_lens = torch.full((B,), T, dtype=torch.int64)
    targets = torch.randint(0, 2, (B,))
    autocast = args.mode.endswith("autocast")
    forward = model
    row = {"torch": torch.__version__, "mode": args.mode, "padded": args.padded,
           "threads": torch.get_num_threads()}
    if args.mode.startswith("compile"):
        forward = torch.compile(model)

    def step():
        adamw.zero_grad()
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            loss = torch.nn.functional.cross_entropy(forward(ids, valid_lens), targets)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        adamw.step()
        return loss.item()

    try:
        start = time.perf_counter()
        step()  # warm-up: allocator, thread pool, AdamW state (and compilation)
        row["first_step_s"] = time.perf_counter() - start
        step()
    except Exception as e:  # torch.compile without a working compiler, say
        row["skipped"] = f"{type(e).__name__}: {e}".splitlines()[0][:200]
        print(json.dumps(row))
        return
    steps, start = 0, time.perf_counter()
    while True:
        step()
        steps += 1
        elapsed = time.perf_counter() - start
        if elapsed >= args.min_time and steps >= 3:
            break
    row["tokens_per_second"] = steps * int(valid_lens.sum()) / elapsed
    print(json.dumps(row))


if __name__ == "__main__":
    main()
