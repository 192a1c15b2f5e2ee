"""The rollout fleet: SGLang servers (or our ``serve``) behind the real ``sglang-router``.

:class:`Fleet` starts ``num_servers`` servers (``python -m sglang.launch_server --tp-size
--port --mem-fraction-static`` on their GPUs, or ``python -m megatron_rl serve`` on CPU) unless
``servers`` lists running ones, starts ``python -m sglang_router.launch_router`` (unless
``router_url`` is given) and registers every server through the router's worker API (router 0.3:
``POST /workers {"url"}`` -> ``worker_id``, ``GET /workers``, ``DELETE /workers/<worker_id>``).
With colocated servers the router never probes them by itself (:func:`router_health_checks`).
:meth:`Fleet.check_health` probes each server's ``/health_generate`` and removes a dead one from
the router (its requests are retried elsewhere by the client). A dead server this fleet started
is restarted at once (``restart_dead``, at most ``max_restarts`` times per server) on a new port;
it stays out of the router until a weight sync has given it the current weights: the sync's
targets are :meth:`Fleet.sync_targets` (registered servers + restarted ones, once healthy) and a
verified sync ends with :meth:`Fleet.rejoin`.
"""

from __future__ import annotations

import atexit
import http.client
import json
import os
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from typing import Any

from megatron_rl.config.errors import ConfigError

WEIGHT_SYNCS = ("from_disk", "from_tensor", "from_distributed")
LAUNCHERS = ("serve", "sglang")


class FleetError(RuntimeError):
    """A server or the router could not be started, reached or registered."""


class ServerError(RuntimeError):
    """A request to a server failed (connection error, timeout or non-2xx status)."""


PLACEMENT_ERROR = (
    "rollout.sglang.launcher='sglang' with empty rollout.sglang.gpus would start the SGLang "
    "servers on the trainer's GPUs while the actor keeps all its memory: set rollout.sglang.gpus "
    "to GPUs the trainer does not use (a separate fleet), list running servers in "
    "rollout.sglang.servers, or set rollout.sglang.colocate=true (share the trainer's GPUs; the "
    "actor is offloaded during rollout and the servers release their memory during the update)")


def on_cpu(s) -> bool:
    """Whether started SGLang servers run on the CPU (``--device cpu`` in ``extra_args``)."""
    args = [str(a) for a in (getattr(s, "extra_args", None) or [])]
    return any(a == "--device=cpu" or (a == "--device" and args[k + 1:k + 2] == ["cpu"])
               for k, a in enumerate(args))


def server_gpus(s, i: int) -> list[str]:
    """CUDA device ids of started server ``i``: ``rollout.sglang.gpus``, or -- colocated SGLang
    servers with no list -- the trainer's own GPUs, ``tp_size`` per server from its first GPU
    (through the trainer's ``CUDA_VISIBLE_DEVICES`` when set). An SGLang server with neither is
    refused (:data:`PLACEMENT_ERROR`)."""
    if s.gpus:
        gpus = [str(g) for g in s.gpus]
    elif s.launcher == "sglang" and s.colocate:
        visible = [g for g in os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",") if g]
        n = s.num_servers * s.tp_size
        gpus = visible[:n] if visible else [str(g) for g in range(n)]
    elif s.launcher == "sglang" and not on_cpu(s):
        raise ConfigError(PLACEMENT_ERROR)
    else:
        gpus = []  # our CPU serve, or SGLang started with --device cpu
    return gpus[i * s.tp_size:(i + 1) * s.tp_size]


def http_json(method: str, url: str, body: Any = None, timeout: float = 30.0) -> Any:
    """One HTTP request; the decoded JSON (or text) reply. Raises :class:`ServerError`."""
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, method=method,
                                 headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            raw = resp.read().decode()
    except urllib.error.HTTPError as exc:
        detail = exc.read().decode(errors="replace")[:500]
        raise ServerError(f"{method} {url}: HTTP {exc.code}: {detail}") from None
    except (urllib.error.URLError, OSError, TimeoutError, http.client.HTTPException) as exc:
        # HTTPException: e.g. a TCP self-connect while polling a port nobody listens on yet
        # (the reply is our own request line)
        raise ServerError(f"{method} {url}: {exc}") from None
    try:
        return json.loads(raw) if raw.strip() else None
    except json.JSONDecodeError:
        return raw


def wait_healthy(url: str, timeout_s: float, proc: subprocess.Popen | None = None,
                 path: str = "/health") -> None:
    """Poll ``url + path`` until it answers 200; :class:`FleetError` on timeout or exit."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise FleetError(f"{url}: process exited with code {proc.returncode} before it "
                             "became healthy")
        try:
            http_json("GET", url + path, timeout=5.0)
            return
        except ServerError:
            time.sleep(0.3)
    raise FleetError(f"{url}{path} did not answer within {timeout_s:.0f}s")


def server_command(s, port: int, model_path: str, eos_id: int | None) -> list[str]:
    """The command line of one server started by the fleet."""
    python = getattr(s, "python", None) or sys.executable  # rollout.sglang.python
    extra = [str(a) for a in getattr(s, "extra_args", None) or []]
    if s.launcher == "sglang":
        return [python, "-m", "sglang.launch_server", "--model-path", model_path,
                "--host", s.host, "--port", str(port), "--tp-size", str(s.tp_size),
                "--mem-fraction-static", str(s.mem_fraction_static), "--skip-tokenizer-init",
                *extra] + \
            (["--enable-memory-saver"] if getattr(s, "colocate", False) else [])  # release/resume
    cmd = [python, "-m", "megatron_rl", "serve", "--model-path", model_path,
           "--host", s.host, "--port", str(port), "--threads", str(s.server_threads),
           "--sglang-rules", getattr(s, "serve_rules", "0.5.21")]
    return cmd + ([] if eos_id is None else ["--eos-id", str(eos_id)]) + extra


def router_command(host: str, port: int, health_checks: bool = True) -> list[str]:
    """``sglang-router`` with no workers yet (they are added through its API); round robin; its
    Prometheus exporter on a free port (the default 29000 is taken by a second router on the
    same machine, which makes the router exit). ``health_checks=False`` (colocated servers):
    ``--disable-health-check``, no periodic ``/health`` (see :func:`router_health_checks`)."""
    import socket

    with socket.socket() as sock:
        sock.bind((host, 0))
        metrics_port = sock.getsockname()[1]
    return [sys.executable, "-m", "sglang_router.launch_router", "--host", host, "--port",
            str(port), "--policy", "round_robin", "--worker-startup-timeout-secs", "120",
            "--log-level", "warn", "--prometheus-port", str(metrics_port)] + \
        ([] if health_checks else ["--disable-health-check"])


# SGLang >= 0.5.21: "false" makes /health answer without a generation (/health_generate unchanged)
HEALTH_GENERATION_VAR = "SGLANG_ENABLE_HEALTH_ENDPOINT_GENERATION"


def router_health_checks(s) -> bool:
    """Whether the router may probe the servers' ``/health`` on its own (every 60 s in
    sglang-router 0.3.2). Not with colocated servers: SGLang 0.5.21's ``/health`` runs a
    one-token generation, which while the servers' memory is released is a forward on unmapped
    weights (or trips the idle check of ``release_memory_occupation``); the trainer checks the
    servers itself after every resume (:class:`megatron_rl.run.colocation.Colocation`). The
    router still probes ``/health`` once when a server is registered (at start, and when a
    restarted server rejoins after a sync): colocated servers this fleet starts get
    :data:`HEALTH_GENERATION_VAR` ``=false``, so that probe runs no generation."""
    return not getattr(s, "colocate", False)


class Fleet:
    """Servers + router. ``workers`` maps a server URL to its router ``worker_id``."""

    def __init__(self, s, model_path: str, eos_id: int | None, log_dir: str,
                 startup_timeout_s: float = 300.0) -> None:
        self.s, self.model_path, self.eos_id, self.log_dir = s, model_path, eos_id, log_dir
        self.timeout = startup_timeout_s
        self.procs: dict[str, subprocess.Popen] = {}
        self.router_proc: subprocess.Popen | None = None
        self.router_url = s.router_url or f"http://{s.host}:{s.router_port}"
        self.workers: dict[str, str] = {}
        self.dead: list[str] = []
        self.slot: dict[str, int] = {}  # url -> server index i, for servers started here
        self.pending: dict[str, int] = {}  # restarted, not in the router until a sync: url -> i
        self.restarts: dict[int, int] = {}  # server index -> restarts so far
        self.logs: dict[str, str] = {}  # url -> log file, for servers started here
        self._health_lock = threading.Lock()
        atexit.register(self.stop)

    # ---- processes -----------------------------------------------------------------------
    def _spawn(self, name: str, cmd: list[str], env: dict | None = None) -> subprocess.Popen:
        """Start ``cmd`` under :mod:`megatron_rl.rollout.guard` (ends with this process)."""
        os.makedirs(self.log_dir, exist_ok=True)
        env = dict(env or os.environ)
        root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
        env["PYTHONPATH"] = os.pathsep.join(p for p in [root, env.get("PYTHONPATH", "")] if p)
        log = open(os.path.join(self.log_dir, f"{name}.log"), "w")
        guard = [sys.executable, "-m", "megatron_rl.rollout.guard", str(os.getpid())]
        return subprocess.Popen(guard + cmd, stdout=log, stderr=subprocess.STDOUT, env=env,
                                start_new_session=True)

    def start_server(self, i: int, port: int | None = None, log_name: str | None = None
                     ) -> str:
        """Start server ``i`` (port ``router_port + 1 + i`` unless given, GPUs
        ``gpus[i*tp:(i+1)*tp]``); log ``server{i}.log`` unless ``log_name``."""
        s = self.s
        port = s.router_port + 1 + i if port is None else port
        url = f"http://{s.host}:{port}"
        env = dict(os.environ)
        if gpus := server_gpus(s, i):  # colocate: the trainer's GPUs
            env["CUDA_VISIBLE_DEVICES"] = ",".join(gpus)
        if not router_health_checks(s):  # the router's one /health at registration generates
            env[HEALTH_GENERATION_VAR] = "false"  # nothing (/health_generate still does)
        name = log_name or f"server{i}"
        self.procs[url] = self._spawn(name, server_command(s, port, self.model_path, self.eos_id),
                                      env)
        self.logs[url] = os.path.join(self.log_dir, f"{name}.log")
        self.slot[url] = i
        return url

    def _lost_its_port(self, url: str) -> bool:
        """Started server ``url`` exited because its port was taken (``Address already in
        use`` in its log): another process bound the port between its choice and the server's
        bind (e.g. a socket given an ephemeral port by the kernel)."""
        proc, log = self.procs.get(url), self.logs.get(url)
        if proc is None or proc.poll() is None or log is None or not os.path.exists(log):
            return False
        with open(log, errors="replace") as f:
            return "address already in use" in f.read().lower()

    def _wait_started(self, url: str) -> str:
        """Wait until server ``url`` is healthy; returns its URL. A started server that exited
        because its port was taken meanwhile is started again on a free port (at most
        ``max_restarts`` times); any other failure raises :class:`FleetError`."""
        limit = getattr(self.s, "max_restarts", 3)
        for k in range(limit + 1):
            try:
                wait_healthy(url, self.timeout, self.procs.get(url))
                return url
            except FleetError:
                if k == limit or url not in self.slot or not self._lost_its_port(url):
                    raise
            i = self.slot.pop(url)
            self.procs.pop(url, None)
            new = self.start_server(i, port=free_port(self.s.host),
                                    log_name=f"server{i}-port{k + 1}")
            print(f"[fleet] server {i}: {url} was taken by another process before the server "
                  f"could listen on it (log {self.logs[url]}); started again as {new}",
                  flush=True)
            url = new
        raise AssertionError("unreachable")

    def start(self) -> Fleet:
        """Start what is missing, wait until healthy, register every server with the router."""
        urls = list(self.s.servers) or [self.start_server(i) for i in range(self.s.num_servers)]
        if self.s.router_url is None:
            self.router_proc = self._spawn("router", router_command(
                self.s.host, self.s.router_port, router_health_checks(self.s)))
        urls = [self._wait_started(u) for u in urls]
        wait_healthy(self.router_url, self.timeout, self.router_proc)
        for u in urls:
            self.add_worker(u)
        return self

    def stop(self) -> None:
        """Terminate every process this fleet started."""
        for p in [*self.procs.values(), self.router_proc]:
            if p is not None and p.poll() is None:
                p.terminate()
        for p in [*self.procs.values(), self.router_proc]:
            if p is not None:
                try:
                    p.wait(timeout=10)
                except subprocess.TimeoutExpired:
                    p.kill()
        self.procs.clear()
        self.router_proc = None

    # ---- router worker API ---------------------------------------------------------------------
    def router_workers(self) -> list[dict]:
        """``GET /workers`` of the router."""
        return http_json("GET", self.router_url + "/workers").get("workers", [])

    def add_worker(self, url: str, timeout_s: float = 60.0) -> str:
        """Register ``url`` with the router and wait until it is listed; returns its id. With
        colocated servers the worker is registered with ``disable_health_check`` (also on a
        router this fleet did not start, ``router_url``): see :func:`router_health_checks`."""
        body: dict[str, Any] = {"url": url}
        if not router_health_checks(self.s):
            body["disable_health_check"] = True
        reply = http_json("POST", self.router_url + "/workers", body)
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            for w in self.router_workers():
                if w.get("url") == url:
                    self.workers[url] = w.get("id", reply.get("worker_id"))
                    return self.workers[url]
            time.sleep(0.2)
        raise FleetError(f"router {self.router_url} did not list worker {url}: {reply}")

    def remove_worker(self, url: str, timeout_s: float = 30.0) -> None:
        """``DELETE /workers/<worker_id>``, forget ``url``, and wait until the router stops
        listing it (router 0.3 queues the removal in the background and answers 202 at once; the
        DELETE is re-sent every 2 s). A router that still lists it after ``timeout_s`` is only
        reported: requests it routes there fail and are retried elsewhere."""
        wid = self.workers.pop(url, None)
        if wid is None:
            return
        deadline, resend = time.monotonic() + timeout_s, 0.0
        while time.monotonic() < deadline:
            if time.monotonic() >= resend:
                try:
                    http_json("DELETE", f"{self.router_url}/workers/{wid}", timeout=5.0)
                except ServerError:
                    pass
                resend = time.monotonic() + 2.0
            try:
                if all(w.get("url") != url for w in self.router_workers()):
                    return
            except ServerError:
                pass
            time.sleep(0.2)
        print(f"[fleet] warning: router {self.router_url} still lists removed worker {url} "
              f"after {timeout_s:.0f}s", flush=True)

    @property
    def urls(self) -> list[str]:
        """Servers currently registered."""
        return list(self.workers)

    def check_health(self, timeout_s: float = 10.0, generate: bool = True) -> list[str]:
        """Probe ``/health_generate`` of every server; remove the dead ones. Returns them. With
        ``generate=False`` (servers whose KV cache is released: a generation would run on
        released memory) only a started server's process is checked."""
        with self._health_lock:
            return self._check_health(timeout_s, generate)

    def _check_health(self, timeout_s: float, generate: bool = True) -> list[str]:
        dead = []
        for u in self.urls:
            proc = self.procs.get(u)
            alive = proc is None or proc.poll() is None
            if alive and generate:
                try:
                    http_json("GET", u + "/health_generate", timeout=timeout_s)
                except ServerError:
                    alive = False
            if not alive:
                self.remove_worker(u)
                self.dead.append(u)
                dead.append(u)
                self._restart(u)
        for u in list(self.pending):  # a restarted server that died before it rejoined
            proc = self.procs.get(u)
            if proc is not None and proc.poll() is not None:
                self.dead.append(u)
                dead.append(u)
                self._restart(u)
        if not self.workers and not self.pending:
            raise FleetError(f"every rollout server is dead ({self.dead})")
        return dead

    # ---- restarts ------------------------------------------------------------------------------
    def _end_process(self, url: str) -> None:
        """End the (guarded) process of ``url`` if it still runs (a hung server) and forget it."""
        proc = self.procs.pop(url, None)
        if proc is not None and proc.poll() is None:
            proc.terminate()  # the guard ends the server's whole process tree
            try:
                proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                proc.kill()

    def _restart(self, url: str) -> str | None:
        """Restart the dead server ``url`` on a new port (``restart_dead``, at most
        ``max_restarts`` times per server; attached servers are only removed). It joins the
        next sync's targets (:meth:`sync_targets`) and the router after it (:meth:`rejoin`).
        Returns its new URL, None when it is not restarted."""
        i = self.slot.pop(url, None)
        self.pending.pop(url, None)
        if i is None:  # attached by URL: not ours to restart
            return None
        self._end_process(url)
        if not getattr(self.s, "restart_dead", True):
            print(f"[fleet] server {i} ({url}) died; removed from the router "
                  "(rollout.sglang.restart_dead=false)", flush=True)
            return None
        k, limit = self.restarts.get(i, 0), getattr(self.s, "max_restarts", 3)
        if k >= limit:
            print(f"[fleet] server {i} ({url}) died; not restarted: it was restarted {k} times "
                  f"(rollout.sglang.max_restarts={limit}); removed from the router", flush=True)
            return None
        self.restarts[i] = k + 1
        new = self.start_server(i, port=free_port(self.s.host),
                                log_name=f"server{i}-restart{k + 1}")
        self.pending[new] = i
        print(f"[fleet] server {i} ({url}) died; restarted as {new} (restart {k + 1}/{limit}); "
              "it rejoins the router once the next weight sync has given it the current "
              "weights", flush=True)
        return new

    def sync_targets(self) -> list[str]:
        """The servers a weight sync must reach: the registered ones and every restarted one,
        waiting until it is healthy (one that fails to start is restarted again, bounded by
        ``max_restarts``)."""
        with self._health_lock:
            ready: list[str] = []
            while todo := [u for u in self.pending if u not in ready]:
                for u in todo:
                    try:
                        wait_healthy(u, self.timeout, self.procs.get(u))
                        ready.append(u)
                    except FleetError as exc:
                        print(f"[fleet] restarted server {u} did not start: {exc}", flush=True)
                        self.dead.append(u)
                        self._restart(u)
            return self.urls + ready

    def rejoin(self, urls: list[str], version: int | str) -> list[str]:
        """Register with the router every restarted server among ``urls`` (they took part in
        the verified sync of ``version``, so they hold the current weights). Returns them."""
        back = []
        with self._health_lock:
            for u in urls:
                if u in self.pending:
                    self.add_worker(u)
                    i = self.pending.pop(u)
                    back.append(u)
                    print(f"[fleet] restarted server {i} ({u}) holds weight version {version}; "
                          "back in the router", flush=True)
        return back


def free_port(host: str) -> int:
    """A port nobody listens on at ``host`` now."""
    import socket

    with socket.socket() as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]
