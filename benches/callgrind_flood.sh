#!/usr/bin/env bash
# Instructions per request under edge-bench's `flood` shape: wrk with 64
# connections, one user, a token bucket of 100/s, so nearly every request
# is refused. benches/callgrind.sh counts one connection at a time; this
# counts what many concurrent connections cost (batching, timers, the
# connection tasks) with the same deterministic counter. wrk runs 6 s after
# a 2 s warm-up; the counters are zeroed between them.
#
#   benches/callgrind_flood.sh PATH-TO-TOLLGATE OUTPUT-FILE
#   -> requests=... non2xx=... instr=... per_req=... [redis_calls=...]
#
# The other shapes of edge-bench, through the environment: USERS (1; 10000
# is `spread`'s), CONNS (64; 1 is `latency`'s closed loop) and STORE
# (memory, redis: one Redis, cluster: three masters, started here), and
# LIMIT (100 per second; edge-bench's `allow` and `latency` use 1000000,
# which a Redis store serves mostly from leases):
#   USERS=10000 STORE=cluster benches/callgrind_flood.sh PATH OUT   # spread
#   USERS=10000 CONNS=1 LIMIT=1000000 STORE=cluster ...              # latency
#
# RATE (requests per second) replaces wrk with benches/paced_client.py:
# the same RATE x SECS (12) requests, users from a seeded generator, at
# fixed times, after one second of the same pace (seed 7) as warm-up. Use
# it to compare builds on a Redis store: under wrk each build is driven at
# its own pace under valgrind, and what the store does per request (how
# many refusals the over-limit cache answers, how often leases renew)
# moves with the pace. 250 per second over CONNS=16 stays paced:
#   RATE=250 CONNS=16 USERS=1 STORE=cluster benches/callgrind_flood.sh PATH OUT
#
# Needs valgrind, wrk and nginx (the upstream); redis-server and redis-cli
# for STORE=redis or cluster.
set -euo pipefail
BIN=$1; OUTF=$2
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
USERS_LUA="$HERE/../../shared/bench/users.lua"
[ -f "$USERS_LUA" ] || { echo "callgrind_flood: needs edge-bench's users.lua at $USERS_LUA" >&2; exit 2; }
free_port() { python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])'; }
# A cluster node also listens on its port + 10000 (the cluster bus): both
# must be free, and below 65536.
bus_port() { python3 -c '
import random, socket
while True:
    p = random.randint(20000, 45000)
    try:
        for q in (p, p + 10000):
            s = socket.socket(); s.bind(("127.0.0.1", q)); s.close()
        print(p); break
    except OSError:
        pass'; }
UP=$(free_port); P=$(free_port); A=$(free_port); D=$(mktemp -d)
USERS=${USERS:-1}; CONNS=${CONNS:-64}; STORE=${STORE:-memory}; LIMIT=${LIMIT:-100}
REDIS=()
case "$STORE" in
  memory) STORE_TOML='backend = "memory"' ;;
  redis)
    R=$(free_port); REDIS=("$R")
    taskset -c 0 redis-server --port "$R" --bind 127.0.0.1 --save "" --appendonly no --dir "$D" >/dev/null 2>&1 &
    STORE_TOML="backend = \"redis\"
url = \"redis://127.0.0.1:$R\"" ;;
  cluster)
    for _ in 1 2 3; do R=$(bus_port); REDIS+=("$R"); mkdir -p "$D/c$R"
      taskset -c 0 redis-server --port "$R" --bind 127.0.0.1 --cluster-enabled yes --cluster-config-file "$D/c$R/nodes.conf" \
        --save "" --appendonly no --dir "$D/c$R" >/dev/null 2>&1 &
    done
    for r in "${REDIS[@]}"; do for _ in $(seq 100); do redis-cli -p "$r" ping >/dev/null 2>&1 && break; sleep 0.1; done; done
    redis-cli --cluster create "${REDIS[@]/#/127.0.0.1:}" --cluster-yes >"$D/create.log" 2>&1 \
      || { echo "callgrind_flood: the cluster did not form:" >&2; cat "$D/create.log" >&2; exit 1; }
    for _ in $(seq 100); do redis-cli -p "${REDIS[0]}" cluster info | grep -q cluster_state:ok && break; sleep 0.1; done
    STORE_TOML="backend = \"redis\"
url = \"redis-cluster://127.0.0.1:${REDIS[0]}?node=127.0.0.1:${REDIS[1]}&node=127.0.0.1:${REDIS[2]}\"" ;;
  *) echo "callgrind_flood: STORE is memory, redis or cluster" >&2; exit 2 ;;
esac
cat > $D/up.conf <<E2
worker_processes 1; daemon off; pid $D/ng.pid; error_log $D/err.log;
events { worker_connections 1024; }
http { access_log off; server { listen 127.0.0.1:$UP; keepalive_requests 10000000; location / { return 200 "ok\n"; } } }
E2
PATH="$PATH:/usr/sbin" taskset -c 0 nginx -p $D -c $D/up.conf & NG=$!
cat > $D/t.toml <<E2
[listen]
proxy = "127.0.0.1:$P"
admin = "127.0.0.1:$A"
[rules]
path = "$D/rules.toml"
[store]
$STORE_TOML
[[upstream]]
name = "bench"
url = "http://127.0.0.1:$UP"
[[route]]
path_prefix = "/"
upstream = "bench"
E2
printf '[[rule]]\nname = "per-user"\nkey = ["header:x-user-id"]\nalgorithm = "token_bucket"\nlimit = %s\nwindow = "1s"\n' "$LIMIT" > $D/rules.toml
TOLLGATE_WORKERS=1 RUST_LOG=warn valgrind --tool=callgrind --callgrind-out-file=$OUTF $BIN --config $D/t.toml > $D/tg.log 2>&1 & TG=$!
for i in $(seq 300); do (echo > /dev/tcp/127.0.0.1/$P) 2>/dev/null && break; sleep 0.1; done
# After the warm-up: tollgate's counters and the store's call counts from zero.
start_counting() {
  callgrind_control --zero $TG >/dev/null 2>&1 || true
  for r in "${REDIS[@]}"; do redis-cli -p "$r" config resetstat >/dev/null; done
}
if [ -n "${RATE:-}" ]; then
  taskset -c 0 python3 "$HERE/paced_client.py" "$P" "$RATE" 1 "$CONNS" "$USERS" 7 >/dev/null
  start_counting
  OUT=$(taskset -c 0 python3 "$HERE/paced_client.py" "$P" "$RATE" "${SECS:-12}" "$CONNS" "$USERS" 2>&1)
  LATE=$(echo "$OUT" | grep -o "late=[0-9]*" | cut -d= -f2)
  [ "${LATE:-0}" -gt 0 ] && echo "callgrind_flood: $LATE requests went out late: lower RATE" >&2
else
  USERS=$USERS taskset -c 0 wrk -t1 -c"$CONNS" -d2s -s "$USERS_LUA" "http://127.0.0.1:$P" >/dev/null 2>&1 || true
  start_counting
  OUT=$(USERS=$USERS taskset -c 0 wrk -t1 -c"$CONNS" -d6s -s "$USERS_LUA" "http://127.0.0.1:$P" 2>&1)
fi
callgrind_control --dump $TG >/dev/null 2>&1 || true; sleep 1
N=$(echo "$OUT" | grep -o "requests=[0-9]*" | head -1 | cut -d= -f2)
TOT=$(callgrind_annotate $OUTF.* 2>/dev/null | awk '/PROGRAM TOTALS/ {gsub(",","",$1); print $1}' | tail -1)
NON=$(echo "$OUT" | grep -o "non2xx=[0-9]*" | head -1)
# The store's scripts run while counting (Redis stores): what the store
# was asked moves the count, so it is printed beside it.
CALLS=""
if [ ${#REDIS[@]} -gt 0 ]; then
  CALLS=" redis_calls=$(for r in "${REDIS[@]}"; do redis-cli -p "$r" info commandstats; done | awk -F'[:=,]' '/^cmdstat_(fcall|evalsha|eval):/ {s += $3} END {print s + 0}')"
fi
echo "requests=$N $NON instr=$TOT per_req=$((TOT / N))$CALLS"
kill $TG $NG; sleep 0.5
for r in "${REDIS[@]}"; do redis-cli -p "$r" shutdown nosave >/dev/null 2>&1 || true; done
rm -rf $D
