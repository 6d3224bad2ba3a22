//! The metrics endpoint and text: scraped over HTTP while jobs run, every counter moves by
//! exactly the work done (jobs, blocks, bytes, lookups, errors by device and class), and the
//! endpoint's errors (port in use, bad address) are clear. The Python tests parse the same text
//! with `prometheus_client`'s parsers.
// Counter values are integers, exact in an f64: compared exactly on purpose.
#![allow(clippy::float_cmp, clippy::field_reassign_with_default)]

mod common;

use std::collections::HashMap;
use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::time::Duration;

use common::{key, load, open_real, open_sim, put, region, sim_config, store, wait_results, BLOCK};
use kvtier::config::{Cores, DeviceConfig};
use kvtier::sim::{Faults, SimStorage};
use kvtier::{Config, Engine, Job};

/// `GET path` with `accept`; the status line and the body.
fn get(addr: SocketAddr, path: &str, accept: &str) -> (String, String, String) {
    let mut s = TcpStream::connect_timeout(&addr, Duration::from_secs(5)).expect("connect");
    s.set_read_timeout(Some(Duration::from_secs(10)))
        .expect("timeout");
    write!(
        s,
        "GET {path} HTTP/1.1\r\nHost: x\r\nAccept: {accept}\r\nConnection: close\r\n\r\n"
    )
    .expect("send");
    let mut raw = String::new();
    s.read_to_string(&mut raw).expect("read");
    let (head, body) = raw.split_once("\r\n\r\n").expect("a head and a body");
    let status = head.lines().next().unwrap_or("").to_owned();
    let content_type = head
        .lines()
        .find_map(|l| l.strip_prefix("Content-Type: "))
        .unwrap_or("")
        .to_owned();
    let length: usize = head
        .lines()
        .find_map(|l| l.strip_prefix("Content-Length: "))
        .and_then(|v| v.parse().ok())
        .expect("Content-Length");
    assert_eq!(length, body.len(), "Content-Length matches the body");
    (status, content_type, body.to_owned())
}

/// The samples of a Prometheus text: `name{labels}` (as written) to value.
fn samples(text: &str) -> HashMap<String, f64> {
    text.lines()
        .filter(|l| !l.starts_with('#') && !l.is_empty())
        .map(|l| {
            let (series, value) = l.rsplit_once(' ').expect("a sample line");
            (series.to_owned(), value.parse().expect("a number"))
        })
        .collect()
}

fn scrape(addr: SocketAddr) -> HashMap<String, f64> {
    let (status, content_type, body) = get(addr, "/metrics", "text/plain");
    assert_eq!(status, "HTTP/1.1 200 OK");
    assert!(
        content_type.starts_with("text/plain; version=0.0.4"),
        "{content_type}"
    );
    samples(&body)
}

/// A scrape once no worker has blocks queued and no job is in flight (or after 5 s). The
/// queue gauges are published at the end of each worker turn, and a job leaves the in-flight
/// count just after its result is sent (so that `drain` never returns before the result is
/// there): both may trail the result the caller already holds.
fn scrape_settled(addr: SocketAddr) -> HashMap<String, f64> {
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(5);
    loop {
        let s = scrape(addr);
        let settled = sum(&s, "kvtier_worker_queued_blocks", &[]) == 0.0
            && value(&s, "kvtier_jobs_in_flight") == 0.0;
        if settled || std::time::Instant::now() > deadline {
            return s;
        }
        std::thread::sleep(std::time::Duration::from_millis(10));
    }
}

fn value(s: &HashMap<String, f64>, series: &str) -> f64 {
    *s.get(series)
        .unwrap_or_else(|| panic!("no series {series} in the scrape"))
}

/// Sums every series of family `name` whose labels contain all of `having`.
fn sum(s: &HashMap<String, f64>, name: &str, having: &[&str]) -> f64 {
    s.iter()
        .filter(|(k, _)| k.split('{').next() == Some(name) && having.iter().all(|h| k.contains(h)))
        .map(|(_, v)| v)
        .sum()
}

fn with_listen(mut c: Config) -> Config {
    c.metrics.listen = Some("127.0.0.1:0".parse().expect("addr"));
    c
}

#[test]
fn scrape_counts_exactly_the_work_done_on_two_real_devices() {
    let dir = tempfile::tempdir().expect("tempdir");
    let mut c = Config::default();
    c.block_size = BLOCK;
    c.cores = Cores::List(vec![0, 1]);
    c.devices = (0..2)
        .map(|i| {
            let mut d = DeviceConfig::new(dir.path().join(format!("dev{i}")));
            d.capacity_bytes = Some(64 << 20);
            d
        })
        .collect();
    let c = with_listen(c);
    let region = region(16);
    let Some(engine) = open_real(&c, &region) else {
        return;
    };
    let addr = engine.metrics_addr().expect("listening");
    assert_ne!(addr.port(), 0, "port 0 resolved to the port chosen");
    let before = scrape(addr);
    assert_eq!(sum(&before, "kvtier_jobs_total", &[]), 0.0);

    // 10 store jobs of 4 blocks, 5 load jobs of 4 stored blocks, 1 load job of 2 unknown keys.
    for j in 0..10u64 {
        let ids: Vec<u64> = (j * 4..j * 4 + 4).collect();
        assert!(store(&engine, &region, j, &ids).success);
    }
    for j in 0..5u64 {
        let ids: Vec<u64> = (j * 4..j * 4 + 4).collect();
        assert!(load(&engine, &region, 100 + j, &ids).success);
    }
    assert!(!load(&engine, &region, 200, &[1000, 1001]).success);
    let hits = engine.lookup(&(0..40).map(key).collect::<Vec<_>>());
    assert!(hits
        .iter()
        .all(|l| *l == kvtier::Lookup::Hit(kvtier::Tier::Nvme)));
    engine.lookup(&(500..503).map(key).collect::<Vec<_>>());

    let s = scrape_settled(addr);
    let v = |series: &str| value(&s, series);
    assert_eq!(v(r#"kvtier_jobs_total{op="store",result="ok"}"#), 10.0);
    assert_eq!(v(r#"kvtier_jobs_total{op="store",result="failed"}"#), 0.0);
    assert_eq!(v(r#"kvtier_jobs_total{op="load",result="ok"}"#), 5.0);
    assert_eq!(v(r#"kvtier_jobs_total{op="load",result="failed"}"#), 1.0);
    assert_eq!(v(r#"kvtier_job_blocks_total{op="store"}"#), 40.0);
    assert_eq!(v(r#"kvtier_job_blocks_total{op="load"}"#), 22.0);
    assert_eq!(v(r#"kvtier_job_seconds_count{op="store"}"#), 10.0);
    assert_eq!(v(r#"kvtier_job_seconds_count{op="load"}"#), 6.0);
    assert_eq!(v(r#"kvtier_job_seconds_bucket{op="load",le="+Inf"}"#), 6.0);
    assert!(v(r#"kvtier_job_seconds_sum{op="store"}"#) > 0.0);
    assert_eq!(v(r#"kvtier_blocks_total{op="store",result="ok"}"#), 40.0);
    assert_eq!(v(r#"kvtier_blocks_total{op="load",result="ok"}"#), 20.0);
    assert_eq!(v(r#"kvtier_blocks_total{op="load",result="miss"}"#), 2.0);
    let bytes = (40 * BLOCK) as f64;
    assert_eq!(
        v(r#"kvtier_moved_bytes_total{tier="nvme",op="store"}"#),
        bytes
    );
    assert_eq!(
        v(r#"kvtier_moved_bytes_total{tier="nvme",op="load"}"#),
        (20 * BLOCK) as f64
    );
    assert_eq!(
        sum(&s, "kvtier_device_bytes_total", &[r#"op="write""#]),
        bytes
    );
    assert_eq!(sum(&s, "kvtier_device_used_bytes", &[]), bytes);
    assert_eq!(v(r#"kvtier_lookups_total{answer="hit_nvme"}"#), 40.0);
    assert_eq!(v(r#"kvtier_lookups_total{answer="miss"}"#), 3.0);
    assert_eq!(sum(&s, "kvtier_device_errors_total", &[]), 0.0);
    // Per device: the keys that route to it, and its capacity.
    for d in 0..2 {
        let path = c.devices[d].path.display().to_string();
        let on_dev = (0..40).filter(|&i| key(i).device(2) == d).count() as u64;
        assert_eq!(
            v(&format!(r#"kvtier_device_used_bytes{{device="{path}"}}"#)),
            (on_dev * BLOCK) as f64,
            "device {d}"
        );
        assert_eq!(
            v(&format!(
                r#"kvtier_device_io_seconds_count{{device="{path}",op="store"}}"#
            )),
            on_dev as f64
        );
        assert!(
            v(&format!(
                r#"kvtier_device_capacity_bytes{{device="{path}"}}"#
            )) > 0.0
        );
    }
    assert_eq!(sum(&s, "kvtier_worker_queued_blocks", &[]), 0.0);
    assert_eq!(v("kvtier_jobs_in_flight"), 0.0);
    assert_eq!(
        v(r#"kvtier_info{version="0.1.0",layout="slab",block_bytes="65536"}"#),
        1.0
    );

    // The endpoint's other answers.
    let (status, _, _) = get(addr, "/", "*/*");
    assert_eq!(status, "HTTP/1.1 404 Not Found");
    let (status, content_type, body) = get(addr, "/metrics", "application/openmetrics-text");
    assert_eq!(status, "HTTP/1.1 200 OK");
    assert!(content_type.starts_with("application/openmetrics-text"));
    assert!(body.ends_with("# EOF\n"));
    assert!(body.contains(r#"kvtier_jobs_total{op="store",result="ok"} 10"#));
    // A request that never ends is cut by the read timeout; the next scrape is answered.
    let mut idle = TcpStream::connect(addr).expect("connect");
    idle.write_all(b"GET /metr").expect("send");
    assert_eq!(
        value(
            &scrape(addr),
            r#"kvtier_jobs_total{op="store",result="ok"}"#
        ),
        10.0
    );
    drop(idle);
    // Nor can a client that sends a byte now and then hold it: the whole request has a deadline.
    let mut drip = TcpStream::connect(addr).expect("connect");
    drip.set_read_timeout(Some(Duration::from_millis(300)))
        .expect("timeout");
    let mut cut = false;
    for b in b"GET /metrics HTTP/1.1\r\nX-Slow: aaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaa" {
        if drip.write_all(&[*b]).is_err() {
            cut = true;
            break;
        }
        // 300 ms per byte: the 60 bytes would take 18 s.
        let mut one = [0u8; 1];
        match drip.read(&mut one) {
            Ok(0) => {
                cut = true;
                break;
            }
            Ok(_) => panic!("an answer to a request that was never finished"),
            Err(e)
                if matches!(
                    e.kind(),
                    std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut
                ) => {}
            Err(_) => {
                cut = true;
                break;
            }
        }
    }
    assert!(
        cut,
        "the server closed a connection that never finished its request"
    );
    assert_eq!(
        value(
            &scrape(addr),
            r#"kvtier_jobs_total{op="store",result="ok"}"#
        ),
        10.0
    );

    engine.shutdown();
    assert!(engine.metrics_addr().is_none());
    assert!(
        TcpStream::connect_timeout(&addr, Duration::from_secs(1)).is_err(),
        "the endpoint closed at shutdown"
    );
}

#[test]
fn scrapes_during_stores_are_monotonic_and_end_exact() {
    let sim = SimStorage::new(3, &[64 << 20]);
    let c = with_listen(sim_config(1, 2));
    let region = region(64);
    let engine = open_sim(&c, &region, &sim);
    let addr = engine.metrics_addr().expect("listening");
    let jobs = 200u64;
    let mut last = 0.0;
    let mut scrapes = 0;
    std::thread::scope(|s| {
        let runner = s.spawn(|| {
            for j in 0..jobs {
                let blocks = vec![(j % 64) as u32];
                put(&region, blocks[0], j);
                engine
                    .submit_store(Job::new(j, vec![key(j)], blocks))
                    .expect("submit");
                wait_results(&engine, 1);
            }
        });
        while !runner.is_finished() {
            let n = value(
                &scrape(addr),
                r#"kvtier_jobs_total{op="store",result="ok"}"#,
            );
            assert!(n >= last, "a counter went back: {last} then {n}");
            last = n;
            scrapes += 1;
        }
    });
    assert!(scrapes > 0);
    let s = scrape(addr);
    assert_eq!(
        value(&s, r#"kvtier_jobs_total{op="store",result="ok"}"#),
        jobs as f64
    );
    assert_eq!(
        value(&s, r#"kvtier_device_bytes_total{device="sim0",op="write"}"#),
        (jobs * BLOCK) as f64
    );
}

#[test]
fn device_errors_are_counted_by_device_and_class() {
    let sim = SimStorage::new(5, &[32 << 20, 32 << 20]);
    let c = sim_config(2, 1);
    let region = region(8);
    let engine = open_sim(&c, &region, &sim);
    let ids: Vec<u64> = (0..8).collect();
    assert!(store(&engine, &region, 1, &ids).success);
    sim.set_faults(Faults {
        eio_ppm: 1_000_000,
        data_only: true,
        ..Faults::default()
    });
    let r = load(&engine, &region, 2, &ids);
    assert!(!r.success);
    sim.set_faults(Faults::default());
    let text = engine.metrics_text();
    let s = samples(&text);
    for d in 0..2 {
        let on_dev = ids.iter().filter(|&&i| key(i).device(2) == d).count();
        assert_eq!(
            value(
                &s,
                &format!(r#"kvtier_device_errors_total{{device="sim{d}",class="io"}}"#)
            ),
            on_dev as f64,
            "device {d}: one EIO per block loaded from it\n{text}"
        );
        assert_eq!(
            value(
                &s,
                &format!(r#"kvtier_device_errors_total{{device="sim{d}",class="short"}}"#)
            ),
            0.0
        );
    }
    assert_eq!(r.failures.len(), 8);
    let st = engine.stats();
    assert_eq!(st.io_errors, 8, "the flat sum agrees with the devices");
    assert_eq!(
        st.devices
            .iter()
            .map(kvtier::metrics::DeviceStats::io_errors)
            .sum::<u64>(),
        8
    );
    assert_eq!(
        value(&s, r#"kvtier_jobs_total{op="load",result="failed"}"#),
        1.0
    );
}

#[test]
fn backpressure_refusals_are_counted_by_limit() {
    let sim = SimStorage::new(9, &[32 << 20]);
    let mut c = sim_config(1, 1);
    c.jobs_in_flight_max = 2;
    let region = region(8);
    let engine = open_sim(&c, &region, &sim);
    sim.pause(true);
    let mut refused = 0;
    for j in 0..5u64 {
        put(&region, j as u32, j);
        if engine
            .submit_store(Job::new(j, vec![key(j)], vec![j as u32]))
            .is_err()
        {
            refused += 1;
        }
    }
    assert_eq!(refused, 3);
    let s = samples(&engine.metrics_text());
    assert_eq!(
        value(
            &s,
            r#"kvtier_backpressure_refusals_total{limit="jobs_in_flight_max"}"#
        ),
        3.0
    );
    assert_eq!(value(&s, "kvtier_jobs_in_flight"), 2.0);
    sim.pause(false);
    wait_results(&engine, 2);
}

#[test]
fn listen_errors_name_the_field() {
    let sim = SimStorage::new(1, &[32 << 20]);
    let region1 = region(4);
    let first = open_sim(&with_listen(sim_config(1, 1)), &region1, &sim);
    let taken = first.metrics_addr().expect("listening");
    let mut c = sim_config(1, 1);
    c.metrics.listen = Some(taken);
    let sim2 = SimStorage::new(2, &[32 << 20]);
    let region2 = region(4);
    let err = Engine::open_with(&c, region2, sim2 as std::sync::Arc<dyn kvtier::io::Storage>)
        .err()
        .expect("a port in use is an error");
    let msg = err.to_string();
    assert!(matches!(err, kvtier::Error::Metrics(_)), "{msg}");
    assert!(
        msg.contains(&format!("metrics.listen = \"{taken}\"")),
        "{msg}"
    );
    assert!(msg.contains("pick another port"), "{msg}");

    for (text, shown) in [
        ("listen = \"localhost:9464\"", "\"localhost:9464\""),
        ("listen = \"127.0.0.1\"", "\"127.0.0.1\""),
        ("listen = 9464", "9464"),
    ] {
        let toml = format!("[[devices]]\npath = \"x\"\n[metrics]\n{text}\n");
        let err = Config::from_toml_str(&toml).expect_err("invalid listen");
        let msg = err.to_string();
        assert!(msg.contains("metrics.listen"), "{msg}");
        assert!(msg.contains(shown), "{msg}");
        assert!(
            msg.contains("127.0.0.1:9464"),
            "names the accepted form: {msg}"
        );
    }
    let ok = Config::from_toml_str("[[devices]]\npath = \"x\"\n[metrics]\nlisten = \"[::1]:0\"\n")
        .expect("an IPv6 address");
    assert_eq!(ok.metrics.listen, Some("[::1]:0".parse().expect("addr")));
}
