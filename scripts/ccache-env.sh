# Sourced by the build scripts: ccache keys on paths relative to the checkout, so a second clone
# or worktree (CI builds a fresh clone in another folder) reuses the objects of the first.
# Debug info then names the directory of the first compile; nothing else changes.
export CCACHE_BASEDIR="$PWD" CCACHE_NOHASHDIR=true
