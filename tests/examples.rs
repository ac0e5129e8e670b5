//! What we ship beside the code stays true: every example config passes
//! `tollgate check` (the real binary), the Prometheus alert rules pass
//! `promtool`, the Grafana dashboard parses and has the panels operators look
//! for, every path the Dockerfile copies exists, `tollgate explain` shows the
//! route, rules and keys of a request against the gateway example, and the
//! README documents every config key.

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

fn repo() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

fn tollgate(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_tollgate"))
        .args(args)
        .current_dir(repo())
        .env_remove("TOLLGATE_LOG_FORMAT")
        .output()
        .expect("the tollgate binary runs")
}

fn text(bytes: &[u8]) -> String {
    String::from_utf8_lossy(bytes).into_owned()
}

/// Main config files: the root `tollgate.toml` and every `*.toml` under
/// `examples/` that is not a rules file (a rules file holds `[[rule]]` or
/// `[[deny]]` tables).
fn main_configs() -> Vec<PathBuf> {
    fn walk(dir: &Path, out: &mut Vec<PathBuf>) {
        let Ok(entries) = std::fs::read_dir(dir) else { return };
        for entry in entries.flatten() {
            let path = entry.path();
            let name = entry.file_name().to_string_lossy().into_owned();
            if name.starts_with('.') || name == "target" {
                continue;
            }
            if path.is_dir() {
                walk(&path, out);
            } else if name.ends_with(".toml") && name != "Cargo.toml" {
                let text = std::fs::read_to_string(&path).unwrap_or_default();
                let rules_file = text.lines().any(|l| {
                    let l = l.trim_start();
                    l.starts_with("[[rule]]") || l.starts_with("[[deny]]")
                });
                if !rules_file {
                    out.push(path);
                }
            }
        }
    }
    let mut configs = vec![repo().join("tollgate.toml")];
    walk(&repo().join("examples"), &mut configs);
    configs.sort();
    configs
}

#[test]
fn every_example_config_passes_check() {
    let configs = main_configs();
    for expected in [
        "tollgate.toml",
        "examples/quickstart/tollgate.toml",
        "examples/gateway/tollgate.toml",
        "examples/gateway/tollgate.compose.toml",
    ] {
        assert!(configs.contains(&repo().join(expected)), "{expected} is missing; found {configs:?}");
    }
    let mut failures = Vec::new();
    for config in &configs {
        let out = tollgate(&["check", "--config", &config.to_string_lossy()]);
        if !out.status.success() || !text(&out.stdout).contains(": ok") {
            failures.push(format!(
                "{}: exit {:?}\n{}{}",
                config.display(),
                out.status.code(),
                text(&out.stdout),
                text(&out.stderr)
            ));
        }
    }
    assert!(failures.is_empty(), "tollgate check failed:\n{}", failures.join("\n"));
}

#[test]
fn check_still_catches_a_broken_rule() {
    // The test above means something only if `check` can fail: a copy of
    // the quickstart with one bad rule must be refused with file:line:column.
    let dir = tempfile::tempdir().expect("temp dir");
    let quickstart = repo().join("examples/quickstart");
    std::fs::copy(quickstart.join("tollgate.toml"), dir.path().join("tollgate.toml")).expect("copy config");
    let rules = std::fs::read_to_string(quickstart.join("rules.toml")).expect("read rules");
    std::fs::write(dir.path().join("rules.toml"), rules.replacen("limit = 5", "limit = 0", 1)).expect("write rules");
    let out = tollgate(&["check", "--config", &dir.path().join("tollgate.toml").to_string_lossy()]);
    assert!(!out.status.success());
    let err = text(&out.stderr);
    assert!(err.contains("rules.toml:") && err.contains("limit must be at least 1"), "{err}");
}

/// promtool's path. A missing promtool fails the test: one that returned
/// early would pass without having checked anything.
fn promtool() -> PathBuf {
    let candidates = std::env::var_os("PATH")
        .map(|p| std::env::split_paths(&p).collect::<Vec<_>>())
        .unwrap_or_default()
        .into_iter()
        .chain([PathBuf::from("/usr/bin"), PathBuf::from("/usr/sbin"), PathBuf::from("/usr/local/bin")]);
    candidates
        .map(|dir| dir.join("promtool"))
        .find(|p| p.is_file())
        .unwrap_or_else(|| panic!("promtool is needed (Debian package prometheus; scripts/test installs it)"))
}

fn run_promtool(promtool: &Path, args: &[&str]) {
    let out = Command::new(promtool)
        .args(args)
        .current_dir(repo().join("examples/prometheus"))
        .output()
        .expect("promtool runs");
    assert!(out.status.success(), "promtool {} failed:\n{}{}", args.join(" "), text(&out.stdout), text(&out.stderr));
}

#[test]
fn alert_rules_pass_promtool() {
    let promtool = promtool();
    run_promtool(&promtool, &["check", "rules", "alerts.yml"]);
    run_promtool(&promtool, &["test", "rules", "alerts.test.yml"]);
    run_promtool(&promtool, &["check", "config", "prometheus.yml"]);
    let alerts = std::fs::read_to_string(repo().join("examples/prometheus/alerts.yml")).expect("read alerts");
    for alert in
        ["TollgateRejectionRatioSpike", "TollgateStoreErrors", "TollgateStoreDegraded", "TollgateRulesReloadFailed"]
    {
        assert!(alerts.contains(&format!("alert: {alert}")), "alerts.yml lacks {alert}");
    }
    assert!(alerts.contains("tollgate_store_degraded"), "the degraded-store alert must read tollgate_store_degraded");
}

fn dashboard() -> serde_json::Value {
    let raw =
        std::fs::read_to_string(repo().join("examples/prometheus/grafana-dashboard.json")).expect("read dashboard");
    serde_json::from_str(&raw).expect("the dashboard is valid JSON")
}

/// Every panel, rows' nested panels included.
fn panels(dashboard: &serde_json::Value) -> Vec<&serde_json::Value> {
    let mut out = Vec::new();
    for p in dashboard["panels"].as_array().expect("dashboard.panels is an array") {
        out.push(p);
        if let Some(nested) = p["panels"].as_array() {
            out.extend(nested);
        }
    }
    out
}

/// The PromQL of every panel, Grafana's variables replaced by what
/// Prometheus would see.
fn dashboard_queries(dashboard: &serde_json::Value) -> Vec<(String, String)> {
    let mut out = Vec::new();
    for p in panels(dashboard) {
        for t in p["targets"].as_array().into_iter().flatten() {
            let expr = t["expr"].as_str().unwrap_or_default();
            let expr = expr
                .replace("$__rate_interval", "1m")
                .replace("$__range", "1h")
                .replace("$__interval", "15s")
                .replace("$instance", ".*");
            out.push((p["title"].as_str().unwrap_or_default().to_string(), expr));
        }
    }
    out
}

#[test]
fn dashboard_parses_and_has_the_panels() {
    let d = dashboard();
    let titles: Vec<&str> = panels(&d).iter().filter_map(|p| p["title"].as_str()).collect();
    for wanted in ["Requests by decision", "Top limited rules", "Store latency", "Upstream errors"] {
        assert!(titles.contains(&wanted), "the dashboard has no {wanted:?} panel; panels: {titles:?}");
    }
    for p in panels(&d) {
        if p["type"] == "row" {
            continue;
        }
        let targets = p["targets"].as_array().map_or(0, |t| t.len());
        assert!(targets > 0, "panel {:?} has no query", p["title"]);
    }
    let queries = dashboard_queries(&d);
    let by_title =
        |t: &str| queries.iter().filter(|(title, _)| title == t).map(|(_, q)| q.as_str()).collect::<String>();
    assert!(by_title("Requests by decision").contains("tollgate_requests_total"));
    assert!(by_title("Top limited rules").contains("tollgate_rule_decisions_total"));
    assert!(by_title("Store latency").contains("tollgate_store_duration_seconds_bucket"));
    assert!(by_title("Upstream errors").contains("tollgate_upstream_errors_total"));
}

#[test]
fn dashboard_queries_are_valid_promql() {
    let promtool = promtool();
    // promtool has no "check this expression": recording rules it can check.
    let mut rules = String::from("groups:\n  - name: dashboard\n    rules:\n");
    for (i, (_, expr)) in dashboard_queries(&dashboard()).iter().enumerate() {
        rules.push_str(&format!("      - record: dashboard:query_{i}\n        expr: {}\n", serde_json::json!(expr)));
    }
    let dir = tempfile::tempdir().expect("temp dir");
    let file = dir.path().join("dashboard-queries.yml");
    std::fs::write(&file, rules).expect("write rules");
    run_promtool(&promtool, &["check", "rules", &file.to_string_lossy()]);
}

/// The metric names `src/metrics.rs` registers.
fn registered_metrics() -> Vec<String> {
    let src = std::fs::read_to_string(repo().join("src/obs/metrics.rs")).expect("read src/obs/metrics.rs");
    src.split('"')
        .filter(|s| s.starts_with("tollgate_") && s.chars().all(|c| c.is_ascii_alphanumeric() || c == '_'))
        .map(String::from)
        .collect()
}

/// Every `tollgate_*` metric name mentioned in `text`.
fn mentioned_metrics(text: &str) -> Vec<String> {
    let mut out = Vec::new();
    let mut rest = text;
    while let Some(i) = rest.find("tollgate_") {
        let tail = &rest[i..];
        let end = tail.find(|c: char| !(c.is_ascii_alphanumeric() || c == '_')).unwrap_or(tail.len());
        out.push(tail[..end].to_string());
        rest = &tail[end..];
    }
    out
}

#[test]
fn dashboard_and_alerts_use_only_real_metrics() {
    let registered = registered_metrics();
    assert!(registered.contains(&"tollgate_requests_total".to_string()), "{registered:?}");
    let mut sources = vec![std::fs::read_to_string(repo().join("examples/prometheus/alerts.yml")).expect("alerts")];
    sources.push(dashboard_queries(&dashboard()).into_iter().map(|(_, q)| q + "\n").collect());
    for text in &sources {
        for name in mentioned_metrics(text) {
            let base = ["_bucket", "_sum", "_count"].iter().fold(name.as_str(), |n, s| n.strip_suffix(s).unwrap_or(n));
            assert!(
                registered.iter().any(|r| r == base || r == &name),
                "{name} is not a metric tollgate exports (src/metrics.rs)"
            );
        }
    }
}

/// Joins continuation lines and drops comments: one string per instruction.
fn dockerfile_instructions(src: &str) -> Vec<String> {
    let mut out = Vec::new();
    let mut current = String::new();
    for line in src.lines() {
        let trimmed = line.trim();
        if current.is_empty() && (trimmed.is_empty() || trimmed.starts_with('#')) {
            continue;
        }
        if let Some(body) = trimmed.strip_suffix('\\') {
            current.push_str(body);
            current.push(' ');
        } else {
            current.push_str(trimmed);
            out.push(std::mem::take(&mut current));
        }
    }
    out
}

#[test]
fn dockerfile_copies_only_what_exists() {
    let src = std::fs::read_to_string(repo().join("Dockerfile")).expect("read Dockerfile");
    let ignored = std::fs::read_to_string(repo().join(".dockerignore")).expect("read .dockerignore");
    let ignored: Vec<&str> = ignored
        .lines()
        .map(str::trim)
        .filter(|l| !l.is_empty() && !l.starts_with('#') && !l.starts_with('!'))
        .collect();
    let instructions = dockerfile_instructions(&src);
    let mut copies = 0;
    for ins in &instructions {
        let mut words = ins.split_whitespace();
        let keyword = words.next().unwrap_or_default().to_ascii_uppercase();
        if keyword != "COPY" && keyword != "ADD" {
            continue;
        }
        let args: Vec<&str> = words.collect();
        if args.iter().any(|a| a.starts_with("--from")) {
            continue; // from another stage, not the build context
        }
        let args: Vec<&str> = args.into_iter().filter(|a| !a.starts_with("--")).collect();
        assert!(args.len() >= 2, "malformed instruction: {ins}");
        for source in &args[..args.len() - 1] {
            let source = source.trim_matches(|c| c == '[' || c == ']' || c == ',' || c == '"');
            assert!(repo().join(source).exists(), "the Dockerfile copies {source}, which does not exist: {ins}");
            assert!(
                !ignored.iter().any(|i| i.trim_end_matches('/') == source.trim_end_matches('/')),
                "the Dockerfile copies {source}, which .dockerignore leaves out"
            );
            copies += 1;
        }
    }
    assert!(copies >= 3, "expected the source tree, tollgate.toml and rules to be copied");

    let has = |prefix: &str| instructions.iter().any(|i| i.starts_with(prefix));
    assert!(instructions.iter().filter(|i| i.starts_with("FROM ")).count() >= 2, "a multi-stage build");
    assert!(has("FROM rust:1-bookworm AS builder"));
    assert!(has("EXPOSE 8080 9090"));
    assert!(instructions.iter().any(|i| i.starts_with("HEALTHCHECK") && i.contains("/healthz")));
    let user = instructions.iter().rev().find(|i| i.starts_with("USER ")).expect("a USER instruction");
    assert!(!user.contains("root") && !user.ends_with(" 0") && !user.contains(" 0:"), "runs as root: {user}");
    assert!(instructions.iter().any(|i| i.contains("cargo build --release --locked")));
    assert!(instructions.iter().any(|i| i.contains("/etc/tollgate/tollgate.toml")));
    assert!(instructions.iter().any(|i| i.contains("/etc/tollgate/rules")));
}

#[test]
fn compose_mounts_exist() {
    let compose = std::fs::read_to_string(repo().join("examples/docker-compose.yml")).expect("read compose file");
    let mut mounts = 0;
    for line in compose.lines() {
        let line = line.trim().trim_start_matches("- ").trim_matches('"');
        if let Some((source, _)) = line.split_once(':')
            && source.starts_with("./")
        {
            assert!(
                repo().join("examples").join(source).exists(),
                "docker-compose.yml mounts {source}, which does not exist"
            );
            mounts += 1;
        }
    }
    assert!(mounts >= 4, "expected the tollgate config, its rules, and Prometheus' files to be mounted");
}

#[test]
fn explain_shows_route_rules_and_keys() {
    let gateway = "examples/gateway/tollgate.toml";
    let out = tollgate(&[
        "explain",
        "--config",
        gateway,
        "--method",
        "GET",
        "--path",
        "/api/search?q=boots",
        "--header",
        "x-user-id: 42",
        "--header",
        "x-tier: free",
        "--ip",
        "203.0.113.7",
    ]);
    let report = text(&out.stdout);
    assert!(out.status.success(), "explain failed: {report}{}", text(&out.stderr));
    for wanted in [
        "route:   search",
        "upstream search",
        "per-ip",
        "key [ip] -> bucket per-ip|ip=203.0.113.7",
        "search-per-user",
        "key [user] -> bucket search-per-user|user=42",
        "search-free-tier",
        "rules:   3 match",
    ] {
        assert!(report.contains(wanted), "explain does not show {wanted:?}:\n{report}");
    }
    for unwanted in ["orders-per-user", "login-by-ip", "users-per-user"] {
        assert!(!report.contains(unwanted), "explain shows {unwanted:?}, which does not match:\n{report}");
    }

    // No user header: the per-user rule falls back to the client IP.
    let out = tollgate(&["explain", "--config", gateway, "--path", "/api/search", "--ip", "203.0.113.7"]);
    let report = text(&out.stdout);
    assert!(report.contains("bucket search-per-user|ip=203.0.113.7"), "{report}");

    // A login from an IPv6 client: keyed by its /64.
    let out = tollgate(&[
        "explain",
        "--config",
        gateway,
        "--method",
        "POST",
        "--path",
        "/api/login",
        "--ip",
        "2001:db8:1:2:aaaa::1",
    ]);
    let report = text(&out.stdout);
    assert!(report.contains("route:   login"), "{report}");
    assert!(report.contains("bucket login-by-ip|ip=2001:db8:1:2::"), "{report}");
    assert!(report.contains("login-by-ip-daily"), "{report}");
    assert!(report.contains("login-failures-by-ip"), "{report}");
    assert!(report.contains("counts only responses 401: a request reserves its cost"), "{report}");
    assert!(
        report.contains("penalty: a key refused 3 times within one window is refused for 900s"),
        "explain shows login-by-ip's penalty: {report}"
    );

    // An export: a rate and a concurrency limit.
    let out = tollgate(&[
        "explain",
        "--config",
        gateway,
        "--path",
        "/api/orders/export",
        "--header",
        "x-user-id: 42",
        "--ip",
        "203.0.113.7",
    ]);
    let report = text(&out.stdout);
    assert!(report.contains("orders-exports-in-flight"), "{report}");
    assert!(report.contains("concurrency: at most 2 in flight, slot_ttl 10s"), "{report}");
}

#[test]
fn explain_shows_the_gateways_tiers_and_partner_override() {
    let gateway = "examples/gateway/tollgate.toml";
    let explain = |headers: &[&str]| {
        let mut args = vec!["explain", "--config", gateway, "--path", "/api/users/7"];
        for h in headers {
            args.extend(["--header", h]);
        }
        let out = tollgate(&args);
        assert!(out.status.success(), "explain failed: {}", text(&out.stderr));
        text(&out.stdout)
    };
    let report = explain(&["x-user-id: 7", "x-tier: pro"]);
    assert!(report.contains("limits of this request: tier \"pro\": 50 per 1s, burst 100"), "{report}");
    let report = explain(&["x-user-id: 7", "x-tier: enterprise"]);
    assert!(
        report.contains("limits of this request: tier default (no tier, or one not listed): 10 per 1s"),
        "{report}"
    );
    // ACME's key, written in the rules file as its SHA-256 only.
    let report = explain(&["x-user-id: 7", "x-client-type: partner", "x-api-key: sk-partner-acme"]);
    assert!(report.contains("limits of this request: override api_key="), "{report}");
    assert!(report.contains(": 1000000 per 86400s"), "{report}");
    // And the partners' monthly quota, on Berlin's calendar.
    assert!(report.contains("users-partner-monthly"), "{report}");
    assert!(report.contains("fixed_window 2000000 per calendar month (Europe/Berlin)"), "{report}");
    let rules = std::fs::read_to_string(repo().join("examples/gateway/rules/20-users.toml")).expect("read rules");
    assert!(!rules.contains("sk-partner-acme"), "the example rules hold no API key in clear");
}

#[test]
fn quickstart_script_is_sound() {
    let script = repo().join("examples/quickstart/run.sh");
    #[cfg(unix)]
    {
        use std::os::unix::fs::PermissionsExt;
        let mode = std::fs::metadata(&script).expect("run.sh exists").permissions().mode();
        assert!(mode & 0o111 != 0, "run.sh is not executable");
    }
    let out = Command::new("bash").arg("-n").arg(&script).output().expect("bash runs");
    assert!(out.status.success(), "run.sh has a syntax error: {}", text(&out.stderr));
    let readme = std::fs::read_to_string(repo().join("README.md")).expect("read README");
    assert!(readme.contains("examples/quickstart/run.sh"), "the README's quickstart runs examples/quickstart/run.sh");
    assert!(readme.contains("scripts/test"), "the README names the test command");
}

/// Every key the config structs accept, as written in files.
fn config_keys() -> Vec<String> {
    let src = std::fs::read_to_string(repo().join("src/config/raw.rs")).expect("read src/config/raw.rs");
    let mut keys = Vec::new();
    let mut rename: Option<String> = None;
    for line in src.lines().map(str::trim) {
        if let Some(r) = line.strip_prefix("#[serde(rename = \"") {
            rename = r.split('"').next().map(String::from);
        } else if let Some(field) = line.strip_prefix("pub ")
            && let Some((name, _)) = field.split_once(':')
            && !name.contains(' ')
        {
            keys.push(rename.take().unwrap_or_else(|| name.to_string()));
        }
    }
    keys
}

#[test]
fn readme_documents_every_config_key() {
    let readme = std::fs::read_to_string(repo().join("README.md")).expect("read README");
    let keys = config_keys();
    assert!(keys.len() > 30, "found only {keys:?} in src/config/raw.rs");
    let documented = |k: &String| readme.contains(&format!("`{k}`")) || readme.contains(&format!("`[{k}]`"));
    let missing: Vec<&String> = keys.iter().filter(|k| !documented(k)).collect();
    assert!(missing.is_empty(), "README.md does not document these config keys: {missing:?}");
}

#[test]
fn cookbook_rules_pass_check() {
    let page = std::fs::read_to_string(repo().join("docs/rules-cookbook.md")).expect("read the cookbook");
    let mut rules = String::new();
    let mut blocks = 0;
    let mut inside = false;
    for line in page.lines() {
        match (inside, line.trim()) {
            (false, "```toml") => {
                inside = true;
                blocks += 1;
            }
            (true, "```") => {
                inside = false;
                rules.push('\n');
            }
            (true, _) => {
                rules.push_str(line);
                rules.push('\n');
            }
            _ => {}
        }
    }
    assert!(blocks >= 8, "found only {blocks} toml blocks in docs/rules-cookbook.md");
    let dir = tempfile::tempdir().expect("temp dir");
    std::fs::write(
        dir.path().join("tollgate.toml"),
        "[rules]\npath = \"cookbook.toml\"\n\n[[upstream]]\nname = \"orders\"\nurl = \"http://127.0.0.1:9001\"\n\n[[route]]\npath_prefix = \"/\"\nupstream = \"orders\"\n",
    )
    .expect("write config");
    std::fs::write(dir.path().join("cookbook.toml"), rules).expect("write rules");
    let out = tollgate(&["check", "--config", &dir.path().join("tollgate.toml").to_string_lossy()]);
    assert!(out.status.success(), "a cookbook rule does not pass tollgate check:\n{}", text(&out.stderr));
}

/// `benches/accuracy` (the table of docs/algorithms.md#measured-accuracy)
/// still runs and offers every fault and row the table shows: it is run by
/// hand, so nothing else would notice it rot.
#[test]
fn accuracy_bench_lists_what_the_docs_table_shows() {
    let bench = repo().join("benches/accuracy");
    let out = Command::new("python3").arg(&bench).arg("--list").output().expect("python3 runs");
    assert!(out.status.success(), "benches/accuracy --list failed: {}", text(&out.stderr));
    let listed = text(&out.stdout);
    let listed: Vec<&str> = listed.lines().collect();
    let docs = std::fs::read_to_string(repo().join("docs/algorithms.md")).expect("read docs/algorithms.md");
    assert!(docs.lines().any(|l| l == "## Measured accuracy"), "docs/algorithms.md has lost its measured table");
    let rows: Vec<&str> = listed.iter().filter_map(|l| l.strip_prefix("row ")).collect();
    let faults: Vec<&str> = listed.iter().filter_map(|l| l.strip_prefix("fault ")).collect();
    assert_eq!(faults, ["none", "crowd", "resets", "pause", "failover", "migration"], "{listed:?}");
    assert_eq!(rows.len(), 9, "{listed:?}");
    for row in rows {
        assert!(docs.contains(&format!("| `{row}` |")), "docs/algorithms.md's table has no row {row}");
    }
    for fault in faults {
        assert!(docs.contains(&format!("\n| {fault} |")), "docs/algorithms.md does not say what {fault} does");
    }
}
