#!/usr/bin/env python3
"""kvtier's LMCache L2 connector against LMCache's own file-system L2 adapter (``fs``).

Both adapters are built as LMCache's multi-process server builds them, from a ``--l2-adapter``
JSON argument through its real parser and factory (python/tests/lmcache_harness: LMCache's
modules from its wheel): kvtier as a ``native_plugin`` wrapped in LMCache's
``NativeConnectorL2Adapter``, and ``{"type": "fs", "base_path": ...}`` (its ``FSL2Adapter``:
aiofiles on an asyncio loop, buffered unless ``--fs-odirect``). Both are driven through the
same ``L2AdapterInterface`` calls LMCache's storage controller makes: ``submit_store_task`` /
``submit_load_task`` of L1 objects, completions waited for on the adapter's event fds.

With ``--in-place``, every L1 object (both adapters') is carved from one arena as LMCache's
allocator carves it (aligned to kvtier's block size, as ``--l1-align-bytes`` would make it),
and kvtier runs as the ``plugin`` adapter ``KvtierL2Adapter`` over that arena: its region is
the arena and objects move with no copy (the fs adapter is handed the same description).

A request is one task of --objects-per-request objects of --object-bytes each; --in-flight
tasks are kept submitted. Per round and adapter (the order alternates): a store phase of fresh
keys, then (after ``sync`` and dropping the page cache when allowed) a load phase of the same
keys into other objects, verified byte for byte after timing. Reported: GiB/s, process CPU
seconds per GiB (every thread), medians over rounds, kvtier/fs ratios. Stores are also timed
to the end of a ``sync`` after the phase ("synced": the bytes on the device; the fs adapter's
buffered stores return once the bytes are in the page cache).

    python tools/lmcache_compare.py --dir /var/tmp --rounds 5
    python tools/lmcache_compare.py --in-flight 1 16 --object-bytes 8MiB --json out.json
    python tools/lmcache_compare.py --in-place --fs-odirect --rounds 5

Needs: the kvtier package (pip install ./python), numpy, aiofiles, and LMCache's wheel (pip
download lmcache==0.5.6 --no-deps -d DIR; KVTIER_LMCACHE_WHEEL_DIR=DIR).
"""

from __future__ import annotations

import argparse
import json
import os
import select
import shutil
import statistics
import sys
import tempfile
import time

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "python",
                                "tests"))
import lmcache_harness as H  # noqa: E402
from compare_common import cpu_seconds, settle  # noqa: E402


def wait(fd: int) -> None:
    p = select.poll()
    p.register(fd, select.POLLIN)
    if not p.poll(60_000):
        raise SystemExit("no completion in 60 s")
    try:
        os.read(fd, 8)
    except BlockingIOError:
        pass


def run_phase(adapter, tasks, in_flight: int, load: bool) -> tuple[float, float, float]:
    """Keeps `in_flight` tasks submitted until all are done; (seconds, CPU seconds, seconds
    until a sync after the phase returned: the bytes on the device)."""
    fd = adapter.get_load_event_fd() if load else adapter.get_store_event_fd()
    todo = list(tasks)
    running: set[int] = set()
    failed = 0
    c0, t0 = cpu_seconds(), time.perf_counter()
    while todo or running:
        while todo and len(running) < in_flight:
            keys, objs = todo.pop()
            submit = adapter.submit_load_task if load else adapter.submit_store_task
            running.add(submit(keys, objs))
        wait(fd)
        if load:
            for task in list(running):
                bitmap = adapter.query_load_result(task)
                if bitmap is not None:
                    running.discard(task)
                    failed += len(bitmap) - bitmap.popcount()
        else:
            for task, result in adapter.pop_completed_store_tasks().items():
                running.discard(task)
                failed += int(result) < 0
    elapsed, cpu = time.perf_counter() - t0, cpu_seconds() - c0
    os.sync()
    synced = time.perf_counter() - t0
    if failed:
        raise SystemExit(f"{failed} {'objects failed to load' if load else 'stores failed'}")
    return elapsed, cpu, synced


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dir", default="/var/tmp")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--in-flight", type=int, nargs="+", default=[1, 16])
    ap.add_argument("--objects-per-request", type=int, default=4)
    ap.add_argument("--object-bytes", default="8MiB")
    ap.add_argument("--bytes", default="512MiB", help="stored (and loaded) per phase")
    ap.add_argument("--block-size", default="2MiB", help="kvtier's block_size")
    ap.add_argument("--layout", choices=("files", "slab"), default="files")
    ap.add_argument("--slab-bytes", default="4GiB")
    ap.add_argument("--fs-odirect", action="store_true", help="LMCache fs adapter with O_DIRECT")
    ap.add_argument("--in-place", action="store_true",
                    help="objects in one L1 arena; kvtier as the plugin adapter over it")
    ap.add_argument("--no-files-checksums", action="store_true",
                    help="kvtier's files layout without its crc32c xattrs ([files] checksums)")
    ap.add_argument("--arena-thp", action="store_true",
                    help="with --in-place: the arena in transparent huge pages")
    ap.add_argument("--no-drop-caches", action="store_true")
    ap.add_argument("--json")
    args = ap.parse_args()
    if args.no_files_checksums and args.layout != "files":
        ap.error("--no-files-checksums is for --layout files")
    import kvtier

    lm = H.load_lmcache()
    obj = kvtier.parse_size(args.object_bytes)
    total = kvtier.parse_size(args.bytes)
    per = args.objects_per_request
    count = max(per, total // obj // per * per)
    staging = max(args.in_flight) * per * obj + (64 << 20)
    print(f"LMCache {lm.version}; objects of {obj >> 10} KiB, {count} a phase "
          f"({count * obj >> 20} MiB), {per} a request; kvtier {args.layout} layout, blocks of "
          f"{args.block_size}, " + ("in place" if args.in_place else
                                    f"staging {staging >> 20} MiB") + "; fs adapter "
          f"{'O_DIRECT' if args.fs_odirect else 'buffered'}")
    base = tempfile.mkdtemp(prefix="lmcache-compare-", dir=args.dir)
    rng = np.random.default_rng(0)
    desc = None
    if args.in_place:
        block = kvtier.parse_size(args.block_size)
        physical = -(-obj // block) * block
        arena = H.Arena(lm, 2 * count * physical, align=block, thp=args.arena_thp)
        desc = arena.desc
        src = [arena.allocate(obj) for _ in range(count)]
        dst = [arena.allocate(obj) for _ in range(count)]
    else:
        src = [H.TensorMemoryObj(obj) for _ in range(count)]
        dst = [H.TensorMemoryObj(obj) for _ in range(count)]
    results: dict = {}
    dropped = True
    try:
        for in_flight in args.in_flight:
            adapters = {}
            for name in ("kvtier", "fs"):
                root = os.path.join(base, f"{name}-{in_flight}")
                os.makedirs(root, exist_ok=True)
                if name == "kvtier":
                    params = {"root_dir": root, "layout": args.layout,
                              "block_size": args.block_size, "staging_bytes": staging}
                    if args.layout == "slab":
                        params["capacity_bytes"] = args.slab_bytes
                    if args.no_files_checksums:
                        from kvtier._tier_config import cores_auto
                        params = {"block_size": args.block_size,
                                  "staging_bytes": staging,
                                  "config": {"cores": cores_auto("auto"), "direct_io": "auto",
                                             "devices": [{"layout": "files", "path": root}],
                                             "files": {"checksums": False}}}
                    spec = {"type": "native_plugin", "module_path": "kvtier.lmcache",
                            "class_name": "KvtierL2Connector", "adapter_params": params}
                    if args.in_place:
                        del params["staging_bytes"]
                        spec.update(type="plugin", class_name="KvtierL2Adapter")
                else:
                    spec = {"type": "fs", "base_path": root, "use_odirect": args.fs_odirect}
                adapters[name] = H.adapter_from_cli(lm, spec, desc)
                if name == "kvtier" and args.in_place and not adapters[name].connector.in_place:
                    raise SystemExit("kvtier: not in place over the arena (see the warning)")
            cells = {n: {"store": [], "load": [], "store_cpu": [], "load_cpu": [],
                         "store_synced": []} for n in adapters}
            for r in range(args.rounds):
                for o in src:
                    o.array[:] = rng.integers(0, 256, obj, dtype=np.uint8)
                order = ["kvtier", "fs"] if r % 2 == 0 else ["fs", "kvtier"]
                for name in order:
                    a = adapters[name]
                    keys = [H.object_key(lm, (r << 40) | (in_flight << 32) | i)
                            for i in range(count)]
                    stores = [(keys[i:i + per], src[i:i + per]) for i in range(0, count, per)]
                    loads = [(keys[i:i + per], dst[i:i + per]) for i in range(0, count, per)]
                    dropped &= settle(not args.no_drop_caches)
                    s, c, synced = run_phase(a, stores, in_flight, load=False)
                    cells[name]["store"].append(s)
                    cells[name]["store_cpu"].append(c)
                    cells[name]["store_synced"].append(synced)
                    dropped &= settle(not args.no_drop_caches)
                    s, c, _ = run_phase(a, loads, in_flight, load=True)
                    cells[name]["load"].append(s)
                    cells[name]["load_cpu"].append(c)
                    for i in range(count):
                        if bytes(src[i].byte_array) != bytes(dst[i].byte_array):
                            raise SystemExit(f"{name}: object {i} came back different")
                        dst[i].array[:] = 0
            for a in adapters.values():
                a.close()
            gib = count * obj / 2**30
            row = {}
            for name, c in cells.items():
                row[name] = {
                    "store_gib_s": gib / statistics.median(c["store"]),
                    "store_synced_gib_s": gib / statistics.median(c["store_synced"]),
                    "load_gib_s": gib / statistics.median(c["load"]),
                    "store_cpu_s_per_gib": statistics.median(c["store_cpu"]) / gib,
                    "load_cpu_s_per_gib": statistics.median(c["load_cpu"]) / gib,
                    "samples": c,
                }
            row["ratio"] = {k: row["kvtier"][k] / row["fs"][k]
                            for k in ("store_gib_s", "store_synced_gib_s", "load_gib_s",
                                      "store_cpu_s_per_gib",
                                      "load_cpu_s_per_gib")}
            results[str(in_flight)] = row
            for name in ("kvtier", "fs"):
                x = row[name]
                print(f"in flight {in_flight:>2}  {name:6}  store {x['store_gib_s']:6.2f} GiB/s "
                      f"(synced {x['store_synced_gib_s']:5.2f}) {x['store_cpu_s_per_gib']:5.2f} "
                      f"cpu-s/GiB   load {x['load_gib_s']:6.2f} GiB/s "
                      f"{x['load_cpu_s_per_gib']:5.2f} cpu-s/GiB")
            x = row["ratio"]
            print(f"in flight {in_flight:>2}  kvtier/fs  store x{x['store_gib_s']:.2f} "
                  f"(synced x{x['store_synced_gib_s']:.2f}, cpu x{x['store_cpu_s_per_gib']:.2f})"
                  f"   load x{x['load_gib_s']:.2f} (cpu x{x['load_cpu_s_per_gib']:.2f})")
    finally:
        shutil.rmtree(base, ignore_errors=True)
    if not dropped and not args.no_drop_caches:
        print("note: the page cache could not be dropped (not root): the fs adapter's loads "
              "may have come from memory")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"lmcache": lm.version, "object_bytes": obj, "objects": count,
                       "args": vars(args), "results": results}, f, indent=1)


if __name__ == "__main__":
    main()
