//! The dashboard on the admin listener (`/`), in a real headless Chromium
//! (Debian's `chromium`, installed by scripts/test) driven through the
//! DevTools protocol by tests/support/dashboard_browser.py: the page
//! renders offline, shows the rules and the keys they limit, and follows
//! new traffic by itself, without a reload. Also the page's headers and the
//! `/upstreams` endpoint it reads.

use crate::support;

use std::path::PathBuf;
use std::process::Stdio;
use std::time::Duration;

use serde_json::Value;
use support::{Tollgate, Upstream};
use tokio::io::{AsyncBufReadExt, AsyncWriteExt, BufReader, Lines};
use tokio::process::{Child, ChildStdin, ChildStdout, Command};

const RULES: &str = r#"
[[rule]]
name = "login-per-user"
key = ["header:x-user"]
limit = 2
window = "1h"
"#;

fn chromium() -> String {
    ["chromium", "chromium-browser", "google-chrome"]
        .into_iter()
        .find(|c| {
            std::process::Command::new("sh")
                .args(["-c", &format!("command -v {c}")])
                .output()
                .is_ok_and(|o| o.status.success())
        })
        .expect("Chromium is installed (scripts/test installs Debian's chromium)")
        .to_string()
}

/// The browser driver and its JSON lines.
struct Browser {
    _child: Child,
    stdin: ChildStdin,
    lines: Lines<BufReader<ChildStdout>>,
}

impl Browser {
    fn open(url: &str) -> Browser {
        let script = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/support/dashboard_browser.py");
        let mut child = Command::new("python3")
            .arg(script)
            .arg(chromium())
            .arg(url)
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .kill_on_drop(true)
            .spawn()
            .expect("python3 runs (scripts/test installs its websockets package)");
        let stdin = child.stdin.take().expect("piped stdin");
        let lines = BufReader::new(child.stdout.take().expect("piped stdout")).lines();
        Browser { _child: child, stdin, lines }
    }

    /// Closes the browser (the driver kills Chromium's whole process group)
    /// and waits for the driver to exit.
    async fn close(mut self) {
        self.stdin.write_all(b"quit\n").await.expect("driver stdin");
        let _ = tokio::time::timeout(Duration::from_secs(20), self._child.wait()).await;
    }

    /// The page once its text contains `text` (or after the driver's 20 s).
    async fn wait_for(&mut self, text: &str) -> Value {
        self.stdin.write_all(format!("wait {text}\n").as_bytes()).await.expect("driver stdin");
        let line = tokio::time::timeout(Duration::from_secs(60), self.lines.next_line())
            .await
            .expect("the driver answers in time")
            .expect("driver stdout")
            .expect("the driver is running");
        serde_json::from_str(&line).unwrap_or_else(|e| panic!("driver said {line}: {e}"))
    }
}

async fn limit(t: &Tollgate, user: &str) {
    let statuses: Vec<u16> = {
        let mut s = Vec::new();
        for _ in 0..4 {
            s.push(t.get("/login").header("x-user", user).send().await.status.as_u16());
        }
        s
    };
    assert_eq!(statuses, [200, 200, 429, 429], "{user}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_dashboard_shows_rules_and_limited_keys_and_follows_new_traffic_without_a_reload() {
    let upstream = Upstream::start().await;
    let t = Tollgate::start(&upstream, RULES).await;
    limit(&t, "mallory").await;

    let mut browser = Browser::open(&format!("http://{}/?every=1", t.admin_addr));
    let first = browser.wait_for("mallory").await;
    let text = first["text"].as_str().unwrap_or_default();
    assert!(text.contains("login-per-user"), "the rule's name is shown:\n{text}");
    assert!(text.contains("mallory"), "the limited key is shown:\n{text}");
    assert!(text.contains("up"), "the upstream server is in service:\n{text}");
    assert!(!text.contains("trudy"), "{text}");

    // New traffic after the page loaded: the page shows it by itself.
    limit(&t, "trudy").await;
    let second = browser.wait_for("trudy").await;
    let text = second["text"].as_str().unwrap_or_default();
    assert!(text.contains("trudy"), "the page follows new limited keys:\n{text}");
    assert!(second["refreshes"].as_u64() > first["refreshes"].as_u64(), "{second}");
    assert_eq!(second["probe"], "still here", "the page did not reload: {second}");
    assert_eq!(second["navigations"], 1, "{second}");
    browser.close().await;
    t.stop().await;
}

#[tokio::test]
async fn the_page_is_self_contained_and_upstreams_are_reported() {
    let upstream = Upstream::start().await;
    let t = Tollgate::start(&upstream, RULES).await;
    let page = t.admin("/").await;
    assert_eq!(page.status, 200);
    assert_eq!(page.header("content-type"), Some("text/html; charset=utf-8"));
    let policy = page.header("content-security-policy").expect("a content security policy");
    assert!(policy.contains("default-src 'none'") && policy.contains("connect-src 'self'"), "{policy}");
    // No external asset: nothing is loaded from another origin.
    for outside in ["http://", "https://", "//cdn", "src=\""] {
        assert!(!page.text().contains(outside), "the page refers to {outside}");
    }

    assert_eq!(t.get("/x").send().await.status, 200);
    let ups = t.admin("/upstreams").await.json();
    let servers = &ups["upstreams"][0]["servers"];
    assert_eq!(ups["upstreams"][0]["name"], "svc", "{ups}");
    assert_eq!(servers[0]["up"], true, "{ups}");
    assert_eq!(servers[0]["requests"], 1, "{ups}");
    assert_eq!(servers[0]["inflight"], 0, "{ups}");
    let rules = t.rules().await;
    assert_eq!(rules["rules"][0]["allowed"], 1, "{rules}");
    assert_eq!(rules["rules"][0]["limited"], 0, "{rules}");
    t.stop().await;
}
