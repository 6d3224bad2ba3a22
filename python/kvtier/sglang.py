"""kvtier as SGLang's HiCache storage backend (its L3, behind the host pool): ``KvtierHiCacheStorage``.

Pages move straight between SGLang's host KV pool and the device: the pool's buffer is the
engine's region (registered once, used in place), and ``batch_set_v1`` / ``batch_get_v1`` are
one kvtier job each. ``batch_exists`` answers from kvtier's in-memory index, without I/O.
Enable it with SGLang's dynamic backend (``interface_v1`` selects the zero-copy calls)::

    python -m sglang.launch_server ... --enable-hierarchical-cache \\
      --hicache-storage-backend dynamic \\
      --hicache-storage-backend-extra-config '{"backend_name": "kvtier",
        "module_path": "kvtier.sglang", "class_name": "KvtierHiCacheStorage",
        "interface_v1": 1, "root_dir": "/mnt/nvme/sglang-kv"}'

Keys of the extra config, besides SGLang's four (``backend_name``, ``module_path``,
``class_name``, ``interface_v1``), as for the vLLM tier: either ``config`` (a kvtier TOML path,
TOML text or a table; ``block_size`` and the files namespace are filled in from the host pool)
or the short form:

* ``root_dir`` (required): the cache directory.
* ``layout``: ``"files"`` (default: one file per page part, shared by the TP ranks of an MLA
  model, each of which reads what the one writer rank stored) or ``"slab"`` (one preallocated
  file per rank, ``<root_dir>/sglang_r<rank>.slab``; needs ``capacity_bytes``).
* ``capacity_bytes``: the bound on the bytes kept, with eviction (files: unset is unbounded).
* ``cores``: ``"auto"`` (default) or a list of CPUs for kvtier's io_uring workers.
* ``s3``: an inline ``[s3]`` table (see kvtier.example.toml).
* ``direct_io``: ``"auto"`` (default), ``"required"`` or ``"off"``.

A page of the host pool is what its own ``get_page_buffer_meta`` says it is (the addresses
SGLang's zero-copy backends use): K and V halves in the page-major layouts (``page_first``,
``page_first_direct``, ``page_head``), one part per layer and half in ``layer_first``, one part
per page (MLA ``page_first``). Each part is one kvtier block, stored under the page's key and
the part's number; every part must be the same whole number of 4 KiB (O_DIRECT), which the
registration checks. A page is a hit only when every one of its parts is held.

Keys follow SGLang's file backend: MHA pages are per TP rank (the TP size and rank name the
directory), MLA pages are shared across TP ranks and written by SGLang's storage writer rank
only. The layout, the page's geometry and the dtype are part of the directory's name too, so a
page is never read into a pool of another shape.

The calls block their SGLang thread until the job has finished and its pages are the pool's
again: a load whose I/O outlives ``io_timeout_ms`` fails, and the call returns once the device
has answered (until then the pages may still be written; handing them back earlier could put
late bytes into a page SGLang has reused).
"""

from __future__ import annotations

import hashlib
import itertools
import logging
import os
import threading
import time
from typing import Any

try:
    import torch
    from sglang.srt.mem_cache.hicache_storage import (
        HiCacheStorage,
        HiCacheStorageConfig,
        HiCacheStorageExtraInfo,
    )
except ImportError as _e:  # pragma: no cover - exercised by a test without SGLang
    raise ImportError(
        "kvtier.sglang needs SGLang (pip install 'sglang>=0.5.23'); `import kvtier` works "
        f"without it ({_e})"
    ) from _e

import kvtier
from kvtier._tier_config import cores_auto, load_config, size_bytes

logger = logging.getLogger("kvtier.sglang")

TESTED_SGLANG = "0.5.23"
_SGLANG_KEYS = ("backend_name", "module_path", "class_name", "interface_v1")
_SHORT_FORM = ("root_dir", "layout", "capacity_bytes", "cores", "s3", "direct_io")
_ACCEPTED = (*_SGLANG_KEYS, *_SHORT_FORM, "config")
_LAYOUTS = ("files", "slab")
_ALIGN = 4096
# A backpressure refusal is retried (other threads' jobs are finishing) for this long.
_BACKPRESSURE_WAIT_S = 30.0
# A files-layout key another rank may have stored is looked up on disk first ("pending").
_PENDING_WAIT_S = 2.0
# How long a reader rank (MLA, files layout) takes an "absent" from disk as the answer.
_READER_ABSENT_TTL_MS = 100


def _key_hash(key: str) -> bytes:
    """SGLang's page key (a sha256 hex string) as 32 bytes; any other string through sha256."""
    if len(key) == 64:
        try:
            return bytes.fromhex(key)
        except ValueError:
            pass
    return hashlib.sha256(key.encode()).digest()


class KvtierHiCacheStorage(HiCacheStorage):
    """SGLang HiCache L3 backed by the kvtier engine; see the module docstring."""

    def __init__(self, storage_config: HiCacheStorageConfig, kwargs: Any = None) -> None:
        extra = dict(storage_config.extra_config or {})
        unknown = sorted(k for k in extra if k not in _ACCEPTED)
        if unknown:
            raise ValueError(
                f"kvtier.sglang: extra config key(s) {', '.join(map(repr, unknown))} not "
                f"understood; accepted: {', '.join(_ACCEPTED)}"
            )
        if not extra.get("interface_v1"):
            raise ValueError(
                "kvtier.sglang: extra config `interface_v1` is missing or 0: kvtier moves pages "
                "in place through batch_get_v1/batch_set_v1; add \"interface_v1\": 1"
            )
        self.storage_config = storage_config
        short = {k: extra[k] for k in _SHORT_FORM if extra.get(k) is not None}
        if extra.get("config") is not None:
            if short:
                raise TypeError(
                    f"kvtier.sglang: config replaces {', '.join(sorted(short))}: give the "
                    "kvtier config alone, or the short form without config"
                )
            cfg = load_config(extra["config"])
        else:
            cfg = self._short_form(short)
        devices = cfg.get("devices") or []
        self._files = bool(devices) and devices[0].get("layout", "slab") == "files"
        self._mla = bool(storage_config.is_mla_model)
        # MLA pages are the same on every TP rank: one writer per shard (SGLang's rule) when
        # the ranks share a files directory; with a slab per rank each rank keeps its own.
        self._writer = storage_config.is_storage_writer or not self._files
        self._cfg = cfg
        # Bad config fails here, before SGLang allocates anything else: checked with a
        # provisional block size (the real one comes with the host pool).
        probe = dict(cfg)
        probe.setdefault("block_size", _ALIGN)
        if self._files:
            probe["files"] = {**(cfg.get("files") or {}),
                              "namespace": self._namespace("probe", "probe", _ALIGN, 1)}
        kvtier.check_config(probe)
        self._engine: kvtier.Engine | None = None
        self._ids = itertools.count(1)
        self._cv = threading.Condition()
        self._done: dict[int, Any] = {}
        self._polling = False
        self._closed = False

    def _short_form(self, short: dict[str, Any]) -> dict[str, Any]:
        root = short.get("root_dir")
        if root is None:
            raise ValueError(
                "kvtier.sglang: extra config needs root_dir (the cache directory) or config "
                "(a kvtier TOML path or table)"
            )
        layout = short.get("layout", "files")
        if layout not in _LAYOUTS:
            raise ValueError(f"kvtier.sglang: layout = {layout!r}: expected one of {_LAYOUTS}")
        device: dict[str, Any] = {"layout": layout}
        if layout == "slab":
            if short.get("capacity_bytes") is None:
                raise ValueError(
                    "kvtier.sglang: layout = 'slab' needs capacity_bytes (the size of each "
                    "rank's slab file, e.g. '512 GiB')"
                )
            device["path"] = os.path.join(str(root), f"sglang_r{self._rank(full=True)}.slab")
        else:
            device["path"] = str(root)
        if short.get("capacity_bytes") is not None:
            device["capacity_bytes"] = short["capacity_bytes"]
        cfg: dict[str, Any] = {
            "cores": cores_auto(short.get("cores", "auto")),
            "direct_io": short.get("direct_io", "auto"),
            "devices": [device],
        }
        if short.get("s3") is not None:
            cfg["s3"] = dict(short["s3"])
        return cfg

    def _rank(self, full: bool) -> int:
        """This rank's number in the directory: TP rank included unless pages are shared."""
        c = self.storage_config
        rank = c.pp_rank * c.attn_cp_size + c.attn_cp_rank
        if self._mla_shared() and not full:
            return rank * c.dcp_size + c.dcp_rank
        return rank * c.tp_size + c.tp_rank

    def _mla_shared(self) -> bool:
        return bool(self.storage_config.is_mla_model)

    def _namespace(self, layout: str, dtype: str, part_bytes: int, parts: int) -> dict[str, Any]:
        """kvtier's files (and S3) namespace: SGLang's key suffix rules, plus what makes the
        bytes of a page mean something (layout, parts, dtype), hashed into the directory."""
        c = self.storage_config
        shared = self._mla_shared()
        model = c.model_name or "sglang"
        page_tokens = int(c.logical_page_size or 0) or 1
        kind = "mla" if shared else "mha"
        return {
            "model_name": model,
            "dtype": dtype,
            "tokens_per_hash": page_tokens,
            "blocks_per_file": 1,
            "tp_size": 1 if shared else int(c.tp_size),
            "pp_size": int(c.pp_size),
            "pcp_size": int(c.attn_cp_size),
            "dcp_size": int(c.dcp_size) if shared else 1,
            "rank": self._rank(full=not shared),
            "kv_cache_groups": [{
                "tokens_per_block": page_tokens,
                "layer_names": [f"sglang/{kind}/{layout}/{parts}x{part_bytes}"],
            }],
        }

    # -- the host pool ------------------------------------------------------------------------

    def register_mem_pool_host(self, mem_pool_host: Any) -> None:
        super().register_mem_pool_host(mem_pool_host)
        if self._engine is not None:
            raise RuntimeError("kvtier.sglang: a host pool is already registered")
        pool = mem_pool_host
        buf = pool.kv_buffer
        self._base = buf.data_ptr()
        self._page_tokens = int(getattr(pool, "logical_page_size", pool.page_size))
        # One page, through the pool's own zero-copy map: its parts' addresses and sizes.
        ptrs, sizes = pool.get_page_buffer_meta(
            torch.arange(0, self._page_tokens, dtype=torch.int64))
        layout = str(pool.layout)
        if not sizes or len(set(sizes)) != 1:
            raise ValueError(
                f"kvtier.sglang: host pool layout {layout!r} gives pages of parts of sizes "
                f"{sorted(set(sizes))}: kvtier needs parts of one size"
            )
        part = int(sizes[0])
        if part % _ALIGN:
            raise ValueError(
                f"kvtier.sglang: host pool layout {layout!r} gives page parts of {part} bytes: "
                f"kvtier needs a multiple of {_ALIGN} (O_DIRECT); use a page-major layout "
                "(--hicache-mem-layout page_first) or a larger --page-size"
            )
        self._parts = len(ptrs)
        self._part_bytes = part
        region = buf.view(torch.uint8).numpy()
        nbytes = region.size
        for p in ptrs:
            if not 0 <= p - self._base < nbytes:
                raise ValueError(
                    f"kvtier.sglang: host pool layout {layout!r} puts page parts outside its "
                    "kv_buffer (several buffers): not supported"
                )
        dtype = str(pool.dtype).removeprefix("torch.")
        cfg = dict(self._cfg)
        cfg.setdefault("block_size", part)
        if size_bytes(cfg["block_size"]) != part:
            raise kvtier.ConfigError(
                f"config field `block_size` = {cfg['block_size']!r}: must equal a host pool "
                f"page part, {part} bytes"
            )
        ns = self._namespace(layout, dtype, part, self._parts)
        if self._files:
            files = dict(cfg.get("files") or {})
            files.setdefault("namespace", ns)
            if not self._writer:
                # Another rank stores these pages: a key not indexed yet is looked up on disk,
                # and an answer "absent" is kept briefly (the writer may store it any moment).
                files.setdefault("first_lookup", "pending")
                files.setdefault("lookup_ttl_ms", _READER_ABSENT_TTL_MS)
            cfg["files"] = files
        if "s3" in cfg:
            s3 = dict(cfg["s3"])
            if "namespace" not in s3 and not self._files:
                s3["namespace"] = ns
            cfg["s3"] = s3
        for dev in cfg.get("devices") or []:
            path = str(dev.get("path", ""))
            os.makedirs(path if dev.get("layout", "slab") == "files" else
                        os.path.dirname(path) or ".", exist_ok=True)
        self._engine = kvtier.Engine(cfg, region.reshape(-1))
        info = self._engine.info()
        logger.info(
            "kvtier.sglang: %s layout %s, pages of %d x %d bytes, %d workers, opened in %.3f s",
            "files" if self._files else "slab", layout, self._parts, part,
            len(info["workers"]), info["open_seconds"],
        )

    @property
    def engine(self) -> kvtier.Engine:
        if self._engine is None:
            raise RuntimeError("kvtier.sglang: no host pool registered yet")
        return self._engine

    # -- pages to jobs --------------------------------------------------------------------------

    def _keys(self, keys: list[str]) -> list[bytes]:
        out = []
        for k in keys:
            h = _key_hash(k)
            out.extend(h + j.to_bytes(4, "big") for j in range(self._parts))
        return out

    def _blocks(self, host_indices: Any, pages: int) -> list[int]:
        if host_indices.numel() != pages * self._page_tokens:
            raise ValueError(
                f"kvtier.sglang: {host_indices.numel()} host indices for {pages} pages of "
                f"{self._page_tokens} tokens"
            )
        ptrs, _ = self.mem_pool_host.get_page_buffer_meta(host_indices)
        return [(p - self._base) // self._part_bytes for p in ptrs]

    def _run(self, store: bool, keys: list[str], host_indices: Any) -> list[bool]:
        if not keys:
            return []
        engine = self.engine
        bkeys = self._keys(keys)
        blocks = self._blocks(host_indices, len(keys))
        job = next(self._ids)
        deadline = time.monotonic() + _BACKPRESSURE_WAIT_S
        while True:
            try:
                if store:
                    engine.submit_store(job, bkeys, blocks)
                else:
                    engine.submit_load(job, bkeys, blocks)
                break
            except kvtier.BackpressureError:
                if time.monotonic() > deadline:
                    logger.warning("kvtier.sglang: queue full for %.0f s; %d pages %s",
                                   _BACKPRESSURE_WAIT_S, len(keys),
                                   "not stored" if store else "not loaded")
                    return [False] * len(keys)
                with self._cv:
                    self._cv.wait(0.005)
            except kvtier.ShutdownError:
                return [False] * len(keys)
        result = self._wait(job)
        ok = [True] * len(keys)
        for index, _key, _class, _reason in result.failures:
            ok[index // self._parts] = False
        if result.failures:
            logger.debug("kvtier.sglang: %s job %d: %s", "store" if store else "load", job,
                         result.failures[:3])
        return ok

    def _wait(self, job: int) -> Any:
        """This job's result; one thread at a time polls the engine for every thread."""
        while True:
            with self._cv:
                if job in self._done:
                    return self._done.pop(job)
                if self._polling:
                    self._cv.wait(0.05)
                    continue
                self._polling = True
            results: list[Any] = []
            try:
                results = self.engine.wait_finished(0.05)
            finally:
                with self._cv:
                    for r in results:
                        self._done[r.job_id] = r
                    self._polling = False
                    self._cv.notify_all()

    # -- HiCacheStorage -----------------------------------------------------------------------

    def batch_set_v1(self, keys: list[str], host_indices: Any,
                     extra_info: HiCacheStorageExtraInfo | None = None) -> list[bool]:
        if not self._writer:
            # SGLang's rule for MLA: one rank writes the shared pages; the others report them
            # stored (their exists and gets see the writer's files).
            return [True] * len(keys)
        return self._run(True, list(keys), host_indices)

    def batch_get_v1(self, keys: list[str], host_indices: Any,
                     extra_info: HiCacheStorageExtraInfo | None = None) -> list[bool]:
        return self._run(False, list(keys), host_indices)

    def batch_exists(self, keys: list[str],
                     extra_info: HiCacheStorageExtraInfo | None = None) -> int:
        """The number of leading pages held (every part of each), from kvtier's index."""
        if not keys:
            return 0
        bkeys = self._keys(list(keys))
        deadline = time.monotonic() + _PENDING_WAIT_S
        while True:
            answers = self.engine.lookup(bkeys)
            held = 0
            pending = False
            for i in range(len(keys)):
                part = answers[i * self._parts:(i + 1) * self._parts]
                if all(a in ("nvme", "s3") for a in part):
                    held += 1
                    continue
                pending = "pending" in part and "miss" not in part
                break
            if not pending or time.monotonic() > deadline:
                return held
            time.sleep(0.001)

    def exists(self, key: str) -> bool:
        return self.batch_exists([key]) == 1

    def get(self, key: str, target_location: Any = None, target_sizes: Any = None) -> Any:
        raise NotImplementedError(
            "kvtier.sglang moves pages in place: SGLang calls batch_get_v1 with interface_v1 = 1")

    def batch_get(self, keys: list[str], target_locations: Any = None,
                  target_sizes: Any = None) -> Any:
        raise NotImplementedError(
            "kvtier.sglang moves pages in place: SGLang calls batch_get_v1 with interface_v1 = 1")

    def set(self, key: str, value: Any = None, target_location: Any = None,
            target_sizes: Any = None) -> bool:
        raise NotImplementedError(
            "kvtier.sglang moves pages in place: SGLang calls batch_set_v1 with interface_v1 = 1")

    def batch_set(self, keys: list[str], values: Any = None, target_locations: Any = None,
                  target_sizes: Any = None) -> bool:
        raise NotImplementedError(
            "kvtier.sglang moves pages in place: SGLang calls batch_set_v1 with interface_v1 = 1")

    def clear(self) -> None:
        raise NotImplementedError(
            "kvtier.sglang does not clear its store from SGLang; remove the cache directory "
            "(or slab) while no server uses it")

    def close(self) -> None:
        """Stops the engine (SGLang calls it on detach); waits for I/O in flight."""
        if self._engine is not None and not self._closed:
            self._closed = True
            self._engine.shutdown()
