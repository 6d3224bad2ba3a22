#!/usr/bin/env bash
# Runs a shell command inside a throwaway QEMU guest that has an emulated NVMe controller, so
# io_uring NVMe passthrough (/dev/ng0n1) can be exercised on hosts without NVMe hardware.
# The guest is an initramfs only (busybox + the given binaries and their libraries), has no
# network, and powers off after the command; this script exits with the command's status.
#
#   tools/guest/run.sh --kernel PATH --lba-size 512|4096 --poll-queues N --disk-mib M \
#     [--mdts K] [--cpus C] [--mem-mib X] [--timeout S] [--append ARGS] [--cpu MODEL] [--vfio] \
#     --log FILE --bin PATH [--bin PATH ...] [--file SRC:DEST ...] -- <shell command>
#
# --vfio boots a q35 machine with an emulated Intel IOMMU (48-bit addresses, interrupt
# remapping) and `intel_iommu=on`, loads the VFIO modules setup.sh keeps beside the kernel, and
# exports KVTIER_GUEST_NVME_PCI (the controller's PCI address) to the command, so a user-space
# driver can take the controller from the kernel's nvme driver through vfio-pci.
#
# The kernel comes from tools/guest/setup.sh (KVTIER_GUEST_KERNEL is used when --kernel is
# absent). Exit status: the command's; 124 when the guest ran past --timeout; 123 when the
# emulator failed (below); 130 when QEMU was stopped by a signal; 1 when it ended
# without reporting (kernel panic, QEMU error) or the guest kernel oopsed or warned; 2 for a
# usage error; 125 when the NVMe devices never appeared.
#
# The emulator fails now and then, not the command: it leaves a halted vCPU without its timer
# interrupts (the guest kernel says "rcu: rcu_preempt kthread timer wakeup didn't happen" and
# whatever runs on that vCPU never wakes), or QEMU aborts on one of its own assertions. Both
# were seen in the VFIO rounds (once each in CI or here). A watcher stops QEMU as soon as the
# console shows the first; either way the script exits 123, so the caller can boot the guest
# again instead of waiting for --timeout or failing a test that never ran.
#
# The serial console goes to stdout and to --log. KVTIER_GUEST_KEEP=1 keeps the temp directory.
set -euo pipefail

prog=kvtier-guest
log_msg() { printf '%s: %s\n' "$prog" "$*" >&2; }
die() { log_msg "error: $*"; exit 2; }
usage() { sed -n '7,9p' "$0" | sed 's/^# \{0,1\}//' >&2; exit 2; }
is_uint() { [[ "$1" =~ ^[0-9]+$ ]]; }
now() { date +%s.%N; }
elapsed() { awk -v a="$1" -v b="$2" 'BEGIN { printf "%.1f", b - a }'; }

kernel="${KVTIER_GUEST_KERNEL:-}"
lba="" poll="" disk_mib="" mdts="" cpus=2 mem_mib=1024 secs=600 logfile="" extra_append=""
cpu_model=max vfio=false
busybox="${KVTIER_GUEST_BUSYBOX:-/bin/busybox}"
bins=() files=()
need_val() { [ $# -ge 2 ] || die "$1 needs a value"; }
while [ $# -gt 0 ]; do
  case "$1" in
    --kernel) need_val "$@"; kernel="$2"; shift 2 ;;
    --lba-size) need_val "$@"; lba="$2"; shift 2 ;;
    --poll-queues) need_val "$@"; poll="$2"; shift 2 ;;
    --disk-mib) need_val "$@"; disk_mib="$2"; shift 2 ;;
    --mdts) need_val "$@"; mdts="$2"; shift 2 ;;
    --cpus) need_val "$@"; cpus="$2"; shift 2 ;;
    --mem-mib) need_val "$@"; mem_mib="$2"; shift 2 ;;
    --timeout) need_val "$@"; secs="$2"; shift 2 ;;
    --append) need_val "$@"; extra_append="$2"; shift 2 ;;
    --cpu) need_val "$@"; cpu_model="$2"; shift 2 ;;
    --vfio) vfio=true; shift ;;
    --log) need_val "$@"; logfile="$2"; shift 2 ;;
    --bin) need_val "$@"; bins+=("$2"); shift 2 ;;
    --file) need_val "$@"; files+=("$2"); shift 2 ;;
    --) shift; break ;;
    -h|--help) usage ;;
    *) log_msg "unknown argument: $1"; usage ;;
  esac
done
[ $# -gt 0 ] || die "no guest command after --"
guest_cmd="$*"

[ -n "$kernel" ] || die "--kernel is required (tools/guest/setup.sh prints one)"
[ -f "$kernel" ] || die "kernel $kernel does not exist"
case "$lba" in 512|4096) ;; *) die "--lba-size must be 512 or 4096" ;; esac
is_uint "$poll" || die "--poll-queues must be a number"
is_uint "$disk_mib" && [ "$disk_mib" -gt 0 ] || die "--disk-mib must be a positive number"
[ -z "$mdts" ] || is_uint "$mdts" || die "--mdts must be a number"
is_uint "$cpus" && [ "$cpus" -gt 0 ] || die "--cpus must be a positive number"
is_uint "$mem_mib" && [ "$mem_mib" -ge 128 ] || die "--mem-mib must be at least 128"
is_uint "$secs" && [ "$secs" -gt 0 ] || die "--timeout must be a positive number of seconds"
[ -n "$logfile" ] || die "--log is required"
command -v qemu-system-x86_64 >/dev/null || die "qemu-system-x86_64 not found (run tools/guest/setup.sh)"
[ -x "$busybox" ] || die "$busybox not found (install busybox-static)"
# The guest has no libc of its own unless a --bin brings one, so busybox must be static.
if ldd "$busybox" >/dev/null 2>&1; then die "$busybox is dynamically linked (install busybox-static)"; fi

t_start="$(now)"
tmp="$(mktemp -d "${TMPDIR:-/tmp}/kvtier-guest.XXXXXX")"
cleanup() {
  if [ "${KVTIER_GUEST_KEEP:-}" = 1 ]; then log_msg "kept $tmp"; else rm -rf "$tmp"; fi
}
trap cleanup EXIT
# Signals end the script through exit, so the EXIT trap still removes the temp dir.
trap 'exit 130' INT
trap 'exit 143' TERM
root="$tmp/root"
mkdir -p "$root"/{bin,dev,proc,sys,tmp,etc/kvtier}

cp "$busybox" "$root/bin/busybox"
for applet in $("$busybox" --list); do
  [ "$applet" = busybox ] || ln -s busybox "$root/bin/$applet"
done

# Copies a host file to the same absolute path in the guest: libraries must stay where the
# binary's interpreter path and RUNPATHs say they are.
copy_abs() {
  mkdir -p "$root$(dirname "$1")"
  [ -e "$root$1" ] || cp -L "$1" "$root$1"
}
copy_bin() {
  local src="$1" dest out line lib
  [ -f "$src" ] && [ -x "$src" ] || die "--bin $src is not an executable file"
  dest="$root/bin/$(basename "$src")"
  # Remove the busybox link first: cp would write through it into busybox.
  rm -f "$dest"
  cp -L "$src" "$dest"
  out="$(ldd "$src" 2>&1)" || true
  case "$out" in *"not a dynamic executable"*|*"statically linked"*) return 0 ;; esac
  while IFS= read -r line; do
    line="${line#"${line%%[![:space:]]*}"}"
    case "$line" in
      *"=> not found"*) die "--bin $src: library missing on the host: ${line%% =>*}" ;;
      *"=> /"*) lib="${line#*=> }"; lib="${lib%% (*}" ;;
      /*) lib="${line%% (*}" ;;  # the dynamic loader, named by its absolute path
      *) continue ;;             # linux-vdso.so.1 and the like come from the kernel
    esac
    copy_abs "$lib"
  done <<<"$out"
}
for b in ${bins[@]+"${bins[@]}"}; do copy_bin "$b"; done
if "$vfio"; then
  moddir="$(dirname "$(dirname "$kernel")")/modules"
  mkdir -p "$root/lib/kvtier-modules"
  : >"$root/etc/kvtier/modules"
  for m in irqbypass vfio vfio_iommu_type1 vfio-pci-core vfio-pci; do
    [ -f "$moddir/$m.ko" ] || die "--vfio: $moddir/$m.ko is missing (run tools/guest/setup.sh)"
    cp "$moddir/$m.ko" "$root/lib/kvtier-modules/"
    echo "$m" >>"$root/etc/kvtier/modules"
  done
fi
for spec in ${files[@]+"${files[@]}"}; do
  [[ "$spec" == *:/* ]] || die "--file $spec: expected SRC:/absolute/dest"
  src="${spec%:*}" dest="${spec##*:}"
  [ -e "$src" ] || die "--file $src does not exist"
  mkdir -p "$root$(dirname "$dest")"
  rm -rf "$root$dest"
  cp -rL "$src" "$root$dest"
done
printf '%s\n' "$guest_cmd" >"$root/etc/kvtier/cmd"

cat >"$root/init" <<'EOF'
#!/bin/sh
# PID 1 of the guest. It must never exit (the kernel would panic), so every path ends in
# poweroff; the host reads the command's status from the KVTIER_GUEST_EXIT line.
export PATH=/bin
mount -t proc proc /proc
mount -t sysfs sysfs /sys
mount -t devtmpfs devtmpfs /dev
mount -t tmpfs tmpfs /tmp
mkdir -p /dev/shm && mount -t tmpfs tmpfs /dev/shm
echo "KVTIER_GUEST_INIT_UPTIME=$(cut -d' ' -f1 /proc/uptime)"
# --vfio: the modules, in dependency order (the file lists them that way).
if [ -f /etc/kvtier/modules ]; then
  while read -r m; do
    insmod "/lib/kvtier-modules/$m.ko" || echo "kvtier-guest: insmod $m failed"
  done </etc/kvtier/modules
fi
# The NVMe controller is probed asynchronously, after init has started.
n=0
while [ ! -e /dev/ng0n1 ] || [ ! -e /dev/nvme0n1 ]; do
  n=$((n + 1))
  [ "$n" -le 100 ] || break
  sleep 0.2
done
if [ -e /dev/ng0n1 ] && [ -e /dev/nvme0n1 ]; then
  q=/sys/block/nvme0n1/queue
  echo "kvtier-guest: kernel $(uname -r), nvme ready at uptime $(cut -d' ' -f1 /proc/uptime)"
  echo "kvtier-guest: logical_block_size=$(cat $q/logical_block_size) max_hw_sectors_kb=$(cat $q/max_hw_sectors_kb) io_poll=$(cat $q/io_poll)"
  ls -l /dev/ng0n1 /dev/nvme0 2>&1 | sed 's/^/kvtier-guest: /'
  pci="$(basename "$(readlink -f /sys/class/nvme/nvme0/device)")"
  export KVTIER_GUEST_NVME_PCI="$pci"
  echo "kvtier-guest: nvme0 at PCI $pci, IOMMU group $(basename "$(readlink -f /sys/bus/pci/devices/$pci/iommu_group 2>/dev/null)" 2>/dev/null)"
  cd /tmp
  sh -c "$(cat /etc/kvtier/cmd)" </dev/null
  rc=$?
else
  echo "kvtier-guest: NVMe devices did not appear within 20 s"
  ls -l /dev 2>&1 | sed 's/^/kvtier-guest: /'
  rc=125
fi
echo "KVTIER_GUEST_EXIT=$rc"
sync
poweroff -f
sleep 5
EOF
chmod 755 "$root/init"

# Uncompressed: the kernel then only copies it, which under TCG is much faster than inflating.
initrd="$tmp/initrd.cpio"
(cd "$root" && find . -mindepth 1 | "$busybox" cpio -o -H newc -R 0:0 2>/dev/null) >"$initrd"
disk="$tmp/disk.img"
truncate -s "${disk_mib}M" "$disk"
t_built="$(now)"
log_msg "initramfs $(( $(stat -c %s "$initrd") / 1048576 )) MiB built in $(elapsed "$t_start" "$t_built") s; booting (lba $lba, poll queues $poll, timeout $secs s)"

nvme_dev="nvme,serial=kvtier0,drive=nvm,logical_block_size=$lba,physical_block_size=$lba"
[ -z "$mdts" ] || nvme_dev="$nvme_dev,mdts=$mdts"
# panic=-1 with -no-reboot turns a guest panic into a QEMU exit instead of a hang until the
# timeout; oops=panic does the same for an oops (the host then sees no exit marker).
append="console=ttyS0 panic=-1 oops=panic quiet loglevel=5 nvme.poll_queues=$poll"
machine=()
accel=tcg
if "$vfio"; then
  # One host thread for all vCPUs: with a thread per vCPU (MTTCG), QEMU 10 has aborted in
  # iotlb_to_section (an assertion) while the guest rebound the controller behind the IOMMU.
  accel=tcg,thread=single
  # 48-bit IOVAs: QEMU's default (39) cannot map every user virtual address. The IOMMU must come
  # before the devices it translates for on the command line.
  machine=(-M q35 -device intel-iommu,intremap=on,aw-bits=48)
  append="$append intel_iommu=on"
fi
[ -z "$extra_append" ] || append="$append $extra_append"

mkdir -p "$(dirname "$logfile")"
: >"$logfile"
# KVM is never used: stock kernels do not run under /dev/kvm here, and TCG behaves the same
# on every host. stdin is /dev/null so QEMU never grabs a terminal. --foreground keeps QEMU in
# this process group, so Ctrl-C or a CI cancel stops it instead of orphaning it.
stall_re="^\[ *[0-9.]+\] rcu: .*timer wakeup didn't happen"
(
  # Ends with QEMU, or when the script ends early and its temp directory is gone.
  while [ -d "$tmp" ] && [ ! -e "$tmp/qemu.done" ]; do
    sleep 2
    if grep -a -q -E "$stall_re" "$logfile" 2>/dev/null; then
      : >"$tmp/stalled"
      [ ! -s "$tmp/qemu.pid" ] || kill -TERM "$(cat "$tmp/qemu.pid")" 2>/dev/null || true
      break
    fi
  done
) &
watcher=$!
set +e
timeout --foreground -k 10 "$secs" qemu-system-x86_64 \
  -accel "$accel" -cpu "$cpu_model" -m "$mem_mib" -smp "$cpus" ${machine[@]+"${machine[@]}"} \
  -nodefaults -nographic -serial mon:stdio -no-reboot -nic none -pidfile "$tmp/qemu.pid" \
  -kernel "$kernel" -initrd "$initrd" -append "$append" \
  -drive "file=$disk,if=none,id=nvm,format=raw" -device "$nvme_dev" \
  </dev/null 2>&1 | sed -u 's/\r$//' | tee "$logfile"
statuses=("${PIPESTATUS[@]}")
: >"$tmp/qemu.done"
wait "$watcher" 2>/dev/null
set -e
qemu_rc="${statuses[0]}"
t_end="$(now)"

timing="guest ran $(elapsed "$t_built" "$t_end") s, round $(elapsed "$t_start" "$t_end") s"
init_up="$(grep -a -o 'KVTIER_GUEST_INIT_UPTIME=[0-9.]*' "$logfile" | head -n1 | cut -d= -f2 || true)"
[ -z "$init_up" ] || timing="$timing, init started at guest uptime $init_up s"
marker="$(grep -a -o 'KVTIER_GUEST_EXIT=[0-9][0-9]*' "$logfile" | tail -n1 | cut -d= -f2 || true)"
# printk lines carry a [seconds] stamp, which tells kernel trouble apart from test output.
trouble="$(grep -a -E '^\[ *[0-9]+\.[0-9]+\] (BUG:|Oops|Kernel panic|general protection fault|WARNING:)' "$logfile" | head -n3 || true)"

if [ -z "$marker" ]; then
  if [ -e "$tmp/stalled" ]; then
    log_msg "error: the emulator failed: the guest kernel lost a timer interrupt; QEMU was stopped; see $logfile:"
    grep -a -E "$stall_re" "$logfile" | head -n1 | sed "s/^/$prog:   /" >&2
    exit 123
  fi
  if grep -a -q -E '^qemu-system-x86_64: .*Assertion .* failed' "$logfile"; then
    log_msg "error: the emulator failed: QEMU aborted on its own assertion; see $logfile:"
    grep -a -E '^qemu-system-x86_64: .*Assertion' "$logfile" | head -n1 | sed "s/^/$prog:   /" >&2
    exit 123
  fi
  if [ "$qemu_rc" -eq 124 ] || [ "$qemu_rc" -eq 137 ]; then
    log_msg "error: the guest ran past --timeout $secs s without reporting an exit status; see $logfile"
    exit 124
  fi
  if grep -a -q '^qemu-system-x86_64: terminating on signal' "$logfile"; then
    log_msg "error: QEMU was stopped by a signal before the command finished; see $logfile"
    exit 130
  fi
  log_msg "error: the guest ended without reporting an exit status (QEMU status $qemu_rc); see $logfile"
  [ -z "$trouble" ] || printf '%s\n' "$trouble" | sed "s/^/$prog:   /" >&2
  exit 1
fi
if [ -n "$trouble" ]; then
  log_msg "error: the guest kernel reported trouble (command status $marker); see $logfile:"
  printf '%s\n' "$trouble" | sed "s/^/$prog:   /" >&2
  [ "$marker" -ne 0 ] || exit 1
fi
if grep -a -q '^kvtier-guest: NVMe devices did not appear' "$logfile"; then
  log_msg "error: the NVMe devices never appeared in the guest; see $logfile"
fi
log_msg "command exited $marker ($timing)"
exit "$marker"
