#!/usr/bin/env python3
"""kvtier's vLLM tier against vLLM's own file-system tier (0.33.0 or 0.34.0), through the same calls.

Both tiers are built by vLLM's real SecondaryTierFactory over the same primary buffer (an
anonymous, page-aligned mmap, the shape vLLM's CPU tier hands its tiers) and driven through the
same SecondaryTierManager calls: submit_store / submit_load of TransferJobs, drain_jobs,
get_finished_jobs. vLLM's tiering modules come from its wheel through python/tests/vllm_harness
(real code; torch and engine modules stood in); its fs tier runs with its default 16 + 16
threads and, by default (--vllm-io c), its production I/O path: the wheel's C extension
vllm/fs_io_C.abi3.so (batched open/write/rename and read with the GIL released), loaded with
empty stand-ins for the torch/CUDA libraries it links but does not call. --vllm-io python runs
its pure-Python fallback instead.

Per cell (block size x job shape) and round, in rotating order with the disk flushed between
tiers, each tier stores fresh keys
into its own directory (kept for the cell's rounds, as a cache directory lives on): a store phase (every job submitted at once, then drain) and a load
phase of the same keys into other rows (bytes verified after timing). Reported: MiB/s, process
CPU seconds (every thread: vLLM's pool, kvtier's workers), medians over rounds, and
kvtier/vLLM ratios of the medians.

    python tools/vllm_compare.py --dir /var/tmp --rounds 5
    python tools/vllm_compare.py --primary-dir /mnt/shm-huge   # a tmpfs mounted huge=within_size
    python tools/vllm_compare.py --block-size 256KiB --shape one --layout files slab --json out.json

Needs: the kvtier package installed (pip install ./python), numpy, typing_extensions, and
vLLM's wheel (pip download vllm==0.34.0 --no-deps -d DIR; --wheel or KVTIER_VLLM_WHEEL_DIR), of
the version --vllm-version names (0.33.0, the default, or 0.34.0).
"""

from __future__ import annotations

import argparse
import gc
import json
import mmap
import os
import shutil
import statistics
import sys
import tempfile
import time

import numpy as np

import kvtier

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "python",
                                "tests"))
VLLM_VERSIONS = ("0.33.0", "0.34.0")


def _vllm_version_first() -> None:
    """--vllm-version picks the harness's vLLM, which reads it when imported: read it first."""
    pre = argparse.ArgumentParser(add_help=False)
    pre.add_argument("--vllm-version", choices=VLLM_VERSIONS)
    known, _ = pre.parse_known_args()
    if known.vllm_version:
        os.environ["KVTIER_VLLM_VERSION"] = known.vllm_version


_vllm_version_first()
import vllm_harness as H  # noqa: E402
from compare_common import cpu_seconds  # noqa: E402


def settle(directory: str) -> None:
    """Flush what earlier phases wrote down to the device (a cache flush through the virtual
    disk to the host) and pause briefly, so one tier's writes do not slow the next one."""
    os.sync()
    fd, path = tempfile.mkstemp(dir=directory, prefix=".vllm-compare-flush-")
    try:
        os.write(fd, b"x")
        os.fsync(fd)
    finally:
        os.close(fd)
        os.unlink(path)
    time.sleep(0.3)


def show_size(n: int) -> str:
    return f"{n >> 20}MiB" if n >= 1 << 20 and n % (1 << 20) == 0 else f"{n >> 10}KiB"


def shm_primary(directory: str, num_blocks: int, block_bytes: int) -> H.Primary:
    """A primary buffer made as vLLM's CPU tier makes it: a file in ``directory`` (vLLM: /dev/shm)
    sized with ftruncate and mapped shared, then unlinked (the mapping keeps it). On a tmpfs
    mounted with huge=within_size it is mapped with 2 MiB pages."""
    fd, path = tempfile.mkstemp(dir=directory, prefix="vllm-compare-primary-")
    try:
        # Allocated now, so that a full tmpfs is an error here and not a SIGBUS at first touch
        # (vLLM checks the free space of /dev/shm first).
        os.posix_fallocate(fd, 0, num_blocks * block_bytes)
        mm = mmap.mmap(fd, num_blocks * block_bytes, mmap.MAP_SHARED,
                       mmap.PROT_READ | mmap.PROT_WRITE)
    finally:
        os.close(fd)
        os.unlink(path)
    array = np.frombuffer(mm, dtype=np.uint8).reshape(num_blocks, block_bytes)
    return H.Primary(array, memoryview(array))


def huge_percent(array: np.ndarray) -> float:
    """How much of the buffer is mapped with huge pages (as the engine reports it)."""
    lo, hi = array.ctypes.data, array.ctypes.data + array.nbytes
    total = huge = 0
    vma = None
    for line in open("/proc/self/smaps"):
        word = line.split()
        if "-" in word[0] and not word[0].endswith(":"):
            start, end = (int(x, 16) for x in word[0].split("-"))
            vma = (start, end) if start < hi and end > lo else None
            if vma:
                total += min(hi, end) - max(lo, start)
        elif vma and word[0] in ("AnonHugePages:", "ShmemPmdMapped:", "FilePmdMapped:"):
            huge += int(word[1]) * 1024 * (min(hi, vma[1]) - max(lo, vma[0])) // (vma[1] - vma[0])
    return 100.0 * huge / total if total else 0.0


class Cell:
    def __init__(self, vllm, block: int, blocks: int, jobs: int, base: str,
                 primary_dir: str | None = None):
        self.vllm = vllm
        self.block = block
        self.blocks = blocks
        self.jobs = jobs
        self.base = base
        self.roots: dict[str, str] = {}
        self.marks = False
        # Rows [0, blocks) are the store source, [blocks, 2*blocks) the load target.
        self.primary = (H.make_primary(2 * blocks, block) if primary_dir is None
                        else shm_primary(primary_dir, 2 * blocks, block))
        self.spec = H.make_spec(vllm, num_blocks=2 * blocks, block_bytes=block)
        rng = np.random.default_rng(block + blocks + jobs)
        self.primary.array[:blocks] = rng.integers(0, 256, size=(blocks, block), dtype=np.uint8)
        self.expect = self.primary.array[:blocks].copy()
        self.huge_percent = huge_percent(self.primary.array)

    def tier(self, name: str, root: str):
        if name == "vllm-fs":
            entry = {"type": "fs", "root_dir": root}
        elif name == "kvtier-files":
            entry = {"type": "KvtierTierManager", "module_path": "kvtier.vllm", "root_dir": root}
        elif name.startswith("kvtier-files["):
            # The files layout with settings changed (the config form of the entry).
            config = {"cores": "auto", "direct_io": "auto",
                      "devices": [{"path": root, "layout": "files"}], "files": {}}
            for setting in name[len("kvtier-files["):-1].split(","):
                key, value = setting.split("=", 1)
                section, _, field = key.rpartition(".")
                table = config.setdefault(section, {}) if section else config
                table[field] = json.loads(value)
            entry = {"type": "KvtierTierManager", "module_path": "kvtier.vllm", "config": config}
        elif name == "kvtier-slab":
            entry = {"type": "KvtierTierManager", "module_path": "kvtier.vllm", "root_dir": root,
                     "layout": "slab",
                     # Slot-table pages (32 slots each) are split between workers: keep
                     # at least a few pages per worker so every worker has room.
                     "capacity_bytes": max(2 * self.blocks, 256) * self.block}
        else:
            raise ValueError(name)
        return self.vllm.SecondaryTierFactory.create_secondary_tier(entry, self.primary.view,
                                                                    self.spec)

    def jobs_of(self, keys, first_row: int, load: bool, job_base: int):
        ctx = self.vllm.ReqContext(req_id=f"bench-{job_base}")
        per = -(-len(keys) // self.jobs)
        out = []
        for j in range(self.jobs):
            lo, hi = j * per, min(len(keys), (j + 1) * per)
            if lo >= hi:
                break
            out.append(H.make_job(keys[lo:hi], list(range(first_row + lo, first_row + hi)),
                                  job_base + j, ctx, is_promotion=load))
        return out

    def run_phase(self, tier, jobs, load: bool) -> tuple[float, float]:
        submit = tier.submit_load if load else tier.submit_store
        c0, t0 = cpu_seconds(), time.perf_counter()
        for job in jobs:
            submit(job)
        tier.drain_jobs()
        results = list(tier.get_finished_jobs())
        t1, c1 = time.perf_counter(), cpu_seconds()
        bad = [r for r in results if not r.success]
        if len(results) != len(jobs) or bad:
            raise RuntimeError(f"{len(results)} results for {len(jobs)} jobs, failed: {bad[:3]}")
        return t1 - t0, c1 - c0

    def mark(self, name: str, phase: str, start: float) -> None:
        """With --marks: the phase's window on CLOCK_MONOTONIC (perf record -k CLOCK_MONOTONIC
        timestamps; tools/io_trace.py --marks reads these lines)."""
        if self.marks:
            end = time.clock_gettime(time.CLOCK_MONOTONIC)
            print(f"phase {name.replace(' ', '')} {phase} {self.block} {self.jobs} {start:.6f} "
                  f"{end:.6f}", file=sys.stderr, flush=True)

    def root(self, name: str) -> str:
        """One directory per tier for the whole cell: a cache directory lives on, so its
        fan-out directories fill in over time (deleting them between rounds would instead
        measure ext4's inode allocator scanning recently deleted inodes)."""
        if name not in self.roots:
            self.roots[name] = tempfile.mkdtemp(prefix=f"vllm-compare-{name}-", dir=self.base)
        return self.roots[name]

    def cleanup(self) -> None:
        for root in self.roots.values():
            shutil.rmtree(root, ignore_errors=True)
        self.roots.clear()

    def round(self, name: str, round_no: int) -> dict:
        tier = self.tier(name, self.root(name))
        try:
            keys = [H.make_key(f"{name}-{round_no}-{i}") for i in range(self.blocks)]
            t0 = time.clock_gettime(time.CLOCK_MONOTONIC)
            st, sc = self.run_phase(tier, self.jobs_of(keys, 0, False, 1_000_000), load=False)
            self.mark(name, "store", t0)
            self.primary.array[self.blocks:] = 0
            t0 = time.clock_gettime(time.CLOCK_MONOTONIC)
            lt, lc = self.run_phase(tier, self.jobs_of(keys, self.blocks, True, 2_000_000),
                                    load=True)
            self.mark(name, "load", t0)
            if not np.array_equal(self.primary.array[self.blocks:], self.expect):
                raise RuntimeError(f"{name}: loaded bytes differ from the stored ones")
        finally:
            tier.shutdown()
        mib = self.blocks * self.block / (1 << 20)
        return {"store_mib_s": mib / st, "store_cpu_s": sc, "load_mib_s": mib / lt,
                "load_cpu_s": lc}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dir", default="/var/tmp", help="directory on the disk to test")
    ap.add_argument("--block-size", nargs="+", default=["256KiB", "2MiB"])
    ap.add_argument("--shape", nargs="+", default=["one", "16"],
                    help="'one' (one job of every block) and/or a number of jobs in flight")
    ap.add_argument("--layout", nargs="+", default=["files", "slab"], choices=["files", "slab"])
    ap.add_argument("--bytes", default="256MiB", help="bytes stored and loaded per cell and round")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--vllm-version", choices=VLLM_VERSIONS, default=H.VLLM_VERSION,
                    help="the vLLM whose tiering code and fs tier run (its wheel is needed)")
    ap.add_argument("--wheel", default=None, help="that vLLM's wheel (else found as the "
                    "harness finds it)")
    ap.add_argument("--json", default=None, help="write the results as JSON here ('-': stdout)")
    ap.add_argument("--vllm-io", choices=["c", "python"], default="c",
                    help="vLLM fs tier's I/O: its C extension (production) or Python fallback")
    ap.add_argument("--files-variant", nargs="*", default=[],
                    help="also run the files layout with these settings, each a comma-separated "
                    "list of KEY=JSON (KEY: a top-level field or SECTION.FIELD), e.g. "
                    "files.io_wq_workers=8 or 'cores=[0],files.checksums=false'")
    ap.add_argument("--primary-dir", default=None,
                    help="make the primary buffer as vLLM does, a file mapped from this "
                    "directory (/dev/shm, or a tmpfs mounted huge=within_size for 2 MiB pages); "
                    "default: an anonymous shared mapping (4 KiB pages)")
    ap.add_argument("--marks", action="store_true",
                    help="print each phase's window (CLOCK_MONOTONIC) to stderr, for "
                    "tools/io_trace.py")
    args = ap.parse_args()

    os.environ["KVTIER_VLLM_FS_IO_C"] = "1" if args.vllm_io == "c" else "0"
    vllm = H.load_vllm(args.wheel)
    if vllm.fs_io_C_available != (args.vllm_io == "c"):
        raise SystemExit(f"vLLM's fs tier I/O is not the one asked for (--vllm-io {args.vllm_io})")
    import kvtier.vllm  # noqa: F401  (after the harness put vLLM's modules in place)

    total = kvtier.parse_size(args.bytes)
    names = (["vllm-fs"] + [f"kvtier-{layout}" for layout in args.layout]
             + [f"kvtier-files[{v}]" for v in args.files_variant])
    cells = []
    for bs_text in args.block_size:
        block = kvtier.parse_size(bs_text)
        blocks = max(16, total // block)
        for shape in args.shape:
            jobs = 1 if shape == "one" else int(shape)
            cell = Cell(vllm, block, blocks, jobs, args.dir, args.primary_dir)
            cell.marks = args.marks
            runs: dict[str, list[dict]] = {n: [] for n in names}
            huge = cell.huge_percent
            try:
                for r in range(args.rounds):
                    # Rotate, so every tier follows every other one as often (a fast writer's
                    # burst can slow whoever comes next on a virtual disk), and let the disk
                    # settle between tiers.
                    k = r % len(names)
                    for n in names[k:] + names[:k]:
                        settle(args.dir)
                        runs[n].append(cell.round(n, r))
            finally:
                cell.cleanup()
                # Free this cell's primary buffer before the next one is made (the tiers that
                # held views of it may sit in reference cycles).
                del cell
                gc.collect()
            med = {n: {k: statistics.median(x[k] for x in runs[n]) for k in runs[n][0]}
                   for n in names}
            cells.append({"block_bytes": block, "blocks": blocks, "jobs": jobs,
                          "primary_huge_percent": huge, "rounds": runs,
                          "median": med})
            print(f"done {show_size(block)} x {blocks} blocks, {jobs} job(s), primary "
                  f"{huge:.0f} % in huge pages", file=sys.stderr)

    header = ("| block | jobs | tier | store MiB/s | store CPU s | load MiB/s | load CPU s | "
              "store × | load × | store CPU × | load CPU × |")
    print(header)
    print("|" + " --- |" * (header.count("|") - 1))
    for c in cells:
        ref = c["median"]["vllm-fs"]
        for n in names:
            m = c["median"][n]
            ratios = ("", "", "", "") if n == "vllm-fs" else (
                f"{m['store_mib_s'] / ref['store_mib_s']:.2f}",
                f"{m['load_mib_s'] / ref['load_mib_s']:.2f}",
                f"{m['store_cpu_s'] / ref['store_cpu_s']:.2f}",
                f"{m['load_cpu_s'] / ref['load_cpu_s']:.2f}")
            print(f"| {show_size(c['block_bytes'])} | {c['jobs']} | {n} | {m['store_mib_s']:.0f} "
                  f"| {m['store_cpu_s']:.2f} | {m['load_mib_s']:.0f} | {m['load_cpu_s']:.2f} | "
                  + " | ".join(ratios) + " |")
    print(f"vLLM {vllm.version}; its fs tier's I/O: "
          f"{'C extension (fs_io_C)' if vllm.fs_io_C_available else 'Python'}")
    report = {"dir": args.dir, "primary_dir": args.primary_dir, "rounds": args.rounds,
              "bytes_per_cell": total,
              "vllm_version": vllm.version, "fs_io_C": vllm.fs_io_C_available, "cells": cells}
    if args.json == "-":
        json.dump(report, sys.stdout, indent=1)
    elif args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
