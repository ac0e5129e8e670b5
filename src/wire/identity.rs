//! Verified identity: the `user` a rule keys on, taken from a JWT the proxy
//! has checked, instead of a header the client could set to anything.
//!
//! Configured under `[client] jwt = { ... }`. The token is read from a header
//! (`authorization` by default, with or without `Bearer `), its signature is
//! checked against a key file or a JWKS file, and `exp`, `nbf`, `iss` and
//! `aud` are validated; the identity is one claim (`sub` by default). When a
//! rule takes its tier from the token (`tier = "claim:NAME"`), that one
//! more claim is read and remembered with it; otherwise nothing more is.
//!
//! The key file decides which algorithms can be used with it: a PEM RSA key
//! only RS*/PS*, a PEM EC key only ES*, anything else is an HMAC secret and
//! only HS*. Letting a token pick HS256 with an RSA public key as the secret
//! is the classic algorithm-confusion forgery; it cannot happen here.
//!
//! A token that verified is remembered until it expires ([`VerifiedTokens`]):
//! a client sends the same token on every request, and checking its
//! signature each time (tens of microseconds for RS256 or ES256) would cost
//! more than everything else tollgate does for the request. A token that
//! failed is remembered for [`FAILURE_TTL`] seconds, so resending a forged
//! token costs a lookup, not a signature check; and one token is checked
//! against at most [`MAX_KEYS_TRIED`] keys of a JWKS. The proxy verifies only
//! when the request needs its user (`RuleSet::needs_user`).
//!
//! `exp` is always required; `iss` and `aud` are required (and checked)
//! when `issuer` and `audience` are configured. The configured algorithms
//! must all be of one family (HMAC, RSA, EC, EdDSA).

use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use arc_swap::ArcSwap;
use http::{HeaderMap, HeaderName};
use jsonwebtoken::jwk::JwkSet;
use jsonwebtoken::{Algorithm, AlgorithmFamily, DecodingKey, Validation};

use crate::limiter::shards::Shards;

/// What the identity of a request turned out to be.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Identity {
    /// A valid token: the value of the identity claim.
    Verified(String),
    /// No token in the request.
    Missing,
    /// A token that failed verification, and why (safe to show a client).
    Invalid(&'static str),
}

/// Where the verification keys come from.
#[derive(Debug, Clone)]
pub enum KeySource {
    /// One key: a PEM public key (RSA or EC) or an HMAC secret, as read.
    Key { path: PathBuf, bytes: Vec<u8> },
    /// A JWKS document (`{"keys": [...]}`), re-read when it changes.
    Jwks { path: PathBuf, bytes: Vec<u8> },
}

/// The validated `[client] jwt` settings.
#[derive(Debug, Clone)]
pub struct JwtConfig {
    pub header: HeaderName,
    pub algorithms: Vec<Algorithm>,
    pub keys: KeySource,
    pub issuer: Option<String>,
    pub audience: Option<String>,
    pub claim: String,
    /// Clock skew tolerated on `exp` and `nbf`, in seconds.
    pub leeway: u64,
}

/// A loaded key set.
enum Keys {
    One(DecodingKey),
    /// `(kid, key)`; a token without `kid` is tried against the keys of its
    /// algorithm's family, at most [`MAX_KEYS_TRIED`] of them.
    Set(Vec<(Option<String>, DecodingKey)>),
}

/// Most keys one token's signature is checked against.
pub const MAX_KEYS_TRIED: usize = 2;

/// Seconds a token that failed verification is answered from memory.
pub const FAILURE_TTL: u64 = 10;

/// Verifies tokens. Shared by all requests; the key set can be swapped when
/// a JWKS file changes.
pub struct JwtVerifier {
    header: HeaderName,
    claim: String,
    validation: Validation,
    keys: ArcSwap<Keys>,
    jwks_path: Option<PathBuf>,
    verified: VerifiedTokens,
    /// Signature checks done (each token's verification may do up to
    /// [`MAX_KEYS_TRIED`]).
    checks: AtomicU64,
}

/// Longest token read: a token is a few hundred bytes to a few KB; anything
/// larger is not worth a signature check.
const MAX_TOKEN_BYTES: usize = 16 * 1024;

impl JwtVerifier {
    /// Loads the keys. Errors are plain sentences for `tollgate check`.
    pub fn new(config: &JwtConfig) -> Result<JwtVerifier, String> {
        let (keys, family, jwks_path) = match &config.keys {
            KeySource::Key { path, bytes } => {
                let (key, family) = load_key(bytes).map_err(|e| format!("{}: {e}", path.display()))?;
                (Keys::One(key), Some(family), None)
            }
            KeySource::Jwks { path, bytes } => {
                (load_jwks(bytes).map_err(|e| format!("{}: {e}", path.display()))?, None, Some(path.clone()))
            }
        };
        let families: Vec<AlgorithmFamily> = config.algorithms.iter().map(|a| a.family()).collect();
        if families.iter().any(|f| *f != families[0]) {
            let mut names: Vec<&str> = Vec::new();
            for f in &families {
                let name = family_name(*f);
                if !names.contains(&name) {
                    names.push(name);
                }
            }
            return Err(format!(
                "algorithms {:?} mix families ({}): list algorithms of one family",
                config.algorithms,
                names.join(" and ")
            ));
        }
        let algorithms: Vec<Algorithm> = match family {
            Some(f) => config.algorithms.iter().copied().filter(|a| a.family() == f).collect(),
            None => config.algorithms.clone(),
        };
        if algorithms.is_empty() {
            return Err(format!(
                "none of the algorithms {:?} can be used with this key (a PEM RSA key allows RS*/PS*, a PEM EC key ES*, a secret HS*)",
                config.algorithms
            ));
        }
        let mut validation = Validation::new(algorithms[0]);
        validation.algorithms = algorithms;
        validation.leeway = config.leeway;
        validation.validate_nbf = true;
        validation.validate_exp = true;
        let mut required = vec!["exp"];
        match &config.audience {
            Some(aud) => {
                validation.set_audience(&[aud]);
                required.push("aud");
            }
            None => validation.validate_aud = false,
        }
        if let Some(iss) = &config.issuer {
            validation.set_issuer(&[iss]);
            required.push("iss");
        }
        // Without this, a token lacking `iss` or `aud` passes the check of
        // the configured value.
        validation.set_required_spec_claims(&required);
        Ok(JwtVerifier {
            header: config.header.clone(),
            claim: config.claim.clone(),
            validation,
            keys: ArcSwap::from_pointee(keys),
            jwks_path,
            verified: VerifiedTokens::new(),
            checks: AtomicU64::new(0),
        })
    }

    /// The JWKS file to watch, if keys come from one.
    pub fn jwks_path(&self) -> Option<&PathBuf> {
        self.jwks_path.as_ref()
    }

    /// Replaces the key set from a changed JWKS document; keeps the old one
    /// if the new one does not parse.
    pub fn reload_jwks(&self, bytes: &[u8]) -> Result<(), String> {
        let keys = load_jwks(bytes)?;
        self.keys.store(Arc::new(keys));
        // A key taken out of the set must stop vouching for its tokens.
        self.verified.forget_all();
        Ok(())
    }

    /// Signature checks done so far.
    pub fn signature_checks(&self) -> u64 {
        self.checks.load(Ordering::Relaxed)
    }

    /// The identity a request proves.
    pub fn verify(&self, headers: &HeaderMap) -> Identity {
        self.verify_claims(headers, None).0
    }

    /// The identity a request proves, and the value of one more claim of
    /// its token (a rule's `tier = "claim:NAME"`): a string, or a number or
    /// boolean as written; `None` without a verified token or that claim.
    pub fn verify_with_claim(&self, headers: &HeaderMap, claim: &str) -> (Identity, Option<String>) {
        self.verify_claims(headers, Some(claim))
    }

    fn verify_claims(&self, headers: &HeaderMap, tier_claim: Option<&str>) -> (Identity, Option<String>) {
        match self.verify_token(headers, tier_claim) {
            Ok((user, tier)) => (Identity::Verified(user), tier),
            Err(identity) => (identity, None),
        }
    }

    fn verify_token(
        &self,
        headers: &HeaderMap,
        tier_claim: Option<&str>,
    ) -> Result<(String, Option<String>), Identity> {
        let verified = |identity: Identity| match identity {
            Identity::Verified(user) => Ok((user, None)),
            other => Err(other),
        };
        let Some(raw) = headers.get(&self.header) else { return verified(Identity::Missing) };
        let Ok(raw) = raw.to_str() else { return verified(Identity::Invalid("the token is not valid text")) };
        let token = strip_bearer(raw.trim());
        if token.is_empty() {
            return verified(Identity::Missing);
        }
        if token.len() > MAX_TOKEN_BYTES {
            return verified(Identity::Invalid("the token is too long"));
        }
        let now = jsonwebtoken::get_current_timestamp();
        if let Some(known) = self.verified.lookup(token, now, tier_claim) {
            return known;
        }
        let generation = self.verified.generation();
        let claims = match self.check(token) {
            Ok(claims) => claims,
            Err(identity) => {
                if let Identity::Invalid(reason) = identity {
                    self.verified.insert(token, Err(reason), now.saturating_add(FAILURE_TTL), generation);
                }
                return Err(identity);
            }
        };
        let user = match claims.get(&self.claim) {
            Some(serde_json::Value::String(s)) if !s.is_empty() => s.clone(),
            Some(serde_json::Value::Number(n)) => n.to_string(),
            _ => {
                let reason = "the token has no identity claim";
                self.verified.insert(token, Err(reason), now.saturating_add(FAILURE_TTL), generation);
                return Err(Identity::Invalid(reason));
            }
        };
        let tier = tier_claim.and_then(|c| match claims.get(c) {
            Some(serde_json::Value::String(s)) => Some(s.clone()),
            Some(serde_json::Value::Number(n)) => Some(n.to_string()),
            Some(serde_json::Value::Bool(b)) => Some(b.to_string()),
            _ => None,
        });
        // `exp` is a required claim, so a verified token has one.
        if let Some(exp) = claims.get("exp").and_then(serde_json::Value::as_u64) {
            let outcome = Ok(Remembered { user: &user, tier: tier_claim.map(|c| (c, tier.as_deref())) });
            self.verified.insert(token, outcome, exp.saturating_add(self.validation.leeway), generation);
        }
        Ok((user, tier))
    }

    /// Checks the token's signature and claims against at most
    /// [`MAX_KEYS_TRIED`] keys: those of its `kid`, or without one, those of
    /// its algorithm's family.
    fn check(&self, token: &str) -> Result<Claims, Identity> {
        let Ok(header) = jsonwebtoken::decode_header(token) else {
            return Err(Identity::Invalid("the token is malformed"));
        };
        if !self.validation.algorithms.contains(&header.alg) {
            return Err(Identity::Invalid("the token's algorithm is not accepted"));
        }
        let keys = self.keys.load();
        match &**keys {
            Keys::One(key) => {
                self.checks.fetch_add(1, Ordering::Relaxed);
                decode(token, key, &self.validation)
            }
            Keys::Set(set) => {
                let mut last = Err(Identity::Invalid("no key matches the token's kid"));
                let candidates = set
                    .iter()
                    .filter(|(kid, key)| match &header.kid {
                        Some(want) => kid.as_deref() == Some(want.as_str()),
                        None => key.family() == header.alg.family(),
                    })
                    .take(MAX_KEYS_TRIED);
                for (_, key) in candidates {
                    self.checks.fetch_add(1, Ordering::Relaxed);
                    last = decode(token, key, &self.validation);
                    if last.is_ok() {
                        break;
                    }
                }
                last
            }
        }
    }
}

fn family_name(f: AlgorithmFamily) -> &'static str {
    match f {
        AlgorithmFamily::Hmac => "HMAC",
        AlgorithmFamily::Rsa => "RSA",
        AlgorithmFamily::Ec => "EC",
        AlgorithmFamily::Ed => "EdDSA",
    }
}

/// Tokens that were verified, with their outcome and the last second it
/// holds: a verified token's identity until `exp` plus the leeway (as
/// `jsonwebtoken` checks it), a failure's reason for [`FAILURE_TTL`]. Keyed
/// by the whole token, so only the very token that was checked is answered
/// here. A JWKS reload forgets everything, and a verification that started
/// before it is not remembered.
///
/// Bounded: tokens longer than [`MAX_CACHED_TOKEN_BYTES`] are not kept, and
/// a full shard first drops what has expired, then takes nothing new (those
/// tokens are simply verified every time), so it holds at most about 32 MB.
struct VerifiedTokens {
    shards: Shards<TokenMap>,
    generation: AtomicU64,
}

type TokenMap = HashMap<Box<str>, VerifiedToken, foldhash::fast::RandomState>;

struct VerifiedToken {
    /// The identity, or why the token was refused.
    outcome: Result<Verified, &'static str>,
    valid_until: u64,
    generation: u64,
}

/// What a verified token proved.
struct Verified {
    user: String,
    /// The tier claim asked for when it was verified, and its value: a
    /// request asking for another claim (the rules changed) verifies again.
    tier: Option<(Box<str>, Option<Box<str>>)>,
}

/// A verified token's outcome as [`VerifiedTokens::insert`] takes it.
struct Remembered<'a> {
    user: &'a str,
    tier: Option<(&'a str, Option<&'a str>)>,
}

const TOKEN_SHARDS: usize = 16;
const TOKENS_PER_SHARD: usize = 1_024;
const MAX_CACHED_TOKEN_BYTES: usize = 2_048;

impl VerifiedTokens {
    fn new() -> VerifiedTokens {
        VerifiedTokens {
            shards: Shards::new(TOKEN_SHARDS, || HashMap::with_hasher(foldhash::fast::RandomState::default())),
            generation: AtomicU64::new(0),
        }
    }

    fn generation(&self) -> u64 {
        self.generation.load(Ordering::Acquire)
    }

    /// What `token` was found to be (with the value of `tier_claim`), if
    /// that still holds at `now` (Unix seconds) under the current keys.
    #[allow(clippy::type_complexity)]
    fn lookup(
        &self,
        token: &str,
        now: u64,
        tier_claim: Option<&str>,
    ) -> Option<Result<(String, Option<String>), Identity>> {
        let shard = self.shards.lock_key(token);
        let entry = shard.get(token)?;
        if entry.valid_until < now || entry.generation != self.generation() {
            return None;
        }
        Some(match &entry.outcome {
            Ok(v) => {
                let tier = match (tier_claim, &v.tier) {
                    (None, _) => None,
                    (Some(want), Some((claim, value))) if **claim == *want => value.as_deref().map(str::to_string),
                    (Some(_), _) => return None,
                };
                Ok((v.user.clone(), tier))
            }
            Err(reason) => Err(Identity::Invalid(reason)),
        })
    }

    /// [`lookup`](Self::lookup) without a tier claim, as an identity.
    #[cfg(test)]
    fn get(&self, token: &str, now: u64) -> Option<Identity> {
        self.lookup(token, now, None).map(|r| match r {
            Ok((user, _)) => Identity::Verified(user),
            Err(identity) => identity,
        })
    }

    fn insert(&self, token: &str, outcome: Result<Remembered<'_>, &'static str>, valid_until: u64, generation: u64) {
        if token.len() > MAX_CACHED_TOKEN_BYTES || generation != self.generation() {
            return;
        }
        let now = jsonwebtoken::get_current_timestamp();
        // Failures take at most half of a shard: a flood of forged tokens
        // cannot push out the tokens that verified.
        let room = if outcome.is_ok() { TOKENS_PER_SHARD } else { TOKENS_PER_SHARD / 2 };
        let mut shard = self.shards.lock_key(token);
        if shard.len() >= room {
            let current = self.generation();
            shard.retain(|_, e| e.valid_until >= now && e.generation == current);
            if shard.len() >= room {
                return;
            }
        }
        let outcome = outcome.map(|r| Verified {
            user: r.user.to_string(),
            tier: r.tier.map(|(claim, value)| (claim.into(), value.map(Into::into))),
        });
        shard.insert(token.into(), VerifiedToken { outcome, valid_until, generation });
    }

    /// Called when the keys change.
    fn forget_all(&self) {
        self.generation.fetch_add(1, Ordering::AcqRel);
        self.shards.each().for_each(|mut s| s.clear());
    }
}

fn strip_bearer(value: &str) -> &str {
    match value.get(..7) {
        Some(p) if p.eq_ignore_ascii_case("bearer ") => value[7..].trim_start(),
        _ => value,
    }
}

type Claims = serde_json::Map<String, serde_json::Value>;

fn decode(token: &str, key: &DecodingKey, validation: &Validation) -> Result<Claims, Identity> {
    use jsonwebtoken::errors::ErrorKind;
    jsonwebtoken::decode::<Claims>(token, key, validation).map(|d| d.claims).map_err(|e| {
        Identity::Invalid(match e.kind() {
            ErrorKind::ExpiredSignature => "the token has expired",
            ErrorKind::ImmatureSignature => "the token is not valid yet",
            ErrorKind::InvalidIssuer => "the token's issuer is not accepted",
            ErrorKind::InvalidAudience => "the token's audience is not accepted",
            ErrorKind::InvalidAlgorithm => "the token's algorithm is not accepted",
            ErrorKind::InvalidSignature => "the token's signature does not verify",
            ErrorKind::MissingRequiredClaim(_) => {
                "the token lacks a required claim (exp, or the configured iss or aud)"
            }
            _ => "the token is malformed",
        })
    })
}

/// One key file: PEM RSA, PEM EC, or a secret.
fn load_key(bytes: &[u8]) -> Result<(DecodingKey, AlgorithmFamily), String> {
    let text = std::str::from_utf8(bytes).unwrap_or("");
    if text.contains("-----BEGIN") {
        if let Ok(k) = DecodingKey::from_rsa_pem(bytes) {
            return Ok((k, AlgorithmFamily::Rsa));
        }
        if let Ok(k) = DecodingKey::from_ec_pem(bytes) {
            return Ok((k, AlgorithmFamily::Ec));
        }
        return Err("the PEM file holds neither an RSA nor an EC public key".into());
    }
    // A secret file usually ends with a newline the secret does not have.
    let secret = trim_ascii_end(bytes);
    if secret.len() < 32 {
        return Err("an HMAC secret must be at least 32 bytes".into());
    }
    Ok((DecodingKey::from_secret(secret), AlgorithmFamily::Hmac))
}

fn trim_ascii_end(mut b: &[u8]) -> &[u8] {
    while let [rest @ .., last] = b {
        if last.is_ascii_whitespace() {
            b = rest;
        } else {
            break;
        }
    }
    b
}

fn load_jwks(bytes: &[u8]) -> Result<Keys, String> {
    let set: JwkSet = serde_json::from_slice(bytes).map_err(|e| format!("not a JWKS document: {e}"))?;
    let mut keys = Vec::new();
    for jwk in &set.keys {
        let key = DecodingKey::from_jwk(jwk).map_err(|e| format!("unusable key in the JWKS: {e}"))?;
        keys.push((jwk.common.key_id.clone(), key));
    }
    if keys.is_empty() {
        return Err("the JWKS holds no keys".into());
    }
    Ok(Keys::Set(keys))
}

#[cfg(test)]
mod tests {
    use super::*;
    use jsonwebtoken::{EncodingKey, Header, encode};
    use serde_json::json;

    const SECRET: &[u8] = b"0123456789abcdef0123456789abcdef-test-secret";

    fn config(keys: KeySource, algorithms: &[Algorithm]) -> JwtConfig {
        JwtConfig {
            header: HeaderName::from_static("authorization"),
            algorithms: algorithms.to_vec(),
            keys,
            issuer: Some("https://issuer.example".into()),
            audience: Some("tollgate".into()),
            claim: "sub".into(),
            leeway: 0,
        }
    }

    fn hs_verifier() -> JwtVerifier {
        let keys = KeySource::Key { path: "secret".into(), bytes: [SECRET, b"\n"].concat() };
        JwtVerifier::new(&config(keys, &[Algorithm::HS256])).expect("valid config")
    }

    fn token(claims: serde_json::Value) -> String {
        encode(&Header::new(Algorithm::HS256), &claims, &EncodingKey::from_secret(SECRET)).expect("encodes")
    }

    fn headers(value: &str) -> HeaderMap {
        let mut h = HeaderMap::new();
        h.insert("authorization", value.parse().expect("header value"));
        h
    }

    fn now() -> u64 {
        jsonwebtoken::get_current_timestamp()
    }

    #[test]
    fn a_tier_claim_is_read_with_the_identity_and_remembered_with_it() {
        let v = hs_verifier();
        let claims = |plan: serde_json::Value| json!({"sub": "u", "plan": plan, "exp": now() + 60, "iss": "https://issuer.example", "aud": "tollgate"});
        let pro = headers(&token(claims(json!("pro"))));
        let alice = Identity::Verified("u".into());
        assert_eq!(v.verify_with_claim(&pro, "plan"), (alice.clone(), Some("pro".into())));
        assert_eq!(v.verify_with_claim(&pro, "plan"), (alice.clone(), Some("pro".into())));
        assert_eq!(v.verify(&pro), alice);
        assert_eq!(v.signature_checks(), 1, "remembered, claim included");
        // Another claim (the rules changed): verified again for it.
        assert_eq!(v.verify_with_claim(&pro, "tier"), (alice.clone(), None));
        assert_eq!(v.signature_checks(), 2);
        assert_eq!(v.verify_with_claim(&headers(&token(claims(json!(3)))), "plan").1.as_deref(), Some("3"));
        assert_eq!(v.verify_with_claim(&headers(&token(claims(json!(["pro"])))), "plan").1, None);
        assert_eq!(v.verify_with_claim(&HeaderMap::new(), "plan"), (Identity::Missing, None));
        assert_eq!(v.verify_with_claim(&headers("Bearer x.y.z"), "plan").1, None);
    }

    #[test]
    fn a_valid_token_yields_its_subject() {
        let v = hs_verifier();
        let t = token(json!({"sub": "user-42", "exp": now() + 60, "iss": "https://issuer.example", "aud": "tollgate"}));
        assert_eq!(v.verify(&headers(&format!("Bearer {t}"))), Identity::Verified("user-42".into()));
        assert_eq!(v.verify(&headers(&t)), Identity::Verified("user-42".into()));
    }

    #[test]
    fn bad_tokens_are_invalid_with_a_reason() {
        let v = hs_verifier();
        let good = json!({"sub": "u", "exp": now() + 60, "iss": "https://issuer.example", "aud": "tollgate"});
        let mut expired = good.clone();
        expired["exp"] = json!(now() - 10);
        assert_eq!(v.verify(&headers(&token(expired))), Identity::Invalid("the token has expired"));
        let mut wrong_aud = good.clone();
        wrong_aud["aud"] = json!("someone-else");
        assert_eq!(v.verify(&headers(&token(wrong_aud))), Identity::Invalid("the token's audience is not accepted"));
        let mut wrong_iss = good.clone();
        wrong_iss["iss"] = json!("https://evil.example");
        assert_eq!(v.verify(&headers(&token(wrong_iss))), Identity::Invalid("the token's issuer is not accepted"));
        let forged = encode(
            &Header::new(Algorithm::HS256),
            &good,
            &EncodingKey::from_secret(b"another-secret-another-secret-xx"),
        )
        .expect("encodes");
        assert_eq!(v.verify(&headers(&forged)), Identity::Invalid("the token's signature does not verify"));
        assert_eq!(v.verify(&headers("Bearer not.a.jwt")), Identity::Invalid("the token is malformed"));
        assert_eq!(v.verify(&HeaderMap::new()), Identity::Missing);
        let mut no_sub = good;
        no_sub.as_object_mut().expect("object").remove("sub");
        assert_eq!(v.verify(&headers(&token(no_sub))), Identity::Invalid("the token has no identity claim"));
    }

    #[test]
    fn verified_tokens_are_remembered_until_they_expire() {
        let v = hs_verifier();
        let claims = json!({"sub": "user-9", "exp": now() + 60, "iss": "https://issuer.example", "aud": "tollgate"});
        let t = token(claims);
        assert_eq!(v.verify(&headers(&t)), Identity::Verified("user-9".into()));
        let at = now();
        let user9 = Some(Identity::Verified("user-9".into()));
        assert_eq!(v.verified.get(&t, at), user9);
        assert_eq!(v.verified.get(&t, at + 60), user9, "valid through its exp second");
        assert_eq!(v.verified.get(&t, at + 62), None, "expired: verified again, and refused");
        // One character changed is another token: verified, and refused.
        let mut tampered = t.clone().into_bytes();
        let last = tampered.len() - 2;
        tampered[last] = if tampered[last] == b'A' { b'B' } else { b'A' };
        let tampered = String::from_utf8(tampered).expect("ascii");
        assert_eq!(v.verify(&headers(&tampered)), Identity::Invalid("the token's signature does not verify"));
        assert_eq!(
            v.verified.get(&tampered, at),
            Some(Identity::Invalid("the token's signature does not verify")),
            "failures are remembered, briefly"
        );
    }

    #[test]
    fn a_secret_key_allows_only_hmac_algorithms() {
        let v = hs_verifier();
        assert_eq!(v.validation.algorithms, vec![Algorithm::HS256]);
        let keys = KeySource::Key { path: "secret".into(), bytes: SECRET.to_vec() };
        let err = JwtVerifier::new(&config(keys, &[Algorithm::RS256])).err().expect("no usable algorithm");
        assert!(err.contains("none of the algorithms"), "{err}");
    }

    #[test]
    fn an_algorithm_list_mixing_families_is_refused() {
        let keys = KeySource::Key { path: "secret".into(), bytes: SECRET.to_vec() };
        let err = JwtVerifier::new(&config(keys, &[Algorithm::HS256, Algorithm::RS256])).err().expect("refused");
        assert_eq!(err, "algorithms [HS256, RS256] mix families (HMAC and RSA): list algorithms of one family");
        let keys = KeySource::Key { path: "secret".into(), bytes: SECRET.to_vec() };
        assert!(JwtVerifier::new(&config(keys, &[Algorithm::HS256, Algorithm::HS512])).is_ok());
    }

    #[test]
    fn exp_issuer_and_audience_are_required_when_configured() {
        let v = hs_verifier();
        let full = json!({"sub": "u", "exp": now() + 60, "iss": "https://issuer.example", "aud": "tollgate"});
        for (claim, reason) in [
            ("exp", "the token lacks a required claim (exp, or the configured iss or aud)"),
            ("iss", "the token lacks a required claim (exp, or the configured iss or aud)"),
            ("aud", "the token lacks a required claim (exp, or the configured iss or aud)"),
        ] {
            let mut c = full.clone();
            c.as_object_mut().expect("object").remove(claim);
            assert_eq!(v.verify(&headers(&token(c))), Identity::Invalid(reason), "without {claim}");
        }
    }

    #[test]
    fn failures_are_remembered_briefly() {
        let v = hs_verifier();
        let good = json!({"sub": "u", "exp": now() + 60, "iss": "https://issuer.example", "aud": "tollgate"});
        let forged = encode(
            &Header::new(Algorithm::HS256),
            &good,
            &EncodingKey::from_secret(b"another-secret-another-secret-xx"),
        )
        .expect("encodes");
        for _ in 0..5 {
            assert_eq!(v.verify(&headers(&forged)), Identity::Invalid("the token's signature does not verify"));
        }
        assert_eq!(v.signature_checks(), 1, "one check, then the remembered failure");
        let at = now();
        assert!(v.verified.get(&forged, at).is_some());
        assert!(v.verified.get(&forged, at + FAILURE_TTL + 1).is_none(), "forgotten after FAILURE_TTL");
    }

    #[test]
    fn a_token_without_kid_is_tried_against_few_keys() {
        use base64::Engine as _;
        // Ten HMAC keys, none of them the token's: a kid-less token is
        // checked against at most MAX_KEYS_TRIED of them.
        let keys: Vec<String> = (0..10)
            .map(|i| {
                let k = base64::engine::general_purpose::URL_SAFE_NO_PAD
                    .encode(format!("{i}-secret-secret-secret-secret-secret"));
                format!(r#"{{"kty":"oct","kid":"k{i}","alg":"HS256","k":"{k}"}}"#)
            })
            .collect();
        let doc = format!(r#"{{"keys":[{}]}}"#, keys.join(","));
        let v = JwtVerifier::new(&config(
            KeySource::Jwks { path: "j".into(), bytes: doc.into_bytes() },
            &[Algorithm::HS256],
        ))
        .expect("valid jwks");
        let t = token(json!({"sub": "u", "exp": now() + 60, "iss": "https://issuer.example", "aud": "tollgate"}));
        assert!(matches!(v.verify(&headers(&t)), Identity::Invalid(_)));
        assert!(v.signature_checks() <= MAX_KEYS_TRIED as u64, "{} checks", v.signature_checks());
    }

    #[test]
    fn short_secrets_and_bad_jwks_are_refused() {
        let short = KeySource::Key { path: "s".into(), bytes: b"short".to_vec() };
        assert!(JwtVerifier::new(&config(short, &[Algorithm::HS256])).is_err());
        let jwks = KeySource::Jwks { path: "j".into(), bytes: b"{\"keys\": []}".to_vec() };
        assert!(JwtVerifier::new(&config(jwks, &[Algorithm::RS256])).is_err());
    }

    #[test]
    fn jwks_keys_are_selected_by_kid_and_reloadable() {
        use base64::Engine as _;
        let k = base64::engine::general_purpose::URL_SAFE_NO_PAD.encode(SECRET);
        let doc = |kid: &str| format!(r#"{{"keys":[{{"kty":"oct","kid":"{kid}","alg":"HS256","k":"{k}"}}]}}"#);
        let keys = KeySource::Jwks { path: "jwks.json".into(), bytes: doc("one").into_bytes() };
        let v = JwtVerifier::new(&config(keys, &[Algorithm::HS256])).expect("valid jwks");
        let claims = json!({"sub": "7", "exp": now() + 60, "iss": "https://issuer.example", "aud": "tollgate"});
        let mut header = Header::new(Algorithm::HS256);
        header.kid = Some("one".into());
        let t = encode(&header, &claims, &EncodingKey::from_secret(SECRET)).expect("encodes");
        assert_eq!(v.verify(&headers(&t)), Identity::Verified("7".into()));
        assert_eq!(v.verify(&headers(&t)), Identity::Verified("7".into()), "the second time from the cache");
        v.reload_jwks(doc("two").as_bytes()).expect("reloads");
        assert_eq!(v.verify(&headers(&t)), Identity::Invalid("no key matches the token's kid"));
        assert!(v.reload_jwks(b"garbage").is_err());
    }
}
