//! The `files` device layout: one file per block in a directory tree that vLLM 0.33.0's
//! file-system tier can share. [`mapper`] names the files (namespace directory, block paths,
//! `config.json`) exactly as vLLM does; it performs no I/O.

pub mod device;
mod evict;
mod index;
pub(crate) mod layout;
mod load;
pub mod mapper;
mod op;
mod probe;
#[cfg(all(test, feature = "sim"))]
mod scenarios;
mod steps;
mod store;
