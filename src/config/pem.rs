//! The one PEM loader: certificates and private keys read from PEM files,
//! for the proxy listener (`[[listen.tls]]`, `client_ca_file`), upstream
//! servers (`tls_ca_file`, `tls_cert_file`) and Redis (`[store] tls_*`).
//!
//! Each caller words its own errors (they name its config keys), so the
//! loader returns what went wrong as a [`PemError`]. One rustls is linked
//! (fred's `fred::rustls` is the same crate), with the ring provider.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use rustls::RootCertStore;
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer};
use rustls::server::WebPkiClientVerifier;
use rustls::server::danger::ClientCertVerifier;
use rustls::sign::CertifiedKey;

use super::der;

/// What a PEM file did not hold.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum PemError {
    /// A `-----BEGIN` block that does not parse, with the parser's reason.
    NotPem(String),
    /// No certificate at all.
    NoCertificate,
    /// No private key, with the parser's reason.
    NoKey(String),
}

/// The ring provider: the one crypto backend linked.
pub fn provider() -> Arc<rustls::crypto::CryptoProvider> {
    Arc::new(rustls::crypto::ring::default_provider())
}

/// The certificates of a PEM file, in order; at least one.
pub fn certificates(pem: &[u8]) -> Result<Vec<CertificateDer<'static>>, PemError> {
    let certs: Vec<CertificateDer<'static>> =
        CertificateDer::pem_slice_iter(pem).collect::<Result<_, _>>().map_err(|e| PemError::NotPem(e.to_string()))?;
    if certs.is_empty() {
        return Err(PemError::NoCertificate);
    }
    Ok(certs)
}

/// The first private key of a PEM file.
pub fn private_key(pem: &[u8]) -> Result<PrivateKeyDer<'static>, PemError> {
    PrivateKeyDer::from_pem_slice(pem).map_err(|e| PemError::NoKey(e.to_string()))
}

/// The certificates of a PEM file, as the roots a `rediss://` connection
/// trusts (`[store] tls_ca_file`). Errors are plain sentences.
pub fn roots(pem: &[u8]) -> Result<RootCertStore, String> {
    let mut roots = RootCertStore::empty();
    for cert in CertificateDer::pem_slice_iter(pem) {
        let cert = cert.map_err(|e| format!("not a PEM certificate file ({e})"))?;
        roots.add(cert).map_err(|e| format!("a certificate cannot be used as a CA ({e})"))?;
    }
    if roots.is_empty() {
        return Err("holds no PEM certificate (-----BEGIN CERTIFICATE-----)".into());
    }
    Ok(roots)
}

/// A client certificate chain and its private key (`[store]
/// tls_cert_file`, `tls_key_file`), checked to go together. Errors are
/// plain sentences.
pub fn client_identity(
    cert: &[u8],
    key: &[u8],
) -> Result<(Vec<CertificateDer<'static>>, PrivateKeyDer<'static>), String> {
    let chain = certificates(cert).map_err(|e| match e {
        PemError::NotPem(e) | PemError::NoKey(e) => format!("not a PEM certificate file ({e})"),
        PemError::NoCertificate => "the certificate file holds no PEM certificate".to_string(),
    })?;
    let key = private_key(key).map_err(|e| match e {
        PemError::NoKey(e) | PemError::NotPem(e) => format!("no PEM private key in the key file ({e})"),
        PemError::NoCertificate => "no PEM private key in the key file".to_string(),
    })?;
    rustls::ClientConfig::builder()
        .with_root_certificates(RootCertStore::empty())
        .with_client_auth_cert(chain.clone(), key.clone_key())
        .map_err(|e| format!("the key does not go with the certificate ({e})"))?;
    Ok((chain, key))
}

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
        let chain = certificates(cert).map_err(|e| not_certificates(cert_path, e))?;
        let Some(leaf) = chain.first() else { return Err(not_certificates(cert_path, PemError::NoCertificate)) };
        let end_entity = webpki::EndEntityCert::try_from(leaf)
            .map_err(|e| format!("the first certificate in {} cannot be parsed ({e})", cert_path.display()))?;
        let names = end_entity.valid_dns_names().map(str::to_ascii_lowercase).collect();
        let not_after = der::not_after(leaf);
        let private = private_key(key).map_err(|e| match e {
            PemError::NoKey(e) | PemError::NotPem(e) => {
                format!("{} holds no PEM private key ({e})", key_path.display())
            }
            PemError::NoCertificate => format!("{} holds no PEM private key", key_path.display()),
        })?;
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
    pub fn covers(&self, name: &str) -> bool {
        self.names.iter().any(|n| match n.strip_prefix("*.") {
            Some(suffix) => {
                name.split_once('.').is_some_and(|(label, rest)| !label.is_empty() && rest.eq_ignore_ascii_case(suffix))
            }
            None => n.eq_ignore_ascii_case(name),
        })
    }
}

/// The listener's and the client CA file's sentence for a file without
/// certificates.
fn not_certificates(path: &Path, e: PemError) -> String {
    match e {
        PemError::NotPem(e) | PemError::NoKey(e) => format!("{} is not a PEM certificate file ({e})", path.display()),
        PemError::NoCertificate => {
            format!("{} holds no PEM certificate (-----BEGIN CERTIFICATE-----)", path.display())
        }
    }
}

/// `[listen] client_ca_file` and `client_auth`, loaded.
#[derive(Debug, Clone)]
pub struct ClientAuth {
    /// The CA certificates client certificates are checked against.
    pub roots: Vec<CertificateDer<'static>>,
    /// `client_auth = "required"`: a client without a valid certificate
    /// fails the handshake. Otherwise one without any is served (with no
    /// `client_cert`) and one with an invalid certificate still fails.
    pub required: bool,
    pub verifier: Arc<dyn ClientCertVerifier>,
}

impl ClientAuth {
    /// The CA certificates of the PEM file `pem` (read from `path`). Errors
    /// are plain sentences naming the file.
    pub fn from_pem(path: &Path, pem: &[u8], required: bool) -> Result<ClientAuth, String> {
        let roots = certificates(pem).map_err(|e| not_certificates(path, e))?;
        let mut store = RootCertStore::empty();
        for root in &roots {
            store.add(root.clone()).map_err(|e| format!("a certificate in {} cannot be a CA ({e})", path.display()))?;
        }
        let builder = WebPkiClientVerifier::builder_with_provider(Arc::new(store), provider());
        let builder = if required { builder } else { builder.allow_unauthenticated() };
        let verifier = builder
            .build()
            .map_err(|e| format!("cannot check client certificates against {} ({e})", path.display()))?;
        Ok(ClientAuth { roots, required, verifier })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

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

    #[test]
    fn a_file_without_certificates_is_refused() {
        let e = ClientAuth::from_pem(Path::new("ca.crt"), b"junk\n", true).expect_err("no certificate");
        assert!(e.contains("holds no PEM certificate"), "{e}");
    }
}
