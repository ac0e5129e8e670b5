#!/usr/bin/env bash
# The CPU of one hot reload, counted in instructions (deterministic, so
# builds can be compared on a busy machine): tollgate runs under callgrind
# with N prefix rules (benches/reload_stall.sh's file), one rule's limit is
# edited, and only what runs inside `Reloader::reload` is counted (reading,
# parsing and validating the files, compiling the rule set, the swap, and
# freeing the rules replaced). Also counts `tollgate check` of the same
# files (start-up's parsing and validation, without building the rule set).
#
#   benches/reload_callgrind.sh --tollgate target/release/tollgate [--rules 10000] [--keep DIR]
#
# RELOAD_CALLGRIND rules=10000 changed=1 reloads=1 instr_per_reload=...
# CHECK_CALLGRIND rules=10000 instr=...
#
# Needs valgrind (callgrind), curl and python3. Under callgrind start-up
# with 10,000 rules takes a minute or so.
set -euo pipefail
TOLLGATE=""; RULES=10000; KEEP=""
while [ $# -gt 0 ]; do
  case "$1" in
    --tollgate) TOLLGATE="$2"; shift 2 ;;
    --rules) RULES="$2"; shift 2 ;;
    --keep) KEEP="$2"; shift 2 ;;
    -h|--help) sed -n 2,17p "$0"; exit 0 ;;
    *) echo "reload_callgrind: unknown argument $1" >&2; exit 2 ;;
  esac
done
[ -x "$TOLLGATE" ] || { echo "reload_callgrind: give --tollgate PATH (a release build)" >&2; exit 2; }
WORK="$(mktemp -d /tmp/reload-callgrind.XXXXXX)"
PID=""
cleanup() { [ -n "$PID" ] && kill "$PID" 2>/dev/null || true; [ -n "$KEEP" ] || rm -rf "$WORK"; }
trap cleanup EXIT
free_port() { python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])'; }
PROXY=$(free_port); ADMIN=$(free_port)

cat > "$WORK/tollgate.toml" <<EOF
[listen]
proxy = "127.0.0.1:$PROXY"
admin = "127.0.0.1:$ADMIN"
[rules]
path = "$WORK/rules.toml"
[store]
backend = "memory"
[[upstream]]
name = "bench"
url = "http://127.0.0.1:9"
[[route]]
path_prefix = "/"
upstream = "bench"
EOF
# $2: the limit of the rule in the middle (the one edited).
rules() {
  python3 - "$RULES" "$1" <<'EOF'
import sys
n, edited = int(sys.argv[1]), int(sys.argv[2])
for i in range(n):
    limit = edited if i == n // 2 else 10
    print(f'[[rule]]\nname = "decoy{i}"\nkey = ["ip"]\nlimit = {limit}\nwindow = "1s"\nmatch = {{ path = "/decoy{i}/*" }}\n')
print('[[rule]]\nname = "per-user"\nkey = ["header:x-user-id"]\nalgorithm = "token_bucket"\nlimit = 1000000\nwindow = "1s"')
EOF
}
rules 10 > "$WORK/rules.toml"

valgrind --tool=callgrind --callgrind-out-file="$WORK/check.out" "$TOLLGATE" check --config "$WORK/tollgate.toml" \
  > /dev/null 2> "$WORK/check.log"
check=$(sed -n 's/^==[0-9]*== Collected : \([0-9]*\).*/\1/p' "$WORK/check.log")
echo "CHECK_CALLGRIND rules=$RULES instr=$check"

RUST_LOG=info valgrind --tool=callgrind --callgrind-out-file="$WORK/reload.out" --collect-atstart=no \
  --toggle-collect='*::Reloader::reload' \
  "$TOLLGATE" --config "$WORK/tollgate.toml" > "$WORK/tollgate.log" 2>&1 & PID=$!
reloads() { curl -s "http://127.0.0.1:$ADMIN/metrics" | awk '/^tollgate_rules_reloads_total\{result="success"\}/ {print $2}'; }
for _ in $(seq 1 1200); do [ -n "$(curl -s "http://127.0.0.1:$ADMIN/metrics" 2>/dev/null)" ] && break; sleep 0.25; done
# Past the poll that follows start-up, then one edit, written in place.
sleep 3
rules 11 > "$WORK/rules.new" && cat "$WORK/rules.new" > "$WORK/rules.toml"
n=""
for _ in $(seq 1 1200); do n=$(reloads); [ -n "$n" ] && [ "${n%.*}" -ge 1 ] && break; sleep 0.25; done
sleep 5
n=$(reloads)
kill -TERM "$PID"; wait "$PID" || true; PID=""
instr=$(callgrind_annotate "$WORK/reload.out" 2>/dev/null | sed -n 's/^ *\([0-9,]*\) (100.0%) *PROGRAM TOTALS.*/\1/p' | tr -d ,)
echo "RELOAD_CALLGRIND rules=$RULES changed=1 reloads=${n%.*} instr_per_reload=$((instr / ${n%.*}))"
[ -z "$KEEP" ] || { cp "$WORK"/*.out "$WORK"/*.log "$KEEP"/; echo "profiles in $KEEP"; }
