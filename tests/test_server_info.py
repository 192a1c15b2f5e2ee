"""Each server's TP size comes from its ``/server_info`` (issue 36, item 4).

SGLang 0.5.21 answers ``GET /server_info`` (``/get_server_info``: a deprecated alias) with its
resolved server arguments as top-level keys (``tp_size``, ``dp_size``, ``pp_size``,
``enable_dp_attention``, ...). A server attached through ``rollout.sglang.servers`` used to be
taken as TP1: ``from_tensor`` sent one payload (SGLang's rank ``r`` reads
``serialized_named_tensors[r]``) and ``from_distributed`` made a weight group too small for the
server's ranks. Stand-in servers here report a layout and record what the strategies post.
"""

from __future__ import annotations

import contextlib
import json
from http.server import BaseHTTPRequestHandler
from types import SimpleNamespace

import pytest
import torch

from megatron_rl.config.sections import SGLangSection
from megatron_rl.rollout.weight_sync import from_distributed, from_tensor, make_strategy
from megatron_rl.rollout.weight_sync.common import (
    ServerLayout,
    WeightSyncError,
    read_server_layout,
)
from megatron_rl.testing.http_stub import serve_handler


@contextlib.contextmanager
def stand_in(info: dict, server_info_path: str = "/server_info"):
    """An HTTP server that answers ``server_info_path`` with ``info`` (404 for other GETs) and
    records every POST body: ``(url, {path: [bodies]})``."""
    posts: dict[str, list] = {}

    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, *args) -> None:
            return

        def _reply(self, code: int, body) -> None:
            data = json.dumps(body).encode()
            self.send_response(code)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def do_GET(self) -> None:  # noqa: N802
            if self.path == server_info_path:
                self._reply(200, info)
            else:
                self._reply(404, {"detail": "Not Found"})

        def do_POST(self) -> None:  # noqa: N802
            n = int(self.headers.get("Content-Length") or 0)
            posts.setdefault(self.path, []).append(json.loads(self.rfile.read(n) or b"{}"))
            self._reply(200, {"success": True, "message": ""})

    with serve_handler(Handler) as url:
        yield url, posts


def _attached_fleet(urls: list[str]) -> SimpleNamespace:
    """A fleet of SGLang servers attached by URL (``rollout.sglang.servers``), TP1 configured
    (``tp_size`` configures only servers the trainer starts)."""
    s = SGLangSection(servers=list(urls), launcher="sglang", tp_size=1)
    return SimpleNamespace(urls=list(urls), s=s, model_path=None)


SGLANG_TP2 = {"tp_size": 2, "dp_size": 1, "pp_size": 1, "enable_dp_attention": False,
              "version": "0.5.21"}
SGLANG_TP1 = {**SGLANG_TP2, "tp_size": 1}


def test_from_tensor_server_info_tp2_gets_two_payloads(monkeypatch):
    """The TP2 server gets one payload per TP rank, the TP1 server one."""
    def bodies(bucket, devices_per_server, keep, codec=None):  # no SGLang serializer here
        return [{"serialized_named_tensors": [f"handle-{d}" for d in devices],
                 "load_format": "flattened_bucket", "flush_cache": False}
                for devices in devices_per_server]

    monkeypatch.setattr(from_tensor, "tensor_update_bodies", bodies)
    with stand_in(SGLANG_TP2) as (tp2, posts2), stand_in(SGLANG_TP1) as (tp1, posts1):
        strat = make_strategy("from_tensor", _attached_fleet([tp2, tp1]), "/unused")
        assert [len(strat.rank_devices(i, torch.device("cpu"))) for i in range(2)] == [2, 1]
        strat._send_cuda([("w", torch.ones(2, 2))])
    (got2,), (got1,) = posts2["/update_weights_from_tensor"], posts1["/update_weights_from_tensor"]
    assert len(got2["serialized_named_tensors"]) == 2
    assert len(got1["serialized_named_tensors"]) == 1


def test_from_distributed_server_info_world_size(monkeypatch):
    """World size = the sender + every server's TP ranks; the TP1 server's rank follows the
    TP2 server's two (a spy stands in for the sender's join: the stand-ins join no group)."""
    joins = []

    def join(backend, addr, port, world, rank, name, timeout):
        joins.append((world, rank))
        return None

    monkeypatch.setattr(from_distributed, "join_weight_group", join)
    with stand_in(SGLANG_TP2) as (tp2, posts2), stand_in(SGLANG_TP1) as (tp1, posts1):
        strat = make_strategy("from_distributed", _attached_fleet([tp2, tp1]), "/unused")
        strat._init_group("gloo")
        strat.pg = None  # nothing to destroy
    (init2,), (init1,) = (posts2["/init_weights_update_group"],
                          posts1["/init_weights_update_group"])
    assert joins == [(4, 0)]
    assert (init2["world_size"], init2["rank_offset"]) == (4, 1)
    assert (init1["world_size"], init1["rank_offset"]) == (4, 3)


def test_server_info_layouts_refused_and_older_path():
    """``dp_size > 1`` without DP attention is refused for tensor and distributed updates (SGLang
    asserts), ``pp_size > 1`` for distributed ones (colliding ranks); ``/get_server_info`` is
    read where ``/server_info`` is missing (older SGLang)."""
    dp2 = {**SGLANG_TP2, "dp_size": 2}
    with stand_in(dp2) as (url, _):
        fleet = _attached_fleet([url])
        for name in ("from_tensor", "from_distributed"):
            with pytest.raises(WeightSyncError, match="dp_size=2 without --enable-dp-attention"):
                make_strategy(name, fleet, "/unused").tp_of(url)
    with stand_in({**dp2, "enable_dp_attention": True}) as (url, _):
        assert make_strategy("from_tensor", _attached_fleet([url]), "/unused").tp_of(url) == 2
    with stand_in({**SGLANG_TP2, "pp_size": 2}) as (url, _):
        fleet = _attached_fleet([url])
        assert make_strategy("from_tensor", fleet, "/unused").tp_of(url) == 2
        with pytest.raises(WeightSyncError, match="pp_size=2"):
            make_strategy("from_distributed", fleet, "/unused").tp_of(url)
    with stand_in(SGLANG_TP2, server_info_path="/get_server_info") as (url, _):
        assert read_server_layout(url) == ServerLayout(tp=2)
    with stand_in({"version": "x"}) as (url, _), pytest.raises(WeightSyncError, match="tp_size"):
        read_server_layout(url)


def test_serve_server_info_like_sglang(server):
    """Our ``serve`` reports its layout under SGLang's keys on both paths."""
    url, _ = server
    assert read_server_layout(url) == ServerLayout()
    from megatron_rl.rollout.fleet import http_json

    for path in ("/server_info", "/get_server_info"):
        info = http_json("GET", url + path)
        assert (info["tp_size"], info["dp_size"], info["pp_size"],
                info["enable_dp_attention"]) == (1, 1, 1, False)
