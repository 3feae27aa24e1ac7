#!/usr/bin/env bash
# Builds the libFuzzer targets (fuzz/fuzz_*.cpp) with clang + AddressSanitizer +
# UndefinedBehaviorSanitizer in build/fuzz and runs each for SECONDS (default 60) on a copy of
# its committed seed corpus. Exits non-zero when a target crashes, leaks, times out or trips a
# sanitizer; the reproducer is left in build/fuzz/artifacts/ (replay: <fuzzer> <file>).
#   scripts/fuzz.sh [SECONDS [TARGET...]]     e.g. scripts/fuzz.sh 60 data_readers cli_args
# Needs clang and, because the top-level configure finds OpenMP, libomp-dev (scripts/setup.sh).
set -euo pipefail
cd "$(dirname "$0")/.."
seconds="${1:-60}"
shift $(($# > 0 ? 1 : 0))
build=build/fuzz

cmake -S . -B "$build" -G Ninja -DCMAKE_CXX_COMPILER=clang++ -DCMAKE_BUILD_TYPE=RelWithDebInfo \
  -DATTN_BUILD_FUZZERS=ON -DATTN_BUILD_TESTS=OFF -DATTN_BUILD_CLI=OFF -DATTN_BUILD_BENCH=OFF \
  -DATTN_SANITIZE=address,undefined -DATTN_WERROR=ON >/dev/null

fuzzers=()
if (($#)); then
  for area in "$@"; do fuzzers+=("fuzz_${area#fuzz_}"); done
else
  for src in fuzz/fuzz_*.cpp; do fuzzers+=("$(basename "$src" .cpp)"); done
fi
cmake --build "$build" --target "${fuzzers[@]}"

mkdir -p "$build/artifacts"
status=0
for name in "${fuzzers[@]}"; do
  area="${name#fuzz_}"
  # New inputs go to the build tree's corpus, so the committed seeds stay small and reviewed.
  work="$build/corpus/$area"
  mkdir -p "$work"
  dict=()
  [ -f "fuzz/$area.dict" ] && dict=(-dict="fuzz/$area.dict")
  # fuzz/<area>.flags: extra libFuzzer flags of one target, whitespace-separated (e.g. the CLI's
  # -close_fd_mask=3, which keeps its output out of the log).
  extra=()
  [ -f "fuzz/$area.flags" ] && read -r -a extra <"fuzz/$area.flags"
  echo "== $name for ${seconds}s"
  # -max_len 4096: room for a header with a handful of entries plus their data; longer inputs
  # only slow mutation down. -rss_limit_mb catches allocations sized from unchecked fields.
  if ! "$build/fuzz/$name" "$work" "fuzz/corpus/$area" "${dict[@]}" "${extra[@]}" \
      -max_total_time="$seconds" -max_len=4096 -timeout=10 -rss_limit_mb=2048 \
      -artifact_prefix="$PWD/$build/artifacts/$name-" -print_final_stats=1 2>"$build/$name.log"; then
    echo "$name FAILED; see $build/$name.log and $build/artifacts/" >&2
    tail -n 40 "$build/$name.log" >&2
    status=1
  fi
  grep -E "^(Done|stat::number_of_executed_units|stat::average_exec_per_sec|stat::new_units_added|stat::peak_rss_mb)|cov: .*(DONE)" "$build/$name.log" || tail -n 5 "$build/$name.log"
done
exit "$status"
