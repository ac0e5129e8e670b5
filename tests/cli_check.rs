//! `tollgate check`, run as the real binary: exit 0 with a summary for a good
//! config; otherwise exit 1 and every problem as `file:line:column: plain
//! sentence`.

use std::path::Path;
use std::process::{Command, Output};

const CONFIG: &str = r#"[listen]
proxy = "127.0.0.1:0"
admin = "127.0.0.1:0"

[rules]
path = "rules"

[[upstream]]
name = "orders"
url = "http://127.0.0.1:9001"

[[route]]
path_prefix = "/orders"
upstream = "orders"
"#;

/// Writes `config` and the rules files into a new directory.
fn setup(config: &str, rules: &[(&str, &str)]) -> tempfile::TempDir {
    let dir = tempfile::tempdir().expect("temp dir");
    std::fs::write(dir.path().join("tollgate.toml"), config).expect("write config");
    std::fs::create_dir(dir.path().join("rules")).expect("rules dir");
    for (name, text) in rules {
        std::fs::write(dir.path().join("rules").join(name), text).expect("write rules");
    }
    dir
}

fn tollgate(args: &[&str], config: &Path) -> Output {
    Command::new(env!("CARGO_BIN_EXE_tollgate"))
        .args(args)
        .arg("--config")
        .arg(config)
        .env_remove("RUST_LOG")
        .output()
        .expect("run tollgate")
}

fn check(dir: &Path) -> Output {
    tollgate(&["check"], &dir.join("tollgate.toml"))
}

fn stderr_lines(out: &Output) -> Vec<String> {
    String::from_utf8(out.stderr.clone()).expect("UTF-8").lines().map(str::to_string).collect()
}

#[test]
fn a_good_config_passes() {
    let dir = setup(
        CONFIG,
        &[
            ("a.toml", "[[rule]]\nname = \"a\"\nlimit = 5\nwindow = \"1m\"\n"),
            (
                "b.toml",
                "[[rule]]\nname = \"b\"\nlimit = 5\nwindow = \"1m\"\n\n[[rule]]\nname = \"c\"\nlimit = 1\nwindow = \"1s\"\nmatch = { route = \"orders\" }\n",
            ),
        ],
    );
    let out = check(dir.path());
    assert_eq!(out.status.code(), Some(0), "{}", String::from_utf8_lossy(&out.stderr));
    assert_eq!(
        String::from_utf8_lossy(&out.stdout),
        format!("{}: ok (1 upstreams, 1 routes, 3 rules in 2 files)\n", dir.path().join("tollgate.toml").display())
    );
}

#[test]
fn every_broken_rule_is_listed_with_its_place() {
    let dir = setup(
        CONFIG,
        &[
            ("1-typo.toml", "[[rule]]\nname = \"typo\"\nlimt = 5\nwindow = \"1m\"\n"),
            (
                "2-values.toml",
                "[[rule]]\nname = \"slow\"\nlimit = 5\nwindow = \"5 parsecs\"\n\n[[rule]]\nname = \"zero\"\nlimit = 0\nwindow = \"1m\"\n",
            ),
            ("3-first.toml", "[[rule]]\nname = \"login\"\nlimit = 1\nwindow = \"1s\"\n"),
            ("4-second.toml", "# the same name again\n[[rule]]\nname = \"login\"\nlimit = 2\nwindow = \"1s\"\n"),
            (
                "5-route.toml",
                "[[rule]]\nname = \"pay\"\nmatch = { route = \"payments\" }\nlimit = 2\nwindow = \"1s\"\n",
            ),
        ],
    );
    let out = check(dir.path());
    assert_eq!(out.status.code(), Some(1));
    assert_eq!(out.stdout, b"");
    let rules = dir.path().join("rules");
    let at = |file: &str, line: u32, col: u32| format!("{}:{line}:{col}: ", rules.join(file).display());
    let lines = stderr_lines(&out);
    // The list of known fields grows with the rules format: only its start is
    // pinned here.
    let typo = format!("{}unknown field `limt`, expected one of `name`, `match`, `key`, ", at("1-typo.toml", 3, 1));
    assert!(lines[0].starts_with(&typo), "{}", lines[0]);
    assert_eq!(
        lines[1..],
        [
            format!(
                "{}window \"5 parsecs\" is not a duration (unknown time unit \"parsecs\", supported units: ns, us/µs, ms, sec, min, hours, days, weeks, months, years (and few variations)); write e.g. \"250ms\", \"1s\", \"5m\", \"1h\", \"1d\"",
                at("2-values.toml", 4, 10)
            ),
            format!("{}limit must be at least 1, not 0", at("2-values.toml", 8, 9)),
            format!(
                "{}rule name \"login\" is already used at {}:1",
                at("4-second.toml", 3, 8),
                rules.join("3-first.toml").display()
            ),
            format!(
                "{}match.route \"payments\" is not the name of any upstream or route in {}",
                at("5-route.toml", 3, 19),
                dir.path().join("tollgate.toml").display()
            ),
            "5 problem(s) found".to_string(),
        ]
    );
}

#[test]
fn a_broken_main_config_is_listed_with_its_places() {
    let config = CONFIG
        .replace("url = \"http://127.0.0.1:9001\"", "url = \"http://127.0.0.1:9001\"\ntimeout = \"forever\"")
        .replace("upstream = \"orders\"", "upstream = \"order\"")
        .replace("[rules]", "[client]\ntrusted_proxies = [\"10.0.0.0/8\", \"not-a-net\"]\n\n[rules]");
    let dir = setup(&config, &[]);
    let out = check(dir.path());
    assert_eq!(out.status.code(), Some(1));
    let file = dir.path().join("tollgate.toml");
    let at = |line: u32, col: u32| format!("{}:{line}:{col}: ", file.display());
    assert_eq!(
        stderr_lines(&out),
        [
            format!(
                "{}client.trusted_proxies entry \"not-a-net\" is not an IP address or CIDR such as \"10.0.0.0/8\"",
                at(6, 34)
            ),
            format!(
                "{}upstream.timeout \"forever\" is not a duration (expected number at 0); write e.g. \"250ms\", \"1s\", \"5m\", \"1h\", \"1d\"",
                at(14, 11)
            ),
            format!("{}route names upstream \"order\", which no [[upstream]] defines", at(18, 12)),
            "3 problem(s) found".to_string(),
        ]
    );
}

#[test]
fn an_unknown_key_in_the_main_config() {
    let dir = setup(&CONFIG.replace("admin = ", "backlog = 5\nadmin = "), &[]);
    let out = check(dir.path());
    assert_eq!(out.status.code(), Some(1));
    let lines = stderr_lines(&out);
    assert_eq!(lines.len(), 2, "{lines:?}");
    let unknown = format!(
        "{}:3:1: unknown field `backlog`, expected one of `proxy`, `admin`, ",
        dir.path().join("tollgate.toml").display()
    );
    assert!(lines[0].starts_with(&unknown), "{}", lines[0]);
    assert_eq!(lines[1], "1 problem(s) found");
    // Running with it refuses to start, with the config exit code.
    let run = tollgate(&[], &dir.path().join("tollgate.toml"));
    assert_eq!(run.status.code(), Some(64));
    assert!(
        String::from_utf8_lossy(&run.stderr).contains(":3:1: unknown field `backlog`"),
        "{}",
        String::from_utf8_lossy(&run.stderr)
    );
}

#[test]
fn missing_files_are_problems_too() {
    let dir = tempfile::tempdir().expect("temp dir");
    let missing = dir.path().join("nope.toml");
    let out = tollgate(&["check"], &missing);
    assert_eq!(out.status.code(), Some(1));
    assert_eq!(
        stderr_lines(&out),
        [
            format!("{}: cannot read the config file: No such file or directory (os error 2)", missing.display()),
            "1 problem(s) found".to_string(),
        ]
    );

    let config = CONFIG.replace("path = \"rules\"", "path = \"no-such-rules\"");
    let dir = setup(&config, &[]);
    let out = check(dir.path());
    assert_eq!(out.status.code(), Some(1));
    assert_eq!(
        stderr_lines(&out),
        [
            format!(
                "{}: cannot read the rules path: No such file or directory (os error 2)",
                dir.path().join("no-such-rules").display()
            ),
            "1 problem(s) found".to_string(),
        ]
    );
}

#[test]
fn a_jwt_algorithm_list_mixing_families_is_refused() {
    let config =
        format!("{CONFIG}\n[client]\njwt = {{ key_file = \"jwt.secret\", algorithms = [\"HS256\", \"RS256\"] }}\n");
    let dir = setup(&config, &[("a.toml", "[[rule]]\nname = \"a\"\nlimit = 5\nwindow = \"1m\"\n")]);
    std::fs::write(dir.path().join("jwt.secret"), "0123456789abcdef0123456789abcdef-secret").expect("secret");
    let out = check(dir.path());
    assert_eq!(out.status.code(), Some(1));
    let lines = stderr_lines(&out);
    assert!(
        lines.iter().any(|l| l.contains("tollgate.toml:")
            && l.contains("algorithms [HS256, RS256] mix families (HMAC and RSA): list algorithms of one family")),
        "{lines:#?}"
    );
}

#[test]
fn explain_shows_an_api_key_as_its_sha256() {
    let rules = "[[rule]]\nname = \"per-key\"\nkey = [\"api_key\"]\nlimit = 5\nwindow = \"1m\"\n";
    let dir = setup(CONFIG, &[("a.toml", rules)]);
    let out = tollgate(
        &["explain", "--path", "/orders/1", "--header", "x-api-key: sk-live-secret", "--ip", "203.0.113.7"],
        &dir.path().join("tollgate.toml"),
    );
    let report = String::from_utf8_lossy(&out.stdout).into_owned();
    assert!(out.status.success(), "{report}{}", String::from_utf8_lossy(&out.stderr));
    // sha256("sk-live-secret"): the same bucket the proxy uses.
    let hashed = "per-key|api_key=sha256:a03d43d254a4ccb8f1921be6b2037423b14cd1d0bd460164980730e0fd1948f8";
    assert!(report.contains(hashed), "{report}");
    assert!(!report.contains("sk-live-secret"), "{report}");
}
