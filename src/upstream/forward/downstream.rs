//! What forwarding knows of the client side: the client, the route's
//! limits on its body, and the budget its connection's requests share for
//! bodies read ahead.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use http::header::HeaderValue;

use crate::wire::client::Peer;

/// What [`crate::upstream::UpstreamClient::forward`] needs to know about
/// the client side.
pub struct Downstream<'a> {
    /// The socket peer.
    pub peer: &'a Peer,
    /// The client's address (after trusted proxies), which `hash_key =
    /// "ip"` hashes.
    pub client_ip: std::net::IpAddr,
    /// The host the client asked for, for `X-Forwarded-Host`.
    pub host: Option<&'a str>,
    /// The `Host` header to send instead of the client's: the host that was
    /// matched, when it came from the request target or was spelled
    /// differently (see [`crate::wire::normalize::host`]).
    pub host_header: Option<HeaderValue>,
    /// The canonical path, when the client spelled it otherwise: the
    /// upstream receives the path the rules matched.
    pub path: Option<String>,
    /// The route's body limit.
    pub max_body: Option<u64>,
    /// The route's `buffer_body`.
    pub buffer_body: u64,
    /// `listen.body_read_timeout`.
    pub body_read_timeout: Duration,
    /// The protocol the client asked to switch to, when tollgate will
    /// tunnel it (see [`crate::upstream::tunnel::requested`]).
    pub upgrade: Option<HeaderValue>,
    /// The client connection's budget for bodies read ahead (HTTP/2
    /// only: an HTTP/1.1 connection has one request at a time).
    pub ahead_budget: Option<AheadBudget>,
    /// Where the body bytes read from the client are counted, for the
    /// access log; `None` when it is off.
    pub bytes_in: Option<Arc<AtomicU64>>,
    /// Where the index of the server the request went to is noted (it
    /// starts at `usize::MAX`: none), for the access log; `None` when it is
    /// off.
    pub chosen: Option<&'a std::sync::atomic::AtomicUsize>,
}

/// What one client connection's requests may hold of their bodies read
/// ahead, together (`[listen] connection_body_buffer`). `buffer_body`
/// bounds one request; an HTTP/2 connection carries up to 100 at once, and
/// without this bound 100 streams each sending just under `buffer_body`
/// would pin 100 times it. Past the budget a request stops reading ahead
/// and is streamed: the rest of its body waits in the client, under HTTP/2
/// flow control.
#[derive(Debug, Clone)]
pub struct AheadBudget(Arc<AtomicU64>);

impl AheadBudget {
    /// The budget whose bytes left are `left` (a connection's, kept with
    /// its peer).
    pub fn shared(left: Arc<AtomicU64>) -> AheadBudget {
        AheadBudget(left)
    }

    /// Takes `n` bytes of the budget, if that many are left.
    pub(super) fn take(&self, n: u64) -> bool {
        self.0.fetch_update(Ordering::Relaxed, Ordering::Relaxed, |left| left.checked_sub(n)).is_ok()
    }

    pub(super) fn give(&self, n: u64) {
        if n > 0 {
            self.0.fetch_add(n, Ordering::Relaxed);
        }
    }
}
