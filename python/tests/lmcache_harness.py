"""Run LMCache's real L2 adapter code (its multi-process server's storage layer) on CPU.

The wheel is ``lmcache-$KVTIER_LMCACHE_VERSION`` (default ``LMCACHE_VERSION``), found in
``$KVTIER_LMCACHE_WHEEL_DIR`` (``tools/test.sh`` downloads it there) or named by
``$KVTIER_LMCACHE_WHEEL``; its modules are read from the wheel (``wheel_modules.py``), not
installed (LMCache's package imports torch and its CUDA extension).

Real LMCache code (from the wheel, unmodified): the ``--l2-adapter`` argument and its parsing
(``l2_adapters/config.py``: ``add_l2_adapters_args``, ``parse_args_to_l2_adapters_config``), the
adapter registry and factory (``l2_adapters/__init__.py``, ``factory.py``), the
``native_plugin`` type that loads a connector by module path (``native_plugin_l2_adapter.py``),
the ``NativeConnectorL2Adapter`` that wraps it (``native_connector_l2_adapter.py``: its demux
thread polling the connector's event fd, key strings, buffers, per-key results), the
``L2AdapterInterface`` base with its byte accounting and events (``base.py``,
``mp_observability/event.py``, ``event_bus.py``, ``otel_init.py``), ``ObjectKey`` and the other
API types (``api.py``, ``internal_api.py``, ``error.py``), the eventfd notifiers
(``platform/event_notifier.py``), ``lmcache/logging.py``, and LMCache's own file-system adapter
(``fs_l2_adapter.py``, the benchmark's reference; it needs ``aiofiles``).

Stand-ins:

* ``torch``: numpy-backed (``vllm_own/torch_standin.py``), only while the modules import.
* ``lmcache.lmcache_native.Bitmap``: a Python bitmap with the methods the adapters call (the
  real one is in a C++ extension that links libtorch).
* ``lmcache.v1.memory_management``: ``MemoryObj`` and ``TensorMemoryObj`` over a numpy byte
  buffer, with the attributes the adapters read (``byte_array``, ``get_size``,
  ``get_physical_size``, ``data_ptr``, ``tensor``, ``metadata``); LMCache's pulls in its
  allocators and CUDA.
* ``lmcache.v1.platform``: the package (device detection) is a stub exposing the real
  ``create_event_notifier``; every other ``lmcache.*`` module the real files import is a stub
  (``wheel_modules.Stub``: ``STUBBED`` lists them).
"""

from __future__ import annotations

import argparse
import importlib
import json
import mmap
import os
import sys
import types
from typing import Any

import numpy as np

import wheel_modules

LMCACHE_VERSION = os.environ.get("KVTIER_LMCACHE_VERSION", "0.5.6")
_D = "lmcache/v1/distributed/"
_REAL = [
    "lmcache/logging.py",
    _D + "api.py",
    _D + "error.py",
    _D + "internal_api.py",
    _D + "l2_adapters/__init__.py",
    _D + "l2_adapters/base.py",
    _D + "l2_adapters/config.py",
    _D + "l2_adapters/factory.py",
    _D + "l2_adapters/native_plugin_l2_adapter.py",
    _D + "l2_adapters/native_connector_l2_adapter.py",
    _D + "l2_adapters/plugin_l2_adapter.py",
    _D + "l2_adapters/fs_l2_adapter.py",
    "lmcache/v1/mp_observability/event.py",
    "lmcache/v1/mp_observability/event_bus.py",
    "lmcache/v1/mp_observability/otel_init.py",
    "lmcache/v1/platform/event_notifier.py",
]
_EMPTY_PACKAGES = ("lmcache", "lmcache.v1", "lmcache.v1.distributed",
                   "lmcache.v1.mp_observability")

STUBBED: set[str] = set()
WheelNotFoundError = wheel_modules.WheelNotFoundError


def find_wheel() -> str:
    return wheel_modules.find_wheel("lmcache", LMCACHE_VERSION, "KVTIER_LMCACHE")


class Bitmap:
    """lmcache_native.Bitmap's behaviour, in Python."""

    def __init__(self, size: int, prefix_bits: int = 0) -> None:
        self._bits = [i < prefix_bits for i in range(size)]

    def set(self, index: int) -> None:
        self._bits[index] = True

    def batched_set(self, indices: Any) -> None:
        for i in indices:
            self._bits[i] = True

    def set_range(self, start: int, end: int) -> None:
        for i in range(start, end):
            self._bits[i] = True

    def clear(self, index: int) -> None:
        self._bits[index] = False

    def test(self, index: int) -> bool:
        return self._bits[index]

    def size(self) -> int:
        return len(self._bits)

    def __len__(self) -> int:
        return len(self._bits)

    def popcount(self) -> int:
        return sum(self._bits)

    def count_leading_ones(self) -> int:
        n = 0
        for b in self._bits:
            if not b:
                break
            n += 1
        return n

    def get_indices_list(self) -> list[int]:
        return [i for i, b in enumerate(self._bits) if b]

    def __repr__(self) -> str:
        return "Bitmap(" + "".join("1" if b else "0" for b in self._bits) + ")"


class TensorMemoryObj:
    """An L1 object: `size` logical bytes in an allocation of `physical` bytes."""

    def __init__(self, size: int, physical: int | None = None) -> None:
        physical = physical or size
        self._map = mmap.mmap(-1, max(physical, 1))
        self._array = np.frombuffer(self._map, dtype=np.uint8)[:physical]
        self._size = size
        self.metadata = types.SimpleNamespace(cached_positions=None)

    @property
    def byte_array(self) -> memoryview:
        return memoryview(self._array[: self._size])

    @property
    def data_ptr(self) -> int:
        return self._array.ctypes.data

    def get_size(self) -> int:
        return self._size

    def get_physical_size(self) -> int:
        return self._array.size

    @property
    def array(self) -> np.ndarray:
        return self._array[: self._size]


class ArenaObj(TensorMemoryObj):
    """An L1 object carved from an `Arena`: `size` logical bytes at `offset`, in an
    allocation of `physical` bytes (the size rounded up to the arena's alignment)."""

    def __init__(self, arena: "Arena", offset: int, size: int, physical: int) -> None:
        self._map = arena.map
        self._array = arena.bytes[offset:offset + physical]
        self._size = size
        self.metadata = types.SimpleNamespace(cached_positions=None)


class Arena:
    """LMCache's L1 arena as its allocator hands it out: one mapping, objects at offsets
    that are multiples of `align` (a bump allocator here), and its `L1MemoryDesc`, whose
    stable prefix is `stable` bytes (-1: the whole arena; None: none, as for shared memory)."""

    def __init__(self, lm: types.SimpleNamespace, size: int, align: int,
                 thp: bool = False, stable: int | None = -1) -> None:
        self.map = mmap.mmap(-1, size)
        if thp:
            # As LMCache's --l1-use-hugepages backs it (there from the hugetlb pool).
            self.map.madvise(mmap.MADV_HUGEPAGE)
        self.bytes = np.frombuffer(self.map, dtype=np.uint8)
        self.align = align
        self.next = 0
        self.desc = lm.L1MemoryDesc(ptr=int(self.bytes.ctypes.data), size=size,
                                    align_bytes=align,
                                    stable_registration_size=size if stable == -1 else stable)

    def allocate(self, size: int) -> ArenaObj:
        physical = -(-size // self.align) * self.align
        if self.next + physical > self.bytes.size:
            raise MemoryError("arena full")
        obj = ArenaObj(self, self.next, size, physical)
        self.next += physical
        return obj


MemoryObj = TensorMemoryObj

_loaded: types.SimpleNamespace | None = None


def load_lmcache() -> types.SimpleNamespace:
    """Imports the real modules (once per process); returns what the tests use."""
    global _loaded
    if _loaded is not None:
        return _loaded
    wheel = find_wheel()
    standin = "torch" not in sys.modules
    if standin:
        try:
            import torch  # noqa: F401
            standin = False
        except ImportError:
            sys.path.insert(0, os.path.join(os.path.dirname(__file__), "vllm_own"))
            import torch_standin

            sys.modules["torch"] = torch_standin
    modules = wheel_modules.WheelModules(wheel, _REAL, ("lmcache",))
    modules.install()
    for pkg in _EMPTY_PACKAGES:
        wheel_modules.empty_package(pkg)
    native = modules.add_stub("lmcache.lmcache_native", types.ModuleType("lmcache.lmcache_native"))
    native.Bitmap = Bitmap
    mm = modules.add_stub("lmcache.v1.memory_management",
                          types.ModuleType("lmcache.v1.memory_management"))
    mm.MemoryObj = MemoryObj
    mm.TensorMemoryObj = TensorMemoryObj
    platform = modules.add_stub("lmcache.v1.platform")
    notifier = importlib.import_module("lmcache.v1.platform.event_notifier")
    platform.create_event_notifier = notifier.create_event_notifier
    modules.import_all()
    importlib.import_module("kvtier.lmcache")
    if standin:
        del sys.modules["torch"]
    STUBBED.update(modules.stubbed)
    l2 = sys.modules["lmcache.v1.distributed.l2_adapters"]
    cfg = sys.modules["lmcache.v1.distributed.l2_adapters.config"]
    api = sys.modules["lmcache.v1.distributed.api"]
    _loaded = types.SimpleNamespace(
        wheel=wheel,
        version=LMCACHE_VERSION,
        ObjectKey=api.ObjectKey,
        L1MemoryDesc=sys.modules["lmcache.v1.distributed.internal_api"].L1MemoryDesc,
        add_l2_adapters_args=cfg.add_l2_adapters_args,
        parse_args_to_l2_adapters_config=cfg.parse_args_to_l2_adapters_config,
        create_l2_adapter=l2.create_l2_adapter,
        NativeConnectorL2Adapter=sys.modules[
            "lmcache.v1.distributed.l2_adapters.native_connector_l2_adapter"
        ].NativeConnectorL2Adapter,
    )
    return _loaded


def adapter_from_cli(lm: types.SimpleNamespace, spec: dict[str, Any],
                     l1_memory_desc: Any = None) -> Any:
    """The adapter LMCache's server builds from `--l2-adapter '<spec as JSON>'` (its storage
    manager hands every adapter the L1 arena's description)."""
    parser = argparse.ArgumentParser()
    lm.add_l2_adapters_args(parser)
    args = parser.parse_args(["--l2-adapter", json.dumps(spec)])
    [config] = lm.parse_args_to_l2_adapters_config(args).adapters
    return lm.create_l2_adapter(config, l1_memory_desc)


def object_key(lm: types.SimpleNamespace, i: int, model: str = "meta-llama/Llama-3.1-8B",
               salt: str = "") -> Any:
    return lm.ObjectKey(chunk_hash=i.to_bytes(8, "big") * 4, model_name=model, kv_rank=0,
                        object_group_id=0, cache_salt=salt)


def wait_fd(fd: int, timeout: float = 10.0) -> bool:
    """Whether `fd` becomes readable within `timeout` seconds (then drained, as LMCache does)."""
    import select

    p = select.poll()
    p.register(fd, select.POLLIN)
    if not p.poll(int(timeout * 1000)):
        return False
    try:
        os.read(fd, 8)
    except BlockingIOError:
        pass
    return True
