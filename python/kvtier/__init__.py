"""kvtier: a KV-cache block storage engine for LLM inference nodes.

``kvtier.Engine`` moves fixed-size blocks between a memory region you own (used in place, never
copied) and local NVMe (io_uring, O_DIRECT) or an S3-compatible object store. Jobs never block
the caller; results are polled. ``kvtier.vllm.KvtierTierManager`` plugs the engine into vLLM's
tiered KV offload, ``kvtier.sglang.KvtierHiCacheStorage`` into SGLang's hierarchical cache,
``kvtier.lmcache.KvtierL2Connector`` into LMCache's multi-process server as an L2 adapter.

    import mmap, kvtier
    region = kvtier.allocate_region(num_blocks=64, block_size=2 << 20)
    with kvtier.Engine({"block_size": "2 MiB",
                        "devices": [{"path": "/var/tmp/kv.slab", "capacity_bytes": "1 GiB"}]},
                       region) as engine:
        region[0:4] = b"abcd"
        engine.submit_store(1, [b"key-0"], [0])
        engine.drain()
        [result] = engine.poll_finished()
        assert result.success
"""

from __future__ import annotations

import json
import mmap
import os
import threading
from collections.abc import Mapping, Sequence
from typing import Any, Literal, Union

from kvtier import _native
from kvtier._native import (
    BackpressureError,
    ConfigError,
    Error,
    ShutdownError,
    parse_size,
)

__all__ = [
    "BackpressureError",
    "ConfigError",
    "Engine",
    "Error",
    "Event",
    "JobResult",
    "ReleaseEvent",
    "ShutdownError",
    "allocate_region",
    "check_config",
    "parse_size",
]

JobResult = _native.JobOutcome
ReleaseEvent = _native.ReleaseEvent
Event = _native.EventOut
REGION_ALIGN_BYTES: int = _native.REGION_ALIGN_BYTES

ConfigLike = Union[str, "os.PathLike[str]", Mapping[str, Any]]
LookupAnswer = Literal["nvme", "s3", "miss", "pending"]


def _config_arg(config: ConfigLike) -> tuple[str, str]:
    """(text, kind) for the native parser: a path, TOML text, or the JSON of a dict."""
    if isinstance(config, Mapping):
        try:
            return json.dumps(config), "json"
        except (TypeError, ValueError) as e:
            raise ConfigError(f"config: the dict holds a value TOML cannot hold: {e}") from None
    if isinstance(config, os.PathLike):
        return os.fspath(config), "path"
    if isinstance(config, str):
        # TOML text has a "=" or a "[table]" header on some line; a path has neither.
        if "\n" in config or "=" in config or config.lstrip().startswith("["):
            return config, "toml"
        return config, "path"
    raise TypeError(
        f"config: expected a TOML path, TOML text or a dict, got {type(config).__name__}"
    )


def check_config(config: ConfigLike) -> str:
    """Validates a config (path, TOML text or dict); returns it as TOML with defaults filled in.

    Raises ConfigError naming the field, the value and what is accepted.
    """
    text, kind = _config_arg(config)
    return _native.check_config(text, kind)


def allocate_region(num_blocks: int, block_size: int) -> mmap.mmap:
    """A zeroed, page-aligned, writable anonymous mapping of num_blocks * block_size bytes,
    advised to use transparent huge pages (blocks in 4 KiB pages move as one segment per page;
    ``Engine.info()["region_huge_percent"]`` says what the kernel gave).

    Any writable C-contiguous page-aligned buffer works as a region (a numpy array over an mmap,
    a shared-memory mapping, a CPU torch tensor); this is the simplest one.

    The mapping is private (transparent huge pages need that): a child process forked after
    this call gets a copy-on-write copy, not the same bytes. To share a region between
    processes, map a shared-memory file (``/dev/shm``, mounted ``huge=within_size`` for huge
    pages) and pass that.
    """
    if num_blocks < 1 or block_size < 1:
        raise ValueError(
            f"num_blocks = {num_blocks}, block_size = {block_size}: both must be at least 1"
        )
    m = mmap.mmap(-1, num_blocks * block_size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    try:
        # Before the first touch, so that the pages are huge from the start.
        m.madvise(mmap.MADV_HUGEPAGE)
    except (AttributeError, OSError):
        pass  # no THP on this kernel: 4 KiB pages
    return m


def _region_view(region: Any) -> memoryview:
    """`region` as a flat byte memoryview for the native engine, which holds its export (and so
    the memory) until shutdown. Objects without the buffer protocol go through numpy: one with
    `__array_interface__` (numpy keeps it referenced), a CPU tensor through `.numpy()`."""
    try:
        view = memoryview(region)
    except TypeError:
        if hasattr(region, "__array_interface__"):
            try:
                import numpy
            except ImportError:
                raise TypeError(
                    "region: an __array_interface__ object needs numpy installed"
                ) from None
            return _region_view(numpy.asarray(region))
        if hasattr(region, "numpy") and not getattr(region, "is_cuda", False):
            # A CPU torch tensor: .numpy() shares its memory.
            return _region_view(region.numpy())
        raise TypeError(
            f"region: {type(region).__name__} is neither a buffer nor has __array_interface__; "
            "pass a writable buffer such as kvtier.allocate_region(), an mmap or a numpy array"
        ) from None
    if not view.c_contiguous:  # checked here because cast() needs it; the rest is native
        raise ValueError(
            "region: the buffer is not C-contiguous; pass one contiguous block of memory"
        )
    if view.format != "B" or view.ndim != 1:
        view = view.cast("B")
    return view


class Engine:
    """The kvtier engine over `region`, configured by `config`.

    config: a TOML path, TOML text, or a dict with the same structure (validated by the same
        code as the Rust config; errors raise ConfigError naming the field).
    region: a writable, C-contiguous, page-aligned buffer whose length is a multiple of
        `block_size`; used in place (registered as the rings' fixed buffers) and kept alive by
        the engine until `shutdown` has reaped every I/O. Block i is bytes
        [i * block_size, (i + 1) * block_size).

    Every method may be called from several threads at once. Calls that wait (the constructor,
    `drain`, `wait_finished`, `shutdown`) release the GIL.
    """

    def __init__(self, config: ConfigLike, region: Any) -> None:
        text, kind = _config_arg(config)
        self._native = _native.Engine(text, kind, _region_view(region))
        self._closed = threading.Event()

    @property
    def block_size(self) -> int:
        return self._native.block_size

    @property
    def num_blocks(self) -> int:
        return self._native.num_blocks

    @property
    def region_address(self) -> int:
        return self._native.region_address

    def submit_store(
        self, job_id: int, keys: Sequence[bytes], blocks: Sequence[int] | Any
    ) -> None:
        """Stores region block blocks[i] under keys[i]. Never blocks.

        Raises BackpressureError (nothing queued), ShutdownError, ValueError for a malformed
        job (lengths differ, block out of range, key too long, job_id already in flight).
        """
        self._native.submit_store(job_id, keys, blocks)

    def submit_load(
        self, job_id: int, keys: Sequence[bytes], blocks: Sequence[int] | Any
    ) -> None:
        """Loads keys[i] into region block blocks[i]. Never blocks; see submit_store."""
        self._native.submit_load(job_id, keys, blocks)

    def poll_finished(self) -> list[JobResult]:
        """Every job finished since the last call (each job exactly once). Never blocks."""
        return self._native.poll_finished()

    def wait_finished(self, timeout: float) -> list[JobResult]:
        """Waits up to `timeout` seconds for a result; returns all there are (maybe none)."""
        return self._native.wait_finished(float(timeout))

    def lookup(self, keys: Sequence[bytes]) -> list[LookupAnswer]:
        """Per key: "nvme" / "s3" (held there), "miss", or "pending" (an S3 HEAD, or a files
        worker's statx with files.first_lookup = "pending", is running)."""
        return self._native.lookup(keys)

    def touch(self, keys: Sequence[bytes]) -> None:
        """Marks keys recently used, so eviction keeps them longer (keys not held: ignored)."""
        self._native.touch(keys)

    def result_fd(self) -> int:
        """An eventfd that is readable whenever a result was published, for a poll/epoll loop
        of your own (non-blocking; owned by the engine, open until it is garbage-collected:
        do not close it). Call `clear_result_fd` before `poll_finished`, so a result published
        after that poll makes it readable again."""
        return self._native.result_fd()

    def clear_result_fd(self) -> int:
        """Resets `result_fd`; returns how many notifications it held (0: none)."""
        return self._native.clear_result_fd()

    def remove(self, keys: Sequence[bytes]) -> list[bool]:
        """Removes keys from the store (NVMe; a copy in the S3 tier stays): freed at once,
        with removed events. Per key, whether it was removed: not when it is not held, or an
        I/O is reading it (ask again later). Waits for the workers' answers (GIL released)."""
        return self._native.remove(keys)

    def jobs_in_flight(self) -> int:
        return self._native.jobs_in_flight()

    def drain(self) -> None:
        """Waits until every submitted job has resolved. Its result is then in poll_finished,
        unless an I/O of it outlived its deadline: such a result comes once the device answers
        (see set_early_results); drain_released waits for those too."""
        self._native.drain()

    def set_early_results(self, early: bool) -> None:
        """How a job is reported whose region blocks an I/O past its deadline still holds.

        False (the default): its result comes once the blocks are free (``result.release`` is
        None). True: it comes when the job resolves, with ``result.release`` an event (as
        ``threading.Event``: ``is_set``, ``wait``) set once no I/O can reach the blocks. Either
        way a block is the caller's again only once ``result.released`` is true.
        """
        self._native.set_early_results(bool(early))

    def drain_released(self) -> None:
        """drain(), then waits until every job is reported and every block free: also for I/O
        past its deadline (as long as the device takes to answer; forever if it never does)."""
        self._native.drain_released()

    def shutdown(self) -> dict[str, Any]:
        """Stops the engine and releases the region. Idempotent.

        Queued jobs fail (reason "shutdown"); I/O in flight completes first. Results stay
        available to poll_finished; later submits raise ShutdownError. If a device never
        answered, shutdown gives up waiting after ``io_timeout_ms``: those jobs are reported
        with an unset ``release``, the region's buffer stays exported (it cannot be freed or
        resized) for the life of the process, and a ResourceWarning names the blocks held.
        Returns what could not be stopped: ``workers_gave_up``, ``ops_in_flight``,
        ``jobs_held``, ``blocks_held`` and ``clean`` (True when nothing is held).
        """
        report = self._native.shutdown()
        self._closed.set()
        return report

    def take_events(self) -> list[Event]:
        """Stored/removed events since the last call (config: [events] enabled = true)."""
        return self._native.take_events()

    def stats(self) -> dict[str, Any]:
        return self._native.stats()

    def metrics_text(self) -> str:
        """Every counter as Prometheus text (0.0.4), the body `GET /metrics` serves."""
        return self._native.metrics_text()

    @property
    def metrics_address(self) -> tuple[str, int] | None:
        """(host, port) of the metrics endpoint (config: [metrics] listen), or None."""
        return self._native.metrics_address

    def info(self) -> dict[str, Any]:
        return self._native.info()

    def s3_object_name(self, key: bytes) -> str | None:
        return self._native.s3_object_name(key)

    def __enter__(self) -> "Engine":
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()

    def __repr__(self) -> str:
        state = "shut down" if self._closed.is_set() else "open"
        return (
            f"<kvtier.Engine {state}: {self.num_blocks} blocks of {self.block_size} bytes>"
        )
