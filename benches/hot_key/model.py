#!/usr/bin/env python3
"""A model of the Redis master that holds a global rule's key, driven by
what benches/hot_key/run.py measured, extrapolated past one machine.

    benches/hot_key/model.py                       # the default curves (constants below)
    benches/hot_key/model.py --measured out.json   # also the model against each measured point
    benches/hot_key/model.py --masters 30 --rate 5e6 --limit 1000

It is arithmetic, not a simulation of tollgate's code: a steady state per
point, found by iterating the round trip (which grows with the hot master's
load) until it settles. What it assumes, each stated where it is used:

1. Every request matches two rules: a global token bucket (one key, limit L
   per second, burst L) and a per-user one whose keys spread evenly over
   the M masters and are never leased (each user is seen too rarely by any
   one instance, as in the bench: 10,000 users).
2. Load is spread evenly over N instances: r = R / N per instance.
3. A request whose global check is answered locally (a lease, or the
   over-limit cache) makes no call at all when the cache rejects it, and
   one per-user check when a lease admits it. Every other request makes a
   global check on the hot master and a per-user check on some master.
4. Under the limit (R < L), leases of s = lease_percent% of L units: a
   lease is granted only while 2 s stay unleased in the bucket
   (prelude.lua `lease`), so at most floor(L / s) - 2 instances hold one at
   a time; the others ask per request. A leased request costs the hot
   master LEASED_CALLS / s calls (LEASED_CALLS, measured: grants and
   renewals per lease's worth of requests).
5. Over the limit, leases are never granted (the bucket is near empty) and
   each instance asks once per probe: after a rejection, the cache answers
   until one unit has refilled (1 / L), then the next request to arrive
   (half an interval, 1 / 2r, on average for paced clients) asks, and the
   requests arriving during its round trip are rejected locally:
   p = 1 / (1 / L + 1 / (2 r) + rtt) probes per second and instance, at
   most r. Every admitted request was a call, so at least L calls.
6. A master is one thread: its CPU per call (US_PER_CALL, measured on this
   machine's masters, network included) is the same for the global key
   and a per-user key, and does not change with load; utilisation
   rho = calls/s x US_PER_CALL. The round trip is RTT0 + the M/M/1 wait,
   US_PER_CALL x rho / (1 - rho). At rho >= 1 the master cannot keep up:
   calls wait past `[store] timeout`, and the model reports it saturated
   instead of a steady state.
7. Past saturation, what the documentation says tollgate does (not
   modelled in numbers): checks time out, the node is marked down after 3
   failures in a row and every check of its keys follows `on_error` (allow:
   the global limit is not enforced; deny: every request is refused, since
   every request carries the global key), until the 100 ms probe takes it
   back and it saturates again.

Accuracy under the limit is not modelled: nothing is rejected. Over it, the
model says L admitted while unsaturated (what the bench measured; see
docs/redis.md); leases then hold nothing back, since none is granted.
"""

import argparse
import json
import math

# Measured on this machine (benches/hot_key/run.py, see docs/redis.md);
# --measured replaces them with a run's own.
US_PER_CALL = 20.0  # master CPU per script call, µs
RTT0 = 0.3e-3  # a call's round trip with idle masters, s
LEASED_CALLS = 1.5  # hot-master calls per lease's worth (s) of leased requests


def hot_master(n, m, rate, limit, pct, us_per_call=US_PER_CALL, rtt0=RTT0, leased_calls=LEASED_CALLS):
    """The steady state of the hot master for n instances, m masters, rate
    req/s in total, a global limit and lease_percent pct."""
    r = rate / n
    rtt, out = rtt0, None
    for _ in range(200):
        if rate < limit:
            s = math.floor(limit * pct / 100)
            holders = max(0, math.floor(limit / s) - 2) if s >= 2 else 0
            f = min(1.0, holders / n)  # share of requests served from leases (assumption 4)
            glob = rate * f * leased_calls / s if s else 0.0
            glob += rate * (1 - f)
            user = rate  # every request checks its user (assumption 3)
            admitted = rate
        else:
            p = min(r, 1 / (1 / limit + 1 / (2 * r) + rtt))  # assumption 5
            glob = max(limit, n * p)
            user = glob
            admitted = limit
        calls = glob + user / m  # the hot master: the global key and its share of users
        rho = calls * us_per_call * 1e-6
        out = {"instances": n, "rate": rate, "glob_calls": glob, "hot_calls": calls, "rho": rho,
               "rtt_ms": rtt * 1e3, "admitted": admitted, "saturated": rho >= 1}
        if rho >= 1:
            return out
        new = rtt0 + us_per_call * 1e-6 * rho / (1 - rho)
        if abs(new - rtt) < 1e-9:
            break
        rtt = (rtt + new) / 2
    return out


def calibrate(points):
    """The model's constants from a run of run.py: CPU per call on the hot
    master, the round trip at the lightest point, the leased calls."""
    us = [p["hot_us_per_call"] for p in points if p["hot_calls_per_s"] > 100]
    rtt = min((p["store_ms"] for p in points if p.get("store_ms")), default=RTT0 * 1e3) * 1e-3
    leased = []
    for p in points:
        if p["leases"] and p["rate"] < 1000:
            s = math.floor(1000 * p["leases"] / 100)
            holders = max(0, 1000 // s - 2)
            if holders >= p["instances"]:
                glob = (p["hot_calls_per_s"] - p["cold_calls_per_s"])  # the global key's calls
                leased.append(max(glob, 0) / p["sent_per_s"] * s)
    return (sorted(us)[len(us) // 2] if us else US_PER_CALL, rtt,
            sorted(leased)[len(leased) // 2] if leased else LEASED_CALLS)


def against_measured(points, consts):
    print("model against the measured points (3 masters, limit 1,000/s):")
    print(f"  {'K':>3} {'lease%':>6} {'rate':>6} | {'hot calls/s meas':>16} {'model':>7} | "
          f"{'global calls/req meas':>21} {'model':>6}")
    for p in points:
        mo = hot_master(p["instances"], 3, p["sent_per_s"], 1000, p["leases"], *consts)
        meas_glob = max(p["hot_calls_per_s"] - p["cold_calls_per_s"], 0) / p["sent_per_s"]
        print(f"  {p['instances']:>3} {p['leases']:>6} {p['sent_per_s']:>6.0f} | {p['hot_calls_per_s']:>16.0f} "
              f"{mo['hot_calls']:>7.0f} | {meas_glob:>21.3f} {mo['glob_calls'] / p['sent_per_s']:>6.3f}")


def curve(masters, rate, limit, pcts, consts, instances):
    print(f"\nmodel: {masters} masters, {rate:,.0f} req/s in total, global limit {limit:,.0f}/s, "
          f"US_PER_CALL {consts[0]:.1f} µs, RTT0 {consts[1] * 1e3:.2f} ms, LEASED_CALLS {consts[2]:.2f}")
    print(f"  {'instances':>9} " + " ".join(f"{'lease ' + str(p) + '%: calls/s  util':>26}" for p in pcts))
    for n in instances:
        cells = []
        for pct in pcts:
            o = hot_master(n, masters, rate, limit, pct, *consts)
            util = "SATURATED" if o["saturated"] else f"{o['rho'] * 100:5.1f}%"
            cells.append(f"{o['hot_calls']:>16,.0f} {util:>9}")
        print(f"  {n:>9} " + " ".join(f"{c:>26}" for c in cells))


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--measured", help="a run.py --json file: calibrate on it and compare")
    ap.add_argument("--masters", type=int, default=30)
    ap.add_argument("--rate", type=float, default=5e6)
    ap.add_argument("--limit", type=float, default=None, help="one global limit (default: the standard set)")
    ap.add_argument("--instances", default="1,2,5,10,20,50,100,200,500,1000")
    args = ap.parse_args()
    consts = (US_PER_CALL, RTT0, LEASED_CALLS)
    if args.measured:
        with open(args.measured) as f:
            points = json.load(f)
        consts = calibrate(points)
        against_measured(points, consts)
    ns = [int(x) for x in args.instances.split(",")]
    limits = [args.limit] if args.limit else [1000, 10 * args.rate]
    for limit in limits:
        curve(args.masters, args.rate, limit, [0, 1], consts, ns)


if __name__ == "__main__":
    main()
