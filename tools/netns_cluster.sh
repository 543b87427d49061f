#!/usr/bin/env bash
# A handoff cluster across network namespaces on one machine: the proxy, decode
# and each prefill stage in a namespace of its own, each with one veth whose
# other end is on a bridge (in a namespace of its own too, so the host's own
# network is not touched). Root only (ip netns).
#
#   tools/netns_cluster.sh net-up   NAME PP   # namespaces, veths, bridge, addresses
#   tools/netns_cluster.sh net-down NAME PP   # removes them
#   tools/netns_cluster.sh start    NAME CONFIG [HANDOFF]   # net-up, then every role, in the background
#   tools/netns_cluster.sh stop     NAME CONFIG             # kills the roles, net-down
#
# Namespaces: NAME-proxy, NAME-decode, NAME-s0 .. NAME-s{PP-1}, NAME-br (the
# bridge). Inside each role namespace the veth is called hv0 (so a topology's
# `[transport.ucx] net_devices = "hv0"` fits every role) with the address
#   proxy 10.77.0.1, decode 10.77.0.2, stage s 10.77.0.(10+s)   (/24)
# The proxy's public listener stays on the proxy namespace's loopback, port
# 8000: `ip netns exec NAME-proxy curl -s localhost:8000/health`.
#
# `start` needs the cluster secret (HANDOFF_CLUSTER_SECRET_FILE): every listener
# but the public one binds beyond loopback. Each role's log is
# /tmp/NAME-ROLE.log and its pid /tmp/NAME-ROLE.pid; who restarts a killed
# role is up to you (a per-host supervisor: run the same line again, see
# docs/serving.md). tests/netns_cluster.rs drives the same layout.
set -euo pipefail

cmd=${1:?usage: $0 net-up|net-down|start|stop NAME ...}
name=${2:?NAME}

roles() { # the role namespaces' suffixes for PP stages
  local pp=$1
  echo proxy decode
  for ((s = 0; s < pp; s++)); do echo "s$s"; done
}

addr_of() {
  case $1 in
    proxy) echo 10.77.0.1 ;;
    decode) echo 10.77.0.2 ;;
    s*) echo "10.77.0.$((10 + ${1#s}))" ;;
  esac
}

net_up() {
  local pp=$1 i=0 br="$name-br"
  ip netns add "$br"
  ip -n "$br" link add hbr0 type bridge
  ip -n "$br" link set lo up
  ip -n "$br" link set hbr0 up
  for r in $(roles "$pp"); do
    local ns="$name-$r" peer="hp$i"
    ip netns add "$ns"
    # Created inside the bridge's namespace, one end moved to the role's.
    ip -n "$br" link add "$peer" type veth peer name hv0 netns "$ns"
    ip -n "$br" link set "$peer" master hbr0 up
    ip -n "$ns" addr add "$(addr_of "$r")/24" dev hv0
    ip -n "$ns" link set lo up
    ip -n "$ns" link set hv0 up
    i=$((i + 1))
  done
}

net_down() {
  local pp=$1
  for r in $(roles "$pp"); do ip netns del "$name-$r" 2>/dev/null || true; done
  ip netns del "$name-br" 2>/dev/null || true
}

pp_of() { # PP from a topology file's [prefill] pp
  awk '/^\[prefill\]/{p=1; next} /^\[/{p=0} p && $1=="pp"{print $3; exit}' "$1"
}

case $cmd in
  net-up) net_up "${3:?PP}" ;;
  net-down) net_down "${3:?PP}" ;;
  start)
    config=${3:?CONFIG}
    bin=${4:-handoff}
    : "${HANDOFF_CLUSTER_SECRET_FILE:?set HANDOFF_CLUSTER_SECRET_FILE (a 0600 file of 64 hex digits)}"
    pp=$(pp_of "$config")
    net_up "$pp"
    run() { # ROLE ARGS...: the role in its namespace, in the background
      local r=$1
      shift
      ip netns exec "$name-$r" "$bin" "$@" >"/tmp/$name-$r.log" 2>&1 &
      echo $! >"/tmp/$name-$r.pid"
    }
    p=$(addr_of proxy)
    run proxy proxy --config "$config" --host 127.0.0.1 --port 8000 --bind "$p:8001" --advertise "$p"
    d=$(addr_of decode)
    run decode decode --config "$config" --proxy "$p:8001" --bind "$d:7100" --advertise "$d" --transport-bind "$d:7200" --transport-advertise "$d"
    for ((s = 0; s < pp; s++)); do
      a=$(addr_of "s$s")
      run "s$s" prefill --config "$config" --stage "$s" --proxy "$p:8001" --bind "$a:7100" --advertise "$a" --transport-bind "$a:0" --transport-advertise "$a"
    done
    echo "started; try: ip netns exec $name-proxy curl -s localhost:8000/health"
    ;;
  stop)
    config=${3:?CONFIG}
    pp=$(pp_of "$config")
    for r in $(roles "$pp"); do
      [ -f "/tmp/$name-$r.pid" ] && kill "$(cat "/tmp/$name-$r.pid")" 2>/dev/null || true
      rm -f "/tmp/$name-$r.pid"
    done
    sleep 0.5
    net_down "$pp"
    ;;
  *) echo "unknown command $cmd" >&2; exit 2 ;;
esac
