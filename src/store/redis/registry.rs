//! The concurrency slots this instance holds in Redis, by request id: when
//! each is due for renewal, and those waiting to be given back (see
//! [`slots`](super::slots)).

use std::collections::HashMap;
use std::time::{Duration, Instant};

use parking_lot::Mutex;
use tokio::sync::Notify;

use crate::limiter::Limits;

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
pub(super) type Release = (String, Limits, String);

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
    pub(super) fn release(&self, ids: Vec<String>) {
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
    pub(super) fn due(&self, now: Instant) -> Vec<(Release, Instant)> {
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
    pub(super) fn retry(&self, id: &str, before: Instant) {
        if let Some(h) = self.held.lock().get_mut(id) {
            h.renewed = before;
        }
    }

    /// The slots waiting to be given back, taken off the queue.
    pub(super) fn released(&self) -> Vec<Release> {
        std::mem::take(&mut *self.releasing.lock())
    }

    /// Completes when a slot is queued to be given back.
    pub(super) async fn woken(&self) {
        self.wake.notified().await;
    }

    /// Everything held or waiting to be given back (at shutdown).
    pub(super) fn drain(&self) -> Vec<Release> {
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
