//! What outlives one TLS handshake: certificates' expiry in a metric, kept
//! current as they are renewed, and session tickets, with which a client
//! resumes without a full handshake (Python's `ssl`, a real OpenSSL client).

use crate::support;

use support::tls::{TestCa, site};
use support::{Tollgate, eventually, metric, write_atomic};
use tokio::process::Command;

/// Seconds since the epoch of midnight UTC on `y-m-d`.
fn midnight(y: i16, m: i8, d: i8) -> f64 {
    let t = jiff::tz::TimeZone::UTC.to_timestamp(jiff::civil::date(y, m, d).at(0, 0, 0, 0)).expect("a UTC date");
    t.as_second() as f64
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn each_certificates_expiry_is_a_gauge_kept_current_on_renewal() {
    let ca = TestCa::new();
    let dir = tempfile::tempdir().expect("temp dir");
    std::fs::create_dir(dir.path().join("rules")).expect("rules dir");
    ca.issue_until("a", &["a.test", "www.a.test"], (2031, 5, 17)).write(dir.path(), "a");
    ca.issue_until("wild", &["*.wild.test"], (2071, 1, 2)).write(dir.path(), "wild");
    let upstream = support::Upstream::start().await;
    let tls = "[[listen.tls]]\ncert_file = \"a.crt\"\nkey_file = \"a.key\"\n\n\
               [[listen.tls]]\ncert_file = \"wild.crt\"\nkey_file = \"wild.key\"\n\n[rules]";
    let config = support::config(upstream.addr).replacen("[rules]", tls, 1);
    let tg = Tollgate::start_in(dir, &config).await;
    let expiry =
        |text: &str, name: &str| metric(text, "tollgate_tls_certificate_expiry_timestamp_seconds", &[("name", name)]);
    // Set as the server starts serving.
    eventually("the expiry gauges", || async { expiry(&tg.metrics().await, "a.test").is_some() }).await;
    let text = tg.metrics().await;
    // Named by their first DNS name; 2071 is past UTCTime's range (2049).
    assert_eq!(expiry(&text, "a.test"), Some(midnight(2031, 5, 17)), "{text}");
    assert_eq!(expiry(&text, "*.wild.test"), Some(midnight(2071, 1, 2)), "{text}");

    // A renewal moves the gauge; a certificate under another name replaces
    // the old series.
    let renewed = ca.issue_until("a", &["a.test"], (2031, 8, 15));
    write_atomic(&tg.dir.path().join("a.key"), &renewed.key);
    write_atomic(&tg.dir.path().join("a.crt"), &renewed.cert);
    eventually("the renewed expiry", || async { expiry(&tg.metrics().await, "a.test") == Some(midnight(2031, 8, 15)) })
        .await;
    let other = ca.issue_until("b", &["b.test"], (2032, 1, 1));
    write_atomic(&tg.dir.path().join("a.key"), &other.key);
    write_atomic(&tg.dir.path().join("a.crt"), &other.cert);
    eventually("the new name's series", || async {
        expiry(&tg.metrics().await, "b.test") == Some(midnight(2032, 1, 1))
    })
    .await;
    let text = tg.metrics().await;
    assert_eq!(expiry(&text, "a.test"), None, "a certificate no longer served keeps its series: {text}");
    assert_eq!(expiry(&text, "*.wild.test"), Some(midnight(2071, 1, 2)));
}

/// Python's `ssl`: two connections to `port` at TLS `version`, the second
/// offering the first's session; prints whether the first session came with
/// a ticket and whether the second resumed it.
const PY_RESUME: &str = r#"
import socket, ssl, sys
port, version = int(sys.argv[1]), getattr(ssl.TLSVersion, sys.argv[2])
ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
ctx.check_hostname = False
ctx.verify_mode = ssl.CERT_NONE
ctx.minimum_version = version
ctx.maximum_version = version
def get(session=None):
    with socket.create_connection(("127.0.0.1", port), timeout=10) as raw:
        with ctx.wrap_socket(raw, server_hostname="a.test", session=session) as tls:
            tls.sendall(b"GET / HTTP/1.1\r\nhost: a.test\r\nconnection: close\r\n\r\n")
            reply = b""
            while True:
                chunk = tls.recv(65536)
                if not chunk:
                    break
                reply += chunk
            assert reply.startswith(b"HTTP/1.1 200"), reply[:100]
            return tls.session, tls.session_reused
first, _ = get()
_, resumed = get(first)
print("ticket" if first.has_ticket else "no-ticket", "resumed" if resumed else "full-handshake")
"#;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn python_resumes_tls_sessions_from_tickets_on_1_2_and_1_3() {
    let site = site("").await;
    for version in ["TLSv1_2", "TLSv1_3"] {
        let out = Command::new("python3")
            .args(["-c", PY_RESUME, &site.port().to_string(), version])
            .output()
            .await
            .expect("python3 runs");
        let stdout = String::from_utf8_lossy(&out.stdout);
        assert!(out.status.success(), "{stdout}{}", String::from_utf8_lossy(&out.stderr));
        assert_eq!(stdout.trim(), "ticket resumed", "{version}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn openssl_s_client_resumes_from_a_saved_session_ticket() {
    let site = site("").await;
    let sess = site.dir().join("session.pem");
    let connect = format!("127.0.0.1:{}", site.port());
    let s_client = |session_flag: &str| {
        let mut cmd = std::process::Command::new("openssl");
        cmd.args(["s_client", "-connect", &connect, "-servername", "a.test", "-tls1_2", "-ign_eof"]);
        cmd.arg(session_flag).arg(&sess);
        cmd.stdin(std::process::Stdio::piped())
            .stdout(std::process::Stdio::piped())
            .stderr(std::process::Stdio::null());
        let mut child = cmd.spawn().expect("openssl runs");
        use std::io::Write;
        let mut stdin = child.stdin.take().expect("stdin");
        stdin.write_all(b"GET / HTTP/1.1\r\nhost: a.test\r\nconnection: close\r\n\r\n").expect("request");
        drop(stdin);
        let out = wait_bounded(child);
        String::from_utf8_lossy(&out.stdout).into_owned()
    };
    let first = s_client("-sess_out");
    assert!(first.contains("TLS session ticket:"), "no ticket in the first session:\n{first}");
    let second = s_client("-sess_in");
    assert!(second.contains("Reused, TLSv1.2"), "not resumed:\n{second}");
    assert!(second.contains("HTTP/1.1 200 OK"), "{second}");
}

/// `child`'s output once it exits; killed (and the test failed) if it
/// takes longer than the support deadline.
fn wait_bounded(mut child: std::process::Child) -> std::process::Output {
    let started = std::time::Instant::now();
    while child.try_wait().expect("wait").is_none() {
        if started.elapsed() > support::DEADLINE {
            let _ = child.kill();
            panic!("openssl s_client did not finish within {:?}", support::DEADLINE);
        }
        std::thread::sleep(std::time::Duration::from_millis(20));
    }
    child.wait_with_output().expect("output")
}
