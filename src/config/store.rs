//! `[store]`: the backend, its limits, and the files of a TLS connection
//! to Redis.

use std::path::PathBuf;
use std::time::Duration;

use super::machine;
use super::raw::{Backend, RawStore};
use super::spec::OnError;
use super::validate::Validator;

/// `[store]`
#[derive(Debug, Clone)]
pub struct StoreConfig {
    pub backend: Backend,
    pub url: Option<String>,
    pub timeout: Duration,
    pub on_error: OnError,
    pub pool_size: usize,
    pub key_prefix: String,
    /// Share of a key's capacity, in percent, that one instance may take
    /// ahead in a round trip and spend locally (0: every check asks Redis).
    pub lease_percent: u8,
    /// How long leased quota nobody here uses is kept before it is given
    /// back to Redis.
    pub lease_idle: Duration,
    /// How long a token-bucket lease lives: between this and twice this,
    /// which bounds what a crashed instance's leases hold back.
    pub lease_lifetime: Duration,
    /// CA certificates (PEM) trusted for a `rediss://` store instead of the
    /// system's roots: the file and its contents.
    pub tls_ca: Option<(PathBuf, Vec<u8>)>,
    /// A client certificate chain and its private key (PEM), for a Redis
    /// that asks for one (`tls-auth-clients yes`).
    pub tls_client: Option<TlsClientFiles>,
    /// The most keys the memory store (or the Redis store's local state)
    /// tracks; beyond it, the keys nearest to their full quota are forgotten.
    pub max_keys: usize,
}

/// `[store] tls_cert_file` and `tls_key_file`, read.
#[derive(Debug, Clone)]
pub struct TlsClientFiles {
    pub cert_path: PathBuf,
    pub cert: Vec<u8>,
    pub key_path: PathBuf,
    pub key: Vec<u8>,
}

impl Validator<'_> {
    /// `[store]`.
    pub(super) fn store(&mut self, store: RawStore) -> StoreConfig {
        let backend = store.backend.as_ref().map_or(Backend::default(), |b| *b.get_ref());
        if let Some(b) = &store.backend
            && backend == Backend::Redis
            && store.url.is_none()
        {
            self.error(b.span(), "store.backend = \"redis\" needs store.url, e.g. \"redis://127.0.0.1:6379\" or \"redis-cluster://10.0.0.1:6379?node=10.0.0.2:6379\"");
        }
        let pool_size = match &store.pool_size {
            Some(n) if !(1..=64).contains(n.get_ref()) => {
                self.error(n.span(), "store.pool_size must be between 1 and 64");
                1
            }
            Some(n) => *n.get_ref() as usize,
            None => 1,
        };
        let max_keys = match &store.max_keys {
            Some(n) if !(1024..=1_000_000_000).contains(n.get_ref()) => {
                self.error(n.span(), "store.max_keys must be between 1024 and 1000000000");
                machine::default_max_keys()
            }
            Some(n) => *n.get_ref() as usize,
            None => machine::default_max_keys(),
        };
        let lease_percent = match &store.lease_percent {
            Some(n) if !(0..=25).contains(n.get_ref()) => {
                self.error(n.span(), "store.lease_percent must be between 0 (no leasing) and 25");
                0
            }
            Some(n) => *n.get_ref() as u8,
            None => 1,
        };
        let lease_lifetime =
            self.opt_duration(store.lease_lifetime.as_ref(), "store.lease_lifetime", Duration::from_secs(5));
        if let Some(v) = &store.lease_lifetime
            && !(Duration::from_millis(100)..=Duration::from_secs(3600)).contains(&lease_lifetime)
        {
            self.error(v.span(), "store.lease_lifetime must be between \"100ms\" and \"1h\"");
        }
        let (tls_ca, tls_client) = self.store_tls(&store);
        StoreConfig {
            backend,
            url: store.url.map(|u| u.into_inner()),
            timeout: self.opt_duration(store.timeout.as_ref(), "store.timeout", Duration::from_millis(20)),
            on_error: store.on_error.unwrap_or_default(),
            pool_size,
            key_prefix: store.key_prefix.unwrap_or_else(|| "tollgate:".to_string()),
            lease_percent,
            lease_idle: self.opt_duration(store.lease_idle.as_ref(), "store.lease_idle", Duration::from_secs(5)),
            lease_lifetime,
            tls_ca,
            tls_client,
            max_keys,
        }
    }

    /// `tls_ca_file`, and `tls_cert_file` with `tls_key_file`, read and
    /// checked: only with a TLS `url`.
    #[allow(clippy::type_complexity)]
    fn store_tls(&mut self, store: &RawStore) -> (Option<(PathBuf, Vec<u8>)>, Option<TlsClientFiles>) {
        let tls_url = store.url.as_ref().is_some_and(|u| {
            let u = u.get_ref();
            u.starts_with("rediss") || u.starts_with("valkeys")
        });
        for key in [&store.tls_ca_file, &store.tls_cert_file, &store.tls_key_file].into_iter().flatten() {
            if !tls_url {
                self.error(
                    key.span(),
                    "TLS files need a TLS store.url (rediss://, rediss-cluster:// or rediss-sentinel://)",
                );
            }
        }
        let tls_ca = store.tls_ca_file.as_ref().filter(|_| tls_url).and_then(|f| {
            let (path, pem) = self.read_relative(f)?;
            if let Err(e) = super::pem::roots(&pem) {
                self.error(f.span(), format!("{}: {e}", path.display()));
                return None;
            }
            Some((path, pem))
        });
        let tls_client = match (&store.tls_cert_file, &store.tls_key_file) {
            (Some(c), Some(k)) if tls_url => {
                let cert = self.read_relative(c);
                let key = self.read_relative(k);
                match (cert, key) {
                    (Some((cert_path, cert)), Some((key_path, key))) => {
                        match super::pem::client_identity(&cert, &key) {
                            Ok(_) => Some(TlsClientFiles { cert_path, cert, key_path, key }),
                            Err(e) => {
                                self.error(
                                    c.span(),
                                    format!("{} and {}: {e}", cert_path.display(), key_path.display()),
                                );
                                None
                            }
                        }
                    }
                    _ => None,
                }
            }
            (Some(f), None) | (None, Some(f)) => {
                self.error(f.span(), "store.tls_cert_file and store.tls_key_file go together: give both or neither");
                None
            }
            _ => None,
        };
        (tls_ca, tls_client)
    }
}
