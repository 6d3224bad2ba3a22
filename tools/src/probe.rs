//! `kvtier probe`: what this host offers the engine — `io_uring` and its setup flags and opcodes,
//! `O_DIRECT` and its alignment at a directory, hugetlb pages and THP, the memlock limit and
//! `CAP_IPC_LOCK`, the cores the process may use, and the block queue behind the directory —
//! with one line of advice for each missing or weak piece.
//!
//! The probe changes nothing on the host: the only thing it creates is a temporary file in the
//! probed directory, removed before it returns. Each probe that cannot answer is reported as
//! unknown rather than failing the command.

use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::path::{Path, PathBuf};
use std::process::ExitCode;

use clap::Args;
use kvtier_sys::file::{DeviceFile, OpenOptions};
use kvtier_sys::probe::{self, BlockQueueInfo, HugePageInfo, UringProbe};
use serde::Serialize;

use crate::output::{self, CliError, CliResult, Human};

/// The region `Config::default()` describes (256 blocks of 2 MiB): what advice measures the
/// memlock limit against.
const DEFAULT_REGION_BYTES: u64 = 512 << 20;
/// Block size of the default config, for advice about request splitting.
const DEFAULT_BLOCK_BYTES: u64 = 2 << 20;
/// Slot alignment the slab layout supports.
const SLAB_ALIGN_MAX_BYTES: u32 = 4096;

#[derive(Args)]
pub struct ProbeArgs {
    /// Directory whose filesystem and block device to probe (where devices would live).
    #[arg(long, default_value = "/var/tmp")]
    dir: PathBuf,
    /// Print one JSON object on stdout instead of the report.
    #[arg(long)]
    json: bool,
}

#[derive(Serialize)]
struct Report {
    io_uring: UringSection,
    o_direct: DirectSection,
    hugepages: HugeSection,
    memlock: MemlockSection,
    cores: Vec<usize>,
    block_device: Option<QueueSection>,
    /// Every NVMe namespace's generic device (`/sys/class/nvme-generic`).
    nvme: Vec<NvmeSection>,
    /// Every NVMe controller on the PCI bus, and what driving it through VFIO needs.
    controllers: Vec<ControllerSection>,
    advice: Vec<String>,
}

/// One NVMe controller and whether `[[devices]] pci = "<pci>"` (kind = "vfio") can take it.
#[derive(Serialize)]
struct ControllerSection {
    pci: String,
    driver: Option<String>,
    iommu_group: Option<u32>,
    namespaces: Vec<String>,
    /// File systems mounted from it: such a controller must never be given to kvtier.
    mounted: Vec<String>,
    /// Bound to vfio-pci, in a viable group this process may open.
    vfio_ready: bool,
    /// What to do before kvtier can take it (empty when ready, or when it must not be used).
    steps: Vec<String>,
}

/// One NVMe generic device and whether kvtier can drive it by passthrough.
#[derive(Serialize)]
struct NvmeSection {
    device: PathBuf,
    /// Whether `[[devices]] path = "<device>"` gets passthrough (else the block device).
    passthrough: bool,
    error: Option<String>,
    block_device: Option<PathBuf>,
    nsid: Option<u32>,
    lba_bytes: Option<u32>,
    capacity_bytes: Option<u64>,
    max_transfer_bytes: Option<u32>,
    poll_queues: Option<bool>,
    geometry_source: Option<&'static str>,
}

// The flags mirror the kernel's setup flags one to one: an enum would only obscure the report.
#[allow(clippy::struct_excessive_bools)]
#[derive(Serialize)]
struct UringSection {
    available: bool,
    error: Option<String>,
    single_issuer: bool,
    defer_taskrun: bool,
    coop_taskrun: bool,
    sqpoll: bool,
    iopoll: bool,
    opcodes: BTreeMap<String, bool>,
}

#[derive(Serialize)]
struct DirectSection {
    dir: PathBuf,
    /// `None` when the probe itself failed (see `error`).
    supported: Option<bool>,
    error: Option<String>,
    dio_mem_align: Option<u32>,
    dio_offset_align: Option<u32>,
}

#[derive(Serialize)]
struct HugeSection {
    total: u64,
    free: u64,
    size_bytes: u64,
    thp_mode: String,
}

#[derive(Serialize)]
struct MemlockSection {
    /// `None`: unlimited.
    limit_bytes: Option<u64>,
    cap_ipc_lock: bool,
}

#[derive(Serialize)]
struct QueueSection {
    device: String,
    scheduler: String,
    nr_requests: u64,
    rotational: bool,
    logical_block_size: u64,
    max_sectors_kb: u64,
}

pub fn run(args: &ProbeArgs) -> CliResult<ExitCode> {
    let meta = std::fs::metadata(&args.dir)
        .map_err(|e| CliError::usage(format!("--dir {}: {e}", args.dir.display())))?;
    if !meta.is_dir() {
        return Err(CliError::usage(format!(
            "--dir {}: not a directory",
            args.dir.display()
        )));
    }
    let report = collect(&args.dir);
    if args.json {
        let value = serde_json::to_value(&report)
            .map_err(|e| CliError::runtime(format!("encoding JSON: {e}")))?;
        output::write_json("-", &value)?;
    } else {
        Human::Stdout.print(&render(&report));
    }
    Ok(ExitCode::SUCCESS)
}

fn collect(dir: &Path) -> Report {
    let uring = probe::probe_uring();
    let direct = probe_direct(dir);
    let huge = probe::hugepage_info();
    let memlock = MemlockSection {
        limit_bytes: probe::memlock_limit(),
        cap_ipc_lock: probe::has_cap_ipc_lock(),
    };
    let cores = kvtier_sys::affinity::available_cores();
    let queue = probe::block_queue_for_path(dir);
    let mut advice = Vec::new();
    advise_uring(&uring, &mut advice);
    advise_direct(&direct, &mut advice);
    advise_huge(&huge, &mut advice);
    advise_memlock(&memlock, &mut advice);
    if cores.len() < 2 {
        advice.push(format!(
            "only {} core available to this process: the engine's workers share it with the \
             inference server; give kvtier dedicated cores (taskset / cpuset) for stable latency",
            cores.len()
        ));
    }
    advise_queue(dir, queue.as_ref(), &mut advice);
    let uring_cmd = uring
        .opcodes
        .iter()
        .any(|&(name, ok)| name == "UringCmd" && ok);
    let nvme = probe_nvme(uring_cmd, &mut advice);
    let controllers = probe_controllers(&memlock);
    Report {
        io_uring: UringSection {
            available: uring.available,
            error: uring.error.clone(),
            single_issuer: uring.features.single_issuer,
            defer_taskrun: uring.features.defer_taskrun,
            coop_taskrun: uring.features.coop_taskrun,
            sqpoll: uring.features.sqpoll,
            iopoll: uring.features.iopoll,
            opcodes: uring
                .opcodes
                .iter()
                .map(|&(name, ok)| (name.to_owned(), ok))
                .collect(),
        },
        o_direct: direct,
        hugepages: HugeSection {
            total: huge.total,
            free: huge.free,
            size_bytes: huge.size_bytes,
            thp_mode: huge.thp_mode,
        },
        memlock,
        cores,
        block_device: queue.map(|q| QueueSection {
            device: q.device,
            scheduler: q.scheduler,
            nr_requests: q.nr_requests,
            rotational: q.rotational,
            logical_block_size: q.logical_block_size,
            max_sectors_kb: q.max_sectors_kb,
        }),
        nvme,
        controllers,
        advice,
    }
}

/// Every NVMe controller on the PCI bus and what taking it through VFIO needs.
fn probe_controllers(memlock: &MemlockSection) -> Vec<ControllerSection> {
    kvtier_sys::vfio::nvme_controllers()
        .into_iter()
        .map(|c| {
            let pci = &c.pci;
            let group_node = c.iommu_group.map(|g| format!("/dev/vfio/{g}"));
            let vfio_ready = c.driver.as_deref() == Some("vfio-pci")
                && group_node.as_ref().is_some_and(|n| {
                    std::fs::OpenOptions::new()
                        .read(true)
                        .write(true)
                        .open(n)
                        .is_ok()
                });
            let mut steps = Vec::new();
            if c.mounted.is_empty() && !vfio_ready {
                if c.iommu_group.is_none() {
                    steps.push(
                        "boot with the IOMMU on (intel_iommu=on or amd_iommu=on): the \
                         controller is in no IOMMU group"
                            .to_owned(),
                    );
                }
                if c.driver.as_deref() != Some("vfio-pci") {
                    steps.push(format!(
                        "as root: modprobe vfio-pci; {}echo vfio-pci > \
                         /sys/bus/pci/devices/{pci}/driver_override; echo {pci} > \
                         /sys/bus/pci/drivers_probe (its namespaces {} disappear from the \
                         kernel)",
                        c.driver.as_ref().map_or(String::new(), |_| format!(
                            "echo {pci} > /sys/bus/pci/devices/{pci}/driver/unbind; "
                        )),
                        if c.namespaces.is_empty() {
                            "-".to_owned()
                        } else {
                            c.namespaces.join(", ")
                        }
                    ));
                }
                if let Some(node) = &group_node {
                    steps.push(format!(
                        "run as root or give this user {node} (chown); every device of IOMMU \
                         group {} must be bound to vfio-pci or to no driver",
                        c.iommu_group.unwrap_or(0)
                    ));
                }
            }
            if c.mounted.is_empty() && !memlock.cap_ipc_lock && memlock.limit_bytes.is_some() {
                steps.push(
                    "raise the locked-memory limit (ulimit -l, or LimitMEMLOCK= in the unit): \
                     VFIO pins the whole region and the queues"
                        .to_owned(),
                );
            }
            ControllerSection {
                pci: c.pci,
                driver: c.driver,
                iommu_group: c.iommu_group,
                namespaces: c.namespaces,
                mounted: c.mounted,
                vfio_ready,
                steps,
            }
        })
        .collect()
}

/// Opens every NVMe generic device as the engine would and reports its geometry, or why
/// passthrough is unavailable.
fn probe_nvme(uring_cmd: bool, advice: &mut Vec<String>) -> Vec<NvmeSection> {
    let mut names: Vec<String> = std::fs::read_dir("/sys/class/nvme-generic")
        .map(|dir| {
            dir.flatten()
                .map(|e| e.file_name().to_string_lossy().into_owned())
                .collect()
        })
        .unwrap_or_default();
    names.sort();
    let mut out = Vec::new();
    for name in names {
        let device = PathBuf::from(format!("/dev/{name}"));
        let mut section = NvmeSection {
            device: device.clone(),
            passthrough: false,
            error: None,
            block_device: None,
            nsid: None,
            lba_bytes: None,
            capacity_bytes: None,
            max_transfer_bytes: None,
            poll_queues: None,
            geometry_source: None,
        };
        match kvtier_sys::nvme::Namespace::open(&device) {
            Ok(ns) => {
                let g = ns.geometry();
                let io = if uring_cmd { ns.check_io() } else { Ok(()) };
                section.passthrough = uring_cmd && io.is_ok();
                section.block_device = Some(g.block_device.clone());
                section.nsid = Some(g.nsid);
                section.lba_bytes = Some(g.lba_bytes());
                section.capacity_bytes = Some(g.size_bytes());
                section.max_transfer_bytes = Some(g.max_transfer_bytes);
                section.poll_queues = Some(g.poll_queues);
                section.geometry_source = Some(g.source);
                if !uring_cmd {
                    section.error = Some("io_uring has no URING_CMD (Linux 6.1+)".to_owned());
                    advice.push(format!(
                        "{}: this kernel's io_uring lacks URING_CMD, so kvtier uses the block \
                         device; NVMe passthrough with fixed buffers needs Linux 6.1 or later",
                        device.display()
                    ));
                } else if let Err(why) = io {
                    advice.push(format!(
                        "{}: a passthrough read failed ({why}), so kvtier uses the block device",
                        device.display()
                    ));
                    section.error = Some(why);
                }
                if !g.poll_queues {
                    advice.push(format!(
                        "{}: the NVMe driver has no poll queues, so iopoll = true completes by \
                         interrupt; load it with nvme.poll_queues=N (kernel argument or modprobe \
                         option, N <= cores) for polled completions",
                        device.display()
                    ));
                }
            }
            Err(why) => {
                advice.push(format!(
                    "{}: passthrough unavailable ({why}); kvtier falls back to the block device. \
                     The generic device is root-only by default: run kvtier as root or grant its \
                     user read-write access to {} (a udev rule)",
                    device.display(),
                    device.display()
                ));
                section.error = Some(why);
            }
        }
        out.push(section);
    }
    out
}

/// `probe_o_direct`, then the DIO alignment of a temporary file opened with `O_DIRECT`.
fn probe_direct(dir: &Path) -> DirectSection {
    let mut section = DirectSection {
        dir: dir.to_path_buf(),
        supported: None,
        error: None,
        dio_mem_align: None,
        dio_offset_align: None,
    };
    match kvtier_sys::file::probe_o_direct(dir) {
        Ok(ok) => section.supported = Some(ok),
        Err(e) => section.error = Some(format!("{} ({e})", e.desc())),
    }
    if section.supported != Some(true) {
        return section;
    }
    let temp = match tempfile::Builder::new()
        .prefix(".kvtier-probe-")
        .tempfile_in(dir)
    {
        Ok(t) => t,
        Err(e) => {
            section.error = Some(format!("creating a temporary file: {e}"));
            return section;
        }
    };
    let opts = OpenOptions {
        direct: true,
        ..OpenOptions::default()
    };
    match DeviceFile::open(temp.path(), opts) {
        Ok(file) => {
            if let Some(a) = file.dio_alignment() {
                section.dio_mem_align = Some(a.mem_align);
                section.dio_offset_align = Some(a.offset_align);
            }
        }
        Err(e) => section.error = Some(format!("opening with O_DIRECT: {} ({e})", e.desc())),
    }
    section
}

fn advise_uring(u: &UringProbe, advice: &mut Vec<String>) {
    if !u.available {
        advice.push(format!(
            "io_uring is unavailable: {}",
            u.error.as_deref().unwrap_or("unknown reason")
        ));
        return;
    }
    if let Some(e) = &u.error {
        advice.push(format!(
            "io_uring opcode probe failed ({e}): the kernel is older than 5.6"
        ));
    }
    let missing: Vec<&str> = u
        .opcodes
        .iter()
        .filter(|(_, ok)| !ok)
        .map(|&(name, _)| name)
        .collect();
    if missing
        .iter()
        .any(|n| *n == "ReadFixed" || *n == "WriteFixed")
    {
        advice.push(
            "the kernel lacks ReadFixed/WriteFixed: the engine cannot use registered buffers; \
             upgrade to Linux 5.6 or newer"
                .into(),
        );
    } else if !missing.is_empty() {
        advice.push(format!(
            "io_uring opcodes missing: {} (the files layout needs them; upgrade the kernel)",
            missing.join(", ")
        ));
    }
    let f = &u.features;
    if !f.single_issuer || !f.defer_taskrun {
        advice.push(
            "no IORING_SETUP_SINGLE_ISSUER/DEFER_TASKRUN (Linux 6.1+): completions run as task \
             work at interrupt time, costing CPU per I/O; upgrade the kernel"
                .into(),
        );
    } else if !f.coop_taskrun {
        advice.push(
            "no IORING_SETUP_COOP_TASKRUN (Linux 5.19+): completions interrupt the worker; \
             upgrade the kernel"
                .into(),
        );
    }
    if !f.sqpoll {
        advice
            .push("SQPOLL rings cannot be created here: keep sqpoll = false (the default)".into());
    }
    if !f.iopoll {
        advice.push(
            "IOPOLL rings cannot be created here: keep iopoll = false (the default; IOPOLL also \
             needs a raw NVMe device with poll queues, nvme.poll_queues=N)"
                .into(),
        );
    }
}

fn advise_direct(d: &DirectSection, advice: &mut Vec<String>) {
    let dir = d.dir.display();
    match d.supported {
        Some(true) => {
            if let Some(align) = d.dio_offset_align.filter(|&a| a > SLAB_ALIGN_MAX_BYTES) {
                advice.push(format!(
                    "O_DIRECT at {dir} needs {align}-byte alignment, above the \
                     {SLAB_ALIGN_MAX_BYTES} the slab layout supports: use another filesystem or \
                     a raw device"
                ));
            }
            if let Some(e) = &d.error {
                advice.push(format!("O_DIRECT alignment at {dir} unknown: {e}"));
            }
        }
        Some(false) => advice.push(format!(
            "O_DIRECT refused at {dir}: use direct_io = \"auto\" (buffered I/O through the page \
             cache) or put devices on ext4/xfs or a raw block device"
        )),
        None => advice.push(format!(
            "O_DIRECT could not be probed at {dir}: {}",
            d.error.as_deref().unwrap_or("unknown error")
        )),
    }
}

fn advise_huge(h: &HugePageInfo, advice: &mut Vec<String>) {
    let page = if h.size_bytes == 0 {
        2 << 20
    } else {
        h.size_bytes
    };
    let pages_per_gib = (1u64 << 30) / page;
    if h.total == 0 {
        let thp = match h.thp_mode.as_str() {
            "always" | "madvise" => "the region falls back to transparent hugepages",
            "never" => "and THP is off: the region uses 4 KiB pages",
            _ => "the region falls back to transparent or 4 KiB pages",
        };
        advice.push(format!(
            "no hugetlb pages reserved ({thp}): echo {pages_per_gib} > /proc/sys/vm/nr_hugepages \
             (1 GiB of {} pages)",
            output::size(page)
        ));
    } else if h.free == 0 {
        advice.push(format!(
            "all {} hugetlb pages are in use: reserve more in /proc/sys/vm/nr_hugepages",
            h.total
        ));
    }
    if h.thp_mode == "never" {
        advice.push(
            "transparent hugepages are disabled: echo madvise > \
             /sys/kernel/mm/transparent_hugepage/enabled (kvtier madvises its region)"
                .into(),
        );
    }
}

fn advise_memlock(m: &MemlockSection, advice: &mut Vec<String>) {
    if m.cap_ipc_lock {
        return;
    }
    if let Some(limit) = m.limit_bytes.filter(|&l| l < DEFAULT_REGION_BYTES) {
        advice.push(format!(
            "memlock limit {} and no CAP_IPC_LOCK: registering a region larger than that will \
             fail (the default region is {}): raise LimitMEMLOCK (systemd) / ulimit -l, or \
             grant CAP_IPC_LOCK",
            output::size(limit),
            output::size(DEFAULT_REGION_BYTES)
        ));
    }
}

fn advise_queue(dir: &Path, q: Option<&BlockQueueInfo>, advice: &mut Vec<String>) {
    let Some(q) = q else {
        advice.push(format!(
            "{} is not on a block device (tmpfs, overlay or a network filesystem?): devices \
             there will not behave like local NVMe",
            dir.display()
        ));
        return;
    };
    if q.rotational {
        advice.push(format!(
            "{} is rotational: kvtier is built for flash; expect seek-bound numbers",
            q.device
        ));
    }
    if q.scheduler != "none" && !q.scheduler.is_empty() {
        advice.push(format!(
            "{} uses the {} I/O scheduler: `echo none > /sys/block/{}/queue/scheduler` is \
             usually fastest on NVMe (kvtier orders loads before stores itself; keep mq-deadline \
             only if you rely on its ioprio handling)",
            q.device, q.scheduler, q.device
        ));
    }
    if q.nr_requests > 0 && q.nr_requests < 64 {
        advice.push(format!(
            "{} queue holds only {} requests (nr_requests): deeper kvtier queues wait in the \
             block layer",
            q.device, q.nr_requests
        ));
    }
    let max_request = q.max_sectors_kb * 1024;
    if max_request > 0 && max_request < DEFAULT_BLOCK_BYTES {
        advice.push(format!(
            "{} max_sectors_kb is {}: a {} block goes to the device as {} requests",
            q.device,
            q.max_sectors_kb,
            output::size(DEFAULT_BLOCK_BYTES),
            DEFAULT_BLOCK_BYTES.div_ceil(max_request)
        ));
    }
}

fn yes(b: bool) -> &'static str {
    if b {
        "yes"
    } else {
        "no"
    }
}

fn render(report: &Report) -> String {
    let mut out = String::new();
    let uring = &report.io_uring;
    if uring.available {
        let _ = writeln!(out, "io_uring       available");
    } else {
        let _ = writeln!(
            out,
            "io_uring       UNAVAILABLE: {}",
            uring.error.as_deref().unwrap_or("unknown")
        );
    }
    let _ = writeln!(
        out,
        "  flags        SINGLE_ISSUER {}, DEFER_TASKRUN {}, COOP_TASKRUN {}, SQPOLL {}, IOPOLL {}",
        yes(uring.single_issuer),
        yes(uring.defer_taskrun),
        yes(uring.coop_taskrun),
        yes(uring.sqpoll),
        yes(uring.iopoll)
    );
    let (have, lack): (Vec<_>, Vec<_>) = uring.opcodes.iter().partition(|(_, ok)| **ok);
    let names = |v: &[(&String, &bool)]| {
        if v.is_empty() {
            "none".to_owned()
        } else {
            v.iter()
                .map(|(n, _)| n.as_str())
                .collect::<Vec<_>>()
                .join(" ")
        }
    };
    let _ = writeln!(out, "  opcodes      {}", names(&have));
    if !lack.is_empty() {
        let _ = writeln!(out, "  missing      {}", names(&lack));
    }
    render_host(report, &mut out);
    out
}

fn render_controllers(report: &Report, out: &mut String) {
    if report.controllers.is_empty() {
        let _ = writeln!(out, "controllers    no NVMe controllers on the PCI bus");
    }
    for c in &report.controllers {
        let _ = writeln!(
            out,
            "controller     {}: driver {}, IOMMU group {}, namespaces {}",
            c.pci,
            c.driver.as_deref().unwrap_or("none"),
            c.iommu_group
                .map_or_else(|| "none".to_owned(), |g| g.to_string()),
            if c.namespaces.is_empty() {
                "-".to_owned()
            } else {
                c.namespaces.join(", ")
            }
        );
        if !c.mounted.is_empty() {
            let _ = writeln!(
                out,
                "                 holds mounted file systems ({}): never give it to kvtier",
                c.mounted.join(", ")
            );
        } else if c.vfio_ready {
            let _ = writeln!(
                out,
                "                 ready for [[devices]] pci = \"{}\" (kind = \"vfio\")",
                c.pci
            );
        } else {
            for step in &c.steps {
                let _ = writeln!(out, "                 to use with kind = \"vfio\": {step}");
            }
        }
    }
}

fn render_nvme(report: &Report, out: &mut String) {
    if report.nvme.is_empty() {
        let _ = writeln!(out, "nvme           no NVMe generic devices (/dev/ngXnY)");
    }
    for n in &report.nvme {
        match (&n.error, n.lba_bytes) {
            (None, Some(lba)) => {
                let _ = writeln!(
                    out,
                    "nvme           {}: passthrough {}, nsid {}, {} LBAs, {}, max transfer {}, \
                     poll queues {} (geometry from {})",
                    n.device.display(),
                    yes(n.passthrough),
                    n.nsid.unwrap_or(0),
                    output::size(u64::from(lba)),
                    output::size(n.capacity_bytes.unwrap_or(0)),
                    output::size(u64::from(n.max_transfer_bytes.unwrap_or(0))),
                    yes(n.poll_queues.unwrap_or(false)),
                    n.geometry_source.unwrap_or("?")
                );
            }
            (err, _) => {
                let _ = writeln!(
                    out,
                    "nvme           {}: passthrough no: {}",
                    n.device.display(),
                    err.as_deref().unwrap_or("unknown")
                );
            }
        }
    }
}

/// Everything but `io_uring`: `O_DIRECT`, memory, cores, block queue, NVMe, advice.
fn render_host(report: &Report, out: &mut String) {
    let direct = &report.o_direct;
    let state = match direct.supported {
        Some(true) => "supported",
        Some(false) => "REFUSED",
        None => "unknown",
    };
    let align = match (direct.dio_mem_align, direct.dio_offset_align) {
        (Some(mem), Some(off)) => format!(" (alignment: memory {mem} B, offset/length {off} B)"),
        _ => String::new(),
    };
    let _ = writeln!(
        out,
        "O_DIRECT       {state} at {}{align}",
        direct.dir.display()
    );
    let huge = &report.hugepages;
    let _ = writeln!(
        out,
        "hugepages      hugetlb {} reserved, {} free, {} pages; THP {}",
        huge.total,
        huge.free,
        output::size(huge.size_bytes),
        if huge.thp_mode.is_empty() {
            "unknown"
        } else {
            &huge.thp_mode
        }
    );
    let limit = report
        .memlock
        .limit_bytes
        .map_or_else(|| "unlimited".to_owned(), output::size);
    let _ = writeln!(
        out,
        "memlock        limit {limit}, CAP_IPC_LOCK {}",
        yes(report.memlock.cap_ipc_lock)
    );
    let cores: Vec<String> = report.cores.iter().map(ToString::to_string).collect();
    let _ = writeln!(
        out,
        "cores          {} available: {}",
        report.cores.len(),
        cores.join(",")
    );
    match &report.block_device {
        Some(queue) => {
            let _ = writeln!(
                out,
                "block device   {}: scheduler {}, nr_requests {}, rotational {}, logical block \
                 {} B, max_sectors_kb {}",
                queue.device,
                queue.scheduler,
                queue.nr_requests,
                yes(queue.rotational),
                queue.logical_block_size,
                queue.max_sectors_kb
            );
        }
        None => {
            let _ = writeln!(
                out,
                "block device   none found under {}",
                direct.dir.display()
            );
        }
    }
    render_nvme(report, out);
    render_controllers(report, out);
    out.push('\n');
    if report.advice.is_empty() {
        out.push_str("advice: none; this host offers everything kvtier uses\n");
    } else {
        out.push_str("advice:\n");
        for a in &report.advice {
            let _ = writeln!(out, "  - {a}");
        }
    }
}
