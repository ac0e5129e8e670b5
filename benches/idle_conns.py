#!/usr/bin/env python3
"""What an idle keep-alive client connection costs: tollgate beside nginx.

    benches/idle_conns.py --tollgate PATH [--conns 10000] [--protocols h1,h2]
                          [--targets tollgate,nginx] [--keep-sources]

For each target and protocol, a fresh proxy is started in front of one
upstream (nginx answering `200 ok`), then client connections are opened
one after another; each sends one request through the proxy, reads its
whole answer, and stays open, idle: first N/2, then N more. The proxy's
resident memory (VmRSS of tollgate, of nginx's one worker) is read before
the first connection, after the first N/2 and after the last (each time
2.5 s after the last request, once the proxy has settled). One line per
run:

    IDLE target=tollgate proto=h1 conns=10000 rss_before_kib=... rss_half_kib=...
         rss_after_kib=... kib_per_conn=... kib_per_conn_from_start=...

`kib_per_conn` is what the last N connections added, divided by N: what one
more idle connection costs. The first N/2 leave in the allocator what the
requests of connections not yet idle took (hyper's buffers, each request's
state; tollgate gives an HTTP/1.1 connection's back after a second of
idling), which the next ones reuse. `kib_per_conn_from_start` divides
everything since the start by all 1.5 N connections, that burst included.

`h1`: HTTP/1.1 keep-alive. `h2`: HTTP/2 with prior knowledge (h2c, what
tollgate's listener takes beside HTTP/1.1 on one port; nginx's `listen ...
http2` on a port of its own). Both proxies hold one token-bucket rule keyed
on `X-User-Id` (nginx: `limit_req`), every request the same user, far below
its limit, and keep-alive to the upstream; idle and header timeouts are set
long enough that nothing closes during the run.

Connections come from 127.0.0.2, .3, ... (loopback addresses on which
nothing listens; 25,000 connections each): the ephemeral ports of
127.0.0.1, which every other process on the machine binds from, stay free.
The script raises its file descriptor limit to 1.5 N + 1,000, which the
proxies inherit (beyond the hard limit it needs CAP_SYS_RESOURCE).
Needs nginx (`apt-get install nginx-light`) and python3; no packages.
"""

import argparse
import os
import resource
import shutil
import signal
import socket
import struct
import subprocess
import sys
import tempfile
import time

CONNS_PER_SOURCE = 25_000


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_port(port, proc=None, seconds=60):
    deadline = time.time() + seconds
    while time.time() < deadline:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"process on port {port} exited with {proc.returncode}")
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            return
        except OSError:
            time.sleep(0.1)
    raise RuntimeError(f"nothing listens on {port}")


def rss_kib(pid):
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    raise RuntimeError(f"no VmRSS for {pid}")


def raise_nofile(n):
    """At least `n` file descriptors for this process and its children."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft >= n:
        return
    try:
        resource.setrlimit(resource.RLIMIT_NOFILE, (n, max(n, hard)))
    except (ValueError, OSError):
        sys.exit(
            f"idle_conns: need {n} file descriptors, the hard limit is {hard}: raise it "
            "(`prlimit --nofile=N:N`, or run with CAP_SYS_RESOURCE)"
        )


class Procs:
    """Processes started by this run, stopped at its end."""

    def __init__(self, work):
        self.work = work
        self.procs = []

    def start(self, name, args, env=None):
        log = open(os.path.join(self.work, name + ".log"), "wb")
        p = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT, env=env)
        self.procs.append(p)
        return p

    def stop(self, p):
        if p.poll() is None:
            p.send_signal(signal.SIGTERM)
            try:
                p.wait(5)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()

    def stop_all(self):
        for p in reversed(self.procs):
            self.stop(p)


def nginx_bin():
    found = shutil.which("nginx") or ("/usr/sbin/nginx" if os.path.exists("/usr/sbin/nginx") else None)
    if not found:
        sys.exit("idle_conns: nginx not found (apt-get install nginx-light)")
    return found


def start_upstream(procs, work):
    port = free_port()
    d = os.path.join(work, "up")
    os.makedirs(d, exist_ok=True)
    with open(os.path.join(d, "nginx.conf"), "w") as f:
        f.write(f"""worker_processes 1; daemon off; pid {d}/nginx.pid; error_log {d}/error.log;
events {{ worker_connections 4096; }}
http {{ access_log off;
  server {{ listen 127.0.0.1:{port} backlog=4096; keepalive_requests 10000000; keepalive_timeout 3600s;
    location / {{ return 200 "ok\\n"; }} }} }}
""")
    p = procs.start("upstream", [nginx_bin(), "-p", d, "-c", os.path.join(d, "nginx.conf")])
    wait_port(port, p)
    return port


def nginx_worker(master):
    """nginx's one worker process (the master only forks it)."""
    for _ in range(100):
        try:
            with open(f"/proc/{master}/task/{master}/children") as f:
                kids = f.read().split()
            if kids:
                return int(kids[0])
        except OSError:
            pass
        time.sleep(0.05)
    raise RuntimeError("nginx started no worker")


def nginx_config(work, up, conns, proto, locations=1, zone_mb=64, single=False):
    """nginx as edge-bench configures it, keep-alive to the upstream:
    (config file, port, prefix directory). `locations`: prefix locations
    `/decoyN/` the requests do not match, before the one they do (the rules
    curve of benches/scale.py). `single`: one process, no master (for
    valgrind)."""
    port = free_port()
    d = os.path.join(work, f"ng-{proto}-{port}")
    os.makedirs(d, exist_ok=True)
    listen = f"127.0.0.1:{port} backlog=4096" + (" http2" if proto == "h2" else "")
    proxy = "proxy_pass http://up; proxy_http_version 1.1; proxy_set_header Connection \"\";"
    decoys = "".join(f"    location /decoy{i}/ {{ {proxy} }}\n" for i in range(1, locations))
    master = " master_process off;" if single else ""
    conf = os.path.join(d, "nginx.conf")
    with open(conf, "w") as f:
        f.write(f"""worker_processes 1; daemon off;{master} pid {d}/nginx.pid; error_log {d}/error.log;
worker_rlimit_nofile {conns * 2 + 1000};
events {{ worker_connections {conns + 1000}; }}
http {{ access_log off;
  limit_req_zone $http_x_user_id zone=users:{zone_mb}m rate=1000000r/s;
  limit_req_status 429;
  upstream up {{ server 127.0.0.1:{up}; keepalive 128; }}
  server {{ listen {listen}; keepalive_requests 10000000; keepalive_timeout 3600s;
    client_header_timeout 3600s;
{decoys}    location / {{ limit_req zone=users burst=1000000 nodelay; {proxy} }} }} }}
""")
    return conf, port, d


def start_nginx(procs, work, up, conns, proto):
    """nginx in front of `up`: (port, its worker's pid, the master process)."""
    conf, port, d = nginx_config(work, up, conns, proto)
    p = procs.start("nginx", [nginx_bin(), "-p", d, "-c", conf])
    wait_port(port, p)
    return port, nginx_worker(p.pid), p


def tollgate_config(work, up, conns, rules_text, store_extra=""):
    """A tollgate configuration in `work`: one route to `up`, the rules given."""
    port, admin = free_port(), free_port()
    rules = os.path.join(work, "rules.toml")
    with open(rules, "w") as f:
        f.write(rules_text)
    conf = os.path.join(work, "tollgate.toml")
    with open(conf, "w") as f:
        f.write(f"""[listen]
proxy = "127.0.0.1:{port}"
admin = "127.0.0.1:{admin}"
max_connections = {conns + 1000}
idle_timeout = "3600s"
header_read_timeout = "3600s"

[rules]
path = "{rules}"

[store]
backend = "memory"
{store_extra}

[[upstream]]
name = "bench"
url = "http://127.0.0.1:{up}"

[[route]]
path_prefix = "/"
upstream = "bench"
""")
    return conf, port


ONE_RULE = """[[rule]]
name = "per-user"
key = ["header:x-user-id"]
algorithm = "token_bucket"
limit = 1000000000
window = "1s"
"""


def start_tollgate(procs, work, binary, up, conns, rules_text=ONE_RULE, store_extra=""):
    d = tempfile.mkdtemp(prefix="tg-", dir=work)
    conf, port = tollgate_config(d, up, conns, rules_text, store_extra)
    env = dict(os.environ, RUST_LOG="warn")
    p = procs.start("tollgate", [binary, "--config", conf], env=env)
    wait_port(port, p)
    return port, p.pid, p


REQUEST_H1 = b"GET /idle HTTP/1.1\r\nHost: bench\r\nX-User-Id: u1\r\n\r\n"


def read_h1_response(s):
    """Reads one HTTP/1.1 response with a Content-Length body."""
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = s.recv(4096)
        if not chunk:
            raise RuntimeError("connection closed before the response head")
        data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    status = head.split(b" ", 2)[1]
    length = 0
    for line in head.split(b"\r\n")[1:]:
        name, _, value = line.partition(b":")
        if name.strip().lower() == b"content-length":
            length = int(value.strip())
    while len(body) < length:
        chunk = s.recv(4096)
        if not chunk:
            raise RuntimeError("connection closed in the response body")
        body += chunk
    if status != b"200":
        raise RuntimeError(f"status {status!r}")


def frame(kind, flags, stream, payload=b""):
    return struct.pack(">I", len(payload))[1:] + bytes([kind, flags]) + struct.pack(">I", stream) + payload


def literal(name, value):
    """An HPACK literal header field without indexing, new name (RFC 7541
    6.2.2), short strings only: no encoder state to keep per connection."""
    return b"\x00" + bytes([len(name)]) + name + bytes([len(value)]) + value


# :method GET (static 2), :scheme http (static 6), :path /idle, :authority bench, x-user-id u1
H2_HEADERS = b"\x82\x86" + b"\x04\x05/idle" + b"\x01\x05bench" + literal(b"x-user-id", b"u1")
H2_PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"
REQUEST_H2 = H2_PREFACE + frame(4, 0, 0) + frame(1, 0x5, 1, H2_HEADERS)  # SETTINGS; HEADERS END_STREAM|END_HEADERS


def read_h2_response(s):
    """Reads frames until stream 1 ends, acknowledging the server's SETTINGS."""
    buf = b""
    status_ok = False
    while True:
        while len(buf) < 9:
            chunk = s.recv(65536)
            if not chunk:
                raise RuntimeError("connection closed before the response ended")
            buf += chunk
        length = int.from_bytes(buf[:3], "big")
        while len(buf) < 9 + length:
            chunk = s.recv(65536)
            if not chunk:
                raise RuntimeError("connection closed in a frame")
            buf += chunk
        kind, flags = buf[3], buf[4]
        stream = int.from_bytes(buf[5:9], "big") & 0x7FFFFFFF
        payload = buf[9 : 9 + length]
        buf = buf[9 + length :]
        if kind == 4 and not flags & 1:
            s.sendall(frame(4, 1, 0))
        elif kind == 7:
            raise RuntimeError(f"GOAWAY {payload!r}")
        elif kind == 1 and stream == 1:
            # The server's first header field: `:status: 200` is static index 8.
            status_ok = payload[:1] == b"\x88"
            if not status_ok:
                raise RuntimeError(f"response head {payload[:16]!r}")
        if stream == 1 and kind in (0, 1) and flags & 1:
            return


def open_idle(port, n, proto, sources=True, first=0):
    """Opens `n` connections to `port`, one request each, answered before the
    next opens; returns the open sockets. `first`: connections already open
    (for the choice of source address)."""
    socks = []
    request, read = (REQUEST_H1, read_h1_response) if proto == "h1" else (REQUEST_H2, read_h2_response)
    for i in range(n):
        s = socket.socket()
        if sources:
            # IP_BIND_ADDRESS_NO_PORT (24): the port is chosen at connect, per
            # destination, so each source address gives the whole ephemeral range.
            s.setsockopt(socket.IPPROTO_IP, 24, 1)
            s.bind((f"127.0.0.{2 + (first + i) // CONNS_PER_SOURCE}", 0))
        s.connect(("127.0.0.1", port))
        s.sendall(request)
        read(s)
        socks.append(s)
    return socks


def settle_rss(pid, seconds=2.0):
    """The process's RSS once it stops moving (allocators return memory lazily)."""
    last = rss_kib(pid)
    deadline = time.time() + seconds
    while time.time() < deadline:
        time.sleep(0.25)
        now = rss_kib(pid)
        if now == last:
            break
        last = now
    return last


def measure(pid, port, conns, proto):
    """RSS before any connection, after `conns // 2` idle ones, and after
    `conns` more: (before, middle, after)."""
    # A few connections first, opened and closed: the first request's
    # one-off allocations (the upstream pool, the rule's key) are not counted.
    for s in open_idle(port, 20, proto):
        s.close()
    time.sleep(0.3)
    before = settle_rss(pid)
    # tollgate parks an HTTP/1.1 connection after a second of idling
    # (checked at most a second later): each figure is taken once the
    # connections opened are idle.
    first = open_idle(port, conns // 2, proto)
    time.sleep(2.5)
    middle = settle_rss(pid)
    second = open_idle(port, conns, proto, first=conns // 2)
    time.sleep(2.5)
    after = settle_rss(pid)
    for s in first + second:
        s.close()
    return before, middle, after


def report(target, proto, conns, before, middle, after, extra=""):
    """Prints the run's line; returns the marginal KiB per connection."""
    total = (after - before) / (conns + conns // 2)
    marginal = (after - middle) / conns
    print(
        f"IDLE target={target} proto={proto} conns={conns} rss_before_kib={before} rss_half_kib={middle} "
        f"rss_after_kib={after} kib_per_conn={marginal:.2f} kib_per_conn_from_start={total:.2f}{extra}",
        flush=True,
    )
    return marginal


def run(binary, conns, protocols, targets, work, procs):
    # The client and each proxy hold one descriptor per connection.
    raise_nofile(conns + conns // 2 + 1000)
    up = start_upstream(procs, work)
    results = {}
    for proto in protocols:
        for target in targets:
            # Room for both batches of measure().
            room = conns + conns // 2
            if target == "tollgate":
                port, pid, p = start_tollgate(procs, work, binary, up, room)
            else:
                port, pid, p = start_nginx(procs, work, up, room, proto)
            before, middle, after = measure(pid, port, conns, proto)
            procs.stop(p)
            results[(target, proto)] = report(target, proto, conns, before, middle, after)
    return results


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tollgate", help="a release build of the tollgate binary")
    ap.add_argument("--conns", type=int, default=10_000)
    ap.add_argument("--protocols", default="h1,h2")
    ap.add_argument("--targets", default="tollgate,nginx")
    args = ap.parse_args()
    targets = args.targets.split(",")
    if "tollgate" in targets and not args.tollgate:
        sys.exit("idle_conns: give --tollgate PATH (a release build), or --targets nginx")
    work = tempfile.mkdtemp(prefix="idle-conns.")
    procs = Procs(work)
    try:
        run(args.tollgate, args.conns, args.protocols.split(","), targets, work, procs)
    finally:
        procs.stop_all()
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
