"""Command-line entry points: ``python -m megatron_rl <command> ...``."""

from __future__ import annotations

import argparse
import sys

from megatron_rl.cli.parser import Parser, chosen_parser, unrecognized


def _cmd_check(args: argparse.Namespace) -> int:
    from megatron_rl.cli.check import format_report, parity

    rep = parity(args.tp, args.pp, preset=args.model, micro_batches=args.micro_batches,
                 batch=args.batch, seq=args.seq, seed=args.seed, temperature=args.temperature,
                 chunk_size=args.chunk_size, cp=args.cp)
    print(format_report(rep, args.atol))
    return 0 if rep.ok(args.atol) else 1


def _train_worker(cfg, mode: str = "train", request: dict | None = None):
    from megatron_rl.run import jobs as commands
    from megatron_rl.run import trainer

    if mode == "eval":
        return commands.evaluate(cfg, request)
    return {"train": trainer.train, "sft": commands.sft_only}[mode](cfg)


def _cmd_train(args: argparse.Namespace) -> int:

    from megatron_rl.config.default_recipe import DEFAULT_RECIPE
    from megatron_rl.config.errors import ConfigError
    from megatron_rl.config.load import load_config

    config, overrides = split_config_arg(args.config, args.overrides)
    try:  # no YAML: the built-in recipe (a tiny DAPO demo that learns)
        cfg = load_config(config, overrides, base=None if config else DEFAULT_RECIPE)
        from megatron_rl.run.input_checks import check_inputs

        check_inputs(cfg)  # data, tokenizer, reward plugin: before anything is written
    except ConfigError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    if getattr(args, "check_only", False):
        print(f"config ok: {config or 'built-in recipe'} + {len(overrides)} override(s)")
        return 0
    launch = _launch_plan(cfg, args.command)
    if launch is None:
        return 2
    plan, world, rank0 = launch
    lock = None
    if (args.command in ("train", "sft") and rank0 and
            (plan.mode == "local" or plan.world_size == world)):
        lock = _lock_run_dir(cfg.trainer.output_dir, args.command)
        if lock is None:
            return 2
    try:
        return _preflight_and_run(cfg, args.command, plan, world, rank0)
    finally:
        if lock is not None:
            lock.release()


def _cmd_eval(args: argparse.Namespace) -> int:
    """``eval TARGET``: a run, a Megatron checkpoint, an HF model or a config (docs/evaluation.md);
    ``eval --compare A B``: two results side by side with bootstrap intervals."""

    from megatron_rl.config.errors import ConfigError

    if args.compare:
        return _compare(args)
    target, overrides = split_config_arg(args.target, args.overrides)
    try:
        request, cfg = _eval_request(args, target, overrides)
        from megatron_rl.run.input_checks import check_inputs

        check_inputs(cfg)
    except ConfigError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    launch = _launch_plan(cfg, "eval")
    if launch is None:
        return 2
    return _preflight_and_run(cfg, "eval", *launch, request)


def _launch_plan(cfg, command: str):
    """``(launch plan, world size, is rank 0)`` for ``command``, or None after printing why the
    launch is refused."""
    import os

    from megatron_rl.parallel.launch import launch_mode

    rank0 = os.environ.get("RANK", os.environ.get("SLURM_PROCID", "0")) == "0"
    world = cfg.parallel.tp * cfg.parallel.pp * cfg.parallel.cp * cfg.parallel.dp
    plan = launch_mode(os.environ)
    if plan.mode == "refuse":
        print(f"[{command}] {plan.message}", file=sys.stderr)
        return None
    return plan, world, rank0


def _eval_request(args: argparse.Namespace, target: str | None, overrides: list[str]):
    """``(request dict, run config)`` of an ``eval`` command line; ``ConfigError`` on misuse."""
    import os

    from megatron_rl.config.errors import ConfigError
    from megatron_rl.eval.targets import (
        EvalRequest,
        load_target_config,
        resolve_sets,
        target_kind,
    )

    kind = target_kind(target)
    if kind in ("hf", "megatron") and not args.out:
        raise ConfigError(f"eval {target}: a model directory has no run directory; give --out DIR "
                          "(results go to DIR/eval/<set>.json)")
    if kind == "run":
        overrides = [*overrides, f"trainer.output_dir={target}"]
    cfg = load_target_config(kind, target, overrides, args.out)
    k = [int(x) for x in args.k.split(",") if x.strip()] if args.k else None
    cfg.data.eval_sets = resolve_sets(args.sets, cfg, args.n, k, args.temperature,
                                      args.max_new_tokens)
    if kind in ("hf", "megatron") and not cfg.data.eval_sets:
        raise ConfigError(f"eval {target}: give --sets (e.g. --sets math_latex,chain_sum or "
                          "--sets /data/aime24.parquet)")
    out = os.path.join(args.out or cfg.trainer.output_dir, "eval")
    req = EvalRequest(kind, target, args.step, out, validate=kind in ("run", "config"))
    return req.to_dict(), cfg


def _compare(args: argparse.Namespace) -> int:
    from megatron_rl.eval.report import compare, format_compare

    a, b = args.compare
    try:
        print(format_compare(compare(a, b, rounds=args.rounds), a, b))
    except (FileNotFoundError, ValueError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    return 0


def _preflight_and_run(cfg, command: str, plan, world: int, rank0: bool,
                       request: dict | None = None) -> int:
    from megatron_rl.config.errors import ConfigError

    if command == "train":  # resume preflight: changed config, finished run
        from megatron_rl.run.guard import preflight

        try:
            done = preflight(cfg, log=print if rank0 else (lambda *_: None))
        except ConfigError as exc:
            print(f"error: {exc}", file=sys.stderr)
            return 2
        if done:
            if rank0:
                print(done, flush=True)
            return 0
    if plan.mode in ("torchrun", "srun"):  # this process is one rank
        return _run_in_place(cfg, command, plan, world, request)
    return _launch_local(cfg, command, world, request)


def _lock_run_dir(run_dir: str, command: str):
    """The run directory's lock (one live trainer per directory), or None after printing why
    not (another live trainer holds it)."""
    from megatron_rl.parallel.lifecycle import RunDirBusy, RunLock

    try:
        lock = RunLock(run_dir).acquire()
    except RunDirBusy as exc:
        print(f"error: {exc}", file=sys.stderr)
        return None
    if lock.taken_over:
        print(f"[{command}] took over the lock of {lock.path} left by pid "
              f"{lock.taken_over.get('pid')} (no longer running)", flush=True)
    return lock


def _launch_local(cfg, command: str, world: int, request: dict | None = None) -> int:
    """Spawn the ranks here; a stop signal (SIGTERM/SIGINT/SIGHUP) stops them all and exits
    ``128 + signal``; a rank that dies or fails stops the job (exit 1) naming it, unless
    ``trainer.max_restarts`` allows another try: then every rank is started again from the newest
    checkpoint (:mod:`megatron_rl.parallel.restart`)."""
    import time

    from megatron_rl.parallel.lifecycle import StopSignal, remove_partial_checkpoints, signal_name
    from megatron_rl.parallel.restart import RestartPolicy, RestartsExhausted, run_with_restarts

    try:
        env = local_spawn_env(cfg.parallel.backend, world)
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(f"[{command}] launching {world} local process(es): TP{cfg.parallel.tp} x PP"
          f"{cfg.parallel.pp} x CP{cfg.parallel.cp} x DP{cfg.parallel.dp}", flush=True)
    policy = RestartPolicy.of(cfg.trainer) if command == "train" else RestartPolicy(0)
    try:
        if policy.max_restarts == 0:
            failed = _spawn_once(cfg, command, world, request, env, 0, full=True)
        else:
            failed = None
            run_with_restarts(lambda k: _spawn_once(cfg, command, world, request, env, k),
                              policy, lambda m: print(f"[{command}] {m}", file=sys.stderr,
                                                      flush=True),
                              what=f"all {world} rank(s)", sleep=_sleep_stoppable)
    except RestartsExhausted as exc:
        failed = str(exc)
    except StopSignal as exc:
        remove_partial_checkpoints(cfg.trainer.output_dir)
        print(f"[{command}] stopped by {signal_name(exc.signum)}: all {world} rank(s) and their "
              f"helper processes ended within {time.monotonic() - exc.at:.1f} s; the newest "
              "complete checkpoint is kept (resume with the same command)", file=sys.stderr,
              flush=True)
        return 128 + exc.signum
    if failed is not None:
        print(f"[{command}] failed: {failed}", file=sys.stderr)
        return 1
    return 0


def _spawn_once(cfg, command: str, world: int, request: dict | None, env: dict,
                k: int, full: bool = False) -> str | None:
    """Try ``k`` (0: the first) of the rank group: None when it finished, else why it failed:
    the launcher's whole message (``full``) or one line of it (the whole one is printed). Every
    rank and helper is stopped and unfinished checkpoints are removed before it returns."""
    from megatron_rl.parallel.launch import WorkerError, spawn
    from megatron_rl.parallel.lifecycle import remove_partial_checkpoints
    from megatron_rl.parallel.restart import RESTART_ENV, failure_reason

    try:
        spawn(_train_worker, world, (cfg, command, request), timeout_s=7 * 24 * 3600,
              env={**env, RESTART_ENV: str(k)}, handle_signals=True,
              preload=("megatron_rl.actor.actor", "megatron_rl.run.trainer"))
    except WorkerError as exc:
        remove_partial_checkpoints(cfg.trainer.output_dir)
        if full:
            return str(exc)
        print(f"[{command}] try {k + 1} failed: {exc}", file=sys.stderr, flush=True)
        return failure_reason(str(exc))
    return None


def _sleep_stoppable(seconds: float) -> None:
    """Sleep between tries; a stop signal meanwhile raises ``StopSignal``."""
    import time

    from megatron_rl.parallel.lifecycle import stop_signals

    with stop_signals():
        time.sleep(seconds)


def local_spawn_env(backend: str, world: int) -> dict[str, str]:
    """Environment of locally spawned ranks; refuses (``ParallelConfigError``) more ranks than
    visible GPUs for NCCL before any process starts. gloo ranks get ``CUDA_VISIBLE_DEVICES=""``."""
    import os

    from megatron_rl.parallel.backend import BACKEND_ENV, resolve_backend, visible_gpu_count

    req = backend if backend != "auto" else os.environ.get(BACKEND_ENV) or "auto"
    cuda = 0 if req == "gloo" else visible_gpu_count()
    return {"CUDA_VISIBLE_DEVICES": ""} if resolve_backend(req, world, cuda) == "gloo" else {}


def split_config_arg(config: str | None, overrides: list[str]) -> tuple[str | None, list[str]]:
    """``train trainer.seed=3 ...`` (no YAML): a first positional that looks like ``key=value``
    and is not a file is an override, and the built-in defaults are the config."""
    import os

    if config is not None and "=" in config and not os.path.exists(config):
        return None, [config, *overrides]
    return config, list(overrides)


def _run_in_place(cfg, command: str, plan, world: int, request: dict | None = None) -> int:
    """Run this process's rank (torchrun / srun task); the launcher's world must be TP x PP x DP."""
    import os
    import warnings

    import torch

    from megatron_rl.parallel.launch import threads_per_rank

    if plan.world_size != world:
        print(f"[{command}] {plan.mode} started {plan.world_size} task(s) but parallel.tp x pp x "
              f"cp x dp = {cfg.parallel.tp} x {cfg.parallel.pp} x {cfg.parallel.cp} x "
              f"{cfg.parallel.dp} = {world}; start {world} tasks or change the layout",
              file=sys.stderr)
        return 2
    os.environ.update(plan.env)
    threads = threads_per_rank()
    if threads:
        torch.set_num_threads(threads)
    # megatron-core warns on import that apex/Transformer Engine are absent: expected on CPU.
    warnings.filterwarnings("ignore", category=UserWarning, module=r"megatron\.")
    _train_worker(cfg, command, request)
    return 0


def _cmd_plot(args: argparse.Namespace) -> int:
    from megatron_rl.metrics.plot import plot_run

    for path in plot_run(args.run_dir):
        print(path)
    return 0


def _cmd_export(args: argparse.Namespace) -> int:
    from megatron_rl.run.export import export_run

    try:
        out = export_run(args.run_dir, args.step, args.out, args.format)
    except (FileNotFoundError, ValueError) as exc:
        print(f"export error: {exc}", file=sys.stderr)
        return 2
    print(f"exported {out}")
    return 0


def _cmd_sweep(args: argparse.Namespace) -> int:
    from megatron_rl.cli.sweep import run_sweep
    from megatron_rl.config.errors import ConfigError

    try:
        return run_sweep(args.sweep_file, args.parallel, args.report_only, args.overrides)
    except ConfigError as exc:
        print(f"sweep config error: {exc}", file=sys.stderr)
        return 2


def build_parser() -> argparse.ArgumentParser:
    """The CLI's argument parser."""
    p = Parser(prog="python -m megatron_rl", description="RL post-training on megatron-core")
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND",
                           help="one of the commands below; COMMAND --help lists its options")
    c = sub.add_parser("check", help="per-token log-prob/entropy parity of a TPxPP layout vs "
                                     "TP1xPP1 on the same weights (gloo processes on CPU)")
    c.add_argument("--tp", type=int, default=2, help="tensor-parallel size (default 2)")
    c.add_argument("--pp", type=int, default=2, help="pipeline-parallel size (default 2)")
    c.add_argument("--cp", type=int, default=1,
                   help="context-parallel size: each sequence split over cp ranks (default 1)")
    c.add_argument("--model", default="tiny", help="model preset (default tiny)")
    c.add_argument("--micro-batches", type=int, default=2,
                   help="micro-batches per pipeline pass (default 2)")
    c.add_argument("--batch", type=int, default=2, help="sequences per micro-batch")
    c.add_argument("--seq", type=int, default=32, help="sequence length")
    c.add_argument("--seed", type=int, default=1234, help="seed of the weights and tokens")
    c.add_argument("--temperature", type=float, default=1.0,
                   help="sampling temperature the log-probs are taken at (default 1.0)")
    c.add_argument("--chunk-size", type=int, default=None,
                   help="token chunk of the log-prob/entropy op (default: unchunked)")
    c.add_argument("--atol", type=float, default=1e-5,
                   help="largest allowed |difference| to TP1xPP1 (default 1e-5)")
    c.set_defaults(func=_cmd_check)

    t = sub.add_parser("train", help="RL training (SFT warm start when sft.steps > 0)")
    t.add_argument("config", nargs="?", default=None,
                   help="YAML config (default: the built-in tiny DAPO recipe, "
                        "megatron_rl/config/default_recipe.py)")
    t.add_argument("overrides", nargs="*", help="key=value overrides, e.g. trainer.seed=3 "
                                                "output_dir=runs/x")
    t.add_argument("--check", dest="check_only", action="store_true",
                   help="only load and check the config (exit 2 on an error), start nothing")
    t.set_defaults(func=_cmd_train)
    e = sub.add_parser("sft", help="supervised warm start only; writes OUTPUT_DIR/sft_weights.pt")
    e.add_argument("config", nargs="?", default=None,
                   help="YAML config (default: the built-in tiny DAPO recipe)")
    e.add_argument("overrides", nargs="*", help="key=value overrides, e.g. output_dir=runs/x")
    e.set_defaults(func=_cmd_train)
    add_eval_subcommand(sub)

    from megatron_rl.convert.cli import add_convert_subcommand

    add_convert_subcommand(sub)

    from megatron_rl.rollout.serve_cli import add_serve_subcommand

    add_serve_subcommand(sub)

    from megatron_rl.plan.command import add_plan_subcommand

    add_plan_subcommand(sub)

    from megatron_rl.cli.repro import add_repro_subcommand

    add_repro_subcommand(sub)
    from megatron_rl.config.doc import add_config_subcommand

    add_config_subcommand(sub)

    ex = sub.add_parser("export", help="Hugging Face directory (config, safetensors, tokenizer) "
                        "of a run's checkpoint")
    ex.add_argument("run_dir", help="run directory (trainer.output_dir)")
    ex.add_argument("--step", type=int, default=None,
                    help="checkpoint after this many RL steps (default: the newest)")
    ex.add_argument("--out", required=True, help="output directory")
    ex.add_argument("--format", choices=("hf", "peft"), default="hf",
                    help="hf: a Hugging Face directory (LoRA runs: adapters merged); peft: the "
                    "PEFT adapter directory of a LoRA run (docs/lora.md)")
    ex.set_defaults(func=_cmd_export)

    sw = sub.add_parser("sweep", help="run a sweep file (base config x one axis per sweep), "
                        "skipping finished runs; writes report.md and plots")
    sw.add_argument("sweep_file", help="sweep YAML (base config, sweeps; docs/study.md)")
    sw.add_argument("overrides", nargs="*", help="key=value overrides for every run (output_dir="
                    "sets the sweep's directory), e.g. model.hf_path=/models/Qwen2.5-3B-Instruct")
    sw.add_argument("--parallel", type=int, default=None,
                    help="runs at the same time (default: the file's parallel_runs)")
    sw.add_argument("--report-only", action="store_true",
                    help="only (re)write the report and plots from the runs on disk")
    sw.set_defaults(func=_cmd_sweep)

    pl = sub.add_parser("plot", help="write PNG curves of a run directory")
    pl.add_argument("run_dir", help="run directory with metrics.jsonl")
    pl.set_defaults(func=_cmd_plot)
    return p


def add_eval_subcommand(sub) -> None:
    """``eval``: validation accuracy and evaluation sets (docs/evaluation.md)."""
    e = sub.add_parser("eval", help="evaluate a run, a Megatron checkpoint or a Hugging Face "
                       "model on evaluation sets (pass@k, avg@k, maj@k; docs/evaluation.md)")
    e.add_argument("target", nargs="?", default=None,
                   help="run directory (newest or --step checkpoint), Megatron checkpoint, "
                        "Hugging Face model directory, or a YAML config whose output_dir is the "
                        "run (default: the built-in recipe)")
    e.add_argument("overrides", nargs="*", help="key=value overrides, e.g. rollout.engine=sglang")
    e.add_argument("--sets", default=None,
                   help="comma-separated sets: names of the config's data.eval_sets, shipped "
                        "sets (math_latex, chain_sum), .jsonl/.parquet files or reasoning-gym "
                        "tasks (default: the config's data.eval_sets)")
    e.add_argument("--n", type=int, default=None, help="samples per prompt, every set")
    e.add_argument("--k", default=None, help="comma-separated k of pass@k/avg@k/maj@k (<= n)")
    e.add_argument("--temperature", type=float, default=None,
                   help="sampling temperature, every set (0: greedy)")
    e.add_argument("--max-new-tokens", type=int, default=None, help="response length limit")
    e.add_argument("--step", type=int, default=None,
                   help="the checkpoint after this many RL steps (default: the newest)")
    e.add_argument("--out", default=None,
                   help="results go to OUT/eval/<set>.json (default: the run directory)")
    e.add_argument("--compare", nargs=2, metavar=("A", "B"), default=None,
                   help="compare two evaluated directories (run or --out): both, B - A and a "
                        "95%% bootstrap interval per metric")
    e.add_argument("--rounds", type=int, default=1000, help="bootstrap resamples of --compare")
    e.set_defaults(func=_cmd_eval)


def main(argv: list[str] | None = None) -> int:
    """Parse ``argv`` and run the command; returns the exit code."""
    args = parse_args(argv)
    return args.func(args)


# Commands whose process exits at once when they return (see :func:`exit_now`).
EXIT_NOW_COMMANDS = ("train", "sft", "eval")


def run(argv: list[str] | None = None) -> None:
    """``python -m megatron_rl``: run the command and exit with its code. ``train``/``sft``/
    ``eval`` end with :func:`exit_now`: their ranks and helpers are stopped by then, and the
    interpreter's teardown of torch & co. would otherwise keep the launcher alive for seconds
    (tens of seconds on a loaded machine) after the job has ended."""
    args = parse_args(argv)
    code = args.func(args)
    if getattr(args, "command", None) in EXIT_NOW_COMMANDS:
        exit_now(code)
    sys.exit(code)


def exit_now(code: int) -> None:
    """Exit without the interpreter's module teardown: wait for non-daemon threads and run the
    ``atexit`` handlers (multiprocessing finalizers, logging, trackers) as a normal exit does,
    flush stdout/stderr, then ``os._exit(code)``."""
    import atexit
    import os
    import threading

    for t in threading.enumerate():
        if t is not threading.main_thread() and not t.daemon:
            t.join()
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
    os._exit(code if isinstance(code, int) else 1)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The parsed command line; ``key=value`` overrides of ``train``/``sft``/``eval`` may come
    before or after options."""
    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    # key=value overrides may also come after options (argparse stops the positional list there)
    if extra and hasattr(args, "overrides") and all("=" in x and not x.startswith("-")
                                                    for x in extra):
        args.overrides = [*args.overrides, *extra]
    elif extra:
        chosen_parser(parser, args).error(unrecognized(chosen_parser(parser, args), extra))
    return args


if __name__ == "__main__":
    run()
