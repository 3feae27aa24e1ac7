#!/usr/bin/env python3
"""One engine's attention timings, for bench/run_peers_attention.sh: attn or a PyPI peer.

    peers_attention.py --engine attn|torch|ort|ov --threads N CASE [CASE ...]

CASE is pass:dtype:B:H:T:D:mask, e.g. forward:bf16:32:4:128:32:pad. q, k, v are (B, H, T, D),
T = S, uniform in [-1, 1); mask "pad" gives each batch row b a key length drawn uniform in
[T/2, T] (seeded, the same for every engine; d2l's valid_lens, every head of row b alike),
"none" no mask. Engines and what they run:
  attn   attn.torch.scaled_dot_product_attention (attn's fused kernels, valid_lens (B,)) on
         Debian's PyTorch 1.13 tensors (run it with /usr/bin/python3 and attn on PYTHONPATH);
         forward and backward, fp32 and bf16
  torch  PyTorch 2.x F.scaled_dot_product_attention, attn_mask a (B, 1, 1, S) bool tensor
         (True = attend); forward and backward, fp32 and bf16 tensors
  ort    ONNX Runtime, one com.microsoft MultiHeadAttention node (num_heads H; q, k, v as
         (B, T, H*D), key_padding_mask (B, S) int32); forward only, fp32 only (its CPU kernel
         has no bf16)
  ov     OpenVINO, one opset13 ScaledDotProductAttention node on (B, H, T, D) with a
         (B, 1, 1, S) boolean mask, compiled for the CPU with INFERENCE_PRECISION_HINT f32 or
         bf16 (f32 inputs and outputs); forward only
The backward is timed alone: each repetition runs a forward (untimed), then times
out.backward(dout). FLOPs: 4*sum over rows of the kept keys*D forward (4*B*H*T*S*D unmasked;
the FlashAttention convention counting useful work, as causal halves it), backward 2.5x.
Prints one JSON object per case (a case an engine cannot run: "skipped" with the reason).
"""
import argparse
import json
import math
import os
import statistics
import sys
import time

import numpy as np


def parse_case(text):
    p, dtype, B, H, T, D, mask = text.split(":")
    return dict(pass_=p, dtype=dtype, B=int(B), H=int(H), T=int(T), D=int(D), mask=mask)


def lengths(c):
    """Key lengths per batch row: seeded by the shape, so every engine gets the same ones."""
    if c["mask"] == "none":
        return np.full(c["B"], c["T"], np.int32)
    rng = np.random.default_rng(1000 * c["T"] + c["B"])
    return rng.integers(c["T"] // 2, c["T"] + 1, size=c["B"]).astype(np.int32)


def inputs(c):
    rng = np.random.default_rng(7)
    shape = (c["B"], c["H"], c["T"], c["D"])
    return [rng.uniform(-1, 1, shape).astype(np.float32) for _ in range(4)]  # q, k, v, dout


def flops(c, lens):
    f = 4.0 * c["H"] * c["T"] * float(np.sum(lens)) * c["D"]
    return f * (2.5 if c["pass_"] == "backward" else 1.0)


def timed(run, min_time, min_reps, max_reps):
    """run() returns the seconds of one timed call; warm-up, then repetitions."""
    start = time.perf_counter()
    run()
    while time.perf_counter() - start < 0.2:
        run()
    times, start = [], time.perf_counter()
    while len(times) < min_reps or (time.perf_counter() - start < min_time and
                                    len(times) < max_reps):
        times.append(run())
    return times


def torch_like(c, lens, torch, sdpa):
    """A timed-call closure for engines with torch tensors and autograd (attn, PyTorch 2.x)."""
    dt = torch.bfloat16 if c["dtype"] == "bf16" else torch.float32
    q, k, v, dout = (torch.from_numpy(a).to(dt) for a in inputs(c))
    backward = c["pass_"] == "backward"
    for t in (q, k, v):
        t.requires_grad_(backward)

    def run():
        if not backward:
            with torch.no_grad():
                t0 = time.perf_counter()
                sdpa(q, k, v)
                return time.perf_counter() - t0
        for t in (q, k, v):
            t.grad = None
        out = sdpa(q, k, v)
        t0 = time.perf_counter()
        out.backward(dout)
        return time.perf_counter() - t0
    return run


def engine_attn(c, lens, threads):
    import torch
    import attn
    import attn.torch as at
    torch.set_num_threads(threads)
    attn.default_context.threads = threads  # exactly N: no spare thread (attn.torch._threads)
    vl = None if c["mask"] == "none" else torch.from_numpy(lens)
    return torch_like(c, lens, torch, lambda q, k, v: at.scaled_dot_product_attention(
        q, k, v, valid_lens=vl, training=False))


def engine_torch(c, lens, threads):
    import torch
    import torch.nn.functional as F
    torch.set_num_threads(threads)
    mask = None
    if c["mask"] != "none":
        keep = torch.arange(c["T"])[None, :] < torch.from_numpy(lens).long()[:, None]
        mask = keep[:, None, None, :]
    return torch_like(c, lens, torch,
                      lambda q, k, v: F.scaled_dot_product_attention(q, k, v, attn_mask=mask))


def engine_ort(c, lens, threads):
    if c["pass_"] != "forward":
        return "ONNX Runtime is an inference engine: no backward"
    if c["dtype"] != "fp32":
        return "ONNX Runtime's CPU MultiHeadAttention has no bf16 kernel"
    import onnx
    import onnxruntime as ort
    from onnx import TensorProto, helper
    B, H, T, D = c["B"], c["H"], c["T"], c["D"]
    E = H * D
    names = ["query", "key", "value"]
    node_inputs = names + ([""] if c["mask"] == "none" else ["", "key_padding_mask"])
    graph_inputs = [helper.make_tensor_value_info(n, TensorProto.FLOAT, [B, T, E]) for n in names]
    if c["mask"] != "none":
        graph_inputs.append(helper.make_tensor_value_info("key_padding_mask", TensorProto.INT32,
                                                          [B, T]))
    node = helper.make_node("MultiHeadAttention", node_inputs, ["out"], domain="com.microsoft",
                            num_heads=H)
    graph = helper.make_graph([node], "mha", graph_inputs,
                              [helper.make_tensor_value_info("out", TensorProto.FLOAT, [B, T, E])])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17),
                                                    helper.make_opsetid("com.microsoft", 1)])
    so = ort.SessionOptions()
    so.intra_op_num_threads = threads
    so.inter_op_num_threads = 1
    sess = ort.InferenceSession(model.SerializeToString(), so, providers=["CPUExecutionProvider"])
    q, k, v, _ = inputs(c)
    feed = {n: np.ascontiguousarray(a.transpose(0, 2, 1, 3).reshape(B, T, E))
            for n, a in zip(names, (q, k, v))}
    if c["mask"] != "none":
        feed["key_padding_mask"] = (np.arange(T)[None, :] < lens[:, None]).astype(np.int32)

    def run():
        t0 = time.perf_counter()
        sess.run(None, feed)
        return time.perf_counter() - t0
    return run


def engine_ov(c, lens, threads):
    if c["pass_"] != "forward":
        return "OpenVINO is an inference engine: no backward"
    import openvino as ov
    import openvino.opset13 as ops
    B, H, T, D = c["B"], c["H"], c["T"], c["D"]
    params = [ops.parameter([B, H, T, D], np.float32, name=n) for n in ("q", "k", "v")]
    args = list(params)
    if c["mask"] != "none":
        m = ops.parameter([B, 1, 1, T], np.bool_, name="mask")
        params.append(m)
        args.append(m)
    sdpa = ops.scaled_dot_product_attention(*args, causal=False)
    model = ov.Model([sdpa], params, "sdpa")
    config = {"INFERENCE_NUM_THREADS": threads, "NUM_STREAMS": 1,
              "PERFORMANCE_HINT": "LATENCY",
              "INFERENCE_PRECISION_HINT": "bf16" if c["dtype"] == "bf16" else "f32"}
    compiled = ov.Core().compile_model(model, "CPU", config)
    request = compiled.create_infer_request()
    q, k, v, _ = inputs(c)
    feed = [q, k, v]
    if c["mask"] != "none":
        feed.append((np.arange(T)[None, :] < lens[:, None])[:, None, None, :])

    def run():
        t0 = time.perf_counter()
        request.infer(feed)
        return time.perf_counter() - t0
    return run


def version(engine):
    if engine == "attn":
        import attn
        return getattr(attn, "__version__", "?")
    if engine == "torch":
        import torch
        return torch.__version__
    if engine == "ort":
        import onnxruntime
        return onnxruntime.__version__
    import openvino
    return openvino.get_version().split("-")[0]


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--engine", required=True, choices=["attn", "torch", "ort", "ov"])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--min-time", type=float, default=0.5, help="seconds of timed calls per case")
    ap.add_argument("--min-reps", type=int, default=3)
    ap.add_argument("--max-reps", type=int, default=30)
    ap.add_argument("cases", nargs="+")
    args = ap.parse_args()
    make = {"attn": engine_attn, "torch": engine_torch, "ort": engine_ort, "ov": engine_ov}
    ver = version(args.engine)
    for text in args.cases:
        c = parse_case(text)
        lens = lengths(c)
        row = dict(engine=args.engine, version=ver, threads=args.threads, case=text)
        try:
            run = make[args.engine](c, lens, args.threads)
        except Exception as e:  # a peer that cannot run a case says why in the table
            run = f"{type(e).__name__}: {e}".splitlines()[0][:160]
        if isinstance(run, str):
            row["skipped"] = run
        else:
            times = timed(run, args.min_time, args.min_reps, args.max_reps)
            f = flops(c, lens)
            row.update(flops=f, median_ms=1e3 * statistics.median(times), min_ms=1e3 * min(times),
                       gflops=f / statistics.median(times) / 1e9,
                       best_gflops=f / min(times) / 1e9, reps=len(times))
        print(json.dumps(row), flush=True)


if __name__ == "__main__":
    sys.dont_write_bytecode = True
    main()
