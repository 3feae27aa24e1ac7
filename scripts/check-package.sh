#!/usr/bin/env bash
# Installs attn into a temporary prefix and builds a tiny consumer four ways: find_package with
# the shared and the static library, and pkg-config with the shared and the static library.
set -euo pipefail
cd "$(dirname "$0")/.."
build=${1:-build/default}
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
cmake --install "$build" --prefix "$tmp/prefix" >/dev/null

run() { echo "  $1: $("$2" | tail -n 1)"; }
echo "== package: consumers of an installed attn"
for kind in shared static; do
  static=OFF; [ "$kind" = static ] && static=ON
  cmake -S tests/package -B "$tmp/cmake-$kind" -G Ninja -DCMAKE_PREFIX_PATH="$tmp/prefix" \
        -DATTN_USE_STATIC_LIBS=$static >/dev/null
  cmake --build "$tmp/cmake-$kind" >/dev/null
  run "find_package, $kind" "$tmp/cmake-$kind/consumer"
done
export PKG_CONFIG_PATH="$tmp/prefix/lib/pkgconfig"
libdir="$tmp/prefix/lib"
c++ -std=c++20 tests/package/consumer.cpp $(pkg-config --cflags --libs attn) \
    -Wl,-rpath,"$libdir" -o "$tmp/pc-shared"
run "pkg-config, shared" "$tmp/pc-shared"
# Static: name the archive so the linker cannot pick the .so; private deps from --static.
c++ -std=c++20 tests/package/consumer.cpp $(pkg-config --cflags attn) "$libdir/libattn.a" \
    $(pkg-config --libs --static attn | sed 's/-lattn//') -o "$tmp/pc-static"
run "pkg-config, static" "$tmp/pc-static"
if ldd "$tmp/pc-static" | grep -q libattn; then echo "static consumer links libattn.so"; exit 1; fi
echo "package: 4 consumers built and ran"
