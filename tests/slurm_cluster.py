"""A real one-node SLURM cluster on loopback for tests: Debian's ``slurm-wlm`` + ``munge``,
``slurmctld`` and ``slurmd`` started by hand (no systemd), private config/state/log dirs and free
ports, torn down afterwards.

``LocalSlurm.ensure_installed()`` installs the packages with ``apt-get`` when they are missing
(root only); the ``slurm`` fixture of ``test_slurm.py`` skips when that is impossible (not root,
or no apt-get) and fails when an installed cluster does not start. Clients need
``cluster.env()`` (it sets ``SLURM_CONF``).
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import time
from pathlib import Path

SBIN = ("/usr/sbin", "/usr/bin", "/sbin")
PACKAGES = ("slurm-wlm", "munge")


class SlurmUnavailable(RuntimeError):
    """SLURM cannot be installed or started here (the tests skip with this message)."""


def _which(name: str) -> str | None:
    return shutil.which(name) or next((f"{d}/{name}" for d in SBIN
                                       if os.access(f"{d}/{name}", os.X_OK)), None)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _run(cmd: list[str], timeout: float = 60, check: bool = True, env: dict | None = None):
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, check=check,
                          env=env)


def _wait(pred, timeout: float, what: str, interval: float = 0.2) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if pred():
            return
        time.sleep(interval)
    raise SlurmUnavailable(f"timed out after {timeout:.0f}s waiting for {what}")


class LocalSlurm:
    """One controller + one compute node (this host, 127.0.0.1) under ``base``."""

    def __init__(self, base: Path):
        self.base = Path(base)
        self.conf = self.base / "etc" / "slurm.conf"
        self.node = socket.gethostname().split(".")[0]
        self.started_munge = False

    # ---- install ---------------------------------------------------------------------------
    @staticmethod
    def installed() -> bool:
        return all(_which(b) for b in ("slurmctld", "slurmd", "sbatch", "munged", "munge"))

    @classmethod
    def ensure_installed(cls) -> None:
        """Install ``slurm-wlm`` and ``munge`` with apt-get when missing (needs root)."""
        if cls.installed():
            return
        if os.geteuid() != 0 or not _which("apt-get"):
            raise SlurmUnavailable("slurm-wlm/munge not installed and cannot apt-get them "
                                   "(needs root and apt-get)")
        env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
        _run(["apt-get", "update", "-qq"], timeout=600, env=env)
        _run(["apt-get", "install", "-y", "-qq", "--no-install-recommends", *PACKAGES],
             timeout=900, env=env)
        if not cls.installed():
            raise RuntimeError("apt-get installed slurm-wlm/munge but the binaries are missing")

    # ---- start / stop ----------------------------------------------------------------------
    def env(self, **extra: str) -> dict[str, str]:
        """Environment for SLURM clients of this cluster (plus ``extra``)."""
        path = os.environ.get("PATH", "")
        path = ":".join([path, *[d for d in SBIN if d not in path.split(":")]])
        env = {**os.environ, "PATH": path, "SLURM_CONF": str(self.conf)}
        try:
            socket.gethostbyname(self.node)  # jobs derive MASTER_ADDR from the node's name
        except OSError:
            env["MASTER_ADDR"] = "127.0.0.1"
        return {**env, **extra}

    def start(self) -> None:
        """Start munged (unless one answers), slurmctld and slurmd; raises with the daemons'
        logs when the node does not become idle."""
        if os.geteuid() != 0:
            raise SlurmUnavailable("starting munged/slurmd needs root")
        self._write_conf()
        try:
            self._start_munge()
            _run([_which("slurmctld"), "-f", str(self.conf), "-c"])  # daemonizes; -c: fresh
            _wait(lambda: "is UP" in self.scontrol("ping", check=False), 30, "slurmctld")
            _run([_which("slurmd"), "-f", str(self.conf), "-N", self.node])
            _wait(lambda: self._node_state() == "idle", 60, f"node {self.node} to become idle")
        except (SlurmUnavailable, subprocess.SubprocessError) as exc:
            raise RuntimeError(f"local SLURM did not start: {exc}\n{self.logs()}") from exc

    def stop(self) -> None:
        """Cancel every job, shut the daemons down, stop munged if this fixture started it."""
        try:
            if "is UP" in self.scontrol("ping", check=False):
                _run(["scancel", "--user", "root"], check=False, env=self.env())
                try:
                    _wait(lambda: not self.squeue(), 20, "jobs to end")
                except SlurmUnavailable:
                    pass
                self.scontrol("shutdown", check=False)
        finally:
            for name in ("slurmctld", "slurmd"):
                self._stop_pid(self.base / "run" / f"{name}.pid")
            if self.started_munge:
                self._stop_pid(Path("/run/munge/munged.pid"))

    # ---- clients ---------------------------------------------------------------------------
    def scontrol(self, *args: str, check: bool = True) -> str:
        r = _run(["scontrol", *args], check=False, env=self.env())
        if check and r.returncode:
            raise RuntimeError(f"scontrol {' '.join(args)} failed: {r.stderr.strip()}")
        return r.stdout

    def squeue(self) -> str:
        return _run(["squeue", "-h"], check=False, env=self.env()).stdout.strip()

    def job_state(self, job_id: str) -> str | None:
        """``JobState`` of a job, or None once the controller forgot it."""
        out = self.scontrol("show", "job", "-o", job_id, check=False)
        for field in out.split():
            if field.startswith("JobState="):
                return field.split("=", 1)[1]
        return None

    def job_field(self, job_id: str, name: str) -> str | None:
        out = self.scontrol("show", "job", "-o", job_id, check=False)
        for field in out.split():
            if field.startswith(name + "="):
                return field.split("=", 1)[1]
        return None

    def logs(self) -> str:
        """Tails of the daemons' logs (for failure messages)."""
        parts = []
        for name in ("slurmctld.log", "slurmd.log"):
            path = self.base / "log" / name
            if path.exists():
                parts.append(f"--- {name}\n" + "\n".join(path.read_text().splitlines()[-30:]))
        return "\n".join(parts)

    # ---- internals -------------------------------------------------------------------------
    def _node_state(self) -> str:
        r = _run(["sinfo", "-h", "-n", self.node, "-o", "%T"], check=False, env=self.env())
        return r.stdout.strip()

    def _write_conf(self) -> None:
        for sub in ("etc", "run", "log", "state/ctld", "state/d"):
            (self.base / sub).mkdir(parents=True, exist_ok=True)
        cpus = os.cpu_count() or 1
        mem_mb = int(int(Path("/proc/meminfo").read_text().split()[1]) / 1024 * 0.9)
        b = self.base
        # cgroup-free (containers): linuxproc tracking, no task binding, no accounting.
        # MinJobAge: a finished job's record is kept >= 16 s (the tests read its state and
        # requeue it); `sbatch --wait` then polls every 8 s (every 2 s needs MinJobAge <= 4).
        self.conf.write_text(f"""\
ClusterName=mrltest
SlurmctldHost={self.node}(127.0.0.1)
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
AuthInfo=cred_expire=15
SlurmctldPort={_free_port()}
SlurmdPort={_free_port()}
StateSaveLocation={b}/state/ctld
SlurmdSpoolDir={b}/state/d
SlurmctldPidFile={b}/run/slurmctld.pid
SlurmdPidFile={b}/run/slurmd.pid
SlurmctldLogFile={b}/log/slurmctld.log
SlurmdLogFile={b}/log/slurmd.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/none
MpiDefault=none
MailProg=/bin/true
SchedulerType=sched/backfill
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
ReturnToService=2
SlurmdTimeout=30
InactiveLimit=0
KillWait=5
MinJobAge=16
NodeName={self.node} NodeAddr=127.0.0.1 CPUs={cpus} RealMemory={mem_mb} State=UNKNOWN
PartitionName=debug Nodes=ALL Default=YES MaxTime=INFINITE State=UP OverSubscribe=NO
""")

    def _start_munge(self) -> None:
        def ok() -> bool:
            try:
                cred = _run(["munge", "-n"], check=False, timeout=10).stdout
                return bool(cred) and subprocess.run(
                    ["unmunge"], input=cred, capture_output=True, text=True,
                    timeout=10).returncode == 0
            except (OSError, subprocess.SubprocessError):
                return False

        if ok():
            return
        for d in ("/run/munge", "/var/lib/munge", "/var/log/munge"):
            os.makedirs(d, exist_ok=True)
            shutil.chown(d, "munge", "munge")
        os.chmod("/run/munge", 0o755)
        key = Path("/etc/munge/munge.key")
        if not key.exists() or key.stat().st_size == 0:
            _run(["runuser", "-u", "munge", "--", _which("mungekey"), "--create",
                  f"--keyfile={key}"])
        shutil.chown(key, "munge", "munge")
        key.chmod(0o400)
        _run(["runuser", "-u", "munge", "--", _which("munged")])
        self.started_munge = True
        _wait(ok, 10, "munged")

    @staticmethod
    def _stop_pid(pidfile: Path) -> None:
        """SIGTERM the daemon named by ``pidfile`` (then SIGKILL after 10 s)."""
        try:
            pid = int(pidfile.read_text().strip())
        except (OSError, ValueError):
            return
        for sig, wait_s in ((15, 10.0), (9, 5.0)):
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                return
            try:
                _wait(lambda: not _alive(pid), wait_s, f"pid {pid} to exit")
                return
            except SlurmUnavailable:
                continue


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] != "Z"
    except OSError:
        return False
