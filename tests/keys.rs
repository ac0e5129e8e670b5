//! Who a request counts against: client IP, user, API key, other key parts,
//! the IP fallback when the identity is missing, trusted proxies and
//! `X-Forwarded-For`, and IPv6 clients grouped by /64.

use crate::support;

use support::{Call, Tollgate, Upstream, config, statuses};

/// A fixed window of 2 per minute keyed by `key`.
fn two_per_minute(key: &str) -> String {
    format!("[[rule]]\nname = \"k\"\nkey = {key}\nalgorithm = \"fixed_window\"\nlimit = 2\nwindow = \"1m\"\n")
}

#[tokio::test]
async fn ip_keys_give_each_client_its_own_bucket() {
    let upstream = Upstream::start().await;
    let tg = Tollgate::start(&upstream, &two_per_minute(r#"["ip"]"#)).await;
    assert_eq!(statuses(3, || tg.get("/").from_ip("203.0.113.1")).await, [200, 200, 429]);
    assert_eq!(statuses(3, || tg.get("/").from_ip("203.0.113.2")).await, [200, 200, 429]);
    // The test client's own address is one more client.
    assert_eq!(statuses(3, || tg.get("/")).await, [200, 200, 429]);
}

#[tokio::test]
async fn user_keys_fall_back_to_the_ip() {
    let upstream = Upstream::start().await;
    let tg = Tollgate::start(&upstream, &two_per_minute(r#"["user"]"#)).await;
    let user = |id: &str, ip: &str| tg.get("/").header("x-user-id", id).from_ip(ip);
    // A user is one bucket, whichever address it comes from.
    assert_eq!(statuses(1, || user("alice", "203.0.113.1")).await, [200]);
    assert_eq!(statuses(2, || user("alice", "203.0.113.2")).await, [200, 429]);
    assert_eq!(statuses(3, || user("bob", "203.0.113.1")).await, [200, 200, 429]);
    // Leaving the header out does not escape the limit: the request is keyed
    // by its IP, which has a bucket of its own...
    assert_eq!(statuses(3, || tg.get("/").from_ip("203.0.113.1")).await, [200, 200, 429]);
    assert_eq!(statuses(3, || tg.get("/").from_ip("203.0.113.3")).await, [200, 200, 429]);
    // ...that a user whose id looks like that address does not share.
    assert_eq!(statuses(3, || user("203.0.113.3", "203.0.113.9")).await, [200, 200, 429]);
    // An empty header is as good as none.
    assert_eq!(statuses(1, || user("", "203.0.113.3")).await, [429]);
}

#[tokio::test]
async fn api_key_keys_fall_back_to_the_ip() {
    let upstream = Upstream::start().await;
    let tg = Tollgate::start(&upstream, &two_per_minute(r#"["api_key"]"#)).await;
    let key = |k: &str, ip: &str| tg.get("/").header("x-api-key", k).from_ip(ip);
    assert_eq!(statuses(1, || key("key-1", "203.0.113.1")).await, [200]);
    assert_eq!(statuses(2, || key("key-1", "203.0.113.2")).await, [200, 429]);
    assert_eq!(statuses(3, || key("key-2", "203.0.113.2")).await, [200, 200, 429]);
    // The user header means nothing to an api_key rule.
    assert_eq!(statuses(3, || tg.get("/").header("x-user-id", "u").from_ip("203.0.113.4")).await, [200, 200, 429]);
    assert_eq!(statuses(3, || tg.get("/").from_ip("203.0.113.5")).await, [200, 200, 429]);
}

#[tokio::test]
async fn identity_header_names_come_from_the_config() {
    let upstream = Upstream::start().await;
    let mut cfg = config(upstream.addr);
    cfg = cfg
        .replace("[client]\n", "[client]\nuser_header = \"x-auth-subject\"\napi_key_header = \"authorization-key\"\n");
    let rules = format!(
        "{}\n{}",
        two_per_minute(r#"["user"]"#),
        two_per_minute(r#"["api_key"]"#).replace("name = \"k\"", "name = \"a\"").replace("limit = 2", "limit = 4")
    );
    let tg = Tollgate::with(&cfg, &[("r.toml", &rules)]).await;
    let call =
        || tg.get("/").header("x-auth-subject", "carol").header("authorization-key", "K").from_ip("198.51.100.1");
    assert_eq!(statuses(3, call).await, [200, 200, 429]);
    // The default header names are ordinary headers here: these requests
    // fall back to their IP for `user` and share key K's bucket for
    // `api_key`, which has 2 of its 4 left.
    let other = || tg.get("/").header("x-user-id", "carol").header("authorization-key", "K").from_ip("198.51.100.2");
    assert_eq!(statuses(3, other).await, [200, 200, 429]);
}

#[tokio::test]
async fn shared_buckets_and_composite_keys() {
    let upstream = Upstream::start().await;
    let rules = format!(
        "{}\n{}",
        two_per_minute("[]").replace("name = \"k\"", "name = \"everyone\"").replace("limit = 2", "limit = 5"),
        two_per_minute(r#"["query:tenant", "method"]"#)
            .replace("name = \"k\"", "name = \"tenant-method\"")
            .replace("[[rule]]\n", "[[rule]]\nmatch = { path = \"/t*\" }\n")
    );
    let tg = Tollgate::start(&upstream, &rules).await;
    // `tenant-method`: one bucket per tenant and method.
    assert_eq!(statuses(3, || tg.get("/t?tenant=a").from_ip("192.0.2.1")).await, [200, 200, 429]);
    assert_eq!(statuses(1, || tg.call("POST", "/t?tenant=a").from_ip("192.0.2.2")).await, [200]);
    // `everyone` has counted 3 of 5 so far (the rejected one is not
    // counted), from two addresses: a third address gets the last 2.
    assert_eq!(statuses(3, || tg.get("/t?tenant=b").from_ip("192.0.2.3")).await, [200, 200, 429]);
    let r = tg.get("/x").from_ip("192.0.2.4").send().await;
    assert_eq!(r.status, 429);
    assert_eq!(r.json()["rule"], "everyone");
}

#[tokio::test]
async fn trusted_proxies_may_name_the_client() {
    let upstream = Upstream::start().await;
    let tg = Tollgate::start(&upstream, &two_per_minute(r#"["ip"]"#)).await;
    // The right-most address a trusted proxy did not add is the client:
    // whatever the client prepends is ignored.
    let via = |xff: &str| tg.get("/").from_ip(xff);
    assert_eq!(statuses(1, || via("1.1.1.1, 203.0.113.7")).await, [200]);
    assert_eq!(statuses(2, || via("2.2.2.2, 203.0.113.7, 127.0.0.1")).await, [200, 429]);
    assert_eq!(statuses(3, || via("203.0.113.8")).await, [200, 200, 429]);
    // X-Real-IP counts when there is no X-Forwarded-For.
    assert_eq!(statuses(3, || tg.get("/").header("x-real-ip", "203.0.113.9")).await, [200, 200, 429]);

    // The upstream learns the chain with the trusted peer appended.
    let r = tg.get("/").from_ip("203.0.113.10").send().await;
    assert_eq!(r.echo().header("x-forwarded-for"), Some("203.0.113.10, 127.0.0.1"));
}

#[tokio::test]
async fn untrusted_peers_cannot_choose_their_key() {
    let upstream = Upstream::start().await;
    // 127.0.0.1, where the test client connects from, is not trusted.
    let cfg = config(upstream.addr).replace(r#"["127.0.0.1/32"]"#, r#"["10.0.0.0/8"]"#);
    let tg = Tollgate::with(&cfg, &[("r.toml", &two_per_minute(r#"["ip"]"#))]).await;
    let r = tg.get("/").from_ip("203.0.113.1").send().await;
    assert_eq!(r.status, 200);
    // The claim does not reach the upstream either: it is replaced.
    assert_eq!(r.echo().header("x-forwarded-for"), Some("127.0.0.1"));
    // Every address claimed is the same client: 127.0.0.1.
    assert_eq!(statuses(1, || tg.get("/").from_ip("203.0.113.2")).await, [200]);
    assert_eq!(statuses(1, || tg.get("/").header("x-real-ip", "203.0.113.3")).await, [429]);
    assert_eq!(statuses(1, || tg.get("/")).await, [429]);
}

#[tokio::test]
async fn ipv6_clients_are_grouped_by_their_64() {
    let upstream = Upstream::start().await;
    let cfg = config(upstream.addr)
        .replace(r#"proxy = "127.0.0.1:0""#, r#"proxy = "[::1]:0""#)
        .replace(r#"["127.0.0.1/32"]"#, r#"["::1/128"]"#);
    let tg = Tollgate::with(&cfg, &[("r.toml", &two_per_minute(r#"["ip"]"#))]).await;
    assert!(tg.proxy_addr.is_ipv6());
    let from = |ip: &str| Call::new("GET", tg.proxy_addr, "/").from_ip(ip);
    // Two addresses of one /64 share a bucket...
    assert_eq!(statuses(1, || from("2001:db8:1:2::1")).await, [200]);
    assert_eq!(statuses(2, || from("2001:db8:1:2:ffff:ffff:ffff:fffe")).await, [200, 429]);
    assert_eq!(statuses(1, || from("[2001:db8:1:2:abcd::9]:4431")).await, [429]);
    // ...the neighbouring /64 is another client...
    assert_eq!(statuses(3, || from("2001:db8:1:3::1")).await, [200, 200, 429]);
    // ...and IPv4 clients behind the same IPv6 proxy are keyed as usual.
    assert_eq!(statuses(3, || from("203.0.113.1")).await, [200, 200, 429]);
    // The peer itself, ::1, is a client of its own /64.
    let r = Call::new("GET", tg.proxy_addr, "/").send().await;
    assert_eq!(r.status, 200);
    assert_eq!(r.echo().header("x-forwarded-for"), Some("::1"));
}

#[tokio::test]
async fn ipv6_prefix_is_configurable() {
    let upstream = Upstream::start().await;
    let cfg = config(upstream.addr)
        .replace(r#"proxy = "127.0.0.1:0""#, r#"proxy = "[::1]:0""#)
        .replace(r#"["127.0.0.1/32"]"#, "[\"::1/128\"]\nipv6_prefix = 128");
    let tg = Tollgate::with(&cfg, &[("r.toml", &two_per_minute(r#"["ip"]"#))]).await;
    let from = |ip: &str| Call::new("GET", tg.proxy_addr, "/").from_ip(ip);
    assert_eq!(statuses(3, || from("2001:db8:1:2::1")).await, [200, 200, 429]);
    assert_eq!(statuses(3, || from("2001:db8:1:2::2")).await, [200, 200, 429]);
}

#[tokio::test]
async fn forwarded_headers_and_garbage_from_a_trusted_peer() {
    let upstream = Upstream::start().await;
    let tg = Tollgate::start(&upstream, &two_per_minute(r#"["ip"]"#)).await;
    // RFC 7239 `Forwarded` names the client like X-Forwarded-For does.
    let fwd = || tg.get("/").header("forwarded", "for=198.51.100.20;proto=https, for=127.0.0.1");
    assert_eq!(statuses(3, fwd).await, [200, 200, 429]);
    assert_eq!(statuses(1, || tg.get("/").from_ip("198.51.100.20")).await, [429], "the same client either way");
    // Garbage names no client: refused with 400, never keyed on the socket
    // address (the trusted proxy, 127.0.0.1) nor on a fresh bucket per
    // garbage value, and nothing is counted.
    for garbage in ["not-an-ip", "999.1.1.1", "1.2.3.4, 5.6.7.8, ", "for=unknown"] {
        let name = if garbage.starts_with("for=") { "forwarded" } else { "x-forwarded-for" };
        assert_eq!(tg.get("/").header(name, garbage).send().await.status, 400, "{garbage}");
    }
    assert_eq!(statuses(3, || tg.get("/")).await, [200, 200, 429], "127.0.0.1's own bucket is untouched");
}

#[tokio::test]
async fn values_cannot_collide_across_key_parts() {
    let upstream = Upstream::start().await;
    let rules = "[[rule]]\nname = \"k\"\nkey = [\"user\", \"path\"]\nalgorithm = \"fixed_window\"\nlimit = 1\nwindow = \"1m\"\n";
    let tg = Tollgate::start(&upstream, rules).await;
    // user "a|path=/b" on path "/c" against user "a" on path "/b|path=/c"
    // (as far as a URL allows it: "%7C" is the client's own spelling of "|").
    assert_eq!(statuses(1, || tg.get("/b%7Cpath=/c").header("x-user-id", "a")).await, [200]);
    assert_eq!(statuses(1, || tg.get("/c").header("x-user-id", "a|path=/b")).await, [200]);
    assert_eq!(statuses(1, || tg.get("/c").header("x-user-id", "a%7Cpath=/b")).await, [200]);
    // A megabyte-scale user id is still one bounded, distinct key.
    let long_a = "a".repeat(10_000);
    let long_b = format!("{}b", "a".repeat(9_999));
    assert_eq!(statuses(2, || tg.get("/x").header("x-user-id", &long_a)).await, [200, 429]);
    assert_eq!(statuses(1, || tg.get("/x").header("x-user-id", &long_b)).await, [200]);
}
