#!/usr/bin/env bash
# Does a reload of many rules stall requests? One tollgate (pinned to CPU 1,
# as edge-bench pins it) with N prefix rules that do not match plus the one
# that does, behind wrk on CPU 0; each round runs wrk twice, once quiet and
# once while the rules file changes every second, and prints both.
#
#   benches/reload_stall.sh --tollgate target/release/tollgate
#   benches/reload_stall.sh --tollgate PATH --rules 10000 --rounds 3 --conns 4
#   benches/reload_stall.sh --tollgate PATH --edit comment
#   benches/reload_stall.sh --tollgate PATH --sched   # and what the
#       scheduler saw (needs perf): see below
#
# Each second the run with reloads edits the rules file in place: by
# default the limit of the rule in the middle of the file (10 <-> 11: one
# rule changes, as an operator's edit does); with `--edit comment` it
# appends a comment line (a reload that changes no rule, as a touched or
# re-synced file). The quiet run makes the same edits to a copy of the
# file that tollgate does not watch, so both runs carry the same writer:
# one Python process on CPU 0 that writes without starting a process per
# edit (a `dd` started each second cost wrk, the upstream or tollgate a
# millisecond or two of CPU on whichever core it landed, and showed in
# p99 as if the reload had).
#
# RELOAD_STALL rules=10000 reloads=no  edit=limit rps=... p50_us=... p99_us=... requests=... reloaded=0 cpu0_steal=0% cpu1_steal=0%
# RELOAD_STALL rules=10000 reloads=yes edit=limit rps=... p50_us=... p99_us=... requests=... reloaded=9 cpu0_steal=0% cpu1_steal=0%
#
# With --sched, each run also records CPU 1's context switches (perf's
# sched_switch and sched_wakeup tracepoints) and adds what they say of
# the runtime's thread: `waited_on_reload_ms`, how long it was runnable
# while the reload thread had the core, and `longest_us`, the longest such
# stretch. Unlike p99 these do not move with what the host takes from the
# machine (steal stops both threads alike), so they compare on a noisy host.
#
# wrk runs closed loop with few connections, so CPU 1 has idle time, as in
# a deployment that is not saturated: what a reload takes from requests
# shows as p99. A timing bench: run it on a quiet machine and compare
# medians of the rounds. Needs wrk and nginx (the upstream).
set -euo pipefail
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
TOLLGATE=""; RULES=10000; ROUNDS=3; CONNS=4; DURATION=10; EDIT=limit; SCHED=""
while [ $# -gt 0 ]; do
  case "$1" in
    --tollgate) TOLLGATE="$2"; shift 2 ;;
    --rules) RULES="$2"; shift 2 ;;
    --rounds) ROUNDS="$2"; shift 2 ;;
    --conns) CONNS="$2"; shift 2 ;;
    --duration) DURATION="$2"; shift 2 ;;
    --edit) EDIT="$2"; shift 2 ;;
    --sched) SCHED=1; shift ;;
    *) echo "reload_stall: unknown argument $1" >&2; exit 2 ;;
  esac
done
[ -x "$TOLLGATE" ] || { echo "reload_stall: give --tollgate PATH (a release build)" >&2; exit 2; }
case "$EDIT" in limit|comment) ;; *) echo "reload_stall: --edit is limit or comment" >&2; exit 2 ;; esac
PATH="$PATH:/usr/sbin"
USERS_LUA="$HERE/../../shared/bench/users.lua"
[ -f "$USERS_LUA" ] || { echo "reload_stall: needs edge-bench's users.lua at $USERS_LUA" >&2; exit 2; }

WORK="$(mktemp -d /tmp/reload-stall.XXXXXX)"
PIDS=()
cleanup() { for p in "${PIDS[@]:-}"; do kill "$p" 2>/dev/null || true; done; sleep 0.3; rm -rf "$WORK"; }
trap cleanup EXIT
free_port() { python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])'; }
wait_port() { for _ in $(seq 1 100); do (echo > /dev/tcp/127.0.0.1/"$1") 2>/dev/null && return 0; sleep 0.1; done; echo "reload_stall: nothing on $1" >&2; exit 1; }
UP=$(free_port); PROXY=$(free_port); ADMIN=$(free_port)

mkdir -p "$WORK/up"
cat > "$WORK/up/nginx.conf" <<EOF
worker_processes 1; daemon off; pid $WORK/up/nginx.pid; error_log $WORK/up/error.log;
events { worker_connections 8192; }
http { access_log off;
  server { listen 127.0.0.1:$UP backlog=4096; keepalive_requests 10000000;
    location / { return 200 "ok\n"; } } }
EOF
taskset -c 0 nginx -p "$WORK/up" -c "$WORK/up/nginx.conf" & PIDS+=($!)
wait_port "$UP"

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
url = "http://127.0.0.1:$UP"
[[route]]
path_prefix = "/"
upstream = "bench"
EOF
python3 - "$RULES" > "$WORK/rules.toml" <<'EOF'
import sys
for i in range(int(sys.argv[1])):
    print(f'[[rule]]\nname = "decoy{i}"\nkey = ["ip"]\nlimit = 10\nwindow = "1s"\nmatch = {{ path = "/decoy{i}/*" }}\n')
print('[[rule]]\nname = "per-user"\nkey = ["header:x-user-id"]\nalgorithm = "token_bucket"\nlimit = 1000000\nwindow = "1s"')
EOF
# Where the middle rule's `limit = 10` has its last digit: the edit writes
# that one byte in place.
DIGIT=$(python3 -c "import sys; s = open(sys.argv[1], 'rb').read(); i = s.index(b'name = \"decoy%d\"' % (int(sys.argv[2]) // 2)); print(s.index(b'limit = 10', i) + 9)" "$WORK/rules.toml" "$RULES")
mkdir -p "$WORK/unwatched"
cp "$WORK/rules.toml" "$WORK/unwatched/rules.toml"
# The writer: N edits, one a second, of a file (the rules file, or the
# copy in a directory tollgate does not watch).
cat > "$WORK/writer.py" <<'EOF'
import os, sys, time
path, edit, digit, n = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
fd = os.open(path, os.O_WRONLY | (os.O_APPEND if edit == "comment" else 0))
for i in range(1, n + 1):
    time.sleep(1)
    if edit == "comment":
        os.write(fd, b"# touched %d\n" % i)
    else:
        os.pwrite(fd, b"%d" % (i % 2), digit)
EOF
RUST_LOG=warn taskset -c 1 "$TOLLGATE" --config "$WORK/tollgate.toml" > "$WORK/tollgate.log" 2>&1 & PIDS+=($!)
TOLLGATE_PID=$!
if [ -n "$SCHED" ]; then
  command -v perf >/dev/null || { echo "reload_stall: --sched needs perf" >&2; exit 2; }
  # Reads `perf script` of the switches: each time the runtime's thread
  # (the process's first) is runnable, how long until it runs again, and
  # how much of that the reload thread had the core.
  cat > "$WORK/sched.py" <<'EOF'
import re, sys
main, waiting, last, on_reload, stretches = sys.argv[1], False, 0.0, 0.0, []
for line in sys.stdin:
    m = re.search(r"\s(\d+\.\d+):\s+sched:(sched_switch|sched_wakeup):\s+(.*)", line)
    if not m:
        continue
    t, event, rest = float(m.group(1)), m.group(2), m.group(3)
    if event == "sched_wakeup":
        if re.search(r"pid=(\d+)", rest).group(1) == main and not waiting:
            waiting, last, on_reload = True, t, 0.0
        continue
    prev = re.search(r"prev_comm=(.*?) prev_pid=(\d+) .*prev_state=(\S+)", rest)
    nxt = re.search(r"next_pid=(\d+)", rest).group(1)
    if prev.group(2) == main and prev.group(3).startswith("R") and not waiting:
        waiting, last, on_reload = True, t, 0.0
        continue
    if waiting:
        if prev.group(1) == "tollgate-reload":
            on_reload += t - last
        last = t
        if nxt == main:
            waiting = False
            if on_reload > 0:
                stretches.append(on_reload)
print("waited_on_reload_ms=%.2f longest_us=%.0f" % (sum(stretches) * 1e3, max(stretches, default=0) * 1e6))
EOF
fi
wait_port "$PROXY"

# Each CPU's steal and total jiffies so far (cpu0 then cpu1): a run where
# the host took more than a few percent of either core (tollgate's, or
# wrk's and the upstream's, whose delays are in the latency too) is not
# comparable.
steal_ticks() { awk '$1 == "cpu0" || $1 == "cpu1" { t = 0; for (i = 2; i <= 9; i++) t += $i; printf "%s %s ", $9, t }' /proc/stat; }
reloads() { curl -s "http://127.0.0.1:$ADMIN/metrics" | awk '/^tollgate_rules_reloads_total\{result="success"\}/ {print $2}'; }
load() { # $1 = yes|no
  local before after line writer steal0 steal target="$WORK/unwatched/rules.toml"
  [ "$1" = yes ] && target="$WORK/rules.toml"
  before=$(reloads)
  steal0=$(steal_ticks)
  taskset -c 0 python3 "$WORK/writer.py" "$target" "$EDIT" "$DIGIT" $((DURATION - 1)) &
  writer=$!
  local recorder="" sched=""
  if [ -n "$SCHED" ]; then
    perf record -q -e sched:sched_switch -e sched:sched_wakeup -C 1 -o "$WORK/sched.data" -- sleep "$DURATION" >/dev/null 2>&1 &
    recorder=$!
  fi
  line=$(USERS=10000 taskset -c 0 wrk -t1 -c"$CONNS" -d"${DURATION}s" -s "$USERS_LUA" "http://127.0.0.1:$PROXY" 2>&1 | grep '^RESULT' || true)
  wait "$writer"
  if [ -n "$recorder" ]; then
    wait "$recorder"
    sched=" $(perf script -i "$WORK/sched.data" 2>/dev/null | python3 "$WORK/sched.py" "$TOLLGATE_PID")"
  fi
  steal=$(awk -v a="$steal0" -v b="$(steal_ticks)" 'BEGIN { split(a, x); split(b, y)
    for (c = 0; c < 2; c++) { t = y[2 * c + 2] - x[2 * c + 2]; printf "cpu%d_steal=%.0f%% ", c, (t > 0 ? 100 * (y[2 * c + 1] - x[2 * c + 1]) / t : 0) } }')
  sleep 1
  after=$(reloads)
  echo "RELOAD_STALL rules=$RULES reloads=$1 edit=$EDIT ${line#RESULT } reloaded=$((${after%.*} - ${before%.*})) ${steal% }$sched"
}
USERS=10000 taskset -c 0 wrk -t1 -c"$CONNS" -d1s -s "$USERS_LUA" "http://127.0.0.1:$PROXY" >/dev/null 2>&1 || true
for _ in $(seq 1 "$ROUNDS"); do
  load no
  load yes
done
