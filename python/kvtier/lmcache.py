"""kvtier as an L2 adapter of LMCache's multi-process server: ``KvtierL2Adapter`` (in place,
LMCache's ``plugin`` type) and ``KvtierL2Connector`` (staged, its ``native_plugin`` type).

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

* ``block_size`` (default ``"2 MiB"``): kvtier's block. An object of n bytes is stored as
  ceil(n / block_size) blocks under its key and the block's number.
* ``staging_bytes`` (default ``"1 GiB"``): kvtier's own region, where objects are staged.

**In place, as a ``plugin``** (``KvtierL2Adapter``)::

    lmcache server ... --l1-align-bytes 2097152 --l2-adapter '{"type": "plugin",
      "module_path": "kvtier.lmcache", "class_name": "KvtierL2Adapter",
      "adapter_params": {"root_dir": "/mnt/nvme/lmcache", "capacity_bytes": "2 TiB"}}'

LMCache hands a ``plugin`` adapter the description of its L1 arena (``L1MemoryDesc``: base,
size, allocation alignment). ``KvtierL2Adapter`` is LMCache's own ``NativeConnectorL2Adapter``
over a ``KvtierL2Connector`` whose engine region *is* that arena (its stable, pinned prefix):
objects go from the arena to the device and back with no copy. That needs every object to
start on a kvtier block, so the arena's alignment (``--l1-align-bytes``) must be a multiple of
``block_size`` (an object's last block then ends inside its own allocation's padding, which a
load may overwrite), and the whole arena must be there from the start. Where that does not
hold (LMCache's default alignment is 4 KiB; a POSIX shared-memory or Device-DAX arena exposes
no stable prefix; a lazily grown arena larger than its initial size; no description at all; an
arena the engine cannot register), the adapter logs why once and stages, as the native plugin
does. ``report_status()`` says which (``in_place``). ``adapter_params`` may add LMCache's ``max_capacity_gb``;
``staging_bytes`` is not used in place. A buffer that is not on a block of the registered arena
cannot be used in place: its object fails (not stored / a miss), counted in
``stats()["lmcache"]["objects_outside_arena"]``. A load that fails in place (a checksum that
does not match, a device error) may leave part of what the device returned in its object's
buffer; LMCache reads nothing of an object whose load failed. (LMCache 0.5.6 itself, aborting a
prefetch, frees the L1 buffers of loads it leaves running; a load into such a buffer, in place
or through its staged copy, writes memory LMCache may have reused, as its own fs adapter's
would.) The arena in 4 KiB pages costs the device one segment per page: LMCache's
``--l1-use-hugepages`` (with ``--no-l1-use-lazy``) backs it with huge pages.

**Staged, as a ``native_plugin``.** The buffers LMCache hands a native connector are slices of
its L1 arena at its allocator's offsets, and the connector is not told where the arena is:
every object is copied into the staging region before its store is submitted, and out of it
(into LMCache's buffer) when its load has finished, in ``drain_completions``. Each object of a
batch is a kvtier job of its own, so one object's copy overlaps the others' I/O; the batch
completes with its last object. A batch that does not fit the staging room left completes at
once as failed (LMCache treats it as not stored / a miss); ``stats()`` counts those.

The event fd is kvtier's result eventfd: the engine bumps it when a job's result is published
(no Python thread polls the engine); this adapter bumps it too for what completes without I/O
(``submit_batch_exists``, refused batches).

Keys are LMCache's ``model@kv_rank@group@chunk_hash[@salt]`` strings, through sha256 (kvtier
keys are at most 64 bytes). ``submit_batch_exists`` answers from kvtier's index (an object is
held when its first block is; a load whose other blocks are gone fails, as a miss).
``submit_batch_delete`` (LMCache's L2 eviction) removes objects from kvtier at once (every
block, freed for new stores); kvtier also evicts by itself under ``capacity_bytes``.
"""

from __future__ import annotations

import collections
import hashlib
import itertools
import logging
import os
import threading
from collections.abc import Collection, Iterable
from typing import Any

import numpy as np

import ctypes

import kvtier
from kvtier._tier_config import cores_auto, load_config, size_bytes

logger = logging.getLogger("kvtier.lmcache")

TESTED_LMCACHE = "0.5.6"
_LAYOUTS = ("files", "slab")
_ALIGN = 4096
_SLAB_FILE = "lmcache.slab"
_NOTIFY = (1).to_bytes(8, "little")
# Objects up to this size are deleted whole even by a connector that has not stored one yet.
_DELETE_OBJECT_BYTES = 64 << 20


def _block_keys(key: str, n: int) -> list[bytes]:
    """kvtier's keys of the first `n` blocks of LMCache's object `key`."""
    h = hashlib.sha256(key.encode()).digest()
    return [h + j.to_bytes(4, "big") for j in range(n)]


def _address(view: memoryview) -> int:
    """Where a byte view's memory starts."""
    return int(np.frombuffer(view, dtype=np.uint8).ctypes.data)


_CONNECTOR_PARAMS = ("root_dir", "layout", "capacity_bytes", "cores", "s3", "direct_io",
                     "config", "block_size", "staging_bytes")


def _refuse_unknown(unknown: Collection[str], accepted: Iterable[str]) -> None:
    """A TypeError naming the `adapter_params` keys not understood and those accepted."""
    if unknown:
        raise TypeError(
            f"kvtier.lmcache: adapter_params key(s) {', '.join(map(repr, sorted(unknown)))} "
            f"not understood; accepted: {', '.join(accepted)}"
        )


def _arena_refusal(desc: Any, block: int) -> str | None:
    """Why LMCache's L1 arena `desc` cannot be kvtier's region for blocks of `block` bytes."""
    if desc is None:
        return "LMCache described no L1 arena to this adapter"
    align = int(desc.align_bytes)
    stable = desc.stable_registration_size
    if align % block:
        return (f"the L1 arena's alignment ({align} bytes) is not a multiple of kvtier's "
                f"block_size ({block} bytes): start LMCache with --l1-align-bytes {block} "
                "(or a multiple), or set block_size to a divisor of it")
    if stable is None:
        return ("the L1 arena exposes no stable registration prefix (POSIX shared memory or "
                "a Device-DAX arena, which io_uring cannot register)")
    if int(stable) < int(desc.size):
        return (f"the L1 arena grows lazily (its stable prefix is {int(stable)} of "
                f"{int(desc.size)} bytes, and objects past it could not be used in place): "
                "start LMCache with --no-l1-use-lazy, or an --l1-size-gb no larger than "
                "--l1-init-size-gb")
    if int(desc.ptr) % _ALIGN:
        return f"the L1 arena starts at {int(desc.ptr):#x}, not {_ALIGN}-byte aligned"
    if int(stable) // block < 1:
        return (f"the L1 arena's stable prefix ({int(stable)} bytes) holds no block of "
                f"{block} bytes")
    return None


class _Batch:
    """A submitted batch: each object's outcome, and how many are still running."""

    __slots__ = ("op", "ok", "left", "errors", "submitted")

    def __init__(self, op: str, n: int) -> None:
        self.op = op
        self.ok = [False] * n
        self.left = n
        self.errors: set[str] = set()
        self.submitted = False


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
        block_size: int | str = "2 MiB",
        staging_bytes: int | str = "1 GiB",
        *,
        _l1_arena: Any = None,
        **unknown: Any,
    ) -> None:
        _refuse_unknown(unknown, _CONNECTOR_PARAMS)
        self._block = size_bytes(block_size)
        if self._block < _ALIGN or self._block % _ALIGN:
            raise ValueError(
                f"kvtier.lmcache: block_size = {block_size!r}: must be a multiple of {_ALIGN}"
            )
        staging = size_bytes(staging_bytes)
        blocks = staging // self._block
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
        # In place (`_l1_arena`: KvtierL2Adapter's `[L1MemoryDesc]`): the engine's region is
        # LMCache's L1 arena (its stable prefix, whole blocks); (base address, bytes).
        # Otherwise a staging region of kvtier's own.
        self._arena: tuple[int, int] | None = None
        self._engine = None
        if _l1_arena is not None:
            [desc] = _l1_arena
            refusal = _arena_refusal(desc, self._block)
            if refusal is None:
                nbytes = int(desc.stable_registration_size) // self._block * self._block
                self._region = np.ctypeslib.as_array(
                    (ctypes.c_ubyte * nbytes).from_address(int(desc.ptr)))
                try:
                    self._engine = kvtier.Engine(cfg, self._region)
                except (kvtier.Error, ValueError, OSError) as e:
                    refusal = f"the engine could not take the L1 arena as its region ({e})"
                else:
                    self._arena = (int(desc.ptr), nbytes)
                    self._bytes = self._region
                    blocks = 0
            if refusal is not None:
                logger.warning("kvtier.lmcache: objects are staged, not used in place: %s",
                               refusal)
        if self._engine is None:
            if blocks < 1:
                raise ValueError(
                    f"kvtier.lmcache: staging_bytes = {staging_bytes!r}: must hold at least "
                    f"one block of {self._block} bytes"
                )
            self._region = kvtier.allocate_region(blocks, self._block)
            self._bytes = np.frombuffer(self._region, dtype=np.uint8)
            self._engine = kvtier.Engine(cfg, self._region)
        self._fd = self._engine.result_fd()
        self._lock = threading.Lock()
        self._free: collections.deque[int] = collections.deque(range(blocks))
        self._ids = itertools.count(1)
        # Batches (futures) not completed yet, and their objects' engine jobs:
        # job id -> (future, object index, blocks, the buffer a load lands in).
        self._batches: dict[int, _Batch] = {}
        self._jobs: dict[int, tuple[int, int, list[int], memoryview | None]] = {}
        # Completions that needed no I/O (exists, refused batches), for drain_completions.
        self._ready: list[tuple[int, bool, str, list[bool] | None]] = []
        self._closed = False
        self._stats = collections.Counter()
        # The most blocks an object had (a delete removes that many per key); at least what
        # the region could hold of one, so objects stored before a restart go too.
        room = blocks if self._arena is None else self._arena[1] // self._block
        self._max_parts = min(room, self._parts(_DELETE_OBJECT_BYTES))
        if self._arena is None:
            logger.info("kvtier.lmcache: %s, blocks of %d bytes, %d staging blocks",
                        self._engine, self._block, blocks)
        else:
            logger.info("kvtier.lmcache: %s, blocks of %d bytes, in place over the L1 arena "
                        "(%d bytes at %#x)", self._engine, self._block, self._arena[1],
                        self._arena[0])

    @property
    def block_size(self) -> int:
        return self._block

    @property
    def in_place(self) -> bool:
        """Whether objects move between LMCache's L1 arena and the device with no copy."""
        return self._arena is not None

    def _arena_blocks(self, view: memoryview, n: int) -> list[int] | None:
        """The region blocks of an object in the arena (`n` of them from its start), or None
        if it does not start on a block of the registered arena or reaches past it."""
        base, nbytes = self._arena  # type: ignore[misc]
        if view.nbytes == 0:
            return None
        off = _address(view) - base
        if off < 0 or off % self._block or off + n * self._block > nbytes:
            return None
        first = off // self._block
        return list(range(first, first + n))

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
        """One engine job per object, over its own blocks of the arena (in place) or over
        staging blocks (so that copying one object overlaps the I/O of the others); the
        batch's future completes with the last of them."""
        if len(keys) != len(buffers):
            raise ValueError(f"kvtier.lmcache: {len(keys)} keys but {len(buffers)} buffers")
        views = [memoryview(b).cast("B") for b in buffers]
        parts = [self._parts(v.nbytes) for v in views]
        if parts:
            self._max_parts = max(self._max_parts, max(parts))
        if self._closed:
            self._stats["batches_closed"] += 1
            return self._complete_now(False, [False] * len(keys), "closed")
        staged: list[int] | None = None
        if self._arena is None:
            need = sum(parts)
            with self._lock:
                if need <= len(self._free):
                    staged = [self._free.popleft() for _ in range(need)]
            if staged is None:
                self._stats["batches_refused_staging"] += 1
                return self._complete_now(False, [False] * len(keys), "staging region full")
        future = next(self._ids)
        with self._lock:
            self._batches[future] = _Batch(op, len(keys))
        at = 0
        for k, (key, view, n) in enumerate(zip(keys, views, parts)):
            if staged is not None:
                blocks = staged[at:at + n]
                at += n
                if op == "set":
                    self._stage(view, blocks)
            else:
                blocks = self._arena_blocks(view, n)
                if blocks is None:
                    self._outside_arena(view)
                    self._settle(future, k, False, "buffer outside kvtier's registered L1 arena")
                    continue
            copy_to = view if op == "get" and staged is not None else None
            if self._submit_object(op, future, k, _block_keys(key, n), blocks, copy_to):
                how = "in_place" if staged is None else "staged"
                self._stats[f"{how}_{op}_bytes"] += view.nbytes
        self._settle(future, None, True, "")
        return future

    def _stage(self, view: memoryview, blocks: list[int]) -> None:
        """Copies an object into its staging blocks (the last one's tail zeroed)."""
        for j, b in enumerate(blocks):
            dst = b * self._block
            chunk = view[j * self._block:(j + 1) * self._block]
            self._bytes[dst:dst + len(chunk)] = chunk
            if len(chunk) < self._block:
                self._bytes[dst + len(chunk):dst + self._block] = 0

    def _outside_arena(self, view: memoryview) -> None:
        """Counts an in-place object whose buffer is not on a block of the arena (logged once)."""
        self._stats["objects_outside_arena"] += 1
        if self._stats["objects_outside_arena"] == 1:
            logger.warning(
                "kvtier.lmcache: a buffer of %d bytes at %#x is not on a block of the registered "
                "L1 arena; its object fails (counted in "
                "stats()['lmcache']['objects_outside_arena'])", view.nbytes,
                _address(view) if view.nbytes else 0)

    def _submit_object(self, op: str, future: int, k: int, bkeys: list[bytes],
                       blocks: list[int], copy_to: memoryview | None) -> bool:
        """Submits one object's job (its staging blocks go back if the engine refuses it,
        and the object fails); whether it was submitted."""
        job = next(self._ids)
        with self._lock:
            self._jobs[job] = (future, k, blocks, copy_to)
        try:
            if op == "set":
                self._engine.submit_store(job, bkeys, blocks)
            else:
                self._engine.submit_load(job, bkeys, blocks)
        except (kvtier.Error, ValueError) as e:
            self._stats["objects_refused_engine"] += 1
            with self._lock:
                del self._jobs[job]
                if self._arena is None:
                    self._free.extend(blocks)
            self._settle(future, k, False, str(e))
            return False
        return True

    def _settle(self, future: int, k: int | None, ok: bool, error: str,
                out: list[Any] | None = None) -> None:
        """Records object k's outcome (None: the batch is fully submitted); once every object
        has one, the batch completes (into `out`, or the ready list and a notification)."""
        with self._lock:
            batch = self._batches[future]
            if k is None:
                batch.submitted = True
            else:
                batch.ok[k] = ok
                batch.left -= 1
                if error:
                    batch.errors.add(error)
            if not batch.submitted or batch.left:
                return
            del self._batches[future]
            done = (future, all(batch.ok), "; ".join(sorted(batch.errors)[:3]), batch.ok)
            if out is None:
                self._ready.append(done)
        if out is not None:
            out.append(done)
        else:
            os.write(self._fd, _NOTIFY)

    def submit_batch_set(self, keys: list[str], buffers: list[Any]) -> int:
        """Queues each buffer's store: in place, or copied into staging blocks first. Never
        blocks."""
        return self._submit("set", list(keys), list(buffers))

    def submit_batch_get(self, keys: list[str], buffers: list[Any]) -> int:
        """Queues the loads: in place into `buffers`, or into staging blocks that
        drain_completions copies into `buffers`."""
        return self._submit("get", list(keys), list(buffers))

    def submit_batch_exists(self, keys: list[str]) -> int:
        """Per key, whether kvtier holds it (its first block), from the index; no I/O."""
        if self._closed:
            return self._complete_now(False, [False] * len(keys), "closed")
        answers = self._engine.lookup([_block_keys(k, 1)[0] for k in keys])
        return self._complete_now(True, [a in ("nvme", "s3") for a in answers])

    def submit_batch_delete(self, keys: list[str]) -> int:
        """Removes each object (every block of it) from kvtier; per key, whether it was held
        and is now removed (a key being loaded is not: LMCache may ask again)."""
        if self._closed:
            return self._complete_now(False, [False] * len(keys), "closed")
        parts = max(self._max_parts, 1)
        bkeys = [b for k in keys for b in _block_keys(k, parts)]
        removed = self._engine.remove(bkeys)
        # A key counts as deleted when its first block was (the others go with it if held).
        results = [removed[i * parts] for i in range(len(keys))]
        self._stats["objects_deleted"] += sum(results)
        return self._complete_now(True, results)

    def drain_completions(self) -> list[tuple[int, bool, str, list[bool] | None]]:
        """Every batch completed since the last call: (future id, ok, error, per-key results).
        A staged load is copied into LMCache's buffer here, before its batch is reported."""
        self._engine.clear_result_fd()
        with self._lock:
            out, self._ready = self._ready, []
        for r in self._engine.poll_finished():
            with self._lock:
                job = self._jobs.pop(r.job_id, None)
            if job is None:
                continue
            future, k, blocks, view = job
            ok = r.success
            if view is not None:
                if self._closed:
                    # Closed: LMCache may have reused the buffer; nothing is written into it.
                    ok = False
                elif ok:
                    for j, b in enumerate(blocks):
                        src = b * self._block
                        n = min(self._block, view.nbytes - j * self._block)
                        view[j * self._block:j * self._block + n] = self._bytes[src:src + n]
            if self._arena is None:
                with self._lock:
                    self._free.extend(blocks)
            error = "" if r.success else "; ".join(
                sorted({f"{cls}: {reason}" for (_, _, cls, reason) in r.failures})[:3])
            self._settle(future, k, ok, error, out)
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
        report = self._engine.shutdown()
        if self._arena is not None and report.get("workers_gave_up"):
            logger.error("kvtier.lmcache: I/O into LMCache's L1 arena outlived the stop (%s); "
                         "the arena must not be freed or reused", report)

    @property
    def engine(self) -> kvtier.Engine:
        return self._engine


_ADAPTER: type | None = None


def _adapter_class() -> type:
    """``KvtierL2Adapter``: LMCache's own ``NativeConnectorL2Adapter`` over a
    ``KvtierL2Connector`` built in place over the L1 arena LMCache describes."""
    global _ADAPTER
    if _ADAPTER is not None:
        return _ADAPTER
    try:
        from lmcache.v1.distributed.l2_adapters.native_connector_l2_adapter import (
            NativeConnectorL2Adapter,
        )
    except ImportError as e:
        raise ImportError(
            "kvtier.lmcache.KvtierL2Adapter is LMCache's `plugin` L2 adapter and needs LMCache "
            f"(pip install lmcache=={TESTED_LMCACHE}); KvtierL2Connector, the `native_plugin` "
            f"connector, needs nothing from it ({e})"
        ) from e

    class KvtierL2Adapter(NativeConnectorL2Adapter):  # type: ignore[misc, valid-type]
        """kvtier as LMCache's ``plugin`` L2 adapter, in place over its L1 arena (see the
        ``kvtier.lmcache`` docstring). ``adapter_params`` as for ``KvtierL2Connector``, plus
        LMCache's ``max_capacity_gb``."""

        def __init__(self, adapter_params: dict[str, Any] | None = None,
                     l1_memory_desc: Any = None) -> None:
            params = dict(adapter_params or {})
            accepted = (*_CONNECTOR_PARAMS, "max_capacity_gb")
            _refuse_unknown(set(params) - set(accepted), accepted)
            max_capacity_gb = params.pop("max_capacity_gb", 0)
            if (isinstance(max_capacity_gb, bool)
                    or not isinstance(max_capacity_gb, (int, float)) or max_capacity_gb < 0):
                raise ValueError(
                    f"kvtier.lmcache: max_capacity_gb = {max_capacity_gb!r}: expected a "
                    "number >= 0 (0: no limit; kvtier's capacity_bytes bounds the device)")
            connector = KvtierL2Connector(**params, _l1_arena=[l1_memory_desc])
            try:
                super().__init__(
                    connector, max_capacity_gb=max_capacity_gb, type_name="kvtier",
                    extra_status={"in_place": connector.in_place,
                                  "block_size": connector.block_size})
            except BaseException:
                connector.close()
                raise

        @property
        def connector(self) -> KvtierL2Connector:
            return self._client

    KvtierL2Adapter.__module__ = __name__
    _ADAPTER = KvtierL2Adapter
    return _ADAPTER


def __getattr__(name: str) -> Any:
    if name == "KvtierL2Adapter":
        return _adapter_class()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
