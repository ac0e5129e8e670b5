//! Whether Redis is answering, and the switch between it and the failure
//! policies.
//!
//! A failed check is answered by its rule's `on_error` policy either way; what
//! this adds is a state. After [`DEGRADE_AFTER`] consecutive checks fail
//! with an outage-like error (timeout, connection lost, cluster down), the
//! store is *degraded*: checks stop going to Redis and fail at once, so each
//! request is decided by its policy (`allow`, `deny`, or `local`: counted in
//! this process's memory) without first waiting out the store timeout. A
//! probe then asks Redis every [`PROBE_EVERY`] and switches back as soon as
//! it answers. Both switches are logged, counted in
//! `tollgate_store_fallback_transitions_total{direction="to_local"|"to_store"}`
//! and shown by the `tollgate_store_degraded` gauge.
//!
//! Several failures in a row, not one: a single slow answer under load must
//! not send a whole instance to local counting (where every instance admits
//! the full limit on its own). Only the probe switches back, so a late
//! success of a check sent before the outage cannot flap the state.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU32, Ordering};
use std::time::Duration;

use fred::interfaces::{ClientLike, ClusterInterface};
use fred::types::config::Options;

use prometheus::{IntCounter, IntGauge};
use tokio::sync::Notify;

use super::call;
use crate::metrics::Metrics;
use crate::store::StoreError;

/// Consecutive failed checks that make the store degraded.
pub const DEGRADE_AFTER: u32 = 3;
/// How often a degraded store asks Redis whether it is back.
pub const PROBE_EVERY: Duration = Duration::from_millis(100);

/// The degraded flag and its metrics.
pub(super) struct Health {
    degraded: AtomicBool,
    failures: AtomicU32,
    /// Wakes the probe when the store becomes degraded.
    pub wake: Notify,
    gauge: IntGauge,
    to_local: IntCounter,
    to_store: IntCounter,
}

impl Health {
    pub fn new(metrics: &Metrics) -> Health {
        let transitions = &metrics.store_fallback_transitions_total;
        Health {
            degraded: AtomicBool::new(false),
            failures: AtomicU32::new(0),
            wake: Notify::new(),
            gauge: metrics.store_degraded.clone(),
            to_local: transitions.with_label_values(&["to_local"]),
            to_store: transitions.with_label_values(&["to_store"]),
        }
    }

    pub fn is_degraded(&self) -> bool {
        self.degraded.load(Ordering::Relaxed)
    }

    /// A check got an answer from Redis.
    pub fn succeeded(&self) {
        if self.failures.load(Ordering::Relaxed) != 0 {
            self.failures.store(0, Ordering::Relaxed);
        }
    }

    /// A check failed because Redis did not answer.
    pub fn failed(&self, reason: &str) {
        let n = self.failures.fetch_add(1, Ordering::Relaxed) + 1;
        if n >= DEGRADE_AFTER {
            self.degrade(reason);
        }
    }

    /// Stops sending checks to Redis until the probe sees it answer.
    pub fn degrade(&self, reason: &str) {
        if !self.degraded.swap(true, Ordering::AcqRel) {
            self.gauge.set(1);
            self.to_local.inc();
            tracing::warn!(reason, "redis unreachable: checks follow their on_error policy until it answers again");
            self.wake.notify_one();
        }
    }

    /// Redis answered the probe: send checks to it again.
    pub fn recover(&self) {
        if self.degraded.swap(false, Ordering::AcqRel) {
            self.failures.store(0, Ordering::Relaxed);
            self.gauge.set(0);
            self.to_store.inc();
            tracing::info!("redis answers again: checks go to redis");
        }
    }
}

/// The longest a readiness or recovery probe waits.
const PROBE_TIMEOUT: Duration = Duration::from_millis(250);

impl super::Shared {
    /// Asks Redis whether it answers: `PING`, or on a cluster `CLUSTER
    /// INFO` reporting `cluster_state:ok` (a cluster that lost a master
    /// answers pings but not every slot). Every pooled client is asked.
    pub(super) async fn probe(&self) -> Result<(), StoreError> {
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

    /// While degraded, probes Redis every [`PROBE_EVERY`] and switches back
    /// when it answers.
    pub(super) async fn probe_loop(self: Arc<Self>) {
        loop {
            if !self.health.is_degraded() {
                self.health.wake.notified().await;
                continue;
            }
            tokio::time::sleep(PROBE_EVERY).await;
            if self.probe().await.is_ok() {
                self.health.recover();
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn degrades_after_consecutive_failures_and_counts_each_switch_once() {
        let metrics = Metrics::new();
        let h = Health::new(&metrics);
        h.failed("timeout");
        h.failed("timeout");
        h.succeeded();
        h.failed("timeout");
        h.failed("timeout");
        assert!(!h.is_degraded(), "a success in between resets the count");
        h.failed("timeout");
        assert!(h.is_degraded());
        h.failed("timeout");
        assert_eq!(metrics.store_degraded.get(), 1);
        h.recover();
        h.recover();
        assert!(!h.is_degraded());
        assert_eq!(metrics.store_degraded.get(), 0);
        let t = &metrics.store_fallback_transitions_total;
        assert_eq!(t.with_label_values(&["to_local"]).get(), 1);
        assert_eq!(t.with_label_values(&["to_store"]).get(), 1);
    }
}
