"""The public API: flat, sorted, documented, and the README's commands in sync with CI."""

import importlib
import inspect
import pathlib
import re

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
    assert "experiments/spike_recovery.py" in cmd
    assert (ROOT / "experiments" / "spike_recovery.py").exists()


def test_readme_shows_the_tested_training_loop():
    loop = (ROOT / "tests" / "readme_loop.py").read_text().strip()
    text = (ROOT / "README.md").read_text()
    assert loop in text, "README.md's training loop differs from tests/readme_loop.py"


def test_readme_init_snippet_runs_and_the_gpt2_plan_passes(capsys):
    text = (ROOT / "README.md").read_text()
    m = re.search(r"## Init: plan, build, check\n\n```python\n(.+?)\n```", text, re.S)
    assert m, "README.md has no init snippet"
    code = m.group(1).replace("print(sj.check_init(", "report = (sj.check_init(")
    scope: dict = {}
    exec(compile(code, "README.md:init", "exec"), scope)
    assert "attn_out" in capsys.readouterr().out  # the plan table was printed
    assert scope["report"].ok, str(scope["report"])


def test_flat_api_unchanged_by_the_reference_move():
    moved = ("TransformerConfig", "TransformerLM", "default_corpus", "lm_batch_fn")
    assert set(moved) <= set(stabljax.__all__)
    corpus = importlib.import_module("stabljax.reference.corpus")
    ref_nn = importlib.import_module("stabljax.reference.nn")

    assert stabljax.TransformerLM is ref_nn.TransformerLM
    assert stabljax.TransformerConfig is ref_nn.TransformerConfig
    assert stabljax.default_corpus is corpus.default_corpus
    assert stabljax.lm_batch_fn is corpus.lm_batch_fn
