"""Reference-model offload: one reference pass's weight traffic, side by side.

For a frozen model of ``--preset`` in ``--precision`` on this machine's device, times per pass

- ``module.to``: the previous scheme, ``model.to(device)`` before the pass and ``model.to("cpu")``
  after it (two copies through pageable host memory, new device and host tensors every pass);
- ``pinned``: :class:`megatron_rl.actor.offload.FrozenModelOffload` (one non-blocking copy from
  pinned host memory into the kept device buffer; nothing copied back);

each followed by a device synchronisation, and prints the ratio. On a CPU-only machine both sides
are host copies and the ratio says little; run it on a GPU.

    python tools/bench_ref_offload.py --preset qwen2.5-0.5b --precision bf16 --passes 5
"""

from __future__ import annotations

import argparse
import time

import torch

from megatron_rl.parallel.launch import spawn


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def _worker(preset: str, precision: str, passes: int) -> dict:
    from megatron_rl.actor.offload import FrozenModelOffload
    from megatron_rl.actor.precision import set_precision, wrap_precision
    from megatron_rl.models.builder import build_gpt_model
    from megatron_rl.models.config import get_preset
    from megatron_rl.parallel import runtime

    runtime.init_parallel(tp=1, pp=1, timeout_s=600)
    dev = runtime.device()

    def frozen():
        m = build_gpt_model(get_preset(preset), seed=1)
        set_precision(m, precision)
        return wrap_precision(m).eval().requires_grad_(False)

    a = frozen().to("cpu")
    times = {"module.to": [], "pinned": []}
    for _ in range(passes):
        _sync()
        t0 = time.perf_counter()
        a.to(dev)
        _sync()
        a.to("cpu")
        times["module.to"].append(time.perf_counter() - t0)
    del a
    b = FrozenModelOffload(frozen())
    for _ in range(passes):
        _sync()
        t0 = time.perf_counter()
        b.onload()
        _sync()
        b.offload()
        times["pinned"].append(time.perf_counter() - t0)
    out = {"device": str(dev), "bytes": b.nbytes, "pinned_host": b.pin,
           **{k: sorted(v)[len(v) // 2] for k, v in times.items()}}
    runtime.shutdown()
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="tiny")
    ap.add_argument("--precision", default=None, help="bf16 | fp16 | fp32 (default: bf16 on "
                    "CUDA, fp32 on CPU)")
    ap.add_argument("--passes", type=int, default=5)
    args = ap.parse_args()
    (r,) = spawn(_worker, 1, (args.preset, args.precision, args.passes), timeout_s=1800)
    print(f"device {r['device']}  weights {r['bytes'] / 2**20:.1f} MiB  pinned host "
          f"{r['pinned_host']}  (median of {args.passes} passes)")
    for k in ("module.to", "pinned"):
        print(f"  {k:10s} {r[k] * 1e3:9.2f} ms/pass")
    print(f"  ratio module.to / pinned: {r['module.to'] / r['pinned']:.2f}x")


if __name__ == "__main__":
    main()
