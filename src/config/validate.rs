//! The [`Validator`] every table's validation writes its errors into, and
//! the parsers of values many tables share (durations, sizes, networks,
//! hosts).

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::time::Duration;

use http::HeaderName;
use ipnet::IpNet;
use toml::Spanned;

use super::error::{ConfigError, ConfigErrors, Lines};
use super::raw::RawSize;
use crate::wire::normalize::Normalization;

/// Collects errors while validating one file.
pub(crate) struct Validator<'a> {
    pub file: &'a Path,
    pub source: &'a str,
    pub errors: Vec<ConfigError>,
    /// The source's line starts: entries record their lines.
    pub lines: Lines,
}

impl<'a> Validator<'a> {
    pub fn new(file: &'a Path, source: &'a str) -> Validator<'a> {
        Validator { file, source, errors: Vec::new(), lines: Lines::of(source) }
    }
}

impl Validator<'_> {
    /// `value` if no problem was recorded, else every problem in file order
    /// (validation visits keys in its own order, not the file's).
    pub fn finish<T>(mut self, value: T) -> Result<T, ConfigErrors> {
        if self.errors.is_empty() {
            Ok(value)
        } else {
            self.errors.sort_by_key(|e| (e.line, e.column));
            Err(ConfigErrors(self.errors))
        }
    }

    pub fn error(&mut self, span: std::ops::Range<usize>, message: impl Into<String>) {
        self.errors.push(ConfigError::at(self.file, self.source, Some(span), message));
    }

    /// A duration such as "250ms", "1s", "90s", "5m", "1h", "1d".
    pub fn duration(&mut self, value: &Spanned<String>, what: &str) -> Option<Duration> {
        match parse_duration(value.get_ref()) {
            Ok(d) if !d.is_zero() => Some(d),
            Ok(_) => {
                self.error(value.span(), format!("{what} must be longer than zero"));
                None
            }
            Err(e) => {
                self.error(
                    value.span(),
                    format!(
                        "{what} {:?} is not a duration ({e}); write e.g. \"250ms\", \"1s\", \"5m\", \"1h\", \"1d\"",
                        value.get_ref()
                    ),
                );
                None
            }
        }
    }

    /// Reads a file named in the config, relative to the config file's
    /// directory unless absolute.
    pub(super) fn read_relative(&mut self, p: &Spanned<String>) -> Option<(PathBuf, Vec<u8>)> {
        let path = PathBuf::from(p.get_ref());
        let path = if path.is_absolute() { path } else { self.file.parent().unwrap_or(Path::new(".")).join(path) };
        match std::fs::read(&path) {
            Ok(bytes) => Some((path, bytes)),
            Err(e) => {
                self.error(p.span(), format!("cannot read {}: {e}", path.display()));
                None
            }
        }
    }

    /// A configured path in the canonical form requests are matched in
    /// (see [`crate::wire::normalize::path`]).
    pub fn canonical_path(&mut self, value: &Spanned<String>, what: &str, n: &Normalization) -> Option<String> {
        match crate::wire::normalize::path(value.get_ref(), n) {
            Ok(p) => Some(p.into_owned()),
            Err(e) => {
                self.error(value.span(), format!("{what} {:?}: {}", value.get_ref(), e.reason()));
                None
            }
        }
    }

    pub(super) fn opt_duration(&mut self, value: Option<&Spanned<String>>, what: &str, default: Duration) -> Duration {
        value.and_then(|v| self.duration(v, what)).unwrap_or(default)
    }

    pub fn header_name(&mut self, value: &Spanned<String>, what: &str) -> Option<HeaderName> {
        match HeaderName::from_bytes(value.get_ref().trim().as_bytes()) {
            Ok(h) => Some(h),
            Err(_) => {
                self.error(value.span(), format!("{what} {:?} is not a valid HTTP header name", value.get_ref()));
                None
            }
        }
    }

    pub(super) fn socket_addr(&mut self, value: &Spanned<String>, what: &str) -> Option<SocketAddr> {
        match value.get_ref().parse() {
            Ok(a) => Some(a),
            Err(_) => {
                self.error(
                    value.span(),
                    format!(
                        "{what} {:?} is not an address such as \"0.0.0.0:8080\" or \"[::1]:8080\"",
                        value.get_ref()
                    ),
                );
                None
            }
        }
    }
}

/// Parses "250ms", "1s", "90s", "5m", "1h", "1d" and combinations such as
/// "1h30m".
pub fn parse_duration(s: &str) -> Result<Duration, humantime::DurationError> {
    humantime::parse_duration(s.trim())
}

/// A size: bytes as a number, or a string with a unit (B, KB, KiB, MB, MiB,
/// GB, GiB; decimal units are powers of 1000, binary ones of 1024).
pub(super) fn parse_size(raw: &RawSize) -> Option<u64> {
    match raw {
        RawSize::Bytes(n) => u64::try_from(*n).ok(),
        RawSize::Text(s) => {
            let s = s.trim();
            let split = s.find(|c: char| !c.is_ascii_digit()).unwrap_or(s.len());
            let (digits, unit) = s.split_at(split);
            let n: u64 = digits.parse().ok()?;
            let scale: u64 = match unit.trim().to_ascii_lowercase().as_str() {
                "" | "b" => 1,
                "kb" => 1000,
                "kib" | "k" => 1024,
                "mb" => 1000 * 1000,
                "mib" | "m" => 1024 * 1024,
                "gb" => 1000 * 1000 * 1000,
                "gib" | "g" => 1024 * 1024 * 1024,
                _ => return None,
            };
            n.checked_mul(scale)
        }
    }
}

/// An address or a CIDR; a bare address is a /32 or /128. An IPv4-mapped
/// network (`::ffff:10.0.0.0/104`) is the IPv4 one it stands for, as the
/// clients it is compared with are ([`crate::wire::client::canonical`]).
pub fn parse_net(s: &str) -> Option<IpNet> {
    let s = s.trim();
    let net = s.parse::<IpNet>().ok().or_else(|| s.parse::<std::net::IpAddr>().ok().map(IpNet::from))?;
    if let IpNet::V6(v6) = net
        && let Some(v4) = v6.addr().to_ipv4_mapped()
        && v6.prefix_len() >= 96
    {
        return ipnet::Ipv4Net::new(v4, v6.prefix_len() - 96).ok().map(IpNet::V4);
    }
    Some(net)
}

/// A configured host, written as requests' hosts are compared
/// ([`crate::wire::normalize::canonical_host`]).
pub fn canonical_host(host: &str) -> String {
    crate::wire::normalize::canonical_host(host.trim())
}
