#!/usr/bin/env python3
"""Top symbols of a bench/sample_prof.cpp profile (where perf is missing: the GPU machine's host).

    python3 bench/sample_prof.py PROFILE [--top 25] [--late] [--search DIR ...]

PROFILE lines are `count<TAB>late count<TAB>object<TAB>address in the object`; --late counts
only the samples past the run's first fifth (without the warm-up: oneDNN's primitives created for
each new shape). Each object is looked up on this machine by its path, else by its file name in
the --search folders (default: the CUDA build's and the GPU check bundle's, where the binaries
that ran there were built), and each address turned into the symbol that holds it (nm's table).
Prints each symbol's share of the samples, as `perf report --no-children --sort symbol` would,
labelled arithmetic or overhead as scripts/profile.sh labels perf's (bench/profile_report.py; libc's
code without a symbol as copies: its memmove and memset variants have none here), and each
object's and each kind's share.
"""
import argparse
import bisect
import collections
import os
import subprocess
import sys

from profile_report import label

DEFAULT_SEARCH = ["build/cuda/bench", "build/cuda", "build/cuda/tests", "build/gpu-check/lib",
                  "build/default/bench", "build/default", "/usr/lib/x86_64-linux-gnu"]


def find_object(path, search):
    if os.path.isfile(path):
        return path
    name = os.path.basename(path)
    for d in search:
        p = os.path.join(d, name)
        if os.path.isfile(p):
            return p
    return None


class Symbols:
    def __init__(self, path):
        syms = []
        for dynamic in (False, True):
            cmd = ["nm", "-C", "-S", "--defined-only"] + (["-D"] if dynamic else []) + [path]
            res = subprocess.run(cmd, capture_output=True, text=True)
            for line in res.stdout.splitlines():
                parts = line.split(" ", 3)
                if len(parts) == 4 and parts[2].lower() in ("t", "w", "i"):
                    syms.append((int(parts[0], 16), int(parts[1], 16), parts[3]))
                elif len(parts) == 3 and parts[1].lower() in ("t", "w"):
                    syms.append((int(parts[0], 16), 0, parts[2]))
            if syms:
                break
        syms.sort()
        self.starts = [s[0] for s in syms]
        self.syms = syms

    def name(self, addr):
        i = bisect.bisect_right(self.starts, addr) - 1
        if i < 0:
            return None
        start, size, name = self.syms[i]
        # Past a symbol's size, or far past one without a size (a stripped library's exported
        # symbols only: its hidden functions lie between them), the address has no symbol.
        if addr >= start + (size or 256):
            return None
        return name


def kind(base, name):
    # libc's functions without a symbol here are mostly its IFUNC variants of memmove, memset,
    # memcmp and strlen (their exported names are the resolvers): counted as copies, the
    # conservative reading.
    if base.startswith("libc.so") and name.endswith("code without a symbol]"):
        return "copy"
    return label(base, name)


def short(name, width=110):
    return name if len(name) <= width else name[: width - 3] + "..."


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("profile")
    ap.add_argument("--top", type=int, default=25)
    ap.add_argument("--late", action="store_true", help="only the samples past the first fifth")
    ap.add_argument("--search", action="append", default=[])
    a = ap.parse_args()
    search = a.search + DEFAULT_SEARCH
    header, rows = "", []
    for line in open(a.profile):
        if line.startswith("#"):
            header = line.strip("# \n")
            continue
        count, late, obj, off = line.rstrip("\n").split("\t")  # off: address in obj
        rows.append((int(late if a.late else count), obj, int(off, 16)))
    total = sum(r[0] for r in rows)
    if total == 0:
        print(f"{a.profile}: no samples ({header})")
        return 1
    tables, by_sym, by_obj = {}, collections.Counter(), collections.Counter()
    unnamed = collections.Counter()
    for count, obj, off in rows:
        base = os.path.basename(obj)
        by_obj[base] += count
        if obj == "[no object]":  # executable memory without a file: generated code
            by_sym[("[JIT code: e.g. oneDNN's generated kernels]", base)] += count
            continue
        if obj not in tables:
            local = find_object(obj, search)
            tables[obj] = Symbols(local) if local else None
        name = tables[obj].name(off) if tables[obj] else None
        if name is None:
            unnamed[f"{base}+{off:#x}"] += count
            name = f"[{base}: code without a symbol]"
        by_sym[(name, base)] += count
    print(f"{a.profile}: {header}{' (past the first fifth)' if a.late else ''}")
    print("by object: " + ", ".join(f"{o} {100 * c / total:.1f}%" for o, c in by_obj.most_common(8)))
    by_kind = collections.Counter()
    for (name, base), count in by_sym.items():
        by_kind[kind(base, name)] += count
    print("by kind: " + ", ".join(f"{k} {100 * c / total:.1f}%" for k, c in by_kind.most_common()))
    print(f"{'share':>7} {'samples':>8}  {'kind':<12} symbol [object]")
    for (name, base), count in by_sym.most_common(a.top):
        print(f"{100 * count / total:6.2f}% {count:8d}  {kind(base, name):<12} {short(name)} "
              f"[{base}]")
    if unnamed:
        print("hottest addresses without a symbol (objdump -d --start-address=...): " +
              ", ".join(f"{a} {100 * c / total:.1f}%" for a, c in unnamed.most_common(5)))
    missing = sorted(o for o, t in tables.items() if t is None)
    if missing:
        print("not found here (offsets shown): " + ", ".join(missing), file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
