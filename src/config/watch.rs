//! The one file watcher: notify events, debounced, and a poll of the
//! files' metadata as a backstop, each look at the files on the one
//! background thread, under SCHED_IDLE (see [`background`]). Used for the
//! rules and main file ([`crate::ops::reload`]) and the listener's
//! certificates ([`crate::edge::tls`]).
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

/// The nice value of the [`background`] thread where SCHED_IDLE is
/// refused: a reload of 10,000 rules takes tens of milliseconds of CPU,
/// which on a core shared with the runtime (a proxy pinned to one CPU)
/// would otherwise delay every request that arrives meanwhile.
pub const BACKGROUND_NICE: i32 = 10;

/// A piece of work for the [`background`] thread.
type Job = Box<dyn FnOnce() + Send>;

/// The [`background`] thread's queue, started on first use; `None` when it
/// could not be started.
static WORKER: std::sync::OnceLock<Option<std::sync::mpsc::Sender<Job>>> = std::sync::OnceLock::new();

/// Runs `work` on the one background thread, of the lowest priority
/// (see [`lower_priority`]): file reads, parsing and validation of
/// reloads, never the request path. Work runs in the order given, one at a
/// time, so two reloads (a SIGHUP during a poll) take turns. The receiver
/// completes when `work` returns, and fails if it panicked (the thread
/// goes on with the next) or the thread could not be started (logged).
pub fn background<F: FnOnce() + Send + 'static>(work: F) -> tokio::sync::oneshot::Receiver<()> {
    let (tx, rx) = tokio::sync::oneshot::channel();
    let job: Job = Box::new(move || {
        work();
        let _ = tx.send(());
    });
    // A send fails only if the thread is gone, which it never is once
    // started (panics are caught): the job and its sender are dropped, and
    // the receiver fails.
    if let Some(queue) = WORKER.get_or_init(start_worker) {
        let _ = queue.send(job);
    }
    rx
}

/// How long the [`background`] thread runs before [`breathe`] hands the
/// CPU to a runnable thread.
pub const BREATH: Duration = Duration::from_micros(100);

/// Calls of [`breathe`] between two looks at the clock (a look costs tens
/// of nanoseconds; a call between them, a thread-local read).
const BREATH_CALLS: u32 = 64;

std::thread_local! {
    /// On the [`background`] thread: the calls of [`breathe`] left before
    /// it looks at the clock, and when the thread last gave way. `None` on
    /// every other thread.
    static BREATHING: std::cell::Cell<Option<Breath>> = const { std::cell::Cell::new(None) };
    /// Calls of [`breathe`] on this thread while it breathes (for tests).
    #[cfg(test)]
    static CALLS: std::cell::Cell<u64> = const { std::cell::Cell::new(0) };
}

/// What [`breathe`] keeps between calls.
#[derive(Clone, Copy, Debug, PartialEq)]
struct Breath {
    left: u32,
    since: std::time::Instant,
}

impl Breath {
    fn new(now: std::time::Instant) -> Breath {
        Breath { left: BREATH_CALLS, since: now }
    }

    /// One call: the state after it, and whether to give way now. The
    /// clock is read only when the calls left run out.
    fn step(self, now: impl FnOnce() -> std::time::Instant) -> (Breath, bool) {
        if self.left > 0 {
            return (Breath { left: self.left - 1, ..self }, false);
        }
        let now = now();
        if now.saturating_duration_since(self.since) < BREATH {
            (Breath { left: BREATH_CALLS, since: self.since }, false)
        } else {
            (Breath::new(now), true)
        }
    }
}

/// Called between the steps of a long piece of work (a rule of 10,000):
/// on the [`background`] thread, once it has run for [`BREATH`] since it
/// last gave way, yields the CPU to any runnable thread; elsewhere (start-up,
/// `tollgate check`) does nothing.
///
/// Why: SCHED_IDLE keeps the thread from delaying a request thread that
/// wakes, not one that is already runnable. On a core busy with requests
/// the runtime's thread seldom sleeps; the scheduler still hands the
/// reload a turn now and then, and without this it kept the CPU to the
/// next tick: the runtime's thread waited 2 to 4 ms at a time, about 20 ms
/// over 9 reloads of 10,000 rules (`perf record -e sched:sched_switch`).
pub fn breathe() {
    take_breath(false);
}

/// [`breathe`] for a step of tens of microseconds (64 KiB of a file read,
/// compared or counted): the clock is read on every call.
pub fn breathe_now() {
    take_breath(true);
}

fn take_breath(look_now: bool) {
    BREATHING.with(|b| {
        let Some(mut breath) = b.get() else { return };
        #[cfg(test)]
        CALLS.with(|c| c.set(c.get() + 1));
        if look_now {
            breath.left = 0;
        }
        let (next, give_way) = breath.step(std::time::Instant::now);
        if give_way {
            std::thread::yield_now();
        }
        b.set(Some(next));
    });
}

/// Runs `f` on this thread as if on the [`background`] thread; returns
/// how many times it called [`breathe`].
#[cfg(test)]
pub fn breathing<R>(f: impl FnOnce() -> R) -> (R, u64) {
    BREATHING.with(|b| b.set(Some(Breath::new(std::time::Instant::now()))));
    CALLS.with(|c| c.set(0));
    let out = f();
    BREATHING.with(|b| b.set(None));
    (out, CALLS.with(|c| c.get()))
}

/// Starts the [`background`] thread: one for the process's life, rather
/// than one per poll (a thread's start is cheap, but not free, every two
/// seconds forever).
fn start_worker() -> Option<std::sync::mpsc::Sender<Job>> {
    let (tx, rx) = std::sync::mpsc::channel::<Job>();
    let spawned = std::thread::Builder::new().name("tollgate-reload".into()).spawn(move || {
        lower_priority();
        for job in rx {
            BREATHING.with(|b| b.set(Some(Breath::new(std::time::Instant::now()))));
            // The panic is reported to the job's caller (its sender is
            // dropped unsent) and by the panic hook; the next job runs.
            let _ = std::panic::catch_unwind(std::panic::AssertUnwindSafe(job));
        }
    });
    match spawned {
        Ok(_) => Some(tx),
        Err(e) => {
            tracing::error!(error = %e, "cannot start a thread for reloads");
            None
        }
    }
}

/// Puts the calling thread under SCHED_IDLE, or where that is refused, at
/// [`BACKGROUND_NICE`]. Linux keeps both per thread, so only this one
/// changes; other systems apply a nice value to the whole process, so
/// there it is left alone.
///
/// Why SCHED_IDLE rather than a nice value: CFS and EEVDF preempt a
/// SCHED_IDLE task as soon as a normal task wakes on its CPU, whereas a
/// nice-10 task keeps the slice it was given (milliseconds), and every
/// request that arrives meanwhile waits for it. A SCHED_IDLE task runs
/// when nothing else wants the CPU, so a reload takes longer on a busy core
/// (it still gets a sliver: a weight of 3 against a normal task's 1,024).
/// Once it has that sliver, it keeps it until the next tick unless it
/// gives way: long work calls [`breathe`]. What it could hold up is a lock a request
/// waits for; it holds none of the request path's (rules are swapped in
/// through an `ArcSwap`, metric handles resolved before). Threads started
/// from it inherit the policy.
fn lower_priority() {
    #[cfg(any(target_os = "linux", target_os = "android"))]
    {
        if let Err(e) = sched_idle() {
            tracing::debug!(error = %e, "SCHED_IDLE refused for the reload thread; lowering its nice value instead");
            use rustix::process::{getpriority_process, setpriority_process};
            // Only ever lower: a process started under `nice 19` stays there.
            let below = getpriority_process(None).is_ok_and(|now| now < BACKGROUND_NICE);
            if below && let Err(e) = setpriority_process(None, BACKGROUND_NICE) {
                tracing::debug!(error = %e, "cannot lower the reload thread's priority");
            }
        }
    }
}

/// `sched_setscheduler(0, SCHED_IDLE)`: pid 0 is the calling thread.
/// Neither std nor rustix wraps it.
#[cfg(any(target_os = "linux", target_os = "android"))]
#[allow(unsafe_code)]
fn sched_idle() -> std::io::Result<()> {
    let param = libc::sched_param { sched_priority: 0 };
    // SAFETY: `param` is a valid, initialised sched_param that outlives
    // the call; pid 0 names the calling thread.
    let rc = unsafe { libc::sched_setscheduler(0, libc::SCHED_IDLE, &param) };
    if rc == 0 { Ok(()) } else { Err(std::io::Error::last_os_error()) }
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

    /// A reload's thread yields the core to the runtime's: it runs under
    /// SCHED_IDLE (or, refused, at [`BACKGROUND_NICE`]), and the caller's
    /// thread keeps its own policy and nice value. Every job runs on the
    /// same thread.
    #[cfg(target_os = "linux")]
    #[allow(unsafe_code)]
    #[tokio::test]
    async fn background_work_runs_on_one_thread_under_sched_idle() {
        let policy = || {
            // SAFETY: no arguments beyond the pid; 0 is the calling thread.
            let p = unsafe { libc::sched_getscheduler(0) };
            (p, rustix::process::getpriority_process(None).expect("getpriority"))
        };
        let before = policy();
        let seen = Arc::new(parking_lot::Mutex::new(Vec::new()));
        for _ in 0..2 {
            let into = seen.clone();
            background(move || into.lock().push((policy(), std::thread::current().id()))).await.expect("the work ran");
        }
        let seen = seen.lock().clone();
        assert_eq!(seen.len(), 2);
        assert_eq!(seen[0].1, seen[1].1, "one thread for every job");
        let ((p, nice), _) = seen[0];
        assert!(
            p == libc::SCHED_IDLE || (p == before.0 && nice == BACKGROUND_NICE.max(before.1)),
            "policy {p}, nice {nice}"
        );
        assert_eq!(policy(), before);
    }

    /// A panic in the work reaches the caller as an error, not a hang, and
    /// the thread goes on with the next job.
    #[tokio::test]
    async fn background_work_that_panics_is_reported() {
        assert!(background(|| panic!("a broken reload")).await.is_err());
        assert!(background(|| ()).await.is_ok());
    }

    /// The clock is read only once the calls run out; the thread gives way
    /// once [`BREATH`] has passed since it last did, and starts over.
    #[test]
    fn a_breath_reads_the_clock_every_so_many_calls_and_gives_way_after_its_time() {
        let t0 = std::time::Instant::now();
        let mut b = Breath::new(t0);
        for _ in 0..BREATH_CALLS {
            let (next, give_way) = b.step(|| panic!("the clock is read only when the calls run out"));
            assert!(!give_way);
            b = next;
        }
        let (next, give_way) = b.step(|| t0 + BREATH / 2);
        assert!(!give_way, "not yet its time");
        assert_eq!(next, Breath { left: BREATH_CALLS, since: t0 });
        let mut b = next;
        for _ in 0..BREATH_CALLS {
            b = b.step(|| unreachable!()).0;
        }
        let (next, give_way) = b.step(|| t0 + BREATH);
        assert!(give_way);
        assert_eq!(next, Breath::new(t0 + BREATH));
    }

    /// Off the background thread (start-up, `tollgate check`) a breath is
    /// nothing; a job on it breathes.
    #[tokio::test]
    async fn only_the_background_thread_breathes() {
        BREATHING.with(|b| assert!(b.get().is_none()));
        breathe();
        BREATHING.with(|b| assert!(b.get().is_none()));
        let (tx, rx) = std::sync::mpsc::channel();
        background(move || tx.send(BREATHING.with(|b| b.get().is_some())).expect("sent")).await.expect("ran");
        assert!(rx.recv().expect("received"), "a background job breathes");
    }

    /// `breathe_now` looks at the clock on every call (the calls left
    /// start over each time), `breathe` once the calls run out.
    #[test]
    fn breathe_now_reads_the_clock_at_once() {
        let left = || BREATHING.with(|b| b.get().map(|b| b.left));
        let ((), calls) = breathing(|| {
            breathe();
            assert_eq!(left(), Some(BREATH_CALLS - 1));
            breathe_now();
            assert_eq!(left(), Some(BREATH_CALLS), "the clock was read");
        });
        assert_eq!(calls, 2);
        breathe_now();
        assert_eq!(left(), None, "off the background thread, nothing");
    }
}
