//! tollgate as a real process (the binary `cargo test` built, with its own
//! allocator): for what only a process shows, its memory and what it asked
//! of the kernel. Linux only (`/proc`).

use std::io::{BufRead, BufReader};
use std::net::SocketAddr;
use std::path::Path;
use std::process::{Child, Command, Stdio};

/// A running tollgate; killed on drop.
pub struct Process {
    pub child: Child,
    pub proxy: SocketAddr,
    _dir: tempfile::TempDir,
}

impl Drop for Process {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl Process {
    /// Starts the binary on `config` (written as `tollgate.toml`, its
    /// listeners on port 0) with `rules` as `rules/rules.toml` and `env`
    /// added to its environment; returns once it listens.
    pub fn start(config: &str, rules: &str, env: &[(&str, &str)]) -> Process {
        let dir = tempfile::tempdir().expect("temp dir");
        std::fs::create_dir(dir.path().join("rules")).expect("rules dir");
        std::fs::write(dir.path().join("tollgate.toml"), config).expect("config");
        std::fs::write(dir.path().join("rules").join("rules.toml"), rules).expect("rules");
        let mut child =
            command(&dir.path().join("tollgate.toml")).envs(env.iter().copied()).spawn().expect("tollgate starts");
        let mut lines = BufReader::new(child.stderr.take().expect("stderr")).lines();
        let proxy = loop {
            let line = lines.next().expect("tollgate exited before listening").expect("log line");
            let Ok(v) = serde_json::from_str::<serde_json::Value>(&line) else { continue };
            if v["fields"]["message"] == "tollgate listening" {
                break v["fields"]["proxy"].as_str().and_then(|s| s.parse().ok()).expect("address in log");
            }
        };
        // Keep draining the log so the process never blocks on a full pipe.
        std::thread::spawn(move || for _ in lines.map_while(Result::ok) {});
        Process { child, proxy, _dir: dir }
    }

    /// A field of `/proc/<pid>/status`, its value trimmed.
    pub fn status(&self, field: &str) -> Option<String> {
        let status = std::fs::read_to_string(format!("/proc/{}/status", self.child.id())).ok()?;
        status.lines().find_map(|l| l.strip_prefix(field)?.strip_prefix(':')).map(|v| v.trim().to_string())
    }

    /// The process's resident memory in KiB.
    pub fn rss_kib(&self) -> usize {
        self.status("VmRSS")
            .and_then(|v| v.trim_end_matches("kB").trim().parse().ok())
            .expect("VmRSS in /proc/<pid>/status")
    }
}

/// The binary on `config`, logging JSON on stderr (piped) at info.
fn command(config: &Path) -> Command {
    let mut c = Command::new(env!("CARGO_BIN_EXE_tollgate"));
    c.arg("--config")
        .arg(config)
        .args(["--log-format", "json"])
        .env("RUST_LOG", "info")
        .env_remove("MIMALLOC_ALLOW_THP")
        .stdout(Stdio::null())
        .stderr(Stdio::piped());
    c
}
