//! TLS termination on the proxy listener (`[[listen.tls]]`).
//!
//! Each `[[listen.tls]]` table is one certificate chain and its key. The
//! certificate a client gets is chosen by the name it asks for (SNI) among
//! the certificates' own DNS names (subject alternative names, wildcards
//! such as `*.example.com` included); a client that asks for no name, or
//! for one no certificate carries, gets the first table's.
//!
//! The certificates live behind an [`ArcSwap`]: a handshake reads the
//! current set without a lock, and [`CertWatcher`] swaps in a new set when
//! a certificate or key file changes on disk (renewal), so the next
//! handshake presents it without a restart. A replacement that does not
//! load (half written, a key that does not go with its certificate) keeps
//! the previous certificate of that table, is logged and counted in
//! `tollgate_tls_reload_failures_total`.
//!
//! rustls with the ring provider (the one the Redis client already links),
//! TLS 1.2 and 1.3 only, ALPN `h2` and `http/1.1`. Session tickets are on
//! (rustls's ring [`Ticketer`](rustls::crypto::ring::Ticketer): a random
//! key of this process, rotated every 6 hours), so a returning client
//! resumes its session without a full handshake, on TLS 1.2 as on 1.3 and
//! with no session cache to share between connections. Each certificate's
//! expiry is `tollgate_tls_certificate_expiry_timestamp_seconds{name}`,
//! kept current as certificates are re-read.

use std::path::PathBuf;
use std::sync::Arc;

use parking_lot::Mutex;

use arc_swap::ArcSwap;
use prometheus::{IntCounter, IntGaugeVec};
use rustls::server::{ClientHello, ResolvesServerCert};
use rustls::sign::CertifiedKey;

use crate::config::der::common_name;
use crate::config::pem::provider;
use crate::config::watch::{self, Target, file_fingerprint, recently_modified};
use crate::config::{Certificate, ClientAuth};

/// The common name of the subject of the client certificate `conn`
/// verified, if it sent one and it has a common name: the `client_cert`
/// key part.
///
/// The key is the certificate subject's common name: short, readable in
/// bucket keys and logs, and what CAs for clients put the client's identity
/// in. The whole distinguished name would need an RFC 4514 renderer (type
/// names, escaping, multi-valued RDNs) for little gain. A certificate
/// without a common name keys like a request without one.
pub fn client_subject(conn: &rustls::ServerConnection) -> Option<Arc<[u8]>> {
    // rustls only reports certificates its verifier accepted.
    let leaf = conn.peer_certificates()?.first()?;
    common_name(leaf).map(Arc::from)
}

/// Chooses the certificate for a handshake from the current set.
#[derive(Debug)]
pub struct CertResolver {
    /// In `[[listen.tls]]` order; never empty (the first is the default).
    certs: ArcSwap<Vec<Certificate>>,
}

impl CertResolver {
    /// The certificates in force, in config order.
    pub fn current(&self) -> Arc<Vec<Certificate>> {
        self.certs.load_full()
    }

    fn choose(&self, server_name: Option<&str>) -> Option<Arc<CertifiedKey>> {
        let certs = self.certs.load();
        let chosen = server_name
            .and_then(|name| {
                // An exact name wins over a wildcard of another certificate.
                certs
                    .iter()
                    .find(|c| c.names.iter().any(|n| n.eq_ignore_ascii_case(name)))
                    .or_else(|| certs.iter().find(|c| c.covers(name)))
            })
            .or_else(|| certs.first())?;
        Some(chosen.key.clone())
    }
}

impl ResolvesServerCert for CertResolver {
    fn resolve(&self, hello: ClientHello<'_>) -> Option<Arc<CertifiedKey>> {
        self.choose(hello.server_name())
    }
}

/// The proxy listener's TLS set-up: the acceptor and the certificates it
/// presents.
#[derive(Clone)]
pub struct Tls {
    pub acceptor: tokio_rustls::TlsAcceptor,
    pub resolver: Arc<CertResolver>,
}

impl Tls {
    /// A server configuration presenting `certs` (validated, non-empty),
    /// asking clients for certificates when `client_auth` is given.
    pub fn new(certs: Vec<Certificate>, client_auth: Option<&ClientAuth>) -> Result<Tls, String> {
        if certs.is_empty() {
            return Err("no [[listen.tls]] certificate".into());
        }
        let resolver = Arc::new(CertResolver { certs: ArcSwap::from_pointee(certs) });
        let builder = rustls::ServerConfig::builder_with_provider(provider())
            .with_protocol_versions(&[&rustls::version::TLS13, &rustls::version::TLS12])
            .map_err(|e| format!("cannot set up TLS: {e}"))?;
        let builder = match client_auth {
            Some(auth) => builder.with_client_cert_verifier(auth.verifier.clone()),
            None => builder.with_no_client_auth(),
        };
        let mut config = builder.with_cert_resolver(resolver.clone());
        config.alpn_protocols = vec![b"h2".to_vec(), b"http/1.1".to_vec()];
        config.ticketer =
            rustls::crypto::ring::Ticketer::new().map_err(|e| format!("cannot set up TLS session tickets: {e}"))?;
        Ok(Tls { acceptor: tokio_rustls::TlsAcceptor::from(Arc::new(config)), resolver })
    }
}

/// Re-reads the certificates when their files change.
pub struct CertWatcher {
    resolver: Arc<CertResolver>,
    failures: IntCounter,
    /// `tollgate_tls_certificate_expiry_timestamp_seconds`, by name.
    expiry: IntGaugeVec,
    /// Per table, the fingerprints of its certificate and key files when
    /// last read (0: read again at the next look).
    seen: Mutex<Vec<(u64, u64)>>,
}

impl CertWatcher {
    /// Watches `resolver`'s files; `metrics` counts failed reloads and
    /// shows each certificate's expiry, from now on.
    pub fn new(resolver: Arc<CertResolver>, metrics: &crate::obs::metrics::Metrics) -> CertWatcher {
        let seen = resolver.current().iter().map(fingerprints).collect();
        let expiry = metrics.tls_certificate_expiry_timestamp_seconds.clone();
        let watcher = CertWatcher {
            resolver,
            failures: metrics.tls_reload_failures_total.clone(),
            expiry,
            seen: Mutex::new(seen),
        };
        watcher.show_expiry(&[]);
        watcher
    }

    /// Sets each current certificate's expiry, and drops the series of
    /// `before`'s names no certificate carries any more.
    fn show_expiry(&self, before: &[Certificate]) {
        let current = self.resolver.current();
        let names: Vec<String> = current.iter().map(Certificate::metric_name).collect();
        for gone in before.iter().map(Certificate::metric_name).filter(|n| !names.contains(n)) {
            let _ = self.expiry.remove_label_values(&[&gone]);
        }
        for (cert, name) in current.iter().zip(&names) {
            match cert.not_after {
                Some(t) => self.expiry.with_label_values(&[name]).set(t),
                None => {
                    let _ = self.expiry.remove_label_values(&[name]);
                }
            }
        }
    }

    /// Re-reads every table whose files changed since the last look and
    /// swaps the set in. Blocking (file IO): the watch runs it on a
    /// blocking thread. Returns how many tables were replaced.
    pub fn poll(&self) -> usize {
        let current = self.resolver.current();
        let mut seen = self.seen.lock();
        let mut next: Vec<Certificate> = current.as_ref().clone();
        let mut replaced = 0;
        for (i, cert) in current.iter().enumerate() {
            let now = fingerprints(cert);
            if seen.get(i) == Some(&now) {
                continue;
            }
            // A file modified within the timestamps' resolution may change
            // again without its metadata changing: look again next time.
            let racy = [&cert.cert_path, &cert.key_path].iter().any(|p| recently_modified(p));
            if let Some(s) = seen.get_mut(i) {
                *s = if racy { (0, 0) } else { now };
            }
            match Certificate::read(&cert.cert_path, &cert.key_path) {
                Ok(fresh) => {
                    tracing::info!(cert = %cert.cert_path.display(), names = ?fresh.names, "TLS certificate reloaded");
                    next[i] = fresh;
                    replaced += 1;
                }
                Err(e) => {
                    self.failures.inc();
                    tracing::error!(
                        cert = %cert.cert_path.display(),
                        "TLS certificate reload failed, the previous certificate stays in force: {e}"
                    );
                }
            }
        }
        if replaced > 0 {
            self.resolver.certs.store(Arc::new(next));
            self.show_expiry(&current);
        }
        replaced
    }

    /// Watches the directories holding the certificate and key files until
    /// the task is dropped: a renewal usually replaces a file (rename, or a
    /// swapped symlink as certbot's `live/` does), which a watch on the file
    /// itself would miss.
    pub async fn watch(self: Arc<Self>) {
        let mut dirs: Vec<PathBuf> = Vec::new();
        for c in self.resolver.current().iter() {
            for dir in [&c.cert_path, &c.key_path].into_iter().filter_map(|p| watch::parent(p)) {
                if !dirs.contains(&dir) {
                    dirs.push(dir);
                }
            }
        }
        let targets = dirs.into_iter().map(|path| Target { path, recursive: false, required: true }).collect();
        watch::watch("TLS files", targets, move || {
            self.poll();
        })
        .await;
    }
}

fn fingerprints(c: &Certificate) -> (u64, u64) {
    (file_fingerprint(&c.cert_path), file_fingerprint(&c.key_path))
}

#[cfg(test)]
mod tests {
    use std::path::Path;

    use super::*;

    fn cert(names: &[&str]) -> Certificate {
        let key = rcgen::KeyPair::generate().expect("key");
        let params =
            rcgen::CertificateParams::new(names.iter().map(|n| n.to_string()).collect::<Vec<_>>()).expect("params");
        let pem = params.self_signed(&key).expect("certificate").pem();
        Certificate::from_pem(Path::new("c.pem"), pem.as_bytes(), Path::new("k.pem"), key.serialize_pem().as_bytes())
            .expect("a matching pair loads")
    }

    #[test]
    fn sni_prefers_an_exact_name_then_a_wildcard_then_the_first() {
        let certs = vec![cert(&["default.test"]), cert(&["*.example.com"]), cert(&["api.example.com"])];
        let keys: Vec<Arc<CertifiedKey>> = certs.iter().map(|c| c.key.clone()).collect();
        let resolver = CertResolver { certs: ArcSwap::from_pointee(certs) };
        let chosen = |name: Option<&str>| {
            let key = resolver.choose(name).expect("always a certificate");
            keys.iter().position(|k| Arc::ptr_eq(k, &key)).expect("one of ours")
        };
        assert_eq!(chosen(Some("api.example.com")), 2, "exact beats an earlier wildcard");
        assert_eq!(chosen(Some("API.Example.COM")), 2, "names compare without case");
        assert_eq!(chosen(Some("www.example.com")), 1);
        assert_eq!(chosen(Some("a.b.example.com")), 0, "a wildcard covers one label");
        assert_eq!(chosen(Some("example.com")), 0, "nor the bare domain");
        assert_eq!(chosen(Some("default.test")), 0);
        assert_eq!(chosen(None), 0);
    }
}
