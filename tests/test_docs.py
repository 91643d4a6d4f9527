"""The documentation, checked like code: the Sphinx site builds with warnings as errors, its
API reference holds every public name, README stays short and its links resolve, and no
user-facing text names one of this project's issue numbers.

The build needs the ``docs`` extra (``pip install -e ".[docs]"``); without it the two build
tests skip, and ``.ci/run`` installs it and runs this file on its own.
"""

from __future__ import annotations

import importlib
import pathlib
import re
import subprocess
import sys
import tomllib

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
README = ROOT / "README.md"
#: The namespaces whose ``__all__`` is public API: the top level and the subpackages it
#: exposes (``stabljax.<package>.<name>``), with the report, which runs as a command.
NAMESPACES = ("stabljax", "control", "init", "reference", "report", "telemetry")


def namespaces():
    out = {}
    for name in NAMESPACES:
        full = name if name == "stabljax" else f"stabljax.{name}"
        out[full] = importlib.import_module(full)
    return out


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    pytest.importorskip("sphinx")
    pytest.importorskip("myst_parser")
    out = tmp_path_factory.mktemp("html")
    cmd = [sys.executable, "-m", "sphinx", "-W", "--keep-going", "-b", "html", "-q"]
    run = subprocess.run(
        [*cmd, str(DOCS), str(out)], capture_output=True, text=True, cwd=ROOT, timeout=600
    )
    return run, out


def test_sphinx_build_passes_with_warnings_as_errors(built):
    run, out = built
    assert run.returncode == 0, run.stderr[-5000:]
    for page in ("index", "api/index", "guides/guards", "guides/rollback", "experiments"):
        assert (out / f"{page}.html").is_file(), page


def test_every_public_name_is_in_the_api_reference(built):
    from sphinx.util.inventory import InventoryFile

    run, out = built
    assert run.returncode == 0, run.stderr[-5000:]
    with open(out / "objects.inv", "rb") as f:
        inventory = InventoryFile.load(f, "", lambda base, uri: uri)
    data = getattr(inventory, "data", inventory)  # Sphinx < 8.2 returns the dict itself
    documented = {name for kind, objs in data.items() if kind.startswith("py:") for name in objs}
    missing = [
        f"{full}.{name}"
        for full, module in namespaces().items()
        for name in module.__all__
        if f"{full}.{name}" not in documented
    ]
    assert not missing, f"not in the API reference: {missing}"
    assert len(documented) > 150  # not an empty inventory


# -------------------------------------------------------------------- issue numbers

#: "issue 37", "Issue #42", "issues 27-28": this project's tracker, which users never see.
#: A third-party project's issue (optax issue #828, flax issue 2547) is a citation and stays.
ISSUE = re.compile(r"(?<![\w/])(\w+\s+)?issues?\s+#?\d+", re.I)
THIRD_PARTY = {"optax", "flax", "jax", "orbax", "grain", "chex", "xla", "deepspeed", "pytorch"}


def issue_mentions(text: str) -> list[str]:
    return [
        m.group(0)
        for m in ISSUE.finditer(text)
        if (m.group(1) or "").strip().lower() not in THIRD_PARTY
    ]


def user_facing_files() -> list[pathlib.Path]:
    files = [README, *sorted(DOCS.rglob("*.md")), *sorted(DOCS.glob("*.py"))]
    files += sorted((ROOT / "examples").glob("*.py")) + sorted((ROOT / "stabljax").rglob("*.py"))
    return [f for f in files if "_build" not in f.parts]


def test_the_issue_check_catches_what_it_forbids():
    assert issue_mentions("Re-measured with issue 37's rule; Issue #42: a guard") == [
        "with issue 37",
        "Issue #42",
    ]
    assert issue_mentions("issues 27 and 28") == ["issues 27"]
    assert issue_mentions("optax issue #828 and flax issue 2547, DeepSpeed #8439") == []


def test_no_user_facing_page_names_an_issue_number():
    found = {
        str(f.relative_to(ROOT)): hits
        for f in user_facing_files()
        if (hits := issue_mentions(f.read_text()))
    }
    assert len(user_facing_files()) > 50
    assert not found, found


# -------------------------------------------------------------------------- README


def test_readme_is_short_and_in_the_promised_order():
    text = README.read_text()
    assert len(text.splitlines()) <= 250
    heads = re.findall(r"^## (.+)$", text, re.M)
    order = ["Install", "Two commands", "Quickstart", "Features", "The evidence", "Compatibility"]
    at = [next(i for i, h in enumerate(heads) if h.startswith(o)) for o in order]
    assert at == sorted(at), heads
    assert "experiment-claims:start" not in text  # the generated claims live on a docs page


def test_readme_names_the_negative_results():
    evidence = README.read_text().split("## The evidence")[1].split("\n## ")[0]
    evidence = " ".join(evidence.split())  # the phrases may wrap
    for needle in ("worse", "+0.11", "7 of 10", "not shown to help", "ZClip", "eps = 0"):
        assert needle in evidence, needle
    assert "docs/experiments.md" in evidence


def _slug(heading: str) -> str:
    """GitHub's and myst's anchor of a Markdown heading."""
    text = re.sub(r"[`*]", "", heading.strip().lower())
    return re.sub(r"\s", "-", re.sub(r"[^\w\s-]", "", text))


def test_readme_links_resolve_to_files_and_headings():
    text = README.read_text()
    links = re.findall(r"\]\(([^)\s]+)\)", text)
    local = [link for link in links if not link.startswith(("http://", "https://"))]
    assert len(local) >= 12
    for link in local:
        path, _, anchor = link.partition("#")
        target = ROOT / path
        assert target.is_file(), link
        if anchor:
            heads = re.findall(r"^#+ (.+)$", target.read_text(), re.M)
            assert anchor in {_slug(h) for h in heads}, (link, heads)


def test_readme_slug_helper():
    assert _slug("Which optimizer inside") == "which-optimizer-inside"
    assert _slug("The errors you may catch") == "the-errors-you-may-catch"


def test_readme_install_uses_extras_that_exist_and_the_tested_command():
    text = README.read_text()
    extras = set(
        tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    )
    assert {"test", "experiments", "docs", "tpu", "tensorboard"} <= extras
    install = text.split("## Install")[1].split("\n## ")[0]
    named = set(re.findall(r"`(\w+)` \(", install))  # "`docs` (Sphinx, ...)"
    assert named & extras == {"test", "experiments", "docs", "tpu", "tensorboard"}, named
    block = re.search(r"```bash\n(.+?)\n```", install).group(1)
    test_cmd = re.search(r"<!-- test-command -->\n```bash\n(.+)\n```", text).group(1)
    # README's install is the test command's, which CI runs verbatim from a fresh clone.
    assert test_cmd.startswith(block.replace("pip install -e", "pip install -q -e")), block


@pytest.mark.parametrize(
    ("link", "warning"),
    [("[a page](missing.md)", "missing"), ("[a heading](other.md#no-such-heading)", "no-such")],
)
def test_the_build_fails_on_a_broken_internal_link(tmp_path, link, warning):
    """The site's own configuration turns a broken page link or anchor into an error."""
    pytest.importorskip("sphinx")
    pytest.importorskip("myst_parser")
    src = tmp_path / "docs"
    src.mkdir()
    (src / "conf.py").write_text((DOCS / "conf.py").read_text())
    toc = "```{toctree}\nother\n```\n"
    (src / "index.md").write_text(f"# Home\n\n{toc}\nSee {link}.\n")
    (src / "other.md").write_text("# Other\n\n## A heading\n")
    cmd = [
        sys.executable,
        "-m",
        "sphinx",
        "-W",
        "-b",
        "html",
        "-q",
        str(src),
        str(tmp_path / "out"),
    ]
    run = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert run.returncode != 0
    assert warning in run.stderr, run.stderr[-2000:]
    good = "[a heading](other.md#a-heading)"
    (src / "index.md").write_text(f"# Home\n\n{toc}\nSee {good}.\n")
    run = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert run.returncode == 0, run.stderr[-2000:]  # the control: a good link builds
