#!/usr/bin/env python3
"""PyTorch baseline for bench/bench_attention.cpp: unfused attention on the CPU, fp32.

    out = bmm(softmax(bmm(q, k^T) * scale [masked_fill(-inf) above the diagonal if causal]), v)

on q, k, v of shape (B*H, T, D), T = S, the shapes of bench_attention.cpp, with the same thread
count (--threads, default 2). This is what d2l's DotProductAttention and PyTorch 1.13's
nn.MultiheadAttention run; Debian's PyTorch 1.13 has no fused CPU attention. The backward is
autograd's (through bmm, softmax, bmm) for dout of the output's shape, timed alone as
(forward + backward) - forward.

FLOPs are counted as in bench_attention.cpp (FlashAttention convention): forward 4*BH*T*S*D,
backward 2.5x, causal halves both (PyTorch computes the full square either way).

PyTorch is only at its best on this machine with
  GLIBC_TUNABLES=glibc.malloc.mmap_max=0:glibc.malloc.trim_threshold=68719476736
  OMP_WAIT_POLICY=PASSIVE
set before the interpreter starts (bench/run_cpu.sh does it); otherwise every T x S temporary is
a fresh mmap and page-faults. Prints one JSON object per (pass, shape) on stdout.
"""
import argparse
import json
import math
import statistics
import time

import torch


def loaded_blas():
    """Path of the BLAS this process mapped: Debian's torch runs bmm through libblas.so.3, which
    is the netlib reference BLAS (~1 GFLOP/s) unless OpenBLAS is installed or on LD_LIBRARY_PATH."""
    with open("/proc/self/maps") as maps:
        for line in maps:
            if "libblas.so" in line or "openblas" in line:
                return line.split()[-1]
    return "?"


def attention(q, k, v, causal):
    scores = torch.bmm(q, k.transpose(1, 2)) * (1.0 / math.sqrt(q.shape[-1]))
    if causal:
        T, S = scores.shape[-2:]
        mask = torch.ones(T, S, dtype=torch.bool).triu_(1)
        scores = scores.masked_fill(mask, float("-inf"))
    return torch.bmm(torch.softmax(scores, dim=-1), v)


def best_time(fn, reps):
    fn()  # warm-up: allocator, thread pool
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times), statistics.median(times)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--bh", type=int, default=16)
    ap.add_argument("--seq", type=int, nargs="+", default=[1024, 4096])
    ap.add_argument("--dims", type=int, nargs="+", default=[64, 128])
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    for T in args.seq:
        for D in args.dims:
            for causal in (False, True):
                q, k, v = (torch.rand(args.bh, T, D) * 2 - 1 for _ in range(3))
                fwd_flops = 4.0 * args.bh * T * T * D * (0.5 if causal else 1.0)

                def fwd():
                    with torch.no_grad():
                        attention(q, k, v, causal)

                qg, kg, vg = (x.clone().requires_grad_() for x in (q, k, v))
                dout = torch.rand(args.bh, T, D) * 2 - 1

                def fwd_train():
                    return attention(qg, kg, vg, causal)

                def fwd_bwd():
                    out = fwd_train()
                    out.backward(dout)

                f_min, f_med = best_time(fwd, args.reps)
                t_min, _ = best_time(fwd_train, args.reps)
                fb_min, fb_med = best_time(fwd_bwd, args.reps)
                b_min = max(fb_min - t_min, 1e-9)
                for name, sec, med, flops in (("forward", f_min, f_med, fwd_flops),
                                              ("backward", b_min, None, 2.5 * fwd_flops)):
                    print(json.dumps({"impl": "torch", "pass": name, "BH": args.bh, "T": T,
                                      "D": D, "causal": int(causal), "threads": args.threads,
                                      "ms": sec * 1e3,
                                      "median_ms": med * 1e3 if med else None,
                                      "gflops": flops / sec * 1e-9,
                                      "torch": torch.__version__,
                                      "blas": loaded_blas()}), flush=True)


if __name__ == "__main__":
    main()
