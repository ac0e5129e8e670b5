//! The periodic summary: one `info` log line per interval saying what the
//! proxy decided since the previous line.
//!
//! A rejected request is logged at `debug` (one line each, too many to keep
//! on at the edge); this line is what an operator reads at `info`. It is
//! computed from the Prometheus counters the request path already updates,
//! so it costs the request path nothing and always agrees with `/metrics`.
//! An interval without traffic logs nothing at `info`.

use std::collections::BTreeMap;
use std::sync::{Arc, Weak};
use std::time::Duration;

use prometheus::core::Collector;

use crate::obs::metrics::Metrics;

/// How often the summary is logged.
pub const EVERY: Duration = Duration::from_secs(60);

/// How many of the most-limiting rules the line names.
const TOP_RULES: usize = 3;

/// Counter values at one moment, or the difference between two moments.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Totals {
    /// `tollgate_requests_total` by `decision`, summed over routes.
    pub requests: BTreeMap<String, u64>,
    /// `tollgate_rule_decisions_total{decision="limited"}` by rule.
    pub limited_by_rule: BTreeMap<String, u64>,
    /// `tollgate_rule_decisions_total{decision="shadow_limited"}`, all rules.
    pub shadow_limited: u64,
    pub store_errors: u64,
    pub upstream_errors: u64,
}

impl Totals {
    /// Reads the counters now.
    pub fn read(metrics: &Metrics) -> Totals {
        let mut t = Totals::default();
        sum_by(&metrics.requests_total, "decision", |decision, v| {
            *t.requests.entry(decision.to_string()).or_default() += v;
        });
        // A rule that never limited is left out: `since` counts a rule
        // missing from the earlier reading from zero.
        for (rule, (limited, shadow_limited)) in metrics.rule_series.lock().iter() {
            let n = limited.get();
            if n > 0 {
                t.limited_by_rule.insert(rule.clone(), n);
            }
            t.shadow_limited += shadow_limited.get();
        }
        sum_by(&metrics.store_errors_total, "backend", |_, v| t.store_errors += v);
        sum_by(&metrics.upstream_errors_total, "upstream", |_, v| t.upstream_errors += v);
        t
    }

    /// What happened between `earlier` and `self` (counters only grow; a
    /// value missing from `earlier` counts from zero).
    pub fn since(&self, earlier: &Totals) -> Totals {
        let diff = |now: &BTreeMap<String, u64>, before: &BTreeMap<String, u64>| {
            now.iter()
                .map(|(k, v)| (k.clone(), v.saturating_sub(before.get(k).copied().unwrap_or(0))))
                .filter(|(_, v)| *v > 0)
                .collect()
        };
        Totals {
            requests: diff(&self.requests, &earlier.requests),
            limited_by_rule: diff(&self.limited_by_rule, &earlier.limited_by_rule),
            shadow_limited: self.shadow_limited.saturating_sub(earlier.shadow_limited),
            store_errors: self.store_errors.saturating_sub(earlier.store_errors),
            upstream_errors: self.upstream_errors.saturating_sub(earlier.upstream_errors),
        }
    }

    /// Requests with the given decision (`allowed`, `limited`,
    /// `store_unavailable`, `rejected`).
    pub fn decision(&self, decision: &str) -> u64 {
        self.requests.get(decision).copied().unwrap_or(0)
    }

    /// Every request decision with a count, as `decision=count, ...`
    /// (complete, whatever decisions the proxy records).
    pub fn decisions(&self) -> String {
        self.requests.iter().filter(|(_, v)| **v > 0).map(|(k, v)| format!("{k}={v}")).collect::<Vec<_>>().join(", ")
    }

    /// Whether anything happened at all.
    pub fn is_quiet(&self) -> bool {
        self.requests.values().all(|v| *v == 0)
            && self.shadow_limited == 0
            && self.store_errors == 0
            && self.upstream_errors == 0
    }

    /// The rules that rejected the most requests, most first, as
    /// `rule=count, rule=count`.
    pub fn top_limited(&self, n: usize) -> String {
        let mut rules: Vec<(&String, &u64)> = self.limited_by_rule.iter().filter(|(_, v)| **v > 0).collect();
        rules.sort_by(|a, b| b.1.cmp(a.1).then_with(|| a.0.cmp(b.0)));
        rules.iter().take(n).map(|(r, v)| format!("{r}={v}")).collect::<Vec<_>>().join(", ")
    }
}

/// Adds up a counter vector's values by one label.
fn sum_by(vec: &prometheus::IntCounterVec, name: &str, mut add: impl FnMut(&str, u64)) {
    for family in vec.collect() {
        for m in family.get_metric() {
            add(label(m, name), m.get_counter().get_value() as u64);
        }
    }
}

/// The value of one label of a metric ("" when absent).
fn label<'m>(m: &'m prometheus::proto::Metric, name: &str) -> &'m str {
    m.get_label().iter().find(|l| l.name() == name).map_or("", |l| l.value())
}

/// Logs one interval's summary.
fn log(d: &Totals, every: Duration) {
    if d.is_quiet() {
        tracing::debug!(interval_seconds = every.as_secs(), "summary: no requests");
        return;
    }
    tracing::info!(
        interval_seconds = every.as_secs(),
        allowed = d.decision("allowed"),
        limited = d.decision("limited"),
        shadow_limited = d.shadow_limited,
        store_unavailable = d.decision("store_unavailable"),
        rejected = d.decision("rejected"),
        store_errors = d.store_errors,
        upstream_errors = d.upstream_errors,
        top_limited_rules = %d.top_limited(TOP_RULES),
        decisions = %d.decisions(),
        "summary"
    );
}

/// The running summary task; stops when dropped.
pub struct SummaryTask(tokio::task::JoinHandle<()>);

impl Drop for SummaryTask {
    fn drop(&mut self) {
        self.0.abort();
    }
}

/// Starts logging a summary every [`EVERY`]. Keep the returned handle for as
/// long as the summary should run.
pub fn spawn(metrics: &Arc<Metrics>) -> SummaryTask {
    spawn_every(metrics, EVERY)
}

/// [`spawn`] with another interval. The task holds the metrics weakly: it
/// also ends once they are gone.
pub fn spawn_every(metrics: &Arc<Metrics>, every: Duration) -> SummaryTask {
    let weak: Weak<Metrics> = Arc::downgrade(metrics);
    SummaryTask(tokio::spawn(async move {
        let Some(mut last) = weak.upgrade().map(|m| Totals::read(&m)) else { return };
        let mut ticker = tokio::time::interval_at(tokio::time::Instant::now() + every, every);
        ticker.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            ticker.tick().await;
            let Some(now) = weak.upgrade().map(|m| Totals::read(&m)) else { return };
            log(&now.since(&last), every);
            last = now;
        }
    }))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reads_and_differences_the_counters() {
        let m = Metrics::new();
        let orders = m.route_counters("orders");
        let search = m.route_counters("search");
        let login = m.rule_counters("login-by-ip");
        let per_ip = m.rule_counters("per-ip");
        orders.allowed.inc_by(5);
        search.allowed.inc_by(2);
        orders.limited.inc();
        login.limited.inc();
        let first = Totals::read(&m);
        assert_eq!(first.decision("allowed"), 7);
        assert_eq!(first.decision("limited"), 1);

        search.limited.inc_by(4);
        per_ip.limited.inc_by(3);
        login.limited.inc();
        per_ip.shadow_limited.inc_by(2);
        m.store_errors_total.with_label_values(&["memory"]).inc();
        m.upstream_errors_total.with_label_values(&["orders", "timeout"]).inc_by(2);
        let d = Totals::read(&m).since(&first);
        assert_eq!(d.decision("allowed"), 0);
        assert_eq!(d.decision("limited"), 4);
        assert_eq!(d.shadow_limited, 2);
        assert_eq!(d.store_errors, 1);
        assert_eq!(d.upstream_errors, 2);
        assert_eq!(d.top_limited(3), "per-ip=3, login-by-ip=1");
        assert_eq!(d.decisions(), "limited=4");
        assert!(!d.is_quiet());
    }

    #[test]
    fn an_idle_interval_is_quiet() {
        let m = Metrics::new();
        m.route_counters("orders").allowed.inc();
        let a = Totals::read(&m);
        let d = Totals::read(&m).since(&a);
        assert!(d.is_quiet());
        assert_eq!(d.top_limited(3), "");
    }

    /// On the paused clock: the task's tick after the drop comes before
    /// the test's check, however slow the machine.
    #[tokio::test(start_paused = true)]
    async fn the_task_ends_with_the_metrics() {
        let m = Arc::new(Metrics::new());
        let task = spawn_every(&m, Duration::from_millis(20));
        tokio::time::sleep(Duration::from_millis(50)).await;
        assert!(!task.0.is_finished());
        drop(m);
        tokio::time::sleep(Duration::from_millis(100)).await;
        assert!(task.0.is_finished());
    }
}
