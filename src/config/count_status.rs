//! `count_status`: a rule that counts only the requests whose response has
//! one of these statuses (`[401, 403]`, `["4xx"]`, `["5xx"]`), such as
//! failed logins. Every request the rule lets through reserves its cost as
//! usual; one answered with another status gives it back when its response
//! head comes (see [`crate::proxy::settle`]). So the rule never admits past
//! its limit: requests under way at once can only be refused early (their
//! reservations still count), never let through late.

use toml::Spanned;

use super::status_set::StatusSet;
use super::validate::Validator;
use crate::limiter::Algorithm;

impl Validator<'_> {
    /// `count_status`: statuses from 100 to 599 and classes `"1xx"` to
    /// `"5xx"`, on an algorithm that can give a whole reservation back.
    pub(super) fn count_status(
        &mut self,
        list: Option<&Spanned<Vec<Spanned<toml::Value>>>>,
        algorithm: Algorithm,
    ) -> Option<StatusSet> {
        let list = list?;
        if list.get_ref().is_empty() {
            self.error(list.span(), "count_status needs at least one status or class, such as [401] or [\"5xx\"]");
            return None;
        }
        if !matches!(algorithm, Algorithm::FixedWindow | Algorithm::SlidingWindowCounter) {
            let why = if algorithm == Algorithm::TokenBucket {
                "a token bucket gives back only what has not drained since it was counted, less than a whole request by the time any response comes"
            } else {
                "it cannot give a request back once counted"
            };
            self.error(
                list.span(),
                format!(
                    "count_status counts fixed_window and sliding_window_counter rules only, not {}: {why}",
                    algorithm.as_str()
                ),
            );
            return None;
        }
        let mut set = StatusSet::default();
        for item in list.get_ref() {
            match item.get_ref() {
                toml::Value::Integer(n) if (100..=599).contains(n) => set.insert(*n as u16),
                toml::Value::Integer(n) => {
                    self.error(item.span(), format!("count_status {n} is not an HTTP status (100 to 599)"));
                }
                other @ toml::Value::String(c) => match class(c) {
                    Some(first) => (first..first + 100).for_each(|s| set.insert(s)),
                    None => self.error(
                        item.span(),
                        format!("count_status {other} is not a class of statuses: \"1xx\" to \"5xx\", or a number such as 401"),
                    ),
                },
                other => self.error(
                    item.span(),
                    format!("count_status takes statuses such as 401 and classes such as \"4xx\", not {other}"),
                ),
            }
        }
        Some(set)
    }
}

/// The first status of a class written `"4xx"`.
fn class(c: &str) -> Option<u16> {
    match c.as_bytes() {
        [d @ b'1'..=b'5', x, y] if x.eq_ignore_ascii_case(&b'x') && y.eq_ignore_ascii_case(&b'x') => {
            Some(u16::from(d - b'0') * 100)
        }
        _ => None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn classes_are_one_digit_and_two_xs() {
        assert_eq!(class("4xx"), Some(400));
        assert_eq!(class("5XX"), Some(500));
        for bad in ["6xx", "0xx", "4x", "4xxx", "401", "xx4"] {
            assert_eq!(class(bad), None, "{bad}");
        }
    }
}
