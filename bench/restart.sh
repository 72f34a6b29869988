#!/usr/bin/env bash
# `meson test --benchmark`: a lost worker until its group is back (restart = "group", recover =
# "checkpoint", the digits example, 4 workers) next to what `twinkle run` takes to start and stop
# the same 4 workers (the same job with no epochs), measured in the same run.
# Usage: restart.sh TWINKLE_BINARY SOURCE_ROOT EXAMPLES_BUILD_DIR
set -euo pipefail
TWK=$1 SRC=$2 EXAMPLES=$3
TMP=$(mktemp -d "${TMPDIR:-/tmp}/twinkle-bench-restart.XXXXXX")
trap 'rm -rf "$TMP"' EXIT
sed -e "s|^plugin *=.*|plugin = \"$EXAMPLES/digits/libdigits.so\"|" \
  -e 's|^timeout_s = 120|timeout_s = 120\ncheckpoint_dir = "ck"|' \
  -e 's|^ranks  = 4 .*|ranks  = 4\nmax_restarts = 1|' "$SRC/examples/digits/job.toml" >"$TMP/job.toml"
cp "$SRC/examples/digits/digits.csv.gz" "$TMP/"
recover=() start=()
for rep in 1 2 3 4 5; do
  rm -rf "$TMP/ck"
  "$TWK" run --quiet "$TMP/job.toml" --set args.fail_at=model:2:3 --set args.epochs=4 \
    >/dev/null 2>"$TMP/err"
  recover+=("$(sed -n 's/^  group model, rank 2: .*; back in \([0-9.]*\) s$/\1/p' "$TMP/err")")
  t0=$(date +%s%N)
  "$TWK" run --quiet "$TMP/job.toml" --set args.epochs=0 --set job.checkpoint_dir=ck0 >/dev/null 2>&1
  start+=("$(python3 -c "print(($(date +%s%N) - $t0) / 1e9)")")
done
median() { printf '%s\n' "$@" | sort -g | sed -n "$(( ($# + 1) / 2 ))p"; }
r=$(median "${recover[@]}") s=$(median "${start[@]}")
printf 'restart of a 4-worker group (worker lost -> group back, from a checkpoint): %.3f s median of 5\n' "$r"
printf 'twinkle run of the same 4 workers (start, one create, stop):             %.3f s median of 5\n' "$s"
printf 'ratio: %.2fx\n' "$(python3 -c "print($r / $s)")"
