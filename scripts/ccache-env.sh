# Sourced by the build scripts: ccache keys on paths relative to the checkout, so a second clone
# or worktree (CI builds a fresh clone in another folder) reuses the objects of the first.
# Debug info then names the directory of the first compile; nothing else changes.
# pch_defines,time_macros: what ccache needs to cache sources compiled with a precompiled header
# (ATTN_PCH, the main job's CLI).
export CCACHE_BASEDIR="$PWD" CCACHE_NOHASHDIR=true CCACHE_SLOPPINESS=pch_defines,time_macros
