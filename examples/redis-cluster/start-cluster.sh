#!/usr/bin/env bash
# Starts a throwaway Redis Cluster on this machine, 3 masters + 3 replicas,
# from the redis-server and redis-cli binaries (Debian: apt-get install
# redis-server redis-tools), for trying two tollgate instances against it:
#
#   examples/redis-cluster/start-cluster.sh                  # ports 7000-7005; Ctrl-C stops and deletes it
#   BASE_PORT=30000 examples/redis-cluster/start-cluster.sh  # ports 30000-30005
#   examples/redis-cluster/start-cluster.sh --detach         # leave it running; prints how to stop it
#
# Every node gets its own directory and cluster config file under a
# temporary directory (nothing is persisted: no RDB, no AOF). The cluster
# bus of each node listens on its port + 10000, so BASE_PORT + 5 must stay
# below 55536. When the cluster is ready (cluster_state:ok on every node,
# every replica linked) the script prints the URL for tollgate's
# [store] url; tollgate-a.toml and tollgate-b.toml next to this script use
# the default ports.
set -euo pipefail

BASE_PORT="${BASE_PORT:-7000}"
DETACH=0
case "${1:-}" in
  --detach) DETACH=1 ;;
  "") ;;
  -h|--help) sed -n 2,16p "$0"; exit 0 ;;
  *) echo "start-cluster.sh: unknown argument $1 (try --help)" >&2; exit 2 ;;
esac

for bin in redis-server redis-cli; do
  command -v "$bin" >/dev/null || { echo "start-cluster.sh: $bin not found (apt-get install redis-server redis-tools)" >&2; exit 1; }
done
if [ $((BASE_PORT + 5 + 10000)) -gt 65535 ]; then
  echo "start-cluster.sh: BASE_PORT $BASE_PORT leaves no room for the bus ports (port + 10000)" >&2
  exit 2
fi
PORTS=()
for i in 0 1 2 3 4 5; do
  port=$((BASE_PORT + i))
  for p in "$port" $((port + 10000)); do
    if (exec 3<>"/dev/tcp/127.0.0.1/$p") 2>/dev/null; then
      echo "start-cluster.sh: something already listens on 127.0.0.1:$p" >&2
      exit 1
    fi
  done
  PORTS+=("$port")
done

DATA="$(mktemp -d /tmp/tollgate-redis-cluster.XXXXXX)"
PIDS=()
cleanup() {
  for pid in "${PIDS[@]}"; do kill "$pid" 2>/dev/null || true; done
  wait 2>/dev/null || true
  rm -rf "$DATA"
}
if [ "$DETACH" = 0 ]; then
  trap cleanup EXIT
  trap 'exit 130' INT TERM
fi

for port in "${PORTS[@]}"; do
  mkdir -p "$DATA/$port"
  redis-server --port "$port" --bind 127.0.0.1 --dir "$DATA/$port" \
    --cluster-enabled yes --cluster-config-file "nodes-$port.conf" --cluster-node-timeout 1000 \
    --save "" --appendonly no --repl-diskless-sync yes --repl-diskless-sync-delay 0 \
    --logfile redis.log --daemonize no >/dev/null 2>&1 &
  PIDS+=($!)
done
echo "${PIDS[*]}" >"$DATA/pids"

for port in "${PORTS[@]}"; do
  for _ in $(seq 1 100); do
    [ "$(redis-cli -p "$port" PING 2>/dev/null)" = PONG ] && break
    sleep 0.1
  done
done

NODES=()
for port in "${PORTS[@]}"; do NODES+=("127.0.0.1:$port"); done
redis-cli --cluster create "${NODES[@]}" --cluster-replicas 1 --cluster-yes >"$DATA/create.log" 2>&1 || {
  cat "$DATA/create.log" >&2
  exit 1
}

ready() {
  for port in "${PORTS[@]}"; do
    redis-cli -p "$port" CLUSTER INFO | grep -q '^cluster_state:ok' || return 1
    redis-cli -p "$port" CLUSTER INFO | grep -q '^cluster_known_nodes:6' || return 1
    local repl
    repl="$(redis-cli -p "$port" INFO replication)"
    grep -q '^role:master' <<<"$repl" || grep -q '^master_link_status:up' <<<"$repl" || return 1
  done
}
for _ in $(seq 1 300); do
  ready && break
  sleep 0.1
done
ready || { echo "start-cluster.sh: the cluster did not become ready; logs under $DATA" >&2; exit 1; }

URL="redis-cluster://127.0.0.1:${PORTS[0]}?node=127.0.0.1:${PORTS[1]}&node=127.0.0.1:${PORTS[2]}"
echo "cluster ready: 3 masters + 3 replicas on ports ${PORTS[0]}-${PORTS[5]}, data in $DATA"
redis-cli -p "${PORTS[0]}" CLUSTER NODES | awk '{split($2, a, "@"); print "  " a[1], ($3 ~ /master/ ? "master" : "replica"), $9}'
echo
echo "[store] url = \"$URL\""
if [ "$DETACH" = 1 ]; then
  echo
  echo "left running; stop it with:  kill \$(cat $DATA/pids) && rm -rf $DATA"
  exit 0
fi
echo "Ctrl-C stops the cluster and deletes its data."
wait
