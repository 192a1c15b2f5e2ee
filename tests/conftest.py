"""Shared pytest hooks: ``gpu``-marked tests skip automatically where CUDA is unavailable; with
``MRL_REQUIRE_GPU=1`` (the GPU machine's runner sets it) they fail instead, so a GPU run that
silently lost its GPU cannot pass."""

from __future__ import annotations

import os

import pytest
import torch

REQUIRE_GPU_VAR = "MRL_REQUIRE_GPU"


def gpu_missing_action(environ=None) -> str:
    """``"fail"`` when ``MRL_REQUIRE_GPU=1``, else ``"skip"`` (for a gpu test without CUDA)."""
    env = os.environ if environ is None else environ
    return "fail" if env.get(REQUIRE_GPU_VAR) == "1" else "skip"


def pytest_runtest_setup(item):
    if "gpu" not in item.keywords or torch.cuda.is_available():
        return
    reason = "needs a CUDA GPU (torch.cuda.is_available() is False)"
    if gpu_missing_action() == "fail":
        pytest.fail(f"{reason} and {REQUIRE_GPU_VAR}=1", pytrace=False)
    pytest.skip(reason)
