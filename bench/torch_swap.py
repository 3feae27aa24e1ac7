#!/usr/bin/env python3
"""d2l's PyTorch training step with nn.MultiheadAttention vs attn.torch.MultiheadAttention.

Both models are bench/torch_train.py's: d2l's TransformerEncoder (tests/fixtures/
d2l_reference.py) with attn's classification head, E = 128, 4 heads, 2 blocks, FFN 256,
vocabulary 1000, 2 classes, dropout 0.1, train mode; one step is zero_grad, forward,
F.cross_entropy, backward, clip_grad_norm_(1.0), AdamW(lr 1e-3) step. In each block d2l's own
MultiHeadAttention is replaced by the module under test (batch_first=True, bias=False, d2l's
valid_lens passed as key_padding_mask, need_weights=False): torch.nn.MultiheadAttention in one
model, attn.torch.MultiheadAttention (attn's fused kernels inside the same autograd graph) in the
other. Both start from the same weights (one state dict). A third model, "none", has no
attention at all (each block's attention returns its queries): its step is what the rest of the
loop costs, so median torch / median none bounds the speedup that any attention module, however
fast, can give this loop (Amdahl).

All models run in the same process, in many short alternating rounds of --min-time seconds
each (default 12 rounds of 0.5 s per side), the order rotated every round so that no side always
follows the same one (the side before leaves OpenBLAS's spinning worker and warm caches behind).
The figure is the median over rounds of the paired ratio torch round / attn round of the same
round, with its quartiles and range: a pair sees about the same load from other processes, so
the ratio moves far less than either time, and many short pairs resolve a few percent where three
long rounds (this script's first method: 1.27-1.69 between pairs on a quiet machine) could not.
Before timing, torch and attn run the same step in eval mode (no dropout) from the same weights
and their losses and first gradients are compared.

--baseline-module FILE adds a fourth model, "attn_base": attn.torch.MultiheadAttention from
another version of python/attn/torch.py (e.g. `git show main:python/attn/torch.py > f.py`),
loaded inside this build's attn package (so on this build's _attn), timed in the same rounds: an
A/B of two versions of the module (attn_base / attn per round pair).

Run it through bench/run_torch_swap.sh for PyTorch's best settings (OpenBLAS, no mmap per
temporary, passive OpenMP waits). Prints one JSON object: ms per step of each round, the loss
check, the BLAS, the threads; also the process CPU time per step (all threads), whose ratio
moves less than wall time when other processes load the machine.
"""
import argparse
import importlib.util
import json
import os
import statistics
import sys
import time

import torch
from torch import nn

sys.dont_write_bytecode = True
here = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(here, "..", "tests", "fixtures"))
from d2l_reference import EncoderClassifier  # noqa: E402

import attn.torch  # noqa: E402  (PYTHONPATH=<build>/python)


class _Weights(nn.Module):
    attention_weights = None  # d2l's encoder reads blk.attention.attention.attention_weights


class TorchMHA(nn.Module):
    """d2l's MultiHeadAttention call (queries, keys, values, valid_lens) over an
    nn.MultiheadAttention-like module (batch_first=True): valid_lens become a padding mask."""

    def __init__(self, mha):
        super().__init__()
        self.mha = mha
        self.attention = _Weights()

    def forward(self, queries, keys, values, valid_lens):
        mask = None
        if valid_lens is not None:
            mask = torch.arange(keys.shape[1])[None, :] >= valid_lens[:, None]
        return self.mha(queries, keys, values, key_padding_mask=mask, need_weights=False)[0]


class NoAttention(nn.Module):
    """The attention-free floor: returns the queries (no parameters, no work)."""

    def __init__(self):
        super().__init__()
        self.attention = _Weights()

    def forward(self, queries, keys, values, valid_lens):
        return queries


def loaded_blas():
    found = set()
    with open("/proc/self/maps") as maps:
        for line in maps:
            name = line.split()[-1]
            if "blas" in name.lower():
                found.add(os.path.realpath(name))
    return ", ".join(sorted(found)) or "?"


def load_module_version(path):
    """attn.torch as written in `path` (another version of python/attn/torch.py), as a module
    of this build's attn package: its `from . import _attn` finds this build's extension."""
    spec = importlib.util.spec_from_file_location("attn._torch_baseline", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def paired(num, den):
    """Per-round ratios num / den and their median, quartiles and range."""
    r = [a / b for a, b in zip(num, den)]
    q = statistics.quantiles(r, n=4, method="inclusive") if len(r) > 1 else [r[0]] * 3
    return r, dict(median=statistics.median(r), q1=q[0], q3=q[2], min=min(r), max=max(r))


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
    ap.add_argument("--min-time", type=float, default=0.5, help="seconds per round and side")
    ap.add_argument("--attn-threads", type=int, default=0,
                    help="thread count of attn's modules (Context.threads); 0: attn.torch's "
                         "default (torch's count, plus one spare for the fused kernels)")
    ap.add_argument("--rounds", type=int, default=12)
    ap.add_argument("--baseline-module", metavar="FILE",
                    help="another python/attn/torch.py, timed as the side attn_base")
    args = ap.parse_args()

    torch.set_num_threads(args.threads)
    B, T, E, H = args.batch, args.length, args.hiddens, args.heads

    def build(cls):
        torch.manual_seed(0)
        model = EncoderClassifier(args.vocab, E, args.ffn, H, args.blocks, args.dropout,
                                  args.classes)
        for blk in model.encoder.blks:
            blk.attention = (NoAttention() if cls is None else
                             TorchMHA(cls(E, H, dropout=args.dropout, bias=False,
                                          batch_first=True)))
            if cls is not None and hasattr(blk.attention.mha, "context"):
                blk.attention.mha.context.threads = args.attn_threads
        return model

    classes = {"torch": nn.MultiheadAttention, "attn": attn.torch.MultiheadAttention}
    if args.baseline_module:
        classes["attn_base"] = load_module_version(args.baseline_module).MultiheadAttention
    models = {name: build(cls) for name, cls in classes.items()}
    torch.manual_seed(1)
    ids = torch.randint(2, args.vocab, (B, T))
    valid_lens = torch.full((B,), T, dtype=torch.int64)
    valid_lens[B // 2:] = T * 3 // 4  # half the batch padded: the mask path is exercised
    targets = torch.randint(0, args.classes, (B,))
    for m in models.values():
        m(ids, valid_lens)  # materialise the lazy layers (the FFN's LazyLinear)
        m.load_state_dict(models["torch"].state_dict())
    models["none"] = build(None)
    models["none"](ids, valid_lens)

    # The same weights give the same loss (eval: no dropout), forward and first gradient.
    check = {}
    for name in ("torch", "attn"):
        m = models[name]
        m.eval()
        m.zero_grad()
        loss = nn.functional.cross_entropy(m(ids, valid_lens), targets)
        loss.backward()
        check[name] = (loss.item(), torch.cat([p.grad.flatten() for p in m.parameters()]))
        m.zero_grad()
        m.train()
    grad_diff = (check["attn"][1] - check["torch"][1]).abs().max().item()
    grad_scale = check["torch"][1].abs().max().item()

    opts = {n: torch.optim.AdamW(m.parameters(), lr=1e-3) for n, m in models.items()}

    def step(name):
        m, opt = models[name], opts[name]
        opt.zero_grad()
        loss = nn.functional.cross_entropy(m(ids, valid_lens), targets)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(m.parameters(), 1.0)
        opt.step()
        return loss.item()

    for name in models:  # warm-up: allocators, thread pool, AdamW state
        step(name)
        step(name)
    ms = {n: [] for n in models}
    cpu_ms = {n: [] for n in models}  # process CPU time: less sensitive to being descheduled
    losses = {n: [] for n in models}
    sides = list(models)
    for r in range(args.rounds):
        for name in sides[r % len(sides):] + sides[:r % len(sides)]:  # rotated every round
            steps, start, cpu_start = 0, time.perf_counter(), time.process_time()
            while True:
                losses[name].append(step(name))
                steps += 1
                elapsed = time.perf_counter() - start
                if elapsed >= args.min_time and steps >= 3:
                    break
            ms[name].append(1000.0 * elapsed / steps)
            cpu_ms[name].append(1000.0 * (time.process_time() - cpu_start) / steps)
    med = {n: statistics.median(v) for n, v in ms.items()}
    # The torch and attn rounds of one round saw about the same load.
    per_round, spread = paired(ms["torch"], ms["attn"])
    extra = {}
    if "attn_base" in ms:
        extra["base_speedup_paired"] = paired(ms["torch"], ms["attn_base"])[1]
        extra["attn_vs_base_per_round"], extra["attn_vs_base_paired"] = \
            paired(ms["attn_base"], ms["attn"])
        extra["baseline_module"] = args.baseline_module
    print(json.dumps({
        "shape": dict(B=B, T=T, E=E, H=H, blocks=args.blocks, ffn=args.ffn, dropout=args.dropout),
        "threads": torch.get_num_threads(),
        "attn_threads": attn.torch._threads(models["attn"].encoder.blks[0].attention.mha.context),
        "blas": loaded_blas(), "torch": torch.__version__,
        "rounds": args.rounds, "min_time": args.min_time,
        "ms_per_step": ms, "median_ms": med, "speedup_median": med["torch"] / med["attn"],
        "speedup_best": min(ms["torch"]) / min(ms["attn"]),
        "speedup_per_round": per_round, "speedup_paired_median": spread["median"],
        "speedup_paired": spread, **extra,
        "cpu_ms_per_step": cpu_ms,
        "amdahl_bound": med["torch"] / med["none"],
        "cpu_ratio_median": statistics.median(cpu_ms["torch"]) / statistics.median(cpu_ms["attn"]),
        "eval_loss": {n: c[0] for n, c in check.items()},
        "first_grad_max_abs_diff": grad_diff, "first_grad_max_abs": grad_scale,
        "train_loss_last": {n: v[-1] for n, v in losses.items()},
    }))


if __name__ == "__main__":
    main()
