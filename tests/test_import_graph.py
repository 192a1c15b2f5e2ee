"""The package's import graph, read with ``ast`` (nothing is imported): no import cycles, and every
import points down the layers of docs/architecture.md.

An edge ``a -> b`` is any ``import`` / ``from ... import`` in module ``a`` naming module ``b`` --
at module level or inside a function, relative imports resolved -- plus the package ``__init__``
files that importing ``b`` runs first, plus a string constant that names a module exactly
(``importlib.import_module`` targets, ``python -m`` commands).
"""

from __future__ import annotations

import ast
import functools
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = "megatron_rl"

# Bottom to top (docs/architecture.md). An import may point to its own layer or a lower one.
# config.errors (the bad-config exception) is the one config module every layer may raise.
LAYERS: list[tuple[str, tuple[str, ...]]] = [
    ("foundation", ("parallel", "ops", "testing", "util", "config.errors")),
    ("model", ("kernels", "models")),
    ("losses and weights", ("loss", "convert")),
    ("training engine", ("actor", "critic")),
    ("inputs", ("rewards", "envs", "data")),
    ("rollout", ("rollout",)),
    ("config", ("config",)),
    ("records", ("metrics",)),
    ("run", ("run", "eval")),
    ("tools", ("plan", "cli", "__main__")),
]


def module_files(root: Path, package: str = PACKAGE) -> dict[str, tuple[Path, bool]]:
    """``{dotted module: (file, is_package)}`` of every ``.py`` file under ``root/package``."""
    out = {}
    for path in sorted((root / package).rglob("*.py")):
        parts = list(path.relative_to(root).with_suffix("").parts)
        is_pkg = parts[-1] == "__init__"
        out[".".join(parts[:-1] if is_pkg else parts)] = (path, is_pkg)
    return out


def _resolve(name: str, mods: dict) -> str | None:
    """The longest prefix of dotted ``name`` that is one of ``mods`` (None: not ours)."""
    while name and name not in mods:
        name = name.rpartition(".")[0]
    return name or None


def _ancestors(mod: str) -> list[str]:
    parts = mod.split(".")
    return [".".join(parts[:i]) for i in range(1, len(parts))]


def import_graph(root: Path = ROOT, package: str = PACKAGE,
                 parents: bool = True) -> dict[str, dict[str, int]]:
    """``{module: {imported module: line}}`` over the whole package (see the module docstring);
    ``parents=False``: without the package ``__init__`` files an import runs first."""
    mods = module_files(root, package)
    graph: dict[str, dict[str, int]] = {m: {} for m in mods}
    for mod, (path, is_pkg) in mods.items():
        tree = ast.parse(path.read_text(), str(path))
        here = mod if is_pkg else mod.rpartition(".")[0]
        docstrings = {id(n.body[0].value) for n in ast.walk(tree)
                      if isinstance(n, (ast.Module, ast.ClassDef, ast.FunctionDef,
                                        ast.AsyncFunctionDef))
                      and n.body and isinstance(n.body[0], ast.Expr)
                      and isinstance(n.body[0].value, ast.Constant)}
        for node in ast.walk(tree):
            targets: list[str] = []
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    up = here.split(".")[: len(here.split(".")) - node.level + 1]
                    base = ".".join(up + ([node.module] if node.module else []))
                targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in mods else base
                           for a in node.names]
            elif (isinstance(node, ast.Constant) and isinstance(node.value, str)
                  and node.value in mods and id(node) not in docstrings):
                targets = [node.value]
            for target in targets:
                dep = _resolve(target, mods) if target.startswith(package) else None
                if dep is not None and dep != mod:
                    graph[mod].setdefault(dep, node.lineno)
    return with_parents(graph) if parents else graph


def with_parents(graph: dict[str, dict[str, int]]) -> dict[str, dict[str, int]]:
    """``graph`` plus, for each edge, the package ``__init__`` files that importing its target
    runs first (those of the importer's own packages are running already)."""
    out = {}
    for mod, deps in graph.items():
        own = set(_ancestors(mod))
        out[mod] = dict(deps)
        for dep, line in deps.items():
            for d in _ancestors(dep):
                if d != mod and d not in own and d in graph:
                    out[mod].setdefault(d, line)
    return out


@functools.cache
def _direct_graph() -> dict[str, dict[str, int]]:
    return import_graph(ROOT, PACKAGE, parents=False)


def package_graph(parents: bool = True) -> dict[str, dict[str, int]]:
    """:func:`import_graph` of this checkout (the files are read once per test session)."""
    return with_parents(_direct_graph()) if parents else _direct_graph()


def cycles(graph: dict[str, dict[str, int]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    counter = 0
    for start in graph:
        if start in index:
            continue
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = counter
        counter += 1
        stack.append(start)
        on_stack.add(start)
        while work:
            v, it = work[-1]
            advanced = False
            for w in it:
                if w not in index:
                    index[w] = low[w] = counter
                    counter += 1
                    stack.append(w)
                    on_stack.add(w)
                    work.append((w, iter(sorted(graph[w]))))
                    advanced = True
                    break
                if w in on_stack:
                    low[v] = min(low[v], index[w])
            if advanced:
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[v])
            if low[v] == index[v]:
                comp = []
                while True:
                    w = stack.pop()
                    on_stack.discard(w)
                    comp.append(w)
                    if w == v:
                        break
                if len(comp) > 1:
                    found.append(sorted(comp))
    return found


def cycle_path(graph: dict[str, dict[str, int]], component: list[str]) -> str:
    """One closed path through ``component``, e.g. ``a (line 3) -> b (line 9) -> a``."""
    members = set(component)
    start = component[0]
    prev: dict[str, str] = {}
    frontier = [start]
    while frontier:
        nxt = []
        for v in frontier:
            for w in sorted(graph[v]):
                if w == start:
                    path = [v]
                    while path[-1] != start:
                        path.append(prev[path[-1]])
                    path.reverse()
                    hops = [f"{a} (line {graph[a][b]})" for a, b in zip(path, path[1:] + [start])]
                    return " -> ".join(hops + [start])
                if w in members and w not in prev and w != start:
                    prev[w] = v
                    nxt.append(w)
        frontier = nxt
    return " <-> ".join(component)


def layer_of(mod: str) -> int:
    """Index in :data:`LAYERS` of the most specific entry naming ``mod`` or a package above it."""
    rel = mod[len(PACKAGE) + 1:]
    best, best_len = None, -1
    for i, (_, members) in enumerate(LAYERS):
        for m in members:
            if (rel == m or rel.startswith(m + ".")) and len(m) > best_len:
                best, best_len = i, len(m)
    if best is None:
        raise AssertionError(f"{mod} is in no layer of tests/test_import_graph.py::LAYERS "
                             "(add its package, and to docs/architecture.md)")
    return best


def test_no_import_cycles():
    graph = package_graph()
    found = cycles(graph)
    assert not found, "import cycles:\n" + "\n".join(
        f"{len(c)} modules import each other ({', '.join(c)}), e.g. {cycle_path(graph, c)}"
        for c in found)


def test_imports_point_down_the_layers():
    graph = package_graph(parents=False)
    up = []
    for mod, deps in graph.items():
        if mod == PACKAGE:
            continue
        for dep, line in deps.items():
            if dep != PACKAGE and layer_of(dep) > layer_of(mod):
                up.append(f"{mod} (line {line}) imports {dep}: layer "
                          f"{LAYERS[layer_of(mod)][0]!r} below {LAYERS[layer_of(dep)][0]!r}")
    assert not up, "imports that point up the layers:\n" + "\n".join(sorted(up))


def test_top_level_holds_only_packages():
    loose = sorted(p.name for p in (ROOT / PACKAGE).glob("*.py")
                   if p.name not in ("__init__.py", "__main__.py"))
    assert not loose, f"loose modules at the top of {PACKAGE}/: {loose} (put them in a package)"
    layered = {m.split(".")[0] for _, members in LAYERS for m in members}
    packages = {p.parent.name for p in (ROOT / PACKAGE).glob("*/__init__.py")}
    assert packages <= layered, f"packages in no layer: {sorted(packages - layered)}"


def test_the_graph_sees_local_relative_string_and_parent_imports(tmp_path):
    """The checker itself: a cycle made of a function-local import, a relative import, a module
    named in a string and a package ``__init__`` is found and named."""
    pkg = tmp_path / PACKAGE
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "a.py").write_text("def f():\n    from megatron_rl.sub import b\n    return b\n")
    (pkg / "sub" / "__init__.py").write_text("from . import c\n")
    (pkg / "sub" / "b.py").write_text('"""Docstring naming megatron_rl.a is no edge."""\n')
    (pkg / "sub" / "c.py").write_text('import importlib\nM = importlib.import_module('
                                      '"megatron_rl.a")\n')
    graph = import_graph(tmp_path)
    assert graph[f"{PACKAGE}.a"] == {f"{PACKAGE}.sub": 2, f"{PACKAGE}.sub.b": 2}
    assert graph[f"{PACKAGE}.sub"] == {f"{PACKAGE}.sub.c": 1}
    assert graph[f"{PACKAGE}.sub.b"] == {}
    found = cycles(graph)
    assert found == [[f"{PACKAGE}.a", f"{PACKAGE}.sub", f"{PACKAGE}.sub.c"]]
    path = cycle_path(graph, found[0])
    assert path.startswith(f"{PACKAGE}.a (line 2) -> {PACKAGE}.sub (line 1) -> ") and \
        path.endswith(f" -> {PACKAGE}.a"), path
    (pkg / "sub" / "c.py").write_text("X = 1\n")
    assert cycles(import_graph(tmp_path)) == []
