//! Leases and the over-limit cache together, against one real
//! `redis-server`: a key flooded past its limit keeps admitting its limit
//! when the instance holds a lease for it.
//!
//! The cache answers a key Redis rejected until its retry moment, then lets
//! one request (the probe) ask; the requests behind it are rejected until
//! the probe reports. A renewal ahead granted just before the key ran out
//! can leave the instance holding leased units for a key the cache has
//! rejected. The probe is then answered from the lease, not by Redis: it
//! must clear the entry as an admission by Redis does, or every probe
//! waits out the store timeout and the key admits one request per timeout
//! (measured with benches/hot_key: 47 a second against a limit of 1,000).

use crate::support;

use std::sync::OnceLock;
use std::time::{Duration, Instant};

use support::redis::{RedisServer, tollgate_config};
use support::{Tollgate, Upstream, burst, count};

fn server() -> &'static RedisServer {
    static SERVER: OnceLock<RedisServer> = OnceLock::new();
    SERVER.get_or_init(RedisServer::start)
}

#[tokio::test]
async fn a_flooded_key_held_in_a_lease_keeps_admitting_its_limit() {
    let up = Upstream::start().await;
    // One key for everyone; 10% of 100: leases of 10.
    let rules = "[[rule]]\nname = \"global\"\nkey = []\nalgorithm = \"token_bucket\"\nlimit = 100\nwindow = \"1s\"\n";
    let store = "key_prefix = \"t-lease-cache:\"\non_error = \"deny\"\nlease_percent = 10\n";
    let tg = Tollgate::with(&tollgate_config(up.addr, &server().url(), store), &[("rules.toml", rules)]).await;
    // The burst of 100 first, then the flood: the bucket refills 100 a
    // second, and each second after the first should admit about that.
    let started = Instant::now();
    let (mut admitted, mut sent, mut late) = (0, 0, 0);
    while started.elapsed() < Duration::from_secs(4) {
        let replies = burst(60, |_| tg.get("/")).await;
        admitted += count(&replies, 200);
        sent += replies.len();
        if started.elapsed() >= Duration::from_secs(2) {
            late += count(&replies, 200);
        }
    }
    let late_window = started.elapsed().as_secs_f64() - 2.0;
    assert!(sent > admitted + 200, "the load must exceed the bucket to test it ({admitted} of {sent})");
    // Exactly the limit would be 100 a second; one request per store
    // timeout (500 ms in the tests) is 2. Half the limit leaves room for a
    // slow machine.
    assert!(
        late as f64 >= 50.0 * late_window,
        "{late} admitted in the last {late_window:.1} s ({admitted} of {sent} in all): the flooded key stalled"
    );
}
