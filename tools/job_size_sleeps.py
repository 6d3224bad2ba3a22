#!/usr/bin/env python3
"""Loads (or, with `--workload store`, stores of new keys) in jobs of 1, 2, 4 and 8 blocks with
the same blocks in flight, and what the job size does to the workers' sleeps and CPU per GiB
(issue 35): a worker that gets a job's blocks together issues them together, the device
completes them together, and one wake-up reaps them; one-block jobs arriving one at a time wake
it more often. On a virtual machine each wake-up
costs the worker several µs of CPU (`cargo bench --bench wake_cost`).

Through the Python package (the real engine, a real slab of `--slab` bytes in `--dir`): the keys
are stored once, then each job size runs `--seconds` in turn, `--rounds` times in alternating
order, with `--in-flight` blocks in flight in total (in-flight / size jobs), each finished job
replaced at once. With `--fio` (fio installed), fio's random reads (writes) of the same block
size on a file of the same size, `numjobs` = the engine's workers and `iodepth` = in-flight /
workers, run before each round and after the last, as the reference: fio's CPU per GiB (usr +
sys) and its context switches per I/O. fio's buffers are hugetlb pages (`iomem=mmaphuge`) when
enough are free (`echo 16 > /proc/sys/vm/nr_hugepages`), as the engine's region is huge pages.

    python tools/job_size_sleeps.py --dir /var/tmp --block-size 256KiB --in-flight 8 --fio

Figures and conditions go in docs/perf.md ("Load CPU per GiB: the sleeps").
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import statistics
import subprocess
import tempfile
import time

import kvtier

SIZES = (1, 2, 4, 8)


def key(i: int) -> bytes:
    return i.to_bytes(8, "big") * 4 + (0).to_bytes(4, "big")


class Stores:
    """New keys for store jobs, from `first` on (never stored before in this run)."""

    def __init__(self, first: int) -> None:
        self.next = first

    def take(self, n: int) -> list[int]:
        self.next += n
        return list(range(self.next - n, self.next))


def run_size(
    engine: kvtier.Engine,
    workload: str,
    size: int,
    in_flight: int,
    keys: int,
    stores: Stores,
    seconds: float,
) -> dict:
    """Keeps `in_flight // size` jobs of `size` keys in flight: loads of distinct stored keys,
    or stores of new keys."""
    jobs = in_flight // size
    rng = random.Random(size)
    next_id = 0

    def submit(slot: int) -> None:
        nonlocal next_id
        next_id += 1
        blocks = list(range(slot * size, slot * size + size))
        if workload == "load":
            picked = rng.sample(range(keys), size)
            engine.submit_load((next_id << 16) | slot, [key(k) for k in picked], blocks)
        else:
            engine.submit_store((next_id << 16) | slot, [key(k) for k in stores.take(size)], blocks)

    before = engine.stats()
    start = time.monotonic()
    for slot in range(jobs):
        submit(slot)
    while time.monotonic() - start < seconds:
        for r in engine.wait_finished(0.1):
            if not r.success:
                raise SystemExit(f"a {workload} job failed: {r}")
            submit(r.job_id & 0xFFFF)
    engine.drain()
    for r in engine.poll_finished():
        if not r.success:
            raise SystemExit(f"a {workload} job failed: {r}")
    elapsed = time.monotonic() - start
    after = engine.stats()
    counted = ("read_ops", "write_ops", "table_writes", "loads_ok", "stores_ok", "wakeups",
               "submits", "worker_cpu_seconds")
    delta = {k: after[k] - before[k] for k in counted}
    # Device ops: data reads or writes and, for stores, slot-table page writes.
    ops = delta["read_ops"] + delta["write_ops"] + delta["table_writes"]
    blocks = delta["loads_ok"] + delta["stores_ok"]
    gib = blocks * engine.block_size / 2**30
    return {
        "blocks_per_job": size,
        "gib_per_s": gib / elapsed,
        "sleeps_per_op": delta["wakeups"] / ops,
        "enters_per_op": delta["submits"] / ops,
        "worker_cpu_s_per_gib": delta["worker_cpu_seconds"] / gib,
    }


def hugetlb_free_bytes() -> int:
    with open("/proc/meminfo") as f:
        info = dict(line.split(":", 1) for line in f)
    return int(info["HugePages_Free"].split()[0]) * int(info["Hugepagesize"].split()[0]) * 1024


def fio_iomem(block: int, workers: int, in_flight: int) -> str:
    """Huge pages for fio's buffers when hugetlb pages are free for them (the engine's region
    is in transparent huge pages): with 4 KiB pages a 256 KiB read is 64 segments, and fio on
    the development machine then reads a third slower and sleeps twice as often."""
    per_job = max(1, in_flight // workers) * block
    need = workers * ((per_job + (2 << 20) - 1) // (2 << 20) + 1) * (2 << 20)
    return "mmaphuge" if hugetlb_free_bytes() >= need else "malloc"


def run_fio(
    workload: str, path: str, block: int, size: int, workers: int, in_flight: int, seconds: float
) -> dict:
    iomem = fio_iomem(block, workers, in_flight)
    job = "\n".join(
        [
            "[global]",
            "ioengine=io_uring",
            "direct=1",
            "fixedbufs=1",
            "registerfiles=1",
            f"iomem={iomem}",
            f"filename={path}",
            f"size={size}",
            f"bs={block}",
            f"numjobs={workers}",
            f"iodepth={max(1, in_flight // workers)}",
            f"cpus_allowed={','.join(str(c) for c in range(workers))}",
            "cpus_allowed_policy=split",
            "time_based=1",
            f"runtime={int(seconds * 1000)}ms",
            "norandommap=1",
            "randrepeat=0",
            "group_reporting=1",
            f"[{workload}s]",
            "rw=randread" if workload == "load" else "rw=randwrite",
            "",
        ]
    )
    out = subprocess.run(
        ["fio", "--output-format=json", "-"],
        input=job,
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    j = json.loads(out)["jobs"][0]
    r = j["read" if workload == "load" else "write"]
    gib = r["io_bytes"] / 2**30
    cpu = (j["usr_cpu"] + j["sys_cpu"]) / 100 * j["job_runtime"] / 1000
    return {
        "gib_per_s": gib / (r["runtime"] / 1000),
        "sleeps_per_op": j["ctx"] / r["total_ios"],
        "cpu_s_per_gib": cpu / gib,
        "iomem": iomem,
    }


def print_fio(f: dict) -> None:
    print(
        f"fio              {f['gib_per_s']:6.3f} GiB/s  sleeps/op {f['sleeps_per_op']:.3f}  "
        f"cpu s/GiB {f['cpu_s_per_gib']:.3f}  iomem={f['iomem']}",
        flush=True,
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dir", default="/var/tmp")
    ap.add_argument("--block-size", default="256KiB")
    ap.add_argument("--slab", default="1GiB", help="slab size (default 1GiB)")
    ap.add_argument("--in-flight", type=int, default=8, help="blocks in flight (a multiple of 8)")
    ap.add_argument("--workers", type=int, default=min(2, os.cpu_count() or 1))
    ap.add_argument("--seconds", type=float, default=4.0)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--workload", choices=("load", "store"), default="load")
    ap.add_argument(
        "--fio", action="store_true", help="fio's random reads (or writes) as the reference"
    )
    ap.add_argument("--json", help="also write every measurement to this file")
    args = ap.parse_args()
    if args.in_flight % max(SIZES) != 0:
        ap.error(f"--in-flight {args.in_flight}: must be a multiple of {max(SIZES)}")
    block = kvtier.parse_size(args.block_size)
    slab = kvtier.parse_size(args.slab)
    work = tempfile.mkdtemp(prefix="kvtier-job-size-", dir=args.dir)
    results: list[dict] = []
    try:
        path = os.path.join(work, "kvtier.slab")
        # Three quarters of the slots hold keys; the rest is room the workers' shares need.
        keys = slab // block * 3 // 4
        region = kvtier.allocate_region(num_blocks=args.in_flight, block_size=block)
        config = {
            "block_size": block,
            "cores": list(range(args.workers)),
            "devices": [{"path": path, "capacity_bytes": slab}],
        }
        fio_path = os.path.join(work, "fio.bin")
        if args.fio:
            with open(fio_path, "wb") as f:
                chunk = os.urandom(1 << 20)
                for _ in range(slab >> 20):
                    f.write(chunk)
        stores = Stores(keys)
        with kvtier.Engine(config, region) as engine:
            for first in range(0, keys, args.in_flight):
                n = min(args.in_flight, keys - first)
                batch = [key(k) for k in range(first, first + n)]
                engine.submit_store(first, batch, list(range(n)))
                engine.drain()
                for r in engine.poll_finished():
                    if not r.success:
                        raise SystemExit(f"storing the keys failed: {r}")
            for rnd in range(args.rounds):
                if args.fio:
                    f = run_fio(
                        args.workload, fio_path, block, slab, args.workers, args.in_flight,
                        args.seconds,
                    )
                    results.append({"tool": "fio", "round": rnd, **f})
                    print_fio(f)
                order = SIZES if rnd % 2 == 0 else tuple(reversed(SIZES))
                for size in order:
                    r = run_size(
                        engine, args.workload, size, args.in_flight, keys, stores, args.seconds
                    )
                    results.append({"tool": "kvtier", "round": rnd, **r})
                    print(
                        f"kvtier {size} blocks/job {r['gib_per_s']:6.3f} GiB/s  sleeps/op "
                        f"{r['sleeps_per_op']:.3f}  enters/op {r['enters_per_op']:.3f}  "
                        f"worker cpu s/GiB {r['worker_cpu_s_per_gib']:.3f}",
                        flush=True,
                    )
            if args.fio:
                f = run_fio(
                    args.workload, fio_path, block, slab, args.workers, args.in_flight,
                    args.seconds,
                )
                results.append({"tool": "fio", "round": args.rounds, **f})
                print_fio(f)
        print("\nmedians")
        fio_cpu = None
        if args.fio:
            fio_runs = [r for r in results if r["tool"] == "fio"]
            fio_cpu = statistics.median(r["cpu_s_per_gib"] for r in fio_runs)
            fio_sleeps = statistics.median(r["sleeps_per_op"] for r in fio_runs)
            print(f"fio              sleeps/op {fio_sleeps:.3f}  cpu s/GiB {fio_cpu:.3f}")
        for size in SIZES:
            runs = [r for r in results if r.get("blocks_per_job") == size]
            cpu = statistics.median(r["worker_cpu_s_per_gib"] for r in runs)
            ratio = f"  cpu ratio to fio {cpu / fio_cpu:.2f}" if fio_cpu else ""
            print(
                f"kvtier {size} blocks/job sleeps/op "
                f"{statistics.median(r['sleeps_per_op'] for r in runs):.3f}  worker cpu s/GiB "
                f"{cpu:.3f}{ratio}"
            )
        if args.json:
            with open(args.json, "w") as f:
                json.dump(results, f, indent=1)
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
