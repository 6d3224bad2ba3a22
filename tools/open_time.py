#!/usr/bin/env python3
"""How long kvtier.Engine takes to open over a large caller region, as vLLM's CPU tier hands it.

vLLM's primary tier is a shared mapping (/dev/shm) that vLLM pre-faults with
MADV_POPULATE_WRITE before any tier sees it; kvtier registers all of it as fixed buffers on every
worker's ring (the kernel pins each page once per ring). This script builds such a region
(a MAP_SHARED mapping of a /dev/shm file, pre-faulted as vLLM does, not timed), then times
kvtier.Engine(...) over it, a few times per size, and prints the medians.

    python tools/open_time.py --sizes 1GiB 4GiB 16GiB --rounds 3
"""

from __future__ import annotations

import argparse
import mmap
import os
import statistics
import sys
import tempfile
import time

import kvtier

def shm_region(size: int) -> mmap.mmap:
    fd, path = tempfile.mkstemp(dir="/dev/shm", prefix="kvtier-open-time-")
    try:
        os.ftruncate(fd, size)
        m = mmap.mmap(fd, size, flags=mmap.MAP_SHARED)
    finally:
        os.close(fd)
        os.unlink(path)  # as vLLM does once every worker has mapped it
    populate = getattr(mmap, "MADV_POPULATE_WRITE", 23)
    try:
        m.madvise(populate)
    except OSError:
        for off in range(0, size, mmap.PAGESIZE):
            m[off] = 0
    return m


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sizes", nargs="+", default=["1GiB", "4GiB", "16GiB"])
    ap.add_argument("--block-size", default="2 MiB")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--cores", default="auto", help='"auto" or a comma list, e.g. 0,1')
    ap.add_argument("--dir", default="/var/tmp")
    args = ap.parse_args()
    cores = args.cores if args.cores == "auto" else [int(c) for c in args.cores.split(",")]
    block = kvtier.parse_size(args.block_size)
    print("| region | workers | open s (median) | opens |")
    print("| --- | --- | --- | --- |")
    for size_text in args.sizes:
        size = kvtier.parse_size(size_text) // block * block
        region = shm_region(size)
        times = []
        workers = 0
        with tempfile.TemporaryDirectory(dir=args.dir, prefix="kvtier-open-time-") as d:
            cfg = {"block_size": block, "cores": cores,
                   "devices": [{"path": d, "layout": "files"}],
                   "files": {"namespace": {"model_name": "open-time", "dtype": "bfloat16",
                                           "tokens_per_hash": 16, "blocks_per_file": 1,
                                           "kv_cache_groups": []}}}
            for _ in range(args.rounds):
                t0 = time.perf_counter()
                engine = kvtier.Engine(cfg, region)
                times.append(time.perf_counter() - t0)
                workers = len(engine.info()["workers"])
                engine.shutdown()
        region.close()
        print(f"| {size_text} | {workers} | {statistics.median(times):.3f} | "
              f"{', '.join(f'{t:.3f}' for t in times)} |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
