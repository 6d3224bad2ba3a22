#!/usr/bin/env bash
# Checks that tools/guest/run.sh gives a working NVMe guest: four short boots (512 and 4096
# byte LBAs, with and without poll queues), block I/O through dd, the passthrough char device,
# and, when the host has fio, fio's io_uring_cmd engine on /dev/ng0n1 (polled when possible).
# Logs go to $1 (default /tmp/kvtier-guest-selfcheck). Exits non-zero when a check fails.
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
logs="${1:-/tmp/kvtier-guest-selfcheck}"
mkdir -p "$logs"
kernel="${KVTIER_GUEST_KERNEL:-$("$here/setup.sh" | tail -n1 | sed 's/^KVTIER_GUEST_KERNEL=//')}"

# Facts about the emulated controller, then a direct-I/O write/read-back through the block
# device (drop_caches makes the read come from the "disk").
facts='
q=/sys/block/nvme0n1/queue
bs=$(cat $q/logical_block_size)
echo "FACT io_poll=$(cat $q/io_poll) logical_block_size=$bs max_hw_sectors_kb=$(cat $q/max_hw_sectors_kb) max_segments=$(cat $q/max_segments)"
if [ -e /sys/block/nvme0n1/nsid ]; then echo "FACT nsid=$(cat /sys/block/nvme0n1/nsid)"; else echo "FACT nsid absent"; fi
if [ -e /sys/class/nvme-generic/ng0n1 ]; then
  echo "FACT nvme-generic/ng0n1 -> $(readlink /sys/class/nvme-generic/ng0n1)"
  echo "FACT nvme-generic/ng0n1/device -> $(readlink /sys/class/nvme-generic/ng0n1/device) = $(readlink -f /sys/class/nvme-generic/ng0n1/device)"
  echo "FACT nvme-generic/ng0n1/dev=$(cat /sys/class/nvme-generic/ng0n1/dev)"
else
  echo "FACT /sys/class/nvme-generic/ng0n1 absent"
fi
if [ -c /dev/nvme0 ]; then echo "FACT /dev/nvme0 exists: $(ls -l /dev/nvme0)"; else echo "FACT /dev/nvme0 absent"; fi
ls -l /dev/ng0n1
dmesg | grep -i nvme
dd if=/dev/urandom of=/tmp/pat bs=$bs count=16 2>/dev/null
dd if=/tmp/pat of=/dev/nvme0n1 bs=$bs seek=8 count=16 oflag=direct conv=fsync || exit 1
echo 3 >/proc/sys/vm/drop_caches
dd if=/dev/nvme0n1 of=/tmp/back bs=$bs skip=8 count=16 iflag=direct || exit 1
cmp /tmp/pat /tmp/back && echo CHECK dd-roundtrip ok
'

# fio through the passthrough char device. No --direct=1: passthrough never goes through the
# page cache, and fio 3.33 then opens the char device with O_DIRECT, which fails (EINVAL); that
# run is kept, as information only. The NVMe interrupt count around the polled run tells whether
# it really polled: without poll queues the kernel may accept it and complete by interrupt.
fio_cmd='
base="--filename=/dev/ng0n1 --ioengine=io_uring_cmd --cmd_type=nvme --bs=4k --size=4m"
stat -c "%n: %F %t:%T" /dev/ng0n1 /dev/nvme0n1 || exit 1
fail=0
irqs() { awk '\''/nvme/ { for (i = 2; i <= NF && $i ~ /^[0-9]+$/; i++) s += $i } END { print s + 0 }'\'' /proc/interrupts; }
fio --name=read $base --rw=randread && echo "CHECK fio-randread ok" || { echo "CHECK fio-randread FAILED"; fail=1; }
fio --name=verify $base --rw=randwrite --verify=crc32c --do_verify=1 && echo "CHECK fio-randwrite-verify ok" || { echo "CHECK fio-randwrite-verify FAILED"; fail=1; }
fio --name=direct $base --rw=randread --direct=1 && echo "CHECK fio-randread-direct1 ok (info)" || echo "CHECK fio-randread-direct1 failed (info)"
i0=$(irqs)
if fio --name=polled $base --rw=randread --hipri=1 --fixedbufs=1; then
  echo "CHECK fio-hipri-fixedbufs ok"
  echo "FACT nvme interrupts during the polled run (1024 reads): $(( $(irqs) - i0 ))"
elif [ "$(cat /sys/block/nvme0n1/queue/io_poll)" = 0 ]; then
  echo "CHECK fio-hipri-fixedbufs failed (expected: no poll queues)"
else
  echo "CHECK fio-hipri-fixedbufs FAILED"; fail=1
fi
fio --name=polled-qd8 $base --rw=randrw --iodepth=8 --hipri=1 --fixedbufs=1 --verify=crc32c && echo "CHECK fio-hipri-qd8-verify ok" || echo "CHECK fio-hipri-qd8-verify failed (info)"
exit $fail
'

rc=0
round() {
  local name="$1"; shift
  local t0 t1 st=0
  t0="$(date +%s.%N)"
  "$here/run.sh" --kernel "$kernel" --disk-mib 64 --timeout 300 --log "$logs/$name.log" "$@" \
    >/dev/null || st=$?
  t1="$(date +%s.%N)"
  printf '== %s: status %s, %.1f s wall\n' "$name" "$st" "$(awk -v a="$t0" -v b="$t1" 'BEGIN{print b-a}')"
  grep -a -E '^(FACT|CHECK|KVTIER_GUEST_)' "$logs/$name.log" | sed 's/^/   /' || true
  [ "$st" -eq 0 ] || rc=1
}

round bb-512-poll1 --lba-size 512 --poll-queues 1 -- "$facts"
round bb-4096-poll0-mdts5 --lba-size 4096 --poll-queues 0 --mdts 5 -- "$facts"
if command -v fio >/dev/null && command -v stat >/dev/null; then
  round fio-4096-poll1 --lba-size 4096 --poll-queues 1 --bin "$(command -v fio)" \
    --bin "$(command -v stat)" -- "$fio_cmd"
  round fio-512-poll0 --lba-size 512 --poll-queues 0 --bin "$(command -v fio)" \
    --bin "$(command -v stat)" -- "$fio_cmd"
else
  echo "== fio rounds skipped: fio not installed on the host"
fi
exit "$rc"
