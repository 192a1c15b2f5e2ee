"""Launch rules of ``train``/``eval``/``sft`` (torchrun, srun, inside an allocation, local) and
the SLURM host-list parser. Environment dicts only: no processes, no SLURM needed."""

import pytest

from megatron_rl.cli.app import main
from megatron_rl.parallel.launch import (
    expand_hostlist,
    launch_mode,
    slurm_master_port,
    tasks_per_node,
    threads_per_rank,
)


def parse(nodelist: str) -> list[str]:
    return expand_hostlist(nodelist, use_scontrol=False)


@pytest.mark.parametrize("nodelist,hosts", [
    ("node7", ["node7"]),
    ("node[01-04]", ["node01", "node02", "node03", "node04"]),
    ("gpu[003-005,9]", ["gpu003", "gpu004", "gpu005", "gpu9"]),
    ("a1,b2", ["a1", "b2"]),
    ("n[1-2]-ib,x[3]", ["n1-ib", "n2-ib", "x3"]),
    ("rack[1-2]-n[08-10]", ["rack1-n08", "rack1-n09", "rack1-n10", "rack2-n08", "rack2-n09",
                            "rack2-n10"]),
    ("node[098-101]", ["node098", "node099", "node100", "node101"]),
])
def test_expand_hostlist_parser(nodelist, hosts):
    assert parse(nodelist) == hosts


@pytest.mark.parametrize("bad", ["", "node[1-", "node[a-b]", "node[5-3]", "n]1["])
def test_expand_hostlist_rejects_malformed(bad):
    with pytest.raises(ValueError):
        parse(bad)


def test_tasks_per_node():
    assert tasks_per_node("4(x2),3") == [4, 4, 3]
    assert tasks_per_node("8") == [8]
    assert tasks_per_node("") == []
    with pytest.raises(ValueError):
        tasks_per_node("4(2)")


def test_torchrun_runs_in_place_even_inside_slurm():
    env = {"RANK": "3", "WORLD_SIZE": "8", "LOCAL_RANK": "3", "SLURM_JOB_ID": "77",
           "SLURM_PROCID": "0", "SLURM_NTASKS": "1"}
    plan = launch_mode(env, expand=parse)
    assert (plan.mode, plan.world_size, plan.env) == ("torchrun", 8, {})


def _srun_env(**extra) -> dict:
    env = {"SLURM_JOB_ID": "4242", "SLURM_STEP_ID": "0", "SLURM_PROCID": "5",
           "SLURM_NTASKS": "16", "SLURM_LOCALID": "1", "SLURM_NODEID": "1",
           "SLURM_JOB_NODELIST": "login1,gpu[010-013]", "SLURM_STEP_NODELIST": "gpu[012-013]",
           "SLURM_STEP_TASKS_PER_NODE": "8(x2)"}
    env.update(extra)
    return env


def test_srun_task_runs_its_rank():
    plan = launch_mode(_srun_env(), expand=parse)
    assert plan.mode == "srun" and plan.world_size == 16
    assert plan.env == {"RANK": "5", "WORLD_SIZE": "16", "LOCAL_RANK": "1",
                        "MASTER_ADDR": "gpu012", "MASTER_PORT": str(slurm_master_port(4242)),
                        "LOCAL_WORLD_SIZE": "8"}


def test_srun_master_from_job_nodelist_without_step_list():
    env = _srun_env()
    del env["SLURM_STEP_NODELIST"]
    assert launch_mode(env, expand=parse).env["MASTER_ADDR"] == "login1"


def test_srun_keeps_given_master():
    plan = launch_mode(_srun_env(MASTER_ADDR="ib-gpu012", MASTER_PORT="6000"), expand=parse)
    assert (plan.env["MASTER_ADDR"], plan.env["MASTER_PORT"]) == ("ib-gpu012", "6000")


def test_master_port_same_for_all_tasks_differs_per_job_step_restart():
    ports = {launch_mode(_srun_env(SLURM_PROCID=str(r), SLURM_LOCALID=str(r % 8)),
                         expand=parse).env["MASTER_PORT"] for r in range(16)}
    assert len(ports) == 1
    base = slurm_master_port(4242)
    assert {slurm_master_port(4243), slurm_master_port(4242, step_id=1),
            slurm_master_port(4242, restart=1)}.isdisjoint({base})
    assert all(20000 <= slurm_master_port(j, s, r) < 40000
               for j in (0, 1, 10**9) for s in (0, 3) for r in (0, 5))
    restarted = launch_mode(_srun_env(SLURM_RESTART_COUNT="1"), expand=parse)
    assert restarted.env["MASTER_PORT"] == str(slurm_master_port(4242, 0, 1))


def test_batch_script_without_srun_is_refused():
    """The batch script has SLURM_PROCID/SLURM_NTASKS but no SLURM_STEP_ID (measured on
    slurm-wlm 22.05): starting all ranks from there would hang, so it is refused."""
    env = {"SLURM_JOB_ID": "9", "SLURM_PROCID": "0", "SLURM_NTASKS": "4",
           "SLURM_JOB_NODELIST": "vm"}
    plan = launch_mode(env, expand=parse)
    assert plan.mode == "refuse"
    assert "srun python -m megatron_rl train" in plan.message
    assert "MRL_LOCAL_SPAWN=1" in plan.message
    assert launch_mode({**env, "MRL_LOCAL_SPAWN": "1"}, expand=parse).mode == "local"
    assert launch_mode({"SLURM_JOB_ID": "9"}, expand=parse).mode == "refuse"


def test_plain_shell_spawns_locally():
    assert launch_mode({}, expand=parse).mode == "local"
    assert launch_mode({"MRL_LOCAL_SPAWN": "0", "HOME": "/root"}, expand=parse).mode == "local"


def test_threads_per_rank():
    assert threads_per_rank({}) is None
    assert threads_per_rank({"SLURM_CPUS_PER_TASK": "4"}) == 4
    assert threads_per_rank({"SLURM_CPUS_PER_TASK": "4", "MRL_THREADS_PER_RANK": "2"}) == 2


def _scrub(monkeypatch):
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "SLURM_PROCID", "SLURM_NTASKS",
                "SLURM_STEP_ID", "SLURM_JOB_ID", "MRL_LOCAL_SPAWN"):
        monkeypatch.delenv(key, raising=False)


def test_cli_refuses_inside_allocation(monkeypatch, capsys, tmp_path):
    _scrub(monkeypatch)
    monkeypatch.setenv("SLURM_JOB_ID", "123")
    monkeypatch.setenv("SLURM_PROCID", "0")
    monkeypatch.setenv("SLURM_NTASKS", "4")
    rc = main(["train", "examples/tiny_dapo.yaml", f"output_dir={tmp_path}"])
    assert rc == 2
    err = capsys.readouterr().err
    assert "not in an srun step" in err and "srun python -m megatron_rl train" in err
    assert not list(tmp_path.iterdir())  # nothing started


def test_cli_rejects_task_count_that_is_not_the_layout(monkeypatch, capsys, tmp_path):
    _scrub(monkeypatch)
    monkeypatch.setenv("SLURM_JOB_ID", "123")
    monkeypatch.setenv("SLURM_STEP_ID", "0")
    monkeypatch.setenv("SLURM_PROCID", "0")
    monkeypatch.setenv("SLURM_NTASKS", "3")
    rc = main(["train", "examples/tiny_dapo.yaml", f"output_dir={tmp_path}"])
    assert rc == 2
    assert "srun started 3 task(s) but parallel.tp x pp x cp x dp = 2 x 2 x 1 x 1 = 4" in (
        capsys.readouterr().err)


def test_hostlist_cli(capsys):
    from megatron_rl.parallel.hostlist import main as hostlist_main

    assert hostlist_main(["n[1-2]", "gpu9"]) == 0
    assert capsys.readouterr().out.split() == ["n1", "n2", "gpu9"]
    assert hostlist_main(["n[2-1]"]) == 2
    assert "descending range" in capsys.readouterr().err
