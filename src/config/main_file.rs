//! The main file (`tollgate.toml`): [`Config`], read and validated table
//! by table (each table's validation is in the file named for it).

use std::path::{Path, PathBuf};

use super::admin::AdminConfig;
use super::client::ClientConfig;
use super::error::{ConfigError, ConfigErrors};
use super::listen::Listen;
use super::log::LogConfig;
use super::otel::TracingConfig;
use super::raw::{RawConfig, RawRules};
use super::routes::Route;
use super::store::StoreConfig;
use super::upstream::Upstream;
use super::validate::Validator;

/// The validated main configuration.
#[derive(Debug, Clone)]
pub struct Config {
    /// The file it was read from.
    pub path: PathBuf,
    pub listen: Listen,
    /// The rules file or directory, resolved against the config file's
    /// directory.
    pub rules_path: PathBuf,
    pub store: StoreConfig,
    pub client: ClientConfig,
    pub upstreams: Vec<Upstream>,
    pub routes: Vec<Route>,
    /// `[log]`: the access log.
    pub log: LogConfig,
    /// `[admin]`: the heavy-hitter sketches behind `/top`.
    pub admin: AdminConfig,
    /// `[tracing]`: OpenTelemetry spans; `None` when off.
    pub tracing: Option<TracingConfig>,
}

impl Config {
    /// Reads and validates the main file.
    pub fn load(path: &Path) -> Result<Config, ConfigErrors> {
        let source = std::fs::read_to_string(path)
            .map_err(|e| ConfigError::file(path, format!("cannot read the config file: {e}")))?;
        Config::parse(path, &source)
    }

    /// Validates the text of a main file; `path` names it in errors and
    /// anchors a relative rules path.
    pub fn parse(path: &Path, source: &str) -> Result<Config, ConfigErrors> {
        let raw: RawConfig = toml::from_str(source).map_err(|e| ConfigError::from_toml(path, source, &e))?;
        let mut v = Validator::new(path, source);
        let config = v.config(raw);
        v.finish(config)
    }

    /// The upstream a rule's `match.route` names, by name.
    pub fn upstream_index(&self, name: &str) -> Option<usize> {
        self.upstreams.iter().position(|u| u.name == name)
    }
}

impl Validator<'_> {
    /// Validates the main file. A value with an error gets a placeholder so
    /// that validation goes on and reports every problem; the caller discards
    /// the result when any error was recorded.
    fn config(&mut self, raw: RawConfig) -> Config {
        let listen = self.listen(&raw.listen.unwrap_or_default());
        let rules_path = self.rules_path(raw.rules.unwrap_or_default());
        let store = self.store(raw.store.unwrap_or_default());
        let client = self.client(raw.client.unwrap_or_default());
        let (upstreams, routes) = self.upstreams_and_routes(raw.upstream, raw.route, &listen.normalization);
        let log = self.log(raw.log);
        let admin = self.admin(raw.admin);
        let tracing = self.tracing(raw.tracing);
        Config {
            path: self.file.to_path_buf(),
            listen,
            rules_path,
            store,
            client,
            upstreams,
            routes,
            log,
            admin,
            tracing,
        }
    }

    /// `[rules] path`, relative to the config file's directory unless absolute.
    fn rules_path(&mut self, rules: RawRules) -> PathBuf {
        if let Some(p) = &rules.path
            && p.get_ref().trim().is_empty()
        {
            // An empty path would resolve to the config file's own directory.
            self.error(p.span(), "rules.path must name a rules file or directory");
        }
        let rules_path = PathBuf::from(rules.path.as_ref().map_or("rules", |p| p.get_ref().as_str()));
        if rules_path.is_absolute() {
            rules_path
        } else {
            self.file.parent().unwrap_or(Path::new(".")).join(rules_path)
        }
    }
}
