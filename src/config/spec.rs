//! The validated rule specs, shared by the rules files' validation
//! ([`super::rules_file`]) and that of overrides and tiers
//! ([`super::overrides`]), and read by [`crate::limit::rules`] to compile them.

use std::path::PathBuf;
use std::time::Duration;

use http::{HeaderName, Method};
use serde::Deserialize;

use crate::limiter::Algorithm;

/// What a check does when the store cannot answer.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize, Default)]
#[serde(rename_all = "snake_case")]
pub enum OnError {
    /// Fail open: forward the request as if the rule allowed it.
    #[default]
    Allow,
    /// Fail closed: answer 503 with Retry-After.
    Deny,
    /// Count in this process's memory with the same rules until the store
    /// is back.
    Local,
}

/// Whether a rule may reject.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize, Default)]
#[serde(rename_all = "snake_case")]
pub enum RuleMode {
    #[default]
    Enforce,
    /// Counted, with headers and metrics as usual, but never rejects: for
    /// trialling a rule on live traffic.
    Shadow,
}

/// How far over its limit a rule lets a key go.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Throttle {
    /// Never over the limit.
    Hard,
    /// Up to `limit * (1 + percent / 100)`, always.
    Soft { percent: u32 },
    /// Up to `limit * (1 + percent / 100)` while the route's upstream has
    /// fewer than `inflight_below` requests in flight; the plain limit
    /// otherwise.
    Elastic { percent: u32, inflight_below: u32 },
}

/// How many units one request takes.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Cost {
    Fixed(u64),
    /// Read from this request header; absent means 1.
    Header(HeaderName),
}

/// One part of a rule's key: the request property whose distinct values get
/// distinct buckets.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum KeyPart {
    Ip,
    User,
    ApiKey,
    Route,
    Method,
    Path,
    /// The common name of the verified client certificate.
    ClientCert,
    Header(HeaderName),
    Query(String),
}

impl KeyPart {
    /// The spelling in config files.
    pub fn describe(&self) -> String {
        match self {
            KeyPart::Ip => "ip".into(),
            KeyPart::User => "user".into(),
            KeyPart::ApiKey => "api_key".into(),
            KeyPart::Route => "route".into(),
            KeyPart::Method => "method".into(),
            KeyPart::Path => "path".into(),
            KeyPart::ClientCert => "client_cert".into(),
            KeyPart::Header(h) => format!("header:{h}"),
            KeyPart::Query(q) => format!("query:{q}"),
        }
    }
}

/// `match.path`: exact, or a prefix when written with a trailing `*`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum PathPattern {
    Exact(String),
    Prefix(String),
}

/// Which requests a rule applies to; every present condition must hold.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct MatchSpec {
    /// Empty: any method.
    pub methods: Vec<Method>,
    pub path: Option<PathPattern>,
    /// Lower-cased; compared with the request's host without its port.
    pub host: Option<String>,
    /// A route's upstream name.
    pub route: Option<String>,
    pub header: Option<(HeaderName, String)>,
}

/// A set of clients, by address, verified user or API key: a rule's
/// `exempt`, or a `[[deny]]` entry.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ClientSet {
    pub nets: Vec<ipnet::IpNet>,
    pub users: Vec<String>,
    pub api_keys: Vec<String>,
}

impl ClientSet {
    pub fn is_empty(&self) -> bool {
        self.nets.is_empty() && self.users.is_empty() && self.api_keys.is_empty()
    }

    /// Whether the client at `ip` (its full address), with this user and API
    /// key, is in the set.
    pub fn contains(&self, ip: std::net::IpAddr, user: Option<&[u8]>, api_key: Option<&[u8]>) -> bool {
        self.nets.iter().any(|n| n.contains(&ip))
            || user.is_some_and(|u| self.users.iter().any(|x| x.as_bytes() == u))
            || api_key.is_some_and(|k| self.api_keys.iter().any(|x| x.as_bytes() == k))
    }
}

/// What a rule keyed on `user` does with a request whose JWT fails
/// verification (`[client] jwt` only).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize, Default)]
#[serde(rename_all = "snake_case")]
pub enum InvalidToken {
    /// 401 with a JSON body.
    #[default]
    Reject,
    /// Count the request under its client IP, as if it had no token.
    Ip,
}

/// A validated `[[deny]]` entry.
#[derive(Debug, Clone)]
pub struct DenySpec {
    pub name: String,
    pub source: PathBuf,
    pub line: usize,
    pub clients: ClientSet,
}

/// The default `max_cost` of a `cost_header` rule (or its bucket, if
/// smaller): enough for weighted requests, not enough for one request to be
/// a denial of service on its own.
pub const DEFAULT_MAX_COST: u64 = 1000;

/// A concurrency slot's TTL in a shared store when the rule does not say:
/// how long the slots of an instance that died stay counted.
pub const DEFAULT_SLOT_TTL: Duration = Duration::from_secs(10);
/// Slots are renewed several times per TTL; below a second, a Redis pause
/// or a slow renewal round could let a live request's slot expire.
pub(super) const MIN_SLOT_TTL: Duration = Duration::from_secs(1);
pub(super) const MAX_SLOT_TTL: Duration = Duration::from_secs(3600);

/// `calendar` and `timezone`: a quota per calendar window.
#[derive(Debug, Clone)]
pub struct CalendarSpec {
    pub period: crate::limiter::calendar::Period,
    /// The IANA name as written (`"UTC"` when left out).
    pub timezone: String,
    pub zone: jiff::tz::TimeZone,
}

/// The zone is read from the tz database by `timezone`'s name, so the name
/// and the period say everything.
impl PartialEq for CalendarSpec {
    fn eq(&self, other: &CalendarSpec) -> bool {
        self.period == other.period && self.timezone == other.timezone
    }
}

/// A validated rule. Equal specs compile to the same rule: a reload keeps
/// the compiled rule of a spec it finds unchanged (see
/// [`crate::limit::rules::RuleSet::from_loaded_reusing`]).
#[derive(Debug, Clone, PartialEq)]
pub struct RuleSpec {
    pub name: String,
    /// The file it came from and the line of its `[[rule]]`.
    pub source: PathBuf,
    pub line: usize,
    pub matcher: MatchSpec,
    pub key: Vec<KeyPart>,
    pub algorithm: Algorithm,
    pub limit: u64,
    /// The window; for `algorithm = "concurrency"`, the slot TTL
    /// (`slot_ttl`), the one duration such a rule has; for a `calendar`
    /// rule, its longest window ([`crate::limiter::calendar::Period::longest`]).
    pub window: Duration,
    /// `calendar`: windows on calendar boundaries rather than of `window`.
    pub calendar: Option<CalendarSpec>,
    pub burst: u64,
    pub mode: RuleMode,
    pub throttle: Throttle,
    pub cost: Cost,
    /// The largest cost one request may claim through `cost_header` (the
    /// fixed cost itself otherwise): a client cannot make one request cost
    /// the store more than this.
    pub max_cost: u64,
    /// `cost_response_header`: the response header, or else trailer, whose
    /// value corrects the reserved cost to the real one (token bucket,
    /// fixed window and sliding window counter only).
    pub cost_response_header: Option<HeaderName>,
    /// `count_status`: only responses with these statuses count; the
    /// others give their reservation back (fixed and sliding window
    /// counter only).
    pub count_status: Option<super::status_set::StatusSet>,
    /// `quota_unit`: what the quota counts ("tokens"), reported as
    /// `RateLimit-Policy`'s `qu`.
    pub quota_unit: Option<String>,
    pub on_error: Option<OnError>,
    /// Clients this rule never applies to.
    pub exempt: ClientSet,
    pub on_invalid_token: InvalidToken,
    /// `[[rule.override]]`: keys with limits of their own.
    pub overrides: Vec<OverrideSpec>,
    /// `tier` and `tiers`: limits chosen by the request's tier.
    pub tiers: Option<TiersSpec>,
    /// `penalty` and `penalty_after`: a key this rule refuses is refused
    /// for the penalty's duration, whatever its window would allow.
    pub penalty: Option<crate::limiter::Penalty>,
}

impl RuleSpec {
    /// Whether the rule's reservation waits for its request's response
    /// (`cost_response_header`, `count_status`): only such a rule makes the
    /// request path stamp, and settle after, a request.
    pub fn settles_from_response(&self) -> bool {
        self.cost_response_header.is_some() || self.count_status.is_some()
    }

    /// The JWT claim the rule reads its tier from, if it does.
    pub fn claim(&self) -> Option<&str> {
        match self.tiers.as_ref().map(|t| &t.source) {
            Some(TierSource::Claim(c)) => Some(c),
            _ => None,
        }
    }
}

/// One key's own limits (`[[rule.override]]`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct OverrideSpec {
    /// The key as the rule builds it, without the rule's name: `user=alice`,
    /// or `api_key=sha256:` and the SHA-256 of the API key in hex.
    pub key: String,
    pub limit: u64,
    pub burst: u64,
    /// Where it is written, for `/rules` and `explain`.
    pub line: usize,
}

/// Where a request's tier comes from.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum TierSource {
    /// A request header: only as trustworthy as the layer that sets it.
    Header(HeaderName),
    /// A claim of the verified JWT (`[client] jwt`).
    Claim(String),
}

impl TierSource {
    /// The spelling in rules files.
    pub fn describe(&self) -> String {
        match self {
            TierSource::Header(h) => format!("header:{h}"),
            TierSource::Claim(c) => format!("claim:{c}"),
        }
    }
}

/// `tier` and `tiers`: the rule's limits chosen by the request's tier.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TiersSpec {
    pub source: TierSource,
    /// Every tier but `default`, by name: `(name, limit, burst)`.
    pub tiers: Vec<(String, u64, u64)>,
    /// The limits of a request whose tier is missing or not listed.
    pub default: (u64, u64),
}

/// The largest limit or burst: counters and Redis scripts stay well inside
/// exact integer arithmetic (2^53 in Lua doubles, 2^32 in packed cells).
pub(super) const MAX_COUNT: i64 = 1_000_000_000;
