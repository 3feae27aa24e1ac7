#!/usr/bin/env python3
"""Labels the rows of `perf report --no-children --sort dso,sym --stdio -g none` (on stdin) and
prints the top symbols with their share of CPU time (scripts/profile.sh runs it).

Each symbol is arithmetic (attn's kernels, oneDNN's JIT GEMMs, libm) or overhead: string building
and formatting, allocation, page faults and page clearing, copies and fills (memmove, memcpy,
memset; a symbol is judged by its name without its parameters), bounds checks,
locks and OpenMP waits (a libgomp address: a thread idle at a barrier). Exits 1 when an overhead
symbol takes more than --limit percent.

    perf report ... | profile_report.py [--limit 3] [--top 25]   (--top 0: the totals only)
"""
import argparse
import re
import sys

OVERHEAD = [
    ("string", re.compile(r"basic_string|_M_append|_M_create|shape_str|fmt::|vformat|format_to|"
                          r"char_traits|to_string")),
    ("allocation", re.compile(r"malloc|_int_free|cfree|\bfree\b|operator new|operator delete|"
                              r"_int_malloc|malloc_consolidate|acquire_block|release_block|mmap|munmap")),
    ("page faults", re.compile(r"page_fault|clear_page|do_anonymous_page|get_page_from_freelist|"
                               r"alloc_pages|folio")),
    ("copy", re.compile(r"memmove|memcpy|memset|clone|copy_from|contiguous")),
    ("checks", re.compile(r"offset_of|Tensor::at|Tensor::dim|Tensor::stride|check_|throw")),
    ("locks", re.compile(r"mutex|futex|spin_lock|spin_unlock|pthread_cond|sched_yield|"
                         r"finish_task_switch|_raw_spin")),
]


def function_name(sym: str) -> str:
    """sym without its parameter list and what follows it (" [clone .arch_x86_64_v4]", say):
    a kernel taking a std::string or named by its clone must not read as string or copy work."""
    sym = sym.replace("(anonymous namespace)", "{anonymous}")
    depth = 0
    for i, c in enumerate(sym):
        if c == "<":
            depth += 1
        elif c == ">":
            depth = max(depth - 1, 0)
        elif c == "(" and depth == 0 and i > 0:
            return sym[:i]
    return sym


def label(dso: str, sym: str) -> str:
    if "libgomp" in dso:
        return "OpenMP wait"
    name = function_name(sym)
    for kind, pattern in OVERHEAD:
        if pattern.search(name):
            return kind
    return "arithmetic"


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--limit", type=float, default=3.0)
    ap.add_argument("--top", type=int, default=25)
    args = ap.parse_args()
    rows = []
    for line in sys.stdin:
        m = re.match(r"\s+([0-9.]+)%\s+(\S+(?: tid \d+)?|\[JIT\] tid \d+)\s+\[[.k]\]\s+(.*)$", line)
        if m:
            rows.append((float(m.group(1)), m.group(2), m.group(3).strip()))
    if not rows:
        print("profile_report: no samples (is perf allowed? run as root)", file=sys.stderr)
        return 2
    # oneDNN's JIT code shows as one "[JIT] tid N" DSO per thread with unnamed addresses: sum them.
    merged = {}
    for pct, dso, sym in rows:
        key = ("[JIT]", "oneDNN JIT kernels (GEMMs)") if dso.startswith("[JIT]") else \
              (dso, sym if not sym.startswith("0x") else f"{dso} (unnamed)")
        merged[key] = merged.get(key, 0.0) + pct
    ranked = sorted(merged.items(), key=lambda kv: -kv[1])
    totals = {}
    worst = []
    if args.top > 0:
        print(f"{'share':>7}  {'kind':<12} symbol")
    for (dso, sym), pct in ranked[: args.top]:
        kind = label(dso, sym)
        print(f"{pct:6.2f}%  {kind:<12} {sym[:100]}")
    for (dso, sym), pct in ranked:
        kind = label(dso, sym)
        totals[kind] = totals.get(kind, 0.0) + pct
        if kind != "arithmetic" and pct > args.limit:
            worst.append((pct, kind, sym))
    print("by kind: " + ", ".join(f"{k} {v:.1f}%" for k, v in sorted(totals.items(), key=lambda kv: -kv[1])))
    for pct, kind, sym in worst:
        print(f"OVER {args.limit}%: {kind} {sym[:100]} takes {pct:.2f}%")
    return 1 if worst else 0


if __name__ == "__main__":
    sys.exit(main())
