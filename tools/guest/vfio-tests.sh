#!/usr/bin/env bash
# The user-space NVMe driver (VFIO) on a real kernel with a real (emulated) NVMe controller
# behind an emulated IOMMU: boots a q35 QEMU guest with an Intel IOMMU (tools/guest/run.sh
# --vfio) twice, takes the controller from the kernel's nvme driver to vfio-pci, runs the
# `vfio_nvme` test binary against it, gives the controller back to nvme and checks that the
# kernel reads, through /dev/nvme0n1, the block the user-space driver wrote last.
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

say() { printf 'vfio-tests: %s\n' "$*" >&2; }
unavailable() {
  if [ "${CI:-}" = true ]; then
    say "error: $*"
    exit 1
  fi
  say "skipping the VFIO guest tests: $*"
  exit 0
}

command -v qemu-system-x86_64 >/dev/null 2>&1 || unavailable "qemu-system-x86_64 is not installed (tools/guest/setup.sh installs it)"
kernel="${KVTIER_GUEST_KERNEL:-}"
if [ -z "$kernel" ]; then
  kernel=$(tools/guest/setup.sh 2>/dev/null | sed -n 's/^KVTIER_GUEST_KERNEL=//p' | tail -1) || true
fi
[ -n "$kernel" ] && [ -f "$kernel" ] || unavailable "no guest kernel (run tools/guest/setup.sh)"
[ -f "$(dirname "$(dirname "$kernel")")/modules/vfio-pci.ko" ] \
  || unavailable "no VFIO modules beside $kernel (run tools/guest/setup.sh again)"

test_bin=$(cargo test --workspace --all-targets --locked --features kvtier/sim --no-run \
  --message-format=json 2>/dev/null | python3 -c '
import json, sys
for line in sys.stdin:
    m = json.loads(line)
    exe = m.get("executable")
    if m.get("reason") == "compiler-artifact" and exe and m["target"]["name"] == "vfio_nvme":
        print(exe)
')
[ -x "$test_bin" ] || { say "error: the vfio_nvme test binary was not found"; exit 1; }

work=$(mktemp -d /tmp/kvtier-vfio-tests.XXXXXX)
trap 'rm -rf "$work"' EXIT
strip -o "$work/vfio_nvme" "$test_bin"

disk_mib=128
round() {
  local name=$1 lba=$2 mdts=$3
  local log="$work/$name.log"
  say "round $name: LBA $lba B, MDTS $mdts, IOMMU on"
  local rc=0
  # The controller goes to vfio-pci for the tests and back to nvme after them; the last block
  # the tests wrote must then read the same through the kernel's driver.
  tools/guest/run.sh --kernel "$kernel" --vfio --lba-size "$lba" --poll-queues 0 --mdts "$mdts" \
    --disk-mib "$disk_mib" --mem-mib 1024 --timeout "${KVTIER_GUEST_TIMEOUT:-600}" --log "$log" \
    --bin "$work/vfio_nvme" -- \
    "set -e; p=\$KVTIER_GUEST_NVME_PCI; d=/sys/bus/pci/devices/\$p; \
     echo \$p > \$d/driver/unbind; echo vfio-pci > \$d/driver_override; \
     echo \$p > /sys/bus/pci/drivers_probe; \
     echo \"kvtier-guest: \$p bound to \$(basename \$(readlink \$d/driver))\"; \
     export KVTIER_VFIO_PCI=\$p KVTIER_NVME_LBA=$lba KVTIER_VFIO_MDTS_BYTES=$((4096 << mdts)) \
       KVTIER_VFIO_DISK_BYTES=$((disk_mib << 20)) KVTIER_VFIO_PATTERN_OUT=/tmp/pattern; \
     vfio_nvme --include-ignored --test-threads=1; \
     echo \$p > /sys/bus/pci/drivers/vfio-pci/unbind; echo > \$d/driver_override; \
     echo \$p > /sys/bus/pci/drivers_probe; \
     n=0; while [ ! -e /dev/nvme0n1 ] && [ \$n -lt 50 ]; do sleep 0.2; n=\$((n + 1)); done; \
     dd if=/dev/nvme0n1 bs=1M skip=$((disk_mib - 1)) count=1 2>/dev/null | cmp - /tmp/pattern; \
     echo 'kvtier-guest: back on nvme, /dev/nvme0n1 reads the block the VFIO driver wrote'" \
    >/dev/null 2>&1 || rc=$?
  sed -n '/^running [0-9]* tests/,/^KVTIER_GUEST_EXIT=/p' "$log" | grep -v '^KVTIER_GUEST_EXIT='
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
