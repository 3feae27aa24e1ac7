"""PyTorch 2.x peers of bench/bench_cuda.cpp on the GPU machine (scripts/gpu-check.sh): SDPA's
FlashAttention-2 and cuDNN backends at the same shapes, the cuBLAS GEMMs as the run's peak. One
JSON object a line on stdout, the fields of bench_cuda's lines; read by bench/gpu_table.py.
FLOP convention (FlashAttention papers): forward 4*B*H*T*S*D, backward 2.5x forward."""
import json
import os
import statistics
import sys
import time

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

sys.dont_write_bytecode = True
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests",
                                "fixtures"))
from d2l_reference import EncoderClassifier  # noqa: E402

QUICK = "--quick" in sys.argv
torch.backends.cuda.matmul.allow_tf32 = False


def time_ms(fn, reps, inner):
    fn()
    torch.cuda.synchronize()
    ts = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(inner):
            fn()
        end.record()
        torch.cuda.synchronize()
        ts.append(start.elapsed_time(end) / inner)
    return statistics.median(ts)


def emit(impl, op, shape, dtype, ms, flops=0.0):
    row = {"impl": impl, "op": op, "shape": shape, "dtype": dtype, "ms": round(ms, 4),
           "us": round(ms * 1e3, 1)}
    if flops:
        row["tflops"] = round(flops / ms / 1e9, 1)
    print(json.dumps(row), flush=True)


def gemm(dtype, n, reps):
    a = torch.randn(n, n, device="cuda", dtype=dtype)
    b = torch.randn_like(a)
    ms = time_ms(lambda: a @ b, reps, 1)
    emit("torch", "gemm", f"{n}x{n}x{n}", "bf16" if dtype == torch.bfloat16 else "f32", ms,
         2.0 * n ** 3)


def sdpa(batch, heads, n, d, dtype, causal, reps, inner):
    shape = f"({batch},{heads},{n},{d})" + (" causal" if causal else "")
    dts = "bf16" if dtype == torch.bfloat16 else "f32"
    flops = 4.0 * batch * heads * n * n * d / (2 if causal else 1)
    q = torch.randn(batch, heads, n, d, device="cuda", dtype=dtype, requires_grad=True)
    k = torch.randn_like(q, requires_grad=True)
    v = torch.randn_like(q, requires_grad=True)
    g = torch.randn_like(q)
    backends = {"torch-flash": SDPBackend.FLASH_ATTENTION, "torch-cudnn": SDPBackend.CUDNN_ATTENTION,
                "torch-efficient": SDPBackend.EFFICIENT_ATTENTION}
    for name, backend in backends.items():
        try:
            with sdpa_kernel([backend]):
                fwd = lambda: F.scaled_dot_product_attention(q, k, v, is_causal=causal)
                ms = time_ms(fwd, reps, inner)
                emit(name, "sdpa_fwd", shape, dts, ms, flops)

                def fwd_bwd():
                    q.grad = k.grad = v.grad = None
                    fwd().backward(g)

                ms2 = time_ms(fwd_bwd, reps, inner)
                emit(name, "sdpa_bwd", shape, dts, max(ms2 - ms, 1e-6), 2.5 * flops)
        except RuntimeError as ex:  # a backend that does not take this shape or dtype
            print(json.dumps({"impl": name, "op": "sdpa_fwd", "shape": shape, "dtype": dts,
                              "error": str(ex).splitlines()[0][:80]}), flush=True)


def train(batch, length, padded, autocast, steps):
    """bench_cuda's bench_train in PyTorch eager: d2l's encoder classifier (E 128, 4 heads, 2
    blocks, FFN 256, vocabulary 1000, 2 classes, dropout 0.1), zero_grad, forward, cross-entropy,
    backward, clip_grad_norm_(1.0), AdamW(lr 1e-3) step, and loss.item() (attn reads its loss
    every step too); bf16 autocast around forward and loss when `autocast`."""
    torch.manual_seed(0)
    model = EncoderClassifier(1000, 128, 256, 4, 2, 0.1, 2).cuda().train()
    adamw = torch.optim.AdamW(model.parameters(), lr=1e-3)
    ids = torch.randint(2, 1000, (batch, length), device="cuda")
    if padded:
        lens = torch.randint(length // 2, length + 1, (batch,), device="cuda")
    else:
        lens = torch.full((batch,), length, dtype=torch.int64, device="cuda")
    targets = torch.randint(0, 2, (batch,), device="cuda")

    def step():
        adamw.zero_grad()
        with torch.autocast("cuda", dtype=torch.bfloat16, enabled=autocast):
            loss = torch.nn.functional.cross_entropy(model(ids, lens), targets)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        adamw.step()
        return loss.item()

    for _ in range(3):
        step()
    ts = []
    for _ in range(5):
        torch.cuda.synchronize()
        start = time.perf_counter()
        for _ in range(steps):
            step()
        torch.cuda.synchronize()
        ts.append((time.perf_counter() - start) * 1e3 / steps)
    ms = statistics.median(ts)
    row = {"impl": "torch-autocast" if autocast else "torch", "op": "train_step",
           "shape": f"B{batch}xT{length}" + (" padded" if padded else ""), "dtype": "f32",
           "ms": round(ms, 4), "us": round(ms * 1e3, 1),
           "tokens_per_s": round(batch * length / ms * 1e3)}
    print(json.dumps(row), flush=True)


def main():
    reps = 3 if QUICK else 7
    print(json.dumps({"impl": "torch", "version": torch.__version__,
                      "device": torch.cuda.get_device_name(0)}), flush=True)
    gemm(torch.bfloat16, 8192, reps)
    gemm(torch.float32, 4096, reps)
    sdpa(2, 16, 8192, 128, torch.bfloat16, False, 1 if QUICK else 3, 1)
    sdpa(32, 4, 128, 32, torch.bfloat16, False, reps, 50)
    sdpa(32, 4, 128, 32, torch.float32, False, reps, 50)
    sdpa(2, 16, 2048, 128, torch.bfloat16, True, reps, 1)
    for autocast in (False, True):
        train(32, 128, False, autocast, 10 if QUICK else 30)
        train(32, 128, True, autocast, 10 if QUICK else 30)
        train(256, 128, False, autocast, 5 if QUICK else 15)


if __name__ == "__main__":
    main()
