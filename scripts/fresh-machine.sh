#!/usr/bin/env bash
# The fresh-machine check: runs the README's main job (scripts/tour.sh) on a bare Debian 12, so
# that a package installed by hand on this machine cannot hide a missing install step.
#
#   1. debootstrap --variant=minbase bookworm into a new folder (Debian's mirror as this
#      machine's apt is set up for it; only apt's sources and local apt settings are copied in,
#      no package and no file of the host's installed packages),
#   2. a clean clone of the committed HEAD into it (uncommitted changes are not tested),
#   3. chroot with /proc, /sys and /dev mounted, a bare environment, and the main job run there,
#   4. the check: tour/index.html and every figure it references exist and are not empty,
#   5. unmount and delete, by trap, also on failure or interrupt.
# With --test, the README's test command (scripts/test.sh) runs there after the main job.
#
#   sudo bash scripts/fresh-machine.sh [--test] [--keep] [--remove PACKAGE]
#
#   --keep            leave the root (and print its path) instead of deleting it
#   --remove PACKAGE  drop PACKAGE from scripts/setup.sh in the clone first: shows that the check
#                     fails when set-up misses a package (expect a failure)
# Needs root (debootstrap, chroot, mount) and Debian's package registry; installs debootstrap.
set -euo pipefail
cd "$(dirname "$0")/.."
repo=$PWD
run_tests=0 keep=0 remove=""
while (($#)); do
  case "$1" in
    --test) run_tests=1 ;;
    --keep) keep=1 ;;
    --remove) remove=${2:?--remove needs a package name}; shift ;;
    *) echo "fresh-machine: unknown option '$1'" >&2; exit 2 ;;
  esac
  shift
done
[ "$(id -u)" -eq 0 ] || { echo "fresh-machine: needs root (debootstrap, chroot, mount)" >&2; exit 2; }
suite=bookworm
start=$SECONDS
say() { echo "fresh-machine [$((SECONDS - start)) s]: $*"; }

bash scripts/setup.sh fresh
# The Debian mirror this machine's apt uses for the suite (so no host name is written here).
mirror=$(apt-get indextargets --format '$(RELEASE) $(REPO_URI)' 2>/dev/null |
  awk -v s="$suite" '$1 == s { print $2; exit }')
[ -n "$mirror" ] || { echo "fresh-machine: apt has no source for $suite (apt-get update?)" >&2; exit 1; }

root=$(mktemp -d "${TMPDIR:-/var/tmp}/attn-fresh.XXXXXX")
chmod 755 "$root"  # apt drops to the _apt user for downloads: it must reach /var inside
mounts=()
cleanup() {
  local status=$?
  trap - EXIT INT TERM
  for ((i = ${#mounts[@]} - 1; i >= 0; i--)); do
    umount -R "${mounts[$i]}" 2>/dev/null || umount -R -l "${mounts[$i]}" 2>/dev/null || true
  done
  if ((keep)); then
    echo "fresh-machine: kept $root (unmounted)"
  elif grep -q " $root/" /proc/mounts; then
    # Never delete through a mount that is still there.
    echo "fresh-machine: $root still has mounts; not deleting it" >&2
  else
    rm -rf --one-file-system "$root"
  fi
  exit "$status"
}
trap cleanup EXIT
trap 'exit 130' INT
trap 'exit 143' TERM

say "debootstrap --variant=minbase $suite into $root"
debootstrap --variant=minbase "$suite" "$root" "$mirror" >"$root.debootstrap.log" 2>&1 || {
  tail -n 20 "$root.debootstrap.log" >&2
  rm -f "$root.debootstrap.log"
  exit 1
}
rm -f "$root.debootstrap.log"

# apt as this machine has it set up: its sources (updates and security included), and the
# apt.conf.d settings that no package owns (local settings such as a proxy); name resolution.
rm -f "$root/etc/apt/sources.list"
cp -a /etc/apt/sources.list "$root/etc/apt/" 2>/dev/null || true
for f in /etc/apt/sources.list.d/*.list /etc/apt/sources.list.d/*.sources; do
  [ -f "$f" ] && cp -a "$f" "$root/etc/apt/sources.list.d/"
done
for f in /etc/apt/apt.conf.d/*; do
  [ -f "$f" ] && ! dpkg -S "$f" >/dev/null 2>&1 && cp -a "$f" "$root/etc/apt/apt.conf.d/"
done
cp -L /etc/resolv.conf "$root/etc/resolv.conf"

say "clone of $(git rev-parse --short HEAD) into /root/attn"
git clone --quiet --no-local "$repo" "$root/root/attn"
git -C "$root/root/attn" checkout --quiet --detach "$(git rev-parse HEAD)"
if [ -n "$remove" ]; then
  grep -qw -- "$remove" "$root/root/attn/scripts/setup.sh" ||
    { echo "fresh-machine: '$remove' is not in scripts/setup.sh" >&2; exit 2; }
  pattern=$(printf '%s' "$remove" | sed 's/[.+*^$/]/\\&/g')  # g++ and the like, literally
  sed -i -E "s/(^|[[:space:](])$pattern([[:space:])]|$)/\1\2/" "$root/root/attn/scripts/setup.sh"
  say "removed $remove from the clone's scripts/setup.sh (this run should fail)"
fi

for m in proc sys dev; do
  mount --rbind "/$m" "$root/$m"
  mount --make-rslave "$root/$m"
  mounts+=("$root/$m")
done

in_root() {
  chroot "$root" /usr/bin/env -i HOME=/root LANG=C.UTF-8 TERM=dumb \
    PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin \
    /bin/bash -c "cd /root/attn && $1"
}

# Wall time and the CPU time of every process the job ran: the CPU figure tells what the job
# costs when the wall time was stretched by other work on the machine.
TIMEFORMAT="%R s wall, %U s user + %S s system CPU"
say "main job: bash scripts/tour.sh"
{ time in_root "bash scripts/tour.sh" 2>&1; } 2>"$root/tmp/fresh-machine.time"
say "main job took $(cat "$root/tmp/fresh-machine.time") (apt, build and tour; $(nproc) cores)"
rm -f "$root/tmp/fresh-machine.time"

# The tour's page and each figure it references.
index="$root/root/attn/tour/index.html"
[ -s "$index" ] || { echo "fresh-machine: no tour/index.html" >&2; exit 1; }
figures=$(grep -oE '(src|href)="[^"#:]+\.svg"' "$index" | sed -E 's/^[a-z]+="(.*)"$/\1/' | sort -u)
[ -n "$figures" ] || { echo "fresh-machine: tour/index.html references no figure" >&2; exit 1; }
n=0
for f in $figures; do
  [ -s "$root/root/attn/tour/$f" ] || { echo "fresh-machine: tour/$f is missing or empty" >&2; exit 1; }
  n=$((n + 1))
done
say "tour/index.html and its $n figures exist"

if ((run_tests)); then
  say "test command: bash scripts/test.sh"
  { time in_root "bash scripts/test.sh" 2>&1; } 2>"$root/tmp/fresh-machine.time"
  say "test command took $(cat "$root/tmp/fresh-machine.time")"
  rm -f "$root/tmp/fresh-machine.time"
fi
say "passed"
