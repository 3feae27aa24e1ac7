"""Shared bits of the bench/run_peers_*.sh reports: the machine, the load, the FMA peak."""
import json
import subprocess


def cpu_model():
    """The model name, with the family, model and widest vector extension: VMs often report a
    bare "AMD EPYC" for Zen 3 and Zen 5 alike, whose kernels differ (AVX2 against AVX-512)."""
    fields = {}
    with open("/proc/cpuinfo") as f:
        for line in f:
            if not line.strip():
                break  # the first processor's fields only
            key, _, value = line.partition(":")
            fields[key.strip()] = value.strip()
    flags = set(fields.get("flags", "").split())
    isa = next((name for flag, name in (("amx_bf16", "AMX"), ("avx512f", "AVX-512"),
                                        ("avx2", "AVX2")) if flag in flags), "no AVX2")
    return (f"{fields.get('model name', '?')} (family {fields.get('cpu family', '?')} model "
            f"{fields.get('model', '?')}, {isa})")


def cpu_flags():
    with open("/proc/cpuinfo") as f:
        for line in f:
            if line.startswith("flags"):
                return set(line.split(":", 1)[1].split())
    return set()


def amx_line():
    """What the block says about AMX: attn has no AMX path yet (issue 24 part 1), so on a CPU
    with AMX-BF16 only the peers (oneDNN, OpenVINO) can use the tiles."""
    flags = cpu_flags()
    if "amx_bf16" in flags:
        return ("AMX-BF16: on this CPU; attn has no AMX path (it ran AVX512-BF16), PyTorch's "
                "oneDNN and OpenVINO may use the tiles")
    bf16 = "AVX512-BF16 present" if "avx512_bf16" in flags else "no AVX512-BF16"
    return f"AMX: not on this CPU (no amx_bf16 flag), so nobody ran it; {bf16}"


def load():
    with open("/proc/loadavg") as f:
        return " ".join(f.read().split()[:3])


def fma_peak(attn_bin, threads):
    """The FP32 FMA peak in GFLOP/s that `attn bench attention` measures (register-only FMA
    loop at `threads` threads), from a tiny run of it."""
    out = subprocess.run([attn_bin, "bench", "attention", "--batch-heads", "1", "--queries", "64",
                          "--head-dim", "32", "--threads", str(threads), "--repeats", "1",
                          "--warmup", "0", "--warmup-seconds", "0", "--json"],
                         check=True, capture_output=True, text=True).stdout
    return json.loads(out)["peak_gflops"]


def read_jsonl(path):
    rows = []
    with open(path) as f:
        for line in f:
            line = line.strip()
            if line.startswith("{"):
                rows.append(json.loads(line))
    return rows
