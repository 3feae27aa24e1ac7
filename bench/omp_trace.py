#!/usr/bin/env python3
"""Where the threads of a run waited, from bench/omp_trace.cpp's record of its OpenMP regions.

perf shows a waiting thread as anonymous libgomp addresses. This splits that time in two:
  * idle inside regions: a team member done with its share, at the end barrier until the slowest
    one finishes (load imbalance), by the code that started the region;
  * gaps between regions: the calling thread runs serial code while the rest of the team waits
    in libgomp for the next region, by the pair of regions around the gap. A gap is whatever the
    caller did between two regions: arithmetic left on one thread, bookkeeping, a one-time setup.
Shares are of the wall time of the window (the calling thread's); a team of two idles half of
what one member idles when counted as a share of CPU time, as perf counts it.

    omp_trace.py TRACE [--from 0.2] [--top 12]

--from skips the first part of the run (a fraction of its wall time), e.g. one-time setup.
Callers in attn are named with addr2line; oneDNN's regions show as "oneDNN".
"""
import argparse
import collections
import os
import re
import subprocess
import sys


def load(path):
    regions = []
    with open(path) as f:
        for line in f:
            p = line.split()
            if len(p) < 5:
                continue
            start, end, team = int(p[0]), int(p[1]), int(p[2])
            numbers = [int(b) for b in p[5:]]
            # Each member's busy time, then (traces since session 18) its lateness: the time from
            # the region's start to the member entering the body.
            busy, late = numbers[:team], numbers[team:2 * team] or [0] * team
            regions.append((start, end, team, p[3], p[4], busy, late))
    regions.sort()
    return regions


class Names:
    """Symbolizes caller addresses: one addr2line call per object file."""

    def __init__(self, regions):
        wanted = collections.defaultdict(set)
        for r in regions:
            wanted[r[3]].add(r[4])
        self.names = {}
        for obj, offsets in wanted.items():
            base = os.path.basename(obj)
            if "dnnl" in base:
                for o in offsets:
                    self.names[(obj, o)] = "oneDNN"
                continue
            offsets = sorted(offsets)
            chains = {}
            if os.path.exists(obj):
                # One address per call (the return address less one: the call instruction), each
                # answered by its chain of inlined functions, innermost first, then "??" lines
                # for none; a sentinel address ends each answer.
                for o in offsets:
                    chains[o] = []
                try:
                    query = "".join(f"0x{int(o, 16) - 1:x}\n0x0\n" for o in offsets)
                    out = subprocess.run(["addr2line", "-f", "-i", "-C", "-e", obj], input=query,
                                         capture_output=True, text=True, check=False).stdout
                except OSError:
                    out = ""
                answers = out.split("\n")
                k = 0
                for o in offsets:
                    funcs = []
                    while k + 1 < len(answers) and not (answers[k] == "??" and answers[k + 1].startswith("??:0")
                                                        and funcs):
                        funcs.append(answers[k])
                        k += 2
                    k += 2  # the sentinel's answer
                    chains[o] = [f for f in funcs if f != "??"]
            for o in offsets:
                # The innermost function that is attn's own (not the standard library's).
                funcs = [re.sub(r"\(.*", "", f) for f in chains.get(o, [])]
                own = [f for f in funcs if not f.startswith(("std::", "__gnu_cxx::"))]
                name = (own or funcs or [f"{base}+0x{o}"])[0]
                name = name.replace("attn::", "").replace("(anonymous namespace)::", "")
                self.names[(obj, o)] = name[:70]

    def __call__(self, region):
        return self.names[(region[3], region[4])]


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("trace")
    ap.add_argument("--from", dest="start", type=float, default=0.0,
                    help="skip this fraction of the run's wall time first (default 0)")
    ap.add_argument("--top", type=int, default=12)
    args = ap.parse_args()
    regions = load(args.trace)
    if not regions:
        print(f"omp_trace: no regions in {args.trace}", file=sys.stderr)
        return 2
    t0, t1 = regions[0][0], max(r[1] for r in regions)
    cut = t0 + (t1 - t0) * args.start
    regions = [r for r in regions if r[0] >= cut]
    if len(regions) < 2:
        print("omp_trace: fewer than two regions in the window", file=sys.stderr)
        return 2
    name = Names(regions)
    wall = regions[-1][1] - regions[0][0]
    share = lambda ns: 100.0 * ns / wall
    inside = collections.Counter()      # caller -> idle ns of the team members, summed
    region_time = collections.Counter()
    count = collections.Counter()
    idle_by_thread = collections.Counter()
    idle_by_caller_thread = collections.Counter()  # (caller, thread) -> ns
    late_by_caller_thread = collections.Counter()  # (caller, thread) -> ns before entering the body
    gaps = collections.Counter()        # (previous caller, next caller) -> ns
    gap_count = collections.Counter()
    sizes = []
    parallel = 0
    for i, r in enumerate(regions):
        start, end, team, _, _, busy, late = r
        who = name(r)
        length = end - start
        count[who] += 1
        region_time[who] += length
        if team > 1:
            parallel += length
            for t, b in enumerate(busy[:team]):
                idle = max(0, length - b)
                inside[who] += idle
                idle_by_thread[t] += idle
                idle_by_caller_thread[(who, t)] += idle
                late_by_caller_thread[(who, t)] += late[t]
        if i + 1 < len(regions):
            gap = max(0, regions[i + 1][0] - end)
            sizes.append(gap)
            key = (who, name(regions[i + 1]))
            gaps[key] += gap
            gap_count[key] += 1
    total_gap = sum(sizes)
    teams = max(r[2] for r in regions)
    print(f"{len(regions)} regions over {wall / 1e6:.1f} ms of wall time (from {100 * args.start:.0f}% "
          f"of the run), teams of up to {teams}")
    print(f"  in regions of 2+ threads: {share(parallel):5.1f}%")
    print(f"  gaps between regions:     {share(total_gap):5.1f}%  (the other threads wait in libgomp)")
    for t in sorted(idle_by_thread):
        print(f"  thread {t} idle in regions: {share(idle_by_thread[t]):5.1f}%  (at the end barrier)")
    print("gaps by length:")
    edges = [0, 5e3, 2e4, 1e5, 1e6, float("inf")]
    labels = ["< 5 us", "5-20 us", "20-100 us", "0.1-1 ms", ">= 1 ms"]
    for lo, hi, label in zip(edges, edges[1:], labels):
        g = [s for s in sizes if lo <= s < hi]
        print(f"  {label:>9}: {len(g):7d} gaps, {share(sum(g)):5.2f}%")
    print(f"largest gaps (serial code between two regions), top {args.top}:")
    for (a, b), ns in gaps.most_common(args.top):
        print(f"  {share(ns):5.2f}%  {gap_count[(a, b)]:6d} x {ns / gap_count[(a, b)] / 1e3:7.1f} us  "
              f"after {a}  before {b}")
    print(f"idle inside regions, by the caller that started them, top {args.top}"
          " (mean region length; each thread's mean idle per region, and of it the mean time"
          " before it entered the region's body: wake-up and hand-off):")
    for who, ns in inside.most_common(args.top):
        threads = [t for t in range(teams) if (who, t) in idle_by_caller_thread]
        per_thread = " / ".join(f"{idle_by_caller_thread[(who, t)] / count[who] / 1e3:.1f}" for t in threads)
        late = " / ".join(f"{late_by_caller_thread[(who, t)] / count[who] / 1e3:.1f}" for t in threads)
        print(f"  {share(ns):5.2f}%  of {share(region_time[who]):5.1f}% in {count[who]:6d} regions  "
              f"{region_time[who] / count[who] / 1e3:7.1f} us, idle {per_thread} us (late {late})  {who}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
