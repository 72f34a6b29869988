#!/usr/bin/env bash
# `meson test --benchmark`: restarts, each next to a reference measured in the same run.
# - digits (4 workers): a lost worker until its group is back, with restart = "worker" (the state
#   copied from a replica) and restart = "group" (from a checkpoint), next to what `twinkle run`
#   takes to start and stop the same 4 workers (the same job with no epochs).
# - the bench plugin's Heavy (2 replicas of 256 MiB): the live copy of the lost replica's state
#   from the other (as the driver's summary times it, from the pull to the last load), next to a
#   memcpy of the same bytes into touched memory and into new memory.
# Usage: restart.sh TWINKLE_BINARY SOURCE_ROOT EXAMPLES_BUILD_DIR BENCH_BUILD_DIR
set -euo pipefail
TWK=$1 SRC=$2 EXAMPLES=$3 BENCH=$4
TMP=$(mktemp -d "${TMPDIR:-/tmp}/twinkle-bench-restart.XXXXXX")
trap 'rm -rf "$TMP"' EXIT
sed -e "s|^plugin *=.*|plugin = \"$EXAMPLES/digits/libdigits.so\"|" \
  -e 's|^timeout_s = 120|timeout_s = 120\ncheckpoint_dir = "ck"|' \
  -e 's|^ranks  = 4 .*|ranks  = 4\nmax_restarts = 1|' "$SRC/examples/digits/job.toml" >"$TMP/job.toml"
cp "$SRC/examples/digits/digits.csv.gz" "$TMP/"
# "back in 0.06 s" of the restart summary's line for rank $1.
back_in() { sed -n "s/^  group [a-z]*, rank $1: .*; back in \([0-9.]*\) s (.*$/\1/p" "$TMP/err"; }
median() { printf '%s\n' "$@" | sort -g | sed -n "$(( ($# + 1) / 2 ))p"; }

worker=() group=() start=()
for rep in 1 2 3 4 5; do
  rm -rf "$TMP/ck"
  "$TWK" run --quiet "$TMP/job.toml" --set args.fail_at=model:2:3 --set args.epochs=4 \
    >/dev/null 2>"$TMP/err"
  worker+=("$(back_in 2)")
  rm -rf "$TMP/ck"
  "$TWK" run --quiet "$TMP/job.toml" --set args.fail_at=model:2:3 --set args.epochs=4 \
    --set group.model.restart=group >/dev/null 2>"$TMP/err"
  group+=("$(back_in 2)")
  t0=$(date +%s%N)
  "$TWK" run --quiet "$TMP/job.toml" --set args.epochs=0 --set job.checkpoint_dir=ck0 >/dev/null 2>&1
  start+=("$(python3 -c "print(($(date +%s%N) - $t0) / 1e9)")")
done
w=$(median "${worker[@]}") g=$(median "${group[@]}") s=$(median "${start[@]}")
printf 'restart = "worker" of 1 of 4 workers (lost -> back, state from a replica): %.3f s median of 5\n' "$w"
printf 'restart = "group" of 4 workers (lost -> back, from a checkpoint):           %.3f s median of 5\n' "$g"
printf 'twinkle run of the same 4 workers (start, one create, stop):                %.3f s median of 5\n' "$s"
printf 'ratios to the start: worker %.2fx, group %.2fx\n' "$(python3 -c "print($w / $s)")" \
  "$(python3 -c "print($g / $s)")"

MIB=256
cat >"$TMP/heavy.toml" <<TOML
[job]
name = "heavy"
plugin = "$BENCH/libtwinkle_bench.so"
driver = "peer_recover"
timeout_s = 120

[[group]]
name = "pair"
ranks = 2
max_restarts = 1

[args]
state_mib = $MIB
TOML
copy=() warm=() cold=()
for rep in 1 2 3; do
  "$TWK" run --quiet "$TMP/heavy.toml" >"$TMP/out" 2>"$TMP/err"
  grep -q "state copied pair:1 from pair:0" "$TMP/err" || { cat "$TMP/err"; exit 1; }
  if grep -q "CHECKSUMS DIFFER" "$TMP/out"; then echo "the copied state differs"; exit 1; fi
  copy+=("$(sed -n 's/^  group pair, rank 1: .*MiB in \([0-9.]*\) s))$/\1/p' "$TMP/err")")
  warm+=("$(sed -n 's/^FIGURE memcpy \([0-9.]*\) s$/\1/p' "$TMP/out")")
  cold+=("$(sed -n 's/^FIGURE memcpy_fresh \([0-9.]*\) s$/\1/p' "$TMP/out")")
done
c=$(median "${copy[@]}") m=$(median "${warm[@]}") f=$(median "${cold[@]}")
gibs() { python3 -c "print('%.2f GiB/s' % ($MIB / 1024 / $1))"; }
printf 'live copy of %d MiB from a replica (pull to load, median of 3): %.3f s, %s\n' "$MIB" "$c" "$(gibs "$c")"
printf 'memcpy of %d MiB into touched memory: %.3f s, %s: the copy runs at %.2fx its speed\n' \
  "$MIB" "$m" "$(gibs "$m")" "$(python3 -c "print($m / $c)")"
printf 'memcpy of %d MiB into new memory:     %.3f s, %s: the copy runs at %.2fx its speed\n' \
  "$MIB" "$f" "$(gibs "$f")" "$(python3 -c "print($f / $c)")"
