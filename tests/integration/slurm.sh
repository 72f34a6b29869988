#!/usr/bin/env bash
# Twinkle inside Slurm allocations (issue 12): a Slurm cluster started by the test itself
# (slurm_cluster.sh: munged, slurmctld and slurmd with a generated slurm.conf in a temporary
# directory; two nodes, each in its own network and UTS namespace, where namespaces can be made,
# else one), and `twinkle run --launcher slurm` through salloc, sbatch of the shipped batch script
# (deploy/slurm/twinkle.sbatch) and scancel. Root only; exit 77 where Slurm is not installed.
# Every Slurm command runs on the cluster's submit host (slurm_on), never from the root namespace.
# Two nodes, not one: only agents on two hosts with their own addresses and hostnames show that the
# driver starts one agent per allocated node, reachable across hosts, and places ranks on both (hello's
# 6 ranks do not fit on one node of 4 CPUs; the hang job spreads group a). One node (SLURM_NODES=1,
# or where namespaces cannot be made) runs the same cases with 8 CPUs on that node.
# Usage: slurm.sh TWINKLE_BINARY SOURCE_ROOT FIXTURE_PLUGIN EXAMPLES_BUILD_DIR CASE
# Absolute paths: jobs run in other directories (sbatch: the submit directory) and on other hosts.
TWK=$(realpath -- "$1")
SRC=$(realpath -- "$2")
PLUGIN=$(realpath -- "$3")
EXAMPLES=$(realpath -- "$4")
CASE=$5
source "$SRC/tests/integration/lib.sh"
source "$SRC/tests/integration/netns.sh"
source "$SRC/tests/integration/slurm_cluster.sh"
slurm_require

export HOME="$TMP/home"  # the test's own keys and caches; the cluster's hosts have theirs
mkdir -p "$HOME" "$TMP/job"
unset TWINKLE_ADDRESS TWINKLE_KEY TWINKLE_HEAD_KEY TWINKLE_AUTHORIZED_KEYS TWINKLE_HOME
# Jobs run as root on hosts that share this file system; the batch script runs this binary.
export TWINKLE="$TWK"
chmod 711 "$TMP"
cleanup() {
  pkill -KILL -f -- "$TMP/" 2>/dev/null
  rm -rf "$TMP"
}
trap cleanup EXIT  # slurm_start puts slurm_stop ahead of it

# Every node offers 4 CPUs, 8 when there is only one (this machine may have fewer): an agent offers
# a worker per CPU, and the hello example has 6 ranks.
if [ -z "${SLURM_NODES:-}" ]; then
  if slurm_can_netns; then SLURM_NODES=2; else SLURM_NODES=1; fi
fi
if [ "$SLURM_NODES" = 2 ]; then SLURM_NODE_CPUS=${SLURM_NODE_CPUS:-4}; else SLURM_NODE_CPUS=${SLURM_NODE_CPUS:-8}; fi

now() { date +%s.%N; }
since() { python3 -c "import sys; print(round($(now) - $1, 2))"; }

# example_job NAME: the example's job file in $TMP/job, mode remote, the built plugin's absolute
# path, its data file next to it.
example_job() {
  sed -e 's/^mode *=.*/mode = "remote"/' -e "s|^plugin *=.*|plugin = \"$EXAMPLES/$1/lib$1.so\"|" \
    "$SRC/examples/$1/job.toml" >"$TMP/job/$1.toml"
  grep -q '^mode = "remote"' "$TMP/job/$1.toml" || fail "no mode line in the $1 example"
  [ -f "$SRC/examples/$1/$1.csv.gz" ] && cp "$SRC/examples/$1/$1.csv.gz" "$TMP/job/"
  return 0
}

# local_results NAME: the example's results in local mode (root namespace) into $TMP/local-NAME.
hello_results() { grep -E '^(collect|custom|    worker)' "$1"; }
local_results() {
  sed -e 's/^mode = "remote"/mode = "local"/' "$TMP/job/$1.toml" >"$TMP/job/$1-local.toml"
  run 0 "$TWK" run "$TMP/job/$1-local.toml"
  case $1 in
    hello) hello_results "$TMP/out" >"$TMP/local-hello" ;;
    digits) sed -n 's/^final loss: //p' "$TMP/out" >"$TMP/local-digits" ;;
  esac
  [ -s "$TMP/local-$1" ] || { cat "$TMP/out"; fail "no results for $1 in local mode"; }
}

# same_loss A B WHAT: the two final losses agree within 1e-4.
same_loss() {
  [ -n "$1" ] && [ -n "$2" ] || fail "$3: final loss '$1', local '$2'"
  python3 -c "import sys; a,b=float('$1'),float('$2'); sys.exit(0 if abs(a-b)<=1e-4 else 1)" ||
    fail "$3: final loss $1, local $2"
}

# twinkle_pids: agents and workers of this test anywhere on the machine (its cluster's hosts and
# the root namespace): a worker's command line has `worker --endpoint`, an agent's `node start
# --address`; they are the test's when they run the test's binary in the cluster (its namespaces or
# its hosts' HOME) or name the test's directory.
twinkle_pids() {
  local p
  for p in $(_slurm_pids; pgrep -f -- "$TMP/"); do
    tr '\0' ' ' 2>/dev/null <"/proc/$p/cmdline" | grep -qE -- 'worker --endpoint|node start --address' &&
      echo "$p"
  done | sort -u
}
# on_node_pids NODE: the processes of NODE (2 nodes: its namespace; 1 node: the whole cluster).
on_node_pids() {
  if [ "$SLURM_NODES" = 2 ]; then ip netns pids "$SLURM_NS-$1"; else _slurm_pids; fi
}
# expect_no_twinkle SECONDS: no agent or worker of the test left (bounded).
expect_no_twinkle() {
  local deadline=$((SECONDS + $1)) left p
  while left=$(twinkle_pids) && [ -n "$left" ]; do
    if [ $SECONDS -ge $deadline ]; then
      for p in $left; do echo "$p: $(tr '\0' ' ' <"/proc/$p/cmdline")"; done
      fail "twinkle processes left running $1 s after the run: $left"
    fi
    sleep 0.1
  done
}

# job_state ID: the job's state as Slurm reports it (empty once it left the queue).
job_state() { slurm_on scontrol show job "$1" 2>/dev/null | sed -n 's/.*JobState=\([A-Z_]*\).*/\1/p'; }

# wait_job_end ID SECONDS: until the job is no longer pending, running or completing (bounded); its
# last state in JOB_STATE.
wait_job_end() {
  local deadline=$((SECONDS + $2))
  while JOB_STATE=$(job_state "$1"); [[ $JOB_STATE =~ ^(PENDING|CONFIGURING|RUNNING|COMPLETING|SUSPENDED)$ ]]; do
    [ $SECONDS -lt $deadline ] || { slurm_on scontrol show job "$1"; fail "job $1 still $JOB_STATE after $2 s"; }
    sleep 0.1
  done
}

# The allocation every case asks for: every node, one agent per node, all its CPUs (ALLOC); sbatch
# of the shipped script asks for them with its own #SBATCH lines (2 nodes, 4 CPUs each), SBATCH
# only says what differs.
alloc() {
  ALLOC=(-N "${#SLURM_NODE_NAMES[@]}" --ntasks-per-node=1 --cpus-per-task="$SLURM_CPUS_PER_NODE")
  SBATCH=()
  [ "${#SLURM_NODE_NAMES[@]}" = 2 ] || SBATCH+=(-N "${#SLURM_NODE_NAMES[@]}")
  [ "$SLURM_CPUS_PER_NODE" = 4 ] || SBATCH+=(--cpus-per-task="$SLURM_CPUS_PER_NODE")
}

case "$CASE" in
  slurm_boot)
    slurm_start
    alloc
    t=$(now)
    run 0 slurm_on srun -N1 hostname
    echo "srun -N1 hostname: $(since "$t") s"
    expect_out "${SLURM_NODE_NAMES[0]}"
    t=$(now)
    run 0 slurm_on srun "${ALLOC[@]}" hostname
    echo "srun -N${#SLURM_NODE_NAMES[@]} hostname: $(since "$t") s"
    for n in "${SLURM_NODE_NAMES[@]}"; do expect_out "$n"; done
    run 0 slurm_on sinfo -h -N -o '%N %c %T'
    for n in "${SLURM_NODE_NAMES[@]}"; do expect_out "$n $SLURM_CPUS_PER_NODE idle"; done
    # The daemons' pids are the daemons' own (munged, slurmctld, a slurmd per node).
    want="munged slurmctld$(printf ' slurmd%.0s' "${SLURM_NODE_NAMES[@]}")"
    got=$(for p in "${SLURM_DAEMONS[@]}"; do tr '\0' '\n' 2>/dev/null <"/proc/$p/cmdline" | head -1 | xargs basename; done | tr '\n' ' ')
    [ "$got" = "$want " ] || fail "daemon pids: $got, expected $want"
    # A batch job, submit to done.
    printf '#!/bin/sh\nhostname\n' >"$TMP/job/host.sbatch"
    t=$(now)
    run 0 slurm_on sbatch --wait --output="$TMP/job/host.out" "$TMP/job/host.sbatch"
    echo "sbatch --wait of a one-line script: $(since "$t") s"
    grep -qxF "${SLURM_NODE_NAMES[0]}" "$TMP/job/host.out" || { cat "$TMP/job/host.out"; fail "the batch job did not run on ${SLURM_NODE_NAMES[0]}"; }
    # slurm_stop ends the cluster, a running job included, and leaves nothing behind.
    dir=$SLURM_DIR ns=$SLURM_NS daemons=("${SLURM_DAEMONS[@]}")
    slurm_on sbatch --output=/dev/null --wrap "sleep 300" >/dev/null || fail "cannot submit a long job"
    t=$(now)
    slurm_stop
    echo "slurm_stop: $(since "$t") s"
    for p in "${daemons[@]}"; do
      _slurm_running "$p" && fail "daemon $p ($(tr '\0' ' ' <"/proc/$p/cmdline")) outlived slurm_stop"
    done
    left=$(pgrep -f -- "$dir/")
    [ -z "$left" ] || fail "processes naming $dir outlived slurm_stop: $left"
    for p in /proc/[0-9]*; do
      tr '\0' '\n' 2>/dev/null <"$p/environ" | grep -q "^HOME=$dir/" && fail "${p#/proc/} ($(tr '\0' ' ' <"$p/cmdline")) of the cluster outlived slurm_stop"
    done
    [ -e "$dir" ] && fail "$dir is still there"
    ip netns list | grep -q "^$ns-" && { ip netns list; fail "namespaces $ns-* are still there"; }
    grep -qF "$dir" /proc/mounts && fail "mounts under $dir are still there"
    ;;

  slurm_salloc)
    slurm_start
    alloc
    example_job hello
    local_results hello
    # twinkle run inside an allocation of every node: its own head, one agent per node by srun.
    t=$(now)
    run 0 slurm_on salloc "${ALLOC[@]}" "$TWK" run --launcher slurm "$TMP/job/hello.toml"
    echo "salloc ... twinkle run --launcher slurm hello: $(since "$t") s"
    hello_results "$TMP/out" >"$TMP/slurm-hello"
    diff "$TMP/local-hello" "$TMP/slurm-hello" || { cat "$TMP/out" "$TMP/err"; fail "hello through salloc differs from local mode"; }
    # Its 6 ranks do not fit on one node of 4 CPUs: every allocated node got workers.
    expect_out "(reserved)"
    for n in "${SLURM_NODE_NAMES[@]}"; do
      grep -qE "workers? on ([^ ]+ [^ ]+, )*$n " "$TMP/out" || { cat "$TMP/out"; fail "no workers placed on $n"; }
    done
    expect_no_twinkle 10
    # The same with launcher = "slurm" in the job file.
    sed -e 's/^mode = "remote"/&\nlauncher = "slurm"/' "$TMP/job/hello.toml" >"$TMP/job/hello-launcher.toml"
    run 0 slurm_on salloc "${ALLOC[@]}" "$TWK" run "$TMP/job/hello-launcher.toml"
    hello_results "$TMP/out" >"$TMP/slurm-hello"
    diff "$TMP/local-hello" "$TMP/slurm-hello" || { cat "$TMP/out" "$TMP/err"; fail "hello with launcher = \"slurm\" differs from local mode"; }
    expect_no_twinkle 10
    # digits too: the same final loss.
    example_job digits
    local_results digits
    run 0 slurm_on salloc "${ALLOC[@]}" "$TWK" run --launcher slurm "$TMP/job/digits.toml"
    same_loss "$(sed -n 's/^final loss: //p' "$TMP/out")" "$(cat "$TMP/local-digits")" "digits through salloc"
    expect_no_twinkle 10
    # A job that cannot fit names the Slurm fact and what to ask for, before starting anything;
    # topology inside the allocation places on the allocated nodes.
    sed -e 's/^device *=.*//' -e 's/^\(ranks *=.*\)/\1\ndevice = "cuda"/' "$TMP/job/hello.toml" >"$TMP/job/hello-gpu.toml"
    run 2 slurm_on salloc "${ALLOC[@]}" "$TWK" run --launcher slurm "$TMP/job/hello-gpu.toml"
    expect_err "the Slurm allocation (job"
    expect_err "--gpus-per-node"
    run 0 slurm_on salloc "${ALLOC[@]}" "$TWK" topology --launcher slurm --json "$TMP/job/hello.toml"
    python3 - "$TMP/out" "${SLURM_NODE_NAMES[@]}" <<'PY' || { cat "$TMP/out"; fail "topology --launcher slurm"; }
import json, sys
d = json.load(open(sys.argv[1]))
used = {w["host"].split()[0] for g in d["groups"] for w in g["workers"]}
assert used == set(sys.argv[2:]), (used, sys.argv[2:])
PY
    expect_no_twinkle 10
    # twinkle nodes inside an allocation: the allocated nodes and their CPUs.
    run 0 slurm_on salloc "${ALLOC[@]}" "$TWK" nodes
    for n in "${SLURM_NODE_NAMES[@]}"; do expect_out "$n"; done
    run 0 slurm_on salloc -N1 --ntasks-per-node=1 --cpus-per-task="$SLURM_CPUS_PER_NODE" \
      -w "${SLURM_NODE_NAMES[0]}" "$TWK" nodes --json
    python3 - "$TMP/out" "${SLURM_NODE_NAMES[0]}" "$SLURM_CPUS_PER_NODE" <<'PY' || { cat "$TMP/out"; fail "nodes --json in a one-node allocation"; }
import json, sys
d = json.load(open(sys.argv[1]))
nodes = d["nodes"]
assert [n["id"] for n in nodes] == [sys.argv[2]], nodes
assert str(nodes[0].get("cpus")) == sys.argv[3], nodes
PY
    expect_no_twinkle 10
    ;;

  slurm_sbatch)
    slurm_start
    alloc
    example_job digits
    local_results digits
    # The shipped batch script, as a user submits it (its own --output, in the submit directory).
    cd "$TMP/job" || fail "no job directory"
    t=$(now)
    run 0 slurm_on sbatch --wait "${SBATCH[@]}" "$SRC/deploy/slurm/twinkle.sbatch" "$TMP/job/digits.toml"
    echo "sbatch --wait twinkle.sbatch digits: $(since "$t") s"
    id=$(sed -n 's/^Submitted batch job \([0-9]*\).*/\1/p' "$TMP/out")
    [ -n "$id" ] || fail "no job id from sbatch"
    [ -f "twinkle-$id.out" ] || { ls; fail "no twinkle-$id.out"; }
    same_loss "$(sed -n 's/^final loss: //p' "twinkle-$id.out")" "$(cat "$TMP/local-digits")" \
      "digits through sbatch (twinkle-$id.out: $(tail -5 "twinkle-$id.out" | tr '\n' '|'))"
    expect_no_twinkle 10
    # hello through the same script: the same results as local mode.
    example_job hello
    local_results hello
    run 0 slurm_on sbatch --wait "${SBATCH[@]}" "$SRC/deploy/slurm/twinkle.sbatch" "$TMP/job/hello.toml"
    id=$(sed -n 's/^Submitted batch job \([0-9]*\).*/\1/p' "$TMP/out")
    hello_results "twinkle-$id.out" >"$TMP/slurm-hello"
    diff "$TMP/local-hello" "$TMP/slurm-hello" || { cat "twinkle-$id.out"; fail "hello through sbatch differs from local mode"; }
    expect_no_twinkle 10
    ;;

  slurm_scancel)
    slurm_start
    alloc
    cat >"$TMP/job/hang.toml" <<TOML
[job]
name = "hang"
mode = "remote"
plugin = "$PLUGIN"
timeout_s = 60

[[group]]
name = "a"
ranks = ${#SLURM_NODE_NAMES[@]}
placement = "strict_spread"

[[group]]
name = "b"
ranks = 1

[args]
tag = "t"
TOML
    cd "$TMP/job" || fail "no job directory"
    run 0 slurm_on sbatch "${SBATCH[@]}" "$SRC/deploy/slurm/twinkle.sbatch" "$TMP/job/hang.toml" \
      --set job.driver=hang
    id=$(sed -n 's/^Submitted batch job \([0-9]*\).*/\1/p' "$TMP/out")
    [ -n "$id" ] || fail "no job id from sbatch"
    out="$TMP/job/twinkle-$id.out"
    wait_for "$out" "ALL READY" 60
    # An agent on every node, and workers on every node (group a is strict_spread over them).
    for n in "${SLURM_NODE_NAMES[@]}"; do
      on_node=$(on_node_pids "$n")
      for what in "$TWK node start --address" "$(dirname "$TWK")/twinkle-worker --endpoint"; do
        for p in $on_node; do
          [[ $(tr '\0' ' ' 2>/dev/null <"/proc/$p/cmdline") == "$what"* ]] && continue 2
        done
        cat "$out"; fail "no '$what' process on $n before scancel"
      done
    done
    t=$(now)
    run 0 slurm_on scancel "$id"
    wait_job_end "$id" 30
    echo "scancel to job ${JOB_STATE:-gone}: $(since "$t") s"
    expect_no_twinkle 15
    echo "scancel to no twinkle process: $(since "$t") s"
    summary=$(grep -E 'twinkle: interrupted by SIG[A-Z]+|twinkle: job "hang" failed' "$out") ||
      { cat "$out"; fail "no summary line of the driver in $out"; }
    echo "the driver's summary: $summary"
    grep -A3 -F "$summary" "$out" | tail -n +2
    ;;

  *) fail "unknown case $CASE" ;;
esac
echo "PASS slurm $CASE"
