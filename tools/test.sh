#!/usr/bin/env bash
# The full test suite: formatting, lints, then every test of the workspace (unit, integration,
# real-kernel, CLI end to end, and the criterion benches in quick test mode), then the Python
# package's tests (the binding, and the vLLM tier against vLLM 0.33.0's real tiering code), and
# the vLLM tests once more against vLLM 0.34.0's (the same installed package: nothing rebuilt);
# the SGLang backend runs on SGLang's real HiCache storage and host-pool code, the LMCache
# connector under LMCache's real L2 adapter code (both read from their wheels).
# Real-kernel tests that need root (ramfs mount, loop devices) skip with a message elsewhere;
# the NVMe passthrough tests run inside a QEMU guest (tools/guest/nvme-tests.sh).
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
# `kvtier/sim`: the simulated device and the deterministic simulator, for tests only.
cargo clippy --workspace --all-targets --locked --features kvtier/sim -- -D warnings
# The engine builds without its default S3 tier too.
cargo check -p kvtier --no-default-features --locked
# No module cycles in the kvtier crate (docs/architecture.md), and a declared MSRV that covers
# every locked dependency (clippy above checks kvtier's own code against it).
python3 tools/module_deps.py --quiet
python3 tools/msrv_check.py
cargo build --release --workspace --locked
# The Python package, installed the way the README says (`pip install ./python`), into a venv
# of its own; the build reuses the release artifacts above. vLLM's wheel (about 340 MB, no
# dependencies installed) is downloaded once per machine: the tests extract its tiering modules.
venv="${KVTIER_VENV:-$PWD/target/python-venv}"
[ -x "$venv/bin/python" ] || python3 -m venv "$venv"
# numpy and typing_extensions are what the vLLM tiering modules import besides the standard
# library; the metric tests parse kvtier's text with prometheus_client's parsers.
# mfusepy (ctypes over libfuse3) serves the FUSE file system whose reads fail
# (python/tests/failing_fs.py). msgspec is what SGLang's MLA host pool module imports,
# aiofiles what LMCache's file-system L2 adapter does.
"$venv/bin/python" -m pip install -q --disable-pip-version-check "numpy>=1.26" "pytest>=8" \
  typing_extensions "prometheus_client>=0.20" "mfusepy>=3" "msgspec>=0.18" "aiofiles>=23"
"$venv/bin/python" -m pip install -q --disable-pip-version-check --force-reinstall --no-deps ./python
export KVTIER_VLLM_WHEEL_DIR="${KVTIER_VLLM_WHEEL_DIR:-$HOME/.cache/kvtier/vllm-wheel}"
vllm_versions="0.33.0 0.34.0"
for v in $vllm_versions; do
  if ! ls "$KVTIER_VLLM_WHEEL_DIR"/vllm-$v-*.whl >/dev/null 2>&1; then
    "$venv/bin/python" -m pip download -q --disable-pip-version-check --no-deps vllm==$v \
      -d "$KVTIER_VLLM_WHEEL_DIR"
  fi
done
# SGLang's and LMCache's wheels (about 40 and 18 MB, not installed): python/tests/
# sglang_harness.py and lmcache_harness.py read the modules kvtier plugs into from them.
export KVTIER_SGLANG_VERSION="${KVTIER_SGLANG_VERSION:-0.5.23}"
export KVTIER_SGLANG_WHEEL_DIR="${KVTIER_SGLANG_WHEEL_DIR:-$HOME/.cache/kvtier/sglang-wheel}"
export KVTIER_LMCACHE_VERSION="${KVTIER_LMCACHE_VERSION:-0.5.6}"
export KVTIER_LMCACHE_WHEEL_DIR="${KVTIER_LMCACHE_WHEEL_DIR:-$HOME/.cache/kvtier/lmcache-wheel}"
for pkg in sglang:$KVTIER_SGLANG_VERSION:$KVTIER_SGLANG_WHEEL_DIR \
           lmcache:$KVTIER_LMCACHE_VERSION:$KVTIER_LMCACHE_WHEEL_DIR; do
  IFS=: read -r name version dir <<< "$pkg"
  if ! ls "$dir"/$name-$version-*.whl >/dev/null 2>&1; then
    "$venv/bin/python" -m pip download -q --disable-pip-version-check --no-deps \
      $name==$version -d "$dir"
  fi
done
: > /tmp/kvtier-test.log
# Rust tests that cannot run here (no root, no io_uring, no fio) pass after recording why in
# this file (kvtier_sys::skip!); the summary counts them as skipped, not passed.
export KVTIER_SKIPPED=/tmp/kvtier-skipped.log
: > "$KVTIER_SKIPPED"
# Every suite runs even when one fails, so the summary below covers them all.
rc=0
cargo test --workspace --all-targets --locked --features kvtier/sim 2>&1 | tee -a /tmp/kvtier-test.log || rc=1
# NVMe passthrough on a real kernel and a real (emulated) NVMe controller: the nvme_passthrough
# tests, `kvtier probe`, `bench` and `inspect` inside two QEMU guests (tools/guest/nvme-tests.sh;
# skipped with a message where QEMU or the guest kernel is missing, except under CI=true).
bash tools/guest/nvme-tests.sh 2>&1 | tee -a /tmp/kvtier-test.log || rc=1
# The user-space NVMe driver over VFIO, in two q35 guests with an emulated IOMMU
# (tools/guest/vfio-tests.sh; skipped the same way).
bash tools/guest/vfio-tests.sh 2>&1 | tee -a /tmp/kvtier-test.log || rc=1
# Doc tests too (--all-targets skips them).
cargo test --workspace --doc --locked --features kvtier/sim 2>&1 | tee -a /tmp/kvtier-test.log || rc=1
# The Python tests (from outside python/, so `import kvtier` is the installed package): all of
# them against vLLM 0.33.0, then the vLLM ones (test_vllm_*) against 0.34.0.
(cd python/tests && KVTIER_VLLM_VERSION=0.33.0 "$venv/bin/python" -m pytest -q -p no:cacheprovider -rs .) 2>&1 \
  | tee /tmp/kvtier-pytest-0.33.0.log || rc=1
(cd python/tests && KVTIER_VLLM_VERSION=0.34.0 "$venv/bin/python" -m pytest -q -p no:cacheprovider -rs \
  test_vllm_*.py) 2>&1 | tee /tmp/kvtier-pytest-0.34.0.log || rc=1
# vLLM's own fs-tier tests (tests/v1/kv_offload/tiering/test_fs_tier.py from each version's
# sdist, about 50 MB, downloaded once to ~/.cache/kvtier/vllm-sdist), unmodified: first against
# vLLM's own tier (the baseline), then with kvtier's class in its place
# (python/tests/vllm_own/vllm_own_plugin.py lists the tests of vLLM's internals it skips, and why).
own_logs=""
for v in $vllm_versions; do
  own=$(cd python/tests/vllm_own && KVTIER_VLLM_VERSION=$v "$venv/bin/python" extract.py) || rc=1
  for target in vllm kvtier; do
    log=/tmp/kvtier-pytest-own-$v-$target.log
    (cd python/tests/vllm_own && KVTIER_VLLM_VERSION=$v KVTIER_VLLM_OWN_TARGET=$target \
      KVTIER_VLLM_FS_IO_C=1 PYTHONPATH=$PWD "$venv/bin/python" -m pytest -q -p no:cacheprovider \
      -p vllm_own_plugin -rs "$own") 2>&1 | tee "$log" || rc=1
    printf 'vLLM %s own fs-tier tests against %s: %s\n' "$v" "$target" "$(tail -1 "$log")"
    own_logs="$own_logs $log"
  done
done
# One summary line over all test binaries and both pytest runs.
py_count() {
  local n=0 f c
  for f in /tmp/kvtier-pytest-0.33.0.log /tmp/kvtier-pytest-0.34.0.log $own_logs; do
    c=$(grep -Eo "[0-9]+ $1" "$f" | tail -1 | grep -Eo "[0-9]+" || echo 0)
    # A run that ended without pytest's summary (it could not even collect) counts as one
    # failure, so the line below never says 0 failed for it.
    if [ "$1" = failed ] && ! tail -1 "$f" | grep -Eq "[0-9]+ (passed|failed|skipped|error)"; then
      c=$((c + 1))
    fi
    n=$((n + c))
  done
  echo "$n"
}
rust_skipped=$(wc -l < "$KVTIER_SKIPPED")
if [ "$rust_skipped" -gt 0 ]; then
  echo "Rust tests skipped on this machine ($rust_skipped):"
  sed 's/^/  /' "$KVTIER_SKIPPED"
fi
awk -v pp="$(py_count passed)" -v pf="$(py_count failed)" -v pe="$(py_count error)" -v ps="$(py_count skipped)" \
  -v rs="$rust_skipped" \
  '/^test result:/ { p += $4; f += $6; s += $8 } END { printf "%d passed, %d failed, %d skipped\n", p + pp - rs, f + pf + pe, s + ps + rs }' \
  /tmp/kvtier-test.log
exit "$rc"
