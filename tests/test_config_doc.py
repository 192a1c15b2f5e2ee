"""docs/configuration.md is generated from the config dataclasses and must be up to date."""

from __future__ import annotations

import dataclasses
import subprocess
import sys
import typing
import warnings
from dataclasses import dataclass, field
from pathlib import Path

from megatron_rl.cli.app import main
from megatron_rl.config import doc as config_doc

ROOT = Path(__file__).resolve().parents[1]
DOC = ROOT / "docs" / "configuration.md"


class UndocumentedConfigFields(Warning):
    """Config fields without a description (listed, not a failure)."""


def test_configuration_md_is_up_to_date():
    missing = config_doc.undocumented_keys()
    if missing:
        warnings.warn(UndocumentedConfigFields(
            f"{len(missing)} config field(s) have no `# comment`: {', '.join(missing)}"),
            stacklevel=1)
        print(f"undocumented config fields: {', '.join(missing)}")
    # A fresh process: what other tests imported (e.g. a registered loss) cannot change the text.
    proc = subprocess.run([sys.executable, "-m", "megatron_rl", "config", "--check", "--out",
                           str(DOC)], cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr.strip().splitlines()[-1:] or proc.stdout


def _keys(cls: type, prefix: str) -> list[str]:
    hints = typing.get_type_hints(cls)
    out = []
    for f in dataclasses.fields(cls):
        key = f"{prefix}.{f.name}" if prefix else f.name
        out += _keys(hints[f.name], key) if dataclasses.is_dataclass(hints[f.name]) else [key]
    return out


def test_every_field_has_one_row():
    from megatron_rl.config.sections import RunConfig
    from megatron_rl.loss import LossConfig

    rows = [r.key for _, _, rs in config_doc.all_sections() for r in rs]
    want = _keys(RunConfig, "") + _keys(LossConfig, "loss.overrides")
    assert sorted(rows) == sorted(want)
    text = config_doc.render()
    for key in want:
        assert f"| `{key}` |" in text, key


@dataclass
class _Sample:
    # a group note
    # over two lines
    a: int = 1  # the a field
    b: str = "x # not a comment"  # b's doc | with a bar

    c: list = field(
        default_factory=list)  # multi-line field
    d: float | None = None
    e: typing.Literal["x", "y"] = "x"  # a choice


def test_comments_types_defaults_and_markers():
    trailing, group = config_doc.source_comments(_Sample)
    assert trailing == {"a": "the a field", "b": "b's doc | with a bar", "c": "multi-line field",
                        "e": "a choice"}
    assert group == {"a": "a group note over two lines"}
    (_, _, rows), = config_doc.section_rows(_Sample, "s")
    by = {r.key: r for r in rows}
    assert by["s.b"].default == "x # not a comment" and by["s.d"].type == "float | None"
    assert by["s.d"].default == "null" and by["s.c"].default == "[]" and by["s.d"].doc == ""
    assert by["s.e"].type == "str" and by["s.e"].allowed == "`x`, `y`"
    assert config_doc.allowed_values("loss.overrides.kl_loss_type").startswith("`k1`, `kl`")


def test_stale_doc_is_reported_with_the_command(tmp_path, capsys):
    out = tmp_path / "configuration.md"
    assert main(["config", "--check", "--out", str(out)]) == 1          # missing
    assert config_doc.DOC_COMMAND in capsys.readouterr().err
    assert main(["config", "--doc", "--out", str(out)]) == 0
    assert out.read_text() == config_doc.render()
    assert main(["config", "--check", "--out", str(out)]) == 0
    out.write_text(out.read_text().replace("| `parallel.tp` |", "| `parallel.tpx` |"))
    assert main(["config", "--check", "--out", str(out)]) == 1
    assert "out of date" in capsys.readouterr().err
