"""kvtier's vLLM tier over vLLM's real ``SharedOffloadRegion`` (the CPU buffer vLLM hands its
tiers), not an anonymous stand-in: the region is several /dev/shm files mapped back to back
over a memfd reservation once it is 2 GiB or more (``num_segments``), and kvtier registers the
whole view as fixed buffers in pieces of at most 1 GiB, so a piece spans two mappings. Blocks
on both sides of every segment boundary are stored and loaded byte-exact.

The region's module is vLLM's, read from the wheel unmodified; stood in: torch (numpy-backed,
``vllm_own/torch_standin.py``: ``frombuffer``), ``check_shm_free_space`` and
``host_unregister`` (CUDA host registration, never called without pinning).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import types
import zipfile

import numpy as np
import pytest

import vllm_harness as H

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "vllm_own"))
import torch_standin  # noqa: E402

# 3 MiB rows: 1 GiB segments rounded up to a row end, 1 GiB registration pieces rounded down
# to one: their boundaries differ, so pieces straddle segments.
ROW = 3 << 20
# 2.05 GiB: two segments. The huge-page run maps one (300 rows, 900 MiB): vLLM maps segments
# at the address of a memfd reservation, 2 MiB aligned only where the kernel's shmem_enabled
# allows huge pages, so only a one-file region is sure to get them here.
CHUNKS = int(os.environ.get("KVTIER_REGION_CHUNKS", "700"))


def real_region_class(vllm):
    src = zipfile.ZipFile(H.find_wheel()).read(
        "vllm/v1/kv_offload/cpu/shared_offload_region.py").decode()
    standins = {
        "vllm.distributed.device_communicators.shm_broadcast": types.SimpleNamespace(
            check_shm_free_space=lambda size, allocation_name="": None),
        "vllm.v1.kv_offload.cpu.host_register": types.SimpleNamespace(
            host_unregister=lambda address: None),
    }
    saved = {name: sys.modules.get(name) for name in [*standins, "torch"]}
    for name, ns in standins.items():
        mod = types.ModuleType(name)
        mod.__dict__.update(vars(ns))
        sys.modules[name] = mod
    sys.modules["torch"] = torch_standin
    try:
        module = types.ModuleType("vllm_real_shared_offload_region")
        module.__file__ = "vllm/v1/kv_offload/cpu/shared_offload_region.py"
        exec(compile(src, module.__file__, "exec"), module.__dict__)
    finally:
        for name, mod in saved.items():
            if mod is None:
                sys.modules.pop(name, None)
            else:
                sys.modules[name] = mod
    return module.SharedOffloadRegion


def test_tier_over_vllms_segmented_region(vllm, tmp_path):
    free = shutil.disk_usage("/dev/shm").free
    if free < 3 * CHUNKS * ROW // 2:
        pytest.skip(f"/dev/shm has {free >> 20} MiB free; the region needs {CHUNKS * ROW >> 20}")
    Region = real_region_class(vllm)
    region = Region(engine_id=f"kvtier-test-{os.getpid()}", num_chunks=CHUNKS, rank=None,
                    kv_bytes_per_chunk=ROW, cpu_page_size=ROW, num_segments=32)
    try:
        segments = region._segments
        assert len(segments) >= 2 or CHUNKS * ROW < 2 << 30, segments
        view = region.create_kv_memoryview()
        primary = np.asarray(view).view(np.uint8)
        assert primary.shape == (CHUNKS, ROW)
        spec = H.make_spec(vllm, num_blocks=CHUNKS, block_bytes=ROW)
        tier = vllm.SecondaryTierFactory.create_secondary_tier(
            {"type": "KvtierTierManager", "module_path": "kvtier.vllm", "root_dir": str(tmp_path),
             "cores": [0]}, view, spec)
        try:
            assert tier.engine.region_address == primary.ctypes.data
            if os.environ.get("KVTIER_EXPECT_HUGE_SHM") == "1":
                huge = meminfo_kib("ShmemHugePages")
                assert huge >= (CHUNKS * ROW >> 10) // 2, f"{huge} KiB of shmem in 2 MiB pages"
            # Rows on both sides of every segment boundary and of every 1 GiB piece boundary.
            edges = {0, CHUNKS - 1}
            for _, offset, _ in segments[1:]:
                edges |= {offset // ROW - 1, offset // ROW}
            piece_bytes = (1 << 30) // ROW * ROW  # kvtier registers pieces of whole blocks
            for piece in range(piece_bytes, CHUNKS * ROW, piece_bytes):
                edges |= {piece // ROW - 1, piece // ROW}
            rows = sorted(r for r in edges if 0 <= r < CHUNKS)
            rng = np.random.default_rng(5)
            data = rng.integers(0, 256, size=(len(rows), ROW), dtype=np.uint8)
            primary[rows] = data
            keys = [H.make_key(f"segment-{r}") for r in rows]
            ctx = vllm.ReqContext(req_id="seg")
            tier.submit_store(H.make_job(keys, rows, 1, ctx, is_promotion=False))
            assert [r.success for r in H.drain(tier)] == [True]
            primary[rows] = 0
            back = list(reversed(rows))  # each block into another row
            tier.submit_load(H.make_job(keys, back, 2, ctx, is_promotion=True))
            assert [(r.success, r.successful_keys) for r in H.drain(tier)] == [(True, None)]
            np.testing.assert_array_equal(primary[back], data)
        finally:
            tier.shutdown()
    finally:
        del view, primary
        region.cleanup()


def meminfo_kib(field: str) -> int:
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    return 0


def test_tier_over_vllms_region_in_huge_pages(vllm):
    """The same on a /dev/shm of 2 MiB pages (a tmpfs mounted huge=always, as README's
    "Huge pages for vLLM's CPU buffer" advises), in a mount namespace of its own so the
    machine's /dev/shm is untouched: kvtier registers and moves blocks over huge pages (a
    one-file region: see CHUNKS)."""
    if os.geteuid() != 0 or shutil.which("unshare") is None:
        if os.environ.get("CI") == "true":
            pytest.fail("needs root and unshare(1) (util-linux)")
        pytest.skip("needs root and unshare(1): a private /dev/shm mount")
    here = os.path.dirname(os.path.abspath(__file__))
    script = (
        "mount -t tmpfs -o huge=always,size=4g kvtier-huge-shm /dev/shm && "
        f"exec {sys.executable} -m pytest -q -p no:cacheprovider "
        "test_vllm_shared_region.py::test_tier_over_vllms_segmented_region"
    )
    env = {**os.environ, "KVTIER_EXPECT_HUGE_SHM": "1", "KVTIER_REGION_CHUNKS": "300"}
    out = subprocess.run(["unshare", "--mount", "--propagation", "private", "sh", "-c", script],
                         cwd=here, env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0 and "1 passed" in out.stdout, out.stdout[-3000:] + out.stderr[-2000:]
