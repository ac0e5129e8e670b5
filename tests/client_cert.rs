//! Client certificates on the TLS proxy listener (`[listen]
//! client_ca_file`, `client_auth`) and the `client_cert` key part, against
//! a real tollgate and rustls clients presenting certificates made by a CA
//! of the test (and by another CA, which must not be accepted).

use crate::support;

use support::Upstream;
use support::tls::{Issued, TestCa};

/// A tollgate serving TLS as `a.test`, asking for client certificates of
/// `clients` (`client_auth` as given, or left out when `None`), with
/// `rules` as its rules file.
async fn tollgate(clients: &TestCa, client_auth: Option<&str>, rules: &str) -> (support::Tollgate, TestCa, Upstream) {
    let upstream = Upstream::start().await;
    let server = TestCa::new();
    let dir = tempfile::tempdir().expect("temp dir");
    std::fs::create_dir(dir.path().join("rules")).expect("rules dir");
    std::fs::write(dir.path().join("rules/r.toml"), rules).expect("write rules");
    server.issue("a", &["a.test"]).write(dir.path(), "a");
    std::fs::write(dir.path().join("clients.crt"), &clients.pem).expect("write client CA");
    let auth = client_auth.map(|a| format!("client_auth = \"{a}\"\n")).unwrap_or_default();
    let tls = format!(
        "client_ca_file = \"clients.crt\"\n{auth}\n[[listen.tls]]\ncert_file = \"a.crt\"\nkey_file = \"a.key\"\n\n[rules]"
    );
    let config = support::config(upstream.addr).replacen("\n[rules]", &tls, 1);
    (support::Tollgate::start_in(dir, &config).await, server, upstream)
}

/// The status line of a GET over TLS presenting `client`, or `None` when
/// the handshake (or the connection right after it, where TLS 1.3 reports
/// a refused client certificate) failed.
async fn status(server: &TestCa, t: &support::Tollgate, client: Option<&Issued>) -> Option<String> {
    match server.get_as(t.proxy_addr, "a.test", client).await {
        Ok((_, line)) if !line.is_empty() => Some(line),
        _ => None,
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn required_client_certificates_refuse_clients_without_one_from_the_ca() {
    let clients = TestCa::new();
    let (t, server, _upstream) = tollgate(&clients, Some("required"), "").await;
    assert_eq!(status(&server, &t, None).await, None, "no certificate was accepted");
    let stranger = TestCa::new().issue("stranger", &[]);
    assert_eq!(status(&server, &t, Some(&stranger)).await, None, "another CA's certificate was accepted");
    let alice = clients.issue("alice", &[]);
    assert_eq!(status(&server, &t, Some(&alice)).await.as_deref(), Some("HTTP/1.1 200 OK"));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn optional_client_certificates_key_each_subject_on_its_own() {
    let clients = TestCa::new();
    let rules = "[[rule]]\nname = \"per-cert\"\nkey = [\"client_cert\"]\nalgorithm = \"fixed_window\"\nlimit = 2\nwindow = \"1m\"\n";
    let (t, server, _upstream) = tollgate(&clients, None, rules).await;
    let ok = Some("HTTP/1.1 200 OK".to_string());
    // Without a certificate: admitted, keyed as a missing part is (by IP).
    assert_eq!(status(&server, &t, None).await, ok);
    let (alice, bob) = (clients.issue("alice", &[]), clients.issue("bob", &[]));
    for _ in 0..2 {
        assert_eq!(status(&server, &t, Some(&alice)).await, ok, "alice");
    }
    assert_eq!(status(&server, &t, Some(&alice)).await.as_deref(), Some("HTTP/1.1 429 Too Many Requests"));
    // Bob has his own two, though he comes from the same address.
    for _ in 0..2 {
        assert_eq!(status(&server, &t, Some(&bob)).await, ok, "bob");
    }
    assert_eq!(status(&server, &t, Some(&bob)).await.as_deref(), Some("HTTP/1.1 429 Too Many Requests"));
    // A stranger's certificate is no certificate here: refused, not keyed.
    let stranger = TestCa::new().issue("alice", &[]);
    assert_eq!(status(&server, &t, Some(&stranger)).await, None, "another CA's certificate was accepted");
}
