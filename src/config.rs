//! Engine configuration: plain data read from TOML (see `kvtier.example.toml`) and checked once,
//! by [`Config::validate`], before the engine derives its layout from it. Invariants: a `Config`
//! returned by [`Config::from_toml_str`] or [`Config::from_file`] has passed `validate`; unknown
//! keys are errors, so a misspelt key never falls back silently to a default; and every error
//! names the field by its dotted path (`scheduler.store_chunk_bytes`, `devices[1].path`), the bad
//! value as TOML would write it, and what would be accepted. Reading is two-staged so that both
//! halves of that promise hold: TOML is first read into raw values (syntax errors and unknown keys
//! come out of this stage with their line), then each raw value is converted knowing its path.

use std::collections::HashSet;
use std::fmt;
use std::path::{Path, PathBuf};

use serde::{Deserialize, Deserializer, Serialize, Serializer};
use toml::Value;

const KIB: u64 = 1 << 10;
const MIB: u64 = 1 << 20;
const GIB: u64 = 1 << 30;
const TIB: u64 = 1 << 40;

/// Alignment of blocks and store chunks: the logical block size `O_DIRECT` needs on most drives.
const ALIGN_BYTES: u64 = 4096;
/// Upper bound on `block_size`: one block must stay a reasonable unit of I/O and of memory.
const BLOCK_SIZE_MAX: u64 = GIB;
/// Smallest device worth formatting: room for the header and a useful number of blocks.
const DEVICE_CAPACITY_MIN: u64 = 16 * MIB;
/// CPU numbers in `cores` must be below this: room for any machine kvtier targets, while a
/// slip such as `10000` is caught.
const CPU_LIMIT: usize = 1024;
/// Bounds of `ring_entries`; the kernel caps submission queues at 32768 entries.
const RING_ENTRIES_MIN: u32 = 8;
const RING_ENTRIES_MAX: u32 = 32768;
/// The primary region is one allocation, and Rust allocations are bounded by `isize::MAX`.
const REGION_BYTES_MAX: u64 = i64::MAX.unsigned_abs();

/// What a size may look like; shown by every error about a size that could not be read.
const SIZE_FORMS: &str = "an integer number of bytes, or a string such as \"4096\", \"512 KiB\", \
                          \"2 MiB\", \"1.5 GiB\" (units B, K/KiB, M/MiB, G/GiB, T/TiB are \
                          binary; KB, MB, GB, TB are decimal; case does not matter)";
const BOOL_FORMS: &str = "true or false";
const CORES_FORMS: &str = "\"auto\" or a non-empty list of distinct CPU numbers, e.g. [0, 1]";
const CPU_FORMS: &str = "a CPU number from 0 to 1023";
const PATH_FORMS: &str =
    "a non-empty path to a file or block device, e.g. \"/var/lib/kvtier/slab0\"";
const BLOCK_SIZE_FORMS: &str = "a multiple of 4096 bytes from 4 KiB to 1 GiB, e.g. \"2 MiB\"";
const RING_ENTRIES_FORMS: &str = "a power of two from 8 to 32768";
const AT_LEAST_ONE: &str = "an integer of at least 1";

/// Whether the region kvtier allocates itself is backed by huge pages.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Deserialize, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum HugePages {
    /// Fail at start-up when huge pages cannot be had.
    Required,
    /// Use huge pages when available, otherwise normal pages.
    #[default]
    Auto,
    /// Always use normal pages.
    Off,
}

/// Whether devices are opened with `O_DIRECT`, bypassing the page cache.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Deserialize, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum DirectIo {
    /// Fail at start-up when a device does not support `O_DIRECT`.
    Required,
    /// Use `O_DIRECT` where the device supports it, buffered I/O elsewhere.
    #[default]
    Auto,
    /// Always use buffered I/O.
    Off,
}

/// How blocks are laid out on a device.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Deserialize, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Layout {
    /// One file or block device cut into `block_size` slots.
    #[default]
    Slab,
    /// Blocks kept as separate files.
    Files,
}

/// Locality tag carried by emitted events; spelt in upper case, as vLLM spells it.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Deserialize, Serialize)]
#[serde(rename_all = "UPPERCASE")]
pub enum Locality {
    Local,
    Remote,
}

/// The closed set of names a config enum accepts. `ALL` and `name` must agree with serde's
/// spelling; a test checks that they do.
trait Named: Copy + 'static {
    const ALL: &'static [Self];
    fn name(self) -> &'static str;
}

impl Named for HugePages {
    const ALL: &'static [Self] = &[Self::Required, Self::Auto, Self::Off];
    fn name(self) -> &'static str {
        match self {
            Self::Required => "required",
            Self::Auto => "auto",
            Self::Off => "off",
        }
    }
}

impl Named for DirectIo {
    const ALL: &'static [Self] = &[Self::Required, Self::Auto, Self::Off];
    fn name(self) -> &'static str {
        match self {
            Self::Required => "required",
            Self::Auto => "auto",
            Self::Off => "off",
        }
    }
}

impl Named for Layout {
    const ALL: &'static [Self] = &[Self::Slab, Self::Files];
    fn name(self) -> &'static str {
        match self {
            Self::Slab => "slab",
            Self::Files => "files",
        }
    }
}

impl Named for S3Write {
    const ALL: &'static [Self] = &[Self::Through, Self::OnEvict, Self::Off];
    fn name(self) -> &'static str {
        match self {
            Self::Through => "through",
            Self::OnEvict => "on_evict",
            Self::Off => "off",
        }
    }
}

impl Named for WriteAck {
    const ALL: &'static [Self] = &[Self::Both, Self::Nvme];
    fn name(self) -> &'static str {
        match self {
            Self::Both => "both",
            Self::Nvme => "nvme",
        }
    }
}

impl Named for SyncMode {
    const ALL: &'static [Self] = &[Self::None, Self::Data];
    fn name(self) -> &'static str {
        match self {
            Self::None => "none",
            Self::Data => "data",
        }
    }
}

impl Named for Locality {
    const ALL: &'static [Self] = &[Self::Local, Self::Remote];
    fn name(self) -> &'static str {
        match self {
            Self::Local => "LOCAL",
            Self::Remote => "REMOTE",
        }
    }
}

macro_rules! display_by_name {
    ($($ty:ty),*) => {$(
        impl fmt::Display for $ty {
            fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str(self.name())
            }
        }
    )*};
}
display_by_name!(SyncMode, HugePages, DirectIo, Layout, Locality);

/// The CPUs worker threads are pinned to: one worker per listed CPU.
///
/// TOML: `cores = "auto"` or `cores = [0, 1]`.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub enum Cores {
    /// Let the engine choose.
    #[default]
    Auto,
    /// These CPU numbers, each below 1024, none twice, at least one.
    List(Vec<usize>),
}

impl Serialize for Cores {
    fn serialize<S: Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        match self {
            Self::Auto => serializer.serialize_str("auto"),
            Self::List(cpus) => cpus.serialize(serializer),
        }
    }
}

impl<'de> Deserialize<'de> for Cores {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        let value = Value::deserialize(deserializer)?;
        cores_from_value("cores", &value).map_err(serde::de::Error::custom)
    }
}

/// The whole engine configuration. Deserialization goes through a raw form that denies unknown
/// keys and names the field of any badly typed value; it does not run [`Config::validate`].
#[derive(Clone, Debug, PartialEq, Deserialize, Serialize)]
#[serde(try_from = "RawConfig")]
pub struct Config {
    /// Bytes per block, the unit of storage and I/O.
    #[serde(serialize_with = "serialize_size")]
    pub block_size: u64,
    pub cores: Cores,
    /// Huge pages for the region kvtier allocates itself.
    pub hugepages: HugePages,
    /// Blocks in the primary region when kvtier allocates it.
    pub region_blocks: u64,
    pub direct_io: DirectIo,
    /// Submission queue entries of each worker's `io_uring`.
    pub ring_entries: u32,
    pub sqpoll: bool,
    pub sqpoll_idle_ms: u32,
    pub iopoll: bool,
    /// Per worker bound on queued blocks (loads and stores).
    pub queue_blocks_max: usize,
    pub jobs_in_flight_max: usize,
    pub scheduler: SchedulerConfig,
    pub events: EventsConfig,
    pub devices: Vec<DeviceConfig>,
    /// `[files]`: required when a device uses `layout = "files"`.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub files: Option<FilesConfig>,
    /// `[s3]`: the object-store tier; absent means no S3 tier.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub s3: Option<S3Config>,
}

/// A credential from the config: kept for the client, shown as `"<redacted>"` by `Debug` and
/// when the config is printed, so it never reaches a log.
#[derive(Clone, PartialEq, Eq, Deserialize)]
pub struct Secret(String);

impl Secret {
    #[must_use]
    pub fn new(value: impl Into<String>) -> Secret {
        Secret(value.into())
    }

    /// The secret itself, for the S3 client only.
    #[must_use]
    pub fn expose(&self) -> &str {
        &self.0
    }
}

impl fmt::Debug for Secret {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("\"<redacted>\"")
    }
}

impl Serialize for Secret {
    fn serialize<S: Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        serializer.serialize_str("<redacted>")
    }
}

/// `[s3] write`: when stored blocks go to the object store.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default, Deserialize, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum S3Write {
    /// Every stored block is uploaded after its NVMe store.
    Through,
    /// Blocks the NVMe tier evicts are uploaded: read into a staging buffer before their slot is
    /// reused (slab) or their file removed (files).
    OnEvict,
    /// Nothing is uploaded: the bucket is read-only for this node.
    #[default]
    Off,
}

/// `[s3] write_ack`: when a write-through store job is reported.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default, Deserialize, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum WriteAck {
    /// After both the NVMe store and the upload finished; the job fails if either failed.
    #[default]
    Both,
    /// After the NVMe store and a copy of the block for the upload; the upload finishes in the
    /// background (failures are counted and logged, not reported in the job). A block finding
    /// `upload_queue_blocks` copies waiting is not uploaded (counted): stores never wait for S3.
    Nvme,
}

/// `[s3]`: an S3-compatible object store behind the NVMe tier.
#[derive(Clone, Debug, PartialEq, Eq, Deserialize, Serialize)]
#[serde(try_from = "RawS3")]
pub struct S3Config {
    pub bucket: String,
    /// `http(s)://host:port` for S3-compatible stores; `None` for AWS itself.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub endpoint: Option<String>,
    pub region: String,
    /// Path-style URLs (`endpoint/bucket/key`), which most S3-compatible servers need.
    pub force_path_style: bool,
    /// Static credentials; all three absent means the AWS default chain (env, profile, IMDS...).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub access_key_id: Option<Secret>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub secret_access_key: Option<Secret>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub session_token: Option<Secret>,
    /// Object names are `<prefix>/<files-layout relative path>`, the prefix used verbatim (an
    /// empty prefix gives no leading slash; vLLM's prefix `P` is kvtier's `"P/"`).
    pub prefix: String,
    /// Requests in flight at once (GET, HEAD and PUT together).
    pub max_concurrency: usize,
    /// Per attempt: connect plus response, and the whole body for GET and PUT.
    pub timeout_ms: u64,
    /// Retries after the first attempt, for timeouts, connection errors, 5xx and throttling.
    pub retries: u32,
    pub write: S3Write,
    pub write_ack: WriteAck,
    /// Store a block loaded from S3 into NVMe too (the load reports once that store is done).
    pub promote_on_load: bool,
    /// Bound of the lookup cache (keys whose presence in the bucket is known or being asked).
    pub lookup_cache_max: usize,
    /// How long a HEAD's answer is trusted before the key is asked again (other nodes upload,
    /// lifecycle rules delete).
    pub lookup_ttl_ms: u64,
    /// Bound of blocks copied and waiting for upload (`write_ack = "nvme"` and demotions).
    pub upload_queue_blocks: usize,
    /// Namespace for object names; defaults to `[files.namespace]`.
    pub namespace: crate::files::mapper::Namespace,
}

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

/// `[files]`: the vLLM-compatible files layout.
#[derive(Clone, Debug, PartialEq, Eq, Deserialize, Serialize)]
#[serde(try_from = "RawFiles")]
pub struct FilesConfig {
    /// What vLLM's FileMapper derives the namespace directory from (`[files.namespace]`).
    pub namespace: crate::files::mapper::Namespace,
    pub sync: SyncMode,
    /// Temp files older than this are a crashed writer's and are removed at open.
    pub temp_grace_secs: u64,
    /// Keep a crc32c of each block in the `user.kvtier.crc32c` xattr and verify it on load.
    pub checksums: bool,
}

/// `[scheduler]`: how each worker shares its ring between loads and stores.
#[derive(Clone, Debug, PartialEq, Eq, Deserialize, Serialize)]
#[serde(try_from = "RawScheduler")]
pub struct SchedulerConfig {
    /// Reads in flight per worker.
    pub load_inflight_max: usize,
    /// Bytes of writes in flight per worker when no load waits.
    #[serde(serialize_with = "serialize_size")]
    pub store_inflight_max: u64,
    /// Bytes of writes in flight per worker while loads wait; also the stores' guaranteed share.
    #[serde(serialize_with = "serialize_size")]
    pub store_inflight_max_while_loading: u64,
    /// Stores are issued in chunks of this many bytes, so loads can overtake them.
    #[serde(serialize_with = "serialize_size")]
    pub store_chunk_bytes: u64,
    /// Tag SQEs with I/O priorities: loads best-effort level 0, stores best-effort level 7.
    pub ioprio: bool,
}

/// What the engine runs with, derived from a validated [`Config`] by [`Config::validate`].
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Derived {
    pub block_bytes: u64,
    /// The layout of every device (one engine runs one).
    pub layout: Layout,
    /// A store's write size while loads wait: `scheduler.store_chunk_bytes`, raised so a block
    /// has at most 255 chunks (the chunk number travels in 8 bits of `user_data`), at most the
    /// block.
    pub store_chunk_bytes: u64,
    /// Largest registered piece of a buffer: whole blocks, at most 1 GiB (one iovec's limit),
    /// at least one block.
    pub piece_bytes: usize,
    /// `s3.write = "on_evict"`: evicted blocks are read into staging and demoted.
    pub demote_on_evict: bool,
    /// Staging slots per worker for demotion.
    pub staging_blocks: usize,
}

/// Most chunks one block's store may be cut into.
pub(crate) const MAX_STORE_CHUNKS: u64 = 255;
/// Largest registered buffer piece (the kernel's limit per iovec).
const REGISTERED_PIECE_MAX: u64 = 1 << 30;
const DEMOTION_STAGING_BLOCKS: usize = 8;

/// The store chunk for `configured` bytes and blocks of `block_bytes`: at least
/// `block_bytes / 255` rounded up to 4 KiB, at most the block.
pub(crate) fn store_chunk_bytes(configured: u64, block_bytes: u64) -> u64 {
    let floor = block_bytes.div_ceil(MAX_STORE_CHUNKS).div_ceil(ALIGN_BYTES) * ALIGN_BYTES;
    configured.max(floor).min(block_bytes)
}

/// `[events]`: the block event stream.
#[derive(Clone, Debug, PartialEq, Eq, Deserialize, Serialize)]
#[serde(try_from = "RawEvents")]
pub struct EventsConfig {
    pub enabled: bool,
    /// Bound on events buffered and not yet taken.
    pub max: usize,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub locality: Option<Locality>,
}

/// One `[[devices]]` entry.
#[derive(Clone, Debug, PartialEq, Eq, Deserialize, Serialize)]
#[serde(try_from = "RawDevice")]
pub struct DeviceConfig {
    pub path: PathBuf,
    pub layout: Layout,
    /// Needed to create a file that does not exist yet.
    #[serde(
        serialize_with = "serialize_size_opt",
        skip_serializing_if = "Option::is_none"
    )]
    pub capacity_bytes: Option<u64>,
    /// Allow formatting an existing non-empty file or device that has no kvtier header.
    pub overwrite: bool,
}

impl DeviceConfig {
    /// A slab device at `path` with every other field at its default.
    pub fn new(path: impl Into<PathBuf>) -> DeviceConfig {
        DeviceConfig {
            path: path.into(),
            layout: Layout::Slab,
            capacity_bytes: None,
            overwrite: false,
        }
    }
}

impl Default for SchedulerConfig {
    fn default() -> Self {
        SchedulerConfig {
            load_inflight_max: 64,
            store_inflight_max: 64 * MIB,
            store_inflight_max_while_loading: 512 * KIB,
            store_chunk_bytes: 512 * KIB,
            ioprio: true,
        }
    }
}

impl Default for EventsConfig {
    fn default() -> Self {
        EventsConfig {
            enabled: false,
            max: 65536,
            locality: None,
        }
    }
}

impl Default for Config {
    /// Every field at its default and no devices, so it does not validate as it is.
    fn default() -> Self {
        Config {
            block_size: 2 * MIB,
            cores: Cores::Auto,
            hugepages: HugePages::Auto,
            region_blocks: 256,
            direct_io: DirectIo::Auto,
            ring_entries: 256,
            sqpoll: false,
            sqpoll_idle_ms: 1000,
            iopoll: false,
            queue_blocks_max: 65536,
            jobs_in_flight_max: 8192,
            scheduler: SchedulerConfig::default(),
            events: EventsConfig::default(),
            devices: Vec::new(),
            files: None,
            s3: None,
        }
    }
}

impl Config {
    /// Parses `text` as TOML and validates the result.
    ///
    /// # Errors
    ///
    /// [`ConfigError::Parse`] for bad TOML, an unknown key or a misplaced table (the message has
    /// the line); [`ConfigError::Invalid`] for a value its field does not accept.
    pub fn from_toml_str(text: &str) -> Result<Config, ConfigError> {
        let raw: RawConfig = toml::from_str(text)
            .map_err(|err| ConfigError::Parse(err.to_string().trim_end().to_owned()))?;
        let config = Config::try_from(raw)?;
        config.validate()?;
        Ok(config)
    }

    /// Reads, parses and validates the config file at `path`.
    ///
    /// # Errors
    ///
    /// [`ConfigError::Io`] naming `path` when it cannot be read, otherwise as
    /// [`Config::from_toml_str`], with `path` prefixed to parse messages.
    pub fn from_file(path: &Path) -> Result<Config, ConfigError> {
        let text = std::fs::read_to_string(path).map_err(|source| ConfigError::Io {
            path: path.to_owned(),
            source,
        })?;
        Config::from_toml_str(&text).map_err(|err| match err {
            ConfigError::Parse(message) => {
                ConfigError::Parse(format!("{}: {message}", path.display()))
            }
            other => other,
        })
    }

    /// Checks every field and the relations between fields, and derives the sizes the engine
    /// runs with from them (computed here once; nothing else recomputes them).
    ///
    /// # Errors
    ///
    /// [`ConfigError::Invalid`] for the first violation found.
    pub fn validate(&self) -> Result<Derived, ConfigError> {
        let block_size = self.block_size;
        ensure(
            block_size % ALIGN_BYTES == 0 && (ALIGN_BYTES..=BLOCK_SIZE_MAX).contains(&block_size),
            "block_size",
            show_size(block_size),
            BLOCK_SIZE_FORMS,
        )?;
        validate_cores(&self.cores)?;
        ensure(
            self.region_blocks >= 1
                && self
                    .region_blocks
                    .checked_mul(block_size)
                    .is_some_and(|bytes| bytes <= REGION_BYTES_MAX),
            "region_blocks",
            self.region_blocks,
            format!(
                "an integer of at least 1 such that region_blocks × block_size \
                 ({}) is at most {REGION_BYTES_MAX} bytes",
                show_size(block_size)
            ),
        )?;
        ensure(
            self.ring_entries.is_power_of_two()
                && (RING_ENTRIES_MIN..=RING_ENTRIES_MAX).contains(&self.ring_entries),
            "ring_entries",
            self.ring_entries,
            RING_ENTRIES_FORMS,
        )?;
        ensure(
            self.queue_blocks_max >= 1,
            "queue_blocks_max",
            self.queue_blocks_max,
            AT_LEAST_ONE,
        )?;
        ensure(
            self.jobs_in_flight_max >= 1,
            "jobs_in_flight_max",
            self.jobs_in_flight_max,
            AT_LEAST_ONE,
        )?;
        self.validate_scheduler()?;
        ensure(
            self.events.max >= 1,
            "events.max",
            self.events.max,
            AT_LEAST_ONE,
        )?;
        self.validate_devices()?;
        self.validate_s3()?;
        Ok(self.derive())
    }

    fn derive(&self) -> Derived {
        let block_bytes = self.block_size;
        let piece_blocks = (REGISTERED_PIECE_MAX / block_bytes).max(1);
        Derived {
            block_bytes,
            layout: self.devices.first().map_or(Layout::Slab, |d| d.layout),
            store_chunk_bytes: store_chunk_bytes(self.scheduler.store_chunk_bytes, block_bytes),
            piece_bytes: (piece_blocks * block_bytes) as usize,
            demote_on_evict: self
                .s3
                .as_ref()
                .is_some_and(|s3| s3.write == S3Write::OnEvict),
            staging_blocks: DEMOTION_STAGING_BLOCKS,
        }
    }

    fn validate_s3(&self) -> Result<(), ConfigError> {
        let Some(s3) = &self.s3 else {
            return Ok(());
        };
        ensure(
            (1..=1024).contains(&s3.max_concurrency),
            "s3.max_concurrency",
            s3.max_concurrency,
            "an integer from 1 to 1024",
        )?;
        ensure(
            (1..=3_600_000).contains(&s3.timeout_ms),
            "s3.timeout_ms",
            s3.timeout_ms,
            "an integer number of milliseconds from 1 to 3600000",
        )?;
        ensure(
            s3.retries <= 20,
            "s3.retries",
            s3.retries,
            "an integer from 0 to 20",
        )?;
        ensure(
            s3.lookup_cache_max >= 1,
            "s3.lookup_cache_max",
            s3.lookup_cache_max,
            AT_LEAST_ONE,
        )?;
        ensure(
            s3.upload_queue_blocks >= 1,
            "s3.upload_queue_blocks",
            s3.upload_queue_blocks,
            AT_LEAST_ONE,
        )
    }

    fn validate_scheduler(&self) -> Result<(), ConfigError> {
        let s = &self.scheduler;
        ensure(
            (1..=self.ring_entries as usize).contains(&s.load_inflight_max),
            "scheduler.load_inflight_max",
            s.load_inflight_max,
            format!("an integer from 1 to ring_entries ({})", self.ring_entries),
        )?;
        ensure(
            s.store_chunk_bytes >= ALIGN_BYTES && s.store_chunk_bytes % ALIGN_BYTES == 0,
            "scheduler.store_chunk_bytes",
            show_size(s.store_chunk_bytes),
            "a multiple of 4096 bytes, at least 4 KiB, e.g. \"512 KiB\"",
        )?;
        ensure(
            s.store_inflight_max >= s.store_chunk_bytes,
            "scheduler.store_inflight_max",
            show_size(s.store_inflight_max),
            format!(
                "a size of at least scheduler.store_chunk_bytes ({})",
                show_size(s.store_chunk_bytes)
            ),
        )?;
        ensure(
            (s.store_chunk_bytes..=s.store_inflight_max)
                .contains(&s.store_inflight_max_while_loading),
            "scheduler.store_inflight_max_while_loading",
            show_size(s.store_inflight_max_while_loading),
            format!(
                "a size from scheduler.store_chunk_bytes ({}) to scheduler.store_inflight_max ({})",
                show_size(s.store_chunk_bytes),
                show_size(s.store_inflight_max)
            ),
        )
    }

    fn validate_devices(&self) -> Result<(), ConfigError> {
        ensure(
            !self.devices.is_empty(),
            "devices",
            "[]",
            "at least one [[devices]] entry",
        )?;
        for (index, device) in self.devices.iter().enumerate() {
            ensure(
                !device.path.as_os_str().is_empty(),
                &format!("devices[{index}].path"),
                "\"\"",
                PATH_FORMS,
            )?;
            if let Some(earlier) = self.devices[..index]
                .iter()
                .position(|d| d.path == device.path)
            {
                return Err(invalid(
                    format!("devices[{index}].path"),
                    show_path(&device.path),
                    format!("a path no other device uses (devices[{earlier}] has it)"),
                ));
            }
            if device.layout == Layout::Files && self.files.is_none() {
                return Err(invalid(
                    "files",
                    "(missing)",
                    format!(
                        "a [files] section with [files.namespace], because devices[{index}] \
                         uses layout = \"files\""
                    ),
                ));
            }
            if index > 0 && device.layout != self.devices[0].layout {
                return Err(invalid(
                    format!("devices[{index}].layout"),
                    format!("\"{}\"", device.layout.name()),
                    format!(
                        "\"{}\", like devices[0]: one engine runs one layout",
                        self.devices[0].layout.name()
                    ),
                ));
            }
            if let Some(capacity) = device.capacity_bytes {
                ensure(
                    capacity >= DEVICE_CAPACITY_MIN,
                    &format!("devices[{index}].capacity_bytes"),
                    show_size(capacity),
                    "a size of at least 16 MiB, e.g. \"64 GiB\"",
                )?;
            }
        }
        Ok(())
    }

    /// The embedded default used by `kvtier bench` with no config: one slab device
    /// `<dir>/kvtier-bench.slab`, capacity 1 GiB, other fields default.
    #[must_use]
    pub fn bench_default(dir: &Path) -> Config {
        let mut device = DeviceConfig::new(dir.join("kvtier-bench.slab"));
        device.capacity_bytes = Some(GIB);
        Config {
            devices: vec![device],
            ..Config::default()
        }
    }

    /// The config as TOML, for printing the effective config. Sizes that are a whole number of
    /// binary units print as strings such as `"2 MiB"`, other sizes as integers.
    #[must_use]
    pub fn to_toml_string(&self) -> String {
        // Only values TOML cannot hold fail here (a non-UTF-8 path, an integer above i64::MAX);
        // printing the config must still say something useful then.
        toml::to_string(self).unwrap_or_else(|err| {
            format!("# this config cannot be written as TOML: {err}\n# {self:?}\n")
        })
    }
}

fn validate_cores(cores: &Cores) -> Result<(), ConfigError> {
    let Cores::List(cpus) = cores else {
        return Ok(());
    };
    ensure(!cpus.is_empty(), "cores", "[]", CORES_FORMS)?;
    let mut seen = HashSet::with_capacity(cpus.len());
    for (index, &cpu) in cpus.iter().enumerate() {
        ensure(cpu < CPU_LIMIT, &format!("cores[{index}]"), cpu, CPU_FORMS)?;
        if !seen.insert(cpu) {
            return Err(invalid(
                "cores",
                format!("{cpus:?}"),
                format!("{CORES_FORMS} ({cpu} is listed more than once)"),
            ));
        }
    }
    Ok(())
}

/// Everything that can go wrong loading a config.
#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    #[error("reading config {path}: {source}")]
    Io {
        path: PathBuf,
        source: std::io::Error,
    },
    /// TOML syntax, an unknown key or a misplaced table; the message has the line and the key.
    #[error("config: {0}")]
    Parse(String),
    /// A value outside what its field accepts; `value` is written as TOML would write it.
    #[error("config field `{field}` = {value}: {expected}")]
    Invalid {
        field: String,
        value: String,
        expected: String,
    },
}

fn invalid(
    field: impl Into<String>,
    value: impl fmt::Display,
    expected: impl Into<String>,
) -> ConfigError {
    ConfigError::Invalid {
        field: field.into(),
        value: value.to_string(),
        expected: expected.into(),
    }
}

fn ensure(
    ok: bool,
    field: &str,
    value: impl fmt::Display,
    expected: impl Into<String>,
) -> Result<(), ConfigError> {
    if ok {
        Ok(())
    } else {
        Err(invalid(field, value, expected))
    }
}

// ---------------------------------------------------------------------------------------------
// Sizes.

/// Why a size string was refused.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum SizeError {
    #[error("not a number followed by an optional unit")]
    Malformed,
    #[error("unknown unit `{0}`")]
    UnknownUnit(String),
    #[error("not a whole number of bytes")]
    NotWholeBytes,
    #[error("more than 2^64 - 1 bytes")]
    TooLarge,
}

/// Parses a size such as `"4096"`, `"512KiB"`, `"2 MiB"` or `"1.5 GiB"` into bytes.
///
/// Units (case-insensitive, optionally after spaces): none or `B` for bytes; `KiB`, `MiB`,
/// `GiB`, `TiB` and the short `K`, `M`, `G`, `T` are binary; `KB`, `MB`, `GB`, `TB` decimal.
/// A fraction is allowed as long as the result is a whole number of bytes.
///
/// # Errors
///
/// [`SizeError`] saying what is wrong with `text`.
pub fn parse_size(text: &str) -> Result<u64, SizeError> {
    // Longer fractions (after trailing zeros) are refused as malformed: nobody writes them, and
    // the bound keeps the arithmetic below within u128.
    const FRACTION_DIGITS_MAX: u32 = 20;

    let text = text.trim();
    let number_end = text
        .find(|c: char| !(c.is_ascii_digit() || c == '.'))
        .unwrap_or(text.len());
    let (number, unit) = text.split_at(number_end);
    if number.is_empty() {
        return Err(SizeError::Malformed);
    }
    let unit_bytes = unit_bytes(unit.trim_start())
        .ok_or_else(|| SizeError::UnknownUnit(unit.trim_start().to_owned()))?;
    let (whole, fraction) = number.split_once('.').unwrap_or((number, ""));
    let fraction = fraction.trim_end_matches('0');
    if whole.is_empty()
        || number.ends_with('.')
        || fraction.contains('.')
        || fraction.len() > FRACTION_DIGITS_MAX as usize
    {
        return Err(SizeError::Malformed);
    }
    // Both parts are ASCII digits by now, so parsing fails only on overflow.
    let whole: u128 = whole.parse().map_err(|_| SizeError::TooLarge)?;
    let mut bytes = whole * u128::from(unit_bytes);
    if !fraction.is_empty() {
        let fraction_digits: u128 = fraction.parse().map_err(|_| SizeError::Malformed)?;
        let scale = 10u128.pow(u32::try_from(fraction.len()).map_err(|_| SizeError::Malformed)?);
        let scaled = fraction_digits * u128::from(unit_bytes);
        if scaled % scale != 0 {
            return Err(SizeError::NotWholeBytes);
        }
        bytes += scaled / scale;
    }
    u64::try_from(bytes).map_err(|_| SizeError::TooLarge)
}

fn unit_bytes(unit: &str) -> Option<u64> {
    let bytes = match unit.to_ascii_lowercase().as_str() {
        "" | "b" => 1,
        "k" | "kib" => KIB,
        "m" | "mib" => MIB,
        "g" | "gib" => GIB,
        "t" | "tib" => TIB,
        "kb" => 1_000,
        "mb" => 1_000_000,
        "gb" => 1_000_000_000,
        "tb" => 1_000_000_000_000,
        _ => return None,
    };
    Some(bytes)
}

/// `bytes` as a whole number of the largest binary unit that divides it, e.g. `2 MiB`.
fn whole_binary_units(bytes: u64) -> Option<String> {
    [(TIB, "TiB"), (GIB, "GiB"), (MIB, "MiB"), (KIB, "KiB")]
        .into_iter()
        .find(|&(unit, _)| bytes >= unit && bytes % unit == 0)
        .map(|(unit, name)| format!("{} {name}", bytes / unit))
}

/// A size as it would be written in TOML: `"2 MiB"` when exact, else the integer.
fn show_size(bytes: u64) -> String {
    whole_binary_units(bytes).map_or_else(|| bytes.to_string(), |text| format!("\"{text}\""))
}

fn show_path(path: &Path) -> String {
    Value::String(path.display().to_string()).to_string()
}

#[allow(clippy::trivially_copy_pass_by_ref)] // serde's `serialize_with` passes a reference
fn serialize_size<S: Serializer>(bytes: &u64, serializer: S) -> Result<S::Ok, S::Error> {
    match whole_binary_units(*bytes) {
        Some(text) => serializer.serialize_str(&text),
        // TOML integers are i64; larger sizes go out as digit strings, which parse back.
        None if i64::try_from(*bytes).is_err() => serializer.serialize_str(&bytes.to_string()),
        None => serializer.serialize_u64(*bytes),
    }
}

#[allow(clippy::ref_option)] // serde's `serialize_with` passes a reference
fn serialize_size_opt<S: Serializer>(
    bytes: &Option<u64>,
    serializer: S,
) -> Result<S::Ok, S::Error> {
    match bytes {
        Some(bytes) => serialize_size(bytes, serializer),
        None => serializer.serialize_none(),
    }
}

// ---------------------------------------------------------------------------------------------
// Raw stage: the same keys as the typed structs, each leaf kept as the TOML value written, so
// that conversion can name the field and show the value whatever is wrong with it.

#[derive(Deserialize)]
#[serde(deny_unknown_fields, expecting = "a kvtier config table")]
struct RawConfig {
    block_size: Option<Value>,
    cores: Option<Value>,
    hugepages: Option<Value>,
    region_blocks: Option<Value>,
    direct_io: Option<Value>,
    ring_entries: Option<Value>,
    sqpoll: Option<Value>,
    sqpoll_idle_ms: Option<Value>,
    iopoll: Option<Value>,
    queue_blocks_max: Option<Value>,
    jobs_in_flight_max: Option<Value>,
    scheduler: Option<RawScheduler>,
    events: Option<RawEvents>,
    devices: Option<Vec<RawDevice>>,
    files: Option<RawFiles>,
    s3: Option<RawS3>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields, expecting = "an [s3] table")]
struct RawS3 {
    bucket: Option<Value>,
    endpoint: Option<Value>,
    region: Option<Value>,
    force_path_style: Option<Value>,
    access_key_id: Option<Value>,
    secret_access_key: Option<Value>,
    session_token: Option<Value>,
    prefix: Option<Value>,
    max_concurrency: Option<Value>,
    timeout_ms: Option<Value>,
    retries: Option<Value>,
    write: Option<Value>,
    write_ack: Option<Value>,
    promote_on_load: Option<Value>,
    lookup_cache_max: Option<Value>,
    lookup_ttl_ms: Option<Value>,
    upload_queue_blocks: Option<Value>,
    namespace: Option<Value>,
}

fn string_or(field: &str, value: Option<Value>, default: &str) -> Result<String, ConfigError> {
    match value {
        None => Ok(default.to_owned()),
        Some(Value::String(text)) => Ok(text),
        Some(other) => Err(invalid(field, other, "a string")),
    }
}

fn secret_opt(field: &str, value: Option<Value>) -> Result<Option<Secret>, ConfigError> {
    match value {
        None => Ok(None),
        Some(Value::String(text)) if !text.is_empty() => Ok(Some(Secret(text))),
        // Never echo what was written: it may be a credential in the wrong form.
        Some(_) => Err(invalid(field, "<redacted>", "a non-empty string")),
    }
}

/// Builds `[s3]` once the whole config is read: the namespace may come from `[files]`.
fn s3_from_raw(raw: RawS3, files: Option<&FilesConfig>) -> Result<S3Config, ConfigError> {
    let bucket = match raw.bucket {
        Some(Value::String(b)) if !b.is_empty() => b,
        Some(other) => return Err(invalid("s3.bucket", other, "a non-empty bucket name")),
        None => return Err(invalid("s3.bucket", "(missing)", "a non-empty bucket name")),
    };
    let endpoint = match raw.endpoint {
        None => None,
        Some(Value::String(e)) if e.starts_with("http://") || e.starts_with("https://") => {
            Some(e.trim_end_matches('/').to_owned())
        }
        Some(other) => {
            return Err(invalid(
                "s3.endpoint",
                other,
                "a URL such as \"http://127.0.0.1:9000\" or \"https://s3.example.com\"",
            ))
        }
    };
    let namespace = match raw.namespace {
        Some(value) => value.try_into().map_err(|e: toml::de::Error| {
            ConfigError::Parse(format!("in [s3.namespace]: {}", e.message()))
        })?,
        None => match files {
            Some(f) => f.namespace.clone(),
            None => {
                return Err(invalid(
                    "s3.namespace",
                    "(missing)",
                    "an [s3.namespace] table (or a [files.namespace] table) with model_name, \
                     dtype, tokens_per_hash, blocks_per_file and kv_cache_groups: object names \
                     follow vLLM's object-store tier",
                ))
            }
        },
    };
    let access_key_id = secret_opt("s3.access_key_id", raw.access_key_id)?;
    let secret_access_key = secret_opt("s3.secret_access_key", raw.secret_access_key)?;
    let session_token = secret_opt("s3.session_token", raw.session_token)?;
    if access_key_id.is_some() != secret_access_key.is_some() {
        let (field, missing) = if access_key_id.is_some() {
            ("s3.secret_access_key", "secret_access_key")
        } else {
            ("s3.access_key_id", "access_key_id")
        };
        return Err(invalid(
            field,
            "(missing)",
            format!("both access_key_id and secret_access_key, or neither (then the AWS default credential chain is used); {missing} is missing"),
        ));
    }
    if session_token.is_some() && access_key_id.is_none() {
        return Err(invalid(
            "s3.session_token",
            "<redacted>",
            "a session token only together with access_key_id and secret_access_key",
        ));
    }
    let prefix = string_or("s3.prefix", raw.prefix, "")?;
    let write: S3Write = choice_or("s3.write", raw.write, S3Write::Off)?;
    Ok(S3Config {
        bucket,
        endpoint,
        region: string_or("s3.region", raw.region, "us-east-1")?,
        force_path_style: bool_or("s3.force_path_style", raw.force_path_style, false)?,
        access_key_id,
        secret_access_key,
        session_token,
        prefix,
        max_concurrency: int_or(
            "s3.max_concurrency",
            raw.max_concurrency,
            32,
            "an integer from 1 to 1024",
        )?,
        timeout_ms: int_or(
            "s3.timeout_ms",
            raw.timeout_ms,
            5000,
            "an integer number of milliseconds from 1 to 3600000",
        )?,
        retries: int_or("s3.retries", raw.retries, 3, "an integer from 0 to 20")?,
        write,
        write_ack: choice_or("s3.write_ack", raw.write_ack, WriteAck::Both)?,
        promote_on_load: bool_or("s3.promote_on_load", raw.promote_on_load, true)?,
        lookup_cache_max: int_or(
            "s3.lookup_cache_max",
            raw.lookup_cache_max,
            65536,
            AT_LEAST_ONE,
        )?,
        lookup_ttl_ms: int_or(
            "s3.lookup_ttl_ms",
            raw.lookup_ttl_ms,
            30_000,
            "an integer number of milliseconds",
        )?,
        upload_queue_blocks: int_or(
            "s3.upload_queue_blocks",
            raw.upload_queue_blocks,
            64,
            AT_LEAST_ONE,
        )?,
        namespace,
    })
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields, expecting = "a [files] table")]
struct RawFiles {
    namespace: Option<Value>,
    sync: Option<Value>,
    temp_grace_secs: Option<Value>,
    checksums: Option<Value>,
}

impl TryFrom<RawFiles> for FilesConfig {
    type Error = ConfigError;

    fn try_from(raw: RawFiles) -> Result<Self, ConfigError> {
        let namespace = match raw.namespace {
            Some(value) => value.try_into().map_err(|e: toml::de::Error| {
                ConfigError::Parse(format!("in [files.namespace]: {}", e.message()))
            })?,
            None => {
                return Err(invalid(
                    "files.namespace",
                    "(missing)",
                    "a [files.namespace] table with model_name, dtype, tokens_per_hash, \
                     blocks_per_file and [[files.namespace.kv_cache_groups]]",
                ))
            }
        };
        Ok(FilesConfig {
            namespace,
            sync: choice_or("files.sync", raw.sync, SyncMode::None)?,
            temp_grace_secs: int_or(
                "files.temp_grace_secs",
                raw.temp_grace_secs,
                600,
                "an integer number of seconds",
            )?,
            checksums: bool_or("files.checksums", raw.checksums, true)?,
        })
    }
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields, expecting = "a [scheduler] table")]
struct RawScheduler {
    load_inflight_max: Option<Value>,
    store_inflight_max: Option<Value>,
    store_inflight_max_while_loading: Option<Value>,
    store_chunk_bytes: Option<Value>,
    ioprio: Option<Value>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields, expecting = "an [events] table")]
struct RawEvents {
    enabled: Option<Value>,
    max: Option<Value>,
    locality: Option<Value>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields, expecting = "a [[devices]] table")]
struct RawDevice {
    path: Option<Value>,
    layout: Option<Value>,
    capacity_bytes: Option<Value>,
    overwrite: Option<Value>,
}

impl TryFrom<RawConfig> for Config {
    type Error = ConfigError;

    fn try_from(raw: RawConfig) -> Result<Self, ConfigError> {
        let d = Config::default();
        Config {
            block_size: size_or("block_size", raw.block_size, d.block_size)?,
            cores: raw
                .cores
                .map_or(Ok(d.cores), |value| cores_from_value("cores", &value))?,
            hugepages: choice_or("hugepages", raw.hugepages, d.hugepages)?,
            region_blocks: int_or(
                "region_blocks",
                raw.region_blocks,
                d.region_blocks,
                AT_LEAST_ONE,
            )?,
            direct_io: choice_or("direct_io", raw.direct_io, d.direct_io)?,
            ring_entries: int_or(
                "ring_entries",
                raw.ring_entries,
                d.ring_entries,
                RING_ENTRIES_FORMS,
            )?,
            sqpoll: bool_or("sqpoll", raw.sqpoll, d.sqpoll)?,
            sqpoll_idle_ms: int_or(
                "sqpoll_idle_ms",
                raw.sqpoll_idle_ms,
                d.sqpoll_idle_ms,
                "an integer number of milliseconds from 0 to 4294967295",
            )?,
            iopoll: bool_or("iopoll", raw.iopoll, d.iopoll)?,
            queue_blocks_max: int_or(
                "queue_blocks_max",
                raw.queue_blocks_max,
                d.queue_blocks_max,
                AT_LEAST_ONE,
            )?,
            jobs_in_flight_max: int_or(
                "jobs_in_flight_max",
                raw.jobs_in_flight_max,
                d.jobs_in_flight_max,
                AT_LEAST_ONE,
            )?,
            scheduler: raw
                .scheduler
                .map_or(Ok(d.scheduler), SchedulerConfig::try_from)?,
            events: raw.events.map_or(Ok(d.events), EventsConfig::try_from)?,
            devices: raw
                .devices
                .unwrap_or_default()
                .into_iter()
                .enumerate()
                .map(|(index, device)| device_from_raw(&format!("devices[{index}]"), device))
                .collect::<Result<_, _>>()?,
            files: None,
            s3: None,
        }
        .with_sections(raw.files, raw.s3)
    }
}

impl Config {
    fn with_sections(
        mut self,
        files: Option<RawFiles>,
        s3: Option<RawS3>,
    ) -> Result<Config, ConfigError> {
        self.files = files.map(FilesConfig::try_from).transpose()?;
        self.s3 = s3
            .map(|raw| s3_from_raw(raw, self.files.as_ref()))
            .transpose()?;
        Ok(self)
    }
}

impl TryFrom<RawS3> for S3Config {
    type Error = ConfigError;

    fn try_from(raw: RawS3) -> Result<Self, ConfigError> {
        s3_from_raw(raw, None)
    }
}

impl TryFrom<RawScheduler> for SchedulerConfig {
    type Error = ConfigError;

    fn try_from(raw: RawScheduler) -> Result<Self, ConfigError> {
        let d = SchedulerConfig::default();
        Ok(SchedulerConfig {
            load_inflight_max: int_or(
                "scheduler.load_inflight_max",
                raw.load_inflight_max,
                d.load_inflight_max,
                "an integer from 1 to ring_entries",
            )?,
            store_inflight_max: size_or(
                "scheduler.store_inflight_max",
                raw.store_inflight_max,
                d.store_inflight_max,
            )?,
            store_inflight_max_while_loading: size_or(
                "scheduler.store_inflight_max_while_loading",
                raw.store_inflight_max_while_loading,
                d.store_inflight_max_while_loading,
            )?,
            store_chunk_bytes: size_or(
                "scheduler.store_chunk_bytes",
                raw.store_chunk_bytes,
                d.store_chunk_bytes,
            )?,
            ioprio: bool_or("scheduler.ioprio", raw.ioprio, d.ioprio)?,
        })
    }
}

impl TryFrom<RawEvents> for EventsConfig {
    type Error = ConfigError;

    fn try_from(raw: RawEvents) -> Result<Self, ConfigError> {
        let d = EventsConfig::default();
        Ok(EventsConfig {
            enabled: bool_or("events.enabled", raw.enabled, d.enabled)?,
            max: int_or("events.max", raw.max, d.max, AT_LEAST_ONE)?,
            locality: raw
                .locality
                .map(|value| choice_from_value("events.locality", &value))
                .transpose()?,
        })
    }
}

impl TryFrom<RawDevice> for DeviceConfig {
    type Error = ConfigError;

    /// Used when a device table is deserialized on its own; inside a config the field names
    /// carry the entry's index instead.
    fn try_from(raw: RawDevice) -> Result<Self, ConfigError> {
        device_from_raw("device", raw)
    }
}

fn device_from_raw(prefix: &str, raw: RawDevice) -> Result<DeviceConfig, ConfigError> {
    let path_field = format!("{prefix}.path");
    let path = match raw.path {
        Some(Value::String(path)) => PathBuf::from(path),
        Some(other) => return Err(invalid(path_field, other, PATH_FORMS)),
        None => return Err(invalid(path_field, "(missing)", PATH_FORMS)),
    };
    Ok(DeviceConfig {
        path,
        layout: choice_or(&format!("{prefix}.layout"), raw.layout, Layout::Slab)?,
        capacity_bytes: raw
            .capacity_bytes
            .map(|value| size_from_value(&format!("{prefix}.capacity_bytes"), &value))
            .transpose()?,
        overwrite: bool_or(&format!("{prefix}.overwrite"), raw.overwrite, false)?,
    })
}

fn size_or(field: &str, value: Option<Value>, default: u64) -> Result<u64, ConfigError> {
    value.map_or(Ok(default), |value| size_from_value(field, &value))
}

fn size_from_value(field: &str, value: &Value) -> Result<u64, ConfigError> {
    let bytes = match value {
        Value::Integer(n) => u64::try_from(*n).map_err(|_| "negative".to_owned()),
        Value::String(text) => parse_size(text).map_err(|err| err.to_string()),
        _ => Err(format!("a {}", value.type_str())),
    };
    bytes.map_err(|reason| invalid(field, value, format!("a size ({reason}): {SIZE_FORMS}")))
}

fn int_or<T: TryFrom<i64>>(
    field: &str,
    value: Option<Value>,
    default: T,
    expected: &str,
) -> Result<T, ConfigError> {
    let Some(value) = value else {
        return Ok(default);
    };
    if let Value::Integer(n) = value {
        if let Ok(n) = T::try_from(n) {
            return Ok(n);
        }
    }
    Err(invalid(field, value, expected))
}

fn bool_or(field: &str, value: Option<Value>, default: bool) -> Result<bool, ConfigError> {
    match value {
        None => Ok(default),
        Some(Value::Boolean(flag)) => Ok(flag),
        Some(other) => Err(invalid(field, other, BOOL_FORMS)),
    }
}

fn choice_or<T: Named>(field: &str, value: Option<Value>, default: T) -> Result<T, ConfigError> {
    value.map_or(Ok(default), |value| choice_from_value(field, &value))
}

fn choice_from_value<T: Named>(field: &str, value: &Value) -> Result<T, ConfigError> {
    if let Value::String(text) = value {
        if let Some(&choice) = T::ALL.iter().find(|choice| choice.name() == text) {
            return Ok(choice);
        }
    }
    let names: Vec<String> = T::ALL
        .iter()
        .map(|choice| format!("\"{}\"", choice.name()))
        .collect();
    Err(invalid(
        field,
        value,
        format!("one of {}", names.join(", ")),
    ))
}

fn cores_from_value(field: &str, value: &Value) -> Result<Cores, ConfigError> {
    match value {
        Value::String(text) if text == "auto" => Ok(Cores::Auto),
        Value::Array(items) => items
            .iter()
            .enumerate()
            .map(|(index, item)| {
                match item {
                    Value::Integer(n) => usize::try_from(*n).ok(),
                    _ => None,
                }
                .ok_or_else(|| invalid(format!("{field}[{index}]"), item, CPU_FORMS))
            })
            .collect::<Result<_, _>>()
            .map(Cores::List),
        other => Err(invalid(field, other, CORES_FORMS)),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const ONE_DEVICE: &str = "[[devices]]\npath = \"/dev/nvme0n1\"\n";

    /// Parses `text` followed by one valid device and returns the error text; panics if it
    /// parsed.
    fn error_with_device(text: &str) -> String {
        error_of(&format!("{text}\n{ONE_DEVICE}"))
    }

    fn error_of(text: &str) -> String {
        match Config::from_toml_str(text) {
            Ok(config) => panic!("expected an error, parsed {config:?}"),
            Err(err) => err.to_string(),
        }
    }

    fn assert_mentions(message: &str, parts: &[&str]) {
        for part in parts {
            assert!(message.contains(part), "`{part}` missing from: {message}");
        }
    }

    // The documented defaults, both for `Config::default` and for a file that sets nothing but
    // a device; a changed default would silently change every deployment's behaviour.
    #[test]
    fn defaults() {
        let d = Config::default();
        assert_eq!(d.block_size, 2 * MIB);
        assert_eq!(d.cores, Cores::Auto);
        assert_eq!(d.hugepages, HugePages::Auto);
        assert_eq!(d.region_blocks, 256);
        assert_eq!(d.direct_io, DirectIo::Auto);
        assert_eq!(d.ring_entries, 256);
        assert!(!d.sqpoll);
        assert_eq!(d.sqpoll_idle_ms, 1000);
        assert!(!d.iopoll);
        assert_eq!(d.queue_blocks_max, 65536);
        assert_eq!(d.jobs_in_flight_max, 8192);
        assert_eq!(d.scheduler.load_inflight_max, 64);
        assert_eq!(d.scheduler.store_inflight_max, 64 * MIB);
        assert_eq!(d.scheduler.store_inflight_max_while_loading, 512 * KIB);
        assert_eq!(d.scheduler.store_chunk_bytes, 512 * KIB);
        assert!(d.scheduler.ioprio);
        assert!(!d.events.enabled);
        assert_eq!(d.events.max, 65536);
        assert_eq!(d.events.locality, None);
        assert!(d.devices.is_empty());

        let parsed = Config::from_toml_str(ONE_DEVICE).expect("minimal config");
        let expected = Config {
            devices: vec![DeviceConfig::new("/dev/nvme0n1")],
            ..Config::default()
        };
        assert_eq!(parsed, expected);
        assert_eq!(parsed.devices[0].layout, Layout::Slab);
        assert_eq!(parsed.devices[0].capacity_bytes, None);
        assert!(!parsed.devices[0].overwrite);
    }

    // Every accepted size spelling, including fractions and decimal units; a regression here
    // would misread the capacity or block size an operator wrote.
    #[test]
    fn sizes_parse() {
        let good: &[(&str, u64)] = &[
            ("4096", 4096),
            ("0", 0),
            ("2 MiB", 2 * MIB),
            ("512KiB", 512 * KIB),
            ("1 GiB", GIB),
            ("1.5 GiB", 3 * GIB / 2),
            ("0.5 KiB", 512),
            ("1.50 MiB", 3 * MIB / 2),
            ("2 mib", 2 * MIB),
            ("2 MIB", 2 * MIB),
            ("4K", 4 * KIB),
            ("3 m", 3 * MIB),
            ("1 G", GIB),
            ("2T", 2 * TIB),
            ("1 TiB", TIB),
            ("1 KB", 1000),
            ("1.5 kb", 1500),
            ("2 MB", 2_000_000),
            ("1GB", 1_000_000_000),
            ("1 TB", 1_000_000_000_000),
            ("100 B", 100),
            ("100b", 100),
            ("  7   MiB  ", 7 * MIB),
            ("18446744073709551615", u64::MAX),
        ];
        for &(text, bytes) in good {
            assert_eq!(parse_size(text), Ok(bytes), "{text:?}");
        }
        let bad: &[(&str, SizeError)] = &[
            ("", SizeError::Malformed),
            ("GiB", SizeError::Malformed),
            (".5 GiB", SizeError::Malformed),
            ("1. GiB", SizeError::Malformed),
            ("1.2.3 MiB", SizeError::Malformed),
            ("1.5", SizeError::NotWholeBytes),
            ("0.3 KiB", SizeError::NotWholeBytes),
            ("2 XB", SizeError::UnknownUnit("XB".into())),
            ("-1 MiB", SizeError::Malformed),
            ("1e3", SizeError::UnknownUnit("e3".into())),
            ("2 Mi B", SizeError::UnknownUnit("Mi B".into())),
            ("16 EiB", SizeError::UnknownUnit("EiB".into())),
            ("18446744073709551616", SizeError::TooLarge),
            ("16777216 TiB", SizeError::TooLarge),
            (
                "99999999999999999999999999999999999999999 B",
                SizeError::TooLarge,
            ),
        ];
        for (text, err) in bad {
            assert_eq!(parse_size(text).as_ref(), Err(err), "{text:?}");
        }
    }

    // Sizes inside a config: integer and string forms are read, and a bad one names its dotted
    // field (with the device index) and shows the accepted spellings.
    #[test]
    fn sizes_in_config() {
        let config = Config::from_toml_str(
            "block_size = 8192\n[scheduler]\nstore_chunk_bytes = \"64KiB\"\n\
             [[devices]]\npath = \"/a\"\ncapacity_bytes = \"1.5 GiB\"\n",
        )
        .expect("valid sizes");
        assert_eq!(config.block_size, 8192);
        assert_eq!(config.scheduler.store_chunk_bytes, 64 * KIB);
        assert_eq!(config.devices[0].capacity_bytes, Some(3 * GIB / 2));

        let message = error_with_device("block_size = \"2 XB\"");
        assert_mentions(
            &message,
            &["`block_size`", "\"2 XB\"", "unknown unit `XB`", "512 KiB"],
        );
        let message = error_with_device("[scheduler]\nstore_chunk_bytes = \"lots\"");
        assert_mentions(
            &message,
            &["`scheduler.store_chunk_bytes`", "\"lots\"", "1.5 GiB"],
        );
        let message = error_with_device("block_size = 1.5");
        assert_mentions(&message, &["`block_size`", "1.5", "a float", "\"2 MiB\""]);
        let message = error_with_device("block_size = -4096");
        assert_mentions(&message, &["`block_size`", "-4096", "negative"]);
        let message = error_of(&format!(
            "{ONE_DEVICE}[[devices]]\npath = \"/b\"\ncapacity_bytes = \"3.3 B\"\n"
        ));
        assert_mentions(
            &message,
            &[
                "`devices[1].capacity_bytes`",
                "\"3.3 B\"",
                "whole number of bytes",
            ],
        );
        let message = error_of(&format!(
            "{ONE_DEVICE}[[devices]]\npath = \"/b\"\ncapacity_bytes = \"1 MiB\"\n"
        ));
        assert_mentions(
            &message,
            &["`devices[1].capacity_bytes`", "\"1 MiB\"", "16 MiB"],
        );
    }

    // Misspelt keys at each level must be refused, naming the key and its line, so a typo
    // never falls back to a default unnoticed.
    #[test]
    fn unknown_keys() {
        let message = error_with_device("block_sise = \"2 MiB\"");
        assert_mentions(&message, &["block_sise", "line 1", "block_size"]);
        let message = error_with_device("[scheduler]\nioprio = true\nload_inflight = 3");
        assert_mentions(&message, &["load_inflight", "line 3", "load_inflight_max"]);
        let message = error_of("[[devices]]\npath = \"/a\"\ncapacity = \"1 GiB\"\n");
        assert_mentions(&message, &["capacity", "line 3", "capacity_bytes"]);
        let message = error_with_device("[events]\nlimit = 5");
        assert_mentions(&message, &["limit", "line 2"]);
    }

    // A bad enum value names the field, shows the value and lists every accepted spelling.
    #[test]
    fn bad_enum_value() {
        let message = error_with_device("hugepages = \"sometimes\"");
        assert_mentions(
            &message,
            &[
                "`hugepages`",
                "\"sometimes\"",
                "\"required\"",
                "\"auto\"",
                "\"off\"",
            ],
        );
        let message = error_with_device("direct_io = true");
        assert_mentions(&message, &["`direct_io`", "true", "\"required\""]);
        let message = error_of("[[devices]]\npath = \"/a\"\nlayout = \"log\"\n");
        assert_mentions(
            &message,
            &["`devices[0].layout`", "\"log\"", "\"slab\"", "\"files\""],
        );
        let config = Config::from_toml_str(
            "[[devices]]\npath = \"/a\"\nlayout = \"files\"\n[files.namespace]\nmodel_name = \"m\"\n\
             dtype = \"float16\"\ntokens_per_hash = 16\nblocks_per_file = 1\nkv_cache_groups = []\n",
        )
        .expect("files layout is accepted");
        assert_eq!(config.devices[0].layout, Layout::Files);
    }

    // Blocks are read with O_DIRECT, so their size must be a multiple of 4 KiB within bounds.
    #[test]
    fn block_size_alignment() {
        let message = error_with_device("block_size = 6000");
        assert_mentions(&message, &["`block_size`", "= 6000", "multiple of 4096"]);
        let message = error_with_device("block_size = \"2 GiB\"");
        assert_mentions(&message, &["`block_size`", "\"2 GiB\"", "1 GiB"]);
        let message = error_with_device("block_size = \"1 KiB\"");
        assert_mentions(&message, &["`block_size`", "\"1 KiB\""]);
    }

    // The ring size must be a power of two the kernel accepts.
    #[test]
    fn ring_entries_power_of_two() {
        let message = error_with_device("ring_entries = 100");
        assert_mentions(&message, &["`ring_entries`", "= 100", "power of two"]);
        let message = error_with_device("ring_entries = 65536");
        assert_mentions(&message, &["`ring_entries`", "65536", "32768"]);
        let message = error_with_device("ring_entries = 4");
        assert_mentions(&message, &["`ring_entries`", "= 4"]);
        let message = error_with_device("ring_entries = 5000000000");
        assert_mentions(&message, &["`ring_entries`", "5000000000", "power of two"]);
        let message = error_with_device("ring_entries = 64\n[scheduler]\nload_inflight_max = 65");
        assert_mentions(
            &message,
            &["`scheduler.load_inflight_max`", "= 65", "ring_entries (64)"],
        );
    }

    // Worker placement: an empty list would start no worker and a duplicate would pin two
    // workers to one CPU, so both are refused; "auto" and a plain list are read.
    #[test]
    fn cores_list() {
        let message = error_with_device("cores = []");
        assert_mentions(&message, &["`cores`", "= []", "non-empty"]);
        let message = error_with_device("cores = [0, 1, 0]");
        assert_mentions(
            &message,
            &["`cores`", "[0, 1, 0]", "0 is listed more than once"],
        );
        let message = error_with_device("cores = [0, 2000]");
        assert_mentions(&message, &["`cores[1]`", "2000", "1023"]);
        let message = error_with_device("cores = [0, -1]");
        assert_mentions(&message, &["`cores[1]`", "-1"]);
        let message = error_with_device("cores = \"all\"");
        assert_mentions(&message, &["`cores`", "\"all\"", "\"auto\""]);
        let config = Config::from_toml_str(&format!("cores = [3, 1]\n{ONE_DEVICE}")).expect("list");
        assert_eq!(config.cores, Cores::List(vec![3, 1]));
        let config =
            Config::from_toml_str(&format!("cores = \"auto\"\n{ONE_DEVICE}")).expect("auto");
        assert_eq!(config.cores, Cores::Auto);
    }

    // The stores' budget while loading is a share of the full budget, and both must hold at
    // least one chunk, or stores could never be issued.
    #[test]
    fn scheduler_store_budgets() {
        let message = error_with_device(
            "[scheduler]\nstore_inflight_max = \"4 MiB\"\n\
             store_inflight_max_while_loading = \"8 MiB\"",
        );
        assert_mentions(
            &message,
            &[
                "`scheduler.store_inflight_max_while_loading`",
                "\"8 MiB\"",
                "\"4 MiB\"",
            ],
        );
        let message = error_with_device("[scheduler]\nstore_inflight_max = \"256 KiB\"");
        assert_mentions(
            &message,
            &[
                "`scheduler.store_inflight_max`",
                "\"256 KiB\"",
                "\"512 KiB\"",
            ],
        );
        let message = error_with_device("[scheduler]\nstore_chunk_bytes = 1000");
        assert_mentions(
            &message,
            &[
                "`scheduler.store_chunk_bytes`",
                "= 1000",
                "multiple of 4096",
            ],
        );
    }

    // A config without devices has nowhere to put blocks.
    #[test]
    fn missing_devices() {
        let message = error_of("block_size = \"2 MiB\"\n");
        assert_mentions(
            &message,
            &["`devices`", "[]", "at least one [[devices]] entry"],
        );
        let message = error_of("[[devices]]\nlayout = \"slab\"\n");
        assert_mentions(&message, &["`devices[0].path`", "(missing)"]);
    }

    // Two entries with one path would format the same file twice.
    #[test]
    fn duplicate_device_paths() {
        let message = error_of(&format!(
            "{ONE_DEVICE}[[devices]]\npath = \"/x\"\n{ONE_DEVICE}"
        ));
        assert_mentions(
            &message,
            &["`devices[2].path`", "\"/dev/nvme0n1\"", "devices[0]"],
        );
    }

    // Locality is spelt as vLLM spells it; lower case must not be accepted.
    #[test]
    fn locality_is_upper_case() {
        let message = error_with_device("[events]\nlocality = \"local\"");
        assert_mentions(
            &message,
            &["`events.locality`", "\"local\"", "\"LOCAL\"", "\"REMOTE\""],
        );
        let config =
            Config::from_toml_str(&format!("[events]\nlocality = \"REMOTE\"\n{ONE_DEVICE}"))
                .expect("upper case locality");
        assert_eq!(config.events.locality, Some(Locality::Remote));
    }

    // Wrongly typed scalars name their field: a quoted boolean or a negative count.
    #[test]
    fn wrong_types() {
        let message = error_with_device("sqpoll = \"yes\"");
        assert_mentions(&message, &["`sqpoll`", "\"yes\"", "true or false"]);
        let message = error_with_device("[scheduler]\nioprio = 1");
        assert_mentions(&message, &["`scheduler.ioprio`", "= 1"]);
        let message = error_with_device("queue_blocks_max = -1");
        assert_mentions(&message, &["`queue_blocks_max`", "-1", "at least 1"]);
        let message = error_with_device("jobs_in_flight_max = 0");
        assert_mentions(&message, &["`jobs_in_flight_max`", "= 0"]);
        let message = error_with_device("[events]\nmax = 0");
        assert_mentions(&message, &["`events.max`", "= 0"]);
        let message = error_with_device("region_blocks = 0");
        assert_mentions(&message, &["`region_blocks`", "= 0"]);
        let message = error_with_device("scheduler = 3");
        assert_mentions(&message, &["scheduler", "[scheduler] table"]);
    }

    // The shipped example must stay loadable and keep the values it documents.
    #[test]
    fn example_file_parses() {
        let text = include_str!("../kvtier.example.toml");
        let config = Config::from_toml_str(text).expect("example config");
        assert_eq!(config.block_size, 2 * MIB);
        assert_eq!(config.cores, Cores::Auto);
        assert_eq!(config.ring_entries, 256);
        assert_eq!(config.scheduler.store_inflight_max, 64 * MIB);
        assert_eq!(config.scheduler.store_chunk_bytes, 512 * KIB);
        assert!(config.scheduler.ioprio);
        assert!(!config.events.enabled);
        assert_eq!(config.devices.len(), 1);
        assert_eq!(config.devices[0].path, Path::new("/var/lib/kvtier/slab0"));
        assert_eq!(config.devices[0].layout, Layout::Slab);
        assert_eq!(config.devices[0].capacity_bytes, Some(64 * GIB));
        assert!(!config.devices[0].overwrite);
        // Every key the engine knows is documented, set or commented out.
        let mut full = Config::bench_default(Path::new("/tmp"));
        full.events.locality = Some(Locality::Local);
        for line in full.to_toml_string().lines() {
            if let Some((key, _)) = line.split_once(" = ") {
                let documented = text.lines().any(|l| {
                    l.trim_start_matches(['#', ' '])
                        .starts_with(&format!("{key} ="))
                });
                assert!(documented, "key `{key}` missing from kvtier.example.toml");
            }
        }
    }

    // Printing the effective config and reading it back, through `from_toml_str` and through
    // serde directly, must give the same config; otherwise the printout would lie.
    #[test]
    fn toml_round_trip() {
        let mut config = Config::bench_default(Path::new("/srv/kv"));
        config.cores = Cores::List(vec![2, 3]);
        config.hugepages = HugePages::Required;
        config.block_size = 3 * 4096;
        config.scheduler.store_inflight_max = 5 * MIB / 2;
        config.events.locality = Some(Locality::Local);
        config.devices.push(DeviceConfig {
            path: "/dev/nvme1n1".into(),
            layout: Layout::Slab,
            capacity_bytes: Some(20_000_000),
            overwrite: true,
        });
        config.files = Some(FilesConfig {
            namespace: crate::files::mapper::Namespace::new("org/m", "bfloat16", 16, 2),
            sync: SyncMode::Data,
            temp_grace_secs: 60,
            checksums: false,
        });
        config.validate().expect("valid");
        let text = config.to_toml_string();
        assert!(text.contains("block_size = \"12 KiB\""), "{text}");
        assert!(text.contains("capacity_bytes = \"1 GiB\""), "{text}");
        assert!(text.contains("store_inflight_max = \"2560 KiB\""), "{text}");
        assert!(text.contains("capacity_bytes = 20000000"), "{text}");
        assert!(text.contains("locality = \"LOCAL\""), "{text}");
        assert_eq!(
            Config::from_toml_str(&text).expect("printed config"),
            config
        );
        assert_eq!(toml::from_str::<Config>(&text).expect("serde path"), config);
    }

    // The bench default is valid as is and puts its slab in the given directory.
    #[test]
    fn bench_default_is_valid() {
        let config = Config::bench_default(Path::new("/tmp/bench"));
        config.validate().expect("bench default validates");
        assert_eq!(config.devices.len(), 1);
        assert_eq!(
            config.devices[0].path,
            Path::new("/tmp/bench/kvtier-bench.slab")
        );
        assert_eq!(config.devices[0].capacity_bytes, Some(GIB));
        assert_eq!(config.devices[0].layout, Layout::Slab);
    }

    // A missing file is reported with its path.
    #[test]
    fn from_file_names_path() {
        let path = Path::new("/nonexistent/kvtier-config-test.toml");
        let err = Config::from_file(path).expect_err("no such file");
        assert!(matches!(err, ConfigError::Io { .. }));
        assert_mentions(&err.to_string(), &["/nonexistent/kvtier-config-test.toml"]);
    }

    // The names used in error messages must be exactly those serde reads and writes.
    #[test]
    fn enum_names_match_serde() {
        fn check<T: Named + Serialize + fmt::Debug + fmt::Display>() {
            for &choice in T::ALL {
                let value = Value::try_from(choice).expect("enum serializes");
                assert_eq!(value.as_str(), Some(choice.name()), "{choice:?}");
                assert_eq!(choice.to_string(), choice.name());
            }
        }
        check::<HugePages>();
        check::<DirectIo>();
        check::<Layout>();
        check::<Locality>();
    }

    const S3_NS: &str = "[s3.namespace]\nmodel_name = \"m\"\ndtype = \"bfloat16\"\n\
                         tokens_per_hash = 16\nblocks_per_file = 1\n\
                         kv_cache_groups = [{ tokens_per_block = 16, layer_names = [\"l\"] }]\n";

    fn with_s3(lines: &str) -> Result<Config, ConfigError> {
        Config::from_toml_str(&format!("{ONE_DEVICE}[s3]\n{lines}\n{S3_NS}"))
    }

    #[test]
    fn s3_defaults_and_values() {
        let c = with_s3("bucket = \"kv-cache\"").expect("minimal [s3]");
        let s3 = c.s3.expect("s3 section");
        assert_eq!(s3.bucket, "kv-cache");
        assert_eq!(s3.endpoint, None);
        assert_eq!(s3.region, "us-east-1");
        assert!(!s3.force_path_style);
        assert_eq!(
            (s3.max_concurrency, s3.timeout_ms, s3.retries),
            (32, 5000, 3)
        );
        assert_eq!((s3.write, s3.write_ack), (S3Write::Off, WriteAck::Both));
        assert!(s3.promote_on_load);
        assert_eq!(s3.prefix, "");
        assert_eq!(s3.namespace.model_name, "m");
        let c = with_s3(
            "bucket = \"b-1\"\nendpoint = \"http://127.0.0.1:9000/\"\nwrite = \"on_evict\"\n\
             write_ack = \"nvme\"\nprefix = \"kv/\"\nretries = 0",
        )
        .expect("[s3] with values");
        let s3 = c.s3.expect("s3");
        assert_eq!(s3.endpoint.as_deref(), Some("http://127.0.0.1:9000"));
        assert_eq!((s3.write, s3.write_ack), (S3Write::OnEvict, WriteAck::Nvme));
        assert_eq!((s3.prefix.as_str(), s3.retries), ("kv/", 0));
        // The namespace falls back to [files.namespace].
        let text = format!(
            "{ONE_DEVICE}[s3]\nbucket = \"b-1\"\n[files.namespace]\nmodel_name = \"f\"\n\
             dtype = \"x\"\ntokens_per_hash = 16\nblocks_per_file = 1\nkv_cache_groups = []\n"
        );
        let c = Config::from_toml_str(&text).expect("namespace from [files]");
        assert_eq!(c.s3.expect("s3").namespace.model_name, "f");
    }

    #[test]
    fn s3_errors_name_field_value_and_accepted() {
        let e = |lines: &str| with_s3(lines).expect_err("invalid [s3]").to_string();
        assert_mentions(&e("region = \"x\""), &["s3.bucket", "(missing)"]);
        assert_mentions(
            &e("bucket = \"b\"\nwrite = \"sometimes\""),
            &[
                "s3.write",
                "sometimes",
                "\"through\"",
                "\"on_evict\"",
                "\"off\"",
            ],
        );
        assert_mentions(
            &e("bucket = \"b\"\nendpoint = \"127.0.0.1:9000\""),
            &["s3.endpoint", "127.0.0.1:9000", "http://"],
        );
        let message = e("bucket = \"b\"\naccess_key_id = \"AKIA-SECRET-ID\"");
        assert_mentions(
            &message,
            &["s3.secret_access_key", "default credential chain"],
        );
        assert_mentions(
            &e("bucket = \"b\"\nmax_concurrency = 0"),
            &["s3.max_concurrency", "1 to 1024"],
        );
        assert_mentions(&e("bucket = \"b\"\ntimeout_ms = 0"), &["s3.timeout_ms"]);
        assert_mentions(
            &e("bucket = \"b\"\nretries = 99"),
            &["s3.retries", "0 to 20"],
        );
        assert_mentions(
            &e("bucket = \"b\"\nbukket = 1"),
            &["unknown field", "bukket"],
        );
        // A credential in the wrong form is never echoed.
        let message = e("bucket = \"b\"\nsecret_access_key = 12345");
        assert_mentions(&message, &["s3.secret_access_key", "<redacted>"]);
        assert!(!message.contains("12345"), "{message}");
        // No namespace anywhere.
        let message = Config::from_toml_str(&format!("{ONE_DEVICE}[s3]\nbucket = \"b\"\n"))
            .expect_err("no namespace")
            .to_string();
        assert_mentions(&message, &["s3.namespace", "[files.namespace]"]);
    }

    #[test]
    fn the_example_s3_section_parses_when_uncommented() {
        let text = include_str!("../kvtier.example.toml");
        let start = text.find("# [s3]\n").expect("example has an [s3] section");
        let mut section = String::new();
        for line in text[start..]
            .lines()
            .map(|l| l.strip_prefix("# ").unwrap_or(l))
            .filter(|l| {
                l.starts_with('[')
                    || l.split_once(" = ").is_some_and(|(k, _)| {
                        !k.is_empty() && k.chars().all(|c| c.is_ascii_lowercase() || c == '_')
                    })
            })
        {
            section.push_str(line);
            section.push('\n');
        }
        let config = Config::from_toml_str(&format!("{ONE_DEVICE}{section}"))
            .expect("uncommented [s3] section");
        let s3 = config.s3.expect("s3");
        assert_eq!(s3.bucket, "kv-cache");
        assert_eq!(s3.endpoint.as_deref(), Some("http://127.0.0.1:9000"));
        assert_eq!(
            (s3.max_concurrency, s3.timeout_ms, s3.retries),
            (32, 5000, 3)
        );
        assert_eq!(s3.access_key_id.as_ref().map(Secret::expose), Some("..."));
        assert!(!format!("{s3:?}").contains("\"...\""));
    }
}
