# A Slurm 22.05 cluster owned by one test (Debian's slurm-wlm and munge), on this machine; its
# nodes are network namespaces (netns.sh). Source it after lib.sh and netns.sh; then
#
#   slurm_start   boots the cluster and waits (bounded) until sinfo shows every node idle;
#   slurm_on CMD  runs CMD on the submit host: where sinfo, srun, salloc, sbatch and scancel reach
#                 slurmctld (with SLURM_CONF set and that host's HOME, TMPDIR and XDG_RUNTIME_DIR);
#   slurm_stop    cancels the jobs and kills every process of the cluster (daemons, job steps and
#                 what they started), removes the namespaces and the cluster's directory. slurm_start
#                 registers it on EXIT, ahead of the test's own EXIT trap, so it also runs on failure.
#
# Everything lives in one temporary directory ($SLURM_DIR): a munged with its own 1 KiB key and its
# own socket (AuthInfo=socket=...), the generated slurm.conf ($SLURM_CONF, exported), state, spool,
# log and pid files. slurmctld and slurmd run as root in the foreground (-D), so their pids are known.
#
# Two layouts (SLURM_NODES, default 2 where network namespaces can be made, else 1):
#   2  two "hosts", each a network namespace plus a UTS namespace whose hostname is its NodeName
#      (slurm-n1 at $SLURM_NET.1, slurm-n2 at $SLURM_NET.2), joined by a bridge in a third "switch"
#      namespace. slurmctld and the first slurmd run in slurm-n1, the second slurmd in slurm-n2; the
#      one munged runs in the root namespace and serves both through its socket file. The submit
#      host is slurm-n1: nothing is ever sent from the root namespace to the hosts' addresses.
#   1  one node named after this host, at 127.0.0.1, in the root namespace; free loopback ports.
# Hosts are entered with nsenter, not `ip netns exec`: the latter remounts /sys without
# /sys/fs/cgroup, and slurmd then fails to start.
#
# Each node offers this machine's CPUs and memory (slurmd -C); SLURM_NODE_CPUS declares another CPU
# count (with SlurmdParameters=config_overrides, so that a 2-core machine can host ranks that take
# one CPU each). Exits 77 (skipped) when not root, when munged, slurmctld, slurmd or a Slurm command
# (sinfo, srun, salloc, sbatch, ...) is missing, or when munged cannot start. Boot to idle takes
# 1.3-2 s here (2 nodes 1.3-1.5 s, 1 node 1.5-2 s); slurm_start prints it and leaves it in SLURM_BOOT_S.

SLURM_NET=${SLURM_NET:-10.78.0}  # the hosts' /24 (2 nodes): host N is $SLURM_NET.N
SLURM_NODE_NAMES=()               # the NodeNames, in order
SLURM_DAEMONS=()                  # pids of munged, slurmctld and the slurmds
SLURM_NAMESPACES=()               # namespaces made by this cluster (2 nodes)
SLURM_UTS=()                      # UTS namespace bind mounts made by this cluster (2 nodes)
SLURM_DIR=""

# Skips the test (exit 77) where this cluster cannot run.
slurm_require() {
  if [ "$(id -u)" -ne 0 ]; then echo "SKIP: a Slurm cluster of the test needs root"; exit 77; fi
  case ":$PATH:" in *:/usr/sbin:*) ;; *) PATH=$PATH:/usr/sbin:/sbin ;; esac  # the daemons live there
  local tool
  for tool in munged slurmctld slurmd sinfo squeue scontrol srun salloc sbatch scancel; do
    command -v "$tool" >/dev/null ||
      { echo "SKIP: no $tool (install slurm-wlm and munge: .ci/install-deps --tests)"; exit 77; }
  done
}

# Whether this machine lets root make network and UTS namespaces (a container may not).
slurm_can_netns() {
  command -v ip >/dev/null && command -v nsenter >/dev/null && command -v unshare >/dev/null &&
    unshare --net --uts true 2>/dev/null
}

# _slurm_running PID: the process exists and is not a zombie (kill -0 succeeds on a zombie).
_slurm_running() {
  local state
  state=$(sed -n 's/^[0-9]* (.*) \([A-Za-z]\) .*/\1/p' "/proc/$1/stat" 2>/dev/null)
  [ -n "$state" ] && [ "$state" != Z ] && [ "$state" != X ]
}

# _slurm_env HOST: the environment of a process of HOST (its own HOME, TMPDIR, XDG_RUNTIME_DIR).
_slurm_env() {
  echo HOME="$SLURM_DIR/$1/home" TMPDIR="$SLURM_DIR/$1/tmp" XDG_RUNTIME_DIR="$SLURM_DIR/$1/run" \
    SLURM_CONF="$SLURM_CONF"
}

# _slurm_prefix NODE: the command that runs a program on NODE, in SLURM_PREFIX (env and nsenter
# exec the program: its pid is theirs).
_slurm_prefix() {
  # shellcheck disable=SC2207
  SLURM_PREFIX=(env $(_slurm_env "$1"))
  [ "$SLURM_NODES" = 2 ] &&
    SLURM_PREFIX+=(nsenter --net="/run/netns/$SLURM_NS-$1" --uts="$SLURM_DIR/uts/$1" --)
  return 0
}
# slurm_in NODE CMD...: runs CMD on NODE (2 nodes: in its namespaces; 1 node: here).
slurm_in() {
  local n=$1; shift
  _slurm_prefix "$n"
  "${SLURM_PREFIX[@]}" "$@"
}
slurm_on() { slurm_in "${SLURM_NODE_NAMES[0]}" "$@"; }

# _slurm_free_port: a TCP port free on loopback now (1 node: Slurm's ports, not the defaults).
_slurm_free_port() {
  python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'
}

# _slurm_chain_exit: slurm_stop first on EXIT, then the EXIT trap the test already had.
_slurm_chain_exit() {
  local prev=""
  local -a t
  eval "t=($(trap -p EXIT))"  # trap -- 'COMMAND' EXIT
  [ ${#t[@]} -ge 3 ] && prev=${t[2]}
  # shellcheck disable=SC2064
  trap "slurm_stop; $prev" EXIT
  trap 'exit 143' TERM
  trap 'exit 130' INT HUP
}

_slurm_make_hosts() {
  local specs=() n
  for n in "${SLURM_NODE_NAMES[@]}"; do specs+=("$n:$n"); done  # hostname = NodeName
  netns_hosts "$SLURM_NS" "$SLURM_NET" "$SLURM_DIR" "${specs[@]}"
}

_slurm_write_conf() {
  local hw cpus mem ctld_port slurmd_port ctld_addr i n addr overrides=""
  hw=$(slurmd -C 2>/dev/null | head -1)
  cpus=$(sed -n 's/.* CPUs=\([0-9]*\).*/\1/p' <<<"$hw")
  mem=$(sed -n 's/.* RealMemory=\([0-9]*\).*/\1/p' <<<"$hw")
  [ -n "$cpus" ] || cpus=$(nproc)
  [ -n "$mem" ] || mem=$(awk '/^MemTotal:/ { print int($2 / 1024) }' /proc/meminfo)
  if [ -n "${SLURM_NODE_CPUS:-}" ] && [ "$SLURM_NODE_CPUS" != "$cpus" ]; then
    cpus=$SLURM_NODE_CPUS
    overrides="SlurmdParameters=config_overrides"
  fi
  SLURM_CPUS_PER_NODE=$cpus
  if [ "$SLURM_NODES" = 2 ]; then
    ctld_port=16817 slurmd_port=16818  # each host has its own network stack: fixed, not the defaults
    ctld_addr=$SLURM_NET.1
  else
    ctld_port=$(_slurm_free_port) slurmd_port=$(_slurm_free_port)
    while [ "$slurmd_port" = "$ctld_port" ]; do slurmd_port=$(_slurm_free_port); done
    ctld_addr=127.0.0.1
  fi
  {
    cat <<CONF
# Generated by tests/integration/slurm_cluster.sh for one test; everything under $SLURM_DIR.
ClusterName=twinkle-test
SlurmctldHost=${SLURM_NODE_NAMES[0]}($ctld_addr)
SlurmctldPort=$ctld_port
SlurmdPort=$slurmd_port
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket=$SLURM_DIR/munge-run/munge.socket
StateSaveLocation=$SLURM_DIR/ctld
SlurmctldPidFile=$SLURM_DIR/ctld/slurmctld.pid
SlurmctldLogFile=$SLURM_DIR/log/slurmctld.log
SlurmdSpoolDir=$SLURM_DIR/slurmd/%n
SlurmdPidFile=$SLURM_DIR/slurmd/%n.pid
SlurmdLogFile=$SLURM_DIR/log/slurmd-%n.log
SlurmctldDebug=info
SlurmdDebug=info
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
AccountingStorageType=accounting_storage/none
JobAcctGatherType=jobacct_gather/none
JobCompType=jobcomp/none
SwitchType=switch/none
MpiDefault=none
MailProg=/bin/true
ReturnToService=2
# Short enough for a test: SIGKILL 5 s after SIGTERM when a job is cancelled.
KillWait=5
MessageTimeout=10
SlurmdTimeout=60
InactiveLimit=0
$overrides
CONF
    i=0
    for n in "${SLURM_NODE_NAMES[@]}"; do
      i=$((i + 1))
      if [ "$SLURM_NODES" = 2 ]; then addr=$SLURM_NET.$i; else addr=127.0.0.1; fi
      echo "NodeName=$n NodeAddr=$addr CPUs=$cpus Boards=1 SocketsPerBoard=1 CoresPerSocket=$cpus ThreadsPerCore=1 RealMemory=$mem State=UNKNOWN"
    done
    echo "PartitionName=twinkle Nodes=ALL Default=YES MaxTime=INFINITE State=UP OverSubscribe=NO"
  } >"$SLURM_CONF"
}

# _slurm_spawn LOG NODE CMD...: CMD on NODE in the background, output to LOG; pid in SLURM_DAEMONS.
_slurm_spawn() {
  local log=$1 n=$2; shift 2
  _slurm_prefix "$n"
  "${SLURM_PREFIX[@]}" "$@" >"$log" 2>&1 &
  SLURM_DAEMONS+=($!)
}

# _slurm_wait_idle SECONDS: until sinfo shows every node idle (bounded).
_slurm_wait_idle() {
  local deadline=$((SECONDS + $1)) want=${#SLURM_NODE_NAMES[@]} idle
  while :; do
    idle=$(slurm_on sinfo -h -N -o '%N %T' 2>/dev/null | grep -c ' idle$')
    [ "$idle" = "$want" ] && return 0
    if [ $SECONDS -ge $deadline ]; then
      slurm_on sinfo -N 2>&1
      tail -20 "$SLURM_DIR"/log/*.log "$SLURM_DIR"/*.out 2>/dev/null
      fail "the Slurm cluster did not come up within $1 s ($idle of $want nodes idle)"
    fi
    sleep 0.1
  done
}

slurm_start() {
  slurm_require
  SLURM_NODES=${SLURM_NODES:-}
  if [ -z "$SLURM_NODES" ]; then
    if slurm_can_netns; then SLURM_NODES=2; else SLURM_NODES=1; fi
  fi
  if [ "$SLURM_NODES" = 2 ]; then
    slurm_can_netns || { echo "SKIP: cannot create network namespaces"; exit 77; }
    SLURM_NODE_NAMES=(slurm-n1 slurm-n2)
  else
    SLURM_NODE_NAMES=("$(hostname -s)")
  fi
  local started=$EPOCHREALTIME
  # /tmp, not $TMPDIR: the munge socket's path must stay short (a Unix socket path is < 108 bytes).
  SLURM_DIR=$(mktemp -d /tmp/twk-slurm.XXXXXX) || fail "cannot make the cluster's directory"
  SLURM_NS="twks$$"
  export SLURM_CONF="$SLURM_DIR/slurm.conf"
  _slurm_chain_exit
  # munged requires execute permission for all on every directory above its socket.
  chmod 711 "$SLURM_DIR"
  mkdir -p "$SLURM_DIR/munge" "$SLURM_DIR/munge-run" "$SLURM_DIR/ctld" "$SLURM_DIR/slurmd" \
    "$SLURM_DIR/log"
  chmod 700 "$SLURM_DIR/munge"
  chmod 755 "$SLURM_DIR/munge-run"
  local n
  for n in "${SLURM_NODE_NAMES[@]}"; do
    mkdir -p "$SLURM_DIR/$n/home" "$SLURM_DIR/$n/tmp" "$SLURM_DIR/$n/run" "$SLURM_DIR/slurmd/$n"
  done
  dd if=/dev/urandom of="$SLURM_DIR/munge/munge.key" bs=1024 count=1 status=none
  chmod 0400 "$SLURM_DIR/munge/munge.key"
  munged -F --key-file="$SLURM_DIR/munge/munge.key" --socket="$SLURM_DIR/munge-run/munge.socket" \
    --pid-file="$SLURM_DIR/munge-run/munged.pid" --log-file="$SLURM_DIR/log/munged.log" \
    --seed-file="$SLURM_DIR/munge/munged.seed" >"$SLURM_DIR/munged.out" 2>&1 &
  SLURM_DAEMONS+=($!)
  local k
  for k in $(seq 50); do  # bounded: 5 s
    [ -S "$SLURM_DIR/munge-run/munge.socket" ] && break
    if ! _slurm_running "${SLURM_DAEMONS[0]}" || [ "$k" = 50 ]; then
      cat "$SLURM_DIR/munged.out"
      echo "SKIP: munged cannot start here"
      exit 77
    fi
    sleep 0.1
  done
  [ "$SLURM_NODES" = 2 ] && _slurm_make_hosts
  _slurm_write_conf
  _slurm_spawn "$SLURM_DIR/slurmctld.out" "${SLURM_NODE_NAMES[0]}" slurmctld -D -c
  for n in "${SLURM_NODE_NAMES[@]}"; do
    _slurm_spawn "$SLURM_DIR/slurmd-$n.out" "$n" slurmd -D -N "$n"
  done
  _slurm_wait_idle 30
  SLURM_BOOT_S=$(python3 -c "print(round($EPOCHREALTIME - $started, 2))")
  echo "Slurm cluster of ${#SLURM_NODE_NAMES[@]} node(s) (${SLURM_NODE_NAMES[*]}, $SLURM_CPUS_PER_NODE CPUs each) idle after $SLURM_BOOT_S s"
}

# _slurm_pids: every live process of this cluster: in its namespaces, a daemon, with its directory
# on the command line, or with a HOME of its hosts in the environment (slurmd passes its own to
# slurmstepd; job steps and what they start inherit the submit host's).
_slurm_pids() {
  [ -n "$SLURM_DIR" ] || return 0
  local ns p
  {
    for ns in "${SLURM_NAMESPACES[@]}" "${NETNS_MADE[@]}"; do ip netns pids "$ns" 2>/dev/null; done
    printf '%s\n' "${SLURM_DAEMONS[@]}"
    pgrep -f -- "$SLURM_DIR/"
    for p in /proc/[0-9]*; do
      tr '\0' '\n' 2>/dev/null <"$p/environ" | grep -q "^HOME=$SLURM_DIR/" && echo "${p#/proc/}"
    done
  } | sort -un | while read -r p; do
    [ "$p" != $$ ] && [ "$p" != "$BASHPID" ] && _slurm_running "$p" && echo "$p"
  done
}

slurm_stop() {
  [ -n "$SLURM_DIR" ] || return 0
  local p k left
  # Jobs first, so that Slurm ends their steps itself (bounded: 10 s).
  if _slurm_running "${SLURM_DAEMONS[1]:-0}"; then
    slurm_on timeout 5 scancel --quiet --user=root 2>/dev/null
    for k in $(seq 100); do
      [ -z "$(slurm_on timeout 2 squeue -h -o %i 2>/dev/null)" ] && break
      sleep 0.1
    done
  fi
  # Daemons: SIGTERM, then (bounded: 3 s) SIGKILL; then whatever else of the cluster is left.
  for p in "${SLURM_DAEMONS[@]}"; do kill -TERM "$p" 2>/dev/null; done
  for k in $(seq 30); do
    left=""
    for p in "${SLURM_DAEMONS[@]}"; do _slurm_running "$p" && left+=" $p"; done
    [ -z "$left" ] && break
    sleep 0.1
  done
  for k in $(seq 50); do  # bounded: 5 s
    left=$(_slurm_pids)
    [ -z "$left" ] && break
    for p in $left; do kill -KILL "$p" 2>/dev/null; done
    sleep 0.1
  done
  for p in "${SLURM_DAEMONS[@]}"; do wait "$p" 2>/dev/null; done
  for p in "${SLURM_NAMESPACES[@]}" "${NETNS_MADE[@]}"; do ip netns delete "$p" 2>/dev/null; done
  for p in "${SLURM_UTS[@]}" "${NETNS_UTS[@]}"; do umount "$p" 2>/dev/null; done
  rm -rf "$SLURM_DIR"
  SLURM_DIR="" SLURM_DAEMONS=() SLURM_NAMESPACES=() SLURM_UTS=() NETNS_MADE=() NETNS_UTS=()
}
