//! For the workspace's tests: a test that cannot run on this machine (no root, no io_uring, no
//! fio, no NVMe namespace) says why and is counted as skipped, not passed. Rust's test harness
//! has no skip, so [`skip!`](crate::skip) prints the reason and, when `KVTIER_SKIPPED` names a
//! file, appends the test's name and the reason to it; `tools/test.sh` counts those lines as
//! skipped in its summary (and takes them off the passed count).

use std::io::Write as _;
use std::path::Path;

/// Records that the running test is skipped, for `why`. Call it as the test returns.
pub fn skipped(why: &str) {
    println!("skipping: {why}");
    if let Some(path) = std::env::var_os("KVTIER_SKIPPED") {
        // The harness runs each test on a thread named after it.
        let name = std::thread::current()
            .name()
            .unwrap_or("unnamed test")
            .to_owned();
        if let Err(e) = record(Path::new(&path), &name, why) {
            eprintln!("recording the skip in {}: {e}", Path::new(&path).display());
        }
    }
}

/// Appends `name` and `why` as one line (one write, `O_APPEND`: tests of many binaries and
/// threads append to one file).
fn record(path: &Path, name: &str, why: &str) -> std::io::Result<()> {
    let line = format!("{name}\t{}\n", why.replace(['\n', '\t'], " "));
    std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(path)?
        .write_all(line.as_bytes())
}

/// `return kvtier_sys::skip!("no root: {why}")`: the test is skipped (see the module docs);
/// takes `format!`'s arguments.
#[macro_export]
macro_rules! skip {
    ($($arg:tt)*) => {
        $crate::testing::skipped(&format!($($arg)*))
    };
}

#[cfg(test)]
mod tests {
    #[test]
    fn skips_are_recorded_one_line_each() {
        let dir = tempfile::tempdir().expect("dir");
        let file = dir.path().join("skipped");
        super::record(&file, "a::test", "no\troot\nhere").expect("recorded");
        super::record(&file, "b::test", "no fio").expect("recorded");
        let text = std::fs::read_to_string(&file).expect("the file");
        assert_eq!(text, "a::test\tno root here\nb::test\tno fio\n");
    }
}
