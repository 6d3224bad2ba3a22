"""kvtier's SGLang HiCache backend (``kvtier.sglang``) on SGLang's real storage code.

SGLang's ``StorageBackendFactory`` loads the class from the ``dynamic`` extra config and the
pages live in SGLang's real host pools (``MHATokenToKVPoolHost``, ``MLATokenToKVPoolHost``:
their ``init_kv_buffer``, ``get_page_buffer_meta``, ``get_data_page``); see
``sglang_harness.py`` for what is stood in and why. Bytes are compared through the pool's own
``get_data_page``.
"""

from __future__ import annotations

import glob
import os
import subprocess
import sys
import threading
import time

import pytest

import kvtier
import sglang_harness as H


@pytest.fixture(scope="module")
def sgl():
    try:
        return H.load_sglang()
    except H.WheelNotFoundError as exc:
        if os.environ.get("CI") == "true":
            raise
        pytest.skip(str(exc))


def extra(root, **kw):
    e = {"backend_name": "kvtier", "module_path": "kvtier.sglang",
         "class_name": "KvtierHiCacheStorage", "interface_v1": 1, "root_dir": str(root)}
    e.update(kw)
    return {k: v for k, v in e.items() if v is not None}


def keys_for(n, start=0):
    return ["%064x" % (0xC0FFEE00 + i) for i in range(start, start + n)]


LAYOUTS = [
    pytest.param(dict(layout="page_first"), id="mha-page_first"),
    pytest.param(dict(layout="layer_first"), id="mha-layer_first"),
    pytest.param(dict(layout="page_first_direct"), id="mha-page_first_direct"),
    pytest.param(dict(layout="page_head"), id="mha-page_head"),
    pytest.param(dict(layout="page_first", mla=True, head_dim=128), id="mla-page_first"),
]


@pytest.mark.parametrize("store_layout", ["files", "slab"])
@pytest.mark.parametrize("geometry", LAYOUTS)
def test_pages_round_trip_into_other_host_indices(sgl, tmp_path, geometry, store_layout):
    pool = H.make_host_pool(sgl, page_num=16, **geometry)
    cap = "64 MiB" if store_layout == "slab" else None
    cfg = H.storage_config(sgl, extra(tmp_path, layout=store_layout, capacity_bytes=cap),
                           mla=geometry.get("mla", False))
    backend = H.attach(sgl, cfg, pool)
    try:
        assert type(backend).__name__ == "KvtierHiCacheStorage"
        H.fill_pages(pool, [1, 2, 3, 4], seed=11)
        keys = keys_for(4)
        src = [H.page_bytes(pool, p * pool.page_size) for p in (1, 2, 3, 4)]
        assert backend.batch_set_v1(keys, H.indices(pool, [1, 2, 3, 4])) == [True] * 4
        assert backend.batch_exists(keys) == 4
        # Into other pages, in another order; the pages around them stay as they were.
        before = H.page_bytes(pool, 9 * pool.page_size)
        assert backend.batch_get_v1(keys[::-1], H.indices(pool, [13, 12, 11, 10])) == [True] * 4
        got = [H.page_bytes(pool, p * pool.page_size) for p in (10, 11, 12, 13)]
        assert got == src
        assert H.page_bytes(pool, 9 * pool.page_size) == before
    finally:
        backend.close()


def test_batch_exists_is_the_leading_run_of_whole_pages(sgl, tmp_path):
    pool = H.make_host_pool(sgl, layout="page_first")
    backend = H.attach(sgl, H.storage_config(sgl, extra(tmp_path)), pool)
    try:
        H.fill_pages(pool, [0, 1, 2], seed=3)
        k = keys_for(5)
        assert backend.batch_set_v1([k[0], k[1], k[3]], H.indices(pool, [0, 1, 2])) == [True] * 3
        assert backend.batch_exists(k) == 2
        assert backend.batch_exists(k[3:]) == 1
        assert backend.batch_exists([k[2]] + k[:2]) == 0
        assert backend.batch_exists([]) == 0
        assert backend.exists(k[1]) and not backend.exists(k[4])
        # A page with one part missing is not a hit: the key with only its K half held.
        backend.engine.submit_store(99999, [H_key(k[4], 0)], [0])
        backend.engine.drain()
        assert backend.batch_exists([k[4]]) == 0
        assert backend.batch_get_v1([k[4]], H.indices(pool, [5])) == [False]
    finally:
        backend.close()


def H_key(key, part):
    return bytes.fromhex(key) + part.to_bytes(4, "big")


@pytest.mark.parametrize("store_layout", ["files", "slab"])
def test_a_restarted_backend_serves_the_pages_again(sgl, tmp_path, store_layout):
    cap = "64 MiB" if store_layout == "slab" else None
    cfg = H.storage_config(sgl, extra(tmp_path, layout=store_layout, capacity_bytes=cap))
    pool = H.make_host_pool(sgl, layout="page_first")
    first = H.attach(sgl, cfg, pool)
    H.fill_pages(pool, [0, 1, 2], seed=5)
    src = [H.page_bytes(pool, p * pool.page_size) for p in (0, 1, 2)]
    keys = keys_for(3, start=100)
    assert first.batch_set_v1(keys, H.indices(pool, [0, 1, 2])) == [True] * 3
    first.close()
    pool2 = H.make_host_pool(sgl, layout="page_first")
    second = H.attach(sgl, cfg, pool2)
    try:
        assert second.batch_exists(keys) == 3
        assert second.batch_get_v1(keys, H.indices(pool2, [7, 8, 9])) == [True] * 3
        assert [H.page_bytes(pool2, p * pool2.page_size) for p in (7, 8, 9)] == src
    finally:
        second.close()


def test_another_layout_or_geometry_does_not_see_the_pages(sgl, tmp_path):
    """The directory names the layout and the page geometry: a page_first page is not read
    into a layer_first pool (its bytes would be in another order)."""
    pool = H.make_host_pool(sgl, layout="page_first")
    a = H.attach(sgl, H.storage_config(sgl, extra(tmp_path)), pool)
    H.fill_pages(pool, [0], seed=1)
    assert a.batch_set_v1(keys_for(1), H.indices(pool, [0])) == [True]
    a.close()
    for geometry in (dict(layout="layer_first"), dict(layout="page_first", head_num=4)):
        other = H.make_host_pool(sgl, **geometry)
        b = H.attach(sgl, H.storage_config(sgl, extra(tmp_path)), other)
        try:
            assert b.batch_exists(keys_for(1)) == 0
        finally:
            b.close()


def test_tp_ranks_keep_mha_pages_apart_and_share_mla_pages(sgl, tmp_path):
    keys = keys_for(2, start=7)
    # MHA: each rank holds its own heads; rank 1 does not see rank 0's pages.
    pool0 = H.make_host_pool(sgl, layout="page_first")
    r0 = H.attach(sgl, H.storage_config(sgl, extra(tmp_path), tp_rank=0, tp_size=2), pool0)
    pool1 = H.make_host_pool(sgl, layout="page_first")
    r1 = H.attach(sgl, H.storage_config(sgl, extra(tmp_path), tp_rank=1, tp_size=2), pool1)
    try:
        H.fill_pages(pool0, [0, 1], seed=8)
        assert r0.batch_set_v1(keys, H.indices(pool0, [0, 1])) == [True, True]
        assert r0.batch_exists(keys) == 2
        assert r1.batch_exists(keys) == 0
    finally:
        r0.close()
        r1.close()
    # MLA: one writer (rank 0); rank 1 reports its set done without writing, and reads rank 0's.
    m0 = H.make_host_pool(sgl, mla=True, layout="page_first", head_dim=128)
    w = H.attach(sgl, H.storage_config(sgl, extra(tmp_path), tp_rank=0, tp_size=2, mla=True), m0)
    m1 = H.make_host_pool(sgl, mla=True, layout="page_first", head_dim=128)
    r = H.attach(sgl, H.storage_config(sgl, extra(tmp_path), tp_rank=1, tp_size=2, mla=True), m1)
    try:
        H.fill_pages(m1, [0, 1], seed=9)
        assert r.batch_set_v1(keys, H.indices(m1, [0, 1])) == [True, True]
        assert r.engine.stats()["stores_ok"] == 0
        assert r.batch_exists(keys) == 0  # nothing written by the reader
        H.fill_pages(m0, [2, 3], seed=10)
        src = [H.page_bytes(m0, p * m0.page_size) for p in (2, 3)]
        assert w.batch_set_v1(keys, H.indices(m0, [2, 3])) == [True, True]
        # Found on disk: the reader's "absent" above is kept for 100 ms, then asked again.
        deadline = time.monotonic() + 5
        while r.batch_exists(keys) != 2 and time.monotonic() < deadline:
            time.sleep(0.02)
        assert r.batch_exists(keys) == 2
        assert r.batch_get_v1(keys, H.indices(m1, [5, 6])) == [True, True]
        assert [H.page_bytes(m1, p * m1.page_size) for p in (5, 6)] == src
    finally:
        w.close()
        r.close()


def test_a_damaged_or_lost_page_is_a_miss_never_wrong_bytes(sgl, tmp_path):
    pool = H.make_host_pool(sgl, layout="page_first")
    backend = H.attach(sgl, H.storage_config(sgl, extra(tmp_path)), pool)
    try:
        H.fill_pages(pool, [0, 1, 2], seed=12)
        keys = keys_for(3, start=50)
        assert backend.batch_set_v1(keys, H.indices(pool, [0, 1, 2])) == [True] * 3
        # Page 1: its V half's file has a flipped byte (its crc32c no longer matches).
        [v_file] = glob.glob(f"{tmp_path}/**/*_g1/{keys[1]}.bin", recursive=True)
        with open(v_file, "r+b") as f:
            f.seek(100)
            b = f.read(1)
            f.seek(100)
            f.write(bytes([b[0] ^ 0xFF]))
        # Page 2: its K half is gone.
        [k_file] = glob.glob(f"{tmp_path}/**/*_g0/{keys[2]}.bin", recursive=True)
        os.unlink(k_file)
        src0 = H.page_bytes(pool, 0)
        got = backend.batch_get_v1(keys, H.indices(pool, [4, 5, 6]))
        assert got == [True, False, False]
        assert H.page_bytes(pool, 4 * pool.page_size) == src0
        stats = backend.engine.stats()
        assert stats["checksum_failures"] == 1
    finally:
        backend.close()


def test_threads_share_one_backend(sgl, tmp_path):
    """SGLang's prefetch and backup threads call at once: every call gets its own result."""
    pool = H.make_host_pool(sgl, layout="page_first", page_num=64)
    backend = H.attach(sgl, H.storage_config(sgl, extra(tmp_path)), pool)
    errors = []

    def worker(t):
        try:
            src_pages = [t * 4, t * 4 + 1]
            dst_pages = [32 + t * 4, 32 + t * 4 + 1]
            keys = keys_for(2, start=1000 + t * 2)
            for _ in range(5):
                assert backend.batch_set_v1(keys, H.indices(pool, src_pages)) == [True, True]
                assert backend.batch_get_v1(keys, H.indices(pool, dst_pages)) == [True, True]
                for s, d in zip(src_pages, dst_pages):
                    assert H.page_bytes(pool, s * 16) == H.page_bytes(pool, d * 16)
        except Exception as e:  # noqa: BLE001 - reported below
            errors.append((t, repr(e)))

    H.fill_pages(pool, list(range(32)), seed=13)
    threads = [threading.Thread(target=worker, args=(t,)) for t in range(8)]
    try:
        for th in threads:
            th.start()
        for th in threads:
            th.join(60)
        assert errors == []
        assert backend.engine.stats()["stores_ok"] == 32
    finally:
        backend.close()


@pytest.mark.parametrize(
    ("kw", "message"),
    [
        (dict(interface_v1=None), "interface_v1"),
        (dict(interface_v1=0), "interface_v1"),
        (dict(root_dir=None), "root_dir"),
        (dict(layout="raid"), "layout = 'raid'"),
        (dict(layout="slab"), "capacity_bytes"),
        (dict(capacity_byte="1 GiB"), "'capacity_byte'"),
        (dict(capacity_bytes="lots"), "capacity_bytes"),
        (dict(direct_io="sometimes"), "direct_io"),
        (dict(config={"block_size": "4 KiB"}), "config replaces root_dir"),
    ],
)
def test_bad_config_is_refused_at_construction_naming_the_field(sgl, tmp_path, kw, message):
    cfg = H.storage_config(sgl, extra(tmp_path, **kw))
    with pytest.raises((ValueError, TypeError, kvtier.ConfigError)) as err:
        sgl.StorageBackendFactory.create_backend("dynamic", cfg, None)
    assert message in str(err.value)


def test_a_pool_whose_page_parts_are_not_whole_4k_is_refused(sgl, tmp_path):
    # MLA layer_first: one part per layer of 16 tokens x 160 x 2 bytes = 5120 bytes.
    pool = H.make_host_pool(sgl, mla=True, layout="layer_first", head_dim=128)
    cfg = H.storage_config(sgl, extra(tmp_path), mla=True, page_first=False)
    with pytest.raises(ValueError, match="5120 bytes.*multiple of 4096"):
        H.attach(sgl, cfg, pool)


def test_calls_kvtier_does_not_serve_raise_instead_of_returning_none(sgl, tmp_path):
    pool = H.make_host_pool(sgl, layout="page_first")
    backend = H.attach(sgl, H.storage_config(sgl, extra(tmp_path)), pool)
    try:
        page = pool.get_dummy_flat_data_page()
        for call in (lambda: backend.get("k", page), lambda: backend.batch_get(["k"], [page]),
                     lambda: backend.set("k", page), lambda: backend.batch_set(["k"], [page]),
                     backend.clear, lambda: backend.batch_get_v2([]),
                     lambda: backend.batch_set_v2([]), lambda: backend.batch_exists_v2(["k"])):
            with pytest.raises(NotImplementedError):
                call()
    finally:
        backend.close()


def test_after_close_calls_fail_without_touching_the_pool(sgl, tmp_path):
    pool = H.make_host_pool(sgl, layout="page_first")
    backend = H.attach(sgl, H.storage_config(sgl, extra(tmp_path)), pool)
    H.fill_pages(pool, [0, 1], seed=14)
    keys = keys_for(1, start=300)
    assert backend.batch_set_v1(keys, H.indices(pool, [0])) == [True]
    backend.close()
    backend.close()  # idempotent
    before = H.page_bytes(pool, 16)
    assert backend.batch_get_v1(keys, H.indices(pool, [1])) == [False]
    assert backend.batch_set_v1(keys, H.indices(pool, [1])) == [False]
    assert H.page_bytes(pool, 16) == before


def test_import_without_sglang_says_what_to_install():
    code = "import kvtier, kvtier.sglang"
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                       cwd="/", env={**os.environ, "PYTHONPATH": ""})
    assert r.returncode != 0
    assert "ImportError: kvtier.sglang needs SGLang (pip install 'sglang>=0.5.23')" in r.stderr
