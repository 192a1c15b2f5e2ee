"""Load-time checks of the ``teacher`` section (on-policy distillation, docs/distillation.md).

The teacher is a second model: its own weights (``teacher.hf_path`` or ``teacher.checkpoint``),
its own architecture (any size that fits the run's TP/PP: :func:`check_teacher_layout` says why
the split itself is the run's), and the student's tokenizer. Token ids
are what the two models exchange, so a teacher with another tokenizer would score other text: it
is refused here, before any process starts, with both tokenizers named.
"""

from __future__ import annotations

from typing import Any

from megatron_rl.config.errors import ConfigError
from megatron_rl.config.sections import ModelSection, RunConfig, TeacherSection


def teacher_enabled(t: TeacherSection) -> bool:
    """True when the run has a teacher (``teacher.hf_path``, ``teacher.checkpoint`` or
    ``teacher.url`` set)."""
    return bool(t.hf_path or t.checkpoint or t.url)


def actor_teacher(t: TeacherSection) -> bool:
    """True when the teacher is a frozen Megatron model on the trainer ranks."""
    return teacher_enabled(t) and t.engine == "actor"


def served_teacher(t: TeacherSection) -> bool:
    """True when SGLang servers serve the teacher (rank 0 asks them for log-probs)."""
    return teacher_enabled(t) and t.engine == "sglang"


def teacher_model_section(t: TeacherSection) -> ModelSection:
    """The teacher as a model section (weights, architecture and tokenizer resolve the same way
    as the student's: :mod:`megatron_rl.convert.model_source`)."""
    return ModelSection(hf_path=t.hf_path, megatron_ckpt=t.checkpoint, tokenizer=t.tokenizer)


def tokenizer_of(section: ModelSection) -> tuple[str, Any]:
    """``(description, tokenizer)`` of a model section: the HF tokenizer directory, or
    ``"byte"`` and the byte tokenizer."""
    from megatron_rl.convert.model_source import tokenizer_dir
    from megatron_rl.data.tokenizer import HFTokenizer
    from megatron_rl.rewards.tokenizer import ByteTokenizer

    path = tokenizer_dir(section)
    return (path, HFTokenizer(path)) if path else ("byte", ByteTokenizer())


def tokenizer_difference(a: Any, b: Any) -> str | None:
    """How tokenizers ``a`` and ``b`` map text to ids differently (None: they are the same):
    kind, vocabulary size, EOS/PAD ids, or the first token whose id differs."""
    kinds = (type(a).__name__, type(b).__name__)
    if kinds[0] != kinds[1]:
        return f"{kinds[0]} vs {kinds[1]}"
    for name in ("vocab_size", "eos_id", "pad_id"):
        if getattr(a, name) != getattr(b, name):
            return f"{name} {getattr(a, name)} vs {getattr(b, name)}"
    if hasattr(a, "tok"):  # HF: the whole token -> id table
        va, vb = a.tok.get_vocab(), b.tok.get_vocab()
        for token in sorted(set(va) | set(vb)):
            if va.get(token) != vb.get(token):
                return f"token {token!r} has id {va.get(token)} vs {vb.get(token)}"
    return None


def check_teacher_tokenizer(student: ModelSection, teacher: ModelSection) -> None:
    """Refuse a teacher whose tokenizer differs from the student's, naming both."""
    s_desc, s_tok = tokenizer_of(student)
    t_desc, t_tok = tokenizer_of(teacher)
    diff = tokenizer_difference(s_tok, t_tok)
    if diff is not None:
        raise ConfigError(
            f"teacher tokenizer {t_desc!r} does not match the student's tokenizer {s_desc!r} "
            f"({diff}); on-policy distillation scores the student's token ids with the teacher, "
            "so both must use one tokenizer (set teacher.tokenizer, or pick a teacher of the "
            "student's model family)")


def validate_teacher(cfg: RunConfig) -> None:
    """Checks of ``teacher`` (choices and ranges are :mod:`megatron_rl.config.schema`'s): one
    weight source that fits the run's layout, the student's tokenizer, and a mode the run's
    advantage estimator can take. A no-op when no teacher is set."""
    from megatron_rl.convert.model_source import ModelSourceError, validate_model_section
    from megatron_rl.data.tokenizer import TokenizerError, check_vocab_fits
    from megatron_rl.models.config import ModelConfigError

    t = cfg.teacher
    if cfg.loss.overrides.get("distill_loss_coef"):
        raise ConfigError("loss.overrides.distill_loss_coef is set by the teacher section: use "
                          "teacher.mode=loss and teacher.coef")
    if t.engine == "sglang" and not t.url:
        raise ConfigError("teacher.engine='sglang' needs teacher.url, the http(s):// URL of the "
                          "teacher's router or server")
    if not teacher_enabled(t):
        return
    if t.hf_path and t.checkpoint:
        raise ConfigError(f"teacher: exactly one of teacher.hf_path, teacher.checkpoint names the "
                          f"teacher, got both ({t.hf_path!r}, {t.checkpoint!r})")
    if t.engine == "sglang":
        validate_served_teacher(cfg)
    check_teacher_layout(cfg)
    section = teacher_model_section(t)
    p = cfg.parallel
    model = None
    if t.engine == "actor":
        if t.url:
            raise ConfigError(f"teacher.url={t.url!r} is for teacher.engine='sglang'; "
                              "teacher.engine='actor' loads teacher.hf_path or teacher.checkpoint")
        try:
            model = validate_model_section(section, p.tp, p.pp, p.ep)
        except (ModelSourceError, ModelConfigError) as exc:
            raise ConfigError("teacher: " + str(exc).replace("model.hf_path", "teacher.hf_path")
                              .replace("model.megatron_ckpt", "teacher.checkpoint")
                              .replace("model.tokenizer", "teacher.tokenizer")) from exc
    try:
        check_teacher_tokenizer(cfg.model, section)
        if model is not None:
            check_vocab_fits(tokenizer_of(section)[1], model.vocab_size,
                             "teacher tokenizer vs the teacher's vocab_size")
    except TokenizerError as exc:
        raise ConfigError(str(exc)) from exc
    if t.mode == "reward" and cfg.trainer.advantage == "gae":
        raise ConfigError("teacher.mode='reward' replaces the advantages, which "
                          "trainer.advantage='gae' computes from the critic afterwards; use "
                          "teacher.mode='loss' with gae (allowed modes: reward, loss)")


def check_teacher_layout(cfg: RunConfig) -> None:
    """Refuse a ``teacher.parallel`` split other than the run's.

    The actor teacher runs on the run's TP/PP split: megatron-core keeps one model-parallel layout
    per process (``parallel_state``), and the teacher's forward (the pipeline schedule and its
    P2P, the vocab-parallel log-probs, the micro-batch and data-parallel groups) and its sharded
    weight loading all read that one layout. (megatron-core 0.16's ``GPTModel`` and schedules
    take a ``pg_collection`` of their own groups, but this package's forward, head and weight
    loading do not, and the layout helpers are process-global.) A teacher split differently over
    the same ranks would also have another data-parallel size, so each step's rows would have to
    be regrouped for it and its log-probs sent back to the student's last stage. A teacher of
    another depth or width fits the run's split as long as its heads, KV heads and layers divide
    ``parallel.tp``/``pp``; a teacher that needs its own split is served by SGLang
    (``teacher.engine: sglang``)."""
    t, p = cfg.teacher, cfg.parallel
    for name in ("tp", "pp"):
        want, run = getattr(t.parallel, name), getattr(p, name)
        if want is None or want == run:
            continue
        if t.engine == "sglang":
            raise ConfigError(f"teacher.parallel.{name}={want} is for teacher.engine='actor'; "
                              "an SGLang teacher's split is its servers' own (their --tp)")
        raise ConfigError(
            f"teacher.parallel.{name}={want} differs from parallel.{name}={run}: the actor "
            "teacher runs on the run's TP/PP split (megatron-core keeps one model-parallel "
            "layout per process, which the teacher's forward, log-probs and sharded weight "
            "loading use). Leave teacher.parallel unset, choose a teacher whose heads and "
            f"layers divide parallel.tp/pp, or serve it with teacher.engine='sglang' "
            "(docs/distillation.md)")


def validate_served_teacher(cfg: RunConfig) -> None:
    """``teacher.engine: sglang``: a URL, a named tokenizer (the load-time check needs it), and
    temperature 1 (SGLang's prompt-token log-probs come from unscaled logits)."""
    import os

    t = cfg.teacher
    if not t.url or not t.url.startswith(("http://", "https://")):
        raise ConfigError(f"teacher.engine='sglang' needs teacher.url, the http(s):// URL of the "
                          f"teacher's router or server; got {t.url!r}")
    if not (t.hf_path or t.checkpoint or t.tokenizer):
        raise ConfigError("teacher.engine='sglang' needs the teacher's tokenizer to check it "
                          "against the student's: set teacher.tokenizer ('byte' or a directory) "
                          "or teacher.hf_path (the served model's directory)")
    for name in ("hf_path", "checkpoint"):
        path = getattr(t, name)
        if path and not os.path.isdir(path):
            raise ConfigError(f"teacher.{name}={path!r} is not a directory")
    if cfg.actor.temperature != 1.0:
        raise ConfigError(f"teacher.engine='sglang' scores at temperature 1 (SGLang's prompt-token "
                          f"log-probs are unscaled) but actor.temperature={cfg.actor.temperature};"
                          " use teacher.engine='actor' or sample at temperature 1")
