//! [`StatusSet`]: the statuses a `count_status` rule counts (see
//! [`super::count_status`]).

/// A set of HTTP statuses, 100 to 599: one bit each.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct StatusSet {
    bits: [u64; 10],
}

impl StatusSet {
    pub fn contains(&self, status: u16) -> bool {
        let s = usize::from(status);
        s < 640 && self.bits[s / 64] & (1 << (s % 64)) != 0
    }

    /// Adds `status`; one of 640 or more (never an HTTP status, and
    /// refused by validation) is left out.
    pub(super) fn insert(&mut self, status: u16) {
        let s = usize::from(status);
        if let Some(word) = self.bits.get_mut(s / 64) {
            *word |= 1 << (s % 64);
        }
    }

    /// The set as it would be written: whole classes as `"4xx"`, other
    /// statuses by number (`401, 403, "5xx"`), for `explain` and `/rules`.
    pub fn written(&self) -> Vec<String> {
        let mut out = Vec::new();
        for class in 1..=5u16 {
            let statuses = class * 100..class * 100 + 100;
            if statuses.clone().all(|s| self.contains(s)) {
                out.push(format!("{class}xx"));
            } else {
                out.extend(statuses.filter(|&s| self.contains(s)).map(|s| s.to_string()));
            }
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_set_is_written_back_in_classes_and_numbers() {
        let mut s = StatusSet::default();
        (500..600).for_each(|c| s.insert(c));
        s.insert(401);
        s.insert(403);
        assert_eq!(s.written(), ["401", "403", "5xx"]);
        assert!(s.contains(503) && s.contains(401) && !s.contains(402) && !s.contains(200) && !s.contains(600));
    }
}
