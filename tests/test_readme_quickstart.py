"""README's Quickstart runs as written and does what its text says: one NaN batch is skipped
on device, and the guarded Adam still solves the least-squares problem."""

from __future__ import annotations

import pathlib
import re

import numpy as np
import optax

README = pathlib.Path(__file__).resolve().parents[1] / "README.md"


def quickstart() -> str:
    m = re.search(r"<!-- quickstart -->\n```python\n(.*?)```", README.read_text(), re.S)
    assert m, "README.md has no <!-- quickstart --> python block"
    return m.group(1)


def test_quickstart_runs_verbatim_and_skips_the_nan_batch(capsys):
    scope = {"__name__": "readme_quickstart"}
    exec(compile(quickstart(), "README.md[quickstart]", "exec"), scope)  # noqa: S102
    out = capsys.readouterr().out.strip()
    assert out.startswith("loss ") and out.endswith("NaN steps skipped 1"), out
    # The independent reference: the exact least-squares solution is the generating w.
    np.testing.assert_allclose(np.asarray(scope["params"]["w"]), [1.0, -2.0, 0.5, 3.0], atol=1e-3)
    assert float(scope["loss"]) < 1e-6
    assert int(optax.tree.get(scope["opt_state"], "nonfinite_skips")) == 1
    # 300 steps reached Adam but one: the skipped step left its count alone.
    assert int(optax.tree.get(scope["opt_state"], "count")) == 299


def test_quickstart_is_self_contained_and_short():
    code = quickstart()
    assert "import stabljax" in code and "import optax" in code
    assert len(code.splitlines()) <= 35
