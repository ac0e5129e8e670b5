//! `[admin]`: what the admin listener offers beyond its fixed endpoints
//! (its address is `[listen] admin`).

use super::raw::RawAdmin;
use super::validate::Validator;

/// `[admin]`, validated.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct AdminConfig {
    /// Keys each `/top` sketch holds: the most a report shows, and what
    /// fixes their memory. 0: no sketch, nothing counted per request.
    pub top_keys: usize,
}

/// `[admin] top_keys` when not given: enough for a screenful, a few
/// kilobytes per rule.
pub const DEFAULT_TOP_KEYS: usize = 64;

/// Most `[admin] top_keys`: a sketch's memory grows with it, per rule and
/// per shard.
pub const MAX_TOP_KEYS: usize = 10_000;

impl Default for AdminConfig {
    fn default() -> Self {
        AdminConfig { top_keys: DEFAULT_TOP_KEYS }
    }
}

impl Validator<'_> {
    /// `[admin]`: `top_keys` from 0 (off) to [`MAX_TOP_KEYS`].
    pub(super) fn admin(&mut self, raw: Option<RawAdmin>) -> AdminConfig {
        let Some(n) = raw.and_then(|r| r.top_keys) else { return AdminConfig::default() };
        let max = MAX_TOP_KEYS;
        match usize::try_from(*n.get_ref()) {
            Ok(top_keys) if top_keys <= max => AdminConfig { top_keys },
            _ => {
                self.error(n.span(), format!("admin.top_keys must be between 0 (off) and {max}"));
                AdminConfig::default()
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use std::path::Path;

    use crate::config::Config;

    fn top_keys(source: &str) -> Result<usize, String> {
        Config::parse(Path::new("t.toml"), source).map(|c| c.admin.top_keys).map_err(|e| e.to_string())
    }

    #[test]
    fn sixty_four_by_default_zero_turns_it_off() {
        assert_eq!(top_keys(""), Ok(64));
        assert_eq!(top_keys("[admin]\n"), Ok(64));
        assert_eq!(top_keys("[admin]\ntop_keys = 0\n"), Ok(0));
        assert_eq!(top_keys("[admin]\ntop_keys = 10000\n"), Ok(10_000));
    }

    #[test]
    fn out_of_range_or_unknown_keys_point_at_the_value() {
        let expected = Err("t.toml:2:12: admin.top_keys must be between 0 (off) and 10000".to_string());
        assert_eq!(top_keys("[admin]\ntop_keys = -1\n"), expected);
        assert_eq!(top_keys("[admin]\ntop_keys = 10001\n"), expected);
        let err = top_keys("[admin]\ntopkeys = 5\n").expect_err("unknown key");
        assert!(err.starts_with("t.toml:2:1: unknown field `topkeys`, expected `top_keys`"), "{err}");
        let err = top_keys("[admin]\ntop_keys = \"many\"\n").expect_err("a string");
        assert!(err.starts_with("t.toml:2:12: "), "{err}");
    }
}
