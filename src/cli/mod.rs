//! The `tollgate` command line.
//!
//! - `tollgate [--config tollgate.toml]`: run the proxy.
//! - `tollgate check --config tollgate.toml`: validate the config and every
//!   rules file; exit 1 listing each problem as file:line:column.
//! - `tollgate explain --config ... --method GET --path /x --header 'k: v'
//!   --ip 203.0.113.7`: which route and rules a request would match, the key
//!   of each rule, and the quota left, without consuming any.
//! - `tollgate top --admin 127.0.0.1:9090`: the heaviest keys of each rule
//!   of a running tollgate, redrawn every second (see [`top`]).
//! - `tollgate block --rule login --key 'login|ip=203.0.113.7' --for 1h
//!   --reason '...'` and `tollgate unblock --rule login --key ...`: a key
//!   put in or let out of a rule's penalty box (see [`blocks`]).
//!
//! [`floor`] is the setup of the `tollgate-floor` bench binary;
//! `allocator.rs` beside this file is the binaries' global allocator,
//! included by `main.rs` and `bin/` with `#[path]` (no library module).

pub mod blocks;
pub mod floor;
pub mod top;

use std::fmt::Write as _;
use std::net::IpAddr;
use std::path::PathBuf;
use std::sync::Arc;

use clap::{Parser, Subcommand};
use http::{HeaderMap, HeaderName, HeaderValue, Method};

use crate::config::{Backend, Config, ConfigErrors, load_rules};
use crate::limit::rules::{RequestFacts, Rule, RuleSet};
use crate::limiter::Verdict;
use crate::limiter::clock::SystemClock;
use crate::obs::metrics::Metrics;
use crate::store::{Check, MemoryStore, Mode, RedisStore, Store};

/// Exit code for a config that does not validate (EX_USAGE... EX_CONFIG is
/// 78, but 64 is what linkerd and mini-redis use for "bad input").
pub const EXIT_CONFIG: i32 = 64;

#[derive(Debug, Parser)]
#[command(name = "tollgate", version, about = "A rate-limiting reverse proxy")]
pub struct Cli {
    /// The main config file.
    #[arg(long, short, global = true, default_value = "tollgate.toml")]
    pub config: PathBuf,
    /// Log format: text (default) or json. Also TOLLGATE_LOG_FORMAT.
    #[arg(long, global = true, env = "TOLLGATE_LOG_FORMAT", default_value = "text")]
    pub log_format: String,
    #[command(subcommand)]
    pub command: Option<Command>,
}

#[derive(Debug, Subcommand)]
pub enum Command {
    /// Run the proxy (the default).
    Run,
    /// Validate the config and every rules file, then exit.
    Check(CheckArgs),
    /// Show which route and rules a request would match, and their keys.
    Explain(ExplainArgs),
    /// Show the keys each rule of a running tollgate limits most, every second.
    Top(top::TopArgs),
    /// Put a key in a rule's penalty box through a running tollgate's admin listener.
    Block(blocks::BlockArgs),
    /// Let a key out of a rule's penalty box through a running tollgate's admin listener.
    Unblock(blocks::UnblockArgs),
}

#[derive(Debug, clap::Args)]
pub struct CheckArgs {
    /// The admin address of a running tollgate (`127.0.0.1:9090`): also
    /// say which sections of the file differ from what it runs and apply
    /// only after a restart (upstreams and routes reload by themselves).
    #[arg(long)]
    pub running: Option<String>,
}

#[derive(Debug, clap::Args)]
pub struct ExplainArgs {
    #[arg(long, default_value = "GET")]
    pub method: String,
    #[arg(long, default_value = "/")]
    pub path: String,
    /// The Host the request is for.
    #[arg(long)]
    pub host: Option<String>,
    /// A request header, `name: value`; repeatable.
    #[arg(long = "header", short = 'H')]
    pub headers: Vec<String>,
    /// The client address (as the proxy would key it, after X-Forwarded-For).
    #[arg(long, default_value = "127.0.0.1")]
    pub ip: IpAddr,
}

/// `tollgate check`: every problem, one per line; `Ok` with a summary.
pub fn check(config_path: &std::path::Path) -> Result<String, ConfigErrors> {
    let config = Config::load(config_path)?;
    let loaded = load_rules(&config.rules_path, &config)?;
    Ok(format!(
        "{}: ok ({} upstreams, {} routes, {} rules in {} files)",
        config_path.display(),
        config.upstreams.len(),
        config.routes.len(),
        loaded.rules.len(),
        loaded.files.len()
    ))
}

/// `tollgate check --running ADMIN`: the sections of the (valid) file at
/// `config_path` that differ from what the tollgate at `admin` runs and
/// apply only after a restart, one line each; `Err` when it cannot be
/// asked.
pub fn check_running(config_path: &std::path::Path, admin: &str) -> Result<Vec<String>, String> {
    use std::io::{Read, Write};
    let config = Config::load(config_path).map_err(|e| e.to_string())?;
    let addr: std::net::SocketAddr =
        admin.parse().map_err(|_| format!("--running {admin:?} is not an address such as 127.0.0.1:9090"))?;
    let ask = || -> std::io::Result<Vec<u8>> {
        let mut s = std::net::TcpStream::connect_timeout(&addr, std::time::Duration::from_secs(3))?;
        s.set_read_timeout(Some(std::time::Duration::from_secs(3)))?;
        s.write_all(format!("GET /config HTTP/1.1\r\nhost: {addr}\r\nconnection: close\r\n\r\n").as_bytes())?;
        let mut out = Vec::new();
        s.take(1 << 20).read_to_end(&mut out)?;
        Ok(out)
    };
    let reply = ask().map_err(|e| format!("cannot ask the tollgate at {admin}: {e}"))?;
    let reply = String::from_utf8_lossy(&reply);
    let body = reply.split_once("\r\n\r\n").map_or("", |(_, b)| b);
    let running: serde_json::Value = serde_json::from_str(body)
        .map_err(|_| format!("the tollgate at {admin} did not answer /config (an older version?)"))?;
    Ok(crate::ops::reload::restart_fingerprints(&config)
        .into_iter()
        .filter(|(name, print)| running["restart_sections"][*name].as_str() != Some(print.as_str()))
        .map(|(name, _)| format!("{name} differs from the running tollgate at {admin}: it applies after a restart"))
        .collect())
}

/// `tollgate explain`: the report, as text.
pub fn explain(config_path: &std::path::Path, args: &ExplainArgs) -> Result<String, String> {
    let config = Config::load(config_path).map_err(|e| e.to_string())?;
    let loaded = load_rules(&config.rules_path, &config).map_err(|e| e.to_string())?;
    let metrics = Metrics::new();
    let set = RuleSet::from_loaded(loaded, &metrics);
    let method = Method::from_bytes(args.method.to_ascii_uppercase().as_bytes())
        .map_err(|_| format!("{:?} is not an HTTP method", args.method))?;
    let headers = parse_headers(&args.headers)?;
    let (path, query) = match args.path.split_once('?') {
        Some((p, q)) => (p, Some(q)),
        None => (args.path.as_str(), None),
    };
    // Matched as the proxy matches it: by its canonical spelling.
    let path = crate::wire::normalize::path(path, &config.listen.normalization).map_err(|e| e.reason().to_string())?;
    let path = path.as_ref();
    let host = args.host.as_ref().map(|h| crate::config::canonical_host(h));
    let route = find_route(&config, path, host.as_deref());

    let mut out = String::new();
    let _ = writeln!(out, "request: {method} {} from {}", args.path, args.ip);
    write_route(&mut out, &config, route);
    // A tier read from a JWT claim: the token is verified as the proxy
    // would (explain shows the `default` tier without a valid one).
    let tier_claim = match (&config.client.jwt, &set.tier_claim) {
        (Some(jwt), Some(claim)) => {
            crate::wire::identity::JwtVerifier::new(jwt).ok().and_then(|v| v.verify_with_claim(&headers, claim).1)
        }
        _ => None,
    };
    let facts = RequestFacts {
        method: &method,
        path,
        query,
        host: host.as_deref(),
        route: route.map(|r| (r.name.as_str(), config.upstreams[r.upstream].name.as_str())),
        headers: &headers,
        client: crate::wire::client::key_addr(args.ip, config.client.ipv6_prefix),
        client_ip: args.ip,
        user: headers.get(&config.client.user_header).map(|v| v.as_bytes()),
        api_key: headers.get(&config.client.api_key_header).map(|v| v.as_bytes()),
        tier_claim: tier_claim.as_deref().map(str::as_bytes),
        // `explain` makes no TLS connection: keyed as a request without
        // a client certificate.
        client_cert: None,
    };
    let matching: Vec<&Rule> = set.matching(&facts).collect();
    if matching.is_empty() {
        let _ = writeln!(out, "rules:   none match (no rate-limit headers would be sent)");
        return Ok(out);
    }
    write_rules(&mut out, &config, &matching, &facts)?;
    Ok(out)
}

/// `--header 'name: value'` arguments as a header map.
fn parse_headers(args: &[String]) -> Result<HeaderMap, String> {
    let mut headers = HeaderMap::new();
    for h in args {
        let (k, v) = h.split_once(':').ok_or_else(|| format!("--header {h:?} must look like 'name: value'"))?;
        let name = HeaderName::from_bytes(k.trim().as_bytes()).map_err(|_| format!("{k:?} is not a header name"))?;
        let value = HeaderValue::from_str(v.trim()).map_err(|_| format!("{v:?} is not a header value"))?;
        headers.append(name, value);
    }
    Ok(headers)
}

/// The route the proxy would take: the longest prefix, a route naming the
/// host before one for any host.
fn find_route<'c>(config: &'c Config, path: &str, host: Option<&str>) -> Option<&'c crate::config::Route> {
    let mut routes: Vec<&crate::config::Route> = config.routes.iter().collect();
    routes.sort_by_key(|r| (std::cmp::Reverse(r.path_prefix.len()), r.host.is_none()));
    routes
        .into_iter()
        .find(|r| path.starts_with(r.path_prefix.as_str()) && r.host.as_deref().is_none_or(|h| Some(h) == host))
}

fn write_route(out: &mut String, config: &Config, route: Option<&crate::config::Route>) {
    let Some(r) = route else {
        let _ = writeln!(out, "route:   none (tollgate would answer 404 after checking the rules)");
        return;
    };
    let u = &config.upstreams[r.upstream];
    let servers: Vec<String> =
        u.servers.iter().map(|s| format!("{}://{}{}", s.scheme, s.authority, u.base_path)).collect();
    let _ = writeln!(
        out,
        "route:   {} (prefix {}) -> upstream {} at {}",
        r.name,
        r.path_prefix,
        u.name,
        servers.join(", ")
    );
}

/// Every matching rule: its spec, its bucket for this request, and the
/// quota left there.
fn write_rules(out: &mut String, config: &Config, matching: &[&Rule], facts: &RequestFacts<'_>) -> Result<(), String> {
    // Every matching rule's bucket, peeked at in the configured store
    // without consuming: this process's memory is always empty, so it can
    // only show the full quota; the shared store shows live counts.
    let buckets: Vec<(String, u64)> = matching
        .iter()
        .map(|rule| {
            let mut key = String::new();
            rule.key(facts, &mut key)?;
            Ok((key, rule.cost(facts.headers).unwrap_or(1)))
        })
        .collect::<Result<_, String>>()?;
    let plans: Vec<&crate::limit::rules::Plan> =
        matching.iter().zip(&buckets).map(|(rule, (key, _))| rule.plan_for(key, facts)).collect();
    let checks: Vec<Check<'_>> = matching
        .iter()
        .zip(&buckets)
        .zip(&plans)
        .map(|((rule, (key, cost)), plan)| Check {
            key,
            limits: rule.in_calendar(plan.nominal, &SystemClock),
            cost: *cost,
            enforced: rule.enforced(),
            // Explain asks Redis only: a rule it cannot answer says so.
            on_error: crate::config::OnError::Allow,
            settles: false,
            penalty: None,
        })
        .collect();
    let (peeked, source) = peek(config, &checks);
    let _ = writeln!(out, "rules:   {} match", matching.len());
    for (((rule, (key, _)), plan), verdict) in matching.iter().zip(&buckets).zip(&plans).zip(peeked) {
        let s = &rule.spec;
        write_spec(out, s);
        let parts: Vec<String> = s.key.iter().map(|k| k.describe()).collect();
        let _ = writeln!(out, "    key [{}] -> bucket {key}", parts.join(", "));
        write_plan(out, s, plan);
        write_verdict(out, plan, verdict, source);
    }
    Ok(())
}

/// What a rule says, as its file says it.
fn write_spec(out: &mut String, s: &crate::config::RuleSpec) {
    let _ = writeln!(out, "  - {} ({}:{})", s.name, s.source.display(), s.line);
    if s.algorithm.holds() {
        let _ = writeln!(
            out,
            "    concurrency: at most {} in flight, slot_ttl {:?}, mode {:?}, throttle {:?}",
            s.limit, s.window, s.mode, s.throttle
        );
    } else if let Some(c) = &s.calendar {
        let _ = writeln!(
            out,
            "    {} {} per calendar {} ({}), mode {:?}, throttle {:?}",
            s.algorithm.as_str(),
            s.limit,
            c.period.as_str(),
            c.timezone,
            s.mode,
            s.throttle
        );
    } else {
        let _ = writeln!(
            out,
            "    {} {} per {:?}, burst {}, mode {:?}, throttle {:?}",
            s.algorithm.as_str(),
            s.limit,
            s.window,
            s.burst,
            s.mode,
            s.throttle
        );
    }
    for o in &s.overrides {
        let _ = writeln!(out, "    override {} (line {}): limit {}, burst {}", o.key, o.line, o.limit, o.burst);
    }
    if let Some(t) = &s.tiers {
        let listed: Vec<String> = t.tiers.iter().map(|(n, l, b)| format!("{n} = {l}/{b}")).collect();
        let _ = writeln!(
            out,
            "    tier from {}: {}{}default = {}/{} (limit/burst)",
            t.source.describe(),
            listed.join(", "),
            if listed.is_empty() { "" } else { ", " },
            t.default.0,
            t.default.1
        );
    }
    if let Some(h) = &s.cost_response_header {
        let reserved = match &s.cost {
            crate::config::Cost::Fixed(n) => format!("{n}"),
            crate::config::Cost::Header(c) => format!("the {c} header's value (absent: 1, at most {})", s.max_cost),
        };
        let _ = writeln!(
            out,
            "    cost settled from response header {h} (or trailer): reserves {reserved} until the response says"
        );
    }
    if let Some(counted) = &s.count_status {
        let _ = writeln!(
            out,
            "    counts only responses {}: a request reserves its cost, given back when its response has another status",
            counted.written().join(", ")
        );
    }
    if let Some(u) = &s.quota_unit {
        let _ = writeln!(out, "    quota unit: {u}");
    }
    if let Some(p) = &s.penalty {
        let after = match p.after {
            1 => "refused".to_string(),
            n => format!("refused {n} times within one window"),
        };
        let _ = writeln!(
            out,
            "    penalty: a key {after} is refused for {:?}, whatever its window allows",
            std::time::Duration::from_nanos(p.duration)
        );
    }
}

/// The limits of this request, when an override or a tier replaced the
/// rule's.
fn write_plan(out: &mut String, s: &crate::config::RuleSpec, plan: &crate::limit::rules::Plan) {
    if plan.source == crate::limit::rules::PlanSource::Rule {
        return;
    }
    if let Some(c) = &s.calendar {
        let _ = writeln!(
            out,
            "    limits of this request: {}: {} per calendar {}",
            plan.source,
            plan.nominal.limit,
            c.period.as_str()
        );
    } else {
        let _ = writeln!(
            out,
            "    limits of this request: {}: {} per {:?}, burst {}",
            plan.source, plan.nominal.limit, s.window, plan.nominal.burst
        );
    }
}

fn write_verdict(out: &mut String, plan: &crate::limit::rules::Plan, verdict: Result<Verdict, String>, source: &str) {
    let capacity = plan.nominal.capacity();
    match verdict {
        Ok(v) if v.allowed => {
            let _ = writeln!(out, "    remaining after this request: {} of {capacity} ({source})", v.remaining);
        }
        Ok(v) if v.boxed != crate::limiter::Boxed::No => {
            let _ = writeln!(
                out,
                "    in the penalty box: this request would be limited for {} s more ({source})",
                crate::limiter::ceil_secs(v.retry_after).max(1)
            );
        }
        Ok(v) => {
            let _ = writeln!(
                out,
                "    remaining: 0 of {capacity}: this request would be limited, retry in {} s ({source})",
                crate::limiter::ceil_secs(v.retry_after).max(1)
            );
        }
        Err(e) => {
            let _ = writeln!(out, "    remaining: unknown ({e})");
        }
    }
}

/// Peeks at each check alone in the configured store, without consuming.
/// Returns the verdicts and a note on where they come from.
fn peek(config: &Config, checks: &[Check<'_>]) -> (Vec<Result<Verdict, String>>, &'static str) {
    match config.store.backend {
        Backend::Memory => {
            let memory = MemoryStore::new(Arc::new(SystemClock));
            let verdicts =
                checks.iter().map(|c| Ok(memory.check_now(std::slice::from_ref(c), Mode::Peek)[0])).collect();
            (verdicts, "memory store: each process counts on its own; a new process starts full")
        }
        Backend::Redis => (peek_redis(config, checks), "redis: the count every instance shares, not consumed"),
    }
}

/// Peeks in Redis from a thread with its own runtime, so that `explain`
/// stays a plain function callable from anywhere, inside a runtime or not.
fn peek_redis(config: &Config, checks: &[Check<'_>]) -> Vec<Result<Verdict, String>> {
    let fail = |e: String| checks.iter().map(|_| Err(e.clone())).collect();
    // A person is waiting, not a request: allow a slow link its second.
    let mut store_config = config.store.clone();
    store_config.timeout = store_config.timeout.max(std::time::Duration::from_secs(1));
    let run = || -> Result<Vec<Result<Verdict, String>>, String> {
        let runtime = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .map_err(|e| format!("cannot start a runtime: {e}"))?;
        runtime.block_on(async {
            let store = RedisStore::connect(&store_config, Arc::new(SystemClock), Arc::new(Metrics::new())).await?;
            let mut out = Vec::with_capacity(checks.len());
            for c in checks {
                let answer = store.check(std::slice::from_ref(c), Mode::Peek).await.into_iter().next();
                let answer = answer.unwrap_or_else(|| Err(crate::store::StoreError::Protocol("no answer".into())));
                out.push(answer.map_err(|e| format!("redis not asked: {e}")));
            }
            Ok(out)
        })
    };
    std::thread::scope(|scope| scope.spawn(run).join())
        .unwrap_or_else(|_| Err("the redis peek panicked".into()))
        .unwrap_or_else(fail)
}
