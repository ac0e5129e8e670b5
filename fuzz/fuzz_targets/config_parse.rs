//! Arbitrary text as the main config file (`tollgate.toml`).
//!
//! `Config::parse` must answer a config or a list of file:line:column
//! errors, never panic, and the errors must render. Non-UTF-8 input is read
//! lossily: the real loader rejects it before parsing, so only text matters,
//! and a lossy read keeps every mutation useful.

#![no_main]

use std::path::Path;

use libfuzzer_sys::fuzz_target;
use tollgate::config::Config;

fuzz_target!(|data: &[u8]| {
    let text = String::from_utf8_lossy(data);
    // A directory that does not exist: a relative `key_file` or
    // `jwks_file` fails to read at once instead of touching real files.
    match Config::parse(Path::new("/nonexistent-tollgate-fuzz/tollgate.toml"), &text) {
        Ok(config) => {
            let _ = format!("{config:?}");
        }
        Err(errors) => {
            assert!(!errors.0.is_empty(), "an error result carries at least one error");
            let _ = errors.to_string();
        }
    }
});
