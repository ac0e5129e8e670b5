//! The Redis store over TLS (`rediss://`) against a real `redis-server`
//! with a certificate from a CA made for the test: trusted through
//! `[store] tls_ca_file`, checks run and count; without it the certificate
//! is refused, the store is not ready, and requests follow `on_error`. A
//! Redis that asks for a client certificate gets one from `tls_cert_file`
//! and `tls_key_file`, and refuses tollgate without it.

use crate::support;

use support::redis::{RedisTlsServer, tollgate_config};
use support::{Tollgate, Upstream, eventually};

const RULES: &str = r#"
[[rule]]
name = "tls"
key = ["ip"]
algorithm = "fixed_window"
limit = 3
window = "1h"
"#;

#[tokio::test]
async fn a_tls_store_is_used_when_its_ca_is_trusted_and_refused_otherwise() {
    let server = tokio::task::spawn_blocking(|| RedisTlsServer::start(false)).await.expect("tls redis");
    let up = Upstream::start().await;

    let trusted = format!("on_error = \"deny\"\ntls_ca_file = \"{}\"", server.ca_file.display());
    let tg = Tollgate::with(&tollgate_config(up.addr, &server.url(), &trusted), &[("rules.toml", RULES)]).await;
    assert_eq!(tg.admin("/readyz").await.status, 200);
    let statuses = support::statuses(4, || tg.get("/").from_ip("192.0.2.20")).await;
    assert_eq!(statuses, support::expect_statuses(3, 200, 1, 429));
    let value = server.cli(&support::redis::window("tollgate:{tls|ip=192.0.2.20}:fw2"));
    assert!(value.trim().ends_with(":3"), "counted in Redis over TLS: {value:?}");

    // The system's roots do not include the test CA: refused, so the store
    // is not ready and `deny` answers 503.
    let untrusted = "on_error = \"deny\"";
    let tg = Tollgate::with(&tollgate_config(up.addr, &server.url(), untrusted), &[("rules.toml", RULES)]).await;
    eventually("the store reports not ready", || async { tg.admin("/readyz").await.status == 503 }).await;
    assert_eq!(tg.get("/").from_ip("192.0.2.21").send().await.status, 503);
}

#[tokio::test]
async fn a_redis_that_asks_for_a_client_certificate_gets_the_configured_one() {
    let server = tokio::task::spawn_blocking(|| RedisTlsServer::start(true)).await.expect("tls redis");
    let up = Upstream::start().await;
    let ca = format!("on_error = \"deny\"\ntls_ca_file = \"{}\"", server.ca_file.display());

    let with_cert = format!(
        "{ca}\ntls_cert_file = \"{}\"\ntls_key_file = \"{}\"",
        server.client_cert_file.display(),
        server.client_key_file.display()
    );
    let tg = Tollgate::with(&tollgate_config(up.addr, &server.url(), &with_cert), &[("rules.toml", RULES)]).await;
    assert_eq!(tg.admin("/readyz").await.status, 200);
    let statuses = support::statuses(4, || tg.get("/").from_ip("192.0.2.22")).await;
    assert_eq!(statuses, support::expect_statuses(3, 200, 1, 429));

    let tg = Tollgate::with(&tollgate_config(up.addr, &server.url(), &ca), &[("rules.toml", RULES)]).await;
    eventually("the store reports not ready", || async { tg.admin("/readyz").await.status == 503 }).await;
    assert_eq!(tg.get("/").from_ip("192.0.2.23").send().await.status, 503);
}
