"""The user documentation: README size and commands, and links that resolve."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# Pages that parallel work adds; a link to one of them is only checked once the page exists.
PENDING_PAGES = {"gpu.md", "colocation.md", "sglang.md", "losses-2025.md",
                 "advantages-and-presets.md", "reliability.md", "bad-input.md"}


def _slug(heading: str) -> str:
    """GitHub's anchor of a Markdown heading."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def _anchors(path: Path) -> set[str]:
    return {_slug(m.group(1)) for m in re.finditer(r"^#+ (.*)$", path.read_text(), re.M)}


def _doc_files() -> list[Path]:
    return [ROOT / "README.md", ROOT / "CHANGELOG.md", *sorted((ROOT / "docs").glob("*.md"))]


def broken_links(files: list[Path], root: Path = ROOT) -> list[str]:
    """Relative links whose file or ``#anchor`` does not exist."""
    bad = []
    for f in files:
        for m in re.finditer(r"\]\(([^)\s]+)\)", f.read_text()):
            link = m.group(1)
            if re.match(r"[a-z]+:", link):
                continue
            path, _, anchor = link.partition("#")
            target = (f.parent / path) if path else f
            if not target.exists():
                if target.name not in PENDING_PAGES:
                    bad.append(f"{f.relative_to(root)}: {link} (no such file)")
                continue
            if anchor and target.suffix == ".md" and anchor not in _anchors(target):
                bad.append(f"{f.relative_to(root)}: {link} (no such heading)")
    return bad


def test_links_resolve():
    assert broken_links(_doc_files()) == []


def test_broken_link_is_found(tmp_path):
    (tmp_path / "a.md").write_text("# Top\n[x](b.md) [y](#top) [z](#nope) [w](a.md#top)\n")
    assert broken_links([tmp_path / "a.md"], tmp_path) == ["a.md: b.md (no such file)",
                                                          "a.md: #nope (no such heading)"]


def test_readme_is_short_and_runs_the_ci_command():
    readme = (ROOT / "README.md").read_text()
    assert len(readme.splitlines()) <= 250
    ci = (ROOT / ".ci" / "run").read_text().splitlines()
    test_cmd = next(line for line in ci if "pytest" in line)
    assert f"```bash\n{test_cmd}\n```" in readme
    assert ("```bash\npython -m pip install torch==2.13.0 -e . && python -m megatron_rl train "
            "examples/tiny_dapo.yaml\n```") in readme.split("---")[0]


def ragged_table_rows(text: str) -> list[int]:
    """Line numbers of Markdown table rows whose cell count differs from the table's header (an
    unescaped ``|`` inside a cell splits it)."""
    bad, width, fenced = [], None, False
    for no, line in enumerate(text.splitlines(), 1):
        if line.startswith("```"):
            fenced = not fenced
            continue
        if fenced or not line.startswith("|"):
            width = None
            continue
        cells = len(re.split(r"(?<!\\)\|", line)) - 2
        if width is None:
            width = cells
        elif cells != width:
            bad.append(no)
    return bad


def test_tables_are_rectangular():
    assert ragged_table_rows("| a | b |\n|---|---|\n| `x\\|y` | z |\n") == []
    assert ragged_table_rows("| a | b |\n|---|---|\n| `x|y` | z |\n") == [3]
    bad = {str(f.relative_to(ROOT)): ragged_table_rows(f.read_text()) for f in _doc_files()}
    assert {f: rows for f, rows in bad.items() if rows} == {}
