//! TLS on the proxy listener (`[[listen.tls]]`), against real clients: curl,
//! h2load, Python's `ssl` and rustls. Certificates come from a CA made in
//! each test.

use crate::support;

use std::net::SocketAddr;
use std::path::Path;
use std::process::Output;

use support::tls::{Site, TestCa, site, site_for};
use support::{DEADLINE, eventually, metric, write_atomic};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;
use tokio::process::Command;

fn text(b: &[u8]) -> String {
    String::from_utf8_lossy(b).into_owned()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn curl_speaks_http1_and_h2_over_tls_and_sni_picks_the_certificate() {
    let site = site("").await;
    // curl checks that the certificate is valid for the name it asked for:
    // the wrong one fails the request.
    for (host, http) in [("a.test", "--http1.1"), ("a.test", "--http2"), ("x.wild.test", "--http2")] {
        let out =
            site.curl(&[http, "--write-out", "\n%{http_code} %{http_version}", &site.url(host, "/hello?x=1")]).await;
        assert!(out.status.success(), "{host} {http}: {}", text(&out.stderr));
        let stdout = text(&out.stdout);
        let (body, last) = stdout.rsplit_once('\n').expect("status line");
        let want = if http == "--http2" { "200 2" } else { "200 1.1" };
        assert_eq!(last, want, "{host} {http}");
        let echo: serde_json::Value = serde_json::from_str(body).expect("echo JSON");
        assert_eq!(echo["path"], "/hello");
        assert_eq!(echo["headers"]["x-forwarded-proto"][0], "https", "{echo}");
    }
    // No certificate carries other.test: the default is presented, which
    // curl refuses for that name (Python's test shows it is a.test's).
    let out = site.curl(&[&site.url("other.test", "/")]).await;
    assert!(!out.status.success(), "other.test was accepted: {}", text(&out.stdout));
    assert!(text(&out.stderr).contains("no alternative certificate subject name matches"), "{}", text(&out.stderr));
}

/// Python's `ssl`: for each server name (or none), the common name of the
/// certificate presented (checked against the CA) and the status line of a
/// GET over the connection.
const PY_SNI: &str = r#"
import socket, ssl, sys
port, ca = int(sys.argv[1]), sys.argv[2]
ctx = ssl.create_default_context(cafile=ca)
ctx.check_hostname = False
for name in sys.argv[3:]:
    sni = None if name == "-" else name
    with socket.create_connection(("127.0.0.1", port), timeout=10) as raw:
        with ctx.wrap_socket(raw, server_hostname=sni) as tls:
            subject = dict(x[0] for x in tls.getpeercert()["subject"])
            tls.sendall(b"GET / HTTP/1.1\r\nhost: py.test\r\nconnection: close\r\n\r\n")
            reply = b""
            while True:
                chunk = tls.recv(65536)
                if not chunk:
                    break
                reply += chunk
            print(name, subject["commonName"], tls.version(), reply.split(b"\r\n")[0].decode())
"#;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn python_ssl_client_gets_the_certificate_of_the_name_it_asks_for() {
    let site = site("").await;
    let out = Command::new("python3")
        .args(["-c", PY_SNI, &site.port().to_string(), &site.dir().join("ca.crt").to_string_lossy()])
        .args(["a.test", "x.wild.test", "A.TEST", "deep.x.wild.test", "wild.test", "-"])
        .output()
        .await
        .expect("python3 runs");
    assert!(out.status.success(), "{}", text(&out.stderr));
    let lines: Vec<String> = text(&out.stdout).lines().map(str::to_string).collect();
    assert_eq!(
        lines,
        [
            "a.test a TLSv1.3 HTTP/1.1 200 OK",
            "x.wild.test wild TLSv1.3 HTTP/1.1 200 OK",
            "A.TEST a TLSv1.3 HTTP/1.1 200 OK",
            // A wildcard covers one label only, and not the bare domain:
            // both get the default.
            "deep.x.wild.test a TLSv1.3 HTTP/1.1 200 OK",
            "wild.test a TLSv1.3 HTTP/1.1 200 OK",
            "- a TLSv1.3 HTTP/1.1 200 OK",
        ]
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn h2load_over_tls_negotiates_h2_and_every_request_succeeds() {
    let site = site("").await;
    let out = Command::new("h2load")
        .args(["-n", "400", "-c", "4", "-m", "10", &format!("https://127.0.0.1:{}/load", site.port())])
        .output()
        .await
        .expect("h2load runs (scripts/test installs nghttp2-client)");
    let report = text(&out.stdout);
    assert!(out.status.success(), "{report}{}", text(&out.stderr));
    assert!(report.contains("Application protocol: h2"), "{report}");
    assert!(report.contains("400 succeeded, 0 failed, 0 errored"), "{report}");
    assert!(report.contains("status codes: 400 2xx"), "{report}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tls_1_2_and_1_3_are_accepted_and_1_1_refused() {
    let site = site("").await;
    for (args, version) in
        [(["--tlsv1.2", "--tls-max", "1.2"], "TLSv1.2"), (["--tlsv1.3", "--tls-max", "1.3"], "TLSv1.3")]
    {
        let out =
            site.curl(&[args[0], args[1], args[2], "--verbose", "-o", "/dev/null", &site.url("a.test", "/")]).await;
        assert!(out.status.success(), "{version}: {}", text(&out.stderr));
        assert!(text(&out.stderr).contains(&format!("SSL connection using {version}")), "{}", text(&out.stderr));
    }
    // Python, with OpenSSL's security level lowered so that it offers TLS
    // 1.1 at all: the server answers 1.1 with an alert, 1.2 with a
    // handshake (the control).
    let script = r#"
import socket, ssl, sys, warnings
warnings.simplefilter("ignore", DeprecationWarning)
version = getattr(ssl.TLSVersion, sys.argv[2])
ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
ctx.check_hostname = False
ctx.verify_mode = ssl.CERT_NONE
ctx.set_ciphers("DEFAULT:@SECLEVEL=0")
ctx.minimum_version = version
ctx.maximum_version = version
with socket.create_connection(("127.0.0.1", int(sys.argv[1])), timeout=10) as raw:
    try:
        with ctx.wrap_socket(raw, server_hostname="a.test") as tls:
            print("handshake", tls.version())
    except ssl.SSLError as e:
        print("refused", e.reason)
"#;
    let python = |version: &'static str| {
        let port = site.port().to_string();
        async move {
            let out =
                Command::new("python3").args(["-c", script, &port, version]).output().await.expect("python3 runs");
            assert!(out.status.success(), "{}", text(&out.stderr));
            text(&out.stdout).trim().to_string()
        }
    };
    assert_eq!(python("TLSv1_2").await, "handshake TLSv1.2");
    let refused = python("TLSv1_1").await;
    // An alert received from the server (not a client-side "no protocols
    // available"): the ClientHello offering TLS 1.1 was sent and refused.
    assert!(refused.starts_with("refused ") && refused.contains("ALERT"), "{refused}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn plain_http_to_the_tls_port_gets_a_400_saying_so() {
    let site = site("[log]\naccess = \"access.log\"\n").await;
    // curl speaking plain HTTP to the HTTPS port, as a mistyped URL does.
    let out = site
        .curl(&[
            "--write-out",
            "\n%{http_code}",
            "--header",
            "user-agent: plain",
            &format!("http://a.test:{}/orders?x=1", site.port()),
        ])
        .await;
    assert!(out.status.success(), "{}", text(&out.stderr));
    let stdout = text(&out.stdout);
    let (body, status) = stdout.rsplit_once('\n').expect("status line");
    assert_eq!(status, "400", "{stdout}");
    let body: serde_json::Value = serde_json::from_str(body).expect("a JSON body");
    assert_eq!(body["error"], "plain_http_to_https_port", "{body}");
    assert!(body["message"].as_str().is_some_and(|m| m.contains("https://")), "{body}");
    let counted = || async {
        metric(&site.tollgate.metrics().await, "tollgate_tls_plain_http_total", &[]).expect("metric exported")
    };
    assert_eq!(counted().await, 1.0);

    // A head larger than the bound is answered once the bound is read.
    let mut stream = TcpStream::connect(site.tollgate.proxy_addr).await.expect("connect");
    let mut big = b"POST /upload HTTP/1.1\r\nhost: a.test\r\nx-filler: ".to_vec();
    big.resize(256 * 1024, b'a');
    // The server stops reading at its bound: what it leaves unsent is fine.
    let _ = tokio::time::timeout(DEADLINE, stream.write_all(&big)).await;
    let mut answer = Vec::new();
    let _ = tokio::time::timeout(DEADLINE, stream.read_to_end(&mut answer)).await.expect("the connection is closed");
    assert!(text(&answer).starts_with("HTTP/1.1 400 Bad Request\r\n"), "{:?}", text(&answer));
    assert_eq!(counted().await, 2.0);

    // Both are in the access log, as the requests they were.
    let log = site.dir().join("access.log");
    eventually("two access log lines", || async {
        std::fs::read_to_string(&log).unwrap_or_default().lines().count() == 2
    })
    .await;
    let lines: Vec<serde_json::Value> = std::fs::read_to_string(&log)
        .expect("access log")
        .lines()
        .map(|l| serde_json::from_str(l).expect("JSON line"))
        .collect();
    assert_eq!(
        (lines[0]["method"].as_str(), lines[0]["path"].as_str(), lines[0]["status"].as_u64()),
        (Some("GET"), Some("/orders"), Some(400))
    );
    assert_eq!(
        (lines[1]["method"].as_str(), lines[1]["path"].as_str(), lines[1]["status"].as_u64()),
        (Some("POST"), Some("/upload"), Some(400))
    );
    assert_eq!(lines[0]["request_id"], body["request_id"]);

    // Whereas a TLS client on the same port is served.
    let (_, status) = site.ca.get(site.tollgate.proxy_addr, "a.test").await.expect("TLS GET");
    assert_eq!(status, "HTTP/1.1 200 OK");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_plain_request_head_that_never_ends_is_answered_at_header_read_timeout() {
    let site = site("header_read_timeout = \"1s\"").await;
    let mut stream = TcpStream::connect(site.tollgate.proxy_addr).await.expect("connect");
    stream.write_all(b"GET /slow HTTP/1.1\r\nhost: a.test\r\n").await.expect("write");
    let mut answer = Vec::new();
    let _ = tokio::time::timeout(DEADLINE, stream.read_to_end(&mut answer)).await.expect("the connection is closed");
    assert!(text(&answer).starts_with("HTTP/1.1 400 Bad Request\r\n"), "{:?}", text(&answer));
    assert!(text(&answer).contains("plain_http_to_https_port"), "{:?}", text(&answer));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_renewed_certificate_is_served_to_the_next_connection_and_a_broken_one_keeps_it() {
    let site = site("").await;
    let addr = site.tollgate.proxy_addr;
    let (served, status) = site.ca.get(addr, "a.test").await.expect("TLS GET");
    assert_eq!((served, status.as_str()), (site.a.der(), "HTTP/1.1 200 OK"));

    // Renewal: a new certificate and key for the same name, each file
    // replaced whole, the way certbot and cert-manager do.
    let renewed = site.ca.issue("a renewed", &["a.test"]);
    write_atomic(&site.dir().join("a.key"), &renewed.key);
    write_atomic(&site.dir().join("a.crt"), &renewed.cert);
    eventually("the renewed certificate is presented", || async {
        site.ca.get(addr, "a.test").await.is_ok_and(|(served, _)| served == renewed.der())
    })
    .await;
    let failures = || async {
        metric(&site.tollgate.metrics().await, "tollgate_tls_reload_failures_total", &[]).expect("metric exported")
    };
    let before = failures().await;

    // A broken replacement (not a certificate at all): logged, counted, and
    // the renewed certificate stays.
    write_atomic(&site.dir().join("a.crt"), "-----BEGIN CERTIFICATE-----\nnot base64 at all\n");
    eventually("the failed reload is counted", || async { failures().await > before }).await;
    let (served, status) = site.ca.get(addr, "a.test").await.expect("TLS GET after a broken file");
    assert!(served == renewed.der(), "the broken file replaced the certificate in force");
    assert_eq!(status, "HTTP/1.1 200 OK");

    // A certificate whose key is not the one on disk: refused the same way.
    let before = failures().await;
    let stranger = site.ca.issue("stranger", &["a.test"]);
    write_atomic(&site.dir().join("a.crt"), &stranger.cert);
    eventually("the mismatched pair is counted", || async { failures().await > before }).await;
    assert!(site.ca.get(addr, "a.test").await.expect("TLS GET").0 == renewed.der());
    // The other table was never touched.
    assert!(site.ca.get(addr, "x.wild.test").await.expect("TLS GET").0 == site.wild.der());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_silent_handshake_is_cut_after_header_read_timeout_and_frees_its_slot() {
    // Long enough that a loaded machine refuses the second client before
    // the silent one is cut.
    let site = site("max_connections = 1\nheader_read_timeout = \"3s\"").await;
    let addr = site.tollgate.proxy_addr;
    let tollgate = &site.tollgate;
    let gauge = |name: &'static str| async move { metric(&tollgate.metrics().await, name, &[]) };
    // Holds the only slot: connects and sends nothing.
    let mut silent = TcpStream::connect(addr).await.expect("connect");
    eventually("the silent connection holds the slot", || async {
        gauge("tollgate_connections_active").await == Some(1.0)
    })
    .await;
    // Another client cannot get in while it does...
    let refused = site.ca.get(addr, "a.test").await;
    assert!(refused.is_err(), "served while the only slot was held: {refused:?}");
    assert_eq!(gauge("tollgate_connections_refused_total").await, Some(1.0));
    // ...but does once the silent handshake has been given up on.
    eventually("a TLS request is served again", || async { site.ca.get(addr, "a.test").await.is_ok() }).await;
    let mut buf = [0u8; 64];
    let closed = tokio::time::timeout(DEADLINE, silent.read(&mut buf)).await.expect("the silent connection is closed");
    assert!(matches!(closed, Ok(0) | Err(_)), "{closed:?}");
}

/// curl's `--write-out` of a request to the redirect listener of `site`.
async fn redirected(site: &Site, host: &str, target: &str) -> String {
    let redirect: SocketAddr = site.tollgate.redirect_addr.expect("redirect listener");
    let out = site
        .curl(&[
            "--output",
            "/dev/null",
            "--write-out",
            "%{http_code} %{redirect_url}",
            "--header",
            &format!("host: {host}"),
            &format!("http://{redirect}{target}"),
        ])
        .await;
    assert!(out.status.success(), "{}", text(&out.stderr));
    text(&out.stdout)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_redirect_listener_answers_308_to_the_https_url_on_port_443() {
    let site = site("http_redirect = \"127.0.0.1:0\"").await;
    let redirect: SocketAddr = site.tollgate.redirect_addr.expect("redirect listener");
    // The public HTTPS port defaults to 443, whatever port the proxy
    // listener has (behind a load balancer or a port mapping): left out.
    assert_eq!(
        redirected(&site, "shop.test:8080", "/cart/add?item=7&n=2").await,
        "308 https://shop.test/cart/add?item=7&n=2"
    );
    // Followed, it reaches the upstream over TLS, method kept: curl's
    // connection to a.test:443 goes to the proxy listener.
    let out = site
        .curl(&[
            "--location",
            "--resolve",
            &format!("a.test:{}:127.0.0.1", redirect.port()),
            "--connect-to",
            &format!("a.test:443:127.0.0.1:{}", site.port()),
            "--request",
            "POST",
            "--data",
            "x",
            &format!("http://a.test:{}/orders", redirect.port()),
        ])
        .await;
    assert!(out.status.success(), "{}", text(&out.stderr));
    let echo: serde_json::Value = serde_json::from_slice(&out.stdout).expect("echo JSON");
    assert_eq!((echo["method"].as_str(), echo["path"].as_str()), (Some("POST"), Some("/orders")));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redirect_port_names_the_public_https_port_in_the_redirect() {
    let named = site("http_redirect = \"127.0.0.1:0\"\nredirect_port = 8443").await;
    assert_eq!(redirected(&named, "shop.test", "/a?b=c").await, "308 https://shop.test:8443/a?b=c");
    let standard = site("http_redirect = \"127.0.0.1:0\"\nredirect_port = 443").await;
    assert_eq!(redirected(&standard, "[::1]:80", "/").await, "308 https://[::1]/");
}

fn tollgate_check(config: &Path) -> Output {
    std::process::Command::new(env!("CARGO_BIN_EXE_tollgate"))
        .args(["check", "--config", &config.to_string_lossy()])
        .env_remove("TOLLGATE_LOG_FORMAT")
        .output()
        .expect("the tollgate binary runs")
}

#[test]
fn check_rejects_a_key_that_does_not_go_with_its_certificate() {
    let ca = TestCa::new();
    let dir = tempfile::tempdir().expect("temp dir");
    ca.issue("a", &["a.test"]).write(dir.path(), "a");
    ca.issue("b", &["b.test"]).write(dir.path(), "b");
    std::fs::write(dir.path().join("rules.toml"), "").expect("rules");
    let write = |pairs: &[(&str, &str)], extra: &str| {
        let mut config = format!("[listen]\nproxy = \"127.0.0.1:0\"\n{extra}\n");
        for (cert, key) in pairs {
            config.push_str(&format!("\n[[listen.tls]]\ncert_file = \"{cert}\"\nkey_file = \"{key}\"\n"));
        }
        config.push_str("\n[rules]\npath = \"rules.toml\"\n");
        let path = dir.path().join("tollgate.toml");
        std::fs::write(&path, config).expect("config");
        path
    };

    let good = tollgate_check(&write(&[("a.crt", "a.key"), ("b.crt", "b.key")], ""));
    assert!(good.status.success(), "{}", text(&good.stderr));

    // The second table pairs b's certificate with a's key: line 9 is its
    // `[[listen.tls]]` header.
    let out = tollgate_check(&write(&[("a.crt", "a.key"), ("b.crt", "a.key")], ""));
    assert!(!out.status.success());
    let err = text(&out.stderr);
    assert!(err.contains("tollgate.toml:9:"), "{err}");
    assert!(err.contains("a.key does not go with the certificate in") && err.contains("b.crt"), "{err}");

    // A key file that is a certificate, and a missing file.
    let out = tollgate_check(&write(&[("a.crt", "a.crt"), ("b.crt", "missing.key")], ""));
    let err = text(&out.stderr);
    assert!(err.contains("a.crt holds no PEM private key"), "{err}");
    assert!(err.contains("tollgate.toml:11:12: cannot read") && err.contains("missing.key"), "{err}");

    // A redirect listener with nothing to redirect to.
    let out = tollgate_check(&write(&[], "http_redirect = \"127.0.0.1:8081\""));
    let err = text(&out.stderr);
    assert!(err.contains("tollgate.toml:3:17: listen.http_redirect redirects to HTTPS"), "{err}");
}

#[test]
fn the_gateway_examples_tls_section_passes_check_once_uncommented() {
    let repo = Path::new(env!("CARGO_MANIFEST_DIR"));
    let example = std::fs::read_to_string(repo.join("examples/gateway/tollgate.toml")).expect("read the example");
    let ca = TestCa::new();
    let dir = tempfile::tempdir().expect("temp dir");
    let (api_cert, api_key) = ca.issue("api", &["api.example.com"]).write(dir.path(), "api");
    let (partners_cert, partners_key) = ca.issue("partners", &["*.partners.example.com"]).write(dir.path(), "partners");
    let mut uncommented = 0;
    let config: String = example
        .lines()
        .map(|line| {
            let key = ["# http_redirect", "# [[listen.tls]]", "# cert_file", "# key_file"];
            if key.iter().any(|k| line.starts_with(k)) {
                uncommented += 1;
                line[2..].to_string()
            } else {
                line.to_string()
            }
        })
        .collect::<Vec<_>>()
        .join("\n")
        .replace("/etc/letsencrypt/live/api.example.com/fullchain.pem", &api_cert.to_string_lossy())
        .replace("/etc/letsencrypt/live/api.example.com/privkey.pem", &api_key.to_string_lossy())
        .replace("/etc/tollgate/tls/partners.crt", &partners_cert.to_string_lossy())
        .replace("/etc/tollgate/tls/partners.key", &partners_key.to_string_lossy())
        .replace("path = \"rules\"", &format!("path = {:?}", repo.join("examples/gateway/rules")));
    assert_eq!(uncommented, 7, "the example's TLS section changed shape:\n{config}");
    let path = dir.path().join("tollgate.toml");
    std::fs::write(&path, &config).expect("write config");
    let out = tollgate_check(&path);
    assert!(out.status.success(), "{}\n{config}", text(&out.stderr));
}

/// tests/support/h2_slow_client.py over TLS against `site`: its first line
/// of output, then a receiver of the rest. The child is killed on drop.
struct SlowH2 {
    child: tokio::process::Child,
    lines: tokio::io::Lines<tokio::io::BufReader<tokio::process::ChildStdout>>,
}

impl SlowH2 {
    async fn start(site: &Site, mode: &str) -> SlowH2 {
        use tokio::io::AsyncBufReadExt;
        let script = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/support/h2_slow_client.py");
        let mut child = Command::new("python3")
            .args([script, &site.port().to_string(), "256", mode, "tls"])
            .stdin(std::process::Stdio::piped())
            .stdout(std::process::Stdio::piped())
            .kill_on_drop(true)
            .spawn()
            .expect("python3 runs (scripts/test installs its h2 package)");
        let lines = tokio::io::BufReader::new(child.stdout.take().expect("stdout")).lines();
        let mut client = SlowH2 { child, lines };
        let first = client.next_line().await;
        assert!(first.starts_with("sent "), "the client did not send its requests: {first:?}");
        client
    }

    async fn next_line(&mut self) -> String {
        let line = tokio::time::timeout(DEADLINE, self.lines.next_line()).await;
        line.ok().and_then(|l| l.ok().flatten()).unwrap_or_else(|| {
            let _ = self.child.start_kill();
            panic!("no word from the h2 client within {DEADLINE:?}")
        })
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn h2_over_tls_keeps_the_slow_reader_protections() {
    use std::sync::atomic::Ordering;
    use support::big_upstream::BigUpstream;

    // A client that grants no flow-control window: its connection holds
    // response data none of which leaves, and is closed after send_timeout.
    let upstream = BigUpstream::start(16 * 1024 * 1024).await;
    let site = site_for(upstream.addr, "send_timeout = \"1s\"").await;
    let mut client = SlowH2::start(&site, "nowindow").await;
    assert_eq!(client.next_line().await, "closed", "tollgate should close the connection");

    // A client that stops reading its socket: tollgate's writes (through
    // TLS) stay blocked, the connection is closed and the upstream
    // responses it relayed are dropped.
    let upstream = BigUpstream::start(16 * 1024 * 1024).await;
    let site = site_for(upstream.addr, "send_timeout = \"1s\"").await;
    let _client = SlowH2::start(&site, "noread").await;
    eventually("the upstream connections are closed", || async { upstream.broken.load(Ordering::SeqCst) }).await;
}
