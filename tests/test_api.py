"""The public API: flat, sorted, documented, and the README's commands in sync with CI.

The guides' loop and init snippet, and where moved names went (the API reference's
"Where things live"), are checked against the code here too.

Also the shape of the surface: at most 50 names at the top level, the rest in subpackages;
no DeprecationWarning anywhere in stabljax; every name imported from the module that
defines it; and nothing underscored imported across modules (in stabljax, the
experiments or the tests).
"""

import ast
import importlib
import inspect
import pathlib
import re
import subprocess
import sys

import pytest

import stabljax

ROOT = pathlib.Path(__file__).resolve().parents[1]


def test_all_is_sorted_and_unique():
    assert list(stabljax.__all__) == sorted(stabljax.__all__)
    assert len(set(stabljax.__all__)) == len(stabljax.__all__)


def test_every_public_name_resolves_and_has_a_docstring():
    missing = []
    for name in stabljax.__all__:
        obj = getattr(stabljax, name)  # AttributeError here is the failure
        doc = inspect.getdoc(obj)
        if not doc or len(doc.strip()) < 10:
            missing.append(name)
    assert not missing, f"public names without a docstring: {missing}"


def test_no_public_name_left_out_of_all():
    exported = {n for n in dir(stabljax) if not n.startswith("_")}
    modules = {n for n in exported if inspect.ismodule(getattr(stabljax, n))}
    assert exported - modules - set(stabljax.__all__) == set()


def _readme_command(marker: str) -> str:
    text = (ROOT / "README.md").read_text()
    m = re.search(rf"<!-- {marker} -->\n```[a-z]*\n(.+)\n```", text)
    assert m, f"README.md has no block after <!-- {marker} -->"
    return m.group(1)


def test_readme_test_command_matches_ci():
    ci = (ROOT / ".ci" / "run").read_text()
    m = re.search(r"^TEST_CMD='(.+)'$", ci, re.M)
    assert m, ".ci/run defines no TEST_CMD"
    assert _readme_command("test-command") == m.group(1)


def test_readme_main_command_runs_the_main_job():
    cmd = _readme_command("main-command")
    assert cmd.endswith(".venv/bin/python -m experiments.spike_recovery")
    assert (ROOT / "experiments" / "spike_recovery.py").exists()


def test_readme_shows_the_tested_training_loop():
    loop = (ROOT / "tests" / "readme_loop.py").read_text().strip()
    text = (ROOT / "docs" / "guides" / "train_step.md").read_text()
    assert loop in text, "the train-step guide's loop differs from tests/readme_loop.py"


def test_readme_init_snippet_runs_and_the_gpt2_plan_passes(capsys):
    text = (ROOT / "docs" / "guides" / "init.md").read_text()
    m = re.search(r"<!-- tested: tests/test_api.py -->\n```python\n(.+?)\n```", text, re.S)
    assert m, "docs/guides/init.md has no init snippet"
    code = m.group(1).replace("print(sj.init.check_init(", "report = (sj.init.check_init(")
    scope: dict = {}
    exec(compile(code, "docs/guides/init.md", "exec"), scope)
    assert "attn_out" in capsys.readouterr().out  # the plan table was printed
    assert scope["report"].ok, str(scope["report"])


# Where each name that left the top level went (docs/api/index.md, "Where things live").
MOVED = {
    "reference": ("TransformerConfig", "TransformerLM", "default_corpus", "lm_batch_fn"),
    "init": ("ArchSpec", "InitPlan", "InitReport", "check_init", "init_plan"),
    "control": (
        "CheckpointMismatch",
        "CheckpointSaveError",
        "DataExhausted",
        "Detection",
        "Event",
        "EventLog",
        "EventSchemaError",
        "JsonlMetricsWriter",
        "Preempted",
        "RunResult",
        "TensorBoardMetricsWriter",
        "read_events",
    ),
    "telemetry": ("adam_eps_report", "layer_metrics_to_host"),
}


def test_the_top_level_is_optax_sized():
    assert len(stabljax.__all__) <= 50, len(stabljax.__all__)


@pytest.mark.parametrize("package", sorted(MOVED))
def test_moved_names_live_in_their_subpackage_and_the_readme_says_where(package):
    sub = importlib.import_module(f"stabljax.{package}")
    assert getattr(stabljax, package) is sub
    section = (ROOT / "docs" / "api" / "index.md").read_text().split("## Where things live")[1]
    for name in MOVED[package]:
        assert name not in stabljax.__all__ and not hasattr(stabljax, name), name
        assert name in sub.__all__, f"stabljax.{package}.__all__ lacks {name}"
        assert getattr(sub, name).__module__.startswith(f"stabljax.{package}"), name
        line = next((ln for ln in section.splitlines() if f"`{name}`" in ln), "")
        assert f"`stabljax.{package}`" in line, f"the API reference does not say where {name} went"


def test_importing_any_stabljax_module_raises_no_deprecation_warning():
    # A fresh interpreter: a warning at import time fires once per process. Third-party
    # packages are imported first, under the default filters; from then on any warning
    # raised by importing a stabljax module, or reading a name in its __all__, is an error
    # (the old control/ module paths included).
    code = """
import importlib, pkgutil, sys, warnings
import flax.nnx, grain, jax, numpy, optax, orbax.checkpoint
warnings.simplefilter("error")
import stabljax
names = ["stabljax"] + [m.name for m in pkgutil.walk_packages(stabljax.__path__, "stabljax.")]
names += sorted(k for k in sys.modules if k.startswith("stabljax.") and k not in names)
for name in names:
    module = importlib.import_module(name)
    for attr in getattr(module, "__all__", ()):
        getattr(module, attr)
assert "stabljax.control.controller" in names, names
assert "stabljax.control.lifecycle" not in sys.modules, names
print(len(names))
"""
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=300
    )
    assert out.returncode == 0, out.stderr[-3000:]
    assert int(out.stdout.split()[-1]) > 30  # every module was walked


# ---------------------------------------------------------------------------- imports


def _private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def _module_name(path: pathlib.Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _is_stabljax(module: str) -> bool:
    return module == "stabljax" or module.startswith("stabljax.")


def _import_problems(path: pathlib.Path, check_origin: bool) -> list[str]:
    """Underscored names this file takes from a stabljax module (by import or through a
    module attribute), and with ``check_origin`` every class or function imported from a
    module other than the one that defines it."""
    tree = ast.parse(path.read_text(), str(path))
    here, problems, modules = _module_name(path), [], {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if _is_stabljax(alias.name):
                    modules[alias.asname or "stabljax"] = alias.name if alias.asname else "stabljax"
        if not isinstance(node, ast.ImportFrom):
            continue
        source = node.module or ""
        if node.level:  # relative: from the file's package, up level - 1
            package = here.split(".")[: None if path.name == "__init__.py" else -1]
            base = package[: len(package) - node.level + 1]
            source = ".".join(base + ([node.module] if node.module else []))
        if not _is_stabljax(source):
            continue
        for alias in node.names:
            where = f"{path.relative_to(ROOT)}:{node.lineno}"
            if _private(alias.name):
                problems.append(f"{where}: from {source} import {alias.name}")
                continue
            try:
                obj = importlib.import_module(f"{source}.{alias.name}")
            except ImportError:
                obj = getattr(importlib.import_module(source), alias.name, None)
            if inspect.ismodule(obj):
                modules[alias.asname or alias.name] = obj.__name__
            elif check_origin and (inspect.isclass(obj) or inspect.isfunction(obj)):
                origin = obj.__module__
                if _is_stabljax(origin) and origin != source:
                    problems.append(f"{where}: {alias.name} from {source}, defined in {origin}")
    for node in ast.walk(tree):
        if not (isinstance(node, ast.Attribute) and _private(node.attr)):
            continue
        chain, value = [], node.value
        while isinstance(value, ast.Attribute):
            chain.append(value.attr)
            value = value.value
        if not (isinstance(value, ast.Name) and value.id in modules):
            continue
        obj = importlib.import_module(modules[value.id])
        for name in reversed(chain):  # a private name reached through modules only
            obj = getattr(obj, name, None)
            if not inspect.ismodule(obj):
                break
        else:
            dotted = ".".join([value.id, *reversed(chain), node.attr])
            problems.append(f"{path.relative_to(ROOT)}:{node.lineno}: {dotted}")
    return problems


def _python_files(folder: str) -> list[pathlib.Path]:
    return sorted(p for p in (ROOT / folder).rglob("*.py") if "results" not in p.parts)


def test_nothing_underscored_is_imported_across_modules():
    problems = []
    for folder in ("stabljax", "experiments", "tests"):
        for path in _python_files(folder):
            problems += _import_problems(path, check_origin=folder == "stabljax")
    assert not problems, "\n".join(problems)


def test_the_import_check_catches_what_it_forbids(tmp_path, monkeypatch):
    monkeypatch.setattr(sys.modules[__name__], "ROOT", tmp_path)
    (tmp_path / "bad.py").write_text(
        "import stabljax\n"
        "from stabljax import step\n"
        "from stabljax.base import _TRACER_ERRORS\n"
        "from stabljax.step import nnx_apply\n"
        "step._FP32, stabljax.step._FP32\n"
    )
    problems = "\n".join(_import_problems(tmp_path / "bad.py", check_origin=True))
    assert "import _TRACER_ERRORS" in problems
    assert "nnx_apply from stabljax.step, defined in stabljax.nnx_bridge" in problems
    assert "step._FP32" in problems and "stabljax.step._FP32" in problems
