"""The sbatch scripts without a cluster: ``bash -n`` and the dry runs of ``examples/dapo_32b.sh``
and ``examples/dapo_qwen3_30b_a3b.sh`` (``MRL_DRY_RUN=1`` prints their srun commands) under a
made-up heterogeneous allocation."""

from __future__ import annotations

import os
import re
import shlex
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

REPO = Path(__file__).resolve().parents[1]
DAPO_SH = REPO / "examples" / "dapo_32b.sh"
MOE_SH = REPO / "examples" / "dapo_qwen3_30b_a3b.sh"
TINY_SH = REPO / "examples" / "tiny_slurm.sh"
CP_SH = REPO / "examples" / "dapo_qwen3_8b_32k.sh"


@pytest.mark.parametrize("script", [DAPO_SH, MOE_SH, TINY_SH, CP_SH], ids=lambda p: p.name)
def test_bash_syntax(script):
    r = subprocess.run(["bash", "-n", str(script)], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr


@pytest.mark.parametrize("script", [DAPO_SH, MOE_SH, TINY_SH, CP_SH], ids=lambda p: p.name)
def test_requeue_and_resume(script):
    text = script.read_text()
    assert "#SBATCH --requeue" in text and "#SBATCH --open-mode=append" in text
    assert "trainer.resume=true" in text


def _dry_run(tmp_path, actor: str, fleet: str, *args: str,
             script: Path = DAPO_SH) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM")}
    env.update(MRL_DRY_RUN="1", SLURM_JOB_ID="77", SLURM_JOB_NODELIST_HET_GROUP_0=actor,
               SLURM_JOB_NODELIST_HET_GROUP_1=fleet, SLURM_SUBMIT_DIR=str(REPO),
               MRL_RUN_DIR=str(tmp_path / "run"), PYTHONPATH=str(REPO))
    return subprocess.run(["bash", str(script), *args], capture_output=True, text=True,
                          env=env, timeout=60)


def _commands(out: str) -> list[list[str]]:
    return [shlex.split(line[2:].removesuffix(" &")) for line in out.splitlines()
            if line.startswith("+ ")]


def test_dapo_32b_dry_run_places_actor_and_fleet(tmp_path):
    r = _dry_run(tmp_path, "gpu[001-008]", "gpu[101-107],gpu200", "trainer.total_steps=3")
    assert r.returncode == 0, r.stderr
    assert "MASTER_ADDR=gpu001" in r.stdout
    servers, router, actor = _commands(r.stdout)
    # 16 SGLang servers: 2 per fleet node, TP4 each (4 GPUs per srun task)
    assert servers[:4] == ["srun", "--het-group=1", "--ntasks-per-node=2", "--gpus-per-task=4"]
    assert "sglang.launch_server" in " ".join(servers)
    # one router on the first fleet node, in front of every server
    assert router[:4] == ["srun", "--het-group=1", "--nodes=1", "--ntasks=1"]
    urls = router[router.index("--worker-urls") + 1:]
    hosts = [f"gpu{i}" for i in range(101, 108)] + ["gpu200"]
    assert urls == [f"http://{h}:{30000 + i}" for h in hosts for i in range(2)]
    # the actor: group 0, one task per GPU, the run config, resume, the overrides last
    assert actor[:4] == ["srun", "--het-group=0", "--ntasks-per-node=8", "--kill-on-bad-exit=1"]
    train = actor[actor.index("train") + 1:]
    assert train[0] == str(REPO / "examples" / "dapo_32b.yaml")
    assert {"parallel.tp=8", "parallel.pp=1", "parallel.dp=8", "trainer.resume=true",
            f"output_dir={tmp_path / 'run'}"} <= set(train)
    assert train[-1] == "trainer.total_steps=3"
    servers_arg = next(a for a in train if a.startswith("rollout.sglang.servers="))
    assert yaml.safe_load(servers_arg.split("=", 1)[1]) == urls
    assert "rollout.sglang.router_url=http://gpu101:30080" in train


def test_dapo_32b_refuses_wrong_actor_node_count(tmp_path):
    r = _dry_run(tmp_path, "gpu[001-007]", "gpu[101-108]")
    assert r.returncode == 2
    assert "7 nodes x 8 GPUs = 56 ranks but TP8 x PP1 x DP8 needs 64" in r.stderr


def test_dapo_32b_layout_matches_its_config():
    """The script's actor layout is the one examples/dapo_32b.yaml plans (when present)."""
    cfg_path = REPO / "examples" / "dapo_32b.yaml"
    if not cfg_path.exists():
        pytest.skip("examples/dapo_32b.yaml not in this checkout")
    par = yaml.safe_load(cfg_path.read_text())["parallel"]
    m = re.search(r"^ACTOR_TP=(\d+) ACTOR_PP=(\d+) ACTOR_DP=(\d+)", DAPO_SH.read_text(), re.M)
    assert m and tuple(map(int, m.groups())) == (par["tp"], par["pp"], par["dp"])
    nodes = re.search(r"^#SBATCH --nodes=(\d+)", DAPO_SH.read_text(), re.M)
    assert int(nodes.group(1)) * 8 == par["tp"] * par["pp"] * par["dp"]


def test_dapo_32b_overrides_are_valid_config(tmp_path):
    """What the script passes to ``train`` loads with ``examples/dapo_32b.yaml`` (the model and
    data paths aside: they name files of the cluster)."""
    from megatron_rl.config.load import load_config

    cfg_path = REPO / "examples" / "dapo_32b.yaml"
    if not cfg_path.exists():
        pytest.skip("examples/dapo_32b.yaml not in this checkout")
    r = _dry_run(tmp_path, "gpu[001-008]", "gpu[101-108]")
    assert r.returncode == 0, r.stderr
    actor = _commands(r.stdout)[-1]
    train = actor[actor.index("train") + 1:]
    overrides = [a for a in train[1:] if not a.startswith(("model.", "data.path="))]
    cfg = load_config(train[0], overrides)
    assert (cfg.parallel.tp, cfg.parallel.pp, cfg.parallel.dp) == (8, 1, 8)
    assert cfg.trainer.resume and cfg.trainer.output_dir == str(tmp_path / "run")
    assert cfg.rollout.engine == "sglang" and len(cfg.rollout.sglang.servers) == 16
    assert cfg.rollout.sglang.router_url == "http://gpu101:30080"
    assert cfg.rollout.sglang.weight_sync == "from_distributed"


def test_qwen3_moe_script_runs_its_config_layout(tmp_path):
    """``dapo_qwen3_30b_a3b.sh``: the actor layout (with EP) is its config's, one node per EP
    group; 4 SGLang servers x TP4 on the fleet; what it passes to ``train`` loads."""
    from megatron_rl.config.load import load_config

    par = yaml.safe_load((REPO / "examples" / "dapo_qwen3_30b_a3b.yaml").read_text())["parallel"]
    m = re.search(r"^ACTOR_TP=(\d+) ACTOR_PP=(\d+) ACTOR_DP=(\d+) ACTOR_EP=(\d+)",
                  MOE_SH.read_text(), re.M)
    assert m and tuple(map(int, m.groups())) == (par["tp"], par["pp"], par["dp"], par["ep"])
    nodes = re.search(r"^#SBATCH --nodes=(\d+)", MOE_SH.read_text(), re.M)
    assert int(nodes.group(1)) * 8 == par["tp"] * par["pp"] * par["dp"]
    r = _dry_run(tmp_path, "gpu[001-002]", "gpu[101-102]", "trainer.total_steps=3",
                 script=MOE_SH)
    assert r.returncode == 0, r.stderr
    servers, router, actor = _commands(r.stdout)
    assert servers[:4] == ["srun", "--het-group=1", "--ntasks-per-node=2", "--gpus-per-task=4"]
    assert len(router[router.index("--worker-urls") + 1:]) == 4
    train = actor[actor.index("train") + 1:]
    assert train[0] == str(REPO / "examples" / "dapo_qwen3_30b_a3b.yaml")
    assert {"parallel.tp=1", "parallel.pp=1", "parallel.dp=16", "parallel.ep=8"} <= set(train)
    overrides = [a for a in train[1:] if not a.startswith(("model.", "data.path="))]
    cfg = load_config(train[0], overrides)
    assert (cfg.parallel.dp, cfg.parallel.ep, cfg.trainer.total_steps) == (16, 8, 3)
    assert len(cfg.rollout.sglang.servers) == 4
    r = _dry_run(tmp_path, "gpu[001-003]", "gpu[101-102]", script=MOE_SH)
    assert r.returncode == 2 and "3 nodes x 8 GPUs = 24 ranks but TP1 x PP1 x DP16" in r.stderr


def test_qwen3_8b_32k_script_runs_its_config_layout(tmp_path):
    """``dapo_qwen3_8b_32k.sh``: the actor layout (with CP) is its config's and reaches
    ``train`` as ``parallel.cp``; a wrong node count is refused naming the CP size."""
    from megatron_rl.config.load import load_config

    par = yaml.safe_load((REPO / "examples" / "dapo_qwen3_8b_32k.yaml").read_text())["parallel"]
    m = re.search(r"^ACTOR_TP=(\d+) ACTOR_PP=(\d+) ACTOR_CP=(\d+) ACTOR_DP=(\d+)",
                  CP_SH.read_text(), re.M)
    assert m and tuple(map(int, m.groups())) == (par["tp"], par["pp"], par["cp"], par["dp"])
    r = _dry_run(tmp_path, "gpu[001-002]", "gpu[101-102]", "trainer.total_steps=3",
                 script=CP_SH)
    assert r.returncode == 0, r.stderr
    _servers, _router, actor = _commands(r.stdout)
    train = actor[actor.index("train") + 1:]
    assert {"parallel.tp=4", "parallel.pp=1", "parallel.dp=2", "parallel.cp=2"} <= set(train)
    overrides = [a for a in train[1:] if not a.startswith(("model.", "data.path="))]
    cfg = load_config(train[0], overrides)
    assert (cfg.parallel.cp, cfg.rollout.max_new_tokens) == (2, 32768)
    r = _dry_run(tmp_path, "gpu[001-003]", "gpu[101-102]", script=CP_SH)
    assert r.returncode == 2 and "24 ranks but TP4 x PP1 x CP2 x DP2 needs 16" in r.stderr


# ---- examples/tiny_slurm.sh fits the node ------------------------------------------------------
def _tiny(env_extra: dict[str, str], *args: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM", "MRL_"))}
    env.update(MRL_DRY_RUN="1", **env_extra)
    return subprocess.run(["bash", str(TINY_SH), *args], capture_output=True, text=True,
                          env=env, timeout=60)


@pytest.mark.parametrize("cpus,tasks,layout", [(1, 1, "TP1 x PP1 x DP1"),
                                               (2, 2, "TP2 x PP1 x DP1"),
                                               (3, 2, "TP2 x PP1 x DP1"),
                                               (64, 4, "TP2 x PP2 x DP1")])
def test_tiny_slurm_submits_what_the_node_fits(cpus, tasks, layout):
    r = _tiny({"MRL_NODE_CPUS": str(cpus)}, "--wait", "sft.steps=0", "--output=x.out")
    assert r.returncode == 0, r.stderr
    assert f"node CPUs {cpus}: {tasks} task(s), {layout}" in r.stderr
    (cmd,) = _commands(r.stdout)
    # sbatch options first, the script, then only the key=value overrides
    assert cmd == ["sbatch", f"--ntasks={tasks}", "--wait", "--output=x.out", str(TINY_SH),
                   "sft.steps=0"]


def test_tiny_slurm_refuses_more_tasks_than_cpus():
    for extra in ({"MRL_NTASKS": "4"}, {"MRL_LAYOUT": "2 2 1"}):
        r = _tiny({"MRL_NODE_CPUS": "2", "MRL_PARTITION": "debug", **extra})
        assert r.returncode == 2 and r.stdout == ""
        assert ("4 task(s) need a node with >= 4 CPUs (one per task) but the largest node of "
                "partition debug has 2") in r.stderr and "PartitionConfig" in r.stderr
    r = _tiny({"MRL_NODE_CPUS": "8", "MRL_PARTITION": "big", "MRL_LAYOUT": "1 1 8"})
    assert r.returncode == 0 and _commands(r.stdout)[0][:3] == ["sbatch", "--ntasks=8",
                                                                "--partition=big"]


def test_tiny_slurm_without_sinfo_says_what_to_do(tmp_path):
    for tool in ("tr", "sort", "tail"):  # a PATH with the script's tools but no sinfo
        (tmp_path / tool).symlink_to(shutil.which(tool))
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM", "MRL_"))}
    env.update(MRL_DRY_RUN="1", PATH=str(tmp_path))
    r = subprocess.run([shutil.which("bash"), str(TINY_SH)], capture_output=True, text=True,
                       env=env, timeout=60)
    assert r.returncode == 2 and "cannot read the nodes' CPUs" in r.stderr, r.stderr
    assert "MRL_NODE_CPUS" in r.stderr


def test_tiny_slurm_header_default_fits_two_cpus():
    """``sbatch examples/tiny_slurm.sh`` (the header's task count) lands on a 2-CPU node."""
    m = re.search(r"^#SBATCH --ntasks=(\d+)", TINY_SH.read_text(), re.M)
    assert m and int(m.group(1)) <= 2


def test_tiny_slurm_job_runs_one_rank_per_task(tmp_path):
    r = _tiny({"SLURM_JOB_ID": "9", "SLURM_NTASKS": "4", "SLURM_SUBMIT_DIR": str(REPO),
               "MRL_RUN_DIR": str(tmp_path / "run")}, "sft.steps=0")
    assert r.returncode == 0, r.stderr
    assert "4 task(s), TP2 x PP2 x DP1" in r.stdout
    (cmd,) = _commands(r.stdout)
    assert cmd[:3] == ["srun", "--kill-on-bad-exit=1", "--ntasks=4"]
    assert {"parallel.tp=2", "parallel.pp=2", "parallel.dp=1", "trainer.resume=true"} <= set(cmd)
    assert cmd[-1] == "sft.steps=0" and not (tmp_path / "run").exists()
