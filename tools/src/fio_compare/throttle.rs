//! `--device-limit`: the target's disk made slower on purpose, to see what CPU per GiB does when
//! the device is slow. This process (and so kvtier's threads, its io_uring kernel workers and
//! the fio it starts) moves into a cgroup of its own whose block-I/O limit caps the disk's read
//! and write bytes per second: cgroup v2 `io.max` where the io controller is on the unified
//! hierarchy, else cgroup v1 `blkio.throttle.{read,write}_bps_device`. The kernel holds back
//! the bios over the limit and releases them as the budget refills, so at a fixed queue depth
//! each I/O waits longer, as on a slower device (in bursts: the limit is enforced per time
//! slice, so latencies spread wider than a uniformly slower device's would).

use super::*;

/// A limit of `--device-limit`: bytes per second, or `None` (the device as it is).
pub(super) type Limit = Option<u64>;

/// Parses one `--device-limit` value: `none` or a size per second (`1GiB`, `300MiB`).
pub(super) fn parse_limit(text: &str) -> Result<Limit, String> {
    let t = text.trim();
    if t.eq_ignore_ascii_case("none") {
        return Ok(None);
    }
    let bytes = bench::parse_size_arg(t.strip_suffix("/s").unwrap_or(t))?;
    if bytes < 1 << 20 {
        return Err(format!(
            "`{text}`: a device limit is at least 1 MiB per second (or `none`)"
        ));
    }
    Ok(Some(bytes))
}

/// How a limit reads in the tables.
pub(super) fn limit_label(limit: Limit) -> String {
    match limit {
        None => "none".to_owned(),
        Some(b) => format!("{}/s", output::size(b)),
    }
}

/// Which cgroup interface limits the disk.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Version {
    /// `io.max` on the unified hierarchy.
    V2,
    /// `blkio.throttle.*_bps_device` on the blkio hierarchy.
    V1,
}

/// This process inside a cgroup that limits the target's disk; dropping it moves the process
/// back where it was and removes the cgroup.
pub(super) struct Throttle {
    version: Version,
    dir: PathBuf,
    /// `cgroup.procs` of the cgroup this process came from.
    home: PathBuf,
    /// The disk the limit applies to, `major:minor`.
    disk: String,
}

impl Throttle {
    /// Makes the cgroup for `target`'s disk and moves this process into it, with no limit yet.
    pub(super) fn new(target: &Path) -> CliResult<Throttle> {
        let disk = disk_of(target)?;
        let (version, mount, home_rel) = hierarchy()?;
        let dir = mount.join(format!("kvtier-fio-compare-{}", std::process::id()));
        let fail = |what: &str, p: &Path, e: std::io::Error| {
            CliError::runtime(format!(
                "--device-limit: {what} {}: {e} (needs root and a writable cgroup hierarchy)",
                p.display()
            ))
        };
        if version == Version::V2 {
            // The io controller must be enabled for the root's children.
            let control = mount.join("cgroup.subtree_control");
            std::fs::write(&control, "+io").map_err(|e| fail("enabling io in", &control, e))?;
        }
        std::fs::create_dir(&dir).map_err(|e| fail("creating", &dir, e))?;
        let home = mount
            .join(home_rel.trim_start_matches('/'))
            .join("cgroup.procs");
        let procs = dir.join("cgroup.procs");
        let t = Throttle {
            version,
            dir,
            home,
            disk,
        };
        std::fs::write(&procs, std::process::id().to_string())
            .map_err(|e| fail("moving this process into", &procs, e))?;
        Ok(t)
    }

    /// The disk (`major:minor`) and the interface, for the report.
    pub(super) fn describe(&self) -> String {
        let how = match self.version {
            Version::V2 => "cgroup v2 io.max",
            Version::V1 => "cgroup v1 blkio.throttle",
        };
        format!("{how} on disk {} ({})", self.disk, self.dir.display())
    }

    /// Caps the disk's reads and writes at `limit` bytes per second each (`None`: no cap).
    pub(super) fn set(&self, limit: Limit) -> CliResult<()> {
        let write = |file: &str, text: String| {
            let p = self.dir.join(file);
            std::fs::write(&p, &text).map_err(|e| {
                CliError::runtime(format!(
                    "--device-limit: writing `{text}` to {}: {e}",
                    p.display()
                ))
            })
        };
        match self.version {
            Version::V2 => {
                let v = limit.map_or_else(|| "max".to_owned(), |b| b.to_string());
                write("io.max", format!("{} rbps={v} wbps={v}", self.disk))
            }
            Version::V1 => {
                // 0 removes the rule.
                let v = limit.unwrap_or(0);
                write(
                    "blkio.throttle.read_bps_device",
                    format!("{} {v}", self.disk),
                )?;
                write(
                    "blkio.throttle.write_bps_device",
                    format!("{} {v}", self.disk),
                )
            }
        }
    }
}

impl Drop for Throttle {
    fn drop(&mut self) {
        let _ = self.set(None);
        if let Err(e) = std::fs::write(&self.home, std::process::id().to_string()) {
            tracing::warn!(
                "--device-limit: moving this process back to {}: {e}",
                self.home.display()
            );
        }
        // A cgroup goes once its last task has left: fio's have exited, and this process moved.
        if let Err(e) = std::fs::remove_dir(&self.dir) {
            tracing::warn!(
                "--device-limit: removing the cgroup {}: {e}",
                self.dir.display()
            );
        }
    }
}

/// The whole disk (`major:minor`) under `target`: its file system's device for a file, the
/// device itself for a block device; a partition's disk (limits apply to whole disks only).
fn disk_of(target: &Path) -> CliResult<String> {
    use std::os::unix::fs::MetadataExt;
    let probe = if target.exists() {
        target.to_path_buf()
    } else {
        target
            .parent()
            .map_or_else(|| PathBuf::from("."), Path::to_path_buf)
    };
    let meta = std::fs::metadata(&probe)
        .map_err(|e| CliError::runtime(format!("--device-limit: {}: {e}", probe.display())))?;
    if meta.file_type().is_char_device() {
        return Err(CliError::usage(format!(
            "--device-limit: {} is a character device (an NVMe generic device?): passthrough \
             commands skip the block layer where cgroups limit I/O, so it cannot be slowed \
             this way",
            target.display()
        )));
    }
    let dev = if meta.file_type().is_block_device() {
        meta.rdev()
    } else {
        meta.dev()
    };
    let (major, minor) = (nix::sys::stat::major(dev), nix::sys::stat::minor(dev));
    let sys = PathBuf::from(format!("/sys/dev/block/{major}:{minor}"));
    if !sys.exists() {
        return Err(CliError::usage(format!(
            "--device-limit: {} is on device {major}:{minor}, which is no block device (a \
             network or memory file system?); nothing to limit",
            target.display()
        )));
    }
    if sys.join("partition").exists() {
        let parent = std::fs::read_to_string(sys.join("../dev")).map_err(|e| {
            CliError::runtime(format!(
                "--device-limit: the disk of partition {major}:{minor}: {e}"
            ))
        })?;
        return Ok(parent.trim().to_owned());
    }
    Ok(format!("{major}:{minor}"))
}

/// Where to make the cgroup: the unified hierarchy if its io controller is there, else the
/// blkio hierarchy; with this process's cgroup in it (relative to the mount).
fn hierarchy() -> CliResult<(Version, PathBuf, String)> {
    let mountinfo = std::fs::read_to_string("/proc/self/mountinfo")
        .map_err(|e| CliError::runtime(format!("--device-limit: /proc/self/mountinfo: {e}")))?;
    let cgroups = std::fs::read_to_string("/proc/self/cgroup")
        .map_err(|e| CliError::runtime(format!("--device-limit: /proc/self/cgroup: {e}")))?;
    let mut v1 = None;
    for line in mountinfo.lines() {
        // `ID PARENT MAJ:MIN ROOT MOUNT OPTS [OPTIONAL...] - FSTYPE SOURCE SUPEROPTS`
        let Some((left, right)) = line.split_once(" - ") else {
            continue;
        };
        let mount = left.split(' ').nth(4).unwrap_or("");
        let mut r = right.split(' ');
        let (fstype, superopts) = (r.next().unwrap_or(""), r.nth(1).unwrap_or(""));
        if fstype == "cgroup2" {
            let controllers = std::fs::read_to_string(Path::new(mount).join("cgroup.controllers"))
                .unwrap_or_default();
            if controllers.split_whitespace().any(|c| c == "io") {
                let home = own_cgroup(&cgroups, str::is_empty).unwrap_or("/");
                return Ok((Version::V2, PathBuf::from(mount), home.to_owned()));
            }
        } else if fstype == "cgroup" && superopts.split(',').any(|o| o == "blkio") {
            v1 = Some(PathBuf::from(mount));
        }
    }
    match v1 {
        Some(mount) => {
            let home = own_cgroup(&cgroups, |c| c.split(',').any(|c| c == "blkio")).unwrap_or("/");
            Ok((Version::V1, mount, home.to_owned()))
        }
        None => Err(CliError::usage(
            "--device-limit: no cgroup hierarchy with the io (v2) or blkio (v1) controller is \
             mounted here",
        )),
    }
}

/// This process's cgroup path in the hierarchy whose controller list matches `which`.
fn own_cgroup(cgroups: &str, which: impl Fn(&str) -> bool) -> Option<&str> {
    cgroups.lines().find_map(|l| {
        let mut f = l.splitn(3, ':');
        let (_, controllers, path) = (f.next()?, f.next()?, f.next()?);
        which(controllers).then_some(path)
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn limits_parse_with_units_or_none_and_refuse_nonsense() {
        assert_eq!(parse_limit("none"), Ok(None));
        assert_eq!(parse_limit("1GiB"), Ok(Some(1 << 30)));
        assert_eq!(parse_limit("300MiB/s"), Ok(Some(300 << 20)));
        let err = parse_limit("4KiB").expect_err("below 1 MiB/s");
        assert!(err.contains("at least 1 MiB"), "{err}");
        assert!(parse_limit("fast").is_err());
        assert_eq!(limit_label(None), "none");
        assert_eq!(limit_label(Some(1 << 30)), "1 GiB/s");
    }

    #[test]
    fn own_cgroup_finds_the_hierarchy_asked_for() {
        let text = "9:name=systemd:/\n7:blkio:/user.slice\n4:memory:/x\n0::/init.scope\n";
        assert_eq!(
            own_cgroup(text, |c| c.split(',').any(|c| c == "blkio")),
            Some("/user.slice")
        );
        assert_eq!(own_cgroup(text, str::is_empty), Some("/init.scope"));
        assert_eq!(own_cgroup(text, |c| c == "cpu"), None);
    }

    #[test]
    fn a_character_device_cannot_be_limited() {
        let err = disk_of(Path::new("/dev/null")).expect_err("a character device");
        assert!(err.to_string().contains("passthrough"), "{err}");
    }
}
