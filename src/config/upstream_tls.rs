//! How tollgate talks to an upstream's servers: `https://` with a CA file,
//! SNI and an optional client certificate, and `protocol = "h2"`.

use std::hash::{Hash, Hasher};
use std::sync::Arc;

use rustls::pki_types::ServerName;

use super::pem::{self, PemError};
use super::raw::RawUpstream;
use super::validate::Validator;

/// `protocol`: what is spoken to the servers.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Protocol {
    /// HTTP/1.1, a request per connection at a time, connections pooled.
    #[default]
    Http1,
    /// HTTP/2: one connection per server, requests multiplexed on it (over
    /// TLS with ALPN `h2`, or cleartext with prior knowledge).
    H2,
}

/// The TLS client side for `https://` servers.
#[derive(Debug, Clone)]
pub struct UpstreamTls {
    pub client: Arc<rustls::ClientConfig>,
    /// `tls_server_name`: the name sent in SNI and checked against the
    /// server's certificate, instead of each server's own host.
    pub server_name: Option<ServerName<'static>>,
    /// A hash of the files and names it was made from: a reload keeps the
    /// connections of a server whose TLS settings and files are unchanged.
    pub fingerprint: u64,
}

impl Validator<'_> {
    pub(super) fn protocol(&mut self, u: &RawUpstream) -> Option<Protocol> {
        match u.protocol.as_ref().map(|p| (p, p.get_ref().as_str())) {
            None | Some((_, "http/1.1")) => Some(Protocol::Http1),
            Some((_, "h2")) => Some(Protocol::H2),
            Some((p, other)) => {
                self.error(p.span(), format!("upstream protocol {other:?} is not \"http/1.1\" or \"h2\""));
                None
            }
        }
    }

    /// The TLS settings of an upstream whose servers are `https` (`None`
    /// for `http`, where any `tls_*` key is an error).
    pub(super) fn upstream_tls(
        &mut self,
        u: &RawUpstream,
        https: bool,
        protocol: Protocol,
    ) -> Option<Option<UpstreamTls>> {
        if !https {
            return self.no_tls_keys(u);
        }
        let mut fingerprint = std::hash::DefaultHasher::new();
        let roots = self.trusted_roots(u, &mut fingerprint)?;
        let server_name = self.tls_server_name(u)?;
        let builder = rustls::ClientConfig::builder_with_provider(pem::provider())
            .with_protocol_versions(&[&rustls::version::TLS13, &rustls::version::TLS12])
            .ok()?
            .with_root_certificates(roots);
        let mut client = self.client_certificate(u, builder, &mut fingerprint)?;
        client.alpn_protocols = match protocol {
            Protocol::H2 => vec![b"h2".to_vec()],
            Protocol::Http1 => vec![b"http/1.1".to_vec()],
        };
        u.tls_server_name.as_ref().map(|n| n.get_ref()).hash(&mut fingerprint);
        let fingerprint = fingerprint.finish();
        Some(Some(UpstreamTls { client: Arc::new(client), server_name, fingerprint }))
    }

    /// An `http://` upstream: no TLS, and no `tls_*` key that would suggest
    /// otherwise.
    fn no_tls_keys(&mut self, u: &RawUpstream) -> Option<Option<UpstreamTls>> {
        let keys = [&u.tls_ca_file, &u.tls_cert_file, &u.tls_key_file, &u.tls_server_name];
        if let Some(k) = keys.iter().copied().flatten().next() {
            self.error(k.span(), "tls_* keys are for https:// upstream servers");
            return None;
        }
        Some(None)
    }

    /// The CA certificates servers are checked against: `tls_ca_file`, or
    /// the system's trust store, as curl would use.
    fn trusted_roots(&mut self, u: &RawUpstream, fingerprint: &mut impl Hasher) -> Option<rustls::RootCertStore> {
        let mut roots = rustls::RootCertStore::empty();
        let Some(ca) = &u.tls_ca_file else {
            let found = rustls_native_certs::load_native_certs();
            roots.add_parsable_certificates(found.certs);
            return Some(roots);
        };
        let (path, pem) = self.read_relative(ca)?;
        pem.hash(fingerprint);
        let certs = match pem::certificates(&pem) {
            Ok(c) => c,
            Err(PemError::NotPem(e) | PemError::NoKey(e)) => {
                self.error(ca.span(), format!("{} is not a PEM certificate file ({e})", path.display()));
                return None;
            }
            Err(PemError::NoCertificate) => Vec::new(),
        };
        let (added, _) = roots.add_parsable_certificates(certs);
        if added == 0 {
            self.error(ca.span(), format!("{} holds no usable CA certificate", path.display()));
            return None;
        }
        Some(roots)
    }

    /// `tls_server_name`, when set: the name sent in SNI and checked
    /// instead of each server's host.
    fn tls_server_name(&mut self, u: &RawUpstream) -> Option<Option<ServerName<'static>>> {
        let Some(n) = &u.tls_server_name else { return Some(None) };
        match ServerName::try_from(n.get_ref().clone()) {
            Ok(name) => Some(Some(name)),
            Err(_) => {
                self.error(n.span(), format!("tls_server_name {:?} is not a DNS name or an IP address", n.get_ref()));
                None
            }
        }
    }

    /// `tls_cert_file` and `tls_key_file`, which go together: the client
    /// certificate presented to servers that ask for one.
    fn client_certificate(
        &mut self,
        u: &RawUpstream,
        builder: rustls::ConfigBuilder<rustls::ClientConfig, rustls::client::WantsClientCert>,
        fingerprint: &mut impl Hasher,
    ) -> Option<rustls::ClientConfig> {
        match (&u.tls_cert_file, &u.tls_key_file) {
            (None, None) => Some(builder.with_no_client_auth()),
            (Some(cert), Some(key)) => {
                let (cert_path, cert_pem) = self.read_relative(cert)?;
                let (key_path, key_pem) = self.read_relative(key)?;
                (&cert_pem, &key_pem).hash(fingerprint);
                let Ok(chain) = pem::certificates(&cert_pem) else {
                    self.error(cert.span(), format!("{} holds no PEM certificate", cert_path.display()));
                    return None;
                };
                let Ok(private) = pem::private_key(&key_pem) else {
                    self.error(key.span(), format!("{} holds no PEM private key", key_path.display()));
                    return None;
                };
                match builder.with_client_auth_cert(chain, private) {
                    Ok(c) => Some(c),
                    Err(e) => {
                        self.error(key.span(), format!("the client certificate and key cannot be used ({e})"));
                        None
                    }
                }
            }
            (Some(k), None) | (None, Some(k)) => {
                self.error(k.span(), "tls_cert_file and tls_key_file go together");
                None
            }
        }
    }
}
