//! Asking Redis whether it answers: the probe that takes a node that is
//! down back (see [`health`](super::health)), and the survey of every node
//! for `/healthz/store` and `/readyz`.

use std::sync::Arc;
use std::time::Duration;

use fred::interfaces::{ClientLike, ClusterInterface};
use fred::types::config::{Options, Server};

use super::call;
use super::health::{Node, PROBE_EVERY};
use super::shared::Shared;
use crate::store::StoreError;

/// The shortest a recovery probe may wait (longer if the store timeout is).
const PROBE_TIMEOUT: Duration = Duration::from_millis(250);
/// The longest a node's probe for `/healthz/store` and `/readyz` waits:
/// within the admin endpoints' own 500 ms bound, so that one frozen node
/// is reported as such instead of the whole store timing out.
const SURVEY_TIMEOUT: Duration = Duration::from_millis(300);

fn probe_options(node: Option<Server>, timeout: Duration) -> Options {
    Options { timeout: Some(timeout), max_attempts: Some(1), cluster_node: node, ..Default::default() }
}

impl Shared {
    /// Asks Redis whether it answers: `PING`, or on a cluster `CLUSTER
    /// INFO` reporting `cluster_state:ok` (a cluster that lost a master
    /// answers pings but not every slot). Every pooled client is asked,
    /// each through whichever node it picks.
    pub(super) async fn probe(&self) -> Result<(), StoreError> {
        self.probe_within(self.probe_timeout()).await
    }

    async fn probe_within(&self, timeout: Duration) -> Result<(), StoreError> {
        for client in self.pool.clients() {
            let client = client.with_options(&probe_options(None, timeout));
            if self.clustered {
                cluster_ok(client.cluster_info().await, self.timeout)?;
            } else {
                let _: String = client.ping(None).await.map_err(|e| call::store_error(&e, self.timeout))?;
            }
        }
        Ok(())
    }

    /// Asks `node` alone whether it answers: a cluster node `CLUSTER INFO`
    /// (its own view must be `cluster_state:ok`: a node of a cluster that
    /// lost a master refuses every key), else [`probe`](Self::probe).
    pub(super) async fn probe_node(&self, node: &Node, timeout: Duration) -> Result<(), StoreError> {
        let Some(server) = &node.server else { return self.probe_within(timeout).await };
        let client = self.pool.next().with_options(&probe_options(Some(server.clone()), timeout));
        cluster_ok(client.cluster_info().await, self.timeout)
    }

    fn probe_timeout(&self) -> Duration {
        PROBE_TIMEOUT.max(self.timeout)
    }

    /// Probes every node that is down and takes back those that answer.
    pub(super) async fn probe_down_nodes(&self) {
        let down = self.health.down_nodes();
        let probes = down.iter().map(|n| self.probe_node(n, self.probe_timeout()));
        for (node, answer) in down.iter().zip(futures::future::join_all(probes).await) {
            if answer.is_ok() {
                self.health.recover(node);
            }
        }
    }

    /// While a node is down, probes the nodes down every [`PROBE_EVERY`].
    pub(super) async fn probe_loop(self: Arc<Self>) {
        loop {
            if !self.health.is_degraded() {
                self.health.wake.notified().await;
                continue;
            }
            tokio::time::sleep(PROBE_EVERY).await;
            self.probe_down_nodes().await;
        }
    }

    /// The nodes that answer now and those that do not (down, or failing a
    /// probe within [`SURVEY_TIMEOUT`]), by name: what `/healthz/store` and
    /// `/readyz` report.
    pub(super) async fn survey(&self) -> (Vec<String>, Vec<(String, StoreError)>) {
        let timeout = self.probe_timeout().min(SURVEY_TIMEOUT);
        let nodes = self.health.all_nodes();
        let answers = nodes.iter().map(|n| async move {
            if n.is_down() {
                return Err(StoreError::Unavailable("did not answer recent calls; waiting for it to come back".into()));
            }
            self.probe_node(n, timeout).await
        });
        let (mut up, mut down) = (Vec::new(), Vec::new());
        for (node, answer) in nodes.iter().zip(futures::future::join_all(answers).await) {
            match answer {
                Ok(()) => up.push(node.name.clone()),
                Err(e) => down.push((node.name.clone(), e)),
            }
        }
        up.sort();
        down.sort_by(|a, b| a.0.cmp(&b.0));
        (up, down)
    }
}

/// A `CLUSTER INFO` answer: `Ok` when it reports `cluster_state:ok`.
fn cluster_ok(answer: Result<String, fred::error::Error>, timeout: Duration) -> Result<(), StoreError> {
    let info = answer.map_err(|e| call::store_error(&e, timeout))?;
    if !info.contains("cluster_state:ok") {
        return Err(StoreError::Unavailable("the cluster reports cluster_state other than ok".into()));
    }
    Ok(())
}
