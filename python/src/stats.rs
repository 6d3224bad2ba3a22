//! `Engine.stats()`: the engine's counters and histograms as Python dicts.

use kvtier::Stats;
use pyo3::prelude::*;
use pyo3::types::{PyDict, PyList};

pub(crate) fn hist_dict<'py>(
    py: Python<'py>,
    h: &kvtier::metrics::HistogramSnapshot,
) -> PyResult<Bound<'py, PyDict>> {
    let d = PyDict::new(py);
    d.set_item("count", h.count())?;
    d.set_item("p50_us", h.quantile(0.5))?;
    d.set_item("p99_us", h.quantile(0.99))?;
    d.set_item("p999_us", h.quantile(0.999))?;
    Ok(d)
}

pub(crate) fn stats_dict<'py>(py: Python<'py>, s: &Stats) -> PyResult<Bound<'py, PyDict>> {
    let d = PyDict::new(py);
    macro_rules! put {
        ($($f:ident),* $(,)?) => { $( d.set_item(stringify!($f), s.$f)?; )* };
    }
    put!(
        loads_ok,
        loads_failed,
        load_misses,
        stores_ok,
        stores_failed,
        stores_skipped_present,
        bytes_read,
        bytes_written,
        read_ops,
        write_ops,
        table_writes,
        evictions,
        removals,
        checksum_failures,
        files_refused,
        io_timeouts,
        devices_failed,
        io_errors,
        queued_loads,
        queued_stores,
        inflight_ops,
        submits,
        wakeups,
        blocks_stored,
        slots_total,
        recovered_blocks,
        torn_entries,
        unroutable_entries,
        demotions,
        demotions_dropped,
        jobs_in_flight,
        blocks_held_by_hung_io,
        jobs_released_late,
        events_dropped,
        worker_cpu_seconds,
    );
    d.set_item("load_latency", hist_dict(py, &s.load_latency_us)?)?;
    d.set_item("store_latency", hist_dict(py, &s.store_latency_us)?)?;
    breakdown_into(py, &d, s)?;
    stats_s3(py, &d, s)?;
    Ok(d)
}

/// The breakdown of the flat counters: lookups by answer, jobs, and each device.
pub(crate) fn breakdown_into<'py>(
    py: Python<'py>,
    d: &Bound<'py, PyDict>,
    s: &Stats,
) -> PyResult<()> {
    let lookups = PyDict::new(py);
    lookups.set_item("hit_nvme", s.lookups.hit_nvme)?;
    lookups.set_item("hit_s3", s.lookups.hit_s3)?;
    lookups.set_item("miss", s.lookups.miss)?;
    lookups.set_item("pending", s.lookups.pending)?;
    d.set_item("lookups", lookups)?;
    let jobs = PyDict::new(py);
    jobs.set_item("load_ok", s.jobs.load_ok)?;
    jobs.set_item("load_failed", s.jobs.load_failed)?;
    jobs.set_item("store_ok", s.jobs.store_ok)?;
    jobs.set_item("store_failed", s.jobs.store_failed)?;
    jobs.set_item("refused_jobs_in_flight", s.jobs.refused_jobs_in_flight)?;
    jobs.set_item("refused_queue_blocks", s.jobs.refused_queue_blocks)?;
    jobs.set_item("load_latency", hist_dict(py, &s.jobs.load_latency_us)?)?;
    jobs.set_item("store_latency", hist_dict(py, &s.jobs.store_latency_us)?)?;
    jobs.set_item(
        "load_latency_under_stores",
        hist_dict(py, &s.jobs.load_latency_under_stores_us)?,
    )?;
    d.set_item("jobs", jobs)?;
    let devices = PyList::empty(py);
    for dev in &s.devices {
        let dd = PyDict::new(py);
        dd.set_item("path", &dev.path)?;
        dd.set_item("bytes_read", dev.bytes_read)?;
        dd.set_item("bytes_written", dev.bytes_written)?;
        dd.set_item("used_bytes", dev.blocks_stored * s.block_bytes)?;
        dd.set_item("capacity_bytes", dev.slots_total * s.block_bytes)?;
        dd.set_item("io_timeouts", dev.io_timeouts)?;
        dd.set_item("failed", dev.failed_by > 0)?;
        let errors = PyDict::new(py);
        for (c, &n) in kvtier::metrics::ErrClass::ALL.iter().zip(&dev.errors) {
            errors.set_item(c.as_str(), n)?;
        }
        dd.set_item("errors", errors)?;
        devices.append(dd)?;
    }
    d.set_item("devices", devices)?;
    Ok(())
}

pub(crate) fn stats_s3<'py>(py: Python<'py>, d: &Bound<'py, PyDict>, s: &Stats) -> PyResult<()> {
    match &s.s3 {
        None => d.set_item("s3", py.None())?,
        Some(s3) => {
            let sd = PyDict::new(py);
            for (name, op) in [("head", &s3.head), ("get", &s3.get), ("put", &s3.put)] {
                let od = PyDict::new(py);
                od.set_item("requests", op.requests)?;
                od.set_item("errors", op.errors)?;
                od.set_item("retries", op.retries)?;
                od.set_item("bytes", op.bytes)?;
                od.set_item("latency", hist_dict(py, &op.latency_us)?)?;
                sd.set_item(name, od)?;
            }
            sd.set_item("lookup_hits", s3.lookup_hits)?;
            sd.set_item("lookup_misses", s3.lookup_misses)?;
            sd.set_item("lookup_pending", s3.lookup_pending)?;
            sd.set_item("promotions", s3.promotions)?;
            sd.set_item("promotions_failed", s3.promotions_failed)?;
            sd.set_item("promotions_skipped", s3.promotions_skipped)?;
            sd.set_item("demotions", s3.demotions)?;
            sd.set_item("demotions_dropped", s3.demotions_dropped)?;
            sd.set_item("background_upload_failures", s3.background_upload_failures)?;
            sd.set_item("uploads_dropped", s3.uploads_dropped)?;
            d.set_item("s3", sd)?;
        }
    }
    Ok(())
}
