"""The controller's life in an operator's world: the state it is handed, preemption, the loop.

* :func:`check_state`: what the operator hands the controller (a state with a ``step``);
  the directory, its checks and its lock are
  :class:`~stabljax.control.checkpoint.fsutil.RunFiles`'s.
* :class:`PreemptionWatch`: SIGTERM (and SIGINT, if asked) asks to stop at the next step
  boundary; on several processes JAX's preemption sync point decides, by ``state.step``.
* :class:`RunResult` (how a run ended), :func:`drive` (the loop of
  :meth:`~stabljax.control.controller.RollbackController.run`) and the progress bar.
"""

from __future__ import annotations

import dataclasses
import signal
import sys
import threading
import weakref
from collections.abc import Iterable, Mapping
from typing import Any

import jax
import numpy as np
from jax.experimental import multihost_utils

from stabljax.control.errors import DataExhausted, Preempted, warn
from stabljax.control.events import Event, host_metrics

# ------------------------------------------------------------------------------- the state
# What the operator hands the controller: a train state.


def check_state(state: Any) -> None:
    """Raises ``TypeError`` unless ``state`` has the ``step`` field checkpoints count by."""
    if not hasattr(state, "step"):
        raise TypeError(
            f"state must have a 'step' field (int32 scalar), got {type(state).__name__}"
        )


@dataclasses.dataclass(frozen=True)
class RunResult:
    """How :meth:`RollbackController.run` ended (``ctl.last_run``).

    Attributes:
      step: ``state.step`` at the end.
      target: the ``num_steps`` asked for.
      reached: ``step == target``.
      preempted: a preemption signal stopped it (the state was saved). A signal that lands
        in the last step gives ``preempted`` and ``reached`` both: saved at the target.
      data_exhausted: the data ran out (``StopIteration``, or ``IndexError`` from a
        ``batch_fn``) before the target, possibly inside a rollback's skip.
    """

    step: int
    target: int
    reached: bool
    preempted: bool = False
    data_exhausted: bool = False


_OPEN: weakref.WeakSet = weakref.WeakSet()  # controllers to close at interpreter exit
_HOOKED = False


def close_at_exit(controller: Any) -> None:
    """Closes ``controller`` at interpreter exit if nothing else did.

    A hand-written loop that dies of an exception never calls ``close()``, and by the
    time ``atexit`` hooks run, ``concurrent.futures`` refuses new work, so Orbax abandons
    the async save in flight ("cannot schedule new futures after interpreter shutdown")
    and the restart resumes one ``save_every`` earlier. ``threading``'s exit hooks run
    before that (last registered first), so the save in flight is finished there. Only a
    weak reference is held.
    """
    global _HOOKED
    if not _HOOKED:
        try:
            threading._register_atexit(_close_open)  # what concurrent.futures itself uses
        except (AttributeError, RuntimeError):  # another Python, or already shutting down
            import atexit

            atexit.register(_close_open)
        _HOOKED = True
    _OPEN.add(controller)


def _close_open() -> None:
    for controller in list(_OPEN):
        try:
            controller.close(quiet=True)
        except BaseException:  # noqa: BLE001 - nothing may be raised at exit
            pass


class PreemptionWatch:
    """A stop request from a signal (one process) or JAX's preemption sync point."""

    def __init__(self, signals: Iterable[int]):
        self.signals = tuple(signal.Signals(s) for s in signals)
        for s in self.signals:
            if s in (signal.SIGKILL, signal.SIGSTOP):
                raise ValueError(f"preemption_signals: {s.name} cannot be caught")
        self.signum: int | None = None
        self._previous: dict[int, Any] = {}
        self._sync = False  # JAX's preemption service decides (several processes)
        self._probed = False

    def install(self, step: int) -> None:
        """Installs the handlers (main thread only); on several processes, asks JAX whether
        its preemption service runs, with ``step`` (the restored ``state.step``)."""
        self.signum = None
        if jax.process_count() > 1 and not self._probed:
            self._probed = True
            try:
                multihost_utils.reached_preemption_sync_point(int(step))
                self._sync = True
            except RuntimeError:
                self._sync = False
        if self._previous or threading.current_thread() is not threading.main_thread():
            return
        for s in self.signals:
            if self._sync and s == signal.SIGTERM:
                continue  # JAX's preemption notifier owns SIGTERM
            self._previous[s] = signal.signal(s, self._handler)

    def _handler(self, signum: int, frame: Any) -> None:
        if self.signum is not None and signum == signal.SIGINT:
            raise KeyboardInterrupt  # a second Ctrl-C: stop now
        self.signum = signum

    def restore(self) -> None:
        """Puts the previous handlers back."""
        previous, self._previous = self._previous, {}
        for s, handler in previous.items():
            try:
                signal.signal(s, handler)
            except (ValueError, TypeError):  # not the main thread / a C handler
                pass

    def should_stop(self, step: int, *, agree: bool) -> bool:
        """Whether to stop at step boundary ``step``; call once per step on every process.

        Args:
          step: ``state.step`` after this step (the step a save here would hold).
          agree: on several processes without the preemption service, combine the
            processes' flags now (a collective: the caller does it on save steps only).
        """
        if jax.process_count() == 1:
            return self.signum is not None
        if self._sync:
            # JAX stops at (the highest step id any process last gave) + 1, and only when
            # a process gives exactly that id, so the id must be the same on every process
            # and must not jump. state.step is both, across restarts too; after a rollback
            # it goes back, which only delays a notice that came before the rollback. The
            # store's Orbax manager never calls the sync point (StepManager), so no other
            # caller feeds it a different id.
            if multihost_utils.reached_preemption_sync_point(int(step)):
                self.signum = self.signum or signal.SIGTERM
                return True
        if not agree or not self._previous:
            return False  # no handler of ours: only the sync point can ask
        flags = multihost_utils.process_allgather(np.asarray(self.signum is not None, np.int32))
        return bool(flags.any())


def drive(
    ctl: Any,
    train_step: Any,
    state: Any,
    data: Any,
    target: int,
    bar: Progress,
    writer: Any = None,
    log_every: int = 1,
):
    """The loop of ``RollbackController.run``: ``(state, data, preempted, exhausted)``.

    Feeds ``next(data)`` to ``train_step`` and ``ctl.step`` until ``ctl.current_step``
    reaches ``target``, then ``ctl.finish`` (which may roll back, and the loop goes on).
    The data running out (``StopIteration``, or :class:`DataExhausted` from a rollback's
    skip) and :class:`Preempted` end it with the state as saved; anything else propagates.
    The data running out is a ``data_exhausted`` event in ``ctl.events``.
    ``writer(step, host_metrics)`` gets every ``log_every``-th step's metrics one step
    late (after the next step is dispatched), and the last one on the way out.
    """
    if isinstance(log_every, bool) or int(log_every) != log_every or log_every < 1:
        raise ValueError(f"log_every must be an int >= 1, got {log_every!r}")
    if writer is not None and not callable(writer):
        raise TypeError(f"metrics_writer must be a callable(step, metrics), got {writer!r}")
    preempted = exhausted = False
    pending: tuple[int, Any] | None = None

    def write_pending() -> None:
        nonlocal pending
        if pending is not None and writer is not None:
            writer(pending[0], host_metrics(pending[1]))
        pending = None

    try:
        while ctl.current_step < target and not exhausted:
            try:
                batch = next(data)
            except StopIteration:
                exhausted = True
                state, data = ctl.finish(state, data)
                continue
            step = ctl.current_step
            state, metrics = train_step(state, batch)
            write_pending()  # the previous step's: this one is already dispatched
            if writer is not None and step % log_every == 0:
                pending = (step, metrics)
            state, data = ctl.step(state, metrics, data)
            bar.show(ctl)
            if ctl.current_step >= target:
                state, data = ctl.finish(state, data)
    except Preempted as e:
        state, preempted = e.state, True
    except DataExhausted as e:
        state, exhausted = e.state, True
    finally:
        try:
            write_pending()
            if writer is not None and callable(getattr(writer, "flush", None)):
                writer.flush()
        finally:
            bar.show(ctl)
            bar.close()
    if exhausted:  # through the controller's public event log, as any loop may
        step, details = ctl.current_step, dict(data_index=data.index, target=target)
        ctl.events.append(Event("data_exhausted", step, details=details))
        # drive < ctl.run < the user
        warn(f"the data ran out at step {step} (index {data.index}) of {target}", stacklevel=3)
    return state, data, preempted, exhausted


class Progress:
    """tqdm when installed, else a line on stderr every 10%."""

    def __init__(self, total: int, initial: int, *, enabled: bool = True):
        self._enabled = enabled
        if not enabled:
            return
        try:
            from tqdm.auto import tqdm
        except ImportError:  # pragma: no cover - tqdm is an optional dependency
            tqdm = None
        self._bar = None
        if tqdm is not None:
            self._bar = tqdm(total=total, initial=initial, desc="train", dynamic_ncols=True)
        self._total, self._last = total, initial

    def show(self, ctl: Any) -> None:
        """Shows the controller's step, smoothed loss, spikes, rollbacks, skipped batches."""
        if not self._enabled:
            return
        loss = ctl.smoothed_loss
        postfix = {
            "loss": "-" if loss is None else f"{loss:.4g}",
            "spikes": ctl.events.count("spike"),
            "rollbacks": ctl.rollbacks,
            "skipped": sum(b - a for a, b in ctl.skipped_ranges),
        }
        self.update(ctl.current_step, postfix)

    def update(self, n: int, postfix: Mapping[str, Any]) -> None:
        if self._bar is not None:
            self._bar.update(n - self._bar.n)  # back after a rollback: a negative update
            self._bar.set_postfix(postfix, refresh=False)
        elif n >= self._last + max(self._total // 10, 1) or n < self._last:
            self._last = n
            items = ", ".join(f"{k}={v}" for k, v in postfix.items())
            print(f"train {n}/{self._total} {items}", file=sys.stderr, flush=True)

    def close(self) -> None:
        if self._enabled and self._bar is not None:
            self._bar.close()
