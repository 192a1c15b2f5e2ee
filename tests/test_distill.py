"""On-policy distillation (issue 43, docs/distillation.md): the teacher's per-token log-probs on
the student's samples, the reverse-KL signal (reward and loss modes), its metrics, and the
``teacher`` section's load-time errors.

The per-token check uses a hand-made pair of tiny Hugging Face models (a 4-layer student and a
2-layer, narrower teacher with the same tokenizer): the actor's teacher pass, on two
data-parallel ranks, is compared with a direct ``transformers`` forward of each model
(log-softmax at the actor's temperature, gathered at the sampled tokens), and the advantages and
the metrics (reduced over both ranks) with the formulas computed by hand on the whole batch.
The same two processes then run the passes at TP2 and at PP2 (the teacher split like the run):
the teacher's log-probs, the advantages and the metrics equal TP1's within 1e-5.
"""

from __future__ import annotations

import shutil

import pytest
import torch

from megatron_rl.config.errors import ConfigError
from megatron_rl.config.load import load_config
from megatron_rl.config.sections import TeacherSection
from megatron_rl.loss import LossConfig, LossInputs, ReductionContext, compute_loss
from megatron_rl.loss.distill import distill_advantages, distill_stats, reverse_kl
from megatron_rl.parallel.launch import spawn

TEMP = 0.8
COEF, TASK_COEF, NATS = 0.5, 1.0, 0.3


# ---- a hand-made student/teacher pair -----------------------------------------------------
@pytest.fixture(scope="module")
def pair(tmp_path_factory) -> dict[str, str]:
    """``student``/``teacher`` HF dirs sharing one tokenizer, ``other``: another tokenizer."""
    from megatron_rl.testing.tiny_hf import make_model, make_tokenizer

    root = tmp_path_factory.mktemp("distill")
    corpus = [f"What is {a} plus {b} ? \\boxed{{{a + b}}}" for a in range(20) for b in range(20)]
    dirs = {n: str(root / n) for n in ("student", "teacher", "other")}
    tok = make_tokenizer(dirs["student"], corpus)
    shutil.copytree(dirs["student"], dirs["teacher"])
    vocab = -(-len(tok) // 64) * 64
    make_model(dirs["student"], vocab, "qwen2", seed=0)
    make_model(dirs["teacher"], vocab, "qwen2", seed=1, hidden_size=32, intermediate_size=64,
               num_hidden_layers=2)
    other = make_tokenizer(dirs["other"], [c.replace("plus", "minus") for c in corpus])
    make_model(dirs["other"], -(-len(other) // 64) * 64, "qwen2", seed=2)
    return dirs


def _batch(vocab: int) -> dict[str, torch.Tensor]:
    """4 rows of 12 tokens: a 5-token prompt, then responses of 7, 4, 6 and 1 tokens."""
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(3, vocab, (4, 12), generator=g)
    mask = torch.zeros(4, 12, dtype=torch.bool)
    for row, n in enumerate((7, 4, 6, 1)):
        mask[row, 5:5 + n] = True
    adv = torch.tensor([1.0, -1.0, 0.5, -0.5])[:, None].expand(4, 12) * mask
    return {"tokens": tokens, "mask": mask, "advantages": adv.contiguous()}


def _pair_worker(student: str, teacher: str, batch: dict, mode: str) -> dict:
    """One of two data-parallel ranks (rows 2r, 2r+1 of the batch): the actor with its
    teacher, the old-policy and teacher passes, the signal, its metrics over both ranks."""
    from megatron_rl.actor.actor import Actor
    from megatron_rl.actor.optim import OptimConfig
    from megatron_rl.actor.train_step import ActorConfig
    from megatron_rl.convert.model_source import HFShardSource
    from megatron_rl.convert.registry import read_hf_config
    from megatron_rl.parallel import runtime
    from megatron_rl.rollout.distill import add_distillation

    runtime.init_parallel(tp=1, pp=1, dp=2, timeout_s=120)
    rank = torch.distributed.get_rank()
    full = batch
    batch = {k: v[2 * rank:2 * rank + 2] for k, v in batch.items()}
    s_cfg, t_cfg = read_hf_config(student)[1], read_hf_config(teacher)[1]
    actor = Actor(s_cfg, ActorConfig(micro_batch_size=2, temperature=TEMP),
                  OptimConfig(lr=1e-3), LossConfig.for_algorithm("dapo"), total_steps=1,
                  full_state=HFShardSource(student, s_cfg), teacher_cfg=t_cfg,
                  teacher_state=HFShardSource(teacher, t_cfg))
    actor.add_old_logprobs(batch)
    actor.add_teacher_logprobs(batch)
    loss_mode = dict(batch)  # loss mode: only the task advantages' weight changes
    metrics = add_distillation(batch, TeacherSection(hf_path=teacher, mode=mode, coef=COEF,
                                                     task_coef=TASK_COEF, disagree_nats=NATS))
    add_distillation(loss_mode, TeacherSection(hf_path=teacher, mode="loss", task_coef=0.5))
    out = {k: batch[k] for k in ("old_logp", "teacher_logp", "advantages")} | {
        "m": metrics, "loss_mode_adv": loss_mode["advantages"]}
    out["offload"] = _offload_checks(actor, batch, s_cfg, t_cfg, student, teacher)
    out["layouts"] = {f"tp{tp}pp{pp}": _layout_pass(tp, pp, full, mode, student, teacher)
                      for tp, pp in ((2, 1), (1, 2))}
    runtime.shutdown()
    return out


def _layout_pass(tp: int, pp: int, batch: dict, mode: str, student: str,
                 teacher: str) -> dict | None:
    """The same passes and signal on the whole batch at TP ``tp`` x PP ``pp`` (the two ranks,
    DP1; megatron's model-parallel state re-made on the same processes): ``teacher_logp``,
    ``advantages`` and the metrics from the last stage (None on the first stage)."""
    from megatron.core import parallel_state as ps

    from megatron_rl.actor.actor import Actor
    from megatron_rl.actor.optim import OptimConfig
    from megatron_rl.actor.train_step import ActorConfig
    from megatron_rl.convert.model_source import HFShardSource
    from megatron_rl.convert.registry import read_hf_config
    from megatron_rl.parallel import runtime
    from megatron_rl.rollout.distill import add_distillation

    runtime.init_parallel(tp=tp, pp=pp, dp=1, timeout_s=120)
    batch = dict(batch)
    s_cfg, t_cfg = read_hf_config(student)[1], read_hf_config(teacher)[1]
    actor = Actor(s_cfg, ActorConfig(micro_batch_size=2, temperature=TEMP),
                  OptimConfig(lr=1e-3), LossConfig.for_algorithm("dapo"), total_steps=1,
                  full_state=HFShardSource(student, s_cfg), teacher_cfg=t_cfg,
                  teacher_state=HFShardSource(teacher, t_cfg))
    actor.add_old_logprobs(batch)
    actor.add_teacher_logprobs(batch)
    metrics = add_distillation(batch, TeacherSection(hf_path=teacher, mode=mode, coef=COEF,
                                                     task_coef=TASK_COEF, disagree_nats=NATS))
    if not ps.is_pipeline_last_stage():
        return None
    return {"teacher_logp": batch["teacher_logp"], "advantages": batch["advantages"],
            "m": metrics}


def _offload_checks(actor, batch: dict, s_cfg, t_cfg, student: str, teacher: str) -> dict:
    """Placement like the reference model: a resident teacher leaves the device with the actor
    (colocation) and comes back bit-exact; an offloaded one (``actor.offload_ref``) holds no
    device bytes between its passes and gives the same log-probs."""
    from megatron_rl.actor.actor import Actor
    from megatron_rl.actor.offload import ActorOffload
    from megatron_rl.actor.optim import OptimConfig
    from megatron_rl.actor.train_step import ActorConfig
    from megatron_rl.convert.model_source import HFShardSource
    from megatron_rl.testing.device_accounting import device_bytes

    out = {"resident": not actor.offload_ref}
    off = ActorOffload(actor, "cpu")
    off.offload()
    out["bytes_offloaded"] = device_bytes(actor, "cpu")
    off.onload()
    again = {k: batch[k] for k in ("tokens", "mask")}
    out["after_onload"] = actor.add_teacher_logprobs(again)["teacher_logp"]
    cfg = ActorConfig(micro_batch_size=2, temperature=TEMP, offload_ref=True)
    offloaded = Actor(s_cfg, cfg, OptimConfig(lr=1e-3), LossConfig.for_algorithm("dapo"), 1,
                      full_state=HFShardSource(student, s_cfg), teacher_cfg=t_cfg,
                      teacher_state=HFShardSource(teacher, t_cfg))
    out["teacher_bytes_between"] = sum(p.untyped_storage().nbytes()  # as the reference's
                                       for p in offloaded.teacher_model.parameters())
    again = {k: batch[k] for k in ("tokens", "mask")}
    out["offloaded_logp"] = offloaded.add_teacher_logprobs(again)["teacher_logp"]
    return out


def _direct_logp(hf_dir: str, tokens: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """``[N, S]``: ``log softmax(logits / TEMP)`` of the HF model at each sampled token."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        logits = model(tokens).logits.float() / TEMP
    logp = torch.log_softmax(logits[:, :-1], dim=-1).gather(-1, tokens[:, 1:, None])[..., 0]
    return torch.where(mask, torch.nn.functional.pad(logp, (1, 0)), 0.0)


def test_distill_teacher_pass_and_signal_match_a_direct_computation(pair):
    from transformers import AutoTokenizer

    batch = _batch(len(AutoTokenizer.from_pretrained(pair["student"])))
    ranks = spawn(_pair_worker, 2, (pair["student"], pair["teacher"], batch, "reward"),
                  timeout_s=300)
    out = {k: torch.cat([r[k] for r in ranks]) for k in ranks[0]
           if k not in ("m", "offload", "layouts")}
    assert ranks[0]["m"] == ranks[1]["m"]  # reduced over both data-parallel ranks
    out["m"] = ranks[0]["m"]
    out["offload"] = {k: v if not isinstance(v, torch.Tensor) else torch.cat(
        [r["offload"][k] for r in ranks]) for k, v in ranks[0]["offload"].items()}
    for r in ranks:
        assert r["offload"]["bytes_offloaded"] == 0 and r["offload"]["teacher_bytes_between"] == 0
    mask = batch["mask"]
    student = _direct_logp(pair["student"], batch["tokens"], mask)
    teacher = _direct_logp(pair["teacher"], batch["tokens"], mask)
    # the teacher pass: the teacher's own log-probs of the student's tokens, per token
    got_t = torch.where(mask, out["teacher_logp"], 0.0)
    torch.testing.assert_close(got_t, teacher, atol=2e-5, rtol=1e-5)
    torch.testing.assert_close(torch.where(mask, out["old_logp"], 0.0), student, atol=2e-5,
                               rtol=1e-5)
    assert (teacher - student).abs()[mask].max() > 0.1  # two different models
    off = out["offload"]
    assert off["resident"] and off["bytes_offloaded"] == 0  # the teacher left with the actor
    assert torch.equal(off["after_onload"], out["teacher_logp"])
    assert off["teacher_bytes_between"] == 0 and torch.equal(off["offloaded_logp"],
                                                             out["teacher_logp"])
    # reward mode: A_t = task_coef * A_task - coef * (log pi_S - log pi_T), 0 at padding
    want = torch.where(mask, TASK_COEF * batch["advantages"] - COEF * (student - teacher), 0.0)
    torch.testing.assert_close(out["advantages"], want, atol=3e-5, rtol=1e-5)
    torch.testing.assert_close(out["loss_mode_adv"], 0.5 * batch["advantages"])
    # metrics: means over the valid tokens
    kl = (student - teacher)[mask].double()
    m = out["m"]
    assert m["distill/reverse_kl"] == pytest.approx(float(kl.mean()), abs=2e-5)
    assert m["distill/teacher_logp"] == pytest.approx(float(teacher[mask].mean()), abs=2e-5)
    assert m["distill/disagree_frac"] == pytest.approx(float((kl > NATS).double().mean()))
    # TP2 and PP2 (DP1, the whole batch): the teacher's per-token log-probs, the advantages and
    # the metrics equal TP1's (the DP2 pass above) within 1e-5
    for name in ("tp2pp1", "tp1pp2"):
        last = [r["layouts"][name] for r in ranks if r["layouts"][name] is not None]
        assert len(last) == (2 if name == "tp2pp1" else 1), name  # both TP ranks; the last stage
        for got in last:
            for key in ("teacher_logp", "advantages"):
                torch.testing.assert_close(torch.where(mask, got[key], 0.0),
                                           torch.where(mask, out[key], 0.0),
                                           atol=1e-5, rtol=0, msg=f"{name} {key}")
            assert got["m"] == pytest.approx(m, abs=1e-5), name


# ---- the signal, by hand -------------------------------------------------------------------
def test_distill_reward_mode_by_hand():
    s = torch.tensor([[0.0, -1.0, -2.0, -3.0]])
    t = torch.tensor([[0.0, -1.5, -0.5, -9.0]])
    mask = torch.tensor([[False, True, True, False]])
    task = torch.tensor([[0.0, 0.3, 0.3, 0.0]])
    assert reverse_kl(s, t, mask).tolist() == [[0.0, 0.5, -1.5, 0.0]]
    adv = distill_advantages(task, s, t, mask, coef=2.0, task_coef=1.0)
    torch.testing.assert_close(adv, torch.tensor([[0.0, 0.3 - 1.0, 0.3 + 3.0, 0.0]]))
    pure = distill_advantages(task, s, t, mask, coef=2.0, task_coef=0.0)
    torch.testing.assert_close(pure, torch.tensor([[0.0, -1.0, 3.0, 0.0]]))
    st = distill_stats(s, t, mask, disagree_nats=0.4, group=None)
    assert float(st["distill/reverse_kl"]) == pytest.approx(-0.5)
    assert float(st["distill/teacher_logp"]) == pytest.approx(-1.0)
    assert float(st["distill/disagree_frac"]) == pytest.approx(0.5)  # 0.5 > 0.4 nats; -1.5 not


def test_distill_loss_mode_adds_the_k2_term_with_the_reverse_kl_gradient():
    """``coef * token-mean 1/2 (logp - teacher)^2``: its gradient on each valid token is
    ``coef * (logp - teacher) / n_valid`` (the per-token reverse-KL policy gradient)."""
    g = torch.Generator().manual_seed(1)
    logp = (-torch.rand(3, 5, generator=g) * 3).requires_grad_(True)
    teacher = -torch.rand(3, 5, generator=g) * 3
    mask = torch.rand(3, 5, generator=g) > 0.3
    zeros = torch.zeros(3, 5)
    cfg = LossConfig.for_algorithm("dapo", distill_loss_coef=0.7)
    ctx = ReductionContext.from_minibatch(mask, group=None)
    out = compute_loss(LossInputs(logp=logp, old_logp=logp.detach(), advantages=zeros,
                                  mask=mask, teacher_logp=teacher), cfg, ctx)
    out.loss.backward()  # zero advantages: the policy loss has no gradient
    n = mask.sum()
    delta = (logp.detach() - teacher)
    torch.testing.assert_close(logp.grad, torch.where(mask, 0.7 * delta / n, 0.0))
    torch.testing.assert_close(out.loss.detach(),
                               0.7 * (0.5 * delta.square())[mask].sum() / n)
    with pytest.raises(ValueError, match="teacher_logp"):
        compute_loss(LossInputs(logp=logp, old_logp=logp.detach(), advantages=zeros,
                                mask=mask), cfg, ctx)


# ---- config: load-time errors --------------------------------------------------------------
def _load(*overrides: str):
    return load_config(None, list(overrides))


def test_distill_config_refuses_a_teacher_with_another_tokenizer(pair):
    with pytest.raises(ConfigError) as err:
        _load(f"model.hf_path={pair['student']}", f"teacher.hf_path={pair['other']}")
    msg = str(err.value)
    assert pair["other"] in msg and pair["student"] in msg and "tokenizer" in msg, msg
    with pytest.raises(ConfigError, match=r"teacher tokenizer .*student's tokenizer 'byte'"):
        _load("model.preset=tiny", f"teacher.hf_path={pair['teacher']}")


def test_distill_config_errors_name_the_field_and_the_allowed_values(pair):
    with pytest.raises(ConfigError, match=r"teacher\.mode='bogus' is not one of "
                                          r"\('reward', 'loss'\)"):
        _load("teacher.mode=bogus")
    with pytest.raises(ConfigError, match=r"teacher\.engine='vllm' is not one of "
                                          r"\('actor', 'sglang'\)"):
        _load("teacher.engine=vllm")
    with pytest.raises(ConfigError, match=r"teacher\.coef must be > 0"):
        _load("teacher.coef=0")
    with pytest.raises(ConfigError, match="exactly one of teacher.hf_path, teacher.checkpoint"):
        _load(f"model.hf_path={pair['student']}", f"teacher.hf_path={pair['teacher']}",
              f"teacher.checkpoint={pair['teacher']}")
    with pytest.raises(ConfigError, match=r"teacher\.hf_path='/no/such' is not a directory"):
        _load("teacher.hf_path=/no/such")
    with pytest.raises(ConfigError, match="use teacher.mode=loss and teacher.coef"):
        _load("loss.overrides={distill_loss_coef: 0.5}")


def test_distill_config_loads_a_matching_teacher_and_sets_the_loss_term(pair):
    from megatron_rl.run.setup import loss_config, teacher_model

    cfg = _load(f"model.hf_path={pair['student']}", f"teacher.hf_path={pair['teacher']}",
                "teacher.mode=loss", "teacher.coef=0.25")
    assert loss_config(cfg).distill_loss_coef == 0.25
    arch, source = teacher_model(cfg)
    assert arch.num_hidden_layers == 2 and source.hf_dir == pair["teacher"]
    reward = _load(f"model.hf_path={pair['student']}", f"teacher.hf_path={pair['teacher']}")
    assert loss_config(reward).distill_loss_coef == 0.0
    assert teacher_model(_load()) == (None, None)


def test_distill_config_refuses_a_teacher_layout_other_than_the_runs(pair):
    """``teacher.parallel``: the run's split (or unset) loads; another TP or PP is refused with
    both values named (the actor teacher runs on the run's parallel_state layout)."""
    base = (f"model.hf_path={pair['student']}", f"teacher.hf_path={pair['teacher']}",
            "parallel.tp=2", "parallel.pp=2")
    cfg = _load(*base, "teacher.parallel.tp=2", "teacher.parallel.pp=2")
    assert (cfg.teacher.parallel.tp, cfg.teacher.parallel.pp) == (2, 2)
    with pytest.raises(ConfigError, match=r"teacher\.parallel\.tp=1 differs from "
                                          r"parallel\.tp=2: the actor teacher runs on the run's"):
        _load(*base, "teacher.parallel.tp=1")
    with pytest.raises(ConfigError, match=r"teacher\.parallel\.pp=4 differs from parallel\.pp=2"):
        _load(*base, "teacher.parallel.pp=4")
    with pytest.raises(ConfigError, match=r"teacher\.parallel\.tp must be >= 1"):
        _load(*base, "teacher.parallel.tp=0")
    with pytest.raises(ConfigError,
                       match=r"teacher\.parallel\.tp=4 is for teacher\.engine='actor'"):
        _load("teacher.engine=sglang", "teacher.url=http://127.0.0.1:1", "teacher.tokenizer=byte",
              "teacher.parallel.tp=4")


# ---- teacher.engine: sglang ----------------------------------------------------------------
def test_distill_sglang_teacher_logprobs_match_a_direct_computation(server):
    """Our ``serve`` (SGLang's HTTP API) as the teacher: ``input_token_logprobs`` of each row's
    ids, placed on the valid tokens, equal a direct forward of the served model."""
    from megatron_rl.rollout.teacher_client import SGLangTeacher

    url, state = server
    batch = _batch(256)
    mask = batch["mask"].clone()
    mask[3] = False  # a padding row: no request, zeros
    got = SGLangTeacher(url, concurrency=2).batch_logprobs(batch["tokens"], mask)
    with torch.no_grad():
        logits = state.model(input_ids=batch["tokens"]).logits.float()
    direct = torch.log_softmax(logits[:, :-1], -1).gather(-1, batch["tokens"][:, 1:, None])[..., 0]
    want = torch.where(mask, torch.nn.functional.pad(direct, (1, 0)), 0.0)
    torch.testing.assert_close(got, want, atol=2e-5, rtol=1e-5)
    assert got[3].abs().sum() == 0 and got[mask].abs().min() > 0


def test_distill_sglang_engine_config_errors(pair):
    with pytest.raises(ConfigError, match=r"teacher\.engine='sglang' needs teacher\.url"):
        _load("teacher.engine=sglang")
    with pytest.raises(ConfigError, match="needs the teacher's tokenizer"):
        _load("teacher.engine=sglang", "teacher.url=http://127.0.0.1:1")
    with pytest.raises(ConfigError, match=r"temperature 1 .*actor\.temperature=0\.7"):
        _load("teacher.engine=sglang", "teacher.url=http://127.0.0.1:1", "teacher.tokenizer=byte",
              "rollout.temperature=0.7")
    with pytest.raises(ConfigError, match=r"teacher tokenizer .*student's tokenizer 'byte'"):
        _load("teacher.engine=sglang", "teacher.url=http://127.0.0.1:1",
              f"teacher.tokenizer={pair['other']}")
    with pytest.raises(ConfigError, match=r"teacher\.url='http://127\.0\.0\.1:1' is for "
                                          r"teacher\.engine='sglang'"):
        _load("teacher.url=http://127.0.0.1:1")
    cfg = _load("teacher.engine=sglang", "teacher.url=http://127.0.0.1:1", "teacher.tokenizer=byte")
    from megatron_rl.config.teacher import served_teacher
    from megatron_rl.run.setup import teacher_model

    assert served_teacher(cfg.teacher) and teacher_model(cfg) == (None, None)


# ---- plan: the teacher's memory and time ---------------------------------------------------
def test_distill_plan_counts_the_teacher(pair):
    """A teacher with the student's architecture costs what the student's frozen copy costs:
    its weights per stage (none on the GPU when offloaded) and one forward per step; the
    smaller teacher less; with colocated servers a resident teacher is in the weight-sync phase
    and the host<->device swaps. A served teacher costs the trainer nothing."""
    import dataclasses

    from megatron_rl.plan.inputs import HOST_LINK_GBPS, inputs_from_config
    from megatron_rl.plan.memory import actor_breakdown, stage_params
    from megatron_rl.plan.report import make_plan
    from megatron_rl.plan.step_time import step_flops

    def plan(teacher: str, **kw):
        cfg = _load(f"model.hf_path={pair['student']}", f"teacher.hf_path={teacher}")
        x = inputs_from_config(cfg, precision="bf16", **kw)
        return x, actor_breakdown(x)[1], step_flops(x)

    x, mem, fl = plan(pair["student"], offload_ref=False)
    assert mem["distillation teacher"] == stage_params(x.model, 1, 1, 0) * 2
    assert fl["teacher log-probs"] == fl["old-policy log-probs"]
    _, small_mem, small_fl = plan(pair["teacher"], offload_ref=False)
    assert 0 < small_mem["distillation teacher"] < mem["distillation teacher"]
    assert 0 < small_fl["teacher log-probs"] < small_fl["old-policy log-probs"]
    _, off, _ = plan(pair["teacher"], offload_ref=True)
    assert off["distillation teacher (offloaded to CPU)"] == 0.0
    # colocated servers: a resident teacher leaves and comes back with the actor's parameters,
    # so the weight-sync phase (parameters on the device) and the swaps carry it; offloaded, not
    teacher_bytes = small_mem["distillation teacher"]
    for off in (False, True):
        xc = dataclasses.replace(plan(pair["teacher"], offload_ref=off)[0], colocate=True,
                                 servers=1, server_tp=1, gpu_mem_gb=80)
        with_t, without = make_plan(xc), make_plan(dataclasses.replace(xc, teacher=None))
        extra = 0.0 if off else teacher_bytes
        (sync,) = [k for k in with_t.colocated if k.startswith("weight sync")]
        assert with_t.colocated[sync] == pytest.approx(without.colocated[sync] + extra)
        swaps = "colocation swaps (host<->device)"
        assert with_t.seconds[swaps] == pytest.approx(
            without.seconds[swaps] + 2 * extra / (HOST_LINK_GBPS * 1e9), rel=1e-12)
    served = inputs_from_config(_load("teacher.engine=sglang", "teacher.url=http://127.0.0.1:1",
                                      "teacher.tokenizer=byte"))
    assert served.teacher is None and "teacher log-probs" not in step_flops(served)


# ---- the trainer with a teacher (one process, two steps) -----------------------------------
def test_distill_train_run_logs_the_signal_and_the_summary(tmp_path, server):
    """``train`` with a served teacher in loss mode: the rows carry the teacher's log-probs
    from rank 0 to the update (the k2 term's metric is logged), the step logs ``distill/*``
    and ``time/teacher``, and the last line adds ``reverse_kl_start``/``reverse_kl_end`` (the
    means of the first and last 5 steps: here the one step's value)."""
    import json
    import re

    from megatron_rl.run.serial_runs import train_each

    url, _ = server
    overrides = [f"output_dir={tmp_path}", "parallel.tp=1", "parallel.pp=1", "sft.steps=0",
                 "trainer.total_steps=1", "trainer.test_freq=1", "trainer.save_freq=1",
                 "trainer.plots=false", "trainer.train_batch_size=2", "rollout.n=2",
                 "rollout.gen_batch_size=2", "rollout.dynamic_sampling=false",
                 "rollout.val_n=1", "data.val_size=4", "actor.micro_batch_size=2",
                 "actor.mini_batch_size=4", "teacher.engine=sglang", f"teacher.url={url}",
                 "teacher.tokenizer=byte", "teacher.mode=loss", "teacher.task_coef=0"]
    (res,) = spawn(train_each, 1, ([("opd", "examples/tiny_dapo.yaml", overrides)],),
                   timeout_s=600, env={"CUDA_VISIBLE_DEVICES": ""})
    assert "error" not in res["opd"], res["opd"].get("error")
    rows = [json.loads(line) for line in open(tmp_path / "metrics.jsonl")]
    steps = [r for r in rows if r["step"] >= 1]
    assert len(steps) == 1
    for r in steps:
        assert r["distill/reverse_kl"] != 0 and r["distill/loss_k2"] > 0, r
        assert r["time/teacher"] > 0 and 0 <= r["distill/disagree_frac"] <= 1
    summary = res["opd"]["summary"]
    for key in ("reverse_kl_start", "reverse_kl_end"):
        assert summary[key] == pytest.approx(steps[0]["distill/reverse_kl"], abs=1e-6)
    from megatron_rl.run.driver import summary_line

    last = summary_line(summary)  # what the run prints last
    assert re.fullmatch(r"summary: val_acc_start=\S+ val_acc_end=\S+ wall_s=\S+ "
                        r"reverse_kl_start=\S+ reverse_kl_end=\S+", last), last
