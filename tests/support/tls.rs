//! TLS for the tests: a certificate authority made in the test, the
//! certificates it issues, a rustls client that says which certificate
//! a server presented, and [`Site`]: a tollgate serving TLS with two of them.

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::Output;
use std::sync::Arc;

use rcgen::{BasicConstraints, CertificateParams, DnType, IsCa, Issuer, KeyPair};
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer, ServerName};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;
use tokio::process::Command;

use super::{DEADLINE, Tollgate, Upstream};

/// A test CA.
pub struct TestCa {
    pub pem: String,
    issuer: Issuer<'static, KeyPair>,
}

/// A certificate the CA issued, PEM.
#[derive(Clone)]
pub struct Issued {
    pub cert: String,
    pub key: String,
}

impl Issued {
    /// The end-entity certificate, DER, as a server presents it.
    pub fn der(&self) -> Vec<u8> {
        CertificateDer::from_pem_slice(self.cert.as_bytes()).expect("issued certificate is PEM").to_vec()
    }

    /// Writes the chain and key as `<name>.crt` and `<name>.key` in `dir`.
    pub fn write(&self, dir: &Path, name: &str) -> (PathBuf, PathBuf) {
        let (cert, key) = (dir.join(format!("{name}.crt")), dir.join(format!("{name}.key")));
        std::fs::write(&cert, &self.cert).expect("write certificate");
        std::fs::write(&key, &self.key).expect("write key");
        (cert, key)
    }
}

fn fail(e: rcgen::Error) -> ! {
    panic!("test certificates: {e}")
}

impl TestCa {
    pub fn new() -> TestCa {
        let key = KeyPair::generate().unwrap_or_else(|e| fail(e));
        let mut params = CertificateParams::new(Vec::<String>::new()).unwrap_or_else(|e| fail(e));
        params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
        params.distinguished_name.push(DnType::CommonName, "tollgate test CA");
        let ca = params.self_signed(&key).unwrap_or_else(|e| fail(e));
        TestCa { pem: ca.pem(), issuer: Issuer::new(params, key) }
    }

    /// A certificate for `names` (DNS names, `*.` wildcards allowed), with
    /// `cn` as its common name, and a fresh key.
    pub fn issue(&self, cn: &str, names: &[&str]) -> Issued {
        let key = KeyPair::generate().unwrap_or_else(|e| fail(e));
        let mut params =
            CertificateParams::new(names.iter().map(|n| n.to_string()).collect::<Vec<_>>()).unwrap_or_else(|e| fail(e));
        params.distinguished_name.push(DnType::CommonName, cn);
        let cert = params.signed_by(&key, &self.issuer).unwrap_or_else(|e| fail(e));
        Issued { cert: cert.pem(), key: key.serialize_pem() }
    }

    /// [`TestCa::issue`] valid until midnight (UTC) of `year-month-day`.
    pub fn issue_until(&self, cn: &str, names: &[&str], (year, month, day): (i32, u8, u8)) -> Issued {
        let key = KeyPair::generate().unwrap_or_else(|e| fail(e));
        let mut params =
            CertificateParams::new(names.iter().map(|n| n.to_string()).collect::<Vec<_>>()).unwrap_or_else(|e| fail(e));
        params.distinguished_name.push(DnType::CommonName, cn);
        params.not_after = rcgen::date_time_ymd(year, month, day);
        let cert = params.signed_by(&key, &self.issuer).unwrap_or_else(|e| fail(e));
        Issued { cert: cert.pem(), key: key.serialize_pem() }
    }

    /// Writes the CA certificate as `ca.crt` in `dir`.
    pub fn write(&self, dir: &Path) -> PathBuf {
        let path = dir.join("ca.crt");
        std::fs::write(&path, &self.pem).expect("write CA");
        path
    }

    /// Connects to `addr` over TLS asking for `server_name` (verified
    /// against this CA), sends one HTTP/1.1 GET and returns the certificate
    /// the server presented (DER) and the response's status line.
    pub async fn get(&self, addr: SocketAddr, server_name: &str) -> Result<(Vec<u8>, String), String> {
        self.get_as(addr, server_name, None).await
    }

    /// [`TestCa::get`] presenting `client` as its client certificate, if
    /// given.
    pub async fn get_as(
        &self,
        addr: SocketAddr,
        server_name: &str,
        client: Option<&Issued>,
    ) -> Result<(Vec<u8>, String), String> {
        let mut roots = rustls::RootCertStore::empty();
        roots
            .add(CertificateDer::from_pem_slice(self.pem.as_bytes()).map_err(|e| e.to_string())?)
            .map_err(|e| e.to_string())?;
        let config = rustls::ClientConfig::builder_with_provider(Arc::new(rustls::crypto::ring::default_provider()))
            .with_safe_default_protocol_versions()
            .map_err(|e| e.to_string())?
            .with_root_certificates(roots);
        let config = match client {
            None => config.with_no_client_auth(),
            Some(c) => {
                let chain = vec![CertificateDer::from_pem_slice(c.cert.as_bytes()).map_err(|e| e.to_string())?];
                let key = PrivateKeyDer::from_pem_slice(c.key.as_bytes()).map_err(|e| e.to_string())?;
                config.with_client_auth_cert(chain, key).map_err(|e| e.to_string())?
            }
        };
        let connector = tokio_rustls::TlsConnector::from(Arc::new(config));
        let name = ServerName::try_from(server_name.to_string()).map_err(|e| e.to_string())?;
        let exchange = async {
            let tcp = TcpStream::connect(addr).await.map_err(|e| format!("connect: {e}"))?;
            let mut tls = connector.connect(name, tcp).await.map_err(|e| format!("handshake: {e}"))?;
            let served = tls
                .get_ref()
                .1
                .peer_certificates()
                .and_then(|c| c.first())
                .map(|c| c.to_vec())
                .ok_or("no certificate presented")?;
            let request = format!("GET / HTTP/1.1\r\nhost: {server_name}\r\nconnection: close\r\n\r\n");
            tls.write_all(request.as_bytes()).await.map_err(|e| format!("write: {e}"))?;
            let mut response = Vec::new();
            // A peer that closes without close_notify still sent its answer.
            let _ = tls.read_to_end(&mut response).await;
            let text = String::from_utf8_lossy(&response);
            Ok((served, text.lines().next().unwrap_or_default().to_string()))
        };
        tokio::time::timeout(DEADLINE, exchange).await.map_err(|_| "no answer within the deadline".to_string())?
    }
}

/// A tollgate with two certificates: `a.test` (the first, so the default)
/// and `*.wild.test`, in front of an echo upstream.
pub struct Site {
    pub ca: TestCa,
    pub a: Issued,
    pub wild: Issued,
    pub tollgate: Tollgate,
    _upstream: Option<Upstream>,
}

/// `extra` goes into `[listen]`.
pub async fn site(extra: &str) -> Site {
    let upstream = Upstream::start().await;
    let mut site = site_for(upstream.addr, extra).await;
    site._upstream = Some(upstream);
    site
}

/// [`site`] in front of the upstream at `upstream`.
pub async fn site_for(upstream: SocketAddr, extra: &str) -> Site {
    let ca = TestCa::new();
    let a = ca.issue("a", &["a.test"]);
    let wild = ca.issue("wild", &["*.wild.test"]);
    let dir = tempfile::tempdir().expect("temp dir");
    std::fs::create_dir(dir.path().join("rules")).expect("rules dir");
    ca.write(dir.path());
    a.write(dir.path(), "a");
    wild.write(dir.path(), "wild");
    let tls = "[[listen.tls]]\ncert_file = \"a.crt\"\nkey_file = \"a.key\"\n\n\
               [[listen.tls]]\ncert_file = \"wild.crt\"\nkey_file = \"wild.key\"\n\n[rules]";
    let config = super::config(upstream).replacen("[rules]", &format!("{extra}\n{tls}"), 1);
    let tollgate = Tollgate::start_in(dir, &config).await;
    Site { ca, a, wild, tollgate, _upstream: None }
}

impl Site {
    pub fn dir(&self) -> &Path {
        self.tollgate.dir.path()
    }

    pub fn port(&self) -> u16 {
        self.tollgate.proxy_addr.port()
    }

    /// curl with the test CA, every `*.test` name used here resolving to
    /// the proxy listener.
    pub async fn curl(&self, args: &[&str]) -> Output {
        let mut cmd = Command::new("curl");
        cmd.arg("--silent").arg("--show-error").arg("--max-time").arg("10");
        cmd.arg("--cacert").arg(self.dir().join("ca.crt"));
        for name in ["a.test", "x.wild.test", "other.test"] {
            cmd.arg("--resolve").arg(format!("{name}:{}:127.0.0.1", self.port()));
        }
        cmd.args(args).output().await.expect("curl runs")
    }

    pub fn url(&self, host: &str, path: &str) -> String {
        format!("https://{host}:{}{path}", self.port())
    }
}
