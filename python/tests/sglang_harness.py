"""Run SGLang's real HiCache storage code on CPU, without torch, CUDA or SGLang's engine.

The wheel is ``sglang-$KVTIER_SGLANG_VERSION`` (default ``SGLANG_VERSION``), found in
``$KVTIER_SGLANG_WHEEL_DIR`` (``tools/test.sh`` downloads it there) or given as
``$KVTIER_SGLANG_WHEEL``. Its modules are read from the wheel with ``zipfile`` and executed
unmodified under their own names; SGLang is not installed (its package ``__init__`` files pull in
the whole server, torch and CUDA kernels).

Real SGLang code (from the wheel):

* ``sglang/srt/mem_cache/hicache_storage.py``: ``HiCacheStorage`` (the base class kvtier's
  backend subclasses), ``HiCacheStorageConfig``, ``HiCacheStorageExtraInfo``, ``HiCacheFile``
  (SGLang's own file backend, the benchmark's reference) and the failure injector;
* ``sglang/srt/mem_cache/storage/__init__.py`` and ``backend_factory.py``: the
  ``StorageBackendFactory`` that loads a ``dynamic`` backend by module path;
* ``sglang/srt/mem_cache/storage/file/``: ``LRUFileEvictor`` (HiCacheFile's space accounting);
* ``sglang/srt/environ.py`` (``envs``), and ``human_readable_int`` from ``sglang/srt/utils/common.py``
  (that one function, taken from the file with ``ast``: the rest of the module imports the server);
* ``sglang/srt/mem_cache/pool_host/``: ``base.py`` (``HostKVCache``), ``mha.py``
  (``MHATokenToKVPoolHost``) and ``mla.py`` (``MLATokenToKVPoolHost``): their
  ``init_kv_buffer``, ``get_page_buffer_meta`` (the zero-copy page addresses storage backends
  use), ``get_data_page``, ``get_dummy_flat_data_page`` and ``set_from_flat_data_page``.

Stand-ins:

* ``torch``: numpy-backed (``vllm_own/torch_standin.py``); only while this harness imports, and
  only if torch is not installed.
* ``sglang.srt.mem_cache.pool_host.common``: ``ALLOC_MEMORY_FUNCS`` with one CPU allocator
  (page-aligned zeroed memory; SGLang's allocates pinned memory through CUDA).
* Every other ``sglang.*``, ``sgl_kernel*`` and ``msgspec`` module those files import (CUDA
  kernels, the device pools, the platform probe, the scheduler's context) is an empty module whose
  capitalised names are empty classes and whose other names are functions returning ``False``
  (``is_cuda()`` and the like, called at import). ``STUBBED`` lists the ones that were
  imported. None of them is called by the methods the tests use; a test that reached one would
  fail on a ``False`` or an empty class, never pass on it.

The host pool objects are made with the real classes but without their ``__init__`` (it sizes
the pool from the GPU's free memory and builds CUDA pointer tables): ``make_host_pool`` sets the
geometry attributes ``__init__`` would and calls the real ``init_kv_buffer``.
"""

from __future__ import annotations

import ast
import importlib
import mmap
import os
import sys
import types
from typing import Any

import numpy as np

import wheel_modules

SGLANG_VERSION = os.environ.get("KVTIER_SGLANG_VERSION", "0.5.23")

_REAL = (
    "sglang/srt/environ.py",
    "sglang/srt/mem_cache/hicache_storage.py",
    "sglang/srt/mem_cache/storage/__init__.py",
    "sglang/srt/mem_cache/storage/backend_factory.py",
    "sglang/srt/mem_cache/storage/file/__init__.py",
    "sglang/srt/mem_cache/storage/file/lru_file_evictor.py",
    "sglang/srt/mem_cache/pool_host/base.py",
    "sglang/srt/mem_cache/pool_host/mha.py",
    "sglang/srt/mem_cache/pool_host/mla.py",
)
# Packages whose own __init__ would import the server: empty packages here.
_EMPTY_PACKAGES = (
    "sglang",
    "sglang.srt",
    "sglang.srt.mem_cache",
    "sglang.srt.mem_cache.pool_host",
)
_STUB_ROOTS = ("sglang", "sgl_kernel", "sgl_kernel_npu", "msgspec")

STUBBED: set[str] = set()
# The torch SGLang's modules were loaded with (the stand-in unless torch is installed).
torch: Any = None


WheelNotFoundError = wheel_modules.WheelNotFoundError


def find_wheel() -> str:
    return wheel_modules.find_wheel("sglang", SGLANG_VERSION, "KVTIER_SGLANG")


def _common_standin() -> types.ModuleType:
    mod = wheel_modules.Stub("sglang.srt.mem_cache.pool_host.common")

    def alloc_cpu(dims: Any, dtype: Any, device: Any = "cpu", pin_memory: bool = False,
                  allocator: Any = None, registration_granularity_bytes: Any = None) -> Any:
        n = int(np.prod(dims)) * dtype.itemsize
        # Page-aligned, as cudaHostAlloc's memory is: an anonymous mapping.
        buf = mmap.mmap(-1, max(n, 1), flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        arr = np.frombuffer(buf, dtype=np.uint8)[:n].view(dtype.np).reshape(dims)
        return torch.Tensor(arr)

    mod.ALLOC_MEMORY_FUNCS = {"cpu": alloc_cpu}
    return mod


_loaded: types.SimpleNamespace | None = None


def load_sglang() -> types.SimpleNamespace:
    """Imports the real modules (once per process); returns the classes the tests use."""
    global _loaded
    if _loaded is not None:
        return _loaded
    global torch
    wheel = find_wheel()
    standin = False
    try:
        import torch as real_torch

        torch = real_torch
    except ImportError:
        sys.path.insert(0, os.path.join(os.path.dirname(__file__), "vllm_own"))
        import torch_standin

        torch = sys.modules["torch"] = torch_standin
        standin = True
    modules = wheel_modules.WheelModules(wheel, list(_REAL), _STUB_ROOTS,
                                         installed_ok=("msgspec",))
    modules.install()
    for pkg in _EMPTY_PACKAGES:
        wheel_modules.empty_package(pkg)
    # sglang.srt.utils: the helpers base.py and mha.py import by name (is_cuda, ...): a stub.
    modules.add_stub("sglang.srt.utils")
    # human_readable_int, the one function lru_file_evictor takes from sglang.srt.utils.common
    # (the rest of that module imports the server), taken from the file as it is.
    utils_common = types.ModuleType("sglang.srt.utils.common")
    tree = ast.parse(modules.read("sglang/srt/utils/common.py"))
    fn = next(n for n in tree.body
              if isinstance(n, ast.FunctionDef) and n.name == "human_readable_int")
    exec(compile(ast.Module(body=[fn], type_ignores=[]), "sglang/srt/utils/common.py", "exec"),
         utils_common.__dict__)
    sys.modules["sglang.srt.utils.common"] = utils_common
    modules.add_stub("sglang.srt.mem_cache.pool_host.common", _common_standin())
    modules.import_all()
    STUBBED.update(modules.stubbed)
    # The module under test, imported while `torch` is the one SGLang's modules hold.
    importlib.import_module("kvtier.sglang")
    if standin:
        # Not left in sys.modules: other tests' importorskip("torch") still skips.
        del sys.modules["torch"]
    hs = sys.modules["sglang.srt.mem_cache.hicache_storage"]
    _loaded = types.SimpleNamespace(
        wheel=wheel,
        version=SGLANG_VERSION,
        HiCacheStorage=hs.HiCacheStorage,
        HiCacheStorageConfig=hs.HiCacheStorageConfig,
        HiCacheStorageExtraInfo=hs.HiCacheStorageExtraInfo,
        HiCacheFile=hs.HiCacheFile,
        StorageBackendFactory=sys.modules[
            "sglang.srt.mem_cache.storage.backend_factory"].StorageBackendFactory,
        MHATokenToKVPoolHost=sys.modules["sglang.srt.mem_cache.pool_host.mha"]
        .MHATokenToKVPoolHost,
        MLATokenToKVPoolHost=sys.modules["sglang.srt.mem_cache.pool_host.mla"]
        .MLATokenToKVPoolHost,
    )
    return _loaded


def make_host_pool(sgl: types.SimpleNamespace, *, mla: bool = False, layout: str = "page_first",
                   page_num: int = 16, page_size: int = 16, layer_num: int = 4,
                   head_num: int = 2, head_dim: int = 64, dtype: Any = None) -> Any:
    """A real MHA (or MLA) host pool object with a real kv_buffer of `layout`, on CPU."""
    dtype = dtype or torch.bfloat16
    cls = sgl.MLATokenToKVPoolHost if mla else sgl.MHATokenToKVPoolHost
    pool = cls.__new__(cls)
    pool.layout = layout
    pool.page_size = page_size
    pool.page_num = page_num
    pool.size = page_num * page_size
    pool.layer_num = layer_num
    pool.dtype = dtype
    pool.device = "cpu"
    pool.pin_memory = False
    pool.allocator = None
    pool._transfer_device = types.SimpleNamespace(type="cpu")
    pool.dcp_size = 1
    pool.dcp_rank = 0
    if mla:
        pool.kv_lora_rank = head_dim
        pool.qk_rope_head_dim = head_dim // 4
        pool.kv_cache_dim = pool.kv_lora_rank + pool.qk_rope_head_dim
    else:
        pool.head_num = head_num
        pool.head_dim = head_dim
        pool.v_head_dim = head_dim
    pool.kv_buffer = pool.init_kv_buffer()
    return pool


def storage_config(sgl: types.SimpleNamespace, extra: dict[str, Any], *, tp_rank: int = 0,
                   tp_size: int = 1, mla: bool = False, page_first: bool = True,
                   model_name: str = "meta-llama/Llama-3.1-8B") -> Any:
    """SGLang's HiCacheStorageConfig as the cache controller builds it."""
    return sgl.HiCacheStorageConfig(
        tp_rank=tp_rank, tp_size=tp_size, pp_rank=0, pp_size=1, attn_cp_rank=0, attn_cp_size=1,
        is_mla_model=mla, enable_storage_metrics=False, is_page_first_layout=page_first,
        model_name=model_name, extra_config=dict(extra),
    )


def attach(sgl: types.SimpleNamespace, config: Any, pool: Any) -> Any:
    """What the cache controller's attach does: the factory, then the host pool."""
    backend = sgl.StorageBackendFactory.create_backend("dynamic", config, pool)
    backend.register_mem_pool_host(pool)
    backend.on_host_pools_registered()
    return backend


def page_bytes(pool: Any, index: int) -> bytes:
    """The bytes of the page at token index `index`, through the pool's own get_data_page."""
    return pool.get_data_page(index, flat=True).contiguous().view(np_uint8()).numpy().tobytes()


def np_uint8() -> Any:
    return torch.uint8


def fill_pages(pool: Any, pages: list[int], seed: int) -> None:
    """Random bytes into whole pages (each part of each page), through set_from_flat_data_page."""
    rng = np.random.default_rng(seed)
    flat = pool.get_dummy_flat_data_page()
    nbytes = flat.numel() * flat.element_size()
    for p in pages:
        data = rng.integers(0, 256, nbytes, dtype=np.uint8).view(flat.dtype.np)
        pool.set_from_flat_data_page(p * pool.page_size, torch.Tensor(data))


def indices(pool: Any, pages: list[int]) -> Any:
    """host_indices for whole pages, as SGLang passes them: every token index, int64."""
    return torch.Tensor(np.concatenate(
        [np.arange(p * pool.page_size, (p + 1) * pool.page_size, dtype=np.int64) for p in pages]
    ) if pages else np.zeros(0, dtype=np.int64))
