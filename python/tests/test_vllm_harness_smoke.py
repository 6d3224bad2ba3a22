"""Smoke tests of vllm_harness against vLLM 0.33.0's own ``fs`` tier.

Real vLLM code exercised (extracted from the wheel, unmodified): the
OffloadingConfig dataclasses and TieringOffloadingSpec, SecondaryTierFactory,
FileSystemTierManager with its pure-Python I/O (fs/io.py) and thread pool,
FsAsyncLookupManager / AsyncLookupManager, FileMapper, TieringOffloadingManager
with its CPUPrimaryTierOffloadingManager (CPUOffloadingManager + LRU policy),
TieringMetricsTracker, backpressure, OffloadingConnectorStats.

Stood in (see vllm_harness.STANDIN_REASONS): torch (import only),
vllm.logger, vllm.platforms, vllm.config, the connector Prometheus metrics
module, vllm.v1.kv_cache_interface, SharedOffloadRegion (anonymous mmap instead
of /dev/shm), the GPU worker, and vllm.v1.kv_hints without msgspec. The C
extension vllm.fs_io_C is deliberately absent, so the fs tier runs its Python
fallback. The GPU side is simulated by writing bytes straight into the primary
buffer rows that prepare_store() allocated.

Skipped only when the wheel cannot be found (see vllm_harness.find_wheel).
"""

from __future__ import annotations

import json

import numpy as np
import pytest

import vllm_harness as H

BLOCK = 256 * 1024


@pytest.fixture
def spec(vllm):
    return H.make_spec(vllm, num_blocks=8, block_bytes=BLOCK, enable_kv_cache_events=True)


def _random_rows(n: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, size=(n, BLOCK), dtype=np.uint8)


def test_loader_uses_real_modules_and_python_fallback(vllm):
    assert vllm.version == H.VLLM_VERSION and vllm.version in H.SUPPORTED_VERSIONS
    assert len(vllm.modules) >= 25
    assert vllm.num_modules >= 38
    for name, mod in vllm.modules.items():
        assert mod.__file__.startswith(vllm.root), name
        assert not getattr(mod, "__kvtier_standin__", False), name
    assert not vllm.fs_io_C_available and not vllm.fs_batch_lookup_C_available
    assert "torch" not in vllm.modules
    assert vllm.SecondaryTierFactory.get_tier_class({"type": "fs"}) is vllm.FileSystemTierManager
    # Reuse: a second call returns the same namespace.
    assert H.load_vllm() is vllm


def test_fs_tier_store_load_lookup(vllm, spec, tmp_path):
    primary = H.make_primary(8, BLOCK)
    assert primary.view.strides[0] == BLOCK
    tier = vllm.SecondaryTierFactory.create_secondary_tier(
        {"type": "fs", "root_dir": str(tmp_path), "enable_kv_events": True, "locality": "LOCAL"},
        primary.view,
        spec,
    )
    try:
        assert isinstance(tier, vllm.FileSystemTierManager)
        assert tier.tier_type == "fs" and tier.bp_detector is None
        assert tier.medium is vllm.Medium.STORAGE and tier.locality is vllm.Locality.LOCAL
        assert tier.block_size_bytes == BLOCK

        # config.json is written at the FileMapper base path with the run config.
        fm = tier.file_mapper
        assert fm.base_path.startswith(f"{tmp_path}/kvtier-test_tiny-model_")
        with open(fm.get_config_file_path()) as fh:
            assert json.load(fh) == fm.get_run_config()

        keys = [H.make_key(f"block-{i}") for i in range(3)]
        data = _random_rows(3, seed=1)
        src_rows = [1, 4, 6]
        primary.array[src_rows] = data
        ctx = vllm.ReqContext(req_id="req-store")
        tier.on_new_request(ctx)
        tier.submit_store(H.make_job(keys, src_rows, 7, ctx, is_promotion=False))
        results = H.drain(tier)
        assert [(r.job_id, r.success, r.transfer_bytes) for r in results] == [(7, True, 3 * BLOCK)]

        for key, row in zip(keys, data):
            path = fm.get_file_name(key)
            hash_hex = vllm.get_offload_block_hash(key).hex()
            assert path == f"{fm.base_path}_r0/{hash_hex[:3]}/{hash_hex[3:5]}_g0/{hash_hex}.bin"
            with open(path, "rb") as fh:
                assert fh.read() == row.tobytes()

        events = list(tier.take_events())
        assert len(events) == 1
        ev = events[0]
        assert ev.keys == keys and ev.medium is vllm.Medium.STORAGE
        assert ev.removed is False and ev.locality is vllm.Locality.LOCAL

        # Lookups: async, so RETRY first, then HIT / MISS after a step.
        missing = H.make_key("never-stored")
        lctx = vllm.ReqContext(req_id="req-lookup")
        tier.on_new_request(lctx)
        assert tier.lookup(keys[0], lctx) is vllm.LookupResult.RETRY
        assert H.lookup_and_wait(tier, keys[0], lctx) is vllm.LookupResult.HIT
        assert H.lookup_and_wait(tier, missing, lctx) is vllm.LookupResult.MISS
        for key in keys[1:]:
            assert H.lookup_and_wait(tier, key, lctx) is vllm.LookupResult.HIT

        # Load into other rows and compare.
        dst_rows = [0, 2, 7]
        primary.array[dst_rows] = 0
        tier.submit_load(H.make_job(keys, dst_rows, 8, lctx, is_promotion=True))
        results = H.drain(tier)
        assert [(r.job_id, r.success, r.successful_keys) for r in results] == [(8, True, None)]
        np.testing.assert_array_equal(primary.array[dst_rows], data)

        # A load of a missing file fails after the blocks before it loaded.
        primary.array[[3, 5]] = 0
        tier.submit_load(H.make_job([keys[2], missing], [3, 5], 9, lctx, is_promotion=True))
        (res,) = H.drain(tier)
        assert res.job_id == 9 and res.success is False
        assert res.successful_keys == (keys[2],)
        np.testing.assert_array_equal(primary.array[3], data[2])
        tier.on_request_finished(ctx)
        tier.on_request_finished(lctx)
    finally:
        tier.shutdown()


def test_fs_tier_rejects_bad_locality_and_unusable_root(vllm, spec, tmp_path):
    primary = H.make_primary(2, BLOCK)
    with pytest.raises(ValueError, match="is not a valid Locality"):
        vllm.SecondaryTierFactory.create_secondary_tier(
            {"type": "fs", "root_dir": str(tmp_path), "locality": "local"}, primary.view, spec)
    blocker = tmp_path / "a-file"
    blocker.write_bytes(b"x")
    with pytest.raises(OSError):
        vllm.SecondaryTierFactory.create_secondary_tier(
            {"type": "fs", "root_dir": str(blocker / "kv")}, primary.view, spec)


def test_orchestrator_cascade_reset_promotion(vllm, spec, tmp_path):
    orch = H.make_orchestrator(spec, [{"type": "fs", "root_dir": str(tmp_path)}], 8, BLOCK)
    mgr = orch.manager
    try:
        assert isinstance(mgr, vllm.TieringOffloadingManager)
        assert isinstance(mgr.primary_tier, vllm.CPUPrimaryTierOffloadingManager)
        (fs,) = orch.secondary_tiers
        assert isinstance(fs, vllm.FileSystemTierManager)
        assert orch.view.strides[0] == BLOCK and orch.primary.shape == (8, BLOCK)

        keys = [H.make_key(f"orch-{i}") for i in range(3)]
        data = _random_rows(3, seed=2)
        ctx = vllm.ReqContext(req_id="req-0")
        mgr.on_new_request(ctx)
        for key in keys:
            assert mgr.lookup(key, ctx) in (vllm.LookupResult.RETRY, vllm.LookupResult.MISS)

        out = mgr.prepare_store(keys, ctx)
        assert out.keys_to_store == keys and out.evicted_keys == []
        chunk_ids = [int(c) for c in out.store_spec.chunk_ids]
        orch.primary[chunk_ids] = data  # the GPU->CPU copy a worker would do
        assert mgr.lookup(keys[0], ctx) is vllm.LookupResult.HIT_PENDING
        mgr.complete_store(keys, ctx)  # cascades to the fs tier
        mgr.on_request_finished(ctx)
        orch.settle()
        assert not mgr.has_pending_work()
        for key, row in zip(keys, data):
            assert mgr.lookup(key, ctx) is vllm.LookupResult.HIT
            with open(fs.file_mapper.get_file_name(key), "rb") as fh:
                assert fh.read() == row.tobytes()
        stored = [e for e in mgr.take_events() if not e.removed]
        assert [e.keys for e in stored] == [keys] and stored[0].medium is vllm.Medium.CPU

        stats = mgr.get_stats()
        assert isinstance(stats, vllm.OffloadingConnectorStats)
        reduced = stats.reduce()
        assert reduced[f"{vllm.TieringOffloadingMetrics.WRITE_BYTES}:('1:fs',)"] == 3 * BLOCK

        # Reset the primary tier; the fs tier keeps its files.
        mgr.reset_cache()
        orch.primary[:] = 0
        ctx1 = vllm.ReqContext(req_id="req-1")
        mgr.on_new_request(ctx1)
        assert mgr.lookup(keys[0], ctx1) is vllm.LookupResult.MISS  # promotions held
        mgr.on_reset_flushed()

        # Step 1: primary MISS, fs lookup posted -> RETRY. Later step: fs HIT,
        # primary slot allocated, promotion queued -> HIT_PENDING.
        assert [mgr.lookup(k, ctx1) for k in keys] == [vllm.LookupResult.RETRY] * 3
        pending = H.lookup_all_and_wait(mgr, keys, ctx1)
        assert pending == [vllm.LookupResult.HIT_PENDING] * 3
        assert not mgr._jobs  # promotions are submitted at on_schedule_end
        assert mgr.lookup(keys[0], ctx1) is vllm.LookupResult.HIT_PENDING
        orch.step()  # _flush_pending_promotions: one batched submit_load
        (job,) = mgr._jobs.values()
        assert job.transfer_job.is_promotion and list(job.transfer_job.keys) == keys
        orch.settle()  # the load completes and complete_write() makes the chunks ready
        for key in keys:
            assert mgr.lookup(key, ctx1) is vllm.LookupResult.HIT
            assert mgr.get_load_source(key, ctx1) is vllm.CacheHitSource.DISK
        spec_out = mgr.prepare_load(keys, ctx1)
        rows = [int(c) for c in spec_out.chunk_ids]
        np.testing.assert_array_equal(orch.primary[rows], data)
        mgr.complete_load(keys, ctx1)
        mgr.on_request_finished(ctx1)
        orch.step()
    finally:
        orch.shutdown()
