"""Multi-turn environments and rollouts (issue 15): FrozenLake (gymnasium) and Sokoban
(reasoning-gym) behind the text interface, episodes with a real engine, and loss masks that keep
environment tokens out of the update."""

from random import Random

import pytest
import torch

from megatron_rl.envs import FrozenLakeTextEnv, SokobanTextEnv, parse_direction


def test_parse_direction():
    assert [parse_direction(t) for t in ("R", " up\n", "Left!", "d", "x", "", "42")] == \
        ["R", "U", "L", "D", None, None, None]


def test_frozenlake_slip_probability_is_gymnasiums_transition_table():
    for rate in (0.8, 0.98):
        env = FrozenLakeTextEnv(size=4, success_rate=rate)
        env.reset(3)
        start = int(env.state)
        probs = sorted(p for p, *_ in env.env.P[start][2])  # RIGHT from the start cell
        assert probs == pytest.approx(sorted([rate, (1 - rate) / 2, (1 - rate) / 2]))


def test_frozenlake_deterministic_episode_reaches_goal_and_invalid_is_a_noop():
    env = FrozenLakeTextEnv(size=3, success_rate=1.0, invalid_penalty=0.1)
    obs = env.reset(0)
    grid = [row for row in obs.strip().split("\n")]
    assert len(grid) == 3 and grid[0][0] == "P" and grid[2][2] == "G"
    obs2, r, done, info = env.step("banana")
    assert (obs2, r, done, info["invalid"]) == (obs, -0.1, False, True)
    # shortest path on this map by BFS over the map's ice cells
    desc = [[c.decode() for c in row] for row in env.env.desc]
    path = _bfs(desc)
    total, info = 0.0, {}
    for move in path:
        obs, r, done, info = env.step(move)
        total += r
    assert done and info["success"] and total == 1.0 and "P" in obs.split("\n")[2]


def _bfs(desc):
    n = len(desc)
    moves = {"L": (0, -1), "D": (1, 0), "R": (0, 1), "U": (-1, 0)}
    frontier, seen = [((0, 0), "")], {(0, 0)}
    while frontier:
        (r, c), path = frontier.pop(0)
        if desc[r][c] == "G":
            return path
        for m, (dr, dc) in moves.items():
            rr, cc = r + dr, c + dc
            if 0 <= rr < n and 0 <= cc < n and (rr, cc) not in seen and desc[rr][cc] != "H":
                seen.add((rr, cc))
                frontier.append(((rr, cc), path + m))
    raise AssertionError("generated map has no path")


def test_sokoban_room_solved_by_generators_solution():
    from reasoning_gym.games.contrib.sokoban.src.generator import generate

    env = SokobanTextEnv(size=5, boxes=1)
    obs = env.reset(11)
    assert obs.count("@") == 1 and "*" in obs
    _, solution, _ = generate(rng=Random(11), min_w=5, min_h=5, max_w=5, max_h=5, min_boxes=1,
                              max_boxes=1, max_depth=40)
    rewards = [env.step(m)[1] for m in solution]
    assert env.solved() and rewards[-1] == 1.0 and sum(rewards) == 1.0
    assert env.step("?")[1] == -0.1


@pytest.fixture(scope="module")
def episodes():
    from megatron_rl.models.config import get_preset
    from megatron_rl.rewards.tokenizer import ByteTokenizer
    from megatron_rl.rollout.embedded import EmbeddedEngine
    from megatron_rl.rollout.engine import SamplingParams
    from megatron_rl.rollout.multiturn import run_episodes

    torch.manual_seed(0)
    tok = ByteTokenizer()
    engine = EmbeddedEngine(get_preset("tiny"), tok.eos_id, tok.pad_id)
    recs = run_episodes(engine, tok, lambda: FrozenLakeTextEnv(size=3, success_rate=0.8),
                        [5, 6], 3, SamplingParams(max_new_tokens=3), max_turns=3, gen_seed=1,
                        max_total_tokens=512)
    return tok, recs


def test_episode_records_mask_only_the_models_tokens(episodes):
    tok, recs = episodes
    assert len(recs) == 6 and len({r["uid"] for r in recs}) == 2
    for r in recs:
        resp, mask = r["response_ids"], r["response_mask"]
        assert len(mask) == len(resp) == len(r["logprobs"])
        assert r["turns"] == len(r["turn_rewards"]) == len(r["turn_ends"]) >= 1
        assert r["reward"] == pytest.approx(sum(r["turn_rewards"]))
        # every turn's end is a model token; between turns the env's text is never masked
        assert all(mask[e] for e in r["turn_ends"])
        for a, b in zip(r["turn_ends"], r["turn_ends"][1:]):
            gap = mask[a + 1:b + 1]
            env_len = gap.index(True)
            assert env_len > 0 and not any(gap[:env_len])
            env_text = tok.decode(resp[a + 1:a + 1 + env_len])
            assert set(env_text.strip()) <= set("PSFHG\n")  # the grid observation
        assert all(lp == 0.0 for lp, m in zip(r["logprobs"], mask) if not m)


def test_episodes_to_batch_rewards_on_turn_ends(episodes):
    from megatron_rl.rollout.multiturn import episodes_to_batch

    _, recs = episodes
    batch = episodes_to_batch(recs, "gae", pad_id=0, rows_multiple=4)
    assert batch["tokens"].shape[0] == 8 and not batch["mask"][6:].any()
    for i, r in enumerate(recs):
        p = len(r["prompt_ids"])
        assert batch["mask"][i, :p].sum() == 0
        assert int(batch["mask"][i].sum()) == sum(r["response_mask"])
        assert batch["token_rewards"][i].sum().item() == pytest.approx(r["reward"])
        assert not batch["token_rewards"][i][~batch["mask"][i]].any()
    grpo = episodes_to_batch(recs, "grpo", pad_id=0, rows_multiple=1)
    assert not grpo["advantages"][~grpo["mask"]].any()


def _returns_over_valid_tokens(rewards, mask, gamma=1.0):
    """Independent float64 reward-to-go over the valid tokens of one row (env tokens skipped)."""
    out, running = [0.0] * len(mask), 0.0
    for t in reversed(range(len(mask))):
        if mask[t]:
            running = float(rewards[t]) + gamma * running
            out[t] = running
    return out


def test_reinforce_pp_multiturn_every_turn_receives_the_outcome(episodes):
    """REINFORCE++ on multi-turn episodes (ALGORITHMS.md §3.4): the outcome reward and the KL of
    later turns reach the earlier turns across the environment tokens between them."""
    from megatron_rl.rollout.late_advantages import reinforce_pp, token_rewards
    from megatron_rl.rollout.multiturn import episodes_to_batch

    _, recs = episodes
    batch = episodes_to_batch(recs, "reinforce_pp", pad_id=0, rows_multiple=4)
    mask = batch["mask"]
    assert not batch["advantages"].any()  # filled in after the old/ref passes
    g = torch.Generator().manual_seed(0)
    old = torch.randn(mask.shape, generator=g) - 2
    ref = old + 0.1 * torch.randn(mask.shape, generator=g)
    adv, _ = reinforce_pp(batch["reward"], mask, old, ref, kl_coef=0.05)
    r, _ = token_rewards(batch["reward"], mask, old, ref, 0.05)
    ret = torch.zeros(mask.shape, dtype=torch.float64)
    for i in range(mask.shape[0]):
        ret[i] = torch.tensor(_returns_over_valid_tokens(r[i].double(), mask[i].tolist()))
    vals = ret[mask]
    expected = torch.where(mask, (ret - vals.mean()) / (vals.var() + 1e-8).sqrt(), 0.0)
    torch.testing.assert_close(adv.double(), expected, atol=1e-5, rtol=0)
    # without KL every reply token of an episode, first turn included, has the episode's outcome
    adv0, _ = reinforce_pp(batch["reward"], mask, old, None, kl_coef=0.0)
    for i, rec in enumerate(recs):
        p = len(rec["prompt_ids"])
        first, last = p + rec["turn_ends"][0], p + rec["turn_ends"][-1]
        assert rec["turns"] > 1 and adv0[i, first] == adv0[i, last]
    assert adv0[0, len(recs[0]["prompt_ids"]) + recs[0]["turn_ends"][0]] != 0


@pytest.mark.parametrize("advantage", ["reinforce_pp", "reinforce_pp_baseline"])
def test_reinforce_pp_is_accepted_with_multi_turn_envs(advantage):
    from megatron_rl.config.load import load_config

    cfg = load_config("examples/sweeps/tiny_frozenlake.yaml", [f"trainer.advantage={advantage}"])
    assert cfg.trainer.advantage == advantage and cfg.env.name == "frozenlake"


def _mask_worker(records):
    """One actor update per variant from the same seeded weights; the updated weights."""
    import dataclasses

    from megatron_rl.actor.actor import Actor
    from megatron_rl.actor.optim import OptimConfig
    from megatron_rl.actor.train_step import ActorConfig
    from megatron_rl.loss import LossConfig
    from megatron_rl.models.config import get_preset
    from megatron_rl.parallel import runtime
    from megatron_rl.rollout.multiturn import episodes_to_batch

    runtime.init_parallel(tp=1, pp=1, dp=1, timeout_s=120)
    base = episodes_to_batch(records, "grpo", pad_id=0, rows_multiple=len(records))
    reply = base["mask"]
    tokens_seen = torch.zeros_like(reply)
    for i, r in enumerate(records):
        tokens_seen[i, 1:len(r["prompt_ids"]) + len(r["response_ids"])] = True
    env = tokens_seen & ~reply  # prompt and environment text
    clean = {"tokens": base["tokens"], "mask": reply, "advantages": reply.float()}
    # poisoned: environment/prompt positions carry a large negative advantage
    poisoned = dict(clean, advantages=torch.where(env, -50.0, clean["advantages"]))
    leaky = dict(poisoned, mask=reply | env)  # what a wrong mask would train on
    out = {}
    for name, batch in (("clean", clean), ("poisoned", poisoned), ("leaky", leaky)):
        actor = Actor(get_preset("tiny"), ActorConfig(micro_batch_size=len(records)),
                      OptimConfig(lr=1e-3), dataclasses.replace(
                          LossConfig.for_algorithm("ppo", loss_agg_mode="token-mean")),
                      total_steps=1, seed=3)
        batch = dict(batch)
        actor.add_old_logprobs(batch)
        metrics = actor.update(batch, 0)[-1]
        out[name] = ({k: v.detach().clone() for k, v in actor.model.state_dict().items()
                      if isinstance(v, torch.Tensor)}, metrics["policy/pg_loss"])
        del actor
    runtime.shutdown()
    return out


@pytest.mark.timeout(300)
def test_environment_tokens_never_reach_the_loss(episodes):
    from megatron_rl.parallel.launch import spawn

    _, recs = episodes
    (out,) = spawn(_mask_worker, 1, (recs,), timeout_s=240)
    (w_clean, pg_clean), (w_poison, pg_poison), (w_leak, pg_leak) = (
        out["clean"], out["poisoned"], out["leaky"])
    # env-token advantages change nothing: identical loss and bit-identical weights
    assert pg_poison == pg_clean == pytest.approx(-1.0)
    assert all(torch.equal(w_clean[k], w_poison[k]) for k in w_clean)
    # had they entered the loss, the objective's sign would flip and the update would differ
    assert pg_leak > 0
    assert any(not torch.allclose(w_clean[k], w_leak[k]) for k in w_clean)


@pytest.mark.parametrize("override,match", [
    ("env.name=chess", "env.name='chess' is not one of"),
    ("env.size=1", r"env.size must be in \[2, 64\], got 1"),
    ("env.success_rate=0", "env.success_rate must be in"),
    ("critic.gamma=1.5", r"critic.gamma must be in \[0, 1\], got 1.5"),
    ("critic.mini_batch_size=12", "critic.mini_batch_size=12 must divide"),
])
def test_env_and_critic_config_errors_name_the_field(override, match):
    from megatron_rl.config.errors import ConfigError
    from megatron_rl.config.load import load_config

    with pytest.raises(ConfigError, match=match):
        load_config("examples/sweeps/tiny_frozenlake.yaml", [override])


def test_gae_needs_an_environment():
    from megatron_rl.config.errors import ConfigError
    from megatron_rl.config.load import load_config

    with pytest.raises(ConfigError, match="needs a multi-turn environment"):
        load_config(None, ["trainer.advantage=gae"])


def test_chat_template_turns_rebuild_the_rendered_conversation(tmp_path):
    """With an HF chat template, prompt + reply(+EOS) + env turn == the template's rendering of
    the whole conversation, so the model sees exactly what the chat format says."""
    from megatron_rl.data.tokenizer import HFTokenizer
    from megatron_rl.rollout.multiturn import TurnRenderer
    from megatron_rl.testing.tiny_hf import make_tokenizer

    make_tokenizer(str(tmp_path), ["FrozenLake reach G avoid H Reply L D R U PFFF SFHG"])
    tok = HFTokenizer(str(tmp_path))
    render = TurnRenderer(tok, use_template=True)
    assert render.template
    ids = render.first("Reply L.\n", "PF\nFG\n") + tok.encode("R") + [tok.eos_id]
    ids += render.next("SP\nFG\n")
    want = tok.tok.apply_chat_template(
        [{"role": "user", "content": "Reply L.\nPF\nFG\n"}, {"role": "assistant", "content": "R"},
         {"role": "user", "content": "SP\nFG\n"}], add_generation_prompt=True, tokenize=False)
    assert tok.tok.decode(ids) == want
