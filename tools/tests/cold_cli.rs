//! `kvtier bench --workload cold` end to end against a local S3 server (s3s-fs, installed by
//! `.ci/run`): it must run every phase, verify every loaded block, report the engine next to the
//! plain SDK loop, and leave the bucket as it found it.

mod common;
#[path = "../../tests/common/s3.rs"]
mod s3;

use common::kvtier;
use s3::{S3Server, ACCESS_KEY, BUCKET, SECRET_KEY};

#[test]
fn cold_bench_reports_engine_and_plain_sdk_and_cleans_up() {
    let server = S3Server::start();
    let dir = tempfile::Builder::new()
        .prefix("kvtier-cold-test-")
        .tempdir_in("/var/tmp")
        .expect("scratch");
    let endpoint = server.endpoint();
    let out = kvtier(&[
        "bench",
        "--workload",
        "cold",
        "--s3-endpoint",
        &endpoint,
        "--s3-bucket",
        BUCKET,
        "--s3-access-key",
        ACCESS_KEY,
        "--s3-secret-key",
        SECRET_KEY,
        "--s3-concurrency",
        "4",
        "--blocks",
        "6",
        "--rounds",
        "2",
        "--block-size",
        "256KiB",
        "--duration",
        "1",
        "--json",
        "-",
        "--dir",
        dir.path().to_str().expect("utf-8"),
    ]);
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "exit {:?}\n{err}", out.status);
    let doc: serde_json::Value = serde_json::from_slice(&out.stdout).expect("JSON on stdout");
    assert_eq!(doc["workload"], "cold");
    assert_eq!(doc["object_bytes"], 256 * 1024);
    for op in ["put_gib_s", "get_gib_s"] {
        for side in ["engine", "plain_sdk"] {
            let v = doc[op][side].as_f64().expect("rate");
            assert!(v > 0.0, "{op}.{side} = {v}");
        }
        assert_eq!(doc[op]["engine_rounds"].as_array().map(Vec::len), Some(2));
    }
    for phase in ["alone", "during_s3"] {
        let loads = doc["nvme_load_latency"][phase]["loads"]
            .as_u64()
            .expect("loads");
        assert!(loads > 0, "{phase}: no NVMe loads");
    }
    assert!(
        doc["nvme_load_latency"]["s3_gib_s_during"]
            .as_f64()
            .expect("rate")
            > 0.0
    );
    // The table went to stderr (stdout is the JSON), and the secret never shows.
    assert!(err.contains("plain SDK GiB/s"), "{err}");
    assert!(!err.contains(SECRET_KEY), "{err}");
    // Every object the bench wrote is deleted.
    assert_eq!(server.client().list(), Vec::<String>::new());
}

#[test]
fn cold_bench_without_an_endpoint_says_what_it_needs() {
    let out = kvtier(&["bench", "--workload", "cold", "--duration", "1"]);
    assert_eq!(out.status.code(), Some(2), "{out:?}");
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("--s3-endpoint") && err.contains("[s3]"),
        "{err}"
    );
}
