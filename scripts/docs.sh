#!/usr/bin/env bash
# Builds the API reference (HTML) from the public headers into build/docs/api/html with Doxygen
# (docs/Doxyfile), then lists the public symbols that have no documentation comment. The list is
# information, not a failure: the script exits 0 unless Doxygen itself fails.
#   scripts/docs.sh            # then open build/docs/api/html/index.html
# Installs doxygen and python3 (the comment filter) with scripts/setup.sh docs.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh docs
out=build/docs/api
# The filter's interpreter, resolved past any shim (docs/Doxyfile reads it from the environment).
ATTN_DOCS_PYTHON=$(python3 -c 'import sys; print(sys.executable)')
export ATTN_DOCS_PYTHON
rm -rf "$out"
mkdir -p "$out"

# Pass 1: the reference, undocumented members included (EXTRACT_ALL = YES in the Doxyfile).
doxygen docs/Doxyfile
# Doxygen does not warn about undocumented symbols under EXTRACT_ALL; pass 2 (no output) does.
{ cat docs/Doxyfile; printf 'EXTRACT_ALL = NO\nGENERATE_HTML = NO\nWARN_LOGFILE = %s\n' \
  "$out/undocumented.log"; } | doxygen - >/dev/null 2>&1  # (it only says "no output formats")

undocumented=$(grep -c "is not documented" "$out/undocumented.log" || true)
other=$(grep -v "is not documented" "$out/warnings.log" | grep -c . || true)
echo "docs: $out/html/index.html"
echo "docs: $undocumented undocumented public symbols ($out/undocumented.log):"
grep "is not documented" "$out/undocumented.log" | sed -e "s|^$PWD/||" -e 's/^/  /' | sort || true
if [ "$other" -gt 0 ]; then
  echo "docs: $other other Doxygen warnings ($out/warnings.log):"
  sed -e "s|^$PWD/||" -e 's/^/  /' "$out/warnings.log" | head -n 40
fi
