"""A cached virtual environment with real SGLang for CPU tests and local runs.

    python -m megatron_rl.testing.sglang_env            # build it if missing, print its python
    python -m megatron_rl.testing.sglang_env --check    # exit 1 if it is not built

SGLang pins its own torch and transformers, so it lives in its own venv and never touches the
trainer's environment. The venv (default ``~/.cache/megatron_rl/sglang-<version>``, overridable with
``MEGATRON_RL_SGLANG_VENV``) is built once, in a temporary directory that is renamed into place
when every step has succeeded, under a file lock (concurrent test sessions wait for one build):

1. ``torch`` and ``torchvision`` from the package index proper (the local ``+cpu`` torch wheel
   cannot load PyPI's torchvision), plus ``tools/sglang-cpu-deps-<version>.txt``: SGLang's own
   requirement list minus CUDA-only packages, plus the imports it does not declare;
2. ``sglang==<version> --no-deps`` (a plain install fails on CUDA-only pre-release metadata).

pip runs with the machine's pip configuration and local find-links switched off
(``PIP_CONFIG_FILE=/dev/null``), so the venv resolves from the index exactly as on a fresh machine.
About 2 minutes and 5.5 GB (of which 2.7 GB are NVIDIA libraries never loaded on CPU).
"""

from __future__ import annotations

import argparse
import fcntl
import hashlib
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

SGLANG_VERSION = "0.5.21"
TORCH_PINS = ("torch==2.13.0", "torchvision==0.28.0")
ENV_VAR = "MEGATRON_RL_SGLANG_VENV"
_MARKER = ".megatron_rl_sglang_ok"


def deps_file(version: str = SGLANG_VERSION) -> Path:
    """The project's dependency list for ``sglang==version`` on CPU (``tools/``)."""
    return Path(__file__).resolve().parents[2] / "tools" / f"sglang-cpu-deps-{version}.txt"


def venv_dir(version: str = SGLANG_VERSION) -> Path:
    """Where the venv lives: ``$MEGATRON_RL_SGLANG_VENV`` or ``~/.cache/megatron_rl/sglang-V``."""
    override = os.environ.get(ENV_VAR)
    if override:
        return Path(override).expanduser()
    return Path.home() / ".cache" / "megatron_rl" / f"sglang-{version}"


def venv_python(root: Path | None = None) -> Path:
    """The venv's interpreter (``bin/python``)."""
    return (root or venv_dir()) / "bin" / "python"


def recipe_hash(version: str = SGLANG_VERSION) -> str:
    """Fingerprint of what the venv is built from (version, pins, dependency list)."""
    h = hashlib.sha256(f"{version}|{'|'.join(TORCH_PINS)}|".encode())
    h.update(deps_file(version).read_bytes())
    return h.hexdigest()[:16]


def is_built(root: Path | None = None, version: str = SGLANG_VERSION) -> bool:
    """True when ``root`` holds a finished venv built from the current recipe."""
    root = root or venv_dir(version)
    marker = root / _MARKER
    return (venv_python(root).exists() and marker.exists()
            and marker.read_text().strip() == recipe_hash(version))


def pip_env() -> dict[str, str]:
    """Environment for the venv's pip: no machine config, no local wheels, no constraints."""
    env = dict(os.environ)
    for key in list(env):
        if key.startswith("PIP_") and key not in ("PIP_CERT", "PIP_DEFAULT_TIMEOUT",
                                                  "PIP_INDEX_URL", "PIP_EXTRA_INDEX_URL"):
            del env[key]
    env["PIP_CONFIG_FILE"] = os.devnull
    env["PIP_DISABLE_PIP_VERSION_CHECK"] = "1"
    env.pop("PYTHONPATH", None)
    return env


def _run(cmd: list[str], log) -> None:
    """Run one install step (output appended to ``log``); on failure raise with the log tail."""
    log.write(f"\n$ {' '.join(cmd)}\n")
    log.flush()
    rc = subprocess.call(cmd, stdout=log, stderr=subprocess.STDOUT, env=pip_env())
    if rc != 0:
        log.flush()
        tail = Path(log.name).read_text()[-4000:]
        raise RuntimeError(f"SGLang venv step failed (rc={rc}): {' '.join(cmd)}\n{tail}")


def build(root: Path, version: str = SGLANG_VERSION, python: str = sys.executable) -> Path:
    """Build the venv at ``root`` (via ``root.partial``, renamed when done); return its python."""
    tmp = root.with_name(root.name + ".partial")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.parent.mkdir(parents=True, exist_ok=True)
    log_path = root.with_name(root.name + ".install.log")
    t0 = time.time()
    with open(log_path, "w") as log:
        _run([python, "-m", "venv", str(tmp)], log)
        py = str(venv_python(tmp))
        _run([py, "-m", "pip", "install", "-q", *TORCH_PINS, "-r", str(deps_file(version))], log)
        _run([py, "-m", "pip", "install", "-q", "--no-deps", f"sglang=={version}"], log)
        _run([py, "-c", "import sglang, sglang.srt.utils, sglang.srt.managers.io_struct"], log)
        log.write(f"\nbuilt in {time.time() - t0:.0f} s\n")
    (tmp / _MARKER).write_text(recipe_hash(version) + "\n")
    shutil.rmtree(root, ignore_errors=True)
    # venv scripts hard-code their directory; ``python -m pip`` and ``bin/python`` do not care.
    tmp.rename(root)
    return venv_python(root)


def ensure(version: str = SGLANG_VERSION) -> Path:
    """The venv's python, building the venv first when missing or stale (under a file lock)."""
    root = venv_dir(version)
    if is_built(root, version):
        return venv_python(root)
    root.parent.mkdir(parents=True, exist_ok=True)
    with open(root.with_name(root.name + ".lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not is_built(root, version):
            build(root, version)
    return venv_python(root)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--check", action="store_true", help="exit 1 unless the venv is built")
    p.add_argument("--version", default=SGLANG_VERSION)
    a = p.parse_args(argv)
    if a.check:
        ok = is_built(version=a.version)
        print(venv_python() if ok else f"not built: {venv_dir(a.version)}")
        return 0 if ok else 1
    print(ensure(a.version))
    return 0


if __name__ == "__main__":
    sys.exit(main())
