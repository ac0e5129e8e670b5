//! The compiled rules: which rules a request matches, the bucket key,
//! cost and limits (own, override or tier) of each, and the heaviest keys
//! of each rule (`/top`), built at reload and read per request with no IO;
//! and the [`decide::Decider`], the one place those rules, one store round
//! and `on_error` turn a request's facts into verdicts.

pub mod decide;
pub mod path_index;
pub mod rules;
pub mod top;
