//! Giving quota back to Redis, in the background: what a rejected request
//! counted under the rules that admitted it, and leased units nobody here
//! will spend (idle, replaced, or at shutdown).

use std::sync::Arc;
use std::time::{Duration, Instant};

use fred::interfaces::ClientLike;
use fred::types::Value;

use super::scripts::{self, LeaseArgs, Reply, ScriptMode};
use super::shared::Shared;
use super::{call, lease};
use crate::limiter::Algorithm;
use crate::store::Check;

impl Shared {
    /// Gives back, in the background, what the `counted` checks (index and
    /// reply) counted for this request. Units they leased stay leased.
    pub(super) fn refund<'r>(
        self: &Arc<Self>,
        checks: &[Check<'_>],
        keys: &[String],
        ids: &[String],
        counted: impl Iterator<Item = (usize, &'r Reply)>,
    ) {
        let calls: Vec<(Algorithm, String, [Value; scripts::ARGS])> = counted
            .map(|(i, reply)| {
                let c = &checks[i];
                // The log and concurrency name their entries by request
                // id; the windows name the window the request was counted in.
                let token = if c.limits.algorithm.names_requests() { ids[i].clone() } else { reply.token.to_string() };
                (
                    c.limits.algorithm,
                    keys[i].clone(),
                    scripts::args(ScriptMode::Refund, &c.limits, c.cost, &token, LeaseArgs::default()),
                )
            })
            .collect();
        self.spawn_refunds(calls);
    }

    /// Corrects, in the background, what a check reserved by `delta` units,
    /// counted `since` ago: one script call (mode `Settle`), atomic on the
    /// server. Never through a lease: a settled check takes none. A call
    /// that fails is not retried (it may have run): the reservation stands.
    pub(super) fn settle(self: &Arc<Self>, check: &Check<'_>, delta: i64, since: Duration) {
        let delta = crate::limiter::refundable(&check.limits, check.cost, delta, super::scripts::nanos(since));
        if delta == 0 || !crate::limiter::settles(check.limits.algorithm) {
            return;
        }
        let sign = if delta < 0 { '-' } else { '+' };
        let tail = format!("{sign}{}", since.as_micros());
        let key = super::scripts::redis_key(&self.key_prefix, check.key, check.limits.algorithm);
        let args = scripts::args(ScriptMode::Settle, &check.limits, delta.unsigned_abs(), &tail, LeaseArgs::default());
        self.spawn_refunds(vec![(check.limits.algorithm, key, args)]);
    }

    /// Gives back, in the background, leased units nobody here will spend.
    pub(super) fn give_back_to_redis(self: &Arc<Self>, unused: Vec<lease::Unused>) {
        let shared = self.clone();
        tokio::spawn(async move { shared.return_units(unused).await });
    }

    /// Gives leased units back to Redis now, as many as it still counts.
    ///
    /// Only a give-back never sent waits in the backlog for a later try:
    /// one whose connection is known down (or whose node is down) before
    /// it leaves. One sent whose call fails is dropped, whatever the
    /// error: a call that timed out may have run, and running it again
    /// would give the units back twice and let the key admit past its
    /// limit. Dropped, its units stay counted until its window ends (a
    /// bucket's slot counts them as spent when it ends): fewer admitted,
    /// by at most one lease per key.
    pub(super) async fn return_units(&self, unused: Vec<lease::Unused>) {
        let now = Instant::now();
        let unused: Vec<lease::Unused> = unused.into_iter().filter(|u| u.worth_sending(now)).collect();
        if unused.is_empty() {
            return;
        }
        let (unused, later): (Vec<lease::Unused>, Vec<lease::Unused>) =
            unused.into_iter().partition(|u| !self.node_down(&u.key));
        self.queue(later);
        let (sending, unsent): (Vec<_>, Vec<_>) =
            unused.into_iter().map(|u| (u, self.pool.next())).partition(|(_, client)| client.is_connected());
        self.queue(unsent.into_iter().map(|(u, _)| u).collect());
        let deadline = now + self.timeout;
        let calls = sending.iter().map(|(u, client)| {
            call::run(client, self.scripts.get(u.limits.algorithm), &u.key, unused_args(u), deadline, self.timeout)
        });
        let results = futures::future::join_all(calls).await;
        for ((u, _), result) in sending.iter().zip(results) {
            if let Err(f) = result {
                self.metrics.lease_give_backs_dropped_total.inc();
                tracing::debug!(key = u.key, units = u.units, error = %f.error, "give-back failed; not sent again");
            }
        }
    }

    /// Keeps units for a later give-back, up to [`MAX_BACKLOG`] entries.
    fn queue(&self, unused: Vec<lease::Unused>) {
        if unused.is_empty() {
            return;
        }
        let mut backlog = self.backlog.lock();
        let room = MAX_BACKLOG.saturating_sub(backlog.len());
        let dropped = unused.len().saturating_sub(room);
        let lost: u64 = unused.iter().skip(room).map(|u| u.units).sum();
        backlog.extend(unused.into_iter().take(room));
        if dropped > 0 {
            self.metrics.lease_give_backs_dropped_total.inc_by(dropped as u64);
            tracing::warn!(units = lost, "the give-back backlog is full; leased units stay counted in redis");
        }
    }

    /// Tries the backlog again; what is for a node still down waits on.
    pub(super) async fn flush_backlog(&self) {
        let waiting: Vec<lease::Unused> = self.backlog.lock().drain(..).collect();
        self.return_units(waiting).await;
    }

    /// Entries waiting in the backlog.
    pub(super) fn backlog_len(&self) -> usize {
        self.backlog.lock().len()
    }

    pub(super) fn spawn_refunds(self: &Arc<Self>, calls: Vec<(Algorithm, String, [Value; scripts::ARGS])>) {
        if calls.is_empty() {
            return;
        }
        let shared = self.clone();
        tokio::spawn(async move { shared.run_refunds(calls).await });
    }

    pub(super) async fn run_refunds(&self, calls: Vec<(Algorithm, String, [Value; scripts::ARGS])>) {
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
    pub(super) async fn lease_loop(self: Arc<Self>, every: Duration) {
        let mut tick = tokio::time::interval(every);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            tick.tick().await;
            let unused = self.leases.expire(Instant::now());
            self.return_units(unused).await;
            self.flush_backlog().await;
        }
    }
}

/// Give-backs kept while Redis is unreachable, at most: one per key the
/// leases can track (see `lease`), some 200 bytes each. Past it, units stay
/// counted in Redis until their window ends or their bucket refills.
const MAX_BACKLOG: usize = 128_000;

/// The refund call's arguments that give leased units back: a window's
/// units as a refund of their count, a token bucket's lease as a settle.
fn unused_args(u: &lease::Unused) -> [Value; scripts::ARGS] {
    match u.settle() {
        Some(settle) => {
            let lease = LeaseArgs { settle: Some(settle), ..LeaseArgs::default() };
            scripts::args(ScriptMode::Refund, &u.limits, 0, "", lease)
        }
        None => scripts::args(ScriptMode::Refund, &u.limits, u.units, &u.token.to_string(), LeaseArgs::default()),
    }
}
