#!/usr/bin/env bash
# `meson test --benchmark`: restarts, each next to a reference measured in the same run.
# - digits (4 workers): a lost worker until its group is back, with restart = "worker" (the state
#   copied from a replica) and restart = "group" (from a checkpoint), next to what `twinkle run`
#   takes to start and stop the same 4 workers (the same job with no epochs).
# - the bench plugin's Heavy (2 replicas of 256 MiB): the live copy of the lost replica's state
#   from the other (as the driver's summary times it, from the pull to the last load), next to a
#   memcpy of the same bytes into touched memory and into new memory.
# - remote (a head and node agents on loopback): a node lost mid-epoch (its agent and workers
#   SIGKILLed) until its ranks run on a spare node with the state of their replicas, next to what
#   `twinkle run` takes there to start and stop the same 4 workers.
# Usage: restart.sh TWINKLE_BINARY SOURCE_ROOT EXAMPLES_BUILD_DIR BENCH_BUILD_DIR
set -euo pipefail
TWK=$1 SRC=$2 EXAMPLES=$3 BENCH=$4
TMP=$(mktemp -d "${TMPDIR:-/tmp}/twinkle-bench-restart.XXXXXX")
PIDS=()  # the remote case's heads and agents
# Kills what the remote case started: its heads, agents and their workers.
uncluster() {
  for p in "${PIDS[@]}"; do kill -KILL "$p" 2>/dev/null || true; done
  pkill -KILL -f -- "--plugin $TMP/" 2>/dev/null || true
  PIDS=()
}
trap 'uncluster; rm -rf "$TMP"' EXIT
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
copy=() warm=() cold=() hback=()
for rep in 1 2 3; do
  "$TWK" run --quiet "$TMP/heavy.toml" >"$TMP/out" 2>"$TMP/err"
  grep -q "state copied pair:1 from pair:0" "$TMP/err" || { cat "$TMP/err"; exit 1; }
  if grep -q "CHECKSUMS DIFFER" "$TMP/out"; then echo "the copied state differs"; exit 1; fi
  copy+=("$(sed -n 's/^  group pair, rank 1: .*MiB in \([0-9.]*\) s))$/\1/p' "$TMP/err")")
  warm+=("$(sed -n 's/^FIGURE memcpy \([0-9.]*\) s$/\1/p' "$TMP/out")")
  cold+=("$(sed -n 's/^FIGURE memcpy_fresh \([0-9.]*\) s$/\1/p' "$TMP/out")")
  hback+=("$(back_in 1)")
done
c=$(median "${copy[@]}") m=$(median "${warm[@]}") f=$(median "${cold[@]}")
gibs() { python3 -c "print('%.2f GiB/s' % ($MIB / 1024 / $1))"; }
printf 'live copy of %d MiB from a replica (pull to load, median of 3): %.3f s, %s\n' "$MIB" "$c" "$(gibs "$c")"
printf 'memcpy of %d MiB into touched memory: %.3f s, %s: the copy runs at %.2fx its speed\n' \
  "$MIB" "$m" "$(gibs "$m")" "$(python3 -c "print($m / $c)")"
printf 'memcpy of %d MiB into new memory:     %.3f s, %s: the copy runs at %.2fx its speed\n' \
  "$MIB" "$f" "$(gibs "$f")" "$(python3 -c "print($f / $c)")"
printf '(the donor copies into new shared memory at its regroup, while the replacement starts)\n'
printf 'the replica of %d MiB lost -> back with its state: %.3f s median of 3\n' "$MIB" \
  "$(median "${hback[@]}")"

# ----- remote: a lost node's ranks on a spare ----------------------------------------------
export HOME="$TMP/home"
mkdir -p "$HOME"
# wait_line FILE TEXT: until FILE has TEXT (bounded: 30 s).
wait_line() {
  local deadline=$((SECONDS + 30))
  until grep -qF -- "$2" "$1" 2>/dev/null; do
    [ $SECONDS -lt $deadline ] || { cat "$1"; echo "no \"$2\" in $1"; exit 1; }
    sleep 0.02
  done
}
# A fresh cluster: a head and agents n1 and n2 (2 CPUs each: digits' 4 ranks fill them).
cluster() {
  "$TWK" node start --head --no-agent --bind 127.0.0.1 --port 0 --state-dir "$TMP/state-$1" \
    >"$TMP/head.log" 2>&1 &
  HEAD=$!
  PIDS+=("$HEAD")
  disown "$HEAD"  # killed on purpose: no "Killed" line from bash
  wait_line "$TMP/head.log" "listening on"
  ADDR=$(grep -o 'tcp://127.0.0.1:[0-9]*' "$TMP/head.log" | head -1)
  for n in n1 n2; do agent "$n"; done
}
agent() {
  "$TWK" node start --address "$ADDR" --node-id "$1" --cpus 2 --cache-dir "$TMP/cache-$1" \
    >"$TMP/agent-$1.log" 2>&1 &
  eval "AGENT_$1=$!"
  PIDS+=("$!")
  disown "$!"
  wait_line "$TMP/agent-$1.log" "joined the cluster"
}
moved=() after=() rstart=()
for rep in 1 2 3; do
  cluster "$rep"
  rm -rf "$TMP/ck"
  "$TWK" run --quiet "$TMP/job.toml" --address "$ADDR" --set job.mode=remote \
    --set args.fail_at=model:0:3:stop --set args.epochs=4 >"$TMP/out" 2>"$TMP/err" &
  RUN=$!
  wait_line "$TMP/out" "epoch 1 "
  agent n3  # the spare
  stopped=""
  deadline=$((SECONDS + 30))
  while [ -z "$stopped" ]; do
    for p in $(pgrep -f -- "worker --endpoint .* --plugin $TMP/cache-"); do
      grep -q '^State:.*T (stopped)' "/proc/$p/status" 2>/dev/null && stopped=$p
    done
    [ $SECONDS -lt $deadline ] || { cat "$TMP/err"; echo "rank 0 did not stop"; exit 1; }
    sleep 0.02
  done
  node=$(tr '\0' ' ' <"/proc/$stopped/cmdline" | grep -o "cache-n[12]" | head -1)
  node=${node#cache-}
  t0=$(date +%s%N)
  agent_pid="AGENT_$node"
  kill -KILL "${!agent_pid}"
  pkill -KILL -f -- "--plugin $TMP/cache-$node/" || true
  wait_line "$TMP/err" "twinkle: group model is back"
  moved+=("$(python3 -c "print(($(date +%s%N) - $t0) / 1e9)")")
  after+=("$(sed -n 's/^twinkle: group model is back (restart 1, \([0-9.]*\) s after the loss.*/\1/p' "$TMP/err")")
  wait "$RUN" || { cat "$TMP/err"; echo "the remote run with a lost node failed"; exit 1; }
  grep -q "start on node n3 (node $node is DEAD)" "$TMP/err" || { cat "$TMP/err"; exit 1; }
  uncluster
  cluster "$rep-ref"
  t0=$(date +%s%N)
  "$TWK" run --quiet "$TMP/job.toml" --address "$ADDR" --set job.mode=remote --set args.epochs=0 \
    --set job.checkpoint_dir=ck0 >/dev/null 2>&1
  rstart+=("$(python3 -c "print(($(date +%s%N) - $t0) / 1e9)")")
  uncluster
done
m=$(median "${moved[@]}") r=$(median "${rstart[@]}")
printf 'remote: node lost (agent and workers SIGKILLed) -> its ranks back on a spare: %.3f s median of 3\n' "$m"
printf '        of which after the head declared it DEAD (3 s of silence): %.3f s median\n' "$(median "${after[@]}")"
printf '        twinkle run of the same 4 workers there (start, one create, stop): %.3f s median of 3\n' "$r"
