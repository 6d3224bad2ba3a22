//! `kvtier._native`: the engine for Python. The pure-Python package (`python/kvtier/`) wraps it;
//! this module converts at the boundary and nothing more.
#![deny(unsafe_op_in_unsafe_fn, clippy::undocumented_unsafe_blocks)]
//!
//! Invariants:
//! * The region is the caller's buffer, used in place: its pages are registered as the rings'
//!   fixed buffers. The engine holds the buffer export until `shutdown` has joined every worker,
//!   and releases it only then, so the exporter cannot free, resize or unmap the memory while
//!   the kernel may still touch it. If a worker gave up on I/O past its deadline, the export is
//!   kept for the life of the process (a warning names the blocks held): a late read could
//!   otherwise land in memory the exporter has reused. The one `unsafe` block (wrapping that
//!   memory as a `Region`) is below, with its SAFETY argument.
//! * Every call that waits (open, drain, wait_finished, shutdown) releases the GIL; no engine
//!   thread ever takes it (results are converted on the caller's thread).
//! * A job id is in flight at most once; its keys are kept here until its result is polled, so
//!   results can name the keys that loaded.

mod config;
mod stats;

use config::{check_config, parse_config, parse_size, to_py};
use stats::stats_dict;
use std::collections::HashMap;
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use kvtier::{Engine, Event, Job, JobKind, JobResult, Key, KeyFailure, Lookup, Region, Tier};
use pyo3::buffer::PyBuffer;
use pyo3::exceptions::{PyException, PyOverflowError, PyTypeError, PyValueError};
use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyDict, PyList};

pyo3::create_exception!(
    _native,
    Error,
    PyException,
    "Base class of every error kvtier raises."
);
pyo3::create_exception!(
    _native,
    ConfigError,
    Error,
    "The configuration is invalid; the message names the field, the value and what is accepted."
);
pyo3::create_exception!(
    _native,
    BackpressureError,
    Error,
    "A queue is full: nothing was queued; retry later."
);
pyo3::create_exception!(
    _native,
    ShutdownError,
    Error,
    "The engine has been shut down."
);

/// Page alignment the region must have: O_DIRECT and registered buffers need it.
const REGION_ALIGN_BYTES: usize = 4096;

/// One finished job.
#[pyclass(frozen, get_all, module = "kvtier._native")]
struct JobOutcome {
    job_id: u64,
    /// "load" or "store".
    kind: &'static str,
    success: bool,
    /// Keys, in job order, that succeeded before the first failure.
    succeeded_prefix: usize,
    /// vLLM's `successful_keys`: the keys of that prefix on a partial failure, else None.
    successful_keys: Option<Py<PyList>>,
    /// `(key_index, key, reason, detail)` per failed key, in key order.
    failures: Py<PyList>,
    transfer_bytes: u64,
    /// Submission to result, seconds.
    transfer_seconds: f64,
    /// None: the job's blocks were free when it was reported. Else an event, set once no I/O
    /// of kvtier can reach them (early results, or a shutdown that gave up on a hung I/O).
    release: Option<Py<ReleaseEvent>>,
}

/// Set once no I/O of kvtier can reach a job's region blocks: usable where vLLM expects a
/// `threading.Event` (`is_set`, `wait`). Only kvtier sets it.
#[pyclass(frozen, module = "kvtier._native")]
struct ReleaseEvent {
    release: kvtier::Release,
}

#[pymethods]
impl ReleaseEvent {
    /// The job whose blocks this is about.
    #[getter]
    fn job_id(&self) -> u64 {
        self.release.job_id()
    }

    /// Distinct region blocks the job named.
    #[getter]
    fn blocks(&self) -> usize {
        self.release.blocks()
    }

    fn is_set(&self) -> bool {
        self.release.is_released()
    }

    /// Waits (GIL released) until set or `timeout` seconds pass (None: no limit); returns
    /// `is_set()`, as `threading.Event.wait` does.
    #[pyo3(signature = (timeout=None))]
    fn wait(&self, py: Python<'_>, timeout: Option<f64>) -> PyResult<bool> {
        let timeout = match timeout {
            None => None,
            Some(t) if t.is_finite() => Some(Duration::from_secs_f64(t.max(0.0))),
            Some(t) => {
                return Err(PyValueError::new_err(format!(
                    "timeout = {t}: a finite number of seconds, or None"
                )))
            }
        };
        Ok(py.detach(|| self.release.wait(timeout)))
    }

    fn __repr__(&self) -> String {
        format!(
            "ReleaseEvent(job_id={}, blocks={}, set={})",
            self.release.job_id(),
            self.release.blocks(),
            if self.release.is_released() {
                "True"
            } else {
                "False"
            }
        )
    }
}

#[pymethods]
impl JobOutcome {
    /// Whether the job's blocks are the caller's again now.
    #[getter]
    fn released(&self) -> bool {
        self.release
            .as_ref()
            .is_none_or(|r| r.get().release.is_released())
    }

    fn __repr__(&self) -> String {
        format!(
            "JobResult(job_id={}, kind='{}', success={}, succeeded_prefix={}, transfer_bytes={}, transfer_seconds={:.6})",
            self.job_id,
            self.kind,
            if self.success { "True" } else { "False" },
            self.succeeded_prefix,
            self.transfer_bytes,
            self.transfer_seconds
        )
    }
}

/// One stored or removed event.
#[pyclass(frozen, get_all, module = "kvtier._native")]
struct EventOut {
    keys: Py<PyList>,
    /// Always "STORAGE" (vLLM's medium for both of kvtier's tiers).
    medium: &'static str,
    /// "nvme" or "s3".
    tier: &'static str,
    removed: bool,
    /// "LOCAL", "REMOTE" or None.
    locality: Option<&'static str>,
}

fn reason_name(r: KeyFailure) -> &'static str {
    match r {
        KeyFailure::Miss => "miss",
        KeyFailure::NotReady => "not_ready",
        KeyFailure::Io(_) => "io",
        KeyFailure::ShortIo { .. } => "short_io",
        KeyFailure::Checksum => "checksum",
        KeyFailure::NoSpace => "no_space",
        KeyFailure::Shutdown => "shutdown",
        KeyFailure::InvalidJob => "invalid_job",
        KeyFailure::Remote => "remote",
        KeyFailure::Refused => "refused",
        KeyFailure::Timeout => "timeout",
    }
}

fn tier_name(t: Tier) -> &'static str {
    match t {
        Tier::S3 => "s3",
        Tier::Nvme => "nvme",
    }
}

#[pyclass(frozen, module = "kvtier._native", name = "Engine")]
struct PyEngine {
    engine: Engine,
    region: Arc<Region>,
    block_bytes: u64,
    region_blocks: u64,
    /// The keys of every job in flight, by job id.
    jobs: Mutex<HashMap<u64, Vec<Key>>>,
    /// The buffer export that keeps the region's memory in place; taken by `shutdown`.
    export: Mutex<Option<PyBuffer<u8>>>,
    /// Set by the first `shutdown`: what it could not stop.
    stopped: Mutex<Option<kvtier::ShutdownReport>>,
}

fn extract_keys(keys: &Bound<'_, PyAny>) -> PyResult<Vec<Key>> {
    let mut out = Vec::new();
    for (i, item) in keys.try_iter()?.enumerate() {
        let item = item?;
        let bytes = item.cast::<PyBytes>().map_err(|_| {
            PyTypeError::new_err(format!(
                "keys[{i}]: expected bytes, got {}",
                item.get_type()
                    .name()
                    .map_or_else(|_| "?".into(), |n| n.to_string())
            ))
        })?;
        out.push(
            Key::new(bytes.as_bytes())
                .map_err(|e| PyValueError::new_err(format!("keys[{i}]: {e}")))?,
        );
    }
    Ok(out)
}

fn block_id(i: usize, v: i64) -> PyResult<u32> {
    u32::try_from(v).map_err(|_| {
        PyValueError::new_err(format!(
            "blocks[{i}] = {v}: a block index from 0 to {}",
            u32::MAX
        ))
    })
}

/// Block indexes from a list/tuple of ints or an int32/int64/uint32 array (buffer protocol).
fn extract_blocks(py: Python<'_>, blocks: &Bound<'_, PyAny>) -> PyResult<Vec<u32>> {
    if let Ok(buf) = PyBuffer::<i64>::get(blocks) {
        let v = buf.to_vec(py)?;
        return v
            .into_iter()
            .enumerate()
            .map(|(i, b)| block_id(i, b))
            .collect();
    }
    if let Ok(buf) = PyBuffer::<i32>::get(blocks) {
        let v = buf.to_vec(py)?;
        return v
            .into_iter()
            .enumerate()
            .map(|(i, b)| block_id(i, i64::from(b)))
            .collect();
    }
    if let Ok(buf) = PyBuffer::<u32>::get(blocks) {
        return buf.to_vec(py);
    }
    let mut out = Vec::new();
    for (i, item) in blocks.try_iter()?.enumerate() {
        let v: i64 = item?.extract().map_err(|e: PyErr| {
            if e.is_instance_of::<PyOverflowError>(py) {
                PyValueError::new_err(format!("blocks[{i}]: out of range"))
            } else {
                PyTypeError::new_err(format!("blocks[{i}]: expected an int"))
            }
        })?;
        out.push(block_id(i, v)?);
    }
    Ok(out)
}

impl PyEngine {
    fn submit(
        &self,
        py: Python<'_>,
        kind: JobKind,
        job_id: u64,
        keys: &Bound<'_, PyAny>,
        blocks: &Bound<'_, PyAny>,
    ) -> PyResult<()> {
        let keys = extract_keys(keys)?;
        let blocks = extract_blocks(py, blocks)?;
        if keys.len() != blocks.len() {
            return Err(PyValueError::new_err(format!(
                "{} keys but {} blocks: one block per key",
                keys.len(),
                blocks.len()
            )));
        }
        if let Some((i, &b)) = blocks
            .iter()
            .enumerate()
            .find(|(_, &b)| u64::from(b) >= self.region_blocks)
        {
            return Err(PyValueError::new_err(format!(
                "blocks[{i}] = {b}: the region has {} blocks (0 to {})",
                self.region_blocks,
                self.region_blocks - 1
            )));
        }
        {
            let mut jobs = self.jobs.lock().unwrap_or_else(PoisonError::into_inner);
            if jobs.contains_key(&job_id) {
                return Err(PyValueError::new_err(format!(
                    "job_id {job_id} is already in flight: job ids must be unique until reported"
                )));
            }
            jobs.insert(job_id, keys.clone());
        }
        let job = Job::new(job_id, keys, blocks);
        // Without the GIL: with the files layout or S3, admission may `stat` a key's file.
        let r = py.detach(|| match kind {
            JobKind::Load => self.engine.submit_load(job),
            JobKind::Store => self.engine.submit_store(job),
        });
        if let Err(e) = r {
            self.jobs
                .lock()
                .unwrap_or_else(PoisonError::into_inner)
                .remove(&job_id);
            return Err(to_py(e));
        }
        Ok(())
    }

    fn convert(&self, py: Python<'_>, results: Vec<JobResult>) -> PyResult<Vec<JobOutcome>> {
        // Take the keys under the lock, build Python objects after it: an allocation may run
        // the garbage collector, whose finalizers may switch threads or call back in here.
        let keyed: Vec<(JobResult, Vec<Key>)> = {
            let mut jobs = self.jobs.lock().unwrap_or_else(PoisonError::into_inner);
            results
                .into_iter()
                .map(|r| {
                    let keys = jobs.remove(&r.id).unwrap_or_default();
                    (r, keys)
                })
                .collect()
        };
        let mut out = Vec::with_capacity(keyed.len());
        for (r, keys) in keyed {
            let key_bytes = |i: usize| -> Option<Bound<'_, PyBytes>> {
                keys.get(i).map(|k| PyBytes::new(py, k.as_bytes()))
            };
            let successful_keys = match r.successful_keys() {
                Some(n) => {
                    Some(PyList::new(py, (0..n.min(keys.len())).filter_map(key_bytes))?.unbind())
                }
                None => None,
            };
            let failures = PyList::empty(py);
            for f in &r.failures {
                let detail = if f.detail.is_empty() {
                    f.reason.to_string()
                } else {
                    format!("{}: {}", f.reason, f.detail)
                };
                failures.append((
                    f.key_index,
                    key_bytes(f.key_index),
                    reason_name(f.reason),
                    detail,
                ))?;
            }
            out.push(JobOutcome {
                job_id: r.id,
                kind: match r.kind {
                    JobKind::Load => "load",
                    JobKind::Store => "store",
                },
                success: r.success,
                succeeded_prefix: r.succeeded_prefix,
                successful_keys,
                failures: failures.unbind(),
                transfer_bytes: r.bytes,
                transfer_seconds: r.elapsed.as_secs_f64(),
                release: match r.release {
                    Some(release) => Some(Py::new(py, ReleaseEvent { release })?),
                    None => None,
                },
            });
        }
        Ok(out)
    }
}

#[pymethods]
impl PyEngine {
    /// `config` is a path, TOML text or the JSON of a dict (`kind` says which); `region` is a
    /// writable, C-contiguous byte buffer (the Python package passes a `memoryview`).
    #[new]
    fn new(
        py: Python<'_>,
        config: &str,
        kind: &str,
        region: &Bound<'_, PyAny>,
    ) -> PyResult<PyEngine> {
        let config = parse_config(config, kind)?;
        let buf = PyBuffer::<u8>::get(region)
            .map_err(|e| PyTypeError::new_err(format!("region: not a byte buffer ({e})")))?;
        if buf.readonly() {
            return Err(PyValueError::new_err(
                "region: the buffer is read-only; kvtier loads write into it",
            ));
        }
        if !buf.is_c_contiguous() {
            return Err(PyValueError::new_err(
                "region: the buffer is not C-contiguous; pass one contiguous block of memory",
            ));
        }
        let (ptr, len) = (buf.buf_ptr().cast::<u8>(), buf.len_bytes());
        let block = usize::try_from(config.block_size).unwrap_or(usize::MAX);
        if len == 0 || len % block != 0 {
            return Err(PyValueError::new_err(format!(
                "region: {len} bytes is not a whole number of blocks of block_size = {block} bytes \
                 (a multiple of block_size is accepted)"
            )));
        }
        if !(ptr as usize).is_multiple_of(REGION_ALIGN_BYTES) {
            return Err(PyValueError::new_err(format!(
                "region: the buffer starts at {ptr:p}, which is not {REGION_ALIGN_BYTES}-byte \
                 aligned; O_DIRECT and registered buffers need page-aligned memory: allocate it \
                 with kvtier.allocate_region() or mmap.mmap(-1, size)"
            )));
        }
        // SAFETY: `ptr..ptr + len` is the memory of a live, writable buffer export (`buf`),
        // valid and in place while the export lives. The export is held by the
        // returned engine and released only after `Engine::shutdown` has joined every worker
        // and stopped the S3 reactor (`shutdown` below; concurrent calls all wait for that),
        // and never if that shutdown gave up on I/O still in flight (the export is then
        // forgotten, in `shutdown` and in `Drop`), so the memory outlives every ring that
        // registered it and every I/O on it. Rust
        // touches it only through `Region`'s accessors, under their contract (no I/O on a
        // block while it is read or written).
        let region = unsafe { Region::from_raw_parts(ptr, len) }
            .map_err(|e| PyValueError::new_err(format!("region: {}", e.desc())))?;
        let region = Arc::new(region);
        let engine = py
            .detach(|| Engine::open(&config, Arc::clone(&region)))
            .map_err(to_py)?;
        Ok(PyEngine {
            block_bytes: config.block_size,
            region_blocks: (len / block) as u64,
            engine,
            region,
            jobs: Mutex::new(HashMap::new()),
            export: Mutex::new(Some(buf)),
            stopped: Mutex::new(None),
        })
    }

    #[getter]
    fn block_size(&self) -> u64 {
        self.block_bytes
    }

    #[getter]
    fn num_blocks(&self) -> u64 {
        self.region_blocks
    }

    /// Address of the region's first byte (for checks that the region is used in place).
    #[getter]
    fn region_address(&self) -> usize {
        self.region.addr()
    }

    /// Queues a store of `blocks[i]` under `keys[i]`. Never blocks.
    fn submit_store(
        &self,
        py: Python<'_>,
        job_id: u64,
        keys: &Bound<'_, PyAny>,
        blocks: &Bound<'_, PyAny>,
    ) -> PyResult<()> {
        self.submit(py, JobKind::Store, job_id, keys, blocks)
    }

    /// Queues a load of `keys[i]` into `blocks[i]`. Never blocks.
    fn submit_load(
        &self,
        py: Python<'_>,
        job_id: u64,
        keys: &Bound<'_, PyAny>,
        blocks: &Bound<'_, PyAny>,
    ) -> PyResult<()> {
        self.submit(py, JobKind::Load, job_id, keys, blocks)
    }

    /// Every result since the last call; never blocks.
    fn poll_finished(&self, py: Python<'_>) -> PyResult<Vec<JobOutcome>> {
        let mut out = Vec::new();
        self.engine.poll_finished(&mut out);
        self.convert(py, out)
    }

    /// Waits up to `timeout` seconds for a result (GIL released), then returns every result.
    fn wait_finished(&self, py: Python<'_>, timeout: f64) -> PyResult<Vec<JobOutcome>> {
        if !(timeout.is_finite() && timeout >= 0.0) {
            return Err(PyValueError::new_err(format!(
                "timeout = {timeout}: a finite number of seconds >= 0"
            )));
        }
        let mut out = Vec::new();
        py.detach(|| {
            self.engine
                .wait_finished(&mut out, Duration::from_secs_f64(timeout))
        });
        self.convert(py, out)
    }

    /// Per key: "nvme" or "s3" (a hit in that tier), "miss", or "pending" (ask again).
    fn lookup(&self, py: Python<'_>, keys: &Bound<'_, PyAny>) -> PyResult<Vec<&'static str>> {
        let keys = extract_keys(keys)?;
        // Without the GIL: the answers take short locks (the S3 and files-layout lookup
        // caches), never a system call.
        let answers = py.detach(|| self.engine.lookup(&keys));
        Ok(answers
            .into_iter()
            .map(|l| match l {
                Lookup::Hit(t) => tier_name(t),
                Lookup::Miss => "miss",
                Lookup::Pending => "pending",
            })
            .collect())
    }

    /// Marks keys recently used (eviction keeps them longer); keys not held are ignored.
    fn touch(&self, keys: &Bound<'_, PyAny>) -> PyResult<()> {
        let keys = extract_keys(keys)?;
        self.engine.touch(&keys);
        Ok(())
    }

    /// Removes keys from the store (GIL released while the workers answer); per key, whether
    /// it was removed (not when not held, or being read: ask again later).
    fn remove(&self, py: Python<'_>, keys: &Bound<'_, PyAny>) -> PyResult<Vec<bool>> {
        let keys = extract_keys(keys)?;
        Ok(py.detach(|| self.engine.remove(&keys)))
    }

    /// An eventfd (non-blocking; the engine owns and closes it) that is readable whenever a
    /// result was published: for a caller's own poll loop. Clear it (`clear_result_fd`, or
    /// read 8 bytes) before `poll_finished`.
    fn result_fd(&self) -> PyResult<i32> {
        use std::os::fd::AsRawFd;
        Ok(self.engine.result_fd().map_err(to_py)?.as_raw_fd())
    }

    /// Resets the result eventfd; returns how many notifications it held.
    fn clear_result_fd(&self) -> u64 {
        self.engine.clear_result_fd()
    }

    /// Jobs submitted whose result has not been published yet.
    fn jobs_in_flight(&self) -> usize {
        self.engine.jobs_in_flight()
    }

    /// Waits (GIL released) until every submitted job has resolved (a job whose I/O outlived
    /// its deadline is reported once its blocks are free: see `drain_released`).
    fn drain(&self, py: Python<'_>) {
        py.detach(|| self.engine.drain());
    }

    /// `drain`, then waits (GIL released) until every job is reported and its blocks are free,
    /// I/O past its deadline included.
    fn drain_released(&self, py: Python<'_>) {
        py.detach(|| self.engine.drain_released());
    }

    /// Reports a job whose blocks an I/O past its deadline still holds when it resolves
    /// (`release` set on its result), instead of once the blocks are free (the default).
    fn set_early_results(&self, early: bool) {
        self.engine.set_early_results(early);
    }

    /// Stops the engine (GIL released); idempotent. Queued jobs fail with reason "shutdown";
    /// results stay available to `poll_finished`. Then releases the region, unless a worker
    /// gave up on I/O that may still reach it: then the export is kept for the life of the
    /// process and a `ResourceWarning` names the blocks held. Returns what could not be
    /// stopped (`workers_gave_up`, `ops_in_flight`, `jobs_held`, `blocks_held`).
    fn shutdown<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let report = py.detach(|| self.engine.shutdown());
        let first = self
            .stopped
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .replace(report)
            .is_none();
        let export = self
            .export
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .take();
        if report.clean() {
            // Every worker has been joined: nothing can touch the region any more.
            drop(export);
        } else if let Some(export) = export {
            // The device may still write the memory: it stays exported (the exporter cannot
            // free or resize it) for the life of the process.
            std::mem::forget(export);
        }
        if first && !report.clean() {
            let msg = std::ffi::CString::new(format!(
                "kvtier: shutdown gave up on {} I/O past its deadline ({} workers); {} region \
                 blocks of {} jobs may still be written by the device, so the region's buffer \
                 stays exported (never freed or resized) for the life of this process",
                report.ops_in_flight, report.workers_gave_up, report.blocks_held, report.jobs_held
            ))
            .unwrap_or_default();
            PyErr::warn(
                py,
                &py.get_type::<pyo3::exceptions::PyResourceWarning>(),
                &msg,
                1,
            )?;
        }
        let d = PyDict::new(py);
        d.set_item("workers_gave_up", report.workers_gave_up)?;
        d.set_item("ops_in_flight", report.ops_in_flight)?;
        d.set_item("jobs_held", report.jobs_held)?;
        d.set_item("blocks_held", report.blocks_held)?;
        d.set_item("clean", report.clean())?;
        Ok(d)
    }

    /// Whether `shutdown` has run (the region is released unless it reported I/O held).
    #[getter]
    fn is_shut_down(&self) -> bool {
        self.stopped
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .is_some()
    }

    /// Stored and removed events since the last call.
    fn take_events(&self, py: Python<'_>) -> PyResult<Vec<EventOut>> {
        self.engine
            .take_events()
            .into_iter()
            .map(|e: Event| {
                Ok(EventOut {
                    keys: PyList::new(py, e.keys.iter().map(|k| PyBytes::new(py, k.as_bytes())))?
                        .unbind(),
                    medium: "STORAGE",
                    tier: tier_name(e.tier),
                    removed: e.removed,
                    locality: e.locality.map(|l| match l {
                        kvtier::config::Locality::Local => "LOCAL",
                        kvtier::config::Locality::Remote => "REMOTE",
                    }),
                })
            })
            .collect()
    }

    /// The engine's counters as a dict (see `Stats` in the Rust docs).
    fn stats<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        stats_dict(py, &self.engine.stats())
    }

    /// Every counter in the Prometheus text format (0.0.4): what `GET /metrics` serves.
    fn metrics_text(&self) -> String {
        self.engine.metrics_text()
    }

    /// `(host, port)` the metrics endpoint listens on (`[metrics] listen`), or None.
    #[getter]
    fn metrics_address(&self) -> Option<(String, u16)> {
        self.engine
            .metrics_addr()
            .map(|a| (a.ip().to_string(), a.port()))
    }

    /// What `open` set up, as a dict.
    fn info<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let info = self.engine.info();
        let d = PyDict::new(py);
        d.set_item("block_size", info.block_bytes)?;
        d.set_item("num_blocks", info.region_blocks)?;
        d.set_item("region_backing", info.region_backing)?;
        d.set_item("region_huge_percent", info.region_huge_percent)?;
        d.set_item("open_seconds", info.open_seconds)?;
        let devices = PyList::empty(py);
        for dev in &info.devices {
            let dd = PyDict::new(py);
            dd.set_item("path", dev.path.to_string_lossy().into_owned())?;
            dd.set_item("kind", dev.kind)?;
            dd.set_item("direct", dev.direct)?;
            dd.set_item("size_bytes", dev.size_bytes)?;
            dd.set_item("slots", dev.geometry.slot_count)?;
            dd.set_item("formatted", dev.formatted)?;
            if let Some(f) = &dev.files {
                dd.set_item("files", format!("{f:?}"))?;
            }
            devices.append(dd)?;
        }
        d.set_item("devices", devices)?;
        let workers = PyList::empty(py);
        for w in &info.workers {
            let wd = PyDict::new(py);
            wd.set_item("core", w.core)?;
            wd.set_item("pinned", w.pinned)?;
            wd.set_item("backend", &w.backend)?;
            wd.set_item("recovered_blocks", w.recovered_blocks)?;
            workers.append(wd)?;
        }
        d.set_item("workers", workers)?;
        if let Some(s3) = &info.s3 {
            let sd = PyDict::new(py);
            sd.set_item("bucket", &s3.bucket)?;
            sd.set_item("endpoint", &s3.endpoint)?;
            sd.set_item("prefix", &s3.prefix)?;
            sd.set_item("reactor_threads", s3.reactor_threads)?;
            sd.set_item("probe_seconds", s3.probe_seconds)?;
            d.set_item("s3", sd)?;
        } else {
            d.set_item("s3", py.None())?;
        }
        Ok(d)
    }

    /// The object name `key` has in the S3 tier, or None without one.
    fn s3_object_name(&self, key: &Bound<'_, PyBytes>) -> PyResult<Option<String>> {
        let key = Key::new(key.as_bytes()).map_err(|e| PyValueError::new_err(e.to_string()))?;
        Ok(self.engine.s3_object_name(&key))
    }
}

impl Drop for PyEngine {
    fn drop(&mut self) {
        // Dropped by Python's garbage collector without `shutdown`: stop the workers before
        // the buffer export is released (fields drop after this), without holding the GIL
        // while they finish their I/O. If the stop gave up on I/O that may still reach the
        // region, the export is kept for good, as `shutdown` does.
        let report = Python::attach(|py| py.detach(|| self.engine.shutdown()));
        if !report.clean() {
            let export = self
                .export
                .get_mut()
                .unwrap_or_else(PoisonError::into_inner)
                .take();
            std::mem::forget(export);
        }
    }
}

/// kvtier's log lines on stderr: warnings and errors by default (a device marked failed, an
/// object store that stops answering, recovery after a crash), `KVTIER_LOG` to choose (a
/// `RUST_LOG`-style filter, e.g. `kvtier=info`), `KVTIER_LOG_FORMAT=json` for one JSON object
/// per line. Left alone if the process already has a subscriber.
fn init_logging() {
    use tracing_subscriber::EnvFilter;
    let default = "warn,kvtier=warn,kvtier_sys=warn";
    let filter = std::env::var("KVTIER_LOG")
        .ok()
        .and_then(|s| EnvFilter::try_new(s).ok())
        .unwrap_or_else(|| EnvFilter::new(default));
    let builder = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        .with_ansi(false);
    let _ = if std::env::var("KVTIER_LOG_FORMAT").as_deref() == Ok("json") {
        builder.json().with_current_span(false).try_init()
    } else {
        builder.try_init()
    };
}

#[pymodule]
fn _native(m: &Bound<'_, PyModule>) -> PyResult<()> {
    init_logging();
    let py = m.py();
    m.add_class::<PyEngine>()?;
    m.add_class::<JobOutcome>()?;
    m.add_class::<ReleaseEvent>()?;
    m.add_class::<EventOut>()?;
    m.add_function(wrap_pyfunction!(check_config, m)?)?;
    m.add_function(wrap_pyfunction!(parse_size, m)?)?;
    m.add("Error", py.get_type::<Error>())?;
    m.add("ConfigError", py.get_type::<ConfigError>())?;
    m.add("BackpressureError", py.get_type::<BackpressureError>())?;
    m.add("ShutdownError", py.get_type::<ShutdownError>())?;
    m.add("REGION_ALIGN_BYTES", REGION_ALIGN_BYTES)?;
    Ok(())
}
