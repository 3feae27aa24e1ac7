#!/usr/bin/env python3
"""d2l's training step under PyTorch 2.x, eager and torch.compile'd: nn.MultiheadAttention
(PyTorch's fused CPU attention) vs attn.torch.MultiheadAttention (attn's custom operators).

The model and step are bench/torch_swap.py's (d2l's TransformerEncoder with a classification
head, E = 128, 4 heads, 2 blocks, FFN 256, dropout 0.1, half the batch padded, valid_lens as
key_padding_mask, need_weights=False; zero_grad, forward, cross-entropy, backward,
clip_grad_norm_(1.0), AdamW), in fp32 or under torch.autocast("cpu", torch.bfloat16)
(--precision bf16). Four sides from the same weights, each with its own optimiser: torch and attn,
eager and compiled (torch.compile of the model, Inductor, default mode). They run in one process
in --rounds rounds of --min-time seconds each, the order rotated every round; the figures are the
medians over rounds of the paired ratios torch / attn of the same round (eager with eager,
compiled with compiled), with quartiles and range. Before timing: torch._dynamo.explain's graph
break count of each model, and the eval-mode losses of the four sides from the same weights.
Prints one JSON object. Run it through bench/run_torch_swap2.sh (a venv with torch 2.x and this
checkout's wheel).
"""
import argparse
import contextlib
import copy
import json
import os
import statistics
import sys
import time

import torch
from torch import nn

sys.dont_write_bytecode = True
here = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, here)
from torch_swap import NoAttention, TorchMHA, paired  # noqa: E402,F401
sys.path.insert(0, os.path.join(here, "..", "tests", "fixtures"))
from d2l_reference import EncoderClassifier  # noqa: E402

import attn.torch  # noqa: E402


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--length", type=int, default=128)
    ap.add_argument("--precision", choices=("fp32", "bf16"), default="fp32")
    ap.add_argument("--rounds", type=int, default=8)
    ap.add_argument("--min-time", type=float, default=0.5, help="seconds per round and side")
    ap.add_argument("--sides", default="torch_eager,attn_eager,torch_compiled,attn_compiled")
    args = ap.parse_args()

    torch.set_num_threads(args.threads)
    B, T, E, H, ffn, blocks, vocab, classes, p = args.batch, args.length, 128, 4, 256, 2, 1000, 2, 0.1

    def build(cls):
        torch.manual_seed(0)
        model = EncoderClassifier(vocab, E, ffn, H, blocks, p, classes)
        for blk in model.encoder.blks:
            blk.attention = TorchMHA(cls(E, H, dropout=p, bias=False, batch_first=True))
        return model

    torch.manual_seed(1)
    ids = torch.randint(2, vocab, (B, T))
    valid_lens = torch.full((B,), T, dtype=torch.int64)
    valid_lens[B // 2:] = T * 3 // 4
    targets = torch.randint(0, classes, (B,))
    base = {"torch": build(nn.MultiheadAttention), "attn": build(attn.torch.MultiheadAttention)}
    for m in base.values():
        m(ids, valid_lens)  # materialise the lazy layers
    base["attn"].load_state_dict(base["torch"].state_dict())

    sides = args.sides.split(",")
    models, runners = {}, {}
    for side in sides:
        kind, mode = side.split("_")
        m = copy.deepcopy(base[kind])
        models[side] = m
        runners[side] = torch.compile(m) if mode == "compiled" else m
    autocast = (lambda: torch.autocast("cpu", dtype=torch.bfloat16)) \
        if args.precision == "bf16" else contextlib.nullcontext

    breaks = {}
    for kind in ("torch", "attn"):
        torch._dynamo.reset()
        with autocast():
            ex = torch._dynamo.explain(copy.deepcopy(base[kind]))(ids, valid_lens)
        breaks[kind] = dict(graph_breaks=ex.graph_break_count, graphs=ex.graph_count,
                            reasons=[str(r.reason) for r in ex.break_reasons][:3])
    torch._dynamo.reset()

    check = {}
    for side in sides:
        m = models[side]
        m.eval()
        with torch.no_grad(), autocast():
            check[side] = nn.functional.cross_entropy(runners[side](ids, valid_lens).float(),
                                                      targets).item()
        m.train()

    opts = {s: torch.optim.AdamW(models[s].parameters(), lr=1e-3) for s in sides}

    def step(side):
        opt = opts[side]
        opt.zero_grad()
        with autocast():
            loss = nn.functional.cross_entropy(runners[side](ids, valid_lens).float(), targets)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(models[side].parameters(), 1.0)
        opt.step()
        return loss.item()

    compile_s = {}
    for side in sides:  # warm-up; the first compiled step compiles forward and backward
        start = time.perf_counter()
        step(side)
        compile_s[side] = time.perf_counter() - start
        step(side)
        step(side)
    ms = {s: [] for s in sides}
    for r in range(args.rounds):
        for side in sides[r % len(sides):] + sides[:r % len(sides)]:
            steps, start = 0, time.perf_counter()
            while True:
                step(side)
                steps += 1
                elapsed = time.perf_counter() - start
                if elapsed >= args.min_time and steps >= 3:
                    break
            ms[side].append(1000.0 * elapsed / steps)
    ratios = {}
    for mode in ("eager", "compiled"):
        if f"torch_{mode}" in ms and f"attn_{mode}" in ms:
            ratios[mode] = paired(ms[f"torch_{mode}"], ms[f"attn_{mode}"])[1]
    if "attn_eager" in ms and "attn_compiled" in ms:
        ratios["attn_compiled_vs_eager"] = paired(ms["attn_eager"], ms["attn_compiled"])[1]
    if "torch_eager" in ms and "attn_compiled" in ms:
        ratios["torch_eager_vs_attn_compiled"] = paired(ms["torch_eager"], ms["attn_compiled"])[1]
    print(json.dumps({
        "shape": dict(B=B, T=T, E=E, H=H, blocks=blocks, ffn=ffn, dropout=p),
        "precision": args.precision, "threads": torch.get_num_threads(),
        "torch": torch.__version__, "rounds": args.rounds, "min_time": args.min_time,
        "graph_breaks": breaks, "eval_loss": check, "first_step_s": compile_s,
        "ms_per_step": ms, "median_ms": {s: statistics.median(v) for s, v in ms.items()},
        "speedup_paired": ratios,
    }))


if __name__ == "__main__":
    main()
