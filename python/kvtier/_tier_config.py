"""What the stacks' adapters (``kvtier.vllm``, ``kvtier.sglang``) share to turn their config
entries into a kvtier config: the ``config`` key read as a table, ``cores = "auto"``, sizes."""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

import kvtier

# Workers for cores = "auto" on a large machine: every worker registers the whole region, so
# opening costs grow with workers.
AUTO_WORKERS_MAX = 8


def load_config(config: Any) -> dict[str, Any]:
    """The `config` key as a dict: an inline table, TOML text or a TOML path."""
    import tomllib

    if isinstance(config, Mapping):
        return dict(config)
    if isinstance(config, (str, os.PathLike)):
        text, kind = kvtier._config_arg(config)
        if kind == "path":
            try:
                with open(text, "rb") as f:
                    return tomllib.load(f)
            except OSError as e:
                raise kvtier.ConfigError(f"reading config {text}: {e}") from None
        try:
            return tomllib.loads(text)
        except tomllib.TOMLDecodeError as e:
            raise kvtier.ConfigError(f"config: {e}") from None
    raise TypeError(
        f"config: expected a kvtier TOML path, TOML text or a table, got {type(config).__name__}"
    )


def cores_auto(cores: Any) -> Any:
    """`cores`: "auto" becomes at most AUTO_WORKERS_MAX of the CPUs this process may run on
    (the highest-numbered, away from the CPU 0 housekeeping usually lands on)."""
    if cores != "auto":
        return cores
    cpus = sorted(os.sched_getaffinity(0))
    if len(cpus) <= AUTO_WORKERS_MAX:
        return "auto"
    return cpus[-AUTO_WORKERS_MAX:]


def size_bytes(value: Any) -> int:
    """A kvtier size (an int, or a string such as "2 MiB") in bytes."""
    if isinstance(value, int):
        return value
    return kvtier.parse_size(str(value))
