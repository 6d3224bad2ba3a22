#!/usr/bin/env bash
# The user-space NVMe driver (VFIO) on a real kernel with a real (emulated) NVMe controller
# behind an emulated IOMMU: boots a q35 QEMU guest with an Intel IOMMU (tools/guest/run.sh
# --vfio) twice, takes the controller from the kernel's nvme driver to vfio-pci, runs the
# `vfio_nvme` (the driver) and `vfio_engine` (the engine on it) tests and `kvtier bench`, `put`,
# `get` and `inspect` against it, then gives the controller back to nvme and checks that the
# kernel reads the same bytes: the last block the driver wrote through /dev/nvme0n1, and the
# key `put` stored through VFIO with `kvtier get` through passthrough on /dev/ng0n1.
#
#   round 1: 512 B LBAs, QEMU's default MDTS (7: 512 KiB)
#   round 2: 4 KiB LBAs, MDTS 5 (128 KiB): 1 MiB blocks are eight commands
#
# The test binary is the one `cargo test --workspace --all-targets --features kvtier/sim` built
# (the same flags, so nothing is rebuilt). Each round's `test result:` line is printed so that
# tools/test.sh counts the guest's tests in its summary. Where the guest cannot run (no QEMU or
# kernel and not CI), it says why and exits 0; with CI=true a missing guest is a failure.
set -euo pipefail
cd "$(dirname "$0")/../.."

GUEST_SCRIPT=vfio-tests GUEST_WHAT="VFIO guest tests"
. tools/guest/common.sh
require_guest
[ -f "$(dirname "$(dirname "$kernel")")/modules/vfio-pci.ko" ] \
  || unavailable "no VFIO modules beside $kernel (run tools/guest/setup.sh again)"

bins=$(test_binaries vfio_nvme vfio_engine)
sys_bin=$(awk '$1 == "vfio_nvme" { print $2 }' <<<"$bins")
engine_bin=$(awk '$1 == "vfio_engine" { print $2 }' <<<"$bins")
[ -x "$sys_bin" ] && [ -x "$engine_bin" ] \
  || { say "error: the vfio_nvme and vfio_engine test binaries were not found"; exit 1; }
kvtier=target/release/kvtier
[ -x "$kvtier" ] || cargo build --release --locked -p kvtier-cli

# Stripped copies: the guest's initramfs lives in its RAM.
work=$(mktemp -d /tmp/kvtier-vfio-tests.XXXXXX)
trap 'rm -rf "$work"' EXIT
strip -o "$work/vfio_nvme" "$sys_bin"
strip -o "$work/vfio_engine" "$engine_bin"
strip -o "$work/kvtier" "$kvtier"
# One slab, written through VFIO and read again through passthrough once the controller is
# back with the kernel: the namespace's first 64 MiB (the tests keep a pattern in its last MiB).
cat >"$work/vfio.toml" <<'EOF'
block_size = "1 MiB"
cores = [0]
region_blocks = 64

[[devices]]
pci = "PCI"
capacity_bytes = "64 MiB"
overwrite = true
EOF
sed -e 's|^pci = "PCI"|path = "/dev/ng0n1"|' -e '/^overwrite/d' "$work/vfio.toml" >"$work/passthrough.toml"

disk_mib=128
key=6b76746965722d7666696f0000000000
round() {
  local name=$1 lba=$2 mdts=$3
  local log="$work/$name.log"
  say "round $name: LBA $lba B, MDTS $mdts, IOMMU on"
  local rc=0
  # `kvtier bench` figures in a TCG guest say nothing about a drive: a check that it runs.
  boot_round "$name" "$log" --kernel "$kernel" --vfio --lba-size "$lba" --poll-queues 0 --mdts "$mdts" \
    --disk-mib "$disk_mib" --mem-mib 1024 --timeout "${KVTIER_GUEST_TIMEOUT:-600}" \
    --bin "$work/vfio_nvme" --bin "$work/vfio_engine" --bin "$work/kvtier" \
    --file "$work/vfio.toml:/etc/kvtier-vfio.toml" --file "$work/passthrough.toml:/etc/kvtier-pt.toml" -- \
    "set -e; p=\$KVTIER_GUEST_NVME_PCI; d=/sys/bus/pci/devices/\$p; \
     quiet() { \"\$@\" 2>/tmp/err || { cat /tmp/err; return 1; }; }; \
     kvtier probe --dir /tmp 2>/dev/null | grep -A4 '^controller' | sed 's/^/kvtier-guest: /'; \
     echo \$p > \$d/driver/unbind; echo vfio-pci > \$d/driver_override; \
     echo \$p > /sys/bus/pci/drivers_probe; \
     kvtier probe --dir /tmp 2>/dev/null | grep -A4 '^controller' | sed 's/^/kvtier-guest: /'; \
     export KVTIER_VFIO_PCI=\$p KVTIER_NVME_LBA=$lba KVTIER_VFIO_MDTS_BYTES=$((4096 << mdts)) \
       KVTIER_VFIO_DISK_BYTES=$((disk_mib << 20)) KVTIER_VFIO_PATTERN_OUT=/tmp/pattern; \
     vfio_nvme --include-ignored --test-threads=1; \
     vfio_engine --include-ignored --test-threads=1; \
     sed -i \"s/PCI/\$p/\" /etc/kvtier-vfio.toml; \
     quiet kvtier bench --config /etc/kvtier-vfio.toml --blocks 48 --queue-depth 8 --duration 2 \
       --workload all > /tmp/bench; sed 's/^/kvtier-guest: bench: /' /tmp/bench; \
     head -c 1048576 /dev/urandom > /tmp/block; \
     quiet kvtier put --config /etc/kvtier-vfio.toml --key $key --in /tmp/block; \
     quiet kvtier get --config /etc/kvtier-vfio.toml --key $key --out /tmp/back; \
     cmp /tmp/block /tmp/back; echo 'kvtier-guest: put + get through VFIO: byte-exact'; \
     quiet kvtier inspect --config /etc/kvtier-vfio.toml > /tmp/inspect; \
     sed 's/^/kvtier-guest: inspect: /' /tmp/inspect; \
     echo \$p > /sys/bus/pci/drivers/vfio-pci/unbind; echo > \$d/driver_override; \
     echo \$p > /sys/bus/pci/drivers_probe; \
     n=0; while [ ! -e /dev/ng0n1 ] && [ \$n -lt 50 ]; do sleep 0.2; n=\$((n + 1)); done; \
     dd if=/dev/nvme0n1 bs=1M skip=$((disk_mib - 1)) count=1 2>/dev/null | cmp - /tmp/pattern; \
     echo 'kvtier-guest: back on nvme, /dev/nvme0n1 reads the block the VFIO driver wrote'; \
     quiet kvtier get --config /etc/kvtier-pt.toml --key $key --out /tmp/back2; \
     cmp /tmp/block /tmp/back2; \
     echo 'kvtier-guest: the slab written through VFIO reads back byte-exact through /dev/ng0n1'" \
    || rc=$?
  # The test lines and the checks, for the log of the whole suite.
  sed -n '/^running [0-9]* tests/,/^KVTIER_GUEST_EXIT=/p' "$log" \
    | grep -v -e '^KVTIER_GUEST_EXIT=' -e '^\[ *[0-9]'
  if [ "$rc" -ne 0 ]; then
    say "round $name failed (exit $rc); the guest's console:"
    tail -n 80 "$log" >&2
    return "$rc"
  fi
}

rc=0
round lba512 512 7 || rc=1
round lba4k-mdts5 4096 5 || rc=1
exit "$rc"
