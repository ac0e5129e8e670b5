#!/usr/bin/env python3
"""A fixed sequence of requests at a fixed rate, for instruction counts that
two builds can share (benches/callgrind_flood.sh with RATE set).

wrk sends as fast as the proxy answers, and under valgrind a proxy answers
some fifty times slower than natively; what a Redis store does per request
moves with that pace (how many refusals the over-limit cache answers, how
often a lease is renewed), so two builds counted under wrk are not asked
the same thing. Here every run sends the same requests (users drawn from a
seeded generator) at the same times, over CONNS keep-alive connections,
each connection one request at a time.

    paced_client.py PORT RATE SECONDS CONNS USERS [SEED]
    -> RESULT requests=N non2xx=M late=L

`late` counts requests sent more than 50 ms after their time: a run with
many is not paced (lower RATE).
"""
import asyncio
import random
import sys
import time


async def read_response(r):
    status = int((await r.readline()).split()[1])
    length, chunked = 0, False
    while True:
        line = await r.readline()
        if line in (b"\r\n", b""):
            break
        name, _, value = line.partition(b":")
        name = name.strip().lower()
        if name == b"content-length":
            length = int(value)
        elif name == b"transfer-encoding" and b"chunked" in value.lower():
            chunked = True
    if chunked:
        while True:
            size = int((await r.readline()).split(b";")[0], 16)
            await r.readexactly(size + 2)
            if size == 0:
                break
    elif length:
        await r.readexactly(length)
    return status


async def connection(k, port, rate, ids, conns, start, stats):
    r, w = await asyncio.open_connection("127.0.0.1", port)
    for i in range(k, len(ids), conns):
        wait = start + i / rate - time.monotonic()
        if wait > 0:
            await asyncio.sleep(wait)
        elif wait < -0.05:
            stats["late"] += 1
        w.write(b"GET /api/items HTTP/1.1\r\nHost: bench\r\nX-User-Id: user-%d\r\n\r\n" % ids[i])
        await w.drain()
        status = await read_response(r)
        stats["requests"] += 1
        stats["non2xx"] += not 200 <= status < 300
    w.close()


async def main(port, rate, seconds, conns, users, seed):
    rng = random.Random(seed)
    ids = [rng.randint(1, users) for _ in range(int(rate * seconds))]
    stats = {"requests": 0, "non2xx": 0, "late": 0}
    start = time.monotonic() + 0.1
    await asyncio.gather(*(connection(k, port, rate, ids, conns, start, stats) for k in range(conns)))
    print("RESULT requests={requests} non2xx={non2xx} late={late}".format(**stats))


if __name__ == "__main__":
    if len(sys.argv) not in (6, 7):
        sys.exit(__doc__)
    a = sys.argv[1:]
    asyncio.run(main(int(a[0]), float(a[1]), float(a[2]), int(a[3]), int(a[4]), int(a[5]) if len(a) > 5 else 42))
