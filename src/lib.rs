//! tollgate: a rate-limiting reverse proxy.
//!
//! Every request is matched against hot-reloaded TOML rules, counted in a
//! store (this process's memory, or Redis shared by every instance), and
//! either forwarded to its upstream with `X-RateLimit-*` headers or answered
//! `429 Too Many Requests` with `Retry-After`.
//!
//! # Layers
//!
//! `src/` holds one folder per layer. A module may import only from its own
//! row and the rows below it, and no two files may import each other,
//! directly or around a circle. `scripts/layers` reads this table (the number
//! and the linked modules of each row) and reports every import that breaks
//! it, as file:line.
//!
//! | layer | modules | what the layer holds |
//! |---|---|---|
//! | 12 | [`cli`] | the command line (run, `check`, `explain`, `top`, `block`, `unblock`) and the `tollgate-floor` bench binary's setup |
//! | 11 | [`edge`] | listeners and the composition root, one client connection's life (TLS, timeouts, send budget, drain), signals |
//! | 10 | [`ops`] | operating a running proxy: the admin listener, hot reload |
//! | 9 | [`proxy`] | the request path: route, decide, forward or reject, settle |
//! | 8 | [`api`] | the decision API (`POST /v1/check`) and Envoy's rate limit service |
//! | 7 | [`limit`] | the compiled rules: which match, their keys, costs and limits; the heaviest keys; the `Decider`: one store round, verdicts |
//! | 6 | [`store`] | where counters live: this process's memory, or Redis (Cluster) |
//! | 5 | [`upstream`] | talking to upstream servers: balancing, health, pools, bodies, tunnels |
//! | 4 | [`obs`] | what tollgate tells operators: metrics, the access log, the summary line, traces |
//! | 3 | [`config`] | reading and validating the configuration and rules; PEM certificates and keys; the file watcher |
//! | 2 | [`wire`] | the HTTP a request arrives as and an answer leaves as |
//! | 1 | [`limiter`] | the algorithms' arithmetic, calendar windows and time, pure |
//!
//! # Where a request goes
//!
//! 1. [`edge::server`] accepts the connection (connection limits);
//!    [`edge::handshake`] and [`edge::tls`] do TLS (certificates by SNI,
//!    client certificates); [`edge::connection`] runs hyper over
//!    [`edge::idle`] (idle and send timeouts) with [`edge::send_budget`]
//!    and [`edge::drain`] (graceful shutdown, per-connection limits).
//! 2. [`proxy::Proxy::serve`] takes each request; its `admit` phase
//!    (`proxy/admit.rs`): [`wire::normalize`] gives it one spelling (or
//!    400), the route is chosen, [`wire::client`] says who the client is,
//!    [`wire::identity`] verifies its JWT.
//! 3. [`limit::decide::Decider`] turns the request's facts into verdicts:
//!    the deny list and, per matching rule, the bucket key, cost and limits
//!    (overrides, tiers) from [`limit::rules`]; one round to the [`store`]
//!    ([`store::memory`] or [`store::redis`], the arithmetic in
//!    [`limiter`]) answers every rule, a key in the penalty box refused
//!    there, `on_error` when it fails;
//!    [`limit::top`] counts the heaviest keys. `/v1/check` and Envoy
//!    ([`api::decision`], [`api::envoy_rls`]) ask the same Decider.
//! 4. A rejection is answered (`proxy/respond.rs`) by [`wire::error`] with
//!    the headers of [`wire::headers`] (429 with `Retry-After`, 503, 403);
//!    a gRPC request gets it in gRPC's form ([`wire::grpc`]).
//! 5. An admitted request is forwarded by [`upstream`]: a server chosen by
//!    [`upstream::balance`] among those [`upstream::health`] keeps in
//!    service, headers and body by [`upstream::forward`], a connection from
//!    [`upstream::pool`]; a 101 becomes an [`upstream::tunnel`].
//! 6. The request's concurrency slots stay [`proxy::held`] until its body ends;
//!    [`proxy::settle`] corrects its reserved cost from the response
//!    (`cost_response_header`), or gives it back when the response's status
//!    is not one its rule counts (`count_status`).
//! 7. [`obs::access_log`] writes its line (and hands a sampled request's
//!    span to [`obs::trace`], which also set its `traceparent` on arrival);
//!    [`obs::metrics`] counts it.
//!
//! Around it: [`ops::reload`] swaps in new rules (watching files with
//! [`config::watch`]), [`ops::admin`] serves `/metrics`, `/rules`, `/top`
//! and the health endpoints, and `/blocks` (keys put in or let out of the
//! penalty box), [`obs::summary`] logs a periodic summary.
//!
//! # Modules by layer
//!
//! | module | responsibility |
//! |---|---|
//! | [`cli`] | the `tollgate` command line: run, `check`, `explain`, `top`, `block`/`unblock` (whose client is [`cli::blocks`]) |
//! | [`cli::floor`] | `tollgate-floor`: the same server setup and upstream pool with nothing between them, a bench target |
//! | [`edge::server`] | listeners, connection limits, graceful shutdown: the one place the stack is put together |
//! | [`edge::connection`] | one client connection: hyper over [`edge::idle::IdleIo`], its requests handed to the proxy, the limits on its life |
//! | [`edge::drain`] | graceful shutdown's signal to each connection, polled only once it is sent, and a connection's own (`max_requests_per_connection`, `max_connection_age`) |
//! | [`edge::tls`] | TLS on the proxy listener: certificates chosen by SNI, re-read when their files change; optional or required client certificates, keyed by their common name |
//! | [`edge::handshake`] | a TLS connection's first byte: its handshake, or plain HTTP answered 400 |
//! | [`edge::redirect`] | `listen.http_redirect`: a plain-HTTP listener answering 308 to the `https://` URL |
//! | [`edge::idle`] | closes connections with no request in flight for `listen.idle_timeout`, and clients that read nothing for `listen.send_timeout` |
//! | [`edge::send_budget`] | at most 128 KiB of response bodies held per client connection, whatever its HTTP/2 streams |
//! | [`edge::process`] | what the binaries share: the async runtime, logging, the shutdown signals (SIGTERM: lame duck first; SIGINT: drain at once), SIGHUP (reload) and SIGUSR1 (reopen the access log) |
//! | [`ops::admin`] | `/metrics`, `/healthz`, `/readyz`, `/rules`, `/upstreams`, `/config`, `/top`, `/blocks` (blocks and lifts of keys in the penalty box) |
//! | [`ops::dashboard`] | `/`: one self-contained HTML page that reads the admin endpoints every few seconds |
//! | [`ops::reload`] | watch the rules and the main file, debounce, validate, swap; keep the old rules on error |
//! | [`proxy`] | the request path in phases over one per-request context: admit (spelling, route, limits, client, identity), decide, reject or forward, settle, and one log step |
//! | [`proxy::held`] | a request's concurrency slots, held until its response body ends or its client goes away |
//! | [`proxy::settle`] | `cost_response_header`: the reserved cost corrected to the real one from the response's header or trailers, with the store (the arithmetic is in [`limiter`]); `count_status`: given back when the status is not counted |
//! | [`api::decision`] | `[listen] decision`: `POST /v1/check`, the proxy's decision for services not behind it (key parts parsed into a rule's key, then [`limit::decide::Decider::decide_one`], shared with `envoy_rls`) |
//! | [`api::envoy_rls`] | `[listen] envoy_rls`: Envoy's `ShouldRateLimit` over gRPC, descriptors mapped to rules by `[[envoy]]` ([`config::EnvoyMapping`]); tonic's generated service on hyper's HTTP/2 server |
//! | [`limit::rules`] | the compiled rule set: which rules match, the bucket key and limits (overrides, tiers) of each, what each reports to the client |
//! | [`limit::decide`] | the `Decider`, the one place a request's facts become verdicts: deny list, keys and costs, one store round, `on_error`, per-rule metrics and reports; used by the proxy, [`api::decision`] and [`api::envoy_rls`] |
//! | [`limit::path_index`] | which rules and routes can match a request path, by exact path and by prefix directory: a request looks only at those, whatever their number |
//! | [`limit::top`] | the heaviest keys of each rule (`/top`, `tollgate top`, whose client is [`cli::top`]) in fixed-memory sketches |
//! | [`store`] | the [`store::Store`] trait; [`store::memory`] keeps counters in this process, [`store::redis`] in a shared Redis (Cluster) |
//! | [`store::penalty_box`] | keys refused whatever their counters say (a rule's `penalty`, a block through `/blocks`): the memory store's own; Redis keeps them in each bucket's own key |
//! | [`upstream`] | one upstream's servers and a request's tries on them: servers in service (`eject_after`, `max_ejected_percent`, panic mode, backups, `max_inflight`), retries within one deadline and a budget, what each failure is answered with |
//! | [`upstream::forward`] | hop-by-hop and `X-Forwarded-*` headers, request bodies (read ahead up to `buffer_body` and the connection's `connection_body_buffer`, `max_body`, `body_read_timeout`) |
//! | [`upstream::tunnel`] | WebSocket and other upgrades: after the upstream's 101, bytes copied both ways; at shutdown's end a WebSocket close frame, 1001 |
//! | [`upstream::balance`] | which of the candidate servers a request goes to: smooth weighted round robin, least request, weighted rendezvous hash |
//! | [`upstream::health`] | one server's health: out after `eject_after` failures in a row for a doubling backoff, active health checks |
//! | [`upstream::pool`] | keep-alive connections to one upstream server, reused request after request; a request the server closed a reused connection on is sent once more on a new one |
//! | [`obs::metrics`] | Prometheus metrics on an explicit registry |
//! | [`obs::access_log`] | one JSON line per request, written off the request path by a thread behind a bounded queue, never a torn line |
//! | [`obs::summary`] | a periodic `info` log line: requests allowed and limited since the last one |
//! | [`obs::trace`] | `[tracing]`: W3C trace context in and out, sampling, OpenTelemetry spans batched to an OTLP/HTTP collector off the request path |
//! | [`config`] | main config and rules, validated with file:line:column errors; the files tollgate reads ([`config::pem`] certificates and keys, [`config::watch`] the one file watcher) |
//! | [`wire::normalize`] | one spelling per request: canonical path, host, method and header names, or 400 |
//! | [`wire::client`] | who the client is: trusted proxies, `X-Forwarded-For`, IPv6 prefixes |
//! | [`wire::identity`] | verified user identity from a JWT (`[client] jwt`) |
//! | [`wire::headers`] | `X-RateLimit-*`, `RateLimit-Policy`, `RateLimit`, `Retry-After` |
//! | [`wire::error`] | every status tollgate answers itself, with its JSON body |
//! | [`wire::grpc`] | the same answers to gRPC clients: trailers-only, `grpc-status` by one table, `RetryInfo` |
//! | [`wire::request_id`] | `X-Request-Id`: kept from a trusted proxy or generated, sent upstream and in every answer |
//! | [`wire::via`] | the `Via` hop tollgate adds to forwarded requests and responses |
//! | [`limiter`] | the six algorithms' arithmetic, pure, time injected, and a reservation corrected to its real cost |
//! | [`limiter::shards`] | the one sharded map, locked per shard (every lock is `parking_lot`'s; clippy.toml bans std's) |
//! | [`limiter::calendar`] | `calendar` rules: where the current day, week or month starts in the rule's time zone |
//! | [`limiter::clock`] | wall-clock time, or a manual clock for tests |

// Deny, not forbid: one call has no safe wrapper (`sched_setscheduler`,
// see `config::watch`), and it alone says `allow(unsafe_code)`.
#![deny(unsafe_code)]

pub mod api;
pub mod cli;
pub mod config;
pub mod edge;
pub mod limit;
pub mod limiter;
pub mod obs;
pub mod ops;
pub mod proxy;
pub mod store;
pub mod upstream;
pub mod wire;
