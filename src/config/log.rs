//! `[log]`: where the access log goes.
//!
//! Only the access log lives here: tollgate's own diagnostics go to stderr
//! (`--log-format`, `RUST_LOG`), and mixing requests into them would make
//! both harder to ship and to read.

use std::path::{Path, PathBuf};

use super::raw::RawLog;
use super::validate::Validator;

/// `[log]`, validated.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct LogConfig {
    pub access: AccessLogTarget,
}

/// `[log] access`: where one JSON line per request is written.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub enum AccessLogTarget {
    /// No access log (the default): nothing is done per request.
    #[default]
    Off,
    /// This process's standard output.
    Stdout,
    /// A file, appended to, reopened on SIGHUP (logrotate's `create` mode).
    File(PathBuf),
}

impl Validator<'_> {
    /// `[log]`: `access` is `"off"`, `"stdout"` or a file path, relative to
    /// the config file's directory unless absolute. The file itself is
    /// opened by the writer thread (it may be a FIFO, whose opening waits for
    /// a reader); its directory must exist now.
    pub(super) fn log(&mut self, raw: Option<RawLog>) -> LogConfig {
        let Some(access) = raw.and_then(|r| r.access) else { return LogConfig::default() };
        let target = match access.get_ref().trim() {
            "off" => AccessLogTarget::Off,
            "stdout" => AccessLogTarget::Stdout,
            "" => {
                self.error(access.span(), "log.access must be \"off\", \"stdout\" or the path of a file");
                AccessLogTarget::Off
            }
            p => {
                let path = PathBuf::from(p);
                let path =
                    if path.is_absolute() { path } else { self.file.parent().unwrap_or(Path::new(".")).join(path) };
                let dir = path.parent().filter(|d| !d.as_os_str().is_empty()).unwrap_or(Path::new("."));
                if path.is_dir() {
                    self.error(
                        access.span(),
                        format!("log.access {} is a directory; name a file in it", path.display()),
                    );
                } else if !dir.is_dir() {
                    self.error(
                        access.span(),
                        format!("log.access {}: the directory {} does not exist", path.display(), dir.display()),
                    );
                }
                AccessLogTarget::File(path)
            }
        };
        LogConfig { access: target }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::Config;

    fn parse(dir: &Path, source: &str) -> Result<Config, String> {
        Config::parse(&dir.join("t.toml"), source).map_err(|e| e.to_string())
    }

    #[test]
    fn off_by_default_stdout_or_a_file_beside_the_config() {
        let dir = tempfile::tempdir().expect("temp dir");
        assert_eq!(parse(dir.path(), "").expect("valid").log.access, AccessLogTarget::Off);
        let access = |v: &str| parse(dir.path(), &format!("[log]\naccess = {v:?}\n")).map(|c| c.log.access);
        assert_eq!(access("off"), Ok(AccessLogTarget::Off));
        assert_eq!(access("stdout"), Ok(AccessLogTarget::Stdout));
        assert_eq!(access("access.log"), Ok(AccessLogTarget::File(dir.path().join("access.log"))));
        let abs = dir.path().join("abs.log");
        assert_eq!(access(abs.to_str().expect("utf-8")), Ok(AccessLogTarget::File(abs)));
    }

    #[test]
    fn a_missing_directory_or_an_empty_value_points_at_the_key() {
        let dir = tempfile::tempdir().expect("temp dir");
        let err = parse(dir.path(), "[log]\naccess = \"nowhere/access.log\"\n").expect_err("invalid");
        assert!(err.starts_with(&format!("{}:2:10: log.access ", dir.path().join("t.toml").display())), "{err}");
        assert!(err.ends_with("does not exist"), "{err}");
        let err = parse(dir.path(), "[log]\naccess = \"\"\n").expect_err("invalid");
        assert!(err.ends_with("t.toml:2:10: log.access must be \"off\", \"stdout\" or the path of a file"), "{err}");
        let err = parse(dir.path(), "[log]\nacess = \"stdout\"\n").expect_err("invalid");
        assert!(err.contains("t.toml:2:1: unknown field `acess`, expected `access`"), "{err}");
    }
}
