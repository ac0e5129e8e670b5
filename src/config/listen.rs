//! `[listen]`: the listeners' addresses, their limits on requests and on
//! how long one client connection lives, and how they stop.

use std::net::SocketAddr;
use std::time::Duration;

use super::pem::{Certificate, ClientAuth};
use super::raw::RawListen;
use super::routes::MAX_BUFFER_BODY;
use super::validate::{Validator, parse_duration, parse_size};
use crate::wire::normalize::Normalization;

/// `[listen]`
#[derive(Debug, Clone)]
pub struct Listen {
    pub proxy: SocketAddr,
    pub admin: SocketAddr,
    /// How long a client may take to send its request headers.
    pub header_read_timeout: Duration,
    /// How long an idle keep-alive connection stays open.
    pub idle_timeout: Duration,
    /// Connections served at once; further ones wait in the kernel backlog.
    pub max_connections: usize,
    /// How long shutdown waits for in-flight requests.
    pub drain_timeout: Duration,
    /// Largest request header section accepted (431 above it).
    pub max_header_bytes: usize,
    /// Longest request target (path and query) accepted (414 above it).
    pub max_uri_bytes: usize,
    /// Path, header-name and host normalisation.
    pub normalization: Normalization,
    /// Longest wait for the next piece of a request body (408 after it).
    pub body_read_timeout: Duration,
    /// The most request body bytes one client connection's requests hold
    /// read ahead together (`buffer_body` is per request; an HTTP/2
    /// connection carries many).
    pub connection_body_buffer: u64,
    /// A client that takes none of the response's bytes for this long is
    /// disconnected.
    pub send_timeout: Duration,
    /// A WebSocket (or other upgraded) tunnel that moves no byte for this
    /// long is closed.
    pub tunnel_idle_timeout: Duration,
    /// Requests one client connection may carry; its last is answered with
    /// `Connection: close` (HTTP/1.1) or followed by a GOAWAY (HTTP/2).
    pub max_requests_per_connection: usize,
    /// How long one client connection may live before it is closed the
    /// same graceful way; none when not set.
    pub max_connection_age: Option<Duration>,
    /// On SIGTERM, how long the listeners keep serving (with `/readyz`
    /// answering 503) before they stop accepting and drain.
    pub shutdown_delay: Duration,
    /// `[[listen.tls]]`, read and checked: when not empty the proxy
    /// listener speaks TLS only, and the first is the default certificate.
    pub tls: Vec<Certificate>,
    /// A plain-HTTP listener answering 308 to the `https://` URL.
    pub http_redirect: Option<SocketAddr>,
    /// The public HTTPS port the redirects name (left out when 443): the
    /// proxy listener's own port is often not the one clients reach, behind
    /// a load balancer or a port mapping.
    pub redirect_port: u16,
    /// `client_ca_file` and `client_auth`: client certificates asked for
    /// in the TLS handshake; none when `client_ca_file` is not set.
    pub client_auth: Option<ClientAuth>,
    /// `[listen] decision`: the decision API's listener (`POST /v1/check`,
    /// see [`crate::api::decision`]); none when not set.
    pub decision: Option<SocketAddr>,
    /// `[listen] envoy_rls`: Envoy's rate limit service over gRPC; none
    /// when not set.
    pub envoy_rls: Option<SocketAddr>,
}

/// `connection_body_buffer` when not set: four requests' default
/// `buffer_body` at once.
const DEFAULT_CONNECTION_BODY_BUFFER: u64 = 4 * 1024 * 1024;

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
    /// `[listen]`.
    pub(super) fn listen(&mut self, listen: &RawListen) -> Listen {
        let default_proxy = SocketAddr::from(([0, 0, 0, 0], 8080));
        let proxy = listen.proxy.as_ref().map_or(Some(default_proxy), |v| self.socket_addr(v, "listen.proxy"));
        let default_admin = SocketAddr::from(([127, 0, 0, 1], 9090));
        let admin = listen.admin.as_ref().map_or(Some(default_admin), |v| self.socket_addr(v, "listen.admin"));
        let (max_connections, max_header_bytes, max_uri_bytes) = self.request_limits(listen);
        let (tls, http_redirect, redirect_port) = self.listen_tls(listen);
        let client_auth = self.client_auth(listen);
        let decision = listen.decision.as_ref().and_then(|v| self.socket_addr(v, "listen.decision"));
        let envoy_rls = listen.envoy_rls.as_ref().and_then(|v| self.socket_addr(v, "listen.envoy_rls"));
        let (max_requests_per_connection, max_connection_age) = self.connection_lifetime(listen);
        let shutdown_delay = self.shutdown_delay(listen);
        Listen {
            shutdown_delay,
            max_requests_per_connection,
            max_connection_age,
            tls,
            http_redirect,
            redirect_port,
            client_auth,
            decision,
            envoy_rls,
            max_uri_bytes,
            proxy: proxy.unwrap_or(default_proxy),
            admin: admin.unwrap_or(default_admin),
            header_read_timeout: self.opt_duration(
                listen.header_read_timeout.as_ref(),
                "listen.header_read_timeout",
                Duration::from_secs(10),
            ),
            idle_timeout: self.opt_duration(
                listen.idle_timeout.as_ref(),
                "listen.idle_timeout",
                Duration::from_secs(60),
            ),
            max_connections,
            drain_timeout: self.opt_duration(
                listen.drain_timeout.as_ref(),
                "listen.drain_timeout",
                Duration::from_secs(30),
            ),
            max_header_bytes,
            normalization: Normalization {
                merge_slashes: listen.merge_slashes.unwrap_or(true),
                encoded_slashes: listen.encoded_slashes.unwrap_or_default(),
                underscores_in_headers: listen.underscores_in_headers.unwrap_or(false),
            },
            body_read_timeout: self.opt_duration(
                listen.body_read_timeout.as_ref(),
                "listen.body_read_timeout",
                Duration::from_secs(60),
            ),
            connection_body_buffer: match listen.connection_body_buffer.as_ref().map(|s| (s, parse_size(s.get_ref()))) {
                None => DEFAULT_CONNECTION_BODY_BUFFER,
                Some((_, Some(n))) if n <= MAX_BUFFER_BODY * 16 => n,
                Some((s, _)) => {
                    self.error(s.span(), "listen.connection_body_buffer must be a size from 0 to 1GiB: a whole number of bytes, or a string such as \"4MiB\"");
                    DEFAULT_CONNECTION_BODY_BUFFER
                }
            },
            send_timeout: self.opt_duration(
                listen.send_timeout.as_ref(),
                "listen.send_timeout",
                Duration::from_secs(60),
            ),
            tunnel_idle_timeout: self.opt_duration(
                listen.tunnel_idle_timeout.as_ref(),
                "listen.tunnel_idle_timeout",
                Duration::from_secs(3600),
            ),
        }
    }

    /// `max_connections`, `max_header_bytes` and `max_uri_bytes`.
    fn request_limits(&mut self, listen: &RawListen) -> (usize, usize, usize) {
        let max_connections = match &listen.max_connections {
            Some(n) if *n.get_ref() < 1 => {
                self.error(n.span(), "listen.max_connections must be at least 1");
                1
            }
            Some(n) => *n.get_ref() as usize,
            None => 10_000,
        };
        let max_header_bytes = match &listen.max_header_bytes {
            Some(n) if *n.get_ref() < 1024 => {
                self.error(n.span(), "listen.max_header_bytes must be at least 1024");
                1024
            }
            Some(n) => *n.get_ref() as usize,
            None => 64 * 1024,
        };
        let max_uri_bytes = match &listen.max_uri_bytes {
            Some(n) if !(256..=65_000).contains(n.get_ref()) => {
                self.error(n.span(), "listen.max_uri_bytes must be between 256 and 65000");
                16 * 1024
            }
            Some(n) => *n.get_ref() as usize,
            None => 16 * 1024,
        };
        (max_connections, max_header_bytes, max_uri_bytes)
    }

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
