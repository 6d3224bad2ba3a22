"""The few torch calls vLLM's own fs-tier tests make (``tests/v1/kv_offload/tiering/
test_fs_tier.py``), on numpy, so those tests run without a 2 GB torch install: tensors are only
made, filled, sliced, viewed and compared there; the tier under test takes a memoryview.

Also what vLLM's real ``SharedOffloadRegion`` calls to wrap its mapping (``frombuffer``).

And what SGLang's HiCache storage and host-pool code calls on its tensors, for the SGLang tests
(``python/tests/sglang_harness.py``): page slices, ``flatten``, ``reshape``, ``contiguous``,
``tolist``, ``item``, ``arange``, ``empty``.

Provided: the dtypes the tests name (with ``itemsize``), ``zeros``, ``empty``, ``rand``,
``tensor``, ``arange``, ``allclose``, ``Tensor`` (``data_ptr``, ``element_size``, ``numel``,
``view`` by dtype or shape, ``reshape``, ``flatten``, ``contiguous``, ``tolist``, ``item``,
``numpy``, indexing and slice assignment, ``shape``, ``dtype``). Anything else raises
``AttributeError``, so a test needing more of torch fails loudly instead of passing on a
stand-in.
"""

from __future__ import annotations

from typing import Any

import numpy as np


class dtype:  # noqa: N801 - torch's name
    def __init__(self, name: str, np_dtype: Any) -> None:
        self.name = name
        self.np = np.dtype(np_dtype)

    @property
    def itemsize(self) -> int:
        return self.np.itemsize

    def __repr__(self) -> str:
        return f"torch.{self.name}"

    def __str__(self) -> str:
        return f"torch.{self.name}"


float32 = float = dtype("float32", np.float32)
float16 = half = dtype("float16", np.float16)
bfloat16 = dtype("bfloat16", np.uint16)  # same width; the tests only move bytes
uint8 = dtype("uint8", np.uint8)
int8 = dtype("int8", np.int8)
int32 = dtype("int32", np.int32)
int64 = long = dtype("int64", np.int64)
_BY_NP = {d.np: d for d in (float32, float16, bfloat16, uint8, int8, int32, int64)}


class Tensor:
    def __init__(self, array: np.ndarray) -> None:
        self._a = array

    @property
    def shape(self) -> tuple[int, ...]:
        return self._a.shape

    @property
    def dtype(self) -> dtype:
        return _BY_NP[self._a.dtype]

    def data_ptr(self) -> int:
        return self._a.ctypes.data

    def element_size(self) -> int:
        return self._a.itemsize

    def numel(self) -> int:
        return self._a.size

    def numpy(self) -> np.ndarray:
        return self._a

    def view(self, *shape: Any, **kw: Any) -> Tensor:
        if "dtype" in kw:
            shape = (kw.pop("dtype"),)
        if len(shape) == 1 and isinstance(shape[0], dtype):
            return Tensor(self._a.view(shape[0].np))
        if len(shape) == 1 and isinstance(shape[0], tuple):
            shape = shape[0]
        if not self._a.flags.c_contiguous:
            raise RuntimeError("view of a non-contiguous tensor (as torch: use reshape)")
        return Tensor(self._a.reshape(shape))

    def reshape(self, *shape: Any) -> Tensor:
        if len(shape) == 1 and isinstance(shape[0], tuple):
            shape = shape[0]
        return Tensor(self._a.reshape(shape))

    def flatten(self) -> Tensor:
        return Tensor(self._a.reshape(-1))

    def contiguous(self) -> Tensor:
        return self if self._a.flags.c_contiguous else Tensor(np.ascontiguousarray(self._a))

    def tolist(self) -> Any:
        return self._a.tolist()

    def item(self) -> Any:
        return self._a.item()

    def clone(self) -> Tensor:
        return Tensor(self._a.copy())

    def __getitem__(self, idx: Any) -> Tensor:
        return Tensor(self._a[_unwrap(idx)])

    def __setitem__(self, idx: Any, value: Any) -> None:
        self._a[_unwrap(idx)] = _unwrap(value)

    def __len__(self) -> int:
        return len(self._a)

    def __eq__(self, other: Any) -> Tensor:  # type: ignore[override]
        return Tensor(self._a == _unwrap(other))

    def all(self) -> bool:
        return bool(self._a.all())

    def __bool__(self) -> bool:
        return bool(self._a)


def _unwrap(x: Any) -> Any:
    if isinstance(x, Tensor):
        return x._a
    if isinstance(x, tuple):
        return tuple(_unwrap(i) for i in x)
    return x


def zeros(*shape: Any, dtype: dtype = float32, device: Any = "cpu", pin_memory: bool = False) -> Tensor:
    if len(shape) == 1 and isinstance(shape[0], tuple):
        shape = shape[0]
    if str(device) != "cpu":
        raise RuntimeError(f"the torch stand-in has no device {device!r}")
    return Tensor(np.zeros(shape, dtype=dtype.np))


def empty(*shape: Any, dtype: dtype = float32, device: Any = "cpu", pin_memory: bool = False) -> Tensor:
    return zeros(*shape, dtype=dtype, device=device, pin_memory=pin_memory)


def arange(*args: int, dtype: dtype = int64) -> Tensor:
    return Tensor(np.arange(*args, dtype=dtype.np))


def rand(*shape: Any, dtype: dtype = float32) -> Tensor:
    if len(shape) == 1 and isinstance(shape[0], tuple):
        shape = shape[0]
    return Tensor(np.random.default_rng().random(shape).astype(dtype.np))


def tensor(data: Any, dtype: dtype = float32) -> Tensor:
    return Tensor(np.asarray(data, dtype=dtype.np))


def frombuffer(buffer: Any, dtype: dtype = uint8) -> Tensor:
    """Zero-copy, as torch's: vLLM's SharedOffloadRegion wraps its mmap with it."""
    return Tensor(np.frombuffer(buffer, dtype=dtype.np))


def allclose(a: Tensor, b: Tensor, rtol: float = 1e-05, atol: float = 1e-08) -> bool:
    return bool(np.allclose(_unwrap(a), _unwrap(b), rtol=rtol, atol=atol))

