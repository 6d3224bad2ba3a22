"""kvtier's LMCache L2 adapters (``kvtier.lmcache``) under LMCache's real adapter code.

Both are built as LMCache's multi-process server builds them: from a ``--l2-adapter`` JSON
argument, through its parser, registry and ``native_plugin`` factory (``KvtierL2Connector``,
staged) or ``plugin`` factory, handed an L1 arena's description (``KvtierL2Adapter``, in
place), and used through LMCache's ``NativeConnectorL2Adapter`` (its demux thread polls
kvtier's event fd). See ``lmcache_harness.py`` for what is stood in and why.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time

import numpy as np
import pytest

import lmcache_harness as H


@pytest.fixture(scope="module")
def lm():
    try:
        return H.load_lmcache()
    except H.WheelNotFoundError as exc:
        if os.environ.get("CI") == "true":
            raise
        pytest.skip(str(exc))


def spec(root, **params):
    p = {"root_dir": str(root), "block_size": "64 KiB", "staging_bytes": "4 MiB"}
    p.update(params)
    return {"type": "native_plugin", "module_path": "kvtier.lmcache",
            "class_name": "KvtierL2Connector",
            "adapter_params": {k: v for k, v in p.items() if v is not None}}


def objects(sizes, seed, allocate=H.TensorMemoryObj):
    """L1 objects of `sizes` bytes (each its own mapping, or from `allocate`), random bytes."""
    rng = np.random.default_rng(seed)
    out = []
    for n in sizes:
        o = allocate(n)
        o.array[:] = rng.integers(0, 256, n, dtype=np.uint8)
        out.append(o)
    return out


def store(adapter, keys, objs):
    task = adapter.submit_store_task(keys, objs)
    assert H.wait_fd(adapter.get_store_event_fd()), "store completion never signalled"
    done = adapter.pop_completed_store_tasks()
    return done[task]


def lookup(adapter, keys):
    task = adapter.submit_lookup_and_lock_task(keys, {})
    assert H.wait_fd(adapter.get_lookup_and_lock_event_fd())
    bitmap = adapter.query_lookup_and_lock_result(task)
    adapter.submit_unlock(keys)
    return [bitmap.test(i) for i in range(len(keys))]


def damage_second_block(root):
    """Flips a byte in the one block file of a block numbered 1 (an object's second block), so
    that its crc32c no longer matches."""
    import glob

    files = sorted(glob.glob(f"{root}/**/*_g1/*.bin", recursive=True))
    assert len(files) == 1, files
    with open(files[0], "r+b") as f:
        b = f.read(1)
        f.seek(0)
        f.write(bytes([b[0] ^ 0x55]))


def load(adapter, keys, objs):
    task = adapter.submit_load_task(keys, objs)
    assert H.wait_fd(adapter.get_load_event_fd()), "load completion never signalled"
    bitmap = adapter.query_load_result(task)
    return [bitmap.test(i) for i in range(len(keys))]


@pytest.mark.parametrize("layout", ["files", "slab"])
def test_store_exists_load_byte_exact_through_lmcaches_adapter(lm, tmp_path, layout):
    cap = "64 MiB" if layout == "slab" else None
    adapter = H.adapter_from_cli(lm, spec(tmp_path, layout=layout, capacity_bytes=cap))
    try:
        assert type(adapter).__name__ == "NativeConnectorL2Adapter"
        assert type(adapter._client).__name__ == "KvtierL2Connector"
        # Objects of one block, of several (the last one partial), and smaller than a block.
        sizes = [64 << 10, 200 << 10, 1000, 128 << 10]
        keys = [H.object_key(lm, i) for i in range(4)]
        src = objects(sizes, seed=1)
        result = store(adapter, keys, src)
        # LMCache's L2StoreResult: an int, the bytes stored (-1: failed).
        assert int(result) == sum(sizes)
        absent = H.object_key(lm, 99)
        assert lookup(adapter, keys + [absent]) == [True] * 4 + [False]
        dst = objects(sizes, seed=2)
        assert load(adapter, keys, dst) == [True] * 4
        for s, d in zip(src, dst):
            assert bytes(d.byte_array) == bytes(s.byte_array)
        # A load of a key never stored is a miss, and its buffer is left alone.
        other = objects([64 << 10], seed=3)
        before = bytes(other[0].byte_array)
        assert load(adapter, [absent], other) == [False]
        assert bytes(other[0].byte_array) == before
    finally:
        adapter.close()


def test_salted_keys_and_models_are_distinct(lm, tmp_path):
    adapter = H.adapter_from_cli(lm, spec(tmp_path))
    try:
        plain = H.object_key(lm, 5)
        salted = H.object_key(lm, 5, salt="user-a")
        other_model = H.object_key(lm, 5, model="Qwen/Qwen3-8B")
        store(adapter, [plain], objects([4096], seed=4))
        assert lookup(adapter, [plain, salted, other_model]) == [True, False, False]
    finally:
        adapter.close()


def test_a_restarted_connector_serves_what_was_stored(lm, tmp_path):
    keys = [H.object_key(lm, i) for i in range(10, 13)]
    src = objects([64 << 10, 100 << 10, 70 << 10], seed=5)
    first = H.adapter_from_cli(lm, spec(tmp_path))
    store(first, keys, src)
    first.close()
    second = H.adapter_from_cli(lm, spec(tmp_path))
    try:
        assert lookup(second, keys) == [True, True, True]
        dst = objects([64 << 10, 100 << 10, 70 << 10], seed=6)
        assert load(second, keys, dst) == [True] * 3
        assert [bytes(d.byte_array) for d in dst] == [bytes(s.byte_array) for s in src]
    finally:
        second.close()


def test_a_damaged_block_fails_its_key_and_leaves_its_buffer(lm, tmp_path):
    adapter = H.adapter_from_cli(lm, spec(tmp_path))
    try:
        keys = [H.object_key(lm, i) for i in range(20, 22)]
        src = objects([128 << 10, 64 << 10], seed=7)
        store(adapter, keys, src)
        # Key 0 has two blocks: its second one no longer matches its crc32c.
        damage_second_block(tmp_path)
        dst = objects([128 << 10, 64 << 10], seed=8)
        before = bytes(dst[0].byte_array)
        assert load(adapter, keys, dst) == [False, True]
        assert bytes(dst[0].byte_array) == before, "a failed key's buffer was written"
        assert bytes(dst[1].byte_array) == bytes(src[1].byte_array)
    finally:
        adapter.close()


def test_lmcaches_eviction_delete_removes_every_block_of_an_object(lm, tmp_path):
    adapter = H.adapter_from_cli(lm, spec(tmp_path))
    try:
        keys = [H.object_key(lm, i) for i in range(30, 34)]
        sizes = [200 << 10, 64 << 10, 1000, 130 << 10]  # 4, 1, 1 and 3 blocks of 64 KiB
        store(adapter, keys, objects(sizes, seed=13))
        client = adapter._client
        before = client.engine.stats()["blocks_stored"]
        assert before == 9
        # LMCache's delete waits for the completion its demux thread routes.
        adapter.delete([keys[0], keys[3], H.object_key(lm, 77)])
        assert lookup(adapter, keys) == [False, True, True, False]
        stats = client.stats()
        assert stats["removals"] == 7 and stats["blocks_stored"] == 2
        assert stats["lmcache"]["objects_deleted"] == 2
        dst = objects([200 << 10], seed=14)
        assert load(adapter, [keys[0]], dst) == [False]
    finally:
        adapter.close()


def test_the_event_fd_is_kvtiers_and_wakes_for_every_kind_of_completion(lm, tmp_path):
    from kvtier.lmcache import KvtierL2Connector

    conn = KvtierL2Connector(root_dir=str(tmp_path), block_size="64 KiB", staging_bytes="1 MiB")
    try:
        fd = conn.event_fd()
        assert fd == conn.engine.result_fd()
        assert not H.wait_fd(fd, 0.05)
        src = objects([64 << 10], seed=9)
        f1 = conn.submit_batch_set(["m@00000000@0@aa"], [src[0].byte_array])
        assert H.wait_fd(fd)
        got = []
        while not got:
            got = conn.drain_completions()
        assert got == [(f1, True, "", [True])]
        f2 = conn.submit_batch_exists(["m@00000000@0@aa", "m@00000000@0@bb"])
        assert H.wait_fd(fd)
        assert conn.drain_completions() == [(f2, True, "", [True, False])]
        # A batch larger than the staging room completes at once, failed; nothing is copied.
        big = objects([2 << 20], seed=10)
        f3 = conn.submit_batch_set(["m@00000000@0@cc"], [big[0].byte_array])
        assert H.wait_fd(fd)
        assert conn.drain_completions() == [(f3, False, "staging region full", [False])]
        assert conn.stats()["lmcache"]["batches_refused_staging"] == 1
    finally:
        conn.close()


def test_close_with_work_in_flight(lm, tmp_path):
    adapter = H.adapter_from_cli(lm, spec(tmp_path, staging_bytes="16 MiB"))
    keys = [H.object_key(lm, i) for i in range(100, 140)]
    src = objects([256 << 10] * len(keys), seed=11)
    store(adapter, keys, src)
    dst = objects([256 << 10] * len(keys), seed=12)
    before = [bytes(d.byte_array) for d in dst]
    adapter.submit_load_task(keys, dst)
    adapter.close()  # stops the demux thread, then the connector
    client = adapter._client
    assert "shut down" in repr(client.engine)
    # Loads the demux thread drained before close are in place (right bytes); the rest were
    # never written. After close nothing is: what is drained now reports failure.
    after = [bytes(d.byte_array) for d in dst]
    for a, b, s in zip(after, before, src):
        assert a in (b, bytes(s.byte_array))
    out = client.drain_completions()
    assert [bytes(d.byte_array) for d in dst] == after
    # What it reports loaded was copied before close (an object's copy is its own job's).
    for _future, _ok, _err, per_key in out:
        for i, loaded in enumerate(per_key):
            if loaded:
                assert after[i] == bytes(src[i].byte_array)
    # After close, every call completes at once, failed.
    client.submit_batch_set(["m@00000000@0@dd"], [src[0].byte_array])
    assert [r[1] for r in client.drain_completions()] == [False]


@pytest.mark.parametrize(
    ("params", "message"),
    [
        (dict(root_dir=None), "root_dir"),
        (dict(layout="raid"), "layout = 'raid'"),
        (dict(layout="slab"), "capacity_bytes"),
        (dict(block_size="1000"), "block_size"),
        (dict(staging_bytes="4 KiB"), "staging_bytes"),
        (dict(capacity_bytes="lots"), "capacity_bytes"),
        (dict(chunk_size=256), "'chunk_size'"),
        (dict(config={"block_size": "64 KiB"}), "config replaces root_dir"),
    ],
)
def test_bad_adapter_params_are_refused_naming_the_field(lm, tmp_path, params, message):
    with pytest.raises(Exception) as err:
        H.adapter_from_cli(lm, spec(tmp_path, **params))
    assert message in str(err.value)


def test_import_without_lmcache_is_fine_the_connector_needs_nothing_from_it():
    """kvtier.lmcache imports nothing of LMCache (LMCache imports it): it loads anywhere."""
    r = subprocess.run([sys.executable, "-c", "import kvtier.lmcache as m; print(m.__name__)"],
                       capture_output=True, text=True, cwd="/",
                       env={**os.environ, "PYTHONPATH": ""})
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "kvtier.lmcache"


# -- in place: the `plugin` type over LMCache's L1 arena ------------------------------------


def plugin_spec(root, **params):
    p = {"root_dir": str(root), "block_size": "64 KiB"}
    p.update(params)
    return {"type": "plugin", "module_path": "kvtier.lmcache", "class_name": "KvtierL2Adapter",
            "adapter_params": {k: v for k, v in p.items() if v is not None}}


BLOCK = 64 << 10


def in_place(lm, root, arena_bytes, align=BLOCK, **params):
    """An arena, and the plugin adapter built over it (blocks of BLOCK) as LMCache builds it."""
    arena = H.Arena(lm, arena_bytes, align=align)
    return arena, H.adapter_from_cli(lm, plugin_spec(root, **params), l1_memory_desc=arena.desc)


def arena_objects(arena, sizes, seed):
    return objects(sizes, seed, allocate=arena.allocate)


@pytest.mark.parametrize("layout", ["files", "slab"])
def test_in_place_over_the_l1_arena_moves_objects_without_staging(lm, tmp_path, layout):
    """LMCache's plugin factory hands the adapter its L1 arena; objects aligned to kvtier's
    block go to the device and back in place: byte-exact, nothing staged, and a load writes
    nothing outside its object's own allocation."""
    cap = "64 MiB" if layout == "slab" else None
    arena, adapter = in_place(lm, tmp_path, 8 << 20, layout=layout, capacity_bytes=cap,
                              max_capacity_gb=1)
    try:
        assert type(adapter).__name__ == "KvtierL2Adapter"
        assert isinstance(adapter, lm.NativeConnectorL2Adapter)
        client = adapter.connector
        assert client.in_place
        # The engine's region is the arena itself.
        assert client.engine.region_address == arena.desc.ptr
        status = adapter.report_status()
        assert status["type"] == "kvtier" and status["in_place"] is True
        sizes = [BLOCK, 200 << 10, 1000, 2 * BLOCK]
        keys = [H.object_key(lm, i) for i in range(40, 44)]
        src = arena_objects(arena, sizes, seed=11)
        assert int(store(adapter, keys, src)) == sum(sizes)
        assert lookup(adapter, keys + [H.object_key(lm, 49)]) == [True] * 4 + [False]
        # Loads land in other objects of the arena; the bytes past the last one are a canary.
        dst = arena_objects(arena, sizes, seed=12)
        canary = arena.bytes[arena.next:arena.next + BLOCK].copy()
        assert load(adapter, keys, dst) == [True] * 4
        for s, d in zip(src, dst):
            assert bytes(d.byte_array) == bytes(s.byte_array)
        assert np.array_equal(arena.bytes[arena.next:arena.next + BLOCK], canary)
        lmstats = client.stats()["lmcache"]
        assert lmstats["in_place_set_bytes"] == sum(sizes)
        assert lmstats["in_place_get_bytes"] == sum(sizes)
        assert "staged_set_bytes" not in lmstats and "staged_get_bytes" not in lmstats
    finally:
        adapter.close()


def test_in_place_refuses_a_buffer_outside_the_arena_and_leaves_it(lm, tmp_path):
    arena, adapter = in_place(lm, tmp_path, 4 << 20)
    try:
        keys = [H.object_key(lm, i) for i in range(50, 52)]
        inside = arena_objects(arena, [BLOCK], seed=13)
        outside = objects([BLOCK], seed=14)
        # One object in the arena and one not: the batch fails, the one inside is stored.
        assert int(store(adapter, keys, inside + outside)) == -1
        assert lookup(adapter, keys) == [True, False]
        before = bytes(outside[0].byte_array)
        assert load(adapter, keys, inside + outside) == [True, False]
        assert bytes(outside[0].byte_array) == before
        assert adapter.connector.stats()["lmcache"]["objects_outside_arena"] == 2
    finally:
        adapter.close()


@pytest.mark.parametrize(
    ("align", "stable", "why"),
    [
        (4096, -1, "--l1-align-bytes 65536"),
        (64 << 10, 2 << 20, "--no-l1-use-lazy"),
        (64 << 10, None, "no stable registration prefix"),
    ],
)
def test_an_arena_kvtier_cannot_use_in_place_is_staged_and_says_why(lm, tmp_path, caplog,
                                                                    align, stable, why):
    arena = H.Arena(lm, 4 << 20, align=align, stable=stable)
    with caplog.at_level("WARNING", logger="kvtier.lmcache"):
        adapter = H.adapter_from_cli(lm, plugin_spec(tmp_path, staging_bytes="1 MiB"),
                                     l1_memory_desc=arena.desc)
    try:
        assert not adapter.connector.in_place
        assert why in caplog.text
        keys = [H.object_key(lm, i) for i in range(60, 62)]
        src = arena_objects(arena, [100 << 10, 5000], seed=15)
        assert int(store(adapter, keys, src)) == (100 << 10) + 5000
        dst = arena_objects(arena, [100 << 10, 5000], seed=16)
        assert load(adapter, keys, dst) == [True, True]
        assert [bytes(d.byte_array) for d in dst] == [bytes(s.byte_array) for s in src]
        assert adapter.connector.stats()["lmcache"]["staged_get_bytes"] == (100 << 10) + 5000
    finally:
        adapter.close()


def test_in_place_a_damaged_block_fails_its_key(lm, tmp_path):
    """In place the device's bytes land in the object before the checksum is checked: the key
    fails (LMCache then reads nothing of that object); the other key is byte-exact."""
    arena, adapter = in_place(lm, tmp_path, 4 << 20)
    try:
        keys = [H.object_key(lm, i) for i in range(70, 72)]
        src = arena_objects(arena, [2 * BLOCK, BLOCK], seed=17)
        store(adapter, keys, src)
        damage_second_block(tmp_path)
        dst = arena_objects(arena, [2 * BLOCK, BLOCK], seed=18)
        assert load(adapter, keys, dst) == [False, True]
        assert bytes(dst[1].byte_array) == bytes(src[1].byte_array)
    finally:
        adapter.close()


def test_in_place_nothing_is_written_after_close(lm, tmp_path):
    arena, adapter = in_place(lm, tmp_path, 32 << 20)
    keys = [H.object_key(lm, i) for i in range(200, 240)]
    src = arena_objects(arena, [4 * BLOCK] * len(keys), seed=19)
    store(adapter, keys, src)
    dst = arena_objects(arena, [4 * BLOCK] * len(keys), seed=20)
    task = adapter.submit_load_task(keys, dst)
    adapter.close()
    client = adapter.connector
    # An object whose job was cut by the stop may hold some of its blocks (it fails); what
    # close left is never written again.
    after = [bytes(d.byte_array) for d in dst]
    time.sleep(0.2)
    out = client.drain_completions()
    assert [bytes(d.byte_array) for d in dst] == after, "a buffer was written after close"
    # The batch is reported once, by the adapter's demux thread before close or here after.
    reported = adapter.query_load_result(task)
    assert (reported is not None) != (len(out) == 1)
    per_key = (out[0][3] if out else [reported.test(i) for i in range(len(keys))])
    assert len(per_key) == len(keys)
    for i, loaded in enumerate(per_key):
        if loaded:
            assert after[i] == bytes(src[i].byte_array)
    client.submit_batch_get([keys[0]], [dst[0].byte_array])
    assert [r[1] for r in client.drain_completions()] == [False]


def test_in_place_moves_only_an_objects_blocks_not_its_whole_allocation(lm, tmp_path):
    """With the arena aligned to four blocks, an object of one block and a bit takes two
    blocks and one of a few bytes takes one: the rest of each allocation is left alone."""
    arena, adapter = in_place(lm, tmp_path, 4 << 20, align=4 * BLOCK)
    try:
        assert adapter.connector.in_place
        sizes = [BLOCK + 1000, 100]
        keys = [H.object_key(lm, i) for i in range(80, 82)]
        src = arena_objects(arena, sizes, seed=21)
        store(adapter, keys, src)
        dst = arena_objects(arena, sizes, seed=22)
        for d in dst:
            d._array[d.get_size():] = 0xA5
        parts = [2, 1]
        assert load(adapter, keys, dst) == [True, True]
        for s, d, n in zip(src, dst, parts):
            assert bytes(d.byte_array) == bytes(s.byte_array)
            # Past the blocks the object spans, its allocation's padding is untouched.
            assert (d._array[n * BLOCK:] == 0xA5).all()
    finally:
        adapter.close()


def test_a_plugin_without_an_arena_or_one_the_engine_cannot_take_stages(lm, tmp_path, caplog):
    # LMCache hands no description (an L1 it cannot describe): staged, and said.
    with caplog.at_level("WARNING", logger="kvtier.lmcache"):
        adapter = H.adapter_from_cli(lm, plugin_spec(tmp_path / "a", staging_bytes="1 MiB"))
    try:
        assert not adapter.connector.in_place
        assert adapter.report_status()["in_place"] is False
        assert "described no L1 arena" in caplog.text
        src = objects([BLOCK], seed=23)
        key = [H.object_key(lm, 90)]
        store(adapter, key, src)
        dst = objects([BLOCK], seed=24)
        assert load(adapter, key, dst) == [True]
        assert bytes(dst[0].byte_array) == bytes(src[0].byte_array)
    finally:
        adapter.close()
    # An arena the engine cannot register (read-only memory): staged, and said.
    import mmap

    ro = mmap.mmap(-1, 1 << 20, prot=mmap.PROT_READ)
    ptr = int(np.frombuffer(ro, dtype=np.uint8).ctypes.data)
    desc = lm.L1MemoryDesc(ptr=ptr, size=1 << 20, align_bytes=BLOCK,
                           stable_registration_size=1 << 20)
    caplog.clear()
    with caplog.at_level("WARNING", logger="kvtier.lmcache"):
        adapter = H.adapter_from_cli(lm, plugin_spec(tmp_path / "b", staging_bytes="1 MiB"),
                                     l1_memory_desc=desc)
    try:
        assert not adapter.connector.in_place
        assert "could not take the L1 arena" in caplog.text
    finally:
        adapter.close()
        ro.close()


@pytest.mark.parametrize(
    ("params", "message"),
    [
        (dict(max_capacity_gb=-1), "max_capacity_gb = -1"),
        (dict(max_capacity_gb="1"), "max_capacity_gb = '1'"),
        (dict(l1_memory_desc=1), "'l1_memory_desc' not understood"),
        (dict(chunk_size=256), "'chunk_size'"),
        (dict(chunk_size=256), "accepted: root_dir"),
        (dict(chunk_size=256), "max_capacity_gb"),
    ],
)
def test_bad_plugin_params_are_refused_naming_the_field(lm, tmp_path, params, message):
    arena = H.Arena(lm, 1 << 20, align=64 << 10)
    with pytest.raises(Exception) as err:
        H.adapter_from_cli(lm, plugin_spec(tmp_path, **params), l1_memory_desc=arena.desc)
    assert message in str(err.value)


def test_the_plugin_class_without_lmcache_says_what_to_install():
    code = ("import importlib.util\n"
            "if importlib.util.find_spec('lmcache') is not None:\n    print('LMCACHE')\n"
            "    raise SystemExit\n"
            "import kvtier.lmcache as m\n"
            "try:\n    m.KvtierL2Adapter\nexcept ImportError as e:\n    print(e)\n")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd="/",
                       env={**os.environ, "PYTHONPATH": ""})
    assert r.returncode == 0, r.stderr
    if r.stdout.strip() == "LMCACHE":
        pytest.skip("LMCache is importable here: the class builds")
    assert "pip install lmcache==" in r.stdout
