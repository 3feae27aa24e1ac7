#!/usr/bin/env bash
# The bf16 attention training step with dropout (BM_FlashBf16DropoutStep: forward + backward,
# p = 0.1, 1 thread) of OLD_REF against the working tree, in alternating rounds (bench/ab.sh),
# CPU time per round in ms. Written for issue 13 item 3 (the bf16 kernel's Philox moved onto the
# shared SIMD Philox, kernels/cpu/philox-inl.h); any change to the bf16 kernels can reuse it.
#
#   bench/ab_bf16_dropout.sh OLD_REF [ROUNDS=4] [THREADS=1]
#   FILTER='BM_FlashDropoutStep|BM_FlashBf16DropoutStep/BH:16/T:1024/D:64' bench/ab_bf16_dropout.sh ...
#     (another benchmark filter; the float32 step too, as for the ring's dropout window)
#
# Builds bench_attention twice (OLD_REF exported under build/ab-old/src with this tree's
# bench/bench_attention.cpp, so both run the same benchmark; the working tree in build/ab-new),
# Release with debug info as the default preset; ccache shortens the second build.
set -euo pipefail
[[ $# -ge 1 ]] || { sed -n '2,14p' "$0" >&2; exit 2; }
old_ref=$1 rounds=${2:-4} threads=${3:-1}
root=$(git rev-parse --show-toplevel)
cd "$root"
configure() {  # configure SRC BUILD
  cmake -S "$1" -B "$2" -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo -DATTN_BUILD_BENCH=ON \
    -DATTN_BUILD_TESTS=OFF -DATTN_BUILD_CLI=OFF -DATTN_BUILD_PYTHON=OFF -DATTN_WITH_MPI=OFF >/dev/null
  nice -n 5 cmake --build "$2" --target bench_attention >/dev/null
}
old_commit=$(git rev-parse "$old_ref^{commit}")
if [[ "$(cat build/ab-old/src/.ab_ref 2>/dev/null)" != "$old_commit" ]]; then  # else reuse it
  rm -rf build/ab-old
  mkdir -p build/ab-old/src
  git archive "$old_commit" | tar -x -C build/ab-old/src
  echo "$old_commit" >build/ab-old/src/.ab_ref
fi
cmp -s bench/bench_attention.cpp build/ab-old/src/bench/bench_attention.cpp ||
  cp bench/bench_attention.cpp build/ab-old/src/bench/bench_attention.cpp
configure build/ab-old/src build/ab-old/build
configure . build/ab-new
echo "old: $(git rev-parse --short "$old_ref"), new: working tree of $(git rev-parse --short HEAD);" \
  "load: $(cut -d' ' -f1-3 /proc/loadavg); $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2)"
bash bench/ab.sh build/ab-old/build/bench/bench_attention build/ab-new/bench/bench_attention \
  "${FILTER:-BM_FlashBf16DropoutStep}" "$rounds" "$threads"
