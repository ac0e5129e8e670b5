//! One rule's Redis node stops answering while another rule's answers: each rule is
//! decided on its own. The answers that arrived stand (a rule that rejects
//! still rejects, a rule that admits still counts), and only the failed
//! rule falls back to its own `on_error`.
//!
//! This file starts its own cluster: the frozen node must not disturb the
//! tests of other files.

use crate::support;

use support::redis::{OwnCluster, ip_on_master};

/// Every request matches both: `down`, whose keys the test puts on the
/// master it freezes, and `strict`, two per hour, on another master.
const RULES: &str = r#"
[[rule]]
name = "down"
key = ["ip"]
algorithm = "fixed_window"
limit = 1000
window = "1h"
on_error = "allow"

[[rule]]
name = "strict"
key = ["ip"]
algorithm = "fixed_window"
limit = 2
window = "1h"
on_error = "allow"
"#;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failed_rule_does_not_discard_the_verdicts_of_the_rules_that_answered() {
    let own = OwnCluster::start().await;
    let cluster = own.cluster.clone();
    // No leases: every request asks both nodes.
    let tg = own.tollgate("timeout = \"300ms\"\non_error = \"allow\"\nlease_percent = 0", RULES).await;

    let victim = cluster.masters()[0];
    // Addresses whose `down` bucket is on the victim and whose `strict`
    // bucket is elsewhere.
    let mut ips = (0..)
        .map(|n| ip_on_master(&cluster, "down", victim, n))
        .filter(|ip| cluster.master_of(&format!("{{strict|ip={ip}}}")).is_some_and(|m| m != victim));
    let (rejected_ip, admitted_ip) = (ips.next().expect("an address"), ips.next().expect("another"));
    let strict_count = |ip: &str| {
        let key = format!("tollgate:{{strict|ip={ip}}}:fw2");
        let port = cluster.master_of(&key).expect("strict's master");
        cluster.cli(port, &support::redis::window(&key)).trim().rsplit(':').next().unwrap_or("").to_string()
    };

    for _ in 0..2 {
        assert_eq!(tg.get("/").from_ip(&rejected_ip).send().await.status, 200);
    }
    assert_eq!(tg.get("/").from_ip(&admitted_ip).send().await.status, 200);

    // The victim stops answering (a frozen node: its connection stays up,
    // so the other masters are still reached; a killed one makes fred hold
    // every command until the cluster's topology changes). `down` times
    // out, `strict` answers.
    cluster.cli(victim, &["CLIENT", "PAUSE", "5000", "ALL"]);
    let reply = tg.get("/").from_ip(&rejected_ip).send().await;
    assert_eq!(reply.status, 429, "strict rejected it; down's on_error = allow must not forward it");
    assert_eq!(reply.header("x-ratelimit-limit"), Some("2"), "{:?}", reply.headers);
    let reply = tg.get("/").from_ip(&admitted_ip).send().await;
    assert_eq!(reply.status, 200, "strict admitted it and down fails open");
    assert_eq!(reply.header("x-ratelimit-remaining"), Some("0"), "strict's verdict is reported: {:?}", reply.headers);
    // Admitted requests count where their rule answered; rejected ones nowhere.
    assert_eq!(strict_count(&admitted_ip), "2", "strict counted the admitted request");
    assert_eq!(strict_count(&rejected_ip), "2", "the rejected request counted nowhere");
}
