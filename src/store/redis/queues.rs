//! The queues of checks waiting for a call to their node (see
//! [`batch`](super::batch), which fills and sends them).

use std::sync::Arc;
use std::time::Instant;

use fred::bytes_utils::Str;
use fred::types::Value;
use parking_lot::Mutex;
use tokio::sync::oneshot;

use super::call::Failure;
use super::health::Node;
use super::scripts::{self, Reply};

/// The queues of checks waiting for a call, per node and algorithm.
pub(super) struct Batcher {
    pub(super) state: Mutex<State>,
    pub(super) clustered: bool,
}

pub(super) struct State {
    /// The node (an index of fred's primaries) owning each slot; empty for
    /// a single server, or until the cluster's layout is known.
    pub(super) routes: Vec<u16>,
    /// When `routes` was read; `None` asks for a fresh read.
    pub(super) routed_at: Option<Instant>,
    /// The health of each node of `routes`, by index; the one node of a
    /// single server, or the whole cluster until its layout is known.
    pub(super) nodes: Vec<Arc<Node>>,
    /// `node * ALGORITHMS + algorithm`.
    pub(super) queues: Vec<Queue>,
}

#[derive(Default)]
pub(super) struct Queue {
    pub(super) waiting: Vec<Waiting>,
    /// Tasks sending this queue's checks, a call each at a time.
    pub(super) senders: usize,
    /// A timer will send the lazy checks waiting here if no call does.
    pub(super) timer: bool,
    /// When this queue's last call left, if it carried more than one
    /// check: the next call, even from a queue gone idle since, leaves no
    /// sooner than `batch::SPACING` after it (see `batch::send_queue`).
    pub(super) shared_at: Option<Instant>,
}

/// A check waiting for its call.
pub(super) struct Waiting {
    pub(super) key: Str,
    /// The key's cluster slot, hashed once when the check was queued.
    pub(super) slot: u16,
    pub(super) args: [Value; scripts::ARGS],
    pub(super) deadline: Instant,
    pub(super) reply: oneshot::Sender<Result<Reply, Failure>>,
}

impl Batcher {
    pub(super) fn new(clustered: bool, first: Arc<Node>) -> Batcher {
        let state = State { routes: Vec::new(), routed_at: None, nodes: vec![first], queues: Vec::new() };
        Batcher { state: Mutex::new(state), clustered }
    }
}
