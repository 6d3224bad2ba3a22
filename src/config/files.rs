//! `[files]`: the vLLM-compatible files layout's settings.

use super::raw::RawFiles;
use serde::{Deserialize, Serialize};

/// Whether the files layout makes each published block durable before it is visible.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default, Deserialize, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum SyncMode {
    /// Like vLLM: write, close, rename; no flush (a crash may leave a short or stale file,
    /// which the checksum or the length check catches at load).
    #[default]
    None,
    /// fdatasync the temp file before the rename, and fsync the directory after it.
    Data,
}

/// The files layout's answer to the first lookup of a key it has not indexed (its worker then
/// `statx`es the block path on its ring, and indexes a block another process published).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default, Deserialize, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum FirstLookup {
    /// Miss at once, as if the probe had found nothing; a block published elsewhere is a hit
    /// from the lookup after the probe's answer on.
    #[default]
    Miss,
    /// Pending until the probe answers (vLLM's own tier answers RETRY first likewise).
    Pending,
}

/// `[files]`: the vLLM-compatible files layout.
#[derive(Clone, Debug, PartialEq, Eq, Deserialize, Serialize)]
#[serde(try_from = "RawFiles")]
pub struct FilesConfig {
    /// What vLLM's FileMapper derives the namespace directory from (`[files.namespace]`).
    pub namespace: crate::config::Namespace,
    pub sync: SyncMode,
    /// Temp files older than this are a crashed writer's and are removed at open.
    pub temp_grace_secs: u64,
    /// Keep a crc32c of each block in the `user.kvtier.crc32c` xattr and verify it on load.
    pub checksums: bool,
    /// Permission bits of every file kvtier creates in the directory (blocks, temp files,
    /// `config.json`, `.kvtier-usage`, `.kvtier-lock`), exactly (not reduced by the umask).
    /// Default 0600: only this user reads the cached prompts' KV.
    #[serde(serialize_with = "serialize_mode")]
    pub file_mode: u32,
    /// Permission bits of every directory kvtier creates there. Default 0700.
    #[serde(serialize_with = "serialize_mode")]
    pub dir_mode: u32,
    /// The answer to the first lookup of a key not indexed (see [`FirstLookup`]).
    pub first_lookup: FirstLookup,
    /// Bound of the answers kept for keys this engine has not indexed (a `statx` on the
    /// worker's ring says whether another process published the block).
    pub lookup_cache_max: usize,
    /// How long such an answer is served before it is asked again; an older "absent" is still
    /// answered while the new `statx` runs.
    pub lookup_ttl_ms: u64,
    /// Most of io_uring's kernel worker threads per worker ring that run file-extending block
    /// writes at once. ext4 and xfs run such an `O_DIRECT` write to completion in that thread,
    /// so this bounds the layout's writes in flight per worker.
    pub io_wq_workers: u32,
    /// Most stores per worker preparing at once: opening the temp file, making its directories
    /// and setting its checksum, the steps before the block's write (a store's write and what
    /// follows it are not counted). Every step runs in io_uring's kernel workers in submission
    /// order: with every queued store preparing, the first block writes would wait behind all
    /// of their opens and directory creations.
    pub stores_opening: u32,
}

impl FilesConfig {
    /// Default file mode: owner read and write.
    pub const DEFAULT_FILE_MODE: u32 = 0o600;
    /// Default directory mode: owner only.
    pub const DEFAULT_DIR_MODE: u32 = 0o700;
    /// Default bound of the lookup answers for blocks not indexed.
    pub const DEFAULT_LOOKUP_CACHE_MAX: usize = 65536;
    /// Default age at which such an answer is asked again.
    pub const DEFAULT_LOOKUP_TTL_MS: u64 = 1000;
    /// Default bound of the kernel's io_uring workers per ring (the kernel's own default is 4
    /// per CPU, 8 on a 2-CPU machine).
    pub const DEFAULT_IO_WQ_WORKERS: u32 = 32;
    /// Largest accepted `io_wq_workers`.
    pub const IO_WQ_WORKERS_MAX: u32 = 1024;
    /// Default bound of the stores preparing per worker.
    pub const DEFAULT_STORES_OPENING: u32 = 32;
    /// Largest accepted `stores_opening`.
    pub const STORES_OPENING_MAX: u32 = 4096;

    /// The `[files]` section for `namespace` with every other field at its default.
    pub fn new(namespace: crate::config::Namespace) -> FilesConfig {
        FilesConfig {
            namespace,
            sync: SyncMode::None,
            temp_grace_secs: 600,
            checksums: true,
            file_mode: Self::DEFAULT_FILE_MODE,
            dir_mode: Self::DEFAULT_DIR_MODE,
            first_lookup: FirstLookup::Miss,
            lookup_cache_max: Self::DEFAULT_LOOKUP_CACHE_MAX,
            lookup_ttl_ms: Self::DEFAULT_LOOKUP_TTL_MS,
            io_wq_workers: Self::DEFAULT_IO_WQ_WORKERS,
            stores_opening: Self::DEFAULT_STORES_OPENING,
        }
    }
}

/// A mode as TOML writes it back: an octal string, `"0640"`.
#[allow(clippy::trivially_copy_pass_by_ref)] // serde's `serialize_with` passes a reference
pub(super) fn serialize_mode<S: serde::Serializer>(
    mode: &u32,
    serializer: S,
) -> Result<S::Ok, S::Error> {
    serializer.serialize_str(&format!("{mode:04o}"))
}
