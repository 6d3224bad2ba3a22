//! The target fio and kvtier share: a scratch file, a file or block device, checked before
//! anything is written to it.

use super::*;
/// The device both fio and kvtier measure, and the engine config that uses it.
pub(super) struct Target {
    /// The engine config of every run, but for `block_size`.
    pub(super) config: Config,
    pub(super) path: PathBuf,
    /// The default scratch directory, removed on drop (after every engine has shut down).
    pub(super) scratch: Option<tempfile::TempDir>,
}

impl Target {
    pub(super) fn resolve(args: &FioCompareArgs) -> CliResult<Target> {
        let mut config = match &args.config {
            Some(path) => Config::from_file(path)?,
            None => Config::default(),
        };
        let mut scratch = None;
        let mut device = if let Some(path) = &args.device {
            let mut d = DeviceConfig::new(path);
            d.capacity_bytes = match (args.size, std::fs::metadata(path)) {
                (Some(size), _) => Some(size),
                (None, Ok(m))
                    if m.file_type().is_block_device()
                        || FioEngine::of(path) == FioEngine::UringCmd =>
                {
                    Some(BLOCK_DEVICE_BYTES)
                }
                (None, Ok(_)) => None,
                (None, Err(_)) => Some(SCRATCH_BYTES),
            };
            d
        } else if args.config.is_some() {
            if config.devices.len() != 1 {
                return Err(CliError::usage(format!(
                    "--config: fio-compare measures one device, the config has {}; give one \
                     [[devices]] entry or pick one with --device",
                    config.devices.len()
                )));
            }
            let mut d = config.devices[0].clone();
            if args.size.is_some() {
                d.capacity_bytes = args.size;
            } else if d.capacity_bytes.is_none()
                && (std::fs::metadata(&d.path).is_ok_and(|m| m.file_type().is_block_device())
                    || FioEngine::of(&d.path) == FioEngine::UringCmd)
            {
                d.capacity_bytes = Some(BLOCK_DEVICE_BYTES);
            }
            d
        } else {
            let parent = args
                .dir
                .clone()
                .unwrap_or_else(|| PathBuf::from(DEFAULT_DIR));
            let dir = tempfile::Builder::new()
                .prefix("kvtier-fio-compare-")
                .tempdir_in(&parent)
                .map_err(|e| {
                    CliError::usage(format!(
                        "creating a scratch directory in {}: {e}",
                        parent.display()
                    ))
                })?;
            let mut d = DeviceConfig::new(dir.path().join("kvtier-fio-compare.slab"));
            d.capacity_bytes = Some(args.size.unwrap_or(SCRATCH_BYTES));
            scratch = Some(dir);
            d
        };
        let path = device.path.clone();
        check_target(&path, scratch.is_none(), args.overwrite)?;
        // fio overwrites the slots between kvtier runs, and each kvtier run formats afresh.
        device.overwrite = true;
        device.layout = Layout::Slab;
        config.devices = vec![device];
        config.direct_io = DirectIo::Required;
        config.validate()?;
        Ok(Target {
            config,
            path,
            scratch,
        })
    }

    /// Opens the engine once at block size `bs` (creating and pre-writing a new file, formatting
    /// the slab) to learn the slots' byte range, the workers' cores and the region's backing.
    pub(super) fn prepare(&self, bs: u64, queue_depth_max: u32) -> CliResult<Prepared> {
        let mut config = self.config.clone();
        config.block_size = bs;
        config.validate()?;
        self.wipe_header()?;
        let info = bench::engine_info(&config, queue_depth_max)
            .map_err(|e| e.context(format!("opening the engine at block size {bs}")))?;
        let dev = &info.devices[0];
        if !dev.direct {
            return Err(CliError::runtime(format!(
                "{}: the engine did not open it with O_DIRECT",
                dev.path.display()
            )));
        }
        let g = dev.geometry;
        // fio goes the way kvtier went: passthrough when kvtier opened the generic device by
        // passthrough (not after a fallback, and not `kind = "nvme"` on the block device's
        // path, where fio runs io_uring on that block device: the same LBAs).
        let engine = if dev.kind == "nvme passthrough" {
            FioEngine::of(&dev.path)
        } else {
            FioEngine::Uring
        };
        let cores: Vec<usize> = info.workers.iter().filter_map(|w| w.core).collect();
        let pinned = cores.len() == info.workers.len() && info.workers.iter().all(|w| w.pinned);
        let (cpus, cpus_policy) = if pinned {
            (join(&cores), "split")
        } else {
            tracing::warn!(
                "kvtier's workers are not all pinned: fio's jobs share the available cores"
            );
            (join(&kvtier_sys::affinity::available_cores()), "shared")
        };
        let iomem = if info.region_backing == kvtier::Backing::HugeTlb2M.as_str() {
            "mmaphuge"
        } else {
            "malloc"
        };
        Ok(Prepared {
            block_bytes: bs,
            data_offset: g.data_offset,
            data_bytes: g.slot_count * g.slot_bytes,
            device_bytes: dev.size_bytes,
            numjobs: info.workers.len().max(1) as u32,
            cpus,
            cpus_policy,
            iomem,
            hipri: u8::from(config.iopoll),
            sqpoll: u8::from(config.sqpoll),
            engine,
            max_command_bytes: (engine == FioEngine::UringCmd)
                .then(|| max_command_bytes(&dev.path))
                .flatten(),
            config,
            info,
        })
    }

    /// Zeroes the slab header (if the target exists), so that the next engine open formats a
    /// new, empty store instead of recovering entries whose slots fio has overwritten.
    pub(super) fn wipe_header(&self) -> CliResult<()> {
        if !self.path.exists() {
            return Ok(());
        }
        if FioEngine::of(&self.path) == FioEngine::UringCmd {
            let ns = kvtier_sys::nvme::Namespace::open(&self.path).map_err(|e| {
                CliError::runtime(format!(
                    "{}: opening to clear the header: {e}",
                    self.path.display()
                ))
            })?;
            let page = kvtier::Region::allocate(PAGE_BYTES, HugePages::Off)
                .map_err(|e| CliError::runtime(e.to_string()))?;
            return ns
                .write_sync(0, &page, 0, PAGE_BYTES)
                .map_err(|e| CliError::runtime(format!("clearing the slab header: {e}")));
        }
        let fail = |what: &str, e: kvtier::Errno| {
            CliError::runtime(format!(
                "{}: {what} the slab header: {} ({e})",
                self.path.display(),
                e.desc()
            ))
        };
        let file = DeviceFile::open(
            &self.path,
            OpenOptions {
                create: false,
                direct: true,
                read_only: false,
            },
        )
        .map_err(|e| fail("opening to clear", e))?;
        let page = kvtier::Region::allocate(PAGE_BYTES, HugePages::Off)
            .map_err(|e| CliError::runtime(e.to_string()))?;
        file.write_all_at(0, &page, 0, PAGE_BYTES)
            .map_err(|e| fail("clearing", e))?;
        file.sync_data().map_err(|e| fail("syncing", e))
    }
}

/// Refuses targets whose numbers would not be the device's, or whose data would be lost
/// without being asked.
pub(super) fn check_target(path: &Path, may_hold_data: bool, overwrite: bool) -> CliResult<()> {
    let meta = std::fs::metadata(path).ok();
    let is_block = meta
        .as_ref()
        .is_some_and(|m| m.file_type().is_block_device());
    if FioEngine::of(path) == FioEngine::UringCmd {
        // An NVMe generic device: no filesystem and no mount of its own; its block device
        // (the same namespace) must not be mounted.
        // From the kernel's name (ngXnY -> nvmeXnY), without opening anything, so the check
        // cannot be skipped by a device that fails to open.
        let block = kvtier_sys::nvme::generic_name(path)
            .and_then(|name| kvtier_sys::nvme::block_device_of(&name));
        if let Some(block) = block {
            if let Some(mount) = mounted(&block) {
                return Err(CliError::usage(format!(
                    "{} is mounted through {} ({mount}): fio-compare writes over the whole \
                     namespace",
                    path.display(),
                    block.display()
                )));
            }
        }
    } else if is_block {
        if let Some(mount) = mounted(path) {
            return Err(CliError::usage(format!(
                "{} is mounted ({mount}): fio-compare writes over the whole device; use an \
                 unmounted device, or --dir for a scratch file",
                path.display()
            )));
        }
    } else {
        let dir = path
            .parent()
            .filter(|p| !p.as_os_str().is_empty())
            .unwrap_or(Path::new("."));
        let refuse = |why: String| {
            CliError::usage(format!(
                "{}: {why}; fio-compare would measure memory, not a disk. Use a directory on \
                 a disk (ext4, xfs), e.g. --dir /var/tmp",
                dir.display()
            ))
        };
        match kvtier_sys::file::probe_o_direct(dir) {
            Ok(true) => {}
            Ok(false) => {
                return Err(refuse(
                    "the filesystem refuses O_DIRECT (or silently buffers it)".into(),
                ))
            }
            Err(e) => {
                return Err(CliError::usage(format!(
                    "{}: cannot probe O_DIRECT: {} ({e})",
                    dir.display(),
                    e.desc()
                )))
            }
        }
        if kvtier_sys::probe::block_queue_for_path(dir).is_none() {
            return Err(refuse(
                "not on a block device (tmpfs accepts O_DIRECT and buffers anyway)".into(),
            ));
        }
    }
    if may_hold_data && meta.is_some() && !overwrite {
        if let Some(what) = holds_data(path)? {
            return Err(CliError::usage(format!(
                "{} {what}; fio-compare writes over all of it. Pass --overwrite to destroy it, \
                 or use --dir for a scratch file",
                path.display()
            )));
        }
    }
    Ok(())
}

/// What the first page of `path` says it holds; `None` when it is all zeros.
pub(super) fn holds_data(path: &Path) -> CliResult<Option<String>> {
    let mut page = vec![0u8; PAGE_BYTES];
    if FioEngine::of(path) == FioEngine::UringCmd {
        let fail = |e: String| CliError::runtime(format!("{}: {e}", path.display()));
        let ns = kvtier_sys::nvme::Namespace::open_read_only(path).map_err(fail)?;
        let buf = kvtier::Region::allocate(PAGE_BYTES, HugePages::Off)
            .map_err(|e| CliError::runtime(e.to_string()))?;
        ns.read_sync(0, &buf, 0, PAGE_BYTES)
            .map_err(|e| fail(e.to_string()))?;
        buf.read(0, &mut page);
        return Ok(describe_first_page(&page));
    }
    let mut file = std::fs::File::open(path)
        .map_err(|e| CliError::runtime(format!("{}: {e}", path.display())))?;
    let mut got = 0;
    while got < page.len() {
        match file.read(&mut page[got..]) {
            Ok(0) => break,
            Ok(n) => got += n,
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
            Err(e) => return Err(CliError::runtime(format!("{}: {e}", path.display()))),
        }
    }
    Ok(describe_first_page(&page))
}

pub(super) fn describe_first_page(page: &[u8]) -> Option<String> {
    match Header::decode(page) {
        HeaderRead::Empty => None,
        HeaderRead::Valid(_) => Some("holds a kvtier store".to_owned()),
        HeaderRead::Foreign(why) => Some(format!("holds other data ({why})")),
    }
}

/// The mount entry using block device `path` or one of its partitions, if any.
pub(super) fn mounted(path: &Path) -> Option<String> {
    let dev = path.canonicalize().ok()?;
    let dev = dev.to_str()?;
    let mounts = std::fs::read_to_string("/proc/self/mounts").ok()?;
    mounts.lines().find_map(|line| {
        let mut fields = line.split_whitespace();
        let (source, point) = (fields.next()?, fields.next()?);
        let source = Path::new(source)
            .canonicalize()
            .ok()
            .and_then(|p| p.to_str().map(str::to_owned))?;
        source
            .starts_with(dev)
            .then(|| format!("{source} on {point}"))
    })
}

pub(super) fn join(cores: &[usize]) -> String {
    cores
        .iter()
        .map(ToString::to_string)
        .collect::<Vec<_>>()
        .join(",")
}
