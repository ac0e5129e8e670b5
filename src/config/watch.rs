//! The one file watcher: notify events, debounced, and a poll of the
//! files' metadata as a backstop, each look at the files on a blocking
//! thread. Used for the rules and main file ([`crate::ops::reload`]) and the
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

/// Calls `poll` (on a blocking thread) after file events on `targets`
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

/// `poll` on a blocking thread, never on the runtime that serves requests
/// (on one CPU it has a single thread).
async fn off_runtime<F: Fn() + Send + Sync + 'static>(what: &str, poll: &Arc<F>) {
    let poll = poll.clone();
    if let Err(e) = tokio::task::spawn_blocking(move || poll()).await {
        tracing::error!(error = %e, "the poll of the {what} failed");
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
