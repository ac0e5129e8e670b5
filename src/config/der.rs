//! The two fields tollgate reads from a DER certificate itself: when it
//! expires (`notAfter`, for `tollgate_tls_certificate_expiry_timestamp_seconds`)
//! and its subject's common name (the `client_cert` key part).
//!
//! rustls and webpki check validity but do not expose either, and the few
//! fields on the way to them (RFC 5280 §4.1) are read here rather than
//! linking a whole X.509 parser for one date and one name.

/// `notAfter` of the DER certificate `cert`, in seconds since the epoch;
/// `None` when it cannot be read.
pub fn not_after(cert: &[u8]) -> Option<i64> {
    const SEQUENCE: u8 = 0x30;
    const VERSION: u8 = 0xa0;
    let (SEQUENCE, certificate, _) = element(cert)? else { return None };
    let (SEQUENCE, tbs, _) = element(certificate)? else { return None };
    // [0] version (absent in v1), serialNumber, signature, issuer, validity.
    let mut rest = tbs;
    if element(rest)?.0 == VERSION {
        rest = element(rest)?.2;
    }
    for _ in 0..3 {
        rest = element(rest)?.2;
    }
    let (SEQUENCE, validity, _) = element(rest)? else { return None };
    let not_before_rest = element(validity)?.2;
    let (tag, time, _) = element(not_before_rest)?;
    timestamp(tag, time)
}

/// The DER element at the start of `der`: its tag, its contents and what
/// follows it.
fn element(der: &[u8]) -> Option<(u8, &[u8], &[u8])> {
    let (&tag, rest) = der.split_first()?;
    let (&first, rest) = rest.split_first()?;
    let (len, rest) = if first < 0x80 {
        (usize::from(first), rest)
    } else {
        // Long form: the next (first & 0x7f) bytes hold the length; four
        // are more than any certificate needs.
        let n = usize::from(first & 0x7f);
        if n == 0 || n > 4 || rest.len() < n {
            return None;
        }
        let len = rest[..n].iter().fold(0usize, |acc, &b| (acc << 8) | usize::from(b));
        (len, &rest[n..])
    };
    (rest.len() >= len).then(|| (tag, &rest[..len], &rest[len..]))
}

/// A UTCTime (`YYMMDDHHMMSSZ`, years 1950 to 2049) or GeneralizedTime
/// (`YYYYMMDDHHMMSSZ`), as DER requires them, in seconds since the epoch.
fn timestamp(tag: u8, text: &[u8]) -> Option<i64> {
    const UTC_TIME: u8 = 0x17;
    const GENERALIZED_TIME: u8 = 0x18;
    let digits = text.strip_suffix(b"Z")?;
    let (year, rest) = match (tag, digits.len()) {
        (UTC_TIME, 12) => {
            let yy = number(&digits[..2])?;
            (if yy >= 50 { 1900 + yy } else { 2000 + yy }, &digits[2..])
        }
        (GENERALIZED_TIME, 14) => (number(&digits[..4])?, &digits[4..]),
        _ => return None,
    };
    let field = |i: usize| number(&rest[i..i + 2]);
    let date = jiff::civil::DateTime::new(
        i16::try_from(year).ok()?,
        i8::try_from(field(0)?).ok()?,
        i8::try_from(field(2)?).ok()?,
        i8::try_from(field(4)?).ok()?,
        i8::try_from(field(6)?).ok()?,
        i8::try_from(field(8)?).ok()?,
        0,
    )
    .ok()?;
    Some(jiff::tz::TimeZone::UTC.to_timestamp(date).ok()?.as_second())
}

/// ASCII digits as a number.
fn number(digits: &[u8]) -> Option<i64> {
    digits.iter().try_fold(0i64, |acc, &d| d.is_ascii_digit().then(|| acc * 10 + i64::from(d - b'0')))
}

/// The first common name (OID 2.5.4.3) in the subject of the DER
/// certificate `cert`, its string's bytes as they are.
pub fn common_name(cert: &[u8]) -> Option<&[u8]> {
    const SEQUENCE: u8 = 0x30;
    const SET: u8 = 0x31;
    const VERSION: u8 = 0xa0;
    const OID: u8 = 0x06;
    const COMMON_NAME: &[u8] = &[0x55, 0x04, 0x03];
    let (SEQUENCE, certificate, _) = element(cert)? else { return None };
    let (SEQUENCE, tbs, _) = element(certificate)? else { return None };
    // [0] version, serialNumber, signature, issuer, validity, subject.
    let mut rest = tbs;
    if element(rest)?.0 == VERSION {
        rest = element(rest)?.2;
    }
    for _ in 0..4 {
        rest = element(rest)?.2;
    }
    let (SEQUENCE, mut rdns, _) = element(rest)? else { return None };
    while !rdns.is_empty() {
        let (SET, mut attributes, next) = element(rdns)? else { return None };
        while !attributes.is_empty() {
            let (SEQUENCE, attribute, after) = element(attributes)? else { return None };
            let (tag, oid, value) = element(attribute)?;
            if tag == OID && oid == COMMON_NAME {
                return Some(element(value)?.1);
            }
            attributes = after;
        }
        rdns = next;
    }
    None
}

#[cfg(test)]
mod tests {
    use super::*;

    fn der_until(year: i32, month: u8, day: u8) -> Vec<u8> {
        let key = rcgen::KeyPair::generate().expect("key");
        let mut params = rcgen::CertificateParams::new(vec!["a.test".to_string()]).expect("params");
        params.not_after = rcgen::date_time_ymd(year, month, day);
        params.self_signed(&key).expect("certificate").der().to_vec()
    }

    #[test]
    fn reads_utc_and_generalized_times() {
        // 2031-05-17 (UTCTime) and 2071-01-02 (GeneralizedTime) at midnight UTC.
        assert_eq!(not_after(&der_until(2031, 5, 17)), Some(1_936_742_400));
        assert_eq!(not_after(&der_until(2071, 1, 2)), Some(3_187_382_400));
        assert_eq!(timestamp(0x17, b"991231235959Z"), Some(946_684_799));
        assert_eq!(timestamp(0x18, b"20000101000000Z"), Some(946_684_800));
    }

    #[test]
    fn anything_else_is_none() {
        assert_eq!(not_after(b""), None);
        assert_eq!(not_after(&[0x30, 0x82, 0xff]), None);
        assert_eq!(timestamp(0x17, b"20000101000000Z"), None);
        assert_eq!(timestamp(0x18, b"2000010100000aZ"), None);
        assert_eq!(timestamp(0x18, b"20001301000000Z"), None);
    }

    fn der(cn: Option<&str>) -> Vec<u8> {
        let key = rcgen::KeyPair::generate().expect("key");
        let mut params = rcgen::CertificateParams::new(vec!["a.test".to_string()]).expect("params");
        params.distinguished_name = rcgen::DistinguishedName::new();
        params.distinguished_name.push(rcgen::DnType::OrganizationName, "Example");
        if let Some(cn) = cn {
            params.distinguished_name.push(rcgen::DnType::CommonName, cn);
        }
        params.self_signed(&key).expect("certificate").der().to_vec()
    }

    #[test]
    fn reads_the_common_name_after_other_attributes() {
        assert_eq!(common_name(&der(Some("alice"))), Some(&b"alice"[..]));
        assert_eq!(common_name(&der(None)), None);
        assert_eq!(common_name(b""), None);
    }
}
