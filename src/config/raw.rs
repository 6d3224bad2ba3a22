//! The raw stage: the same keys as the typed structs, each leaf kept as the TOML value
//! written, so that conversion can name the field and show the value whatever is wrong with it.

use std::path::PathBuf;

use serde::Deserialize;
use toml::Value;

use super::{
    invalid, parse_size, Config, ConfigError, Cores, DeviceConfig, DeviceKind, EventsConfig,
    FilesConfig, FirstLookup, Layout, MetricsConfig, Named, S3Config, S3Write, SchedulerConfig,
    Secret, SyncMode, WriteAck, AT_LEAST_ONE, BOOL_FORMS, CORES_FORMS, CPU_FORMS, PATH_FORMS,
    RING_ENTRIES_FORMS, SIZE_FORMS,
};

// Raw stage: the same keys as the typed structs, each leaf kept as the TOML value written, so
// that conversion can name the field and show the value whatever is wrong with it.

#[derive(Deserialize)]
#[serde(deny_unknown_fields, expecting = "a kvtier config table")]
pub(super) struct RawConfig {
    block_size: Option<Value>,
    cores: Option<Value>,
    hugepages: Option<Value>,
    region_blocks: Option<Value>,
    direct_io: Option<Value>,
    ring_entries: Option<Value>,
    sqpoll: Option<Value>,
    sqpoll_idle_ms: Option<Value>,
    io_timeout_ms: Option<Value>,
    verify_loads: Option<Value>,
    iopoll: Option<Value>,
    queue_blocks_max: Option<Value>,
    jobs_in_flight_max: Option<Value>,
    scheduler: Option<RawScheduler>,
    events: Option<RawEvents>,
    metrics: Option<RawMetrics>,
    devices: Option<Vec<RawDevice>>,
    files: Option<RawFiles>,
    s3: Option<RawS3>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields, expecting = "an [s3] table")]
pub(super) struct RawS3 {
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

pub(super) fn string_or(
    field: &str,
    value: Option<Value>,
    default: &str,
) -> Result<String, ConfigError> {
    match value {
        None => Ok(default.to_owned()),
        Some(Value::String(text)) => Ok(text),
        Some(other) => Err(invalid(field, other, "a string")),
    }
}

pub(super) fn secret_opt(field: &str, value: Option<Value>) -> Result<Option<Secret>, ConfigError> {
    match value {
        None => Ok(None),
        Some(Value::String(text)) if !text.is_empty() => Ok(Some(Secret(text))),
        // Never echo what was written: it may be a credential in the wrong form.
        Some(_) => Err(invalid(field, "<redacted>", "a non-empty string")),
    }
}

/// Builds `[s3]` once the whole config is read: the namespace may come from `[files]`.
#[allow(clippy::too_many_lines)] // one conversion per [s3] key, in the order the docs list them
pub(super) fn s3_from_raw(
    raw: RawS3,
    files: Option<&FilesConfig>,
) -> Result<S3Config, ConfigError> {
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

const IO_TIMEOUT_MIN_MS: u32 = 10;
const IO_TIMEOUT_MAX_MS: u32 = 3_600_000;
const IO_TIMEOUT_FORMS: &str =
    "an integer number of milliseconds from 10 to 3600000 (one hour), e.g. 10000";

#[derive(Deserialize)]
#[serde(deny_unknown_fields, expecting = "a [files] table")]
pub(super) struct RawFiles {
    namespace: Option<Value>,
    sync: Option<Value>,
    temp_grace_secs: Option<Value>,
    checksums: Option<Value>,
    file_mode: Option<Value>,
    dir_mode: Option<Value>,
    first_lookup: Option<Value>,
    lookup_cache_max: Option<Value>,
    lookup_ttl_ms: Option<Value>,
    io_wq_workers: Option<Value>,
    stores_opening: Option<Value>,
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
            file_mode: mode_or(
                "files.file_mode",
                raw.file_mode,
                FilesConfig::DEFAULT_FILE_MODE,
                0o600,
                "owner read and write (0600)",
            )?,
            dir_mode: mode_or(
                "files.dir_mode",
                raw.dir_mode,
                FilesConfig::DEFAULT_DIR_MODE,
                0o700,
                "owner read, write and search (0700)",
            )?,
            first_lookup: choice_or("files.first_lookup", raw.first_lookup, FirstLookup::Miss)?,
            lookup_cache_max: int_or(
                "files.lookup_cache_max",
                raw.lookup_cache_max,
                FilesConfig::DEFAULT_LOOKUP_CACHE_MAX,
                AT_LEAST_ONE,
            )?,
            lookup_ttl_ms: int_or(
                "files.lookup_ttl_ms",
                raw.lookup_ttl_ms,
                FilesConfig::DEFAULT_LOOKUP_TTL_MS,
                "an integer number of milliseconds",
            )?,
            io_wq_workers: int_or(
                "files.io_wq_workers",
                raw.io_wq_workers,
                FilesConfig::DEFAULT_IO_WQ_WORKERS,
                IO_WQ_WORKERS_FORMS,
            )?,
            stores_opening: int_or(
                "files.stores_opening",
                raw.stores_opening,
                FilesConfig::DEFAULT_STORES_OPENING,
                STORES_OPENING_FORMS,
            )?,
        })
    }
}

pub(super) const IO_WQ_WORKERS_FORMS: &str = "an integer from 1 to 1024";
pub(super) const STORES_OPENING_FORMS: &str = "an integer from 1 to 4096";

/// A permission mode: an octal TOML integer (`0o640`) or an octal string (`"0640"`,
/// `"0o640"`), at most 0777, including the bits `needs` (kvtier must use what it creates).
fn mode_or(
    field: &str,
    value: Option<Value>,
    default: u32,
    needs: u32,
    needs_text: &str,
) -> Result<u32, ConfigError> {
    let Some(value) = value else {
        return Ok(default);
    };
    let expected = format!(
        "permission bits in octal, at most 0777 and including {needs_text}: e.g. 0o640 \
         (a TOML octal integer) or \"0640\"; a decimal integer such as 640 is not octal"
    );
    let mode = match &value {
        Value::Integer(n) => u32::try_from(*n).ok(),
        Value::String(text) => {
            let digits = text.strip_prefix("0o").unwrap_or(text);
            (!digits.is_empty() && digits.len() <= 4)
                .then(|| u32::from_str_radix(digits, 8).ok())
                .flatten()
        }
        _ => None,
    };
    match mode {
        Some(mode) if mode <= 0o777 && mode & needs == needs => Ok(mode),
        _ => Err(invalid(field, value, expected)),
    }
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields, expecting = "a [scheduler] table")]
pub(super) struct RawScheduler {
    load_inflight_max: Option<Value>,
    store_inflight_max: Option<Value>,
    store_inflight_max_while_loading: Option<Value>,
    store_chunk_bytes: Option<Value>,
    ioprio: Option<Value>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields, expecting = "an [events] table")]
pub(super) struct RawEvents {
    enabled: Option<Value>,
    max: Option<Value>,
    locality: Option<Value>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields, expecting = "a [metrics] table")]
pub(super) struct RawMetrics {
    listen: Option<Value>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields, expecting = "a [[devices]] table")]
pub(super) struct RawDevice {
    path: Option<Value>,
    layout: Option<Value>,
    kind: Option<Value>,
    capacity_bytes: Option<Value>,
    overwrite: Option<Value>,
    pci: Option<Value>,
    nsid: Option<Value>,
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
            verify_loads: choice_or("verify_loads", raw.verify_loads, d.verify_loads)?,
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
            io_timeout_ms: int_or(
                "io_timeout_ms",
                raw.io_timeout_ms,
                d.io_timeout_ms,
                IO_TIMEOUT_FORMS,
            )
            .and_then(|ms: u32| {
                if (IO_TIMEOUT_MIN_MS..=IO_TIMEOUT_MAX_MS).contains(&ms) {
                    Ok(ms)
                } else {
                    Err(invalid("io_timeout_ms", ms, IO_TIMEOUT_FORMS))
                }
            })?,
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
            metrics: raw.metrics.map_or(Ok(d.metrics), MetricsConfig::try_from)?,
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

const LISTEN_FORMS: &str = "an IP address and port, e.g. \"127.0.0.1:9464\" or \"[::1]:9464\" \
                            (port 0: any free port)";

impl TryFrom<RawMetrics> for MetricsConfig {
    type Error = ConfigError;

    fn try_from(raw: RawMetrics) -> Result<Self, ConfigError> {
        let listen = match raw.listen {
            None => None,
            Some(Value::String(text)) => Some(
                text.parse::<std::net::SocketAddr>()
                    .map_err(|_| invalid("metrics.listen", format!("{text:?}"), LISTEN_FORMS))?,
            ),
            Some(other) => return Err(invalid("metrics.listen", other, LISTEN_FORMS)),
        };
        Ok(MetricsConfig { listen })
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

pub(super) fn device_from_raw(prefix: &str, raw: RawDevice) -> Result<DeviceConfig, ConfigError> {
    let pci = match raw.pci {
        None => None,
        Some(Value::String(pci)) => {
            kvtier_sys::vfio::check_pci_address(&pci)
                .map_err(|_| invalid(format!("{prefix}.pci"), format!("\"{pci}\""), PCI_FORMS))?;
            Some(pci)
        }
        Some(other) => return Err(invalid(format!("{prefix}.pci"), other, PCI_FORMS)),
    };
    let mut kind = choice_or(&format!("{prefix}.kind"), raw.kind, DeviceKind::Auto)?;
    let path_field = format!("{prefix}.path");
    let path = match (raw.path, &pci) {
        (Some(Value::String(path)), None) => PathBuf::from(path),
        // The name a serialized VFIO device carries; anything else is ambiguous.
        (Some(Value::String(path)), Some(pci)) if path == format!("vfio:{pci}") => {
            PathBuf::from(path)
        }
        (Some(other), Some(pci)) => {
            return Err(invalid(
                path_field,
                other,
                format!("no path with pci = \"{pci}\" (a VFIO device is named by its PCI address)"),
            ))
        }
        (None, Some(pci)) => PathBuf::from(format!("vfio:{pci}")),
        (Some(other), None) => return Err(invalid(path_field, other, PATH_FORMS)),
        (None, None) if kind == DeviceKind::Vfio => {
            return Err(invalid(format!("{prefix}.pci"), "(missing)", PCI_FORMS))
        }
        (None, None) => return Err(invalid(path_field, "(missing)", PATH_FORMS)),
    };
    if pci.is_some() {
        if kind == DeviceKind::Auto {
            kind = DeviceKind::Vfio;
        } else if kind != DeviceKind::Vfio {
            return Err(invalid(
                format!("{prefix}.kind"),
                format!("\"{}\"", kind.name()),
                "\"vfio\" (or no kind) for a device named by pci",
            ));
        }
    }
    let nsid = int_or(&format!("{prefix}.nsid"), raw.nsid, 1_u32, NSID_FORMS)?;
    if nsid == 0 || (nsid != 1 && pci.is_none()) {
        return Err(invalid(
            format!("{prefix}.nsid"),
            nsid,
            if nsid == 0 {
                NSID_FORMS
            } else {
                "no nsid: it applies to kind = \"vfio\" devices (the path names the namespace \
                 otherwise)"
            },
        ));
    }
    Ok(DeviceConfig {
        path,
        layout: choice_or(&format!("{prefix}.layout"), raw.layout, Layout::Slab)?,
        kind,
        capacity_bytes: raw
            .capacity_bytes
            .map(|value| size_from_value(&format!("{prefix}.capacity_bytes"), &value))
            .transpose()?,
        overwrite: bool_or(&format!("{prefix}.overwrite"), raw.overwrite, false)?,
        pci,
        nsid,
    })
}

const PCI_FORMS: &str =
    "a PCI address \"DDDD:BB:DD.F\" such as \"0000:01:00.0\" (`kvtier probe` lists NVMe controllers)";
const NSID_FORMS: &str = "a namespace id from 1 to 4294967294";

pub(super) fn size_or(field: &str, value: Option<Value>, default: u64) -> Result<u64, ConfigError> {
    value.map_or(Ok(default), |value| size_from_value(field, &value))
}

pub(super) fn size_from_value(field: &str, value: &Value) -> Result<u64, ConfigError> {
    let bytes = match value {
        Value::Integer(n) => u64::try_from(*n).map_err(|_| "negative".to_owned()),
        Value::String(text) => parse_size(text).map_err(|err| err.to_string()),
        _ => Err(format!("a {}", value.type_str())),
    };
    bytes.map_err(|reason| invalid(field, value, format!("a size ({reason}): {SIZE_FORMS}")))
}

pub(super) fn int_or<T: TryFrom<i64>>(
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

pub(super) fn bool_or(
    field: &str,
    value: Option<Value>,
    default: bool,
) -> Result<bool, ConfigError> {
    match value {
        None => Ok(default),
        Some(Value::Boolean(flag)) => Ok(flag),
        Some(other) => Err(invalid(field, other, BOOL_FORMS)),
    }
}

pub(super) fn choice_or<T: Named>(
    field: &str,
    value: Option<Value>,
    default: T,
) -> Result<T, ConfigError> {
    value.map_or(Ok(default), |value| choice_from_value(field, &value))
}

pub(super) fn choice_from_value<T: Named>(field: &str, value: &Value) -> Result<T, ConfigError> {
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

pub(super) fn cores_from_value(field: &str, value: &Value) -> Result<Cores, ConfigError> {
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
