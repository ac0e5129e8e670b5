//! `[listen]`'s limits on how long one client connection lives, and on how
//! the listeners stop, checked here to keep `mod.rs` to the table's older
//! keys.

use std::time::Duration;

use super::raw::RawListen;
use super::{Validator, parse_duration};

/// `max_requests_per_connection` when not set: nginx's
/// `keepalive_requests` default since 1.19.10, high enough that no client
/// notices, low enough that a connection's memory is given back now and
/// then and a load balancer's shares move.
const MAX_REQUESTS_PER_CONNECTION: usize = 10_000;

/// `shutdown_delay` when not set: long enough for a load balancer probing
/// `/readyz` every second or two, and for kube-proxy to drop the endpoint,
/// before new connections are refused.
const SHUTDOWN_DELAY: Duration = Duration::from_secs(5);

impl Validator<'_> {
    /// `max_requests_per_connection` (at least 1) and `max_connection_age`
    /// (none when not set).
    pub(super) fn connection_lifetime(&mut self, listen: &RawListen) -> (usize, Option<Duration>) {
        let max_requests = match &listen.max_requests_per_connection {
            Some(n) if *n.get_ref() < 1 => {
                self.error(n.span(), "listen.max_requests_per_connection must be at least 1");
                MAX_REQUESTS_PER_CONNECTION
            }
            Some(n) => usize::try_from(*n.get_ref()).unwrap_or(usize::MAX),
            None => MAX_REQUESTS_PER_CONNECTION,
        };
        let max_age = listen.max_connection_age.as_ref().and_then(|v| match parse_duration(v.get_ref()) {
            Ok(d) if d.is_zero() => {
                self.error(
                    v.span(),
                    "listen.max_connection_age must be longer than zero; leave it out for no age limit",
                );
                None
            }
            Ok(d) => Some(d),
            // The usual message for a value that is no duration.
            Err(_) => self.duration(v, "listen.max_connection_age"),
        });
        (max_requests, max_age)
    }

    /// `shutdown_delay`: zero is allowed (stop accepting at once).
    pub(super) fn shutdown_delay(&mut self, listen: &RawListen) -> Duration {
        let Some(v) = &listen.shutdown_delay else { return SHUTDOWN_DELAY };
        match parse_duration(v.get_ref()) {
            Ok(d) => d,
            Err(e) => {
                self.error(
                    v.span(),
                    format!(
                        "listen.shutdown_delay {:?} is not a duration ({e}); write e.g. \"0s\", \"250ms\", \"5s\", \"1m\"",
                        v.get_ref()
                    ),
                );
                SHUTDOWN_DELAY
            }
        }
    }
}
