//! Calendar quotas (`calendar = "month"`, `"week"`, `"day"`): windows that
//! start at a calendar boundary in a time zone, DST included, so a day can
//! last 23 or 25 hours and a month 28 to 31 days.
//!
//! The limiter only knows windows as `[origin, origin + window)` (see
//! [`crate::limiter::Limits::origin`]); this module says where the current
//! calendar window starts and how long it is. Each calendar rule keeps the
//! current window and recomputes it only when the clock reaches its end: the
//! time-zone arithmetic runs once per window, a request costs a comparison.

use parking_lot::Mutex;

use jiff::civil::Date;
use jiff::tz::TimeZone;
use jiff::{Span, Timestamp};

use crate::limiter::Nanos;

/// The length of a calendar window.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Period {
    Day,
    /// ISO weeks: Monday to Sunday.
    Week,
    Month,
}

impl Period {
    /// The spelling in rules files.
    pub fn as_str(self) -> &'static str {
        match self {
            Period::Day => "day",
            Period::Week => "week",
            Period::Month => "month",
        }
    }

    pub fn parse(s: &str) -> Option<Period> {
        match s {
            "day" => Some(Period::Day),
            "week" => Some(Period::Week),
            "month" => Some(Period::Month),
            _ => None,
        }
    }

    /// The longest such window in any zone (a DST change adds an hour to a
    /// day, week or month): how long a key's state must be kept, and the
    /// window the rule's nominal limits carry.
    pub fn longest(self) -> Nanos {
        const HOUR: Nanos = 3600 * crate::limiter::NANOS_PER_SEC;
        match self {
            Period::Day => 25 * HOUR,
            Period::Week => (7 * 24 + 1) * HOUR,
            Period::Month => (31 * 24 + 1) * HOUR,
        }
    }
}

/// One calendar window, `[start, end)` in nanoseconds since the epoch.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Window {
    pub start: Nanos,
    pub end: Nanos,
}

impl Window {
    pub fn len(&self) -> Nanos {
        self.end - self.start
    }

    pub fn is_empty(&self) -> bool {
        self.end <= self.start
    }
}

/// The calendar window of `period` in `zone` that holds `now`. `None` only
/// for instants outside what the time-zone database covers (years past
/// 9999).
pub fn window_at(period: Period, zone: &TimeZone, now: Nanos) -> Option<Window> {
    let at = Timestamp::from_nanosecond(i128::from(now)).ok()?.to_zoned_datetime(zone.clone());
    let date = at.date();
    let first = match period {
        Period::Day => date,
        Period::Week => date.checked_sub(Span::new().days(date.weekday().to_monday_zero_offset())).ok()?,
        Period::Month => date.first_of_month(),
    };
    let next = match period {
        Period::Day => first.tomorrow().ok()?,
        Period::Week => first.checked_add(Span::new().days(7)).ok()?,
        Period::Month => first.checked_add(Span::new().months(1)).ok()?,
    };
    let (start, end) = (start_of(first, zone)?, start_of(next, zone)?);
    (start <= now && now < end).then_some(Window { start, end })
}

/// The first instant of `date` in `zone`: midnight, or the end of a DST gap
/// that swallows midnight (some zones change their clocks at 00:00).
fn start_of(date: Date, zone: &TimeZone) -> Option<Nanos> {
    let first = date.to_zoned_datetime(zone.clone()).ok()?.start_of_day().ok()?;
    u64::try_from(first.timestamp().as_nanosecond()).ok()
}

/// A rule's calendar: its period and zone, and the current window.
#[derive(Debug)]
pub struct Calendar {
    pub period: Period,
    pub zone: TimeZone,
    /// The window last computed. A std mutex: held for a comparison, and
    /// once per window for the time-zone arithmetic; only calendar rules
    /// have one.
    current: Mutex<Window>,
}

impl Calendar {
    pub fn new(period: Period, zone: TimeZone) -> Calendar {
        Calendar { period, zone, current: Mutex::new(Window { start: 0, end: 0 }) }
    }

    /// The window holding `now`: the cached one while `now` is inside it.
    /// Falls back to a window of [`Period::longest`] aligned to the epoch
    /// for an instant the time-zone database cannot place, so a request is
    /// still counted somewhere.
    pub fn window(&self, now: Nanos) -> Window {
        let mut current = self.current.lock();
        if current.start <= now && now < current.end {
            return *current;
        }
        *current = window_at(self.period, &self.zone, now).unwrap_or_else(|| {
            let len = self.period.longest();
            let start = now - now % len;
            Window { start, end: start + len }
        });
        *current
    }

    /// The current window's length in whole seconds, for `RateLimit-Policy`
    /// `w=` and the 429 body (the window last computed: a request computed
    /// it just before).
    pub fn window_secs(&self) -> u64 {
        let current = *self.current.lock();
        let len = if current.is_empty() { self.period.longest() } else { current.len() };
        crate::limiter::ceil_secs(len).max(1)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::limiter::NANOS_PER_SEC;

    const HOUR: Nanos = 3600 * NANOS_PER_SEC;
    const DAY: Nanos = 24 * HOUR;

    fn at(text: &str) -> Nanos {
        let ts: Timestamp = text.parse().unwrap();
        ts.as_nanosecond() as Nanos
    }

    fn berlin() -> TimeZone {
        TimeZone::get("Europe/Berlin").unwrap()
    }

    #[test]
    fn a_day_in_berlin_starts_at_local_midnight() {
        let w = window_at(Period::Day, &berlin(), at("2026-07-15T12:00:00Z")).unwrap();
        // CEST is UTC+2.
        assert_eq!(w, Window { start: at("2026-07-14T22:00:00Z"), end: at("2026-07-15T22:00:00Z") });
        // Just before local midnight it is still the 15th.
        let w2 = window_at(Period::Day, &berlin(), at("2026-07-15T21:59:59.999Z")).unwrap();
        assert_eq!(w2, w);
        let w3 = window_at(Period::Day, &berlin(), at("2026-07-15T22:00:00Z")).unwrap();
        assert_eq!(w3.start, w.end);
    }

    #[test]
    fn dst_days_last_23_and_25_hours() {
        // 2026-03-29: clocks go forward at 02:00 CET.
        let spring = window_at(Period::Day, &berlin(), at("2026-03-29T12:00:00Z")).unwrap();
        assert_eq!(spring, Window { start: at("2026-03-28T23:00:00Z"), end: at("2026-03-29T22:00:00Z") });
        assert_eq!(spring.len(), 23 * HOUR);
        // 2026-10-25: clocks go back at 03:00 CEST.
        let autumn = window_at(Period::Day, &berlin(), at("2026-10-25T12:00:00Z")).unwrap();
        assert_eq!(autumn, Window { start: at("2026-10-24T22:00:00Z"), end: at("2026-10-25T23:00:00Z") });
        assert_eq!(autumn.len(), 25 * HOUR);
    }

    #[test]
    fn months_follow_their_length_and_dst() {
        let z = TimeZone::UTC;
        let feb_leap = window_at(Period::Month, &z, at("2028-02-29T23:59:59Z")).unwrap();
        assert_eq!(feb_leap, Window { start: at("2028-02-01T00:00:00Z"), end: at("2028-03-01T00:00:00Z") });
        assert_eq!(feb_leap.len(), 29 * DAY);
        let feb = window_at(Period::Month, &z, at("2027-02-10T00:00:00Z")).unwrap();
        assert_eq!(feb.len(), 28 * DAY);
        assert_eq!(window_at(Period::Month, &z, at("2027-01-31T12:00:00Z")).unwrap().len(), 31 * DAY);
        // Berlin's March loses an hour, its October gains one.
        let march = window_at(Period::Month, &berlin(), at("2026-03-15T00:00:00Z")).unwrap();
        assert_eq!(march, Window { start: at("2026-02-28T23:00:00Z"), end: at("2026-03-31T22:00:00Z") });
        assert_eq!(march.len(), 31 * DAY - HOUR);
        let october = window_at(Period::Month, &berlin(), at("2026-10-31T22:30:00Z")).unwrap();
        assert_eq!(october, Window { start: at("2026-09-30T22:00:00Z"), end: at("2026-10-31T23:00:00Z") });
        assert_eq!(october.len(), 31 * DAY + HOUR);
    }

    #[test]
    fn weeks_start_on_monday() {
        // 2026-11-24 is a Tuesday; 2026-11-23 the Monday.
        let w = window_at(Period::Week, &TimeZone::UTC, at("2026-11-24T10:00:00Z")).unwrap();
        assert_eq!(w, Window { start: at("2026-11-23T00:00:00Z"), end: at("2026-11-30T00:00:00Z") });
        // A Sunday belongs to the week before it.
        let sunday = window_at(Period::Week, &TimeZone::UTC, at("2026-11-29T23:59:59Z")).unwrap();
        assert_eq!(sunday, w);
        // The week of Berlin's autumn change has 169 hours.
        let dst = window_at(Period::Week, &berlin(), at("2026-10-25T12:00:00Z")).unwrap();
        assert_eq!(dst, Window { start: at("2026-10-18T22:00:00Z"), end: at("2026-10-25T23:00:00Z") });
        assert_eq!(dst.len(), 7 * DAY + HOUR);
    }

    #[test]
    fn the_cached_window_is_recomputed_only_at_its_end() {
        let c = Calendar::new(Period::Day, berlin());
        let w = c.window(at("2026-03-28T23:30:00Z"));
        assert_eq!(w.len(), 23 * HOUR);
        assert_eq!(c.window_secs(), 23 * 3600);
        assert_eq!(c.window(w.end - 1), w);
        let next = c.window(w.end);
        assert_eq!(next.start, w.end);
        assert_eq!(next.len(), 24 * HOUR);
        assert_eq!(c.window_secs(), 24 * 3600);
        // A clock that steps back finds its window again.
        assert_eq!(c.window(w.start), w);
    }
}
