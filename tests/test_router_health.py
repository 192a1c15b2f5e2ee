"""No router health checks on colocated servers; the trainer checks them after a resume (issue 36,
item 5).

sglang-router 0.3.2 probes every worker's ``/health`` every 60 s, and SGLang 0.5.21's ``/health``
runs a one-token generation (``SGLANG_ENABLE_HEALTH_ENDPOINT_GENERATION`` defaults to true): while a
colocated server's memory is released that is a forward on unmapped weights. With
``rollout.sglang.colocate`` the fleet starts the router with ``--disable-health-check``, registers
every worker with ``disable_health_check`` (also on a router it did not start), starts SGLang
servers with ``/health`` generation off (the router's one probe at registration), and the
colocation hand-offs run the trainer's own ``/health_generate`` check once every region is back.

Not on the GPU tier: SGLang is not installed on the GPU machine, and our ``serve`` refuses to
generate on released memory instead of touching it, so no GPU run can show more than these do.
"""

from __future__ import annotations

import contextlib
import json
import threading
from http.server import BaseHTTPRequestHandler
from types import SimpleNamespace

import psutil
import pytest

from megatron_rl.config.sections import SGLangSection
from megatron_rl.parallel.launch import spawn
from megatron_rl.rollout.fleet import (
    HEALTH_GENERATION_VAR,
    Fleet,
    free_port,
    router_command,
    router_health_checks,
)
from megatron_rl.testing.http_stub import serve_handler

FLAG = "--disable-health-check"


@contextlib.contextmanager
def stand_in_router():
    """An HTTP stand-in for the router's worker API: records ``POST /workers`` bodies and lists
    every posted URL on ``GET /workers``."""
    bodies: list[dict] = []

    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, *args) -> None:
            return

        def _reply(self, body) -> None:
            data = json.dumps(body).encode()
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def do_GET(self) -> None:  # noqa: N802
            self._reply({"workers": [{"id": f"w{i}", "url": b["url"]}
                                     for i, b in enumerate(bodies)]})

        def do_POST(self) -> None:  # noqa: N802
            n = int(self.headers.get("Content-Length") or 0)
            bodies.append(json.loads(self.rfile.read(n)))
            self._reply({"status": "accepted", "worker_id": f"w{len(bodies) - 1}"})

    with serve_handler(Handler) as url:
        yield url, bodies


@pytest.mark.parametrize("colocate", [True, False])
def test_router_health_checks_off_only_when_colocated(colocate, tmp_path, monkeypatch):
    """Colocated: the router command disables health checks, workers are registered with
    ``disable_health_check`` and started SGLang servers answer ``/health`` without generating;
    otherwise the router keeps its checks and nothing changes."""
    s = SGLangSection(colocate=colocate, launcher="sglang", gpus=[0], num_servers=1)
    assert router_health_checks(s) is (not colocate)
    cmd = router_command("127.0.0.1", 30000, router_health_checks(s))
    assert (FLAG in cmd) is colocate
    assert FLAG not in router_command("127.0.0.1", 30000)  # the default keeps them
    spawned = []
    fleet = Fleet(s, "/model", None, str(tmp_path))
    monkeypatch.setattr(fleet, "_spawn", lambda name, cmd, env=None: spawned.append(
        (name, cmd, env)) or SimpleNamespace(poll=lambda: None))
    fleet.start_server(0)
    fleet.procs.clear()  # nothing was started
    (_, server_cmd, env), = spawned
    assert "sglang.launch_server" in server_cmd
    assert env.get(HEALTH_GENERATION_VAR) == ("false" if colocate else None)
    with stand_in_router() as (router, bodies):
        fleet.router_url = router
        fleet.add_worker("http://127.0.0.1:1")
    want = {"url": "http://127.0.0.1:1"}
    assert bodies == [{**want, "disable_health_check": True} if colocate else want]


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_router_health_flag_accepted_by_the_real_router(server, tmp_path):
    """The real sglang-router 0.3.2: a colocated fleet's router (started with the flag; it would
    exit on an unknown option) lists its worker with health checks disabled; a router started
    without the flag keeps them for a non-colocated fleet, and a colocated fleet attached to that
    router (``router_url``) still registers its worker without them."""
    pytest.importorskip("sglang_router")
    url, _ = server
    fleets = []
    try:
        plain = Fleet(SGLangSection(servers=[url], router_port=free_port("127.0.0.1")),
                      "/model", None, str(tmp_path / "plain")).start()
        fleets.append(plain)
        assert FLAG not in psutil.Process(plain.router_proc.pid).cmdline()
        assert [w["disable_health_check"] for w in plain.router_workers()] == [False]
        plain.remove_worker(url)
        attached = Fleet(SGLangSection(servers=[url], colocate=True,
                                       router_url=plain.router_url),
                         "/model", None, str(tmp_path / "attached")).start()
        assert [w["disable_health_check"] for w in plain.router_workers()] == [True]
        attached.remove_worker(url)
        colo = Fleet(SGLangSection(servers=[url], colocate=True,
                                   router_port=free_port("127.0.0.1")),
                     "/model", None, str(tmp_path / "colo")).start()
        fleets.append(colo)
        assert FLAG in psutil.Process(colo.router_proc.pid).cmdline()
        assert [w["disable_health_check"] for w in colo.router_workers()] == [True]
    finally:
        for f in fleets:
            f.stop()


# ---- the trainer's own check after a resume ----------------------------------------------------
def _resume_health_worker() -> dict:
    """One rank with our ``serve`` in a thread and a fleet that registered it (no router): the
    colocation's release/resume hand-offs, recording each health check with what the server had
    released at that moment."""
    from megatron_rl.models.config import get_preset
    from megatron_rl.parallel import runtime
    from megatron_rl.rollout.embedded import build_hf_model
    from megatron_rl.rollout.fleet import http_json
    from megatron_rl.rollout.serve import ServeState, make_server
    from megatron_rl.run.colocation import Colocation

    runtime.init_distributed(backend="gloo", timeout_s=120)
    state = ServeState(build_hf_model(get_preset("tiny")), "preset:tiny", 1, 0)
    srv = make_server(state, "127.0.0.1", 0)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    url = f"http://127.0.0.1:{state.port}"
    import tempfile

    fleet = Fleet(SGLangSection(servers=[url], colocate=True), "preset:tiny", None,
                  tempfile.mkdtemp())
    fleet.workers[url] = "w0"
    checks: list = []
    real = fleet.check_health

    def check_health(timeout_s: float = 10.0) -> list[str]:
        released = http_json("GET", url + "/server_info")["internal_states"][0]
        checks.append(released["memory_released"])
        return real(timeout_s)

    fleet.check_health = check_health
    cfg = SimpleNamespace(rollout=SimpleNamespace(engine="sglang",
                                                  sglang=SimpleNamespace(colocate=False)))
    # the hand-offs' server half only (no actor to move: a disabled Colocation)
    colo = Colocation(cfg, None, SimpleNamespace(engine=SimpleNamespace(fleet=fleet)))
    out = {}
    colo._servers("release", None)  # after the rollout: everything
    colo._servers("resume", ["weights"])  # part of it back: no check yet
    out["partial"] = list(checks)
    colo._servers("resume", None)  # the rest
    out["full"] = list(checks)
    colo._servers("release", ["kv_cache"])  # a checkpoint save
    colo._servers("resume", ["kv_cache"])
    out["save"] = list(checks)
    out["registered"] = fleet.urls
    srv.shutdown()
    runtime.shutdown()
    return out


def test_colocation_health_checked_after_each_resume():
    """The trainer's ``/health_generate`` check runs once every released region is back (after
    the sync's resume and after a checkpoint save's), never while something is released; the
    live server passes it and stays registered."""
    (out,) = spawn(_resume_health_worker, 1, timeout_s=300)
    assert out["partial"] == []
    assert out["full"] == [[]]
    assert out["save"] == [[], []]
    assert len(out["registered"]) == 1
