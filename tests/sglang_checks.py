"""Checks run by the real-SGLang venv's python (``tests/test_sglang_real.py``): real ``sglang``
code judges what our trainer sends.

    python sglang_checks.py validate BODIES.json   # every recorded request through FastAPI's types
    python sglang_checks.py join RANK ADDR PORT WORLD GROUP SPEC.json OUT.pt   # a receiving rank
"""

from __future__ import annotations

import json
import sys


def _routes() -> dict:
    """``path -> body annotation`` of real SGLang's HTTP server (None: no body)."""
    from fastapi.routing import APIRoute
    from sglang.srt.entrypoints import http_server

    out = {}
    for r in http_server.app.routes:
        if isinstance(r, APIRoute):
            bp = r.dependant.body_params
            out[r.path] = bp[0].field_info.annotation if bp else None
    return out


def validate(path: str) -> dict:
    """Validate each ``[method, url_path, body]`` with pydantic's ``TypeAdapter`` of the route's
    io_struct type (FastAPI's own path); ``GenerateReqInput`` is also normalized as SGLang's
    tokenizer manager does. Also round-trips our ``from_tensor`` payload."""
    from pydantic import TypeAdapter

    routes = _routes()
    errors, seen = [], set()
    for method, url_path, body in json.load(open(path)):
        route, _, query = url_path.partition("?")
        seen.add(route)
        if route not in routes:
            errors.append(f"{route}: no such route in SGLang")
            continue
        ann = routes[route]
        try:
            if ann is None:
                if body not in (None, {}):
                    raise ValueError(f"route takes no body, got {body!r}")
            else:
                obj = TypeAdapter(ann).validate_python(body)
                if route == "/generate":
                    obj.normalize_batch_and_arguments()
            if route == "/flush_cache" and query:
                key, _, val = query.partition("=")
                assert key == "timeout" and float(val) >= 0, query
        except Exception as exc:  # noqa: BLE001 - reported to the test
            errors.append(f"{method} {url_path}: {type(exc).__name__}: {exc}")
    return {"errors": errors, "routes": sorted(seen), "tensor": tensor_roundtrip(routes),
            "lora": lora_configs(json.load(open(path)))}


def lora_configs(bodies: list) -> list[dict]:
    """Each distinct ``/load_lora_adapter`` directory read by SGLang's ``LoRAConfig``: rank,
    alpha, normalized target modules, and whether they fit the served targets (the
    ``/server_info`` of our serve lists them: SGLang's ``LoRAMemoryPool.can_support`` rule)."""
    from sglang.srt.lora.lora_config import LoRAConfig
    from sglang.srt.lora.utils import get_normalized_target_modules

    served = set(LORA_SERVED)
    out, seen = [], set()
    for _, url_path, body in bodies:
        if url_path != "/load_lora_adapter" or body["lora_path"] in seen:
            continue
        seen.add(body["lora_path"])
        conf = LoRAConfig(body["lora_path"])
        targets = get_normalized_target_modules(conf.target_modules)
        out.append({"r": conf.r, "lora_alpha": conf.lora_alpha, "targets": sorted(targets),
                    "fits": targets <= get_normalized_target_modules(served)})
    return out


# the --lora-target-modules of the serve in test_sglang_real.py
LORA_SERVED = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def tensor_roundtrip(routes: dict) -> dict:
    """Our ``from_tensor`` bodies (CPU tensors, 2 TP ranks) through SGLang's request type and
    ``MultiprocessingSerializer.deserialize`` + ``FlattenedTensorBucket``: bit-exact?"""
    import torch
    from pydantic import TypeAdapter
    from sglang.srt.utils import MultiprocessingSerializer
    from sglang.srt.weight_sync.tensor_bucket import FlattenedTensorBucket

    from megatron_rl.rollout.weight_sync.from_tensor import tensor_update_bodies

    g = torch.Generator().manual_seed(0)
    bucket = [("a.weight", torch.randn(3, 5, generator=g)),
              ("b.bias", torch.randn(7, generator=g).to(torch.bfloat16)),
              ("c.weight", torch.randn(2, 2, 2, generator=g).half())]
    keep: list = []
    body = tensor_update_bodies(bucket, [[torch.device("cpu")] * 2], keep)[0]
    req = TypeAdapter(routes["/update_weights_from_tensor"]).validate_python(body)
    ok = len(req.serialized_named_tensors) == 2
    for rank in range(2):  # what SGLang's deserialize_own_rank does on each TP rank
        payload = MultiprocessingSerializer.deserialize(req.serialized_named_tensors[rank])
        fb = FlattenedTensorBucket(flattened_tensor=payload["flattened_tensor"],
                                   metadata=payload["metadata"])
        got = dict(fb.reconstruct_tensors())
        ok = ok and all(got[n].dtype == t.dtype and torch.equal(got[n], t) for n, t in bucket)
    return {"ok": bool(ok), "load_format": req.load_format, "flush_cache": req.flush_cache}


def join(rank: int, addr: str, port: int, world: int, group: str, spec: str, out: str) -> None:
    """One SGLang receiving rank: ``init_custom_process_group`` as SGLang's model runner calls
    it, then receive each tensor of ``spec`` by broadcast from rank 0, as its
    ``update_weights_from_distributed`` does; save them to ``out``."""
    import torch
    from sglang.srt.utils.common import init_custom_process_group

    pg = init_custom_process_group(backend="gloo", init_method=f"tcp://{addr}:{port}",
                                   world_size=world, rank=rank, group_name=group)
    got = {}
    for name, dtype, shape in json.load(open(spec)):
        t = torch.empty(shape, dtype=getattr(torch, dtype))
        torch.distributed.broadcast(t, src=0, group=pg)
        got[name] = t
    torch.save(got, out)


if __name__ == "__main__":
    cmd, args = sys.argv[1], sys.argv[2:]
    if cmd == "validate":
        print("RESULT " + json.dumps(validate(args[0])), flush=True)
    elif cmd == "join":
        join(int(args[0]), args[1], int(args[2]), int(args[3]), args[4], args[5], args[6])
        print("RESULT joined", flush=True)
    else:
        raise SystemExit(f"unknown command {cmd!r}")
