"""The rollback's path, traced: every stabljax module a real rollback enters, at any depth.

``sys.setprofile`` sees every Python call on the training thread from the moment the
controller starts executing a rollback (``RollbackController._rollback``, right after a
detector's finding was turned into a plan) until ``ctl.step`` returns control to the loop,
where the next training step runs. Nothing is left out: the events log, the run
directory's files, Orbax's callbacks into our retention policy and the detectors whose
state comes back with the checkpoint all count. BUILD.md's Layout states the figure.
"""

from __future__ import annotations

import functools
import sys

import pytest
from toy import BAD, batch_fn_factory, toy_controller, toy_problem

from stabljax.control import IndexedBatches, RollbackController

# The modules one rollback enters, and why each is on the path. Keep BUILD.md in step.
PATH = {
    "stabljax.control.controller": "executes the plan",
    "stabljax.control.decide.policy": "plans it: onset, restore target, skip range, ledger",
    "stabljax.control.checkpoint.store": "restores the target, deletes the newer checkpoints",
    "stabljax.control.checkpoint.integrity": "checks the restored meta's digest and state",
    "stabljax.control.checkpoint.jsonio": "reads the meta item strictly",
    "stabljax.control.checkpoint.retention": "Orbax asks it which checkpoints to keep",
    "stabljax.control.checkpoint.fsutil": "writes the crash-safe rollback record atomically",
    "stabljax.control.data.iterators": "moves the data past the skipped range",
    "stabljax.control.detect.monitor": "brings the detectors' state back",
    "stabljax.control.detect.detectors": "SpikeDetector.set_state",
    "stabljax.control.detect.drift": "the divergence detectors' set_state",
    "stabljax.control.events": "logs the rollback and skip events",
    "stabljax.control.hosts": "host reads and agreement (one decision on every process)",
    "stabljax.control.loop": "the loop contract: a run with no target is warned",
}
TRIAGE = "stabljax.control.diagnose.triage"  # with triage=: the replay hook


def _is_stabljax_callable(value) -> bool:
    """A function or method of stabljax's (or a partial of one): a callback, where it is
    handed from one module to another. The user's train step is not one."""
    while isinstance(value, functools.partial):
        value = value.func
    value = getattr(value, "__func__", value)
    module = getattr(value, "__module__", None) or ""
    return callable(value) and not isinstance(value, type) and module.startswith("stabljax.")


def _trace(directory, steps: int = 60, **kw):
    """A hand-written loop over the toy with its poisoned batches; per rollback, the
    modules entered (any depth) and the stabljax callables handed between modules."""
    state, train_step = toy_problem()
    rollback = RollbackController._rollback.__code__
    traces: list[tuple[set[str], list[str]]] = []
    active = [False]

    def profile(frame, event, arg):
        if event != "call":
            return
        if frame.f_code is rollback:
            active[0] = True
            traces.append((set(), []))
        if not active[0]:
            return
        name = frame.f_globals.get("__name__", "")
        if not name.startswith("stabljax."):
            return
        modules, callbacks = traces[-1]
        modules.add(name)
        caller = frame.f_back.f_globals.get("__name__", "") if frame.f_back else ""
        if caller.startswith("stabljax.") and caller != name:
            code = frame.f_code
            params = code.co_varnames[: code.co_argcount + code.co_kwonlyargcount]
            callbacks += [
                f"{name}.{code.co_name}({p}=...)"
                for p in params
                if p != "self" and _is_stabljax_callable(frame.f_locals.get(p))
            ]

    with toy_controller(directory, **kw) as ctl:
        state, data = ctl.restore_or_init(state, IndexedBatches(batch_fn_factory(BAD)))
        for _ in ctl.steps(steps):
            state, metrics = train_step(state, next(data))
            sys.setprofile(profile)
            try:
                state, data = ctl.step(state, metrics, data)
            finally:
                sys.setprofile(None)
                active[0] = False
        ctl.finish(state, data)
    return ctl, traces


@pytest.mark.parametrize("triage", [False, True])
def test_a_rollback_enters_the_modules_it_names_and_passes_no_callback(tmp_path, triage):
    ctl, traces = _trace(tmp_path, triage=triage)
    assert len(traces) == ctl.rollbacks >= 1
    expected = set(PATH) | ({TRIAGE} if triage else set())
    for modules, callbacks in traces:
        assert modules == expected, sorted(modules ^ expected)
        assert callbacks == []
    assert len(PATH) == 14  # the figure BUILD.md states


def test_the_trace_sees_a_module_that_joins_the_path(tmp_path, monkeypatch):
    """The tracer is not blind: a call into a module off the path (the trend tests),
    patched into the data's skip, shows up in the trace."""
    from stabljax.control.detect import trends

    original = IndexedBatches.skip

    def skip(self, *args, **kwargs):
        trends.sen_slope([1.0, 2.0, 3.0])
        return original(self, *args, **kwargs)

    monkeypatch.setattr(IndexedBatches, "skip", skip)
    _, traces = _trace(tmp_path)
    assert traces and all(trends.__name__ in modules for modules, _ in traces)
