"""The shape of the package, read from the source (ast, nothing imported): no import circle
(imports under ``TYPE_CHECKING`` and inside functions count), no module over 600 lines, no
module aliased under an old path; no folder over 8 modules, no function over 80 lines of
code, no experiment file over 400 lines, no frame reads or private optax attributes, no
module-name aliases and no unused re-exports. Each rule's checker is also fed a violation."""

from __future__ import annotations

import ast
import io
import pathlib
import sys
import tokenize

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


# ------------------------------------------------------------------------ sizes a newcomer can walk
# STYLE.md: a folder holds at most 8 modules; a function at most 80 lines of code; an
# experiment file at most 400 lines; no frame reads and no private optax attributes; no
# module aliased under another name, and no unused re-export outside a package's __init__.

REPO = ROOT.parent
MAX_MODULES = 8
MAX_FUNCTION_LINES = 80
MAX_EXPERIMENT_LINES = 400
FORBIDDEN = (
    "sys._getframe",
    "_getframe",
    "inspect.currentframe",
    "inspect.stack",
    "_should_skip_update_fn",
)
_NOT_CODE = (
    tokenize.COMMENT,
    tokenize.NL,
    tokenize.NEWLINE,
    tokenize.INDENT,
    tokenize.DEDENT,
    tokenize.ENDMARKER,
)


def _python_files(*folders: str) -> list[pathlib.Path]:
    out = []
    for folder in folders:
        out += [p for p in (REPO / folder).rglob("*.py") if "results" not in p.parts]
    return sorted(out)


def folder_sizes(root: pathlib.Path) -> dict[str, int]:
    """The number of modules (``.py`` files, ``__init__.py`` included) in each folder."""
    sizes: dict[str, int] = {}
    for path in root.rglob("*.py"):
        key = str(path.parent.relative_to(root.parent))
        sizes[key] = sizes.get(key, 0) + 1
    return sizes


def _code_lines(source: str) -> set[int]:
    """The lines holding a token of code: not blank, not a comment alone."""
    lines: set[int] = set()
    for tok in tokenize.generate_tokens(io.StringIO(source).readline):
        if tok.type not in _NOT_CODE:
            lines.update(range(tok.start[0], tok.end[0] + 1))
    return lines


def function_lengths(source: str) -> dict[str, int]:
    """Lines of code of every function, by qualified name (``outer.inner``).

    From the ``def`` line to the function's last line, nested functions included; blank
    lines, comment lines and the docstring are not counted.
    """
    code, out = _code_lines(source), {}

    def visit(node: ast.AST, prefix: str) -> None:
        for child in ast.iter_child_nodes(node):
            name = prefix
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
                name = f"{prefix}{child.name}"
                span = set(range(child.lineno, child.end_lineno + 1))
                first = child.body[0]
                if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant):
                    if isinstance(first.value.value, str):
                        span -= set(range(first.lineno, first.end_lineno + 1))
                out[name] = len(span & code)
                name += "."
            elif isinstance(child, ast.ClassDef):
                name = f"{prefix}{child.name}."
            visit(child, name)

    visit(ast.parse(source), "")
    return out


def forbidden_strings(text: str) -> list[str]:
    return [s for s in FORBIDDEN if s in text]


def module_aliases(source: str, modules: set[str]) -> list[str]:
    """``from stabljax.x import mod as m`` / ``import stabljax.x.mod as m`` with ``m != mod``."""
    out = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            for a in node.names:
                if a.asname and a.name in modules and a.asname != a.name.rpartition(".")[2]:
                    out.append(f"import {a.name} as {a.asname}")
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            for a in node.names:
                full = f"{node.module}.{a.name}"
                if a.asname and full in modules and a.asname != a.name:
                    out.append(f"from {node.module} import {a.name} as {a.asname}")
    return out


def unused_reexports(source: str) -> list[str]:
    """``from X import name as name`` whose ``name`` the module never reads."""
    tree = ast.parse(source)
    read = {n.id for n in ast.walk(tree) if isinstance(n, ast.Name)}
    read |= {
        n.value.id
        for n in ast.walk(tree)
        if isinstance(n, ast.Attribute) and isinstance(n.value, ast.Name)
    }
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            for a in node.names:
                if a.asname is not None and a.asname == a.name and a.name not in read:
                    out.append(f"from {node.module} import {a.name} as {a.name}")
    return out


def test_no_folder_holds_more_than_8_modules():
    big = {k: v for k, v in folder_sizes(ROOT).items() if v > MAX_MODULES}
    assert not big, f"folders over {MAX_MODULES} modules (group them by concept): {big}"


def test_the_folder_count_catches_a_ninth_module(tmp_path):
    pkg = tmp_path / "stabljax" / "optim"
    pkg.mkdir(parents=True)
    for i in range(8):
        (pkg / f"m{i}.py").write_text("")
    assert folder_sizes(tmp_path / "stabljax") == {"stabljax/optim": 8}
    (pkg / "__init__.py").write_text("")
    assert folder_sizes(tmp_path / "stabljax") == {"stabljax/optim": 9}


def test_no_function_over_80_lines_of_code():
    long = []
    for path in _python_files("stabljax", "experiments"):
        for name, n in function_lengths(path.read_text()).items():
            if n > MAX_FUNCTION_LINES:
                long.append(f"{path.relative_to(REPO)}::{name} ({n})")
    assert not long, f"functions over {MAX_FUNCTION_LINES} lines of code: {long}"


def test_the_function_count_skips_the_docstring_comments_and_blanks():
    def body(n: int, pad: str = "    ") -> str:  # n // 3 three-line statements, then pass
        lines = "".join(f"{pad}x{i} = (\n{pad}    {i}\n{pad})\n" for i in range(n // 3))
        return lines + f"{pad}pass\n"

    doc = '    """Doc.\n\n' + "    more\n" * 40 + '    """\n'
    noise = "    # a comment\n\n" * 30
    method = f"class C:\n    def g(self):\n{body(6, pad='        ')}"
    src = f"def f():\n{doc}{noise}{body(78)}\n{method}"
    # f: its def line, 26 three-line statements and a pass; C.g: the def, 2 statements, pass.
    assert function_lengths(src) == {"f": 80, "C.g": 8}
    longer = f"def f():\n{doc}{body(78)}    y = 1\n"
    assert function_lengths(longer) == {"f": 81}
    nested = "def outer():\n    def inner():\n        return 1\n    return inner\n"
    assert function_lengths(nested) == {"outer": 4, "outer.inner": 2}


def test_no_experiment_file_over_400_lines():
    long = {}
    for path in _python_files("experiments"):
        n = len(path.read_text().splitlines())
        if n > MAX_EXPERIMENT_LINES:
            long[str(path.relative_to(REPO))] = n
    assert not long, f"experiment files over {MAX_EXPERIMENT_LINES} lines: {long}"


def test_the_experiment_line_count_catches_a_long_file(tmp_path, monkeypatch):
    (tmp_path / "experiments" / "results").mkdir(parents=True)
    (tmp_path / "experiments" / "ok.py").write_text("x = 1\n" * 400)
    (tmp_path / "experiments" / "long.py").write_text("x = 1\n" * 401)
    (tmp_path / "experiments" / "results" / "data.py").write_text("x = 1\n" * 999)
    monkeypatch.setattr(sys.modules[__name__], "REPO", tmp_path)
    with pytest.raises(AssertionError, match=r"experiments/long.py': 401}"):
        test_no_experiment_file_over_400_lines()


def test_no_frame_reads_and_no_private_optax_attribute():
    found = {}
    for path in _python_files("stabljax"):
        hits = forbidden_strings(path.read_text())
        if hits:
            found[str(path.relative_to(REPO))] = hits
    assert not found, f"frame reads or private optax attributes: {found}"


def test_the_forbidden_strings_are_caught():
    assert forbidden_strings("f = sys._getframe(1).f_locals") == ["sys._getframe", "_getframe"]
    assert forbidden_strings("from sys import _getframe") == ["_getframe"]
    assert forbidden_strings("inspect.currentframe().f_back") == ["inspect.currentframe"]
    assert forbidden_strings("for f in inspect.stack():") == ["inspect.stack"]
    assert forbidden_strings('getattr(ms, "_should_skip_update_fn")') == ["_should_skip_update_fn"]
    assert forbidden_strings("optax.MultiSteps(opt, k, should_skip_update_fn=fn)") == []


def test_no_module_aliases_and_no_unused_reexports():
    modules = set(_modules())
    found = []
    for path in _python_files("stabljax", "experiments", "tests", "examples"):
        src = path.read_text()
        where = path.relative_to(REPO)
        found += [f"{where}: {a}" for a in module_aliases(src, modules)]
        if path.name != "__init__.py":
            found += [f"{where}: {r}" for r in unused_reexports(src)]
    assert not found, "\n".join(found)


def test_the_alias_and_reexport_checks_catch_what_they_forbid():
    modules = {"stabljax", "stabljax.metrics", "stabljax.optim", "stabljax.optim.adam"}
    src = (
        "from stabljax import metrics as keys\n"
        "import stabljax.optim.adam as a\n"
        "from stabljax import metrics\n"
        "import stabljax.optim.adam as adam\n"
        "from stabljax.metrics import LOSS as L\n"  # a name, not a module: not an alias
        "import numpy as np\n"
    )
    assert module_aliases(src, modules) == [
        "from stabljax import metrics as keys",
        "import stabljax.optim.adam as a",
    ]
    src = (
        "from stabljax.report.read import load_run as load_run\n"
        "from stabljax.metrics import LOSS as LOSS\n"
        "from stabljax import metrics as metrics\n"
        "print(LOSS, metrics.GRAD_NORM)\n"
    )
    assert unused_reexports(src) == ["from stabljax.report.read import load_run as load_run"]
