"""Fault-injection campaign: kill the launcher, one rank or one rollout server at every phase of a
step, resume, and check that the run ends exactly as an uninterrupted one.

    python tools/chaos.py                       # the full campaign (embedded engine and fleet)
    python tools/chaos.py --quick               # 2 faults chained into one run (the CI subset)
    python tools/chaos.py --engines embedded --targets rank --signals KILL --phases update

Each fault: a fresh run of the tiny job (``examples/tiny_dapo.yaml`` at TP1 x PP2, 3 RL steps,
a checkpoint every step) is started with ``MRL_CHAOS_PHASE`` set, so every rank marks the start of
each phase (:mod:`megatron_rl.testing.chaos_hook`). The target's rank waits at the start of the
phase of step 2 while the other ranks go on into it; then the injector sends the signal
(``KILL`` = -9, ``TERM``) to the launcher, to that rank, or to one ``serve`` process of the
fleet, and releases the wait. A run that stopped is resumed with the same command (no fault).
Survived means:

* the launcher exited non-zero within 30 s of a launcher/rank fault (a server fault: the run goes
  on on the other server), naming the dead rank and its signal, and no process of the run was
  left 30 s after it exited;
* no unfinished ``step_*.tmp`` checkpoint was left by a stopped launcher and ``latest`` names a
  complete checkpoint;
* the resumed run finished (exit 0) with ``metrics.jsonl`` equal to the uninterrupted run's, key
  by key, bit for bit (wall times and the fleet's retry counters excepted), one row per step;
* its final checkpoint (model weights, optimizer state) is bit-identical to the uninterrupted
  run's and so is the trainer state saved in it (data-loader position, history): no sample was
  trained twice or skipped.

Prints a table of faults x outcome and, last, ``chaos: injected=N survived=M``.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from megatron_rl.testing.procs import alive, free_port_block  # noqa: E402

PHASES = ("rollout", "old_logp", "update", "weight_sync", "validation", "checkpoint")
TARGETS = ("launcher", "rank", "server")
SIGNALS = ("KILL", "TERM")
ENGINES = ("embedded", "fleet")
STRIKE_STEP = 1  # 0-based: the second step (a checkpoint of the first exists; validation runs)
VICTIM_RANK = 1  # the last pipeline stage of TP1 x PP2
BOUND_S = 30.0
QUICK = (("embedded", "rank", "KILL", "update"), ("embedded", "launcher", "KILL", "weight_sync"))
BASE = ("parallel.tp=1", "parallel.pp=2", "trainer.total_steps=3", "trainer.test_freq=2",
        "trainer.save_freq=1", "trainer.train_batch_size=4", "rollout.n=4",
        "rollout.gen_batch_size=4", "rollout.dynamic_sampling=false", "rollout.val_n=1",
        "actor.micro_batch_size=8", "actor.mini_batch_size=8", "sft.steps=3", "data.val_size=8",
        "rollout.per_request_seed=true", "rollout.temperature=0.9", "trainer.plots=false")
# Keys that may differ after a fault: wall times and rates, process stats (sys/: resident memory,
# open files), and the fleet's counts of retried requests and of tokens generated again.
VOLATILE_PREFIXES = ("time/", "gpu/", "sys/", "rollout/request_retries", "rollout/aborted_requests",
                     "rollout/redone_tokens", "rollout/resumed_requests",
                     "rollout/weight_sync_s", "rollout/weight_sync_gbps")
VOLATILE_KEYS = ("time", "wall_s")


@dataclass
class Outcome:
    """One fault and what came of it."""

    engine: str
    target: str
    sig: str
    phase: str
    rc: int | None = None
    stop_s: float | None = None
    orphans: list = field(default_factory=list)
    partial: list = field(default_factory=list)
    resumed: bool = False
    metrics_equal: bool = False
    weights_equal: bool = False
    note: str = ""
    chain: str = ""  # the chain this fault was struck in ("" = a run of its own)
    seconds: float = 0.0  # wall time spent on this fault (a chain's final run shared out)

    @property
    def key(self) -> tuple[str, str, str, str]:
        return self.engine, self.target, self.sig, self.phase

    @property
    def survived(self) -> bool:
        return (not self.orphans and not self.partial and self.metrics_equal
                and self.weights_equal and not self.note)


def engine_overrides(engine: str) -> list[str]:
    if engine == "embedded":
        return []
    return ["rollout.engine=sglang", "rollout.sglang.num_servers=2",
            f"rollout.sglang.router_port={free_port_block(3)}",
            "rollout.sglang.weight_sync=from_tensor"]


def train_cmd(out: str, overrides: list[str]) -> list[str]:
    return [sys.executable, "-m", "megatron_rl", "train", "examples/tiny_dapo.yaml",
            f"output_dir={out}", *BASE, *overrides]


def _env(extra: dict | None = None) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith("MRL_CHAOS")}
    env["PYTHONPATH"] = os.pathsep.join(p for p in [ROOT, env.get("PYTHONPATH", "")] if p)
    return {**env, **(extra or {})}


def run(out: str, overrides: list[str], timeout: float = 900) -> int:
    """One uninterrupted ``train``; its exit code (log in ``out + '.log'``)."""
    with open(out + ".log", "a") as log:
        return subprocess.run(train_cmd(out, overrides), cwd=ROOT, stdout=log,
                              stderr=subprocess.STDOUT, env=_env(), timeout=timeout).returncode


def metrics(out: str) -> list[dict]:
    rows = [json.loads(x) for x in open(os.path.join(out, "metrics.jsonl"))]
    return [{k: v for k, v in r.items() if k not in VOLATILE_KEYS and
             not k.startswith(VOLATILE_PREFIXES)} for r in rows]


def final_state(out: str) -> tuple[dict, dict]:
    """The newest checkpoint's tensors (every shard gathered, no process group needed) and its
    trainer state."""
    import torch
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    from megatron_rl.actor.checkpoint import latest_checkpoint

    ckpt = latest_checkpoint(os.path.join(out, "checkpoints"))
    with tempfile.TemporaryDirectory() as tmp:
        dcp_to_torch_save(ckpt, os.path.join(tmp, "all.pt"))
        tensors = torch.load(os.path.join(tmp, "all.pt"), weights_only=False)
    meta = torch.load(os.path.join(ckpt, "trainer.pt"), weights_only=False)
    return tensors, {"step": meta["step"], "trainer": meta["trainer"]}


def same_tree(a, b) -> bool:
    """Bit-exact equality of nested dicts/lists of tensors and plain values."""
    import io

    import torch

    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor)
                and a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b))
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(same_tree(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(same_tree(x, y) for x, y in zip(a, b))
    if isinstance(a, io.BytesIO) and isinstance(b, io.BytesIO):
        return a.getvalue() == b.getvalue()
    if isinstance(a, float) and isinstance(b, float) and a != a and b != b:
        return True  # NaN == NaN for our purpose
    try:
        return bool(a == b)
    except Exception:  # noqa: BLE001 - numpy arrays and the like
        import numpy as np

        return bool(np.array_equal(a, b))


def _markers(path: str) -> list[dict]:
    if not os.path.exists(path):
        return []
    with open(path) as f:
        return [json.loads(x) for x in f if x.strip()]


def _pidalive(pid: int) -> bool:
    import psutil

    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def _server_pid(tree, port: int) -> int | None:
    """The ``serve`` process listening on ``port`` among ``tree``."""
    for p in tree:
        try:
            cmd = p.cmdline()
        except Exception:  # noqa: BLE001 - gone meanwhile
            continue
        if ("serve" in cmd and "--port" in cmd and "megatron_rl.rollout.guard" not in cmd
                and cmd[cmd.index("--port") + 1] == str(port)):
            return p.pid
    return None


def inject(o: Outcome, out: str, overrides: list[str], timeout: float = 900,
           tag: str = "") -> int | None:
    """Start the run (or resume it), strike at the marker, wait for the launcher; the launcher's
    exit code. ``tag`` names this run's marker file (one per run of a chain)."""
    import psutil

    marker = os.path.join(out + f".chaos{tag}.jsonl")
    hold_rank = VICTIM_RANK if o.target == "rank" else 0
    env = _env({"MRL_CHAOS_PHASE": marker, "MRL_CHAOS_HOLD": f"{STRIKE_STEP}:{o.phase}:"
                f"{hold_rank}", "MRL_CHAOS_HOLD_S": "300"})
    log = open(out + ".log", "a")
    proc = subprocess.Popen(train_cmd(out, overrides), cwd=ROOT, stdout=log,
                            stderr=subprocess.STDOUT, env=env)
    deadline = time.monotonic() + timeout
    hold = None
    while hold is None and proc.poll() is None and time.monotonic() < deadline:
        hold = next((m for m in _markers(marker) if m["hold"]), None)
        time.sleep(0.05)
    if hold is None:
        o.note = f"phase {o.phase} of step {STRIKE_STEP + 1} never began (rc {proc.poll()})"
        _stop(proc)
        return None
    tree = psutil.Process(proc.pid).children(recursive=True)
    sig = getattr(signal, f"SIG{o.sig}")
    if o.target == "launcher":
        victim = proc.pid
    elif o.target == "rank":
        victim = hold["pid"]
    else:
        port = int(next(x for x in overrides if "router_port" in x).split("=")[1]) + 2
        victim = _server_pid(tree, port)
        if victim is None:
            o.note = "no serve process found"
    t0 = time.monotonic()
    if victim is not None:
        os.kill(victim, sig)
        if o.target == "server":  # the server must really be gone (SIGTERM: within 5 s)
            end = time.monotonic() + 5
            while _pidalive(victim) and time.monotonic() < end:
                time.sleep(0.05)
            if _pidalive(victim):
                o.note = f"server pid {victim} survived SIG{o.sig}"
    open(marker + ".go", "w").close()  # release the held rank (if it still lives)
    bound = BOUND_S if o.target != "server" else timeout
    try:
        rc = proc.wait(timeout=bound)
    except subprocess.TimeoutExpired:
        o.note = f"launcher still running {bound:.0f}s after the fault"
        _stop(proc)
        rc = proc.returncode
    exited = time.monotonic()
    if o.target == "rank" and not o.note:
        log.flush()
        said = open(out + ".log").read()
        if f"rank {VICTIM_RANK} (pid {victim}) died (killed by SIG{o.sig})" not in said:
            o.note = "the launcher did not name the dead rank and its signal"
    while alive(tree) and time.monotonic() - exited < BOUND_S:
        time.sleep(0.05)
    o.stop_s = time.monotonic() - t0
    o.orphans = alive(tree)
    for pid in o.orphans:  # leave nothing behind for the next fault
        try:
            os.kill(pid, signal.SIGKILL)
        except OSError:
            pass
    return rc


def _stop(proc: subprocess.Popen) -> None:
    from megatron_rl.parallel.lifecycle import stop_tree

    stop_tree([proc.pid])
    proc.wait()


def strike(o: Outcome, out: str, overrides: list[str], tag: str = "") -> None:
    """Inject ``o`` into the run in ``out`` (fresh, or resumed after an earlier fault of a chain)
    and check how it stopped: exit code, orphans, unfinished checkpoints, a loadable ``latest``.
    Sets ``o.note`` when the fault was not survived so far."""
    import glob

    from megatron_rl.actor.checkpoint import latest_checkpoint

    o.rc = inject(o, out, overrides, tag=tag)
    if o.note:
        return
    if o.target != "launcher" or o.sig != "KILL":  # the launcher cleaned up after itself
        o.partial = sorted(glob.glob(os.path.join(out, "*checkpoints", "step_*.tmp")))
    try:
        latest_checkpoint(os.path.join(out, "checkpoints"))
    except Exception as exc:  # noqa: BLE001 - a broken 'latest' is a finding
        o.note = f"latest is broken: {exc}"
        return
    if o.target != "server" and o.rc == 0:
        o.note = f"the run finished (exit 0) after SIG{o.sig} to the {o.target}"


def finish(outcomes: list[Outcome], out: str, ref: dict, overrides: list[str]) -> None:
    """Resume the run in ``out`` if it stopped (no fault), compare its metrics and final
    checkpoint with the reference run; the verdict applies to every fault in ``outcomes``."""
    last = outcomes[-1]
    if last.rc != 0:
        for o in outcomes:
            o.resumed = True
        rc = run(out, overrides)
        if rc != 0:
            for o in outcomes:
                o.note = o.note or f"resume exited {rc} (log {out}.log)"
            return
    metrics_equal = metrics(out) == ref["metrics"]
    tensors, trainer = final_state(out)
    weights_equal = same_tree(tensors, ref["tensors"]) and same_tree(trainer, ref["trainer"])
    for o in outcomes:
        o.metrics_equal, o.weights_equal = metrics_equal, weights_equal


def fresh(engine: str, overrides: list[str]) -> list[str]:
    """The fleet gets fresh ports for every run (another process may have taken the old ones)."""
    return engine_overrides(engine) if engine == "fleet" else overrides


def one_fault(o: Outcome, work: str, ref: dict, overrides: list[str]) -> Outcome:
    """Inject ``o`` into a fresh run, resume if the run stopped, compare with the reference."""
    t0 = time.monotonic()
    out = os.path.join(work, f"{o.engine}-{o.target}-{o.sig}-{o.phase}")
    shutil.rmtree(out, ignore_errors=True)
    strike(o, out, overrides)
    if not o.note:
        finish([o], out, ref, fresh(o.engine, overrides))
    o.seconds = time.monotonic() - t0
    return o


def chain(faults: list[Outcome], work: str, ref: dict, overrides: list[str],
          name: str) -> list[Outcome]:
    """Strike ``faults`` one after another into one run: the first into a fresh run, each next
    one into the resumed run of the one before (which redoes the struck step from the last
    checkpoint); then resume once more without a fault and compare with the reference. Each
    fault's stop is checked on its own; the final comparison covers them all. Halves the runs
    (N + 1 instead of 2N). If the run does not end as the reference did, every fault of the chain
    is redone in a run of its own, so that the failure is pinned on the fault that caused it."""
    out = os.path.join(work, name)
    shutil.rmtree(out, ignore_errors=True)
    t_chain = time.monotonic()
    for i, o in enumerate(faults):
        t0 = time.monotonic()
        o.chain = name
        strike(o, out, fresh(o.engine, overrides), tag=str(i))
        o.seconds = time.monotonic() - t0
        _report(o, "struck")
    t0 = time.monotonic()
    finish(faults, out, ref, fresh(faults[0].engine, overrides))
    share = (time.monotonic() - t0) / len(faults)
    for o in faults:
        o.seconds += share
    wall = time.monotonic() - t_chain
    if all(o.metrics_equal and o.weights_equal for o in faults):
        # the run ended as the reference did: each fault's verdict is its own stop check
        print(f"chaos: chain {name}: {sum(o.survived for o in faults)} of {len(faults)} faults "
              f"survived ({wall:.0f} s)", flush=True)
        return faults
    print(f"chaos: chain {name}: the run did not end as the reference; redoing its faults one "
          "by one", flush=True)
    return [one_fault(Outcome(o.engine, o.target, o.sig, o.phase), work, ref,
                      fresh(o.engine, overrides)) for o in faults]


def _report(o: Outcome, what: str = "") -> None:
    state = what or ("survived" if o.survived else "FAILED")
    print(f"chaos: {o.engine}/{o.target}/SIG{o.sig}/{o.phase}: {state} ({o.seconds:.0f} s)"
          f"{' ' + o.note if o.note else ''}", flush=True)


def reference(engine: str, work: str, overrides: list[str], reuse: bool = False) -> dict:
    """The uninterrupted run's metrics and final state; ``reuse``: an uninterrupted run already
    finished in ``work`` (same code and settings: the caller's word) is taken as it is."""
    out = os.path.join(work, f"{engine}-reference")
    done = os.path.exists(out + ".log") and "summary: " in open(out + ".log").read()
    if reuse and done:
        tensors, trainer = final_state(out)
        return {"metrics": metrics(out), "tensors": tensors, "trainer": trainer}
    shutil.rmtree(out, ignore_errors=True)
    rc = run(out, overrides)
    if rc != 0:
        raise SystemExit(f"chaos: the uninterrupted {engine} run failed (exit {rc}); see "
                         f"{out}.log")
    tensors, trainer = final_state(out)
    return {"metrics": metrics(out), "tensors": tensors, "trainer": trainer}


def plan(args) -> list[Outcome]:
    if args.quick:
        return [Outcome(*q) for q in QUICK]
    if args.faults:
        return [Outcome(*f.split("/")) for f in args.faults]
    return [Outcome(e, t, s, p) for e in args.engines for t in args.targets for s in args.signals
            for p in args.phases if not (t == "server" and e == "embedded")]


def load_results(path: str) -> list[Outcome]:
    """The faults recorded in a ``--results`` file (the last record of each fault wins)."""
    if not os.path.exists(path):
        return []
    by_key: dict = {}
    with open(path) as f:
        for line in f:
            if line.strip():
                o = Outcome(**json.loads(line))
                by_key[o.key] = o
    return list(by_key.values())


def groups(faults: list[Outcome], n: int, mixed: bool = False) -> list[list[Outcome]]:
    """Chains of up to ``n`` faults of one engine, target and signal (``mixed``: of one engine), in
    plan order; server faults (the run goes on to its end) always run on their own."""
    out: list[list[Outcome]] = []

    def kind(o: Outcome) -> tuple:
        return (o.engine,) if mixed else (o.engine, o.target, o.sig)

    for o in faults:
        last = out[-1] if out else None
        if (last and o.target != "server" and last[0].target != "server" and len(last) < n
                and kind(last[0]) == kind(o)):
            last.append(o)
        else:
            out.append([o])
    return out


def table(outcomes: list[Outcome]) -> str:
    head = ("engine", "target", "signal", "phase", "rc", "stop s", "orphans", "resumed",
            "metrics ==", "weights ==", "survived", "run", "fault s")
    rows = [head]
    for o in outcomes:
        rows.append((o.engine, o.target, o.sig, o.phase, str(o.rc),
                     "n/r" if o.stop_s is None else f"{o.stop_s:.1f}", str(len(o.orphans)),
                     "yes" if o.resumed else "no", "yes" if o.metrics_equal else "NO",
                     "yes" if o.weights_equal else "NO", "yes" if o.survived else "NO",
                     o.chain or "own", f"{o.seconds:.0f}"))
    widths = [max(len(r[i]) for r in rows) for i in range(len(head))]
    lines = ["| " + " | ".join(c.ljust(w) for c, w in zip(r, widths)) + " |" for r in rows]
    lines.insert(1, "|" + "|".join("-" * (w + 2) for w in widths) + "|")
    notes = [f"- {o.engine}/{o.target}/{o.sig}/{o.phase}: {o.note or ''}"
             f"{' partial ' + str(o.partial) if o.partial else ''}"
             f"{' orphans ' + str(o.orphans) if o.orphans else ''}"
             for o in outcomes if not o.survived]
    return "\n".join(lines + notes)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help=f"only {len(QUICK)} faults")
    ap.add_argument("--engines", nargs="+", default=list(ENGINES), choices=ENGINES)
    ap.add_argument("--targets", nargs="+", default=list(TARGETS), choices=TARGETS)
    ap.add_argument("--signals", nargs="+", default=list(SIGNALS), choices=SIGNALS)
    ap.add_argument("--phases", nargs="+", default=list(PHASES), choices=PHASES)
    ap.add_argument("--faults", nargs="+", default=None, metavar="ENGINE/TARGET/SIGNAL/PHASE",
                    help="an explicit list instead of the cross product, e.g. "
                         "fleet/server/KILL/rollout embedded/rank/TERM/validation")
    ap.add_argument("--work", default=None, help="work directory (default: a temporary one)")
    ap.add_argument("--chain", type=int, default=len(PHASES), metavar="N",
                    help="strike up to N launcher/rank faults of one engine, target and signal "
                         "into one run, each into the resumed run of the one before, and compare "
                         "once at the end (a chain that does not end as the reference is redone "
                         "fault by fault); 1 = every "
                         "fault in a run of its own (default: %(default)s; --quick: its "
                         f"{len(QUICK)} faults in one chain)")
    ap.add_argument("--results", default=None, metavar="FILE",
                    help="append one JSON line per finished fault to FILE; the table and the "
                         "last line then cover every fault in FILE")
    ap.add_argument("--skip-done", action="store_true",
                    help="with --results: leave out the faults FILE already holds (go on with "
                         "an interrupted campaign)")
    ap.add_argument("--reuse-reference", action="store_true",
                    help="take a finished uninterrupted run in --work as it is")
    args = ap.parse_args(argv)
    faults = plan(args)
    earlier = load_results(args.results) if args.results else []
    if args.skip_done:
        seen = {o.key for o in earlier}
        faults = [o for o in faults if o.key not in seen]
    chain_len = len(QUICK) if args.quick else max(1, args.chain)
    work = args.work or tempfile.mkdtemp(prefix="mrl-chaos-")
    os.makedirs(work, exist_ok=True)
    print(f"chaos: {len(faults)} fault(s), work directory {work}", flush=True)
    t_start = time.monotonic()
    refs: dict[str, tuple[dict, list[str]]] = {}
    done: list[Outcome] = []
    for group in groups(faults, chain_len, mixed=args.quick):
        engine = group[0].engine
        if engine not in refs:
            ov = engine_overrides(engine)
            t0 = time.monotonic()
            refs[engine] = (reference(engine, work, ov, args.reuse_reference), ov)
            print(f"chaos: {engine} reference run ({time.monotonic() - t0:.0f} s)", flush=True)
        ref, ov = refs[engine]
        if len(group) == 1:
            finished = [one_fault(group[0], work, ref, fresh(engine, ov))]
        else:
            g = group[0]
            finished = chain(group, work, ref, ov, f"{engine}-{g.target}-{g.sig}-chain{len(done)}")
        for o in finished:
            done.append(o)
            _report(o)
            if args.results:
                with open(args.results, "a") as f:
                    f.write(json.dumps(dataclasses.asdict(o)) + "\n")
    if args.results:  # every fault of the campaign so far, this invocation's last
        mine = {o.key for o in done}
        done = [o for o in load_results(args.results) if o.key not in mine] + done
    print(table(done))
    print(f"chaos: wall {time.monotonic() - t_start:.0f} s, {len(refs)} reference run(s)",
          flush=True)
    survived = sum(o.survived for o in done)
    print(f"chaos: injected={len(done)} survived={survived}", flush=True)
    return 0 if survived == len(done) else 1


if __name__ == "__main__":
    sys.exit(main())
