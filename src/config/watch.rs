//! The one file watcher, for every file tollgate re-reads while it runs
//! (the rules, the main file, the JWKS, the TLS certificates): notify ->
//! debounce -> a look at the files, on a blocking thread.
//!
//! A watch can go stale without a word (its directory replaced, the
//! kernel's watch limit reached), so the files are also looked at every
//! [`POLL`] whatever the watch says: the caller's look compares metadata
//! fingerprints and reads nothing that did not change, so it is cheap. The
//! look runs on a blocking thread, never on the runtime that serves
//! requests (on one CPU it has a single thread).

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use notify::{RecursiveMode, Watcher};
use tokio::sync::mpsc;

/// How long file events must pause before the files are looked at.
pub const DEBOUNCE: Duration = Duration::from_millis(200);
/// How often the files are looked at in case a watch missed a change.
pub const POLL: Duration = Duration::from_secs(2);

/// One path to watch.
#[derive(Debug, Clone)]
pub struct Watched {
    path: PathBuf,
    mode: RecursiveMode,
    /// Whether failing to watch it is worth a warning (the poll covers it
    /// either way).
    required: bool,
}

impl Watched {
    /// `path` and, when it is a directory, what it holds, however deep.
    pub fn tree(path: &Path) -> Watched {
        Watched { path: path.to_path_buf(), mode: RecursiveMode::Recursive, required: true }
    }

    /// The directory `path`, for its entries being edited, added, removed or
    /// renamed over: what a watch on a file that gets replaced misses.
    pub fn dir(path: &Path) -> Watched {
        Watched { path: path.to_path_buf(), mode: RecursiveMode::NonRecursive, required: true }
    }

    /// The directory holding `path`, if it names one, without a warning when
    /// it cannot be watched.
    pub fn parent_of(path: &Path) -> Option<Watched> {
        let parent = path.parent().filter(|p| !p.as_os_str().is_empty())?;
        Some(Watched { required: false, ..Watched::dir(parent) })
    }
}

/// What the log lines of [`watch`] call the files and their look.
#[derive(Debug, Clone, Copy)]
pub struct Names {
    /// "the rules path": "cannot watch {files}; polling every 2s instead".
    pub files: &'static str,
    /// "the rules poll": "{poll} failed" when the look panicked.
    pub poll: &'static str,
}

/// Watches `paths` until the task is dropped, and calls `look` on a
/// blocking thread once events stop arriving for [`DEBOUNCE`], and every
/// [`POLL`].
pub async fn watch(names: Names, paths: Vec<Watched>, look: impl Fn() + Send + Sync + 'static) {
    let look = Arc::new(look);
    let (tx, mut rx) = mpsc::unbounded_channel::<()>();
    let _watcher = watcher(names, paths, tx);
    let mut poll = tokio::time::interval(POLL);
    poll.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tokio::select! {
            ev = rx.recv() => {
                if ev.is_none() { return; }
                // Debounce: wait until events stop arriving for DEBOUNCE.
                loop {
                    match tokio::time::timeout(DEBOUNCE, rx.recv()).await {
                        Ok(Some(())) => continue,
                        Ok(None) => return,
                        Err(_) => break,
                    }
                }
                look_off_runtime(names, &look).await;
            }
            _ = poll.tick() => look_off_runtime(names, &look).await,
        }
    }
}

async fn look_off_runtime(names: Names, look: &Arc<impl Fn() + Send + Sync + 'static>) {
    let look = look.clone();
    if let Err(e) = tokio::task::spawn_blocking(move || look()).await {
        tracing::error!(error = %e, "{} failed", names.poll);
    }
}

/// A watcher sending `()` on `tx` for every event under `paths`, or `None`
/// when notify cannot watch at all. A path watched twice is watched once,
/// recursively if either asked so. A required path that cannot be watched
/// is warned about; the others stay watched.
fn watcher(names: Names, paths: Vec<Watched>, tx: mpsc::UnboundedSender<()>) -> Option<notify::RecommendedWatcher> {
    let warn = |e: &notify::Error| {
        tracing::warn!(error = %e, "cannot watch {}; polling every {POLL:?} instead", names.files);
    };
    let mut w = match notify::recommended_watcher(move |res: notify::Result<notify::Event>| {
        if res.is_ok() {
            let _ = tx.send(());
        }
    }) {
        Ok(w) => w,
        Err(e) => {
            warn(&e);
            return None;
        }
    };
    let mut merged: Vec<Watched> = Vec::with_capacity(paths.len());
    for p in paths {
        match merged.iter_mut().find(|m| m.path == p.path) {
            Some(m) => {
                m.required |= p.required;
                if p.mode == RecursiveMode::Recursive {
                    m.mode = RecursiveMode::Recursive;
                }
            }
            None => merged.push(p),
        }
    }
    let mut warned = false;
    for p in &merged {
        if let Err(e) = w.watch(&p.path, p.mode)
            && p.required
            && !std::mem::replace(&mut warned, true)
        {
            warn(&e);
        }
    }
    Some(w)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::{AtomicUsize, Ordering};

    #[test]
    fn a_parent_is_named_only_when_there_is_one() {
        assert!(Watched::parent_of(Path::new("rules.toml")).is_none());
        let p = Watched::parent_of(Path::new("/etc/tollgate/rules.toml")).expect("a parent");
        assert_eq!(
            (p.path.as_path(), p.mode, p.required),
            (Path::new("/etc/tollgate"), RecursiveMode::NonRecursive, false)
        );
    }

    #[tokio::test]
    async fn an_edit_is_seen_after_the_debounce() {
        let dir = tempfile::tempdir().expect("temp dir");
        let file = dir.path().join("rules.toml");
        std::fs::write(&file, "a").expect("write");
        let looks = Arc::new(AtomicUsize::new(0));
        let counted = looks.clone();
        let names = Names { files: "the test files", poll: "the test poll" };
        let paths = vec![Watched::tree(&file), Watched::dir(dir.path())];
        let task = tokio::spawn(watch(names, paths, move || {
            counted.fetch_add(1, Ordering::SeqCst);
        }));
        // The interval's first tick is at once: one look at the start.
        let deadline = tokio::time::Instant::now() + Duration::from_secs(1);
        while looks.load(Ordering::SeqCst) < 1 && tokio::time::Instant::now() < deadline {
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        let before = looks.load(Ordering::SeqCst);
        std::fs::write(&file, "b").expect("write");
        let deadline = tokio::time::Instant::now() + POLL - Duration::from_millis(300);
        while looks.load(Ordering::SeqCst) == before && tokio::time::Instant::now() < deadline {
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        task.abort();
        assert!(looks.load(Ordering::SeqCst) > before, "the edit was not seen before the next poll");
    }
}
