//! A slot that moves to another master while tollgate's map of the cluster
//! still names the old one: checks batched for the old master whose key
//! has left are asked again of the new owner, nothing is counted twice, and
//! the limit holds exactly. Its own cluster: moving a slot would disturb
//! the other cluster tests.

use crate::support;

use std::time::{Duration, Instant};

use support::redis::{RedisCluster, ip_on_master, tollgate_config};
use support::{Tollgate, Upstream, metric};

/// Moves `slot` with its keys from the master on `from` to the one on
/// `to`, as `redis-cli --cluster reshard` does.
fn move_slot(cluster: &RedisCluster, slot: u16, from: u16, to: u16) {
    start_moving(cluster, slot, from, to);
    finish_moving(cluster, slot, to);
}

/// The first half of [`move_slot`]: `to` imports `slot`, `from` migrates it
/// and its keys are moved, but `from` still owns it. Until
/// [`finish_moving`], `from` answers `ASK` for a key it no longer holds.
fn start_moving(cluster: &RedisCluster, slot: u16, from: u16, to: u16) {
    let (from_id, to_id) = (node_id(cluster, from), node_id(cluster, to));
    let slot = slot.to_string();
    assert_eq!(cluster.cli(to, &["CLUSTER", "SETSLOT", &slot, "IMPORTING", &from_id]).trim(), "OK");
    assert_eq!(cluster.cli(from, &["CLUSTER", "SETSLOT", &slot, "MIGRATING", &to_id]).trim(), "OK");
    let keys = cluster.cli(from, &["CLUSTER", "GETKEYSINSLOT", &slot, "1000"]);
    let keys: Vec<&str> = keys.lines().map(str::trim).filter(|k| !k.is_empty()).collect();
    if !keys.is_empty() {
        let to_port = to.to_string();
        let mut args = vec!["MIGRATE", "127.0.0.1", &to_port, "", "0", "5000", "KEYS"];
        args.extend(keys.iter().copied());
        assert_eq!(cluster.cli(from, &args).trim(), "OK");
    }
}

/// The second half of [`move_slot`]: every master learns that `to` owns
/// `slot`.
fn finish_moving(cluster: &RedisCluster, slot: u16, to: u16) {
    let to_id = node_id(cluster, to);
    let slot = slot.to_string();
    for master in cluster.masters() {
        assert_eq!(cluster.cli(master, &["CLUSTER", "SETSLOT", &slot, "NODE", &to_id]).trim(), "OK");
    }
}

fn node_id(cluster: &RedisCluster, port: u16) -> String {
    cluster.nodes().into_iter().find(|n| n.port == port).expect("a node").id
}

#[tokio::test]
async fn checks_batched_for_a_master_that_lost_their_slot_are_decided_by_the_new_owner_once() {
    let cluster = RedisCluster::start();
    let up = Upstream::start().await;
    let config = tollgate_config(up.addr, &cluster.url(), "on_error = \"deny\"\ntimeout = \"5s\"");
    let rule = "[[rule]]\nname = \"moved\"\nkey = [\"ip\"]\nalgorithm = \"fixed_window\"\nlimit = 5\nwindow = \"1h\"\n";
    let tg = Tollgate::with(&config, &[("rules.toml", rule)]).await;
    let masters = cluster.masters();
    let (from, to) = (masters[0], masters[1]);
    // One client whose bucket moves, twenty that stay on the same master.
    let mover = ip_on_master(&cluster, "moved", from, 0);
    let stayers: Vec<String> = (1..=20).map(|n| ip_on_master(&cluster, "moved", from, n)).collect();
    let slot = fred::util::redis_keyslot(format!("{{moved|ip={mover}}}").as_bytes());
    assert!(stayers.iter().all(|ip| fred::util::redis_keyslot(format!("{{moved|ip={ip}}}").as_bytes()) != slot));

    // tollgate reads the cluster's layout at its first check.
    let mapped = Instant::now();
    for _ in 0..3 {
        assert_eq!(tg.get("/").from_ip(&mover).send().await.status, 200);
    }
    move_slot(&cluster, slot, from, to);
    assert_eq!(cluster.master_of(&format!("{{moved|ip={mover}}}")), Some(to));

    // All at once, so that they share calls to the old master.
    let calls: Vec<String> = std::iter::repeat_n(mover.clone(), 5).chain(stayers.iter().cloned()).collect();
    let burst_at = mapped.elapsed();
    let barrier = std::sync::Arc::new(tokio::sync::Barrier::new(calls.len()));
    let mut set = tokio::task::JoinSet::new();
    for ip in calls {
        let call = tg.get("/").from_ip(&ip);
        let barrier = barrier.clone();
        set.spawn(async move {
            barrier.wait().await;
            (ip, call.send().await.status.as_u16())
        });
    }
    let (mut mover_ok, mut mover_limited, mut stayers_ok) = (0, 0, 0);
    while let Some(r) = set.join_next().await {
        match r.expect("request task") {
            (ip, 200) if ip == mover => mover_ok += 1,
            (ip, 429) if ip == mover => mover_limited += 1,
            (_, 200) => stayers_ok += 1,
            other => panic!("unexpected reply {other:?}"),
        }
    }
    // The three counted before the move travelled with the key.
    assert_eq!((mover_ok, mover_limited), (2, 3));
    assert_eq!(stayers_ok, 20);
    let count = cluster.cli(to, &support::redis::window(&format!("tollgate:{{moved|ip={mover}}}:fw2")));
    assert!(count.trim().ends_with(":5"), "the moved bucket counts 5: {count}");

    let m = tg.metrics().await;
    let misrouted = metric(&m, "tollgate_redis_misrouted_total", &[]).unwrap_or(0.0);
    let errors = metric(&m, "tollgate_store_errors_total", &[("backend", "redis")]).unwrap_or(0.0);
    eprintln!("burst {burst_at:?} after the map was read; {misrouted} checks asked again");
    assert_eq!(errors, 0.0, "no check failed");
    // The slot map is read again every second: a burst within it went out
    // on the old map, and some of its checks had to be asked again.
    if burst_at < Duration::from_millis(800) {
        assert!(misrouted >= 1.0, "the burst at {burst_at:?} used the old map, yet nothing was asked again");
    } else {
        eprintln!("the burst came {burst_at:?} after the map was read; it may have used a fresh one");
    }
}

/// A key that has already left a slot being migrated is answered `ASK` by
/// the master still owning the slot. fred 10 follows `ASK` only with a
/// command attempt to spare; with tollgate's one attempt per command it
/// gave up with "Max attempts reached." and ended its connection task,
/// and no check reached Redis again (`benches/accuracy --fault migration`).
#[tokio::test]
async fn a_check_answered_ask_mid_migration_keeps_the_store_alive_and_the_limit_exact() {
    let cluster = RedisCluster::start();
    let up = Upstream::start().await;
    let config = tollgate_config(up.addr, &cluster.url(), "on_error = \"deny\"\ntimeout = \"5s\"");
    let rule = "[[rule]]\nname = \"asked\"\nkey = [\"ip\"]\nalgorithm = \"fixed_window\"\nlimit = 5\nwindow = \"1h\"\n";
    let tg = Tollgate::with(&config, &[("rules.toml", rule)]).await;
    let masters = cluster.masters();
    let (from, to) = (masters[0], masters[1]);
    let mover = ip_on_master(&cluster, "asked", from, 0);
    let bystander = ip_on_master(&cluster, "asked", masters[2], 0);
    let key = format!("{{asked|ip={mover}}}");
    let slot = fred::util::redis_keyslot(key.as_bytes());

    for _ in 0..2 {
        assert_eq!(tg.get("/").from_ip(&mover).send().await.status, 200);
    }
    start_moving(&cluster, slot, from, to);
    // Sent while the key is on `to` and the slot still `from`'s: `ASK`.
    let mut asked = tokio::task::JoinSet::new();
    for _ in 0..3 {
        let call = tg.get("/").from_ip(&mover);
        asked.spawn(async move { call.send().await.status.as_u16() });
    }
    tokio::time::sleep(Duration::from_millis(300)).await;
    finish_moving(&cluster, slot, to);
    let mut during = Vec::new();
    while let Some(status) = asked.join_next().await {
        during.push(status.expect("request task"));
    }
    let mut after = Vec::new();
    for _ in 0..4 {
        after.push(tg.get("/").from_ip(&mover).send().await.status.as_u16());
    }
    let bystander_status = tg.get("/").from_ip(&bystander).send().await.status.as_u16();

    let m = tg.metrics().await;
    let errors = metric(&m, "tollgate_store_errors_total", &[("backend", "redis")]).unwrap_or(0.0);
    let restarts = metric(&m, "tollgate_redis_connection_restarts_total", &[]).unwrap_or(0.0);
    eprintln!(
        "during the move {during:?}, after {after:?}, bystander {bystander_status}; {errors} errors, {restarts} restarts"
    );
    // Exactly the limit: the 3 asked during the move are the last 3 of 5.
    assert_eq!(during, [200, 200, 200], "the checks redirected mid-migration are decided, not failed");
    assert_eq!(after, [429; 4], "the limit holds after the move");
    assert_eq!(bystander_status, 200, "the store still answers");
    let count = cluster.cli(to, &support::redis::window(&format!("tollgate:{key}:fw2")));
    assert!(count.trim().ends_with(":5"), "the moved bucket counts 5: {count}");
    assert_eq!(errors, 0.0, "no check failed");
    assert_eq!(restarts, 0.0, "fred's connection task never ended");
}
