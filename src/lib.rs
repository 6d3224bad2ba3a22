//! kvtier: a storage engine for LLM inference nodes. It moves fixed-size KV-cache blocks between
//! a pinned DRAM region and local NVMe through one io_uring per pinned core, loads ahead of
//! stores.
//!
//! ```no_run
//! use std::sync::Arc;
//! use kvtier::{Config, Engine, Job, Key};
//! let config = Config::bench_default(std::path::Path::new("/var/tmp"));
//! let region = kvtier::region::allocate(&config)?;
//! let engine = Engine::open(&config, Arc::clone(&region))?;
//! region.fill(0, config.block_size as usize, 7);
//! let key = Key::new(b"block-0")?;
//! engine.submit_store(Job::new(1, vec![key], vec![0]))?;
//! engine.drain();
//! let mut done = Vec::new();
//! engine.poll_finished(&mut done);
//! assert!(done[0].success);
//! # Ok::<(), kvtier::Error>(())
//! ```
#![forbid(unsafe_code)]

pub mod checksum;
mod clock;
mod cold;
mod commands;
pub mod config;
pub mod engine;
pub mod error;
pub mod events;
pub mod files;
pub mod io;
pub mod job;
pub mod key;
mod logs;
pub mod metrics;
mod node;
pub mod region;
mod route;
#[cfg(feature = "s3")]
pub mod s3;
#[cfg(any(test, feature = "sim"))]
#[doc(hidden)]
pub mod sim;
pub mod slab;
mod tier;
pub mod uring;
mod verdicts;
pub mod vfio;
mod worker;

pub use config::{Config, ConfigError};
pub use engine::{DeviceSummary, Engine, EngineInfo, Lookup, Tier, WorkerSummary};
pub use error::{Error, Result};
pub use events::{Event, Medium};
pub use job::release;
pub use job::release::{Release, ShutdownReport};
pub use job::{BlockId, Job, JobFailure, JobId, JobKind, JobResult, KeyFailure};
pub use key::{Key, MAX_KEY_BYTES};
pub use kvtier_sys::mem::{Backing, Region};
pub use kvtier_sys::Errno;
pub use metrics::{S3OpStats, S3Stats, Stats, ThreadCpu};
