#!/usr/bin/env python3
"""A model of the Redis master that holds a global rule's key, driven by
what benches/hot_key/run.py measured, extrapolated past one machine.

    benches/hot_key/model.py                        # the curves, with the constants below
    benches/hot_key/model.py --measured benches/hot_key/measured.json   # fit the costs to a run, compare, curves
    benches/hot_key/model.py --measured benches/hot_key/measured.json --markdown \
        --instances 1,2,5,10,20,50,100,200,500      # the table in docs/redis.md
    benches/hot_key/model.py --masters 30 --rate 5e6 --limits 1000,1e7 --call-us 10   # an idler server

It is arithmetic, not a simulation of tollgate's code: one steady state per
point, the round trip iterated with the hot master's load until it
settles. Its assumptions, each used once below:

A1 Every request matches two token-bucket rules: a global one (one key,
   limit L per second, burst L) and a per-user one whose keys spread evenly
   over the M masters and are never leased (each user is seen too rarely
   by any one instance: the bench's 10,000 users).
A2 Load is spread evenly: r = R / N requests per second per instance.
A3 Under the limit (R < L), leases are s = lease_percent% of L units. The
   script grants one only while 2 s stay unleased (prelude.lua `lease`),
   so at most H = floor(L / s) - 2 instances hold one at a time; the
   others ask per request. A leased instance costs the hot master
   LEASE_CHECKS checks per s requests (grants, renewals, settles; fitted
   to the leased points: what they add to the hot master's CPU, counted
   in single-check calls).
A4 Over the limit (R >= L) no lease is granted (the bucket is near empty).
   After a rejection the over-limit cache answers until a unit has
   refilled, then the next request to arrive (1 / r later, on average) is
   the probe, and the requests arriving during its round trip are rejected
   locally: g = 1 / (GAP + 1 / r + rtt) global checks per second and
   instance, at most r and at least L / N (each admission is a check). GAP,
   the wait for a unit, is fitted to the run (0.11 ms at L = 1,000: under
   1 / L, since a probe that finds units left clears the entry and the
   requests behind it ask too); the model keeps it for every L (rtt and
   1 / r dominate it). A probe Redis rejects also refunds its per-user
   check.
A5 Each instance batches the checks bound for one node: calls = h / (1 +
   h T) for h checks per second, T = max(rtt, 1 ms) (batch.rs: a call
   waits for the one before and leaves at least SPACING, 1 ms, after it).
   Over the limit an instance has one probe out at a time: each global
   check is a call of its own.
A6 A master is one thread. Its CPU is CALL_US per call plus CHECK_US per
   check (network, parsing and the script's entry per call; the script's
   work per check; see `fit`), independent of load: a busy server reads
   several calls per wake-up and spends less per call, so this overstates
   the cost near saturation. Utilisation rho = CPU seconds per second.
   The round trip is RTT0 plus the M/M/1 wait, the mean call's CPU x rho
   / (1 - rho). At rho >= 1 the master
   cannot keep up: calls wait past `[store] timeout` (20 ms), and the model
   says SATURATED instead of a steady state.
A7 Past saturation (documented behaviour, not modelled in numbers): checks
   time out, after 3 in a row the node is marked down and every check of
   its keys follows `on_error` (allow: the global limit is not enforced;
   deny: every request is refused, since every request carries the global
   key) until the 100 ms probe takes it back, and it saturates again.
"""

import argparse
import json
import math

# Fitted to benches/hot_key/measured.json (2 busy cores); --measured
# fits them to another run. CHECK_US is edge-bench's (batch.rs).
LIMIT = 1000  # the bench's global limit
CALL_US = 24.9  # master CPU per script call, µs
CHECK_US = 5.0  # master CPU per check in it, µs
RTT0 = 0.28e-3  # a check's round trip when the masters are idle, s
LEASE_CHECKS = 2.9  # hot-master checks per lease's worth of leased requests
GAP = 0.11e-3  # A4's wait for a unit after a rejection, s
SPACING = 1e-3  # batch.rs SPACING


def batched(h, rtt):
    """Calls per second for h checks per second from one instance to one node (A5)."""
    return h / (1 + h * max(rtt, SPACING)) if h > 0 else 0.0


def hot_master(n, m, rate, limit, pct, costs, users=True):
    """The steady state of the global key's master (A1-A6); without
    `users`, a master that holds the global key alone (its slot moved to
    a master of its own)."""
    call_us, check_us, rtt0, lease_checks, gap = costs
    r = rate / n
    rtt, out = rtt0, {}
    for _ in range(500):
        if rate < limit:
            s = math.floor(limit * pct / 100)
            holders = max(0, math.floor(limit / s) - 2) if s >= 2 else 0
            f = min(1.0, holders / n)  # A3
            g = r * (1 - f) + (r * f * lease_checks / s if s else 0.0)
            u = r
            admitted = rate
        else:
            g = max(limit / n, min(r, 1 / (gap + 1 / r + rtt)))  # A4
            u = g + (g - limit / n)  # a rejected probe's per-user check is refunded
            admitted = limit
        share = u / m if users else 0.0
        h = g + share  # the hot master's checks from one instance: the key and its share of users
        if rate < limit:
            glob_calls, calls = batched(g, rtt), batched(h, rtt)
        else:  # one probe out at a time per instance: each is a call of its own (A5)
            glob_calls, calls = g, g + batched(share, rtt)
        glob_cpu = n * (glob_calls * call_us + g * check_us) * 1e-6
        user_cpu = n * (batched(share, rtt) * call_us + share * check_us) * 1e-6
        calls *= n
        rho = (calls * call_us + n * h * check_us) * 1e-6
        out = {"glob_checks": n * g, "hot_checks": n * h, "hot_calls": calls, "rho": rho, "glob_rho": glob_cpu,
               "user_rho": user_cpu, "rtt_ms": rtt * 1e3, "admitted": admitted, "saturated": rho >= 1,
               "holders": None if rate >= limit else min(n, holders if pct else 0)}
        if rho >= 1:
            return out
        per_call = rho / calls if calls else 0.0
        new = rtt0 + per_call * rho / (1 - rho)
        if abs(new - rtt) < 1e-9:
            break
        rtt = (rtt + new) / 2
    return out


def global_checks(p):
    """The global key's checks per second at a measured point, where known:
    every request without a lease (lease_percent 0), or over the limit
    every request the over-limit cache did not answer."""
    if p["rate"] > LIMIT:
        return (1 - p["cache_hits_per_req"]) * p["sent_per_s"]
    return p["sent_per_s"] if p["leases"] == 0 else None


def steady(p):
    return p["sent_per_s"] >= 0.9 * p["rate"]


def fit(points):
    """The costs from a run. CALL_US + CHECK_US: what the global key adds to
    its master's CPU (its CPU less the other masters' mean) per global
    check, the median over the points over the limit with 5 instances or
    more, where each global check is a call of its own and the master is
    busiest (under the limit, at fewer calls a second, each call cost more:
    a wake-up of its own; the model is for busy masters). CHECK_US stays at
    its default (edge-bench's 4 to 5 µs per check, batch.rs). RTT0: the
    lightest point's mean store round; GAP: see A4."""
    single = []
    for p in points:
        g = global_checks(p)
        if g and steady(p) and p["instances"] >= 5 and p["rate"] > LIMIT:
            single.append((p["hot_cpu"] - p["cold_cpu"]) * 1e6 / g)
    call_us = max(0.0, median(single) - CHECK_US) if single else CALL_US
    rtt = min(p["store_ms"] for p in points if p["rate"] < LIMIT and p["instances"] >= 2) * 1e-3
    gaps = []
    for p in points:
        if p["rate"] > LIMIT and p["instances"] >= 2 and steady(p):
            r = p["sent_per_s"] / p["instances"]
            gaps.append(1 / (global_checks(p) / p["instances"]) - 1 / r - p["store_ms"] * 1e-3)
    gap = max(0.0, median(gaps)) if gaps else GAP
    # Leased, under the limit: the added CPU in single-check calls, per
    # lease's worth (s units) of requests.
    leased = []
    for p in points:
        if p["rate"] < LIMIT and p["leases"] > 0 and p["instances"] >= 2 and steady(p):
            s = LIMIT * p["leases"] // 100
            if p["instances"] <= LIMIT // s - 2:  # every instance holds a lease (A3)
                checks = (p["hot_cpu"] - p["cold_cpu"]) * 1e6 / (call_us + CHECK_US)
                leased.append(checks / (p["sent_per_s"] / s))
    lease_checks = max(1.0, median(leased)) if leased else LEASE_CHECKS
    return call_us, CHECK_US, rtt, lease_checks, gap


def median(xs):
    xs = sorted(xs)
    return (xs[(len(xs) - 1) // 2] + xs[len(xs) // 2]) / 2


def against_measured(points, costs):
    print("the model against each measured point (3 masters, limit 1,000/s): the global key's master,")
    print("its CPU per second less the other masters' mean (what the global key adds), measured and modelled")
    print(f"  {'K':>3} {'lease%':>6} {'req/s':>6} | {'added CPU meas':>14} {'model':>7} | "
          f"{'global checks/s meas':>20} {'model':>7}")
    for p in points:
        if not steady(p):
            continue
        o = hot_master(p["instances"], 3, p["sent_per_s"], 1000, p["leases"], costs)
        meas = (p["hot_cpu"] - p["cold_cpu"]) * 100
        model = (o["rho"] - o["user_rho"]) * 100
        g = global_checks(p)
        checks = f"{g:>20,.0f}" if g else f"{'':>20}"
        print(f"  {p['instances']:>3} {p['leases']:>6} {p['sent_per_s']:>6.0f} | {meas:>13.1f}% {model:>6.1f}% | "
              f"{checks} {o['glob_checks']:>7,.0f}")


def curve(masters, rate, limit, pcts, costs, instances):
    regime = "over" if rate >= limit else "under"
    print(f"\n{masters} masters, {rate:,.0f} req/s in all, global limit {limit:,.0f}/s ({regime} the limit); "
          f"CALL_US {costs[0]:.1f}, CHECK_US {costs[1]:.1f}, RTT0 {costs[2] * 1e3:.2f} ms")
    print("  the global key's master: global checks/s, CPU of the key alone / with its share of per-user keys")
    print(f"  {'instances':>9} " + "".join(f"{'lease_percent ' + str(p):>40}" for p in pcts))
    for n in instances:
        cells = []
        for pct in pcts:
            o = hot_master(n, masters, rate, limit, pct, costs)
            tot = "SATURATED" if o["saturated"] else f"{o['rho'] * 100:.0f}%"
            cells.append(f"{o['glob_checks']:>12,.0f} {o['glob_rho'] * 100:>10.0f}% {tot:>14}")
        print(f"  {n:>9} " + "".join(f"{c:>40}" for c in cells))


def saturation(masters, rate_per_instance, limit, pct, costs, share=0.5):
    """The fewest instances at which the global key takes `share` of a
    master that holds it alone."""
    for n in range(1, 100_000):
        o = hot_master(n, masters, rate_per_instance * n, limit, pct, costs, users=False)
        if o["saturated"] or o["glob_rho"] >= share:
            return n
    return None


def masters_for_users(n, rate, costs, share=0.5):
    """The fewest masters whose share of per-user checks stays under `share`
    of each (the global key left aside: a limit far above the load)."""
    for m in range(1, 100_000):
        if hot_master(n, m, rate, rate * 100, 1, costs)["user_rho"] <= share:
            return m
    return None


def markdown(masters, rate, limits, costs, instances):
    """The docs' table: per N, the global key's checks and CPU (in cores of
    a master holding it alone) over and under its limit, and the masters
    the per-user keys need."""
    over, under = limits
    print(f"| instances | over the limit ({over:,.0f}/s): global checks/s | cores of its master | "
          f"under it ({under:,.0f}/s), no leases: CPU | leases 1%: global checks/s | CPU | "
          f"masters for the per-user keys |")
    print("|---:|---:|---:|---:|---:|---:|---:|")

    def cores(o):
        return f"{o['glob_rho']:.2f}" + (" (saturated)" if o["saturated"] else "")  # the key alone
    for n in instances:
        o = hot_master(n, masters, rate, over, 1, costs, users=False)
        u0 = hot_master(n, masters, rate, under, 0, costs, users=False)
        u1 = hot_master(n, masters, rate, under, 1, costs, users=False)
        print(f"| {n} | {o['glob_checks']:,.0f} | {cores(o)} | {cores(u0)} | {u1['glob_checks']:,.0f} | "
              f"{cores(u1)} | {masters_for_users(n, rate, costs)} |")


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--measured", help="a run.py --json file: fit the costs to it and compare")
    ap.add_argument("--masters", type=int, default=30)
    ap.add_argument("--rate", type=float, default=5e6)
    ap.add_argument("--limits", default="1000,1e7", help="global limits per second, one curve each")
    ap.add_argument("--leases", default="0,1", help="lease_percent values, one column each")
    ap.add_argument("--instances", default="1,2,5,10,20,50,100,200,500,1000")
    ap.add_argument("--call-us", type=float, help="override CALL_US")
    ap.add_argument("--markdown", action="store_true", help="only the table in docs/redis.md")
    ap.add_argument("--check-us", type=float, help="override CHECK_US")
    args = ap.parse_args()
    costs = (CALL_US, CHECK_US, RTT0, LEASE_CHECKS, GAP)
    if args.measured:
        with open(args.measured) as f:
            points = json.load(f)
        costs = fit(points)
        print(f"{'<!-- ' if args.markdown else ''}fitted: {costs[0]:.1f} µs per call + {costs[1]:.1f} µs per check, RTT0 {costs[2] * 1e3:.2f} ms, "
              f"GAP {costs[4] * 1e3:.2f} ms, LEASE_CHECKS {costs[3]:.1f}{' -->' if args.markdown else ''}\n")
        if not args.markdown:
            against_measured(points, costs)
    costs = (args.call_us or costs[0], args.check_us or costs[1], *costs[2:])
    ns = [int(x) for x in args.instances.split(",")]
    if args.markdown:
        return markdown(args.masters, args.rate, [float(x) for x in args.limits.split(",")][:2], costs, ns)
    pcts = [int(x) for x in args.leases.split(",")]
    for limit in map(float, args.limits.split(",")):
        curve(args.masters, args.rate, limit, pcts, costs, ns)
    per = args.rate / max(ns)
    print(f"\ninstances at which the global key alone takes half its master ({per:,.0f} req/s per instance):")
    for limit in map(float, args.limits.split(",")):
        for pct in pcts:
            print(f"  limit {limit:>12,.0f}/s, lease_percent {pct}: {saturation(args.masters, per, limit, pct, costs)}")
    print("\nmasters for the per-user keys alone, each at most half busy:")
    for n in ns:
        print(f"  {n:>5} instances, {args.rate:,.0f} req/s: {masters_for_users(n, args.rate, costs)}")


if __name__ == "__main__":
    main()
