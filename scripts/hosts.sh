#!/usr/bin/env bash
# Emulated hosts on one machine, for the multi-host tests and benchmarks: N Linux network
# namespaces on a bridge, each with its own address and, for the processes started in it by
# the rsh agent below, its own hostname and its own /dev/shm (UTS and mount namespaces). A
# host's mount and UTS namespaces are kept (bind-mounted under $dir/ns) from `up` to `down`,
# as a real host's /dev/shm outlives a job: what a job leaves there stays until `down`, and
# `shm HOST` shows it. Traffic stays on the bridge's subnet (and loopback). Needs root,
# iproute2 and util-linux (unshare, nsenter).
#
#   scripts/hosts.sh up N [RATE]   # hosts ctp-h1..ctp-hN at 10.77.0.11.., links limited to
#                                  # RATE (tc tbf, e.g. 1gbit) when given
#   scripts/hosts.sh down          # removes every namespace, link and file it made
#   scripts/hosts.sh mpirun ARGS   # Open MPI's mpirun with the hostfile, the rsh agent, shared
#                                  # memory inside a host and TCP on the bridge between hosts,
#                                  # a host that stops answering noticed within ~5 s (Open
#                                  # MPI's default keepalive takes 8 min), ranks not bound to
#                                  # cores (each host's daemon would bind its first rank to
#                                  # core 0, so every host's first rank shared one core: 2
#                                  # hosts x 1 rank decoded at half the speed of 1 rank), and
#                                  # waiting ranks yielding the CPU (every emulated host
#                                  # shares this machine's cores) (e.g. -np 4 PROGRAM)
#   scripts/hosts.sh shm HOST      # the files in host HOST's /dev/shm, one a line
#   scripts/hosts.sh check         # exit 0 if this machine can make hosts (root, ip, netns)
#
# This kernel has no netem, so latency cannot be added, only a rate limit. The hostfile and the
# agent live in $CANDLE_TP_HOME/hosts/ (default ~/.cache/candle-tp/hosts).
set -euo pipefail

home=${CANDLE_TP_HOME:-$HOME/.cache/candle-tp}
dir="$home/hosts"
bridge=ctp-br0
subnet=10.77.0
prefix=ctp-h

check() {
  [ "$(id -u)" = 0 ] || { echo "emulated hosts need root (network namespaces)"; return 1; }
  command -v ip >/dev/null || { echo "emulated hosts need iproute2's ip"; return 1; }
  command -v unshare >/dev/null || { echo "emulated hosts need util-linux's unshare"; return 1; }
  command -v nsenter >/dev/null || { echo "emulated hosts need util-linux's nsenter"; return 1; }
  ip netns add ctp-probe 2>/dev/null || { echo "this machine does not allow network namespaces"; return 1; }
  ip netns del ctp-probe
}

down() {
  for ns in $(ip netns list 2>/dev/null | awk '{print $1}' | grep "^$prefix" || true); do
    # Whatever still runs in a host (a rank left behind by a failed test) goes with it.
    for pid in $(ip netns pids "$ns" 2>/dev/null || true); do kill -9 "$pid" 2>/dev/null || true; done
    ip netns del "$ns" 2>/dev/null || true
  done
  for l in $(ip -o link show 2>/dev/null | awk -F': ' '{print $2}' | sed 's/@.*//' | grep "^v$prefix" || true); do
    ip link del "$l" 2>/dev/null || true
  done
  ip link del "$bridge" 2>/dev/null || true
  # The hosts' kept mount and UTS namespaces (and with them each host's /dev/shm).
  for f in "$dir"/ns/*.mnt "$dir"/ns/*.uts; do
    [ -e "$f" ] && umount "$f" 2>/dev/null || true
  done
  mountpoint -q "$dir/ns" 2>/dev/null && umount "$dir/ns" 2>/dev/null || true
  rm -rf "$dir"
}

# Lists host $1's /dev/shm.
shm() {
  local host=${1:?hosts.sh shm HOST}
  [ -e "$dir/ns/$host.mnt" ] || { echo "hosts.sh shm: no host $host" >&2; exit 1; }
  nsenter --mount="$dir/ns/$host.mnt" ls -A /dev/shm
}

up() {
  local n=$1 rate=${2:-}
  [[ "$n" =~ ^[1-9][0-9]?$ ]] || { echo "hosts.sh up N: N is 1 to 99, got '$n'" >&2; exit 2; }
  down
  check >/dev/null || { check; exit 1; }
  mkdir -p "$dir/ns"
  # Namespace files can only be bind-mounted on a private mount.
  mount --bind "$dir/ns" "$dir/ns"
  mount --make-private "$dir/ns"
  ip link add "$bridge" type bridge
  ip addr add "$subnet.1/24" dev "$bridge"
  ip link set "$bridge" up
  : >"$dir/hostfile"
  for i in $(seq 1 "$n"); do
    local ns="$prefix$i" veth="v$prefix$i"
    ip netns add "$ns"
    ip link add "$veth" type veth peer name eth0 netns "$ns"
    ip link set "$veth" master "$bridge" up
    ip netns exec "$ns" ip addr add "$subnet.$((10 + i))/24" dev eth0
    ip netns exec "$ns" ip link set eth0 up
    ip netns exec "$ns" ip link set lo up
    if [ -n "$rate" ]; then
      # Both directions: the bridge side shapes what enters the host, the host side what leaves.
      tc qdisc add dev "$veth" root tbf rate "$rate" burst 256kb latency 100ms
      ip netns exec "$ns" tc qdisc add dev eth0 root tbf rate "$rate" burst 256kb latency 100ms
    fi
    # The host's own hostname and /dev/shm, kept until `down`.
    touch "$dir/ns/$ns.mnt" "$dir/ns/$ns.uts"
    unshare --mount="$dir/ns/$ns.mnt" --uts="$dir/ns/$ns.uts" --propagation private \
      sh -c 'hostname "$0" && mount -t tmpfs -o mode=1777 tmpfs /dev/shm' "$ns"
    echo "$ns slots=64" >>"$dir/hostfile"
  done
  # The rsh agent mpirun uses to start its daemon on host NAME: the command runs in the host's
  # network namespace, with its hostname and its /dev/shm (the host's kept namespaces).
  cat >"$dir/agent.sh" <<AGENT
#!/usr/bin/env bash
# usage (by mpirun): agent.sh [ssh options] HOST COMMAND...
while [ \$# -gt 0 ] && [[ "\$1" == -* ]]; do shift; done
host=\$1; shift
exec nsenter --net="/run/netns/\$host" --mount="$dir/ns/\$host.mnt" --uts="$dir/ns/\$host.uts" \\
  sh -c 'eval "\$*"' "\$host" "\$@"
AGENT
  chmod +x "$dir/agent.sh"
  echo "$n emulated hosts (${rate:-unlimited} links): $(cut -d' ' -f1 "$dir/hostfile" | tr '\n' ' ')"
}

run_mpirun() {
  [ -f "$dir/hostfile" ] || { echo "hosts.sh mpirun: no hosts (run hosts.sh up N first)" >&2; exit 1; }
  OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 exec mpirun \
    --hostfile "$dir/hostfile" \
    --mca plm_rsh_agent "$dir/agent.sh" \
    --mca btl self,vader,tcp \
    --mca btl_tcp_if_include "$subnet.0/24" \
    --mca oob_tcp_if_include "$subnet.0/24" \
    --mca oob_tcp_keepalive_time 2 --mca oob_tcp_keepalive_intvl 1 \
    --mca oob_tcp_keepalive_probes 3 --mca mpi_yield_when_idle 1 \
    --bind-to none \
    "$@"
}

case "${1:-}" in
  up) shift; up "$@" ;;
  down) down ;;
  mpirun) shift; run_mpirun "$@" ;;
  shm) shift; shm "$@" ;;
  check) check ;;
  *) sed -n '2,26p' "$0" >&2; exit 2 ;;
esac
