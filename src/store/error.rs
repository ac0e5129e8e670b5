//! Why a store could not answer.

/// Why a store could not answer. Mapped to the rule's `on_error` policy by
/// the proxy; never shown to clients.
#[derive(Debug, Clone, thiserror::Error)]
pub enum StoreError {
    #[error("store timed out after {0:?}")]
    Timeout(std::time::Duration),
    #[error("store unavailable: {0}")]
    Unavailable(String),
    #[error("store answered an unexpected reply: {0}")]
    Protocol(String),
}
