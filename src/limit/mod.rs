//! The compiled rules: which rules a request matches, the bucket key,
//! cost and limits (own, override or tier) of each, and the heaviest keys
//! of each rule (`/top`). Built at reload, read per request, no IO.

pub mod path_index;
pub mod rules;
pub mod top;
