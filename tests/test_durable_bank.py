"""Durable rollout bank (issue 42, item 2): finished rollout groups are appended to a checksummed
file; a torn last record is dropped; after a kill during generation the resumed step trains the
same samples as an uninterrupted run, and the banked groups are not generated again."""

import json
import os
import signal

import pytest
import torch

from megatron_rl.rollout.bank import (
    FILE_NAME,
    HEADER,
    RolloutBank,
    encode_record,
    read_records,
)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SEED = 1234  # trainer.seed


def _records(uid0: int, prompts: list[list[int]], version: int, n: int = 2) -> list[dict]:
    """Scored records of one generation round as ``generate_records`` makes them."""
    return [{"uid": uid0 + k, "prompt_index": k, "prompt_ids": p, "response_ids": [7, k, j],
             "logprobs": [-0.5, -0.25 * j, -1.0 / 3], "truncated": False, "response_length": 3,
             "score": float(j), "acc": float(j), "reward": float(j), "text": f"r{k}{j}",
             "weight_version": version}
            for k, p in enumerate(prompts) for j in range(n)]


def test_durable_bank_torn_record_and_checksum(tmp_path):
    path = str(tmp_path / FILE_NAME)
    recs = [{"step": i, "x": [1.5, -0.1, 1e-300], "t": torch.arange(6, dtype=torch.int32
                                                                   ).reshape(2, 3)}
            for i in range(3)]
    blob = [encode_record(r) for r in recs]
    with open(path, "wb") as f:
        f.write(b"".join(blob))
    got, good, size = read_records(path)
    assert good == size == sum(map(len, blob)) and [g["step"] for g in got] == [0, 1, 2]
    assert got[1]["x"] == [1.5, -0.1, 1e-300]  # floats round-trip exactly
    assert torch.equal(got[2]["t"], recs[2]["t"]) and got[2]["t"].dtype == torch.int32

    # a SIGKILL during an append: the last record is cut anywhere in its header or payload
    for cut in (1, HEADER.size - 1, HEADER.size + 3, len(blob[2]) - 1):
        with open(path, "wb") as f:
            f.write(b"".join(blob[:2]) + blob[2][:cut])
        got, good, size = read_records(path)
        assert [g["step"] for g in got] == [0, 1] and size - good == cut

    # a flipped payload byte fails the checksum: reading stops there
    bad = bytearray(b"".join(blob))
    bad[len(blob[0]) + HEADER.size + 5] ^= 0x01
    with open(path, "wb") as f:
        f.write(bytes(bad))
    got, good, _ = read_records(path)
    assert [g["step"] for g in got] == [0] and good == len(blob[0])

    # the bank cuts a torn tail off when it opens, so later appends follow good records
    os.remove(path)
    bank = RolloutBank(path, "fp")
    bank.append(5, 0, _records(0, [[1, 2], [3]], version=5))
    with open(path, "ab") as f:
        f.write(encode_record({"step": 5})[:9])
    st = RolloutBank(path, "fp").open(resume_step=5, max_staleness=0)
    assert st == {"kept": 2, "dropped": 0, "torn_bytes": 9}
    assert read_records(path)[1] == os.path.getsize(path)


def test_durable_bank_reuse_rules(tmp_path):
    """Which banked groups a run resumed at step 5 trains on: same fingerprint and prompts,
    complete rounds, versions of its own history, within rollout.max_staleness."""
    path = str(tmp_path / FILE_NAME)
    p = [[1, 2, 3], [4, 5]]
    bank = RolloutBank(path, "fp")
    bank.append(4, 0, _records(0, p, version=4))  # a step already trained
    bank.append(5, 0, _records(10, p, version=5))  # the resumed step, its own weights
    bank.append(5, 1, _records(20, p, version=4))  # one version older
    bank.append(6, 0, _records(30, p, version=6))  # weights the resumed run never had
    bank.append(6, 1, _records(40, p, version=5))  # next step, one version older
    with open(path, "ab") as f:  # an incomplete round (one of its two groups)
        f.write(encode_record({"format": 1, "fingerprint": "fp", "step": 5, "round": 2,
                               "prompt_index": 0, "groups": 2, "oldest": 5, "newest": 5,
                               "samples": _records(50, p[:1], 5)}))
    RolloutBank(path + "2", "other").append(5, 3, _records(0, p, version=5))
    with open(path, "ab") as f, open(path + "2", "rb") as g:
        f.write(g.read())  # banked under another model or sampling settings

    sync = RolloutBank(path, "fp")
    assert sync.open(resume_step=5, max_staleness=0) == {"kept": 2, "dropped": 11,
                                                          "torn_bytes": 0}
    assert sync.take(5, 1, p) is None and sync.take(6, 1, p) is None
    assert sync.take(5, 0, [[1, 2, 3], [9]]) is None  # banked for other prompts: regenerated
    assert len(read_records(path)[0]) == 2  # the file holds what is reusable only

    os.remove(path)
    bank = RolloutBank(path, "fp")
    bank.append(5, 0, _records(10, p, version=5))
    bank.append(5, 1, _records(20, p, version=4))
    bank.append(6, 1, _records(40, p, version=5))
    bank.append(6, 0, _records(30, p, version=6))
    one_off = RolloutBank(path, "fp")
    assert one_off.open(resume_step=5, max_staleness=1)["kept"] == 6
    groups = one_off.take(5, 0, p)
    assert [[s["response_ids"] for s in g] for g in groups] == [[[7, 0, 0], [7, 0, 1]],
                                                               [[7, 1, 0], [7, 1, 1]]]
    assert all("uid" not in s for g in groups for s in g)
    assert groups[1][1]["logprobs"] == [-0.5, -0.25, -1.0 / 3] and groups[1][1]["reward"] == 1
    assert one_off.take(5, 1, p) is not None and one_off.take(6, 1, p) is not None
    assert one_off.take(5, 0, p) is None  # each round is trained once
    one_off.prune(6)
    assert {r["step"] for r in read_records(path)[0]} == {6}

    assert RolloutBank(path, "fp").open(resume_step=None, max_staleness=1)["kept"] == 0


def test_durable_bank_config_is_validated():
    from megatron_rl.config.errors import ConfigError
    from megatron_rl.config.load import load_config

    assert load_config(None, []).rollout.durable_bank is False
    assert load_config(None, ["rollout.durable_bank=true"]).rollout.durable_bank is True
    with pytest.raises(ConfigError, match="rollout.durable_bank must be true or false"):
        load_config(None, ["rollout.durable_bank=yes please"])
    with pytest.raises(ConfigError, match="rollout.durable_bank=true.*env.name"):
        load_config(None, ["rollout.durable_bank=true", "env.name=frozenlake"])


# ---- kill during generation, resume ---------------------------------------------------------
def parity_reward(row: dict, response: str) -> float:
    """A reward that varies within a group (an untrained model never solves the task), so that
    dynamic sampling keeps groups and needs several generation rounds per step."""
    return float(sum(response.encode()) % 2)


def _set_version(engine, init: torch.Tensor, version: int) -> None:
    """The weights of policy version ``version`` (a stand-in for the actor's update and weight
    sync: the final norm scaled by ``1 + version / 10``)."""
    with torch.no_grad():
        dict(engine.model.named_parameters())["model.norm.weight"].copy_(
            init * (1 + version / 10))
    engine.weight_version = version


def _rollout_run(out: str, steps: int, calls: str, kill_step: int | None = None) -> dict:
    """The trainer's rollout side (``RolloutDriver``: resume, start, collect, published,
    finish_step, state_dict, in train()'s order) with the embedded engine; the actor update is
    replaced by :func:`_set_version`, the checkpoint by the trainer state it holds. Each
    generate call is logged to ``calls`` as ``[out, step, round]``; with ``kill_step`` the
    process SIGKILLs itself when round 1 of that step starts (round 0 is banked). Returns
    the trained rows (token ids, rewards, behaviour log-probs) and reused groups per step."""
    from megatron_rl.config.load import load_config
    from megatron_rl.run import setup
    from megatron_rl.run.driver import RolloutDriver

    cfg = load_config(os.path.join(ROOT, "examples/tiny_dapo.yaml"), [
        f"output_dir={out}", "parallel.tp=1", "parallel.pp=1", f"trainer.total_steps={steps}",
        "trainer.train_batch_size=4", "rollout.gen_batch_size=2", "rollout.n=4",
        "actor.mini_batch_size=8", "actor.micro_batch_size=8",
        "rollout.max_num_gen_batches=30", "rollout.durable_bank=true",
        "rollout.reward_fn=test_durable_bank.parity_reward", "data.val_size=8",
        "data.train_size=64",
        "trainer.plots=false", f"trainer.seed={SEED}"])
    tok = setup.make_tokenizer(cfg)
    driver = RolloutDriver(cfg, tok, setup.score_fn(cfg))
    state_path = os.path.join(out, "trainer_state.pt")
    resuming = os.path.exists(state_path)
    start = driver.load_state_dict(torch.load(state_path, weights_only=False)) if resuming else 0

    def make_engine(cfg_, tok_):
        torch.manual_seed(0)
        engine = setup.make_engine(cfg_, tok_)
        engine.init_norm = dict(engine.model.named_parameters())["model.norm.weight"].clone()
        _set_version(engine, engine.init_norm, start)  # the first weight sync
        generate = engine.generate

        def counted(prompts, params, seed=None, **kw):
            step, rnd = divmod(seed - SEED * 100003, 101)
            with open(calls, "a") as f:
                f.write(json.dumps([out, step, rnd]) + "\n")
            if (step, rnd) == (kill_step, 1):
                os.kill(os.getpid(), signal.SIGKILL)
            return generate(prompts, params, seed=seed, **kw)

        engine.generate = counted
        return engine

    driver.start(make_engine, start, resuming)
    trained = {}
    for step in range(start, steps):
        local, metrics = driver.collect(step, 1, 1, 0)
        n = int(local["mask"].any(1).sum())
        trained[step] = {"tokens": local["tokens"][:n].tolist(),
                         "reward": local["reward"][:n].tolist(),
                         "logp": local["rollout_logp"][:n].tolist(),
                         "reused": metrics.get("rollout/bank_reused_groups", 0.0)}
        _set_version(driver.engine, driver.engine.init_norm, step + 1)
        driver.published(step + 1)
        driver.finish_step(step, metrics, None)
        torch.save(driver.state_dict(step + 1), state_path + ".tmp")
        os.replace(state_path + ".tmp", state_path)
    driver.tracker.close()
    return trained


def _bank_worker(jobs: list[tuple[str, int | None]], steps: int, calls: str) -> list[dict]:
    from megatron_rl.parallel import runtime

    runtime.init_parallel(tp=1, pp=1, dp=1, timeout_s=600)
    out = [_rollout_run(d, steps, calls, kill) for d, kill in jobs]
    runtime.shutdown()
    return out


@pytest.mark.slow
@pytest.mark.timeout(1500)
def test_durable_bank_kill_during_generation_resumes_same_samples(tmp_path):
    from megatron_rl.parallel.launch import WorkerError, spawn

    run, ref, calls = str(tmp_path / "run"), str(tmp_path / "ref"), str(tmp_path / "calls")
    # SIGKILLed as step 1's second generation round starts
    with pytest.raises(WorkerError, match="SIGKILL"):
        spawn(_bank_worker, 1, ([(run, 1)], 2, calls), timeout_s=600)
    banked = {(r["step"], r["round"], r["newest"]) for r in
              read_records(os.path.join(run, FILE_NAME))[0]}
    assert (1, 0, 1) in banked and (1, 1, 1) not in banked  # round 0 of step 1 was banked
    resumed, reference = spawn(_bank_worker, 1, ([(run, None), (ref, None)], 2, calls),
                               timeout_s=600)[0]
    log = [tuple(x) for x in map(json.loads, open(calls))]
    run_calls = [(s, r) for d, s, r in log if d == run]
    killed = run_calls.index((1, 1)) + 1
    assert run_calls[killed - 2:killed] == [(1, 0), (1, 1)]
    ref_step1 = [(s, r) for d, s, r in log if d == ref and s == 1]
    assert ref_step1[:2] == [(1, 0), (1, 1)]  # the uninterrupted run: round 0, 1, ...
    assert run_calls[killed:] == ref_step1[1:]  # resumed: round 0 is not generated again
    assert resumed.keys() == {1} and resumed[1]["reused"] == 2  # its two groups, from the bank
    assert reference[1]["reused"] == 0
    for key in ("tokens", "reward", "logp"):  # the resumed step trains the same samples
        assert resumed[1][key] == reference[1][key], key
