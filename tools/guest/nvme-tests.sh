#!/usr/bin/env bash
# The NVMe passthrough tests on a real kernel with a real (emulated) NVMe controller: boots a
# QEMU guest (tools/guest/run.sh) twice and runs, inside it, the `nvme_passthrough` test binary
# against /dev/ng0n1, then `kvtier probe`, a short `kvtier bench` and `kvtier inspect` on the same
# device, and in the first round a short `kvtier fio-compare` against fio's io_uring_cmd engine.
#
#   round 1: 512 B LBAs, one poll queue (polled completions), QEMU's default MDTS (512 KiB)
#   round 2: 4 KiB LBAs, no poll queues (iopoll falls back to interrupts), MDTS 5 (128 KiB)
#
# Blocks are 1 MiB, so every block is several NVMe commands in both rounds. Emulated NVMe says
# nothing about a real drive's speed: these check correctness only.
#
# The test binary is the one `cargo test --workspace --all-targets --features kvtier/sim` built
# (the same flags, so nothing is rebuilt); `kvtier` is target/release/kvtier. Each round's
# `test result:` line is printed so that tools/test.sh counts the guest's tests in its summary.
# Where the guest cannot run (no QEMU or kernel and not CI), it says why and exits 0; with
# CI=true a missing guest is a failure.
set -euo pipefail
cd "$(dirname "$0")/../.."

GUEST_SCRIPT=nvme-tests GUEST_WHAT="NVMe guest tests"
. tools/guest/common.sh
require_guest

test_bin=$(test_binaries nvme_passthrough | awk '{ print $2 }')
[ -x "$test_bin" ] || { say "error: the nvme_passthrough test binary was not found"; exit 1; }
kvtier=target/release/kvtier
[ -x "$kvtier" ] || cargo build --release --locked -p kvtier-cli

# Stripped copies: the guest's initramfs lives in its RAM.
work=$(mktemp -d /tmp/kvtier-nvme-tests.XXXXXX)
trap 'rm -rf "$work"' EXIT
strip -o "$work/nvme_passthrough" "$test_bin"
strip -o "$work/kvtier" "$kvtier"
cat > "$work/bench.toml" <<'EOF'
block_size = "1 MiB"
cores = [0]
iopoll = true
region_blocks = 64

[[devices]]
path = "/dev/ng0n1"
overwrite = true
EOF

command -v fio >/dev/null 2>&1 || { say "error: fio is not installed (.ci/run installs it)"; exit 1; }
fio_bin=$(command -v fio)

round() {
  local name=$1 lba=$2 poll=$3 mdts=$4 compare=$5
  local polled=0
  [ "$poll" -gt 0 ] && polled=1
  local log="$work/$name.log"
  say "round $name: LBA $lba B, poll queues $poll, MDTS $mdts"
  local rc=0
  local fio_compare=true
  if [ "$compare" = yes ]; then
    # One pair per cell, 1 s runs: a check that both sides run on the same LBAs, not a figure.
    fio_compare="quiet kvtier fio-compare --config /etc/kvtier-bench.toml --device /dev/ng0n1 \
      --overwrite --block-size 256KiB --queue-depth 8 --pairs 1 --duration 1 --workload all"
  fi
  # `kvtier bench` uses the namespace after the tests; its figures are emulated, not a drive's.
  boot_round "$name" "$log" --kernel "$kernel" --lba-size "$lba" --poll-queues "$poll" --mdts "$mdts" \
    --disk-mib 512 --mem-mib 2048 --timeout "${KVTIER_GUEST_TIMEOUT:-900}" \
    --bin "$work/nvme_passthrough" --bin "$work/kvtier" --bin "$fio_bin" --file "$work/bench.toml:/etc/kvtier-bench.toml" -- \
    "export KVTIER_NVME_DEVICE=/dev/ng0n1 KVTIER_NVME_POLLED=$polled KVTIER_NVME_LBA=$lba; \
     nvme_passthrough --include-ignored --test-threads=1 && kvtier probe --dir /tmp && \
     quiet() { \"\$@\" 2>/tmp/err || { cat /tmp/err; return 1; }; } && \
     quiet kvtier bench --config /etc/kvtier-bench.toml --blocks 96 --queue-depth 8 --duration 3 \
       --workload all && quiet kvtier inspect --config /etc/kvtier-bench.toml && \
     head -c 1048576 /dev/urandom > /tmp/block && \
     quiet kvtier put --config /etc/kvtier-bench.toml --key 6b76746965722d677565737400000000 --in /tmp/block && \
     quiet kvtier get --config /etc/kvtier-bench.toml --key 6b76746965722d677565737400000000 --out /tmp/back && \
     cmp /tmp/block /tmp/back && echo 'kvtier put + get on /dev/ng0n1: byte-exact' && $fio_compare" \
    || rc=$?
  # The test lines, the probe and the bench report, for the log of the whole suite.
  sed -n '/^running [0-9]* tests/,/^KVTIER_GUEST_EXIT=/p' "$log" | grep -v '^KVTIER_GUEST_EXIT='
  if [ "$rc" -ne 0 ]; then
    say "round $name failed (exit $rc); the guest's console:"
    tail -n 80 "$log" >&2
    return "$rc"
  fi
}

rc=0
round lba512-polled 512 1 7 yes || rc=1
round lba4k-interrupt 4096 0 5 no || rc=1
exit "$rc"
