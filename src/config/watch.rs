//! The one file watcher: notify events, debounced, and a poll of the
//! files' metadata as a backstop, each look at the files on a background
//! thread of lower priority. Used for the rules and main file ([`crate::ops::reload`]) and the
//! listener's certificates ([`crate::edge::tls`]).
//!
//! A watch can silently go stale when the watched directory is replaced,
//! so the files' fingerprint is also polled every few seconds. The
//! fingerprint is made of the files' metadata (size, modification and
//! change times, inode), so an unchanged file is never read.

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use notify::{RecursiveMode, Watcher};
use tokio::sync::mpsc;

/// How long file events must pause before the files are looked at (a
/// renewal writes a chain and a key one after the other; an editor writes
/// and renames).
pub const DEBOUNCE: Duration = Duration::from_millis(200);
/// How often the files' metadata is looked at in case a watch missed a
/// change.
pub const POLL: Duration = Duration::from_secs(2);
/// File times are as coarse as the kernel's clock tick (up to 10 ms): a
/// file modified this recently may change again without its metadata
/// changing.
pub const RACY: Duration = Duration::from_millis(50);

/// One path to watch.
#[derive(Debug, Clone)]
pub struct Target {
    pub path: PathBuf,
    /// With what is under it (a directory of rules files).
    pub recursive: bool,
    /// A failure to watch it is logged (and the poll alone finds changes);
    /// otherwise it is a best effort, left out silently.
    pub required: bool,
}

/// Calls `poll` (on a [`background`] thread) after file events on `targets`
/// pause for [`DEBOUNCE`], and every [`POLL`], until the task is dropped.
/// `what` names the files in the log lines ("rules path", "TLS files").
pub async fn watch<F>(what: &'static str, targets: Vec<Target>, poll: F)
where
    F: Fn() + Send + Sync + 'static,
{
    let poll = Arc::new(poll);
    let (tx, mut rx) = mpsc::unbounded_channel::<()>();
    let _watcher = watcher(what, &targets, tx);
    let mut tick = tokio::time::interval(POLL);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
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
                off_runtime(what, &poll).await;
            }
            _ = tick.tick() => off_runtime(what, &poll).await,
        }
    }
}

/// `poll` on a [`background`] thread, never on the runtime that serves
/// requests (on one CPU it has a single thread).
async fn off_runtime<F: Fn() + Send + Sync + 'static>(what: &str, poll: &Arc<F>) {
    let poll = poll.clone();
    let done = background(move || poll());
    if done.await.is_err() {
        tracing::error!("the poll of the {what} failed");
    }
}

/// The nice value of [`background`] threads: a reload of 10,000 rules
/// takes about a tenth of a second of CPU, which on a core shared with the
/// runtime (a proxy pinned to one CPU) would otherwise delay every request
/// that arrives meanwhile. At 10 the runtime thread preempts it when a
/// request arrives and gets about nine tenths of a saturated core.
pub const BACKGROUND_NICE: i32 = 10;

/// Runs `work` on a new thread of lower priority ([`BACKGROUND_NICE`]):
/// file reads, parsing and validation of reloads, never the request path.
/// The receiver completes when `work` returns, and fails if it panicked
/// or no thread could be started (logged).
pub fn background<F: FnOnce() + Send + 'static>(work: F) -> tokio::sync::oneshot::Receiver<()> {
    let (tx, rx) = tokio::sync::oneshot::channel();
    let spawned = std::thread::Builder::new().name("tollgate-reload".into()).spawn(move || {
        lower_priority();
        work();
        let _ = tx.send(());
    });
    if let Err(e) = spawned {
        tracing::error!(error = %e, "cannot start a thread for a reload");
    }
    rx
}

/// Lowers the calling thread's priority. Linux keeps the nice value per
/// thread, so `setpriority(PRIO_PROCESS, 0)` changes only this one; other
/// systems apply it to the whole process, so there it is left alone.
fn lower_priority() {
    #[cfg(any(target_os = "linux", target_os = "android"))]
    {
        use rustix::process::{getpriority_process, setpriority_process};
        // Only ever lower: a process started under `nice 19` stays there.
        let below = getpriority_process(None).is_ok_and(|now| now < BACKGROUND_NICE);
        if below && let Err(e) = setpriority_process(None, BACKGROUND_NICE) {
            tracing::debug!(error = %e, "cannot lower the reload thread's priority");
        }
    }
}

/// A notify watcher on `targets`; `None` when none could be watched.
fn watcher(what: &str, targets: &[Target], tx: mpsc::UnboundedSender<()>) -> Option<notify::RecommendedWatcher> {
    let made = notify::recommended_watcher(move |res: notify::Result<notify::Event>| {
        if res.is_ok() {
            let _ = tx.send(());
        }
    });
    let mut w = match made {
        Ok(w) => w,
        Err(e) => {
            tracing::warn!(error = %e, "cannot watch the {what}; polling every {POLL:?} instead");
            return None;
        }
    };
    for t in targets {
        let mode = if t.recursive { RecursiveMode::Recursive } else { RecursiveMode::NonRecursive };
        if let Err(e) = w.watch(&t.path, mode)
            && t.required
        {
            tracing::warn!(error = %e, "cannot watch the {what}; polling every {POLL:?} instead");
        }
    }
    Some(w)
}

/// The directory holding `path`, for a watch that sees the file replaced
/// (a rename over it, a swapped symlink as certbot's `live/` does); none
/// for a bare file name.
pub fn parent(path: &Path) -> Option<PathBuf> {
    path.parent().filter(|p| !p.as_os_str().is_empty()).map(Path::to_path_buf)
}

/// A summary of one file's metadata (0 when it cannot be read): follows
/// symlinks, so a swapped link shows as another inode.
pub fn file_fingerprint(path: &Path) -> u64 {
    use std::hash::{BuildHasher, Hasher};
    let mut h = foldhash::quality::FixedState::with_seed(2).build_hasher();
    match std::fs::metadata(path) {
        Ok(meta) => write_metadata(&mut h, &meta),
        Err(_) => return 0,
    }
    h.finish()
}

/// A summary of several files' metadata (their names included): changes
/// when any file is added, removed or edited, including through a swapped
/// symlink. Reads metadata only, never contents. Also whether any file was
/// modified within [`RACY`] of now.
pub fn files_fingerprint(files: &[PathBuf]) -> (u64, bool) {
    use std::hash::{BuildHasher, Hasher};
    let mut h = foldhash::quality::FixedState::with_seed(1).build_hasher();
    let mut racy = false;
    for f in files {
        h.write(f.as_os_str().as_encoded_bytes());
        match std::fs::metadata(f) {
            Ok(meta) => {
                write_metadata(&mut h, &meta);
                racy |= is_racy(&meta);
            }
            Err(_) => h.write_u8(0),
        }
    }
    (h.finish(), racy)
}

/// Whether the file was modified within [`RACY`] of now.
pub fn recently_modified(path: &Path) -> bool {
    std::fs::metadata(path).is_ok_and(|m| is_racy(&m))
}

fn is_racy(meta: &std::fs::Metadata) -> bool {
    meta.modified().is_ok_and(|m| m.elapsed().is_ok_and(|age| age < RACY))
}

/// Size, modification and change times (to the nanosecond) and identity: an
/// edit changes the times, a rename over the file or a swapped symlink the
/// inode.
fn write_metadata(h: &mut impl std::hash::Hasher, meta: &std::fs::Metadata) {
    use std::os::unix::fs::MetadataExt;
    h.write_u64(meta.len());
    h.write_i64(meta.mtime());
    h.write_i64(meta.mtime_nsec());
    h.write_i64(meta.ctime());
    h.write_i64(meta.ctime_nsec());
    h.write_u64(meta.ino());
    h.write_u64(meta.dev());
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A reload's thread yields the core to the runtime's: its nice value
    /// is [`BACKGROUND_NICE`], and the caller's thread keeps its own.
    #[cfg(target_os = "linux")]
    #[tokio::test]
    async fn background_work_runs_at_a_lower_priority_than_the_runtime() {
        let before = rustix::process::getpriority_process(None).expect("getpriority");
        let seen = Arc::new(parking_lot::Mutex::new(None));
        let into = seen.clone();
        background(move || *into.lock() = Some(rustix::process::getpriority_process(None)))
            .await
            .expect("the work ran");
        let seen = seen.lock().take().expect("the work ran").expect("getpriority");
        assert_eq!(seen, BACKGROUND_NICE.max(before));
        assert_eq!(rustix::process::getpriority_process(None).expect("getpriority"), before);
    }

    /// A panic in the work reaches the caller as an error, not a hang.
    #[tokio::test]
    async fn background_work_that_panics_is_reported() {
        assert!(background(|| panic!("a broken reload")).await.is_err());
    }
}
