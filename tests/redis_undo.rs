//! Calls that take back what an earlier one counted (a refund of a
//! rejected request, a settle of a reservation, a lease given back) reach
//! Redis twice when a call is sent again, and must be applied once: no
//! unit is given back twice, and no key admits past its limit.
//!
//! - On one server behind a [`Relay`] that sends every such call to the
//!   node twice: what the node counts afterwards is exact.
//! - On a cluster whose master is reached through a relay that holds the
//!   replies of a refund (the node ran it; tollgate does not know), while a
//!   cluster sync makes fred drop that connection: fred reports the refund
//!   out of attempts and tollgate sends it again, to the same node.

use crate::support;

use std::net::SocketAddr;
use support::redis::{RedisCluster, RedisServer, tollgate_config};
use support::relay::{Command, Relay};
use support::{Tollgate, Upstream, eventually};

/// Whether `command` is a script call that takes back (mode 2, a refund
/// or a give-back, or 4, a settle) on a key of `rule`: its checks are
/// key, spec, tail after the first key (`batch.lua`).
fn takes_back(command: &Command, rule: &str) -> bool {
    let call = command.first().is_some_and(|c| matches!(c.as_slice(), b"FCALL" | b"EVALSHA" | b"EVAL"));
    let tag = format!("{{{rule}|");
    call && command.len() >= 7
        && command[4..].chunks(3).any(|check| {
            check.len() == 3
                && check[0].windows(tag.len()).any(|w| w == tag.as_bytes())
                && (check[1].starts_with(b"2:") || check[1].starts_with(b"4:"))
        })
}

fn addr(port: u16) -> SocketAddr {
    SocketAddr::from(([127, 0, 0, 1], port))
}

/// `spend` (limit 5 an hour, `algorithm`) for every request, and `gate`
/// (1 an hour) for `/gated`: a request to `/gated` once the gate is spent
/// is counted by `spend`, rejected by `gate`, and refunded to `spend`.
fn gated_rules(spend: &str, algorithm: &str) -> String {
    format!(
        "[[rule]]\nname = \"{spend}\"\nkey = [\"ip\"]\nalgorithm = \"{algorithm}\"\nlimit = 5\nwindow = \"1h\"\nburst = 5\n\
         [[rule]]\nname = \"gate-{spend}\"\nmatch = {{ path = \"/gated\" }}\nkey = [\"ip\"]\nlimit = 1\nwindow = \"1h\"\n"
    )
}

/// Requests from `ip` until one is refused: how many were admitted.
async fn admitted_until_refused(tg: &Tollgate, ip: &str) -> usize {
    for n in 0..20 {
        let status = tg.get("/").from_ip(ip).send().await.status.as_u16();
        if status != 200 {
            assert_eq!(status, 429);
            return n;
        }
    }
    panic!("never refused");
}

#[tokio::test]
async fn a_refund_sent_twice_is_applied_once() {
    let redis = RedisServer::start();
    let relay = Relay::start(addr(redis.port)).await;
    let up = Upstream::start().await;
    let url = format!("redis://127.0.0.1:{}", relay.port);
    let config = tollgate_config(up.addr, &url, "on_error = \"deny\"\nlease_percent = 0");
    for algorithm in ["fixed_window", "sliding_window_counter", "token_bucket"] {
        let spend = format!("spend-{}", algorithm.replace('_', "-"));
        let tg = Tollgate::with(&config, &[("rules.toml", &gated_rules(&spend, algorithm))]).await;
        let rule = spend.clone();
        relay.duplicate(move |c| takes_back(c, &rule));
        let ip = "198.51.100.7";
        assert_eq!(tg.get("/").from_ip(ip).send().await.status, 200);
        assert_eq!(tg.get("/").from_ip(ip).send().await.status, 200);
        assert_eq!(tg.get("/gated").from_ip(ip).send().await.status, 200, "{algorithm}");
        // Refused by the gate: counted by `spend`, then refunded. (The
        // next ones are refused from the over-limit cache, asking nobody.)
        let before = relay.duplicated();
        for _ in 0..3 {
            assert_eq!(tg.get("/gated").from_ip(ip).send().await.status, 429, "{algorithm}");
        }
        eventually("the refund and its duplicate ran", || async { relay.duplicated() > before }).await;
        // Three counted: two more, and never past the limit.
        assert_eq!(admitted_until_refused(&tg, ip).await, 2, "{algorithm}: a refund was applied twice");
        tg.stop().await;
    }
}

/// A rule whose requests reserve 10 tokens and settle on what the upstream
/// reports (`x-tokens-used`).
const SETTLED: &str = "[[rule]]\nname = \"settled\"\nkey = [\"ip\"]\nalgorithm = \"fixed_window\"\nlimit = 100\n\
                       window = \"1h\"\ncost = 10\ncost_response_header = \"x-tokens-used\"\n";

#[tokio::test]
async fn a_settle_sent_twice_is_applied_once() {
    let redis = RedisServer::start();
    let relay = Relay::start(addr(redis.port)).await;
    let up = Upstream::start().await;
    let url = format!("redis://127.0.0.1:{}", relay.port);
    let config = tollgate_config(up.addr, &url, "on_error = \"deny\"\nlease_percent = 0");
    let tg = Tollgate::with(&config, &[("rules.toml", SETTLED)]).await;
    relay.duplicate(|c| takes_back(c, "settled"));
    let ip = "198.51.100.8";
    for _ in 0..3 {
        let reply = tg.get("/").from_ip(ip).header("x-echo-header", "x-tokens-used: 1").send().await;
        assert_eq!(reply.status, 200);
    }
    eventually("every settle and its duplicate ran", || async { relay.duplicated() >= 3 }).await;
    // 1 each: 3 counted, whatever the settles' duplicates.
    let key = format!("tollgate:{{settled|ip={ip}}}:fw2");
    let state = redis.cli(&support::redis::window(&key));
    assert!(state.trim().ends_with(":3"), "the window counts {state:?}, not 3: a settle was applied twice");
}

#[tokio::test]
async fn a_lease_given_back_twice_is_applied_once() {
    let redis = RedisServer::start();
    let relay = Relay::start(addr(redis.port)).await;
    let up = Upstream::start().await;
    let url = format!("redis://127.0.0.1:{}", relay.port);
    // 1% of 1,000: leases of 10.
    let config = tollgate_config(up.addr, &url, "on_error = \"deny\"\nlease_percent = 1");
    let rules =
        "[[rule]]\nname = \"leased\"\nkey = [\"ip\"]\nalgorithm = \"fixed_window\"\nlimit = 1000\nwindow = \"1h\"\n";
    let tg = Tollgate::with(&config, &[("rules.toml", rules)]).await;
    relay.duplicate(|c| takes_back(c, "leased"));
    let ip = "198.51.100.9";
    // The first request takes a lease of 10 with it; three more spend it.
    for _ in 0..4 {
        assert_eq!(tg.get("/").from_ip(ip).send().await.status, 200);
    }
    let key = format!("tollgate:{{leased|ip={ip}}}:fw2");
    assert!(redis.cli(&support::redis::window(&key)).trim().ends_with(":11"));
    // At shutdown the 7 units left go back, once.
    tg.stop().await;
    eventually("the give-back and its duplicate ran", || async { relay.duplicated() >= 1 }).await;
    let state = redis.cli(&support::redis::window(&key));
    assert!(state.trim().ends_with(":4"), "the window counts {state:?}, not 4: the lease was given back twice");
}

/// Sets the port `port` announces to clients (`CLUSTER SLOTS`, `MOVED`) and
/// waits until every node says so.
fn announce(cluster: &RedisCluster, real: u16, port: u16) {
    assert_eq!(cluster.cli(real, &["CONFIG", "SET", "cluster-announce-port", &port.to_string()]).trim(), "OK");
    let me = cluster.cli(real, &["CLUSTER", "MYID"]);
    let me = me.trim();
    support::redis::wait_until(&format!("every node sees {real} as :{port}"), || {
        cluster.ports.iter().filter(|&&p| p != real).all(|&p| {
            cluster.cli(p, &["CLUSTER", "NODES"]).lines().any(|l| l.starts_with(me) && l.contains(&format!(":{port}@")))
        })
    });
}

/// An address whose `rule` key is on the master on `port` and whose
/// `other` key is not.
fn ip_split(cluster: &RedisCluster, rule: &str, other: &str, port: u16) -> String {
    let ranges = cluster.nodes().into_iter().find(|n| n.port == port).map(|n| n.slots).unwrap_or_default();
    let on = |r: &str, ip: &str| {
        let slot = fred::util::redis_keyslot(format!("{{{r}|ip={ip}}}").as_bytes());
        ranges.iter().any(|&(a, b)| (a..=b).contains(&slot))
    };
    (0..=255u16)
        .flat_map(|a| (1..=254u16).map(move |b| format!("10.8.{a}.{b}")))
        .find(|ip| on(rule, ip) && !on(other, ip))
        .unwrap_or_else(|| panic!("no address splits {rule} and {other}"))
}

/// Gives the empty `slot` from its master to the master on `to`, on every
/// master: the next call for it to the old owner is answered `MOVED`.
fn reassign_empty_slot(cluster: &RedisCluster, slot: u16, masters: &[u16], to: u16) {
    let id = cluster.cli(to, &["CLUSTER", "MYID"]);
    for &m in masters {
        let out = cluster.cli(m, &["CLUSTER", "SETSLOT", &slot.to_string(), "NODE", id.trim()]);
        assert_eq!(out.trim(), "OK", "SETSLOT on {m}");
    }
}

#[tokio::test]
async fn refunds_in_flight_when_a_cluster_sync_drops_their_connection_are_applied_once() {
    let cluster = RedisCluster::start();
    let masters = cluster.masters();
    let (m, other) = (masters[0], masters[1]);
    let ip = ip_split(&cluster, "spend", "gate-spend", m);
    // A client of `spend` on another master, whose empty slot moves to a
    // third one: its next request is answered MOVED.
    let mover = support::redis::ip_on_master(&cluster, "spend", other, 0);
    let moved_slot = fred::util::redis_keyslot(format!("{{spend|ip={mover}}}").as_bytes());

    // tollgate reaches `m` through `first`, and after the switch below
    // through `second`: both relay to it.
    let first = Relay::start(addr(m)).await;
    let second = Relay::start(addr(m)).await;
    announce(&cluster, m, first.port);

    let up = Upstream::start().await;
    // One connection per node (a sync is per client), and a timeout long
    // enough for the switch while a refund waits.
    let store = "on_error = \"deny\"\nlease_percent = 0\npool_size = 1\ntimeout = \"10s\"";
    let config = tollgate_config(up.addr, &cluster.url(), store);
    let tg = Tollgate::with(&config, &[("rules.toml", &gated_rules("spend", "fixed_window"))]).await;
    assert_eq!(tg.get("/").from_ip(&ip).send().await.status, 200);
    assert_eq!(tg.get("/").from_ip(&ip).send().await.status, 200);
    assert_eq!(tg.get("/gated").from_ip(&ip).send().await.status, 200);
    assert!(first.count(|c| c.first().is_some_and(|n| n == b"FCALL")) >= 3, "tollgate reaches {m} through the relay");

    // `m` moves to the second relay's port, and the empty slot of `mover`
    // to a third master: tollgate goes on as it was until a MOVED.
    announce(&cluster, m, second.port);
    reassign_empty_slot(&cluster, moved_slot, &masters, masters[2]);

    // A refused request's refund runs on `m`, and its answer is held.
    first.hold_replies_after(|c| takes_back(c, "spend"));
    assert_eq!(tg.get("/gated").from_ip(&ip).send().await.status, 429);
    eventually("the refund reached the node", || async { first.count(|c| takes_back(c, "spend")) == 1 }).await;
    // A MOVED makes tollgate's client sync: it drops the connection
    // through `first` with the refund in flight. A call lost that way is
    // not sent again (only a redirection is re-sent); before undo ids and
    // the redirection-only re-send, tollgate sent it again through the
    // second relay and the node applied it twice (3 admitted here, 6
    // against a limit of 5).
    assert_eq!(tg.get("/").from_ip(&mover).send().await.status, 200);
    tokio::time::sleep(std::time::Duration::from_secs(1)).await;
    first.release();
    assert_eq!(second.count(|c| takes_back(c, "spend")), 0, "the lost refund was sent again");

    // Three counted before the refused request, whose refund reached the
    // node once: exactly two more are admitted.
    assert_eq!(admitted_until_refused(&tg, &ip).await, 2, "admitted past the limit: the refund was applied twice");
    let key = format!("tollgate:{{spend|ip={ip}}}:fw2");
    let state = cluster.cli(m, &support::redis::window(&key));
    assert!(state.trim().ends_with(":5"), "the window counts {state:?}");
}

/// The fault tried from outside first: the connection is reset right after
/// a refund was forwarded (the node ran it, its answer held). fred fails
/// the call with the reset itself and tollgate does not send it again: the
/// refund reaches the node once, and the limit holds. (This did not apply
/// a refund twice before undo ids either; it guards that.)
#[tokio::test]
async fn a_refund_whose_connection_is_reset_after_it_ran_is_not_sent_again() {
    let redis = RedisServer::start();
    let relay = Relay::start(addr(redis.port)).await;
    let up = Upstream::start().await;
    let url = format!("redis://127.0.0.1:{}", relay.port);
    let config = tollgate_config(up.addr, &url, "on_error = \"deny\"\nlease_percent = 0\ntimeout = \"5s\"");
    let tg = Tollgate::with(&config, &[("rules.toml", &gated_rules("spend", "fixed_window"))]).await;
    let ip = "198.51.100.10";
    assert_eq!(tg.get("/").from_ip(ip).send().await.status, 200);
    assert_eq!(tg.get("/").from_ip(ip).send().await.status, 200);
    assert_eq!(tg.get("/gated").from_ip(ip).send().await.status, 200);
    relay.hold_replies_after(|c| takes_back(c, "spend"));
    assert_eq!(tg.get("/gated").from_ip(ip).send().await.status, 429);
    eventually("the refund reached the node", || async { relay.count(|c| takes_back(c, "spend")) == 1 }).await;
    relay.reset_all();
    eventually("tollgate is connected again", || async { tg.admin("/readyz").await.status == 200 }).await;
    assert_eq!(admitted_until_refused(&tg, ip).await, 2, "admitted past the limit");
    assert_eq!(relay.count(|c| takes_back(c, "spend")), 1, "the refund was sent again");
}

/// A token bucket's lease is given back by settling its escrow slot, which
/// the leases of other instances may share: settled twice, the slot would
/// give up another instance's units, and the bucket would admit them
/// again while that instance still spends them.
#[tokio::test]
async fn a_token_bucket_lease_settled_twice_gives_up_its_own_units_only() {
    let redis = RedisServer::start();
    let relay = Relay::start(addr(redis.port)).await;
    let up = Upstream::start().await;
    let url = format!("redis://127.0.0.1:{}", relay.port);
    let config = |store: &str| tollgate_config(up.addr, &url, &format!("on_error = \"deny\"\n{store}"));
    // 1,000 a day: nothing refills within the test; 1% leases of 10.
    let rules =
        "[[rule]]\nname = \"escrow\"\nkey = [\"ip\"]\nalgorithm = \"token_bucket\"\nlimit = 1000\nwindow = \"1d\"\n";
    let a = Tollgate::with(&config("lease_percent = 1\nlease_idle = \"1h\""), &[("rules.toml", rules)]).await;
    let b = Tollgate::with(&config("lease_percent = 1\nlease_idle = \"1h\""), &[("rules.toml", rules)]).await;
    relay.duplicate(|c| takes_back(c, "escrow"));
    let ip = "198.51.100.11";
    // Each instance takes a lease of 10 with its first request, into the
    // same escrow slot; `a` spends 3 more of its own.
    assert_eq!(b.get("/").from_ip(ip).send().await.status, 200);
    for _ in 0..4 {
        assert_eq!(a.get("/").from_ip(ip).send().await.status, 200);
    }
    // `a` gives its lease back at shutdown: 7 unspent.
    a.stop().await;
    eventually("the give-back and its duplicate ran", || async { relay.duplicated() >= 1 }).await;
    // Counted: 5 requests, and the 10 `b` still holds. A third instance
    // (which leases nothing) sees what is left after its own request.
    let c = Tollgate::with(&config("lease_percent = 0"), &[("rules.toml", rules)]).await;
    let reply = c.get("/").from_ip(ip).send().await;
    assert_eq!(reply.status, 200);
    assert_eq!(
        reply.header("x-ratelimit-remaining"),
        Some("984"),
        "1,000 less 6 requests and the lease `b` holds: a slot settled twice gave up `b`'s units"
    );
    drop(b);
}
