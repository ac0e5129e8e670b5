//! The access log's writer thread: renders what is queued into one buffer
//! and hands it to the output in one write, so that lines never interleave.
//!
//! A write can still be cut short: a full disk (ENOSPC), a file-size limit
//! (EFBIG), a pipe whose reader went away. Its lines are counted as
//! dropped, and what reached the output must not tear the log: a file is
//! cut back to its length before the batch (a torn line would otherwise be
//! glued to the next batch's first line, and both lost to a JSON reader);
//! an output that cannot be cut back (stdout, a pipe) gets a newline before
//! the next batch instead, so the torn piece stays one bad line of its own.

use std::fs::{File, OpenOptions};
use std::io::{ErrorKind, Write};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc::Receiver;

use prometheus::IntCounter;

use super::entry::Message;
use super::line::render;
use crate::config::AccessLogTarget;

/// The writer hands this much rendered text to the file at once, at most.
const BATCH_BYTES: usize = 64 * 1024;

/// Where lines go once opened.
pub(super) enum Output {
    /// A file opened for appending: a failed batch is cut back from it.
    File(File),
    /// Anything else (stdout): what a failed batch wrote stays.
    Stream(Box<dyn Write + Send>),
}

impl Output {
    fn writer(&mut self) -> &mut dyn Write {
        match self {
            Output::File(f) => f,
            Output::Stream(s) => s.as_mut(),
        }
    }
}

/// The writer thread's state.
pub(super) struct Writer {
    pub target: AccessLogTarget,
    pub reopen: Arc<AtomicBool>,
    pub dropped: IntCounter,
    /// `None` until opened, and after a failed open or write.
    pub out: Option<Output>,
    /// A batch was cut short on an output that could not be cut back: the
    /// next batch starts on a new line.
    pub torn: bool,
}

impl Writer {
    /// Writes until every [`super::AccessLog`] and [`super::Pending`] is gone.
    pub fn run(mut self, rx: Receiver<Message>) {
        let mut buf: Vec<u8> = Vec::with_capacity(BATCH_BYTES + 4096);
        let mut failing = false;
        while let Ok(first) = rx.recv() {
            buf.clear();
            let mut lines = 0u64;
            let mut acks = Vec::new();
            let mut next = Some(first);
            while let Some(msg) = next.take() {
                match msg {
                    Message::Line(entry) => {
                        render(&entry, &mut buf);
                        lines += 1;
                    }
                    Message::Flush(ack) => acks.push(ack),
                }
                if buf.len() < BATCH_BYTES {
                    next = rx.try_recv().ok();
                }
            }
            if lines > 0 {
                match self.write(&buf) {
                    Ok(()) => {
                        if failing {
                            tracing::info!("access log: writing again");
                        }
                        failing = false;
                    }
                    Err(e) => {
                        // Said once per failure, not once per line.
                        if !failing {
                            tracing::error!(error = %e, "access log: cannot write; lines are dropped and counted");
                        }
                        failing = true;
                        self.dropped.inc_by(lines);
                    }
                }
            }
            for ack in acks {
                let _ = ack.send(());
            }
        }
    }

    /// Writes one batch of whole lines, (re)opening the output first when
    /// it is not open or SIGHUP asked for it. On failure nothing of the
    /// batch stays in a file, and a stream's next batch starts on a new
    /// line.
    pub fn write(&mut self, batch: &[u8]) -> std::io::Result<()> {
        if self.reopen.swap(false, Ordering::Relaxed) {
            self.out = None;
        }
        if self.out.is_none() {
            self.out = Some(match &self.target {
                AccessLogTarget::File(path) => Output::File(OpenOptions::new().append(true).create(true).open(path)?),
                _ => Output::Stream(Box::new(std::io::stdout())),
            });
        }
        let Some(out) = self.out.as_mut() else { return Ok(()) };
        // In append mode every write lands at the end: the length now is
        // where this batch starts.
        let start = match out {
            Output::File(f) => Some(f.metadata()?.len()),
            Output::Stream(_) => None,
        };
        let newline: &[u8] = if self.torn { b"\n" } else { b"" };
        let (written, result) = write_all(out.writer(), newline, batch);
        let result = result.and_then(|()| out.writer().flush());
        let Err(e) = result else {
            self.torn = false;
            return Ok(());
        };
        if written > 0 {
            // Another process appending to the same file between the
            // length and the cut would lose its lines too: an access log
            // has one writer.
            let cut = match (out, start) {
                (Output::File(f), Some(len)) => f.set_len(len).is_ok(),
                _ => false,
            };
            self.torn = !cut;
        }
        // Opened again for the next batch: the file may have been
        // replaced, or the disk freed.
        self.out = None;
        Err(e)
    }
}

/// Writes `first` then `rest` as far as `out` takes them: the bytes written
/// and how it ended. One write call for each in the usual case; a short
/// write goes on from where it stopped, as `write_all` would, but counts.
fn write_all(out: &mut dyn Write, first: &[u8], rest: &[u8]) -> (usize, std::io::Result<()>) {
    let mut written = 0;
    for part in [first, rest] {
        let mut at = 0;
        while at < part.len() {
            match out.write(&part[at..]) {
                Ok(0) => return (written, Err(ErrorKind::WriteZero.into())),
                Ok(n) => {
                    at += n;
                    written += n;
                }
                Err(e) if e.kind() == ErrorKind::Interrupted => {}
                Err(e) => return (written, Err(e)),
            }
        }
    }
    (written, Ok(()))
}

#[cfg(test)]
mod tests {
    use parking_lot::Mutex;

    use super::*;

    /// A stream that takes `room` bytes, then fails as a full disk does,
    /// until given more room.
    #[derive(Clone, Default)]
    struct Tight {
        taken: Arc<Mutex<Vec<u8>>>,
        room: Arc<Mutex<usize>>,
    }

    impl Write for Tight {
        fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
            let mut room = self.room.lock();
            if *room == 0 {
                return Err(std::io::Error::from_raw_os_error(28)); // ENOSPC
            }
            let n = buf.len().min(*room);
            *room -= n;
            self.taken.lock().extend_from_slice(&buf[..n]);
            Ok(n)
        }

        fn flush(&mut self) -> std::io::Result<()> {
            Ok(())
        }
    }

    fn writer(out: Output) -> Writer {
        Writer {
            target: AccessLogTarget::Stdout,
            reopen: Arc::new(AtomicBool::new(false)),
            dropped: IntCounter::new("t", "t").expect("counter"),
            out: Some(out),
            torn: false,
        }
    }

    #[test]
    fn a_stream_cut_short_mid_line_starts_the_next_batch_on_a_new_line() {
        let tight = Tight::default();
        *tight.room.lock() = 20;
        let mut w = writer(Output::Stream(Box::new(tight.clone())));
        w.write(b"{\"a\":1}\n{\"b\":22222222}\n").expect_err("no room for the second line");
        // The failed stream is reopened for the next batch: the test's
        // stands in for stdout again, with room.
        *tight.room.lock() = 1000;
        w.out = Some(Output::Stream(Box::new(tight.clone())));
        w.write(b"{\"c\":3}\n").expect("room again");
        w.out = Some(Output::Stream(Box::new(tight.clone())));
        w.write(b"{\"d\":4}\n").expect("still room");
        let taken = String::from_utf8(tight.taken.lock().clone()).expect("text");
        assert_eq!(taken, "{\"a\":1}\n{\"b\":2222222\n{\"c\":3}\n{\"d\":4}\n");
    }

    #[test]
    fn a_file_cut_short_is_cut_back_to_its_length_before_the_batch() {
        let dir = tempfile::tempdir().expect("temp dir");
        let path = dir.path().join("access.log");
        std::fs::write(&path, "{\"old\":1}\n").expect("write");
        let mut w = writer(Output::Stream(Box::new(std::io::sink())));
        w.target = AccessLogTarget::File(path.clone());
        w.out = None;
        w.write(b"{\"a\":1}\n").expect("a first batch");
        // /dev/full takes nothing: a real failing file, cut back to itself.
        w.out = Some(Output::File(OpenOptions::new().append(true).open("/dev/full").expect("/dev/full")));
        assert_eq!(w.write(b"{\"b\":2}\n").expect_err("full").raw_os_error(), Some(28));
        assert!(!w.torn, "nothing was written, nothing torn");
        w.write(b"{\"c\":3}\n").expect("the file again");
        assert_eq!(std::fs::read_to_string(&path).expect("read"), "{\"old\":1}\n{\"a\":1}\n{\"c\":3}\n");
    }
}
