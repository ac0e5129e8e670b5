//! Rate-limit response headers: the names as constants and the renderers.
//!
//! Two families are sent together, because clients in the wild read both:
//! the de facto `X-RateLimit-*` trio for the most restrictive rule, and the
//! IETF draft-10 `RateLimit-Policy` / `RateLimit` structured fields with one
//! item per matching rule.

use bytes::Bytes;
use http::header::{CONTENT_TYPE, HeaderMap, HeaderName, HeaderValue, RETRY_AFTER};

pub const X_RATELIMIT_LIMIT: HeaderName = HeaderName::from_static("x-ratelimit-limit");
pub const X_RATELIMIT_REMAINING: HeaderName = HeaderName::from_static("x-ratelimit-remaining");
pub const X_RATELIMIT_RESET: HeaderName = HeaderName::from_static("x-ratelimit-reset");
pub const X_RATELIMIT_RETRY_AFTER: HeaderName = HeaderName::from_static("x-ratelimit-retry-after");
pub const RATELIMIT_POLICY: HeaderName = HeaderName::from_static("ratelimit-policy");
pub const RATELIMIT: HeaderName = HeaderName::from_static("ratelimit");

/// What one matching rule reported for a request, as the client sees it:
/// the values the headers are written from. The rules implement it
/// ([`crate::limit::rules::RuleReport`]), so that this module works on plain
/// values and knows nothing of rules.
pub trait Report {
    /// The rule's name as a structured-field string, quotes included.
    fn quoted_name(&self) -> &str;
    /// The limit as the `X-RateLimit-Limit` value.
    fn limit_value(&self) -> &HeaderValue;
    /// The rule's part of `RateLimit-Policy`: `"name";q=5;w=60`.
    fn policy(&self) -> &str;
    /// The same as a header value, rendered at reload; `None` for a
    /// calendar rule, whose window changes.
    fn policy_value(&self) -> Option<&HeaderValue>;
    /// A calendar rule's current window, in seconds; `None` for others.
    fn calendar_window_secs(&self) -> Option<u64>;
    /// Requests left, against the rule's nominal limit.
    fn remaining(&self) -> u64;
    /// Seconds until the quota is fully available again.
    fn reset_secs(&self) -> u64;
}

/// A whole number as a header value. Those below [`SMALL`] (retry and
/// reset seconds, most remaining counts) point into a table rendered at
/// compile time: no allocation and no digits written per response.
fn number(n: u64) -> HeaderValue {
    if n < SMALL {
        let (from, to) = (SMALL_AT[n as usize] as usize, SMALL_AT[n as usize + 1] as usize);
        // Digits only: `from_static` cannot panic on them (checked for
        // every entry by a unit test).
        return HeaderValue::from_static(&SMALL_DIGITS[from..to]);
    }
    // Digits are always a valid header value. Copied from the stack:
    // `HeaderValue::from(u64)` grows a `BytesMut` for them, which costs
    // more than the digits do.
    HeaderValue::from_bytes(itoa::Buffer::new().format(n).as_bytes()).unwrap_or(HeaderValue::from_static("0"))
}

/// Numbers below this come from [`SMALL_DIGITS`].
const SMALL: u64 = 1000;

/// "0", "1", ... "999" written one after the other (10 one-digit, 90
/// two-digit and 900 three-digit numbers).
const SMALL_LEN: usize = 10 + 90 * 2 + 900 * 3;

/// `SMALL_DIGITS[SMALL_AT[n]..SMALL_AT[n + 1]]` is `n` in decimal.
const SMALL_AT: [u16; SMALL as usize + 1] = small_table().1;

static SMALL_DIGITS: &str = match std::str::from_utf8(&SMALL_BYTES) {
    Ok(s) => s,
    Err(_) => panic!("digits are ASCII"),
};
const SMALL_BYTES: [u8; SMALL_LEN] = small_table().0;

const fn small_table() -> ([u8; SMALL_LEN], [u16; SMALL as usize + 1]) {
    let mut bytes = [0u8; SMALL_LEN];
    let mut at = [0u16; SMALL as usize + 1];
    let (mut n, mut len) = (0, 0);
    while n < SMALL as usize {
        at[n] = len as u16;
        if n >= 100 {
            bytes[len] = b'0' + (n / 100) as u8;
            len += 1;
        }
        if n >= 10 {
            bytes[len] = b'0' + (n / 10 % 10) as u8;
            len += 1;
        }
        bytes[len] = b'0' + (n % 10) as u8;
        len += 1;
        n += 1;
    }
    at[n] = len as u16;
    (bytes, at)
}

/// A header value that is a whole number.
fn parse_u64(v: &HeaderValue) -> Option<u64> {
    std::str::from_utf8(v.as_bytes()).ok()?.trim().parse().ok()
}

/// How many decimal digits `n` takes.
fn digits(n: u64) -> usize {
    n.checked_ilog10().map_or(1, |d| d as usize + 1)
}

/// Adds the rate-limit headers for `reports` (the matching enforced rules,
/// in rule order: shadow rules never show) to `headers`. `primary` is the
/// index of the rule the `X-RateLimit-*` trio describes. Nothing is added
/// when no rule matched.
///
/// An upstream's own rate-limit headers are kept, never made more
/// permissive (the IETF draft's rule for intermediaries): `RateLimit` and
/// `RateLimit-Policy` get tollgate's items as further field lines (a list
/// split over lines is one list), and an `X-RateLimit-*` trio whose
/// remaining is lower than tollgate's stays as the upstream sent it. With no
/// upstream headers (the common case) this costs nothing more than writing
/// tollgate's own.
pub fn write<R: Report>(headers: &mut HeaderMap, reports: &[R], primary: usize) {
    let Some(p) = reports.get(primary) else { return };
    match headers.insert(X_RATELIMIT_REMAINING, number(p.remaining())) {
        Some(theirs) if parse_u64(&theirs).is_some_and(|t| t < p.remaining()) => {
            headers.insert(X_RATELIMIT_REMAINING, theirs);
        }
        _ => {
            headers.insert(X_RATELIMIT_LIMIT, p.limit_value().clone());
            headers.insert(X_RATELIMIT_RESET, number(p.reset_secs()));
        }
    }

    let mut policy = String::new();
    let mut buffer = itoa::Buffer::new();
    for (i, r) in reports.iter().enumerate() {
        if i > 0 {
            policy.push_str(", ");
        }
        if reports.len() > 1 || r.policy_value().is_none() {
            policy.push_str(r.policy());
            if let Some(w) = r.calendar_window_secs() {
                // The current calendar window's length.
                policy.push_str(";w=");
                policy.push_str(buffer.format(w));
            }
        }
    }
    // One rule, the common case: its policy value was rendered at reload.
    if let [only] = reports
        && let Some(v) = only.policy_value()
    {
        headers.append(RATELIMIT_POLICY, v.clone());
    }
    // Rule names are validated to printable ASCII without quotes or
    // backslashes (the sf-string alphabet, nothing to escape), so
    // these are valid header values; skip the header rather than panic if
    // that ever changes.
    if !policy.is_empty()
        && let Ok(v) = HeaderValue::from_str(&policy)
    {
        headers.append(RATELIMIT_POLICY, v);
    }
    if let Some(v) = state(reports) {
        headers.append(RATELIMIT, v);
    }
}

/// The header section of a 429 from a one-rule request, prebuilt for one
/// plan of that rule at reload: a rejection clones it and overwrites the
/// five values that change, instead of hashing nine names into an empty
/// map. The result is header for header what [`ProxyError::into_response`]
/// and [`write`] give (a unit test compares both), in the same order.
///
/// [`ProxyError::into_response`]: crate::wire::error::ProxyError::into_response
#[derive(Debug)]
pub struct RejectHead(HeaderMap);

/// Where [`RejectHead::render`] writes the values of each rejection:
/// positions in the map's entry order, which is insertion order while
/// nothing is removed (`HeaderMap::iter_mut` walks its entries in order).
const HEAD_REQUEST_ID: usize = 1;
const HEAD_RETRY_AFTER: usize = 2;
const HEAD_X_RETRY_AFTER: usize = 3;
const HEAD_RESET: usize = 6;
const HEAD_RATELIMIT: usize = 8;
const HEAD_LEN: usize = 9;

impl RejectHead {
    /// The 429 head of a plan whose `RateLimit-Policy` was rendered at
    /// reload (`None` for a calendar rule, whose window changes).
    pub fn new(plan_limit: &HeaderValue, policy: Option<&HeaderValue>) -> Option<RejectHead> {
        let placeholder = HeaderValue::from_static("0");
        let mut h = HeaderMap::with_capacity(HEAD_LEN);
        h.insert(CONTENT_TYPE, HeaderValue::from_static("application/json"));
        h.insert(crate::wire::request_id::X_REQUEST_ID, placeholder.clone());
        h.insert(RETRY_AFTER, placeholder.clone());
        h.insert(X_RATELIMIT_RETRY_AFTER, placeholder.clone());
        h.insert(X_RATELIMIT_REMAINING, HeaderValue::from_static("0"));
        h.insert(X_RATELIMIT_LIMIT, plan_limit.clone());
        h.insert(X_RATELIMIT_RESET, placeholder.clone());
        h.append(RATELIMIT_POLICY, policy?.clone());
        h.append(RATELIMIT, placeholder);
        Some(RejectHead(h))
    }

    /// The headers of one rejection of request `request_id` by `report`'s
    /// rule, the only one the request matched: retry after `retry_secs`
    /// (at least 1, as [`write_retry_after`] writes it).
    pub fn render<R: Report>(&self, request_id: &HeaderValue, retry_secs: u64, report: &R) -> HeaderMap {
        let mut h = self.0.clone();
        let retry = number(retry_secs.max(1));
        for (i, (_, v)) in h.iter_mut().enumerate() {
            match i {
                HEAD_REQUEST_ID => *v = request_id.clone(),
                HEAD_RETRY_AFTER | HEAD_X_RETRY_AFTER => *v = retry.clone(),
                HEAD_RESET => *v = number(report.reset_secs()),
                HEAD_RATELIMIT => {
                    if let Some(s) = state(std::slice::from_ref(report)) {
                        *v = s;
                    }
                }
                _ => {}
            }
        }
        h
    }
}

/// The `RateLimit` value of `reports`: each rule's remaining and reset.
/// Rule names are validated to printable ASCII without quotes or
/// backslashes (the sf-string alphabet, nothing to escape), so this is
/// `None` only if that ever changes.
fn state<R: Report>(reports: &[R]) -> Option<HeaderValue> {
    // Written into a buffer of its exact length, which then becomes the
    // header value without another copy.
    let len = reports
        .iter()
        .map(|r| r.quoted_name().len() + 6 + digits(r.remaining()) + digits(r.reset_secs()))
        .sum::<usize>()
        + 2 * reports.len().saturating_sub(1);
    let mut state = Vec::with_capacity(len);
    let mut buffer = itoa::Buffer::new();
    for (i, r) in reports.iter().enumerate() {
        if i > 0 {
            state.extend_from_slice(b", ");
        }
        state.extend_from_slice(r.quoted_name().as_bytes());
        state.extend_from_slice(b";r=");
        state.extend_from_slice(buffer.format(r.remaining()).as_bytes());
        state.extend_from_slice(b";t=");
        state.extend_from_slice(buffer.format(r.reset_secs()).as_bytes());
    }
    HeaderValue::from_maybe_shared(Bytes::from(state)).ok()
}

/// Adds `Retry-After` and `X-RateLimit-Retry-After` (whole seconds, at least 1).
pub fn write_retry_after(headers: &mut HeaderMap, secs: u64) {
    let v = number(secs.max(1));
    headers.insert(RETRY_AFTER, v.clone());
    headers.insert(X_RATELIMIT_RETRY_AFTER, v);
}

/// The index of the most restrictive report: least remaining, first on ties.
pub fn most_restrictive<R: Report>(reports: &[R]) -> usize {
    reports.iter().enumerate().min_by_key(|(i, r)| (r.remaining(), *i)).map_or(0, |(i, _)| i)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn digits_counts_what_itoa_writes() {
        for n in [0, 1, 9, 10, 99, 100, 999_999, 1_000_000, u64::MAX] {
            assert_eq!(digits(n), itoa::Buffer::new().format(n).len(), "{n}");
        }
        assert_eq!(number(1_000_000_000), "1000000000");
    }

    #[test]
    fn every_number_of_the_table_is_its_decimal_digits() {
        for n in 0..=SMALL + 1 {
            assert_eq!(number(n).as_bytes(), itoa::Buffer::new().format(n).as_bytes(), "{n}");
        }
        assert_eq!(SMALL_AT[SMALL as usize] as usize, SMALL_LEN);
    }

    /// The patched `HeaderMap` hash (vendor/http/TOLLGATE-PATCH.md) finds a
    /// name in whatever case it is asked for: names of up to 64 bytes are
    /// lower-cased before hashing, longer ones hashed in pieces of eight.
    /// Run here so that `scripts/test` covers the patch.
    #[test]
    fn header_names_are_found_in_any_case_and_length() {
        let mut names: Vec<String> =
            [X_RATELIMIT_REMAINING, RATELIMIT, http::header::HOST].iter().map(|n| n.as_str().to_string()).collect();
        names.extend(
            [1, 7, 8, 9, 64, 65, 71, 72, 73, 100].map(|len| (0..len).map(|i| (b'a' + i % 26) as char).collect()),
        );
        let mut map = HeaderMap::new();
        for (i, n) in names.iter().enumerate() {
            map.insert(HeaderName::from_bytes(n.as_bytes()).expect("a token"), HeaderValue::from(i));
        }
        for (i, n) in names.iter().enumerate() {
            assert_eq!(map.get(n.as_str()), Some(&HeaderValue::from(i)), "{n}");
            let upper = n.to_ascii_uppercase();
            assert_eq!(map.get(upper.as_str()), Some(&HeaderValue::from(i)), "{upper}");
        }
    }
}
