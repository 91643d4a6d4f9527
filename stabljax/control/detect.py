"""Host-side detectors of loss spikes, divergence and slow divergence.

Each detector sees one observation per training step, in order: the step and a dict
of host scalars (``loss``, and the train step's ``skipped`` / ``skip_streak`` /
``overflow`` / ``loss_scale`` when present). It keeps O(1) or O(window) state, returns a
:class:`Detection` or ``None``, and has JSON-able ``get_state`` / ``set_state`` so the
rollback controller checkpoints it with the model and restores it on a rollback.

Actions: ``"record"`` (an event only), ``"warn"`` (an event and a warning),
``"rollback"`` (go back to the newest checkpoint at least ``rollback_margin`` steps
before the onset), ``"rollback_best"`` (go back to the checkpoint with the lowest
smoothed loss), ``"raise"`` (the run cannot make progress and a rollback would not
help: the controller must log the event and raise
:class:`~stabljax.control.controller.TrainingDiverged`).

The rule for guarded steps: a spike or a NaN whose update a guard already skipped
in-graph (``skipped``) did no harm, so it is only recorded; it causes a rollback when
the loss stays anomalous for ``patience`` steps or the skip streak passes its limit. An
anomaly whose update was applied rolls back at once. A float16 overflow
(``overflow``: the loss scaler found non-finite gradients and did not call the
optimizer) did no harm either: every detector counts it exactly as a guard-skipped step.

The pieces, one detector family a module: :mod:`~stabljax.control.detection` (what they
share), :mod:`~stabljax.control.spike`, :mod:`~stabljax.control.divergence`,
:mod:`~stabljax.control.slow` and its statistics in :mod:`~stabljax.control.trend`. This
module gathers them under the names they always had.
"""

from __future__ import annotations

from stabljax.control.detection import Action as Action
from stabljax.control.detection import Detection as Detection
from stabljax.control.detection import Detector as Detector
from stabljax.control.divergence import DivergenceDetector as DivergenceDetector
from stabljax.control.slow import SlowDivergenceDetector as SlowDivergenceDetector
from stabljax.control.spike import SpikeDetector as SpikeDetector
from stabljax.control.trend import mann_kendall as mann_kendall
from stabljax.control.trend import mann_kendall_hamed_rao as mann_kendall_hamed_rao
from stabljax.control.trend import sen_slope as sen_slope

__all__ = (
    "Action",
    "Detection",
    "Detector",
    "DivergenceDetector",
    "SlowDivergenceDetector",
    "SpikeDetector",
    "default_detectors",
    "mann_kendall",
    "mann_kendall_hamed_rao",
    "sen_slope",
)


def default_detectors() -> list[Detector]:
    """The controller's default: spike, divergence and (warn-only) slow divergence."""
    return [SpikeDetector(), DivergenceDetector(), SlowDivergenceDetector()]
