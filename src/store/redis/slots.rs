//! Concurrency slots held in Redis: renewed while their requests run,
//! given back when they end.
//!
//! A slot is a member of its key's sorted set scored by when it expires
//! (see `concurrency.lua`). Every slot this instance holds is in its
//! [`Registry`](super::registry::Registry); one task ([`Shared::slots_loop`]) renews those due (a
//! third of their TTL after they were taken or last renewed, and at every
//! tick after a renewal that failed) and gives back those whose requests
//! ended. Both go through the [`batch`](super::batch)
//! queues: one call per node carries many renewals, not one timer and one
//! call per request.
//!
//! A request's [`Slots`] hand their ids to the task when dropped, which
//! `Drop` must do without awaiting: the release is queued and the task is
//! woken. If the release cannot be sent (Redis down, a failed call), the
//! slot is left to expire: within one TTL it stops counting, which is also
//! what happens to every slot of an instance that dies. No slot is ever
//! leased: each acquire asks Redis.

use std::sync::Arc;
use std::time::{Duration, Instant};

use super::registry::Release;
use super::scripts::{self, LeaseArgs, ScriptMode};
use super::shared::Shared;
use crate::limiter::Algorithm;
use crate::store::memory;

/// How often the task looks for slots due for renewal, and tries again
/// those whose renewal failed. Slot TTLs are at least a second (config
/// validation), so a slot is renewed at most TTL / 3 + this after its last
/// renewal while its node answers.
const TICK: Duration = Duration::from_millis(250);

/// Concurrency slots a request holds through the Redis store (and, for
/// rules decided by the `local` fallback, in its memory): given back when
/// dropped.
pub struct Slots {
    pub(super) shared: Arc<Shared>,
    pub(super) ids: Vec<String>,
    /// Held for its `Drop`, which gives the fallback's slots back.
    pub(super) _local: Option<memory::Slots>,
}

impl Drop for Slots {
    fn drop(&mut self) {
        if !self.ids.is_empty() {
            self.shared.slots.release(std::mem::take(&mut self.ids));
        }
    }
}

impl Shared {
    /// Renews the slots held here and gives back those released, until
    /// the store is dropped.
    pub(super) async fn slots_loop(self: Arc<Self>) {
        let mut tick = tokio::time::interval(TICK);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            tokio::select! {
                _ = tick.tick() => {
                    let due = self.slots.due(Instant::now());
                    self.renew(due).await;
                }
                () = self.slots.woken() => {}
            }
            let released = self.slots.released();
            self.give_back_slots(released).await;
            self.metrics.concurrency_slots_held.set(self.slots.len() as i64);
        }
    }

    /// Gives every slot still held back (after the server drained).
    pub(super) async fn release_all_slots(self: &Arc<Self>) {
        let all = self.slots.drain();
        self.give_back_slots(all).await;
        self.metrics.concurrency_slots_held.set(0);
    }

    /// Renews `due` (with when each was renewed before). A slot whose node
    /// is down is not sent; it and every failed renewal are tried again at
    /// the next tick (renewing twice is harmless: it sets the same expiry
    /// from the server's clock). A slot that cannot be renewed within its
    /// TTL expires, which is the backstop for an instance that cannot
    /// reach Redis either.
    async fn renew(self: &Arc<Self>, due: Vec<(Release, Instant)>) {
        let replies = self.call_slots(ScriptMode::Renew, due.iter().map(|(r, _)| r)).await;
        for (((key, _, id), before), reply) in due.iter().zip(replies) {
            match reply {
                Ok(r) if !r.verdict.allowed => {
                    self.metrics.concurrency_slots_lost_total.inc();
                    tracing::debug!(key, id, "a concurrency slot had expired before its renewal");
                }
                Ok(_) => {}
                Err(e) => {
                    tracing::debug!(key, error = %e.error, "renewing a concurrency slot failed; trying again at the next tick");
                    self.slots.retry(id, *before);
                }
            }
        }
    }

    /// Gives `released` back; a slot whose node is down is not sent and
    /// is left to expire within its TTL.
    async fn give_back_slots(self: &Arc<Self>, released: Vec<Release>) {
        for ((key, _, _), reply) in released.iter().zip(self.call_slots(ScriptMode::Refund, released.iter()).await) {
            if let Err(e) = reply {
                // Left to expire within its TTL.
                tracing::debug!(key, error = %e.error, "giving back a concurrency slot failed");
            }
        }
    }

    /// One script call per slot, queued together: they go out in batches
    /// per node.
    async fn call_slots<'a>(
        self: &Arc<Self>,
        mode: ScriptMode,
        slots: impl Iterator<Item = &'a Release>,
    ) -> Vec<Result<scripts::Reply, super::call::Failure>> {
        let deadline = Instant::now() + self.timeout;
        let calls = slots.map(|(key, limits, id)| {
            let args = scripts::args(mode, limits, 1, id, LeaseArgs::default());
            self.submit(Algorithm::Concurrency, key.clone(), args, deadline)
        });
        futures::future::join_all(calls).await
    }
}
