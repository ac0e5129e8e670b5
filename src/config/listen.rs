//! `[listen]`'s limits on how long one client connection lives, checked
//! here to keep `mod.rs` to the table's older keys.

use std::time::Duration;

use super::raw::RawListen;
use super::{Validator, parse_duration};

/// `max_requests_per_connection` when not set: nginx's
/// `keepalive_requests` default since 1.19.10, high enough that no client
/// notices, low enough that a connection's memory is given back now and
/// then and a load balancer's shares move.
const MAX_REQUESTS_PER_CONNECTION: usize = 10_000;

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
}
