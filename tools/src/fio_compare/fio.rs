//! fio's side of a cell: the job files filled in for a target and block size, and running fio.

use super::*;
/// What one block size looks like on the target, learned by opening the engine once.
pub(super) struct Prepared {
    pub(super) block_bytes: u64,
    /// The engine config of every kvtier run at this block size.
    pub(super) config: Config,
    pub(super) info: kvtier::EngineInfo,
    pub(super) data_offset: u64,
    pub(super) data_bytes: u64,
    pub(super) device_bytes: u64,
    pub(super) numjobs: u32,
    pub(super) cpus: String,
    pub(super) cpus_policy: &'static str,
    pub(super) iomem: &'static str,
    pub(super) hipri: u8,
    pub(super) sqpoll: u8,
    /// fio's engine and `direct`: `io_uring` and 1, or `io_uring_cmd` and 0 on an NVMe generic
    /// device (passthrough, as kvtier drives it).
    pub(super) engine: FioEngine,
    /// With `io_uring_cmd`: the device's transfer limit. The kernel never splits a passthrough
    /// command and fio does not either, so fio runs commands of this size with as many more in
    /// flight: the same commands and bytes in flight that kvtier issues for its blocks.
    pub(super) max_command_bytes: Option<u64>,
}

/// How fio reaches the target.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum FioEngine {
    /// `ioengine=io_uring`, `direct=1`: files and block devices.
    Uring,
    /// `ioengine=io_uring_cmd` (NVMe passthrough, `cmd_type=nvme`), `direct=0`: `/dev/ngXnY`.
    UringCmd,
}

impl FioEngine {
    pub(super) fn of(path: &Path) -> FioEngine {
        if kvtier_sys::nvme::generic_name(path).is_some() {
            FioEngine::UringCmd
        } else {
            FioEngine::Uring
        }
    }

    pub(super) fn vars(self) -> [(&'static str, String); 2] {
        match self {
            FioEngine::Uring => [("IOENGINE", "io_uring".into()), ("DIRECT", "1".into())],
            FioEngine::UringCmd => [("IOENGINE", "io_uring_cmd".into()), ("DIRECT", "0".into())],
        }
    }
}

/// A cell to measure, with its fio job filled in.
#[derive(Clone)]
pub(super) struct CellPlan {
    pub(super) kind: Kind,
    pub(super) block_bytes: u64,
    pub(super) queue_depth: u32,
    pub(super) numjobs: u32,
    pub(super) iodepth: u32,
    pub(super) job: String,
    /// Store cells: fio's store job with the checksum kvtier computes ([`CHECKSUM_OPTIONS`]),
    /// run beside the plain one in every pair; `None` for other cells or with
    /// `--no-fio-checksum`.
    pub(super) checksum_job: Option<String>,
}

/// What turns fio's store job into the reference with kvtier's checksum work: a crc32c of every
/// block, which fio writes into a verify header at the block's start as it prepares the write
/// (`do_verify=0`: nothing is read back). The buffer holds a fixed pattern, written once per
/// buffer (`verify_pattern` with `refill_buffers=0`): with a verify mode and no pattern fio
/// would also fill every buffer with fresh random bytes before every write, twice over
/// (`refill_buffers`, then the verify fill), work neither kvtier nor plain fio does
/// (docs/perf.md measures it). `verify_state_save=0`: no state file of what was written (fio
/// would leave one per job in its working directory).
pub(super) const CHECKSUM_OPTIONS: &str = "verify=crc32c\nverify_pattern=0x6b767472\n\
     refill_buffers=0\ndo_verify=0\nverify_state_save=0\n";

/// The name fio's store job with the checksum runs under (and `--show-fio` prints).
pub(super) const CHECKSUM_JOB_NAME: &str = "randwrite-crc32c.fio";

impl CellPlan {
    pub(super) fn new(
        kind: Kind,
        prep: &Prepared,
        queue_depth: u32,
        runtime: Duration,
        checksum: bool,
    ) -> CliResult<CellPlan> {
        let mut iodepth = queue_depth.div_ceil(prep.numjobs);
        let mut fio_bs = prep.block_bytes;
        if let Some(max) = prep.max_command_bytes.filter(|&m| m < prep.block_bytes) {
            let per_block = u32::try_from(prep.block_bytes.div_ceil(max)).unwrap_or(u32::MAX);
            iodepth = iodepth.saturating_mul(per_block);
            fio_bs = max;
        }
        let vars = [
            ("FILENAME", prep.info.devices[0].path.display().to_string()),
            ("OFFSET", prep.data_offset.to_string()),
            ("SIZE", prep.data_bytes.to_string()),
            ("BS", fio_bs.to_string()),
            ("NUMJOBS", prep.numjobs.to_string()),
            ("IODEPTH", iodepth.to_string()),
            ("CPUS", prep.cpus.clone()),
            ("CPUS_POLICY", prep.cpus_policy.to_owned()),
            ("IOMEM", prep.iomem.to_owned()),
            ("HIPRI", prep.hipri.to_string()),
            ("SQPOLL", prep.sqpoll.to_string()),
            // fio reads time values with a unit suffix; kvtier runs exactly as long.
            ("RUNTIME", format!("{}ms", runtime.as_millis().max(1))),
        ];
        let vars: Vec<(&str, String)> = vars.into_iter().chain(prep.engine.vars()).collect();
        let job = fill_template(kind.template(), &vars)
            .map_err(|e| CliError::runtime(format!("tools/fio/{}: {e}", kind.fio_file())))?;
        let job = strip_comments(&job);
        // The store job's one section is its last: the options land in it.
        let checksum_job =
            (checksum && kind == Kind::Store).then(|| format!("{job}{CHECKSUM_OPTIONS}"));
        Ok(CellPlan {
            kind,
            block_bytes: prep.block_bytes,
            queue_depth,
            numjobs: prep.numjobs,
            iodepth,
            job,
            checksum_job,
        })
    }

    pub(super) fn label(&self) -> String {
        format!(
            "{} {} QD {}",
            self.kind.name(),
            output::size(self.block_bytes),
            self.queue_depth
        )
    }
}

/// The fill job: the whole target once, sequentially, in the largest power-of-two request
/// (at most 1 MiB) that divides its size.
pub(super) fn fill_job(
    path: &Path,
    device_bytes: u64,
    engine: FioEngine,
    max_command_bytes: Option<u64>,
) -> String {
    let bytes = device_bytes / PAGE_BYTES as u64 * PAGE_BYTES as u64;
    let mut bs = (1u64 << bytes.trailing_zeros().min(63)).min(FILL_BS_MAX);
    if let Some(max) = max_command_bytes {
        // Powers of two both: the fill's request stays a divisor of the size.
        bs = bs.min(1 << max.ilog2());
    }
    let vars = [
        ("FILENAME", path.display().to_string()),
        ("SIZE", bytes.to_string()),
        ("BS", bs.to_string()),
    ];
    let vars: Vec<(&str, String)> = vars.into_iter().chain(engine.vars()).collect();
    strip_comments(
        &fill_template(FILL_JOB, &vars)
            .expect("fill.fio uses only FILENAME, SIZE, BS, IOENGINE and DIRECT"),
    )
}

/// The transfer limit of an NVMe generic device (what one passthrough command may carry);
/// `None` for anything else.
pub(super) fn max_command_bytes(path: &Path) -> Option<u64> {
    if FioEngine::of(path) != FioEngine::UringCmd {
        return None;
    }
    kvtier_sys::nvme::Namespace::open_read_only(path)
        .ok()
        .map(|ns| u64::from(ns.geometry().max_transfer_bytes))
}

/// The job without its `;` comment lines (the templates' documentation), as it is run.
pub(super) fn strip_comments(job: &str) -> String {
    let mut out = String::with_capacity(job.len());
    for line in job.lines().filter(|l| !l.trim_start().starts_with(';')) {
        out.push_str(line);
        out.push('\n');
    }
    out
}

/// Replaces every `${NAME}` in `template` by its value; an unknown or unclosed name is an error,
/// so a template and this code cannot drift apart silently.
pub(super) fn fill_template(template: &str, vars: &[(&str, String)]) -> Result<String, String> {
    let mut out = String::with_capacity(template.len() + 64);
    let mut rest = template;
    while let Some(at) = rest.find("${") {
        out.push_str(&rest[..at]);
        let after = &rest[at + 2..];
        let end = after
            .find('}')
            .ok_or_else(|| format!("unclosed ${{ in `{}`", &rest[at..]))?;
        let name = &after[..end];
        // Comment lines describe the variables by name; only job lines are filled in.
        let line_start = out.rfind('\n').map_or(0, |i| i + 1);
        if out[line_start..].trim_start().starts_with(';') {
            out.push_str(&rest[at..=at + 2 + end]);
        } else {
            let value = vars
                .iter()
                .find(|(n, _)| *n == name)
                .map(|(_, v)| v)
                .ok_or_else(|| format!("unknown variable ${{{name}}}"))?;
            out.push_str(value);
        }
        rest = &after[end + 1..];
    }
    out.push_str(rest);
    Ok(out)
}

/// Runs fio job files in a private directory.
pub(super) struct Fio {
    pub(super) dir: PathBuf,
    pub(super) show_progress: bool,
}

impl Fio {
    /// Runs `job` (expected to take about `runtime`) and returns fio's JSON report.
    pub(super) fn run(
        &self,
        name: &str,
        job: &str,
        runtime: Duration,
        label: &str,
    ) -> CliResult<Value> {
        let job_path = self.dir.join(name);
        let out_path = self.dir.join(format!("{name}.json"));
        let err_path = self.dir.join(format!("{name}.stderr"));
        let io = |what: &str, p: &Path, e: std::io::Error| {
            CliError::runtime(format!("{what} {}: {e}", p.display()))
        };
        std::fs::write(&job_path, job).map_err(|e| io("writing", &job_path, e))?;
        let stderr = std::fs::File::create(&err_path).map_err(|e| io("creating", &err_path, e))?;
        let _ = std::fs::remove_file(&out_path);
        let mut child = Command::new("fio")
            // Whatever fio leaves behind (state files) stays in the private directory.
            .current_dir(&self.dir)
            .arg("--output-format=json")
            .arg(format!("--output={}", out_path.display()))
            .arg(&job_path)
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(stderr)
            .spawn()
            .map_err(|e| CliError::runtime(format!("starting fio: {e}")))?;
        let bar = self.progress_bar(label, runtime);
        let started = Instant::now();
        let limit = runtime + FIO_SLACK;
        let status = loop {
            match child.try_wait() {
                Ok(Some(status)) => break status,
                Ok(None) if started.elapsed() > limit => {
                    let _ = child.kill();
                    let _ = child.wait();
                    bar.finish_and_clear();
                    return Err(CliError::runtime(format!(
                        "fio ({name}) did not finish within {} s; killed",
                        limit.as_secs()
                    )));
                }
                Ok(None) => {
                    bar.set_position(started.elapsed().as_millis() as u64);
                    std::thread::sleep(Duration::from_millis(50));
                }
                Err(e) => return Err(CliError::runtime(format!("waiting for fio: {e}"))),
            }
        };
        bar.finish_and_clear();
        let errors = std::fs::read_to_string(&err_path).unwrap_or_default();
        if !status.success() && !interrupt::requested() {
            return Err(CliError::runtime(format!(
                "fio failed ({status}) on this job:\n{job}\nfio said:\n{}",
                errors.trim()
            )));
        }
        let text = std::fs::read_to_string(&out_path).map_err(|e| io("reading", &out_path, e))?;
        // fio may put notes before the JSON document.
        let json_text = text.find('{').map_or(text.as_str(), |at| &text[at..]);
        serde_json::from_str(json_text).map_err(|e| {
            CliError::runtime(format!(
                "fio's report ({}) is not JSON: {e}; fio said: {}",
                out_path.display(),
                errors.trim()
            ))
        })
    }

    /// Runs a cell's job; returns fio's report and the `iomem` it ran with. A job asking for
    /// hugetlb memory that fails is run once more with `iomem=malloc`, with a warning: the
    /// hugetlb pool is shared with everything else on the host and may run dry between runs.
    pub(super) fn run_cell(
        &self,
        name: &str,
        job: &str,
        runtime: Duration,
        label: &str,
    ) -> CliResult<(Value, &'static str)> {
        const HUGE: &str = "iomem=mmaphuge\n";
        match self.run(name, job, runtime, label) {
            Ok(doc) if job.contains(HUGE) => Ok((doc, "mmaphuge")),
            Ok(doc) => Ok((doc, "malloc")),
            Err(e) if job.contains(HUGE) && !interrupt::requested() => {
                tracing::warn!(
                    "fio failed with hugetlb buffers (is the pool exhausted?); running this one \
                     with iomem=malloc, so this pair compares different memory: {e}"
                );
                let job = job.replace(HUGE, "iomem=malloc\n");
                Ok((self.run(name, &job, runtime, label)?, "malloc"))
            }
            Err(e) => Err(e),
        }
    }

    pub(super) fn progress_bar(&self, label: &str, runtime: Duration) -> ProgressBar {
        if !self.show_progress {
            return ProgressBar::hidden();
        }
        let bar = ProgressBar::with_draw_target(
            Some(runtime.as_millis() as u64),
            ProgressDrawTarget::stderr(),
        );
        if let Ok(style) = ProgressStyle::with_template("{prefix:>10} [{bar:30}] {elapsed} {msg}") {
            bar.set_style(style.progress_chars("=> "));
        }
        bar.set_prefix("fio");
        bar.set_message(label.to_owned());
        bar
    }
}
