#!/usr/bin/env bash
# The three ways kvtier reaches an NVMe namespace, side by side in one QEMU guest (q35, emulated
# IOMMU): the block layer (/dev/nvme0n1, O_DIRECT), io_uring passthrough (/dev/ng0n1) and the
# user-space driver (VFIO), `kvtier bench` at queue depth 1 on each, alternating, for --rounds
# rounds (the controller moves between nvme and vfio-pci every round). Prints, per path, the
# medians of load and store p50 latency and of the worker's CPU per I/O, and their ratios to
# the block layer.
#
#   tools/guest/vfio-compare.sh [--rounds N] [--block-size 256KiB] [--duration S] [--json FILE]
#
# The guest runs on TCG: the controller is emulated by the same host CPUs, so absolute figures
# say nothing about a drive; only the ratios within one run mean something, and they mostly
# measure how much work each path does per I/O on the guest's CPU.
set -euo pipefail
cd "$(dirname "$0")/../.."

rounds=3 block_size=256KiB duration=3 json=""
while [ $# -gt 0 ]; do
  case "$1" in
    --rounds) rounds="$2"; shift 2 ;;
    --block-size) block_size="$2"; shift 2 ;;
    --duration) duration="$2"; shift 2 ;;
    --json) json="$2"; shift 2 ;;
    -h|--help) sed -n '2,13p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
    *) echo "vfio-compare: unknown argument $1" >&2; exit 2 ;;
  esac
done
GUEST_SCRIPT=vfio-compare GUEST_WHAT="VFIO comparison"
. tools/guest/common.sh
kernel=$(guest_kernel)
kvtier=target/release/kvtier
[ -x "$kvtier" ] || cargo build --release --locked -p kvtier-cli
work=$(mktemp -d /tmp/kvtier-vfio-compare.XXXXXX)
trap 'rm -rf "$work"' EXIT
strip -o "$work/kvtier" "$kvtier"
head_toml='block_size = "1 MiB"
cores = [0]
region_blocks = 64

[[devices]]
capacity_bytes = "128 MiB"
overwrite = true'
printf '%s\npath = "/dev/nvme0n1"\nkind = "block"\n' "$head_toml" >"$work/block.toml"
printf '%s\npath = "/dev/ng0n1"\n' "$head_toml" >"$work/passthrough.toml"
printf '%s\npci = "PCI"\n' "$head_toml" >"$work/vfio.toml"

bench="kvtier bench --block-size $block_size --blocks 64 --queue-depth 1 --duration $duration --workload all"
log="$work/guest.log"
tools/guest/run.sh --kernel "$kernel" --vfio --lba-size 4096 --poll-queues 0 --disk-mib 256 \
  --mem-mib 1024 --timeout 1800 --log "$log" --bin "$work/kvtier" \
  --file "$work/block.toml:/etc/b.toml" --file "$work/passthrough.toml:/etc/p.toml" \
  --file "$work/vfio.toml:/etc/v.toml" -- \
  "set -e; p=\$KVTIER_GUEST_NVME_PCI; d=/sys/bus/pci/devices/\$p; sed -i \"s/PCI/\$p/\" /etc/v.toml; \
   to_vfio() { echo \$p > \$d/driver/unbind; echo vfio-pci > \$d/driver_override; echo \$p > /sys/bus/pci/drivers_probe; }; \
   to_nvme() { echo \$p > \$d/driver/unbind; echo > \$d/driver_override; echo \$p > /sys/bus/pci/drivers_probe; \
     n=0; while [ ! -e /dev/ng0n1 ] && [ \$n -lt 50 ]; do sleep 0.2; n=\$((n + 1)); done; }; \
   one() { $bench --config /etc/\$1.toml --json /tmp/r.json >/dev/null 2>/tmp/err || { cat /tmp/err; return 1; }; \
     echo \"KVTIER_BENCH \$1 \$2 \$(tr -d '\n' < /tmp/r.json)\"; }; \
   for r in \$(seq 1 $rounds); do one b \$r; one p \$r; to_vfio; one v \$r; to_nvme; done" \
  >/dev/null 2>&1 || { echo "vfio-compare: the guest failed; its console:" >&2; tail -n 40 "$log" >&2; exit 1; }

grep -a '^KVTIER_BENCH ' "$log" | python3 -c '
import json, statistics, sys
names = {"b": "block layer (/dev/nvme0n1)", "p": "passthrough (/dev/ng0n1)", "v": "VFIO (user space)"}
runs = {}
for line in sys.stdin:
    _, path, rnd, body = line.rstrip("\n").split(" ", 3)
    rows = {r["workload"]: r for r in json.loads(body)["results"]}
    def per_io(row):
        ios = row["bytes"] / row["block_size"]
        return row["cpu_seconds"] / ios * 1e6 if ios else float("nan")
    runs.setdefault(path, []).append({
        "load_p50_us": rows["load_alone"]["p50_us"],
        "store_p50_us": rows["store"]["p50_us"],
        "load_cpu_us_per_io": per_io(rows["load_alone"]),
        "store_cpu_us_per_io": per_io(rows["store"]),
    })
med = {p: {k: statistics.median(r[k] for r in rs) for k in rs[0]} for p, rs in runs.items()}
keys = ["load_p50_us", "store_p50_us", "load_cpu_us_per_io", "store_cpu_us_per_io"]
print("path                          " + "  ".join(f"{k:>20}" for k in keys))
for p in ("b", "p", "v"):
    if p not in med:
        continue
    cells = []
    for k in keys:
        ratio = med[p][k] / med["b"][k] if med["b"][k] else float("nan")
        cells.append(f"{med[p][k]:>10.1f} ({ratio:4.2f}x)")
    print(f"{names[p]:<30}" + "  ".join(f"{c:>20}" for c in cells))
rounds = len(runs.get("b", []))
print(f"medians of {rounds} rounds; ratios to the block layer; TCG guest: ratios only")
out = sys.argv[1]
if out:
    json.dump({"runs": runs, "medians": med}, open(out, "w"), indent=1)
' "$json"
