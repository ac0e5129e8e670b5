//! Unit tests for the main file and rules files: every key of the issue's
//! examples, every default, and every error with its exact
//! file:line:column. No IO except temporary directories for rules paths.

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::time::Duration;

use ipnet::IpNet;

use super::*;
use crate::limiter::Algorithm;

const MS: Duration = Duration::from_millis(1);
const SEC: Duration = Duration::from_secs(1);

fn main_path() -> &'static Path {
    Path::new("/etc/tollgate/tollgate.toml")
}

fn parse(source: &str) -> Config {
    match Config::parse(main_path(), source) {
        Ok(c) => c,
        Err(e) => panic!("expected a valid config, got:\n{e}"),
    }
}

/// Every error of an invalid main file, as `tollgate check` prints it.
fn errors(source: &str) -> Vec<String> {
    match Config::parse(Path::new("t.toml"), source) {
        Ok(_) => panic!("expected errors for:\n{source}"),
        Err(e) => e.0.iter().map(ToString::to_string).collect(),
    }
}

// ---------------------------------------------------------------------------
// Main file
// ---------------------------------------------------------------------------

/// The main file exactly as the issue shows it.
const ISSUE_MAIN: &str = r#"[listen]
proxy = "0.0.0.0:8080"        # clients connect here
admin = "127.0.0.1:9090"      # /metrics /healthz /readyz /rules, keep it private

[rules]
path = "rules"                # one .toml file or a directory of *.toml files, watched and hot-reloaded

[store]
backend = "memory"            # "memory" (default, this process only) | "redis" (separate issue)
# url = "redis-cluster://10.0.0.1:6379?node=10.0.0.2:6379"   # fred's URL syntax
# timeout = "20ms"
on_error = "allow"            # what a check does when the store fails: allow | deny | local

[client]
trusted_proxies = ["127.0.0.1/32"]  # only these peers may set X-Forwarded-For / X-Real-IP; otherwise the socket address is the client
ipv6_prefix = 64                    # IPv6 clients are keyed by their /64 (one host owns a whole /64)
user_header = "x-user-id"           # identity set by an auth layer in front
api_key_header = "x-api-key"

[[upstream]]
name = "orders"
url = "http://127.0.0.1:9001"
connect_timeout = "1s"
timeout = "30s"

[[route]]
path_prefix = "/orders"       # longest matching prefix wins; optional host = "api.example.com"
upstream = "orders"
"#;

#[test]
fn the_issue_main_file_parses() {
    let c = parse(ISSUE_MAIN);
    assert_eq!(c.path, PathBuf::from("/etc/tollgate/tollgate.toml"));
    assert_eq!(c.listen.proxy.to_string(), "0.0.0.0:8080");
    assert_eq!(c.listen.admin.to_string(), "127.0.0.1:9090");
    assert_eq!(c.rules_path, PathBuf::from("/etc/tollgate/rules"));
    assert_eq!(c.store.backend, Backend::Memory);
    assert_eq!(c.store.url, None);
    assert_eq!(c.store.timeout, 20 * MS);
    assert_eq!(c.store.on_error, OnError::Allow);
    assert_eq!(c.client.trusted_proxies, vec!["127.0.0.1/32".parse::<IpNet>().unwrap()]);
    assert_eq!(c.client.ipv6_prefix, 64);
    assert_eq!(c.client.user_header, "x-user-id");
    assert_eq!(c.client.api_key_header, "x-api-key");
    assert_eq!(c.upstreams.len(), 1);
    let u = &c.upstreams[0];
    assert_eq!(u.name, "orders");
    assert_eq!(u.servers[0].scheme, http::uri::Scheme::HTTP);
    assert_eq!(u.servers[0].authority.as_str(), "127.0.0.1:9001");
    assert_eq!(u.base_path, "");
    assert_eq!(u.connect_timeout, SEC);
    assert_eq!(u.timeout, 30 * SEC);
    assert_eq!(c.routes.len(), 1);
    let r = &c.routes[0];
    assert_eq!(
        (r.name.as_str(), r.path_prefix.as_str(), r.host.as_deref(), r.upstream),
        ("orders", "/orders", None, 0)
    );
    assert_eq!(c.upstream_index("orders"), Some(0));
    assert_eq!(c.upstream_index("billing"), None);
}

#[test]
fn every_main_key_is_read() {
    let c = parse(
        r#"
[listen]
proxy = "[::]:8000"
admin = "127.0.0.1:0"
header_read_timeout = "5s"
idle_timeout = "90s"
max_connections = 250
drain_timeout = "2m"
max_header_bytes = 2048
decision = "127.0.0.1:8081"
envoy_rls = "[::1]:8082"

[rules]
path = "/srv/rules.toml"

[store]
backend = "redis"
url = "redis-cluster://10.0.0.1:6379?node=10.0.0.2:6379"
timeout = "250ms"
on_error = "local"
pool_size = 4
key_prefix = "tg:"

[client]
trusted_proxies = ["10.0.0.0/8", "192.168.1.1", "fd00::/8"]
ipv6_prefix = 56
user_header = "X-Auth-User"
api_key_header = "authorization"

[[upstream]]
name = "orders"
url = "http://orders.internal:9001/base/"
connect_timeout = "250ms"
timeout = "1h"

[[upstream]]
name = "users"
url = "http://127.0.0.1:9002"

[[route]]
name = "orders-api"
path_prefix = "/orders"
host = "API.Example.com"
upstream = "orders"

[[route]]
path_prefix = "/users"
upstream = "users"
"#,
    );
    assert_eq!(c.listen.proxy.to_string(), "[::]:8000");
    assert_eq!(c.listen.admin.to_string(), "127.0.0.1:0");
    assert_eq!(c.listen.decision.map(|a| a.to_string()).as_deref(), Some("127.0.0.1:8081"));
    assert_eq!(c.listen.envoy_rls.map(|a| a.to_string()).as_deref(), Some("[::1]:8082"));
    assert_eq!(c.listen.header_read_timeout, 5 * SEC);
    assert_eq!(c.listen.idle_timeout, 90 * SEC);
    assert_eq!(c.listen.max_connections, 250);
    assert_eq!(c.listen.drain_timeout, 120 * SEC);
    assert_eq!(c.listen.max_header_bytes, 2048);
    assert_eq!(c.rules_path, PathBuf::from("/srv/rules.toml"));
    assert_eq!(c.store.backend, Backend::Redis);
    assert_eq!(c.store.url.as_deref(), Some("redis-cluster://10.0.0.1:6379?node=10.0.0.2:6379"));
    assert_eq!(c.store.timeout, 250 * MS);
    assert_eq!(c.store.on_error, OnError::Local);
    assert_eq!(c.store.pool_size, 4);
    assert_eq!(c.store.key_prefix, "tg:");
    let nets: Vec<String> = c.client.trusted_proxies.iter().map(ToString::to_string).collect();
    assert_eq!(nets, ["10.0.0.0/8", "192.168.1.1/32", "fd00::/8"]);
    assert_eq!(c.client.ipv6_prefix, 56);
    assert_eq!(c.client.user_header, "x-auth-user");
    assert_eq!(c.client.api_key_header, "authorization");

    let names: Vec<&str> = c.upstreams.iter().map(|u| u.name.as_str()).collect();
    assert_eq!(names, ["orders", "users"]);
    let o = &c.upstreams[0];
    assert_eq!(o.servers[0].authority.as_str(), "orders.internal:9001");
    assert_eq!(o.base_path, "/base");
    assert_eq!(o.connect_timeout, 250 * MS);
    assert_eq!(o.timeout, 3600 * SEC);
    let u = &c.upstreams[1];
    assert_eq!((u.base_path.as_str(), u.connect_timeout, u.timeout), ("", SEC, 30 * SEC));

    let r = &c.routes[0];
    assert_eq!(
        (r.name.as_str(), r.path_prefix.as_str(), r.host.as_deref(), r.upstream),
        ("orders-api", "/orders", Some("api.example.com"), 0)
    );
    let r = &c.routes[1];
    assert_eq!((r.name.as_str(), r.path_prefix.as_str(), r.host.as_deref(), r.upstream), ("users", "/users", None, 1));
}

#[test]
fn an_empty_main_file_takes_every_default() {
    let c = parse("");
    assert_eq!(c.listen.proxy, SocketAddr::from(([0, 0, 0, 0], 8080)));
    assert_eq!(c.listen.admin, SocketAddr::from(([127, 0, 0, 1], 9090)));
    assert_eq!(c.listen.header_read_timeout, 10 * SEC);
    assert_eq!(c.listen.idle_timeout, 60 * SEC);
    assert_eq!(c.listen.max_connections, 10_000);
    assert_eq!(c.listen.drain_timeout, 30 * SEC);
    assert_eq!(c.listen.max_header_bytes, 65_536);
    assert_eq!((c.listen.decision, c.listen.envoy_rls), (None, None));
    assert_eq!(c.rules_path, PathBuf::from("/etc/tollgate/rules"));
    assert_eq!(c.store.backend, Backend::Memory);
    assert_eq!(c.store.url, None);
    assert_eq!(c.store.timeout, 20 * MS);
    assert_eq!(c.store.on_error, OnError::Allow);
    assert_eq!(c.store.pool_size, 1);
    assert_eq!(c.store.key_prefix, "tollgate:");
    assert!(c.client.trusted_proxies.is_empty());
    assert_eq!(c.client.ipv6_prefix, 64);
    assert_eq!(c.client.user_header, "x-user-id");
    assert_eq!(c.client.api_key_header, "x-api-key");
    assert!(c.upstreams.is_empty());
    assert!(c.routes.is_empty());
}

#[test]
fn empty_tables_take_the_defaults_too() {
    let c = parse("[listen]\n[rules]\n[store]\n[client]\n");
    assert_eq!(c.listen.proxy.to_string(), "0.0.0.0:8080");
    assert_eq!(c.listen.admin.to_string(), "127.0.0.1:9090");
    assert_eq!(c.rules_path, PathBuf::from("/etc/tollgate/rules"));
    assert_eq!((c.store.backend, c.store.timeout, c.store.on_error), (Backend::Memory, 20 * MS, OnError::Allow));
    assert_eq!(c.client.ipv6_prefix, 64);
}

#[test]
fn the_rules_path_is_resolved_against_the_config_files_directory() {
    let rel = |config: &str, rules: &str| {
        let src = format!("[rules]\npath = {rules:?}\n");
        Config::parse(Path::new(config), &src).expect("valid").rules_path
    };
    assert_eq!(rel("/etc/tollgate/tollgate.toml", "rules.d"), PathBuf::from("/etc/tollgate/rules.d"));
    assert_eq!(rel("/etc/tollgate/tollgate.toml", "../shared/rules"), PathBuf::from("/etc/tollgate/../shared/rules"));
    assert_eq!(rel("/etc/tollgate/tollgate.toml", "/abs/rules"), PathBuf::from("/abs/rules"));
    assert_eq!(rel("conf/tollgate.toml", "rules"), PathBuf::from("conf/rules"));
    // A bare file name in the working directory: the rules are beside it.
    assert_eq!(rel("tollgate.toml", "rules"), PathBuf::from("rules"));
    let c = Config::parse(Path::new("tollgate.toml"), "").expect("valid");
    assert_eq!(c.rules_path, PathBuf::from("rules"));
}

#[test]
fn on_error_and_backend_spellings() {
    for (text, want) in [("allow", OnError::Allow), ("deny", OnError::Deny), ("local", OnError::Local)] {
        assert_eq!(parse(&format!("[store]\non_error = {text:?}\n")).store.on_error, want);
    }
    assert_eq!(
        errors("[store]\non_error = \"ignore\"\n"),
        ["t.toml:2:12: unknown variant `ignore`, expected one of `allow`, `deny`, `local`"]
    );
    assert_eq!(
        errors("[store]\nbackend = \"etcd\"\n"),
        ["t.toml:2:11: unknown variant `etcd`, expected `memory` or `redis`"]
    );
}

#[test]
fn unknown_key_at_the_top_level() {
    assert_eq!(
        errors("[listen]\nproxy = \"0.0.0.0:8080\"\n\n[limits]\nx = 1\n"),
        [
            "t.toml:4:2: unknown field `limits`, expected one of `listen`, `rules`, `store`, `client`, `upstream`, `route`, `log`, `admin`, `tracing`"
        ]
    );
    assert_eq!(
        errors("verbose = true\n"),
        [
            "t.toml:1:1: unknown field `verbose`, expected one of `listen`, `rules`, `store`, `client`, `upstream`, `route`, `log`, `admin`, `tracing`"
        ]
    );
}

#[test]
fn unknown_key_in_a_table() {
    assert_eq!(
        errors("[store]\nbackend = \"memory\"\n  timout = \"20ms\"\n"),
        [
            "t.toml:3:3: unknown field `timout`, expected one of `backend`, `url`, `timeout`, `on_error`, `pool_size`, `key_prefix`, `lease_percent`, `lease_idle`, `lease_lifetime`, `tls_ca_file`, `tls_cert_file`, `tls_key_file`, `max_keys`"
        ]
    );
    // [listen] and [[route]] grow keys too: the place and the start only.
    let listen = errors("[listen]\nport = 8080\n");
    assert_eq!(listen.len(), 1);
    assert!(
        listen[0].starts_with("t.toml:2:1: unknown field `port`, expected one of `proxy`, `admin`, ")
            && listen[0].contains("`merge_slashes`, `encoded_slashes`, `underscores_in_headers`")
            && listen[0].contains("`body_read_timeout`, `send_timeout`"),
        "{listen:?}"
    );
    // [client] is growing keys (jwt): check the place and the start only.
    let client = errors("[client]\ntrusted_proxy = []\n");
    assert_eq!(client.len(), 1);
    assert!(
        client[0].starts_with("t.toml:2:1: unknown field `trusted_proxy`, expected one of ")
            && client[0].contains("`trusted_proxies`, `ipv6_prefix`, `user_header`, `api_key_header`"),
        "{client:?}"
    );
    assert_eq!(
        errors("[[upstream]]\nname = \"a\"\nurl = \"http://a\"\nretry = 3\n"),
        [
            "t.toml:4:1: unknown field `retry`, expected one of `name`, `url`, `servers`, `balance`, `hash_key`, `health_check`, `connect_timeout`, `timeout`, `eject_after`, `max_ejected_percent`, `retries`, `retry_budget_percent`, `pool_idle_timeout`, `h2_keepalive_interval`, `max_inflight`, `try_timeout`, `protocol`, `tls_ca_file`, `tls_cert_file`, `tls_key_file`, `tls_server_name`"
        ]
    );
    let route = errors("[[route]]\npath = \"/\"\nupstream = \"a\"\n");
    assert_eq!(route.len(), 1);
    assert!(
        route[0].starts_with("t.toml:2:1: unknown field `path`, expected one of `name`, `path_prefix`, ")
            && route[0].contains("`max_body`, `buffer_body`"),
        "{route:?}"
    );
    assert_eq!(errors("[rules]\ndir = \"r\"\n"), ["t.toml:2:1: unknown field `dir`, expected `path`"]);
}

#[test]
fn a_toml_syntax_error_has_its_position() {
    assert_eq!(
        errors("[store]\nbackend = memory\n"),
        ["t.toml:2:11: string values must be quoted, expected literal string"]
    );
}

#[test]
fn bad_durations() {
    assert_eq!(
        errors("[store]\ntimeout = \"20 parsecs\"\n"),
        [
            "t.toml:2:11: store.timeout \"20 parsecs\" is not a duration (unknown time unit \"parsecs\", supported units: ns, us/µs, ms, sec, min, hours, days, weeks, months, years (and few variations)); write e.g. \"250ms\", \"1s\", \"5m\", \"1h\", \"1d\""
        ]
    );
    assert_eq!(
        errors("[[upstream]]\nname = \"a\"\nurl = \"http://a\"\ntimeout = \"30\"\n"),
        [
            "t.toml:4:11: upstream.timeout \"30\" is not a duration (time unit needed, for example 30sec or 30ms); write e.g. \"250ms\", \"1s\", \"5m\", \"1h\", \"1d\""
        ]
    );
    assert_eq!(
        errors("[listen]\nidle_timeout = \"-1s\"\n"),
        [
            "t.toml:2:16: listen.idle_timeout \"-1s\" is not a duration (expected number at 0); write e.g. \"250ms\", \"1s\", \"5m\", \"1h\", \"1d\""
        ]
    );
}

#[test]
fn zero_durations() {
    assert_eq!(errors("[store]\ntimeout = \"0ms\"\n"), ["t.toml:2:11: store.timeout must be longer than zero"]);
    assert_eq!(
        errors("[[upstream]]\nname = \"a\"\nurl = \"http://a\"\nconnect_timeout = \"0s\"\n"),
        ["t.toml:4:19: upstream.connect_timeout must be longer than zero"]
    );
    assert_eq!(
        errors("[listen]\ndrain_timeout = \"0s\"\n"),
        ["t.toml:2:17: listen.drain_timeout must be longer than zero"]
    );
}

#[test]
fn durations_in_every_unit_of_the_contract() {
    let timeout = |s: &str| parse(&format!("[store]\ntimeout = {s:?}\n")).store.timeout;
    assert_eq!(timeout("250ms"), 250 * MS);
    assert_eq!(timeout("1s"), SEC);
    assert_eq!(timeout("90s"), 90 * SEC);
    assert_eq!(timeout("5m"), 300 * SEC);
    assert_eq!(timeout("1h"), 3600 * SEC);
    assert_eq!(timeout("1d"), 86_400 * SEC);
    assert_eq!(timeout("1h30m"), 5400 * SEC);
    assert_eq!(timeout(" 2s "), 2 * SEC);
}

#[test]
fn bad_listen_addresses() {
    assert_eq!(
        errors("[listen]\nproxy = \"8080\"\n"),
        ["t.toml:2:9: listen.proxy \"8080\" is not an address such as \"0.0.0.0:8080\" or \"[::1]:8080\""]
    );
    assert_eq!(
        errors("[listen]\nadmin = \"localhost:9090\"\n"),
        ["t.toml:2:9: listen.admin \"localhost:9090\" is not an address such as \"0.0.0.0:8080\" or \"[::1]:8080\""]
    );
    assert_eq!(
        errors("[listen]\nproxy = \"0.0.0.0:80800\"\n"),
        ["t.toml:2:9: listen.proxy \"0.0.0.0:80800\" is not an address such as \"0.0.0.0:8080\" or \"[::1]:8080\""]
    );
    assert_eq!(
        errors("[listen]\ndecision = \"8081\"\nenvoy_rls = \"grpc://127.0.0.1:8082\"\n"),
        [
            "t.toml:2:12: listen.decision \"8081\" is not an address such as \"0.0.0.0:8080\" or \"[::1]:8080\"",
            "t.toml:3:13: listen.envoy_rls \"grpc://127.0.0.1:8082\" is not an address such as \"0.0.0.0:8080\" or \"[::1]:8080\""
        ]
    );
}

#[test]
fn listen_limits_are_checked() {
    assert_eq!(
        errors("[listen]\nmax_connections = 0\nmax_header_bytes = 100\n"),
        [
            "t.toml:2:19: listen.max_connections must be at least 1",
            "t.toml:3:20: listen.max_header_bytes must be at least 1024"
        ]
    );
}

/// A directory holding `t.toml`'s certificate, `a.crt` and `a.key`
/// (self-signed for `a.test`), and the `[[listen.tls]]` table naming them.
fn tls_dir() -> (tempfile::TempDir, &'static str) {
    let dir = tempfile::tempdir().expect("tempdir");
    let key = rcgen::KeyPair::generate().expect("key");
    let cert = rcgen::CertificateParams::new(vec!["a.test".to_string()])
        .expect("params")
        .self_signed(&key)
        .expect("certificate");
    std::fs::write(dir.path().join("a.crt"), cert.pem()).expect("write certificate");
    std::fs::write(dir.path().join("a.key"), key.serialize_pem()).expect("write key");
    (dir, "\n[[listen.tls]]\ncert_file = \"a.crt\"\nkey_file = \"a.key\"\n")
}

/// [`errors`] of a main file beside the certificates of [`tls_dir`].
fn errors_in(dir: &Path, source: &str) -> Vec<String> {
    match Config::parse(&dir.join("t.toml"), source) {
        Ok(_) => panic!("expected errors for:\n{source}"),
        Err(e) => e.0.iter().map(|e| e.to_string().replace(&format!("{}/", dir.display()), "")).collect(),
    }
}

#[test]
fn redirect_port_defaults_to_443_and_is_a_port() {
    let (dir, tls) = tls_dir();
    let parse_in = |source: &str| Config::parse(&dir.path().join("t.toml"), source).expect("valid");
    let c = parse_in(&format!("[listen]\nhttp_redirect = \"127.0.0.1:80\"\n{tls}"));
    assert_eq!((c.listen.http_redirect.map(|a| a.port()), c.listen.redirect_port), (Some(80), 443));
    let c = parse_in(&format!("[listen]\nhttp_redirect = \"127.0.0.1:80\"\nredirect_port = 8443\n{tls}"));
    assert_eq!(c.listen.redirect_port, 8443);
    assert_eq!(
        errors_in(dir.path(), &format!("[listen]\nhttp_redirect = \"127.0.0.1:80\"\nredirect_port = 0\n{tls}")),
        ["t.toml:3:17: listen.redirect_port must be a port from 1 to 65535"]
    );
    assert_eq!(
        errors_in(dir.path(), &format!("[listen]\nhttp_redirect = \"127.0.0.1:80\"\nredirect_port = 65536\n{tls}")),
        ["t.toml:3:17: listen.redirect_port must be a port from 1 to 65535"]
    );
    assert_eq!(
        errors_in(dir.path(), &format!("[listen]\nredirect_port = 8443\n{tls}")),
        [
            "t.toml:2:17: listen.redirect_port is the port written into listen.http_redirect's redirects; set listen.http_redirect too, or remove it"
        ]
    );
}

#[test]
fn connection_lifetime_limits() {
    let c = parse("");
    assert_eq!((c.listen.max_requests_per_connection, c.listen.max_connection_age), (10_000, None));
    let c = parse("[listen]\nmax_requests_per_connection = 1\nmax_connection_age = \"10m\"\n");
    assert_eq!((c.listen.max_requests_per_connection, c.listen.max_connection_age), (1, Some(600 * SEC)));
    assert_eq!(
        errors("[listen]\nmax_requests_per_connection = 0\nmax_connection_age = \"0s\"\n"),
        [
            "t.toml:2:31: listen.max_requests_per_connection must be at least 1",
            "t.toml:3:22: listen.max_connection_age must be longer than zero; leave it out for no age limit"
        ]
    );
    assert_eq!(
        errors("[listen]\nmax_connection_age = \"forever\"\n"),
        [
            "t.toml:2:22: listen.max_connection_age \"forever\" is not a duration (expected number at 0); write e.g. \"250ms\", \"1s\", \"5m\", \"1h\", \"1d\""
        ]
    );
}

#[test]
fn shutdown_delay_may_be_zero() {
    assert_eq!(parse("").listen.shutdown_delay, 5 * SEC);
    assert_eq!(parse("[listen]\nshutdown_delay = \"0s\"\n").listen.shutdown_delay, Duration::ZERO);
    assert_eq!(parse("[listen]\nshutdown_delay = \"15s\"\n").listen.shutdown_delay, 15 * SEC);
    assert_eq!(
        errors("[listen]\nshutdown_delay = \"soon\"\n"),
        [
            "t.toml:2:18: listen.shutdown_delay \"soon\" is not a duration (expected number at 0); write e.g. \"0s\", \"250ms\", \"5s\", \"1m\""
        ]
    );
}

const ORDERS: &str = "[[upstream]]\nname = \"orders\"\nurl = \"http://127.0.0.1:9001\"\n";

#[test]
fn a_route_naming_an_unknown_upstream() {
    let src = format!("{ORDERS}\n[[route]]\npath_prefix = \"/billing\"\nupstream = \"billing\"\n");
    assert_eq!(errors(&src), ["t.toml:7:12: route names upstream \"billing\", which no [[upstream]] defines"]);
}

#[test]
fn a_route_prefix_must_start_with_a_slash() {
    let src = format!("{ORDERS}[[route]]\npath_prefix = \"orders\"\nupstream = \"orders\"\n");
    assert_eq!(errors(&src), ["t.toml:5:15: route path_prefix \"orders\" must start with '/'"]);
}

#[test]
fn a_route_on_an_invalid_upstream_gets_no_second_error() {
    let src = ISSUE_MAIN.replace("http://127.0.0.1:9001", "ftp://127.0.0.1:9001");
    assert_eq!(errors(&src), ["t.toml:22:7: upstream servers are http:// or https://"]);
    // ...and a second upstream of the same name is still a duplicate.
    let src = format!("{src}\n[[upstream]]\nname = \"orders\"\nurl = \"http://127.0.0.1:9002\"\n");
    assert_eq!(
        errors(&src),
        ["t.toml:22:7: upstream servers are http:// or https://", "t.toml:31:8: upstream \"orders\" is defined twice",]
    );
}

#[test]
fn an_empty_rules_path() {
    assert_eq!(errors("[rules]\npath = \"\"\n"), ["t.toml:2:8: rules.path must name a rules file or directory"]);
}

#[test]
fn a_duplicate_upstream() {
    let src = format!("{ORDERS}\n[[upstream]]\nname = \"orders\"\nurl = \"http://127.0.0.1:9002\"\n");
    assert_eq!(errors(&src), ["t.toml:6:8: upstream \"orders\" is defined twice"]);
}

#[test]
fn upstreams_are_http_or_https_urls() {
    assert_eq!(
        errors("[[upstream]]\nname = \"a\"\nurl = \"ftp://a.example.com\"\n"),
        ["t.toml:3:7: upstream servers are http:// or https://"]
    );
    assert_eq!(
        errors("[[upstream]]\nname = \"a\"\nurl = \"127.0.0.1:9001\"\n"),
        ["t.toml:3:7: upstream url \"127.0.0.1:9001\" needs a scheme and a host, such as \"http://127.0.0.1:9001\""]
    );
    assert_eq!(
        errors("[[upstream]]\nname = \"a\"\nurl = \"http://a b\"\n"),
        ["t.toml:3:7: upstream url \"http://a b\" is not a URL such as \"http://127.0.0.1:9001\""]
    );
}

#[test]
fn bad_trusted_proxies() {
    assert_eq!(
        errors("[client]\ntrusted_proxies = [\"10.0.0.0/8\", \"10.0.0.0/33\", \"proxy.local\"]\n"),
        [
            "t.toml:2:34: client.trusted_proxies entry \"10.0.0.0/33\" is not an IP address or CIDR such as \"10.0.0.0/8\"",
            "t.toml:2:49: client.trusted_proxies entry \"proxy.local\" is not an IP address or CIDR such as \"10.0.0.0/8\"",
        ]
    );
}

#[test]
fn ipv6_prefix_out_of_range() {
    assert_eq!(errors("[client]\nipv6_prefix = 0\n"), ["t.toml:2:15: client.ipv6_prefix must be between 1 and 128"]);
    assert_eq!(errors("[client]\nipv6_prefix = 129\n"), ["t.toml:2:15: client.ipv6_prefix must be between 1 and 128"]);
    assert_eq!(errors("[client]\nipv6_prefix = -64\n"), ["t.toml:2:15: client.ipv6_prefix must be between 1 and 128"]);
    assert_eq!(parse("[client]\nipv6_prefix = 128\n").client.ipv6_prefix, 128);
    assert_eq!(parse("[client]\nipv6_prefix = 1\n").client.ipv6_prefix, 1);
}

#[test]
fn bad_identity_headers() {
    assert_eq!(
        errors("[client]\nuser_header = \"x user\"\n"),
        ["t.toml:2:15: client.user_header \"x user\" is not a valid HTTP header name"]
    );
}

#[test]
fn request_id_in_response_is_on_unless_turned_off() {
    assert!(parse("").client.request_id_in_response);
    assert!(parse("[client]\nrequest_id_in_response = true\n").client.request_id_in_response);
    assert!(!parse("[client]\nrequest_id_in_response = false\n").client.request_id_in_response);
    let errs = errors("[client]\nrequest_id_in_response = \"no\"\n");
    assert_eq!(errs.len(), 1, "{errs:?}");
    assert!(errs[0].starts_with("t.toml:2:26: invalid type: string \"no\", expected a boolean"), "{errs:?}");
}

#[test]
fn redis_needs_a_url_and_the_error_points_at_the_backend() {
    assert_eq!(
        errors("[listen]\nproxy = \"0.0.0.0:8080\"\n\n[store]\nbackend = \"redis\"\n"),
        [
            "t.toml:5:11: store.backend = \"redis\" needs store.url, e.g. \"redis://127.0.0.1:6379\" or \"redis-cluster://10.0.0.1:6379?node=10.0.0.2:6379\""
        ]
    );
}

#[test]
fn store_max_keys_is_bounded_and_defaults_from_memory() {
    assert_eq!(errors("[store]\nmax_keys = 10\n"), ["t.toml:2:12: store.max_keys must be between 1024 and 1000000000"]);
    assert_eq!(parse("[store]\nmax_keys = 5000\n").store.max_keys, 5000);
    let default = parse("").store.max_keys;
    assert!((100_000..=50_000_000).contains(&default), "{default}");
}

#[test]
fn max_cost_goes_with_cost_header_and_fits_the_bucket() {
    let base = "[[rule]]\nname = \"r\"\nlimit = 10\nwindow = \"1s\"\n";
    assert_eq!(rule(&format!("{base}cost_header = \"x-cost\"\n")).max_cost, 10);
    assert_eq!(rule(&format!("{base}cost_header = \"x-cost\"\nmax_cost = 4\n")).max_cost, 4);
    assert_eq!(
        rule_errors(&format!("{base}cost_header = \"x-cost\"\nmax_cost = 11\n")),
        ["r.toml:6:12: max_cost 11 is larger than the bucket (10): no request could ever pass"]
    );
    assert_eq!(
        rule_errors(&format!("{base}max_cost = 4\n")),
        ["r.toml:5:12: max_cost bounds cost_header: set cost_header too, or leave max_cost out"]
    );
    assert_eq!(
        rule_errors(&format!("{base}cost_header = \"x-cost\"\nmax_cost = 0\n")),
        ["r.toml:6:12: max_cost must be at least 1, not 0"]
    );
}

#[test]
fn count_status_takes_statuses_and_classes_on_the_windows_that_give_back_whole_requests() {
    let base = "[[rule]]\nname = \"r\"\nlimit = 10\nwindow = \"1s\"\n";
    for algorithm in ["fixed_window", "sliding_window_counter"] {
        let r = rule(&format!("{base}algorithm = \"{algorithm}\"\ncount_status = [401, 403, \"5xx\"]\n"));
        let counted = r.count_status.expect("count_status");
        assert_eq!(counted.written(), ["401", "403", "5xx"], "{algorithm}");
        assert!(r.settles_from_response());
    }
    let windowed = |list: &str| rule_errors(&format!("{base}algorithm = \"fixed_window\"\ncount_status = {list}\n"));
    assert_eq!(
        windowed("[99, 401, 600]"),
        [
            "r.toml:6:17: count_status 99 is not an HTTP status (100 to 599)",
            "r.toml:6:26: count_status 600 is not an HTTP status (100 to 599)"
        ]
    );
    assert_eq!(
        windowed("[\"4xx\", \"6xx\"]"),
        ["r.toml:6:24: count_status \"6xx\" is not a class of statuses: \"1xx\" to \"5xx\", or a number such as 401"]
    );
    assert_eq!(
        windowed("[true, 4.01]"),
        [
            "r.toml:6:17: count_status takes statuses such as 401 and classes such as \"4xx\", not true",
            "r.toml:6:23: count_status takes statuses such as 401 and classes such as \"4xx\", not 4.01"
        ]
    );
    assert_eq!(
        windowed("[]"),
        ["r.toml:6:16: count_status needs at least one status or class, such as [401] or [\"5xx\"]"]
    );
    assert_eq!(
        rule_errors(&format!("{base}count_status = [401]\n")),
        [
            "r.toml:5:16: count_status counts fixed_window and sliding_window_counter rules only, not token_bucket: a token bucket gives back only what has not drained since it was counted, less than a whole request by the time any response comes"
        ]
    );
    for algorithm in ["leaky_bucket", "sliding_window_log"] {
        assert_eq!(
            rule_errors(&format!("{base}algorithm = \"{algorithm}\"\ncount_status = [401]\n")),
            [format!(
                "r.toml:6:16: count_status counts fixed_window and sliding_window_counter rules only, not {algorithm}: it cannot give a request back once counted"
            )]
        );
    }
    let concurrency = "[[rule]]\nname = \"r\"\nlimit = 10\nalgorithm = \"concurrency\"\ncount_status = [\"5xx\"]\n";
    assert_eq!(
        rule_errors(concurrency),
        [
            "r.toml:5:16: count_status counts fixed_window and sliding_window_counter rules only, not concurrency: it cannot give a request back once counted"
        ]
    );
    assert!(rule(&format!("{base}algorithm = \"fixed_window\"\n")).count_status.is_none());
}

#[test]
fn penalty_is_a_duration_and_penalty_after_needs_it() {
    let base = "[[rule]]\nname = \"r\"\nlimit = 10\nwindow = \"1s\"\n";
    let r = rule(&format!("{base}penalty = \"15m\"\npenalty_after = 3\n"));
    assert_eq!(r.penalty, Some(crate::limiter::Penalty { duration: 900 * crate::limiter::NANOS_PER_SEC, after: 3 }));
    assert_eq!(rule(&format!("{base}penalty = \"2s\"\n")).penalty.map(|p| p.after), Some(1));
    assert_eq!(rule(base).penalty, None);
    assert_eq!(
        rule_errors(&format!("{base}penalty = \"soon\"\n")),
        [
            "r.toml:5:11: penalty \"soon\" is not a duration (expected number at 0); write e.g. \"250ms\", \"1s\", \"5m\", \"1h\", \"1d\""
        ]
    );
    assert_eq!(
        rule_errors(&format!("{base}penalty = \"500ms\"\n")),
        ["r.toml:5:11: penalty must be between 1s and 366d"]
    );
    assert_eq!(
        rule_errors(&format!("{base}penalty = \"400d\"\n")),
        ["r.toml:5:11: penalty must be between 1s and 366d"]
    );
    assert_eq!(
        rule_errors(&format!("{base}penalty = \"1m\"\npenalty_after = 0\n")),
        ["r.toml:6:17: penalty_after must be at least 1, not 0"]
    );
    assert_eq!(
        rule_errors(&format!("{base}penalty = \"1m\"\npenalty_after = 2000000\n")),
        ["r.toml:6:17: penalty_after must be at most 1000000"]
    );
    assert_eq!(
        rule_errors(&format!("{base}penalty_after = 3\n")),
        ["r.toml:5:17: penalty_after counts refusals before a penalty: set penalty too (such as \"15m\")"]
    );
    assert_eq!(
        rule_errors(&format!("{base}mode = \"shadow\"\npenalty = \"1m\"\n")),
        ["r.toml:6:11: a shadow rule has no penalty: it never refuses, so its penalty box would refuse nothing"]
    );
    assert_eq!(
        rule_errors("[[rule]]\nname = \"c\"\nalgorithm = \"concurrency\"\nlimit = 2\npenalty = \"1m\"\n"),
        ["r.toml:5:11: a concurrency rule has no penalty: its slots come back as requests end"]
    );
}

#[test]
fn cost_response_header_settles_the_counting_algorithms_only() {
    let base = "[[rule]]\nname = \"r\"\nlimit = 10\nwindow = \"1s\"\n";
    for algorithm in ["token_bucket", "fixed_window", "sliding_window_counter"] {
        let r = rule(&format!("{base}algorithm = \"{algorithm}\"\ncost_response_header = \"X-Tokens-Used\"\n"));
        assert_eq!(r.cost_response_header, Some(http::HeaderName::from_static("x-tokens-used")), "{algorithm}");
    }
    assert_eq!(
        rule_errors(&format!("{base}algorithm = \"leaky_bucket\"\ncost_response_header = \"x-tokens-used\"\n")),
        [
            "r.toml:6:24: cost_response_header settles token_bucket, fixed_window and sliding_window_counter rules only: leaky_bucket cannot correct a cost once counted"
        ]
    );
    assert_eq!(
        rule_errors(&format!("{base}algorithm = \"sliding_window_log\"\ncost_response_header = \"x-tokens-used\"\n")),
        [
            "r.toml:6:24: cost_response_header settles token_bucket, fixed_window and sliding_window_counter rules only: sliding_window_log cannot correct a cost once counted"
        ]
    );
    assert_eq!(
        rule_errors(&format!("{base}cost_response_header = \"x tokens\"\n")),
        ["r.toml:5:24: cost_response_header \"x tokens\" is not a valid HTTP header name"]
    );
}

#[test]
fn quota_unit_is_a_short_token() {
    let base = "[[rule]]\nname = \"r\"\nlimit = 10\nwindow = \"1s\"\n";
    assert_eq!(rule(&format!("{base}quota_unit = \"tokens\"\n")).quota_unit.as_deref(), Some("tokens"));
    assert_eq!(
        rule_errors(&format!("{base}quota_unit = \"Tokens\\\"\"\n")),
        [
            "r.toml:5:14: quota_unit \"Tokens\\\"\" must be 1 to 32 lower-case letters, digits, '-' or '_' (such as \"tokens\")"
        ]
    );
}

#[test]
fn store_pool_size_is_bounded() {
    assert_eq!(errors("[store]\npool_size = 0\n"), ["t.toml:2:13: store.pool_size must be between 1 and 64"]);
    assert_eq!(errors("[store]\npool_size = 65\n"), ["t.toml:2:13: store.pool_size must be between 1 and 64"]);
}

#[test]
fn every_problem_in_one_file_is_reported_in_file_order() {
    let src = r#"[[upstream]]
name = "orders"
url = "ftp://127.0.0.1:9001"
timeout = "soon"

[listen]
proxy = "8080"
admin = "nowhere"

[store]
backend = "redis"
timeout = "0s"

[client]
trusted_proxies = ["1.2.3.4/99"]
ipv6_prefix = 200
user_header = "bad header"

[[upstream]]
name = "users"
url = "http://127.0.0.1:9002"

[[upstream]]
name = "users"
url = "http://127.0.0.1:9003"

[[route]]
path_prefix = "/x"
upstream = "billing"
"#;
    assert_eq!(
        errors(src),
        [
            "t.toml:3:7: upstream servers are http:// or https://",
            "t.toml:4:11: upstream.timeout \"soon\" is not a duration (expected number at 0); write e.g. \"250ms\", \"1s\", \"5m\", \"1h\", \"1d\"",
            "t.toml:7:9: listen.proxy \"8080\" is not an address such as \"0.0.0.0:8080\" or \"[::1]:8080\"",
            "t.toml:8:9: listen.admin \"nowhere\" is not an address such as \"0.0.0.0:8080\" or \"[::1]:8080\"",
            "t.toml:11:11: store.backend = \"redis\" needs store.url, e.g. \"redis://127.0.0.1:6379\" or \"redis-cluster://10.0.0.1:6379?node=10.0.0.2:6379\"",
            "t.toml:12:11: store.timeout must be longer than zero",
            "t.toml:15:20: client.trusted_proxies entry \"1.2.3.4/99\" is not an IP address or CIDR such as \"10.0.0.0/8\"",
            "t.toml:16:15: client.ipv6_prefix must be between 1 and 128",
            "t.toml:17:15: client.user_header \"bad header\" is not a valid HTTP header name",
            "t.toml:24:8: upstream \"users\" is defined twice",
            "t.toml:29:12: route names upstream \"billing\", which no [[upstream]] defines",
        ]
    );
}

#[test]
fn a_file_that_cannot_be_read_names_the_file() {
    let dir = tempfile::tempdir().expect("tempdir");
    let missing = dir.path().join("nope.toml");
    let err = Config::load(&missing).expect_err("missing file");
    assert_eq!(err.0.len(), 1);
    assert_eq!((err.0[0].line, err.0[0].column), (0, 0));
    let text = err.to_string();
    assert!(text.starts_with(&format!("{}: cannot read the config file: ", missing.display())), "{text}");
}

#[test]
fn load_reads_the_file_from_disk() {
    let dir = tempfile::tempdir().expect("tempdir");
    let path = dir.path().join("tollgate.toml");
    std::fs::write(&path, ISSUE_MAIN).expect("write");
    let c = Config::load(&path).expect("valid");
    assert_eq!(c.rules_path, dir.path().join("rules"));
    assert_eq!(c.upstreams[0].name, "orders");
}

#[test]
fn parse_helpers() {
    assert_eq!(parse_duration("1d"), Ok(86_400 * SEC));
    assert!(parse_duration("").is_err());
    assert_eq!(parse_net("10.0.0.1").map(|n| n.to_string()), Some("10.0.0.1/32".to_string()));
    assert_eq!(parse_net(" ::1 ").map(|n| n.to_string()), Some("::1/128".to_string()));
    assert_eq!(parse_net("10.1.2.3/8").map(|n| n.to_string()), Some("10.1.2.3/8".to_string()));
    assert_eq!(parse_net("10.0.0.0/33"), None);
    assert_eq!(parse_net("example.com"), None);
}

// ---------------------------------------------------------------------------
// Rules files
// ---------------------------------------------------------------------------

/// A main file with one upstream ("orders") and a named route on it
/// ("orders-api"), for `match.route`.
fn rules_config() -> Config {
    parse(
        r#"
[[upstream]]
name = "orders"
url = "http://127.0.0.1:9001"

[[route]]
name = "orders-api"
path_prefix = "/orders"
upstream = "orders"
"#,
    )
}

fn rules(source: &str) -> Vec<RuleSpec> {
    match parse_rules(Path::new("r.toml"), source, &rules_config()) {
        Ok(r) => r.into_iter().map(|(spec, _)| spec).collect(),
        Err(e) => panic!("expected valid rules, got:\n{e}"),
    }
}

fn rule(source: &str) -> RuleSpec {
    let mut r = rules(source);
    assert_eq!(r.len(), 1);
    r.remove(0)
}

fn rule_errors(source: &str) -> Vec<String> {
    match parse_rules(Path::new("r.toml"), source, &rules_config()) {
        Ok(_) => panic!("expected errors for:\n{source}"),
        Err(e) => e.0.iter().map(ToString::to_string).collect(),
    }
}

/// The issue's example rule, word for word.
const ISSUE_RULE: &str = r#"[[rule]]
name = "login-by-ip"                 # unique across all rule files; appears in headers, bodies and metrics
match = { methods = ["POST"], path = "/api/login" }   # optional: methods, path (exact, or prefix with a trailing *), host, route (a route's upstream name), header = { name = "x-tier", value = "free" }
key = ["ip"]                         # one bucket per distinct value of: ip | user | api_key | route | method | path | "header:NAME" | "query:NAME"; several parts = one bucket per combination; [] = one bucket shared by every matching request (server- or API-level limit)
algorithm = "sliding_window_log"     # token_bucket (default) | leaky_bucket | fixed_window | sliding_window_log | sliding_window_counter
limit = 5                            # requests per window
window = "1m"                        # any duration: "250ms", "1s", "90s", "5m", "1h", "1d"
burst = 10                           # token_bucket: bucket capacity; leaky_bucket: queue length (default: limit)
mode = "enforce"                     # enforce | shadow (counted, headers and metrics as usual, never rejected)
throttle = "hard"                    # hard | soft (allow up to limit * (1 + soft_percent/100)) | elastic (see below)
soft_percent = 10
cost = 1                             # tokens one request takes; or cost_header = "x-cost" (absent: 1; not a whole number from 1 to the bucket size: 400 with a JSON reason)
on_error = "allow"                   # overrides store.on_error for this rule
"#;

#[test]
fn the_issue_rule_parses() {
    let r = rule(ISSUE_RULE);
    assert_eq!(r.name, "login-by-ip");
    assert_eq!(r.source, PathBuf::from("r.toml"));
    assert_eq!(r.line, 1);
    assert_eq!(
        r.matcher,
        MatchSpec {
            methods: vec![http::Method::POST],
            path: Some(PathPattern::Exact("/api/login".into())),
            host: None,
            route: None,
            header: None,
        }
    );
    assert_eq!(r.key, [KeyPart::Ip]);
    assert_eq!(r.algorithm, Algorithm::SlidingWindowLog);
    assert_eq!((r.limit, r.window, r.burst), (5, 60 * SEC, 10));
    assert_eq!(r.mode, RuleMode::Enforce);
    assert_eq!(r.throttle, Throttle::Hard);
    assert_eq!(r.cost, Cost::Fixed(1));
    assert_eq!(r.on_error, Some(OnError::Allow));
}

#[test]
fn every_rule_key_is_read() {
    let r = rules(
        r#"
[[rule]]
name = "orders-free-tier"
match = { methods = ["get", "POST"], path = "/orders/*", host = "API.example.com", route = "orders", header = { name = "X-Tier", value = "free" } }
key = ["user", "api_key", "route", "method", "path", "header:X-Tenant", "query:page", "ip"]
algorithm = "token_bucket"
limit = 100
window = "90s"
burst = 150
mode = "shadow"
throttle = "soft"
soft_percent = 25
cost = 3
on_error = "deny"

[[rule]]
name = "search-elastic"
match = { route = "orders-api" }
algorithm = "leaky_bucket"
limit = 20
window = "250ms"
throttle = "elastic"
elastic_percent = 40
elastic_when_inflight_below = 64
cost_header = "X-Cost"
on_error = "local"

[[rule]]
name = "fixed"
algorithm = "fixed_window"
limit = 1
window = "1d"

[[rule]]
name = "counter"
algorithm = "sliding_window_counter"
limit = 7
window = "5m"
"#,
    );
    assert_eq!(r.len(), 4);
    let a = &r[0];
    assert_eq!(a.line, 2);
    assert_eq!(
        a.matcher,
        MatchSpec {
            methods: vec![http::Method::GET, http::Method::POST],
            path: Some(PathPattern::Prefix("/orders/".into())),
            host: Some("api.example.com".into()),
            route: Some("orders".into()),
            header: Some((http::HeaderName::from_static("x-tier"), "free".into())),
        }
    );
    assert_eq!(
        a.key,
        [
            KeyPart::User,
            KeyPart::ApiKey,
            KeyPart::Route,
            KeyPart::Method,
            KeyPart::Path,
            KeyPart::Header(http::HeaderName::from_static("x-tenant")),
            KeyPart::Query("page".into()),
            KeyPart::Ip,
        ]
    );
    let described: Vec<String> = a.key.iter().map(KeyPart::describe).collect();
    assert_eq!(described, ["user", "api_key", "route", "method", "path", "header:x-tenant", "query:page", "ip"]);
    assert_eq!(a.algorithm, Algorithm::TokenBucket);
    assert_eq!((a.limit, a.window, a.burst), (100, 90 * SEC, 150));
    assert_eq!(a.mode, RuleMode::Shadow);
    assert_eq!(a.throttle, Throttle::Soft { percent: 25 });
    assert_eq!(a.cost, Cost::Fixed(3));
    assert_eq!(a.on_error, Some(OnError::Deny));

    let b = &r[1];
    assert_eq!(b.line, 16);
    assert_eq!(b.matcher.route.as_deref(), Some("orders-api"));
    assert_eq!(b.algorithm, Algorithm::LeakyBucket);
    assert_eq!((b.limit, b.window, b.burst), (20, 250 * MS, 20));
    assert_eq!(b.throttle, Throttle::Elastic { percent: 40, inflight_below: 64 });
    assert_eq!(b.cost, Cost::Header(http::HeaderName::from_static("x-cost")));
    assert_eq!(b.on_error, Some(OnError::Local));

    assert_eq!((r[2].algorithm, r[2].limit, r[2].window), (Algorithm::FixedWindow, 1, 86_400 * SEC));
    assert_eq!((r[3].algorithm, r[3].limit, r[3].window), (Algorithm::SlidingWindowCounter, 7, 300 * SEC));
}

#[test]
fn rule_defaults() {
    let r = rule("[[rule]]\nname = \"r\"\nlimit = 5\nwindow = \"1s\"\n");
    assert_eq!(r.matcher, MatchSpec::default());
    assert_eq!(r.key, [KeyPart::Ip]);
    assert_eq!(r.algorithm, Algorithm::TokenBucket);
    assert_eq!(r.burst, 5);
    assert_eq!(r.mode, RuleMode::Enforce);
    assert_eq!(r.throttle, Throttle::Hard);
    assert_eq!(r.cost, Cost::Fixed(1));
    assert_eq!(r.on_error, None);
}

#[test]
fn throttle_percent_defaults() {
    let soft = rule("[[rule]]\nname = \"r\"\nlimit = 5\nwindow = \"1s\"\nthrottle = \"soft\"\n");
    assert_eq!(soft.throttle, Throttle::Soft { percent: 10 });
    let elastic = rule("[[rule]]\nname = \"r\"\nlimit = 5\nwindow = \"1s\"\nthrottle = \"elastic\"\n");
    assert_eq!(elastic.throttle, Throttle::Elastic { percent: 50, inflight_below: 100 });
}

#[test]
fn an_empty_key_is_one_shared_bucket() {
    let r = rule("[[rule]]\nname = \"api\"\nkey = []\nlimit = 1000\nwindow = \"1s\"\n");
    assert!(r.key.is_empty());
}

#[test]
fn an_empty_rules_file_has_no_rules() {
    assert!(rules("").is_empty());
    assert!(rules("# nothing yet\n").is_empty());
}

/// A rule with `extra` lines added after name, limit and window (lines 1-4).
fn with(extra: &str) -> String {
    format!("[[rule]]\nname = \"r\"\nlimit = 5\nwindow = \"1s\"\n{extra}")
}

#[test]
fn limit_and_burst_must_be_positive() {
    assert_eq!(
        rule_errors("[[rule]]\nname = \"r\"\nlimit = 0\nwindow = \"1s\"\n"),
        ["r.toml:3:9: limit must be at least 1, not 0"]
    );
    assert_eq!(rule_errors(&with("burst = -3\n")), ["r.toml:5:9: burst must be at least 1, not -3"]);
    assert_eq!(rule_errors(&with("burst = 0\n")), ["r.toml:5:9: burst must be at least 1, not 0"]);
    assert_eq!(
        rule_errors("[[rule]]\nname = \"r\"\nlimit = 1000000001\nwindow = \"1s\"\n"),
        ["r.toml:3:9: limit must be at most 1000000000"]
    );
}

#[test]
fn the_window_must_be_a_positive_duration() {
    assert_eq!(
        rule_errors("[[rule]]\nname = \"r\"\nlimit = 5\nwindow = \"0s\"\n"),
        ["r.toml:4:10: window must be longer than zero"]
    );
    assert_eq!(
        rule_errors("[[rule]]\nname = \"r\"\nlimit = 5\nwindow = \"500us\"\n"),
        ["r.toml:4:10: window must be at least 1ms"]
    );
    assert_eq!(
        rule_errors("[[rule]]\nname = \"r\"\nlimit = 5\nwindow = \"367d\"\n"),
        ["r.toml:4:10: window must be at most 366d"]
    );
    assert_eq!(
        rule_errors("[[rule]]\nname = \"r\"\nlimit = 5\nwindow = \"minute\"\n"),
        [
            "r.toml:4:10: window \"minute\" is not a duration (expected number at 0); write e.g. \"250ms\", \"1s\", \"5m\", \"1h\", \"1d\""
        ]
    );
}

#[test]
fn missing_required_rule_keys() {
    assert_eq!(rule_errors("[[rule]]\nname = \"r\"\nwindow = \"1s\"\n"), ["r.toml:1:1: missing field `limit`"]);
    assert_eq!(rule_errors("[[rule]]\nlimit = 1\nwindow = \"1s\"\n"), ["r.toml:1:1: missing field `name`"]);
}

#[test]
fn a_cost_larger_than_the_bucket() {
    // Token bucket: the bucket is `burst`.
    assert_eq!(
        rule_errors(&with("burst = 8\ncost = 9\n")),
        ["r.toml:6:8: cost 9 is larger than the bucket (8): no request could ever pass"]
    );
    assert_eq!(rule(&with("burst = 8\ncost = 8\n")).cost, Cost::Fixed(8));
    // Windows: the bucket is `limit`, whatever `burst` says.
    assert_eq!(
        rule_errors(&with("algorithm = \"fixed_window\"\nburst = 100\ncost = 6\n")),
        ["r.toml:7:8: cost 6 is larger than the bucket (5): no request could ever pass"]
    );
    assert_eq!(rule_errors(&with("cost = 0\n")), ["r.toml:5:8: cost must be at least 1, not 0"]);
}

#[test]
fn cost_and_cost_header_together() {
    assert_eq!(
        rule_errors(&with("cost = 2\ncost_header = \"x-cost\"\n")),
        ["r.toml:6:15: set either cost or cost_header, not both"]
    );
    assert_eq!(
        rule_errors(&with("cost_header = \"x cost\"\n")),
        ["r.toml:5:15: cost_header \"x cost\" is not a valid HTTP header name"]
    );
}

#[test]
fn unknown_key_parts() {
    assert_eq!(
        rule_errors(&with("key = [\"ip\", \"session\", \"header:\", \"query:\", \"header:a b\"]\n")),
        [
            "r.toml:5:14: key part \"session\" is not one of ip, user, api_key, route, method, path, client_cert, \"header:NAME\", \"query:NAME\"",
            "r.toml:5:25: key part \"header:\" is not one of ip, user, api_key, route, method, path, client_cert, \"header:NAME\", \"query:NAME\"",
            "r.toml:5:36: key part \"query:\" is not one of ip, user, api_key, route, method, path, client_cert, \"header:NAME\", \"query:NAME\"",
            "r.toml:5:46: key part \"header:a b\" is not one of ip, user, api_key, route, method, path, client_cert, \"header:NAME\", \"query:NAME\"",
        ]
    );
}

#[test]
fn unknown_algorithm_mode_and_on_error() {
    assert_eq!(
        rule_errors(&with("algorithm = \"gcra\"\n")),
        [
            "r.toml:5:13: unknown variant `gcra`, expected one of `token_bucket`, `leaky_bucket`, `fixed_window`, `sliding_window_log`, `sliding_window_counter`, `concurrency`"
        ]
    );
    assert_eq!(
        rule_errors(&with("mode = \"dry_run\"\n")),
        ["r.toml:5:8: unknown variant `dry_run`, expected `enforce` or `shadow`"]
    );
    assert_eq!(
        rule_errors(&with("on_error = \"retry\"\n")),
        ["r.toml:5:12: unknown variant `retry`, expected one of `allow`, `deny`, `local`"]
    );
}

#[test]
fn unknown_throttle() {
    assert_eq!(
        rule_errors(&with("throttle = \"gentle\"\n")),
        ["r.toml:5:12: throttle \"gentle\" is not one of hard, soft, elastic"]
    );
}

#[test]
fn throttle_percentages_are_bounded() {
    assert_eq!(
        rule_errors(&with("throttle = \"soft\"\nsoft_percent = -1\n")),
        ["r.toml:6:16: soft_percent must be between 0 and 1000"]
    );
    assert_eq!(
        rule_errors(&with("throttle = \"elastic\"\nelastic_percent = 1001\nelastic_when_inflight_below = 0\n")),
        [
            "r.toml:6:19: elastic_percent must be between 0 and 1000",
            "r.toml:7:31: elastic_when_inflight_below must be at least 1, not 0",
        ]
    );
}

#[test]
fn match_paths() {
    let path = |p: &str| rule(&with(&format!("match = {{ path = {p:?} }}\n"))).matcher.path;
    assert_eq!(path("/api/login"), Some(PathPattern::Exact("/api/login".into())));
    assert_eq!(path("/api/*"), Some(PathPattern::Prefix("/api/".into())));
    assert_eq!(path("/*"), Some(PathPattern::Prefix("/".into())));
    assert_eq!(
        rule_errors(&with("match = { path = \"/api/*/orders\" }\n")),
        ["r.toml:5:18: match.path \"/api/*/orders\": '*' is allowed only at the end (a prefix match)"]
    );
    // A trailing '*' does not make an inner one acceptable.
    assert_eq!(
        rule_errors(&with("match = { path = \"/api/*/orders/*\" }\n")),
        ["r.toml:5:18: match.path \"/api/*/orders/*\": '*' is allowed only at the end (a prefix match)"]
    );
    assert_eq!(
        rule_errors(&with("match = { path = \"api/login\" }\n")),
        ["r.toml:5:18: match.path \"api/login\" must start with '/'"]
    );
}

#[test]
fn match_route_must_name_an_upstream_or_a_route() {
    let route = |r: &str| rule(&with(&format!("match = {{ route = {r:?} }}\n"))).matcher.route;
    assert_eq!(route("orders"), Some("orders".into()));
    assert_eq!(route("orders-api"), Some("orders-api".into()));
    assert_eq!(
        rule_errors(&with("match = { route = \"billing\" }\n")),
        [
            "r.toml:5:19: match.route \"billing\" is not the name of any upstream or route in /etc/tollgate/tollgate.toml"
        ]
    );
}

#[test]
fn bad_methods() {
    assert_eq!(
        rule_errors(&with("match = { methods = [\"GET\", \"GE T\", \"\"] }\n")),
        ["r.toml:5:29: \"GE T\" is not an HTTP method", "r.toml:5:37: \"\" is not an HTTP method"]
    );
}

#[test]
fn match_header_names_are_checked() {
    assert_eq!(
        rule_errors(&with("match = { header = { name = \"x tier\", value = \"free\" } }\n")),
        ["r.toml:5:29: match.header.name \"x tier\" is not a valid HTTP header name"]
    );
}

#[test]
fn unknown_keys_in_a_rule_and_in_match() {
    assert_eq!(
        rule_errors(&with("  burts = 10\n")),
        [
            "r.toml:5:3: unknown field `burts`, expected one of `name`, `match`, `key`, `algorithm`, `limit`, `window`, `burst`, `slot_ttl`, `calendar`, `timezone`, `mode`, `throttle`, `soft_percent`, `elastic_percent`, `elastic_when_inflight_below`, `cost`, `cost_header`, `max_cost`, `cost_response_header`, `count_status`, `quota_unit`, `on_error`, `exempt`, `on_invalid_token`, `override`, `tier`, `tiers`, `penalty`, `penalty_after`"
        ]
    );
    assert_eq!(
        rule_errors(&with("match = { method = [\"GET\"] }\n")),
        ["r.toml:5:11: unknown field `method`, expected one of `methods`, `path`, `host`, `route`, `header`"]
    );
    assert_eq!(
        rule_errors(&with("[rule.match]\npath = \"/\"\nquery = \"a=1\"\n")),
        ["r.toml:7:1: unknown field `query`, expected one of `methods`, `path`, `host`, `route`, `header`"]
    );
    assert_eq!(
        rule_errors(&with("match = { header = { name = \"x\", value = \"y\", regex = true } }\n")),
        ["r.toml:5:47: unknown field `regex`, expected `name` or `value`"]
    );
    assert_eq!(
        rule_errors("[[rules]]\nname = \"r\"\n"),
        ["r.toml:1:3: unknown field `rules`, expected one of `rule`, `deny`, `envoy`"]
    );
}

#[test]
fn rule_names_are_checked() {
    assert_eq!(
        rule_errors("[[rule]]\nname = \"  \"\nlimit = 5\nwindow = \"1s\"\n"),
        ["r.toml:2:8: rule name must be 1 to 128 printable ASCII characters, without quotes or backslashes"]
    );
    assert_eq!(
        rule_errors("[[rule]]\nname = 'a\"b'\nlimit = 5\nwindow = \"1s\"\n"),
        ["r.toml:2:8: rule name must be 1 to 128 printable ASCII characters, without quotes or backslashes"]
    );
    assert_eq!(
        rule_errors("[[rule]]\nname = \"caf\u{e9}\"\nlimit = 5\nwindow = \"1s\"\n"),
        ["r.toml:2:8: rule name must be 1 to 128 printable ASCII characters, without quotes or backslashes"]
    );
    let long = "n".repeat(129);
    assert_eq!(
        rule_errors(&format!("[[rule]]\nname = \"{long}\"\nlimit = 5\nwindow = \"1s\"\n")),
        ["r.toml:2:8: rule name must be 1 to 128 printable ASCII characters, without quotes or backslashes"]
    );
    // Spaces, punctuation and the key separators are fine: keys encode them.
    let r = rule("[[rule]]\nname = \" a|b {c} 100% ~x=y/z \"\nlimit = 5\nwindow = \"1s\"\n");
    assert_eq!(r.name, "a|b {c} 100% ~x=y/z");
    assert_eq!(
        rule(&format!("[[rule]]\nname = \"{}\"\nlimit = 5\nwindow = \"1s\"\n", "n".repeat(128))).name.len(),
        128
    );
}

#[test]
fn duplicate_rule_names_in_one_file() {
    let src = "[[rule]]\nname = \"a\"\nlimit = 5\nwindow = \"1s\"\n\n[[rule]]\nname = \"b\"\nlimit = 5\nwindow = \"1s\"\n\n[[rule]]\nname = \"a\"\nlimit = 9\nwindow = \"1s\"\n";
    assert_eq!(rule_errors(src), ["r.toml:12:8: rule name \"a\" is already used at line 1"]);
    // Names are trimmed before they are compared.
    let src =
        "[[rule]]\nname = \"a\"\nlimit = 5\nwindow = \"1s\"\n[[rule]]\nname = \" a \"\nlimit = 5\nwindow = \"1s\"\n";
    assert_eq!(rule_errors(src), ["r.toml:6:8: rule name \"a\" is already used at line 1"]);
}

#[test]
fn several_problems_in_one_rules_file_are_all_reported() {
    let src = r#"[[rule]]
name = "a"
limit = 0
window = "0s"
key = ["who"]

[[rule]]
name = "b"
match = { path = "/x*y", route = "nope" }
limit = 5
window = "1s"
throttle = "sometimes"
cost = 2
cost_header = "x-cost"
"#;
    assert_eq!(
        rule_errors(src),
        [
            "r.toml:3:9: limit must be at least 1, not 0",
            "r.toml:4:10: window must be longer than zero",
            "r.toml:5:8: key part \"who\" is not one of ip, user, api_key, route, method, path, client_cert, \"header:NAME\", \"query:NAME\"",
            "r.toml:9:18: match.path \"/x*y\": '*' is allowed only at the end (a prefix match)",
            "r.toml:9:34: match.route \"nope\" is not the name of any upstream or route in /etc/tollgate/tollgate.toml",
            "r.toml:12:12: throttle \"sometimes\" is not one of hard, soft, elastic",
            "r.toml:14:15: set either cost or cost_header, not both",
        ]
    );
}

// ---------------------------------------------------------------------------
// Rules paths: files and directories
// ---------------------------------------------------------------------------

fn write(dir: &Path, name: &str, text: &str) -> PathBuf {
    let p = dir.join(name);
    std::fs::write(&p, text).expect("write rules file");
    p
}

fn simple(name: &str) -> String {
    format!("[[rule]]\nname = {name:?}\nlimit = 5\nwindow = \"1s\"\n")
}

#[test]
fn a_single_rules_file() {
    let dir = tempfile::tempdir().expect("tempdir");
    let file = write(dir.path(), "limits.conf", &simple("one"));
    let crate::config::LoadedRules { rules: specs, files, .. } = load_rules(&file, &rules_config()).expect("valid");
    assert_eq!(files, std::slice::from_ref(&file));
    assert_eq!(specs.len(), 1);
    assert_eq!((specs[0].name.as_str(), &specs[0].source, specs[0].line), ("one", &file, 1));
}

#[test]
fn a_directory_loads_toml_files_in_name_order_and_skips_the_rest() {
    let dir = tempfile::tempdir().expect("tempdir");
    let d = dir.path();
    write(d, "20-b.toml", &format!("{}\n{}", simple("b1"), simple("b2")));
    write(d, "10-a.toml", &simple("a"));
    write(d, "30-c.toml", &simple("c"));
    write(d, ".hidden.toml", "this is not toml");
    write(d, "README.md", "not rules");
    write(d, "old.toml.bak", "[[rule]]");
    write(d, "notes.txt", "nope");
    std::fs::create_dir(d.join("sub.toml")).expect("mkdir");
    std::fs::create_dir(d.join("..data")).expect("mkdir");
    write(&d.join("..data"), "x.toml", "garbage =");

    let want = [d.join("10-a.toml"), d.join("20-b.toml"), d.join("30-c.toml")];
    assert_eq!(rule_files(d).expect("listable"), want);
    assert_eq!(rule_files_or_empty(d), want);
    let crate::config::LoadedRules { rules: specs, files, .. } = load_rules(d, &rules_config()).expect("valid");
    assert_eq!(files, want);
    let names: Vec<&str> = specs.iter().map(|s| s.name.as_str()).collect();
    assert_eq!(names, ["a", "b1", "b2", "c"]);
    let lines: Vec<usize> = specs.iter().map(|s| s.line).collect();
    assert_eq!(lines, [1, 1, 6, 1]);
    assert_eq!(specs[2].source, d.join("20-b.toml"));
}

#[test]
fn an_empty_directory_has_no_rules() {
    let dir = tempfile::tempdir().expect("tempdir");
    let crate::config::LoadedRules { rules: specs, files, .. } =
        load_rules(dir.path(), &rules_config()).expect("valid");
    assert!(specs.is_empty());
    assert!(files.is_empty());
}

#[test]
fn a_missing_rules_path_is_one_error_naming_it() {
    let dir = tempfile::tempdir().expect("tempdir");
    let missing = dir.path().join("rules");
    let err = load_rules(&missing, &rules_config()).expect_err("missing");
    assert_eq!(err.0.len(), 1);
    assert_eq!(err.0[0].file, missing);
    assert_eq!(err.0[0].line, 0);
    assert!(err.0[0].message.starts_with("cannot read the rules path: "), "{}", err.0[0].message);
    assert!(rule_files_or_empty(&missing).is_empty());
}

#[test]
fn duplicate_rule_names_across_files_name_the_first_place() {
    let dir = tempfile::tempdir().expect("tempdir");
    let d = dir.path();
    write(d, "a.toml", &format!("# first\n\n{}", simple("login")));
    write(d, "b.toml", &format!("{}\n{}", simple("other"), simple("login")));
    let err = load_rules(d, &rules_config()).expect_err("duplicate");
    let got: Vec<String> = err.0.iter().map(ToString::to_string).collect();
    assert_eq!(
        got,
        [format!(
            "{}:7:8: rule name \"login\" is already used at {}:3",
            d.join("b.toml").display(),
            d.join("a.toml").display()
        )]
    );
}

#[test]
fn errors_from_several_files_are_all_reported() {
    let dir = tempfile::tempdir().expect("tempdir");
    let d = dir.path();
    write(d, "a.toml", "[[rule]]\nname = \"a\"\nlimit = 0\nwindow = \"1s\"\n");
    write(d, "b.toml", &simple("fine"));
    write(d, "c.toml", "[[rule]]\nname = \"c\"\nlimit = 5\nwindow = \"1s\"\nalgorithm = \"nope\"\n");
    let err = load_rules(d, &rules_config()).expect_err("invalid");
    let got: Vec<String> = err.0.iter().map(ToString::to_string).collect();
    assert_eq!(
        got,
        [
            format!("{}:3:9: limit must be at least 1, not 0", d.join("a.toml").display()),
            format!(
                "{}:5:13: unknown variant `nope`, expected one of `token_bucket`, `leaky_bucket`, `fixed_window`, `sliding_window_log`, `sliding_window_counter`, `concurrency`",
                d.join("c.toml").display()
            ),
        ]
    );
}

#[test]
fn a_symlinked_directory_is_followed() {
    let dir = tempfile::tempdir().expect("tempdir");
    let real = dir.path().join("v1");
    std::fs::create_dir(&real).expect("mkdir");
    write(&real, "rules.toml", &simple("linked"));
    let link = dir.path().join("rules");
    std::os::unix::fs::symlink(&real, &link).expect("symlink");
    let crate::config::LoadedRules { rules: specs, files, .. } = load_rules(&link, &rules_config()).expect("valid");
    assert_eq!(files, [link.join("rules.toml")]);
    assert_eq!(specs[0].name, "linked");
}

#[test]
fn a_duplicate_across_files_is_reported_even_when_the_first_file_has_other_errors() {
    let dir = tempfile::tempdir().expect("temp dir");
    let d = dir.path();
    std::fs::write(
        d.join("a.toml"),
        "[[rule]]\nname = \"x\"\nlimit = 1\nwindow = \"1s\"\n\n[[rule]]\nname = \"bad\"\nlimit = 0\nwindow = \"1s\"\n",
    )
    .expect("write");
    std::fs::write(d.join("b.toml"), "[[rule]]\nname = \"x\"\nlimit = 2\nwindow = \"1s\"\n").expect("write");
    let err = load_rules(d, &rules_config()).expect_err("two problems");
    let lines: Vec<String> = err.0.iter().map(|e| e.to_string()).collect();
    assert_eq!(lines.len(), 2, "{lines:#?}");
    assert!(lines[0].ends_with("a.toml:8:9: limit must be at least 1, not 0"), "{}", lines[0]);
    assert!(lines[1].contains("b.toml:2:8: rule name \"x\" is already used at "), "{}", lines[1]);
    assert!(lines[1].ends_with("a.toml:1"), "{}", lines[1]);
}

#[test]
fn lease_settings_default_to_one_percent_and_five_seconds_and_are_bounded() {
    let config = Config::parse(Path::new("t.toml"), "[store]\nbackend = \"memory\"\n").expect("valid");
    assert_eq!((config.store.lease_percent, config.store.lease_idle), (1, Duration::from_secs(5)));
    assert_eq!(config.store.lease_lifetime, Duration::from_secs(5));
    let config =
        Config::parse(Path::new("t.toml"), "[store]\nlease_percent = 0\nlease_idle = \"250ms\"\n").expect("valid");
    assert_eq!((config.store.lease_percent, config.store.lease_idle), (0, Duration::from_millis(250)));
    assert_eq!(
        errors("[store]\nlease_percent = 30\nlease_idle = \"0s\"\nlease_lifetime = \"10ms\"\n"),
        [
            "t.toml:2:17: store.lease_percent must be between 0 (no leasing) and 25",
            "t.toml:3:14: store.lease_idle must be longer than zero",
            "t.toml:4:18: store.lease_lifetime must be between \"100ms\" and \"1h\""
        ]
    );
}

#[test]
fn a_tls_ca_file_needs_a_tls_url_and_a_pem_certificate() {
    let url = "[store]\nbackend = \"redis\"\nurl = \"redis://127.0.0.1:6379\"\ntls_ca_file = \"/nonexistent/ca.crt\"\n";
    assert_eq!(
        errors(url),
        ["t.toml:4:15: TLS files need a TLS store.url (rediss://, rediss-cluster:// or rediss-sentinel://)"]
    );
    let missing = "[store]\nbackend = \"redis\"\nurl = \"rediss://h:6379\"\ntls_ca_file = \"/nonexistent/ca.crt\"\n";
    let e = errors(missing);
    assert_eq!(e.len(), 1);
    assert!(e[0].starts_with("t.toml:4:15: cannot read /nonexistent/ca.crt:"), "{e:?}");

    let dir = tempfile::tempdir().expect("tempdir");
    std::fs::write(dir.path().join("ca.crt"), "not a certificate\n").expect("write");
    let main = dir.path().join("tollgate.toml");
    let source = "[store]\nbackend = \"redis\"\nurl = \"rediss://h:6379\"\ntls_ca_file = \"ca.crt\"\n";
    let Err(e) = Config::parse(&main, source) else { panic!("a file with no certificate was accepted") };
    let e = e.0;
    assert_eq!(e.len(), 1);
    assert!(e[0].to_string().contains("holds no PEM certificate"), "{}", e[0]);
}

#[test]
fn a_client_certificate_needs_its_key_and_they_must_match() {
    let only_cert = "[store]\nbackend = \"redis\"\nurl = \"rediss://h:6379\"\ntls_cert_file = \"c.pem\"\n";
    assert_eq!(
        errors(only_cert),
        ["t.toml:4:17: store.tls_cert_file and store.tls_key_file go together: give both or neither"]
    );

    let issue = || {
        let key = rcgen::KeyPair::generate().expect("key");
        let cert = rcgen::CertificateParams::new(vec!["tollgate".to_string()])
            .and_then(|p| p.self_signed(&key))
            .expect("certificate");
        (cert.pem(), key.serialize_pem())
    };
    let (cert, key) = issue();
    let (_, other_key) = issue();
    let dir = tempfile::tempdir().expect("tempdir");
    for (name, text) in [("c.pem", &cert), ("k.pem", &key), ("other.pem", &other_key)] {
        std::fs::write(dir.path().join(name), text).expect("write");
    }
    let main = dir.path().join("tollgate.toml");
    let source = |key_file: &str| {
        format!(
            "[store]\nbackend = \"redis\"\nurl = \"rediss://h:6379\"\ntls_cert_file = \"c.pem\"\ntls_key_file = \"{key_file}\"\n"
        )
    };
    let config = Config::parse(&main, &source("k.pem")).unwrap_or_else(|e| panic!("a matching pair is accepted: {e}"));
    assert!(config.store.tls_client.is_some());
    let Err(e) = Config::parse(&main, &source("other.pem")) else {
        panic!("a key of another certificate was accepted")
    };
    assert!(e.0[0].to_string().contains("the key does not go with the certificate"), "{}", e.0[0]);
}

#[test]
fn body_and_send_timeouts_and_buffer_body() {
    let c = parse("");
    assert_eq!((c.listen.body_read_timeout, c.listen.send_timeout), (60 * SEC, 60 * SEC));
    let c = parse(
        "[listen]\nbody_read_timeout = \"5s\"\nsend_timeout = \"250ms\"\n[[upstream]]\nname = \"a\"\nurl = \"http://a\"\n\
         [[route]]\npath_prefix = \"/\"\nupstream = \"a\"\n[[route]]\npath_prefix = \"/up\"\nupstream = \"a\"\nbuffer_body = \"64KiB\"\n\
         [[route]]\npath_prefix = \"/s\"\nupstream = \"a\"\nbuffer_body = 0\n",
    );
    assert_eq!((c.listen.body_read_timeout, c.listen.send_timeout), (5 * SEC, 250 * MS));
    let buffers: Vec<u64> = c.routes.iter().map(|r| r.buffer_body).collect();
    assert_eq!(buffers, [1024 * 1024, 64 * 1024, 0]);
    assert_eq!(
        errors(
            "[[upstream]]\nname = \"a\"\nurl = \"http://a\"\n[[route]]\npath_prefix = \"/\"\nupstream = \"a\"\nbuffer_body = \"65MiB\"\n"
        ),
        [
            "t.toml:7:15: route buffer_body must be a size from 0 to 64MiB: a whole number of bytes, or a string such as \"256KiB\", \"1MiB\""
        ]
    );
    assert_eq!(
        errors("[listen]\nsend_timeout = \"0s\"\n"),
        ["t.toml:2:16: listen.send_timeout must be longer than zero"]
    );
}

#[test]
fn a_concurrency_rule_has_a_slot_ttl_instead_of_a_window() {
    let r = rules(
        r#"
[[rule]]
name = "reports"
key = ["user"]
algorithm = "concurrency"
limit = 4

[[rule]]
name = "exports"
algorithm = "concurrency"
limit = 2
slot_ttl = "3s"
"#,
    );
    assert_eq!((r[0].algorithm, r[0].limit, r[0].window), (Algorithm::Concurrency, 4, 10 * SEC));
    assert_eq!(r[1].window, 3 * SEC);
}

#[test]
fn concurrency_rules_refuse_what_means_nothing_in_flight() {
    let errors = rule_errors(
        r#"[[rule]]
name = "c"
algorithm = "concurrency"
limit = 4
window = "1m"
burst = 8
cost = 2
slot_ttl = "100ms"
"#,
    );
    assert_eq!(
        errors,
        [
            "r.toml:5:10: a concurrency rule has no window: it counts requests in flight (slot_ttl bounds how long a crashed instance's slots stay counted)",
            "r.toml:6:9: a concurrency rule has no burst: limit is the number of requests in flight",
            "r.toml:7:8: a concurrency rule has no cost: every request in flight holds one slot",
            "r.toml:8:12: slot_ttl must be between 1s and 1h",
        ]
    );
    let errors = rule_errors("[[rule]]\nname = \"r\"\nlimit = 4\nslot_ttl = \"5s\"\n");
    assert_eq!(
        errors,
        [
            "r.toml:2:8: window is required, or calendar (algorithm = \"concurrency\" has neither)",
            "r.toml:4:12: slot_ttl applies to algorithm = \"concurrency\" only",
        ]
    );
}

#[test]
fn a_calendar_rule_counts_fixed_windows_in_its_time_zone() {
    let r = rules(
        r#"
[[rule]]
name = "monthly"
limit = 1000
calendar = "month"
timezone = "Europe/Berlin"

[[rule]]
name = "daily"
algorithm = "fixed_window"
limit = 10
calendar = "day"
"#,
    );
    let c = r[0].calendar.as_ref().expect("a calendar");
    assert_eq!((c.period, c.timezone.as_str()), (crate::limiter::calendar::Period::Month, "Europe/Berlin"));
    assert_eq!(r[0].algorithm, Algorithm::FixedWindow, "the default of calendar rules");
    assert_eq!(r[0].window, Duration::from_nanos(crate::limiter::calendar::Period::Month.longest()));
    let c = r[1].calendar.as_ref().expect("a calendar");
    assert_eq!((c.period, c.timezone.as_str()), (crate::limiter::calendar::Period::Day, "UTC"));
}

#[test]
fn calendar_rules_refuse_what_they_cannot_count() {
    let errors = rule_errors(
        r#"[[rule]]
name = "c"
algorithm = "token_bucket"
limit = 4
window = "1m"
burst = 8
calendar = "month"
timezone = "Europe/Atlantis"
"#,
    );
    assert_eq!(
        errors,
        [
            "r.toml:5:10: set either window or calendar, not both",
            "r.toml:6:9: a calendar rule has no burst: limit is the quota of each window",
            "r.toml:7:12: calendar counts with algorithm = \"fixed_window\" (its default), not \"token_bucket\"",
            "r.toml:8:12: timezone \"Europe/Atlantis\" is not an IANA time zone name such as \"Europe/Berlin\" or \"UTC\"",
        ]
    );
    assert_eq!(
        rule_errors("[[rule]]\nname = \"r\"\nlimit = 4\ncalendar = \"year\"\n"),
        ["r.toml:4:12: calendar \"year\" is not one of day, week, month"]
    );
    assert_eq!(
        rule_errors("[[rule]]\nname = \"r\"\nlimit = 4\nwindow = \"1h\"\ntimezone = \"UTC\"\n"),
        ["r.toml:5:12: timezone applies to calendar rules only: set calendar = \"day\", \"week\" or \"month\""]
    );
    assert_eq!(
        rule_errors("[[rule]]\nname = \"r\"\nalgorithm = \"sliding_window_counter\"\nlimit = 4\ncalendar = \"day\"\n"),
        [
            "r.toml:5:12: calendar counts with algorithm = \"fixed_window\" (its default), not \"sliding_window_counter\""
        ]
    );
}

#[test]
fn client_certificates_need_a_readable_ca_and_a_known_client_auth() {
    let (dir, tls) = tls_dir();
    std::fs::copy(dir.path().join("a.crt"), dir.path().join("ca.crt")).expect("copy CA");
    std::fs::write(dir.path().join("junk.crt"), "not a certificate\n").expect("write junk");
    let parse_in = |source: &str| Config::parse(&dir.path().join("t.toml"), source).expect("valid");
    let c = parse_in(&format!("[listen]\nclient_ca_file = \"ca.crt\"\n{tls}"));
    let auth = c.listen.client_auth.expect("client certificates asked for");
    assert_eq!((auth.required, auth.roots.len()), (false, 1));
    let c = parse_in(&format!("[listen]\nclient_ca_file = \"ca.crt\"\nclient_auth = \"required\"\n{tls}"));
    assert!(c.listen.client_auth.expect("client certificates asked for").required);
    assert!(parse_in(tls).listen.client_auth.is_none());
    assert_eq!(
        errors_in(dir.path(), &format!("[listen]\nclient_auth = \"required\"\n{tls}")),
        [
            "t.toml:2:15: listen.client_auth needs listen.client_ca_file: the CA certificates client certificates are checked against"
        ]
    );
    assert_eq!(
        errors_in(dir.path(), &format!("[listen]\nclient_ca_file = \"ca.crt\"\nclient_auth = \"maybe\"\n{tls}")),
        ["t.toml:3:15: listen.client_auth must be \"optional\" or \"required\", not \"maybe\""]
    );
    assert_eq!(
        errors_in(dir.path(), &format!("[listen]\nclient_ca_file = \"junk.crt\"\n{tls}")),
        ["t.toml:2:18: listen.client_ca_file junk.crt holds no PEM certificate (-----BEGIN CERTIFICATE-----)"]
    );
    let errors = errors_in(dir.path(), &format!("[listen]\nclient_ca_file = \"missing.crt\"\n{tls}"));
    assert!(matches!(&errors[..], [e] if e.starts_with("t.toml:2:18: ") && e.contains("missing.crt")), "{errors:?}");
    assert_eq!(
        errors_in(dir.path(), "[listen]\nclient_ca_file = \"ca.crt\"\n"),
        ["t.toml:2:18: listen.client_ca_file asks clients for certificates over TLS; add a [[listen.tls]] certificate"]
    );
}
