#!/usr/bin/env bash
# A/B of two versions of attn.torch.MultiheadAttention in d2l's PyTorch training loop
# (bench/torch_swap.py --baseline-module): this build's python/attn/torch.py against the one at
# git revision BASE (loaded inside this build's attn package, so on this build's _attn; BASE's
# torch.py must only call entry points this build still has), with nn.MultiheadAttention and the
# attention-free loop timed in the same rotated rounds, at T = 128 (B = 32) and T = 512 (B = 8).
# Environment as bench/run_torch_swap.sh (PyTorch's best settings). Prints, per shape, the
# medians over rounds of the paired ratios with their quartiles: torch/attn, torch/attn_base and
# attn_base/attn (> 1: this version is faster).
#
#   bench/ab_torch_swap.sh BASE [build_dir] [rounds]     (default build/default, 24)
#   e.g. bench/ab_torch_swap.sh main
set -euo pipefail
cd "$(dirname "$0")/.."
[[ $# -ge 1 ]] || { sed -n '2,12p' "$0" >&2; exit 2; }
base=$1 build=${2:-build/default} rounds=${3:-24}
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
git show "$base:python/attn/torch.py" >"$tmp/base_torch.py"
for d in /usr/lib/x86_64-linux-gnu/openblas-pthread /usr/lib/x86_64-linux-gnu/openblas-openmp; do
  if [[ -e "$d/libblas.so.3" ]]; then export LD_LIBRARY_PATH="$d${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"; break; fi
done
export OPENBLAS_CORETYPE=${TORCH_OPENBLAS_CORETYPE:-SkylakeX}
export GLIBC_TUNABLES=glibc.malloc.mmap_max=0:glibc.malloc.trim_threshold=68719476736
export OMP_WAIT_POLICY=PASSIVE
export PYTHONPATH="$build/python${PYTHONPATH:+:$PYTHONPATH}"
echo "load before: $(cut -d' ' -f1-3 /proc/loadavg); base $base ($(git rev-parse --short "$base"))"
for T in 128 512; do
  B=$((T == 128 ? 32 : 8))
  r=$rounds
  [[ $T == 512 ]] && r=$(((rounds + 1) / 2))
  /usr/bin/python3 bench/torch_swap.py --threads "${ATTN_THREADS:-2}" --rounds "$r" \
    --length "$T" --batch "$B" --baseline-module "$tmp/base_torch.py" >"$tmp/T$T.json"
  /usr/bin/python3 - "$tmp/T$T.json" <<'PY'
import json, sys
d = json.load(open(sys.argv[1]))
s, m = d["shape"], d["median_ms"]
print(f"B = {s['B']}, T = {s['T']}, {d['threads']} threads, {d['rounds']} rounds: ms/step "
      + ", ".join(f"{k} {v:.1f}" for k, v in m.items()))
for key, label in (("speedup_paired", "torch / attn"), ("base_speedup_paired", "torch / attn_base"),
                   ("attn_vs_base_paired", "attn_base / attn")):
    p = d[key]
    print(f"  {label:<18} {p['median']:.3f}  (quartiles {p['q1']:.3f}-{p['q3']:.3f}, "
          f"range {p['min']:.3f}-{p['max']:.3f})")
PY
done
echo "load after: $(cut -d' ' -f1-3 /proc/loadavg)"
