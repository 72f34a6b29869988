# "Hosts" as network namespaces for the cluster and Slurm tests: each host its own network and UTS
# namespace, all on one bridge, nothing routed from the root namespace. Source it after lib.sh.
#
# netns_hosts NS NET DIR NAME:HOSTNAME...
#   A switch (bridge br0 in namespace NS-sw) and one namespace NS-NAME per host, joined to it by a
#   veth pair (port-NAME on the switch, eth0 in the host, MTU 1500 like Ethernet), with address
#   NET.i/24 (i from 1) and its own HOSTNAME in a UTS namespace kept by a bind mount at
#   DIR/uts/NAME (no process needed). Appends what it made to NETNS_MADE (namespaces) and
#   NETNS_UTS (mounts) as it goes: the caller's cleanup removes what these list, also when this
#   fails half way. Returns once every port of the switch forwards (bounded: 5 s).
NETNS_MADE=()
NETNS_UTS=()
netns_hosts() {
  local ns=$1 net=$2 dir=$3
  shift 3
  ip netns add "$ns-sw" || fail "cannot create namespace $ns-sw"
  NETNS_MADE+=("$ns-sw")
  ip -n "$ns-sw" link add br0 type bridge || fail "cannot create the bridge"
  ip -n "$ns-sw" link set br0 up
  mkdir -p "$dir/uts"
  local i=0 spec name host k
  for spec in "$@"; do
    i=$((i + 1))
    name=${spec%%:*}
    host=${spec#*:}
    ip netns add "$ns-$name" || fail "cannot create namespace $ns-$name"
    NETNS_MADE+=("$ns-$name")
    ip -n "$ns-sw" link add "port-$name" mtu 1500 type veth peer name eth0 mtu 1500 \
      netns "$ns-$name" || fail "cannot create the veth pair of $name"
    ip -n "$ns-sw" link set "port-$name" master br0
    ip -n "$ns-sw" link set "port-$name" up
    ip -n "$ns-$name" link set lo up
    ip -n "$ns-$name" addr add "$net.$i/24" dev eth0
    ip -n "$ns-$name" link set eth0 up
    touch "$dir/uts/$name"
    NETNS_UTS+=("$dir/uts/$name")
    unshare --uts="$dir/uts/$name" hostname "$host" ||
      fail "cannot create the UTS namespace of $name"
  done
  for spec in "$@"; do
    name=${spec%%:*}
    for k in $(seq 50); do
      ip -n "$ns-sw" -d link show "port-$name" | grep -q "state forwarding" && break
      [ "$k" -lt 50 ] || fail "the switch's port to $name does not forward"
      sleep 0.1
    done
  done
}
