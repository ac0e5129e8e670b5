#!/usr/bin/env python3
"""How tollgate's cost grows with the work, beside nginx's: rules, idle
connections, keys.

    benches/scale.py --tollgate PATH [--curves rules,conns,keys] [--quick]

Prints one SCALE line per point and target:

    SCALE curve=rules n=1000 target=tollgate rss_kib=... instr_per_req=...

and a table per curve at the end.

- `rules`, n = 1 ... 10,000: tollgate with n - 1 prefix rules
  (`match = { path = "/decoyN/*" }`) and as many routes (`/decoyN/`) that
  the requests do not match, before the rule and route they do, as
  `benches/callgrind.sh --decoys` builds them; nginx with n - 1 prefix
  `location /decoyN/` blocks (each proxying to the upstream) beside
  `location /` (its `limit_req`): nginx's prefix locations are its routes,
  and what a request matches is found in a tree built at start, as
  tollgate's path index does for routes and rules together.
- `conns`, n = 1,000 ... 50,000: n idle keep-alive HTTP/1.1 connections,
  each after one request (benches/idle_conns.py's method: n/2 first, then
  n, KiB per connection of the last n); points beyond the file descriptor
  hard limit (1.5 n + 1,000 needed) are reported as skipped.
- `keys`, n = 10^3 ... 10^6: n requests, each with its own `X-User-Id`,
  into tollgate's memory store with `max_keys` 1.25 n (at least 1,024),
  a token bucket of 2,000 in 30 days (a key stays until it refills), and
  nginx's `limit_req_zone` sized for n keys (160 bytes each, at least
  1 MB); RSS growth per key.

Instructions per request (valgrind's callgrind, counted over requests on
one keep-alive connection after a warm-up, as `benches/callgrind.sh`
counts them) are measured for every `rules` point, for `conns` up to
10,000 (every idle connection opened under valgrind first) and for
`keys` up to 10^4 (the keys loaded under valgrind first): beyond those,
loading the process under valgrind would take hours. RSS is the
process's VmRSS (nginx: its one worker), in a separate run without
valgrind. `--quick` measures fewer points (for a try of the script).

Needs nginx, valgrind (callgrind_control) and python3; nothing is timed,
so a busy machine gives the same figures.
"""

import argparse
import os
import resource
import shutil
import socket
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import idle_conns as ic  # noqa: E402

REQUESTS = 1000
CALLGRIND_CONNS_MAX = 10_000
CALLGRIND_KEYS_MAX = 10_000


def decoy_rules(n):
    rules = "".join(
        f'[[rule]]\nname = "decoy{i}"\nkey = ["ip"]\nlimit = 10\nwindow = "1s"\nmatch = {{ path = "/decoy{i}/*" }}\n\n'
        for i in range(1, n)
    )
    return rules + ic.ONE_RULE


def decoy_routes(n):
    return "".join(f'[[route]]\npath_prefix = "/decoy{i}/"\nupstream = "bench"\n\n' for i in range(1, n))


# The keys curve's rule: a key used once stays in the store until its
# token is back (21 minutes), longer than the load takes; at the other
# curves' 10^9 a second, a key would be gone as soon as written. The
# counted requests' one user stays far below the limit.
KEYS_RULE = """[[rule]]
name = "per-user"
key = ["header:x-user-id"]
algorithm = "token_bucket"
limit = 2000
window = "720h"
"""


def tollgate_files(work, up, conns, rules=1, max_keys=None):
    """A tollgate configuration: `rules - 1` decoy rules and routes; with
    `max_keys`, the keys curve's rule alone."""
    d = tempfile.mkdtemp(prefix="tg-", dir=work)
    extra = f"max_keys = {max_keys}" if max_keys else ""
    text = KEYS_RULE if max_keys else decoy_rules(rules)
    conf, port = ic.tollgate_config(d, up, conns, text, extra)
    if rules > 1:
        text = open(conf).read()
        text = text.replace("[[route]]\npath_prefix = \"/\"", decoy_routes(rules) + "[[route]]\npath_prefix = \"/\"")
        open(conf, "w").write(text)
    return conf, port


def nginx_files(work, up, conns, locations=1, zone_mb=64):
    """nginx as idle_conns configures it, as one process (no master)."""
    return ic.nginx_config(work, up, conns, "h1", locations, zone_mb, single=True)


def get(s, path, user="u1"):
    s.sendall(f"GET {path} HTTP/1.1\r\nHost: bench\r\nX-User-Id: {user}\r\n\r\n".encode())
    read_response(s)


def read_response(s, buf=None):
    """Reads one response with a Content-Length body; returns what was read past it."""
    data = buf or b""
    while b"\r\n\r\n" not in data:
        chunk = s.recv(65536)
        if not chunk:
            raise RuntimeError("connection closed")
        data += chunk
    head, _, rest = data.partition(b"\r\n\r\n")
    length = 0
    for line in head.split(b"\r\n")[1:]:
        name, _, value = line.partition(b":")
        if name.strip().lower() == b"content-length":
            length = int(value.strip())
    while len(rest) < length:
        chunk = s.recv(65536)
        if not chunk:
            raise RuntimeError("connection closed in a body")
        rest += chunk
    return rest[length:]


def load_keys(port, n, prefix="k"):
    """n requests, each a new user, pipelined 200 at a time, 5,000 to a
    connection (tollgate's `max_requests_per_connection` is 10,000)."""
    s = socket.create_connection(("127.0.0.1", port))
    sent = 0
    while sent < n:
        if sent and sent % 5000 == 0:
            s.close()
            s = socket.create_connection(("127.0.0.1", port))
        batch = min(200, n - sent)
        s.sendall(
            b"".join(
                f"GET /k HTTP/1.1\r\nHost: bench\r\nX-User-Id: {prefix}{sent + i}\r\n\r\n".encode() for i in range(batch)
            )
        )
        left = b""
        for _ in range(batch):
            left = read_response(s, left)
        sent += batch
    s.close()


def callgrind(cmd, port, work, setup=None, env=None):
    """Instructions per request of the process `cmd` starts under callgrind:
    warmed up, `setup(port)` run, then REQUESTS requests on one keep-alive
    connection counted."""
    out = os.path.join(work, f"cg-{port}.out")
    log = open(os.path.join(work, f"cg-{port}.log"), "wb")
    p = subprocess.Popen(
        ["valgrind", "--tool=callgrind", f"--callgrind-out-file={out}"] + cmd, stdout=log, stderr=subprocess.STDOUT, env=env
    )
    try:
        ic.wait_port(port, p, 300)
        s = socket.create_connection(("127.0.0.1", port))
        for i in range(200):
            get(s, f"/warm/{i}")
        kept = setup(port) if setup else None
        subprocess.run(["callgrind_control", "--zero", str(p.pid)], capture_output=True, check=True)
        for i in range(REQUESTS):
            get(s, f"/p/{i}")
        subprocess.run(["callgrind_control", "--dump=measured", str(p.pid)], capture_output=True, check=True)
        del kept
    finally:
        p.terminate()
        p.wait()
    with open(out + ".1") as f:
        total = next(int(line.split()[1]) for line in f if line.startswith("summary:"))
    return total // REQUESTS


def tollgate_cmd(binary, conf):
    return [binary, "--config", conf]


def nginx_cmd(conf, d):
    return [ic.nginx_bin(), "-p", d, "-c", conf]


def start_proc(cmd, port, work, name, env=None):
    p = ic.Procs(work).start(name, cmd, env=env)
    ic.wait_port(port, p, 120)
    return p


def stop(p):
    p.terminate()
    p.wait()


def curve_rules(binary, up, work, points):
    rows = []
    for n in points:
        conf, port = tollgate_files(work, up, 1000, rules=n)
        env = dict(os.environ, RUST_LOG="warn", TOLLGATE_WORKERS="1")
        instr = callgrind(tollgate_cmd(binary, conf), port, work, env=env)
        p = start_proc(tollgate_cmd(binary, conf), port, work, "tg", env)
        rss = rss_of_running(p.pid, port)
        stop(p)
        emit("rules", n, "tollgate", rss, instr)
        nconf, nport, nd = nginx_files(work, up, 1000, locations=n)
        ninstr = callgrind(nginx_cmd(nconf, nd), nport, work)
        q = start_proc(nginx_cmd(nconf, nd), nport, work, "ng")
        nrss = rss_of_running(q.pid, nport)
        stop(q)
        emit("rules", n, "nginx", nrss, ninstr)
        rows.append((n, rss, instr, nrss, ninstr))
    return rows


def open_idle_fn(n):
    def setup(port):
        socks = ic.open_idle(port, n, "h1")
        # Parked before the count starts: the count is the requests' own.
        time.sleep(2.5)
        return socks

    return setup


def curve_conns(binary, up, work, points):
    rows = []
    hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
    for n in points:
        need = n + n // 2 + 1000
        if need > hard:
            print(f"SCALE curve=conns n={n} skipped: needs {need} file descriptors, the hard limit is {hard}", flush=True)
            rows.append((n, None, None, None, None))
            continue
        ic.raise_nofile(need)
        procs = ic.Procs(work)
        port, pid, p = ic.start_tollgate(procs, work, binary, up, need)
        b, m, a = ic.measure(pid, port, n, "h1")
        procs.stop(p)
        per = ic.report("tollgate", "h1", n, b, m, a)
        port, wpid, q = ic.start_nginx(procs, work, up, need, "h1")
        nb, nm, na = ic.measure(wpid, port, n, "h1")
        procs.stop(q)
        nper = ic.report("nginx", "h1", n, nb, nm, na)
        instr = ninstr = None
        if n <= CALLGRIND_CONNS_MAX:
            conf, port = tollgate_files(work, up, need)
            env = dict(os.environ, RUST_LOG="warn", TOLLGATE_WORKERS="1")
            instr = callgrind(tollgate_cmd(binary, conf), port, work, setup=open_idle_fn(n), env=env)
            nconf, nport, nd = nginx_files(work, up, need)
            ninstr = callgrind(nginx_cmd(nconf, nd), nport, work, setup=open_idle_fn(n))
        emit("conns", n, "tollgate", a, instr, f" kib_per_conn={per:.2f}")
        emit("conns", n, "nginx", na, ninstr, f" kib_per_conn={nper:.2f}")
        rows.append((n, per, instr, nper, ninstr))
    return rows


def curve_keys(binary, up, work, points):
    rows = []
    for n in points:
        conf, port = tollgate_files(work, up, 1000, max_keys=max(1024, n * 5 // 4))
        env = dict(os.environ, RUST_LOG="warn", TOLLGATE_WORKERS="1")
        p = start_proc(tollgate_cmd(binary, conf), port, work, "tg", env)
        before = rss_of_running(p.pid, port)
        load_keys(port, n)
        after = ic.settle_rss(p.pid)
        stop(p)
        zone = max(1, (n * 160 + (1 << 20) - 1) >> 20)
        nconf, nport, nd = nginx_files(work, up, 1000, zone_mb=zone)
        q = start_proc(nginx_cmd(nconf, nd), nport, work, "ng")
        nbefore = rss_of_running(q.pid, nport)
        load_keys(nport, n)
        nafter = ic.settle_rss(q.pid)
        stop(q)
        instr = ninstr = None
        if n <= CALLGRIND_KEYS_MAX:
            instr = callgrind(tollgate_cmd(binary, conf), port, work, setup=lambda pt: load_keys(pt, n), env=env)
            ninstr = callgrind(nginx_cmd(nconf, nd), nport, work, setup=lambda pt: load_keys(pt, n))
        per, nper = (after - before) * 1024 / n, (nafter - nbefore) * 1024 / n
        emit("keys", n, "tollgate", after, instr, f" bytes_per_key={per:.0f}")
        emit("keys", n, "nginx", nafter, ninstr, f" bytes_per_key={nper:.0f} zone_mb={zone}")
        rows.append((n, per, instr, nper, ninstr))
    return rows


def rss_of_running(pid, port):
    s = socket.create_connection(("127.0.0.1", port))
    for i in range(200):
        get(s, f"/warm/{i}")
    s.close()
    time.sleep(0.3)
    return ic.settle_rss(pid)


def emit(curve, n, target, rss, instr, extra=""):
    i = "-" if instr is None else instr
    print(f"SCALE curve={curve} n={n} target={target} rss_kib={rss} instr_per_req={i}{extra}", flush=True)


def fmt(v, spec="{:,}"):
    return "-" if v is None else spec.format(v)


def table(title, unit, rows, spec):
    print(f"\n{title}")
    print(f"| n | tollgate {unit} | tollgate instr/req | nginx {unit} | nginx instr/req |")
    print("|---:|---:|---:|---:|---:|")
    for n, a, ai, b, bi in rows:
        print(f"| {n:,} | {fmt(a, spec)} | {fmt(ai)} | {fmt(b, spec)} | {fmt(bi)} |")


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tollgate", required=True, help="a release build of the tollgate binary")
    ap.add_argument("--curves", default="rules,conns,keys")
    ap.add_argument("--quick", action="store_true", help="fewer points")
    args = ap.parse_args()
    if not shutil.which("callgrind_control"):
        sys.exit("scale: needs valgrind (apt-get install valgrind)")
    curves = args.curves.split(",")
    work = tempfile.mkdtemp(prefix="scale.")
    procs = ic.Procs(work)
    try:
        up = ic.start_upstream(procs, work)
        if "rules" in curves:
            pts = [1, 1000] if args.quick else [1, 100, 1000, 10_000]
            rows = curve_rules(args.tollgate, up, work, pts)
            table("Rules (RSS after 200 requests)", "RSS KiB", [(n, a, ai, b, bi) for n, a, ai, b, bi in rows], "{:,}")
        if "conns" in curves:
            pts = [1000] if args.quick else [1000, 5000, 10_000, 50_000]
            table("Idle HTTP/1.1 connections", "KiB/conn", curve_conns(args.tollgate, up, work, pts), "{:.2f}")
        if "keys" in curves:
            pts = [1000, 10_000] if args.quick else [1000, 10_000, 100_000, 1_000_000]
            table("Keys", "bytes/key", curve_keys(args.tollgate, up, work, pts), "{:.0f}")
    finally:
        procs.stop_all()
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
