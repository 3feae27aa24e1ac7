"""One table from the JSON lines of bench_cuda and bench/torch_cuda.py (scripts/gpu-check.sh):
a row per (op, shape, dtype), a column per implementation (TFLOP/s where the op has a FLOP count,
else microseconds a call), and attn's ratio to the best PyTorch backend (> 1: attn is faster)."""
import json
import sys


def main(paths):
    rows, impls, meta = {}, [], []
    for path in paths:
        with open(path) as f:
            for line in f:
                line = line.strip()
                if not line.startswith("{"):
                    continue
                r = json.loads(line)
                if "version" in r:
                    meta.append(f"torch {r['version']} on {r['device']}")
                    continue
                if "error" in r:
                    continue
                key = (r["op"], r["shape"], r["dtype"])
                if r["impl"] not in impls:
                    impls.append(r["impl"])
                rows.setdefault(key, {})[r["impl"]] = r
    for m in meta:
        print(m)
    head = f"{'op':9} {'shape':24} {'dtype':5} " + " ".join(f"{i:>15}" for i in impls) + "  attn/best-torch"
    print(head)
    print("-" * len(head))
    for (op, shape, dtype), by_impl in rows.items():
        cells, best = [], None
        for i in impls:
            r = by_impl.get(i)
            if r is None:
                cells.append(f"{'-':>15}")
                continue
            if "tflops" in r:
                cells.append(f"{r['tflops']:>9.1f} TF/s")
                val = r["tflops"]
            else:
                cells.append(f"{r['us']:>12.1f} us")
                val = 1.0 / r["us"]
            if i.startswith("torch") and (best is None or val > best):
                best = val
        ratio = ""
        a = by_impl.get("attn")
        if a is not None and best:
            val = a["tflops"] if "tflops" in a else 1.0 / a["us"]
            ratio = f"{val / best:.2f}x"
        print(f"{op:9} {shape:24} {dtype:5} " + " ".join(cells) + f"  {ratio:>8}")


if __name__ == "__main__":
    main(sys.argv[1:])
