//! One request's checks: the over-limit cache, the leases held here, one
//! script call per remaining rule (sent together), and the consume-and-
//! refund that keeps a rejected request from counting anywhere.

use std::sync::Arc;
use std::time::Instant;

use super::cache;
use super::call::Failure;
use super::lease::Ahead;
use super::scripts::{self, LeaseArgs, Reply, ScriptMode, redis_key};
use super::shared::Shared;
use super::slots::Slots;
use crate::config::OnError;
use crate::limiter::{Boxed, Verdict};
use crate::store::{Answer, Check, Mode, StoreError};

impl Shared {
    /// Decides `checks`; answers the concurrency slots an admitted request
    /// now holds (in Redis, and in the fallback for `local` rules Redis
    /// could not decide), which the caller keeps until the request ends.
    pub(super) async fn check_holding(
        self: &Arc<Self>,
        checks: &[Check<'_>],
        mode: Mode,
    ) -> (Vec<Answer>, Option<Slots>) {
        let started = Instant::now();
        let keys: Vec<String> = checks.iter().map(|c| redis_key(&self.key_prefix, c.key, c.limits.algorithm)).collect();
        let consume = mode == Mode::Consume;

        let mut probes: Vec<usize> = Vec::new();
        if consume {
            match self.answer_from_cache(checks, &keys, started) {
                Ok(verdicts) => {
                    self.metrics.local_cache_hits_total.inc();
                    return (verdicts.into_iter().map(Ok).collect(), None);
                }
                Err(p) => probes = p,
            }
        }
        // Checks that leased quota held here can answer (see `lease`), and
        // the lease each was taken from, for a give-back.
        let (local, tokens) = if consume && self.leases.enabled() {
            self.take_leases(checks, &keys, started)
        } else {
            (vec![None; checks.len()], vec![0; checks.len()])
        };
        self.forget_probes_leased(&probes, &local, &keys);
        if consume && self.leases.enabled() && local.iter().all(Option::is_some) {
            self.metrics.lease_hits_total.inc();
            return (local.into_iter().flatten().map(Ok).collect(), None);
        }
        // Sliding window log entries and concurrency slots are named by
        // request, so a refund removes exactly this request's entry.
        let ids: Vec<String> = checks
            .iter()
            .map(|c| if c.limits.algorithm.names_requests() { self.ids.next() } else { String::new() })
            .collect();
        let asked: Vec<usize> = (0..checks.len()).filter(|&i| local[i].is_none()).collect();
        let results = self.ask(checks, &keys, &ids, &asked, mode, started).await;
        let now = Instant::now();

        // A probe Redis admitted clears its key's entry (one it rejected is
        // remembered anew below).
        for &i in &probes {
            let admitted = asked
                .iter()
                .position(|&j| j == i)
                .is_some_and(|at| results[at].as_ref().is_ok_and(|r| r.verdict.allowed));
            if admitted {
                self.cache.forget(&keys[i]);
            }
        }
        if results.iter().any(Result::is_err) {
            self.metrics.store_errors_total.with_label_values(&["redis"]).inc();
        }
        self.register_penalties(checks, &asked, &results);

        let mut answers = answers(&local, &asked, &results);
        let mut rejected = self.note_rejections(checks, &keys, &answers, &local, consume, now);
        let denied = checks.iter().zip(&answers).any(|(c, a)| c.enforced && a.is_err() && c.on_error == OnError::Deny);
        // Failed rules whose policy is `local` are decided in this process,
        // unless the request is refused anyway (then they count nowhere).
        let mut local_slots = None;
        if !rejected && !denied {
            let (fallback_rejected, slots) = self.fall_back(checks, &mut answers, mode);
            rejected |= fallback_rejected;
            local_slots = slots;
        }
        if consume && (rejected || denied) {
            // The request counts nowhere: give back what the rules that did
            // answer counted (the fallback counted nothing for a rejected
            // request), concurrency slots included.
            self.uncount(checks, &keys, &ids, &asked, &results, (&local, &tokens));
            return (answers, None);
        }
        let slots = if consume { self.hold(checks, &keys, ids, &asked, &results, local_slots, now) } else { None };
        (answers, slots)
    }

    /// A probe a lease answered is not asked, so no reply reports it: its
    /// entry is cleared now, as an admission by Redis would clear it. Units
    /// leased here are counted in Redis for this instance, so the rejection
    /// no longer holds for it; left standing (a renewal granted while the
    /// key ran out), every probe would wait out the store timeout.
    fn forget_probes_leased(&self, probes: &[usize], local: &[Option<Verdict>], keys: &[String]) {
        for &i in probes {
            if local[i].is_some() {
                self.cache.forget(&keys[i]);
            }
        }
    }

    /// Lists the keys these answers put in the penalty box (in the
    /// background: see `blocks`).
    fn register_penalties(self: &Arc<Self>, checks: &[Check<'_>], asked: &[usize], results: &[Result<Reply, Failure>]) {
        for (&i, result) in asked.iter().zip(results) {
            if let (Ok(reply), Some(p)) = (result, checks[i].penalty)
                && reply.verdict.boxed == Boxed::Entered
            {
                self.register_penalty(checks[i].key, p.duration);
            }
        }
    }

    /// Takes what leases held here can answer of `checks` (`None` for the
    /// others), with the lease each was taken from; sends the renewals
    /// ahead that made due.
    fn take_leases(
        self: &Arc<Self>,
        checks: &[Check<'_>],
        keys: &[String],
        started: Instant,
    ) -> (Vec<Option<Verdict>>, Vec<i64>) {
        let mut local: Vec<Option<Verdict>> = vec![None; checks.len()];
        let mut tokens = vec![0i64; checks.len()];
        let mut ahead = Vec::new();
        for (((slot, token), c), key) in local.iter_mut().zip(&mut tokens).zip(checks).zip(keys) {
            if c.settles {
                continue;
            }
            *slot = self.leases.take(key, &c.limits, c.cost, started, self.timeout).map(|taken| {
                ahead.extend(taken.ahead);
                *token = taken.token;
                taken.verdict
            });
        }
        // Not sent to a node that is down: the next take may try again.
        let (ahead, unsent): (Vec<Ahead>, Vec<Ahead>) = ahead.into_iter().partition(|a| !self.node_down(&a.key));
        for a in &unsent {
            self.leases.unsent(a);
        }
        if !ahead.is_empty() {
            self.renew_ahead(ahead, started);
        }
        (local, tokens)
    }

    /// Asks Redis the checks `asked`, with a lease wanted for each where
    /// leases serve, and records what was leased.
    async fn ask(
        self: &Arc<Self>,
        checks: &[Check<'_>],
        keys: &[String],
        ids: &[String],
        asked: &[usize],
        mode: Mode,
        started: Instant,
    ) -> Vec<Result<Reply, Failure>> {
        let consume = mode == Mode::Consume;
        let script_mode = if consume { ScriptMode::Consume } else { ScriptMode::Peek };
        let deadline = started + self.timeout;
        let wants: Vec<LeaseArgs> = asked
            .iter()
            .map(|&i| {
                let c = &checks[i];
                if consume && self.leases.enabled() && !c.settles {
                    self.leases.want(&keys[i], &c.limits, c.cost, started, self.timeout)
                } else {
                    LeaseArgs::default()
                }
            })
            .collect();
        // Queued together (see `batch`): they go out in the next calls to
        // their nodes, with other requests' checks, so all rules cost one
        // round trip. A check whose node is down is not sent: its rule's
        // policy answers at once (see `health`).
        let calls = asked.iter().zip(&wants).map(|(&i, &lease)| {
            let c = &checks[i];
            let args = scripts::args_with_penalty(script_mode, &c.limits, c.cost, &ids[i], lease, c.penalty);
            let answer = self.submit(c.limits.algorithm, keys[i].clone(), args, deadline);
            async move { answer.await.map(|reply| reply.complete(&c.limits, c.cost)) }
        });
        let results: Vec<Result<Reply, Failure>> = futures::future::join_all(calls).await;

        // Record what was leased, whatever else happened: the units are
        // counted in Redis either way.
        let now = Instant::now();
        for ((&i, lease), result) in asked.iter().zip(&wants).zip(&results) {
            if lease.want == 0 {
                continue;
            }
            match result {
                Ok(reply) => {
                    if reply.granted > 0 {
                        self.metrics.leases_granted_total.inc();
                    }
                    if let Some(old) = self.leases.granted(&keys[i], &checks[i].limits, reply, started, now) {
                        self.give_back_to_redis(vec![old]);
                    }
                }
                Err(_) => self.leases.failed(&keys[i]),
            }
        }
        results
    }

    /// Whether an enforced rule rejected the request; when it consumes,
    /// remembers in the over-limit cache the keys Redis rejected or left
    /// exhausted.
    fn note_rejections(
        &self,
        checks: &[Check<'_>],
        keys: &[String],
        answers: &[Answer],
        local: &[Option<Verdict>],
        consume: bool,
        now: Instant,
    ) -> bool {
        let mut rejected = false;
        for (i, ((c, key), answer)) in checks.iter().zip(keys).zip(answers).enumerate() {
            let Ok(v) = answer else { continue };
            // A concurrency slot may come back any moment: every acquire
            // asks Redis.
            let exact = c.limits.algorithm.holds();
            if c.enforced && !v.allowed {
                rejected = true;
                if consume && !exact {
                    self.cache.remember(key, c.limits, c.cost, v, now);
                }
            } else if consume && c.enforced && v.remaining < c.cost && local[i].is_none() && !exact {
                self.cache.exhausted(key, c.limits, c.cost, v, now);
            }
        }
        rejected
    }

    /// Decides in this process the failed rules whose policy is `local`;
    /// answers whether one of them rejected the request, and the
    /// concurrency slots the fallback now holds for it.
    fn fall_back(
        &self,
        checks: &[Check<'_>],
        answers: &mut [Answer],
        mode: Mode,
    ) -> (bool, Option<crate::store::memory::Slots>) {
        let fallback: Vec<usize> =
            (0..checks.len()).filter(|&i| answers[i].is_err() && checks[i].on_error == OnError::Local).collect();
        if fallback.is_empty() {
            return (false, None);
        }
        let sub: Vec<Check<'_>> = fallback.iter().map(|&i| checks[i].clone()).collect();
        let (verdicts, slots) = self.local.check_holding(&sub, mode);
        let mut rejected = false;
        for (&i, v) in fallback.iter().zip(verdicts) {
            rejected |= checks[i].enforced && !v.allowed;
            answers[i] = Ok(Verdict { fallback: true, ..v });
        }
        (rejected, slots)
    }

    /// Sends the renewals ahead that spending leases made due (see
    /// `lease`), in the background: no request waits for them, and each
    /// goes with the next call to its node.
    fn renew_ahead(self: &Arc<Self>, ahead: Vec<Ahead>, sent: Instant) {
        let shared = self.clone();
        let deadline = sent + self.timeout;
        let answers: Vec<_> = ahead
            .iter()
            .map(|a| {
                let args = scripts::args(ScriptMode::Consume, &a.limits, 0, "", a.args);
                shared.submit_lazy(a.limits.algorithm, a.key.clone(), args, deadline)
            })
            .collect();
        self.metrics.lease_renewals_total.inc_by(ahead.len() as u64);
        tokio::spawn(async move {
            let results = futures::future::join_all(answers).await;
            let now = Instant::now();
            let mut back = Vec::new();
            for (a, result) in ahead.iter().zip(results) {
                match result {
                    Ok(reply) => {
                        let reply = reply.complete(&a.limits, 0);
                        if reply.granted > 0 {
                            shared.metrics.leases_granted_total.inc();
                        }
                        back.extend(shared.leases.renewed(a, &reply, sent, now));
                    }
                    Err(_) => {
                        shared.metrics.store_errors_total.with_label_values(&["redis"]).inc();
                        shared.leases.renew_failed(a);
                    }
                }
            }
            if !back.is_empty() {
                shared.give_back_to_redis(back);
            }
        });
    }

    /// The concurrency slots an admitted request took in Redis, now held
    /// here until it ends (see `slots`).
    #[allow(clippy::too_many_arguments)]
    fn hold(
        self: &Arc<Self>,
        checks: &[Check<'_>],
        keys: &[String],
        mut ids: Vec<String>,
        asked: &[usize],
        results: &[Result<Reply, Failure>],
        local: Option<crate::store::memory::Slots>,
        now: Instant,
    ) -> Option<Slots> {
        let mut held = Vec::new();
        for (&i, result) in asked.iter().zip(results) {
            if checks[i].limits.algorithm.holds() && result.as_ref().is_ok_and(|r| r.verdict.allowed) {
                let id = std::mem::take(&mut ids[i]);
                self.slots.hold(id.clone(), keys[i].clone(), checks[i].limits, now);
                held.push(id);
            }
        }
        if held.is_empty() && local.is_none() {
            return None;
        }
        Some(Slots { shared: self.clone(), ids: held, _local: local })
    }

    /// Undoes everything a request counted, in Redis (`asked` and their
    /// `results`) and in leases here (`local`, with the lease each was
    /// taken from): it ended up counting nowhere.
    fn uncount(
        self: &Arc<Self>,
        checks: &[Check<'_>],
        keys: &[String],
        ids: &[String],
        asked: &[usize],
        results: &[Result<Reply, Failure>],
        local: (&[Option<Verdict>], &[i64]),
    ) {
        let counted = asked.iter().zip(results).filter_map(|(&i, r)| match r {
            Ok(reply) if reply.verdict.allowed => Some((i, reply)),
            _ => None,
        });
        self.refund(checks, keys, ids, counted);
        self.give_back(checks, keys, local);
    }

    /// Returns the units taken from leases here for a request that ended up
    /// counting nowhere, each to the lease it was taken from.
    fn give_back(&self, checks: &[Check<'_>], keys: &[String], (local, tokens): (&[Option<Verdict>], &[i64])) {
        for (((c, key), v), &token) in checks.iter().zip(keys).zip(local).zip(tokens) {
            if v.is_some() {
                self.leases.give_back(key, &c.limits, c.cost, token);
            }
        }
    }

    /// Answers a request from the over-limit cache when one of its enforced
    /// checks is a key Redis rejected and whose retry moment has not come.
    /// Checks not in the cache are not asked either (the request is rejected
    /// anyway, and a rejected request counts nowhere): they are reported
    /// with nothing remaining until the rejection's retry moment, which is
    /// all the client can act on.
    ///
    /// Otherwise returns the checks this request is the probe for (see
    /// [`cache`]), whose outcome the caller reports.
    fn answer_from_cache(
        &self,
        checks: &[Check<'_>],
        keys: &[String],
        now: Instant,
    ) -> Result<Vec<Verdict>, Vec<usize>> {
        let mut known: Vec<Option<Verdict>> = vec![None; checks.len()];
        let mut probes = Vec::new();
        for (i, (c, k)) in checks.iter().zip(keys).enumerate() {
            if !c.enforced {
                continue;
            }
            match self.cache.lookup(k, &c.limits, c.cost, now, self.timeout) {
                cache::Lookup::Rejected(v) => known[i] = Some(v),
                cache::Lookup::Probe => probes.push(i),
                cache::Lookup::Unknown => {}
            }
        }
        let Some(blocker) = known.iter().flatten().next().copied() else { return Err(probes) };
        // Rejected anyway: the probes taken are not sent.
        for &i in &probes {
            self.cache.forget(&keys[i]);
        }
        Ok(known
            .into_iter()
            .map(|v| {
                v.unwrap_or(Verdict {
                    allowed: true,
                    remaining: 0,
                    reset_after: blocker.retry_after,
                    retry_after: 0,
                    delay: 0,
                    fallback: false,
                    boxed: Boxed::No,
                })
            })
            .collect())
    }
}

/// Every rule keeps its own answer: what a lease answered here, what Redis
/// answered, else its error.
fn answers(local: &[Option<Verdict>], asked: &[usize], results: &[Result<Reply, Failure>]) -> Vec<Answer> {
    let mut answers: Vec<Answer> = local.iter().map(|v| v.ok_or(StoreError::Protocol(String::new()))).collect();
    for (&i, result) in asked.iter().zip(results) {
        answers[i] = match result {
            // The client may use what this instance now holds for it.
            Ok(reply) => {
                Ok(Verdict { remaining: reply.verdict.remaining.saturating_add(reply.granted), ..reply.verdict })
            }
            Err(failure) => Err(failure.error.clone()),
        };
    }
    answers
}
