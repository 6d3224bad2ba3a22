//! End-to-end tests of the `kvtier` binary: each runs the built command as a user would and
//! checks its exit code and output. They catch a broken argument surface, a bench that stops
//! verifying data or mislabels its workloads, JSON that no longer parses, and error paths that
//! exit with the wrong code. Scratch data goes under /var/tmp (not /tmp, which may be tmpfs and
//! refuse `O_DIRECT`); each test uses its own temporary directory.

mod common;

use std::path::{Path, PathBuf};
use std::process::Output;

use common::kvtier;

fn scratch() -> tempfile::TempDir {
    tempfile::Builder::new()
        .prefix("kvtier-cli-test-")
        .tempdir_in("/var/tmp")
        .expect("a temporary directory in /var/tmp")
}

fn stderr(out: &Output) -> String {
    String::from_utf8_lossy(&out.stderr).into_owned()
}

fn json_stdout(out: &Output) -> serde_json::Value {
    serde_json::from_slice(&out.stdout).unwrap_or_else(|e| {
        panic!(
            "stdout is not JSON ({e}):\n{}\nstderr:\n{}",
            String::from_utf8_lossy(&out.stdout),
            stderr(out)
        )
    })
}

/// Runs `kvtier` with `args` and checks that it succeeded (else fails with its stderr).
fn kvtier_ok(args: &[&str]) -> Output {
    let out = kvtier(args);
    assert!(
        out.status.success(),
        "exit {:?}\n{}",
        out.status,
        stderr(&out)
    );
    out
}

fn path_str(path: &Path) -> &str {
    path.to_str().expect("temporary paths are UTF-8")
}

// The full bench on a small data set: every phase must run, be named as documented, and every
// loaded block must verify; the scratch directory must be gone afterwards.
/// Runs `kvtier bench --workload all` on 256 KiB blocks at queue depth 8 for 1 s with JSON on
/// stdout, plus `extra` arguments; checks that it succeeds, reports all five workloads, verifies
/// every loaded block, stores `blocks` blocks and loads some. Returns the JSON and stdout.
fn bench_all(dir: &Path, blocks: u64, extra: &[&str]) -> (serde_json::Value, Output) {
    let blocks_arg = blocks.to_string();
    let mut args = vec!["bench"];
    args.extend_from_slice(extra);
    args.extend_from_slice(&[
        "--workload",
        "all",
        "--blocks",
        &blocks_arg,
        "--block-size",
        "256KiB",
        "--queue-depth",
        "8",
        "--duration",
        "1",
        "--json",
        "-",
        "--dir",
        path_str(dir),
    ]);
    let out = kvtier_ok(&args);
    let doc = json_stdout(&out);
    let results = doc["results"].as_array().expect("results array");
    let names: Vec<&str> = results
        .iter()
        .map(|r| r["workload"].as_str().expect("workload name"))
        .collect();
    for want in ["store", "load", "load_alone", "mixed_load", "mixed_store"] {
        assert!(names.contains(&want), "{want} missing from {names:?}");
    }
    for r in results {
        assert_eq!(r["corrupt_blocks"], 0, "{r}");
        assert_eq!(r["block_size"], 256 * 1024, "{r}");
    }
    let store = results
        .iter()
        .find(|r| r["workload"] == "store")
        .expect("store row");
    assert_eq!(store["bytes"], blocks * 256 * 1024, "{store}");
    let load = results
        .iter()
        .find(|r| r["workload"] == "load")
        .expect("load row");
    assert!(
        load["verified_blocks"].as_u64().expect("count") > 0,
        "{load}"
    );
    (doc, out)
}

#[test]
fn bench_all_small_verifies_and_reports_five_workloads() {
    let dir = scratch();
    let (doc, out) = bench_all(dir.path(), 64, &[]);
    for r in doc["results"].as_array().expect("results array") {
        assert_eq!(r["queue_depth"], 8, "{r}");
        for field in ["bytes", "seconds", "gib_per_s", "p99_us", "cpu_seconds"] {
            assert!(r[field].is_number(), "{field} in {r}");
        }
        // Every phase moved blocks through the device: its device ops are counted, and a
        // worker entered the kernel to submit them.
        let io = &r["worker_io"];
        let ops = io["device_ops"].as_u64().expect("device_ops");
        let blocks = r["bytes"].as_u64().expect("bytes") / (256 * 1024);
        assert!(ops >= blocks, "{ops} device ops for {blocks} blocks: {r}");
        assert!(io["enters"].as_u64().expect("enters") > 0, "{r}");
        assert!(io["sleeps"].is_u64(), "{r}");
    }
    assert!(
        stderr(&out).contains("per device op (reads, writes, table pages)"),
        "the table says the workers' enters and sleeps per op"
    );
    assert!(doc["config"]
        .as_str()
        .expect("config text")
        .contains("256 KiB"));
    assert!(doc["engine"]["devices"].is_array());
    assert!(
        stderr(&out).contains("workload"),
        "with --json - the table goes to stderr"
    );
    let left: Vec<PathBuf> = std::fs::read_dir(dir.path())
        .expect("read scratch parent")
        .map(|e| e.expect("entry").path())
        .collect();
    assert!(left.is_empty(), "scratch directory not removed: {left:?}");
}

// Jobs of several blocks (as vLLM's tier submits): every phase runs and verifies, the store
// phase's last job is a short one (66 keys in jobs of 4) and still stores every key, and the
// run says the job size.
#[test]
fn bench_in_jobs_of_several_blocks_verifies() {
    let dir = scratch();
    let (doc, out) = bench_all(dir.path(), 66, &["--blocks-per-job", "4"]);
    assert_eq!(doc["run"]["blocks_per_job"], 4, "{doc}");
    assert_eq!(doc["run"]["queue_depth"], 8, "{doc}");
    assert!(
        stderr(&out).contains("queue depth 8, in jobs of 4 blocks"),
        "{}",
        stderr(&out)
    );
}

// A job size that does not divide the queue depth is refused before anything is opened, naming
// both values.
#[test]
fn bench_refuses_a_job_size_that_does_not_divide_the_queue_depth() {
    let out = kvtier(&["bench", "--queue-depth", "8", "--blocks-per-job", "3"]);
    assert_eq!(out.status.code(), Some(2), "{}", stderr(&out));
    let err = stderr(&out);
    assert!(
        err.contains("--queue-depth 8 is not a multiple of --blocks-per-job 3"),
        "{err}"
    );
}

// `--keep` leaves the slab and a config beside it; `inspect` on that config must find every
// stored block and verify all of them without touching anything else.
#[test]
fn kept_bench_store_is_inspectable() {
    let dir = scratch();
    kvtier_ok(&[
        "bench",
        "--workload",
        "store",
        "--blocks",
        "32",
        "--block-size",
        "64KiB",
        "--queue-depth",
        "4",
        "--keep",
        "--dir",
        path_str(dir.path()),
    ]);
    let kept = std::fs::read_dir(dir.path())
        .expect("read scratch parent")
        .map(|e| e.expect("entry").path())
        .find(|p| p.join("kvtier-bench.toml").exists())
        .expect("--keep leaves the scratch directory with its config");
    let config = kept.join("kvtier-bench.toml");
    let out = kvtier_ok(&["inspect", "--config", path_str(&config), "--json"]);
    let doc = json_stdout(&out);
    assert_eq!(doc["devices"][0]["blocks_stored"], 32, "{doc}");
    assert_eq!(doc["verify"]["keys"], 32, "{doc}");
    assert_eq!(doc["verify"]["ok"], 32, "{doc}");
    assert_eq!(doc["verify"]["checksum_failures"], 0, "{doc}");
}

// The probe must always answer, in JSON, with an io_uring section.
#[test]
fn probe_json_has_io_uring_section() {
    let out = kvtier_ok(&["probe", "--json", "--dir", "/var/tmp"]);
    let doc = json_stdout(&out);
    assert!(doc["io_uring"]["available"].is_boolean(), "{doc}");
    assert!(doc["io_uring"]["opcodes"].is_object(), "{doc}");
    assert!(doc["hugepages"]["thp_mode"].is_string(), "{doc}");
    assert!(doc["advice"].is_array(), "{doc}");
}

// A bad config is a usage error (exit 2) whose message names the field; a good one prints the
// effective config.
#[test]
fn config_check_names_the_bad_field() {
    let dir = scratch();
    let bad = dir.path().join("bad.toml");
    std::fs::write(&bad, "block_size = 6000\n[[devices]]\npath = \"/x\"\n").expect("write");
    let out = kvtier(&["config-check", path_str(&bad)]);
    assert_eq!(out.status.code(), Some(2), "{}", stderr(&out));
    assert!(stderr(&out).contains("error: "), "{}", stderr(&out));
    assert!(stderr(&out).contains("block_size"), "{}", stderr(&out));

    let example = Path::new(env!("CARGO_MANIFEST_DIR")).join("../kvtier.example.toml");
    let out = kvtier(&["config-check", path_str(&example)]);
    assert!(out.status.success(), "{}", stderr(&out));
    assert!(String::from_utf8_lossy(&out.stdout).contains("[[devices]]"));
}

// `--layout files` with no config: the bench fills in a default namespace and makes the scratch
// device a directory; every phase must run and every loaded block verify, as on the slab.
#[test]
fn bench_files_layout_runs_and_verifies() {
    let dir = scratch();
    let (doc, _) = bench_all(dir.path(), 32, &["--layout", "files"]);
    assert_eq!(doc["engine"]["devices"][0]["kind"], "directory", "{doc}");
    let config = doc["config"].as_str().expect("config text");
    assert!(
        config.contains("layout = \"files\"") && config.contains("kvtier-bench"),
        "{config}"
    );
}

/// `kvtier bench --workload store --lookup-threads 1 --lookup-keys KEYS` on `layout`, with JSON
/// on stdout; returns the `lookups` object.
fn bench_lookups(keys: &str, layout: &str) -> serde_json::Value {
    let dir = scratch();
    let out = kvtier_ok(&[
        "bench",
        "--workload",
        "store",
        "--layout",
        layout,
        "--blocks",
        "512",
        "--block-size",
        "64KiB",
        "--queue-depth",
        "4",
        "--lookup-threads",
        "1",
        "--lookup-keys",
        keys,
        "--json",
        "-",
        "--dir",
        path_str(dir.path()),
    ]);
    assert!(
        stderr(&out).contains(&format!("{keys} keys:")),
        "the lookup line names the keys asked for:\n{}",
        stderr(&out)
    );
    let lookups = json_stdout(&out)["lookups"].clone();
    assert_eq!(lookups["keys"], keys, "{lookups}");
    assert_eq!(lookups["threads"], 1, "{lookups}");
    let count = |field: &str| lookups[field].as_u64().expect("a count");
    let asked = count("hits") + count("misses") + count("pending");
    assert_eq!(asked % 64, 0, "whole calls of 64 keys: {lookups}");
    assert!(
        lookups["keys_per_second"].as_f64().expect("a rate") > 0.0,
        "{lookups}"
    );
    lookups
}

// `--lookup-keys stored` asks only for keys whose store has finished: on either layout, with
// nothing evicted and no store failing, every answer is a hit. `mixed` (the default) asks for
// keys half of which are never stored: some answers are misses.
#[test]
fn bench_lookups_of_stored_keys_all_hit() {
    for layout in ["slab", "files"] {
        let lookups = bench_lookups("stored", layout);
        assert!(lookups["hits"].as_u64() > Some(0), "{layout}: {lookups}");
        assert_eq!(lookups["misses"], 0, "{layout}: {lookups}");
        assert_eq!(lookups["pending"], 0, "{layout}: {lookups}");
    }
    let lookups = bench_lookups("mixed", "slab");
    assert!(lookups["misses"].as_u64() > Some(0), "{lookups}");
}
