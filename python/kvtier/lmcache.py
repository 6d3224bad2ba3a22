"""kvtier as an L2 adapter of LMCache's multi-process server: ``KvtierL2Connector``.

LMCache loads it out of tree as a ``native_plugin`` (its connector interface: ``event_fd``,
``submit_batch_get`` / ``_set`` / ``_exists``, ``drain_completions``, ``close``), wrapped by its
own ``NativeConnectorL2Adapter``::

    lmcache server ... --l2-adapter '{"type": "native_plugin",
      "module_path": "kvtier.lmcache", "class_name": "KvtierL2Connector",
      "adapter_params": {"root_dir": "/mnt/nvme/lmcache", "capacity_bytes": "2 TiB"}}'

``adapter_params`` (all optional but ``root_dir``/``config``), as for the vLLM tier: ``root_dir``,
``layout`` (``"files"``, the default, or ``"slab"``: ``<root_dir>/lmcache.slab``, needs
``capacity_bytes``), ``capacity_bytes`` (kvtier evicts to stay under it; leave LMCache's
``max_capacity_gb`` at 0), ``cores``, ``s3``, ``direct_io``, or ``config`` (a kvtier TOML path,
TOML text or table); and two of this adapter's own:

* ``block_size`` (default ``"4 MiB"``): kvtier's block. An object of n bytes is stored as
  ceil(n / block_size) blocks under its key and the block's number.
* ``staging_bytes`` (default ``"1 GiB"``): kvtier's own region, where objects are staged.

**Staged, not in place.** The buffers LMCache hands a native connector are slices of its L1
arena at its allocator's offsets, which kvtier's fixed-size block region cannot address: every
object is copied into the staging region before its store is submitted, and out of it (into
LMCache's buffer) when its load has finished, in ``drain_completions``. A batch that does not fit
the staging room left completes at once as failed (LMCache treats it as not stored / a miss);
``stats()`` counts those.

The event fd is kvtier's result eventfd: the engine bumps it when a job's result is published
(no Python thread polls the engine); this adapter bumps it too for what completes without I/O
(``submit_batch_exists``, refused batches).

Keys are LMCache's ``model@kv_rank@group@chunk_hash[@salt]`` strings, through sha256 (kvtier
keys are at most 64 bytes). ``submit_batch_exists`` answers from kvtier's index (an object is
held when its first block is; a load whose other blocks are gone fails, as a miss).
``submit_batch_delete`` is not offered: kvtier evicts by itself under ``capacity_bytes``, and
LMCache then logs that its eviction deletes are no-ops.
"""

from __future__ import annotations

import collections
import hashlib
import itertools
import logging
import os
import threading
from typing import Any

import numpy as np

import kvtier
from kvtier._tier_config import cores_auto, load_config, size_bytes

logger = logging.getLogger("kvtier.lmcache")

TESTED_LMCACHE = "0.5.6"
_LAYOUTS = ("files", "slab")
_ALIGN = 4096
_SLAB_FILE = "lmcache.slab"
_NOTIFY = (1).to_bytes(8, "little")


def _key_hash(key: str) -> bytes:
    return hashlib.sha256(key.encode()).digest()


class KvtierL2Connector:
    """LMCache native L2 connector over the kvtier engine; see the module docstring."""

    def __init__(
        self,
        root_dir: str | None = None,
        layout: str | None = None,
        capacity_bytes: int | str | None = None,
        cores: Any = None,
        s3: Any = None,
        direct_io: str | None = None,
        config: Any = None,
        block_size: int | str = "4 MiB",
        staging_bytes: int | str = "1 GiB",
        **unknown: Any,
    ) -> None:
        if unknown:
            raise TypeError(
                f"kvtier.lmcache: adapter_params key(s) {', '.join(map(repr, sorted(unknown)))} "
                "not understood; accepted: root_dir, layout, capacity_bytes, cores, s3, "
                "direct_io, config, block_size, staging_bytes"
            )
        self._block = size_bytes(block_size)
        if self._block < _ALIGN or self._block % _ALIGN:
            raise ValueError(
                f"kvtier.lmcache: block_size = {block_size!r}: must be a multiple of {_ALIGN}"
            )
        staging = size_bytes(staging_bytes)
        blocks = staging // self._block
        if blocks < 1:
            raise ValueError(
                f"kvtier.lmcache: staging_bytes = {staging_bytes!r}: must hold at least one "
                f"block of {self._block} bytes"
            )
        short = {"root_dir": root_dir, "layout": layout, "capacity_bytes": capacity_bytes,
                 "cores": cores, "s3": s3, "direct_io": direct_io}
        given = {k: v for k, v in short.items() if v is not None}
        if config is not None:
            if given:
                raise TypeError(
                    f"kvtier.lmcache: config replaces {', '.join(sorted(given))}: give the "
                    "kvtier config alone, or the short form without config"
                )
            cfg = load_config(config)
        else:
            cfg = self._short_form(given)
        cfg.setdefault("block_size", self._block)
        if size_bytes(cfg["block_size"]) != self._block:
            raise kvtier.ConfigError(
                f"config field `block_size` = {cfg['block_size']!r}: must equal the adapter's "
                f"block_size, {self._block} bytes"
            )
        devices = cfg.get("devices") or []
        namespace = {
            "model_name": "lmcache", "dtype": "bytes", "tokens_per_hash": 1,
            "blocks_per_file": 1,
            "kv_cache_groups": [{"tokens_per_block": 1,
                                 "layer_names": [f"lmcache/{self._block}"]}],
        }
        if devices and devices[0].get("layout", "slab") == "files":
            cfg["files"] = {**(cfg.get("files") or {})}
            cfg["files"].setdefault("namespace", namespace)
        if "s3" in cfg:
            cfg["s3"] = {**cfg["s3"]}
            cfg["s3"].setdefault("namespace", namespace)
        kvtier.check_config(cfg)
        for dev in devices:
            path = str(dev.get("path", ""))
            os.makedirs(path if dev.get("layout", "slab") == "files" else
                        os.path.dirname(path) or ".", exist_ok=True)
        self._region = kvtier.allocate_region(blocks, self._block)
        self._bytes = np.frombuffer(self._region, dtype=np.uint8)
        self._engine = kvtier.Engine(cfg, self._region)
        self._fd = self._engine.result_fd()
        self._lock = threading.Lock()
        self._free: collections.deque[int] = collections.deque(range(blocks))
        self._ids = itertools.count(1)
        # future id -> (op, keys, parts per key, blocks, buffers for a load)
        self._pending: dict[int, tuple[str, int, list[int], list[int], list[Any]]] = {}
        # Completions that needed no I/O (exists, refused batches), for drain_completions.
        self._ready: list[tuple[int, bool, str, list[bool] | None]] = []
        self._closed = False
        self._stats = collections.Counter()
        logger.info("kvtier.lmcache: %s, blocks of %d bytes, %d staging blocks",
                    self._engine, self._block, blocks)

    def _short_form(self, short: dict[str, Any]) -> dict[str, Any]:
        root = short.get("root_dir")
        if root is None:
            raise TypeError(
                "kvtier.lmcache: adapter_params needs root_dir (the cache directory) or "
                "config (a kvtier TOML path or table)"
            )
        layout = short.get("layout", "files")
        if layout not in _LAYOUTS:
            raise ValueError(f"kvtier.lmcache: layout = {layout!r}: expected one of {_LAYOUTS}")
        device: dict[str, Any] = {"layout": layout}
        if layout == "slab":
            if short.get("capacity_bytes") is None:
                raise ValueError(
                    "kvtier.lmcache: layout = 'slab' needs capacity_bytes (the size of "
                    f"{os.path.join(str(root), _SLAB_FILE)}, e.g. '512 GiB')"
                )
            device["path"] = os.path.join(str(root), _SLAB_FILE)
        else:
            device["path"] = str(root)
        if short.get("capacity_bytes") is not None:
            device["capacity_bytes"] = short["capacity_bytes"]
        cfg: dict[str, Any] = {"cores": cores_auto(short.get("cores", "auto")),
                               "direct_io": short.get("direct_io", "auto"), "devices": [device]}
        if short.get("s3") is not None:
            cfg["s3"] = dict(short["s3"])
        return cfg

    # -- the native connector interface ---------------------------------------------------------

    def event_fd(self) -> int:
        return self._fd

    def _complete_now(self, ok: bool, results: list[bool] | None, error: str = "") -> int:
        """A completion that needs no I/O: reported by the next drain_completions."""
        future = next(self._ids)
        with self._lock:
            self._ready.append((future, ok, error, results))
        os.write(self._fd, _NOTIFY)
        return future

    def _parts(self, n: int) -> int:
        return max(1, -(-n // self._block))

    def _submit(self, op: str, keys: list[str], buffers: list[Any]) -> int:
        if len(keys) != len(buffers):
            raise ValueError(f"kvtier.lmcache: {len(keys)} keys but {len(buffers)} buffers")
        views = [memoryview(b).cast("B") for b in buffers]
        parts = [self._parts(v.nbytes) for v in views]
        need = sum(parts)
        with self._lock:
            if self._closed or need > len(self._free):
                blocks = None
            else:
                blocks = [self._free.popleft() for _ in range(need)]
        if blocks is None:
            self._stats["batches_refused_staging" if not self._closed else "batches_closed"] += 1
            return self._complete_now(False, [False] * len(keys),
                                      "closed" if self._closed else "staging region full")
        bkeys = []
        at = 0
        for key, view, n in zip(keys, views, parts):
            h = _key_hash(key)
            bkeys.extend(h + j.to_bytes(4, "big") for j in range(n))
            if op == "set":
                for j in range(n):
                    dst = blocks[at + j] * self._block
                    chunk = view[j * self._block:(j + 1) * self._block]
                    self._bytes[dst:dst + len(chunk)] = chunk
                    if len(chunk) < self._block:
                        self._bytes[dst + len(chunk):dst + self._block] = 0
            at += n
        future = next(self._ids)
        with self._lock:
            self._pending[future] = (op, len(keys), parts, blocks, views if op == "get" else [])
        try:
            if op == "set":
                self._engine.submit_store(future, bkeys, blocks)
            else:
                self._engine.submit_load(future, bkeys, blocks)
        except (kvtier.Error, ValueError) as e:
            with self._lock:
                self._pending.pop(future, None)
                self._free.extend(blocks)
            self._stats["batches_refused_engine"] += 1
            return self._complete_now(False, [False] * len(keys), str(e))
        self._stats[f"staged_{op}_bytes"] += sum(v.nbytes for v in views)
        return future

    def submit_batch_set(self, keys: list[str], buffers: list[Any]) -> int:
        """Copies each buffer into staging blocks, then queues their store. Never blocks."""
        return self._submit("set", list(keys), list(buffers))

    def submit_batch_get(self, keys: list[str], buffers: list[Any]) -> int:
        """Queues the loads into staging blocks; drain_completions copies them into `buffers`."""
        return self._submit("get", list(keys), list(buffers))

    def submit_batch_exists(self, keys: list[str]) -> int:
        """Per key, whether kvtier holds it (its first block), from the index; no I/O."""
        if self._closed:
            return self._complete_now(False, [False] * len(keys), "closed")
        answers = self._engine.lookup([_key_hash(k) + b"\0\0\0\0" for k in keys])
        return self._complete_now(True, [a in ("nvme", "s3") for a in answers])

    def drain_completions(self) -> list[tuple[int, bool, str, list[bool] | None]]:
        """Every completion since the last call: (future id, ok, error, per-key results)."""
        self._engine.clear_result_fd()
        with self._lock:
            out, self._ready = self._ready, []
        for r in self._engine.poll_finished():
            with self._lock:
                pending = self._pending.pop(r.job_id, None)
            if pending is None:
                continue
            op, nkeys, parts, blocks, views = pending
            failed_blocks = {i for (i, _, _, _) in r.failures}
            ok_keys = []
            at = 0
            for k in range(nkeys):
                ok = not any(at + j in failed_blocks for j in range(parts[k]))
                if op == "get" and self._closed:
                    # Closed: LMCache may have reused the buffer; nothing is written into it.
                    ok = False
                if ok and op == "get":
                    view = views[k]
                    for j in range(parts[k]):
                        src = blocks[at + j] * self._block
                        n = min(self._block, view.nbytes - j * self._block)
                        view[j * self._block:j * self._block + n] = self._bytes[src:src + n]
                ok_keys.append(ok)
                at += parts[k]
            with self._lock:
                self._free.extend(blocks)
            error = "" if r.success else "; ".join(
                sorted({f"{cls}: {reason}" for (_, _, cls, reason) in r.failures})[:3])
            out.append((r.job_id, r.success, error, ok_keys))
        return out

    def stats(self) -> dict[str, Any]:
        """The engine's stats, with this adapter's counters under "lmcache"."""
        s = self._engine.stats()
        s["lmcache"] = dict(self._stats)
        return s

    def close(self) -> None:
        """Stops the engine: I/O in flight completes first, queued jobs fail; their
        completions stay for drain_completions (no buffer is written after this returns)."""
        if self._closed:
            return
        self._closed = True
        self._engine.shutdown()

    @property
    def engine(self) -> kvtier.Engine:
        return self._engine
