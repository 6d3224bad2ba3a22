"""Run vLLM's real KV-offload tiering code (0.33.0 or 0.34.0) on CPU, without torch.

The version is ``$KVTIER_VLLM_VERSION`` (default 0.33.0; ``SUPPORTED_VERSIONS``), read once
at import: ``tools/test.sh`` runs the vLLM tests once per version.

vLLM's package ``__init__`` files pull in the whole engine (and torch), so this
harness does not ``pip install`` vLLM. It opens the wheel with ``zipfile``,
extracts only the ``.py`` modules the tiering stack needs into a cache
directory, writes an empty ``__init__.py`` for every package on the way, puts
that directory at the front of ``sys.path`` and installs a few small stand-in
modules (written here, no vLLM code) for the engine modules those files
import.

Real vLLM code (extracted from the wheel, unmodified):

* ``vllm/v1/kv_offload/``: ``base``, ``config``, ``factory``, ``file_mapper``;
  ``cpu/``: ``common``, ``manager`` (CPUOffloadingManager), ``spec``
  (CPUOffloadingSpec), ``policies/{base,factory,lru,arc}``;
  ``tiering/``: ``base``, ``factory`` (SecondaryTierFactory), ``manager``
  (TieringOffloadingManager, CPUPrimaryTierOffloadingManager), ``spec``
  (TieringOffloadingSpec), ``metrics``, ``async_lookup``, ``backpressure``;
  ``tiering/fs/{manager,io,thread_pool}`` (FileSystemTierManager) and
  ``tiering/example/manager``.
* ``vllm/distributed/kv_transfer/kv_connector/v1/offloading/``: ``metrics``
  (OffloadingConnectorStats) and ``canonical_mapping`` (canonical_format_id).
* Leaf helpers: ``vllm/utils/math_utils``, ``vllm/v1/metrics/cache_hit_source``,
  ``vllm/v1/kv_cache_layout``, and ``vllm/v1/kv_hints`` when ``msgspec`` is
  installed.

Stand-ins (see ``STANDIN_REASONS`` for why each one is needed):
``torch`` (only during the import, and only if torch is not already imported),
``vllm.logger``, ``vllm.platforms``, ``vllm.config``,
``vllm.distributed.kv_transfer.kv_connector.v1.metrics``,
``vllm.v1.kv_cache_interface``, ``vllm.v1.kv_offload.cpu.shared_offload_region``,
``vllm.v1.kv_offload.cpu.gpu_worker`` and, without ``msgspec``,
``vllm.v1.kv_hints``. The fs tier's C extension ``vllm.fs_io_C`` is kept absent
by default (``sys.modules["vllm.fs_io_C"] = None``), so the fs tier runs its
pure-Python I/O and lookup fallback (``os.write``/``os.readv``,
``os.path.exists``). With ``KVTIER_VLLM_FS_IO_C=1`` the harness loads the
wheel's real ``fs_io_C.abi3.so`` instead (vLLM's production path): it links
libtorch and the CUDA libraries without calling them, so empty stand-in
libraries with those sonames (built with gcc) are preloaded first.

Typical use::

    vllm = load_vllm()
    spec = make_spec(vllm, num_blocks=8, block_bytes=256 * 1024)
    primary = make_primary(8, 256 * 1024)
    tier = vllm.SecondaryTierFactory.create_secondary_tier(
        {"type": "fs", "root_dir": str(tmp)}, primary.view, spec)

    orch = make_orchestrator(spec, [{"type": "fs", "root_dir": str(tmp)}], 8, 256 * 1024)
    orch.manager  # the real TieringOffloadingManager built by TieringOffloadingSpec

Calls into a ``TieringOffloadingManager`` should hold ``manager.lock`` in
vLLM; the helpers here do not take it (it is not reentrant, and no tier-poll
thread runs unless a tier sets ``tolerates_off_thread_polling``).
"""

from __future__ import annotations

import copy
import dataclasses
import glob
import hashlib
import importlib
import json
import logging
import mmap
import os
import shutil
import sys
import tempfile
import threading
import time
import types
import typing
import zipfile
from collections.abc import Iterable, Sequence
from typing import Any, NamedTuple

import numpy as np

SUPPORTED_VERSIONS = ("0.33.0", "0.34.0")
VLLM_VERSION = os.environ.get("KVTIER_VLLM_VERSION", "0.33.0")
if VLLM_VERSION not in SUPPORTED_VERSIONS:
    raise RuntimeError(
        f"KVTIER_VLLM_VERSION={VLLM_VERSION}: the harness runs vLLM "
        f"{' or '.join(SUPPORTED_VERSIONS)}"
    )
WHEEL_GLOB = f"vllm-{VLLM_VERSION}-*.whl"
DEFAULT_WHEEL_DIRS = ("/work/cache",)
# Bump when the extracted file set or layout changes, so old caches are not reused.
_LAYOUT_VERSION = "1"

# Real vLLM modules imported, in dependency order. Every package on their
# paths gets an empty __init__.py (except vllm.v1.kv_hints, whose real
# __init__ only re-exports protocol.py).
REAL_MODULES: tuple[str, ...] = (
    "vllm.utils.math_utils",
    "vllm.v1.metrics.cache_hit_source",
    "vllm.v1.kv_cache_layout",
    "vllm.v1.kv_hints.protocol",  # only when msgspec is importable
    "vllm.v1.kv_hints",  # only when msgspec is importable
    "vllm.v1.kv_offload.config",
    "vllm.v1.kv_offload.base",
    # 0.34: device pointer groups (imported by the CPU manager's spec)
    *(("vllm.v1.kv_offload.pointer_utils",) if VLLM_VERSION != "0.33.0" else ()),
    "vllm.v1.kv_offload.factory",
    "vllm.distributed.kv_transfer.kv_connector.v1.offloading.canonical_mapping",
    "vllm.distributed.kv_transfer.kv_connector.v1.offloading.metrics",
    "vllm.v1.kv_offload.file_mapper",
    "vllm.v1.kv_offload.cpu.policies.base",
    "vllm.v1.kv_offload.cpu.policies.factory",
    "vllm.v1.kv_offload.cpu.policies.lru",
    "vllm.v1.kv_offload.cpu.policies.arc",
    "vllm.v1.kv_offload.cpu.common",
    "vllm.v1.kv_offload.cpu.manager",
    "vllm.v1.kv_offload.cpu.spec",
    "vllm.v1.kv_offload.tiering.backpressure",
    "vllm.v1.kv_offload.tiering.base",
    "vllm.v1.kv_offload.tiering.async_lookup",
    "vllm.v1.kv_offload.tiering.metrics",
    "vllm.v1.kv_offload.tiering.factory",
    "vllm.v1.kv_offload.tiering.manager",
    "vllm.v1.kv_offload.tiering.spec",
    "vllm.v1.kv_offload.tiering.fs.io",
    "vllm.v1.kv_offload.tiering.fs.thread_pool",
    "vllm.v1.kv_offload.tiering.fs.manager",
    "vllm.v1.kv_offload.tiering.example.manager",
)
_KV_HINTS_MODULES = ("vllm.v1.kv_hints.protocol", "vllm.v1.kv_hints")
# Packages whose real __init__.py is extracted instead of an empty one.
_REAL_PACKAGE_INITS = frozenset({"vllm.v1.kv_hints"})

STANDIN_REASONS: dict[str, str] = {
    "torch": "base.py does `import torch` and names torch.Tensor in the "
    "CanonicalKVCacheTensor dataclass; canonical_mapping.py uses torch.Tensor in "
    "annotations. Only a Tensor class is provided; the stand-in is removed from "
    "sys.modules again after loading so pytest.importorskip('torch') still skips.",
    "vllm.logger": "every module calls init_logger(__name__) and uses "
    "warning_once/info_once; the real logger imports vllm.envs and logging_utils.",
    "vllm.platforms": "cpu/spec.py imports current_platform (CUDA/ROCm/XPU "
    "probes); here it reports a CPU-only platform, so get_worker() refuses.",
    "vllm.config": "offloading/metrics.py imports VllmConfig (used only by "
    "OffloadPromMetrics); the real package is the whole engine config.",
    "vllm.distributed.kv_transfer.kv_connector.v1.metrics": "base of "
    "OffloadingConnectorStats (KVConnectorStats dataclass with a `data` dict) "
    "and KVConnectorPromMetrics; the real module imports prometheus_client, "
    "vllm.config and the connector factory.",
    "vllm.v1.kv_cache_interface": "canonical_mapping.py imports KVCacheLayout "
    "(the real enum from vllm/v1/kv_cache_layout.py is re-exported) and spec "
    "classes used only in isinstance checks; the real module imports torch "
    "and the attention backends.",
    "vllm.v1.kv_offload.cpu.shared_offload_region": "the real region is a "
    "/dev/shm mmap wrapped in torch tensors; the stand-in is an anonymous, "
    "page-aligned mmap viewed by numpy (int8, shape (num_chunks, row_stride)) "
    "with the same constructor, BLOCK_SIZE_ALIGNMENT, create_kv_memoryview() "
    "and cleanup().",
    "vllm.v1.kv_offload.cpu.gpu_worker": "cpu/spec.py and tiering/spec.py "
    "import CPUOffloadingWorker (CUDA/triton copy kernels); the stand-in "
    "raises if a worker is built.",
    "vllm.v1.kv_hints": "only without msgspec: base.py imports KvHintsEnvelope "
    "(a msgspec Struct) for a ReqContext annotation; the stand-in is a frozen "
    "dataclass.",
    "vllm.fs_io_C": "kept absent by default (None in sys.modules makes the "
    "try-import raise ImportError), so the fs tier uses its Python fallback; with "
    "KVTIER_VLLM_FS_IO_C=1 the wheel's real extension is loaded instead, with empty "
    "stand-ins for the torch/CUDA libraries it links but never calls.",
}


class WheelNotFoundError(FileNotFoundError):
    """The vLLM wheel could not be located."""


_WHEEL_HELP = (
    f"vLLM {VLLM_VERSION} wheel not found. Get it with\n"
    f"    pip download vllm=={VLLM_VERSION} --no-deps -d DIR\n"
    "then pass wheel_path=..., or set KVTIER_VLLM_WHEEL=DIR/vllm-"
    f"{VLLM_VERSION}-cp38-abi3-manylinux_2_28_x86_64.whl, or set "
    "KVTIER_VLLM_WHEEL_DIR=DIR."
)

_lock = threading.Lock()
_loaded: dict[str, types.SimpleNamespace] = {}


# ---------------------------------------------------------------------------
# Finding and extracting the wheel
# ---------------------------------------------------------------------------


def find_wheel(wheel_path: str | os.PathLike | None = None) -> str:
    """Locate the wheel: argument, $KVTIER_VLLM_WHEEL, a glob in
    $KVTIER_VLLM_WHEEL_DIR, then /work/cache/vllm-0.33.0-*.whl."""
    if wheel_path is not None:
        path = os.fspath(wheel_path)
        if not os.path.isfile(path):
            raise WheelNotFoundError(f"{path} does not exist. {_WHEEL_HELP}")
        return path
    env = os.environ.get("KVTIER_VLLM_WHEEL")
    if env:
        if not os.path.isfile(env):
            raise WheelNotFoundError(f"KVTIER_VLLM_WHEEL={env} does not exist. {_WHEEL_HELP}")
        return env
    dirs = []
    env_dir = os.environ.get("KVTIER_VLLM_WHEEL_DIR")
    if env_dir:
        dirs.append(env_dir)
    dirs.extend(DEFAULT_WHEEL_DIRS)
    for d in dirs:
        matches = sorted(glob.glob(os.path.join(d, WHEEL_GLOB)))
        if matches:
            return matches[-1]
    raise WheelNotFoundError(f"searched {dirs}. {_WHEEL_HELP}")


def _package_of(module: str) -> str:
    return module.rpartition(".")[0]


def _wheel_members() -> tuple[list[str], set[str]]:
    """(module files to extract, package dirs needing an __init__.py)."""
    files: list[str] = []
    packages: set[str] = set()
    for mod in REAL_MODULES:
        if mod in _REAL_PACKAGE_INITS:
            files.append(mod.replace(".", "/") + "/__init__.py")
            parent = _package_of(mod)
        else:
            files.append(mod.replace(".", "/") + ".py")
            parent = _package_of(mod)
        while parent:
            packages.add(parent)
            parent = _package_of(parent)
    packages -= _REAL_PACKAGE_INITS
    return files, packages


def _wheel_key(wheel: str) -> str:
    st = os.stat(wheel)
    # The module list too: a harness that extracts more reuses no older extraction.
    ident = (f"{os.path.basename(wheel)}|{st.st_size}|{st.st_mtime_ns}|{_LAYOUT_VERSION}|"
             f"{','.join(REAL_MODULES)}")
    return hashlib.sha256(ident.encode()).hexdigest()[:16]


def _wheel_version(zf: zipfile.ZipFile) -> str | None:
    for name in zf.namelist():
        if name.endswith(".dist-info/METADATA") and name.startswith("vllm-"):
            for line in zf.read(name).decode("utf-8", "replace").splitlines():
                if line.startswith("Version:"):
                    return line.split(":", 1)[1].strip()
    return None


def extract_wheel(wheel: str, cache_dir: str | os.PathLike | None = None) -> str:
    """Extract the needed modules; return the directory to put on sys.path.

    Reuses ``<cache_dir>/vllm-<version>-<key>`` when it was completely
    extracted from the same wheel (name, size, mtime) before.
    """
    base = os.fspath(cache_dir) if cache_dir is not None else (
        os.environ.get("KVTIER_VLLM_CACHE")
        or os.path.join(tempfile.gettempdir(), "kvtier-vllm-harness")
    )
    os.makedirs(base, exist_ok=True)
    root = os.path.join(base, f"vllm-{VLLM_VERSION}-{_wheel_key(wheel)}")
    marker = os.path.join(root, ".complete")
    if os.path.isfile(marker):
        return root

    files, packages = _wheel_members()
    tmp = tempfile.mkdtemp(prefix=".extract-", dir=base)
    try:
        with zipfile.ZipFile(wheel) as zf:
            version = _wheel_version(zf)
            if version != VLLM_VERSION:
                raise RuntimeError(
                    f"{wheel} is vLLM {version}, the harness targets {VLLM_VERSION}"
                )
            names = set(zf.namelist())
            missing = [f for f in files if f not in names]
            if missing:
                raise RuntimeError(f"{wheel} lacks expected modules: {missing}")
            for f in files:
                dest = os.path.join(tmp, f)
                os.makedirs(os.path.dirname(dest), exist_ok=True)
                with open(dest, "wb") as out:
                    out.write(zf.read(f))
        for pkg in packages:
            d = os.path.join(tmp, pkg.replace(".", "/"))
            os.makedirs(d, exist_ok=True)
            open(os.path.join(d, "__init__.py"), "w").close()
        with open(os.path.join(tmp, ".complete"), "w") as fh:
            json.dump({"wheel": os.path.abspath(wheel), "version": version,
                       "files": files, "empty_inits": sorted(packages)}, fh, indent=1)
        try:
            os.rename(tmp, root)
        except OSError:
            # Another process finished first, or a stale incomplete dir exists.
            if not os.path.isfile(marker):
                shutil.rmtree(root, ignore_errors=True)
                os.rename(tmp, root)
    finally:
        if os.path.isdir(tmp):
            shutil.rmtree(tmp, ignore_errors=True)
    return root


# ---------------------------------------------------------------------------
# Stand-in modules
# ---------------------------------------------------------------------------


def _standin(name: str, **attrs: Any) -> types.ModuleType:
    mod = types.ModuleType(name, f"kvtier harness stand-in for {name}: "
                           f"{STANDIN_REASONS.get(name, '')}")
    mod.__kvtier_standin__ = True
    for k, v in attrs.items():
        setattr(mod, k, v)
    return mod


def _make_torch_standin() -> types.ModuleType:
    class Tensor:
        """Placeholder type; no tensor operation is available."""

        def __init__(self, *args: Any, **kwargs: Any) -> None:
            raise RuntimeError("torch stand-in: tensors are not available in the harness")

    class dtype:  # noqa: N801
        pass

    mod = _standin("torch", Tensor=Tensor, dtype=dtype)

    def __getattr__(attr: str) -> Any:
        raise AttributeError(f"torch stand-in has no attribute {attr!r} (torch is not installed)")

    mod.__getattr__ = __getattr__  # type: ignore[attr-defined]
    return mod


def _make_logger_standin() -> types.ModuleType:
    def init_logger(name: str) -> logging.Logger:
        logger = logging.getLogger(name)
        if not hasattr(logger, "warning_once"):
            seen: set[tuple[int, str, str]] = set()

            def make_once(level: int):
                def log_once(msg: str, *args: Any, **kwargs: Any) -> None:
                    kwargs.pop("scope", None)
                    key = (level, str(msg), repr(args))
                    if key in seen:
                        return
                    seen.add(key)
                    logger.log(level, msg, *args, **kwargs)

                return log_once

            logger.debug_once = make_once(logging.DEBUG)  # type: ignore[attr-defined]
            logger.info_once = make_once(logging.INFO)  # type: ignore[attr-defined]
            logger.warning_once = make_once(logging.WARNING)  # type: ignore[attr-defined]
        return logger

    return _standin("vllm.logger", init_logger=init_logger, logger=init_logger("vllm"))


def _make_platforms_standin() -> types.ModuleType:
    class HarnessCpuPlatform:
        device_name = "cpu"
        device_type = "cpu"

        def is_cuda_alike(self) -> bool:
            return False

        def is_cuda(self) -> bool:
            return False

        def is_rocm(self) -> bool:
            return False

        def is_xpu(self) -> bool:
            return False

        def is_cpu(self) -> bool:
            return True

    return _standin("vllm.platforms", current_platform=HarnessCpuPlatform(),
                    HarnessCpuPlatform=HarnessCpuPlatform)


def _make_config_standin() -> types.ModuleType:
    class VllmConfig:
        """Placeholder: the engine config is not available in the harness."""

    class KVTransferConfig:
        """Placeholder: the engine config is not available in the harness."""

    return _standin("vllm.config", VllmConfig=VllmConfig, KVTransferConfig=KVTransferConfig)


def _make_connector_metrics_standin() -> types.ModuleType:
    @dataclasses.dataclass
    class KVConnectorStats:
        """Minimal base: a serializable ``data`` dict; subclasses do the rest."""

        data: dict[str, Any] = dataclasses.field(default_factory=dict)

        def to_dict(self) -> dict[str, Any]:
            return self.data

        def reset(self) -> None:
            raise NotImplementedError

        def aggregate(self, other: Any) -> Any:
            raise NotImplementedError

        def reduce(self) -> dict[str, int | float]:
            raise NotImplementedError

        def is_empty(self) -> bool:
            raise NotImplementedError

    class KVConnectorPromMetrics:
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            raise RuntimeError("Prometheus metrics are not available in the harness")

    return _standin(
        "vllm.distributed.kv_transfer.kv_connector.v1.metrics",
        KVConnectorStats=KVConnectorStats,
        KVConnectorPromMetrics=KVConnectorPromMetrics,
        PromMetric=object,
        PromMetricT=typing.TypeVar("PromMetricT"),
    )


def _make_kv_cache_interface_standin() -> types.ModuleType:
    layout = importlib.import_module("vllm.v1.kv_cache_layout")

    class KVCacheSpec:
        pass

    class AttentionSpec(KVCacheSpec):
        pass

    class MLAAttentionSpec(AttentionSpec):
        pass

    class MambaSpec(KVCacheSpec):
        pass

    class UniformTypeKVCacheSpecs(KVCacheSpec):
        pass

    class KVCacheConfig:
        pass

    return _standin(
        "vllm.v1.kv_cache_interface",
        KVCacheLayout=layout.KVCacheLayout,
        KVCacheSpec=KVCacheSpec,
        AttentionSpec=AttentionSpec,
        MLAAttentionSpec=MLAAttentionSpec,
        MambaSpec=MambaSpec,
        UniformTypeKVCacheSpecs=UniformTypeKVCacheSpecs,
        KVCacheConfig=KVCacheConfig,
    )


class HarnessSharedOffloadRegion:
    """Stand-in for vllm.v1.kv_offload.cpu.shared_offload_region.SharedOffloadRegion.

    Same constructor; backed by an anonymous page-aligned mmap instead of a
    /dev/shm file, viewed as numpy int8 (vLLM's region is torch.int8, so the
    memoryview format is 'b' as in vLLM). Only the scheduler-side API the
    tiering manager uses is provided: create_kv_memoryview() and cleanup().
    """

    BLOCK_SIZE_ALIGNMENT: int = mmap.PAGESIZE

    def __init__(
        self,
        engine_id: str,
        num_chunks: int,
        rank: int | None,
        kv_bytes_per_chunk: int,
        cpu_page_size: int,
        barrier: Any = None,
        num_segments: int = 1,
        populate_shard: Any = None,
        creator_memory_check: Any = None,
    ) -> None:
        assert kv_bytes_per_chunk % mmap.PAGESIZE == 0
        if rank is not None:
            raise RuntimeError("harness SharedOffloadRegion: worker-side regions are not supported")
        self.engine_id = engine_id
        self.num_chunks = num_chunks
        self.rank = rank
        self.cpu_page_size = cpu_page_size
        self._row_stride = kv_bytes_per_chunk
        self.total_size_bytes = num_chunks * kv_bytes_per_chunk
        self.primary = make_primary(num_chunks, kv_bytes_per_chunk, dtype=np.int8)

    @property
    def array(self) -> np.ndarray:
        """The region as uint8, shape (num_chunks, row_stride), zero-copy."""
        return self.primary.array.view(np.uint8)

    def create_kv_memoryview(self) -> memoryview:
        return memoryview(self.primary.array)

    def cleanup(self) -> None:
        # The numpy array (and views a test holds) keep the mmap alive; it is
        # unmapped when the last reference goes, as vLLM keeps a mapping that
        # still has exported buffers.
        pass


def _make_region_standin() -> types.ModuleType:
    # REGION_SEGMENTS: 0.34's cpu/spec.py imports it (segments of the /dev/shm mapping).
    return _standin("vllm.v1.kv_offload.cpu.shared_offload_region",
                    SharedOffloadRegion=HarnessSharedOffloadRegion, REGION_SEGMENTS=32)


def _make_gpu_worker_standin() -> types.ModuleType:
    class CPUOffloadingWorker:
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            raise RuntimeError("CPUOffloadingWorker (GPU<->CPU copies) is not available in the harness")

    return _standin("vllm.v1.kv_offload.cpu.gpu_worker", CPUOffloadingWorker=CPUOffloadingWorker)


def _make_kv_hints_standin() -> types.ModuleType:
    @dataclasses.dataclass(frozen=True)
    class KvHintAction:
        action_id: str
        action_type: str
        action_version: str
        payload: dict[str, Any]

    @dataclasses.dataclass(frozen=True)
    class KvHintsEnvelope:
        protocol_version: str
        message_id: str
        actions: list[KvHintAction]

    return _standin("vllm.v1.kv_hints", KvHintAction=KvHintAction, KvHintsEnvelope=KvHintsEnvelope)


def _install(name: str, mod: types.ModuleType | None) -> None:
    sys.modules[name] = mod  # type: ignore[assignment]
    parent, _, child = name.rpartition(".")
    if parent and mod is not None and parent in sys.modules:
        setattr(sys.modules[parent], child, mod)


# ---------------------------------------------------------------------------
# load_vllm
# ---------------------------------------------------------------------------


def _have_msgspec() -> bool:
    try:
        import msgspec  # noqa: F401
    except ImportError:
        return False
    return True


def load_vllm(wheel_path: str | os.PathLike | None = None,
              cache_dir: str | os.PathLike | None = None) -> types.SimpleNamespace:
    """Extract (or reuse) the tiering modules from the wheel and import them.

    Returns a namespace with the real vLLM classes (see the attribute list at
    the end of this function), plus ``modules`` (name -> real module loaded
    from the wheel), ``standins`` (name -> reason), ``root`` (the extracted
    directory), ``wheel_path`` and ``version``. Idempotent per process.

    Raises WheelNotFoundError (a FileNotFoundError) naming how to get the wheel.
    """
    wheel = find_wheel(wheel_path)
    with _lock:
        root = extract_wheel(wheel, cache_dir)
        if root in _loaded:
            return _loaded[root]
        existing = sys.modules.get("vllm")
        if existing is not None:
            paths = list(getattr(existing, "__path__", []))
            if _loaded or os.path.join(root, "vllm") not in paths:
                raise RuntimeError(
                    f"another 'vllm' package is already imported from {paths}; "
                    "the harness needs its own extracted copy (load it first, once per process)"
                )
        ns = _import_all(root)
        ns.wheel_path = wheel
        _loaded[root] = ns
        return ns


# Libraries vllm/fs_io_C.abi3.so names in DT_NEEDED without using a symbol of them (it calls
# only the Python C API, libc and libstdc++): empty stand-ins with these sonames let it load.
_FS_IO_C_TORCH_SONAMES = ("libtorch.so", "libc10.so", "libnvrtc.so.13", "libc10_cuda.so",
                          "libtorch_cpu.so", "libtorch_cuda.so")


def _enable_fs_io_c(root: str) -> None:
    """Load vLLM's real C extension for the fs tier (batched open/write/read/rename with the
    GIL released, its production path): extract it from the wheel, build empty stand-ins for
    the torch and CUDA libraries it links without using (gcc), and preload them so the
    dynamic linker matches them by soname. Opt in with KVTIER_VLLM_FS_IO_C=1 (benchmarks)."""
    import ctypes
    import subprocess

    so = os.path.join(root, "vllm", "fs_io_C.abi3.so")
    if not os.path.exists(so):
        with zipfile.ZipFile(find_wheel()) as zf:
            data = zf.read("vllm/fs_io_C.abi3.so")
        tmp = so + ".tmp"
        with open(tmp, "wb") as f:
            f.write(data)
        os.replace(tmp, so)
    stubs = os.path.join(root, "stub-libs")
    os.makedirs(stubs, exist_ok=True)
    src = os.path.join(stubs, "empty.c")
    with open(src, "w") as f:
        f.write("/* an empty stand-in library for vllm/fs_io_C.abi3.so */\n")
    for soname in _FS_IO_C_TORCH_SONAMES:
        lib = os.path.join(stubs, soname)
        if not os.path.exists(lib):
            subprocess.run(["gcc", "-shared", "-fPIC", f"-Wl,-soname,{soname}", "-o", lib, src],
                           check=True)
        ctypes.CDLL(lib, mode=ctypes.RTLD_GLOBAL)


def _import_all(root: str) -> types.SimpleNamespace:
    if root not in sys.path:
        sys.path.insert(0, root)
    importlib.invalidate_caches()
    use_real_hints = _have_msgspec()

    torch_was_loaded = "torch" in sys.modules
    if not torch_was_loaded:
        _install("torch", _make_torch_standin())
    standins: dict[str, str] = {}
    try:
        importlib.import_module("vllm")
        importlib.import_module("vllm.v1")
        importlib.import_module("vllm.v1.kv_offload.cpu")
        importlib.import_module("vllm.distributed.kv_transfer.kv_connector.v1")
        builders = {
            "vllm.logger": _make_logger_standin,
            "vllm.platforms": _make_platforms_standin,
            "vllm.config": _make_config_standin,
            "vllm.distributed.kv_transfer.kv_connector.v1.metrics": _make_connector_metrics_standin,
            "vllm.v1.kv_offload.cpu.shared_offload_region": _make_region_standin,
            "vllm.v1.kv_offload.cpu.gpu_worker": _make_gpu_worker_standin,
        }
        if not use_real_hints:
            builders["vllm.v1.kv_hints"] = _make_kv_hints_standin
        for name, build in builders.items():
            _install(name, build())
            standins[name] = STANDIN_REASONS[name]
        if os.environ.get("KVTIER_VLLM_FS_IO_C") == "1":
            _enable_fs_io_c(root)
        else:
            _install("vllm.fs_io_C", None)
            standins["vllm.fs_io_C"] = STANDIN_REASONS["vllm.fs_io_C"]

        modules: dict[str, types.ModuleType] = {}
        for name in REAL_MODULES:
            if name in _KV_HINTS_MODULES and not use_real_hints:
                continue
            modules[name] = importlib.import_module(name)
            if name == "vllm.v1.kv_cache_layout":
                _install("vllm.v1.kv_cache_interface", _make_kv_cache_interface_standin())
                standins["vllm.v1.kv_cache_interface"] = STANDIN_REASONS["vllm.v1.kv_cache_interface"]
    finally:
        if not torch_was_loaded:
            sys.modules.pop("torch", None)
    if not torch_was_loaded:
        standins["torch"] = STANDIN_REASONS["torch"]

    # Every real module must come from the extracted copy, none from elsewhere.
    for name, mod in modules.items():
        f = os.path.abspath(getattr(mod, "__file__", "") or "")
        assert f.startswith(os.path.abspath(root) + os.sep), f"{name} loaded from {f}"
    packages = {
        name: mod for name, mod in sys.modules.items()
        if mod is not None and (name == "vllm" or name.startswith("vllm."))
        and name not in modules and not getattr(mod, "__kvtier_standin__", False)
        and hasattr(mod, "__path__")
    }

    m = modules
    base = m["vllm.v1.kv_offload.base"]
    cfg = m["vllm.v1.kv_offload.config"]
    tb = m["vllm.v1.kv_offload.tiering.base"]
    tm = m["vllm.v1.kv_offload.tiering.manager"]
    bp = m["vllm.v1.kv_offload.tiering.backpressure"]
    fsm = m["vllm.v1.kv_offload.tiering.fs.manager"]
    cpu_common = m["vllm.v1.kv_offload.cpu.common"]
    ns = types.SimpleNamespace(
        version=VLLM_VERSION,
        root=root,
        modules=modules,
        packages=packages,
        standins=standins,
        num_modules=len(modules) + len(packages),
        fs_io_C_available=bool(getattr(m["vllm.v1.kv_offload.tiering.fs.io"], "_HAS_FSIO_C")),
        fs_batch_lookup_C_available=bool(getattr(fsm, "_HAS_BATCH_LOOKUP_C")),
        # config.py
        OffloadingConfig=cfg.OffloadingConfig,
        OffloadingGroupConfig=cfg.OffloadingGroupConfig,
        OffloadingModelConfig=cfg.OffloadingModelConfig,
        OffloadingCacheConfig=cfg.OffloadingCacheConfig,
        OffloadingParallelConfig=cfg.OffloadingParallelConfig,
        # base.py
        OffloadKey=base.OffloadKey,
        make_offload_key=base.make_offload_key,
        get_offload_block_hash=base.get_offload_block_hash,
        get_offload_group_idx=base.get_offload_group_idx,
        Medium=base.Medium,
        Locality=base.Locality,
        TierMatcher=base.TierMatcher,
        TierFilter=base.TierFilter,
        ReqContext=base.ReqContext,
        LookupResult=base.LookupResult,
        OffloadPolicy=base.OffloadPolicy,
        RequestOffloadingContext=base.RequestOffloadingContext,
        ScheduleEndContext=base.ScheduleEndContext,
        LoadStoreSpec=base.LoadStoreSpec,
        PrepareStoreOutput=base.PrepareStoreOutput,
        OffloadingEvent=base.OffloadingEvent,
        OffloadingMetricMetadata=base.OffloadingMetricMetadata,
        OffloadingCounterMetadata=base.OffloadingCounterMetadata,
        OffloadingGaugeMetadata=base.OffloadingGaugeMetadata,
        OffloadingHistogramMetadata=base.OffloadingHistogramMetadata,
        OffloadingKVEventsConfig=base.OffloadingKVEventsConfig,
        ConfigInfoMapping=base.ConfigInfoMapping,
        ConfigInfo=base.ConfigInfo,
        OffloadingManager=base.OffloadingManager,
        OffloadingSpec=base.OffloadingSpec,
        OffloadingSpecFactory=m["vllm.v1.kv_offload.factory"].OffloadingSpecFactory,
        FileMapper=m["vllm.v1.kv_offload.file_mapper"].FileMapper,
        CacheHitSource=m["vllm.v1.metrics.cache_hit_source"].CacheHitSource,
        OffloadingConnectorStats=m[
            "vllm.distributed.kv_transfer.kv_connector.v1.offloading.metrics"
        ].OffloadingConnectorStats,
        canonical_format_id=m[
            "vllm.distributed.kv_transfer.kv_connector.v1.offloading.canonical_mapping"
        ].canonical_format_id,
        # cpu/
        CPULoadStoreSpec=cpu_common.CPULoadStoreSpec,
        CPUOffloadingInfo=cpu_common.CPUOffloadingInfo,
        CPUOffloadingManager=m["vllm.v1.kv_offload.cpu.manager"].CPUOffloadingManager,
        CPUOffloadingSpec=m["vllm.v1.kv_offload.cpu.spec"].CPUOffloadingSpec,
        CachePolicyFactory=m["vllm.v1.kv_offload.cpu.policies.factory"].CachePolicyFactory,
        SharedOffloadRegion=HarnessSharedOffloadRegion,  # stand-in
        # tiering/
        JobId=tb.JobId,
        TIER_LABEL=tb.TIER_LABEL,
        TieringOffloadingMetrics=tb.TieringOffloadingMetrics,
        TransferJob=tb.TransferJob,
        JobResult=tb.JobResult,
        ParentManager=tb.ParentManager,
        SecondaryTierManager=tb.SecondaryTierManager,
        SecondaryTierFactory=m["vllm.v1.kv_offload.tiering.factory"].SecondaryTierFactory,
        BackpressureDetector=bp.BackpressureDetector,
        BackpressurePolicy=bp.BackpressurePolicy,
        EMABackpressureDetector=bp.EMABackpressureDetector,
        DropStorePolicy=bp.DropStorePolicy,
        ThrottledDropPolicy=bp.ThrottledDropPolicy,
        AsyncLookupManager=m["vllm.v1.kv_offload.tiering.async_lookup"].AsyncLookupManager,
        TieringMetricsTracker=m["vllm.v1.kv_offload.tiering.metrics"].TieringMetricsTracker,
        TieringOffloadingManager=tm.TieringOffloadingManager,
        CPUPrimaryTierOffloadingManager=tm.CPUPrimaryTierOffloadingManager,
        TieringOffloadingSpec=m["vllm.v1.kv_offload.tiering.spec"].TieringOffloadingSpec,
        FileSystemTierManager=fsm.FileSystemTierManager,
        FsAsyncLookupManager=fsm.FsAsyncLookupManager,
        DualQueueThreadPool=m["vllm.v1.kv_offload.tiering.fs.thread_pool"].DualQueueThreadPool,
        fs_io=m["vllm.v1.kv_offload.tiering.fs.io"],
        ExampleSecondaryTierManager=m[
            "vllm.v1.kv_offload.tiering.example.manager"
        ].ExampleSecondaryTierManager,
    )
    ns.EMPTY_SCHEDULE_END = ns.ScheduleEndContext(new_req_ids=(), preempted_req_ids=())
    return ns


def _vllm(vllm: types.SimpleNamespace | None) -> types.SimpleNamespace:
    return vllm if vllm is not None else load_vllm()


# ---------------------------------------------------------------------------
# Spec, primary buffer, orchestrator
# ---------------------------------------------------------------------------


def make_spec(
    vllm: types.SimpleNamespace | None = None,
    *,
    num_blocks: int = 16,
    block_bytes: int = 256 * 1024,
    model_name: str = "kvtier-test/tiny-model",
    dtype: str = "bfloat16",
    tokens_per_block: int = 16,
    tokens_per_hash: int | None = None,
    blocks_per_chunk: int = 1,
    layer_names: Sequence[str] | None = None,
    groups: Sequence[Any] | None = None,
    tp_size: int = 1,
    pp_size: int = 1,
    pcp_size: int = 1,
    dcp_size: int = 1,
    rank: int = 0,
    world_size: int | None = None,
    data_parallel_index: int = 0,
    data_parallel_size: int = 1,
    data_parallel_rank_local: int | None = None,
    is_parallelism_agnostic: bool = False,
    replicated_layout: bool = False,
    canonical_layout: bool = False,
    kv_cache_layout: str | None = None,
    enable_kv_cache_events: bool = False,
    self_describing_kv_events: bool = False,
    engine_id: str = "kvtier-harness",
    max_model_len: int = 0,
    secondary_tiers: list[dict] | None = None,
    extra_config: dict[str, Any] | None = None,
):
    """Build a real ``TieringOffloadingSpec`` over a real ``OffloadingConfig``.

    Everything here is real vLLM: the frozen config dataclasses from
    vllm/v1/kv_offload/config.py and the spec class itself, so
    ``spec.config`` (groups, model, cache, parallel, replicated/canonical
    layout, kv_cache_layout), ``spec.kv_events_config``,
    ``spec.blocks_per_chunk``, ``spec.tokens_per_hash``, ``spec.extra_config``,
    ``spec.num_chunks`` and ``spec.kv_bytes_per_chunk`` are what vLLM computes.
    What vLLM derives from the engine (build_offloading_config) is given as
    arguments instead: ``worker_kv_bytes_per_block`` is chosen so one chunk is
    exactly ``block_bytes`` (block_bytes / (blocks_per_chunk * copies), copies
    = 1 with replicated_layout else world_size) and ``cpu_bytes_to_use`` is
    ``num_blocks * block_bytes``, so ``spec.num_chunks == num_blocks``.

    ``groups``: OffloadingGroupConfig objects or dicts with tokens_per_block,
    layer_names, group_id (default: one group of ``layer_names``).
    ``world_size`` defaults to tp * pp * pcp. ``canonical_layout=True``
    defaults ``kv_cache_layout`` to "LBNHC" (FileMapper then adds the real
    canonical_format_id, "v1-nhd").
    """
    v = _vllm(vllm)
    if block_bytes <= 0 or block_bytes % mmap.PAGESIZE:
        raise ValueError(f"block_bytes must be a positive multiple of {mmap.PAGESIZE}")
    if world_size is None:
        world_size = tp_size * pp_size * pcp_size
    copies = 1 if replicated_layout else world_size
    if block_bytes % (blocks_per_chunk * copies):
        raise ValueError("block_bytes must divide by blocks_per_chunk * world_size")
    if layer_names is None:
        layer_names = tuple(f"model.layers.{i}.self_attn.attn" for i in range(2))
    if groups is None:
        groups = [{"tokens_per_block": tokens_per_block, "layer_names": layer_names, "group_id": 0}]
    group_cfgs = tuple(
        g if isinstance(g, v.OffloadingGroupConfig) else v.OffloadingGroupConfig(
            tokens_per_block=int(g["tokens_per_block"]),
            layer_names=tuple(g["layer_names"]),
            group_id=int(g.get("group_id", i)),
            sliding_window_size_in_chunks=g.get("sliding_window_size_in_chunks"),
        )
        for i, g in enumerate(groups)
    )
    if canonical_layout and kv_cache_layout is None:
        kv_cache_layout = "LBNHC"
    extra: dict[str, Any] = {"cpu_bytes_to_use": num_blocks * block_bytes}
    if secondary_tiers is not None:
        extra["secondary_tiers"] = copy.deepcopy(list(secondary_tiers))
    if self_describing_kv_events:
        extra["self_describing_kv_events"] = True
    if canonical_layout:
        extra["canonical_layout"] = True
    extra.update(extra_config or {})
    config = v.OffloadingConfig(
        groups=group_cfgs,
        worker_kv_bytes_per_block=block_bytes // (blocks_per_chunk * copies),
        enable_kv_cache_events=enable_kv_cache_events,
        extra_config=extra,
        engine_id=engine_id,
        model=v.OffloadingModelConfig(name=model_name, dtype=dtype, max_model_len=max_model_len),
        cache=v.OffloadingCacheConfig(
            tokens_per_hash=tokens_per_hash if tokens_per_hash is not None else tokens_per_block,
            blocks_per_chunk=blocks_per_chunk,
        ),
        parallel=v.OffloadingParallelConfig(
            rank=rank,
            world_size=world_size,
            tp_size=tp_size,
            pp_size=pp_size,
            pcp_size=pcp_size,
            dcp_size=dcp_size,
            data_parallel_index=data_parallel_index,
            data_parallel_size=data_parallel_size,
            data_parallel_rank_local=data_parallel_rank_local,
            is_parallelism_agnostic=is_parallelism_agnostic,
        ),
        replicated_layout=replicated_layout,
        canonical_layout=canonical_layout,
        kv_cache_layout=kv_cache_layout,
    )
    return v.TieringOffloadingSpec(config)


class Primary(NamedTuple):
    """A primary KV buffer: ``array`` (num_blocks, block_bytes) over a
    page-aligned anonymous mmap, and ``view``, its memoryview
    (``view.strides[0] == block_bytes``), what vLLM passes as primary_kv_view."""

    array: np.ndarray
    view: memoryview


def make_primary(num_blocks: int, block_bytes: int, dtype: Any = np.uint8) -> Primary:
    """Page-aligned writable buffer of num_blocks rows of block_bytes bytes.

    ``dtype`` must be a 1-byte type: uint8 (format 'B', default) or int8
    (format 'b', what vLLM's torch.int8 region yields)."""
    dt = np.dtype(dtype)
    if dt.itemsize != 1:
        raise ValueError("dtype must be 1 byte wide")
    if num_blocks <= 0 or block_bytes <= 0:
        raise ValueError("num_blocks and block_bytes must be positive")
    mm = mmap.mmap(-1, num_blocks * block_bytes)
    array = np.frombuffer(mm, dtype=dt).reshape(num_blocks, block_bytes)
    assert array.ctypes.data % mmap.PAGESIZE == 0
    view = memoryview(array)
    assert view.strides[0] == block_bytes and not view.readonly
    return Primary(array, view)


@dataclasses.dataclass
class Orchestrator:
    """What make_orchestrator built. ``manager`` is the real
    TieringOffloadingManager, ``spec`` the real TieringOffloadingSpec that
    built it, ``primary`` the CPU primary buffer as uint8 (num_chunks,
    block_bytes), zero-copy over the memoryview the tiers got."""

    manager: Any
    spec: Any
    primary: np.ndarray
    view: memoryview
    region: HarnessSharedOffloadRegion

    @property
    def primary_tier(self) -> Any:
        return self.manager.primary_tier

    @property
    def secondary_tiers(self) -> list[Any]:
        return self.manager.secondary_tiers

    def step(self, new_req_ids: Iterable[str] = (), preempted_req_ids: Iterable[str] = ()) -> None:
        """End one scheduler step (what vLLM's build_connector_meta() does)."""
        step(self.manager, new_req_ids, preempted_req_ids)

    def settle(self, timeout: float = 10.0) -> None:
        settle(self.manager, timeout)

    def shutdown(self) -> None:
        self.manager.shutdown()


def make_orchestrator(
    spec: Any,
    secondary_tiers_config: Sequence[dict],
    num_blocks: int,
    block_bytes: int,
    *,
    extra_config: dict[str, Any] | None = None,
    vllm: types.SimpleNamespace | None = None,
) -> Orchestrator:
    """Build the real TieringOffloadingManager exactly as vLLM does.

    A fresh real ``TieringOffloadingSpec`` is made from ``spec.config`` with
    ``cpu_bytes_to_use`` / ``worker_kv_bytes_per_block`` set so the CPU
    primary tier has ``num_blocks`` chunks of ``block_bytes`` and with
    ``secondary_tiers = secondary_tiers_config`` (deep-copied; the spec merges
    backpressure settings into them). Then ``spec.get_manager()`` runs vLLM's
    own code: SharedOffloadRegion(rank=None) (the harness stand-in: an
    anonymous mmap instead of /dev/shm), CPUPrimaryTierOffloadingManager,
    ``SecondaryTierFactory.create_secondary_tier(cfg, view, spec)`` per tier,
    and TieringOffloadingManager(primary, tiers, tier_poll_interval_s).
    No GPU worker is built (get_worker() would refuse: no CUDA).
    """
    v = _vllm(vllm)
    if block_bytes <= 0 or block_bytes % mmap.PAGESIZE:
        raise ValueError(f"block_bytes must be a positive multiple of {mmap.PAGESIZE}")
    config = spec.config
    copies = 1 if config.replicated_layout else config.parallel.world_size
    per_block, rem = divmod(block_bytes, config.cache.blocks_per_chunk * copies)
    if rem:
        raise ValueError("block_bytes must divide by blocks_per_chunk * world_size")
    extra = dict(config.extra_config)
    extra.update(extra_config or {})
    extra["cpu_bytes_to_use"] = num_blocks * block_bytes
    extra["secondary_tiers"] = copy.deepcopy(list(secondary_tiers_config))
    config = dataclasses.replace(config, worker_kv_bytes_per_block=per_block, extra_config=extra)
    tiering_spec = v.TieringOffloadingSpec(config)
    assert tiering_spec.num_chunks == num_blocks, tiering_spec.num_chunks
    assert tiering_spec.kv_bytes_per_chunk == block_bytes, tiering_spec.kv_bytes_per_chunk
    manager = tiering_spec.get_manager()
    region = manager.primary_tier._mmap_region
    view = manager.primary_tier.get_kv_memoryview()
    primary = np.asarray(view).view(np.uint8)
    assert primary.shape == (num_blocks, block_bytes)
    return Orchestrator(manager=manager, spec=tiering_spec, primary=primary, view=view, region=region)


# ---------------------------------------------------------------------------
# Helpers
# ---------------------------------------------------------------------------


def make_key(seed: bytes | str | int, group_idx: int = 0, vllm: types.SimpleNamespace | None = None):
    """OffloadKey of a 32-byte block hash (sha256 of ``seed``) and a group."""
    v = _vllm(vllm)
    if isinstance(seed, int):
        seed = str(seed)
    if isinstance(seed, str):
        seed = seed.encode()
    return v.make_offload_key(hashlib.sha256(seed).digest(), group_idx)


def _empty_context(context: Any = None) -> Any:
    if context is not None:
        return context
    return load_vllm().EMPTY_SCHEDULE_END


def step(manager_or_tier: Any, new_req_ids: Iterable[str] = (),
         preempted_req_ids: Iterable[str] = ()) -> None:
    """Call on_schedule_end once, as the scheduler does at the end of a step."""
    v = load_vllm()
    manager_or_tier.on_schedule_end(
        v.ScheduleEndContext(new_req_ids=tuple(new_req_ids), preempted_req_ids=tuple(preempted_req_ids))
    )


def drain(tier: Any) -> list[Any]:
    """Block until the tier's submitted jobs finished; return their JobResults."""
    tier.drain_jobs()
    return list(tier.get_finished_jobs())


def lookup_and_wait(tier: Any, key: Any, ctx: Any, timeout: float = 10.0,
                    context: Any = None, poll_s: float = 0.001) -> Any:
    """lookup(); while RETRY: on_schedule_end(), wait, lookup() again.

    Works on a SecondaryTierManager (the fs tier's async lookup posts its
    batch in on_schedule_end and applies results on the next lookup) and on
    the TieringOffloadingManager (which returns HIT_PENDING once it started a
    promotion). Returns the first non-RETRY LookupResult.
    """
    v = load_vllm()
    ctx_end = _empty_context(context)
    deadline = time.monotonic() + timeout
    result = tier.lookup(key, ctx)
    while result is v.LookupResult.RETRY:
        if time.monotonic() > deadline:
            raise TimeoutError(f"lookup of {key!r} still RETRY after {timeout}s")
        tier.on_schedule_end(ctx_end)
        time.sleep(poll_s)
        result = tier.lookup(key, ctx)
    return result


def lookup_all_and_wait(tier: Any, keys: Sequence[Any], ctx: Any, timeout: float = 10.0,
                        context: Any = None, poll_s: float = 0.001) -> list[Any]:
    """One scheduler-like round per step: look every key up, and while any is
    RETRY call on_schedule_end() and wait. Returns the first round's results
    that hold no RETRY. Keys whose async lookups were posted in the same step
    resolve in the same round, so their promotions are batched into one job.
    """
    v = load_vllm()
    ctx_end = _empty_context(context)
    deadline = time.monotonic() + timeout
    while True:
        results = [tier.lookup(key, ctx) for key in keys]
        if v.LookupResult.RETRY not in results:
            return results
        if time.monotonic() > deadline:
            raise TimeoutError(f"lookups still RETRY after {timeout}s: {results}")
        tier.on_schedule_end(ctx_end)
        time.sleep(poll_s)


def settle(manager: Any, timeout: float = 10.0, context: Any = None) -> None:
    """Step a TieringOffloadingManager until it has no pending work.

    Each round: on_schedule_end() (processes finished jobs, submits deferred
    promotions, flushes tier lookups), then drain_jobs() on every secondary
    tier. Ends with the primary tier reflecting every completed transfer.
    """
    ctx_end = _empty_context(context)
    deadline = time.monotonic() + timeout
    while True:
        manager.on_schedule_end(ctx_end)
        if not manager.has_pending_work():
            return
        if time.monotonic() > deadline:
            raise TimeoutError(f"manager still has pending work after {timeout}s")
        for tier in manager.secondary_tiers:
            tier.drain_jobs()


def make_job(key_list: Sequence[Any], chunk_ids: Sequence[int], job_id: int,
             ctx: Any, is_promotion: bool, vllm: types.SimpleNamespace | None = None):
    """A real TransferJob (store: is_promotion=False; load: True)."""
    v = _vllm(vllm)
    return v.TransferJob(job_id=job_id, keys=list(key_list),
                         chunk_ids=np.asarray(chunk_ids, dtype=np.int32),
                         is_promotion=is_promotion, req_context=ctx)
