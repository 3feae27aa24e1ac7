#!/usr/bin/env python3
"""The ring attention model of docs/scale-out.md: per ring step, compute vs transfer.

  python3 scripts/ring-model.py [--gflops F] [--latency-us A] [--mem-gib M] [--bh BH] [--d D]

F: the attention kernel's speed per machine (GFLOP/s, measured by `attn bench ring --single`),
A: one-way message latency, M: memory per machine for attention tensors. fp32 (4 bytes).
Per step (c = T/N tokens per rank): forward compute 4 c^2 D BH / F (causal zigzag: half),
transfer A + 2 c D BH b / W; backward compute 10 c^2 D BH / F, transfer A + 2 c D BH (b + 4) / W.
Memory per rank (backward, fp32): 80 c D BH bytes (shard tensors 8, key/value receive buffers 4,
gradient sums 6, temporaries 2; times c D BH * 4 bytes).
"""
import argparse, math

ap = argparse.ArgumentParser()
ap.add_argument("--gflops", type=float, default=100.0)
ap.add_argument("--latency-us", type=float, default=10.0)
ap.add_argument("--mem-gib", type=float, default=16.0)
ap.add_argument("--bh", type=int, default=32)
ap.add_argument("--d", type=int, default=64)
ap.add_argument("--seq", type=int, default=262144, help="T of the fixed-size table")
a = ap.parse_args()
F, A, D, BH, b = a.gflops * 1e9, a.latency_us * 1e-6, a.d, a.bh, 4

def step(c, gbps, causal=False):
    W = gbps * 1e9 / 8
    tc_f = 4 * c * c * D * BH / F / (2 if causal else 1)
    tx_f = A + 2 * c * D * BH * b / W
    tc_b = 10 * c * c * D * BH / F / (2 if causal else 1)
    tx_b = A + 2 * c * D * BH * (b + 4) / W
    return tc_f, tx_f, tc_b, tx_b

def c_min(gbps, causal=False):
    # smallest c with compute >= transfer in forward and backward (latency included)
    W = gbps * 1e9 / 8
    k = 2 if causal else 1
    cands = []
    for flops, bytes_ in ((4 / k, b), (10 / k, b + 4)):
        qa, qb, qc = flops * D * BH / F, -2 * D * BH * bytes_ / W, -A
        cands.append((-qb + math.sqrt(qb * qb - 4 * qa * qc)) / (2 * qa))
    return math.ceil(max(cands))

c_mem = int(a.mem_gib * 2**30 / (80 * D * BH))
print(f"F = {a.gflops:g} GFLOP/s per machine, latency {a.latency_us:g} us, {a.mem_gib:g} GiB, "
      f"D = {D}, B*H = {BH}, fp32")
print(f"overlap holds for c >= {c_min(25)} (25 Gb/s), {c_min(100)} (100 Gb/s) tokens per rank; "
      f"causal {c_min(25, True)}, {c_min(100, True)}")
print(f"\nmax sequence (memory: c <= {c_mem} tokens per machine) and the step there")
print(f"| machines | max T | fwd step | fwd pass | bwd pass | efficiency 25 / 100 Gb/s |")
print("|---:|---:|---:|---:|---:|---:|")
for N in (8, 16, 32, 64):
    c = c_mem
    row = []
    for g in (25, 100):
        tcf, txf, tcb, txb = step(c, g)
        row.append((tcf + tcb) / (max(tcf, txf) + max(tcb, txb)))
    tcf, txf, tcb, txb = step(c, 25)
    print(f"| {N} | {N * c:,} | {tcf:.0f} s | {N * tcf / 3600:.1f} h | {N * tcb / 3600:.1f} h "
          f"| {row[0]:.1%} / {row[1]:.1%} |")
print(f"\nfixed T = {a.seq:,}: forward + backward pass time, efficiency = compute / step time")
print("| machines | c = T/N | compute per step f+b | transfer f+b 25 Gb/s | 100 Gb/s | pass 25 Gb/s "
      "| efficiency 25 / 100 Gb/s | smallest T hidden 25 / 100 Gb/s |")
print("|---:|---:|---:|---:|---:|---:|---:|---:|")
for N in (8, 16, 32, 64):
    c = a.seq // N
    tcf, txf25, tcb, txb25 = step(c, 25)
    _, txf100, _, txb100 = step(c, 100)
    st25 = max(tcf, txf25) + max(tcb, txb25)
    st100 = max(tcf, txf100) + max(tcb, txb100)
    print(f"| {N} | {c:,} | {tcf + tcb:.1f} s | {(txf25 + txb25) * 1e3:.1f} ms | "
          f"{(txf100 + txb100) * 1e3:.1f} ms | {N * st25:.0f} s | "
          f"{(tcf + tcb) / st25:.1%} / {(tcf + tcb) / st100:.1%} | "
          f"{N * c_min(25):,} / {N * c_min(100):,} |")
