#!/usr/bin/env bash
# The training run of the profile-guided release build (scripts/release):
# an instrumented tollgate serves the request paths it spends its time on
# in production, and writes the counts of what ran to PROFILE_DIR when it
# exits.
#
#   benches/pgo-train.sh BIN_DIR PROFILE_DIR
#
# BIN_DIR holds the instrumented `tollgate` and, optionally,
# `tollgate-floor` (the bench target of docs/benchmarks.md, trained on the
# same load so that the two stay comparable).
#
# Paths trained, each for a few seconds of wrk over 64 keep-alive
# connections (and one, for the lone-request path), with the memory store,
# one Redis and a three-master Redis Cluster:
#   allow  - 10,000 users, none near its limit: check and forward
#   flood  - one user far over its limit: 429s (and the Redis store's
#            over-limit cache)
#   spread - 10,000 users at 100/s each: a Redis round trip per request
# With the memory store, the same load also comes over TLS (the proxy
# listener with [[listen.tls]]) and over HTTP/2 (h2c, h2load).
# What the training leaves out (the decision API, Envoy RLS, the admin
# listener) the compiler treats as cold: laid out for size, not
# speed, it may run slower than in a plain release build.
#
# Needs wrk, redis-server, redis-cli, curl, python3, h2load and openssl
# (Debian packages of those names, redis-tools for redis-cli and
# nghttp2-client for h2load; installed when missing) and builds the
# demo upstream (examples/demo_upstream.rs) as the upstream.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

BIN_DIR="$(realpath "$1")"
PROFILE_DIR="$(realpath -m "$2")"
SECONDS_EACH="${PGO_TRAIN_SECONDS:-4}"

need=()
command -v wrk >/dev/null 2>&1 || need+=(wrk)
command -v redis-server >/dev/null 2>&1 || need+=(redis-server)
command -v redis-cli >/dev/null 2>&1 || need+=(redis-tools)
command -v curl >/dev/null 2>&1 || need+=(curl)
command -v python3 >/dev/null 2>&1 || need+=(python3)
command -v h2load >/dev/null 2>&1 || need+=(nghttp2-client)
command -v openssl >/dev/null 2>&1 || need+=(openssl)
if [ ${#need[@]} -gt 0 ]; then
  echo "pgo-train: installing ${need[*]}" >&2
  SUDO=""
  [ "$(id -u)" -ne 0 ] && SUDO="sudo"
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq --no-install-recommends "${need[@]}" >/dev/null
  $SUDO systemctl stop redis-server >/dev/null 2>&1 || $SUDO service redis-server stop >/dev/null 2>&1 || true
fi

cargo build --release --quiet --example demo_upstream
UPSTREAM_BIN="$(pwd)/target/release/examples/demo_upstream"

WORK="$(mktemp -d /tmp/pgo-train.XXXXXX)"
PIDS=()
cleanup() {
  for p in "${PIDS[@]:-}"; do [ -n "$p" ] && kill "$p" 2>/dev/null || true; done
  wait 2>/dev/null || true
  [ -n "${PGO_TRAIN_KEEP:-}" ] || rm -rf "$WORK"
}
trap cleanup EXIT

free_port() { python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])'; }
# A cluster node also listens on its port + 10000 (the cluster bus): three
# ports whose bus ports are free too, and ports at all.
free_cluster_ports() {
  python3 - <<'PY'
import random, socket
found, port = [], random.randrange(20000, 30000)
while len(found) < 3 and port < 55000:
    socks = []
    try:
        for p in (port, port + 10000):
            s = socket.socket(); socks.append(s); s.bind(("127.0.0.1", p))
        found.append(port)
    except OSError:
        pass
    finally:
        for s in socks: s.close()
    port += 1
print(" ".join(map(str, found)))
PY
}
wait_port() {
  for _ in $(seq 1 300); do (echo > /dev/tcp/127.0.0.1/"$1") 2>/dev/null && return 0; sleep 0.1; done
  echo "pgo-train: nothing listens on $1" >&2; return 1
}

UP=$(free_port)
"$UPSTREAM_BIN" --addr "127.0.0.1:$UP" >"$WORK/upstream.log" 2>&1 & PIDS+=($!)
wait_port "$UP"

# One user per request out of $USERS (1: the same user every time).
cat > "$WORK/users.lua" <<'EOF'
local users = tonumber(os.getenv("USERS") or "10000")
local prefix = os.getenv("PREFIX") or "/api/"
request = function()
  wrk.headers["x-user-id"] = "u" .. math.random(users)
  return wrk.format("GET", prefix .. "items?page=" .. math.random(5))
end
EOF

REDIS=$(free_port)
redis-server --port "$REDIS" --bind 127.0.0.1 --save "" --appendonly no --daemonize no \
  >"$WORK/redis.log" 2>&1 & PIDS+=($!)
wait_port "$REDIS"

read -r -a CLUSTER <<<"$(free_cluster_ports)"
for i in 0 1 2; do
  p="${CLUSTER[$i]}"
  mkdir -p "$WORK/c$i"
  (cd "$WORK/c$i" && exec redis-server --port "$p" --bind 127.0.0.1 --cluster-enabled yes \
    --cluster-config-file nodes.conf --cluster-node-timeout 2000 --save "" --appendonly no) \
    >"$WORK/c$i/log" 2>&1 & PIDS+=($!)
done
for p in "${CLUSTER[@]}"; do wait_port "$p"; done
redis-cli --cluster create "${CLUSTER[@]/#/127.0.0.1:}" --cluster-yes >"$WORK/cluster.log" 2>&1
for _ in $(seq 1 100); do
  redis-cli -p "${CLUSTER[0]}" cluster info | grep -q cluster_state:ok && break
  sleep 0.1
done

# /api/: the per-user limit as deployed (`spread`: 10,000 users, none
# near it; `flood`: one user, far over it). /bulk/: a limit no user
# nears, as in edge-bench's `allow` (the Redis store answers most of it
# from leases).
cat > "$WORK/rules.toml" <<EOF
[[rule]]
name = "per-user"
match = { path = "/api/*" }
key = ["header:x-user-id"]
algorithm = "token_bucket"
limit = 100
window = "1s"

[[rule]]
name = "bulk"
match = { path = "/bulk/*" }
key = ["header:x-user-id"]
algorithm = "token_bucket"
limit = 1000000
window = "1s"
EOF

# train STORE [BINARY]: one instrumented tollgate (or BINARY) on STORE,
# every scenario, then a clean exit (SIGTERM), which writes its profile.
train() {
  local store="$1" bin="${2:-tollgate}" tls="${3:-}" dir="$WORK/$1-${2:-tollgate}${3:+-tls}" proxy admin
  proxy=$(free_port); admin=$(free_port)
  mkdir -p "$dir"
  local store_toml
  case "$store" in
    memory) store_toml='backend = "memory"' ;;
    redis) store_toml="backend = \"redis\"
url = \"redis://127.0.0.1:$REDIS\"" ;;
    cluster) store_toml="backend = \"redis\"
url = \"redis-cluster://127.0.0.1:${CLUSTER[0]}?node=127.0.0.1:${CLUSTER[1]}&node=127.0.0.1:${CLUSTER[2]}\"" ;;
  esac
  local tls_toml="" scheme=http
  if [ -n "$tls" ]; then
    tls_toml="[[listen.tls]]
cert_file = \"$WORK/cert.pem\"
key_file = \"$WORK/key.pem\""
    scheme=https
  fi
  cat > "$dir/tollgate.toml" <<EOF
[listen]
proxy = "127.0.0.1:$proxy"
admin = "127.0.0.1:$admin"
$tls_toml

[rules]
path = "$WORK/rules.toml"

[store]
$store_toml

[[upstream]]
name = "api"
url = "http://127.0.0.1:$UP"

[[route]]
path_prefix = "/"
upstream = "api"
EOF
  LLVM_PROFILE_FILE="$PROFILE_DIR/tollgate-%m_%p.profraw" TOLLGATE_WORKERS=1 RUST_LOG=warn \
    "$BIN_DIR/$bin" --config "$dir/tollgate.toml" >"$dir/tollgate.log" 2>&1 &
  local pid=$!
  PIDS+=("$pid")
  wait_port "$proxy"
  local url="$scheme://127.0.0.1:$proxy"
  PREFIX=/bulk/ USERS=10000 wrk -t1 -c64 -d"${SECONDS_EACH}s" -s "$WORK/users.lua" "$url" >"$dir/allow.txt"
  USERS=10000 wrk -t1 -c64 -d"${SECONDS_EACH}s" -s "$WORK/users.lua" "$url" >"$dir/spread.txt"
  USERS=1 wrk -t1 -c64 -d"${SECONDS_EACH}s" -s "$WORK/users.lua" "$url" >"$dir/flood.txt"
  USERS=10000 wrk -t1 -c1 -d2s -s "$WORK/users.lua" "$url" >"$dir/latency.txt"
  if [ "$store" = memory ] && [ -z "$tls" ] && [ "$bin" = tollgate ]; then
    # HTTP/2 with prior knowledge: forwarded (/bulk/) and limited (/api/).
    h2load -n 40000 -c 8 -m 16 -H 'x-user-id: h2' "$url/bulk/items" >"$dir/h2-allow.txt" 2>&1
    h2load -n 40000 -c 8 -m 16 -H 'x-user-id: h2' "$url/api/items" >"$dir/h2-flood.txt" 2>&1
  fi
  # What the admin listener and a denied request cost is not trained:
  # neither is on the request path's hot side. One request each keeps
  # them out of the cold section only as far as one request does.
  curl -s -o /dev/null "http://127.0.0.1:$admin/metrics" || true
  kill -TERM "$pid"
  wait "$pid" || true
  echo "pgo-train: $bin, $store${tls:+ over TLS}: $(grep -h 'Requests/sec' "$dir"/allow.txt "$dir"/spread.txt "$dir"/flood.txt | awk '{printf "%s ", $2}')req/s (allow, spread, flood)"
}

mkdir -p "$PROFILE_DIR"
openssl req -x509 -newkey ec -pkeyopt ec_paramgen_curve:P-256 -nodes -days 2 -subj "/CN=pgo.test" \
  -keyout "$WORK/key.pem" -out "$WORK/cert.pem" >/dev/null 2>&1

train memory
train memory tollgate tls
train redis
train cluster
if [ -x "$BIN_DIR/tollgate-floor" ]; then
  train memory tollgate-floor
fi
ls "$PROFILE_DIR"/*.profraw >/dev/null
