//! `kvtier stats` against a running bench's metrics endpoint, and `KVTIER_LOG_FORMAT=json`:
//! the live view reads real figures (GiB/s, jobs, hit rate, latency), fails clearly without an
//! endpoint, and every log line is one JSON object.

mod common;

use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use common::kvtier;

fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .expect("a free port")
        .port()
}

#[test]
fn stats_once_json_reads_a_running_bench() {
    let dir = tempfile::Builder::new()
        .prefix("kvtier-stats-test-")
        .tempdir_in("/var/tmp")
        .expect("scratch");
    let port = free_port();
    let listen = format!("127.0.0.1:{port}");
    let mut bench = Command::new(env!("CARGO_BIN_EXE_kvtier"))
        .args([
            "bench",
            "--workload",
            "load",
            "--block-size",
            "256KiB",
            "--blocks",
            "64",
            "--queue-depth",
            "8",
            "--duration",
            "6",
            "--dir",
            dir.path().to_str().expect("utf-8"),
            "--metrics-listen",
            &listen,
        ])
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .expect("bench starts");
    let url = format!("http://{listen}/metrics");
    let deadline = Instant::now() + Duration::from_mins(1);
    let view = loop {
        let out = kvtier(&[
            "stats",
            "--url",
            &url,
            "--once",
            "--json",
            "--interval-ms",
            "500",
        ]);
        if out.status.success() {
            let v: serde_json::Value =
                serde_json::from_slice(&out.stdout).expect("one JSON object");
            // Wait for the timed load phase (after the store phase).
            if v["load_jobs"].as_f64().unwrap_or(0.0) > 0.0 {
                break v;
            }
        }
        assert!(
            Instant::now() < deadline,
            "no view of a loading bench within 60 s"
        );
        std::thread::sleep(Duration::from_millis(200));
    };
    let status = bench.wait().expect("bench ends");
    assert!(status.success(), "bench failed");
    assert!(
        view["nvme_load_gib_s"].as_f64().expect("a number") > 0.0,
        "{view}"
    );
    assert!(
        view["load_p50_ms"].as_f64().expect("a latency") > 0.0,
        "{view}"
    );
    let p99 = view["load_p99_ms"].as_f64().expect("a latency");
    assert!(
        p99 >= view["load_p50_ms"].as_f64().unwrap_or(f64::MAX),
        "{view}"
    );
    assert!(
        (view["errors"].as_f64().expect("a number")).abs() < f64::EPSILON,
        "{view}"
    );
    assert!(view["seconds"].as_f64().expect("a number") > 0.0);
}

#[test]
fn stats_without_an_endpoint_says_where_it_looked() {
    let port = free_port();
    let url = format!("http://127.0.0.1:{port}/metrics");
    let out = kvtier(&["stats", "--url", &url, "--once"]);
    assert_eq!(out.status.code(), Some(1));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains(&url) && err.contains("[metrics] listen"),
        "{err}"
    );
    let out = kvtier(&["stats", "--url", "https://127.0.0.1:1/metrics", "--once"]);
    assert!(String::from_utf8_lossy(&out.stderr).contains("only http://"));
}

#[test]
fn json_log_format_gives_one_object_per_line() {
    let out = Command::new(env!("CARGO_BIN_EXE_kvtier"))
        .args(["probe"])
        .env_remove("RUST_LOG")
        .env("KVTIER_LOG_FORMAT", "json")
        .env("RUST_LOG", "debug")
        .output()
        .expect("runs");
    let err = String::from_utf8_lossy(&out.stderr);
    let lines: Vec<&str> = err.lines().filter(|l| !l.trim().is_empty()).collect();
    assert!(!lines.is_empty(), "probe logs something at debug");
    for l in lines {
        let v: serde_json::Value =
            serde_json::from_str(l).unwrap_or_else(|e| panic!("not JSON ({e}): {l}"));
        assert!(
            v["level"].is_string() && v["fields"]["message"].is_string(),
            "{l}"
        );
    }
}
