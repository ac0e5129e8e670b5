#!/usr/bin/env bash
# What edge-bench can measure at most on this machine, whatever the proxy:
# the same wrk script and CPU layout as edge-bench (wrk and the upstream on
# CPU 0, the server under test alone on CPU 1), with servers that do less
# than any rate-limiting proxy can.
#
#   benches/ceiling.sh [--duration S]
#
# - allow ceiling: wrk straight to the upstream (edge-bench's `direct`). A
#   proxy only adds work on CPU 0 (the upstream's and wrk's sides of the
#   sockets are the same; the proxy's wake-ups come on top), so no proxy's
#   `allow` can pass it.
# - flood ceiling: nginx on CPU 1 answering every request 429 from its
#   config, with no limiting, no key and no upstream. Past this, wrk on
#   CPU 0 is what saturates.
# - hop latency: one connection through nginx doing nothing but
#   `proxy_pass`, against wrk straight to the upstream: what crossing
#   between the two CPUs costs per request, before any rate limiting.
#
# Prints one CEILING line per measurement.
set -euo pipefail
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
WRK_SCRIPT="${WRK_SCRIPT:-$HERE/../../shared/bench/users.lua}"
DURATION=5
while [ $# -gt 0 ]; do
  case "$1" in
    --duration) DURATION="$2"; shift 2 ;;
    *) echo "ceiling: unknown argument $1" >&2; exit 2 ;;
  esac
done
PATH="$PATH:/usr/sbin"
for tool in wrk nginx taskset; do
  command -v "$tool" >/dev/null || { echo "ceiling: $tool not found (apt-get install wrk nginx-light)" >&2; exit 2; }
done
[ -f "$WRK_SCRIPT" ] || { echo "ceiling: no wrk script at $WRK_SCRIPT (set WRK_SCRIPT)" >&2; exit 2; }

WORK="$(mktemp -d /tmp/ceiling.XXXXXX)"
PIDS=()
cleanup() {
  for p in "${PIDS[@]:-}"; do [ -n "$p" ] && kill "$p" 2>/dev/null || true; done
  sleep 0.3
  rm -rf "$WORK"
}
trap cleanup EXIT

UP=18181; FIXED=18182; PASS=18183
wait_port() { for _ in $(seq 1 100); do (echo > /dev/tcp/127.0.0.1/"$1") 2>/dev/null && return 0; sleep 0.1; done; echo "ceiling: nothing listens on $1" >&2; return 1; }
nginx_on() { # name cpu port body-of-server-block
  mkdir -p "$WORK/$1"
  cat > "$WORK/$1/nginx.conf" <<EOF
worker_processes 1; daemon off; pid $WORK/$1/nginx.pid; error_log $WORK/$1/error.log;
events { worker_connections 8192; }
http { access_log off;
  upstream up { server 127.0.0.1:$UP; keepalive 128; }
  server { listen 127.0.0.1:$3 backlog=4096; keepalive_requests 10000000; $4 } }
EOF
  taskset -c "$2" nginx -p "$WORK/$1" -c "$WORK/$1/nginx.conf" >"$WORK/$1.log" 2>&1 &
  PIDS+=($!)
  wait_port "$3"
}
measure() { # label port users conns
  USERS=$3 taskset -c 0 wrk -t1 -c"$4" -d1s -s "$WRK_SCRIPT" "http://127.0.0.1:$2" >/dev/null 2>&1 || true
  local line
  line="$(USERS=$3 taskset -c 0 wrk -t1 -c"$4" -d"${DURATION}s" -s "$WRK_SCRIPT" "http://127.0.0.1:$2" 2>&1 | grep '^RESULT' || true)"
  echo "CEILING $1 ${line#RESULT }"
}

nginx_on upstream 0 $UP 'location / { return 200 "ok\n"; }'
nginx_on fixed 1 $FIXED 'location / { return 429 "{}\n"; }'
nginx_on pass 1 $PASS 'location / { proxy_pass http://up; proxy_http_version 1.1; proxy_set_header Connection ""; }'

measure allow-direct $UP 10000 64
measure flood-fixed-429 $FIXED 1 64
measure latency-direct $UP 10000 1
measure latency-proxy-pass $PASS 10000 1
