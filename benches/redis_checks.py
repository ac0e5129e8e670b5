#!/usr/bin/env python3
"""What one check costs Redis, per algorithm and batch size.

    benches/redis_checks.py                # CPU us per check (a native redis-server)
    benches/redis_checks.py --callgrind    # also instructions per check (valgrind)
    benches/redis_checks.py --sizes 1,8,32 --calls 20000
    benches/redis_checks.py --callgrind --leased   # a token bucket's lease checks
    benches/redis_checks.py --callgrind --floor    # the least any check can cost
    benches/redis_checks.py --cluster ...          # the server in cluster mode

Starts its own redis-server on a free loopback port, loads each algorithm's
function library exactly as tollgate assembles it (the first lines,
src/store/lua/prelude.lua, box.lua, the algorithm, batch.lua; see
src/store/redis/scripts.rs; --scripts: the script a server without
functions gets), and sends redis-benchmark FCALL (EVALSHA) calls of N
checks each on random keys of 100,000 clients (a rule of 100 per second with
a burst of 100, cost 1, no lease: the `spread` scenario's checks). Prints
one line per algorithm and batch size:

    REDISCHECK algorithm=token_bucket batch=32 us_per_check=4.1 instr_per_check=45465 bytes_per_key=72

us_per_check is the server's CPU time (INFO cpu, user + system) over the
checks decided; it varies with the machine and what else runs.
instr_per_check (--callgrind) counts the instructions redis-server runs in
user space, which do not: compare builds with it. bytes_per_key is MEMORY
USAGE of one key (a 45-byte name) after one check.

--leased (with --callgrind) measures instead what the defaults' busy keys
cost: token-bucket checks that each settle the lease their key holds and
take the next one (the spec above, a lease of 10 in an escrow period of
60 s), on 1,000 keys whose state already holds a level and a slot, in
calls of N checks:

    REDISLEASE batch=4 instr_per_check=65145

--floor measures, beside the token bucket, the least a check can cost
this server: a function whose checks each run one `SET <key> <16 bytes> NX
PX 11 GET` and nothing else (what a fresh token bucket's check writes, with
none of the deciding), and the same `SET` sent bare, pipelined N deep:

    REDISFLOOR kind=lua batch=16 us_per_check=3.9 instr_per_check=19015
    REDISFLOOR kind=plain batch=16 us_per_check=2.8 instr_per_check=14898

--cluster starts the server in cluster mode, one master owning every slot:
each command inside a script then checks its key's slot, and the server
keeps a slot-to-key index, as each master of a cluster does.

Needs redis-server, redis-cli and
redis-benchmark (Debian: redis-server, redis-tools); valgrind for
--callgrind.
"""

import argparse
import glob
import hashlib
import os
import shutil
import socket
import struct
import subprocess
import sys
import tempfile
import time

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
LUA = os.path.join(ROOT, "src", "store", "lua")
# The first lines as scripts.rs writes them (`TAG_CUT`: where the key's
# suffix starts, so that the script finds the penalty strikes beside it;
# `BOX_IN`: how the key holds its penalty box, see box.lua).
ALGORITHMS = {
    "token_bucket": ("local SHAPING = false\nlocal TAG_CUT = -4\nlocal BOX_IN = 'value'\n", "bucket.lua", "tb2"),
    "leaky_bucket": ("local SHAPING = true\nlocal TAG_CUT = -4\nlocal BOX_IN = 'value'\n", "bucket.lua", "lb2"),
    "fixed_window": ("local TAG_CUT = -4\nlocal BOX_IN = 'value'\n", "fixed_window.lua", "fw2"),
    "sliding_window_counter": ("local TAG_CUT = -5\nlocal BOX_IN = 'value'\n", "sliding_window_counter.lua", "swc2"),
    "sliding_window_log": ("local TAG_CUT = -5\nlocal BOX_IN = 'member'\n", "sliding_window_log.lua", "swlw"),
}
SPEC = "1:100:1000000:100:1"  # consume, 100 per 1 s, burst 100, cost 1


def read(name):
    with open(os.path.join(LUA, name)) as f:
        return f.read()


def body(algorithm):
    first, code, _ = ALGORITHMS[algorithm]
    return first + read("prelude.lua") + read("box.lua") + read(code) + read("batch.lua")


def source(algorithm):
    """The script, as tollgate sends it to a server without functions."""
    return body(algorithm) + "return run(ARGV)\n"


def library(algorithm):
    """The function library and its function's name, as tollgate loads them."""
    code = body(algorithm)
    name = "tollgate_" + hashlib.sha1(code.encode()).hexdigest()[:16]
    lib = (f"#!lua name={name}\n{code}redis.register_function{{function_name = '{name}', "
           f"callback = function(_, args) return run(args) end, flags = {{'allow-cross-slot-keys'}}}}\n")
    return lib, name


# --floor: a check that only writes what a fresh token bucket writes.
FLOOR_LIBRARY = """#!lua name=tollgate_floor
redis.register_function{function_name = 'tollgate_floor', flags = {'allow-cross-slot-keys'},
  callback = function(_, args)
    local call = redis.call
    for at = 1, #args, 3 do call('SET', args[at], '0123456789abcdef', 'NX', 'PX', '11', 'GET') end
    return 1
  end}
"""


def floor(native, traced, n, calls):
    """REDISFLOOR lines for batches of n: the floor function, and plain SETs
    pipelined n deep."""
    lua = call_args(["FCALL", "tollgate_floor"], "token_bucket", n)
    plain = ["-P", str(n), "SET", "tollgate:{bench|c0=__rand_int__}:tb2", "0123456789abcdef", "NX", "PX", "11", "GET"]
    for kind, args, per_call in (("lua", lua, n), ("plain", plain, 1)):
        for server in filter(None, (native, traced)):
            subprocess.run(["redis-cli", "-p", str(server.port), "-x", "FUNCTION", "LOAD", "REPLACE"],
                           input=FLOOR_LIBRARY, capture_output=True, text=True, check=True)
        native.bench(args, max(calls // (10 * per_call), 10))
        count = max(calls // per_call, 10)
        c0 = native.cpu()
        native.bench(args, count)
        line = f"REDISFLOOR kind={kind} batch={n} us_per_check={(native.cpu() - c0) * 1e6 / (count * per_call):.2f}"
        if traced:
            traced.bench(args, 20)
            traced_count = max(2000 // per_call, 20)
            line += f" instr_per_check={traced.instructions(args, traced_count) // (traced_count * per_call)}"
        print(line, flush=True)


def free_port():
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    return port


class Redis:
    def __init__(self, work, callgrind, cluster=False):
        self.port = free_port()
        cmd = ["redis-server", "--port", str(self.port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
               "--dir", work]
        if cluster:
            # The bus port named: port + 10000 may be past 65535.
            cmd += ["--cluster-enabled", "yes", "--cluster-config-file", os.path.join(work, "nodes.conf"),
                    "--cluster-port", str(free_port())]
        self.out = os.path.join(work, "callgrind.out")
        if callgrind:
            cmd = ["valgrind", "--tool=callgrind", f"--callgrind-out-file={self.out}"] + cmd
        self.proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        for _ in range(600):
            if self.cli("PING") == "PONG":
                break
            time.sleep(0.1)
        else:
            sys.exit("redis_checks.py: redis-server did not start")
        if cluster:
            # One master owning every slot: a cluster node's per-command
            # work (slot checks, the slot-to-key index) without a network.
            self.cli("CLUSTER", "ADDSLOTSRANGE", "0", "16383")
            for _ in range(600):
                if "cluster_state:ok" in self.cli("CLUSTER", "INFO"):
                    return
                time.sleep(0.1)
            sys.exit("redis_checks.py: the one-node cluster did not come up")

    def cli(self, *args):
        r = subprocess.run(["redis-cli", "-p", str(self.port), *args], capture_output=True, text=True, errors="replace")
        return r.stdout.strip()

    def cpu(self):
        info = dict(l.split(":", 1) for l in self.cli("INFO", "cpu").splitlines() if ":" in l)
        return float(info["used_cpu_user"]) + float(info["used_cpu_sys"])

    def bench(self, args, calls):
        subprocess.run(["redis-benchmark", "-p", str(self.port), "-r", "100000", "-n", str(calls), "-c", "4", "-q",
                        *args], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, check=True)

    def instructions(self, args, calls):
        subprocess.run(["callgrind_control", "-z", str(self.proc.pid)], capture_output=True)
        self.bench(args, calls)
        return self.dumped()

    def dumped(self):
        """Instructions since the last zeroing, dumped now."""
        subprocess.run(["callgrind_control", "-d", str(self.proc.pid)], capture_output=True)
        dumps = sorted(glob.glob(self.out + "*"), key=os.path.getmtime)
        total = 0
        with open(dumps[-1]) as f:
            for line in f:
                if line.startswith(("summary:", "totals:")):
                    total = int(line.split()[1])
        return total

    def stop(self):
        self.proc.terminate()
        self.proc.wait()


def call_args(call, algorithm, n):
    """`call` (["FCALL", name] or ["EVALSHA", sha]) of n checks, each on
    its own random client's key."""
    suffix = ALGORITHMS[algorithm][2]
    args = [*call, "1", f"tollgate:{{bench|c0=__rand_int__}}:{suffix}"]
    for i in range(n):
        tail = "id__rand_int__" if algorithm == "sliding_window_log" else ""
        args += [f"tollgate:{{bench|c{i}=__rand_int__}}:{suffix}", SPEC, tail]
    return args


class Conn:
    """A RESP connection, for calls whose arguments are binary."""

    def __init__(self, port):
        self.sock = socket.create_connection(("127.0.0.1", port))
        self.file = self.sock.makefile("rb")

    def call(self, *args):
        parts = [b"*%d\r\n" % len(args)]
        for arg in args:
            arg = arg.encode() if isinstance(arg, str) else arg
            parts.append(b"$%d\r\n%s\r\n" % (len(arg), arg))
        self.sock.sendall(b"".join(parts))
        return self.read()

    def read(self):
        line = self.file.readline()
        kind, rest = line[:1], line[1:-2]
        if kind == b"-":
            raise RuntimeError(rest.decode())
        if kind in (b"+", b":"):
            return int(rest) if kind == b":" else rest.decode()
        if kind == b"$":
            return None if int(rest) < 0 else self.file.read(int(rest) + 2)[:-2]
        if kind == b"*":
            return [self.read() for _ in range(int(rest))]
        raise RuntimeError(f"unexpected reply {line!r}")


def leased(redis, n, keys=1000, rounds=3):
    """Instructions per check of calls of n lease checks (see --leased)."""
    lib, name = library("token_bucket")
    conn = Conn(redis.port)
    conn.call("FUNCTION", "LOAD", "REPLACE", lib)
    slots = {}

    def one_round():
        for first in range(0, keys, n):
            batch = [f"tollgate:{{bench|user=u{k}}}:tb2" for k in range(first, min(first + n, keys))]
            args = ["FCALL", name, "1", batch[0]]
            for key in batch:
                # want, period, phase, then the lease to settle: its slot,
                # the 10 units taken and 3 of them unspent.
                settle = (slots[key], 10, 3) if key in slots else (0, 0, 0)
                args += [key, SPEC, b"|" + struct.pack("<dddddd", 10, 60_000_000, 0, *settle)]
            reply, i = conn.call(*args), 0
            for key in batch:
                # A grant answers eight doubles in one string (batch.lua).
                if isinstance(reply[i], bytes):
                    values = struct.unpack("<8d", reply[i])
                    if values[6] > 0:
                        slots[key] = int(values[5])
                    i += 1
                else:
                    i += 1 if reply[i] == 20 else 4 if reply[i] >= 10 else 8

    one_round()  # the first leases
    one_round()  # and a settle of each, as in every round measured
    subprocess.run(["callgrind_control", "-z", str(redis.proc.pid)], capture_output=True)
    for _ in range(rounds):
        one_round()
    return redis.dumped() // (rounds * keys)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--sizes", default="1,8,32")
    p.add_argument("--calls", type=int, default=20000, help="checks per measurement (native)")
    p.add_argument("--callgrind", action="store_true")
    p.add_argument("--algorithms", default=",".join(ALGORITHMS))
    p.add_argument("--scripts", action="store_true", help="EVALSHA, as for a server without functions")
    p.add_argument("--leased", action="store_true", help="a token bucket's lease checks (needs --callgrind)")
    p.add_argument("--cluster", action="store_true", help="the server in cluster mode, one master owning every slot")
    p.add_argument("--floor", action="store_true", help="also the least a check can cost: one SET in a function, and bare")
    a = p.parse_args()
    if a.leased and not a.callgrind:
        sys.exit("redis_checks.py: --leased counts instructions: add --callgrind")
    for tool in ["redis-server", "redis-cli", "redis-benchmark"] + (["valgrind"] if a.callgrind else []):
        if not shutil.which(tool):
            sys.exit(f"redis_checks.py: {tool} not found (apt-get install redis-server redis-tools valgrind)")
    sizes = [int(s) for s in a.sizes.split(",")]
    with tempfile.TemporaryDirectory(prefix="redis-checks.") as work:
        if a.leased:
            for n in sizes:
                traced = Redis(tempfile.mkdtemp(dir=work), callgrind=True, cluster=a.cluster)
                try:
                    print(f"REDISLEASE batch={n} instr_per_check={leased(traced, n)}", flush=True)
                finally:
                    traced.stop()
            return
        native = Redis(work, callgrind=False, cluster=a.cluster)
        traced = Redis(tempfile.mkdtemp(dir=work), callgrind=True, cluster=a.cluster) if a.callgrind else None
        try:
            for algorithm in a.algorithms.split(","):
                src = source(algorithm)
                lib, name = library(algorithm)
                for n in sizes:
                    if a.scripts:
                        call = ["EVALSHA", native.cli("SCRIPT", "LOAD", src)]
                    else:
                        subprocess.run(["redis-cli", "-p", str(native.port), "-x", "FUNCTION", "LOAD", "REPLACE"],
                                       input=lib, capture_output=True, text=True, check=True)
                        call = ["FCALL", name]
                    args = call_args(call, algorithm, n)
                    native.bench(args, max(a.calls // (10 * n), 10))  # warm-up
                    calls = max(a.calls // n, 10)
                    c0 = native.cpu()
                    native.bench(args, calls)
                    us = (native.cpu() - c0) * 1e6 / (calls * n)
                    # An hour-long window, so that the key is still there
                    # to be measured.
                    key = f"tollgate:{{bench|ip=203.0.113.7}}:{ALGORITHMS[algorithm][2]}"
                    native.cli(*call, "1", key, key, "1:100:3600000000:100:1", "id1")
                    size = native.cli("MEMORY", "USAGE", key)
                    line = f"REDISCHECK algorithm={algorithm} batch={n} us_per_check={us:.2f}"
                    if traced:
                        traced.cli("SCRIPT", "LOAD", src)
                        subprocess.run(["redis-cli", "-p", str(traced.port), "-x", "FUNCTION", "LOAD", "REPLACE"],
                                       input=lib, capture_output=True, text=True, check=True)
                        traced.bench(args, 20)
                        traced_calls = max(2000 // n, 20)
                        line += f" instr_per_check={traced.instructions(args, traced_calls) // (traced_calls * n)}"
                    print(f"{line} bytes_per_key={size}", flush=True)
            if a.floor:
                for n in sizes:
                    floor(native, traced, n, a.calls)
        finally:
            native.stop()
            if traced:
                traced.stop()


if __name__ == "__main__":
    main()
