#!/usr/bin/env bash
# The replica channel's per-step cost across a node boundary, rehearsed on one machine: the
# server in a network namespace of its own, the client in the root namespace, joined by a veth
# pair on a private /24 (10.231.N.1 / .2). Needs root and `ip netns`; removes the namespace
# and the link on exit, whatever happens.
#   sudo bash benchmarks/cross_node.sh [--bench channel|propose] [--tls] [--steps N]
# channel: the replica's step socket (benchmarks/channel_step.py); propose: a drafter's gRPC
# ProposeStream (benchmarks/propose_step.py).
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
py="${PYTHON:-python}"
tls=""
steps=2000
bench=channel
while [ $# -gt 0 ]; do
  case "$1" in
    --tls) tls=1 ;;
    --steps) steps="$2"; shift ;;
    --bench) bench="$2"; shift ;;
    *) echo "unknown argument $1" >&2; exit 2 ;;
  esac
  shift
done
ns="specd-bench-$$"
a="vba$$"; b="vbb$$"
n=$(( $$ % 40 + 200 ))
while ip -4 -o addr show | grep -q " 10\.231\.$n\."; do n=$(( n + 1 )); done
dir="$(mktemp -d)"
server_pid=""
cleanup() {
  [ -n "$server_pid" ] && kill "$server_pid" 2>/dev/null || true
  for pid in $(ip netns pids "$ns" 2>/dev/null); do kill -9 "$pid" 2>/dev/null || true; done
  ip netns del "$ns" 2>/dev/null || true
  ip link del "$a" 2>/dev/null || true
  rm -rf "$dir"
}
trap cleanup EXIT
ip netns add "$ns"
ip link add "$a" type veth peer name "$b"
ip link set "$b" netns "$ns"
ip addr add "10.231.$n.1/24" dev "$a"
ip link set "$a" up
ip netns exec "$ns" ip addr add "10.231.$n.2/24" dev "$b"
ip netns exec "$ns" ip link set "$b" up
ip netns exec "$ns" ip link set lo up
extra=()
[ -n "$tls" ] && extra=(--tls-dir "$dir")
mkfifo "$dir/in"
ip netns exec "$ns" env PYTHONPATH="$root" "$py" "$root/benchmarks/${bench}_step.py" \
  --serve "10.231.$n.2" "${extra[@]}" < "$dir/in" > "$dir/port" &
server_pid=$!
exec 3> "$dir/in"   # the server serves until this closes
for _ in $(seq 200); do [ -s "$dir/port" ] && break; sleep 0.1; done
port="$(head -n1 "$dir/port")"
PYTHONPATH="$root" "$py" "$root/benchmarks/${bench}_step.py" --connect "10.231.$n.2:$port" \
  --steps "$steps" "${extra[@]}"
exec 3>&-
wait "$server_pid" || true
server_pid=""
