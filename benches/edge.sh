#!/usr/bin/env bash
# The load benchmark: builds a release tollgate and runs the shared
# edge-bench (tollgate side by side with nginx limit_req and HAProxy stick
# tables, same upstream, wrk on CPU 0, the proxy alone on CPU 1).
#
#   benches/edge.sh                      # every target and scenario, 5 s each
#   benches/edge.sh --runs 3             # three runs, for medians
#   benches/edge.sh --targets "nginx haproxy tollgate-memory" --scenarios allow
#   benches/edge.sh --plain              # `cargo build --release`, not scripts/release
#
# tollgate is built as it is released: scripts/release (profile-guided).
# Needs Debian packages wrk nginx-light haproxy redis-server redis-tools
# (installed here when missing). Figures go into docs/benchmarks.md.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
BENCH="${EDGE_BENCH:-../shared/bench/edge-bench}"
runs=1
plain=""
args=()
while [ $# -gt 0 ]; do
  case "$1" in
    --runs) runs="$2"; shift 2 ;;
    --plain) plain=1; shift ;;
    *) args+=("$1"); shift ;;
  esac
done
need=()
for pair in wrk:wrk nginx:nginx-light haproxy:haproxy redis-server:redis-server redis-cli:redis-tools; do
  command -v "${pair%%:*}" >/dev/null 2>&1 || [ -x "/usr/sbin/${pair%%:*}" ] || need+=("${pair#*:}")
done
if [ ${#need[@]} -gt 0 ]; then
  apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${need[@]}" >/dev/null
  systemctl stop nginx haproxy redis-server >/dev/null 2>&1 || true
fi
if [ -n "$plain" ]; then
  cargo build --release --quiet --bin tollgate
  TOLLGATE=target/release/tollgate
else
  scripts/release
  TOLLGATE=target/pgo/release/tollgate
fi
for i in $(seq 1 "$runs"); do
  echo "== edge-bench run $i of $runs"
  "$BENCH" --tollgate "$TOLLGATE" "${args[@]}"
done
