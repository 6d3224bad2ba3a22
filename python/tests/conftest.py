"""Shared fixtures: vLLM's real tiering modules (the harness's version), loaded once per session."""

from __future__ import annotations

import pytest

import vllm_harness as H


@pytest.fixture(scope="session")
def vllm():
    """The harness namespace of vLLM classes; skips the test if the wheel is not found."""
    try:
        return H.load_vllm()
    except H.WheelNotFoundError as exc:
        pytest.skip(str(exc))
