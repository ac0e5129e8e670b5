#!/usr/bin/env bash
# Instructions per request under edge-bench's `flood` shape: wrk with 64
# connections, one user, a token bucket of 100/s, so nearly every request
# is refused. benches/callgrind.sh counts one connection at a time; this
# counts what many concurrent connections cost (batching, timers, the
# connection tasks) with the same deterministic counter. wrk runs 6 s after
# a 2 s warm-up; the counters are zeroed between them.
#
#   benches/callgrind_flood.sh PATH-TO-TOLLGATE OUTPUT-FILE
#   -> requests=... instr=... per_req=...
#
# Needs valgrind, wrk and nginx (the upstream).
set -euo pipefail
BIN=$1; OUTF=$2
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
USERS_LUA="$HERE/../../shared/bench/users.lua"
[ -f "$USERS_LUA" ] || { echo "callgrind_flood: needs edge-bench's users.lua at $USERS_LUA" >&2; exit 2; }
free_port() { python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])'; }
UP=$(free_port); P=$(free_port); A=$(free_port); D=$(mktemp -d)
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
backend = "memory"
[[upstream]]
name = "bench"
url = "http://127.0.0.1:$UP"
[[route]]
path_prefix = "/"
upstream = "bench"
E2
printf '[[rule]]\nname = "per-user"\nkey = ["header:x-user-id"]\nalgorithm = "token_bucket"\nlimit = 100\nwindow = "1s"\n' > $D/rules.toml
TOLLGATE_WORKERS=1 RUST_LOG=warn valgrind --tool=callgrind --callgrind-out-file=$OUTF $BIN --config $D/t.toml > $D/tg.log 2>&1 & TG=$!
for i in $(seq 300); do (echo > /dev/tcp/127.0.0.1/$P) 2>/dev/null && break; sleep 0.1; done
USERS=1 taskset -c 0 wrk -t1 -c64 -d2s -s "$USERS_LUA" "http://127.0.0.1:$P" >/dev/null 2>&1 || true
callgrind_control --zero $TG >/dev/null 2>&1 || true
OUT=$(USERS=1 taskset -c 0 wrk -t1 -c64 -d6s -s "$USERS_LUA" "http://127.0.0.1:$P" 2>&1)
callgrind_control --dump $TG >/dev/null 2>&1 || true; sleep 1
N=$(echo "$OUT" | grep -o "requests=[0-9]*" | head -1 | cut -d= -f2)
TOT=$(callgrind_annotate $OUTF.* 2>/dev/null | awk '/PROGRAM TOTALS/ {gsub(",","",$1); print $1}' | tail -1)
echo "requests=$N instr=$TOT per_req=$((TOT / N))"
kill $TG $NG; sleep 0.5; rm -rf $D
