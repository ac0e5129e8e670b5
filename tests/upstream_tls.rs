//! Upstreams over TLS and HTTP/2: an `https://` server verified against the
//! upstream's CA file and asked for by `tls_server_name`, a client
//! certificate for a server that demands one, `protocol = "h2"` over TLS
//! (ALPN) and over cleartext (prior knowledge). The servers are real hyper
//! servers behind rustls, with certificates from a CA made in the test.

use crate::support;

use std::convert::Infallible;
use std::net::SocketAddr;
use std::sync::Arc;

use bytes::Bytes;
use http_body_util::Full;
use hyper::service::service_fn;
use hyper::{Request, Response};
use hyper_util::rt::{TokioExecutor, TokioIo};
use hyper_util::server::conn::auto;
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer};
use support::tls::{Issued, TestCa};
use support::{Tollgate, config};
use tokio::net::TcpListener;

/// A server answering 200 with the HTTP version it was spoken to in
/// (`x-upstream-version`), over TLS when `tls` is given.
/// A server's TLS side: its certificate, the ALPN protocols it offers, and
/// the CA a client certificate must come from, if it asks for one.
type ServerTls<'a> = (Issued, Vec<&'static [u8]>, Option<&'a TestCa>);

async fn server(tls: Option<ServerTls<'_>>, h2_only: bool) -> SocketAddr {
    let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind");
    let addr = listener.local_addr().expect("addr");
    let acceptor = tls.map(|(issued, alpn, client_ca)| {
        let chain: Vec<CertificateDer<'static>> =
            CertificateDer::pem_slice_iter(issued.cert.as_bytes()).collect::<Result<_, _>>().expect("chain");
        let key = PrivateKeyDer::from_pem_slice(issued.key.as_bytes()).expect("key");
        let provider = Arc::new(rustls::crypto::ring::default_provider());
        let builder = rustls::ServerConfig::builder_with_provider(provider.clone())
            .with_safe_default_protocol_versions()
            .expect("versions");
        let builder = match client_ca {
            Some(ca) => {
                let mut roots = rustls::RootCertStore::empty();
                roots.add(CertificateDer::from_pem_slice(ca.pem.as_bytes()).expect("ca")).expect("add ca");
                let verifier = rustls::server::WebPkiClientVerifier::builder_with_provider(Arc::new(roots), provider)
                    .build()
                    .expect("verifier");
                builder.with_client_cert_verifier(verifier)
            }
            None => builder.with_no_client_auth(),
        };
        let mut cfg = builder.with_single_cert(chain, key).expect("server config");
        cfg.alpn_protocols = alpn.into_iter().map(<[u8]>::to_vec).collect();
        tokio_rustls::TlsAcceptor::from(Arc::new(cfg))
    });
    tokio::spawn(async move {
        while let Ok((tcp, _)) = listener.accept().await {
            let acceptor = acceptor.clone();
            tokio::spawn(async move {
                let svc = service_fn(|req: Request<hyper::body::Incoming>| async move {
                    let mut resp = Response::new(Full::new(Bytes::from_static(b"ok")));
                    let v = format!("{:?}", req.version());
                    resp.headers_mut().insert("x-upstream-version", v.parse().expect("a header value"));
                    Ok::<_, Infallible>(resp)
                });
                let mut builder = auto::Builder::new(TokioExecutor::new());
                if h2_only {
                    builder = builder.http2_only();
                }
                match acceptor {
                    Some(a) => {
                        if let Ok(tls) = a.accept(tcp).await {
                            let _ = builder.serve_connection(TokioIo::new(tls), svc).await;
                        }
                    }
                    None => {
                        let _ = builder.serve_connection(TokioIo::new(tcp), svc).await;
                    }
                }
            });
        }
    });
    addr
}

/// The test config with its upstream at `url` and `extra` keys in it.
fn with_upstream(url: &str, extra: &str) -> String {
    let placeholder: SocketAddr = "127.0.0.1:9".parse().expect("an address");
    config(placeholder).replace("url = \"http://127.0.0.1:9\"", &format!("url = \"{url}\"\n{extra}"))
}

#[tokio::test]
async fn an_https_upstream_is_verified_against_its_ca_and_named_by_tls_server_name() {
    let ca = TestCa::new();
    let addr = server(Some((ca.issue("upstream", &["upstream.test"]), vec![b"http/1.1"], None)), false).await;
    let dir = tempfile::tempdir().expect("temp dir");
    let ca_file = ca.write(dir.path());
    let extra = format!("tls_ca_file = {:?}\ntls_server_name = \"upstream.test\"", ca_file.display().to_string());
    let tg = Tollgate::with(&with_upstream(&format!("https://{addr}"), &extra), &[]).await;
    let r = tg.get("/x").send().await;
    assert_eq!(r.status, 200, "{}", r.text());
    assert_eq!(r.header("x-upstream-version"), Some("HTTP/1.1"));
    assert_eq!(tg.get("/y").send().await.status, 200);

    // Another CA: the server is not trusted, and nothing is sent to it.
    let other = TestCa::new();
    let other_dir = tempfile::tempdir().expect("temp dir");
    let other_file = other.write(other_dir.path());
    let extra = format!("tls_ca_file = {:?}\ntls_server_name = \"upstream.test\"", other_file.display().to_string());
    let tg = Tollgate::with(&with_upstream(&format!("https://{addr}"), &extra), &[]).await;
    assert_eq!(tg.get("/x").send().await.status, 502);

    // The right CA, the wrong name.
    let extra = format!("tls_ca_file = {:?}\ntls_server_name = \"other.test\"", ca_file.display().to_string());
    let tg = Tollgate::with(&with_upstream(&format!("https://{addr}"), &extra), &[]).await;
    assert_eq!(tg.get("/x").send().await.status, 502);
}

#[tokio::test]
async fn a_client_certificate_is_presented_to_a_server_that_demands_one() {
    let ca = TestCa::new();
    let addr = server(Some((ca.issue("upstream", &["upstream.test"]), vec![b"http/1.1"], Some(&ca))), false).await;
    let dir = tempfile::tempdir().expect("temp dir");
    let ca_file = ca.write(dir.path());
    let (cert, key) = ca.issue("tollgate", &["tollgate.test"]).write(dir.path(), "client");
    let base = format!("tls_ca_file = {:?}\ntls_server_name = \"upstream.test\"", ca_file.display().to_string());

    let without = Tollgate::with(&with_upstream(&format!("https://{addr}"), &base), &[]).await;
    assert_eq!(without.get("/x").send().await.status, 502);

    let extra = format!(
        "{base}\ntls_cert_file = {:?}\ntls_key_file = {:?}",
        cert.display().to_string(),
        key.display().to_string()
    );
    let with = Tollgate::with(&with_upstream(&format!("https://{addr}"), &extra), &[]).await;
    let r = with.get("/x").send().await;
    assert_eq!(r.status, 200, "{}", r.text());
}

#[tokio::test]
async fn protocol_h2_speaks_http2_over_tls_and_over_cleartext() {
    let ca = TestCa::new();
    let tls_addr = server(Some((ca.issue("upstream", &["upstream.test"]), vec![b"h2"], None)), true).await;
    let dir = tempfile::tempdir().expect("temp dir");
    let ca_file = ca.write(dir.path());
    let extra = format!(
        "tls_ca_file = {:?}\ntls_server_name = \"upstream.test\"\nprotocol = \"h2\"",
        ca_file.display().to_string()
    );
    let tg = Tollgate::with(&with_upstream(&format!("https://{tls_addr}"), &extra), &[]).await;
    let replies = support::burst(20, |_| tg.get("/x")).await;
    for r in &replies {
        assert_eq!(r.status, 200, "{}", r.text());
        assert_eq!(r.header("x-upstream-version"), Some("HTTP/2.0"));
    }

    let clear = server(None, true).await;
    let tg = Tollgate::with(&with_upstream(&format!("http://{clear}"), "protocol = \"h2\""), &[]).await;
    let r = tg.get("/x").send().await;
    assert_eq!(r.status, 200, "{}", r.text());
    assert_eq!(r.header("x-upstream-version"), Some("HTTP/2.0"));
}
