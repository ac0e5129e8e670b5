//! Batching: the checks of concurrent requests bound for the same Redis
//! node and script go out in one call.
//!
//! One script call per check costs Redis a command's parsing, a scripting
//! entry, a `TIME` and a socket write, and costs this process a fred
//! command; all of that is paid once per call, whatever it decides. So
//! checks queue per node and algorithm, and each call takes everything
//! queued: a check that arrives while its queue is idle goes out on the
//! next turn of the runtime (with whatever else arrived in that turn), one
//! that arrives while the queue's call is out goes in the next one, which
//! leaves once that call is answered and at least [`SPACING`] after it was
//! sent. So does a check that finds its queue idle less than [`SPACING`]
//! after a call of several checks left: the queue emptied between two
//! calls under load, not at rest. A full batch ([`MAX_BATCH`]) does not
//! wait: it goes at once, with up to [`IN_FLIGHT`] calls out per queue.
//! Under light load nothing waits (a lone request's call carries one
//! check); under heavy load batches grow with it.
//!
//! In a cluster, a call goes to the node owning its first key and its
//! other keys travel as arguments, so a batch may span every slot of one
//! node (the scripts' `allow-cross-slot-keys` flag). Which node owns which
//! slot comes from fred's view of the cluster, refreshed every second and
//! after a miss; a key the node turns out not to own (a failover or
//! migration since) is answered `NotHere` by the script before anything is
//! written for it, and asked again in a call of its own, routed by its key.

use std::sync::Arc;
use std::time::{Duration, Instant};

use fred::bytes_utils::Str;
use fred::interfaces::ClusterInterface;
use fred::types::Value;
use tokio::sync::oneshot;

use super::call::{self, Failure};
use super::health::{Node, WHOLE_CLUSTER};
use super::queues::{Queue, Waiting};
use super::scripts::{self, Outcome, Reply};
use super::shared::Shared;
use crate::limiter::Algorithm;
use crate::store::StoreError;

/// Checks per call at most: bounds how long one call holds Redis (a few
/// microseconds per check) and the size of its reply.
const MAX_BATCH: usize = 64;

/// How often the slot map is read again from fred.
const ROUTES_EVERY: Duration = Duration::from_secs(1);

const SLOTS: usize = 16_384;

/// Calls out at once per queue, once batches are full: a queue that keeps
/// [`MAX_BATCH`] checks waiting is not held to one call per [`SPACING`].
const IN_FLIGHT: usize = 4;

/// While checks wait behind a queue's call, the next call leaves no sooner
/// than this after the one before (tokio's timers tick in milliseconds).
/// Each call costs a Redis node a wakeup, two system calls and a script
/// entry (25 to 31 µs of its CPU on edge-bench's shared core, against 4 to
/// 5 µs per check), and this process a fred command. With a cluster's three
/// masters sharing the load, calls sent as soon as the previous one came
/// back carried 5.6 checks on `spread`; spaced by a millisecond they carry
/// 16, and Redis spent 9.1 and 9.3 µs per request against 11.7 and 10.5,
/// tollgate 29.3 and 26.2 against 35.9 and 31.8 (`lease_percent = 0`). A
/// check that finds its queue idle goes at once, so a lone request (the
/// `latency` scenario: 185 against 181 µs at the median) does not wait.
const SPACING: Duration = Duration::from_millis(1);

/// How long a lazy check (a lease renewed ahead) waits for a call to its
/// node to go with before one leaves for it alone. The lease it renews
/// holds what its key spends here in `lease::LEAD` meanwhile.
const LAZY: Duration = Duration::from_millis(5);

const ALGORITHMS: usize = scripts::ALGORITHMS;

impl Shared {
    /// Queues one check for the next call to its key's node, and answers
    /// when that call does. The check is queued before this returns, so
    /// checks submitted together go out together.
    pub(super) fn submit(
        self: &Arc<Self>,
        algorithm: Algorithm,
        key: String,
        args: [Value; scripts::ARGS],
        deadline: Instant,
    ) -> impl Future<Output = Result<Reply, Failure>> + use<> {
        self.enqueue(algorithm, key, args, deadline, false)
    }

    /// As [`submit`](Self::submit), for a check no request waits for (a
    /// lease renewed ahead): it goes with the next call to its node, or
    /// [`LAZY`] after it was queued if none leaves before.
    pub(super) fn submit_lazy(
        self: &Arc<Self>,
        algorithm: Algorithm,
        key: String,
        args: [Value; scripts::ARGS],
        deadline: Instant,
    ) -> impl Future<Output = Result<Reply, Failure>> + use<> {
        self.enqueue(algorithm, key, args, deadline, true)
    }

    fn enqueue(
        self: &Arc<Self>,
        algorithm: Algorithm,
        key: String,
        args: [Value; scripts::ARGS],
        deadline: Instant,
        lazy: bool,
    ) -> impl Future<Output = Result<Reply, Failure>> + use<> {
        let (reply, answer) = oneshot::channel();
        let slot = fred::util::redis_keyslot(key.as_bytes());
        let (queue, node) = self.queue_at(slot, algorithm);
        let key = Str::from(key);
        let (start, arm) = if node.is_down() {
            // Not sent: its policy answers at once (see `health`).
            let error = format!("redis node {} did not answer recent calls; waiting for it to come back", node.name);
            let _ = reply.send(Err(Failure { error: StoreError::Unavailable(error), outage: false }));
            (false, false)
        } else {
            let mut state = self.batcher.state.lock();
            if state.queues.len() <= queue {
                state.queues.resize_with(queue + 1, Queue::default);
            }
            let q = &mut state.queues[queue];
            q.waiting.push(Waiting { key, slot, args, deadline, reply });
            // An idle queue sends at once (a lazy check waits for a call or
            // the timer); a busy one only a full batch.
            let full = q.waiting.len() >= MAX_BATCH;
            let start = (!lazy && q.senders == 0) || (q.senders < IN_FLIGHT && full);
            if start {
                q.senders += 1;
            }
            let arm = lazy && q.senders == 0 && !q.timer;
            if arm {
                q.timer = true;
            }
            (start, arm)
        };
        if start {
            tokio::spawn(self.clone().send_queue(queue, algorithm));
        }
        if arm {
            let shared = self.clone();
            tokio::spawn(async move {
                tokio::time::sleep(LAZY).await;
                let start = {
                    let mut state = shared.batcher.state.lock();
                    let q = &mut state.queues[queue];
                    q.timer = false;
                    let start = q.senders == 0 && !q.waiting.is_empty();
                    if start {
                        q.senders += 1;
                    }
                    start
                };
                if start {
                    shared.send_queue(queue, algorithm).await;
                }
            });
        }
        async move {
            answer.await.unwrap_or_else(|_| {
                Err(Failure { error: StoreError::Unavailable("the check's call was dropped".into()), outage: false })
            })
        }
    }

    /// The queue for `algorithm` of the node owning `slot`, and that node.
    fn queue_at(&self, slot: u16, algorithm: Algorithm) -> (usize, Arc<Node>) {
        let (index, node) = self.node_at(slot);
        (index * ALGORITHMS + scripts::index(algorithm), node)
    }

    /// The node owning `slot` now (as fred routes it), and its index.
    /// (Hashing a key to its slot costs as much as the rest of this: a
    /// check's slot is hashed once, when it is queued.)
    fn node_at(&self, slot: u16) -> (usize, Arc<Node>) {
        if self.batcher.clustered {
            let stale = {
                let state = self.batcher.state.lock();
                state.routed_at.is_none_or(|at| at.elapsed() >= ROUTES_EVERY)
            };
            if stale {
                self.read_routes();
            }
        }
        let state = self.batcher.state.lock();
        let slot = usize::from(slot);
        let index = if self.batcher.clustered { usize::from(state.routes.get(slot).copied().unwrap_or(0)) } else { 0 };
        match state.nodes.get(index).or(state.nodes.first()) {
            Some(node) => (index, node.clone()),
            // `nodes` starts with one and is only ever replaced by a
            // non-empty list; this is the same node, made again.
            None => (0, self.health.node(WHOLE_CLUSTER, None)),
        }
    }

    /// Whether the node owning `key` is down (its checks are not sent).
    pub(super) fn node_down(&self, key: &str) -> bool {
        // With every node up (the count is kept with each node's flag), no
        // key needs hashing to know.
        self.health.is_degraded() && self.node_at(fred::util::redis_keyslot(key.as_bytes())).1.is_down()
    }

    /// Reads fred's slot map: each slot's primary, as an index, and the
    /// health of each primary (forgetting the nodes that own no slot now).
    pub(super) fn read_routes(&self) {
        let routing = self.pool.next().cached_cluster_state();
        let mut routes = Vec::new();
        let mut healths = Vec::new();
        if let Some(routing) = routing {
            let nodes = routing.unique_primary_nodes();
            let names: Vec<String> = nodes.iter().map(ToString::to_string).collect();
            healths = nodes.iter().zip(&names).map(|(s, name)| self.health.node(name, Some(s.clone()))).collect();
            if !names.is_empty() {
                self.health.retain(&names.iter().map(String::as_str).collect::<Vec<_>>());
            }
            routes = vec![0u16; SLOTS];
            for range in routing.slots() {
                let node = nodes.iter().position(|n| *n == range.primary).unwrap_or(0);
                let node = u16::try_from(node).unwrap_or(0);
                let (start, end) = (usize::from(range.start), usize::from(range.end).min(SLOTS - 1));
                if start <= end {
                    routes[start..=end].fill(node);
                }
            }
        }
        let mut state = self.batcher.state.lock();
        // Without a layout yet, ask again on the next check.
        state.routed_at = (!routes.is_empty()).then(Instant::now);
        state.routes = routes;
        if !healths.is_empty() {
            state.nodes = healths;
        }
    }

    /// Sends the checks of one queue, a call at a time, until none waits.
    async fn send_queue(self: Arc<Self>, queue: usize, algorithm: Algorithm) {
        // Checks submitted in this turn of the runtime join the first call.
        tokio::task::yield_now().await;
        let mut sending = Sending { shared: &self, queue, done: false };
        // Spaced from the queue's last call of several checks, even if the
        // queue went idle since (see `Queue::shared_at`).
        let mut sent_at: Option<Instant> = self.batcher.state.lock().queues[queue].shared_at;
        loop {
            if let Some(at) = sent_at {
                let next = at + SPACING;
                let waiting = self.batcher.state.lock().queues[queue].waiting.len();
                if waiting > 0 && waiting < MAX_BATCH && next > Instant::now() {
                    tokio::time::sleep_until(next.into()).await;
                }
            }
            let batch: Vec<Waiting> = {
                let mut state = self.batcher.state.lock();
                let q = &mut state.queues[queue];
                // The last sender of a queue stays while checks wait; the
                // others (sent for full batches) leave it to that one.
                if q.waiting.is_empty() || (q.senders > 1 && q.waiting.len() < MAX_BATCH) {
                    q.senders -= 1;
                    sending.done = true;
                    return;
                }
                let batch: Vec<Waiting> = if q.waiting.len() <= MAX_BATCH {
                    std::mem::take(&mut q.waiting)
                } else {
                    q.waiting.drain(..MAX_BATCH).collect()
                };
                let now = Instant::now();
                sent_at = Some(now);
                if batch.len() > 1 {
                    q.shared_at = Some(now);
                }
                batch
            };
            self.send_batch(algorithm, batch).await;
        }
    }

    /// One call for `batch`; every check gets its answer.
    async fn send_batch(self: &Arc<Self>, algorithm: Algorithm, batch: Vec<Waiting>) {
        let now = Instant::now();
        // Those that waited past their deadline behind a slow call.
        let (batch, late): (Vec<Waiting>, Vec<Waiting>) = batch.into_iter().partition(|w| w.deadline > now);
        for w in late {
            let _ = w.reply.send(Err(Failure { error: StoreError::Timeout(self.timeout), outage: true }));
        }
        let (Some(deadline), Some(first)) = (batch.iter().map(|w| w.deadline).min(), batch.first()) else { return };
        // Where fred sends the call: the owner of its first key.
        let (node, slot) = (self.node_at(first.slot).1, first.slot);
        let jobs: Vec<call::Job<'_>> = batch.iter().map(|w| (&w.key, &w.args)).collect();
        let script = self.scripts.get(algorithm);
        self.metrics.redis_calls_total.inc();
        self.metrics.redis_call_checks_total.inc_by(jobs.len() as u64);
        let result = call::run_batch(self.pool.next(), script, slot, &jobs, deadline, self.timeout).await;
        self.record(&node, result.as_ref().err());
        drop(jobs);
        let outcomes = match result {
            Ok(outcomes) => outcomes,
            Err(failure) => {
                for w in batch {
                    let _ = w.reply.send(Err(failure.clone()));
                }
                return;
            }
        };
        let mut elsewhere = Vec::new();
        for (w, outcome) in batch.into_iter().zip(outcomes) {
            let answer = match outcome {
                Outcome::Decided(reply) => Ok(reply),
                Outcome::Failed(error) => Err(Failure { error: StoreError::Protocol(error), outage: false }),
                Outcome::NotHere => {
                    elsewhere.push(w);
                    continue;
                }
            };
            let _ = w.reply.send(answer);
        }
        if !elsewhere.is_empty() {
            self.batcher.state.lock().routed_at = None;
            self.metrics.redis_misrouted_total.inc_by(elsewhere.len() as u64);
            tracing::debug!(checks = elsewhere.len(), "keys not on the node the slot map named; asking their owners");
            tokio::spawn(self.clone().send_each(algorithm, elsewhere));
        }
    }

    /// Each check in a call of its own, routed by its key.
    async fn send_each(self: Arc<Self>, algorithm: Algorithm, checks: Vec<Waiting>) {
        let script = self.scripts.get(algorithm);
        let shared = &self;
        self.metrics.redis_calls_total.inc_by(checks.len() as u64);
        self.metrics.redis_call_checks_total.inc_by(checks.len() as u64);
        let calls = checks.into_iter().map(|w| async move {
            let node = shared.node_at(w.slot).1;
            let result = call::run(shared.pool.next(), script, &w.key, w.args, w.deadline, shared.timeout).await;
            shared.record(&node, result.as_ref().err());
            let _ = w.reply.send(result);
        });
        futures::future::join_all(calls).await;
    }

    /// Counts a call's outcome towards its node's health: an answer resets
    /// the node's failures, an outage-like error adds one (see `health`).
    /// A key-level error (`WRONGTYPE`...) says the node answered.
    fn record(&self, node: &Node, failure: Option<&Failure>) {
        match failure {
            Some(f) if f.outage => self.health.failed(node, &f.error.to_string()),
            _ => self.health.succeeded(node),
        }
    }
}

/// Marks a queue idle if its task ends without doing so (a panic, or the
/// runtime shutting down), and fails the checks still waiting in it: no
/// check waits for a call nobody will send.
struct Sending<'a> {
    shared: &'a Shared,
    queue: usize,
    done: bool,
}

impl Drop for Sending<'_> {
    fn drop(&mut self) {
        if self.done {
            return;
        }
        let waiting = match self.shared.batcher.state.lock().queues.get_mut(self.queue) {
            Some(q) => {
                q.senders = q.senders.saturating_sub(1);
                if q.senders == 0 { std::mem::take(&mut q.waiting) } else { Vec::new() }
            }
            None => Vec::new(),
        };
        for w in waiting {
            let error = StoreError::Unavailable("the check's call was dropped".into());
            let _ = w.reply.send(Err(Failure { error, outage: false }));
        }
    }
}
