"""``python -m megatron_rl config --doc``: the configuration reference, generated.

Every field of :class:`megatron_rl.config.sections.RunConfig` (sections, nested sections) and every
``loss.overrides`` key (:class:`megatron_rl.loss.LossConfig` fields) becomes one table row: dotted
key, type, default, allowed values (where the load-time validation has a fixed set) and a one-line
description. The description is the field line's trailing ``# comment`` in the source; a field
without one takes its text from :data:`EXTRA_DOCS` (kept here so the config modules stay as they
are), else it is marked ``(undocumented)``. A standalone comment line above a group of fields
becomes a note above that group. ``tests/test_config_doc.py`` fails when ``docs/configuration.md``
differs from what this module generates.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib
import inspect
import io
import json
import re
import sys
import textwrap
import tokenize
import types
import typing
from dataclasses import dataclass
from pathlib import Path

DOC_COMMAND = "python -m megatron_rl config --doc"
DEFAULT_OUT = Path(__file__).resolve().parents[2] / "docs" / "configuration.md"
UNDOCUMENTED = "(undocumented)"

# Fields whose source line has no trailing comment: their one-line description.
EXTRA_DOCS: dict[str, str] = {
    "parallel.tp": "tensor-parallel size",
    "parallel.pp": "pipeline-parallel size",
    "parallel.dp": "data-parallel size; world size = tp x pp x cp x dp",
    "data.task_kwargs": "keyword arguments of the reasoning-gym task generator",
    "data.train_size": "generated training prompts (reasoning-gym tasks)",
    "data.val_size": "held-out validation prompts",
    "data.seed": "seed of the prompt generator, the split and the loader's shuffling",
    "rollout.engine": "where responses are sampled: the in-process `transformers` engine or an "
                      "SGLang fleet (docs/rollout.md)",
    "rollout.n": "responses sampled per prompt (the group size)",
    "rollout.temperature": "sampling temperature; the actor's log-probs use the same one",
    "rollout.top_p": "nucleus sampling, in (0, 1]",
    "rollout.max_new_tokens": "maximum response length in tokens",
    "rollout.dynamic_sampling": "DAPO dynamic sampling: drop groups whose rewards are all equal "
                                "and generate more until the batch is full",
    "rollout.max_num_gen_batches": "generation rounds per step before dynamic sampling gives up",
    "rollout.filter_metric": "per-response field whose in-group std decides dynamic sampling",
    "rollout.overlong_penalty_factor": "scale of the soft overlong punishment",
    "rollout.overlong_filter": "drop truncated responses from the loss",
    "rollout.rv_include_zero": "RV filter: keep zero-variance groups in the top-p candidate set",
    "rollout.reward_timeout_s": "a reward call slower than this scores 0 (counted)",
    "rollout.weight_sync_bucket_mb": "bucket size of the actor -> engine weight stream",
    "rollout.max_staleness": "asynchronous rollouts: generation runs up to K steps ahead of "
                             "training; a sample older than K steps is dropped (docs/async.md)",
    "rollout.durable_bank": "append finished rollout groups to OUTPUT_DIR/rollout_bank.bin; a "
                            "resumed run trains on them instead of regenerating them "
                            "(docs/reliability.md)",
    "rollout.val_temperature": "validation sampling temperature;",
    "rollout.sglang.weight_sync": "how the actor's weights reach the servers (docs/rollout.md):",
    "actor.fused_logprob_entropy": "fused output layer + log-prob + entropy (docs/fused-head.md);",
    "optim.lr_decay_steps": "optimizer steps of the decay;",
    "critic.mini_batch_size": "critic sequences per optimizer step;",
    "env.name": "multi-turn environment;",
    "env.boxes": "boxes per room:",
    "rollout.sglang.host": "host that started servers and the router listen on",
    "rollout.sglang.request_timeout_s": "timeout of one /generate request",
    "trainer.total_steps": "RL steps",
    "trainer.advantage": "advantage estimator (docs/algorithms-and-losses.md)",
    "trainer.test_freq": "validate every N steps",
    "trainer.save_freq": "checkpoint every N steps",
    "trainer.output_dir": "run directory: metrics.jsonl, plots/, checkpoints/ (alias: "
                          "`output_dir=`)",
    "trainer.seed": "seed of model initialisation, rollout sampling and the warm start",
    "trainer.resume": "continue from OUTPUT_DIR's newest checkpoint when there is one",
    "sft.steps": "supervised warm-start steps before RL (0 = none)",
    "sft.batch_size": "warm-start sequences per step",
    "sft.lr": "warm-start learning rate",
    "early_stop.enabled": "stop a run whose reward variance or validation collapsed",
    "early_stop.rv_warmup_steps": "steps that set the reward-variance baseline",
    "early_stop.rv_patience": "consecutive steps below rv_ratio x baseline that stop the run",
    "early_stop.rv_ratio": "reward-variance collapse threshold, relative to the baseline",
    "early_stop.val_threshold": "validation success below this counts as collapsed",
    "early_stop.val_patience": "consecutive collapsed validations that stop the run",
    "logging.tensorboard": "also write TensorBoard events",
    "logging.wandb": "also log to Weights & Biases",
    "logging.project": "W&B project name",
    "loss.algorithm": "published defaults to start from (LossConfig.for_algorithm)",
    "critic.gamma": "GAE discount",
    "critic.lam": "GAE lambda",
    "critic.cliprange_value": "value-loss clip range around the old values",
    "critic.lr": "critic learning rate",
    "critic.weight_decay": "critic AdamW weight decay",
    "critic.clip_grad": "critic gradient clipping by global norm (0 = off)",
    "critic.ppo_epochs": "passes over each batch for the critic",
    "actor.ppo_epochs": "passes over each step's batch",
    "actor.temperature": "log-prob temperature; must equal rollout.temperature",
    "actor.logprob_chunk_size": "token chunk of the log-prob/entropy op (None: unchunked)",
    "actor.max_consecutive_skips": "non-finite updates in a row that stop the run",
    "actor.max_tokens_per_micro_batch": "processed tokens per micro-batch, each padded to its "
                                        "own longest row, rows balanced over DP by tokens (0: "
                                        "micro_batch_size rows; training.md)",
    "optim.lr": "peak learning rate",
    "optim.min_lr": "learning rate at the end of the decay",
    "optim.weight_decay": "AdamW weight decay",
    "optim.adam_beta1": "Adam beta1",
    "optim.adam_beta2": "Adam beta2",
    "optim.adam_eps": "Adam epsilon",
    "optim.clip_grad": "gradient clipping by global norm (0 = off)",
    "optim.lr_warmup_steps": "linear warm-up optimizer steps",
    "optim.lr_decay_style": "learning-rate schedule after warm-up",
    "optim.use_distributed_optimizer": "shard fp32 main weights and Adam moments over DP "
                                       "(docs/checkpoints.md)",
    "env.seed": "base seed of the training and validation environments (disjoint seeds)",
    "loss.overrides.policy_loss": "the policy loss (docs/algorithms-and-losses.md)",
    "loss.overrides.loss_agg_mode": "how token losses become one number (Dr.GRPO: *-sum-norm)",
    "loss.overrides.entropy_coeff": "fixed entropy bonus coefficient (0 = off)",
    "loss.overrides.diagnostic_top_frac": "entropy-dynamics diagnostic: fraction of tokens with "
                                          "the largest covariance reported separately",
    "loss.overrides.clip_ratio_low": "lower clip width (1 - eps_low)",
    "loss.overrides.clip_ratio_high": "upper clip width (1 + eps_high); DAPO clip-higher: 0.28",
    "loss.overrides.log_ratio_clamp": "clamp of log ratios before exp",
    "loss.overrides.clip_cov_ratio": "Clip-Cov: fraction of valid tokens selected (2e-4 = 0.02 %)",
    "loss.overrides.clip_cov_lb": "Clip-Cov: lower covariance bound of candidates",
    "loss.overrides.clip_cov_ub": "Clip-Cov: upper covariance bound of candidates",
    "loss.overrides.kl_cov_ratio": "KL-Cov: fraction of valid tokens penalised (2e-4 = 0.02 %)",
    "loss.overrides.kl_cov_coef": "KL-Cov: coefficient of the KL penalty",
    "loss.overrides.cov_seed": "seed of Clip-Cov's random choice",
    "loss.overrides.gspo_log_ratio_max": "GSPO: clamp of the sequence log ratio",
    "loss.overrides.positive_nll_coef": "GPPO: NLL weight on positive samples (Klear: 0.1)",
    "loss.overrides.aspo_entropy_quantile": "ASPO: per-sequence entropy quantile that splits "
                                            "tokens",
    "loss.overrides.aspo_c_pos": "ASPO: soft dual clip for positive advantages",
    "loss.overrides.aspo_c_neg": "ASPO: soft dual clip for negative advantages",
    "loss.overrides.erc": "ERC gate on any token-level loss",
    "loss.overrides.erc_low": "ERC: lower ratio bound",
    "loss.overrides.erc_high": "ERC: upper ratio bound",
    "loss.overrides.use_kl_loss": "add a KL-to-reference term (builds the reference model)",
    "loss.overrides.kl_loss_coef": "coefficient of the KL term",
    "loss.overrides.kl_loss_type": "KL estimator; `+` suffix: straight-through gradient",
    "loss.overrides.rollout_correction": "training/inference mismatch correction (set it as "
                                         "loss.rollout_correction)",
}

# Fields whose allowed values are a fixed set known to the validation: (module, attribute).
ALLOWED_FROM: dict[str, tuple[str, str]] = {
    "model.preset": ("megatron_rl.models.config", "PRESETS"),
    "data.split_by": ("megatron_rl.config.doc", "_SPLIT_BY"),
    "rollout.engine": ("megatron_rl.config.doc", "_ENGINES"),
    "rollout.filter_metric": ("megatron_rl.config.schema", "FILTER_METRICS"),
    "rollout.sglang.launcher": ("megatron_rl.rollout.fleet", "LAUNCHERS"),
    "rollout.sglang.weight_sync": ("megatron_rl.rollout.fleet", "WEIGHT_SYNCS"),
    "rollout.sglang.quantization": ("megatron_rl.rollout.quant_choices", "QUANTIZATIONS"),
    "rollout.sglang.fp8_scale_fmt": ("megatron_rl.rollout.quant_choices", "SCALE_FMTS"),
    "trainer.advantage": ("megatron_rl.config.schema", "ADVANTAGES"),
    "actor.precision": ("megatron_rl.actor.precision", "PRECISIONS"),
    "actor.recompute": ("megatron_rl.actor.precision", "RECOMPUTE"),
    "optim.lr_decay_style": ("megatron_rl.actor.optim", "LR_DECAY_STYLES"),
    "actor.lora.sync": ("megatron_rl.models.lora_config", "LORA_SYNCS"),
    "loss.algorithm": ("megatron_rl.loss.config", "PRESETS"),
    "loss.rollout_correction": ("megatron_rl.loss.params", "ROLLOUT_CORRECTIONS"),
    "loss.rollout_correction_denominator": ("megatron_rl.loss.params",
                                            "ROLLOUT_CORRECTION_DENOMINATORS"),
    "env.name": ("megatron_rl.envs", "ENVS"),
    "teacher.engine": ("megatron_rl.loss.distill_choices", "ENGINES"),
    "teacher.mode": ("megatron_rl.loss.distill_choices", "MODES"),
    "loss.overrides.policy_loss": ("megatron_rl.loss.registry", "_REGISTRY"),
    "loss.overrides.loss_agg_mode": ("megatron_rl.loss.config", "AGG_MODES"),
    "loss.overrides.kl_loss_type": ("megatron_rl.loss.config", "KL_TYPES"),
    "loss.overrides.cov_stat_source": ("megatron_rl.loss.config", "COV_STAT_SOURCES"),
    "loss.overrides.rollout_correction": ("megatron_rl.loss.params",
                                          "ROLLOUT_CORRECTIONS"),
    "loss.overrides.rollout_correction_denominator": ("megatron_rl.loss.params",
                                                      "ROLLOUT_CORRECTION_DENOMINATORS"),
}
_SPLIT_BY = ("prompt", "row")  # validate_run_config's data.split_by values
_ENGINES = ("embedded", "sglang")  # validate_run_config's rollout.engine values


@dataclass(frozen=True)
class FieldDoc:
    """One row of the reference."""

    key: str  # dotted config key, e.g. "rollout.sglang.weight_sync"
    type: str
    default: str
    allowed: str
    doc: str  # "" when the field has no description
    group: str = ""  # the standalone comment above this field's group ("" if none)


def source_comments(cls: type) -> tuple[dict[str, str], dict[str, str]]:
    """``(trailing, group)`` for a dataclass: each field's trailing ``# comment`` on its own
    (logical) line, and the standalone comment block directly above the first field of a group.
    Fields declared in a dataclass base (``LossConfig``'s in ``LossParams``) are read there."""
    trailing: dict[str, str] = {}
    group: dict[str, str] = {}
    for klass in reversed([k for k in cls.__mro__ if dataclasses.is_dataclass(k)]):
        own_trailing, own_group = _own_source_comments(klass)
        trailing.update(own_trailing)
        group.update(own_group)
    return trailing, group


def _own_source_comments(cls: type) -> tuple[dict[str, str], dict[str, str]]:
    """:func:`source_comments` of the fields written in ``cls``'s own class body."""
    src = textwrap.dedent(inspect.getsource(cls))
    trailing: dict[str, str] = {}
    group: dict[str, str] = {}
    pending: list[str] = []
    line: list[tokenize.TokenInfo] = []
    comment_line = False
    for tok in tokenize.generate_tokens(io.StringIO(src).readline):
        if tok.type == tokenize.COMMENT and not line:
            if tok.start[1] > 0:  # a comment inside the class body, on a line of its own
                pending.append(tok.string.lstrip("#").strip())
            comment_line = True
            continue
        if tok.type in (tokenize.INDENT, tokenize.DEDENT):
            continue
        if tok.type == tokenize.NL and not line:
            if not comment_line:
                pending = []  # a blank line ends a comment block
            comment_line = False
            continue
        if tok.type != tokenize.NEWLINE:
            line.append(tok)
            continue
        code = [t for t in line if t.type != tokenize.COMMENT]
        if (len(code) >= 2 and code[0].type == tokenize.NAME and code[1].string == ":"
                and code[0].start[1] > 0):
            name = code[0].string
            comments = [t.string for t in line if t.type == tokenize.COMMENT]
            if comments:
                trailing[name] = comments[0].lstrip("#").strip()
            if pending:
                group[name] = " ".join(pending)
        pending = []
        line = []
    return trailing, group


def type_name(tp: typing.Any) -> str:
    """``int | None``, ``str``, ``list`` ... of a resolved annotation."""
    args = typing.get_args(tp)
    if typing.get_origin(tp) is typing.Literal:
        return " | ".join(sorted({type(a).__name__ for a in args}))
    if args and typing.get_origin(tp) in (typing.Union, types.UnionType):
        return " | ".join(type_name(a) for a in args)
    if tp is type(None):
        return "None"
    return getattr(tp, "__name__", str(tp))


def default_text(f: dataclasses.Field) -> str:
    """The field's default written as in a YAML config."""
    if f.default is not dataclasses.MISSING:
        value = f.default
    elif f.default_factory is not dataclasses.MISSING:
        value = f.default_factory()
    else:
        return "(required)"
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (list, dict)):
        return json.dumps(value)
    return str(value) if not isinstance(value, str) else (value or '""')


def allowed_values(key: str) -> str:
    """The fixed set of allowed values of ``key`` as the validation knows it ("" if none)."""
    where = ALLOWED_FROM.get(key)
    if where is None:
        return ""
    try:
        values = getattr(importlib.import_module(where[0]), where[1])
    except (ImportError, AttributeError) as exc:
        raise RuntimeError(f"megatron_rl.config.doc.ALLOWED_FROM[{key!r}] names "
                           f"{where[0]}.{where[1]}, which does not exist ({exc}); update "
                           "ALLOWED_FROM") from exc
    names = sorted(values) if isinstance(values, dict) else list(values)
    if key == "loss.overrides.policy_loss":
        names = [n for n in names if n != "nll"]  # the supervised warm-start loss
    return ", ".join(f"`{v}`" for v in names)


def section_rows(cls: type, prefix: str) -> list[tuple[str, type, list[FieldDoc]]]:
    """``(dotted section, class, rows)`` for ``cls`` and, depth first, its nested sections."""
    hints = typing.get_type_hints(cls)
    trailing, group = source_comments(cls)
    rows: list[FieldDoc] = []
    nested: list[tuple[str, type, list[FieldDoc]]] = []
    for f in dataclasses.fields(cls):
        key = f"{prefix}.{f.name}" if prefix else f.name
        tp = hints[f.name]
        if dataclasses.is_dataclass(tp):
            nested.extend(section_rows(tp, key))
            continue
        doc = " ".join(t for t in (EXTRA_DOCS.get(key), trailing.get(f.name)) if t)
        allowed = allowed_values(key)
        if not allowed and typing.get_origin(tp) is typing.Literal:
            allowed = ", ".join(f"`{a}`" for a in typing.get_args(tp))
        rows.append(FieldDoc(key, type_name(tp), default_text(f), allowed, doc,
                             group.get(f.name, "")))
    return [(prefix, cls, rows), *nested]


def all_sections() -> list[tuple[str, type, list[FieldDoc]]]:
    """Every section of the run config, then ``loss.overrides`` (the LossConfig fields)."""
    from megatron_rl.config.sections import RunConfig
    from megatron_rl.loss import LossConfig

    top = section_rows(RunConfig, "")
    return [s for s in top if s[0]] + section_rows(LossConfig, "loss.overrides")


def undocumented_keys() -> list[str]:
    """Dotted keys that have neither a trailing comment nor an :data:`EXTRA_DOCS` entry."""
    return [r.key for _, _, rows in all_sections() for r in rows if not r.doc]


def _cell(text: str) -> str:
    """Table-cell text: RST literals as Markdown, ``|`` escaped, ``docs/x.md`` as a link."""
    text = text.replace("``", "`").replace("|", "\\|").replace("\n", " ")
    return re.sub(r"docs/([\w\-]+\.md)", r"[\1](\1)", text)


def _class_doc(cls: type) -> str:
    doc = inspect.getdoc(cls) or ""
    if not doc or doc.startswith(f"{cls.__name__}("):  # dataclass's generated signature
        return ""
    return " ".join(doc.split("\n\n")[0].split())


_HEADER = """# Configuration reference

<!-- Generated by `{cmd}` from the config dataclasses; do not edit by hand. -->

A run is configured by one YAML file plus `key=value` overrides on the command line
(`python -m megatron_rl train CONFIG.yaml trainer.seed=3 output_dir=runs/x`). A file holds any
subset of the sections below; everything else keeps its default. Unknown keys are errors that
suggest the closest key, values are type-checked, and cross-field rules (batch shapes, the
temperature, layouts) are checked when the config loads: a mistake is one line naming the field
and the allowed values, exit code 2 (see [troubleshooting.md](troubleshooting.md)).
`python -m megatron_rl train --check CONFIG.yaml [key=value ...]` only checks.

`loss.overrides` takes any field of the `LossConfig` table at the end; `loss.algorithm`
first fills that algorithm's published defaults (see
[algorithms-and-losses.md](algorithms-and-losses.md)). Rows marked {undoc} have no
description in the source yet.

Sections: {toc}
"""


def render() -> str:
    """The whole ``docs/configuration.md`` text."""
    sections = all_sections()
    toc = ", ".join(f"[`{name}`](#{name.replace('.', '')})" for name, _, _ in sections)
    out = [_HEADER.format(cmd=DOC_COMMAND, undoc=UNDOCUMENTED, toc=toc)]
    for name, cls, rows in sections:
        out.append(f"## `{name}`\n")
        doc = _class_doc(cls)
        if doc:
            out.append(f"{_cell(doc)} (`{cls.__module__}.{cls.__qualname__}`)\n")
        else:
            out.append(f"`{cls.__module__}.{cls.__qualname__}`\n")
        table_open = False
        for r in rows:
            if r.group:
                if table_open:
                    out.append("")
                out.append(f"*{_cell(r.group)}*\n")
                table_open = False
            if not table_open:
                out.append("| key | type | default | allowed | description |")
                out.append("|---|---|---|---|---|")
                table_open = True
            out.append(f"| `{r.key}` | `{_cell(r.type)}` | `{_cell(r.default)}` | "
                       f"{_cell(r.allowed)} | {_cell(r.doc or UNDOCUMENTED)} |")
        out.append("")
    return "\n".join(out).rstrip("\n") + "\n"


def stale_message(path: Path) -> str | None:
    """``None`` when ``path`` holds exactly :func:`render`'s text, else what to run."""
    want = render()
    have = path.read_text() if path.exists() else None
    if have == want:
        return None
    state = "is missing" if have is None else "is out of date with the config dataclasses"
    return f"{path} {state}; regenerate it with `{DOC_COMMAND}` and commit the result"


def _cmd_config(args: argparse.Namespace) -> int:
    out = Path(args.out)
    if args.check:
        msg = stale_message(out)
        print(msg or f"{out} is up to date", file=sys.stderr if msg else sys.stdout)
        return 1 if msg else 0
    if not args.doc:
        print(render(), end="")
        return 0
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(render())
    missing = undocumented_keys()
    print(f"wrote {out}" + (f" ({len(missing)} undocumented field(s): {', '.join(missing)})"
                            if missing else ""))
    return 0


def add_config_subcommand(sub: argparse._SubParsersAction) -> None:
    """Register ``config`` on the CLI's sub-parsers."""
    c = sub.add_parser("config", help="the configuration reference: --doc writes "
                                      "docs/configuration.md; without --doc print it")
    c.add_argument("--doc", action="store_true", help="write the reference to --out")
    c.add_argument("--out", default=str(DEFAULT_OUT),
                   help=f"output file (default {DEFAULT_OUT})")
    c.add_argument("--check", action="store_true",
                   help="exit 1 if --out differs from the generated text (writes nothing)")
    c.set_defaults(func=_cmd_config)
