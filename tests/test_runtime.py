"""Parallel runtime: environment parsing and layout validation (no processes needed)."""

import pytest

from megatron_rl.parallel.runtime import (
    ParallelConfigError,
    first_slurm_host,
    read_dist_env,
    validate_layout,
)


@pytest.mark.parametrize("nodelist,host", [
    ("gpu[003-005,9]", "gpu003"),
    ("a1,b2", "a1"),
    ("node7", "node7"),
    ("n[1-2]-ib,x[3]", "n1-ib"),
    ("rack[01-02],gpu[7-9]", "rack01"),
])
def test_first_slurm_host(nodelist, host):
    assert first_slurm_host(nodelist) == host


def test_torchrun_env_wins_over_slurm():
    env = {"RANK": "3", "WORLD_SIZE": "8", "LOCAL_RANK": "1", "MASTER_ADDR": "h0",
           "MASTER_PORT": "1234", "SLURM_PROCID": "5", "SLURM_NTASKS": "16"}
    d = read_dist_env(env)
    assert (d.rank, d.world_size, d.local_rank, d.master_addr, d.master_port, d.source) == (
        3, 8, 1, "h0", 1234, "torchrun")


def test_slurm_env():
    env = {"SLURM_PROCID": "5", "SLURM_NTASKS": "16", "SLURM_LOCALID": "1",
           "SLURM_JOB_NODELIST": "gpu[010-013]", "SLURM_JOB_ID": "4242"}
    d = read_dist_env(env)
    assert (d.rank, d.world_size, d.local_rank, d.master_addr, d.source) == (
        5, 16, 1, "gpu010", "slurm")
    assert d.master_port == 10000 + 4242


def test_single_process_env():
    d = read_dist_env({})
    assert (d.rank, d.world_size, d.source) == (0, 1, "single")


def test_validate_layout_ok():
    assert validate_layout(8, tp=2, pp=2) == 2
    assert validate_layout(8, tp=2, pp=2, dp=2) == 2


@pytest.mark.parametrize("world,tp,pp,dp,needle", [
    (6, 4, 1, None, "world size 6 is not divisible by tensor_parallel_size (4)"),
    (8, 2, 2, 4, "data_parallel_size (4)"),
    (4, 0, 1, None, "tensor_parallel_size must be a positive integer"),
])
def test_validate_layout_errors(world, tp, pp, dp, needle):
    with pytest.raises(ParallelConfigError, match=needle.replace("(", r"\(").replace(")", r"\)")):
        validate_layout(world, tp, pp, dp)


def test_context_parallel_layout():
    """CP takes its share of the world (DP = world / (TP x PP x CP)); CP with EP is refused."""
    assert validate_layout(4, 1, 1, cp=2) == 2
    with pytest.raises(ParallelConfigError, match="context_parallel_size=2 with "
                                                  "expert_parallel_size=2 is not supported"):
        validate_layout(4, 1, 1, cp=2, ep=2)
