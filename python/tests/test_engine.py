"""The Python binding (kvtier.Engine) against the real engine on this machine's kernel.

Each test opens an engine over a numpy region (an mmap, so page-aligned) on a slab file or a
files directory under pytest's tmp_path, moves blocks and checks bytes, results, errors and
states. What would break: the zero-copy region (bytes would not arrive where the caller looks),
result conversion (partial loads, per-key failures), error mapping, the region's lifetime
(a freed buffer under in-flight I/O), or the GIL (threads would serialize or deadlock).
"""

from __future__ import annotations

import gc
import mmap
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
import weakref

import numpy as np
import pytest

import kvtier

BLOCK = 64 * 1024
BLOCKS = 32


def slab_config(tmp_path, **extra):
    cfg = {
        "block_size": BLOCK,
        "cores": [0],
        "devices": [{"path": str(tmp_path / "kv.slab"), "capacity_bytes": "16 MiB"}],
    }
    cfg.update(extra)
    return cfg


def files_config(tmp_path, **extra):
    cfg = {
        "block_size": BLOCK,
        "cores": [0],
        "devices": [{"path": str(tmp_path / "kvdir"), "layout": "files"}],
        "files": {
            "namespace": {
                "model_name": "test/model",
                "dtype": "bfloat16",
                "tokens_per_hash": 16,
                "blocks_per_file": 1,
                "kv_cache_groups": [{"tokens_per_block": 16, "layer_names": ["l0"]}],
            }
        },
    }
    cfg.update(extra)
    return cfg


def region(blocks=BLOCKS):
    return np.frombuffer(kvtier.allocate_region(blocks, BLOCK), dtype=np.uint8).reshape(
        blocks, BLOCK
    )


def pattern(seed, n=1):
    return np.random.default_rng(seed).integers(0, 256, size=(n, BLOCK), dtype=np.uint8)


def vkey(i, group=0):
    """A vLLM offload key: a 32-byte hash and the group index, 4 bytes big-endian."""
    return i.to_bytes(32, "big") + group.to_bytes(4, "big")


def run(engine, submit, job_id, keys, blocks):
    submit(job_id, keys, blocks)
    engine.drain()
    (result,) = engine.poll_finished()
    assert result.job_id == job_id
    return result


@pytest.mark.parametrize("layout", ["slab", "files"])
def test_round_trip_is_byte_exact_and_in_place(tmp_path, layout):
    cfg = slab_config(tmp_path) if layout == "slab" else files_config(tmp_path)
    arr = region()
    data = pattern(1, 4)
    arr[[3, 5, 7, 9]] = data
    with kvtier.Engine(cfg, arr) as e:
        assert e.region_address == arr.ctypes.data  # the caller's memory, not a copy
        assert (e.block_size, e.num_blocks) == (BLOCK, BLOCKS)
        keys = [vkey(i) for i in range(4)]
        r = run(e, e.submit_store, 1, keys, np.array([3, 5, 7, 9], dtype=np.int64))
        assert (r.kind, r.success, r.succeeded_prefix, r.failures) == ("store", True, 4, [])
        assert r.successful_keys is None and r.transfer_bytes == 4 * BLOCK
        assert r.transfer_seconds > 0
        assert e.lookup(keys + [vkey(99)]) == ["nvme"] * 4 + ["miss"]
        arr[:] = 0
        r = run(e, e.submit_load, 2, keys, np.array([20, 21, 22, 23], dtype=np.int32))
        assert r.success and r.transfer_bytes == 4 * BLOCK
        np.testing.assert_array_equal(arr[20:24], data)
        assert not arr[:20].any()  # nothing else was written
        # A store of keys already held is a skipped success.
        r = run(e, e.submit_store, 3, keys[:2], [0, 1])
        assert r.success and r.transfer_bytes == 0
        s = e.stats()
        assert s["stores_ok"] == 4 and s["loads_ok"] == 4 and s["stores_skipped_present"] == 2
        assert s["blocks_stored"] == 4 and s["bytes_read"] == 4 * BLOCK
    if layout == "files":
        # The files are vLLM's: <dir>/<model>_<digest>_r0/<hhh>/<hh>_g0/<hash>.bin, block bytes.
        h = vkey(2)[:32].hex()
        (ns,) = [d for d in os.listdir(tmp_path / "kvdir") if d.endswith("_r0")]
        path = tmp_path / "kvdir" / ns / h[:3] / f"{h[3:5]}_g0" / f"{h}.bin"
        assert path.read_bytes() == data[2].tobytes()


def test_result_fd_wakes_a_poll_loop(tmp_path):
    """The engine's result eventfd is readable once a result is published, until cleared."""
    import select

    def readable(fd, ms):
        p = select.poll()
        p.register(fd, select.POLLIN)
        return bool(p.poll(ms))

    arr = region()
    with kvtier.Engine(slab_config(tmp_path), arr) as e:
        fd = e.result_fd()
        assert fd == e.result_fd() and not readable(fd, 0)
        arr[0] = pattern(3)[0]
        e.submit_store(1, [vkey(1)], [0])
        assert readable(fd, 10_000)
        assert e.clear_result_fd() >= 1 and not readable(fd, 0)
        (r,) = e.poll_finished()
        assert (r.job_id, r.success) == (1, True)
        e.submit_load(2, [vkey(1), vkey(2)], [1, 2])
        assert readable(fd, 10_000)
        e.clear_result_fd()
        (r,) = e.poll_finished()
        assert (r.job_id, r.success, r.successful_keys) == (2, False, [vkey(1)])
        np.testing.assert_array_equal(arr[1], arr[0])
        assert e.clear_result_fd() == 0


@pytest.mark.parametrize("layout", ["slab", "files"])
def test_remove_frees_keys_at_once(tmp_path, layout):
    cfg = slab_config(tmp_path) if layout == "slab" else files_config(tmp_path)
    arr = region()
    arr[0:3] = pattern(5, 3)
    with kvtier.Engine(cfg, arr) as e:
        keys = [vkey(i) for i in range(3)]
        assert run(e, e.submit_store, 1, keys, [0, 1, 2]).success
        assert e.remove([keys[1], vkey(9)]) == [True, False]
        assert e.lookup(keys) == ["nvme", "miss", "nvme"]
        assert e.stats()["removals"] == 1
        r = run(e, e.submit_load, 2, [keys[1]], [5])
        assert not r.success and r.failures[0][2] == "miss"


def test_partial_load_reports_prefix_and_every_failed_key(tmp_path):
    arr = region()
    arr[0:2] = pattern(2, 2)
    with kvtier.Engine(slab_config(tmp_path), arr) as e:
        assert run(e, e.submit_store, 1, [b"a", b"c"], [0, 1]).success
        arr[10:14] = 0
        r = run(e, e.submit_load, 2, [b"a", b"missing-1", b"c", b"missing-2"], [10, 11, 12, 13])
        assert (r.success, r.succeeded_prefix) == (False, 1)
        assert r.successful_keys == [b"a"]
        assert [(i, k, reason) for (i, k, reason, _) in r.failures] == [
            (1, b"missing-1", "miss"),
            (3, b"missing-2", "miss"),
        ]
        assert "not stored" in r.failures[0][3]
        np.testing.assert_array_equal(arr[10], arr[0])
        np.testing.assert_array_equal(arr[12], arr[1])  # loaded even after the failure
        assert not arr[11].any() and not arr[13].any()
        # A load whose first key fails has no successful prefix.
        r = run(e, e.submit_load, 3, [b"nope", b"a"], [4, 5])
        assert (r.success, r.succeeded_prefix, r.successful_keys) == (False, 0, None)


def test_events_carry_keys_medium_tier_and_locality(tmp_path):
    cfg = slab_config(tmp_path, events={"enabled": True, "locality": "LOCAL"})
    arr = region()
    with kvtier.Engine(cfg, arr) as e:
        assert run(e, e.submit_store, 1, [b"k1", b"k2"], [0, 1]).success
        assert not run(e, e.submit_load, 2, [b"zz"], [3]).success
        (ev,) = e.take_events()  # one stored event; loads emit none
        assert (ev.keys, ev.medium, ev.tier, ev.removed, ev.locality) == (
            [b"k1", b"k2"], "STORAGE", "nvme", False, "LOCAL")
        assert e.take_events() == []


def test_config_forms_and_errors(tmp_path):
    arr = region()
    toml = (
        f"block_size = {BLOCK}\ncores = [0]\n[[devices]]\npath = \"{tmp_path / 'a.slab'}\"\n"
        "capacity_bytes = \"16 MiB\"\n"
    )
    path = tmp_path / "kvtier.toml"
    path.write_text(toml)
    for cfg in (toml, str(path), path):
        with kvtier.Engine(cfg, arr) as e:
            assert e.block_size == BLOCK
    assert "block_size = \"64 KiB\"" in kvtier.check_config(toml)
    with pytest.raises(kvtier.ConfigError, match=r"`block_size` = \"3 KiB\".*multiple of 4096"):
        kvtier.Engine(slab_config(tmp_path, block_size="3 KiB"), arr)
    with pytest.raises(kvtier.ConfigError, match=r"ring_entries.*power of two"):
        kvtier.Engine(slab_config(tmp_path, ring_entries=100), arr)
    with pytest.raises(kvtier.ConfigError, match="unknown field `bogus`"):
        kvtier.Engine(slab_config(tmp_path, bogus=1), arr)
    with pytest.raises(kvtier.ConfigError, match="reading config .*nope.toml"):
        kvtier.Engine(str(tmp_path / "nope.toml"), arr)
    with pytest.raises(TypeError, match="config: expected"):
        kvtier.Engine(42, arr)
    assert issubclass(kvtier.ConfigError, kvtier.Error)


def test_region_errors(tmp_path):
    cfg = slab_config(tmp_path)
    with pytest.raises(ValueError, match="not a whole number of blocks"):
        kvtier.Engine(cfg, kvtier.allocate_region(1, BLOCK + 4096))
    with pytest.raises(ValueError, match="read-only"):
        kvtier.Engine(cfg, bytes(BLOCK))
    with pytest.raises(ValueError, match="not C-contiguous"):
        kvtier.Engine(cfg, region(4)[:, ::2])
    raw = np.frombuffer(kvtier.allocate_region(3, BLOCK), dtype=np.uint8)
    with pytest.raises(ValueError, match="not 4096-byte aligned.*allocate_region"):
        kvtier.Engine(cfg, raw[16 : 16 + 2 * BLOCK])
    with pytest.raises(TypeError, match="neither a buffer nor has __array_interface__"):
        kvtier.Engine(cfg, object())


def test_job_errors_backpressure_and_shutdown(tmp_path):
    arr = region()
    e = kvtier.Engine(slab_config(tmp_path, queue_blocks_max=2), arr)
    with pytest.raises(kvtier.BackpressureError, match="queue_blocks_max = 2"):
        e.submit_store(1, [b"a", b"b", b"c"], [0, 1, 2])
    assert e.poll_finished() == [] and e.jobs_in_flight() == 0  # nothing was queued
    with pytest.raises(ValueError, match=r"blocks\[1\] = 32: the region has 32 blocks"):
        e.submit_store(2, [b"a", b"b"], [0, BLOCKS])
    with pytest.raises(ValueError, match=r"blocks\[0\] = -1"):
        e.submit_load(2, [b"a"], [-1])
    with pytest.raises(ValueError, match="2 keys but 1 blocks"):
        e.submit_store(2, [b"a", b"b"], [0])
    with pytest.raises(TypeError, match=r"keys\[0\]: expected bytes, got str"):
        e.submit_store(2, ["a"], [0])
    with pytest.raises(ValueError, match=r"keys\[0\]:.*64"):
        e.submit_store(2, [b"x" * 65], [0])
    e.submit_store(5, [b"a"], [0])
    e.drain()
    with pytest.raises(ValueError, match="job_id 5 is already in flight"):
        e.submit_store(5, [b"b"], [1])  # its result has not been polled yet
    assert [r.job_id for r in e.poll_finished()] == [5]
    e.submit_store(5, [b"b"], [1])  # reported: the id is free again
    report = e.shutdown()
    # Nothing was hung: the stop is clean and the region's export is released.
    assert report == {"workers_gave_up": 0, "ops_in_flight": 0, "jobs_held": 0,
                      "blocks_held": 0, "clean": True}
    assert e.shutdown() == report  # idempotent
    (r,) = e.poll_finished()
    # Reported once its blocks were free: no release to wait on.
    assert r.job_id == 5 and r.release is None and r.released
    with pytest.raises(kvtier.ShutdownError):
        e.submit_load(6, [b"a"], [0])
    assert issubclass(kvtier.BackpressureError, kvtier.Error)


def test_region_kept_alive_until_shutdown(tmp_path):
    arr = region()
    arr[0] = pattern(3)[0]
    expect = arr[0].copy()
    ref = weakref.ref(arr)
    e = kvtier.Engine(slab_config(tmp_path), arr)
    del arr
    gc.collect()
    assert ref() is not None  # the engine holds the caller's buffer
    assert run(e, e.submit_store, 1, [b"k"], [0]).success
    assert run(e, e.submit_load, 2, [b"k"], [9]).success
    np.testing.assert_array_equal(ref()[9], expect)
    e.shutdown()
    gc.collect()
    assert ref() is None  # released once every I/O was reaped


def test_mmap_cannot_close_under_the_engine(tmp_path):
    m = kvtier.allocate_region(BLOCKS, BLOCK)
    e = kvtier.Engine(slab_config(tmp_path), m)
    with pytest.raises(BufferError):
        m.close()  # the engine's export pins it
    e.shutdown()
    m.close()


def test_array_interface_region(tmp_path):
    backing = region()

    class Foreign:
        """Memory described only by __array_interface__ (as some tensor libraries do); it owns
        the memory, as such an object must."""

        def __init__(self, memory):
            self._memory = memory
            self.__array_interface__ = memory.__array_interface__

    obj = Foreign(backing)
    backing[2] = pattern(4)[0]
    with kvtier.Engine(slab_config(tmp_path), obj) as e:
        assert e.region_address == backing.ctypes.data
        assert run(e, e.submit_store, 1, [b"k"], [2]).success
        assert run(e, e.submit_load, 2, [b"k"], [3]).success
    np.testing.assert_array_equal(backing[3], backing[2])


def test_tensor_like_region_through_numpy(tmp_path):
    """A CPU torch tensor is neither a buffer nor has __array_interface__; its .numpy() view
    shares its memory, which is what the engine registers (stood in here: torch is not a
    test dependency). A CUDA tensor is refused."""
    backing = region()

    class CpuTensor:
        is_cuda = False

        def numpy(self):
            return backing

    backing[1] = pattern(6)[0]
    with kvtier.Engine(slab_config(tmp_path), CpuTensor()) as e:
        assert e.region_address == backing.ctypes.data
        assert run(e, e.submit_store, 1, [b"t"], [1]).success
        assert run(e, e.submit_load, 2, [b"t"], [2]).success
    np.testing.assert_array_equal(backing[2], backing[1])

    class CudaTensor(CpuTensor):
        is_cuda = True

    with pytest.raises(TypeError, match="neither a buffer"):
        kvtier.Engine(slab_config(tmp_path), CudaTensor())


def test_threads_submit_while_another_drains(tmp_path):
    arr = region(64)
    arr[:] = pattern(5, 64)
    threads_n, jobs_per_thread = 4, 25
    results = []
    lock = threading.Lock()
    with kvtier.Engine(slab_config(tmp_path, cores="auto"), arr) as e:
        stop = threading.Event()

        def submitter(t):
            for j in range(jobs_per_thread):
                job_id = t * 1000 + j
                key = f"t{t}-j{j}".encode()
                while True:
                    try:
                        e.submit_store(job_id, [key], [(t * jobs_per_thread + j) % 64])
                        break
                    except kvtier.BackpressureError:
                        time.sleep(0.001)

        def drainer():
            while not stop.is_set():
                e.drain()
                got = e.poll_finished()
                with lock:
                    results.extend(got)

        d = threading.Thread(target=drainer)
        d.start()
        ts = [threading.Thread(target=submitter, args=(t,)) for t in range(threads_n)]
        for t in ts:
            t.start()
        for t in ts:
            t.join()
        e.drain()
        stop.set()
        d.join()
        results.extend(e.poll_finished())
        ids = sorted(r.job_id for r in results)
        assert ids == sorted(t * 1000 + j for t in range(threads_n) for j in range(jobs_per_thread))
        assert all(r.success for r in results)
        keys = [f"t{t}-j{j}".encode() for t in range(threads_n) for j in range(jobs_per_thread)]
        assert set(e.lookup(keys)) == {"nvme"}


def test_waiting_releases_the_gil(tmp_path):
    with kvtier.Engine(slab_config(tmp_path), region()) as e:
        ticks = 0
        done = threading.Event()

        def spin():
            nonlocal ticks
            while not done.is_set():
                ticks += 1

        t = threading.Thread(target=spin)
        t.start()
        time.sleep(0.05)  # the spinner is running
        before = ticks
        started = time.monotonic()
        assert e.wait_finished(0.3) == []  # nothing submitted: times out
        waited = time.monotonic() - started
        during = ticks - before
        done.set()
        t.join()
        assert waited >= 0.29
        # The spinner ran while this thread waited: with the GIL held it could not have moved.
        assert during > 1000, during
        with pytest.raises(ValueError, match="timeout"):
            e.wait_finished(-1)


def test_info_and_stats_shapes(tmp_path):
    with kvtier.Engine(files_config(tmp_path), region()) as e:
        info = e.info()
        assert info["block_size"] == BLOCK and info["num_blocks"] == BLOCKS
        assert info["region_backing"] == "foreign" and info["s3"] is None
        assert 0.0 <= info["region_huge_percent"] <= 100.0
        (dev,) = info["devices"]
        assert dev["kind"] == "directory" and dev["path"].endswith("_r0")
        assert len(info["workers"]) == 1 and info["workers"][0]["core"] == 0
        s = e.stats()
        assert s["jobs_in_flight"] == 0 and s["s3"] is None
        assert set(s["load_latency"]) == {"count", "p50_us", "p99_us", "p999_us"}


def test_allocate_region():
    m = kvtier.allocate_region(2, 4096)
    assert isinstance(m, mmap.mmap) and len(m) == 8192
    with pytest.raises(ValueError, match="at least 1"):
        kvtier.allocate_region(0, 4096)


def test_memlock_failure_names_the_fix():
    """Without CAP_IPC_LOCK, registering a region beyond RLIMIT_MEMLOCK fails at open with a
    message that says how to raise the limit (run as nobody with a 64 KiB limit)."""
    if os.geteuid() != 0 or not shutil.which("setpriv") or not shutil.which("prlimit"):
        pytest.skip("needs root, setpriv and prlimit to run a process without CAP_IPC_LOCK")
    work = tempfile.mkdtemp(dir="/var/tmp", prefix="kvtier-memlock-")
    try:
        os.chmod(work, 0o777)
        code = (
            "import kvtier\n"
            "cfg = {'block_size': 65536, 'cores': [0], 'devices': "
            f"[{{'path': '{work}/kv.slab', 'capacity_bytes': '16 MiB'}}]}}\n"
            "try:\n"
            "    kvtier.Engine(cfg, kvtier.allocate_region(256, 65536))\n"
            "    print('OPENED')\n"
            "except kvtier.Error as e:\n"
            "    print('ERROR', type(e).__name__, e)\n"
        )
        out = subprocess.run(
            ["prlimit", "--memlock=65536:65536", "setpriv", "--reuid=65534", "--regid=65534",
             "--clear-groups", sys.executable, "-c", code],
            capture_output=True, text=True, timeout=60,
        )
        if "ERROR" not in out.stdout and "OPENED" not in out.stdout:
            pytest.skip(f"cannot run Python as nobody here: {out.stderr.strip()[-300:]}")
        assert "OPENED" not in out.stdout
        assert "RLIMIT_MEMLOCK" in out.stdout and "ulimit -l unlimited" in out.stdout, out.stdout
        assert "CAP_IPC_LOCK" in out.stdout
    finally:
        shutil.rmtree(work, ignore_errors=True)


def test_concurrent_shutdowns_both_wait_for_the_workers(tmp_path):
    """A second shutdown while the first is joining the workers returns only once no I/O can
    touch the region (the caller may free it then)."""
    arr = region(64)
    e = kvtier.Engine(slab_config(tmp_path, cores="auto"), arr)
    for j in range(8):
        e.submit_store(j, [f"c{j}-{i}".encode() for i in range(8)], list(range(j * 8, j * 8 + 8)))
    first = threading.Thread(target=e.shutdown)
    first.start()
    e.shutdown()
    assert e.jobs_in_flight() == 0  # every job has its result: nothing is still running
    first.join()
    assert sorted(r.job_id for r in e.poll_finished()) == list(range(8))
    del e
    gc.collect()


def test_a_fanout_directory_that_cannot_be_made_fails_the_store(tmp_path):
    """A dangling symlink where a fan-out directory <hhh> belongs: kvtier never resolves a path
    through it (ELOOP). The store fails with the path and the reason instead of retrying
    forever or creating anything at the symlink's target."""
    arr = region()
    with kvtier.Engine(files_config(tmp_path), arr) as e:
        data_dir = e.info()["devices"][0]["path"]
        key = vkey(0xABC << 244)  # hash starts "abc"
        h = key[:32].hex()
        assert h.startswith("abc")
        os.symlink(str(tmp_path / "nowhere"), os.path.join(data_dir, h[:3]))
        e.submit_store(1, [key], [0])
        (r,) = e.wait_finished(10.0)
        assert not r.success
        (_, k, reason, detail) = r.failures[0]
        assert (k, reason) == (key, "io")
        assert f"{h[:3]}/{h[3:5]}_g0" in detail and "symlink" in detail
        assert not (tmp_path / "nowhere").exists()
        # Other keys still store.
        assert run(e, e.submit_store, 2, [vkey(1)], [1]).success


def _families(text, openmetrics=False):
    """The families of a metrics text, parsed by prometheus_client's own (strict) parsers."""
    if openmetrics:
        from prometheus_client.openmetrics.parser import text_string_to_metric_families
    else:
        from prometheus_client.parser import text_string_to_metric_families
    return {f.name: f for f in text_string_to_metric_families(text)}


def _value(families, family, name, **labels):
    for s in families[family].samples:
        if s.name == name and all(s.labels.get(k) == v for k, v in labels.items()):
            return s.value
    raise AssertionError(f"no sample {name}{labels} in {family}")


@pytest.mark.parametrize("layout", ["slab", "files"])
def test_metrics_endpoint_parses_and_counts_the_work(tmp_path, layout):
    """Scraped over HTTP while the engine runs, both text formats parse with
    prometheus_client, and the counters are exactly the work done."""
    import urllib.request

    extra = {"metrics": {"listen": "127.0.0.1:0"}}
    cfg = slab_config(tmp_path, **extra) if layout == "slab" else files_config(tmp_path, **extra)
    if layout == "files":
        cfg["devices"][0]["capacity_bytes"] = 16 * 1024 * 1024 + 1000  # 256 whole blocks
    arr = region()
    arr[:4] = pattern(7, 4)
    with kvtier.Engine(cfg, arr) as e:
        host, port = e.metrics_address
        url = f"http://{host}:{port}/metrics"
        keys = [vkey(i) for i in range(4)]
        assert run(e, e.submit_store, 1, keys, [0, 1, 2, 3]).success
        assert run(e, e.submit_load, 2, keys[:3], [10, 11, 12]).success
        assert not run(e, e.submit_load, 3, [vkey(50)], [13]).success
        assert e.lookup(keys + [vkey(60)]) == ["nvme"] * 4 + ["miss"]

        with urllib.request.urlopen(url, timeout=10) as r:
            assert r.headers["Content-Type"].startswith("text/plain; version=0.0.4")
            fams = _families(r.read().decode())
        req = urllib.request.Request(url, headers={"Accept": "application/openmetrics-text"})
        with urllib.request.urlopen(req, timeout=10) as r:
            om = _families(r.read().decode(), openmetrics=True)
        # The same text as metrics_text (but for the moment it was taken).
        assert set(_families(e.metrics_text())) == set(fams)

        for f in (fams, om):
            assert _value(f, "kvtier_jobs", "kvtier_jobs_total", op="store", result="ok") == 1
            assert _value(f, "kvtier_jobs", "kvtier_jobs_total", op="load", result="ok") == 1
            assert _value(f, "kvtier_jobs", "kvtier_jobs_total", op="load", result="failed") == 1
        assert fams["kvtier_job_seconds"].type == "histogram"
        assert fams["kvtier_device_io_seconds"].type == "histogram"
        assert om["kvtier_job_seconds"].unit == "seconds"
        assert _value(fams, "kvtier_job_seconds", "kvtier_job_seconds_count", op="load") == 2
        assert _value(fams, "kvtier_blocks", "kvtier_blocks_total", op="store", result="ok") == 4
        assert _value(fams, "kvtier_blocks", "kvtier_blocks_total", op="load", result="ok") == 3
        assert _value(fams, "kvtier_blocks", "kvtier_blocks_total", op="load", result="miss") == 1
        assert _value(fams, "kvtier_moved_bytes", "kvtier_moved_bytes_total", tier="nvme",
                      op="store") == 4 * BLOCK
        assert _value(fams, "kvtier_lookups", "kvtier_lookups_total", answer="hit_nvme") == 4
        assert _value(fams, "kvtier_lookups", "kvtier_lookups_total", answer="miss") == 1
        dev = cfg["devices"][0]["path"]
        assert _value(fams, "kvtier_device_used_bytes", "kvtier_device_used_bytes",
                      device=dev) == 4 * BLOCK
        assert _value(fams, "kvtier_device_bytes", "kvtier_device_bytes_total", device=dev,
                      op="read") == 3 * BLOCK
        assert sum(s.value for s in fams["kvtier_device_errors"].samples) == 0
        capacity = _value(fams, "kvtier_device_capacity_bytes", "kvtier_device_capacity_bytes",
                          device=dev)
        slots = e.info()["devices"][0]["slots"] if layout == "slab" else 256
        assert capacity == slots * BLOCK and 0 < slots <= 256
        assert _value(fams, "kvtier_info", "kvtier_info", layout=layout) == 1
    # Closed with the engine.
    with pytest.raises(OSError):
        urllib.request.urlopen(url, timeout=2)


def test_metrics_listen_errors_are_clear(tmp_path):
    arr = region()
    with kvtier.Engine(slab_config(tmp_path, metrics={"listen": "127.0.0.1:0"}), arr) as e:
        host, port = e.metrics_address
        cfg = slab_config(tmp_path / "b", metrics={"listen": f"{host}:{port}"})
        (tmp_path / "b").mkdir()
        with pytest.raises(kvtier.Error, match=r"metrics.listen = .*pick another port"):
            kvtier.Engine(cfg, region())
    with pytest.raises(kvtier.ConfigError, match=r"metrics.listen.*localhost:1.*127.0.0.1:9464"):
        kvtier.Engine(slab_config(tmp_path, metrics={"listen": "localhost:1"}), arr)


def test_logs_reach_stderr_as_json_lines(tmp_path):
    """The module logs kvtier's warnings to stderr; KVTIER_LOG_FORMAT=json makes each line one
    JSON object (here: the warning that a files directory has no capacity bound)."""
    import json

    cfg = files_config(tmp_path)
    code = (
        "import json, sys, numpy as np, kvtier\n"
        "cfg = json.loads(sys.argv[1])\n"
        "r = np.frombuffer(kvtier.allocate_region(4, cfg['block_size']), dtype=np.uint8)\n"
        "with kvtier.Engine(cfg, r.reshape(4, -1)):\n"
        "    pass\n"
    )
    env = dict(os.environ, KVTIER_LOG_FORMAT="json")
    env.pop("KVTIER_LOG", None)
    out = subprocess.run([sys.executable, "-c", code, json.dumps(cfg)], env=env,
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    lines = [json.loads(line) for line in out.stderr.splitlines() if line.strip()]
    assert any(rec["level"] == "WARN" and "grows without bound" in rec["fields"]["message"]
               for rec in lines), out.stderr
    # The default level is warnings: no info lines.
    assert all(rec["level"] in ("WARN", "ERROR") for rec in lines), out.stderr
