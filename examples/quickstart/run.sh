#!/usr/bin/env bash
# The quickstart, one command:
#
#   examples/quickstart/run.sh            # build, start, print the curl lines, run until Ctrl-C
#   examples/quickstart/run.sh --smoke    # the same, then send the demo requests and exit (0 = as expected)
#
# Builds tollgate and the demo upstream (examples/demo_upstream.rs), starts
# the upstream on 127.0.0.1:9001 and tollgate on the in-memory store
# (proxy 127.0.0.1:8080, admin 127.0.0.1:9090) with examples/quickstart/
# tollgate.toml and rules.toml, and prints requests to try. A debug build is
# enough to try it; measure with a release build (see the README).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/../.."

HERE=examples/quickstart
PROXY=127.0.0.1:8080
ADMIN=127.0.0.1:9090
UPSTREAM_PORT=9001
SMOKE=0
case "${1:-}" in
  --smoke) SMOKE=1 ;;
  "") ;;
  -h|--help) sed -n 2,12p "$0"; exit 0 ;;
  *) echo "run.sh: unknown argument $1 (try --help)" >&2; exit 2 ;;
esac

command -v curl >/dev/null || { echo "run.sh: curl is needed (apt-get install curl)" >&2; exit 1; }
for port in 8080 9090 "$UPSTREAM_PORT"; do
  if (exec 3<>"/dev/tcp/127.0.0.1/$port") 2>/dev/null; then
    echo "run.sh: something already listens on 127.0.0.1:$port; stop it first (the quickstart uses 8080, 9090, $UPSTREAM_PORT)" >&2
    exit 1
  fi
done

echo "==> building tollgate and the demo upstream (cargo build; the first build takes a few minutes)"
cargo build --quiet --bin tollgate --example demo_upstream
TARGET="${CARGO_TARGET_DIR:-target}/debug"

LOGS="$(mktemp -d /tmp/tollgate-quickstart.XXXXXX)"
PIDS=()
cleanup() {
  for pid in "${PIDS[@]}"; do kill "$pid" 2>/dev/null || true; done
  wait 2>/dev/null || true
  [ "$SMOKE" = 1 ] && rm -rf "$LOGS"
  return 0
}
trap cleanup EXIT
trap 'exit 130' INT TERM

"$TARGET/examples/demo_upstream" --port "$UPSTREAM_PORT" --name demo >"$LOGS/upstream.log" 2>&1 &
PIDS+=($!)
# Debug logs show one line per rejected request; a summary is logged at info every minute.
RUST_LOG="${RUST_LOG:-info,tollgate=debug}" "$TARGET/tollgate" --config "$HERE/tollgate.toml" >"$LOGS/tollgate.log" 2>&1 &
PIDS+=($!)

ready=0
for _ in $(seq 1 100); do
  if curl -fs "http://$ADMIN/readyz" >/dev/null 2>&1; then ready=1; break; fi
  for pid in "${PIDS[@]}"; do
    kill -0 "$pid" 2>/dev/null || { echo "run.sh: a process exited early; its log:" >&2; cat "$LOGS"/*.log >&2; exit 1; }
  done
  sleep 0.1
done
[ "$ready" = 1 ] || { echo "run.sh: tollgate did not become ready; its log:" >&2; cat "$LOGS/tollgate.log" >&2; exit 1; }

cat <<EOF

tollgate is running on http://$PROXY in front of the demo upstream (127.0.0.1:$UPSTREAM_PORT).
Logs: $LOGS/tollgate.log   Rules: $HERE/rules.toml (edit it now: it is hot-reloaded)

Try, in another terminal:

  # a forwarded request, with its rate-limit headers (5 per user per 10 s)
  curl -i http://$PROXY/api/hello -H 'x-user-id: alice'

  # the 6th request within 10 s is rejected: 429 with Retry-After and a JSON body
  for i in 1 2 3 4 5 6; do curl -s -o /dev/null -w '%{http_code}\\n' http://$PROXY/api/hello -H 'x-user-id: alice'; done
  curl -i http://$PROXY/api/hello -H 'x-user-id: alice'

  # another user has their own bucket
  curl -i http://$PROXY/api/hello -H 'x-user-id: bob'

  # logins: 3 per client address per minute
  for i in 1 2 3 4; do curl -s -w ' %{http_code}\\n' -X POST http://$PROXY/api/login; done

  # what tollgate would do with a request, without sending one
  $TARGET/tollgate explain --config $HERE/tollgate.toml --method POST --path /api/login --header 'x-user-id: alice' --ip 127.0.0.1

  # the admin endpoints
  curl -s http://$ADMIN/rules
  curl -s http://$ADMIN/metrics | grep -E '^tollgate_(requests_total|rule_decisions_total)'

EOF

if [ "$SMOKE" = 0 ]; then
  echo "Press Ctrl-C to stop both."
  wait -n "${PIDS[@]}"
  echo "run.sh: a process exited; logs are in $LOGS" >&2
  exit 1
fi

# --smoke: send the requests above and check the answers.
fail() { echo "run.sh --smoke: $*" >&2; exit 1; }
codes=""
for _ in 1 2 3 4 5 6; do
  codes+="$(curl -s -o /dev/null -w '%{http_code}' "http://$PROXY/api/hello" -H 'x-user-id: alice') "
done
[ "$codes" = "200 200 200 200 200 429 " ] || fail "alice got $codes, expected five 200 and a 429"
body="$(curl -s "http://$PROXY/api/hello" -H 'x-user-id: alice')"
[[ "$body" == *'"error":"too_many_requests"'*'"rule":"api-per-user"'* ]] || fail "unexpected 429 body: $body"
code="$(curl -s -o /dev/null -w '%{http_code}' "http://$PROXY/api/hello" -H 'x-user-id: bob')"
[ "$code" = 200 ] || fail "bob got $code, expected 200"
codes=""
for _ in 1 2 3 4; do codes+="$(curl -s -o /dev/null -w '%{http_code}' -X POST "http://$PROXY/api/login") "; done
[ "$codes" = "200 200 200 429 " ] || fail "logins got $codes, expected three 200 and a 429"
curl -fs "http://$ADMIN/metrics" | grep -q 'tollgate_rule_decisions_total{decision="shadow_limited",rule="api-total"}' \
  || fail "the shadow rule api-total reported no shadow_limited decision"
echo "run.sh --smoke: ok"
