"""kvtier.vllm.KvtierTierManager driven by vLLM 0.33.0's real tiering code.

Real vLLM (extracted unmodified from the 0.33.0 wheel by vllm_harness): the OffloadingConfig
dataclasses and TieringOffloadingSpec, SecondaryTierFactory (loading kvtier's class by
module_path), TieringOffloadingManager with its CPU primary tier (CPUOffloadingManager, LRU),
FileMapper, the fs tier (FileSystemTierManager, Python I/O fallback), backpressure detectors,
OffloadingConnectorStats. Stood in (vllm_harness.STANDIN_REASONS): torch (import only), vllm's
logger, platforms and config modules, the connector Prometheus module, kv_cache_interface, the
SharedOffloadRegion (an anonymous mmap instead of /dev/shm) and the GPU worker: the GPU->CPU
copy is simulated by writing bytes into the rows prepare_store() allocated.

What would break: the namespace (kvtier and vLLM would not share a directory), the zero-copy
view, job/lookup semantics the orchestrator relies on (exactly-once results, partial loads,
failed keys turning into misses), or the constructor contract (backpressure_detector, fs kwargs,
locality and root errors).
"""

from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import pytest

import vllm_harness as H

BLOCK = 256 * 1024
KVTIER = {"type": "KvtierTierManager", "module_path": "kvtier.vllm"}


@pytest.fixture(scope="module")
def tiermod(vllm):
    import kvtier.vllm

    return kvtier.vllm


@pytest.fixture
def spec(vllm):
    return H.make_spec(vllm, num_blocks=8, block_bytes=BLOCK, enable_kv_cache_events=True)


def rows(n, seed):
    return np.random.default_rng(seed).integers(0, 256, size=(n, BLOCK), dtype=np.uint8)


def make_tier(vllm, spec, primary, **kwargs):
    cfg = {**KVTIER, **({} if "config" in kwargs else {"cores": [0]}), **kwargs}
    return vllm.SecondaryTierFactory.create_secondary_tier(cfg, primary.view, spec)


def test_factory_loads_kvtier_by_module_path(vllm, tiermod, spec, tmp_path):
    primary = H.make_primary(8, BLOCK, dtype=np.int8)  # vLLM's region is int8 ('b')
    tier = vllm.SecondaryTierFactory.create_secondary_tier(
        {**KVTIER, "root_dir": str(tmp_path), "backpressure": {
            "backpressure_cls": "EMABackpressureDetector"}},
        primary.view,
        spec,
    )
    try:
        assert type(tier) is tiermod.KvtierTierManager
        assert isinstance(tier, vllm.SecondaryTierManager)
        assert isinstance(tier.bp_detector, vllm.EMABackpressureDetector)
        assert tier.medium is vllm.Medium.STORAGE
        assert tier.cache_hit_source is vllm.CacheHitSource.DISK
        assert tier.block_size_bytes == BLOCK and tier.engine.block_size == BLOCK
        # Zero-copy: the engine's region is vLLM's primary buffer itself.
        assert tier.engine.region_address == np.asarray(primary.view).ctypes.data
        assert isinstance(tier.file_mapper, vllm.FileMapper)
    finally:
        tier.shutdown()
        tier.shutdown()  # idempotent


def test_fs_entry_works_unchanged(vllm, tiermod, spec, tmp_path):
    """An existing fs entry, with only type and module_path changed."""
    primary = H.make_primary(8, BLOCK)
    entry = {"type": "fs", "root_dir": str(tmp_path), "n_read_threads": 32,
             "n_write_threads": 16, "enable_kv_events": True, "locality": "LOCAL"}
    entry.update(KVTIER)
    tier = vllm.SecondaryTierFactory.create_secondary_tier(entry, primary.view, spec)
    try:
        assert tier.locality is vllm.Locality.LOCAL
        keys = [H.make_key(f"fs-{i}") for i in range(3)]
        data = rows(3, 1)
        primary.array[[1, 4, 6]] = data
        ctx = vllm.ReqContext(req_id="r")
        tier.on_new_request(ctx)
        # A first lookup of a key kvtier does not hold is a MISS at once (no RETRY step).
        assert tier.lookup(keys[0], ctx) is vllm.LookupResult.MISS
        tier.submit_store(H.make_job(keys, [1, 4, 6], 7, ctx, is_promotion=False))
        (res,) = H.drain(tier)
        assert (res.job_id, res.success, res.transfer_bytes) == (7, True, 3 * BLOCK)
        assert not tier.has_pending_work()
        # Files where vLLM's FileMapper puts them, holding exactly the block.
        for key, row in zip(keys, data):
            with open(tier.file_mapper.get_file_name(key), "rb") as f:
                assert f.read() == row.tobytes()
            assert tier.lookup(key, ctx) is vllm.LookupResult.HIT  # HIT at once
        with open(tier.file_mapper.get_config_file_path()) as f:
            import json

            assert json.load(f) == tier.file_mapper.get_run_config()
        (ev,) = tier.take_events()
        assert isinstance(ev, vllm.OffloadingEvent)
        assert (ev.keys, ev.medium, ev.removed, ev.locality) == (
            keys, vllm.Medium.STORAGE, False, vllm.Locality.LOCAL)
        assert list(tier.take_events()) == []
        # Loads emit no event; a partial load reports the prefix.
        primary.array[:] = 0
        missing = H.make_key("never")
        tier.submit_load(H.make_job([keys[2], keys[0], missing, keys[1]], [0, 2, 3, 5], 8, ctx,
                                    is_promotion=True))
        (res,) = H.drain(tier)
        assert res.success is False and res.successful_keys == (keys[2], keys[0])
        np.testing.assert_array_equal(primary.array[0], data[2])
        np.testing.assert_array_equal(primary.array[2], data[0])
        assert list(tier.take_events()) == []
        assert tier.lookup(missing, ctx) is vllm.LookupResult.MISS
        tier.on_request_finished(ctx)
    finally:
        tier.shutdown()


def test_constructor_errors_match_vllm(vllm, spec, tmp_path):
    primary = H.make_primary(2, BLOCK)
    for bad in ("local", ""):
        with pytest.raises(ValueError, match="is not a valid Locality"):
            make_tier(vllm, spec, primary, root_dir=str(tmp_path), locality=bad)
    blocker = tmp_path / "a-file"
    blocker.write_bytes(b"x")
    with pytest.raises(OSError):
        make_tier(vllm, spec, primary, root_dir=str(blocker / "kv"))
    with pytest.raises(ValueError, match="layout = 'slab' needs capacity_bytes"):
        make_tier(vllm, spec, primary, root_dir=str(tmp_path), layout="slab")
    with pytest.raises(ValueError, match="layout = 'bogus'"):
        make_tier(vllm, spec, primary, root_dir=str(tmp_path), layout="bogus")
    with pytest.raises(TypeError, match="unexpected keyword argument 'rootdir'"):
        make_tier(vllm, spec, primary, rootdir=str(tmp_path))
    import kvtier

    with pytest.raises(kvtier.ConfigError, match="must equal vLLM's primary row stride"):
        make_tier(vllm, spec, primary, config={
            "block_size": "1 MiB", "devices": [{"path": str(tmp_path / "x"),
                                                "layout": "files"}]})
    with pytest.raises(TypeError, match="config replaces root_dir"):
        make_tier(vllm, spec, primary, root_dir=str(tmp_path), config={"devices": []})
    with pytest.raises(kvtier.ConfigError, match="ring_entries"):
        make_tier(vllm, spec, primary, config={
            "ring_entries": 3, "devices": [{"path": str(tmp_path / "x"), "layout": "files"}]})


def test_full_config_form_and_slab_layout(vllm, spec, tmp_path):
    primary = H.make_primary(8, BLOCK)
    toml_path = tmp_path / "kvtier.toml"
    toml_path.write_text(
        f'cores = [0]\n[[devices]]\npath = "{tmp_path / "kv.slab"}"\n'
        'capacity_bytes = "32 MiB"\n'
    )
    tier = make_tier(vllm, spec, primary, config=str(toml_path))
    try:
        assert tier.config_info()["kvtier_layout"] == "slab"
        keys = [H.make_key(f"slab-{i}") for i in range(4)]
        data = rows(4, 2)
        primary.array[:4] = data
        ctx = vllm.ReqContext(req_id="s")
        tier.submit_store(H.make_job(keys, [0, 1, 2, 3], 1, ctx, is_promotion=False))
        assert [r.success for r in H.drain(tier)] == [True]
        primary.array[:] = 0
        tier.submit_load(H.make_job(keys, [7, 6, 5, 4], 2, ctx, is_promotion=True))
        assert [r.success for r in H.drain(tier)] == [True]
        np.testing.assert_array_equal(primary.array[[7, 6, 5, 4]], data)
    finally:
        tier.shutdown()
    # The short form: slab in root_dir.
    tier = make_tier(vllm, spec, primary, root_dir=str(tmp_path / "short"), layout="slab",
                     capacity_bytes="32 MiB")
    try:
        assert os.path.getsize(tmp_path / "short" / "kvtier.slab") == 32 << 20
    finally:
        tier.shutdown()


def test_refused_jobs_are_reported_failed_not_raised(vllm, spec, tmp_path):
    primary = H.make_primary(8, BLOCK)
    tier = make_tier(vllm, spec, primary, enable_kv_events=True, config={
        "cores": [0], "queue_blocks_max": 2,
        "devices": [{"path": str(tmp_path / "d"), "layout": "files"}]})
    try:
        ctx = vllm.ReqContext(req_id="bp")
        keys = [H.make_key(f"bp-{i}") for i in range(3)]
        tier.submit_store(H.make_job(keys, [0, 1, 2], 1, ctx, is_promotion=False))  # too big
        tier.submit_load(H.make_job(keys[:1], [99], 2, ctx, is_promotion=True))  # bad chunk
        assert tier.has_pending_work()
        got = {r.job_id: r for r in tier.get_finished_jobs()}
        assert set(got) == {1, 2} and not got[1].success and not got[2].success
        assert list(tier.get_finished_jobs()) == []  # each job exactly once
        assert not tier.has_pending_work()
        assert list(tier.take_events()) == []  # a refused store emits nothing
        tier.submit_store(H.make_job(keys[:1], [0], 4, ctx, is_promotion=False))
        assert [r.success for r in H.drain(tier)] == [True]
        (ev,) = tier.take_events()  # one stored event per successful store job
        assert ev.keys == keys[:1] and ev.removed is False
        tier.shutdown()
        assert tier.lookup(keys[0], ctx) is vllm.LookupResult.MISS  # nothing loads any more
        tier.submit_store(H.make_job(keys[:1], [0], 3, ctx, is_promotion=False))
        (r,) = tier.get_finished_jobs()
        assert (r.job_id, r.success) == (3, False)
    finally:
        tier.shutdown()


def test_stale_hit_becomes_miss_without_livelock(vllm, spec, tmp_path):
    """A file removed behind kvtier's back: the promotion fails once, then the key is a MISS."""
    orch = H.make_orchestrator(spec, [{**KVTIER, "root_dir": str(tmp_path), "cores": [0]}],
                               8, BLOCK)
    mgr = orch.manager
    try:
        (tier,) = orch.secondary_tiers
        ctx = vllm.ReqContext(req_id="w")
        mgr.on_new_request(ctx)
        keys = [H.make_key(f"stale-{i}") for i in range(2)]
        out = mgr.prepare_store(keys, ctx)
        orch.primary[[int(c) for c in out.store_spec.chunk_ids]] = rows(2, 3)
        mgr.complete_store(keys, ctx)
        mgr.on_request_finished(ctx)
        orch.settle()
        mgr.reset_cache()
        mgr.on_reset_flushed()
        os.remove(tier.file_mapper.get_file_name(keys[1]))

        loads = []
        real_submit_load = tier.submit_load

        def counting_submit_load(job):
            loads.append(list(job.keys))
            real_submit_load(job)

        tier.submit_load = counting_submit_load
        ctx1 = vllm.ReqContext(req_id="r1")
        mgr.on_new_request(ctx1)
        # kvtier answers from its index: HIT (a promotion starts) for both, at once.
        assert [mgr.lookup(k, ctx1) for k in keys] == [vllm.LookupResult.HIT_PENDING] * 2
        orch.step()
        orch.settle()
        assert loads == [keys]
        # The first key loaded; the removed one failed and is now a MISS, in every request.
        assert mgr.lookup(keys[0], ctx1) is vllm.LookupResult.HIT
        for _ in range(5):
            assert mgr.lookup(keys[1], ctx1) is vllm.LookupResult.MISS
            orch.step()
        ctx2 = vllm.ReqContext(req_id="r2")
        mgr.on_new_request(ctx2)
        assert mgr.lookup(keys[1], ctx2) is vllm.LookupResult.MISS
        orch.settle()
        assert loads == [keys]  # no second promotion of the doomed key
        assert tier.engine.stats()["load_misses"] == 1
    finally:
        orch.shutdown()


def test_orchestrator_cascade_and_promotion(vllm, spec, tmp_path):
    orch = H.make_orchestrator(spec, [{**KVTIER, "root_dir": str(tmp_path), "cores": [0],
                                       "enable_kv_events": True}], 8, BLOCK)
    mgr = orch.manager
    try:
        (tier,) = orch.secondary_tiers
        keys = [H.make_key(f"orch-{i}") for i in range(3)]
        data = rows(3, 4)
        ctx = vllm.ReqContext(req_id="req-0")
        mgr.on_new_request(ctx)
        out = mgr.prepare_store(keys, ctx)
        orch.primary[[int(c) for c in out.store_spec.chunk_ids]] = data
        mgr.complete_store(keys, ctx)  # cascades into kvtier
        mgr.on_request_finished(ctx)
        orch.settle()
        for key, row in zip(keys, data):
            with open(tier.file_mapper.get_file_name(key), "rb") as f:
                assert f.read() == row.tobytes()
        storage = [e for e in mgr.take_events() if e.medium is vllm.Medium.STORAGE]
        assert [e.keys for e in storage] == [keys]

        mgr.reset_cache()
        orch.primary[:] = 0
        mgr.on_reset_flushed()
        ctx1 = vllm.ReqContext(req_id="req-1")
        mgr.on_new_request(ctx1)
        assert [mgr.lookup(k, ctx1) for k in keys] == [vllm.LookupResult.HIT_PENDING] * 3
        orch.step()
        (job,) = mgr._jobs.values()
        assert job.transfer_job.is_promotion and list(job.transfer_job.keys) == keys
        orch.settle()
        for key in keys:
            assert mgr.lookup(key, ctx1) is vllm.LookupResult.HIT
            assert mgr.get_load_source(key, ctx1) is vllm.CacheHitSource.DISK
        spec_out = mgr.prepare_load(keys, ctx1)
        np.testing.assert_array_equal(orch.primary[[int(c) for c in spec_out.chunk_ids]], data)
        mgr.complete_load(keys, ctx1)
        mgr.on_request_finished(ctx1)

        # kvtier's figures reach vLLM's stats payload, labelled with the tier type.
        stats = mgr.get_stats()
        reduced = stats.reduce()
        label = ("KvtierTierManager",)
        assert reduced[f"vllm:kv_offload_kvtier_stored_bytes:{label}"] == 3 * BLOCK
        assert reduced[f"vllm:kv_offload_kvtier_loaded_bytes:{label}"] == 3 * BLOCK
        assert reduced[f"vllm:kv_offload_kvtier_blocks_stored:{label}"] == 3
        assert reduced[f"vllm:kv_offload_kvtier_store_job_seconds:{label}_count"] == 1
        # Labelled families: the tier label first, then kvtier's own labels.
        used = {k: v for k, v in reduced.items()
                if k.startswith("vllm:kv_offload_kvtier_device_used_bytes:")}
        assert list(used.values()) == [3 * BLOCK], used
        assert reduced["vllm:kv_offload_kvtier_lookups:('KvtierTierManager', 'hit_nvme')"] >= 3
        assert reduced["vllm:kv_offload_kvtier_queued_blocks:('KvtierTierManager', 'store')"] == 0
        assert not any(k.startswith("vllm:kv_offload_kvtier_s3_") for k in reduced)
        assert "vllm:kv_offload_kvtier_s3_requests" in type(tier).build_metric_definitions({})
        # Rendered the way vLLM's OffloadPromMetrics does (one prometheus_client metric per
        # definition, labels = vLLM's engine labels + the definition's), the payload is valid
        # Prometheus text with kvtier's labels in place.
        text = _render_like_vllm(type(tier).build_metric_definitions({}), stats)
        from prometheus_client.parser import text_string_to_metric_families
        fams = {f.name: f for f in text_string_to_metric_families(text)}
        (s,) = [s for s in fams["vllm:kv_offload_kvtier_device_used_bytes"].samples]
        assert s.labels["engine"] == "0" and s.labels["tier"] == "KvtierTierManager"
        assert s.labels["device"] and s.value == 3 * BLOCK
        # A second payload carries only what moved since (counters are deltas).
        again = mgr.get_stats().reduce()
        assert "vllm:kv_offload_kvtier_lookups:('KvtierTierManager', 'hit_nvme')" not in again
        defs = type(tier).build_metric_definitions({})
        assert set(k for k in reduced if k.startswith("vllm:kv_offload_kvtier_")) and all(
            k.split(":(")[0].removesuffix("_count").removesuffix("_sum") in defs
            for k in reduced if k.startswith("vllm:kv_offload_kvtier_"))
        infos = mgr.config_info()
        assert infos[1]["kvtier_layout"] == "files" and infos[1]["kvtier_workers"] == 1
        assert set(type(tier).config_info_keys({})) <= set(infos[1])
    finally:
        orch.shutdown()


def _render_like_vllm(defs, stats):
    """vLLM's OffloadPromMetrics.observe, on a registry of its own: checks each payload entry
    has as many label values as its definition has label names (vLLM asserts it), and returns
    the Prometheus text."""
    import prometheus_client as pc

    registry = pc.CollectorRegistry()
    made = {}
    for name, md in defs.items():
        kind = type(md).__name__
        labels = ["engine", *md.labelnames]
        if kind == "OffloadingCounterMetadata":
            made[name] = pc.Counter(name, md.documentation, labels, registry=registry)
        elif kind == "OffloadingGaugeMetadata":
            made[name] = pc.Gauge(name, md.documentation, labels, registry=registry)
        else:
            made[name] = pc.Histogram(name, md.documentation, labels, registry=registry,
                                      buckets=md.buckets)
    types, values = stats.metric_sections()
    for name, by_labels in values.items():
        if not name.startswith("vllm:kv_offload_kvtier_"):
            continue  # the manager's and the CPU tier's own
        for labelvalues, value in by_labels.items():
            assert len(labelvalues) == len(defs[name].labelnames), (name, labelvalues)
            m = made[name].labels("0", *labelvalues)
            if types[name] == "counter":
                m.inc(value)
            elif types[name] == "gauge":
                m.set(value)
            else:
                for v in value:
                    m.observe(v)
    return pc.generate_latest(registry).decode()


def _store_rows(vllm, tier, primary, keys, data, job_id):
    primary.array[: len(keys)] = data
    ctx = vllm.ReqContext(req_id=f"s{job_id}")
    tier.submit_store(H.make_job(keys, list(range(len(keys))), job_id, ctx, is_promotion=False))
    assert [r.success for r in H.drain(tier)] == [True]


def _load_rows(vllm, tier, primary, keys, job_id):
    primary.array[:] = 0
    ctx = vllm.ReqContext(req_id=f"l{job_id}")
    tier.submit_load(H.make_job(keys, list(range(len(keys))), job_id, ctx, is_promotion=True))
    assert [(r.success, r.successful_keys) for r in H.drain(tier)] == [(True, None)]
    return primary.array[: len(keys)].copy()


@pytest.mark.parametrize("writer", ["vllm", "kvtier"])
def test_directory_shared_with_vllm_fs_tier(vllm, spec, tmp_path, writer):
    """A directory written by vLLM's own fs tier is read by kvtier byte for byte, and back."""
    primary = H.make_primary(8, BLOCK)
    keys = [H.make_key(f"shared-{writer}-{i}", group_idx=i % 2) for i in range(5)]
    data = rows(5, 5)
    fs_entry = {"type": "fs", "root_dir": str(tmp_path)}
    kv_entry = {**KVTIER, "root_dir": str(tmp_path), "cores": [0]}
    first, second = (fs_entry, kv_entry) if writer == "vllm" else (kv_entry, fs_entry)
    a = vllm.SecondaryTierFactory.create_secondary_tier(first, primary.view, spec)
    try:
        _store_rows(vllm, a, primary, keys, data, 1)
    finally:
        a.shutdown()
    b = vllm.SecondaryTierFactory.create_secondary_tier(second, primary.view, spec)
    try:
        assert b.file_mapper.base_path == a.file_mapper.base_path
        ctx = vllm.ReqContext(req_id="check")
        b.on_new_request(ctx)
        assert all(H.lookup_and_wait(b, k, ctx) is vllm.LookupResult.HIT for k in keys)
        np.testing.assert_array_equal(_load_rows(vllm, b, primary, keys, 2), data)
        b.on_request_finished(ctx)
    finally:
        b.shutdown()


def test_namespace_matches_vllm_for_parallel_variants(vllm, tmp_path):
    """kvtier checks its directory against vLLM's FileMapper at construction; these specs
    exercise the agnostic, replicated and canonical rules."""
    variants = [
        dict(tp_size=2, world_size=2),
        dict(tp_size=2, world_size=2, is_parallelism_agnostic=True),
        dict(tp_size=2, world_size=2, replicated_layout=True),
        dict(canonical_layout=True),
        dict(blocks_per_chunk=2),
        dict(model_name="org/Model-7B", dtype="float16"),
    ]
    seen = set()
    for i, kw in enumerate(variants):
        try:
            spec = H.make_spec(vllm, num_blocks=4, block_bytes=BLOCK, **kw)
        except TypeError as e:  # a variant the harness cannot build
            pytest.fail(f"{kw}: {e}")
        primary = H.make_primary(4, BLOCK)
        tier = make_tier(vllm, spec, primary, root_dir=str(tmp_path))
        try:
            path = tier.engine.info()["devices"][0]["path"]
            assert path == f"{tier.file_mapper.base_path}_r{tier.file_mapper.rank}", kw
            seen.add(path)
        finally:
            tier.shutdown()
    assert len(seen) == len(variants)  # every variant is its own namespace


def test_import_without_vllm_is_a_clear_error(tmp_path):
    code = (
        "import kvtier\n"
        "try:\n"
        "    import kvtier.vllm\n"
        "except ImportError as e:\n"
        "    print('IMPORTERROR', e)\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env,
                         cwd=tmp_path, check=True)
    try:
        import importlib.util

        has_vllm = importlib.util.find_spec("vllm") is not None and "harness" not in str(
            importlib.util.find_spec("vllm").origin)
    except (ImportError, ValueError):
        has_vllm = False
    if has_vllm:
        pytest.skip("a real vLLM is installed in this interpreter")
    assert "IMPORTERROR kvtier.vllm needs vLLM 0.33.0 or 0.34.0 (pip install vllm==0.34.0)" in out.stdout


@pytest.mark.parametrize("refresh", ["touch", "lookup", "none"])
def test_touch_keeps_blocks_from_eviction(vllm, tiermod, spec, tmp_path, refresh):
    """A capacity-bound files directory evicts least recently used blocks; vLLM 0.33's touch
    (for chunks it served from the CPU tier) makes the touched ones recent, and on 0.34, which
    has no touch, a lookup that hits does (flushed at the step's end). Without either, the
    oldest block is the one evicted (the control run)."""
    touched = refresh == "touch" or (refresh == "lookup" and not tiermod._VLLM_TOUCHES)
    primary = H.make_primary(8, BLOCK)
    capacity = 16 << 20  # 64 blocks of 256 KiB
    tier = make_tier(vllm, spec, primary, root_dir=str(tmp_path), capacity_bytes=capacity,
                     enable_kv_events=True, locality="LOCAL")
    try:
        n = capacity // BLOCK
        keys = [H.make_key(f"lru-{i}") for i in range(n + 1)]
        ctx = vllm.ReqContext(req_id="lru")
        # keys[0] and keys[1] alone, in that order, so they are strictly the two oldest;
        # the rest in jobs of 8 (completion order within a job is the device's).
        batches = [keys[:1], keys[1:2]] + [keys[j:min(j + 8, n)] for j in range(2, n, 8)]
        for j, batch in enumerate(batches):
            tier.submit_store(H.make_job(batch, list(range(len(batch))), j, ctx,
                                         is_promotion=False))
            assert [r.success for r in H.drain(tier)] == [True]
        assert tier.engine.stats()["evictions"] == 0
        if refresh == "touch":
            tier.touch(keys[:2], ctx)
        elif refresh == "lookup":
            assert [tier.lookup(k, ctx) for k in keys[:2]] == [vllm.LookupResult.HIT] * 2
            H.step(tier)
        tier.submit_store(H.make_job(keys[n:], [0], 1000, ctx, is_promotion=False))
        assert [r.success for r in H.drain(tier)] == [True]
        assert tier.engine.stats()["evictions"] >= 1
        first_two = [tier.lookup(k, ctx) for k in keys[:2]]
        if touched:
            assert first_two == [vllm.LookupResult.HIT] * 2
            assert vllm.LookupResult.MISS in [tier.lookup(k, ctx) for k in keys[2:10]]
        else:
            assert first_two == [vllm.LookupResult.MISS] * 2
        assert tier.lookup(keys[n], ctx) is vllm.LookupResult.HIT
        # Evictions are reported as vLLM removal events, with the tier's medium and locality.
        removed = [e for e in tier.take_events() if e.removed]
        assert removed and all(e.medium is vllm.Medium.STORAGE and
                               e.locality is vllm.Locality.LOCAL for e in removed)
        gone = {k for e in removed for k in e.keys}
        assert gone and all(tier.lookup(k, ctx) is vllm.LookupResult.MISS for k in gone)
        # Only the oldest go: the two single-key jobs (unless touched) and the first batch.
        assert gone <= set(keys[:10])
        assert not gone & set(keys[:2]) if touched else set(keys[:2]) <= gone
    finally:
        tier.shutdown()


def _s3s_fs() -> str | None:
    import shutil

    return os.environ.get("KVTIER_S3S_FS") or shutil.which("s3s-fs") or next(
        (p for p in [os.path.expanduser("~/.cargo/bin/s3s-fs")] if os.path.isfile(p)), None)


@pytest.fixture
def s3_server(tmp_path):
    """A local S3 server (s3s-fs, what the Rust S3 tests use) with bucket kvtier-test."""
    import socket
    import time

    binary = _s3s_fs()
    if binary is None:
        pytest.skip("s3s-fs is not installed (tools/test.sh installs it)")
    root = tmp_path / "s3"
    (root / "kvtier-test").mkdir(parents=True)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen(
        [binary, "--host", "127.0.0.1", "--port", str(port), "--access-key", "kvtier-test",
         "--secret-key", "kvtier-test-secret", str(root)],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 20
    while True:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=0.2).close()
            break
        except OSError:
            assert time.monotonic() < deadline, "s3s-fs did not start"
            time.sleep(0.02)
    try:
        yield {"bucket": "kvtier-test", "endpoint": f"http://127.0.0.1:{port}",
               "force_path_style": True, "access_key_id": "kvtier-test",
               "secret_access_key": "kvtier-test-secret", "timeout_ms": 2000, "retries": 1}, root
    finally:
        proc.kill()
        proc.wait()


def test_s3_tier_uses_vllm_object_names_and_serves_another_node(vllm, spec, tmp_path, s3_server):
    """The obj-tier drop-in: kvtier writes through to S3 under the names vLLM's object-store
    tier uses for prefix "kv" (kvtier's prefix "kv/"), and a second node with an empty local
    directory finds the blocks there: RETRY while the HEAD runs, then HIT, then the bytes."""
    s3, root = s3_server
    s3 = {**s3, "prefix": "kv/", "write": "through"}
    primary = H.make_primary(8, BLOCK)
    keys = [H.make_key(f"s3-{i}") for i in range(3)]
    data = rows(3, 7)
    a = make_tier(vllm, spec, primary, root_dir=str(tmp_path / "node-a"), s3=s3)
    try:
        # vLLM's obj tier names objects with FileMapper(root_dir=prefix + "/").
        vllm_obj = vllm.FileMapper.from_offloading_spec(
            "kv/", spec, blocks_per_file=spec.blocks_per_chunk, parallel_agnostic=True)
        for k in keys:
            assert a.engine.s3_object_name(k) == vllm_obj.get_file_name(k)
        _store_rows(vllm, a, primary, keys, data, 1)
        for k, row in zip(keys, data):
            # s3s-fs keeps an object as a file under <root>/<bucket>/<name>.
            obj = root / "kvtier-test" / vllm_obj.get_file_name(k).lstrip("/")
            assert obj.read_bytes() == row.tobytes()
    finally:
        a.shutdown()
    b = make_tier(vllm, spec, primary, root_dir=str(tmp_path / "node-b"), s3=s3)
    try:
        ctx = vllm.ReqContext(req_id="b")
        assert b.lookup(keys[0], ctx) is vllm.LookupResult.RETRY  # a HEAD is under way
        assert all(H.lookup_and_wait(b, k, ctx) is vllm.LookupResult.HIT for k in keys)
        assert b.lookup(H.make_key("nowhere"), ctx) is vllm.LookupResult.RETRY
        assert H.lookup_and_wait(b, H.make_key("nowhere"), ctx) is vllm.LookupResult.MISS
        np.testing.assert_array_equal(_load_rows(vllm, b, primary, keys, 2), data)
        assert b.engine.stats()["s3"]["get"]["bytes"] == 3 * BLOCK
    finally:
        b.shutdown()


def test_directory_shared_with_vllm_fs_tier_c_path(tmp_path):
    """The same exchange with vLLM's production I/O path, its C extension fs_io_C (loaded in a
    child process, with empty stand-ins for the torch/CUDA libraries it links but never calls:
    vllm_harness, KVTIER_VLLM_FS_IO_C=1)."""
    import shutil

    if shutil.which("gcc") is None:
        pytest.skip("gcc is needed to build the stand-in libraries for vLLM's fs_io_C")
    here = os.path.dirname(os.path.abspath(__file__))
    code = f'''
import sys, numpy as np
sys.path.insert(0, {here!r})
import vllm_harness as H
import test_vllm_tier as T
vllm = H.load_vllm()
assert vllm.fs_io_C_available and vllm.fs_batch_lookup_C_available
import kvtier.vllm
spec = H.make_spec(vllm, num_blocks=8, block_bytes=T.BLOCK)
for writer in ("vllm", "kvtier"):
    primary = H.make_primary(8, T.BLOCK)
    keys = [H.make_key(f"c-{{writer}}-{{i}}") for i in range(5)]
    data = T.rows(5, 11)
    root = {str(tmp_path)!r} + "/" + writer
    fs = {{"type": "fs", "root_dir": root}}
    kv = {{**T.KVTIER, "root_dir": root, "cores": [0]}}
    first, second = (fs, kv) if writer == "vllm" else (kv, fs)
    a = vllm.SecondaryTierFactory.create_secondary_tier(first, primary.view, spec)
    T._store_rows(vllm, a, primary, keys, data, 1)
    a.shutdown()
    b = vllm.SecondaryTierFactory.create_secondary_tier(second, primary.view, spec)
    ctx = vllm.ReqContext(req_id="c")
    assert all(H.lookup_and_wait(b, k, ctx) is vllm.LookupResult.HIT for k in keys)
    np.testing.assert_array_equal(T._load_rows(vllm, b, primary, keys, 2), data)
    b.shutdown()
print("EXCHANGED")
'''
    env = {**os.environ, "KVTIER_VLLM_FS_IO_C": "1"}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env,
                         cwd=here, timeout=120)
    assert "EXCHANGED" in out.stdout, out.stdout + out.stderr[-3000:]


@pytest.mark.parametrize("bad", [0, 2])
def test_batched_load_failure_follows_vllm_fs_tier(vllm, spec, tmp_path, bad):
    """vLLM's fs tier rule for a batched promotion (its test_batched_load_first_block_fails_
    marks_whole_batch and test_batched_partial_load_failure_keeps_loaded_blocks): a failed
    first block reports no successful keys and makes the whole batch a miss for that request
    (nothing of its prefix loaded: promoting the rest again would be wasted); a failed later
    block reports the keys that loaded, which stay hits. Another request still finds the good
    blocks."""
    primary = H.make_primary(8, BLOCK)
    tier = make_tier(vllm, spec, primary, root_dir=str(tmp_path))
    try:
        keys = [H.make_key(f"batch-{bad}-{i}") for i in range(3)]
        _store_rows(vllm, tier, primary, keys, rows(3, 11), 1)
        with open(tier.file_mapper.get_file_name(keys[bad]), "wb") as f:
            f.write(b"x" * 10)  # a short file: its load fails
        ctx = vllm.ReqContext(req_id=f"batch-{bad}")
        assert [tier.lookup(k, ctx) for k in keys] == [vllm.LookupResult.HIT] * 3
        tier.submit_load(H.make_job(keys, [0, 1, 2], 2, ctx, is_promotion=True))
        (r,) = H.drain(tier)
        assert not r.success
        miss, hit = vllm.LookupResult.MISS, vllm.LookupResult.HIT
        if bad == 0:
            assert r.successful_keys is None
            assert [tier.lookup(k, ctx) for k in keys] == [miss] * 3
        else:
            assert set(r.successful_keys) == {keys[0], keys[1]}
            assert [tier.lookup(k, ctx) for k in keys] == [hit, hit, miss]
        # The request ends: another one finds the good blocks; the bad one stays a miss.
        tier.on_request_finished(ctx)
        fresh = vllm.ReqContext(req_id=f"fresh-{bad}")
        want = [hit] * 3
        want[bad] = miss
        assert [tier.lookup(k, fresh) for k in keys] == want
        # Stored again (its file rewritten), the bad key is a hit at once (0.34's mark_present).
        _store_rows(vllm, tier, primary, [keys[bad]], rows(1, 14), 3)
        assert tier.lookup(keys[bad], fresh) is hit
    finally:
        tier.shutdown()


def test_stored_event_names_the_store_request(vllm, tiermod, spec, tmp_path):
    """vLLM 0.34 gave OffloadingEvent a req_context: a stored event carries the store job's
    (as vLLM's fs tier does); on 0.33 the event has no such field."""
    primary = H.make_primary(8, BLOCK)
    tier = make_tier(vllm, spec, primary, root_dir=str(tmp_path), enable_kv_events=True)
    try:
        keys = [H.make_key(f"event-{i}") for i in range(2)]
        _store_rows(vllm, tier, primary, keys, rows(2, 12), 1)
        (event,) = [e for e in tier.take_events() if not e.removed]
        assert list(event.keys) == keys
        if tiermod._EVENT_REQ_CONTEXT:
            assert event.req_context is not None and event.req_context.req_id == "s1"
        else:
            assert not hasattr(event, "req_context")
    finally:
        tier.shutdown()


@pytest.mark.parametrize("tier_flag,global_flag", [(False, True), (True, False), (False, False)])
def test_events_off_without_both_switches(vllm, tiermod, tmp_path, tier_flag, global_flag):
    """Events need the tier's enable_kv_events and vLLM's global KV events switch (as vLLM's
    tiers: its test_events_disabled_by_default, test_events_require_global_kv_events_flag):
    otherwise `events` is None and a store emits nothing."""
    spec = H.make_spec(vllm, num_blocks=8, block_bytes=BLOCK, enable_kv_cache_events=global_flag)
    primary = H.make_primary(8, BLOCK)
    tier = make_tier(vllm, spec, primary, root_dir=str(tmp_path), enable_kv_events=tier_flag)
    try:
        assert tier.events is None
        _store_rows(vllm, tier, primary, [H.make_key("quiet")], rows(1, 13), 1)
        assert list(tier.take_events()) == []
    finally:
        tier.shutdown()


def test_an_unknown_tier_api_is_refused_naming_the_versions(vllm, tiermod, spec, tmp_path,
                                                             monkeypatch):
    """A vLLM whose tier API lacks what kvtier uses (an older or a later one) is refused when
    the tier is built, with the supported versions named, not deep inside a job."""
    monkeypatch.setattr(tiermod, "_MISSING", ["TransferJob.req_context"])
    primary = H.make_primary(8, BLOCK)
    with pytest.raises(RuntimeError, match=r"supports vLLM 0\.33\.0 and 0\.34\.0.*"
                                           r"has no TransferJob\.req_context"):
        make_tier(vllm, spec, primary, root_dir=str(tmp_path))
    # The versions this harness runs have everything.
    monkeypatch.undo()
    assert tiermod._MISSING == []
