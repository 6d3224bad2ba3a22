#!/usr/bin/env bash
# Prepares what tools/guest/run.sh needs: QEMU >= 10 and a static busybox on the host, and a
# guest kernel with NVMe, io_uring, devtmpfs and ext4 built in. Idempotent; everything except
# the package install stays in a cache directory (nothing under /etc is touched).
#
#   CI=true tools/guest/setup.sh          # as root, on Debian bookworm, when packages are missing
#   eval "$(tools/guest/setup.sh | tail -n1)"   # sets KVTIER_GUEST_KERNEL
#
# Environment:
#   KVTIER_GUEST_CACHE       cache directory (default $HOME/.cache/kvtier/guest)
#   KVTIER_GUEST_KERNEL_PKG  pin a kernel package instead of the newest 6.12 cloud one
#   KVTIER_GUEST_REFRESH=1   refresh the package lists even when they are less than a day old
#
# Only the last line goes to stdout: KVTIER_GUEST_KERNEL=<path of vmlinuz>. The VFIO modules
# lie in modules/ beside boot/ (run.sh --vfio finds them there).
set -euo pipefail

cache="${KVTIER_GUEST_CACHE:-${HOME:?HOME is not set}/.cache/kvtier/guest}"
apt_dir="$cache/apt"

log() { printf 'kvtier-guest-setup: %s\n' "$*" >&2; }
die() { log "error: $*"; exit 1; }

qemu_major() {
  qemu-system-x86_64 --version 2>/dev/null | sed -n '1s/^QEMU emulator version \([0-9][0-9]*\)\..*/\1/p'
}
qemu_ok() { local v; v="$(qemu_major)"; [ -n "$v" ] && [ "$v" -ge 10 ]; }
# ldd fails on a static binary; the guest has no libc, so the dynamic busybox would not run.
busybox_ok() { [ -x /bin/busybox ] && ! ldd /bin/busybox >/dev/null 2>&1; }
may_install() { [ "$(id -u)" -eq 0 ] && [ "${CI:-}" = true ]; }

# A private apt configuration: bookworm's own QEMU (7.2) is too old and would replace the
# preinstalled qemu-utils 10, so the host gets QEMU from bookworm-backports; the 6.12 kernel
# comes from bookworm-security (Debian's 6.1 oopses with polled passthrough in flight at exit).
keyring=/usr/share/keyrings/debian-archive-keyring.gpg
mkdir -p "$apt_dir/lists/partial" "$apt_dir/cache/archives/partial" "$apt_dir/sources.list.d"
{
  for suite in bookworm bookworm-updates bookworm-backports; do
    echo "deb [signed-by=$keyring] http://deb.debian.org/debian $suite main"
  done
  echo "deb [signed-by=$keyring] http://deb.debian.org/debian-security bookworm-security main"
} >"$apt_dir/sources.list"
apt_opts=(
  -o "Dir::Etc::SourceList=$apt_dir/sources.list"
  -o "Dir::Etc::SourceParts=$apt_dir/sources.list.d"
  -o "Dir::State::Lists=$apt_dir/lists"
  -o "Dir::Cache=$apt_dir/cache"
  # The cache lives under $HOME, which apt's _apt download user usually cannot enter.
  -o "APT::Sandbox::User=$(id -un)"
)

lists_fresh=false
refresh_lists() {
  "$lists_fresh" && return 0
  command -v apt-get >/dev/null || die "apt-get not found (this script needs a Debian-based host)"
  [ -r "$keyring" ] || die "$keyring missing (install debian-archive-keyring)"
  log "updating the private package lists in $apt_dir/lists"
  apt-get "${apt_opts[@]}" update >&2 || return 1
  touch "$apt_dir/lists.stamp"
  lists_fresh=true
}
# A daily refresh is enough to notice a new security kernel, and keeps CI runs offline-tolerant.
if [ "${KVTIER_GUEST_REFRESH:-}" != 1 ] && [ -n "$(find "$apt_dir/lists.stamp" -mmin -1440 2>/dev/null)" ]; then
  lists_fresh=true
fi

# 1. Host packages.
if qemu_ok && busybox_ok; then
  log "host: $(qemu-system-x86_64 --version | head -n1); static busybox at /bin/busybox"
else
  qemu_ok || log "need qemu-system-x86_64 >= 10 (found: $(qemu-system-x86_64 --version 2>/dev/null | head -n1 || echo none))"
  busybox_ok || log "need a static busybox at /bin/busybox (package busybox-static)"
  may_install || die "installing packages changes this host: run as root with CI=true, or install QEMU >= 10 and busybox-static yourself"
  # shellcheck disable=SC1091
  codename="$(. /etc/os-release && echo "${VERSION_CODENAME:-}")"
  [ "$codename" = bookworm ] || die "automatic install only knows Debian bookworm (this host: ${codename:-unknown}); install QEMU >= 10 and busybox-static yourself"
  refresh_lists || die "apt-get update failed"
  DEBIAN_FRONTEND=noninteractive apt-get "${apt_opts[@]}" install -y --no-install-recommends \
    -t bookworm-backports qemu-system-x86 busybox-static >&2
  qemu_ok || die "qemu-system-x86_64 is still not >= 10 after the install"
  busybox_ok || die "/bin/busybox is still not static after the install"
fi

# 2. Guest kernel, cached by version: only boot/ of the package is kept.
newest_cached() {
  find "$cache" -mindepth 3 -maxdepth 3 -path '*/boot/vmlinuz-*' 2>/dev/null | sort -V | tail -n1
}
pkg="${KVTIER_GUEST_KERNEL_PKG:-}"
if [ -z "$pkg" ]; then
  if ! refresh_lists; then
    vmlinuz="$(newest_cached)"
    [ -n "$vmlinuz" ] || die "apt-get update failed and no kernel is cached in $cache"
    log "warning: apt-get update failed; using the newest cached kernel"
    echo "KVTIER_GUEST_KERNEL=$vmlinuz"
    exit 0
  fi
  # The regex also matches -dbg packages and the bpo kernels; keep the security ones only.
  pkg="$(apt-cache "${apt_opts[@]}" search --names-only 'linux-image-6\.12\..*cloud-amd64-unsigned' \
    | awk '{print $1}' | grep -E '^linux-image-6\.12\.[0-9]+\+deb12-cloud-amd64-unsigned$' \
    | sort -V | tail -n1 || true)"
  [ -n "$pkg" ] || die "no linux-image-6.12.*+deb12-cloud-amd64-unsigned in bookworm-security"
fi
kver="${pkg#linux-image-}"
kver="${kver%-unsigned}"
dest="$cache/$kver"
vmlinuz="$dest/boot/vmlinuz-$kver"
# The VFIO modules (the cloud kernel builds VFIO as modules), in the order they must be loaded,
# kept uncompressed so the guest's busybox insmod can load them as they are.
vfio_modules=(virt/lib/irqbypass drivers/vfio/vfio drivers/vfio/vfio_iommu_type1
  drivers/vfio/pci/vfio-pci-core drivers/vfio/pci/vfio-pci)
modules_ok() {
  local m
  for m in "${vfio_modules[@]}"; do [ -f "$dest/modules/$(basename "$m").ko" ] || return 1; done
}
if [ -f "$vmlinuz" ] && modules_ok; then
  log "kernel $kver already cached"
else
  refresh_lists || die "apt-get update failed"
  log "downloading $pkg"
  work="$(mktemp -d "$cache/.download.XXXXXX")"
  trap 'rm -rf "$work"' EXIT
  (cd "$work" && apt-get "${apt_opts[@]}" download "$pkg" >&2)
  deb="$(find "$work" -maxdepth 1 -name '*.deb' | head -n1)"
  [ -n "$deb" ] || die "apt-get download $pkg produced no .deb"
  dpkg-deb -x "$deb" "$work/x"
  [ -f "$work/x/boot/vmlinuz-$kver" ] || die "$pkg has no boot/vmlinuz-$kver"
  mkdir -p "$work/stage/modules"
  mv "$work/x/boot" "$work/stage/boot"
  for m in "${vfio_modules[@]}"; do
    src="$work/x/lib/modules/$kver/kernel/$m.ko"
    if [ -f "$src.xz" ]; then
      xz -dc "$src.xz" >"$work/stage/modules/$(basename "$m").ko"
    elif [ -f "$src" ]; then
      cp "$src" "$work/stage/modules/"
    else
      die "$pkg has no module $m"
    fi
  done
  # A rename, so an interrupted download never leaves a half-filled version directory.
  rm -rf "$dest"
  mv "$work/stage" "$dest"
fi

# These must be built in (run.sh loads only the VFIO modules, and only with --vfio).
config="$dest/boot/config-$kver"
if [ -f "$config" ]; then
  for opt in BLK_DEV_NVME NVME_CORE IO_URING DEVTMPFS BLK_DEV_INITRD TMPFS EXT4_FS SERIAL_8250_CONSOLE; do
    grep -qx "CONFIG_$opt=y" "$config" || die "$config: CONFIG_$opt is not built in"
  done
fi
echo "KVTIER_GUEST_KERNEL=$vmlinuz"
