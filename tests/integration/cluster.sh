#!/usr/bin/env bash
# Remote mode on one machine: a head and node agents on loopback (distinct node ids, declared
# GPUs and CPUs), jobs run through them, faults, placement and keys.
# Usage: cluster.sh TWINKLE_BINARY SOURCE_ROOT FIXTURE_PLUGIN EXAMPLES_BUILD_DIR CASE
TWK=$1
SRC=$2
PLUGIN=$3
EXAMPLES=$4
CASE=$5
source "$SRC/tests/integration/lib.sh"

export HOME="$TMP/home"  # keys, plugin caches and pid files of this test only
mkdir -p "$HOME"
unset TWINKLE_ADDRESS TWINKLE_KEY TWINKLE_HEAD_KEY TWINKLE_AUTHORIZED_KEYS TWINKLE_HOME
PIDS=()
cleanup() {
  for p in "${PIDS[@]}"; do kill -KILL "$p" 2>/dev/null; done
  # Workers of this test run from its plugin caches: none may outlive it.
  pkill -KILL -f -- "$TMP/" 2>/dev/null
  rm -rf "$TMP"
}
trap cleanup EXIT

# start_head [FLAGS...]: a head with no agent of its own on an ephemeral loopback port; sets ADDR.
start_head() {
  "$TWK" node start --head --no-agent --bind 127.0.0.1 --port "${HEAD_PORT:-0}" "$@" >"$TMP/head.log" 2>&1 &
  HEAD_PID=$!
  PIDS+=($HEAD_PID)
  wait_for "$TMP/head.log" "listening on" 10
  ADDR=$(grep -o 'tcp://127.0.0.1:[0-9]*' "$TMP/head.log" | head -1)
  HEAD_PORT=${ADDR##*:}
}

# start_agent ID [FLAGS...]: a node agent with its own cache; sets AGENT_PID.
start_agent() {
  local id=$1; shift
  "$TWK" node start --address "$ADDR" --node-id "$id" --cache-dir "$TMP/cache-$id" "$@" \
    >"$TMP/agent-$id.log" 2>&1 &
  AGENT_PID=$!
  PIDS+=($AGENT_PID)
  eval "AGENT_$id=$AGENT_PID"
  wait_for "$TMP/agent-$id.log" "joined the cluster" 10
}

three_agents() {
  start_head "$@"
  start_agent n1 --cpus 4 --gpus 2 --labels zone=a
  start_agent n2 --cpus 4 --labels zone=b
  start_agent n3 --cpus 4 --labels zone=b
}

# remote_job NAME PLUGIN GROUPS...: a remote job file for the fixture plugin.
remote_job() {
  cat >"$TMP/$1.toml" <<TOML
[job]
name = "$1"
mode = "remote"
plugin = "$2"
timeout_s = 30
queue_timeout_s = ${QUEUE:-300}

$3

[args]
tag = "t"
TOML
}

two_groups='[[group]]
name = "a"
ranks = 4
mesh = { dp = 2, tp = 2 }

[[group]]
name = "b"
ranks = 2
mesh = { pp = 2 }'

reservations() { "$TWK" nodes --address "$ADDR" --json | python3 -c 'import json,sys; print(len(json.load(sys.stdin)["reservations"]))'; }

# No worker of the cluster runs any more (they run from the agents' plugin caches).
expect_no_workers() {
  local deadline=$((SECONDS + ${1:-5}))
  while pgrep -f -- "worker --endpoint .* --plugin $TMP/cache-" >/dev/null; do
    [ $SECONDS -lt $deadline ] || { pgrep -af -- "worker --endpoint .* --plugin $TMP/cache-"; fail "workers left running"; }
    sleep 0.05
  done
}

example_job() {
  sed -e 's/^mode *=.*/mode = "remote"/' -e "s|^plugin *=.*|plugin = \"$EXAMPLES/$1/lib$1.so\"|" \
    "$SRC/examples/$1/job.toml" >"$TMP/$1.toml"
  [ -f "$SRC/examples/$1/$1.csv.gz" ] && cp "$SRC/examples/$1/$1.csv.gz" "$TMP/"
  return 0
}

case "$CASE" in
  examples)
    three_agents
    run 0 "$TWK" nodes --address "$ADDR"
    for n in n1 n2 n3; do expect_out "$n"; done
    [ "$(grep -c ALIVE "$TMP/out")" -eq 3 ] || { cat "$TMP/out"; fail "three ALIVE nodes expected"; }
    expect_out "zone=a"
    # hello: the same results as in local mode.
    example_job hello
    run 0 "$TWK" run "$TMP/hello.toml" --address "$ADDR"
    grep -E '^(collect|custom|    worker)' "$TMP/out" >"$TMP/remote-hello"
    expect_out "(reserved)"
    sed -e 's/^mode = "remote"/mode = "local"/' "$TMP/hello.toml" >"$TMP/hello-local.toml"
    run 0 "$TWK" run "$TMP/hello-local.toml"
    grep -E '^(collect|custom|    worker)' "$TMP/out" >"$TMP/local-hello"
    [ -s "$TMP/local-hello" ] || fail "no results in local mode"
    diff "$TMP/local-hello" "$TMP/remote-hello" || fail "remote hello differs from local hello"
    # digits: the same final loss as in local mode.
    example_job digits
    run 0 "$TWK" run "$TMP/digits.toml" --address "$ADDR"
    remote=$(sed -n 's/^final loss: //p' "$TMP/out")
    sed -e 's/^mode = "remote"/mode = "local"/' "$TMP/digits.toml" >"$TMP/digits-local.toml"
    run 0 "$TWK" run "$TMP/digits-local.toml"
    local_loss=$(sed -n 's/^final loss: //p' "$TMP/out")
    python3 -c "import sys; a,b=float('$remote'),float('$local_loss'); sys.exit(0 if abs(a-b)<=1e-4 else 1)" ||
      fail "digits: remote final loss $remote, local $local_loss"
    # rl: groups that call each other across agents learn exactly as in local mode.
    example_job rl
    run 0 "$TWK" run "$TMP/rl.toml" --address "$ADDR"
    grep -E '^(step|mean|weights)' "$TMP/out" >"$TMP/remote-rl"
    sed -e 's/^mode = "remote"/mode = "local"/' "$TMP/rl.toml" >"$TMP/rl-local.toml"
    run 0 "$TWK" run "$TMP/rl-local.toml"
    grep -E '^(step|mean|weights)' "$TMP/out" >"$TMP/local-rl"
    [ "$(wc -l <"$TMP/local-rl")" -eq 32 ] || { cat "$TMP/local-rl"; fail "rl: not 32 result lines"; }
    diff "$TMP/local-rl" "$TMP/remote-rl" || fail "remote rl differs from local rl"
    # A communicator across groups whose members are on different agents.
    remote_job cross "$PLUGIN" "$two_groups"
    run 0 "$TWK" run --set job.driver=cross_group "$TMP/cross.toml" --address "$ADDR"
    expect_out "b:1 rank 2 of 3: 64 MiB bit-exact"
    # Remote workers' lines in a --log-dir that fills up (/dev/full fails every write): one
    # warning from the driver, and the run goes on.
    mkdir -p "$TMP/logs"
    ln -s /dev/full "$TMP/logs/a-0.log"
    run 0 "$TWK" run --set job.driver=env --log-dir "$TMP/logs" "$TMP/cross.toml" --address "$ADDR"
    warning="--log-dir $TMP/logs: cannot write a-0.log (No space left on device); the run goes on"
    [ "$(grep -cF -- "$warning" "$TMP/err")" -eq 1 ] || { cat "$TMP/err"; fail "not one warning"; }
    grep -q "env asked" "$TMP/logs/a-3.log" || fail "remote mode: no a-3.log with the worker's line"
    # The plugins reached the agents by sha256, and nothing is left behind.
    ls "$TMP"/cache-n*/*.so >/dev/null || fail "no plugin in the agents' caches"
    [ "$(reservations)" = 0 ] || fail "a reservation was not released"
    expect_no_workers
    # TWINKLE_ADDRESS works for nodes, and the JSON names every node.
    TWINKLE_ADDRESS="$ADDR" run 0 "$TWK" nodes --json
    python3 -c 'import json,sys; d=json.load(open(sys.argv[1])); assert sorted(n["id"] for n in d["nodes"])==["n1","n2","n3"]; assert all(n["state"]=="ALIVE" for n in d["nodes"])' "$TMP/out" ||
      fail "nodes --json"
    ;;

  placement)
    three_agents
    place() {  # place GROUP_TOML: the topology JSON of a one-group job
      remote_job place "$PLUGIN" "$1"
      run 0 "$TWK" topology --json "$TMP/place.toml" --address "$ADDR"
    }
    nodes_of() { python3 -c 'import json,sys; d=json.load(open(sys.argv[1])); print(" ".join(w["host"].split()[0] for g in d["groups"] for w in g["workers"]))' "$TMP/out"; }
    place '[[group]]
name = "g"
ranks = 3
placement = "strict_spread"'
    [ "$(nodes_of | tr ' ' '\n' | sort -u | wc -l)" = 3 ] || fail "strict_spread: $(nodes_of)"
    # A plan holds nothing, and says so.
    run 0 "$TWK" topology "$TMP/place.toml" --address "$ADDR"
    expect_out "3 nodes (planned)"
    place '[[group]]
name = "g"
ranks = 4
placement = "strict_pack"'
    [ "$(nodes_of | tr ' ' '\n' | sort -u | wc -l)" = 1 ] || fail "strict_pack: $(nodes_of)"
    place '[[group]]
name = "g"
ranks = 6'
    [ "$(nodes_of)" = "n1 n1 n1 n1 n2 n2" ] || fail "pack: $(nodes_of)"
    place '[[group]]
name = "g"
ranks = 3
placement = "spread"'
    [ "$(nodes_of)" = "n1 n2 n3" ] || fail "spread: $(nodes_of)"
    place '[[group]]
name = "g"
ranks = 2
labels = { zone = "b" }
placement = "strict_spread"'
    [ "$(nodes_of)" = "n2 n3" ] || fail "labels: $(nodes_of)"
    place '[[group]]
name = "g"
ranks = 2
device = "cuda"'
    python3 -c 'import json,sys; d=json.load(open(sys.argv[1])); w=d["groups"][0]["workers"]; assert [x["gpus"] for x in w]==[[0],[1]] and all(x["host"].startswith("n1") for x in w), w' "$TMP/out" ||
      fail "cuda workers must get n1's GPUs 0 and 1"
    # Infeasible: an error at once that lists what the cluster has.
    remote_job place "$PLUGIN" '[[group]]
name = "g"
ranks = 4
placement = "strict_spread"'
    run 2 "$TWK" run "$TMP/place.toml" --address "$ADDR"
    expect_err "cannot run on the cluster"
    expect_err "they need 4 distinct nodes with room, and 3 have it"
    expect_err "n1 (4 CPUs, 2 GPUs, labels zone=a)"
    # Busy: a job holding n1's GPUs makes the next one wait, naming it, up to queue_timeout_s.
    remote_job hold "$PLUGIN" '[[group]]
name = "a"
ranks = 2
device = "cuda"

[[group]]
name = "b"
ranks = 1'
    "$TWK" run --set job.driver=hang "$TMP/hold.toml" --address "$ADDR" >"$TMP/hold.out" 2>&1 &
    HOLD=$!
    PIDS+=($HOLD)
    wait_for "$TMP/hold.out" "ALL READY" 20
    QUEUE=1 remote_job wait "$PLUGIN" '[[group]]
name = "g"
ranks = 1
device = "cuda"'
    run 1 "$TWK" run "$TMP/wait.toml" --address "$ADDR"
    expect_err "waiting for devices"
    expect_err "held by job hold"
    expect_err "gave up waiting for devices after 1 s"
    # Two jobs at once share the nodes' CPUs (never a GPU).
    remote_job cpu "$PLUGIN" "$two_groups"
    run 0 "$TWK" run --set job.driver=modes "$TMP/cpu.toml" --address "$ADDR"
    [ "$(reservations)" = 1 ] || fail "the holding job's reservation should be the only one"
    kill -INT $HOLD
    wait $HOLD
    [ "$(reservations)" = 0 ] || fail "an interrupted job's reservation must be released"
    expect_no_workers
    ;;

  agent_dies)
    three_agents
    remote_job steps "$PLUGIN" '[[group]]
name = "a"
ranks = 3
placement = "strict_spread"

[[group]]
name = "b"
ranks = 1'
    "$TWK" run --set job.driver=hang "$TMP/steps.toml" --address "$ADDR" >"$TMP/run.out" 2>"$TMP/run.err" &
    DRIVER=$!
    PIDS+=($DRIVER)
    wait_for "$TMP/run.out" "ALL READY" 20
    killed_at=$(date +%s.%N)
    kill -KILL "$AGENT_n2"
    wait $DRIVER
    rc=$?
    took=$(python3 -c "import time; print(round(time.time() - $killed_at, 2))")
    [ $rc -eq 1 ] || { cat "$TMP/run.err"; fail "driver exited $rc, expected 1"; }
    grep -qF "node n2 is DEAD" "$TMP/run.err" || { cat "$TMP/run.err"; fail "no DEAD node line"; }
    grep -qF "its node n2 (" "$TMP/run.err" || { cat "$TMP/run.err"; fail "the summary must name the node"; }
    grep -qF "Probe.nap" "$TMP/run.err" || { cat "$TMP/run.err"; fail "the summary must name the call"; }
    # Detected within the 3 s silence limit plus margins for a loaded machine.
    python3 -c "import sys; sys.exit(0 if $took < 8 else 1)" || fail "the dead node took $took s to fail the run"
    echo "dead node to failed run: $took s"
    expect_no_workers
    [ "$(reservations)" = 0 ] || fail "the reservation was not released"
    # With restarts, a DEAD node's ranks start on another node, where there is room: group a's
    # strict_spread has none (every other node runs one of its workers), so the run ends
    # naming the node and what the cluster lacks.
    start_agent n2 --cpus 4 --labels zone=b
    "$TWK" run --set job.driver=hang --set group.a.max_restarts=1 --set group.b.max_restarts=1 \
      "$TMP/steps.toml" --address "$ADDR" >"$TMP/run.out" 2>"$TMP/run.err" &
    DRIVER=$!
    PIDS+=($DRIVER)
    wait_for "$TMP/run.out" "ALL READY" 20
    kill -KILL "$AGENT_n3"
    wait $DRIVER
    rc=$?
    [ $rc -eq 1 ] || { cat "$TMP/run.err"; fail "driver exited $rc, expected 1"; }
    grep -qF "twinkle: node n3 is DEAD" "$TMP/run.err" || { cat "$TMP/run.err"; fail "no DEAD node line"; }
    grep -qE "group a could not be restarted: a:[0-9] cannot start again: node n3 is DEAD and the cluster has no room for it elsewhere: " "$TMP/run.err" ||
      { cat "$TMP/run.err"; fail "no 'no room elsewhere' error for group a"; }
    grep -F "could not be restarted" "$TMP/run.err"
    expect_no_workers
    [ "$(reservations)" = 0 ] || fail "the reservation was not released"
    ;;

  driver_dies)
    three_agents
    remote_job steps "$PLUGIN" "$two_groups"
    "$TWK" run --set job.driver=hang "$TMP/steps.toml" --address "$ADDR" >"$TMP/run.out" 2>"$TMP/run.err" &
    DRIVER=$!
    PIDS+=($DRIVER)
    wait_for "$TMP/run.out" "ALL READY" 20
    pgrep -f -- "worker --endpoint .* --plugin $TMP/cache-" >/dev/null || fail "no workers before the driver died"
    killed_at=$(date +%s.%N)
    kill -KILL $DRIVER
    expect_no_workers 6
    took=$(python3 -c "import time; print(round(time.time() - $killed_at, 2))")
    echo "driver killed to no workers: $took s"
    python3 -c "import sys; sys.exit(0 if $took < 5 else 1)" || fail "workers outlived their driver by $took s"
    deadline=$((SECONDS + 8))
    until [ "$(reservations)" = 0 ]; do
      [ $SECONDS -lt $deadline ] || fail "the dead driver's reservation was not released"
      sleep 0.1
    done
    grep -qF "has not renewed its lease" "$TMP/head.log" || { cat "$TMP/head.log"; fail "the head did not log the lease"; }
    ;;

  head_restarts)
    three_agents
    remote_job steps "$PLUGIN" "$two_groups"
    "$TWK" run --set job.driver=steps "$TMP/steps.toml" --address "$ADDR" >"$TMP/run.out" 2>"$TMP/run.err" &
    DRIVER=$!
    PIDS+=($DRIVER)
    wait_for "$TMP/run.out" "STEPS STARTED" 20
    kill -KILL $HEAD_PID
    wait $HEAD_PID 2>/dev/null
    mv "$TMP/head.log" "$TMP/head1.log"
    start_head  # the same port
    wait $DRIVER
    rc=$?
    [ $rc -eq 0 ] || { cat "$TMP/run.out" "$TMP/run.err"; fail "the run did not survive the head restart (exit $rc)"; }
    grep -qF "STEPS DONE" "$TMP/run.out" || fail "the run did not finish its steps"
    wait_for "$TMP/head.log" "adopted run" 5
    wait_for "$TMP/head.log" "released run" 5
    expect_no_workers
    ;;

  security)
    mkdir -p "$TMP/keys"
    run 0 "$TWK" keygen --out "$TMP/keys/head"
    run 0 "$TWK" keygen --out "$TMP/keys/member"
    run 0 "$TWK" keygen --out "$TMP/keys/intruder"
    cat "$TMP/keys/member/twinkle.pub" >"$TMP/keys/authorized_keys"
    # Without keys, only loopback: a head on every interface is refused, with the fix.
    run 2 "$TWK" node start --head --bind 0.0.0.0 --port 0
    expect_err "without keys"
    expect_err "twinkle keygen"
    start_head --key "$TMP/keys/head/twinkle.key" --authorized-keys "$TMP/keys/authorized_keys"
    expect_in_head() { grep -qF -- "$1" "$TMP/head.log" || { cat "$TMP/head.log"; fail "head log lacks: $1"; }; }
    member=(--key "$TMP/keys/member/twinkle.key" --head-key "$TMP/keys/head/twinkle.pub")
    start_agent n1 --cpus 8 "${member[@]}"
    run 0 "$TWK" nodes --address "$ADDR" "${member[@]}"
    expect_out "n1"
    # A key not in the allow-list: refused, with a line on both sides.
    run 1 "$TWK" nodes --address "$ADDR" --key "$TMP/keys/intruder/twinkle.key" --head-key "$TMP/keys/head/twinkle.pub"
    expect_err "refused this member's key"
    wait_for "$TMP/head.log" "is not in the allow-list" 5
    # A plaintext client: refused by the head, which logs it; the client says what is missing.
    run 1 "$TWK" nodes --address "$ADDR"
    expect_err "this side has no key"
    wait_for "$TMP/head.log" "refused a connection on $ADDR: " 5
    # An agent with the wrong key cannot register.
    run 1 "$TWK" node start --address "$ADDR" --node-id evil --key "$TMP/keys/intruder/twinkle.key" --head-key "$TMP/keys/head/twinkle.pub"
    expect_err "refused this member's key"
    # A member with a key runs a job over CURVE end to end (driver, workers and store).
    remote_job sec "$PLUGIN" "$two_groups"
    run 0 "$TWK" run --set job.driver=collectives "$TMP/sec.toml" --address "$ADDR" "${member[@]}"
    # Calls between groups go worker to worker over CURVE too (the run's worker keys).
    run 0 "$TWK" run --set job.driver=peer_map "$TMP/sec.toml" --address "$ADDR" "${member[@]}"
    expect_out "a:3 -> b:1[300,301,302,303,304,305,306,307,308,309,310,311]"
    expect_out "made on b:[1]"
    run 0 "$TWK" nodes --address "$ADDR" "${member[@]}" --json
    python3 -c 'import json,sys; d=json.load(open(sys.argv[1])); assert [n["id"] for n in d["nodes"]]==["n1"]' "$TMP/out" ||
      fail "the refused agent must not be a node"
    expect_no_workers
    ;;

  daemon)
    # A head (with its own agent) in the background: the command returns once it serves, and
    # `node stop` ends it through its pid file.
    run 0 "$TWK" node start --head --bind 127.0.0.1 --port 0 --cpus 8 --daemon \
      --pid-file "$TMP/node.pid" --log-file "$TMP/node.log" --cache-dir "$TMP/cache-head"
    [ -s "$TMP/node.pid" ] || fail "--daemon wrote no pid file"
    pid=$(cat "$TMP/node.pid")
    PIDS+=($pid)
    ADDR=$(grep -o 'tcp://127.0.0.1:[0-9]*' "$TMP/node.log" | head -1)
    [ -n "$ADDR" ] || { cat "$TMP/node.log"; fail "the daemon logged no address"; }
    run 0 "$TWK" nodes --address "$ADDR"
    expect_out "ALIVE"
    remote_job d "$PLUGIN" "$two_groups"
    run 0 "$TWK" run --set job.driver=modes "$TMP/d.toml" --address "$ADDR"
    run 0 "$TWK" node stop --pid-file "$TMP/node.pid"
    expect_out "stopped the node (pid $pid)"
    [ ! -e "/proc/$pid" ] || grep -q '^[0-9]* ([^)]*) Z' "/proc/$pid/stat" || fail "the daemon still runs"
    [ ! -e "$TMP/node.pid" ] || fail "the pid file was left behind"
    run 2 "$TWK" node stop --pid-file "$TMP/node.pid"
    expect_err "no pid file of a node started with --daemon"
    expect_no_workers
    ;;

  *) fail "unknown case $CASE" ;;
esac
echo "PASS cluster $CASE"
