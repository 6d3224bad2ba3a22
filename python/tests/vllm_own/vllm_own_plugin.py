"""pytest plugin: run vLLM's own fs-tier tests (``tests/v1/kv_offload/tiering/test_fs_tier.py``
from vLLM's sdist, unmodified) on vLLM's real tiering code from the wheel (``vllm_harness``),
against vLLM's own ``FileSystemTierManager`` (``KVTIER_VLLM_OWN_TARGET=vllm``, the baseline) or
against ``kvtier.vllm.KvtierTierManager`` put in its place (``=kvtier``).

    KVTIER_VLLM_VERSION=0.34.0 KVTIER_VLLM_OWN_TARGET=kvtier \\
        python -m pytest -p vllm_own_plugin $(python vllm_own/extract.py)

Retargeting replaces the name ``FileSystemTierManager`` in the test module, so every test that
builds a tier builds kvtier's, with the same arguments. Tests that look inside vLLM's fs tier
(its thread pool, its async lookup manager's queues, its Python/C I/O switch) test that
implementation, not the tier contract: they are skipped for kvtier, each with the reason in
``NOT_THE_CONTRACT`` (README, "vLLM's own tests").
"""

from __future__ import annotations

import os
import sys

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))  # vllm_harness
sys.path.insert(0, HERE)

import torch_standin  # noqa: E402

sys.modules.setdefault("torch", torch_standin)

import vllm_harness as H  # noqa: E402

# Now, before pytest imports the tests' conftest.py (which imports vLLM's config module).
H.load_vllm()

TARGET = os.environ.get("KVTIER_VLLM_OWN_TARGET", "kvtier")
if TARGET not in ("kvtier", "vllm"):
    raise RuntimeError(f"KVTIER_VLLM_OWN_TARGET={TARGET}: 'kvtier' or 'vllm'")

# Tests of vLLM's fs tier internals, by name (parameters stripped), with why they do not apply
# to another tier class.
NOT_THE_CONTRACT: dict[str, str] = {
    "test_factory_forwards_locality_to_fs_tier":
        "checks that the factory's built-in 'fs' type builds vLLM's own class; kvtier is "
        "loaded by module_path (test_vllm_tier.py::test_factory_loads_kvtier_by_module_path)",
    "test_shutdown_discards_pending_tasks":
        "reads the fs tier's thread pool (_pool); kvtier has none: a shutdown fails queued "
        "jobs with KeyFailure::Shutdown and waits for I/O in flight (tests/lifecycle.rs)",
    "test_store_load_roundtrip_without_o_direct":
        "reads the fs tier's private _use_o_direct flag; kvtier's is direct_io = \"off\", and "
        "its O_DIRECT fallback is tested on a tmpfs directory (tests/files_layout.rs)",
    "test_failed_load_after_abort_does_not_break_newer_probe":
        "expects RETRY from the fs tier's asynchronous probe; kvtier answers a lookup from its "
        "index at once (HIT or MISS), so there is no probe generation to break",
    "test_mixed_job_results_emit_event_only_for_successful_job":
        "injects its store failure by replacing the fs tier's batch_store_block, which kvtier "
        "never calls; a failed kvtier store emits no event (kvtier.vllm get_finished_jobs)",
    "test_partially_failed_store_emits_no_event":
        "injects its store failure by replacing the fs tier's batch_store_block, which kvtier "
        "never calls; a failed kvtier store emits no event (kvtier.vllm get_finished_jobs)",
    "test_events_disabled_by_default":
        "also reads the fs tier's private _store_jobs map; the contract part (events is None, "
        "take_events() empty) is test_vllm_tier.py::test_events_off_without_both_switches",
    "test_events_require_global_kv_events_flag":
        "also reads the fs tier's private _store_jobs map; the contract part (events is None, "
        "take_events() empty) is test_vllm_tier.py::test_events_off_without_both_switches",
}


class _LookupManagerShim:
    """What the tests' ``lookup_and_wait`` polls on vLLM's fs tier (its async lookup
    manager's result queue): kvtier answers a lookup from its index at once, so its results
    are always ready."""

    class _Ready:
        @staticmethod
        def empty() -> bool:
            return False

    _pending_results = _Ready()
    _lookup_batch: list = []


def _kvtier_class():
    import kvtier.vllm

    class KvtierAsFs(kvtier.vllm.KvtierTierManager):
        """kvtier's tier built with an fs tier's arguments (one worker: the tests' machines
        may have one CPU)."""

        def __init__(self, *args, **kwargs):
            kwargs.setdefault("cores", [0])
            super().__init__(*args, **kwargs)
            self._lookup_manager = _LookupManagerShim()

    return KvtierAsFs


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if TARGET != "kvtier":
        return
    cls = _kvtier_class()
    for module in {item.module for item in items if getattr(item, "module", None)}:
        if hasattr(module, "FileSystemTierManager"):
            module.FileSystemTierManager = cls
    for item in items:
        why = NOT_THE_CONTRACT.get(item.originalname if hasattr(item, "originalname") else item.name)
        if why:
            item.add_marker(pytest.mark.skip(reason=f"vLLM fs-tier internals: {why}"))
