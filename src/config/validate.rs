//! Reading a config (TOML text or file) and checking every field and relation once, which
//! yields a [`Validated`] config with its [`Derived`] sizes.

use std::path::Path;

use super::{
    ensure, invalid, show_path, show_size, store_chunk_bytes, validate_cores, Config, ConfigError,
    Derived, DeviceConfig, DeviceKind, FilesConfig, Layout, Named, RawConfig, S3Write, Validated,
    ALIGN_BYTES, AT_LEAST_ONE, BLOCK_SIZE_FORMS, BLOCK_SIZE_MAX, DEMOTION_STAGING_BLOCKS,
    DEVICE_CAPACITY_MIN, GIB, PATH_FORMS, REGION_BYTES_MAX, REGISTERED_PIECE_MAX,
    RING_ENTRIES_FORMS, RING_ENTRIES_MAX, RING_ENTRIES_MIN,
};

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
    /// runs with from them (computed here once; nothing else recomputes them): the config as
    /// every front end and the node take it.
    ///
    /// # Errors
    ///
    /// [`ConfigError::Invalid`] for the first violation found.
    pub fn validate(&self) -> Result<Validated, ConfigError> {
        let block_size = self.block_size;
        ensure(
            block_size.is_multiple_of(ALIGN_BYTES)
                && (ALIGN_BYTES..=BLOCK_SIZE_MAX).contains(&block_size),
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
        self.validate_files()?;
        self.validate_s3()?;
        Ok(Validated {
            config: self.clone(),
            derived: self.derive(),
        })
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

    fn validate_files(&self) -> Result<(), ConfigError> {
        let Some(files) = &self.files else {
            return Ok(());
        };
        ensure(
            files.lookup_cache_max >= 1,
            "files.lookup_cache_max",
            files.lookup_cache_max,
            AT_LEAST_ONE,
        )?;
        ensure(
            (1..=FilesConfig::IO_WQ_WORKERS_MAX).contains(&files.io_wq_workers),
            "files.io_wq_workers",
            files.io_wq_workers,
            super::raw::IO_WQ_WORKERS_FORMS,
        )?;
        ensure(
            (1..=FilesConfig::STORES_OPENING_MAX).contains(&files.stores_opening),
            "files.stores_opening",
            files.stores_opening,
            super::raw::STORES_OPENING_FORMS,
        )
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
            s.store_chunk_bytes >= ALIGN_BYTES && s.store_chunk_bytes.is_multiple_of(ALIGN_BYTES),
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
            if device.layout == Layout::Files && device.kind != DeviceKind::Auto {
                return Err(invalid(
                    format!("devices[{index}].kind"),
                    device.kind,
                    "\"auto\" with layout = \"files\" (a files directory is not an NVMe \
                     namespace; kind = \"nvme\", \"block\" and \"vfio\" are for slab devices)",
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
            let vfio = |d: &DeviceConfig| d.kind == DeviceKind::Vfio;
            if index > 0 && vfio(device) != vfio(&self.devices[0]) {
                return Err(invalid(
                    format!("devices[{index}].kind"),
                    format!("\"{}\"", device.kind.name()),
                    format!(
                        "{}, like devices[0]: a worker polls its VFIO queue pairs and has no \
                         ring for kernel devices, so one engine drives VFIO devices only or \
                         none",
                        if vfio(&self.devices[0]) {
                            "\"vfio\""
                        } else {
                            "not \"vfio\""
                        }
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
