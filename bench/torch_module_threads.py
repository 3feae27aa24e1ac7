#!/usr/bin/env python3
"""attn.torch.MultiheadAttention alone (forward + backward, no other work in the process): ms per
call at each thread count, float32 and bfloat16, in alternating rounds.

The shape is bench/torch_swap.py's attention call: B = 32, T = 128, E = 128, 4 heads, dropout
0.1, train mode, self-attention. What it answers: does attn.torch's spare thread (torch's count
+ 1 when the Context sets none; python/attn/torch.py's _threads) cost anything on a machine
where nothing else competes for the cores? In d2l's loop, compare
`bench/torch_swap.py --attn-threads 2` with `--attn-threads 3` (run_torch_swap.sh's environment).

    OMP_WAIT_POLICY=PASSIVE PYTHONPATH=build/default/python python3 bench/torch_module_threads.py
"""
import argparse
import statistics
import time

import torch

import attn.torch as at


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, nargs="+", default=[2, 3])
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--reps", type=int, default=20)
    args = ap.parse_args()
    torch.set_num_threads(2)
    B, T, E, H = 32, 128, 128, 4
    for dtype in (torch.float32, torch.bfloat16):
        torch.manual_seed(0)
        m = at.MultiheadAttention(E, H, dropout=0.1, bias=False, batch_first=True, dtype=dtype)
        x = torch.randn(B, T, E, dtype=dtype, requires_grad=True)
        gy = torch.randn(B, T, E, dtype=dtype)

        def call():
            m(x, x, x, need_weights=False)[0].backward(gy)

        ms = {t: [] for t in args.threads}
        for _ in range(args.rounds):
            for t in args.threads:
                m.context.threads = t
                call()
                call()
                t0 = time.perf_counter()
                for _ in range(args.reps):
                    call()
                ms[t].append(1000.0 * (time.perf_counter() - t0) / args.reps)
        print(f"{dtype}: " + ", ".join(
            f"{t} threads {statistics.median(v):.2f} ms (least {min(v):.2f})"
            for t, v in ms.items()))


if __name__ == "__main__":
    main()
