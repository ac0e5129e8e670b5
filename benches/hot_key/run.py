#!/usr/bin/env python3
"""Many tollgate instances, one hot key: what a global limit costs the
Redis master that holds it, as instances are added.

    cargo build --release --bin tollgate
    benches/hot_key/run.py                        # K = 1 2 5 10 20, lease_percent 1 and 0, 800 and 3,000 req/s
    benches/hot_key/run.py --instances 1,20 --rates 3000 --duration 8
    benches/hot_key/run.py --rates 800 --leases 10,25   # where the leases run out (floor(100/pct) - 2 holders)
    benches/hot_key/run.py --json out.json        # the points, for benches/hot_key/model.py

Starts a 3-master Redis Cluster (no replicas: the machine has 2 cores) from
redis-server on free loopback ports, an nginx upstream answering 200, and for
each point K tollgate instances (one worker each, TOLLGATE_WORKERS=1) sharing
the cluster with one rules file of two token-bucket rules:

  global    key = [], limit 1,000/s: every request of every instance on one key
  per-user  key = x-user-id, limit 100/s: 10,000 users, a limit none reaches

A paced load client (its own process) spreads a fixed total rate evenly over
the instances, each request for a random one of the 10,000 users. The same
total rate at every K, so only the number of instances changes. Leases on is
the default `[store]` (`lease_percent` 1); leases off is `lease_percent = 0`;
--leases takes the `lease_percent` values to run.

Per point, over the measurement window (after --warmup):
  calls/req      script calls (FCALL/EVALSHA/EVAL) on all masters per request sent
  cmds/req       every command the masters processed per request (those a
                 script runs inside count too: TIME, GET, SET)
  hot_us/req     CPU (user + sys) of the master holding the global key, per request
  cold_us/req    the same, mean of the two other masters (their per-user share only)
  hot_calls/s    script calls per second on the hot master
  us/call        hot master CPU per script call
  admitted/s     200s per second, and against min(sent, 1,000) in percent
  lease_hits/req requests every rule of which a lease answered (the per-user
                 rule is not leased: near 0 even where the global key is)
  cache_hits/req requests the over-limit cache answered (no call at all)
The JSON has more: the hot and cold masters' calls and CPU per second, the
mean store round (store_ms), store errors. docs/redis.md derives the global
key's share as the hot master's figure less the cold masters' mean.
  tg_calls/req   tollgate_redis_calls_total per request (every instance)
  checks/call    tollgate_redis_call_checks_total / tollgate_redis_calls_total

CPU layout: Redis, nginx and the load client on CPU 0, the tollgate
instances on CPU 1. Counts and CPU time per request, not latencies: a busy
machine changes how much of the offered rate is sent, which each line shows.

Python 3 standard library; needs redis-server, redis-cli, nginx, taskset.
"""

import argparse
import asyncio
import json
import os
import random
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
LIMIT = 1000
USERS = 10_000
RULES = f"""[[rule]]
name = "global"
key = []
limit = {LIMIT}
window = "1s"

[[rule]]
name = "per-user"
key = ["header:x-user-id"]
limit = 100
window = "1s"
"""
SCRIPT_CMDS = ("cmdstat_fcall", "cmdstat_evalsha", "cmdstat_eval")
METRICS = ["tollgate_redis_calls_total", "tollgate_redis_call_checks_total", "tollgate_lease_hits_total",
           "tollgate_leases_granted_total", "tollgate_lease_renewals_total", "tollgate_local_cache_hits_total",
           "tollgate_store_errors_total", "tollgate_store_duration_seconds_sum",
           "tollgate_store_duration_seconds_count"]


_taken = set()


def free_port():
    """A free loopback port below the kernel's ephemeral range (32768 on),
    where outgoing connections would take it between this check and the
    listener's bind, with room for a cluster node's bus port (+ 10000);
    never one this run handed out before."""
    while True:
        p = random.randrange(20000, 32000)
        if p in _taken:
            continue
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", p))
                s.close()
                with socket.socket() as b:
                    b.bind(("127.0.0.1", p + 10000))
                _taken.add(p)
                return p
            except OSError:
                continue


def cli(port, *args):
    out = subprocess.run(["redis-cli", "-p", str(port), *map(str, args)], capture_output=True, text=True, timeout=30)
    return out.stdout + out.stderr


def wait_for(what, cond, within=30.0, log=None):
    end = time.time() + within
    while not cond():
        if time.time() > end:
            tail = open(log).read()[-2000:] if log and os.path.exists(log) else ""
            raise RuntimeError(f"hot_key: gave up waiting for {what}\n{tail}")
        time.sleep(0.05)


def http_get(url):
    try:
        with urllib.request.urlopen(url, timeout=5) as r:
            return r.status, r.read().decode()
    except OSError:
        return 0, ""


def info(port):
    """INFO as a dict of numbers (and the commandstats' calls and usec)."""
    out = {}
    for line in cli(port, "INFO", "all").splitlines():
        if ":" not in line:
            continue
        k, v = line.strip().split(":", 1)
        if k.startswith("cmdstat_"):
            f = dict(x.split("=") for x in v.split(","))
            out[k + ".calls"], out[k + ".usec"] = float(f["calls"]), float(f["usec"])
        else:
            try:
                out[k] = float(v)
            except ValueError:
                pass
    return out


class Cluster:
    """3 masters, no replicas, pinned to CPU 0."""

    def __init__(self, work):
        self.ports, self.procs = [free_port() for _ in range(3)], []
        for p in self.ports:
            d = os.path.join(work, f"redis-{p}")
            os.makedirs(d)
            cmd = ["taskset", "-c", "0", "redis-server", "--port", p, "--bind", "127.0.0.1", "--dir", d, "--save", "",
                   "--appendonly", "no", "--logfile", "redis.log", "--protected-mode", "no", "--cluster-enabled",
                   "yes", "--cluster-config-file", "nodes.conf", "--cluster-node-timeout", "2000"]
            self.procs.append(subprocess.Popen(list(map(str, cmd)), stdout=subprocess.DEVNULL))
        for p in self.ports:
            wait_for(f"redis on {p}", lambda p=p: "PONG" in cli(p, "PING"))
        out = subprocess.run(["redis-cli", "--cluster", "create", *[f"127.0.0.1:{p}" for p in self.ports],
                              "--cluster-yes"], capture_output=True, text=True)
        if "All 16384 slots covered" not in out.stdout:
            sys.exit("hot_key: cluster create failed:\n" + out.stdout + out.stderr)
        wait_for("the cluster", lambda: all("cluster_state:ok" in cli(p, "CLUSTER", "INFO") for p in self.ports))

    def url(self):
        a = self.ports
        return f"redis-cluster://127.0.0.1:{a[0]}?node=127.0.0.1:{a[1]}&node=127.0.0.1:{a[2]}"

    def hot(self):
        """The master holding the global rule's key (looked for until it is written)."""
        end = time.time() + 30
        while time.time() < end:
            for p in self.ports:
                if cli(p, "--scan", "--pattern", "*{global|*").strip():
                    return p
            time.sleep(0.5)
        raise RuntimeError("hot_key: the global key was not written in 30 s")

    def stop(self):
        for c in self.procs:
            c.kill()
            c.wait()


class Upstream:
    """nginx answering 200 "ok" with keep-alive, pinned to CPU 0."""

    def __init__(self, work):
        self.port, d = free_port(), os.path.join(work, "up")
        os.makedirs(d)
        with open(os.path.join(d, "nginx.conf"), "w") as f:
            f.write(f"worker_processes 1; daemon off; pid {d}/nginx.pid; error_log {d}/error.log;\n"
                    "events { worker_connections 8192; }\n"
                    f"http {{ access_log off; server {{ listen 127.0.0.1:{self.port} backlog=4096; "
                    "keepalive_requests 10000000; location / { return 200 \"ok\\n\"; } } }\n")
        nginx = shutil.which("nginx") or "/usr/sbin/nginx"
        self.proc = subprocess.Popen(["taskset", "-c", "0", nginx, "-p", d, "-c", os.path.join(d, "nginx.conf")],
                                     stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        wait_for("nginx", lambda: http_get(f"http://127.0.0.1:{self.port}/")[0] == 200)

    def stop(self):
        self.proc.terminate()
        self.proc.wait()


class Tollgates:
    """K instances, one worker each, pinned to CPU 1."""

    def __init__(self, binary, work, k, url, upstream, leases):
        self.procs, self.proxy, self.admin = [], [], []
        rules = os.path.join(work, "rules.toml")
        with open(rules, "w") as f:
            f.write(RULES)
        extra = f"lease_percent = {leases}\n" if leases != 1 else ""
        env = dict(os.environ, TOLLGATE_WORKERS="1", RUST_LOG="warn")
        for i in range(k):
            proxy, admin = free_port(), free_port()
            conf = os.path.join(work, f"tollgate-{i}.toml")
            with open(conf, "w") as f:
                f.write(f'[listen]\nproxy = "127.0.0.1:{proxy}"\nadmin = "127.0.0.1:{admin}"\n'
                        f'[rules]\npath = "{rules}"\n'
                        f'[store]\nbackend = "redis"\nurl = "{url}"\n{extra}'
                        f'[[upstream]]\nname = "svc"\nurl = "http://127.0.0.1:{upstream}"\n'
                        f'[[route]]\npath_prefix = "/"\nupstream = "svc"\n')
            log = open(os.path.join(work, f"tollgate-{i}.log"), "w")
            self.procs.append(subprocess.Popen(["taskset", "-c", "1", binary, "--config", conf], stdout=log,
                                               stderr=log, env=env))
            self.proxy.append(proxy)
            self.admin.append(admin)
        try:
            for i, a in enumerate(self.admin):
                up = lambda a=a: http_get(f"http://127.0.0.1:{a}/healthz/store")[0] == 200  # noqa: E731
                wait_for(f"tollgate admin {a}", up, within=120.0, log=os.path.join(work, f"tollgate-{i}.log"))
        except RuntimeError:
            self.stop()
            raise

    def metrics(self):
        """Each metric of METRICS summed over its samples and every instance."""
        total = dict.fromkeys(METRICS, 0.0)
        for a in self.admin:
            for line in http_get(f"http://127.0.0.1:{a}/metrics")[1].splitlines():
                name = re.split(r"[ {]", line, 1)[0]
                if name in total:
                    total[name] += float(line.rsplit(" ", 1)[1])
        return total

    def stop(self):
        for p in self.procs:
            p.send_signal(signal.SIGINT)
        for p in self.procs:
            try:
                p.wait(10)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()


# ---------------------------------------------------------------- the load client (its own process)

async def connection(port, rate, stop_at, counts):
    """One keep-alive connection sending `rate` requests per second on a
    fixed schedule; a late answer is caught up on at once (near open loop)."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    start, n = time.time() + random.random() / rate, 0
    while True:
        due = start + n / rate
        if due >= stop_at:
            break
        now = time.time()
        if due > now:
            await asyncio.sleep(due - now)
        user = random.randrange(1, USERS + 1)
        writer.write(f"GET /api/items HTTP/1.1\r\nhost: bench\r\nx-user-id: user-{user}\r\n\r\n".encode())
        head = await reader.readuntil(b"\r\n\r\n")
        m = re.search(rb"(?i)\r\ncontent-length: *(\d+)", head)
        await reader.readexactly(int(m.group(1)) if m else 0)
        second = int(time.time())
        counts.setdefault(second, {}).setdefault(int(head[9:12]), 0)
        counts[second][int(head[9:12])] += 1
        n += 1
    writer.close()


async def load(ports, rate, conns, seconds):
    counts = {}
    stop_at = time.time() + seconds
    per = rate / (len(ports) * conns)
    await asyncio.gather(*(connection(p, per, stop_at, counts) for p in ports for _ in range(conns)))
    return counts


def run_load(args):
    ports = [int(p) for p in args.load.split(",")]
    counts = asyncio.run(load(ports, args.rate, args.conns, args.seconds))
    print(json.dumps({str(k): v for k, v in counts.items()}))


# ---------------------------------------------------------------- one point

def snapshot(cluster, tollgates):
    return time.time(), {p: info(p) for p in cluster.ports}, tollgates.metrics()


def delta(a, b, key):
    return b.get(key, 0.0) - a.get(key, 0.0)


def point(args, binary, work, cluster, upstream, k, rate, leases):
    for p in cluster.ports:
        cli(p, "FLUSHALL")
    tg = Tollgates(binary, work, k, cluster.url(), upstream.port, leases)
    conns = max(2, -(-16 // k))
    seconds = args.warmup + args.duration + 1
    client = subprocess.Popen(["taskset", "-c", "0", sys.executable, __file__, "--load",
                               ",".join(map(str, tg.proxy)), "--rate", str(rate), "--conns", str(conns),
                               "--seconds", str(seconds)], stdout=subprocess.PIPE, text=True)
    time.sleep(args.warmup)
    try:
        hot = cluster.hot()
    except RuntimeError:
        client.kill()
        client.wait()
        tg.stop()
        raise
    t0, r0, m0 = snapshot(cluster, tg)
    time.sleep(args.duration)
    t1, r1, m1 = snapshot(cluster, tg)
    out, _ = client.communicate(timeout=seconds + 60)
    tg.stop()
    counts = json.loads(out)
    # Whole seconds inside the window, by the second an answer arrived.
    secs = [s for s in map(int, counts) if t0 <= s and s + 1 <= t1]
    window = max(len(secs), 1)
    sent = sum(sum(counts[str(s)].values()) for s in secs)
    ok = sum(counts[str(s)].get("200", 0) for s in secs)
    req = sent / window  # requests per second answered in the window
    el = t1 - t0
    cpu = {p: (delta(r0[p], r1[p], "used_cpu_user") + delta(r0[p], r1[p], "used_cpu_sys")) / el for p in cluster.ports}
    calls = {p: sum(delta(r0[p], r1[p], c + ".calls") for c in SCRIPT_CMDS) / el for p in cluster.ports}
    cmds = {p: delta(r0[p], r1[p], "total_commands_processed") / el for p in cluster.ports}
    cold = [p for p in cluster.ports if p != hot]
    tgd = {m: (m1[m] - m0[m]) / el for m in METRICS}
    res = {
        "instances": k, "rate": rate, "leases": leases, "sent_per_s": round(req, 1), "admitted_per_s": ok / window,
        "expected_per_s": min(req, LIMIT),
        "calls_per_req": sum(calls.values()) / req, "cmds_per_req": sum(cmds.values()) / req,
        "hot_calls_per_s": calls[hot], "cold_calls_per_s": sum(calls[p] for p in cold) / len(cold),
        "hot_cpu": cpu[hot], "cold_cpu": sum(cpu[p] for p in cold) / len(cold),
        "hot_us_per_req": cpu[hot] / req * 1e6, "cold_us_per_req": sum(cpu[p] for p in cold) / len(cold) / req * 1e6,
        "hot_us_per_call": cpu[hot] / max(calls[hot], 1e-9) * 1e6,
        "tg_calls_per_req": tgd["tollgate_redis_calls_total"] / req,
        "checks_per_call": tgd["tollgate_redis_call_checks_total"] / max(tgd["tollgate_redis_calls_total"], 1e-9),
        "lease_hits_per_req": tgd["tollgate_lease_hits_total"] / req,
        "cache_hits_per_req": tgd["tollgate_local_cache_hits_total"] / req,
        "store_errors_per_s": tgd["tollgate_store_errors_total"],
        "store_ms": tgd["tollgate_store_duration_seconds_sum"] / max(tgd["tollgate_store_duration_seconds_count"], 1e-9)
        * 1e3,
    }
    res["admitted_vs_limit_pct"] = (res["admitted_per_s"] / res["expected_per_s"] - 1) * 100
    return res


HEADER = ("K  lease rate  sent/s admit/s  vs-exp%  calls/req cmds/req hot_us/req cold_us/req hot_calls/s us/call "
          "tg_calls/req checks/call lease_hits/req cache_hits/req")


def line(r):
    return (f"{r['instances']:<2} {r['leases']:<3}%   {r['rate']:<5} {r['sent_per_s']:>7.0f} "
            f"{r['admitted_per_s']:>7.0f} {r['admitted_vs_limit_pct']:>+7.1f} {r['calls_per_req']:>9.3f} "
            f"{r['cmds_per_req']:>8.3f} {r['hot_us_per_req']:>10.2f} {r['cold_us_per_req']:>11.2f} "
            f"{r['hot_calls_per_s']:>11.0f} {r['hot_us_per_call']:>7.1f} {r['tg_calls_per_req']:>12.3f} "
            f"{r['checks_per_call']:>11.2f} {r['lease_hits_per_req']:>14.3f} {r['cache_hits_per_req']:>14.3f}")


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    target = os.environ.get("CARGO_TARGET_DIR", os.path.join(ROOT, "target"))
    ap.add_argument("--tollgate", default=os.path.join(target, "release", "tollgate"))
    ap.add_argument("--instances", default="1,2,5,10,20")
    ap.add_argument("--rates", default="800,3000", help="total offered requests per second (limit: 1,000)")
    ap.add_argument("--leases", default="1,0", help="lease_percent values (1, the default: leases on; 0: off)")
    ap.add_argument("--warmup", type=float, default=4.0)
    ap.add_argument("--duration", type=float, default=10.0)
    ap.add_argument("--json", help="write the points here")
    ap.add_argument("--load", help=argparse.SUPPRESS)
    ap.add_argument("--rate", type=float, help=argparse.SUPPRESS)
    ap.add_argument("--conns", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--seconds", type=float, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.load:
        return run_load(args)
    if not os.access(args.tollgate, os.X_OK):
        sys.exit(f"hot_key: no tollgate binary at {args.tollgate} (cargo build --release --bin tollgate)")
    work = tempfile.mkdtemp(prefix="hot-key.")
    cluster = upstream = None
    results = []
    try:
        cluster, upstream = Cluster(work), Upstream(work)
        print("HOTKEY " + HEADER.strip(), flush=True)
        for rate in map(int, args.rates.split(",")):
            for k in map(int, args.instances.split(",")):
                for leases in map(int, args.leases.split(",")):
                    try:
                        r = point(args, args.tollgate, work, cluster, upstream, k, rate, leases)
                    except RuntimeError as e:  # this point only: the others still run
                        print(f"HOTKEY {k} instances, lease_percent {leases}, {rate}/s: {e}", flush=True)
                        continue
                    results.append(r)
                    print("HOTKEY " + line(r), flush=True)
                    if args.json:  # after every point: a run cut short keeps what it measured
                        with open(args.json, "w") as f:
                            json.dump(results, f, indent=1)
    finally:
        for c in (upstream, cluster):
            if c:
                c.stop()
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
