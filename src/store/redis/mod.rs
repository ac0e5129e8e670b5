//! The Redis store: counters shared by every tollgate instance, in a single
//! Redis, a Redis Cluster or behind Sentinel, through fred.
//!
//! # One check
//!
//! Each check is one Lua script call (`src/store/lua/<algorithm>.lua`) on
//! one key, deciding and counting atomically on the server with the
//! server's clock (`TIME`), so instances with skewed clocks agree and no
//! read-then-write race exists between them. Scripts are called by SHA
//! (`EVALSHA`); a node that answers `NOSCRIPT` (first use, a restart, or a
//! replica just promoted: the script cache is not replicated) gets the same
//! call as `EVAL`, on the same node, since it is routed by the same key.
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
//! one re-send done here is after a cluster redirection, which fred reports
//! as an exhausted attempt and which proves the script did not run.
//!
//! # Several rules in one request
//!
//! The checks of one request are sent at once and fred pipelines them over
//! its connection to each node: one round trip for all rules, whatever
//! nodes their keys live on. One script cannot span slots (each rule's key
//! has its own hash tag), so "a rejected request consumes no quota" is kept
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
//! is decided exactly by one script.
//!
//! # When Redis fails
//!
//! See [`health`]: a failed check returns a [`StoreError`] that the proxy
//! maps to the rule's `on_error` policy; `local` checks this process's
//! [`MemoryStore`] with the same rules ([`RedisStore::check_local`]). After a few
//! consecutive failures the store stops asking Redis until a probe sees it
//! answer again.
//!
//! # The local over-limit cache
//!
//! See [`cache`]: a key Redis rejected is answered 429 here until its
//! retry-after moment, without a round trip.

mod cache;
mod call;
mod health;
mod lease;
mod scripts;

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use fred::clients::{Client, Pool};
use fred::interfaces::{ClientLike, ClusterInterface, EventInterface};
use fred::types::config::{
    ClusterDiscoveryPolicy, Config as FredConfig, Options, ReconnectPolicy, ServerConfig, UnresponsiveConfig,
};
use fred::types::{Builder, Value};
use tokio::task::JoinHandle;

use crate::clock::SharedClock;
use crate::config::StoreConfig;
use crate::limiter::{Algorithm, Nanos, Verdict};
use crate::metrics::Metrics;
use crate::store::{Check, MemoryStore, Mode, Store, StoreError};

use call::Failure;
use scripts::{Reply, ScriptMode, Scripts};
pub use scripts::{redis_key, suffix};

/// How long fred may take to open a connection (TCP and TLS) or to run its
/// own commands (`CLUSTER SLOTS`, `AUTH`...). fred's defaults are 10 s, which
/// would stall every check that long behind a dead node.
const CONNECT_TIMEOUT: Duration = Duration::from_millis(500);
/// Delay between reconnection attempts: constant and short. An exponential
/// policy measured here delayed recovery after a failover by seconds; with
/// 100 ms checks resumed about 120 ms after the replica's promotion.
const RECONNECT_DELAY_MS: u32 = 100;
/// A connection whose oldest command has waited this long is closed and
/// reopened (a frozen node, a black-holed network): checks give up after the
/// store timeout, but the connection would otherwise stay wedged.
const UNRESPONSIVE_AFTER: Duration = Duration::from_secs(1);
/// How long start-up waits for the first connection before going on
/// degraded (serving by policy) and connecting in the background.
const START_WAIT: Duration = Duration::from_secs(1);
/// The longest a readiness or recovery probe waits.
const PROBE_TIMEOUT: Duration = Duration::from_millis(250);

/// The Redis [`Store`].
pub struct RedisStore {
    shared: Arc<Shared>,
    /// fred's connection tasks and the health probe, stopped on drop.
    tasks: Vec<JoinHandle<()>>,
}

/// What the request path and the probe task share.
struct Shared {
    pool: Pool,
    clustered: bool,
    key_prefix: String,
    timeout: Duration,
    scripts: Scripts,
    cache: cache::OverLimitCache,
    leases: lease::Leases,
    local: MemoryStore,
    health: health::Health,
    metrics: Arc<Metrics>,
    ids: RequestIds,
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
        let mut fred_config =
            FredConfig::from_url(url).map_err(|e| format!("store.url {:?}: {}", redact(url), e.details()))?;
        if config.tls_ca.is_some() || config.tls_client.is_some() {
            fred_config.tls = Some(tls_config(config)?.into());
        }
        let clustered = matches!(fred_config.server, ServerConfig::Clustered { .. });
        if let ServerConfig::Clustered { policy, .. } = &mut fred_config.server {
            // Rediscover the topology through any known node, not only the
            // seeds in the URL: a dead seed must not block recovery.
            *policy = ClusterDiscoveryPolicy::UseCache;
        }
        // Keep reconnecting when the first connection fails.
        fred_config.fail_fast = false;
        let timeout = config.timeout;
        let pool = Builder::from_config(fred_config)
            .with_connection_config(|c| {
                c.connection_timeout = CONNECT_TIMEOUT;
                c.internal_command_timeout = CONNECT_TIMEOUT;
                c.max_command_attempts = 1;
                c.tcp.nodelay = Some(true);
                c.unresponsive =
                    UnresponsiveConfig { max_timeout: Some(UNRESPONSIVE_AFTER), interval: UNRESPONSIVE_AFTER / 4 };
            })
            .with_performance_config(|p| p.default_command_timeout = timeout)
            .set_policy(ReconnectPolicy::new_constant(0, RECONNECT_DELAY_MS))
            .build_pool(config.pool_size.max(1))
            .map_err(|e| format!("cannot build the redis client: {}", e.details()))?;

        // Subscribed before connecting, so the first failure is seen too.
        let error_logs: Vec<JoinHandle<()>> =
            pool.clients().iter().map(|c| tokio::spawn(log_errors(c.error_rx()))).collect();
        let mut tasks: Vec<JoinHandle<()>> = pool
            .connect_pool()
            .into_iter()
            .map(|handle| {
                tokio::spawn(async move {
                    if let Ok(Err(e)) = handle.await {
                        tracing::error!(error = %e, "the redis connection task ended");
                    }
                })
            })
            .collect();

        tasks.extend(error_logs);
        let local = MemoryStore::new(clock);
        let shared = Arc::new(Shared {
            pool,
            clustered,
            key_prefix: config.key_prefix.clone(),
            timeout,
            scripts: Scripts::new(),
            cache: cache::OverLimitCache::new(),
            leases: lease::Leases::new(config.lease_percent, config.lease_idle),
            local,
            health: health::Health::new(&metrics),
            metrics,
            ids: RequestIds::new(),
        });

        let ready = tokio::time::timeout(START_WAIT, shared.pool.wait_for_connect()).await;
        let ready = match ready {
            Ok(Ok(())) => shared.probe().await,
            Ok(Err(e)) => Err(StoreError::Unavailable(e.details().to_string())),
            Err(_) => Err(StoreError::Unavailable(format!("no connection within {START_WAIT:?}"))),
        };
        match ready {
            Ok(()) => tracing::info!(url = %redact(url), clustered, "connected to redis"),
            Err(e) => shared.health.degrade(&format!("at start-up: {e}")),
        }
        tasks.push(tokio::spawn(shared.clone().probe_loop()));
        if shared.leases.enabled() {
            let every = (config.lease_idle / 4).clamp(Duration::from_millis(50), Duration::from_secs(1));
            tasks.push(tokio::spawn(shared.clone().lease_loop(every)));
        }
        Ok(RedisStore { shared, tasks })
    }

    /// Decides `checks` in this process's memory, with the same rules: the
    /// `on_error = "local"` fallback while Redis cannot answer.
    pub fn check_local(&self, checks: &[Check<'_>], mode: Mode) -> Vec<Verdict> {
        self.shared.local.check_now(checks, mode)
    }

    /// Whether checks currently bypass Redis.
    pub fn is_degraded(&self) -> bool {
        self.shared.health.is_degraded()
    }

    /// Drops idle keys of the local fallback and expired over-limit cache
    /// entries; the server calls it periodically.
    pub fn sweep(&self) {
        self.shared.local.sweep();
        self.shared.cache.sweep(Instant::now());
    }

    /// Gives every lease held here back to Redis (bounded by the store
    /// timeout): called once the server has drained, so that a restart
    /// does not hold quota away from the other instances.
    pub async fn close(&self) {
        let unused = self.shared.leases.drain(Instant::now());
        if !unused.is_empty() && !self.shared.health.is_degraded() {
            self.shared.run_refunds(unused_calls(unused)).await;
        }
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
    async fn check(&self, checks: &[Check<'_>], mode: Mode) -> Result<Vec<Verdict>, StoreError> {
        self.shared.check(checks, mode).await
    }

    async fn ping(&self) -> Result<(), StoreError> {
        if self.shared.health.is_degraded() {
            return Err(StoreError::Unavailable("redis did not answer; waiting for it to come back".into()));
        }
        self.shared.probe().await
    }

    fn backend(&self) -> &'static str {
        "redis"
    }

    fn set_idle_horizon(&self, horizon: Nanos) {
        self.shared.local.set_idle_horizon(horizon);
    }
}

impl Shared {
    async fn check(self: &Arc<Self>, checks: &[Check<'_>], mode: Mode) -> Result<Vec<Verdict>, StoreError> {
        let started = Instant::now();
        let deadline = started + self.timeout;
        let keys: Vec<String> = checks.iter().map(|c| redis_key(&self.key_prefix, c.key, c.limits.algorithm)).collect();
        let consume = mode == Mode::Consume;

        let mut probes: Vec<usize> = Vec::new();
        if consume {
            match self.answer_from_cache(checks, &keys, started) {
                Ok(verdicts) => {
                    self.metrics.local_cache_hits_total.inc();
                    return Ok(verdicts);
                }
                Err(p) => probes = p,
            }
        }
        // Checks that leased quota held here can answer (see `lease`).
        let mut local: Vec<Option<Verdict>> = vec![None; checks.len()];
        if consume && self.leases.enabled() {
            for ((slot, c), key) in local.iter_mut().zip(checks).zip(&keys) {
                *slot = self.leases.take(key, &c.limits, c.cost, started);
            }
            if local.iter().all(Option::is_some) {
                self.metrics.lease_hits_total.inc();
                return Ok(local.into_iter().flatten().collect());
            }
        }
        if self.health.is_degraded() {
            self.give_back(checks, &keys, &local);
            return Err(StoreError::Unavailable(
                "redis did not answer recent checks; waiting for it to come back".into(),
            ));
        }

        let script_mode = if consume { ScriptMode::Consume } else { ScriptMode::Peek };
        // Sliding window log entries are named by request, so a refund
        // removes exactly this request's entries.
        let ids: Vec<String> = checks
            .iter()
            .map(|c| if c.limits.algorithm.uses_log() { self.ids.next() } else { String::new() })
            .collect();
        let asked: Vec<usize> = (0..checks.len()).filter(|&i| local[i].is_none()).collect();
        let wants: Vec<u64> = asked
            .iter()
            .map(|&i| {
                let c = &checks[i];
                if consume && self.leases.enabled() {
                    self.leases.want(&keys[i], &c.limits, c.cost, started, self.timeout)
                } else {
                    0
                }
            })
            .collect();
        let calls = asked.iter().zip(&wants).map(|(&i, &want)| {
            let c = &checks[i];
            let script = self.scripts.get(c.limits.algorithm);
            let args = scripts::args(script_mode, &c.limits, c.cost, &ids[i], want);
            call::run(self.pool.next(), script, &keys[i], args, deadline, self.timeout)
        });
        // Sent together: fred writes them back to back on each node's
        // connection, so all rules cost one round trip.
        let results: Vec<Result<Reply, Failure>> = futures::future::join_all(calls).await;

        // Record what was leased, whatever else happened: the units are
        // counted in Redis either way.
        let now = Instant::now();
        for ((&i, &want), result) in asked.iter().zip(&wants).zip(&results) {
            if want == 0 {
                continue;
            }
            match result {
                Ok(reply) => {
                    if reply.granted > 0 {
                        self.metrics.leases_granted_total.inc();
                    }
                    if let Some(old) = self.leases.granted(&keys[i], &checks[i].limits, reply, started, now) {
                        self.give_back_to_redis(vec![old]);
                    }
                }
                Err(_) => self.leases.failed(&keys[i]),
            }
        }

        // A probe Redis admitted clears its key's entry (one it rejected is
        // remembered anew below).
        for &i in &probes {
            let admitted = asked
                .iter()
                .position(|&j| j == i)
                .is_some_and(|at| results[at].as_ref().is_ok_and(|r| r.verdict.allowed));
            if admitted {
                self.cache.forget(&keys[i]);
            }
        }

        if let Some(failure) = results.iter().find_map(|r| r.as_ref().err()) {
            let failure = failure.clone();
            if failure.outage {
                self.health.failed(&failure.error.to_string());
            }
            if consume {
                // An error decides nothing: give back what the rules that
                // did answer counted.
                self.uncount(checks, &keys, &ids, &asked, &results, &local);
            }
            return Err(failure.error);
        }
        self.health.succeeded();

        let mut verdicts: Vec<Verdict> = local.iter().map(|v| v.unwrap_or_default()).collect();
        for (&i, result) in asked.iter().zip(&results) {
            if let Ok(reply) = result {
                // The client may use what this instance now holds for it.
                let mut v = reply.verdict;
                v.remaining = v.remaining.saturating_add(reply.granted);
                verdicts[i] = v;
            }
        }

        if consume {
            let mut rejected = false;
            for (i, ((c, key), v)) in checks.iter().zip(&keys).zip(&verdicts).enumerate() {
                if c.enforced && !v.allowed {
                    rejected = true;
                    self.cache.remember(key, c.limits, c.cost, v, now);
                } else if c.enforced && v.remaining < c.cost && local[i].is_none() {
                    self.cache.exhausted(key, c.limits, c.cost, v, now);
                }
            }
            if rejected {
                self.uncount(checks, &keys, &ids, &asked, &results, &local);
            }
        }
        Ok(verdicts)
    }

    /// Undoes everything a request counted, in Redis (`asked` and their
    /// `results`) and in leases here (`local`): it ended up counting nowhere.
    fn uncount(
        self: &Arc<Self>,
        checks: &[Check<'_>],
        keys: &[String],
        ids: &[String],
        asked: &[usize],
        results: &[Result<Reply, Failure>],
        local: &[Option<Verdict>],
    ) {
        let counted = asked.iter().zip(results).filter_map(|(&i, r)| match r {
            Ok(reply) if reply.verdict.allowed => Some((i, reply)),
            _ => None,
        });
        self.refund(checks, keys, ids, counted);
        self.give_back(checks, keys, local);
    }

    /// Returns the units taken from leases here for a request that ended up
    /// counting nowhere.
    fn give_back(&self, checks: &[Check<'_>], keys: &[String], local: &[Option<Verdict>]) {
        for ((c, key), v) in checks.iter().zip(keys).zip(local) {
            if v.is_some() {
                self.leases.give_back(key, &c.limits, c.cost);
            }
        }
    }

    /// Answers a request from the over-limit cache when one of its enforced
    /// checks is a key Redis rejected and whose retry moment has not come.
    /// Checks not in the cache are not asked either (the request is rejected
    /// anyway, and a rejected request counts nowhere): they are reported
    /// with nothing remaining until the rejection's retry moment, which is
    /// all the client can act on.
    ///
    /// Otherwise returns the checks this request is the probe for (see
    /// [`cache`]), whose outcome the caller reports.
    fn answer_from_cache(
        &self,
        checks: &[Check<'_>],
        keys: &[String],
        now: Instant,
    ) -> Result<Vec<Verdict>, Vec<usize>> {
        let mut known: Vec<Option<Verdict>> = vec![None; checks.len()];
        let mut probes = Vec::new();
        for (i, (c, k)) in checks.iter().zip(keys).enumerate() {
            if !c.enforced {
                continue;
            }
            match self.cache.lookup(k, &c.limits, c.cost, now, self.timeout) {
                cache::Lookup::Rejected(v) => known[i] = Some(v),
                cache::Lookup::Probe => probes.push(i),
                cache::Lookup::Unknown => {}
            }
        }
        let Some(blocker) = known.iter().flatten().next().copied() else { return Err(probes) };
        // Rejected anyway: the probes taken are not sent.
        for &i in &probes {
            self.cache.forget(&keys[i]);
        }
        Ok(known
            .into_iter()
            .map(|v| {
                v.unwrap_or(Verdict {
                    allowed: true,
                    remaining: 0,
                    reset_after: blocker.retry_after,
                    retry_after: 0,
                    delay: 0,
                })
            })
            .collect())
    }

    /// Gives back, in the background, what the `counted` checks (index and
    /// reply) counted for this request. Units they leased stay leased.
    fn refund<'r>(
        self: &Arc<Self>,
        checks: &[Check<'_>],
        keys: &[String],
        ids: &[String],
        counted: impl Iterator<Item = (usize, &'r Reply)>,
    ) {
        let calls: Vec<(Algorithm, String, [Value; scripts::ARGS])> = counted
            .map(|(i, reply)| {
                let c = &checks[i];
                // The log names its entries by request id; the windows
                // name the window the request was counted in.
                let token = if c.limits.algorithm.uses_log() { ids[i].clone() } else { reply.token.to_string() };
                (c.limits.algorithm, keys[i].clone(), scripts::args(ScriptMode::Refund, &c.limits, c.cost, &token, 0))
            })
            .collect();
        self.spawn_refunds(calls);
    }

    /// Gives back, in the background, leased units nobody here will spend.
    fn give_back_to_redis(self: &Arc<Self>, unused: Vec<lease::Unused>) {
        self.spawn_refunds(unused_calls(unused));
    }

    fn spawn_refunds(self: &Arc<Self>, calls: Vec<(Algorithm, String, [Value; scripts::ARGS])>) {
        if calls.is_empty() {
            return;
        }
        let shared = self.clone();
        tokio::spawn(async move { shared.run_refunds(calls).await });
    }

    async fn run_refunds(&self, calls: Vec<(Algorithm, String, [Value; scripts::ARGS])>) {
        let deadline = Instant::now() + self.timeout;
        let refunds = calls.into_iter().map(|(alg, key, args)| async move {
            if let Err(e) = call::run(self.pool.next(), self.scripts.get(alg), &key, args, deadline, self.timeout).await
            {
                // The quota stays taken until the key's window or refill
                // gives it back: an error towards rejecting.
                tracing::debug!(key, error = %e.error, "refund failed");
            }
        });
        futures::future::join_all(refunds).await;
    }

    /// Gives back leases left idle, every so often.
    async fn lease_loop(self: Arc<Self>, every: Duration) {
        let mut tick = tokio::time::interval(every);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            tick.tick().await;
            let unused = self.leases.expire(Instant::now());
            if !unused.is_empty() && !self.health.is_degraded() {
                self.run_refunds(unused_calls(unused)).await;
            }
        }
    }

    /// Asks Redis whether it answers: `PING`, or on a cluster `CLUSTER
    /// INFO` reporting `cluster_state:ok` (a cluster that lost a master
    /// answers pings but not every slot). Every pooled client is asked.
    async fn probe(&self) -> Result<(), StoreError> {
        let timeout = PROBE_TIMEOUT.max(self.timeout);
        for client in self.pool.clients() {
            let options = Options { timeout: Some(timeout), max_attempts: Some(1), ..Default::default() };
            let client = client.with_options(&options);
            if self.clustered {
                let info: String = client.cluster_info().await.map_err(|e| call::store_error(&e, self.timeout))?;
                if !info.contains("cluster_state:ok") {
                    return Err(StoreError::Unavailable("the cluster reports cluster_state other than ok".into()));
                }
            } else {
                let _: String = client.ping(None).await.map_err(|e| call::store_error(&e, self.timeout))?;
            }
        }
        Ok(())
    }

    /// While degraded, probes Redis every `PROBE_EVERY` and switches back
    /// when it answers.
    async fn probe_loop(self: Arc<Self>) {
        loop {
            if !self.health.is_degraded() {
                self.health.wake.notified().await;
                continue;
            }
            tokio::time::sleep(health::PROBE_EVERY).await;
            if self.probe().await.is_ok() {
                self.health.recover();
            }
        }
    }
}

fn nanos(d: Duration) -> u64 {
    u64::try_from(d.as_nanos()).unwrap_or(u64::MAX)
}

/// The refund calls that give leased units back.
fn unused_calls(unused: Vec<lease::Unused>) -> Vec<(Algorithm, String, [Value; scripts::ARGS])> {
    unused
        .into_iter()
        .map(|u| {
            let args = scripts::args(ScriptMode::Refund, &u.limits, u.units, &u.token.to_string(), 0);
            (u.limits.algorithm, u.key, args)
        })
        .collect()
}

/// How often the same connection error is logged again while it lasts.
const ERROR_LOG_EVERY: Duration = Duration::from_secs(10);

/// Logs what fred reports about its connections (refused, reset, a TLS
/// certificate it does not trust...): the store's own errors only say that
/// Redis did not answer, and this is the why. The same error is repeated
/// at most every [`ERROR_LOG_EVERY`] while the client keeps reconnecting.
async fn log_errors(
    mut errors: tokio::sync::broadcast::Receiver<(fred::error::Error, Option<fred::types::config::Server>)>,
) {
    use tokio::sync::broadcast::error::RecvError;
    let mut last: Option<(String, Instant)> = None;
    loop {
        match errors.recv().await {
            Ok((error, server)) => {
                let message = error.to_string();
                let repeat = last.as_ref().is_some_and(|(m, at)| *m == message && at.elapsed() < ERROR_LOG_EVERY);
                if !repeat {
                    let server = server.map_or_else(|| "-".to_string(), |s| s.to_string());
                    tracing::warn!(%server, error = %message, "redis connection error");
                    last = Some((message, Instant::now()));
                }
            }
            Err(RecvError::Lagged(_)) => {}
            Err(RecvError::Closed) => return,
        }
    }
}

/// The TLS settings of `[store]`: the roots (`tls_ca_file`, else the
/// system's) and the client identity (`tls_cert_file`, `tls_key_file`).
fn tls_config(config: &StoreConfig) -> Result<fred::rustls::ClientConfig, String> {
    let roots = match &config.tls_ca {
        Some((path, pem)) => tls_roots(pem).map_err(|e| format!("{}: {e}", path.display()))?,
        None => {
            let mut roots = fred::rustls::RootCertStore::empty();
            let system = fred::rustls_native_certs::load_native_certs();
            for cert in system.certs {
                // A system certificate rustls cannot use is skipped, as
                // every TLS client does.
                let _ = roots.add(cert);
            }
            roots
        }
    };
    let builder = fred::rustls::ClientConfig::builder().with_root_certificates(roots);
    match &config.tls_client {
        Some(files) => {
            let (chain, key) = tls_client_identity(&files.cert, &files.key)
                .map_err(|e| format!("{} and {}: {e}", files.cert_path.display(), files.key_path.display()))?;
            builder.with_client_auth_cert(chain, key).map_err(|e| format!("the client certificate cannot be used: {e}"))
        }
        None => Ok(builder.with_no_client_auth()),
    }
}

/// A client certificate chain and its private key, from PEM. Errors are
/// plain sentences.
pub fn tls_client_identity(
    cert: &[u8],
    key: &[u8],
) -> Result<
    (Vec<fred::rustls::pki_types::CertificateDer<'static>>, fred::rustls::pki_types::PrivateKeyDer<'static>),
    String,
> {
    use fred::rustls::pki_types::pem::PemObject;
    use fred::rustls::pki_types::{CertificateDer, PrivateKeyDer};
    let chain: Vec<CertificateDer<'static>> = CertificateDer::pem_slice_iter(cert)
        .collect::<Result<_, _>>()
        .map_err(|e| format!("not a PEM certificate file ({e})"))?;
    if chain.is_empty() {
        return Err("the certificate file holds no PEM certificate".into());
    }
    let key = PrivateKeyDer::from_pem_slice(key).map_err(|e| format!("no PEM private key in the key file ({e})"))?;
    // Whether the key matches the certificate is checked when the
    // connection's TLS configuration is built.
    fred::rustls::ClientConfig::builder()
        .with_root_certificates(fred::rustls::RootCertStore::empty())
        .with_client_auth_cert(chain.clone(), key.clone_key())
        .map_err(|e| format!("the key does not go with the certificate ({e})"))?;
    Ok((chain, key))
}

/// The certificates of a PEM file, as the roots a `rediss://` connection
/// trusts (`[store] tls_ca_file`). Errors are plain sentences.
pub fn tls_roots(pem: &[u8]) -> Result<fred::rustls::RootCertStore, String> {
    use fred::rustls::pki_types::CertificateDer;
    use fred::rustls::pki_types::pem::PemObject;
    let mut roots = fred::rustls::RootCertStore::empty();
    for cert in CertificateDer::pem_slice_iter(pem) {
        let cert = cert.map_err(|e| format!("not a PEM certificate file ({e})"))?;
        roots.add(cert).map_err(|e| format!("a certificate cannot be used as a CA ({e})"))?;
    }
    if roots.is_empty() {
        return Err("holds no PEM certificate (-----BEGIN CERTIFICATE-----)".into());
    }
    Ok(roots)
}

/// The URL without its password, for logs and errors.
fn redact(url: &str) -> String {
    match (url.find("://"), url.rfind('@')) {
        (Some(scheme), Some(at)) if at > scheme => {
            let userinfo = &url[scheme + 3..at];
            let user = userinfo.split_once(':').map_or(userinfo, |(u, _)| u);
            format!("{}{user}:***{}", &url[..scheme + 3], &url[at..])
        }
        _ => url.to_string(),
    }
}

/// Unique ids for sliding-log entries: a random per-process prefix and a
/// counter, so no two requests of any instance add the same member.
struct RequestIds {
    prefix: u32,
    next: AtomicU64,
}

impl RequestIds {
    fn new() -> RequestIds {
        use std::hash::BuildHasher;
        // A randomly seeded hasher is the one source of randomness at hand.
        let seed = foldhash::quality::RandomState::default().hash_one((std::process::id(), Instant::now()));
        RequestIds { prefix: seed as u32, next: AtomicU64::new(0) }
    }

    fn next(&self) -> String {
        format!("{:08x}{:x}", self.prefix, self.next.fetch_add(1, Ordering::Relaxed))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn passwords_are_redacted() {
        assert_eq!(redact("redis://:secret@h:6379"), "redis://:***@h:6379");
        assert_eq!(redact("rediss://user:secret@h:6379/0"), "rediss://user:***@h:6379/0");
        assert_eq!(redact("redis-cluster://h:7000?node=h:7001"), "redis-cluster://h:7000?node=h:7001");
    }

    #[test]
    fn request_ids_are_distinct() {
        let ids = RequestIds::new();
        let a = ids.next();
        let b = ids.next();
        assert_ne!(a, b);
        assert!(a.len() >= 9);
    }
}
