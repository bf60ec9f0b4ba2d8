#!/bin/sh
# One node of the docker-compose swarm (docker/docker-compose.yml); installed in the image as
# dtnode-swarm-entry.
#
#   dtnode-swarm-entry bootstrap [dtnode join flags...]
#   dtnode-swarm-entry worker [dtnode join flags...]
#
# A worker joins through the bootstrap node's multiaddr, which ends in the bootstrap's libp2p peer
# id. Every node keeps its identity in its run dir (--identity-path, made on first start), so a
# node's peer id and multiaddr survive restarts; the nodes share one volume, $SWARM_RUNS (/runs):
#
# - bootstrap: runs `dtnode join` on fixed ports announcing its host name, which writes
#   $SWARM_RUNS/bootstrap/node.json (peer id, multiaddrs) once the swarm side is up.
# - worker: (compose starts it once the bootstrap is healthy) waits for that file (at most
#   $SWARM_WAIT_SECONDS), then runs `dtnode join --peers` with the multiaddrs in it, announcing its
#   own container address. If the bootstrap is unreachable the join fails and exits non-zero; the
#   compose file restarts it.
#
# Every node's run directory (metrics.jsonl, checkpoints, identity.key) is in the volume: the
# bootstrap's $SWARM_RUNS/bootstrap, a worker's $SWARM_RUNS/worker-<slot>. A worker takes the lowest
# slot no running worker holds: it locks $SWARM_RUNS/worker-<slot>.lock (flock) and keeps the lock
# open for as long as its node runs (the descriptor stays open across exec; the kernel drops the
# lock when the process dies, however it dies). So N workers use worker-1..worker-N whatever their
# container names, a worker killed and restarted takes its run dir back (the others hold theirs)
# and resumes from its checkpoint, and `down` / `up` finds the same run dirs instead of new ones.
# The training settings come from DTNODE_* variables (see `dtnode join --help`).
set -eu

usage="usage: dtnode-swarm-entry bootstrap|worker [dtnode join flags...]"
role="${1:?$usage}"
shift
runs="${SWARM_RUNS:-/runs}"
wait_seconds="${SWARM_WAIT_SECONDS:-180}"
max_slots="${SWARM_MAX_WORKERS:-64}"
grpc_port=7000
dht_port=7001
host_name="$(cat /etc/hostname)"
bootstrap_json="$runs/bootstrap/node.json"

case "$role" in
  bootstrap)
    echo "$runs/bootstrap" >/tmp/dtnode-run-dir
    exec dtnode join --run-dir "$runs/bootstrap" --listen "0.0.0.0:$grpc_port" \
      --dht-listen "0.0.0.0:$dht_port" --announce "$host_name" \
      --identity-path "$runs/bootstrap/identity.key" "$@"
    ;;
  worker)
    waited=0
    while [ ! -s "$bootstrap_json" ]; do
      if [ "$waited" -ge "$wait_seconds" ]; then
        echo "dtnode-swarm-entry: $bootstrap_json did not appear within ${wait_seconds}s" >&2
        exit 1
      fi
      sleep 1
      waited=$((waited + 1))
    done
    # The file is written in one call, but may be caught mid-write: parse it, retrying briefly.
    peers=""
    for _ in 1 2 3 4 5; do
      peers="$(python3 -c 'import json, sys; print(",".join(json.load(open(sys.argv[1]))["multiaddrs"]))' \
        "$bootstrap_json" 2>/dev/null)" && break
      sleep 1
    done
    [ -n "$peers" ] || { echo "dtnode-swarm-entry: no multiaddrs in $bootstrap_json" >&2; exit 1; }
    # The address other containers reach this one at (its entry in the compose network's DNS).
    address="$(python3 -c 'import socket; print(socket.gethostbyname(socket.gethostname()))')"
    slot=1
    while :; do
      exec 9>"$runs/worker-$slot.lock"
      if flock --nonblock 9; then
        break
      fi
      exec 9>&-
      slot=$((slot + 1))
      if [ "$slot" -gt "$max_slots" ]; then
        echo "dtnode-swarm-entry: all $max_slots worker slots in $runs are held by running workers" >&2
        exit 1
      fi
    done
    run_dir="$runs/worker-$slot"
    echo "dtnode-swarm-entry: worker slot $slot (run dir $run_dir)" >&2
    echo "$run_dir" >/tmp/dtnode-run-dir  # for `docker exec`: which run dir this container's node has
    exec dtnode join --run-dir "$run_dir" --listen "0.0.0.0:$grpc_port" \
      --dht-listen "0.0.0.0:$dht_port" --announce "$address" --peers "$peers" \
      --identity-path "$run_dir/identity.key" "$@"
    ;;
  *)
    echo "dtnode-swarm-entry: unknown role '$role'; $usage" >&2
    exit 2
    ;;
esac
