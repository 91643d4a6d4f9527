"""The shape of the package, read from the source (ast, nothing imported): no import circle
(imports under ``TYPE_CHECKING`` and inside functions count), no module over 600 lines, and
no module aliased under an old path."""

from __future__ import annotations

import ast
import pathlib

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1] / "stabljax"
MAX_LINES = 600


def _modules() -> dict[str, pathlib.Path]:
    out = {}
    for path in sorted(ROOT.rglob("*.py")):
        parts = path.relative_to(ROOT.parent).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        out[name] = path
    return out


def _package(name: str, path: pathlib.Path) -> str:
    return name if path.name == "__init__.py" else name.rpartition(".")[0]


def _imports(name: str, path: pathlib.Path, modules: dict[str, pathlib.Path]) -> set[str]:
    """The stabljax modules ``name`` imports, anywhere in its source.

    ``from pkg import sub`` counts as importing the module ``pkg.sub`` when there is one,
    else ``pkg``; the implicit import of a package's ``__init__`` is not counted (it runs
    before its submodules, which is not a circle that can bite).
    """
    out = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                pkg = _package(name, path).split(".")
                base = ".".join(pkg[: len(pkg) - node.level + 1] + ([base] if base else []))
            targets = [
                f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base for a in node.names
            ]
        else:
            continue
        out |= {t for t in targets if t in modules and t != name}
    return out


def _graph() -> dict[str, set[str]]:
    modules = _modules()
    return {name: _imports(name, path, modules) for name, path in modules.items()}


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components with more than one module (Tarjan)."""
    index, low, stack, on, out = {}, {}, [], set(), []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def _is_package_reexport(importer: str, imported: str) -> bool:
    # A package's __init__ importing its own submodules is how it re-exports them.
    return imported.startswith(importer + ".")


def test_no_import_circle():
    graph = _graph()
    pruned = {m: {t for t in ts if not _is_package_reexport(m, t)} for m, ts in graph.items()}
    assert _cycles(pruned) == []


def test_the_cycle_finder_finds_a_circle():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert _cycles(graph) == [["a", "b", "c"]]
    assert _cycles({"a": {"b"}, "b": set()}) == []


def test_a_type_checking_import_counts(tmp_path):
    (tmp_path / "stabljax").mkdir()
    (tmp_path / "stabljax" / "x.py").write_text(
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from stabljax import y\n"
    )
    (tmp_path / "stabljax" / "y.py").write_text("def f():\n    import stabljax.x\n")
    modules = {"stabljax.x": tmp_path / "stabljax/x.py", "stabljax.y": tmp_path / "stabljax/y.py"}
    graph = {m: _imports(m, p, modules) for m, p in modules.items()}
    assert graph == {"stabljax.x": {"stabljax.y"}, "stabljax.y": {"stabljax.x"}}
    assert _cycles(graph) == [["stabljax.x", "stabljax.y"]]


@pytest.mark.parametrize("name", sorted(_modules()))
def test_no_module_over_600_lines(name):
    lines = len(_modules()[name].read_text().splitlines())
    assert lines <= MAX_LINES, f"{name} has {lines} lines"


def test_no_old_path_alias():
    """No module registers another name for itself in ``sys.modules``."""
    for name, path in _modules().items():
        text = path.read_text()
        assert "_OLD_PATHS" not in text, name
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, ast.Subscript) and isinstance(node.value, ast.Attribute):
                target = node.value
                is_modules = target.attr == "modules" and getattr(target.value, "id", "") in (
                    "sys",
                    "_sys",
                )
                assert not (is_modules and isinstance(node.ctx, ast.Store)), name


def test_the_old_paths_are_gone():
    import importlib

    older = ("checkpoints", "lifecycle", "recovery", "writers", "saving")
    flat = ("detectors", "drift", "trends", "monitor", "store", "saver", "retention", "integrity")
    flat += ("items", "jsonio", "fsutil", "grain_state", "policy", "remedies", "triage", "rollback")
    flat += ("attribution", "screen")
    for old in older + flat:
        with pytest.raises(ModuleNotFoundError):
            importlib.import_module(f"stabljax.control.{old}")
