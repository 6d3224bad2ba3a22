//! The engine's error type, grouped by what the caller can do about it.
//!
//! A miss is not an error (see [`crate::Lookup`]); per-key failures inside a finished job are
//! [`crate::KeyFailure`] values in its [`crate::JobResult`]. A broken invariant is an assertion.

use std::path::PathBuf;

use crate::config::ConfigError;

#[non_exhaustive]
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// The configuration is invalid: fix the named field.
    #[error(transparent)]
    Config(#[from] ConfigError),
    /// A device could not be opened, prepared, formatted or recovered.
    #[error("device {path}: {message}")]
    Device { path: PathBuf, message: String },
    /// The primary region could not be allocated or registered.
    #[error("memory: {0}")]
    Memory(String),
    /// The io_uring could not be set up.
    #[error("io_uring: {0}")]
    Ring(String),
    /// A queue is full: retry later (nothing was queued).
    #[error("backpressure: {0}")]
    Backpressure(String),
    /// The engine has been shut down.
    #[error("the engine is shut down")]
    Shutdown,
    /// A key is malformed.
    #[error("invalid key: {0}")]
    InvalidKey(String),
    /// A worker thread could not be started or died.
    #[error("worker: {0}")]
    Worker(String),
    /// The S3 tier could not be set up (the message names bucket, endpoint and likely cause).
    #[error("s3: {0}")]
    S3(String),
    /// The metrics endpoint (`[metrics] listen`) could not be started.
    #[error("metrics: {0}")]
    Metrics(String),
}

impl Error {
    pub(crate) fn device(path: &std::path::Path, message: impl Into<String>) -> Error {
        Error::Device {
            path: path.to_path_buf(),
            message: message.into(),
        }
    }
}

pub type Result<T, E = Error> = std::result::Result<T, E>;
