//! `kvtier stats`: a live view of a running engine's metrics endpoint (`[metrics] listen`).
//!
//! Every interval it scrapes `GET /metrics`, takes the difference with the previous scrape and
//! prints one row: GiB/s loaded and stored per tier, the lookup hit rate, job latency p50/p99
//! (loads, loads while stores were in flight, stores; from the histogram buckets, interpolated
//! inside a bucket as Prometheus' `histogram_quantile` does), queued blocks, I/Os in flight and
//! errors. `--once --json` prints one such view as JSON for scripts; `--svg` draws the rows it
//! saw when it stops (after `--duration`, or at Ctrl-C).

use std::collections::HashMap;
use std::io::{Read, Write};
use std::net::TcpStream;
use std::path::PathBuf;
use std::process::ExitCode;
use std::time::{Duration, Instant};

use clap::Args;
use serde::Serialize;

use crate::output::{CliError, CliResult};

#[derive(Args)]
pub(crate) struct StatsArgs {
    /// The engine's metrics endpoint.
    #[arg(long, default_value = "http://127.0.0.1:9464/metrics")]
    url: String,
    /// Time between scrapes, milliseconds.
    #[arg(long, default_value_t = 1000, value_parser = clap::value_parser!(u64).range(50..=3_600_000))]
    interval_ms: u64,
    /// Print one view (two scrapes an interval apart) and exit.
    #[arg(long)]
    once: bool,
    /// JSON instead of a table (one object per view).
    #[arg(long)]
    json: bool,
    /// Stop after this many seconds.
    #[arg(long)]
    duration: Option<f64>,
    /// Draw what was seen (GiB/s, hit rate, load p99 with and without stores) to this SVG.
    #[arg(long, value_name = "PATH.svg")]
    svg: Option<PathBuf>,
}

/// One sample: family-level name, labels, value.
#[derive(Clone, Debug, PartialEq)]
pub(crate) struct Sample {
    pub name: String,
    pub labels: Vec<(String, String)>,
    pub value: f64,
}

impl Sample {
    fn label(&self, k: &str) -> Option<&str> {
        self.labels
            .iter()
            .find(|(key, _)| key == k)
            .map(|(_, v)| v.as_str())
    }
}

/// Parses the Prometheus text format's sample lines (comments skipped).
pub(crate) fn parse(text: &str) -> Result<Vec<Sample>, String> {
    let mut out = Vec::new();
    for (n, line) in text.lines().enumerate() {
        let line = line.trim();
        if line.is_empty() || line.starts_with('#') {
            continue;
        }
        out.push(parse_line(line).map_err(|e| format!("line {}: {e}: {line:?}", n + 1))?);
    }
    Ok(out)
}

fn parse_line(line: &str) -> Result<Sample, String> {
    let name_end = line
        .find(|c: char| c == '{' || c.is_whitespace())
        .ok_or("no value")?;
    let name = line[..name_end].to_owned();
    let mut rest = &line[name_end..];
    let mut labels = Vec::new();
    if let Some(r) = rest.strip_prefix('{') {
        let mut chars = r.char_indices().peekable();
        let end;
        loop {
            // key
            let start = match chars.peek() {
                Some(&(_, '}')) => {
                    end = chars.next().map(|(i, _)| i);
                    break;
                }
                Some(&(i, _)) => i,
                None => return Err("unterminated labels".into()),
            };
            let mut key_end = start;
            for (i, c) in chars.by_ref() {
                if c == '=' {
                    key_end = i;
                    break;
                }
            }
            let key = r[start..key_end].trim_start_matches(',').trim().to_owned();
            if chars.next().map(|(_, c)| c) != Some('"') {
                return Err(format!("label {key}: no opening quote"));
            }
            let mut value = String::new();
            loop {
                match chars.next() {
                    Some((_, '\\')) => match chars.next() {
                        Some((_, 'n')) => value.push('\n'),
                        Some((_, c)) => value.push(c),
                        None => return Err("unterminated escape".into()),
                    },
                    Some((_, '"')) => break,
                    Some((_, c)) => value.push(c),
                    None => return Err(format!("label {key}: unterminated value")),
                }
            }
            labels.push((key, value));
            if let Some(&(_, ',')) = chars.peek() {
                chars.next();
            }
        }
        let end: usize = end.ok_or("unterminated labels")?;
        rest = &r[end + 1..];
    }
    let value = rest
        .split_whitespace()
        .next()
        .ok_or("no value")?
        .parse::<f64>()
        .map_err(|e| format!("value: {e}"))?;
    Ok(Sample {
        name,
        labels,
        value,
    })
}

/// Fetches `url` (http only) and returns the body of a 200 answer.
pub(crate) fn fetch(url: &str) -> Result<String, String> {
    let rest = url
        .strip_prefix("http://")
        .ok_or_else(|| format!("--url {url:?}: only http:// URLs are served by kvtier"))?;
    let (host, path) = match rest.find('/') {
        Some(i) => (&rest[..i], &rest[i..]),
        None => (rest, "/metrics"),
    };
    let addr = std::net::ToSocketAddrs::to_socket_addrs(host)
        .map_err(|e| format!("--url {url:?}: {host}: {e}"))?
        .next()
        .ok_or_else(|| format!("--url {url:?}: {host} has no address"))?;
    let mut s = TcpStream::connect_timeout(&addr, Duration::from_secs(5)).map_err(|e| {
        format!("{url}: {e} (is the engine running with [metrics] listen = \"{host}\"?)")
    })?;
    let timeout = Some(Duration::from_secs(10));
    s.set_read_timeout(timeout).map_err(|e| e.to_string())?;
    s.set_write_timeout(timeout).map_err(|e| e.to_string())?;
    write!(
        s,
        "GET {path} HTTP/1.1\r\nHost: {host}\r\nAccept: text/plain\r\nConnection: close\r\n\r\n"
    )
    .map_err(|e| format!("{url}: {e}"))?;
    let mut raw = Vec::new();
    s.read_to_end(&mut raw).map_err(|e| format!("{url}: {e}"))?;
    let raw = String::from_utf8(raw).map_err(|_| format!("{url}: the answer is not UTF-8"))?;
    let (head, body) = raw
        .split_once("\r\n\r\n")
        .ok_or_else(|| format!("{url}: not an HTTP answer"))?;
    let status = head.lines().next().unwrap_or("");
    if !status.contains(" 200 ") {
        return Err(format!("{url}: {status}"));
    }
    Ok(body.to_owned())
}

/// A scrape, indexed for the view.
struct Scrape {
    at: Instant,
    samples: Vec<Sample>,
}

impl Scrape {
    fn sum(&self, name: &str, having: &[(&str, &str)]) -> f64 {
        self.samples
            .iter()
            .filter(|s| s.name == name && having.iter().all(|(k, v)| s.label(k) == Some(*v)))
            .map(|s| s.value)
            .sum()
    }

    /// Cumulative buckets (le, count) of histogram `name` with `having`, summed over the rest.
    fn buckets(&self, name: &str, having: &[(&str, &str)]) -> Vec<(f64, f64)> {
        let mut by_le: HashMap<u64, (f64, f64)> = HashMap::new();
        for s in &self.samples {
            if s.name != format!("{name}_bucket")
                || !having.iter().all(|(k, v)| s.label(k) == Some(*v))
            {
                continue;
            }
            let le = match s.label("le") {
                Some("+Inf") => f64::INFINITY,
                Some(v) => v.parse().unwrap_or(f64::NAN),
                None => continue,
            };
            let e = by_le.entry(le.to_bits()).or_insert((le, 0.0));
            e.1 += s.value;
        }
        let mut v: Vec<(f64, f64)> = by_le.into_values().collect();
        v.sort_by(|a, b| a.0.total_cmp(&b.0));
        v
    }
}

/// Quantile `q` of the observations between two cumulative bucket lists, seconds; `None` with
/// none. Linear inside the bucket it falls in; the last finite bound if it falls in +Inf.
fn quantile(before: &[(f64, f64)], after: &[(f64, f64)], q: f64) -> Option<f64> {
    let prev: HashMap<u64, f64> = before.iter().map(|(le, n)| (le.to_bits(), *n)).collect();
    let delta: Vec<(f64, f64)> = after
        .iter()
        .map(|(le, n)| (*le, n - prev.get(&le.to_bits()).copied().unwrap_or(0.0)))
        .collect();
    let total = delta.last()?.1;
    if total <= 0.0 {
        return None;
    }
    let rank = q * total;
    let (mut lo, mut below) = (0.0, 0.0);
    for &(le, n) in &delta {
        if n >= rank {
            if le.is_infinite() {
                return Some(lo);
            }
            let inside = n - below;
            let frac = if inside > 0.0 {
                (rank - below) / inside
            } else {
                1.0
            };
            return Some(lo + (le - lo) * frac);
        }
        lo = le;
        below = n;
    }
    Some(lo)
}

/// One row of the live view: rates and latencies over the last interval, gauges now.
#[derive(Clone, Debug, Default, Serialize)]
pub(crate) struct View {
    pub seconds: f64,
    pub nvme_load_gib_s: f64,
    pub nvme_store_gib_s: f64,
    pub s3_load_gib_s: f64,
    pub s3_store_gib_s: f64,
    /// Hits (NVMe or S3) per key looked up; `None` without lookups.
    pub hit_rate: Option<f64>,
    pub load_jobs: f64,
    pub store_jobs: f64,
    pub load_p50_ms: Option<f64>,
    pub load_p99_ms: Option<f64>,
    pub load_under_stores_p99_ms: Option<f64>,
    pub store_p99_ms: Option<f64>,
    pub queued_loads: f64,
    pub queued_stores: f64,
    pub inflight_ios: f64,
    pub jobs_in_flight: f64,
    /// Device errors, timeouts, checksum failures, S3 errors and backpressure refusals in
    /// the interval.
    pub errors: f64,
    pub refusals: f64,
}

fn view(a: &Scrape, b: &Scrape, started: Instant) -> View {
    let dt = b.at.duration_since(a.at).as_secs_f64().max(1e-9);
    let rate =
        |name: &str, having: &[(&str, &str)]| (b.sum(name, having) - a.sum(name, having)) / dt;
    let gib = |tier: &str, op: &str| {
        rate("kvtier_moved_bytes_total", &[("tier", tier), ("op", op)]) / f64::from(1u32 << 30)
    };
    let d = |name: &str, having: &[(&str, &str)]| b.sum(name, having) - a.sum(name, having);
    let looked = d("kvtier_lookups_total", &[]);
    let hits = d("kvtier_lookups_total", &[("answer", "hit_nvme")])
        + d("kvtier_lookups_total", &[("answer", "hit_s3")]);
    let q = |name: &str, having: &[(&str, &str)], q: f64| {
        quantile(&a.buckets(name, having), &b.buckets(name, having), q).map(|s| s * 1e3)
    };
    let errors = d("kvtier_device_errors_total", &[])
        + d("kvtier_device_timeouts_total", &[])
        + d("kvtier_device_checksum_failures_total", &[])
        + d("kvtier_s3_errors_total", &[]);
    View {
        seconds: b.at.duration_since(started).as_secs_f64(),
        nvme_load_gib_s: gib("nvme", "load"),
        nvme_store_gib_s: gib("nvme", "store"),
        s3_load_gib_s: gib("s3", "load"),
        s3_store_gib_s: gib("s3", "store"),
        hit_rate: (looked > 0.0).then(|| hits / looked),
        load_jobs: d("kvtier_jobs_total", &[("op", "load")]),
        store_jobs: d("kvtier_jobs_total", &[("op", "store")]),
        load_p50_ms: q("kvtier_job_seconds", &[("op", "load")], 0.5),
        load_p99_ms: q("kvtier_job_seconds", &[("op", "load")], 0.99),
        load_under_stores_p99_ms: q("kvtier_load_job_under_stores_seconds", &[], 0.99),
        store_p99_ms: q("kvtier_job_seconds", &[("op", "store")], 0.99),
        queued_loads: b.sum("kvtier_worker_queued_blocks", &[("op", "load")]),
        queued_stores: b.sum("kvtier_worker_queued_blocks", &[("op", "store")]),
        inflight_ios: b.sum("kvtier_worker_inflight_ios", &[]),
        jobs_in_flight: b.sum("kvtier_jobs_in_flight", &[]),
        errors,
        refusals: d("kvtier_backpressure_refusals_total", &[]),
    }
}

fn opt(v: Option<f64>, width: usize) -> String {
    v.map_or_else(|| format!("{:>width$}", "-"), |x| format!("{x:>width$.2}"))
}

const HEADER: &str = "     t  nvme_ld  nvme_st   s3_ld   s3_st   hit%  ld_p50  ld_p99 ldst_p99  st_p99  q_ld  q_st  infl  jobs  errs  refus";

fn row(v: &View) -> String {
    format!(
        "{:>6.1} {:>8.2} {:>8.2} {:>7.2} {:>7.2} {:>6} {} {} {} {} {:>5} {:>5} {:>5} {:>5} {:>5} {:>6}",
        v.seconds,
        v.nvme_load_gib_s,
        v.nvme_store_gib_s,
        v.s3_load_gib_s,
        v.s3_store_gib_s,
        v.hit_rate
            .map_or_else(|| "-".to_owned(), |h| format!("{:.1}", h * 100.0)),
        opt(v.load_p50_ms, 7),
        opt(v.load_p99_ms, 7),
        opt(v.load_under_stores_p99_ms, 8),
        opt(v.store_p99_ms, 7),
        v.queued_loads,
        v.queued_stores,
        v.inflight_ios,
        v.jobs_in_flight,
        v.errors,
        v.refusals,
    )
}

pub(crate) fn run(args: &StatsArgs) -> CliResult<ExitCode> {
    let scrape = || -> CliResult<Scrape> {
        let body = fetch(&args.url).map_err(CliError::runtime)?;
        let samples = parse(&body).map_err(|e| CliError::runtime(format!("{}: {e}", args.url)))?;
        Ok(Scrape {
            at: Instant::now(),
            samples,
        })
    };
    let interval = Duration::from_millis(args.interval_ms);
    let started = Instant::now();
    let stop_at = match args.duration {
        None => None,
        Some(s) => Some(
            Duration::try_from_secs_f64(s)
                .ok()
                .and_then(|d| started.checked_add(d))
                .ok_or_else(|| {
                    CliError::usage(format!(
                        "--duration {s}: a number of seconds, at least 0 (and not absurdly large)"
                    ))
                })?,
        ),
    };
    crate::interrupt::install();
    let mut prev = scrape()?;
    let mut seen = Vec::new();
    let mut out = std::io::stdout().lock();
    if !args.json && !args.once {
        let _ = writeln!(
            out,
            "GiB/s, ms, blocks; every {} ms from {}",
            args.interval_ms, args.url
        );
    }
    loop {
        std::thread::sleep(interval);
        let now = match scrape() {
            Ok(s) => s,
            // The engine went away mid-view: keep what was seen (for --svg), say so.
            Err(e) if !seen.is_empty() => {
                eprintln!("stopped: {e}");
                break;
            }
            Err(e) => return Err(e),
        };
        let v = view(&prev, &now, started);
        if args.json {
            let _ = writeln!(out, "{}", serde_json::to_string(&v).unwrap_or_default());
        } else {
            if seen.len() % 20 == 0 {
                let _ = writeln!(out, "{HEADER}");
            }
            let _ = writeln!(out, "{}", row(&v));
        }
        let _ = out.flush();
        seen.push(v);
        prev = now;
        let done = args.once
            || stop_at.is_some_and(|t| Instant::now() >= t)
            || crate::interrupt::requested();
        if done {
            break;
        }
    }
    if let Some(path) = &args.svg {
        plot::draw(path, &seen)?;
        eprintln!("wrote {}", path.display());
    }
    Ok(ExitCode::SUCCESS)
}

/// The SVG: three panels over time (GiB/s, load p99 with and without stores, hit rate).
mod plot {
    use std::path::Path;

    use plotters::prelude::*;

    use super::View;
    use crate::output::{CliError, CliResult};

    const LOAD: RGBColor = RGBColor(31, 119, 180);
    const STORE: RGBColor = RGBColor(214, 39, 40);
    const UNDER: RGBColor = RGBColor(255, 127, 14);

    pub(super) fn draw(path: &Path, views: &[View]) -> CliResult<()> {
        let root = SVGBackend::new(path, (900, 900)).into_drawing_area();
        draw_on(&root, views)
            .map_err(|e| CliError::runtime(format!("drawing {}: {e}", path.display())))?;
        root.present()
            .map_err(|e| CliError::runtime(format!("writing {}: {e}", path.display())))
    }

    type Result<T> = std::result::Result<T, Box<dyn std::error::Error>>;

    fn draw_on(
        root: &DrawingArea<SVGBackend<'_>, plotters::coord::Shift>,
        v: &[View],
    ) -> Result<()> {
        root.fill(&WHITE)?;
        let panels = root.split_evenly((3, 1));
        let t_max = v.last().map_or(1.0, |x| x.seconds).max(1.0);
        let line = |f: &dyn Fn(&View) -> Option<f64>| -> Vec<(f64, f64)> {
            v.iter()
                .filter_map(|x| f(x).map(|y| (x.seconds, y)))
                .collect()
        };
        let top = |series: &[&Vec<(f64, f64)>]| {
            series
                .iter()
                .flat_map(|s| s.iter().map(|p| p.1))
                .fold(0.0f64, f64::max)
                .max(1e-3)
                * 1.15
        };
        let series = [
            (
                "GiB/s (NVMe)",
                vec![
                    ("loads", LOAD, line(&|x| Some(x.nvme_load_gib_s))),
                    ("stores", STORE, line(&|x| Some(x.nvme_store_gib_s))),
                ],
            ),
            (
                "load job p99, ms",
                vec![
                    ("all loads", LOAD, line(&|x| x.load_p99_ms)),
                    (
                        "loads while stores ran",
                        UNDER,
                        line(&|x| x.load_under_stores_p99_ms),
                    ),
                ],
            ),
            (
                "lookup hit rate, %",
                vec![("hits", LOAD, line(&|x| x.hit_rate.map(|h| h * 100.0)))],
            ),
        ];
        for (panel, (title, lines)) in panels.iter().zip(series) {
            let y_max = if title.starts_with("lookup") {
                105.0
            } else {
                top(&lines.iter().map(|l| &l.2).collect::<Vec<_>>())
            };
            let mut chart = ChartBuilder::on(panel)
                .caption(title, ("sans-serif", 18))
                .margin(12)
                .x_label_area_size(32)
                .y_label_area_size(56)
                .build_cartesian_2d(0.0..t_max, 0.0..y_max)?;
            chart
                .configure_mesh()
                .x_desc("seconds")
                .x_labels(10)
                .y_labels(6)
                .draw()?;
            for (name, color, points) in lines {
                chart
                    .draw_series(LineSeries::new(points, color.stroke_width(2)))?
                    .label(name)
                    .legend(move |(x, y)| {
                        PathElement::new(vec![(x, y), (x + 18, y)], color.stroke_width(2))
                    });
            }
            chart
                .configure_series_labels()
                .position(SeriesLabelPosition::LowerRight)
                .background_style(WHITE.mix(0.85))
                .border_style(BLACK)
                .draw()?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_labels_with_escapes_and_values() {
        let text = "# HELP x y\nkvtier_a_total{op=\"load\",device=\"/d \\\"q\\\" \\\\ z\"} 12\n\
                    kvtier_b 1.5e-05\nkvtier_c_bucket{le=\"+Inf\"} 3\n";
        let s = parse(text).expect("parses");
        assert_eq!(s.len(), 3);
        assert_eq!(s[0].name, "kvtier_a_total");
        assert_eq!(s[0].label("op"), Some("load"));
        assert_eq!(s[0].label("device"), Some("/d \"q\" \\ z"));
        assert!((s[0].value - 12.0).abs() < f64::EPSILON);
        assert!((s[1].value - 1.5e-5).abs() < 1e-12);
        assert_eq!(s[2].label("le"), Some("+Inf"));
        assert!(parse("kvtier_x{op=\"load} 1").is_err());
        assert!(parse("kvtier_x nope").is_err());
    }

    #[test]
    fn quantile_interpolates_inside_the_bucket_of_the_interval() {
        let before = vec![(0.001, 10.0), (0.002, 10.0), (f64::INFINITY, 10.0)];
        // 100 new observations: 50 below 1 ms, 50 between 1 and 2 ms.
        let after = vec![(0.001, 60.0), (0.002, 110.0), (f64::INFINITY, 110.0)];
        let p50 = quantile(&before, &after, 0.5).expect("some");
        assert!((p50 - 0.001).abs() < 1e-12, "{p50}");
        let p99 = quantile(&before, &after, 0.99).expect("some");
        assert!((p99 - 0.00198).abs() < 1e-9, "{p99}");
        assert_eq!(quantile(&after, &after, 0.5), None, "nothing new");
    }
}
