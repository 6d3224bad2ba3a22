"""kvtier as a vLLM secondary KV-offload tier (0.33 and 0.34): ``KvtierTierManager``.

A drop-in for vLLM's file-system tier (``"type": "fs"``): the same directory layout, file names
and ``config.json`` (a directory written by either one is read by the other), with kvtier's
engine underneath (io_uring with O_DIRECT into the primary region itself, a capacity bound with
eviction, checksums, an in-memory index, and optionally the S3 tier with vLLM's object names).
Turn it on by naming this class in the offloading config::

    "secondary_tiers": [{"type": "KvtierTierManager", "module_path": "kvtier.vllm",
                         "root_dir": "/mnt/kv"}]

Keyword arguments (from the tier's JSON entry): either ``config`` (a kvtier TOML path, TOML
text or an inline table; ``block_size`` and the files namespace are filled in from vLLM when
left out) or the short form:

* ``root_dir`` (required): the cache directory, as for vLLM's fs tier.
* ``layout``: ``"files"`` (default; vLLM's layout, shareable with vLLM) or ``"slab"`` (kvtier's
  own: one preallocated file ``<root_dir>/kvtier.slab``; needs ``capacity_bytes``).
* ``capacity_bytes``: bound on the bytes kept (files: unset means unbounded, like vLLM).
* ``cores``: ``"auto"`` (default: one pinned worker per CPU this process may use, at most
  ``AUTO_WORKERS_MAX`` = 8, on the highest-numbered of them: every worker registers the whole
  primary region, so opening costs grow with workers) or an explicit list of CPUs.
* ``s3``: an inline ``[s3]`` table (bucket, endpoint, prefix, ...; see kvtier.example.toml).
* ``enable_kv_events``, ``locality``: as for vLLM's fs tier.
* ``n_read_threads``, ``n_write_threads``: accepted so an ``fs`` entry works unchanged, and
  ignored: kvtier keeps a whole job in flight on its io_uring workers, no thread pool needed.
* ``direct_io``: ``"auto"`` (default), ``"required"`` or ``"off"``.

Every method runs on vLLM's scheduler thread and never waits for a device or the network:
lookups read kvtier's in-memory index (a HIT at once, no extra scheduler step), submissions
only queue, and a refused submission (backpressure, shutdown, a malformed job) is reported as a
failed job by the next ``get_finished_jobs`` so vLLM's backpressure detector sees it.
"""

from __future__ import annotations

import collections
import dataclasses
import logging
import os
import time
from collections.abc import Collection, Iterable, Mapping
from typing import Any, ClassVar

try:
    from vllm.v1.kv_offload.base import (
        Locality,
        LookupResult,
        Medium,
        OffloadingCounterMetadata,
        OffloadingEvent,
        OffloadingGaugeMetadata,
        OffloadingHistogramMetadata,
        OffloadingMetricMetadata,
        ReqContext,
        RequestOffloadingContext,
        ScheduleEndContext,
    )
    from vllm.v1.kv_offload.file_mapper import FileMapper
    from vllm.v1.kv_offload.tiering.base import (
        JobResult,
        SecondaryTierManager,
        TransferJob,
    )
except ImportError as _e:  # pragma: no cover - exercised by a test without vLLM
    raise ImportError(
        "kvtier.vllm needs vLLM 0.33.0 or 0.34.0 (pip install vllm==0.34.0); "
        f"`import kvtier` works without it ({_e})"
    ) from _e

import kvtier
from kvtier._tier_config import cores_auto, load_config, size_bytes

logger = logging.getLogger("kvtier.vllm")

# vLLM 0.34's JobResult.deferred_release: a failed promotion whose I/O may still write its
# chunks is reported at once with an event kvtier sets once they are free. Without it (0.33),
# such a job is reported only once its chunks are free. Detected by feature, not version.
_DEFERRED_RELEASE = "deferred_release" in {f.name for f in dataclasses.fields(JobResult)}
# vLLM 0.34's OffloadingEvent.req_context: a stored event names the store job's request.
_EVENT_REQ_CONTEXT = "req_context" in {f.name for f in dataclasses.fields(OffloadingEvent)}
SUPPORTED_VLLM = ("0.33.0", "0.34.0")
# vLLM 0.33 calls touch(keys) for blocks a request reuses; 0.34 has no touch: there a lookup
# that hits is what keeps a block recent (batched per scheduler step, in on_schedule_end).
_VLLM_TOUCHES = hasattr(SecondaryTierManager, "touch")
_HITS_PER_STEP_MAX = 65536
# What kvtier calls on vLLM's side; an API without them is not one kvtier knows (an older or a
# later vLLM): refused at construction with the versions it supports, not deep in a job.
_REQUIRED = {
    TransferJob: ("job_id", "keys", "chunk_ids", "is_promotion", "req_context"),
    JobResult: ("job_id", "success", "successful_keys", "transfer_time", "transfer_bytes"),
    OffloadingEvent: ("keys", "medium", "removed", "locality"),
}
_MISSING = sorted(
    f"{cls.__name__}.{name}"
    for cls, names in _REQUIRED.items()
    for name in names
    if name not in {f.name for f in dataclasses.fields(cls)}
)
# Keys of a failed batched load after its first failed block that did load: vLLM's fs tier
# stops a batch at its first bad block and makes the rest a miss, so the scheduler does not
# promote them again for the request (they are of no use to it: its prefix is broken there).
# They stay misses until the load's request finishes, or this long; at most this many.
_DOOMED_TTL_S = 30.0
_DOOMED_MAX = 65536

_LAYOUTS = ("files", "slab")
_SLAB_FILE = "kvtier.slab"
# A key whose load failed is a MISS for this long (vLLM's promotion-livelock fix, #49328):
# long enough for the scheduler to recompute instead of retrying, short enough that a
# transient device error does not hide a good block for long. A later store clears it.
_FAILED_KEY_TTL_S = 30.0
_FAILED_KEYS_MAX = 65536

_PREFIX = "vllm:kv_offload_kvtier_"
_LABELS = ("tier",)
_COUNTERS = {
    "loaded_bytes": ("Bytes loaded from kvtier into the primary tier.", "bytes_read"),
    "stored_bytes": ("Bytes stored from the primary tier into kvtier.", "bytes_written"),
    "loads_ok": ("Blocks loaded.", "loads_ok"),
    "loads_failed": ("Blocks whose load failed (misses included).", "loads_failed"),
    "load_misses": ("Blocks asked for that kvtier no longer held.", "load_misses"),
    "stores_ok": ("Blocks stored.", "stores_ok"),
    "stores_failed": ("Blocks whose store failed.", "stores_failed"),
    "stores_skipped_present": ("Stores skipped: the block was already held.",
                               "stores_skipped_present"),
    "evictions": ("Blocks evicted to make room.", "evictions"),
    "checksum_failures": ("Blocks dropped: their crc32c did not match.", "checksum_failures"),
    "files_refused": ("Block paths refused: a symlink or a non-regular file was there.",
                      "files_refused"),
    "io_timeouts": ("Device I/Os past io_timeout_ms (their blocks failed).", "io_timeouts"),
    "io_errors": ("Device I/O errors.", "io_errors"),
    "devices_failed": ("Devices marked failed after repeated timeouts.", "devices_failed"),
}
_GAUGES = {
    "blocks_stored": ("Blocks kvtier holds.", "blocks_stored"),
    "slots_total": ("Blocks kvtier can hold (0: unbounded files layout).", "slots_total"),
    "jobs_in_flight": ("Jobs submitted and not yet finished.", "jobs_in_flight"),
    "blocks_held_by_hung_io": (
        "Primary chunks an I/O past its deadline may still reach (not given back yet).",
        "blocks_held_by_hung_io"),
}
_HISTOGRAMS = {
    "load_job_seconds": "Load job time, submission to completion, seconds.",
    "store_job_seconds": "Store job time, submission to completion, seconds.",
}
# Labelled families: (documentation, extra label names, how to read (label values, value) pairs
# from the engine's stats dict). The same figures as kvtier's own /metrics (docs/metrics.md).
_LABELLED_COUNTERS: dict[str, tuple[str, tuple[str, ...], Any]] = {
    "lookups": (
        "Keys looked up, by answer (hit_nvme, hit_s3, miss, pending).",
        ("answer",),
        lambda s: [((a,), n) for a, n in s["lookups"].items()],
    ),
    "backpressure_refusals": (
        "Submissions kvtier refused (queue full), by the limit hit.",
        ("limit",),
        lambda s: [
            (("jobs_in_flight_max",), s["jobs"]["refused_jobs_in_flight"]),
            (("queue_blocks_max",), s["jobs"]["refused_queue_blocks"]),
        ],
    ),
    "device_errors": (
        "Device I/O errors by device and class (io, no_space, permission, invalid, busy, "
        "short, other).",
        ("device", "class"),
        lambda s: [((d["path"], c), n) for d in s["devices"] for c, n in d["errors"].items()],
    ),
    "s3_requests": (
        "Object-store requests, retries included, by operation.",
        ("op",),
        lambda s: [((op,), s["s3"][op]["requests"]) for op in ("head", "get", "put")]
        if s["s3"] else [],
    ),
    "s3_errors": (
        "Object-store requests that failed after retries, by operation.",
        ("op",),
        lambda s: [((op,), s["s3"][op]["errors"]) for op in ("head", "get", "put")]
        if s["s3"] else [],
    ),
    "s3_bytes": (
        "Bytes moved to and from the object store (get: loaded, put: stored).",
        ("op",),
        lambda s: [((op,), s["s3"][op]["bytes"]) for op in ("get", "put")] if s["s3"] else [],
    ),
}
_LABELLED_GAUGES: dict[str, tuple[str, tuple[str, ...], Any]] = {
    "queued_blocks": (
        "Blocks queued in kvtier's workers, not yet started.",
        ("op",),
        lambda s: [(("load",), s["queued_loads"]), (("store",), s["queued_stores"])],
    ),
    "device_used_bytes": (
        "Bytes of blocks stored on each device.",
        ("device",),
        lambda s: [((d["path"],), d["used_bytes"]) for d in s["devices"]],
    ),
    "device_failed": (
        "1 once the device was marked failed (it kept timing out).",
        ("device",),
        lambda s: [((d["path"],), int(d["failed"])) for d in s["devices"]],
    ),
}
_INFO_KEYS = ("kvtier_layout", "kvtier_workers", "kvtier_devices", "kvtier_s3")


def _namespace(spec: Any, file_mapper: FileMapper) -> dict[str, Any]:
    """kvtier's [files.namespace] from vLLM's spec, read as FileMapper.from_offloading_spec reads
    it (the caller checks that both produce the same directory)."""
    config = spec.config
    parallel = config.parallel
    ns: dict[str, Any] = {
        "model_name": config.model.name,
        "dtype": str(config.model.dtype),
        "tokens_per_hash": int(config.cache.tokens_per_hash),
        "blocks_per_file": int(spec.blocks_per_chunk),
        "tp_size": int(parallel.tp_size),
        "pp_size": int(parallel.pp_size),
        "pcp_size": int(parallel.pcp_size),
        "dcp_size": int(parallel.dcp_size),
        "rank": int(parallel.rank),
        "parallel_agnostic": bool(parallel.is_parallelism_agnostic),
        "replicated_layout": bool(config.replicated_layout),
        "kv_cache_groups": [
            {"tokens_per_block": int(g.tokens_per_block), "layer_names": list(g.layer_names)}
            for g in config.groups
        ],
    }
    canonical = file_mapper.get_run_config().get("canonical_format")
    if canonical is not None:
        ns["canonical_format"] = canonical
    return ns


class KvtierTierManager(SecondaryTierManager):
    """vLLM secondary tier backed by the kvtier engine; see the module docstring."""

    medium: ClassVar[Medium] = Medium.STORAGE

    def __init__(
        self,
        offloading_spec: Any,
        primary_kv_view: memoryview,
        tier_type: str,
        backpressure_detector: Any = None,
        *,
        root_dir: str | None = None,
        config: Any = None,
        layout: str | None = None,
        capacity_bytes: int | str | None = None,
        cores: Any = None,
        s3: Mapping[str, Any] | None = None,
        enable_kv_events: bool = False,
        locality: str | None = None,
        direct_io: str | None = None,
        n_read_threads: int | None = None,
        n_write_threads: int | None = None,
    ) -> None:
        if _MISSING:
            raise RuntimeError(
                f"kvtier.vllm supports vLLM {' and '.join(SUPPORTED_VLLM)}; this vLLM "
                f"({_vllm_version()}) has no {', '.join(_MISSING)}"
            )
        super().__init__(offloading_spec, primary_kv_view, tier_type, backpressure_detector)
        # Validated exactly as vLLM's tiers do: "LOCAL" / "REMOTE" or a ValueError.
        self.locality = Locality(locality) if locality is not None else None
        del n_read_threads, n_write_threads  # accepted for fs compatibility; not needed
        events_enabled = False
        if enable_kv_events:
            if offloading_spec.kv_events_config.enable_kv_cache_events:
                events_enabled = True
            else:
                logger.warning(
                    "enable_kv_events is set on secondary tier '%s' but KV cache events are "
                    "disabled globally; the tier will not emit events.",
                    tier_type,
                )

        short_form = {"root_dir": root_dir, "layout": layout, "capacity_bytes": capacity_bytes,
                      "cores": cores, "s3": s3, "direct_io": direct_io}
        if config is not None:
            both = sorted(k for k, v in short_form.items() if v is not None)
            if both:
                raise TypeError(
                    f"tier '{tier_type}': config replaces {', '.join(both)}: give the kvtier "
                    "config alone, or the short form without config"
                )
            cfg = load_config(config)
        else:
            layout = layout or "files"
            cores = "auto" if cores is None else cores
            direct_io = direct_io or "auto"
            if root_dir is None:
                raise TypeError(
                    f"tier '{tier_type}': give root_dir (the cache directory) or config "
                    "(a kvtier TOML path or table)"
                )
            if layout not in _LAYOUTS:
                raise ValueError(
                    f"tier '{tier_type}': layout = {layout!r}: expected one of {_LAYOUTS}"
                )
            device: dict[str, Any] = {"layout": layout}
            if layout == "slab":
                if capacity_bytes is None:
                    raise ValueError(
                        f"tier '{tier_type}': layout = 'slab' needs capacity_bytes (the size "
                        f"of {os.path.join(root_dir, _SLAB_FILE)}, e.g. '512 GiB')"
                    )
                device["path"] = os.path.join(root_dir, _SLAB_FILE)
            else:
                device["path"] = root_dir
            if capacity_bytes is not None:
                device["capacity_bytes"] = capacity_bytes
            cfg = {"cores": cores_auto(cores), "direct_io": direct_io, "devices": [device]}
            if s3 is not None:
                cfg["s3"] = dict(s3)
        cfg.setdefault("block_size", self.block_size_bytes)
        if size_bytes(cfg["block_size"]) != self.block_size_bytes:
            raise kvtier.ConfigError(
                f"config field `block_size` = {cfg['block_size']!r}: must equal vLLM's primary "
                f"row stride, {self.block_size_bytes} bytes"
            )
        devices = cfg.get("devices") or []
        files_layout = bool(devices) and devices[0].get("layout", "slab") == "files"

        # vLLM's own FileMapper for the namespace: the attribute vLLM's tools and tests use to
        # find a block's file, and the reference kvtier's directory is checked against.
        mapper_root = devices[0]["path"] if files_layout else (root_dir or "")
        self.file_mapper = FileMapper.from_offloading_spec(
            root_dir=str(mapper_root),
            offloading_spec=offloading_spec,
            blocks_per_file=offloading_spec.blocks_per_chunk,
            parallel_agnostic=True,
        )
        namespace = _namespace(offloading_spec, self.file_mapper)
        if files_layout:
            files = dict(cfg.get("files") or {})
            files.setdefault("namespace", namespace)
            cfg["files"] = files
        if "s3" in cfg:
            s3cfg = dict(cfg["s3"])
            if "namespace" not in s3cfg and not files_layout:
                s3cfg["namespace"] = namespace
            cfg["s3"] = s3cfg
        if events_enabled:
            events = dict(cfg.get("events") or {})
            events["enabled"] = True
            if self.locality is not None:
                events["locality"] = self.locality.value
            cfg["events"] = events
        elif "events" in cfg:
            cfg["events"] = {**cfg["events"], "enabled": False}
        self._events_enabled = events_enabled

        for dev in devices:
            path = str(dev.get("path", ""))
            # As vLLM's fs tier: a root that cannot be created is an OSError at construction.
            os.makedirs(path if dev.get("layout", "slab") == "files" else os.path.dirname(path)
                        or ".", exist_ok=True)

        self._engine = kvtier.Engine(cfg, primary_kv_view)
        # With deferred_release (0.34) a failed promotion is reported when it resolves; the
        # chunks go back to vLLM's pool when its event is set. Store jobs, which vLLM never
        # defers, wait here (in _held_stores) until their chunks are free.
        self._engine.set_early_results(_DEFERRED_RELEASE)
        self._held_stores: list[Any] = []
        info = self._engine.info()
        if files_layout:
            expected = f"{self.file_mapper.base_path}_r{self.file_mapper.rank}"
            got = info["devices"][0]["path"]
            if os.path.normpath(got) != os.path.normpath(expected):
                self._engine.shutdown()
                raise RuntimeError(
                    f"kvtier's files directory {got} differs from vLLM's {expected}: the "
                    "namespace was not derived as vLLM derives it (please report this)"
                )
        self._config_info = {
            "kvtier_layout": "files" if files_layout else "slab",
            "kvtier_workers": len(info["workers"]),
            "kvtier_devices": len(info["devices"]),
            "kvtier_s3": info["s3"] is not None,
        }
        self._label = (tier_type,)
        self._s3 = info["s3"] is not None
        # vLLM's event rule: one stored event per successful store job (built when its result
        # is polled), none for loads or failed stores; kvtier adds removal events for blocks
        # it evicted (not with an S3 tier behind, which still holds them). Bounded like the
        # engine's own buffer, in case the consumer stops taking them.
        self._events: collections.deque[OffloadingEvent] = collections.deque(maxlen=65536)
        # Keys of in-flight store jobs, for their stored event (only with events on).
        self._store_keys: dict[int, tuple[list[bytes], Any]] = {}
        # Load jobs in flight: their keys (in the job's order) and request id.
        self._load_jobs: dict[int, tuple[list[bytes], str | None]] = {}
        # Keys that hit since the last scheduler step (0.34: recency comes from lookups).
        self._hits: dict[bytes, None] = {}
        # Keys past a failed load's first failure (see _DOOMED_TTL_S): (request id, deadline).
        self._doomed: collections.OrderedDict[bytes, tuple[str | None, float]] = (
            collections.OrderedDict())
        # Jobs submitted and not yet reported by get_finished_jobs.
        self._pending: set[int] = set()
        # Jobs refused at submission, reported failed by the next get_finished_jobs.
        self._refused: list[JobResult] = []
        # Keys whose load failed: MISS until the deadline (or a store of the key).
        self._failed: collections.OrderedDict[bytes, float] = collections.OrderedDict()
        self._last_stats: dict[str, Any] = {}
        # Samples for the job-time histograms, until get_stats takes them (bounded: vLLM may
        # never call get_stats when its stats logging is off).
        self._job_seconds: dict[str, collections.deque[float]] = {
            "load": collections.deque(maxlen=4096),
            "store": collections.deque(maxlen=4096),
        }
        self._shut = False
        logger.info(
            "kvtier tier '%s': %s layout, %d workers, %d blocks of %d bytes, opened in %.3f s",
            tier_type,
            self._config_info["kvtier_layout"],
            len(info["workers"]),
            info["num_blocks"],
            info["block_size"],
            info["open_seconds"],
        )

    # -- the kvtier engine, for callers who want more than vLLM's interface ------------------

    @property
    def engine(self) -> kvtier.Engine:
        return self._engine

    # -- SecondaryTierManager ---------------------------------------------------------------

    def on_new_request(self, req_context: ReqContext) -> RequestOffloadingContext:
        return RequestOffloadingContext()

    def lookup(self, key: bytes, req_context: ReqContext) -> LookupResult:
        if self._shut:
            return LookupResult.MISS  # nothing can be loaded any more
        if self._doomed:
            doomed = self._doomed.get(key)
            if doomed is not None:
                if time.monotonic() < doomed[1]:
                    return LookupResult.MISS
                del self._doomed[key]
        if self._failed:
            deadline = self._failed.get(key)
            if deadline is not None:
                if time.monotonic() < deadline:
                    return LookupResult.MISS
                del self._failed[key]
        try:
            answer = self._engine.lookup((key,))[0]
        except (ValueError, TypeError) as e:  # not an offload key kvtier can hold
            logger.debug("kvtier tier '%s': lookup of %r: %s", self.tier_type, key, e)
            return LookupResult.MISS
        if answer == "miss":
            return LookupResult.MISS
        if answer == "pending":
            return LookupResult.RETRY
        if not _VLLM_TOUCHES and len(self._hits) < _HITS_PER_STEP_MAX:
            self._hits[key] = None
        return LookupResult.HIT

    def _submit(self, job: TransferJob, store: bool) -> None:
        keys = list(job.keys)
        try:
            if store:
                self._engine.submit_store(job.job_id, keys, job.chunk_ids)
            else:
                self._engine.submit_load(job.job_id, keys, job.chunk_ids)
        except (kvtier.Error, ValueError, TypeError, OverflowError) as e:
            # Never raise into vLLM: report the job failed at the next poll.
            logger.debug("kvtier tier '%s': job %s refused: %s", self.tier_type, job.job_id, e)
            self._refused.append(
                JobResult(job_id=job.job_id, success=False, transfer_time=0.0,
                          transfer_bytes=0)
            )
            return
        self._pending.add(job.job_id)
        if store and self._events_enabled:
            self._store_keys[job.job_id] = (keys, getattr(job, "req_context", None))
        if not store:
            ctx = getattr(job, "req_context", None)
            self._load_jobs[job.job_id] = (keys, getattr(ctx, "req_id", None))
        if store and (self._failed or self._doomed):
            # A key stored again is a hit again (vLLM 0.34's mark_present), for every request.
            for k in keys:
                self._failed.pop(k, None)
                self._doomed.pop(k, None)

    def submit_store(self, job_metadata: TransferJob) -> None:
        self._submit(job_metadata, store=True)

    def submit_load(self, job_metadata: TransferJob) -> None:
        self._submit(job_metadata, store=False)

    def _mark_failed(self, keys: Iterable[bytes]) -> None:
        deadline = time.monotonic() + _FAILED_KEY_TTL_S
        for k in keys:
            self._failed[k] = deadline
            self._failed.move_to_end(k)
        while len(self._failed) > _FAILED_KEYS_MAX:
            self._failed.popitem(last=False)

    def get_finished_jobs(self) -> Iterable[JobResult]:
        out, self._refused = self._refused, []
        results = self._engine.poll_finished()
        if self._held_stores:
            results = [r for r in self._held_stores if r.released] + results
            self._held_stores = [r for r in self._held_stores if not r.released]
        for r in results:
            if r.kind == "store" and not r.released:
                self._held_stores.append(r)
                continue
            self._pending.discard(r.job_id)
            self._job_seconds[r.kind].append(r.transfer_seconds)
            successful = None
            load = self._load_jobs.pop(r.job_id, None) if r.kind == "load" else None
            if r.kind == "load" and not r.success:
                # As vLLM's fs tier: the keys before the first failed one loaded and are
                # reported (None if the first failed), the failed keys stop being HITs (or the
                # scheduler would promote them again at every step, vLLM issue #49176), and
                # the keys after the first failure are misses for the request.
                failed_at = sorted(i for (i, _, _, _) in r.failures)
                first = failed_at[0] if failed_at else 0
                if load is not None and first > 0:
                    successful = tuple(load[0][:first])
                self._mark_failed(k for (_, k, _, _) in r.failures if k is not None)
                if load is not None:
                    deadline = time.monotonic() + _DOOMED_TTL_S
                    failed = set(failed_at)
                    for i, k in enumerate(load[0][first + 1:], start=first + 1):
                        if i not in failed:
                            self._doomed[k] = (load[1], deadline)
                            self._doomed.move_to_end(k)
                    while len(self._doomed) > _DOOMED_MAX:
                        self._doomed.popitem(last=False)
                logger.debug(
                    "kvtier tier '%s': load job %s failed: %s",
                    self.tier_type, r.job_id, r.failures[:3],
                )
            elif r.kind == "store":
                stored = self._store_keys.pop(r.job_id, None)
                if r.success and stored and stored[0]:
                    keys, ctx = stored
                    event = OffloadingEvent(
                        keys=keys, medium=self.medium, removed=False, locality=self.locality)
                    if _EVENT_REQ_CONTEXT:
                        event.req_context = ctx
                    self._events.append(event)
                if not r.success:
                    logger.debug(
                        "kvtier tier '%s': store job %s failed: %s",
                        self.tier_type, r.job_id, r.failures[:3],
                    )
            result = JobResult(
                job_id=r.job_id,
                success=r.success,
                successful_keys=successful,
                transfer_time=r.transfer_seconds,
                transfer_bytes=r.transfer_bytes,
            )
            if _DEFERRED_RELEASE and r.kind == "load" and r.release is not None and not r.success:
                # Only a failed promotion gets here unreleased (0.34, or after a shutdown that
                # gave up on a hung device): vLLM keeps the failed keys' chunks until it is set.
                result.deferred_release = r.release
            out.append(result)
        return out

    def has_pending_work(self) -> bool:
        # Every submitted job until get_finished_jobs has reported it.
        return bool(self._refused) or bool(self._pending)

    def take_events(self) -> Iterable[OffloadingEvent]:
        if not self._events_enabled:
            return []
        for e in self._engine.take_events():
            if e.removed and not self._s3:
                self._events.append(OffloadingEvent(
                    keys=list(e.keys), medium=self.medium, removed=True,
                    locality=self.locality))
        out = list(self._events)
        self._events.clear()
        return out

    def touch(self, keys: Collection[bytes], req_context: ReqContext) -> None:
        # Recency for eviction (LRU for files, CLOCK for the slab); queued to the workers.
        try:
            self._engine.touch(list(keys))
        except (ValueError, TypeError) as e:
            logger.debug("kvtier tier '%s': touch: %s", self.tier_type, e)

    def on_request_finished(self, req_context: ReqContext) -> None:
        # The keys its failed batch doomed are good blocks: other requests may load them.
        if self._doomed:
            req_id = getattr(req_context, "req_id", None)
            for k in [k for k, (r, _) in self._doomed.items() if r == req_id]:
                del self._doomed[k]

    @property
    def events(self) -> collections.deque[OffloadingEvent] | None:
        """The stored/removed events not taken yet; None when events are off (as vLLM's
        tiers expose it)."""
        return self._events if self._events_enabled else None

    def on_schedule_end(self, context: ScheduleEndContext) -> None:
        # Lookups answer from the index at once: the only per-step batch is the recency of the
        # keys that hit (vLLM 0.34, which no longer calls touch): one queue message a step.
        if self._hits:
            keys, self._hits = list(self._hits), {}
            self.touch(keys, None)

    def drain_jobs(self) -> None:
        # vLLM's contract: every job's result available and every deferred_release set when
        # this returns (a hung device blocks here, visibly, rather than hand back chunks it may
        # still write).
        self._engine.drain_released()

    def shutdown(self) -> None:
        # The engine's shutdown is idempotent and every caller waits for the first to finish.
        self._shut = True
        self._engine.shutdown()

    # -- metrics (vLLM's /metrics) ----------------------------------------------------------

    @classmethod
    def build_metric_definitions(
        cls, extra_config: dict[str, Any]
    ) -> dict[str, OffloadingMetricMetadata]:
        metrics: dict[str, OffloadingMetricMetadata] = {}
        for name, (doc, _) in _COUNTERS.items():
            metrics[_PREFIX + name] = OffloadingCounterMetadata(documentation=doc,
                                                                labelnames=_LABELS)
        for name, (doc, _) in _GAUGES.items():
            metrics[_PREFIX + name] = OffloadingGaugeMetadata(documentation=doc,
                                                              labelnames=_LABELS)
        for name, (doc, extra, _) in _LABELLED_COUNTERS.items():
            metrics[_PREFIX + name] = OffloadingCounterMetadata(documentation=doc,
                                                                labelnames=_LABELS + extra)
        for name, (doc, extra, _) in _LABELLED_GAUGES.items():
            metrics[_PREFIX + name] = OffloadingGaugeMetadata(documentation=doc,
                                                              labelnames=_LABELS + extra)
        for name, doc in _HISTOGRAMS.items():
            metrics[_PREFIX + name] = OffloadingHistogramMetadata(
                documentation=doc,
                labelnames=_LABELS,
                buckets=(0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5,
                         5, 10),
            )
        return metrics

    def get_stats(self) -> Any:
        from vllm.distributed.kv_transfer.kv_connector.v1.offloading.metrics import (
            OffloadingConnectorStats,
        )

        stats = OffloadingConnectorStats()
        now = self._engine.stats()
        for name, (_, field) in _COUNTERS.items():
            delta = now[field] - self._last_stats.get(field, 0)
            if delta:
                stats.increase_counter(_PREFIX + name, delta, self._label)
        for name, (_, field) in _GAUGES.items():
            stats.set_gauge(_PREFIX + name, now[field], self._label)
        for name, (_, _, read) in _LABELLED_COUNTERS.items():
            before = {labels: n for labels, n in read(self._last_stats)} if self._last_stats else {}
            for labels, n in read(now):
                delta = n - before.get(labels, 0)
                if delta:
                    stats.increase_counter(_PREFIX + name, delta, self._label + labels)
        for name, (_, _, read) in _LABELLED_GAUGES.items():
            for labels, n in read(now):
                stats.set_gauge(_PREFIX + name, n, self._label + labels)
        for kind in ("load", "store"):
            samples = self._job_seconds[kind]
            while samples:
                stats.observe_histogram(_PREFIX + f"{kind}_job_seconds", samples.popleft(),
                                        self._label)
        self._last_stats = now
        return stats

    @classmethod
    def config_info_keys(cls, tier_config: dict[str, Any]) -> tuple[str, ...]:
        return _INFO_KEYS

    def config_info(self) -> Mapping[str, str | int | float | bool]:
        return dict(self._config_info)


def _vllm_version() -> str:
    try:
        import importlib.metadata

        return importlib.metadata.version("vllm")
    except Exception:  # noqa: BLE001 - the version is for the message only
        return "version unknown"
