#!/usr/bin/env bash
# Remote mode across "hosts" on one machine: every host is a network namespace with its own UTS
# namespace (its own hostname), the hosts are joined through a bridge in a fourth "switch"
# namespace, and their addresses come from a /24 that exists only inside the namespaces. The head
# and the driver run in host 1, node agents in hosts 2 and 3, every member with its own key pair.
# Needs root and ip, nsenter and unshare (exit 77 otherwise). Nothing is ever sent from the root
# namespace to the hosts' addresses: every command that talks to the cluster runs inside host 1.
# Usage: cluster_netns.sh TWINKLE_BINARY SOURCE_ROOT FIXTURE_PLUGIN EXAMPLES_BUILD_DIR CASE
TWK=$(readlink -f -- "$1")  # meson passes ./twinkle, relative to the build dir
SRC=$2
PLUGIN=$3
EXAMPLES=$4
CASE=$5

if [ "$(id -u)" -ne 0 ]; then echo "SKIP: network namespaces need root"; exit 77; fi
for tool in ip nsenter unshare; do
  command -v "$tool" >/dev/null || { echo "SKIP: no $tool"; exit 77; }
done
# Root in a container may still lack the right to make namespaces.
unshare --net --uts true 2>/dev/null || { echo "SKIP: cannot create network namespaces"; exit 77; }

source "$SRC/tests/integration/lib.sh"
source "$SRC/tests/integration/netns.sh"

export HOME="$TMP/home"  # what runs in the root namespace (keygen, the local run) keeps out of ~
mkdir -p "$HOME"
unset TWINKLE_ADDRESS TWINKLE_KEY TWINKLE_HEAD_KEY TWINKLE_AUTHORIZED_KEYS TWINKLE_HOME
NET=10.77.0            # the hosts' /24: host N is $NET.N
PORT=7100              # each host has its own network stack, so the default port is free
ADDR="tcp://$NET.1:$PORT"
NS="twk$$"             # namespace names of this run: $NS-sw, $NS-h1, $NS-h2, $NS-h3
HOSTS=(h1 h2 h3)
NAMESPACES=()          # every namespace this run made (for the cleanup)
UTS=()                 # every UTS namespace bind mount this run made
PIDS=()
declare -A AGENT     # node id -> its agent's pid

# Kills everything this test started, on every host, then removes the namespaces, the UTS bind
# mounts and the temporary directory. Runs on every exit, failures and signals included.
cleanup() {
  trap - EXIT
  local p ns n left
  # Heads, agents and drivers first stop cleanly (agents stop their workers), then by force.
  for p in "${PIDS[@]}"; do kill -TERM "$p" 2>/dev/null; done
  for n in $(seq 30); do  # bounded: 3 s
    left=""
    for p in "${PIDS[@]}"; do running "$p" && left+=" $p"; done
    [ -z "$left" ] && break
    sleep 0.1
  done
  for p in "${PIDS[@]}"; do kill -KILL "$p" 2>/dev/null; wait "$p" 2>/dev/null; done
  pkill -KILL -f -- "$TMP/" 2>/dev/null  # workers run from the agents' caches under $TMP
  for ns in "${NAMESPACES[@]}" "${NETNS_MADE[@]}"; do
    for p in $(ip netns pids "$ns" 2>/dev/null); do kill -KILL "$p" 2>/dev/null; done
  done
  for n in $(seq 50); do  # until every process of a host is gone (bounded: 5 s)
    left=""
    for ns in "${NAMESPACES[@]}" "${NETNS_MADE[@]}"; do left+=$(ip netns pids "$ns" 2>/dev/null); done
    [ -z "$left" ] && break
    sleep 0.1
  done
  for ns in "${NAMESPACES[@]}" "${NETNS_MADE[@]}"; do ip netns delete "$ns" 2>/dev/null; done
  for p in "${UTS[@]}" "${NETNS_UTS[@]}"; do umount "$p" 2>/dev/null; done
  rm -rf "$TMP"
}
trap cleanup EXIT
trap 'exit 143' TERM
trap 'exit 130' INT HUP

# running PID: the process exists and is not a zombie (kill -0 succeeds on a zombie).
running() {
  local state
  state=$(sed -n 's/^[0-9]* (.*) \([A-Za-z]\) .*/\1/p' "/proc/$1/stat" 2>/dev/null)
  [ -n "$state" ] && [ "$state" != Z ] && [ "$state" != X ]
}

now() { date +%s.%N; }
since() { python3 -c "import sys; print(round($(now) - $1, 2))"; }

# on HOST CMD...: runs CMD in HOST (its network and UTS namespaces) with the host's own HOME,
# TMPDIR and XDG_RUNTIME_DIR.
on() {
  local h=$1; shift
  env HOME="$TMP/$h/home" TMPDIR="$TMP/$h/tmp" XDG_RUNTIME_DIR="$TMP/$h/run" \
    nsenter --net="/run/netns/$NS-$h" --uts="$TMP/uts/$h" -- "$@"
}
# spawn OUT ERR HOST CMD...: CMD in HOST in the background, stdout to OUT and stderr to ERR (- for
# OUT too); its pid in SPAWNED and PIDS. env and nsenter exec, so that pid is CMD's own.
spawn() {
  local out=$1 err=$2 h=$3; shift 3
  [ "$err" = - ] && err=/dev/stdout
  env HOME="$TMP/$h/home" TMPDIR="$TMP/$h/tmp" XDG_RUNTIME_DIR="$TMP/$h/run" \
    nsenter --net="/run/netns/$NS-$h" --uts="$TMP/uts/$h" -- "$@" >"$out" 2>"$err" &
  SPAWNED=$!
  PIDS+=("$SPAWNED")
}

# The switch (a bridge in its own namespace) and three hosts, each on one port of it.
make_hosts() {
  local specs=() h
  for h in "${HOSTS[@]}"; do specs+=("$h:twk-$h"); done
  netns_hosts "$NS" "$NET" "$TMP" "${specs[@]}"
  for h in "${HOSTS[@]}"; do mkdir -p "$TMP/$h/home" "$TMP/$h/tmp" "$TMP/$h/run"; done
  [ "$(on h2 hostname)" = twk-h2 ] || fail "host 2's hostname is $(on h2 hostname)"
}

# Every member its own key pair; the head admits the members' public keys. With INSECURE set, no
# keys: every member and the head run with --insecure (plaintext beyond loopback), so the
# workers' control channels are plain TCP streams instead of CURVE sockets.
make_keys() {
  local who
  if [ -n "${INSECURE:-}" ]; then
    for who in "${HOSTS[@]}"; do declare -ga "KEYS_$who=(--insecure)"; done
    HEAD_KEYS=(--insecure)
    return
  fi
  HEAD_KEYS=(--key "$TMP/keys/head/twinkle.key" --authorized-keys "$TMP/keys/authorized_keys")
  run 0 "$TWK" keygen --out "$TMP/keys/head" --name cluster-head
  : >"$TMP/keys/authorized_keys"
  for who in "${HOSTS[@]}"; do
    run 0 "$TWK" keygen --out "$TMP/keys/$who" --name "member-$who"
    cat "$TMP/keys/$who/twinkle.pub" >>"$TMP/keys/authorized_keys"
    # KEYS_hN: the flags of member hN (its key pair, the head's public key as its pin).
    declare -ga "KEYS_$who=(--key $TMP/keys/$who/twinkle.key --head-key $TMP/keys/head/twinkle.pub)"
  done
}

# start_agent HOST CPUS: the agent of HOST (node id HOST), until it joined the cluster.
start_agent() {
  local h=$1 keys="KEYS_${1}[@]"
  spawn "$TMP/agent-$h.log" - "$h" "$TWK" node start --address "$ADDR" \
    --node-id "$h" --cpus "$2" --cache-dir "$TMP/$h/cache" "${!keys}"
  AGENT[$h]=$SPAWNED
}

# The head in host 1 (no agent there), agents h2 and h3 in hosts 2 and 3 with $AGENT_CPUS (4)
# CPUs each.
start_cluster() {
  make_hosts
  make_keys
  spawn "$TMP/head.log" - h1 "$TWK" node start --head --no-agent --bind "$NET.1" \
    --port "$PORT" "${HEAD_KEYS[@]}"
  wait_for "$TMP/head.log" "listening on" 10
  grep -qF "$ADDR" "$TMP/head.log" || { cat "$TMP/head.log"; fail "the head does not listen on $ADDR"; }
  local h
  for h in h2 h3; do start_agent "$h" "${AGENT_CPUS:-4}"; done
  for h in h2 h3; do wait_for "$TMP/agent-$h.log" "joined the cluster" 10; done
}

# nodes_json: `twinkle nodes --json` asked from host 1, into $TMP/out.
nodes_json() { run 0 on h1 "$TWK" nodes --address "$ADDR" "${KEYS_h1[@]}" --json; }
reservations() {
  nodes_json
  python3 -c 'import json,sys; print(len(json.load(open(sys.argv[1]))["reservations"]))' "$TMP/out"
}
expect_no_reservations() {  # bounded: $1 s
  local deadline=$((SECONDS + ${1:-5}))
  until [ "$(reservations)" = 0 ]; do
    [ $SECONDS -lt $deadline ] || { cat "$TMP/out"; fail "the reservation was not released"; }
    sleep 0.2
  done
}

# workers_on HOST: the pids of workers in HOST's network namespace.
workers_on() {
  local p
  for p in $(ip netns pids "$NS-$1" 2>/dev/null); do
    running "$p" && tr '\0' ' ' <"/proc/$p/cmdline" 2>/dev/null | grep -q -- "worker --endpoint" &&
      echo "$p"
  done
}
# wait_stopped HOST: until a worker in HOST has stopped itself (args.fail_at's ":stop"; bounded:
# 60 s), while the run ($DRIVER, rank $stop_rank) goes on.
wait_stopped() {
  local deadline=$((SECONDS + 60)) stopped="" p
  while [ -z "$stopped" ]; do
    for p in $(workers_on "$1"); do
      grep -q '^State:.*T (stopped)' "/proc/$p/status" 2>/dev/null && stopped=$p
    done
    [ $SECONDS -lt $deadline ] || { cat "$TMP/run.out" "$TMP/run.err"; fail "rank $stop_rank did not stop in epoch 12"; }
    running $DRIVER || { cat "$TMP/run.out" "$TMP/run.err"; fail "the run ended before rank $stop_rank stopped"; }
    sleep 0.05
  done
}
# any_workers: pids of workers of this test anywhere (on a host or not).
any_workers() {
  { for h in "${HOSTS[@]}"; do workers_on "$h"; done
    pgrep -f -- "worker --endpoint .* --plugin $TMP/"; } | sort -u
}
# expect_no_workers SECONDS [FROM]: no worker left on any host within SECONDS of FROM (a `now`
# time; default now), in a bounded loop.
expect_no_workers() {
  local from=${2:-$(now)} left p
  while left=$(any_workers) && [ -n "$left" ]; do
    if python3 -c "import sys; sys.exit(0 if $(now) - $from > $1 else 1)"; then
      for p in $left; do tr '\0' ' ' <"/proc/$p/cmdline"; echo; done
      fail "workers left running $1 s after the deadline's start: $left"
    fi
    sleep 0.1
  done
}

case "$CASE" in
  netns_digits)
    start_cluster
    # Both agents ALIVE, with their namespace addresses and hostnames.
    nodes_json
    python3 - "$TMP/out" "$NET" <<'PY' || { cat "$TMP/out"; fail "nodes --json: h2 and h3 ALIVE at their addresses expected"; }
import json, sys
d = json.load(open(sys.argv[1]))
net = sys.argv[2]
nodes = {n["id"]: n for n in d["nodes"]}
assert sorted(nodes) == ["h2", "h3"], nodes
for i in ("2", "3"):
    n = nodes["h" + i]
    assert n["state"] == "ALIVE", n
    assert n["address"] == f"{net}.{i}", n
    assert n["host"] == "twk-h" + i, n
assert d["reservations"] == [], d["reservations"]
PY
    # digits in remote mode, spread so that both hosts get workers (4 ranks, 4 CPUs each).
    mkdir -p "$TMP/job"
    sed -e 's/^mode *=.*/mode = "remote"/' \
      -e "s|^plugin *=.*|plugin = \"$EXAMPLES/digits/libdigits.so\"|" \
      -e 's/^device *= *"cpu".*/&\nplacement = "spread"/' \
      "$SRC/examples/digits/job.toml" >"$TMP/job/digits.toml"
    grep -q '^placement = "spread"' "$TMP/job/digits.toml" || fail "could not add the placement"
    cp "$SRC/examples/digits/digits.csv.gz" "$TMP/job/"
    run 0 on h1 "$TWK" topology --json "$TMP/job/digits.toml" --address "$ADDR" "${KEYS_h1[@]}"
    hosts=$(python3 -c 'import json,sys; d=json.load(open(sys.argv[1])); print(" ".join(sorted({w["host"].split()[0] for g in d["groups"] for w in g["workers"]})))' "$TMP/out")
    [ "$hosts" = "h2 h3" ] || { cat "$TMP/out"; fail "the placement must use both hosts, not: $hosts"; }
    started=$(now)
    run 0 on h1 "$TWK" run "$TMP/job/digits.toml" --address "$ADDR" "${KEYS_h1[@]}"
    echo "digits across two namespace-hosts: $(since "$started") s"
    remote=$(sed -n 's/^final loss: //p' "$TMP/out")
    [ -n "$remote" ] || { cat "$TMP/out"; fail "no final loss in remote mode"; }
    for h in h2 h3; do
      grep -q "started [0-9]* worker(s)" "$TMP/agent-$h.log" ||
        { cat "$TMP/agent-$h.log"; fail "agent $h started no workers"; }
      ls "$TMP/$h/cache/"*.so >/dev/null 2>&1 || fail "the plugin did not reach $h's cache"
    done
    # The same job in local mode, in the root namespace.
    sed -e 's/^mode = "remote"/mode = "local"/' "$TMP/job/digits.toml" >"$TMP/job/digits-local.toml"
    run 0 "$TWK" run "$TMP/job/digits-local.toml"
    local_loss=$(sed -n 's/^final loss: //p' "$TMP/out")
    echo "final loss: remote $remote, local $local_loss"
    python3 -c "import sys; a,b=float('$remote'),float('$local_loss'); sys.exit(0 if abs(a-b)<=1e-4 else 1)" ||
      fail "digits: remote final loss $remote, local $local_loss"
    expect_no_reservations 5
    expect_no_workers 5
    ;;

  netns_link_down_insecure)
    # The same without keys: the workers' plain TCP control streams (idle here) end by their
    # keepalive, and the workers on h3 end by themselves as with CURVE sockets' heartbeats.
    INSECURE=1
    ;&
  netns_link_down)
    start_cluster
    mkdir -p "$TMP/job"
    cat >"$TMP/job/hang.toml" <<TOML
[job]
name = "hang"
mode = "remote"
plugin = "$PLUGIN"
timeout_s = 30
queue_timeout_s = 10

[[group]]
name = "a"
ranks = 2
placement = "strict_spread"

[[group]]
name = "b"
ranks = 1

[args]
tag = "t"
TOML
    spawn "$TMP/run.out" "$TMP/run.err" h1 \
      "$TWK" run --set job.driver=hang "$TMP/job/hang.toml" --address "$ADDR" "${KEYS_h1[@]}"
    DRIVER=$SPAWNED
    wait_for "$TMP/run.out" "ALL READY" 30
    [ -n "$(workers_on h2)" ] || fail "no workers on h2 before the cut"
    [ -n "$(workers_on h3)" ] || fail "no workers on h3 before the cut"
    if [ -n "${INSECURE:-}" ]; then
      pgrep -f -- "--endpoint tcp[+]stream://" >/dev/null ||
        { pgrep -af twinkle-worker; fail "the workers do not talk to their driver over a TCP stream"; }
    fi
    # The silent cut: host 3's port on the switch goes down, its packets are dropped.
    cut=$(now)
    ip -n "$NS-sw" link set port-h3 down || fail "cannot take port-h3 down"
    # The driver fails within the 3 s silence limit plus a margin for a loaded machine.
    deadline=$((SECONDS + 12))
    while running $DRIVER; do
      [ $SECONDS -lt $deadline ] || { cat "$TMP/run.err"; fail "the driver still runs 12 s after the cut"; }
      sleep 0.05
    done
    took=$(since "$cut")
    wait $DRIVER
    rc=$?
    echo "link down to failed run: $took s"
    [ $rc -eq 1 ] || { cat "$TMP/run.out" "$TMP/run.err"; fail "driver exited $rc, expected 1"; }
    grep -qF "node h3 is DEAD" "$TMP/run.err" || { cat "$TMP/run.err"; fail "no DEAD node line for h3"; }
    python3 -c "import sys; sys.exit(0 if $took < 8 else 1)" || fail "the cut took $took s to fail the run"
    expect_no_reservations 5
    nodes_json
    python3 -c 'import json,sys; s={n["id"]: n["state"] for n in json.load(open(sys.argv[1]))["nodes"]}; assert s=={"h2": "ALIVE", "h3": "DEAD"}, s' "$TMP/out" ||
      { cat "$TMP/out"; fail "nodes: h2 ALIVE and h3 DEAD expected"; }
    # Workers on h3 cannot hear from their driver any more: they end by themselves, within the
    # 3 s silence limit plus margins, counted from the cut.
    expect_no_workers 8 "$cut"
    echo "link down to no workers on any host: $(since "$cut") s"
    running "${AGENT[h3]}" || { cat "$TMP/agent-h3.log"; fail "the agent on h3 died with its link"; }
    running "${AGENT[h2]}" || { cat "$TMP/agent-h2.log"; fail "the agent on h2 died"; }
    grep -q "node h3 .*is DEAD" "$TMP/head.log" ||
      { cat "$TMP/head.log"; fail "the head did not log h3 as DEAD"; }
    ;;

    netns_submit)
    # The job service (issue 21, test 8): a job submitted from a "laptop" (host 4, no agent)
    # finishes on the cluster after the laptop's link is cut, with the final loss of a local run.
    HOSTS=(h1 h2 h3 h4)
    start_cluster
    mkdir -p "$TMP/job"
    sed -e "s|^plugin *=.*|plugin = \"$EXAMPLES/digits/libdigits.so\"|" -e 's/^epochs *=.*/epochs = 12/' \
      "$SRC/examples/digits/job.toml" >"$TMP/job/job.toml"
    cp "$SRC/examples/digits/digits.csv.gz" "$TMP/job/"
    run 0 "$TWK" run --quiet "$TMP/job/job.toml"  # the reference, in local mode
    want=$(sed -n 's/^final loss: //p' "$TMP/out")
    spawn "$TMP/laptop.out" - h4 "$TWK" submit --wait "$TMP/job/job.toml" --address "$ADDR" "${KEYS_h4[@]}"
    wait_for "$TMP/laptop.out" "epoch 2 " 60
    ip -n "$NS-sw" link set port-h4 down || fail "cannot take port-h4 down"
    cut=$(now)
    deadline=$((SECONDS + 90))
    while :; do
      run 0 on h1 "$TWK" jobs --all --json --address "$ADDR" "${KEYS_h1[@]}"
      state=$(python3 -c 'import json,sys; print(json.load(open(sys.argv[1]))[0]["state"])' "$TMP/out")
      [ "$state" = SUCCEEDED ] && break
      [ "$state" = RUNNING ] || { cat "$TMP/out"; fail "the job is $state after the laptop's link went down"; }
      [ $SECONDS -lt $deadline ] || fail "the job did not end within 90 s of the cut"
      sleep 0.2
    done
    echo "laptop cut to job SUCCEEDED: $(since "$cut") s"
    python3 -c 'import json,sys; j=json.load(open(sys.argv[1]))[0]; assert j["user"]=="member-h4" and j["from"]=="twk-h4", j' "$TMP/out" ||
      { cat "$TMP/out"; fail "the job is not the laptop's"; }
    run 0 on h1 "$TWK" logs 1 --address "$ADDR" "${KEYS_h1[@]}"
    got=$(sed -n 's/^final loss: //p' "$TMP/out")
    python3 -c "import sys; a,b=float('$got'),float('$want'); sys.exit(0 if abs(a-b)<=1e-4 else 1)" ||
      fail "digits submitted: final loss $got, local $want"
    ;;

  netns_spare)
    # Issue 20, test 8: a node is lost mid-run (every process of host 3 SIGKILLed, its agent
    # included) and its ranks start on a spare node (host 4, which joined after the run began);
    # they copy their state from the survivors' replicas and the run ends with the losses of a
    # run without the fault, bit for bit.
    HOSTS=(h1 h2 h3 h4)
    AGENT_CPUS=2  # digits' 4 ranks fill h2 and h3
    start_cluster
    mkdir -p "$TMP/job"
    sed -e 's/^mode *=.*/mode = "remote"/' \
      -e "s|^plugin *=.*|plugin = \"$EXAMPLES/digits/libdigits.so\"|" \
      "$SRC/examples/digits/job.toml" >"$TMP/job/digits.toml"
    cp "$SRC/examples/digits/digits.csv.gz" "$TMP/job/"
    # The reference: the same job on the same two nodes, without a fault.
    run 0 on h1 "$TWK" run --quiet "$TMP/job/digits.toml" --address "$ADDR" "${KEYS_h1[@]}"
    grep -E '^epoch [0-9]+  loss ' "$TMP/out" >"$TMP/ref-epochs"
    ref_final=$(grep '^final loss:' "$TMP/out")
    [ "$(wc -l <"$TMP/ref-epochs")" -eq 30 ] && [ -n "$ref_final" ] ||
      { cat "$TMP/out"; fail "the reference run has no 30 epochs and final loss"; }
    # A rank that runs on h3: it stops itself (SIGSTOP) in epoch 12, so that its node is lost
    # while the others wait on it in that epoch's all_reduce.
    run 0 on h1 "$TWK" topology --json "$TMP/job/digits.toml" --address "$ADDR" "${KEYS_h1[@]}"
    ranks_h3=$(python3 -c 'import json,sys; d=json.load(open(sys.argv[1])); print(" ".join(str(w["index"]) for g in d["groups"] for w in g["workers"] if w["host"].split()[0] == "h3"))' "$TMP/out")
    [ -n "$ranks_h3" ] || { cat "$TMP/out"; fail "no rank on h3"; }
    stop_rank=${ranks_h3%% *}
    spawn "$TMP/run.out" "$TMP/run.err" h1 "$TWK" run --quiet "$TMP/job/digits.toml" \
      --address "$ADDR" "${KEYS_h1[@]}" --set group.model.max_restarts=1 \
      --set "args.fail_at=model:$stop_rank:12:stop"
    DRIVER=$SPAWNED
    wait_for "$TMP/run.out" "epoch 1 " 60  # the run holds h2 and h3 now
    start_agent h4 2
    wait_for "$TMP/agent-h4.log" "joined the cluster" 10
    wait_stopped h3
    # The node is lost: every process of host 3, its agent too.
    cut=$(now)
    for p in $(ip netns pids "$NS-h3"); do kill -KILL "$p" 2>/dev/null; done
    deadline=$((SECONDS + 60))
    until grep -q "twinkle: group model is back" "$TMP/run.err"; do
      [ $SECONDS -lt $deadline ] || { cat "$TMP/run.out" "$TMP/run.err"; fail "the group was not back within 60 s of the node's loss"; }
      running $DRIVER || { cat "$TMP/run.out" "$TMP/run.err"; fail "the run ended without its group back"; }
      sleep 0.05
    done
    echo "node lost (agent SIGKILL) to ranks running on the spare: $(since "$cut") s"
    deadline=$((SECONDS + 90))
    while running $DRIVER; do
      [ $SECONDS -lt $deadline ] || { cat "$TMP/run.err"; fail "the run did not end within 90 s of its group's return"; }
      sleep 0.1
    done
    wait $DRIVER
    rc=$?
    cat "$TMP/run.err"
    [ $rc -eq 0 ] || { cat "$TMP/run.out"; fail "the run exited $rc after its node was lost"; }
    moved=$(echo "$ranks_h3" | sed 's/\([0-9]*\)/model:\1/g; s/ /, /g')
    grep -qF "twinkle: node h3 is DEAD" "$TMP/run.err" || fail "no DEAD node line"
    grep -qF "twinkle: $moved start on node h4 (node h3 is DEAD)" "$TMP/run.err" ||
      fail "no line saying that $moved start on h4"
    grep -qF "$moved replaced ($moved on node h4: node h3 is DEAD), state copied" "$TMP/run.err" ||
      fail "the back line does not say where the state came from"
    grep -E '^epoch [0-9]+  loss ' "$TMP/run.out" | tail -n 30 >"$TMP/got-epochs"
    diff "$TMP/ref-epochs" "$TMP/got-epochs" || fail "the losses differ from the run without a fault"
    got_final=$(grep '^final loss:' "$TMP/run.out")
    echo "reference $ref_final; after the node's loss $got_final"
    [ "$got_final" = "$ref_final" ] || fail "final loss: $got_final, without the fault $ref_final"
    grep -q "started 2 worker(s)" "$TMP/agent-h4.log" || { cat "$TMP/agent-h4.log"; fail "the spare started no workers"; }
    grep -qF "moves worker(s) off a DEAD node" "$TMP/head.log" || { cat "$TMP/head.log"; fail "the head did not log the move"; }
    # The run's record has the moved ranks on h4, and its audit says so.
    run 0 on h1 "$TWK" jobs --all --json --address "$ADDR" "${KEYS_h1[@]}"
    id=$(python3 -c 'import json,sys; print(" ".join(str(j["id"]) for j in json.load(open(sys.argv[1])) if j["restarts"] == 1))' "$TMP/out")
    [ -n "$id" ] && [ "${id// /}" = "$id" ] || { cat "$TMP/out"; fail "not one job with one restart: $id"; }
    run 0 on h1 "$TWK" job show "$id" --json --address "$ADDR" "${KEYS_h1[@]}"
    python3 - "$TMP/out" "$ranks_h3" <<'PY' || { cat "$TMP/out"; fail "the job's placement does not show the move"; }
import json, sys
j = json.load(open(sys.argv[1]))
moved = {int(r) for r in sys.argv[2].split()}
where = {p["rank"]: p["node"] for p in j["placement"]}
assert sorted(where) == [0, 1, 2, 3], where
assert all(where[r] == "h4" for r in moved), where
assert all(n == "h2" for r, n in where.items() if r not in moved), where
assert any(a["action"] == "move" and "from h3 to h4" in a["detail"] for a in j["audit"]), j["audit"]
PY
    expect_no_reservations 5
    expect_no_workers 10
    # The same with restart = "group" from checkpoints: host 3's agent joins again; the next run
    # holds two of the three nodes, the third is the spare. Rank 0 stops in epoch 12 and its node
    # is lost: the group restarts from the checkpoint of epoch 11, the ranks of the lost node on
    # the spare and the others in place, MASTER_ADDR moves with rank 0, and the losses are the
    # reference's.
    start_agent h3 2
    wait_for "$TMP/agent-h3.log" "joined the cluster" 10
    run 0 on h1 "$TWK" topology --json "$TMP/job/digits.toml" --address "$ADDR" "${KEYS_h1[@]}"
    read -r lost_node stop_rank spare < <(python3 -c 'import json,sys
d = json.load(open(sys.argv[1]))
ws = [(w["host"].split()[0], w["index"]) for g in d["groups"] for w in g["workers"]]
used = sorted({h for h, _ in ws})
assert len(used) == 2, ws
lost = next(h for h, i in ws if i == 0)
print(lost, 0, ({"h2", "h3", "h4"} - set(used)).pop())' "$TMP/out")
    spawn "$TMP/run.out" "$TMP/run.err" h1 "$TWK" run --quiet "$TMP/job/digits.toml" \
      --address "$ADDR" "${KEYS_h1[@]}" --set group.model.max_restarts=1 \
      --set group.model.restart=group --set job.checkpoint_dir=ck \
      --set "args.fail_at=model:$stop_rank:12:stop"
    DRIVER=$SPAWNED
    wait_stopped "$lost_node"
    for p in $(ip netns pids "$NS-$lost_node"); do kill -KILL "$p" 2>/dev/null; done
    deadline=$((SECONDS + 90))
    while running $DRIVER; do
      [ $SECONDS -lt $deadline ] || { cat "$TMP/run.err"; fail "the group restart did not end within 90 s"; }
      sleep 0.1
    done
    wait $DRIVER
    rc=$?
    cat "$TMP/run.err"
    [ $rc -eq 0 ] || { cat "$TMP/run.out"; fail "the run exited $rc after its node was lost (restart = group)"; }
    grep -qE "start on node $spare \(node $lost_node is DEAD\)" "$TMP/run.err" || fail "no line saying they start on $spare"
    grep -qF "model:0, model:1, model:2, model:3 replaced (" "$TMP/run.err" || fail "the group was not replaced whole"
    grep -qE "group model's MASTER_ADDR is now $NET\.${spare#h} \(MASTER_PORT=[0-9]+\): its rank 0 moved" "$TMP/run.err" ||
      fail "MASTER_ADDR did not move to the spare with rank 0"
    grep -qF "from the checkpoint of step 11)" "$TMP/run.err" || fail "the group did not restart from the checkpoint of step 11"
    grep -E '^epoch [0-9]+  loss ' "$TMP/run.out" | tail -n 30 >"$TMP/got-epochs"
    diff "$TMP/ref-epochs" "$TMP/got-epochs" || fail "restart = group: the losses differ from the run without a fault"
    [ "$(grep '^final loss:' "$TMP/run.out")" = "$ref_final" ] || fail "restart = group: another final loss"
    expect_no_reservations 5
    expect_no_workers 10
    ;;

  *) fail "unknown case $CASE" ;;
esac
echo "PASS cluster $CASE"
