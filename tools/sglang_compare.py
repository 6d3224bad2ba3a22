#!/usr/bin/env python3
"""kvtier's SGLang HiCache backend against SGLang's own file backend (``HiCacheFile``).

Both backends come from SGLang's real ``StorageBackendFactory`` (kvtier through the ``dynamic``
entry, ``file`` as SGLang registers it) over the same real host pool class
(``MHATokenToKVPoolHost``, page_first, from python/tests/sglang_harness: SGLang's modules from
its wheel, torch stood in by numpy), each with a pool of its own, and driven as SGLang's cache
controller drives them: kvtier through the zero-copy calls it selects with ``interface_v1``
(``batch_set_v1`` / ``batch_get_v1`` with host indices), the file backend through the generic
ones (``batch_set`` of ``get_data_page`` copies, ``batch_get`` into
``get_dummy_flat_data_page`` buffers, then ``set_from_flat_data_page``: the controller's
``_generic_page_set`` / ``_generic_page_get``, repeated here because the controller's module
imports the whole server).

A request is one batch call of --pages-per-request pages; --in-flight threads issue them at
once. Per round and backend (the order alternates), a store phase of fresh keys, then (after
``sync`` and, when this process may, dropping the page cache, so loads come from the disk for
both) a load phase of the same keys into other pages, verified byte for byte after timing.
Reported: GiB/s and process CPU seconds per GiB (every thread: kvtier's workers and io_uring
threads, the file backend's calls), medians over rounds, and kvtier/file ratios.

    python tools/sglang_compare.py --dir /var/tmp --rounds 5
    python tools/sglang_compare.py --in-flight 1 16 --page-tokens 16 --layers 32 --json out.json

Needs: the kvtier package (pip install ./python), numpy, msgspec, and SGLang's wheel (pip
download sglang==0.5.23 --no-deps -d DIR; KVTIER_SGLANG_WHEEL_DIR=DIR).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import threading
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "python",
                                "tests"))
import sglang_harness as H  # noqa: E402
from compare_common import cpu_seconds, settle  # noqa: E402


class Backend:
    def __init__(self, sgl, name: str, root: str, args) -> None:
        self.name = name
        self.pool = H.make_host_pool(sgl, layout="page_first", page_num=args.pool_pages,
                                     page_size=args.page_tokens, layer_num=args.layers,
                                     head_num=args.heads, head_dim=args.head_dim)
        if name == "kvtier":
            extra = {"backend_name": "kvtier", "module_path": "kvtier.sglang",
                     "class_name": "KvtierHiCacheStorage", "interface_v1": 1,
                     "root_dir": root, "layout": args.layout}
            if args.layout == "slab":
                extra["capacity_bytes"] = args.slab_bytes
            cfg = H.storage_config(sgl, extra)
            self.store = sgl.StorageBackendFactory.create_backend("dynamic", cfg, self.pool)
        else:
            cfg = H.storage_config(sgl, {"file_storage_path": root})
            self.store = sgl.StorageBackendFactory.create_backend("file", cfg, self.pool)
        self.store.register_mem_pool_host(self.pool)
        self.page = self.pool.page_size

    def set(self, keys, pages) -> bool:
        if self.name == "kvtier":
            return all(self.store.batch_set_v1(keys, H.indices(self.pool, pages)))
        data = [self.pool.get_data_page(p * self.page) for p in pages]
        return self.store.batch_set(keys, data)

    def get(self, keys, pages) -> bool:
        if self.name == "kvtier":
            return all(self.store.batch_get_v1(keys, H.indices(self.pool, pages)))
        dst = [self.pool.get_dummy_flat_data_page() for _ in keys]
        got = self.store.batch_get(keys, dst)
        for p, d in zip(pages, got):
            if d is None:
                return False
            self.pool.set_from_flat_data_page(p * self.page, d)
        return True

    def close(self) -> None:
        if hasattr(self.store, "close"):
            self.store.close()


def run_phase(backend: Backend, requests, in_flight: int, load: bool) -> tuple[float, float]:
    """Runs every request on `in_flight` threads; (seconds, CPU seconds)."""
    lock = threading.Lock()
    queue = list(requests)
    failed = []

    def worker():
        while True:
            with lock:
                if not queue:
                    return
                keys, pages = queue.pop()
            ok = backend.get(keys, pages) if load else backend.set(keys, pages)
            if not ok:
                failed.append(keys[0])

    threads = [threading.Thread(target=worker) for _ in range(in_flight)]
    c0, t0 = cpu_seconds(), time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    elapsed, cpu = time.perf_counter() - t0, cpu_seconds() - c0
    if failed:
        raise SystemExit(f"{backend.name}: {len(failed)} {'loads' if load else 'stores'} failed")
    return elapsed, cpu


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dir", default="/var/tmp", help="where both backends' directories go")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--in-flight", type=int, nargs="+", default=[1, 16])
    ap.add_argument("--pages-per-request", type=int, default=4)
    ap.add_argument("--bytes", default="512MiB", help="stored (and loaded) per phase")
    ap.add_argument("--page-tokens", type=int, default=16)
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--layout", choices=("files", "slab"), default="files")
    ap.add_argument("--slab-bytes", default="8GiB")
    ap.add_argument("--no-drop-caches", action="store_true")
    ap.add_argument("--json")
    args = ap.parse_args()
    import kvtier

    sgl = H.load_sglang()
    page_bytes = 2 * args.page_tokens * args.layers * args.heads * args.head_dim * 2
    total = kvtier.parse_size(args.bytes)
    pages = max(args.pages_per_request, total // page_bytes)
    pages -= pages % args.pages_per_request
    args.pool_pages = 2 * pages
    print(f"SGLang {sgl.version} ({os.path.basename(sgl.wheel)}); MHA page_first, "
          f"{args.layers} layers x {args.heads} heads x {args.head_dim}, bf16, "
          f"{args.page_tokens} tokens a page: {page_bytes >> 10} KiB a page "
          f"({page_bytes >> 11} KiB a part for kvtier); {pages} pages ({pages * page_bytes >> 20} "
          f"MiB) a phase, {args.pages_per_request} pages a request; kvtier layout {args.layout}")
    base = tempfile.mkdtemp(prefix="sglang-compare-", dir=args.dir)
    results: dict = {}
    dropped = True
    try:
        for in_flight in args.in_flight:
            roots = {name: os.path.join(base, f"{name}-{in_flight}") for name in ("kvtier", "file")}
            backends = {name: Backend(sgl, name, root, args) for name, root in roots.items()}
            cells: dict = {name: {"store": [], "load": [], "store_cpu": [], "load_cpu": []}
                           for name in backends}
            for r in range(args.rounds):
                order = ["kvtier", "file"] if r % 2 == 0 else ["file", "kvtier"]
                for name in order:
                    b = backends[name]
                    H.fill_pages(b.pool, list(range(pages)), seed=r)
                    keys = ["%064x" % (r << 40 | in_flight << 32 | i) for i in range(pages)]
                    reqs = [(keys[i:i + args.pages_per_request],
                             list(range(i, i + args.pages_per_request)))
                            for i in range(0, pages, args.pages_per_request)]
                    dropped &= settle(not args.no_drop_caches)
                    s, c = run_phase(b, reqs, in_flight, load=False)
                    cells[name]["store"].append(s)
                    cells[name]["store_cpu"].append(c)
                    dropped &= settle(not args.no_drop_caches)
                    loads = [(k, [p + pages for p in ps]) for k, ps in reqs]
                    s, c = run_phase(b, loads, in_flight, load=True)
                    cells[name]["load"].append(s)
                    cells[name]["load_cpu"].append(c)
                    for i in range(pages):
                        if H.page_bytes(b.pool, i * b.page) != H.page_bytes(
                                b.pool, (i + pages) * b.page):
                            raise SystemExit(f"{name}: page {i} came back different")
            for b in backends.values():
                b.close()
            gib = pages * page_bytes / 2**30
            row = {}
            for name, c in cells.items():
                row[name] = {
                    "store_gib_s": gib / statistics.median(c["store"]),
                    "load_gib_s": gib / statistics.median(c["load"]),
                    "store_cpu_s_per_gib": statistics.median(c["store_cpu"]) / gib,
                    "load_cpu_s_per_gib": statistics.median(c["load_cpu"]) / gib,
                    "samples": c,
                }
            row["ratio"] = {k: row["kvtier"][k] / row["file"][k]
                            for k in ("store_gib_s", "load_gib_s", "store_cpu_s_per_gib",
                                      "load_cpu_s_per_gib")}
            results[str(in_flight)] = row
            for name in ("kvtier", "file"):
                x = row[name]
                print(f"in flight {in_flight:>2}  {name:6}  store {x['store_gib_s']:6.2f} GiB/s "
                      f"{x['store_cpu_s_per_gib']:5.2f} cpu-s/GiB   load {x['load_gib_s']:6.2f} "
                      f"GiB/s {x['load_cpu_s_per_gib']:5.2f} cpu-s/GiB")
            x = row["ratio"]
            print(f"in flight {in_flight:>2}  kvtier/file  store x{x['store_gib_s']:.2f} "
                  f"(cpu x{x['store_cpu_s_per_gib']:.2f})   load x{x['load_gib_s']:.2f} "
                  f"(cpu x{x['load_cpu_s_per_gib']:.2f})")
            for root in roots.values():
                shutil.rmtree(root, ignore_errors=True)
    finally:
        shutil.rmtree(base, ignore_errors=True)
    if not dropped:
        print("note: the page cache could not be dropped (not root): the file backend's loads "
              "may have come from memory")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"sglang": sgl.version, "page_bytes": page_bytes, "pages": pages,
                       "args": vars(args), "results": results}, f, indent=1)


if __name__ == "__main__":
    main()
