#!/usr/bin/env python3
"""Checks the workspace's declared MSRV (`rust-version` in Cargo.toml) against what it needs.

Two halves, since no older toolchain can be fetched here to build with:
* kvtier's own code: every crate declares the workspace's `rust-version`, and clippy's
  `incompatible_msrv` lint (tools/test.sh runs clippy with -D warnings) refuses a standard
  library API stabilized after it;
* the dependencies as locked: this script reads `cargo metadata` and fails if any package of
  the build declares a newer `rust-version` than the workspace does (cargo would refuse to
  build with the declared toolchain then).
"""
import json
import subprocess
import sys


def version(text: str) -> tuple[int, ...]:
    return tuple(int(x) for x in text.split("."))


def main() -> int:
    meta = json.loads(
        subprocess.run(
            ["cargo", "metadata", "--format-version", "1", "--locked"],
            check=True,
            capture_output=True,
            text=True,
        ).stdout
    )
    used = {n["id"] for n in meta["resolve"]["nodes"]}
    members = set(meta["workspace_members"])
    declared = {
        p["name"]: p.get("rust_version") for p in meta["packages"] if p["id"] in members
    }
    missing = [n for n, v in declared.items() if not v]
    if missing:
        print(f"msrv: these workspace crates declare no rust-version: {', '.join(missing)}")
        return 1
    ours = max(version(v) for v in declared.values())
    newer = sorted(
        (version(p["rust_version"]), p["name"], p["version"])
        for p in meta["packages"]
        if p["id"] in used and p["id"] not in members and p.get("rust_version")
        and version(p["rust_version"]) > ours
    )
    if newer:
        v, name, ver = newer[-1]
        print(
            f"msrv: the workspace declares rust-version {'.'.join(map(str, ours))}, but "
            f"{len(newer)} locked dependencies need more, up to {name} {ver} "
            f"({'.'.join(map(str, v))}): raise rust-version in Cargo.toml"
        )
        return 1
    print(f"msrv: rust-version {'.'.join(map(str, ours))} covers every locked dependency")
    return 0


if __name__ == "__main__":
    sys.exit(main())
