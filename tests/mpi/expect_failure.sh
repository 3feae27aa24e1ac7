#!/usr/bin/env bash
# expect_failure.sh SECONDS PATTERN COMMAND...: passes when COMMAND fails (non-zero exit) within
# SECONDS and its output matches the extended regular expression PATTERN; a hang (the timeout),
# a success or a silent failure fails the test. Used by the MPI fault tests.
set -uo pipefail
seconds=$1 pattern=$2
shift 2
start=$SECONDS
out=$(timeout --kill-after=5 "$seconds" "$@" 2>&1)
status=$?
printf '%s\n' "$out"
# By the clock, not the status: mpirun itself exits 137 when a rank was killed by SIGKILL.
if [ $((SECONDS - start)) -ge "$seconds" ]; then
  echo "expect_failure: still running after ${seconds} s (a hang)"; exit 1
fi
if [ "$status" -eq 0 ]; then echo "expect_failure: the command succeeded"; exit 1; fi
if ! grep -Eq -- "$pattern" <<<"$out"; then
  echo "expect_failure: exit status $status, but no line matches /$pattern/"; exit 1
fi
echo "expect_failure: exit status $status within ${seconds} s, output matches /$pattern/"
