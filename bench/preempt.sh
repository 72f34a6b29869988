#!/usr/bin/env bash
# `meson test --benchmark`: teams (issue 24), the time from a lender's submit to its job running
# when a preemption is needed, checkpoint included, next to the same submit on an idle cluster,
# measured in one run on this machine. Teams a and b may each hold 4 of the agent's 8 CPUs and a
# may borrow 4 more: alice's 8-worker digits job (a checkpoint every epoch) borrows; bob submits
# a 4-worker job (the fixture's `hang`): alice's job checkpoints, exits 75 and is PREEMPTED
# before bob's starts. "Running" is the first line the job's driver prints once its workers
# answered ("ALL READY"), polled every 20 ms. Median of 5.
# Usage: preempt.sh TWINKLE_BINARY FIXTURE_PLUGIN SOURCE_ROOT EXAMPLES_BUILD_DIR
set -euo pipefail
TWK=$1 PLUGIN=$2 SRC=$3 EXAMPLES=$4
TMP=$(mktemp -d "${TMPDIR:-/tmp}/twinkle-bench-preempt.XXXXXX")
export HOME="$TMP/home"
mkdir -p "$HOME"
unset TWINKLE_ADDRESS TWINKLE_KEY TWINKLE_HEAD_KEY TWINKLE_AUTHORIZED_KEYS TWINKLE_HOME
PIDS=()
trap 'for p in "${PIDS[@]}"; do kill -KILL "$p" 2>/dev/null || true; done
      pkill -KILL -f -- "$TMP/" 2>/dev/null || true; rm -rf "$TMP"' EXIT

"$TWK" keygen --out "$TMP/keys/head" --name the-head >/dev/null  # "head" is the head's own
for who in node alice bob; do
  "$TWK" keygen --out "$TMP/keys/$who" --name "$who" >/dev/null
done
{
  cat "$TMP/keys/node/twinkle.pub"
  echo "$(cat "$TMP/keys/alice/twinkle.pub") team=a"
  echo "$(cat "$TMP/keys/bob/twinkle.pub") team=b"
} >"$TMP/allow"
printf '[team.a]\ncpus = 4\nborrow_cpus = 4\n[team.b]\ncpus = 4\n' >"$TMP/quotas.toml"
as() { echo --key "$TMP/keys/$1/twinkle.key" --head-key "$TMP/keys/head/twinkle.pub"; }

"$TWK" node start --head --no-agent --bind 127.0.0.1 --port 0 --state-dir "$TMP/state" \
  --key "$TMP/keys/head/twinkle.key" --authorized-keys "$TMP/allow" \
  --quotas "$TMP/quotas.toml" >"$TMP/head.log" 2>&1 &
PIDS+=($!)
for _ in $(seq 200); do grep -q "listening on" "$TMP/head.log" && break; sleep 0.05; done
ADDR=$(grep -o 'tcp://127.0.0.1:[0-9]*' "$TMP/head.log" | head -1)
# shellcheck disable=SC2046
"$TWK" node start --address "$ADDR" --node-id n1 --cpus 8 --cache-dir "$TMP/cache" \
  $(as node) >"$TMP/agent.log" 2>&1 &
PIDS+=($!)
for _ in $(seq 200); do grep -q "joined the cluster" "$TMP/agent.log" && break; sleep 0.05; done

mkdir -p "$TMP/big" "$TMP/small"
sed -e 's|^plugin *=.*|plugin = "libdigits.so"|' -e 's|^epochs *=.*|epochs = 100000|' \
  -e 's|^ranks  = 4 .*|ranks  = 8|' -e 's|^timeout_s = 120|timeout_s = 120\ncheckpoint_dir = "ck"|' \
  "$SRC/examples/digits/job.toml" >"$TMP/big/job.toml"
cp "$SRC/examples/digits/digits.csv.gz" "$EXAMPLES/digits/libdigits.so" "$TMP/big/"
cat >"$TMP/small/job.toml" <<TOML
[job]
name = "lender"
plugin = "$PLUGIN"
driver = "hang"
timeout_s = 60

[[group]]
name = "a"
ranks = 3
mesh = { dp = 3 }

[[group]]
name = "b"
ranks = 1

[args]
tag = "t"
TOML

now() { date +%s%N; }
median() { printf '%s\n' "$@" | sort -g | sed -n "$(( ($# + 1) / 2 ))p"; }
submit() {  # submit WHO DIR: prints the job id
  # shellcheck disable=SC2046
  "$TWK" submit --json "$TMP/$2/job.toml" --address "$ADDR" $(as "$1") 2>/dev/null |
    python3 -c 'import json,sys; print(json.load(sys.stdin)["id"])'
}
until_line() {  # until_line WHO ID TEXT: waits (60 s at most) for TEXT in job ID's log
  local deadline=$((SECONDS + 60))
  # shellcheck disable=SC2046
  until "$TWK" logs "$2" --grep "$3" --address "$ADDR" $(as "$1") 2>/dev/null | grep -q .; do
    [ $SECONDS -lt $deadline ] || { echo "job $2 never printed $3" >&2; exit 1; }
    sleep 0.02
  done
}
stop_now() {  # stop_now WHO ID: stops it at once and waits until its devices are free
  # shellcheck disable=SC2046
  "$TWK" stop "$2" --now --address "$ADDR" $(as "$1") >/dev/null 2>&1 || true
  for _ in $(seq 300); do
    # shellcheck disable=SC2046
    "$TWK" nodes --address "$ADDR" $(as "$1") | grep -q "^0 reservations" && return 0
    sleep 0.05
  done
}

idle=() preempted=()
for rep in 1 2 3 4 5; do
  t0=$(now)
  id=$(submit bob small)
  until_line bob "$id" "ALL READY"
  idle+=("$(python3 -c "print(($(now) - $t0) / 1e9)")")
  stop_now bob "$id"

  big=$(submit alice big)
  until_line alice "$big" "^epoch 2 "
  t0=$(now)
  id=$(submit bob small)
  until_line bob "$id" "ALL READY"
  preempted+=("$(python3 -c "print(($(now) - $t0) / 1e9)")")
  # shellcheck disable=SC2046
  "$TWK" job show "$big" --address "$ADDR" $(as alice) >"$TMP/show" && grep -q "preempted  1 time" "$TMP/show" ||
    { cat "$TMP/show" "$TMP/head.log" >&2; echo "alice's job was not preempted" >&2; exit 1; }
  stop_now alice "$big"  # first: it would resume once bob's job is gone
  stop_now bob "$id"
done
i=$(median "${idle[@]}") p=$(median "${preempted[@]}")
echo "a lender's submit until its 4-worker job runs, median of 5:"
echo "  on an idle cluster:                             $i s"
echo "  preempting an 8-worker job (checkpoint, exit 75): $p s ($(python3 -c "print(f'{$p / $i:.2f}')")x)"
