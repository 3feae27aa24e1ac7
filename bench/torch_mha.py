#!/usr/bin/env python3
"""PyTorch baseline for bench/bench_mha.cpp: torch.nn.MultiheadAttention, fp32 or bf16, on the CPU.

--dtype bfloat16 runs nn.MultiheadAttention(...).to(torch.bfloat16) on bfloat16 X and dout
(bench_mha.cpp's BM_Mha*Bf16); the default float32 is BM_MhaInference / BM_MhaTraining's baseline.

Times inference (eval + no_grad) and a training step (forward + backward of
<out, dout> with respect to the parameters and the input) for self-attention X = queries =
keys = values of shape (B, T, E), batch_first, no dropout, with projection biases (PyTorch's
default; torch 1.13's fused inference path crashes with bias=False, so the biased module is
also PyTorch's fastest; bench_mha.cpp uses bias=true too). FLOPs are counted exactly as in
bench_mha.cpp, so GFLOP/s compare directly:
  projections  2 * rows * E * E each (W_q, W_k, W_v on B*T rows, W_o on B*T rows)
  attention    4 * B * H * T * S * D       (Q K^T and P V; softmax not counted)
  training     forward + backward = 3 * projections + 3.5 * attention
PyTorch is only at its best on this machine with
  GLIBC_TUNABLES=glibc.malloc.mmap_max=0:glibc.malloc.trim_threshold=68719476736
  OMP_WAIT_POLICY=PASSIVE
set before the interpreter starts (bench/run_mha.sh does it); without them every large
temporary is a fresh mmap and page-faults.

Prints one JSON object per (mode, T) on stdout.
"""
import argparse
import json
import os
import statistics
import time

import torch


def flops(B, T, E, H, train):
    D = E // H
    proj = 4 * 2 * B * T * E * E
    attn = 4 * B * H * T * T * D
    return (3 * proj + 3.5 * attn) if train else (proj + attn)


def loaded_blas():
    """Path of the libblas.so.3 this process mapped (reference BLAS makes the baseline moot)."""
    with open("/proc/self/maps") as maps:
        for line in maps:
            if "libblas.so" in line or "openblas" in line:
                return os.path.realpath(line.split()[-1])
    return "?"


def time_fn(fn, min_time, min_reps):
    fn()  # warm-up: allocator, thread pool, one-time dispatch
    fn()
    times, cpu = [], []
    start = time.perf_counter()
    while len(times) < min_reps or time.perf_counter() - start < min_time:
        t0, c0 = time.perf_counter(), time.process_time()
        fn()
        times.append(time.perf_counter() - t0)
        cpu.append(time.process_time() - c0)
    return times, cpu


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--hiddens", type=int, default=512)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--lengths", type=int, nargs="+", default=[512, 2048])
    ap.add_argument("--min-time", type=float, default=2.0, help="seconds per measurement")
    ap.add_argument("--min-reps", type=int, default=5)
    ap.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    args = ap.parse_args()
    dtype = getattr(torch, args.dtype)

    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    B, E, H = args.batch, args.hiddens, args.heads
    mha = torch.nn.MultiheadAttention(E, H, dropout=0.0, bias=True, batch_first=True).to(dtype)
    for T in args.lengths:
        x = torch.randn(B, T, E).to(dtype)
        for mode in ("inference", "training"):
            if mode == "inference":
                mha.eval()

                def step():
                    with torch.no_grad():
                        mha(x, x, x, need_weights=False)
            else:
                mha.train()
                xg = x.clone().requires_grad_(True)
                dout = torch.randn(B, T, E).to(dtype)

                def step():
                    out, _ = mha(xg, xg, xg, need_weights=False)
                    out.backward(dout)
                    # Parameter grads accumulate like ours; the input grad is reset each step.
                    xg.grad = None

            times, cpu = time_fn(step, args.min_time, args.min_reps)
            best, med = min(times), statistics.median(times)
            f = flops(B, T, E, H, mode == "training")
            print(json.dumps({
                "impl": "torch", "torch": torch.__version__, "dtype": args.dtype, "mode": mode,
                "B": B, "T": T,
                "E": E, "H": H, "bias": True, "threads": args.threads,
                "reps": len(times), "ms_min": best * 1e3, "ms_median": med * 1e3,
                "gflops_best": f / best * 1e-9,
                # CPU seconds of the whole process per step (all threads): robust to other
                # processes on the machine when idle threads sleep (OMP_WAIT_POLICY=PASSIVE).
                "cpu_ms_min": min(cpu) * 1e3, "cpu_ms_median": statistics.median(cpu) * 1e3, "gflops_median": f / med * 1e-9,
                "blas": loaded_blas(),
                "tunables": os.environ.get("GLIBC_TUNABLES", ""),
                "omp_wait_policy": os.environ.get("OMP_WAIT_POLICY", ""),
            }), flush=True)


if __name__ == "__main__":
    main()
