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


@pytest.fixture(scope="module")
def server():
    """Our ``serve`` of the tiny preset model (EOS id 1) in a thread on a free port:
    ``(base url, ServeState)``; one per test module."""
    import threading

    from megatron_rl.models.config import get_preset
    from megatron_rl.rollout.embedded import build_hf_model
    from megatron_rl.rollout.serve import ServeState, make_server

    torch.manual_seed(0)
    state = ServeState(build_hf_model(get_preset("tiny")), "preset:tiny", 1, 0)
    srv = make_server(state, "127.0.0.1", 0)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{state.port}", state
    srv.shutdown()
