"""``python -m megatron_rl plan CONFIG [--gpus N --gpu-mem-gb 80] [--search]``."""

from __future__ import annotations

from megatron_rl.plan.inputs import DEVICES, PRECISIONS, RECOMPUTE, PlanError, inputs_from_config
from megatron_rl.plan.layout_search import format_search, search
from megatron_rl.plan.report import format_plan, make_plan


def _cmd_plan(args) -> int:
    import sys

    from megatron_rl.config.errors import ConfigError
    from megatron_rl.config.load import load_config

    try:
        cfg = load_config(args.config, args.overrides)
        over = dict(precision=args.precision, recompute=args.recompute, servers=args.servers,
                    server_tp=args.server_tp, concurrency=args.concurrency,
                    server_mem_fraction=args.mem_fraction, gpu_mem_gb=args.gpu_mem_gb,
                    distributed_optimizer=args.distributed_optimizer, device=args.device,
                    prompt_len=args.prompt_len, response_len=args.response_len, mfu=args.mfu,
                    rollout_mfu=args.rollout_mfu, peak_tflops=args.peak_tflops,
                    tp=args.tp, pp=args.pp, dp=args.dp, ep=args.ep, cp=args.cp,
                    colocate=args.colocate,
                    response_mean=args.response_mean, response_p95=args.response_p95,
                    lengths_file=args.lengths_file, gpus_per_node=args.gpus_per_node,
                    intra_node_gbps=args.intra_node_gbps, inter_node_gbps=args.inter_node_gbps)
        if args.gpus is not None and not args.search:
            tp = args.tp or cfg.parallel.tp
            pp = args.pp or cfg.parallel.pp
            cp = args.cp or cfg.parallel.cp
            if args.gpus % (tp * pp * cp):
                raise PlanError(f"--gpus {args.gpus} is not a multiple of TP x PP x CP = "
                                f"{tp * pp * cp}")
            over["dp"] = args.gpus // (tp * pp * cp)
        x = inputs_from_config(cfg, **over)
        if args.search:
            gpus = args.gpus or x.actor_gpus
            plans = search(x, gpus, max_tp=args.max_tp, max_cp=args.max_cp)
            if not plans:
                moe = " x EP" if x.model.is_moe else ""
                raise PlanError(f"no TP x PP x CP x DP{moe} layout of {gpus} GPUs splits this "
                                "model and batch")
            print(f"search: {gpus} actor GPUs, {len(plans)} layouts x recompute settings; ranked "
                  f"by fit, then estimated step time, then memory per GPU\n")
            print(format_search(plans, args.top))
            print(f"\nbest: {plans[0].layout} recompute {plans[0].inputs.recompute}\n")
            print(format_plan(plans[0]))
            return 0 if plans[0].fits else 1
        plan = make_plan(x)
    except (ConfigError, PlanError) as exc:
        print(f"plan error: {exc}", file=sys.stderr)
        return 2
    print(format_plan(plan))
    return 0 if plan.fits else 1


def add_plan_subcommand(sub) -> None:
    """Register ``plan`` on the CLI's subparsers."""
    import argparse

    p = sub.add_parser("plan", help="per-GPU memory and step-time estimate of a config's layout "
                                    "(--search: rank all TPxPPxDP(xEP) layouts)")
    p.add_argument("config", help="YAML run config")
    p.add_argument("overrides", nargs="*", help="key=value config overrides")
    p.add_argument("--gpus", type=int, default=None,
                   help="actor GPUs (sets DP; with --search: the GPUs to lay out)")
    p.add_argument("--gpu-mem-gb", type=float, default=80.0, help="memory per GPU in GiB")
    p.add_argument("--search", action="store_true",
                   help="enumerate and rank TPxPPxCPxDP layouts (xEP for MoE models)")
    p.add_argument("--max-tp", type=int, default=8, help="largest TP in --search (one node)")
    p.add_argument("--top", type=int, default=15, help="rows of the --search table")
    p.add_argument("--tp", type=int, default=None, help="actor TP (default: parallel.tp)")
    p.add_argument("--pp", type=int, default=None, help="actor PP (default: parallel.pp)")
    p.add_argument("--dp", type=int, default=None, help="actor DP (default: parallel.dp)")
    p.add_argument("--cp", type=int, default=None,
                   help="actor context parallelism: each sequence split over cp ranks "
                        "(default: parallel.cp)")
    p.add_argument("--max-cp", type=int, default=8, help="largest CP in --search")
    p.add_argument("--ep", type=int, default=None,
                   help="actor expert parallelism, MoE models (default: parallel.ep)")
    p.add_argument("--gpus-per-node", type=int, default=None,
                   help="GPUs per node: where the EP all-to-all leaves the node (default 8)")
    p.add_argument("--intra-node-gbps", type=float, default=None,
                   help="all-to-all GB/s per GPU inside a node (default 200, NVLink)")
    p.add_argument("--inter-node-gbps", type=float, default=None,
                   help="all-to-all GB/s per GPU between nodes (default 40, 400 Gb/s NIC)")
    p.add_argument("--precision", choices=PRECISIONS, default=None,
                   help="default: actor.precision, else bf16")
    p.add_argument("--recompute", choices=RECOMPUTE, default=None,
                   help="default: actor.recompute, else none")
    p.add_argument("--distributed-optimizer", action=argparse.BooleanOptionalAction,
                   default=None, help="default: optim.use_distributed_optimizer")
    p.add_argument("--device", choices=DEVICES, default=None,
                   help="gpu (flash attention, fused kernels; default) or cpu (local spec)")
    p.add_argument("--servers", type=int, default=None,
                   help="rollout servers (default: rollout.sglang.servers)")
    p.add_argument("--server-tp", type=int, default=None,
                   help="GPUs per server (default: rollout.sglang.tp_size, else 1)")
    p.add_argument("--colocate", action=argparse.BooleanOptionalAction, default=None,
                   help="servers on the actor's GPUs (default: rollout.sglang.colocate)")
    p.add_argument("--concurrency", type=int, default=None,
                   help="requests in flight per server (default: responses / servers)")
    p.add_argument("--mem-fraction", type=float, default=None,
                   help="server mem_fraction_static (default 0.85)")
    p.add_argument("--prompt-len", type=int, default=None,
                   help="default: data.max_prompt_length, else 2048")
    p.add_argument("--response-len", type=int, default=None,
                   help="default: rollout.max_new_tokens")
    p.add_argument("--response-mean", type=float, default=None,
                   help="mean response length (tokens) the batching comparison is priced on")
    p.add_argument("--response-p95", type=float, default=None,
                   help="95th percentile of the response length (default: the cap)")
    p.add_argument("--lengths-file", default=None,
                   help="a run's OUTPUT_DIR/response_lengths.json (wins over --response-*)")
    p.add_argument("--mfu", type=float, default=None, help="actor MFU (default 0.35)")
    p.add_argument("--rollout-mfu", type=float, default=None, help="rollout MFU (default 0.10)")
    p.add_argument("--peak-tflops", type=float, default=None,
                   help="dense bf16 TFLOP/s per GPU (default 989, H100 SXM)")
    p.set_defaults(func=_cmd_plan)
