"""Command-line ergonomics: ``--help`` of every sub-command, "did you mean" on every kind of typo,
the command line's model source replacing the recipe's, and progress output (stderr, TTY bar vs
plain lines). All in-process and cheap."""

from __future__ import annotations

import argparse
import io
from pathlib import Path

import pytest

from megatron_rl.cli.app import build_parser, main, parse_args
from megatron_rl.cli.parser import subcommands
from megatron_rl.config.errors import ConfigError
from megatron_rl.config.load import load_config
from megatron_rl.config.overrides import OverrideConflict, resolve_exclusive
from megatron_rl.util.progress import Progress, last_logged_step, progress

REPO = Path(__file__).resolve().parents[1]


# ---- --help ------------------------------------------------------------------------------------
def test_every_subcommand_lists_its_options_with_help():
    seen = []
    for path, parser in subcommands(build_parser()):
        text = parser.format_help()
        for action in parser._actions:  # noqa: SLF001
            if isinstance(action, argparse._HelpAction):  # noqa: SLF001
                continue
            where = f"{' '.join(path) or '(top)'} {action.option_strings or action.dest}"
            assert action.help and action.help != argparse.SUPPRESS, f"no help: {where}"
            assert action.help.strip() and "\n" not in action.help, where
            for opt in action.option_strings:
                assert opt in text, f"{where} missing from --help"
            if isinstance(action, argparse._SubParsersAction):  # noqa: SLF001
                helps = {a.dest: a.help for a in action._choices_actions}  # noqa: SLF001
                assert set(helps) == set(action.choices), where
                assert all(helps.values()), f"sub-command without help under {where}"
        seen.append(" ".join(path))
    assert {"train", "sft", "eval", "plan", "repro", "sweep", "convert hf-to-megatron",
            "convert megatron-to-hf", "serve", "check", "export", "plot", "config"} <= set(seen)


def test_help_exits_zero(capsys):
    with pytest.raises(SystemExit) as exc:
        parse_args(["plan", "--help"])
    assert exc.value.code == 0 and "--search" in capsys.readouterr().out


# ---- did you mean ------------------------------------------------------------------------------
@pytest.mark.parametrize("argv,needle", [
    (["trian"], "did you mean 'train'?"),
    (["check", "--tpp", "2"], "did you mean '--tp'?"),
    (["train", "--chek"], "did you mean '--check'?"),
    (["convert", "hf-to-megatorn"], "did you mean 'hf-to-megatron'?"),
    (["plan", "x.yaml", "--precision", "bf61"], "did you mean 'bf16'?"),
])
def test_command_line_typos_suggest(argv, needle, capsys):
    with pytest.raises(SystemExit) as exc:
        parse_args(argv)
    assert exc.value.code == 2 and needle in capsys.readouterr().err


@pytest.mark.parametrize("override,needle", [
    ("trainer.sed=3", "did you mean 'trainer.seed'?"),
    ("traner.seed=3", "did you mean 'trainer'?"),
    ("rollout.sglang.num_server=3", "did you mean 'rollout.sglang.num_servers'?"),
    ("total_steps=3", "did you mean 'trainer.total_steps'?"),  # a field of another section
    ("seed=3", "did you mean one of 'data.seed', 'trainer.seed', 'env.seed'?"),
    ("model.hf=/x", "did you mean 'model.hf_path'?"),  # a prefix of the field
    ("optim.lrr=1", "did you mean 'optim.lr'?"),
    ("loss.overrides.clip_ratio_hi=0.3", "did you mean 'clip_ratio_high'?"),
    ("data.task_kwargs.max_term=3", "did you mean 'max_terms'?"),
])
def test_override_typos_suggest(override, needle, capsys):
    assert main(["train", override, "--check"]) == 2
    err = capsys.readouterr().err
    assert needle in err, err


def test_yaml_typos_suggest_at_any_depth(tmp_path):
    for text, needle in (("rollout:\n  sglang:\n    num_server: 2\n",
                          "'rollout.sglang.num_server'; did you mean 'rollout.sglang.num_servers'"),
                         ("trainer:\n  totl_steps: 2\n", "did you mean 'trainer.total_steps'"),
                         ("rollot:\n  n: 2\n", "'rollot'; did you mean 'rollout'")):
        path = tmp_path / "c.yaml"
        path.write_text(text)
        with pytest.raises(ConfigError, match=needle):
            load_config(str(path))


# ---- the command line's model source wins -------------------------------------------------------
def test_command_line_model_source_replaces_the_recipes():
    recipe = {"model": {"preset": "tiny", "tokenizer": "byte"}, "trainer": {"seed": 1}}
    out, notes = resolve_exclusive(recipe, {"model": {"hf_path": "/m"}}, "r.yaml")
    assert out["model"] == {"preset": None, "tokenizer": "byte"} and out["trainer"] == {"seed": 1}
    assert notes == ["[config] model.hf_path from the command line replaces model.preset='tiny' "
                     "of r.yaml (cleared)"]
    assert recipe["model"]["preset"] == "tiny"  # the input is not modified
    # the reverse direction, and nothing to clear
    out, notes = resolve_exclusive({"model": {"megatron_ckpt": "/c"}},
                                   {"model": {"preset": "small"}}, "r")
    assert out["model"]["megatron_ckpt"] is None and len(notes) == 1
    assert resolve_exclusive(recipe, {"model": {"preset": "small"}}, "r") == (recipe, [])
    assert resolve_exclusive(recipe, {"model": {"preset": None, "hf_path": "/m"}}, "r")[1] == []
    with pytest.raises(OverrideConflict, match="the command line sets hf_path, megatron_ckpt"):
        resolve_exclusive(recipe, {"model": {"hf_path": "/m", "megatron_ckpt": "/c"}}, "r")


def test_yaml_model_source_replaced_by_override(tmp_path, capsys):
    """Through load_config: a recipe with ``model.megatron_ckpt`` and ``model.preset=tiny`` on
    the command line loads as the preset (before: an error asking to null the checkpoint)."""
    path = tmp_path / "r.yaml"
    path.write_text(f"model: {{megatron_ckpt: {tmp_path}}}\ntrainer: {{total_steps: 2}}\n")
    cfg = load_config(str(path), ["model.preset=tiny"])
    assert cfg.model.preset == "tiny" and cfg.model.megatron_ckpt is None
    assert f"replaces model.megatron_ckpt='{tmp_path}' of {path}" in capsys.readouterr().err
    with pytest.raises(ConfigError, match="exactly one of model.preset, model.hf_path"):
        load_config(str(path), ["model.preset=tiny", f"model.hf_path={tmp_path}"])


# ---- progress ----------------------------------------------------------------------------------
class FakeStream(io.StringIO):
    def __init__(self, tty: bool) -> None:
        super().__init__()
        self.tty = tty

    def isatty(self) -> bool:
        return self.tty


def _run_bar(tty: bool, n: int = 20, **kw) -> str:
    now = [0.0]
    stream = FakeStream(tty)
    with Progress(n, "demo", unit="items", stream=stream, clock=lambda: now[0], enabled=True,
                  **kw) as bar:
        for _ in range(n):
            now[0] += 1.0
            bar.update()
    return stream.getvalue()


def test_progress_plain_lines_off_a_terminal():
    out = _run_bar(False)
    lines = out.splitlines()
    assert "\r" not in out and len(lines) == 10  # every 10 %, then the final line
    assert lines[0] == "[demo] 2/20 items (10%), 2s elapsed, ~18s left"
    assert lines[2].startswith("[demo] 6/20 items (30%)")
    assert lines[-1] == "[demo] done: 20/20 items (100%), 20s elapsed"
    # every N seconds as well: 3 items, 1 s apart, every_s=0.5 -> 2 lines and the last
    assert len(_run_bar(False, n=3, every_frac=1.0, every_s=0.5).splitlines()) == 3
    # min_s: short work stays silent
    assert _run_bar(False, min_s=60.0) == ""


def test_progress_bar_on_a_terminal():
    out = _run_bar(True)
    frames = out.split("\r")[1:]
    assert len(frames) >= 20 and out.endswith("\n")
    assert frames[0].startswith("demo [#.......................] 1/20 items (5%)")
    assert frames[-1].startswith("demo [########################] 20/20 items (100%)")
    erased = _run_bar(True, transient=True)
    assert erased.endswith("\r") and erased.rsplit("\r", 2)[-2].strip() == ""


def test_progress_off_for_other_ranks_and_by_env(monkeypatch):
    stream = FakeStream(False)
    monkeypatch.setenv("RANK", "1")
    for _ in progress(range(5), "x", stream=stream):
        pass
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("MRL_PROGRESS", "0")
    for _ in progress(range(5), "x", stream=stream):
        pass
    assert stream.getvalue() == ""
    monkeypatch.setenv("MRL_PROGRESS", "1")  # forces lines even below min_s
    for _ in progress(range(5), "x", stream=stream, min_s=1e9):
        pass
    assert stream.getvalue().splitlines()[-1].startswith("[x] done: 5/5")


def test_last_logged_step(tmp_path):
    assert last_logged_step(str(tmp_path)) == 0
    (tmp_path / "metrics.jsonl").write_text('{"step": 0}\n{"step": 3, "a": 1}\n{"ste')
    assert last_logged_step(str(tmp_path)) == 3


def test_plan_search_progress_on_stderr_only(monkeypatch, capsys):
    """A non-TTY run prints plain progress lines on stderr; stdout is the same with and without."""
    argv = ["plan", str(REPO / "examples" / "tiny_dapo.yaml"), "--search", "--gpus", "8"]
    monkeypatch.setenv("MRL_PROGRESS", "0")
    main(argv)
    quiet = capsys.readouterr()
    monkeypatch.setenv("MRL_PROGRESS", "1")
    main(argv)
    loud = capsys.readouterr()
    assert loud.out == quiet.out and "search:" in loud.out and quiet.err == ""
    lines = loud.err.splitlines()
    assert lines[0].startswith("[plan search] 2/20 layouts (10%)")
    assert lines[-1].startswith("[plan search] done: 20/20 layouts (100%)")


def test_progress_says_nothing_done_when_the_work_fails():
    for tty in (False, True):
        stream, now = FakeStream(tty), iter(range(100))
        with pytest.raises(RuntimeError):
            with Progress(4, "x", stream=stream, enabled=True, every_frac=0.25,
                          clock=lambda now=now: float(next(now))) as bar:
                bar.update()
                raise RuntimeError("boom")
        assert "done" not in stream.getvalue() and "100%" not in stream.getvalue()
        assert stream.getvalue().endswith("\n")
