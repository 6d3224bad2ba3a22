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
import glob
import importlib.abc
import importlib.machinery
import importlib.util
import mmap
import os
import sys
import types
import zipfile
from typing import Any

import numpy as np

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


class WheelNotFoundError(FileNotFoundError):
    pass


def find_wheel() -> str:
    env = os.environ.get("KVTIER_SGLANG_WHEEL")
    if env:
        if not os.path.exists(env):
            raise WheelNotFoundError(f"KVTIER_SGLANG_WHEEL={env} does not exist")
        return env
    dirs = [d for d in (os.environ.get("KVTIER_SGLANG_WHEEL_DIR"),
                        os.path.expanduser("~/.cache/kvtier/sglang-wheel")) if d]
    for d in dirs:
        found = sorted(glob.glob(os.path.join(d, f"sglang-{SGLANG_VERSION}-*.whl")))
        if found:
            return found[-1]
    raise WheelNotFoundError(
        f"no sglang-{SGLANG_VERSION} wheel in {dirs}: `pip download --no-deps "
        f"sglang=={SGLANG_VERSION} -d DIR` and set KVTIER_SGLANG_WHEEL_DIR=DIR"
    )


class _Stub(types.ModuleType):
    """An imported module SGLang's files name but the tests never run."""

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)
        if name[:1].isupper():
            value: Any = type(name, (), {"__module__": self.__name__})
        else:
            def value(*_a: Any, **_k: Any) -> bool:
                return False
            value.__name__ = name
        setattr(self, name, value)
        return value


class _StubFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def find_spec(self, fullname: str, path: Any, target: Any = None) -> Any:
        if fullname.split(".")[0] not in _STUB_ROOTS:
            return None
        if fullname.split(".")[0] == "msgspec" and _installed("msgspec"):
            return None
        return importlib.machinery.ModuleSpec(fullname, self, is_package=True)

    def create_module(self, spec: Any) -> types.ModuleType:
        STUBBED.add(spec.name)
        mod = _Stub(spec.name)
        mod.__path__ = []
        return mod

    def exec_module(self, module: types.ModuleType) -> None:
        pass


class _WheelFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Serves the real modules from the wheel's sources, under their own names."""

    def __init__(self, wheel: str, real: dict[str, tuple[str, str]]) -> None:
        self.wheel = wheel
        self.real = real

    def find_spec(self, fullname: str, path: Any, target: Any = None) -> Any:
        if fullname not in self.real:
            return None
        member = self.real[fullname][0]
        return importlib.machinery.ModuleSpec(
            fullname, self, origin=f"{self.wheel}!/{member}",
            is_package=member.endswith("__init__.py"))

    def create_module(self, spec: Any) -> None:
        return None

    def exec_module(self, module: types.ModuleType) -> None:
        member, source = self.real[module.__name__]
        module.__file__ = f"{self.wheel}!/{member}"
        if member.endswith("__init__.py"):
            module.__path__ = []
        exec(compile(source, module.__file__, "exec"), module.__dict__)


def _installed(name: str) -> bool:
    finder = [f for f in sys.meta_path if not isinstance(f, _StubFinder)]
    return any(f.find_spec(name, None) for f in finder if hasattr(f, "find_spec"))


def _common_standin() -> types.ModuleType:
    mod = _Stub("sglang.srt.mem_cache.pool_host.common")

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
    sys.meta_path.insert(0, _StubFinder())
    with zipfile.ZipFile(wheel) as zf:
        sources = {name: zf.read(name).decode() for name in _REAL}
        common = zf.read("sglang/srt/utils/common.py").decode()
    for pkg in _EMPTY_PACKAGES:
        mod = types.ModuleType(pkg)
        mod.__path__ = []
        sys.modules[pkg] = mod
    # sglang.srt.utils: the helpers base.py and mha.py import by name (is_cuda, ...): a stub.
    utils = _Stub("sglang.srt.utils")
    utils.__path__ = []
    STUBBED.add(utils.__name__)
    sys.modules[utils.__name__] = utils
    utils_common = types.ModuleType("sglang.srt.utils.common")
    tree = ast.parse(common)
    fn = next(n for n in tree.body
              if isinstance(n, ast.FunctionDef) and n.name == "human_readable_int")
    exec(compile(ast.Module(body=[fn], type_ignores=[]), "sglang/srt/utils/common.py", "exec"),
         utils_common.__dict__)
    sys.modules["sglang.srt.utils.common"] = utils_common
    sys.modules["sglang.srt.mem_cache.pool_host.common"] = _common_standin()
    real = {}
    for path in _REAL:
        name = path[:-3].replace("/", ".").removesuffix(".__init__")
        real[name] = (path, sources[path])
    sys.meta_path.insert(0, _WheelFinder(wheel, real))
    for name in real:
        importlib.import_module(name)
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
