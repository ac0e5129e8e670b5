//! Concurrency slots held in Redis: renewed while their requests run,
//! given back when they end.
//!
//! A slot is a member of its key's sorted set scored by when it expires
//! (see `concurrency.lua`). Every slot this instance holds is in its
//! [`Registry`]; one task ([`Shared::slots_loop`]) renews those due (a
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

use std::collections::HashMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

use parking_lot::Mutex;
use tokio::sync::Notify;

use super::Shared;
use super::scripts::{self, LeaseArgs, ScriptMode};
use crate::limiter::{Algorithm, Limits};
use crate::store::memory;

/// How often the task looks for slots due for renewal, and tries again
/// those whose renewal failed. Slot TTLs are at least a second (config
/// validation), so a slot is renewed at most TTL / 3 + this after its last
/// renewal while its node answers.
const TICK: Duration = Duration::from_millis(250);

/// The slots this instance holds, and those waiting to be given back.
pub(super) struct Registry {
    held: Mutex<HashMap<String, Held>>,
    releasing: Mutex<Vec<Release>>,
    wake: Notify,
}

/// One slot held: its key, its rule's limits (the TTL is the window), and
/// when it was last taken or renewed.
struct Held {
    key: String,
    limits: Limits,
    renewed: Instant,
}

/// A slot to give back: key, limits and id.
type Release = (String, Limits, String);

impl Registry {
    pub(super) fn new() -> Registry {
        Registry { held: Mutex::new(HashMap::new()), releasing: Mutex::new(Vec::new()), wake: Notify::new() }
    }

    /// Records a slot Redis just gave this instance (taken at `at`).
    pub(super) fn hold(&self, id: String, key: String, limits: Limits, at: Instant) {
        self.held.lock().insert(id, Held { key, limits, renewed: at });
    }

    /// How many slots are held.
    pub(super) fn len(&self) -> usize {
        self.held.lock().len()
    }

    /// Stops renewing `ids` and queues them to be given back.
    fn release(&self, ids: Vec<String>) {
        let released: Vec<Release> = {
            let mut held = self.held.lock();
            ids.into_iter().filter_map(|id| held.remove(&id).map(|h| (h.key, h.limits, id))).collect()
        };
        if !released.is_empty() {
            self.releasing.lock().extend(released);
            self.wake.notify_one();
        }
    }

    /// The slots due for renewal at `now`, marked renewed, each with when
    /// it was renewed before (see [`Registry::retry`]).
    fn due(&self, now: Instant) -> Vec<(Release, Instant)> {
        let mut held = self.held.lock();
        held.iter_mut()
            .filter(|(_, h)| now.saturating_duration_since(h.renewed) >= renew_after(&h.limits))
            .map(|(id, h)| {
                let before = std::mem::replace(&mut h.renewed, now);
                ((h.key.clone(), h.limits, id.clone()), before)
            })
            .collect()
    }

    /// A renewal of `id` failed or was not sent: it is due again at once,
    /// so the next tick tries again. Marked renewed until then, a slot
    /// whose renewal failed twice in a row would have expired.
    fn retry(&self, id: &str, before: Instant) {
        if let Some(h) = self.held.lock().get_mut(id) {
            h.renewed = before;
        }
    }

    /// Everything held or waiting to be given back (at shutdown).
    fn drain(&self) -> Vec<Release> {
        let mut out: Vec<Release> = self.held.lock().drain().map(|(id, h)| (h.key, h.limits, id)).collect();
        out.append(&mut self.releasing.lock());
        out
    }
}

/// A third of the slot TTL: two renewals can be missed before a live
/// request's slot expires.
fn renew_after(limits: &Limits) -> Duration {
    Duration::from_nanos(limits.window / 3)
}

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
                () = self.slots.wake.notified() => {}
            }
            let released = std::mem::take(&mut *self.slots.releasing.lock());
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
