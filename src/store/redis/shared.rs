//! What the request path and the store's tasks share: one [`Shared`]
//! behind an `Arc`, whose methods are written in the files of their
//! responsibility (`check`, `batch`, `refund`, `slots`, `probe`).

use std::collections::VecDeque;
use std::time::Duration;

use fred::clients::Pool;
use parking_lot::Mutex;
use std::sync::Arc;

use super::cache::OverLimitCache;
use super::health::Health;
use super::ids::RequestIds;
use super::lease::{Leases, Unused};
use super::queues::Batcher;
use super::registry::Registry;
use super::scripts::Scripts;
use crate::obs::metrics::Metrics;
use crate::store::MemoryStore;

/// What the request path and the probe task share.
pub(super) struct Shared {
    pub(super) pool: Pool,
    pub(super) clustered: bool,
    pub(super) key_prefix: String,
    pub(super) timeout: Duration,
    pub(super) scripts: Scripts,
    pub(super) batcher: Batcher,
    pub(super) cache: OverLimitCache,
    pub(super) leases: Leases,
    /// Give-backs of leased units never sent, waiting for Redis to come
    /// back (see `refund`).
    pub(super) backlog: Mutex<VecDeque<Unused>>,
    pub(super) local: MemoryStore,
    pub(super) health: Health,
    pub(super) metrics: Arc<Metrics>,
    pub(super) ids: RequestIds,
    pub(super) slots: Registry,
}
