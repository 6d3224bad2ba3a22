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
use std::path::PathBuf;

use serde::{Deserialize, Deserializer, Serialize, Serializer};
use toml::Value;

mod files;
mod namespace;
mod raw;
mod s3;
mod size;
#[cfg(test)]
mod tests;
mod validate;

pub use files::{FilesConfig, FirstLookup, SyncMode};
pub use namespace::{KvCacheGroup, Namespace};
use raw::{cores_from_value, RawConfig, RawDevice, RawEvents, RawMetrics, RawScheduler};
pub use s3::{S3Config, S3Write, Secret, WriteAck};
pub use size::{parse_size, SizeError};
use size::{serialize_size, serialize_size_opt, show_path, show_size};

const KIB: u64 = 1 << 10;
const MIB: u64 = 1 << 20;
const GIB: u64 = 1 << 30;
const TIB: u64 = 1 << 40;

/// Alignment of blocks and store chunks: the logical block size `O_DIRECT` needs on most drives.
const ALIGN_BYTES: u64 = 4096;
/// Upper bound on `block_size`: one block must stay a reasonable unit of I/O and of memory.
const BLOCK_SIZE_MAX: u64 = GIB;
/// Smallest device worth formatting: room for the header and a useful number of blocks.
pub(crate) const DEVICE_CAPACITY_MIN: u64 = 16 * MIB;
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

/// `verify_loads`: which slab loads check the block's crc32c against its slot-table entry
/// (the files layout checks every load that has a checksum xattr, per `[files] checksums`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Deserialize, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum VerifyLoads {
    /// A block recovered at open, on its first load; blocks this process stored (their crc32c
    /// computed from the bytes it wrote) and blocks already verified are trusted.
    #[default]
    Recovered,
    /// Every load: a bit that flips at rest or in transit after the block was written or first
    /// verified is caught too, for one crc32c pass over each loaded block on the worker's core.
    Always,
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

/// What a device path is used as (`[[devices]] kind`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Deserialize, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum DeviceKind {
    /// Judged from the path: NVMe passthrough for an NVMe generic device (`/dev/ngXnY`), the
    /// block layer for a block device, a slab file for a regular file.
    #[default]
    Auto,
    /// NVMe passthrough: the path is `/dev/ngXnY`, or `/dev/nvmeXnY`, whose generic device is
    /// used. Falls back to the block device, with a warning, where passthrough is unavailable.
    Nvme,
    /// Through the block layer even for `/dev/ngXnY` (its block device `/dev/nvmeXnY` is used).
    Block,
    /// The NVMe controller at `pci`, taken from the kernel through VFIO and driven from user
    /// space (the controller must be bound to `vfio-pci`; `kvtier probe` says how).
    Vfio,
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

impl Named for VerifyLoads {
    const ALL: &'static [Self] = &[Self::Recovered, Self::Always];
    fn name(self) -> &'static str {
        match self {
            Self::Recovered => "recovered",
            Self::Always => "always",
        }
    }
}

impl Named for DeviceKind {
    const ALL: &'static [Self] = &[Self::Auto, Self::Nvme, Self::Block, Self::Vfio];
    fn name(self) -> &'static str {
        match self {
            Self::Auto => "auto",
            Self::Nvme => "nvme",
            Self::Block => "block",
            Self::Vfio => "vfio",
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

impl Named for FirstLookup {
    const ALL: &'static [Self] = &[Self::Miss, Self::Pending];
    fn name(self) -> &'static str {
        match self {
            Self::Miss => "miss",
            Self::Pending => "pending",
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
display_by_name!(
    SyncMode,
    FirstLookup,
    HugePages,
    DirectIo,
    VerifyLoads,
    Layout,
    DeviceKind,
    Locality
);

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

impl Cores {
    /// One entry per worker the engine starts: the CPU it is pinned to (`None`: unpinned, the
    /// CPUs this process may use being unknown). `Auto` is one worker per CPU this process may
    /// use.
    pub fn workers(&self) -> Vec<Option<usize>> {
        match self {
            Cores::Auto => {
                let avail = kvtier_sys::affinity::available_cores();
                if avail.is_empty() {
                    vec![None]
                } else {
                    avail.into_iter().map(Some).collect()
                }
            }
            Cores::List(list) => list.iter().copied().map(Some).collect(),
        }
    }
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
    /// The deadline of every device I/O (a load's read, a store's writes, a files-layout
    /// block's whole chain of file operations), in milliseconds: past it the key fails with
    /// `KeyFailure::Timeout`, and shutdown gives up waiting for the device.
    pub io_timeout_ms: u32,
    /// Which slab loads check the block's crc32c.
    pub verify_loads: VerifyLoads,
    /// Per worker bound on queued blocks (loads and stores).
    pub queue_blocks_max: usize,
    pub jobs_in_flight_max: usize,
    pub scheduler: SchedulerConfig,
    pub events: EventsConfig,
    /// `[metrics]`: the Prometheus endpoint.
    pub metrics: MetricsConfig,
    pub devices: Vec<DeviceConfig>,
    /// `[files]`: required when a device uses `layout = "files"`.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub files: Option<FilesConfig>,
    /// `[s3]`: the object-store tier; absent means no S3 tier.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub s3: Option<S3Config>,
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

/// A [`Config`] that passed [`Config::validate`], with what is derived from it (once): what the
/// node, its workers and every front end run with. Only `validate` makes one, so nothing
/// below the front ends runs on a config that was not checked. Reads as the [`Config`] it
/// holds.
#[derive(Clone, Debug)]
pub struct Validated {
    config: Config,
    derived: Derived,
}

impl Validated {
    /// The sizes derived from the config.
    pub fn derived(&self) -> &Derived {
        &self.derived
    }
}

impl std::ops::Deref for Validated {
    type Target = Config;

    fn deref(&self) -> &Config {
        &self.config
    }
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
pub(crate) const DEMOTION_STAGING_BLOCKS: usize = 8;

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

/// `[metrics]`: where `GET /metrics` is served (Prometheus or OpenMetrics text, as the scraper
/// asks). Off by default.
#[derive(Clone, Debug, Default, PartialEq, Eq, Deserialize, Serialize)]
#[serde(try_from = "RawMetrics")]
pub struct MetricsConfig {
    /// An IP address and port (`"127.0.0.1:9464"`, `"[::1]:9464"`; port 0 picks a free one,
    /// see `Engine::metrics_addr`).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub listen: Option<std::net::SocketAddr>,
}

/// One `[[devices]]` entry.
#[derive(Clone, Debug, PartialEq, Eq, Deserialize, Serialize)]
#[serde(try_from = "RawDevice")]
pub struct DeviceConfig {
    pub path: PathBuf,
    pub layout: Layout,
    /// How the path is used (NVMe passthrough or the block layer); `auto` judges by the path.
    pub kind: DeviceKind,
    /// Needed to create a file that does not exist yet.
    #[serde(
        serialize_with = "serialize_size_opt",
        skip_serializing_if = "Option::is_none"
    )]
    pub capacity_bytes: Option<u64>,
    /// Allow formatting an existing non-empty file or device that has no kvtier header.
    pub overwrite: bool,
    /// `kind = "vfio"`: the controller's PCI address (`0000:01:00.0`); `path` is then
    /// `vfio:<pci>`, the name logs and metrics use.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub pci: Option<String>,
    /// `kind = "vfio"`: the namespace the slab lives on (default 1).
    #[serde(skip_serializing_if = "is_first_namespace")]
    pub nsid: u32,
}

#[allow(clippy::trivially_copy_pass_by_ref)] // serde's skip_serializing_if passes a reference
fn is_first_namespace(nsid: &u32) -> bool {
    *nsid == 1
}

impl DeviceConfig {
    /// A slab device at `path` with every other field at its default.
    pub fn new(path: impl Into<PathBuf>) -> DeviceConfig {
        DeviceConfig {
            path: path.into(),
            layout: Layout::Slab,
            kind: DeviceKind::Auto,
            capacity_bytes: None,
            overwrite: false,
            pci: None,
            nsid: 1,
        }
    }

    /// A slab device on namespace `nsid` of the NVMe controller at PCI address `pci`, driven
    /// through VFIO.
    pub fn vfio(pci: &str, nsid: u32) -> DeviceConfig {
        DeviceConfig {
            kind: DeviceKind::Vfio,
            pci: Some(pci.to_owned()),
            nsid,
            ..DeviceConfig::new(format!("vfio:{pci}"))
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
            io_timeout_ms: 10_000,
            verify_loads: VerifyLoads::Recovered,
            iopoll: false,
            queue_blocks_max: 65536,
            jobs_in_flight_max: 8192,
            scheduler: SchedulerConfig::default(),
            events: EventsConfig::default(),
            metrics: MetricsConfig::default(),
            devices: Vec::new(),
            files: None,
            s3: None,
        }
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
