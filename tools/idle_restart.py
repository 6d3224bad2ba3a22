#!/usr/bin/env python3
"""Two of issue 12's engine-level figures, through the Python package (the real engine, real
files): the CPU an idle engine uses, and how long a restart over a full slab takes to serve.

* idle: an engine with `--workers` workers on a slab holding a few blocks, left alone for
  `--idle-seconds`; the CPU time of the whole process over that time (every thread: workers,
  the metrics thread when `--metrics` is given), as a percentage of one core.
* restart: `--slots` blocks of `--block-size` stored on one slab (filled once, not timed), the
  engine shut down, then `Engine(...)` timed, and the time to the first load served (a lookup
  of a stored key, a one-block load job, its result), median of `--rounds`.

    python tools/idle_restart.py --dir /var/tmp/kvtier-idle --slots 100000 --block-size 16KiB

Figures and conditions go in docs/perf.md ("Idle and restart").
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import time

import kvtier


def key(i: int) -> bytes:
    # vLLM-shaped: a 32-byte hash and a 4-byte big-endian group.
    return i.to_bytes(8, "big") * 4 + (0).to_bytes(4, "big")


def config(path: str, block: int, slots: int, workers: int, metrics: bool) -> dict:
    cfg = {
        "block_size": block,
        "cores": list(range(workers)),
        # Room to spare: keys hash unevenly over the workers' shares of the slab.
        "devices": [{"path": path, "capacity_bytes": (slots * 9 // 8 + 64) * block + (8 << 20)}],
    }
    if metrics:
        cfg["metrics"] = {"listen": "127.0.0.1:0"}
    return cfg


def wait(engine: kvtier.Engine, n: int) -> list:
    out: list = []
    deadline = time.monotonic() + 600
    while len(out) < n:
        out.extend(engine.wait_finished(1.0))
        if time.monotonic() > deadline:
            raise RuntimeError(f"{len(out)} of {n} results")
    return out


def fill(path: str, block: int, slots: int, workers: int) -> int:
    """Stores keys 0..slots; returns the blocks stored at the end."""
    batch = 256
    region = kvtier.allocate_region(num_blocks=batch, block_size=block)
    with kvtier.Engine(config(path, block, slots, workers, False), region) as engine:
        for b in range(batch):
            region[b * block : b * block + 8] = b.to_bytes(8, "little")
        job = 0
        for start in range(0, slots, batch):
            ids = range(start, min(start + batch, slots))
            job += 1
            engine.submit_store(job, [key(i) for i in ids], list(range(len(ids))))
            [r] = wait(engine, 1)
            if not r.success:
                raise RuntimeError(f"fill: {r}")
        engine.drain()
        stored = engine.stats()["blocks_stored"]
        if stored != slots:
            raise RuntimeError(f"fill: {stored} of {slots} blocks stored (evictions?)")
        return stored


def idle(path: str, block: int, workers: int, seconds: float, metrics: bool) -> float:
    region = kvtier.allocate_region(num_blocks=16, block_size=block)
    with kvtier.Engine(config(path, block, 1024, workers, metrics), region) as engine:
        engine.submit_store(1, [key(i) for i in range(4)], [0, 1, 2, 3])
        wait(engine, 1)
        time.sleep(1.0)  # let start-up settle
        cpu0, t0 = time.process_time(), time.monotonic()
        time.sleep(seconds)
        cpu1, t1 = time.process_time(), time.monotonic()
    return 100.0 * (cpu1 - cpu0) / (t1 - t0)


def restart(path: str, block: int, slots: int, workers: int) -> tuple[float, float]:
    region = kvtier.allocate_region(num_blocks=16, block_size=block)
    t0 = time.monotonic()
    engine = kvtier.Engine(config(path, block, slots, workers, False), region)
    opened = time.monotonic() - t0
    probe = key(slots // 2)
    if engine.lookup([probe]) != ["nvme"]:
        raise RuntimeError("a stored key is not a hit after the restart")
    engine.submit_load(1, [probe], [0])
    [r] = wait(engine, 1)
    served = time.monotonic() - t0
    if not r.success:
        raise RuntimeError(f"first load failed: {r}")
    stored = engine.stats()["blocks_stored"]
    engine.shutdown()
    if stored != slots:
        raise RuntimeError(f"{stored} blocks recovered of {slots}")
    return opened, served


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dir", default="/var/tmp/kvtier-idle-restart")
    ap.add_argument("--slots", type=int, default=100_000)
    ap.add_argument("--block-size", default="16KiB")
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--idle-seconds", type=float, default=60.0)
    ap.add_argument("--metrics", action="store_true", help="idle with the metrics endpoint on")
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    block = kvtier.parse_size(args.block_size)
    os.makedirs(args.dir, exist_ok=True)
    try:
        pct = idle(os.path.join(args.dir, "idle.slab"), block, args.workers,
                   args.idle_seconds, args.metrics)
        print(f"idle: {pct:.3f} % of one core over {args.idle_seconds:.0f} s "
              f"({args.workers} workers{', metrics on' if args.metrics else ''})")
        path = os.path.join(args.dir, "restart.slab")
        t = time.monotonic()
        fill(path, block, args.slots, args.workers)
        print(f"filled {args.slots} slots of {block} bytes in {time.monotonic() - t:.1f} s")
        runs = [restart(path, block, args.slots, args.workers) for _ in range(args.rounds)]
        print("restart: open s " + ", ".join(f"{o:.3f}" for o, _ in runs)
              + "; open to first served load s " + ", ".join(f"{s:.3f}" for _, s in runs)
              + f"; median {statistics.median(s for _, s in runs):.3f}")
    finally:
        shutil.rmtree(args.dir, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
