//! What a failed try is answered with: counted against the upstream (and,
//! unless tollgate itself ran out of resources, against the server) and
//! logged, then named as the client's status.

use super::client::UpstreamClient;
use super::forward::BodyFailure;
use super::pool::PoolError;
use crate::wire::error::ProxyError;

impl UpstreamClient {
    /// Counts and logs a failed call to server `i` (`e` `None`: out of
    /// time) and names its answer. A failure of tollgate's own resources
    /// is not the server's.
    pub(super) fn upstream_error_at(&self, i: usize, e: Option<&PoolError>) -> ProxyError {
        let name = &self.config.name;
        let address = &self.servers[i].address;
        if let Some(e) = e
            && e.is_local()
        {
            self.counters.local.inc();
            tracing::error!(upstream = %name, server = %address, error = %e, "out of local resources (file descriptors or ports) connecting upstream");
            return ProxyError::ProxyOverloaded;
        }
        self.failed(i);
        match e {
            None => {
                self.counters.timeouts.inc();
                tracing::warn!(upstream = %name, server = %address, "upstream timed out");
                ProxyError::GatewayTimeout
            }
            Some(PoolError::TryTimeout) => {
                self.counters.timeouts.inc();
                self.servers[i].pool.discard_h2();
                tracing::warn!(upstream = %name, server = %address, "upstream try timed out (try_timeout)");
                ProxyError::GatewayTimeout
            }
            Some(e @ PoolError::Connect(_)) if e.is_timeout() => {
                self.counters.timeouts.inc();
                tracing::warn!(upstream = %name, server = %address, "upstream connect timed out");
                ProxyError::GatewayTimeout
            }
            Some(e @ PoolError::Connect(_)) => {
                self.counters.connect_errors.inc();
                tracing::warn!(upstream = %name, server = %address, error = %e, "upstream connect failed");
                ProxyError::BadGateway
            }
            Some(e) => {
                self.counters.resets.inc();
                tracing::warn!(upstream = %name, server = %address, error = %e, "upstream request failed");
                ProxyError::BadGateway
            }
        }
    }

    /// Counts a request whose body failed on the client's side and names
    /// its answer.
    pub(super) fn client_error(&self, failure: BodyFailure) -> ProxyError {
        match failure {
            BodyFailure::TooLarge => {
                self.counters.too_large.inc();
                ProxyError::PayloadTooLarge
            }
            BodyFailure::Malformed => {
                self.counters.bad_bodies.inc();
                ProxyError::BadRequest("The request body is malformed or was cut short.".into())
            }
            BodyFailure::Timeout => {
                self.counters.body_timeouts.inc();
                ProxyError::RequestTimeout
            }
        }
    }
}

/// Whether a response of the server's own counts against it (passive
/// health): 502, 503 and 504.
pub(super) fn is_server_failure(status: http::StatusCode) -> bool {
    matches!(status.as_u16(), 502..=504)
}
