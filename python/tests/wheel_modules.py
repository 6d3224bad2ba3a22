"""Import a few real modules of a Python package straight from its wheel, without installing it.

The SGLang and LMCache harnesses (``sglang_harness.py``, ``lmcache_harness.py``) use it: those
packages' ``__init__`` files and most of their modules pull in a whole server, torch and CUDA
kernels, while the code kvtier plugs into is a handful of modules. ``WheelModules`` serves the
named members of the wheel under their own module names (executed unmodified), and answers every
other import under the given roots with a stub: an empty module whose capitalised names are empty
classes and whose other names are functions returning ``False`` (``is_cuda()`` and the like,
called at import). ``stubbed`` lists the stubs actually imported; a test that reached into one
would fail on a ``False`` or an empty class, never pass on it.
"""

from __future__ import annotations

import glob
import importlib
import importlib.abc
import importlib.machinery
import os
import sys
import types
import zipfile
from typing import Any


class WheelNotFoundError(FileNotFoundError):
    pass


def find_wheel(package: str, version: str, env_prefix: str) -> str:
    """`$<env_prefix>_WHEEL`, else `<package>-<version>-*.whl` in `$<env_prefix>_WHEEL_DIR` or
    ~/.cache/kvtier/<package>-wheel (where tools/test.sh downloads it)."""
    env = os.environ.get(f"{env_prefix}_WHEEL")
    if env:
        if not os.path.exists(env):
            raise WheelNotFoundError(f"{env_prefix}_WHEEL={env} does not exist")
        return env
    dirs = [d for d in (os.environ.get(f"{env_prefix}_WHEEL_DIR"),
                        os.path.expanduser(f"~/.cache/kvtier/{package}-wheel")) if d]
    for d in dirs:
        found = sorted(glob.glob(os.path.join(d, f"{package}-{version}-*.whl")))
        if found:
            return found[-1]
    raise WheelNotFoundError(
        f"no {package}-{version} wheel in {dirs}: `pip download --no-deps "
        f"{package}=={version} -d DIR` and set {env_prefix}_WHEEL_DIR=DIR"
    )


class Stub(types.ModuleType):
    """A module the real files import but the tests never run."""

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


class WheelModules(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """A meta path finder: `members` (wheel paths) real, other imports under `stub_roots`
    stubbed (except names in `installed_ok` that are importable for real)."""

    def __init__(self, wheel: str, members: list[str], stub_roots: tuple[str, ...],
                 installed_ok: tuple[str, ...] = ()) -> None:
        self.wheel = wheel
        self.stub_roots = stub_roots
        self.installed_ok = installed_ok
        self.stubbed: set[str] = set()
        self.real: dict[str, tuple[str, str]] = {}
        with zipfile.ZipFile(wheel) as zf:
            for member in members:
                name = member[:-3].replace("/", ".").removesuffix(".__init__")
                self.real[name] = (member, zf.read(member).decode())

    def read(self, member: str) -> str:
        with zipfile.ZipFile(self.wheel) as zf:
            return zf.read(member).decode()

    def install(self) -> None:
        sys.meta_path.insert(0, self)

    def add_stub(self, name: str, stub: types.ModuleType | None = None) -> types.ModuleType:
        """`stub` (or an empty Stub) as module `name`, recorded in `stubbed`."""
        mod = stub if stub is not None else Stub(name)
        if not hasattr(mod, "__path__"):
            mod.__path__ = []
        self.stubbed.add(name)
        sys.modules[name] = mod
        return mod

    def find_spec(self, fullname: str, path: Any, target: Any = None) -> Any:
        if fullname in self.real:
            member = self.real[fullname][0]
            return importlib.machinery.ModuleSpec(
                fullname, self, origin=f"{self.wheel}!/{member}",
                is_package=member.endswith("__init__.py"))
        root = fullname.split(".")[0]
        if root not in self.stub_roots:
            return None
        if root in self.installed_ok and self._importable(root):
            return None
        return importlib.machinery.ModuleSpec(fullname, self, is_package=True)

    def _importable(self, name: str) -> bool:
        others = [f for f in sys.meta_path if f is not self and hasattr(f, "find_spec")]
        return any(f.find_spec(name, None) for f in others)

    def create_module(self, spec: Any) -> types.ModuleType | None:
        if spec.name in self.real:
            return None
        self.stubbed.add(spec.name)
        mod = Stub(spec.name)
        mod.__path__ = []
        return mod

    def exec_module(self, module: types.ModuleType) -> None:
        if module.__name__ not in self.real:
            return
        member, source = self.real[module.__name__]
        module.__file__ = f"{self.wheel}!/{member}"
        if member.endswith("__init__.py"):
            module.__path__ = []
        exec(compile(source, module.__file__, "exec"), module.__dict__)

    def import_all(self) -> None:
        for name in self.real:
            importlib.import_module(name)


def empty_package(name: str) -> types.ModuleType:
    """A package whose real __init__ would import the server: empty here."""
    mod = types.ModuleType(name)
    mod.__path__ = []
    sys.modules[name] = mod
    return mod
