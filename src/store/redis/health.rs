//! Whether each Redis node is answering, and the switch between it and the
//! failure policies, node by node.
//!
//! A failed check is answered by its rule's `on_error` policy either way; what
//! this adds is a state per node: the single server (or the master Sentinel
//! names), or in a cluster each master owning slots now. After
//! [`DEGRADE_AFTER`] consecutive calls to a node fail with an outage-like
//! error (timeout, connection lost, cluster down), the node is *down*: the
//! checks of the keys it holds stop going to Redis and fail at once, so each
//! of those requests is decided by its policy (`allow`, `deny`, or `local`:
//! counted in this process's memory) without first waiting out the store
//! timeout. The keys of the other nodes are not affected. A probe then asks
//! that node alone every [`PROBE_EVERY`] and takes it back as soon as it
//! answers (see [`probe`](super::probe)). Both switches are logged, counted in
//! `tollgate_store_fallback_transitions_total{direction="to_local"|"to_store"}`
//! (once per node and switch), and shown by `tollgate_store_node_up{node}`;
//! `tollgate_store_degraded` is 1 while any node is down.
//!
//! Several failures in a row, not one: a single slow answer under load must
//! not send a node's keys to local counting (where every instance admits
//! the full limit on its own). Only the probe switches back, so a late
//! success of a call sent before the outage cannot flap the state. The
//! probe of a cluster node asks that node (`CLUSTER INFO`, answered
//! `cluster_state:ok`), never whichever node the client picks: a healthy
//! node answering for a frozen one would take it back at once.
//!
//! Health follows the slot map: a node that no longer owns slots (failed
//! over, emptied by a migration) is forgotten, and its keys are the new
//! owner's, with the new owner's health. Until the cluster's layout is
//! known (at start-up, before any node was reached), the whole cluster is
//! one node named `cluster`.

use std::collections::HashMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicUsize, Ordering};
use std::time::Duration;

use fred::types::config::Server;
use parking_lot::Mutex;

use prometheus::{IntCounter, IntGauge, IntGaugeVec};
use tokio::sync::Notify;

use crate::obs::metrics::Metrics;

/// Consecutive failed calls that take a node down.
pub const DEGRADE_AFTER: u32 = 3;
/// How often a node that is down is asked whether it is back.
pub const PROBE_EVERY: Duration = Duration::from_millis(100);

/// The name of the whole cluster while its layout is not known.
pub(super) const WHOLE_CLUSTER: &str = "cluster";

/// One node's state.
pub(super) struct Node {
    /// `host:port`, the `node` label.
    pub name: String,
    /// The cluster node a probe asks; `None` for a single server (or
    /// Sentinel's master) and for [`WHOLE_CLUSTER`], probed through any
    /// connection.
    pub server: Option<Server>,
    down: AtomicBool,
    failures: AtomicU32,
    gauge: IntGauge,
}

impl Node {
    pub fn is_down(&self) -> bool {
        self.down.load(Ordering::Relaxed)
    }
}

/// Every node's state and the store-wide metrics.
pub(super) struct Health {
    nodes: Mutex<HashMap<String, Arc<Node>>>,
    /// Nodes down now.
    down: AtomicUsize,
    /// Wakes the probe when a node goes down.
    pub wake: Notify,
    degraded: IntGauge,
    node_up: IntGaugeVec,
    to_local: IntCounter,
    to_store: IntCounter,
}

impl Health {
    pub fn new(metrics: &Metrics) -> Health {
        let transitions = &metrics.store_fallback_transitions_total;
        Health {
            nodes: Mutex::new(HashMap::new()),
            down: AtomicUsize::new(0),
            wake: Notify::new(),
            degraded: metrics.store_degraded.clone(),
            node_up: metrics.store_node_up.clone(),
            to_local: transitions.with_label_values(&["to_local"]),
            to_store: transitions.with_label_values(&["to_store"]),
        }
    }

    /// The node named `name`, known from now on if it was not (up).
    pub fn node(&self, name: &str, server: Option<Server>) -> Arc<Node> {
        let mut nodes = self.nodes.lock();
        if let Some(n) = nodes.get(name) {
            return n.clone();
        }
        let gauge = self.node_up.with_label_values(&[name]);
        gauge.set(1);
        let node = Arc::new(Node {
            name: name.to_string(),
            server,
            down: AtomicBool::new(false),
            failures: AtomicU32::new(0),
            gauge,
        });
        nodes.insert(name.to_string(), node.clone());
        node
    }

    /// Forgets the nodes not in `names` (no longer owning slots). One that
    /// was down counts as back: its keys are another node's now.
    pub fn retain(&self, names: &[&str]) {
        let gone: Vec<Arc<Node>> = {
            let mut nodes = self.nodes.lock();
            let gone: Vec<String> = nodes.keys().filter(|k| !names.contains(&k.as_str())).cloned().collect();
            gone.iter().filter_map(|k| nodes.remove(k)).collect()
        };
        for node in gone {
            let _ = self.node_up.remove_label_values(&[&node.name]);
            if node.down.swap(false, Ordering::AcqRel) {
                self.to_store.inc();
                self.count_down(-1);
                tracing::info!(
                    node = node.name,
                    "a redis node that was down owns no slots any more: its keys go to their new owner"
                );
            }
        }
    }

    /// Whether checks of some keys bypass Redis.
    pub fn is_degraded(&self) -> bool {
        self.down.load(Ordering::Relaxed) > 0
    }

    /// The nodes down now.
    pub fn down_nodes(&self) -> Vec<Arc<Node>> {
        let mut down: Vec<Arc<Node>> = self.nodes.lock().values().filter(|n| n.is_down()).cloned().collect();
        down.sort_by(|a, b| a.name.cmp(&b.name));
        down
    }

    /// Every node known, down or not.
    pub fn all_nodes(&self) -> Vec<Arc<Node>> {
        self.nodes.lock().values().cloned().collect()
    }

    /// A call to `node` got an answer from it.
    pub fn succeeded(&self, node: &Node) {
        if node.failures.load(Ordering::Relaxed) != 0 {
            node.failures.store(0, Ordering::Relaxed);
        }
    }

    /// A call to `node` failed because it did not answer.
    pub fn failed(&self, node: &Node, reason: &str) {
        let n = node.failures.fetch_add(1, Ordering::Relaxed) + 1;
        if n >= DEGRADE_AFTER {
            self.degrade(node, reason);
        }
    }

    /// Stops sending the checks of `node`'s keys to Redis until the probe
    /// sees it answer.
    pub fn degrade(&self, node: &Node, reason: &str) {
        // Under the lock, and only a node still known: one forgotten by
        // `retain` (a call to it was out meanwhile) would never be probed.
        let nodes = self.nodes.lock();
        if !nodes.get(&node.name).is_some_and(|n| std::ptr::eq(n.as_ref(), node)) {
            return;
        }
        if !node.down.swap(true, Ordering::AcqRel) {
            node.gauge.set(0);
            self.to_local.inc();
            self.count_down(1);
            tracing::warn!(
                node = node.name,
                reason,
                "redis node unreachable: checks of its keys follow their on_error policy until it answers again"
            );
            self.wake.notify_one();
        }
    }

    /// `node` answered the probe: send its checks to it again.
    pub fn recover(&self, node: &Node) {
        if node.down.swap(false, Ordering::AcqRel) {
            node.failures.store(0, Ordering::Relaxed);
            node.gauge.set(1);
            self.to_store.inc();
            self.count_down(-1);
            tracing::info!(node = node.name, "redis node answers again: checks of its keys go to it");
        }
    }

    fn count_down(&self, by: isize) {
        let now = if by > 0 {
            self.down.fetch_add(1, Ordering::AcqRel) + 1
        } else {
            self.down.fetch_sub(1, Ordering::AcqRel).saturating_sub(1)
        };
        self.degraded.set(i64::from(now > 0));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_node_goes_down_after_consecutive_failures_and_each_switch_counts_once() {
        let metrics = Metrics::new();
        let h = Health::new(&metrics);
        let a = h.node("10.0.0.1:6379", None);
        let b = h.node("10.0.0.2:6379", None);
        h.failed(&a, "timeout");
        h.failed(&a, "timeout");
        h.succeeded(&a);
        h.failed(&a, "timeout");
        h.failed(&a, "timeout");
        assert!(!a.is_down(), "a success in between resets the count");
        h.failed(&b, "timeout");
        assert!(!b.is_down(), "another node's failure does not count for this one");
        h.failed(&a, "timeout");
        assert!(a.is_down());
        assert!(!b.is_down(), "only the node that failed");
        h.failed(&a, "timeout");
        assert_eq!(metrics.store_degraded.get(), 1);
        assert_eq!(metrics.store_fallback_transitions_total.with_label_values(&["to_local"]).get(), 1);
        let up = |n: &str| metrics.store_node_up.with_label_values(&[n]).get();
        assert_eq!((up("10.0.0.1:6379"), up("10.0.0.2:6379")), (0, 1));
        assert_eq!(h.down_nodes().iter().map(|n| n.name.as_str()).collect::<Vec<_>>(), ["10.0.0.1:6379"]);
        h.succeeded(&a);
        assert!(a.is_down(), "only the probe takes a node back");
        h.recover(&a);
        h.recover(&a);
        assert!(!a.is_down());
        assert_eq!(metrics.store_degraded.get(), 0);
        assert_eq!(up("10.0.0.1:6379"), 1);
        let t = &metrics.store_fallback_transitions_total;
        assert_eq!(t.with_label_values(&["to_local"]).get(), 1);
        assert_eq!(t.with_label_values(&["to_store"]).get(), 1);
    }

    #[test]
    fn a_node_that_no_longer_owns_slots_is_forgotten_and_its_keys_are_back() {
        let metrics = Metrics::new();
        let h = Health::new(&metrics);
        let old = h.node("10.0.0.1:6379", None);
        h.node("10.0.0.2:6379", None);
        h.degrade(&old, "timeout");
        assert!(h.is_degraded());
        // Failed over: the replica on .3 owns its slots now.
        h.node("10.0.0.3:6379", None);
        h.retain(&["10.0.0.2:6379", "10.0.0.3:6379"]);
        assert!(!h.is_degraded());
        assert_eq!(metrics.store_degraded.get(), 0);
        assert_eq!(h.all_nodes().len(), 2);
        let t = &metrics.store_fallback_transitions_total;
        assert_eq!(t.with_label_values(&["to_store"]).get(), 1);
        assert!(!metrics.render().contains("node=\"10.0.0.1:6379\""), "its gauge is removed");
        // A call to it that was out meanwhile fails: it stays forgotten.
        h.degrade(&old, "timeout");
        assert!(!h.is_degraded());
        // Known again later (a failback), it starts up.
        assert!(!h.node("10.0.0.1:6379", None).is_down());
    }
}
