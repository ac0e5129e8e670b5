#!/usr/bin/env bash
# The deterministic guard: instructions tollgate executes per forwarded
# request and per rejection, counted by valgrind's callgrind. Instruction
# counts do not depend on what else the machine is doing, so two builds can
# be compared on a busy or shared machine, where edge-bench's timings cannot.
#
#   benches/callgrind.sh                       # builds release, 2,000 requests each
#   benches/callgrind.sh --tollgate PATH       # a given binary (an older build, say)
#   benches/callgrind.sh --requests 5000 --keep DIR   # keep the callgrind profiles
#   benches/callgrind.sh --decoys 1000 --only forward # 1,000 prefix rules
#       (`match.path = "/decoyN/*"`) and 1,000 routes (`/decoyN/`) that
#       the requests do not match, before the ones they do
#   benches/callgrind.sh --h2                  # the client speaks HTTP/2 (h2c,
#       prior knowledge): h2load, one stream at a time on one connection
#
# Prints one line per scenario:
#   CALLGRIND scenario=forward decoys=0 requests=2000 instr_per_req=123456 ...
# `forward`: every request admitted by a token-bucket rule keyed on a header
# (edge-bench's `allow`), forwarded to a local upstream over HTTP/1.1
# keep-alive; `reject`: the same rule at a limit the load passes at once
# (edge-bench's `flood`), so all but the first request get 429.
# Counting covers only the measured requests: the counters are zeroed after
# a warm-up and dumped after the last reply (callgrind_control). The figures
# go into commit messages of performance work; docs/benchmarks.md keeps the
# latest.
#
# Needs valgrind and curl (installed when missing on Debian), and python3
# for the upstream.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

TOLLGATE=""
REQUESTS=2000
KEEP=""
DECOYS=0
ONLY=""
PROTO=h1
while [ $# -gt 0 ]; do
  case "$1" in
    --tollgate) TOLLGATE="$2"; shift 2 ;;
    --requests) REQUESTS="$2"; shift 2 ;;
    --keep) KEEP="$2"; shift 2 ;;
    --decoys) DECOYS="$2"; shift 2 ;;
    --only) ONLY="$2"; shift 2 ;;
    --h2) PROTO=h2; shift ;;
    -h|--help) sed -n 2,27p "$0"; exit 0 ;;
    *) echo "callgrind.sh: unknown argument $1" >&2; exit 2 ;;
  esac
done
for tool in valgrind curl h2load; do
  if ! command -v "$tool" >/dev/null; then
    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq valgrind curl nghttp2-client >/dev/null
  fi
done
if [ -z "$TOLLGATE" ]; then
  cargo build --release --quiet --bin tollgate
  TOLLGATE=target/release/tollgate
fi

WORK="$(mktemp -d /tmp/callgrind.XXXXXX)"
PIDS=()
cleanup() {
  for p in "${PIDS[@]:-}"; do [ -n "$p" ] && kill "$p" 2>/dev/null || true; done
  rm -rf "$WORK"
}
trap cleanup EXIT

free_port() { python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])'; }
wait_port() {
  for _ in $(seq 1 600); do (echo > /dev/tcp/127.0.0.1/"$1") 2>/dev/null && return 0; sleep 0.1; done
  echo "callgrind.sh: nothing listens on $1" >&2; return 1
}

# The upstream: a keep-alive HTTP/1.1 server answering 200 "ok".
UP=$(free_port)
cat > "$WORK/upstream.py" <<'EOF'
import sys
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
class H(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    def do_GET(self):
        self.send_response(200)
        self.send_header("Content-Length", "3")
        self.end_headers()
        self.wfile.write(b"ok\n")
    def log_message(self, *a):
        pass
ThreadingHTTPServer(("127.0.0.1", int(sys.argv[1])), H).serve_forever()
EOF
python3 "$WORK/upstream.py" "$UP" & PIDS+=($!)
wait_port "$UP"

# requests PORT PATH N: N requests one after another on one keep-alive
# connection; prints the replies as COUNTxSTATUS (h2load's: COUNTxCLASS).
requests() {
  if [ "$PROTO" = h2 ]; then
    # h2load's requests all go to one path; the connection is its own.
    h2load -n "$3" -c 1 -m 1 -H 'x-user-id: u1' "http://127.0.0.1:$1/$2" \
      | awk '/^status codes:/ {for (i = 3; i < NF; i += 2) if ($i > 0) {sub(",", "", $(i+1)); printf "%s%sx%s", (n++ ? "," : ""), $i, $(i+1)}}'
  else
    curl -s -o /dev/null -w '%{http_code}\n' -H 'x-user-id: u1' "http://127.0.0.1:$1/$2/[1-$3]" \
      | sort | uniq -c | awk '{printf "%s%sx%s", (NR>1?",":""), $1, $2}'
  fi
}

# scenario LIMIT: one tollgate under callgrind, warmed up, then REQUESTS
# requests on one keep-alive connection, counted.
scenario() {
  local name="$1" limit="$2" proxy admin dir="$WORK/$1"
  proxy=$(free_port); admin=$(free_port)
  mkdir -p "$dir"
  cat > "$dir/tollgate.toml" <<EOF
[listen]
proxy = "127.0.0.1:$proxy"
admin = "127.0.0.1:$admin"

[rules]
path = "$dir/rules.toml"

[store]
backend = "memory"

[[upstream]]
name = "bench"
url = "http://127.0.0.1:$UP"

EOF
  : > "$dir/rules.toml"
  for i in $(seq 1 "$DECOYS"); do
    printf '[[route]]\npath_prefix = "/decoy%d/"\nupstream = "bench"\n\n' "$i" >> "$dir/tollgate.toml"
    printf '[[rule]]\nname = "decoy%d"\nkey = ["ip"]\nlimit = 10\nwindow = "1s"\nmatch = { path = "/decoy%d/*" }\n\n' "$i" "$i" >> "$dir/rules.toml"
  done
  cat >> "$dir/tollgate.toml" <<EOF
[[route]]
path_prefix = "/"
upstream = "bench"
EOF
  cat >> "$dir/rules.toml" <<EOF
[[rule]]
name = "per-user"
key = ["header:x-user-id"]
algorithm = "token_bucket"
limit = $limit
window = "1s"
EOF
  # One worker, as edge-bench runs it (pinned to one CPU, tollgate starts
  # a current-thread runtime): the multi-thread scheduler's own work would
  # otherwise be counted in every request.
  TOLLGATE_WORKERS="${TOLLGATE_WORKERS:-1}" RUST_LOG=warn valgrind --tool=callgrind --callgrind-out-file="$dir/callgrind.out" \
    "$TOLLGATE" --config "$dir/tollgate.toml" >"$dir/tollgate.log" 2>&1 &
  local pid=$!
  PIDS+=("$pid")
  wait_port "$proxy"
  requests "$proxy" warm 200 >/dev/null
  callgrind_control --zero "$pid" >/dev/null 2>&1
  local codes
  codes=$(requests "$proxy" p "$REQUESTS")
  callgrind_control --dump=measured "$pid" >/dev/null 2>&1
  kill "$pid"; wait "$pid" 2>/dev/null || true
  # The dump asked for above is the first numbered one; the unnumbered
  # file is the program's end.
  local profile="$dir/callgrind.out.1" total
  total=$(grep -h '^summary:' "$profile" | awk '{print $2}')
  echo "CALLGRIND scenario=$name proto=$PROTO decoys=$DECOYS requests=$REQUESTS instr_per_req=$((total / REQUESTS)) replies=${codes%,}"
  if [ -n "$KEEP" ]; then mkdir -p "$KEEP"; cp "$profile" "$KEEP/$name.callgrind"; fi
}

if [ -z "$ONLY" ] || [ "$ONLY" = forward ]; then scenario forward 1000000000; fi
if [ -z "$ONLY" ] || [ "$ONLY" = reject ]; then scenario reject 1; fi
