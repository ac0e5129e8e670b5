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

mod client_auth;
mod expiry;

pub use client_auth::{ClientAuth, client_subject};

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use arc_swap::ArcSwap;
use parking_lot::Mutex;
use prometheus::{IntCounter, IntGaugeVec};
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer};
use rustls::server::{ClientHello, ResolvesServerCert};
use rustls::sign::CertifiedKey;

use crate::config::watch::{Names, Watched, watch};

/// One `[[listen.tls]]` table, loaded: where it was read from, the chain
/// and key, and the DNS names SNI chooses it by.
#[derive(Debug, Clone)]
pub struct Certificate {
    pub cert_path: PathBuf,
    pub key_path: PathBuf,
    pub key: Arc<CertifiedKey>,
    /// Lower-case DNS names of the end-entity certificate, wildcards as
    /// `*.example.com`.
    pub names: Vec<String>,
    /// When the end-entity certificate expires (`notAfter`), in seconds
    /// since the epoch; `None` if it could not be read.
    pub not_after: Option<i64>,
}

impl Certificate {
    /// Reads and checks a certificate chain and its key. Errors are plain
    /// sentences naming the file at fault.
    pub fn read(cert_path: &Path, key_path: &Path) -> Result<Certificate, String> {
        let cert = std::fs::read(cert_path).map_err(|e| format!("cannot read {}: {e}", cert_path.display()))?;
        let key = std::fs::read(key_path).map_err(|e| format!("cannot read {}: {e}", key_path.display()))?;
        Certificate::from_pem(cert_path, &cert, key_path, &key)
    }

    /// [`Certificate::read`] from the files' contents.
    pub fn from_pem(cert_path: &Path, cert: &[u8], key_path: &Path, key: &[u8]) -> Result<Certificate, String> {
        let chain: Vec<CertificateDer<'static>> = CertificateDer::pem_slice_iter(cert)
            .collect::<Result<_, _>>()
            .map_err(|e| format!("{} is not a PEM certificate file ({e})", cert_path.display()))?;
        let Some(leaf) = chain.first() else {
            return Err(format!("{} holds no PEM certificate (-----BEGIN CERTIFICATE-----)", cert_path.display()));
        };
        let end_entity = webpki::EndEntityCert::try_from(leaf)
            .map_err(|e| format!("the first certificate in {} cannot be parsed ({e})", cert_path.display()))?;
        let names = end_entity.valid_dns_names().map(str::to_ascii_lowercase).collect();
        let not_after = expiry::not_after(leaf);
        let private = PrivateKeyDer::from_pem_slice(key)
            .map_err(|e| format!("{} holds no PEM private key ({e})", key_path.display()))?;
        let signing = provider()
            .key_provider
            .load_private_key(private)
            .map_err(|e| format!("the private key in {} cannot be used ({e})", key_path.display()))?;
        let certified = CertifiedKey::new(chain, signing);
        certified.keys_match().map_err(|_| {
            format!(
                "the private key in {} does not go with the certificate in {}",
                key_path.display(),
                cert_path.display()
            )
        })?;
        Ok(Certificate {
            cert_path: cert_path.to_path_buf(),
            key_path: key_path.to_path_buf(),
            key: Arc::new(certified),
            names,
            not_after,
        })
    }

    /// The `name` label of its expiry metric: its first DNS name, or for a
    /// certificate without one its file.
    pub fn metric_name(&self) -> String {
        self.names.first().cloned().unwrap_or_else(|| self.cert_path.display().to_string())
    }

    /// Whether this certificate carries `name` (already known to be a DNS
    /// name): exactly, or through a wildcard covering its first label.
    fn covers(&self, name: &str) -> bool {
        self.names.iter().any(|n| match n.strip_prefix("*.") {
            Some(suffix) => {
                name.split_once('.').is_some_and(|(label, rest)| !label.is_empty() && rest.eq_ignore_ascii_case(suffix))
            }
            None => n.eq_ignore_ascii_case(name),
        })
    }
}

/// The ring provider: the one crypto backend linked.
fn provider() -> Arc<rustls::crypto::CryptoProvider> {
    Arc::new(rustls::crypto::ring::default_provider())
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
    pub fn new(resolver: Arc<CertResolver>, metrics: &crate::metrics::Metrics) -> CertWatcher {
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

    /// Watches the certificate and key files until the task is dropped.
    /// Their directories, not the files: a renewal usually replaces a file
    /// (rename, or a swapped symlink as certbot's `live/` does), which a
    /// watch on the file itself would miss. The debounce also waits out a
    /// renewal writing the chain and the key one after the other.
    pub async fn watch(self: Arc<Self>) {
        let mut paths: Vec<Watched> = Vec::new();
        for c in self.resolver.current().iter() {
            for p in [&c.cert_path, &c.key_path] {
                if let Some(dir) = p.parent().filter(|d| !d.as_os_str().is_empty()) {
                    paths.push(Watched::dir(dir));
                }
            }
        }
        let names = Names { files: "the TLS files", poll: "the TLS certificate poll" };
        watch(names, paths, move || {
            self.poll();
        })
        .await;
    }
}

fn fingerprints(c: &Certificate) -> (u64, u64) {
    (crate::reload::file_fingerprint(&c.cert_path), crate::reload::file_fingerprint(&c.key_path))
}

fn recently_modified(path: &Path) -> bool {
    std::fs::metadata(path)
        .and_then(|m| m.modified())
        .is_ok_and(|m| m.elapsed().is_ok_and(|age| age < Duration::from_millis(50)))
}

#[cfg(test)]
mod tests {
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

    #[test]
    fn a_key_of_another_certificate_is_refused() {
        let a = rcgen::KeyPair::generate().expect("key");
        let b = rcgen::KeyPair::generate().expect("key");
        let pem = rcgen::CertificateParams::new(vec!["a.test".to_string()])
            .expect("params")
            .self_signed(&a)
            .expect("certificate")
            .pem();
        let err =
            Certificate::from_pem(Path::new("a.crt"), pem.as_bytes(), Path::new("b.key"), b.serialize_pem().as_bytes())
                .expect_err("mismatched pair");
        assert_eq!(err, "the private key in b.key does not go with the certificate in a.crt");
        let err = Certificate::from_pem(Path::new("a.crt"), b"", Path::new("b.key"), b"").expect_err("empty");
        assert!(err.contains("a.crt holds no PEM certificate"), "{err}");
    }
}
