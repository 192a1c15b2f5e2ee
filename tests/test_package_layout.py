"""Our distribution installs no top-level ``kernels`` package (issue 12: SGLang requires Hugging
Face's ``kernels``; two top-level packages of one name shadow each other)."""

from __future__ import annotations

import importlib.metadata
import importlib.util
import runpy
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _setup_kwargs(monkeypatch) -> dict:
    """The keyword arguments ``setup.py`` passes to ``setuptools.setup`` (find_packages runs)."""
    import setuptools

    captured: dict = {}
    monkeypatch.setattr(setuptools, "setup", lambda **kw: captured.update(kw))
    monkeypatch.chdir(ROOT)
    runpy.run_path(str(ROOT / "setup.py"), run_name="__main__")
    return captured


def test_distribution_declares_no_top_level_kernels(monkeypatch):
    kw = _setup_kwargs(monkeypatch)
    packages = kw["packages"]
    assert "megatron_rl.kernels" in packages, packages
    tops = {p.split(".")[0] for p in packages}
    assert tops == {"megatron_rl"}, tops
    assert "kernels" not in (kw.get("package_dir") or {}), kw.get("package_dir")
    assert not (ROOT / "kernels" / "__init__.py").exists()
    from megatron_rl.kernels import fused_linear_logprob_entropy  # noqa: F401 - importable


def test_import_kernels_finds_hugging_face_package():
    """With Hugging Face's ``kernels`` installed (SGLang needs it), ``import kernels`` is it."""
    try:
        dist = importlib.metadata.distribution("kernels")
    except importlib.metadata.PackageNotFoundError:
        pytest.skip("Hugging Face's `kernels` package is not installed")
    spec = importlib.util.find_spec("kernels")        # resolution only: no import side effects
    expected = Path(dist.locate_file("kernels/__init__.py")).resolve()
    assert spec is not None and Path(spec.origin).resolve() == expected, (spec, expected)
    assert "fused_linear_logprob_entropy" not in Path(spec.origin).read_text()
