//! tollgate: a rate-limiting reverse proxy.
//!
//! Every request is matched against hot-reloaded TOML rules, counted in a
//! store (this process's memory, or Redis shared by every instance), and
//! either forwarded to its upstream with `X-RateLimit-*` headers or answered
//! `429 Too Many Requests` with `Retry-After`.
//!
//! # Map of the modules
//!
//! A request flows top to bottom:
//!
//! | module | responsibility |
//! |---|---|
//! | [`server`] | listeners, connection limits, graceful shutdown |
//! | [`connection`] | one client connection: hyper over [`idle::IdleIo`], its requests handed to the proxy, the limits on its life |
//! | [`drain`] | graceful shutdown's signal to each connection, polled only once it is sent, and a connection's own (`max_requests_per_connection`, `max_connection_age`) |
//! | [`tls`] | TLS on the proxy listener: certificates chosen by SNI, re-read when their files change; optional or required client certificates, keyed by their common name |
//! | [`handshake`] | a TLS connection's first byte: its handshake, or plain HTTP answered 400 |
//! | [`redirect`] | `listen.http_redirect`: a plain-HTTP listener answering 308 to the `https://` URL |
//! | [`idle`] | closes connections with no request in flight for `listen.idle_timeout`, and clients that read nothing for `listen.send_timeout` |
//! | [`send_budget`] | at most 128 KiB of response bodies held per client connection, whatever its HTTP/2 streams |
//! | [`normalize`] | one spelling per request: canonical path, host, method and header names, or 400 |
//! | [`proxy`] | the request path in phases over one per-request context: admit (spelling, route, limits, client, identity), decide, reject or forward, settle, and one log step |
//! | [`decide`] | the `Decider`, the one place a request's facts become verdicts: deny list, keys and costs, one store round, `on_error`, per-rule metrics and reports; used by the proxy, `decision` and `envoy_rls` |
//! | [`upstream`] | one upstream's servers and a request's tries on them: servers in service (`eject_after`, `max_ejected_percent`, panic mode, backups, `max_inflight`), retries within one deadline and a budget, what each failure is answered with |
//! | [`forward`] | hop-by-hop and `X-Forwarded-*` headers, request bodies (read ahead up to `buffer_body` and the connection's `connection_body_buffer`, `max_body`, `body_read_timeout`) |
//! | [`tunnel`] | WebSocket and other upgrades: after the upstream's 101, bytes copied both ways; at shutdown's end a WebSocket close frame, 1001 |
//! | [`held`] | a request's concurrency slots, held until its response body ends or its client goes away |
//! | [`settle`] | `cost_response_header`: the reserved cost corrected to the real one from the response's header or trailers |
//! | [`balance`] | which of the candidate servers a request goes to: smooth weighted round robin, least request, weighted rendezvous hash |
//! | [`health`] | one server's health: out after `eject_after` failures in a row for a doubling backoff, active health checks |
//! | [`pool`] | keep-alive connections to one upstream server, reused request after request; a request the server closed a reused connection on is sent once more on a new one |
//! | [`client`] | who the client is: trusted proxies, `X-Forwarded-For`, IPv6 prefixes |
//! | [`identity`] | verified user identity from a JWT (`[client] jwt`) |
//! | [`rules`] | the compiled rule set: which rules match, the bucket key and limits (overrides, tiers) of each |
//! | [`store`] | the [`store::Store`] trait; [`store::memory`] keeps counters in this process, [`store::redis`] in a shared Redis (Cluster) |
//! | [`limiter`] | the six algorithms' arithmetic, pure, time injected |
//! | [`calendar`] | `calendar` rules: where the current day, week or month starts in the rule's time zone |
//! | [`headers`] | `X-RateLimit-*`, `RateLimit-Policy`, `RateLimit`, `Retry-After` |
//! | [`error`] | every status tollgate answers itself, with its JSON body |
//! | [`request_id`] | `X-Request-Id`: kept from a trusted proxy or generated, sent upstream and in every answer |
//! | [`via`] | the `Via` hop tollgate adds to forwarded requests and responses |
//! | [`access_log`] | one JSON line per request, written off the request path by a thread behind a bounded queue, never a torn line |
//!
//! Around it:
//!
//! | module | responsibility |
//! |---|---|
//! | [`config`] | the only code that reads files: main config and rules, validated with file:line:column errors |
//! | [`reload`] | watch the rules, debounce, validate, swap; keep the old rules on error |
//! | [`admin`] | `/metrics`, `/healthz`, `/readyz`, `/rules`, `/config`, `/top` |
//! | [`decision`] | `[listen] decision`: `POST /v1/check`, the proxy's decision for services not behind it (key parts parsed into a rule's key, then [`decide::Decider::decide_one`], shared with `envoy_rls`) |
//! | [`envoy_rls`] | `[listen] envoy_rls`: Envoy's `ShouldRateLimit` over gRPC, descriptors mapped to rules by `[[envoy]]` ([`config::EnvoyMapping`]); tonic's generated service on hyper's HTTP/2 server |
//! | [`metrics`] | Prometheus metrics on an explicit registry |
//! | [`summary`] | a periodic `info` log line: requests allowed and limited since the last one |
//! | [`top`] | the heaviest keys of each rule (`/top`, `tollgate top`) in fixed-memory sketches |
//! | [`clock`] | wall-clock time, or a manual clock for tests |
//! | [`cli`] | the `tollgate` command line: run, `check`, `explain`, `top` |
//! | [`process`] | what the binaries share: the async runtime, logging, the shutdown signals (SIGTERM: lame duck first; SIGINT: drain at once), SIGHUP (reload) and SIGUSR1 (reopen the access log) |
//! | [`floor`] | `tollgate-floor`: the same server setup and upstream pool with nothing between them, a bench target |

#![forbid(unsafe_code)]

pub mod access_log;
pub mod admin;
pub mod balance;
pub mod calendar;
pub mod cli;
pub mod client;
pub mod clock;
pub mod config;
pub mod connection;
pub mod decide;
pub mod decision;
pub mod drain;
pub mod envoy_rls;
pub mod error;
pub mod floor;
pub mod forward;
pub mod handshake;
pub mod headers;
pub mod health;
pub mod held;
pub mod identity;
pub mod idle;
pub mod limiter;
pub mod metrics;
pub mod normalize;
pub mod pool;
pub mod process;
pub mod proxy;
pub mod redirect;
pub mod reload;
pub mod request_id;
pub mod rules;
pub mod send_budget;
pub mod server;
pub mod settle;
pub mod store;
pub mod summary;
pub mod tls;
pub mod top;
pub mod tunnel;
pub mod upstream;
pub mod via;
