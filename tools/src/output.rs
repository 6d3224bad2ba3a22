//! Presentation shared by every subcommand: the command's error type and exit codes, where human
//! output goes (stdout, or stderr when stdout carries JSON), aligned text tables, byte sizes
//! written the way the config writes them, and JSON output to a file or stdout.
//!
//! Invariants: nothing here decides *what* a command reports, only how; a JSON document is
//! always written whole and newline-terminated; a table never truncates a cell.

use std::fmt;
use std::fmt::Write as _;
use std::io::Write;
use std::path::Path;
use std::process::ExitCode;

/// How a command failed, which decides the exit code.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Failure {
    /// Bad arguments or a bad config: the user must change what they asked for (exit 2).
    Usage,
    /// Something went wrong while running (exit 1).
    Runtime,
}

/// A command's error: printed as `error: <message>` and turned into an exit code.
#[derive(Debug)]
pub struct CliError {
    pub failure: Failure,
    pub message: String,
}

impl CliError {
    pub fn usage(message: impl Into<String>) -> CliError {
        CliError {
            failure: Failure::Usage,
            message: message.into(),
        }
    }

    pub fn runtime(message: impl Into<String>) -> CliError {
        CliError {
            failure: Failure::Runtime,
            message: message.into(),
        }
    }

    /// Prefixes the message with what was being done, keeping the failure kind.
    #[must_use]
    pub fn context(self, what: impl fmt::Display) -> CliError {
        CliError {
            failure: self.failure,
            message: format!("{what}: {}", self.message),
        }
    }

    pub fn exit_code(&self) -> ExitCode {
        match self.failure {
            Failure::Usage => ExitCode::from(2),
            Failure::Runtime => ExitCode::from(1),
        }
    }
}

impl fmt::Display for CliError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.message)
    }
}

impl From<kvtier::Error> for CliError {
    /// A config error is the user's to fix (exit 2); everything else happened at run time.
    fn from(err: kvtier::Error) -> CliError {
        match err {
            kvtier::Error::Config(_) => CliError::usage(err.to_string()),
            other => CliError::runtime(other.to_string()),
        }
    }
}

impl From<kvtier::ConfigError> for CliError {
    fn from(err: kvtier::ConfigError) -> CliError {
        CliError::usage(err.to_string())
    }
}

pub type CliResult<T> = Result<T, CliError>;

/// Where human-readable output goes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Human {
    Stdout,
    /// stdout is reserved for a JSON document.
    Stderr,
}

impl Human {
    /// For a command with `--json PATH|-`: checks now that PATH can be written (without
    /// truncating an earlier result yet), so a long run does not fail at its end; returns where
    /// the human-readable output goes (stderr when the JSON takes stdout).
    pub fn for_json(json: Option<&str>) -> CliResult<Human> {
        match json {
            Some("-") => Ok(Human::Stderr),
            Some(target) => {
                std::fs::OpenOptions::new()
                    .append(true)
                    .create(true)
                    .open(target)
                    .map_err(|e| CliError::usage(format!("--json {target}: {e}")))?;
                Ok(Human::Stdout)
            }
            None => Ok(Human::Stdout),
        }
    }

    /// Writes `text` as is; a closed pipe or full disk is not worth failing a finished run for,
    /// so write errors are ignored (the JSON path reports its own).
    pub fn print(self, text: &str) {
        let _ = match self {
            Human::Stdout => std::io::stdout().lock().write_all(text.as_bytes()),
            Human::Stderr => std::io::stderr().lock().write_all(text.as_bytes()),
        };
    }
}

/// Writes `value` as pretty JSON to `target`: a path, or `-` for stdout.
pub fn write_json(target: &str, value: &serde_json::Value) -> CliResult<()> {
    let mut text = serde_json::to_string_pretty(value)
        .map_err(|e| CliError::runtime(format!("encoding JSON: {e}")))?;
    text.push('\n');
    if target == "-" {
        let mut out = std::io::stdout().lock();
        out.write_all(text.as_bytes())
            .and_then(|()| out.flush())
            .map_err(|e| CliError::runtime(format!("writing JSON to stdout: {e}")))
    } else {
        std::fs::write(Path::new(target), text)
            .map_err(|e| CliError::runtime(format!("writing JSON to {target}: {e}")))
    }
}

const KIB: u64 = 1 << 10;
const MIB: u64 = 1 << 20;
const GIB: u64 = 1 << 30;
const TIB: u64 = 1 << 40;

/// A byte count for people: exact binary units when they divide (`2 MiB`), else one decimal
/// in the largest unit below it (`1.5 GiB`), else bytes.
pub fn size(bytes: u64) -> String {
    for (unit, name) in [(TIB, "TiB"), (GIB, "GiB"), (MIB, "MiB"), (KIB, "KiB")] {
        if bytes >= unit {
            return if bytes.is_multiple_of(unit) {
                format!("{} {name}", bytes / unit)
            } else {
                format!("{:.1} {name}", bytes as f64 / unit as f64)
            };
        }
    }
    format!("{bytes} B")
}

/// Bytes as GiB, for rates.
pub fn gib(bytes: u64) -> f64 {
    bytes as f64 / GIB as f64
}

/// A left-aligned first column and right-aligned other columns, two spaces apart.
pub struct Table {
    header: Vec<String>,
    rows: Vec<Vec<String>>,
}

impl Table {
    pub fn new(header: &[&str]) -> Table {
        Table {
            header: header.iter().map(|h| (*h).to_owned()).collect(),
            rows: Vec::new(),
        }
    }

    /// Adds a row; it must have as many cells as the header.
    pub fn row(&mut self, cells: Vec<String>) {
        assert_eq!(cells.len(), self.header.len(), "table row width");
        self.rows.push(cells);
    }
}

impl fmt::Display for Table {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let mut widths: Vec<usize> = self.header.iter().map(|h| h.chars().count()).collect();
        for row in &self.rows {
            for (w, cell) in widths.iter_mut().zip(row) {
                *w = (*w).max(cell.chars().count());
            }
        }
        for row in std::iter::once(&self.header).chain(&self.rows) {
            let mut line = String::new();
            for (i, (cell, &w)) in row.iter().zip(&widths).enumerate() {
                if i == 0 {
                    let _ = write!(line, "{cell:<w$}");
                } else {
                    let _ = write!(line, "  {cell:>w$}");
                }
            }
            writeln!(f, "{}", line.trim_end())?;
        }
        Ok(())
    }
}

/// The engine as opened, for people: region, devices, workers.
pub fn engine_text(info: &kvtier::EngineInfo, cores: &[usize]) -> String {
    let mut s = String::new();
    let _ = writeln!(
        s,
        "region: {} blocks of {} ({}), backing {}{}; engine opened in {:.2} s",
        info.region_blocks,
        size(info.block_bytes),
        size(info.region_blocks * info.block_bytes),
        info.region_backing,
        info.region_huge_percent
            .map_or_else(String::new, |p| format!(" ({p:.0} % in huge pages)")),
        info.open_seconds
    );
    for (i, d) in info.devices.iter().enumerate() {
        let _ = writeln!(
            s,
            "device {i}: {} ({}, {}, {}), {} slots of {}{}",
            d.path.display(),
            d.kind,
            if d.direct {
                "O_DIRECT"
            } else {
                "buffered (page cache)"
            },
            size(d.size_bytes),
            d.geometry.slot_count,
            size(d.geometry.slot_bytes),
            if d.formatted {
                ", formatted at this open"
            } else {
                ""
            }
        );
    }
    for (i, w) in info.workers.iter().enumerate() {
        let core = match (w.core, w.pinned) {
            (Some(c), true) => format!("core {c} (pinned)"),
            (Some(c), false) => format!("core {c} (NOT pinned)"),
            (None, _) => "unpinned".to_owned(),
        };
        let _ = writeln!(
            s,
            "worker {i}: {core}, {}, {} blocks recovered",
            w.backend, w.recovered_blocks
        );
    }
    if let Some(t) = &info.s3 {
        let _ = writeln!(
            s,
            "s3: bucket {:?} at {}, prefix {:?}, reactor {} threads ({}), probe {:.0} ms",
            t.bucket,
            t.endpoint,
            t.prefix,
            t.reactor_threads,
            if t.reactor_cores.is_empty() {
                "unpinned: every core has a worker".to_owned()
            } else {
                format!("cores {:?}", t.reactor_cores)
            },
            t.probe_seconds * 1000.0
        );
    }
    let list: Vec<String> = cores.iter().map(ToString::to_string).collect();
    let _ = writeln!(s, "cores available: {} ({})", cores.len(), list.join(","));
    s
}

/// The engine as opened, as JSON; with `stats`, the engine's counters at the end.
pub fn engine_json(
    info: &kvtier::EngineInfo,
    cores: &[usize],
    stats: Option<&kvtier::Stats>,
) -> serde_json::Value {
    let devices: Vec<serde_json::Value> = info
        .devices
        .iter()
        .map(|d| {
            serde_json::json!({
                "path": d.path.display().to_string(),
                "kind": d.kind,
                "direct": d.direct,
                "size_bytes": d.size_bytes,
                "slot_count": d.geometry.slot_count,
                "slot_bytes": d.geometry.slot_bytes,
                "formatted": d.formatted,
            })
        })
        .collect();
    let workers: Vec<serde_json::Value> = info
        .workers
        .iter()
        .map(|w| {
            serde_json::json!({
                "core": w.core,
                "pinned": w.pinned,
                "backend": w.backend,
                "recovered_blocks": w.recovered_blocks,
            })
        })
        .collect();
    let mut value = serde_json::json!({
        "block_bytes": info.block_bytes,
        "region_blocks": info.region_blocks,
        "region_backing": info.region_backing,
        "region_huge_percent": info.region_huge_percent,
        "open_seconds": info.open_seconds,
        "cores_available": cores,
        "devices": devices,
        "workers": workers,
    });
    if let Some(st) = stats {
        value["stats"] = serde_json::json!({
            "bytes_read": st.bytes_read,
            "bytes_written": st.bytes_written,
            "evictions": st.evictions,
            "checksum_failures": st.checksum_failures,
            "files_refused": st.files_refused,
            "io_timeouts": st.io_timeouts,
            "devices_failed": st.devices_failed,
            "table_writes": st.table_writes,
            "io_errors": st.io_errors,
            "blocks_stored": st.blocks_stored,
            "slots_total": st.slots_total,
            "recovered_blocks": st.recovered_blocks,
            "torn_entries": st.torn_entries,
            "worker_cpu_seconds": st.worker_cpu_seconds,
        });
    }
    value
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sizes_read_like_the_config() {
        assert_eq!(size(512), "512 B");
        assert_eq!(size(2 * MIB), "2 MiB");
        assert_eq!(size(3 * GIB / 2), "1.5 GiB");
        assert_eq!(size(256 * KIB), "256 KiB");
    }

    #[test]
    fn table_aligns_columns() {
        let mut t = Table::new(&["name", "n"]);
        t.row(vec!["a".into(), "100".into()]);
        t.row(vec!["longer".into(), "2".into()]);
        let text = t.to_string();
        assert_eq!(text, "name      n\na       100\nlonger    2\n");
    }
}
