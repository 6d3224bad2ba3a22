#!/usr/bin/env bash
# The full test suite: formatting, lints, then every test of the workspace (unit, integration,
# real-kernel, CLI end to end, and the criterion benches in quick test mode).
# Real-kernel tests that need root (ramfs mount, loop devices) skip with a message elsewhere.
set -euo pipefail
cd "$(dirname "$0")/.."
export CARGO_TERM_COLOR="${CARGO_TERM_COLOR:-never}"
# The S3 tier's tests start their own local S3-compatible server (s3s-fs, one per test on
# 127.0.0.1); install it when missing. 0.14.1 is the last release that builds with this
# toolchain; it takes about two minutes once.
export PATH="${CARGO_HOME:-$HOME/.cargo}/bin:$PATH"
if ! command -v s3s-fs >/dev/null 2>&1; then
  cargo install s3s-fs@0.14.1 --features binary --locked
fi
s3s-fs --version
cargo fmt --all -- --check
cargo clippy --workspace --all-targets --locked -- -D warnings
cargo build --release --workspace --locked
: > /tmp/kvtier-test.log
cargo test --workspace --all-targets --locked 2>&1 | tee -a /tmp/kvtier-test.log
# Doc tests too (--all-targets skips them).
cargo test --workspace --doc --locked 2>&1 | tee -a /tmp/kvtier-test.log
# One summary line over all test binaries.
awk '/^test result:/ { p += $4; f += $6; s += $8 } END { printf "%d passed, %d failed, %d skipped\n", p, f, s }' /tmp/kvtier-test.log
