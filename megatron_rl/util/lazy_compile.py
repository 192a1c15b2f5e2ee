"""Import megatron-core without importing TorchInductor.

megatron-core decorates its fused kernels with ``torch.compile`` when its modules are imported
(``megatron.core.jit.jit_fuser``). ``torch.compile`` compiles nothing until the first call, but the
call itself imports TorchDynamo and TorchInductor: about 3 s of CPU time in every process that
imports megatron-core, whether or not a fused kernel ever runs (on CPU none does).
:func:`install` makes the import of ``megatron.core`` see a ``torch.compile`` that defers the
real call to the decorated function's first call; after that the function is exactly what
``torch.compile`` returns. ``torch.compile`` itself is restored as soon as the import ends.
"""

from __future__ import annotations

import contextlib
import functools
import importlib.abc
import importlib.util
import sys
from typing import Any, Callable, Iterator

TARGET = "megatron.core"


def deferred(real: Callable) -> Callable:
    """A ``torch.compile`` look-alike that calls ``real`` (with the same arguments) on the first
    call of the decorated function. Modules are compiled at once (nothing to defer)."""

    def compile_later(model: Any = None, **kwargs: Any) -> Any:
        if model is None:  # @torch.compile(mode=...) decorator form
            return lambda fn: compile_later(fn, **kwargs)
        import torch

        if isinstance(model, torch.nn.Module) or not callable(model):
            return real(model, **kwargs)
        compiled: list[Callable] = []

        @functools.wraps(model)
        def first_call_compiles(*args: Any, **kw: Any) -> Any:
            if not compiled:
                compiled.append(real(model, **kwargs))
            return compiled[0](*args, **kw)

        first_call_compiles.__wrapped_compile_kwargs__ = kwargs  # type: ignore[attr-defined]
        return first_call_compiles

    return compile_later


@contextlib.contextmanager
def deferred_torch_compile() -> Iterator[None]:
    """``torch.compile`` is :func:`deferred` inside the block (then the real one again)."""
    import torch

    real = torch.compile
    torch.compile = deferred(real)
    try:
        yield
    finally:
        torch.compile = real


class _Loader(importlib.abc.Loader):
    def __init__(self, inner: importlib.abc.Loader):
        self.inner = inner

    def create_module(self, spec):  # noqa: D401 - importlib protocol
        return self.inner.create_module(spec)

    def exec_module(self, module) -> None:
        with deferred_torch_compile():
            self.inner.exec_module(module)

    def __getattr__(self, name: str) -> Any:  # get_resource_reader, is_package, ...
        return getattr(self.inner, name)


class _Finder(importlib.abc.MetaPathFinder):
    """One-shot: wraps the loader of ``megatron.core`` the first time it is imported."""

    def find_spec(self, fullname, path, target=None):
        if fullname != TARGET:
            return None
        with contextlib.suppress(ValueError):
            sys.meta_path.remove(self)
        spec = importlib.util.find_spec(fullname)
        if spec is not None and spec.loader is not None:
            spec.loader = _Loader(spec.loader)
        return spec


def install() -> None:
    """Defer megatron-core's import-time ``torch.compile`` calls (no effect once it is imported)."""
    if TARGET in sys.modules or any(isinstance(f, _Finder) for f in sys.meta_path):
        return
    sys.meta_path.insert(0, _Finder())
