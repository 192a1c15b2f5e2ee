"""The step batch reaches each rank as its data-parallel rows only (issue 21): DP2 on gloo (and
TP2 x DP2 in the slow tier), one spawn each. Every rank's rows equal the broadcast-then-slice
rows (same tensors, same dtypes), TP peers of one DP rank get the same rows, a rank receives less
than ``1/dp`` of the broadcast payload (its rows, token ids as int32), and a filtered-out step
(no batch) arrives as None."""

import pickle

import pytest
import torch

from megatron_rl.parallel.launch import spawn

N, S, MINI = 16, 48, 8


def _batch() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(3)
    return {"tokens": torch.randint(0, 50_000, (N, S), generator=g),
            "mask": torch.rand(N, S, generator=g) > 0.5,
            "rollout_logp": -torch.rand(N, S, generator=g),
            "advantages": torch.randn(N, S, generator=g),
            "reward": torch.randn(N, generator=g)}


def _worker(tp: int) -> dict:
    from megatron.core import parallel_state as ps

    from megatron_rl.parallel import runtime
    from megatron_rl.parallel.runtime import broadcast_object
    from megatron_rl.rollout.collect import dp_rows
    from megatron_rl.run.driver import dp_rank_table, scatter_rows

    runtime.init_parallel(tp=tp, pp=1, timeout_s=120)
    dp, dp_rank = ps.get_data_parallel_world_size(), ps.get_data_parallel_rank()
    rank0 = torch.distributed.get_rank() == 0
    table = dp_rank_table()
    out: dict = {"dp": dp, "dp_rank": dp_rank, "table": table}
    for mini in (MINI, 0):
        metrics = {"rollout/acc": 0.5}
        batch = _batch() if rank0 else None
        full, m_b = broadcast_object((batch, metrics))  # the broadcast path
        want = {k: v[dp_rows(N, dp, dp_rank, mini)] for k, v in full.items()}
        got, m_s, nbytes = scatter_rows(batch, metrics, table, dp, mini)
        out[mini] = {"equal": sorted(got) == sorted(want) and all(
                         torch.equal(got[k], want[k]) and got[k].dtype == want[k].dtype
                         for k in want),
                     "metrics": m_s == m_b, "rows": got["tokens"].shape[0],
                     "received": nbytes, "broadcast": len(pickle.dumps((full, metrics))),
                     "tokens": got["tokens"].clone()}
    none, m_none, _ = scatter_rows(None, {"skipped": 1}, table, dp, MINI)
    out["none"] = (none, m_none)
    # a token budget: rows balanced over DP by length, each with its step row index
    from megatron_rl.actor.micro_batches import balanced_dp_rows, row_lengths

    batch = _batch() if rank0 else None
    got, _, _ = scatter_rows(batch, {}, table, dp, MINI, balance=True)
    pick = balanced_dp_rows(row_lengths(full["mask"]), dp, dp_rank, MINI)
    out["balanced"] = torch.equal(got["row_index"], pick) and all(
        torch.equal(got[k], v[pick]) for k, v in full.items())
    runtime.shutdown()
    return out


@pytest.mark.parametrize("tp", [1, pytest.param(2, marks=pytest.mark.slow)])
def test_each_rank_receives_only_its_dp_rows(tp):
    outs = spawn(_worker, 2 * tp, (tp,), timeout_s=300)
    assert [o["dp_rank"] for o in outs] == outs[0]["table"] and outs[0]["dp"] == 2
    assert all(o["balanced"] for o in outs)
    for mini in (MINI, 0):
        for rank, o in enumerate(outs):
            r = o[mini]
            assert r["equal"] and r["metrics"] and r["rows"] == N // 2, (rank, mini)
            if rank:  # rank 0 keeps its own rows; the others receive less than 1/dp
                assert 0 < r["received"] < r["broadcast"] / 2, (rank, r)
        by_dp: dict[int, torch.Tensor] = {}
        for o in outs:  # TP peers hold the same rows, the two DP ranks different ones
            prev = by_dp.setdefault(o["dp_rank"], o[mini]["tokens"])
            assert torch.equal(prev, o[mini]["tokens"])
        assert not torch.equal(by_dp[0], by_dp[1])
    assert all(o["none"] == (None, {"skipped": 1}) for o in outs)
