#!/usr/bin/env python3
"""Where one attention module's time goes in bench/torch_swap.py's loop: ms per piece.

One module call of bench/torch_swap.py (batch_first, no bias, dropout, train mode, half the batch
padded to 3T/4 through key_padding_mask), forward and backward, cut into the pieces that
attn.torch.MultiheadAttention runs, each timed alone on the same tensors:

  in_proj fwd      x (B*T, E) W^T, W (3E, E) in_proj_weight: attn's GEMM (_attn._linear_forward,
                   oneDNN on OpenMP), as the module runs it
  core fwd         attn's fused kernel through head strides (_attn._heads_forward)
  out_proj fwd     o (B*T, E) W^T, W (E, E) out_proj.weight: attn's GEMM
  out_proj bwd     its dX and dW (_attn._linear_backward: two GEMMs in one call)
  core bwd         attn's fused backward (_attn._heads_backward), reading the forward's recorded
                   dropout decisions (AVX-512 CPUs; "mask redrawn": drawing them again)
  in_proj bwd      dX and dW of the in-projection (_attn._linear_backward)
  glue             module fwd+bwd minus the pieces: Python, autograd, the mask conversion,
                   allocations, gradient accumulation

beside the two modules' fwd+bwd (nn.MultiheadAttention and attn.torch.MultiheadAttention, the
backward seeded with a fixed dense gradient), the same four projection pieces on torch's GEMM
(F.linear and two torch mm per backward, OpenBLAS: what the module ran before, and what
nn.MultiheadAttention runs), the core without dropout (what the dropout draws cost), and each
piece's GFLOP/s. Rounds alternate over all pieces so that load from other processes hits them
alike; medians of wall and process CPU time (both threads) are printed.

Each piece runs --reps times in a row, the order of pieces rotated every round: a piece that
follows an OpenBLAS row shares the cores for a while with OpenBLAS's worker, which keeps spinning
after every OpenBLAS call (OPENBLAS_THREAD_TIMEOUT, 2^28 cycles, ~77 ms, by default), and the
rotation spreads that over all pieces. d2l's loop has such neighbours all the time (its FFN GEMMs
are OpenBLAS). --baseline-module FILE adds another version of
python/attn/torch.py's module (e.g. main's: `git show main:python/attn/torch.py > f.py`).

    bash bench/run_torch_swap.sh's environment, then:
    PYTHONPATH=build/default/python python3 bench/torch_swap_breakdown.py [--length 128]
"""
import argparse
import importlib.util
import json
import statistics
import time

import torch
import torch.nn.functional as F

import attn.torch as at
from attn import _attn


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--length", type=int, default=128)
    ap.add_argument("--hiddens", type=int, default=128)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--dropout", type=float, default=0.1)
    ap.add_argument("--rounds", type=int, default=9)
    ap.add_argument("--reps", type=int, default=10, help="calls per piece and round")
    ap.add_argument("--baseline-module", metavar="FILE",
                    help="another python/attn/torch.py, timed as 'attn_base module fwd+bwd'")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    B, T, E, H, p = args.batch, args.length, args.hiddens, args.heads, args.dropout
    th = torch.get_num_threads()

    torch.manual_seed(0)
    x = torch.randn(B, T, E, requires_grad=True)
    lens = torch.full((B,), T, dtype=torch.int64)
    lens[B // 2:] = T * 3 // 4
    mask = torch.arange(T)[None, :] >= lens[:, None]
    gy = torch.randn(B, T, E)
    classes = {"torch": torch.nn.MultiheadAttention, "attn": at.MultiheadAttention}
    if args.baseline_module:
        spec = importlib.util.spec_from_file_location("attn._torch_baseline",
                                                      args.baseline_module)
        base = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(base)  # inside this build's attn package: this build's _attn
        classes["attn_base"] = base.MultiheadAttention
    mods = {name: cls(E, H, dropout=p, bias=False, batch_first=True)
            for name, cls in classes.items()}
    for m in mods.values():
        m.load_state_dict(mods["torch"].state_dict())
    ctx = mods["attn"].context
    w_in = mods["attn"].in_proj_weight.detach()
    w_out = mods["attn"].out_proj.weight.detach()
    xd = x.detach().reshape(B * T, E)
    qkv = F.linear(xd, w_in).view(B, T, 3 * E)
    q, k, v = qkv[..., :E], qkv[..., E:2 * E], qkv[..., 2 * E:]
    o, lse, seed, off, keep = _attn._heads_forward(q, k, v, H, lens, False, p, True, None, "zero",
                                                   th, ctx)
    o2 = o.reshape(B * T, E)
    g2 = gy.reshape(B * T, E)
    dqkv = torch.empty(B, T, 3 * E)
    dq, dk, dv = dqkv[..., :E], dqkv[..., E:2 * E], dqkv[..., 2 * E:]
    dqkv2 = dqkv.view(B * T, 3 * E)

    def module(name):
        def run():
            x.grad = None
            y = mods[name](x, x, x, key_padding_mask=mask, need_weights=False)[0]
            y.backward(gy)
        return run

    def core_fwd(drop):
        return lambda: _attn._heads_forward(q, k, v, H, lens, False, drop, True, None, "zero", th,
                                            ctx)

    def core_bwd(drop, recorded=True):
        return lambda: _attn._heads_backward(gy, q, k, v, o, lse, H, lens, False, drop, True, None,
                                             "zero", seed, off, dq, dk, dv, th, ctx,
                                             keep if recorded else None)

    def attn_fwd(a, w):
        y = torch.empty(a.shape[0], w.shape[0])
        return lambda: _attn._linear_forward(a, w, None, y, th)

    def attn_bwd(dy, a, w):
        dx, dw = torch.empty(a.shape), torch.empty(w.shape)
        return lambda: _attn._linear_backward(dy, a, w, dx, dw, None, th)

    pieces = {
        "torch module fwd+bwd": module("torch"),
        "attn module fwd+bwd": module("attn"),
        **({"attn_base module fwd+bwd": module("attn_base")} if "attn_base" in mods else {}),
        "in_proj fwd": attn_fwd(xd, w_in),
        "core fwd": core_fwd(p),
        "out_proj fwd": attn_fwd(o2, w_out),
        "out_proj bwd": attn_bwd(g2, o2, w_out),
        "core bwd": core_bwd(p),
        "in_proj bwd": attn_bwd(dqkv2, xd, w_in),
        "in_proj fwd, torch": lambda: F.linear(xd, w_in),
        "out_proj fwd, torch": lambda: F.linear(o2, w_out),
        "out_proj bwd, torch": lambda: (g2.mm(w_out), g2.t().mm(o2)),
        "in_proj bwd, torch": lambda: (dqkv2.mm(w_in), dqkv2.t().mm(xd)),
        "core fwd, no dropout": core_fwd(0.0),
        "core bwd, no dropout": core_bwd(0.0),
        "core bwd, mask redrawn": core_bwd(p, recorded=False),
    }
    # Multiply-adds x 2 of each piece (dense: the padded rows' skipped keys are not subtracted).
    proj = 2.0 * B * T * E * E
    core = 2.0 * B * H * T * T * (E // H)
    flops = {"in_proj fwd": 3 * proj, "out_proj fwd": proj, "out_proj bwd": 2 * proj,
             "in_proj bwd": 6 * proj, "core fwd": 2 * core, "core bwd": 5 * core,
             "in_proj fwd, torch": 3 * proj, "out_proj fwd, torch": proj,
             "out_proj bwd, torch": 2 * proj, "in_proj bwd, torch": 6 * proj,
             "core fwd, no dropout": 2 * core, "core bwd, no dropout": 5 * core,
             "core bwd, mask redrawn": 5 * core}
    for f in pieces.values():  # warm-up
        f()
        f()
    wall = {n: [] for n in pieces}
    cpu = {n: [] for n in pieces}
    order = list(pieces)
    for r in range(args.rounds):
        # Rotated every round: no piece always runs right after the OpenBLAS rows (whose worker
        # then spins beside it) or always after attn's own pieces.
        for name in order[r % len(order):] + order[:r % len(order)]:
            f = pieces[name]
            t0, c0 = time.perf_counter(), time.process_time()
            for _ in range(args.reps):
                f()
            wall[name].append(1000.0 * (time.perf_counter() - t0) / args.reps)
            cpu[name].append(1000.0 * (time.process_time() - c0) / args.reps)
    med_wall = {n: statistics.median(v) for n, v in wall.items()}
    med_cpu = {n: statistics.median(v) for n, v in cpu.items()}
    parts = ("in_proj fwd", "core fwd", "out_proj fwd", "out_proj bwd", "core bwd", "in_proj bwd")
    for med in (med_wall, med_cpu):
        med["glue"] = med["attn module fwd+bwd"] - sum(med[n] for n in parts)
    rows = []
    for name in list(pieces) + ["glue"]:
        gf = flops.get(name)
        rows.append({"piece": name, "wall_ms": round(med_wall[name], 2),
                     "cpu_ms": round(med_cpu[name], 2),
                     "gflops_wall": round(gf / med_wall[name] / 1e6, 1) if gf else None})
    print(json.dumps({"shape": dict(B=B, T=T, E=E, H=H, dropout=p), "threads": th,
                      "rounds": args.rounds, "reps": args.reps, "pieces": rows}, indent=1))
    width = max(len(r["piece"]) for r in rows)
    print(f"{'piece':<{width}}  wall ms  cpu ms  GFLOP/s (wall)")
    for r in rows:
        g = "" if r["gflops_wall"] is None else f"{r['gflops_wall']:.1f}"
        print(f"{r['piece']:<{width}}  {r['wall_ms']:7.2f}  {r['cpu_ms']:6.2f}  {g}")


if __name__ == "__main__":
    main()
