//! Hot reload of the rules, and of the main file's routes and upstreams:
//! notify -> debounce -> validate -> swap.
//!
//! The main file is watched and polled like the rules. A valid new main
//! file puts its `[[upstream]]` and `[[route]]` tables in force (requests
//! under way finish on the old ones); what else it changed (listeners, the
//! store, `[client]`, `[log]`, the rules path) applies only after a restart,
//! and the reload says so in its log line. A broken main file keeps the
//! running config, like a broken rules file does.
//!
//! The rules path is watched (with [`crate::config::watch`]) together with
//! its parent directory, so that both an edited file and a Kubernetes
//! ConfigMap style swap (a `..data` symlink, or the rules directory itself
//! being a symlink that is atomically replaced) are seen. Bursts of events
//! are debounced, the files' metadata is polled as a backstop, and every
//! look at the files (the poll, a reload) runs on the background thread
//! ([`crate::config::watch::background`], SCHED_IDLE), which also frees the
//! rules replaced.
//!
//! A reload costs what changed: the rules whose text did not change are
//! taken from the last look rather than parsed and validated again
//! ([`RulesCache`]), and those whose spec did not change are the compiled
//! rules in force, shared ([`RuleSet::from_loaded_reusing`]). Measured with
//! `benches/reload_callgrind.sh` (10,000 rules, one edited): see
//! docs/benchmarks.md.
//!
//! An invalid rule set never replaces a valid one: the previous rules keep
//! running, the error is logged with file:line:column, the failure is
//! counted and shown on `/rules`.

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use parking_lot::Mutex;
use std::time::{Duration, Instant, SystemTime};

use crate::config::watch::{self, Target, file_fingerprint, files_fingerprint};
use crate::config::{Config, ConfigErrors, RulesCache, load_rules_cached};
use crate::limit::rules::RuleSet;
use crate::proxy::Proxy;

/// The outcome of the most recent reload, for `/rules` and tests.
#[derive(Debug, Clone, Default)]
pub struct ReloadStatus {
    pub last_success: Option<SystemTime>,
    pub last_error: Option<String>,
    pub last_error_at: Option<SystemTime>,
    pub reloads: u64,
    pub failures: u64,
}

/// Reloads the rules for one proxy.
pub struct Reloader {
    /// The config in force: the one tollgate started with, its routes and
    /// upstreams replaced by each successful reload of the main file.
    config: Mutex<Config>,
    /// The main file's fingerprint at the last look.
    main_fingerprint: Mutex<u64>,
    proxy: Arc<Proxy>,
    pub status: Mutex<ReloadStatus>,
    fingerprint: Mutex<u64>,
    /// `[client] jwt = { jwks_file = ... }`: the file and its last
    /// fingerprint. Polled with the rules; a changed key set is swapped in,
    /// an unreadable or invalid one keeps the old keys.
    jwks: Option<(PathBuf, Mutex<u64>)>,
    /// How many times the contents of a rules or JWKS file were read.
    content_reads: AtomicU64,
    /// What the last reload read of each rules file, for the next (see
    /// [`RulesCache`]). Held from reading the files to swapping in the
    /// rules, which share the unchanged rules of those in force: two
    /// reloads at once (SIGHUP during a poll, a reload by hand) take turns.
    swapping: Mutex<RulesCache>,
}

impl Reloader {
    /// `cache` holds what start-up read of the rules files (see
    /// [`RulesCache`]).
    pub fn new(config: Config, proxy: Arc<Proxy>, cache: RulesCache) -> Reloader {
        let fingerprint = Mutex::new(fingerprint(&config.rules_path));
        let main_fingerprint = Mutex::new(file_fingerprint(&config.path));
        let status = ReloadStatus { last_success: Some(SystemTime::now()), ..Default::default() };
        let jwks = proxy.jwt().and_then(|j| j.jwks_path()).map(|p| (p.clone(), Mutex::new(file_fingerprint(p))));
        Reloader {
            config: Mutex::new(config),
            main_fingerprint,
            proxy,
            status: Mutex::new(status),
            fingerprint,
            jwks,
            content_reads: AtomicU64::new(0),
            swapping: Mutex::new(cache),
        }
    }

    /// How many times the contents of a rules or JWKS file were read (a
    /// reload, a changed JWKS): an unchanged file is never read.
    pub fn content_reads(&self) -> u64 {
        self.content_reads.load(Ordering::Relaxed)
    }

    /// Reloads the rules if their files changed, and the JWKS if it did.
    /// Returns whether the rules were reloaded. Blocking (file IO): the
    /// watcher runs it on a blocking thread.
    pub fn poll(&self) -> bool {
        let path = self.config.lock().path.clone();
        let main = file_fingerprint(&path);
        if main != std::mem::replace(&mut *self.main_fingerprint.lock(), main) {
            let _ = self.reload_config();
        }
        let reloaded = self.changed();
        if reloaded {
            let _ = self.reload();
        }
        self.reload_jwks_if_changed();
        reloaded
    }

    /// Re-reads the JWKS file if it changed since the last look.
    pub fn reload_jwks_if_changed(&self) {
        let (Some((path, last)), Some(jwt)) = (&self.jwks, self.proxy.jwt()) else { return };
        let now = file_fingerprint(path);
        if now == std::mem::replace(&mut *last.lock(), now) {
            return;
        }
        self.content_reads.fetch_add(1, Ordering::Relaxed);
        match std::fs::read(path).map_err(|e| e.to_string()).and_then(|b| jwt.reload_jwks(&b)) {
            Ok(()) => tracing::info!(path = %path.display(), "JWKS reloaded"),
            Err(e) => tracing::error!(path = %path.display(), "JWKS reload failed, previous keys stay in force: {e}"),
        }
    }

    /// Reads, validates and swaps in the rules now. On error the old rules
    /// stay.
    pub fn reload(&self) -> Result<(), ConfigErrors> {
        let m = &self.proxy.metrics;
        let config = self.config.lock().clone();
        let mut swapping = self.swapping.lock();
        let (print, racy) = fingerprint_racy(&config.rules_path);
        // A file modified within the timestamps' resolution of this look
        // could be written again with the same metadata: look again next
        // time (at most one extra reload).
        *self.fingerprint.lock() = if racy { 0 } else { print };
        self.content_reads.fetch_add(1, Ordering::Relaxed);
        match load_rules_cached(&config.rules_path, &config, Some(&mut swapping)) {
            Ok(loaded) => {
                let set = RuleSet::from_loaded_reusing(loaded, m, Some(&self.proxy.rules().load_full()));
                let n = set.rules.len();
                let old = self.proxy.swap_rules(set);
                drop(swapping);
                m.rules_reloads_total.with_label_values(&["success"]).inc();
                let mut s = self.status.lock();
                s.last_success = Some(SystemTime::now());
                s.last_error = None;
                s.reloads += 1;
                tracing::info!(rules = n, path = %config.rules_path.display(), "rules reloaded");
                drop(s);
                // Last: the reload is counted and shown before this waits.
                retire(old);
                Ok(())
            }
            Err(e) => {
                m.rules_reloads_total.with_label_values(&["failure"]).inc();
                let mut s = self.status.lock();
                s.last_error = Some(e.to_string());
                s.last_error_at = Some(SystemTime::now());
                s.failures += 1;
                for err in &e.0 {
                    tracing::error!("rules reload failed, previous rules stay in force: {err}");
                }
                Err(e)
            }
        }
    }

    /// The config in force (its routes and upstreams as last reloaded).
    pub fn running(&self) -> Config {
        self.config.lock().clone()
    }

    /// Whether the files changed since the last reload attempt.
    fn changed(&self) -> bool {
        fingerprint(&self.config.lock().rules_path) != *self.fingerprint.lock()
    }

    /// Reads and validates the main file now and puts its routes and
    /// upstreams in force; on error the running config stays. The rules are
    /// then validated again against the new routes and upstreams.
    pub fn reload_config(&self) -> Result<(), ConfigErrors> {
        let m = &self.proxy.metrics;
        let path = self.config.lock().path.clone();
        let new = match Config::load(&path) {
            Ok(c) => c,
            Err(e) => {
                m.config_reloads_total.with_label_values(&["failure"]).inc();
                for err in &e.0 {
                    tracing::error!("config reload failed, the running config stays in force: {err}");
                }
                return Err(e);
            }
        };
        let restart = {
            let mut running = self.config.lock();
            let restart = needs_restart(&running, &new);
            self.proxy.reroute(&new);
            running.upstreams = new.upstreams;
            running.routes = new.routes;
            restart
        };
        m.config_reloads_total.with_label_values(&["success"]).inc();
        // Rules are validated against the routes and `[client]`.
        self.swapping.lock().clear();
        if restart.is_empty() {
            tracing::info!(path = %path.display(), "routes and upstreams reloaded");
        } else {
            tracing::warn!(
                path = %path.display(),
                "routes and upstreams reloaded; {} changed too and apply only after a restart",
                restart.join(", ")
            );
        }
        let _ = self.reload();
        Ok(())
    }

    /// Watches the rules path and the main file until the task is dropped.
    pub async fn watch(self: Arc<Self>) {
        let (rules_path, main_path) = {
            let c = self.config.lock();
            (c.rules_path.clone(), c.path.clone())
        };
        // The rules path itself (a file, or a directory and what is in it),
        // its parent, which sees the path being replaced (symlink swap,
        // editors that write a new file and rename it over the old one), and
        // the main file's directory; the poll covers what a watch misses.
        let mut targets = vec![Target { path: rules_path.clone(), recursive: true, required: true }];
        for dir in [watch::parent(&rules_path), watch::parent(&main_path)].into_iter().flatten() {
            targets.push(Target { path: dir, recursive: false, required: false });
        }
        watch::watch("rules path", targets, move || {
            self.poll();
        })
        .await;
    }
}

/// How long a reload waits for requests under way to let go of the rules
/// it replaced.
const RETIRE_WAIT: Duration = Duration::from_millis(500);

/// Frees `old` on this (background) thread once the requests that loaded
/// it before the swap are done with it: otherwise the last of them frees
/// it, on the runtime that serves requests, and 10,000 rules take
/// milliseconds to free. After [`RETIRE_WAIT`] (a long response still
/// holds them) the last holder frees them after all.
fn retire(mut old: Arc<RuleSet>) {
    let deadline = Instant::now() + RETIRE_WAIT;
    loop {
        match Arc::try_unwrap(old) {
            Ok(set) => return free(set),
            Err(held) if Instant::now() < deadline => {
                old = held;
                std::thread::sleep(Duration::from_millis(2));
            }
            Err(_) => return,
        }
    }
}

/// Drops `set` a rule at a time, [`watch::breathe`] between: 10,000
/// rules freed at once held the core for about a millisecond (a cache
/// miss on each rule's count).
fn free(set: RuleSet) {
    let mut rules = set.rules;
    while rules.pop().is_some() {
        watch::breathe();
    }
}

/// A fingerprint of each section of `config` that applies only after a
/// restart: what `/config` shows and `tollgate check --running` compares.
/// The sections are plain data; their debug forms differ exactly when a
/// value does (FNV-1a over them: the same in every process of one build).
pub fn restart_fingerprints(config: &Config) -> Vec<(&'static str, String)> {
    let fnv = |text: String| {
        let h = text.bytes().fold(0xcbf2_9ce4_8422_2325_u64, |h, b| (h ^ u64::from(b)).wrapping_mul(0x100_0000_01b3));
        format!("{h:016x}")
    };
    vec![
        ("[listen]", fnv(format!("{:?}", config.listen))),
        ("[store]", fnv(format!("{:?}", config.store))),
        ("[client]", fnv(format!("{:?}", config.client))),
        ("[log]", fnv(format!("{:?}", config.log))),
        ("[admin]", fnv(format!("{:?}", config.admin))),
        ("[tracing]", fnv(format!("{:?}", config.tracing))),
        ("[rules] path", fnv(format!("{:?}", config.rules_path))),
    ]
}

/// The sections of `new` that differ from the running config and apply
/// only after a restart.
fn needs_restart(running: &Config, new: &Config) -> Vec<&'static str> {
    restart_fingerprints(running)
        .into_iter()
        .zip(restart_fingerprints(new))
        .filter(|((_, a), (_, b))| a != b)
        .map(|((name, _), _)| name)
        .collect()
}

/// A cheap summary of the rules files (see [`files_fingerprint`]).
fn fingerprint(path: &Path) -> u64 {
    fingerprint_racy(path).0
}

/// [`fingerprint`], and whether any file was modified too recently for
/// its metadata to show a next change.
fn fingerprint_racy(path: &Path) -> (u64, bool) {
    let files: Vec<PathBuf> = crate::config::rule_files_or_empty(path);
    files_fingerprint(&files)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A retired set is freed a rule at a time, with a breath after each.
    #[test]
    fn a_retired_rule_set_is_freed_breathing() {
        let text: String =
            (0..500).map(|i| format!("[[rule]]\nname = \"r{i}\"\nlimit = 1\nwindow = \"1s\"\n\n")).collect();
        let main = "[[upstream]]\nname = \"u\"\nurl = \"http://127.0.0.1:9\"\n\n[[route]]\npath_prefix = \"/\"\nupstream = \"u\"\n";
        let config = Config::parse(Path::new("tollgate.toml"), main).expect("valid main file");
        let specs = crate::config::parse_rules(Path::new("r.toml"), &text, &config).expect("valid rules");
        let loaded = crate::config::LoadedRules {
            rules: specs.into_iter().map(|(s, _)| Arc::new(s)).collect(),
            ..Default::default()
        };
        let set = RuleSet::from_loaded(loaded, &crate::obs::metrics::Metrics::new());
        let ((), calls) = watch::breathing(|| retire(Arc::new(set)));
        assert!(calls >= 500, "{calls} breaths freeing 500 rules");
    }
}
