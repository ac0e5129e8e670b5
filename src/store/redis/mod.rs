//! The Redis store: counters shared by every tollgate instance, in a single
//! Redis, a Redis Cluster or behind Sentinel, through fred.
//!
//! | file | responsibility |
//! |---|---|
//! | `mod.rs` | [`RedisStore`]: start-up, the [`Store`] methods, shutdown |
//! | `check.rs` | one request's checks: cache, leases, script calls, refunds of a rejected request |
//! | `batch.rs` | the checks of concurrent requests to one node, in one call |
//! | `refund.rs` | giving quota back to Redis in the background |
//! | `blocks.rs` | the penalty box outside the request path: blocks, lifts, the registry that lists it |
//! | `slots.rs` | concurrency slots held here: renewed while their requests run, given back when they end |
//! | `probe.rs` | the probe that takes a node back, and the survey of every node |
//! | `shared.rs` | what the request path and the store's tasks share ([`Shared`]), whose methods the files above write |
//! | `queues.rs` | the queues of checks waiting for a call, per node and algorithm |
//! | `registry.rs` | the concurrency slots held here, by request id |
//! | `lease/` | quota leased to this instance |
//! | `cache.rs` | the local over-limit cache |
//! | `connection.rs` | fred's pool and its settings, TLS, connection error logs |
//! | `health.rs` | each node up or down |
//! | `call.rs` | one script call (a batch of checks) on the node owning its first key |
//! | `scripts.rs` | the Lua scripts, their keys, arguments and replies |
//! | `ids.rs` | request ids, distinct across instances |
//!
//! Each file imports only from those below it in this table.
//!
//! # One check
//!
//! Each check runs the `decide` function of its algorithm's Lua script
//! (`src/store/lua/<algorithm>.lua`) on one key, deciding and counting
//! atomically on the server with the server's clock (`TIME`), so instances
//! with skewed clocks agree and no read-then-write race exists between them.
//! One call decides a batch of checks (see [`batch`]): those of concurrent
//! requests bound for the same node and algorithm. The code is a Redis
//! function (`FCALL`), loaded on a node that does not know it yet, or on a
//! server without functions a script called by SHA (`EVALSHA`, then `EVAL`
//! on a node that answers `NOSCRIPT`); see `call`.
//!
//! # Bounded, never re-sent
//!
//! Every call carries fred's own timeout set to what is left of the store
//! timeout, not just an outer `tokio::time::timeout`: fred marks a timed-out
//! command so that its router drops it instead of writing it once the
//! connection is back (a queue of stale checks replayed after an outage
//! would count requests that were long decided). `max_command_attempts` is
//! 1: after a dropped connection fred would otherwise re-send in-flight
//! scripts, and a script that ran before the drop would count twice. The
//! one re-send done here is after a cluster redirection (`MOVED`, `ASK`),
//! which fred hands back unfollowed (`max_redirections` is 0) and which
//! proves the script did not run; during a slot migration it is repeated
//! until the migration ends or the timeout. A call lost with its
//! connection is not sent again: a consume then stays counted (fewer
//! admitted), a refund is not made (the same). Every call that takes back
//! (a refund, a settle, a lease given back or settled) carries an undo id
//! anyway, and the script applies an id once (see `applied_before` in
//! batch.lua), so that no unit is given back twice however a call comes to
//! reach Redis twice. The backlog of lease give-backs (see `refund`) holds
//! only calls never sent.
//!
//! fred's connection task is started again whenever it ends on an error
//! (see `connection::keep_connected`): one routing error must not leave
//! tollgate without Redis until it restarts.
//!
//! # Several rules in one request
//!
//! The checks of one request are queued at once and go out in the next
//! calls to their nodes: one round trip for all rules, whatever nodes their
//! keys live on. Each rule's key has its own hash tag and the rules of one
//! request are not one transaction, so "a rejected request consumes no quota" is kept
//! by consume-and-refund rather than by one transaction: every script
//! counts the request if its own rule admits it, and when another enforced
//! rule rejects the request, the rules that counted it get a refund call
//! right after (in the background, so the 429 is not delayed). The trade-off:
//! for about one round trip, a rejected request holds quota it will give
//! back, so a concurrent request may be rejected that a single transaction
//! would have admitted. The error is always towards rejecting, never towards
//! admitting more than the limit. Check-then-commit (peek every rule, then
//! consume) would cost every multi-rule request a second round trip and
//! still race between the two. A request with one rule (the common case)
//! is decided exactly by one check.
//!
//! # When Redis fails
//!
//! See [`health`]: a failed check returns a [`StoreError`] that the proxy
//! maps to the rule's `on_error` policy; `local` checks this process's
//! [`MemoryStore`] with the same rules ([`RedisStore::check_local`]). After a few
//! consecutive failures of one node the store stops asking that node for
//! its keys (and only its keys) until a probe sees it answer again.
//!
//! # Concurrency slots
//!
//! See [`slots`]: a concurrency check takes a slot named by a request id
//! that expires `slot_ttl` after it was taken; this instance renews the
//! slots of its requests in flight and removes each when its request ends,
//! so a crashed instance's slots stop counting within one TTL. Slots are
//! never leased nor answered from the over-limit cache.
//!
//! # The local over-limit cache
//!
//! See [`cache`]: a key Redis rejected is answered 429 here until its
//! retry-after moment, without a round trip.

mod batch;
mod blocks;
mod cache;
mod call;
mod check;
mod connection;
mod health;
mod ids;
mod lease;
mod probe;
mod queues;
mod refund;
mod registry;
mod scripts;
mod shared;
mod slots;

use std::collections::VecDeque;
use std::sync::Arc;
use std::time::{Duration, Instant};

use fred::clients::Client;
use fred::interfaces::{ClientLike, EventInterface};
use parking_lot::Mutex;
use tokio::task::JoinHandle;

use crate::config::StoreConfig;
use crate::limiter::clock::SharedClock;
use crate::limiter::{Algorithm, Nanos, Verdict};
use crate::obs::metrics::Metrics;
use crate::store::{Answer, Check, MemoryStore, Mode, Store, StoreError, memory};

pub use blocks::MAX_LISTED;
use connection::{START_WAIT, keep_connected, log_errors, redact};
use ids::RequestIds;
pub use scripts::{Outcome, Reply, fresh_bucket, parse_batch, redis_key, source as script_source, suffix};
use scripts::{Scripts, nanos};
use shared::Shared;
pub use slots::Slots;

/// How long shutdown waits for an unreachable Redis to take back the
/// leased units.
const CLOSE_WAIT: Duration = Duration::from_secs(5);

/// The Redis [`Store`].
pub struct RedisStore {
    shared: Arc<Shared>,
    /// fred's connection tasks and the health probe, stopped on drop.
    tasks: Vec<JoinHandle<()>>,
}

/// [`RedisStore::settle`] from a response body's trailers.
pub struct Settler(Arc<Shared>);

impl Settler {
    pub fn settle(&self, check: &Check<'_>, delta: i64, since: Duration) {
        self.0.settle(check, delta, since);
    }

    /// [`RedisStore::settle_local`].
    pub fn settle_local(&self, check: &Check<'_>, delta: i64, since: Duration) {
        self.0.local.settle(check, delta, nanos(since));
    }
}

impl RedisStore {
    /// Builds the client from `config.url`, starts connecting, and waits up
    /// to a second for the first connection. An unreachable Redis does not
    /// fail the start: the store begins degraded and connects in the
    /// background (an operator restarting tollgate during a Redis outage
    /// gets a proxy that serves by policy, not one that refuses to start).
    /// A URL fred cannot parse does fail it.
    pub async fn connect(
        config: &StoreConfig,
        clock: SharedClock,
        metrics: Arc<Metrics>,
    ) -> Result<RedisStore, String> {
        let url = config.url.as_deref().ok_or("store.backend = \"redis\" needs store.url")?;
        let (pool, clustered, node) = connection::pool(config, url)?;
        let timeout = config.timeout;

        // Subscribed before connecting, so the first failure is seen too.
        let error_logs: Vec<JoinHandle<()>> =
            pool.clients().iter().map(|c| tokio::spawn(log_errors(c.error_rx()))).collect();
        let restarts = &metrics.redis_connection_restarts_total;
        let mut tasks: Vec<JoinHandle<()>> =
            pool.clients().iter().map(|c| tokio::spawn(keep_connected(c.clone(), restarts.clone()))).collect();

        tasks.extend(error_logs);
        let local = MemoryStore::new(clock).bounded(config.max_keys, Some(metrics.store_evictions_total.clone()));
        let health = health::Health::new(&metrics);
        // The single server, or the whole cluster until its layout is known.
        let first = health.node(&node, None);
        let shared = Arc::new(Shared {
            pool,
            clustered,
            key_prefix: config.key_prefix.clone(),
            timeout,
            scripts: Scripts::new(clustered),
            batcher: queues::Batcher::new(clustered, first.clone()),
            cache: cache::OverLimitCache::new(),
            leases: lease::Leases::new(config.lease_percent, config.lease_idle, config.lease_lifetime),
            backlog: Mutex::new(VecDeque::new()),
            local,
            health,
            metrics,
            ids: RequestIds::new(),
            slots: registry::Registry::new(),
        });

        let ready = tokio::time::timeout(START_WAIT, shared.pool.wait_for_connect()).await;
        let ready = match ready {
            Ok(Ok(())) => shared.probe().await,
            Ok(Err(e)) => Err(StoreError::Unavailable(e.details().to_string())),
            Err(_) => Err(StoreError::Unavailable(format!("no connection within {START_WAIT:?}"))),
        };
        match ready {
            Ok(()) => {
                tracing::info!(url = %redact(url), clustered, "connected to redis");
                if clustered {
                    shared.read_routes();
                }
            }
            Err(e) => shared.health.degrade(&first, &format!("at start-up: {e}")),
        }
        tasks.push(tokio::spawn(shared.clone().probe_loop()));
        tasks.push(tokio::spawn(shared.clone().slots_loop()));
        if shared.leases.enabled() {
            let every = (config.lease_idle / 4).clamp(Duration::from_millis(50), Duration::from_secs(1));
            tasks.push(tokio::spawn(shared.clone().lease_loop(every)));
        }
        Ok(RedisStore { shared, tasks })
    }

    /// The clock of the local fallback (Redis itself counts on the server's
    /// clock).
    pub fn clock(&self) -> &dyn crate::limiter::clock::Clock {
        self.shared.local.clock()
    }

    /// Decides `checks` in this process's memory, with the same rules: the
    /// `on_error = "local"` fallback while Redis cannot answer.
    pub fn check_local(&self, checks: &[Check<'_>], mode: Mode) -> Vec<Verdict> {
        self.shared.local.check_now(checks, mode)
    }

    /// [`RedisStore::check_local`] for a request that holds the
    /// concurrency slots it takes until it ends.
    pub fn check_local_holding(&self, checks: &[Check<'_>], mode: Mode) -> (Vec<Verdict>, Option<memory::Slots>) {
        self.shared.local.check_holding(checks, mode)
    }

    /// [`Store::check`] for a request that holds the concurrency slots it
    /// takes until it ends (see [`Slots`]).
    pub async fn check_holding(&self, checks: &[Check<'_>], mode: Mode) -> (Vec<Answer>, Option<Slots>) {
        self.shared.check_holding(checks, mode).await
    }

    /// Corrects a check's reservation in Redis by `delta` units, in the
    /// background (see [`crate::store::AnyStore::settle`]).
    pub fn settle(&self, check: &Check<'_>, delta: i64, since: Duration) {
        self.shared.settle(check, delta, since);
    }

    /// Corrects a reservation the `on_error = "local"` fallback counted,
    /// in the fallback's memory where it was counted: Redis never counted
    /// it, so a refund there would let the key pass its limit.
    pub fn settle_local(&self, check: &Check<'_>, delta: i64, since: Duration) {
        self.shared.local.settle(check, delta, nanos(since));
    }

    /// A handle that settles after the request path has returned.
    pub fn settler(&self) -> Settler {
        Settler(self.shared.clone())
    }

    /// Whether the checks of some keys currently bypass Redis (a node is
    /// down).
    pub fn is_degraded(&self) -> bool {
        self.shared.health.is_degraded()
    }

    /// The nodes that answer and those that do not (down, or not answering
    /// a probe now, with why), by name: for `/healthz/store` and `/readyz`.
    pub async fn survey(&self) -> (Vec<String>, Vec<(String, StoreError)>) {
        self.shared.survey().await
    }

    /// Drops idle keys of the local fallback and expired over-limit cache
    /// entries; the server calls it periodically.
    pub fn sweep(&self) {
        self.shared.local.sweep();
        self.shared.cache.sweep(Instant::now());
    }

    /// Gives every concurrency slot and lease held here back to Redis
    /// (bounded by the store timeout): called once the server has drained,
    /// so that a restart does not hold quota away from the other instances.
    ///
    /// While Redis does not answer, waits up to [`CLOSE_WAIT`] for it to
    /// come back; what still cannot go back then is logged and stays
    /// counted in Redis until its window ends or its bucket refills.
    pub async fn close(&self) {
        let shared = &self.shared;
        shared.release_all_slots().await;
        let unused = shared.leases.drain(Instant::now());
        shared.return_units(unused).await;
        shared.flush_backlog().await;
        let started = Instant::now();
        while shared.backlog_len() > 0 && started.elapsed() < CLOSE_WAIT {
            tokio::time::sleep(health::PROBE_EVERY).await;
            shared.probe_down_nodes().await;
            // Sent only once Redis answers: a give-back sent to a node that
            // does not answer is dropped, not kept (see `refund`).
            if shared.probe().await.is_ok() {
                shared.flush_backlog().await;
            }
        }
        let left = shared.backlog_len();
        if left > 0 {
            tracing::warn!(leases = left, "redis did not come back: leased units stay counted until they expire there");
        }
    }

    /// Puts `key` (a bucket key of the rule whose keys start with
    /// `rule_prefix` and whose algorithm is `algorithm`) in the penalty box
    /// for `ttl`: refused by its rule on every instance until then (see
    /// `blocks`).
    pub async fn block(
        &self,
        rule_prefix: &str,
        key: &str,
        algorithm: Algorithm,
        ttl: Duration,
        reason: &str,
    ) -> Result<(), StoreError> {
        self.shared.block(rule_prefix, key, algorithm, ttl, reason).await
    }

    /// Takes `key` out of the penalty box; whether it was in.
    pub async fn unblock(&self, rule_prefix: &str, key: &str, algorithm: Algorithm) -> Result<bool, StoreError> {
        self.shared.unblock(rule_prefix, key, algorithm).await
    }

    /// The keys of a rule in the penalty box, at most `max`, and how many
    /// its registry holds.
    pub async fn boxed(
        &self,
        rule_prefix: &str,
        algorithm: Algorithm,
        max: usize,
    ) -> Result<(Vec<crate::store::penalty_box::Listed>, usize), StoreError> {
        self.shared.boxed(rule_prefix, algorithm, max).await
    }

    /// The fred client, for tests and tools that inspect Redis directly.
    pub fn client(&self) -> &Client {
        self.shared.pool.next()
    }
}

impl Drop for RedisStore {
    fn drop(&mut self) {
        let clients: Vec<Client> = self.shared.pool.clients().to_vec();
        let tasks = std::mem::take(&mut self.tasks);
        match tokio::runtime::Handle::try_current() {
            // Close the connections politely, then stop the tasks.
            Ok(rt) => {
                rt.spawn(async move {
                    for c in clients {
                        let _ = tokio::time::timeout(Duration::from_millis(200), c.quit()).await;
                    }
                    tasks.iter().for_each(JoinHandle::abort);
                });
            }
            Err(_) => tasks.iter().for_each(JoinHandle::abort),
        }
    }
}

impl Store for RedisStore {
    /// A concurrency slot taken here is given back at once: no request
    /// holds it (see [`RedisStore::check_holding`]).
    async fn check(&self, checks: &[Check<'_>], mode: Mode) -> Vec<Answer> {
        self.shared.check_holding(checks, mode).await.0
    }

    /// Every node answers (see [`RedisStore::survey`] for which do not).
    async fn ping(&self) -> Result<(), StoreError> {
        let (_, down) = self.shared.survey().await;
        match down.as_slice() {
            [] => Ok(()),
            [(node, e)] => Err(StoreError::Unavailable(format!("redis node {node}: {e}"))),
            [(node, e), rest @ ..] => {
                Err(StoreError::Unavailable(format!("redis node {node}: {e} (and {} more)", rest.len())))
            }
        }
    }

    fn backend(&self) -> &'static str {
        "redis"
    }

    fn set_idle_horizon(&self, horizon: Nanos) {
        self.shared.local.set_idle_horizon(horizon);
    }
}
