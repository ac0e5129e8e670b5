//! Client certificates on the proxy listener (`[listen] client_ca_file`,
//! `client_auth`): the verifier a handshake checks them with, and the
//! subject a verified one is keyed by (the `client_cert` key part).
//!
//! The key is the certificate subject's common name: short, readable in
//! bucket keys and logs, and what CAs for clients put the client's identity
//! in. The whole distinguished name would need an RFC 4514 renderer (type
//! names, escaping, multi-valued RDNs) for little gain. A certificate
//! without a common name keys like a request without one.

use std::path::Path;
use std::sync::Arc;

use rustls::RootCertStore;
use rustls::pki_types::CertificateDer;
use rustls::pki_types::pem::PemObject;
use rustls::server::WebPkiClientVerifier;
use rustls::server::danger::ClientCertVerifier;

use super::expiry::element;

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
        let roots: Vec<CertificateDer<'static>> = CertificateDer::pem_slice_iter(pem)
            .collect::<Result<_, _>>()
            .map_err(|e| format!("{} is not a PEM certificate file ({e})", path.display()))?;
        if roots.is_empty() {
            return Err(format!("{} holds no PEM certificate (-----BEGIN CERTIFICATE-----)", path.display()));
        }
        let mut store = RootCertStore::empty();
        for root in &roots {
            store.add(root.clone()).map_err(|e| format!("a certificate in {} cannot be a CA ({e})", path.display()))?;
        }
        let builder = WebPkiClientVerifier::builder_with_provider(Arc::new(store), super::provider());
        let builder = if required { builder } else { builder.allow_unauthenticated() };
        let verifier = builder
            .build()
            .map_err(|e| format!("cannot check client certificates against {} ({e})", path.display()))?;
        Ok(ClientAuth { roots, required, verifier })
    }
}

/// The common name of the subject of the client certificate `conn`
/// verified, if it sent one and it has a common name.
pub fn client_subject(conn: &rustls::ServerConnection) -> Option<Arc<[u8]>> {
    // rustls only reports certificates its verifier accepted.
    let leaf = conn.peer_certificates()?.first()?;
    common_name(leaf).map(Arc::from)
}

/// The first common name (OID 2.5.4.3) in the subject of the DER
/// certificate `cert`, its string's bytes as they are.
fn common_name(cert: &[u8]) -> Option<&[u8]> {
    const SEQUENCE: u8 = 0x30;
    const SET: u8 = 0x31;
    const VERSION: u8 = 0xa0;
    const OID: u8 = 0x06;
    const COMMON_NAME: &[u8] = &[0x55, 0x04, 0x03];
    let (SEQUENCE, certificate, _) = element(cert)? else { return None };
    let (SEQUENCE, tbs, _) = element(certificate)? else { return None };
    // [0] version, serialNumber, signature, issuer, validity, subject.
    let mut rest = tbs;
    if element(rest)?.0 == VERSION {
        rest = element(rest)?.2;
    }
    for _ in 0..4 {
        rest = element(rest)?.2;
    }
    let (SEQUENCE, mut rdns, _) = element(rest)? else { return None };
    while !rdns.is_empty() {
        let (SET, mut attributes, next) = element(rdns)? else { return None };
        while !attributes.is_empty() {
            let (SEQUENCE, attribute, after) = element(attributes)? else { return None };
            let (tag, oid, value) = element(attribute)?;
            if tag == OID && oid == COMMON_NAME {
                return Some(element(value)?.1);
            }
            attributes = after;
        }
        rdns = next;
    }
    None
}

#[cfg(test)]
mod tests {
    use super::*;

    fn der(cn: Option<&str>) -> Vec<u8> {
        let key = rcgen::KeyPair::generate().expect("key");
        let mut params = rcgen::CertificateParams::new(vec!["a.test".to_string()]).expect("params");
        params.distinguished_name = rcgen::DistinguishedName::new();
        params.distinguished_name.push(rcgen::DnType::OrganizationName, "Example");
        if let Some(cn) = cn {
            params.distinguished_name.push(rcgen::DnType::CommonName, cn);
        }
        params.self_signed(&key).expect("certificate").der().to_vec()
    }

    #[test]
    fn reads_the_common_name_after_other_attributes() {
        assert_eq!(common_name(&der(Some("alice"))), Some(&b"alice"[..]));
        assert_eq!(common_name(&der(None)), None);
        assert_eq!(common_name(b""), None);
    }

    #[test]
    fn a_file_without_certificates_is_refused() {
        let e = ClientAuth::from_pem(Path::new("ca.crt"), b"junk\n", true).expect_err("no certificate");
        assert!(e.contains("holds no PEM certificate"), "{e}");
    }
}
