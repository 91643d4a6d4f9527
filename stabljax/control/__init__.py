"""Host control: data position, detectors, events and the Orbax rollback controller.

Layer 3 of stabljax. Nothing here traces: it reads the train step's device metrics one
step late, decides on the host, and owns checkpoints (Orbax), the data position (Grain or
an index) and the event log.

* :class:`RollbackController` — checkpoints, detects, rolls back past bad data.
* :class:`IndexedBatches`, :class:`GrainDatasetIterator`, :class:`GrainLoaderIterator`,
  :class:`PlainIterator` — data iterators with a position and forward skipping.
* :class:`SpikeDetector`, :class:`DivergenceDetector`, :class:`SlowDivergenceDetector` —
  host-side detectors with checkpointable state.
* :class:`Event`, :class:`EventLog`, :func:`read_events` — the event records and
  ``events.jsonl`` (versioned: :data:`SCHEMA_VERSION`, docs/events.md).
* :class:`TriageConfig` — after a rollback, replay the window to classify the spike.
* :class:`RollbackInfo`, :func:`lower_lr`, :func:`scale_hyperparam`,
  :func:`reset_second_moment`, :func:`by_verdict`, :func:`chain_remedies` — remedies: what a
  rollback changes in the restored state (``RollbackController(remedy=...)``).

The modules, each importing only those below it (no circle, ``tests/test_architecture.py``):
:mod:`~stabljax.control.errors`; :mod:`~stabljax.control.policy` (the pure decisions: the
ledger, whether and how to roll back); :mod:`~stabljax.control.data`
(iterators; ``DataIterator.restore`` sets the position); :mod:`~stabljax.control.trends`,
:mod:`~stabljax.control.detectors` and :mod:`~stabljax.control.drift`;
:mod:`~stabljax.control.events`; :mod:`~stabljax.control.integrity` (the meta item's
checks); :mod:`~stabljax.control.items` (device copies, the data item);
:mod:`~stabljax.control.retention` (which checkpoints Orbax keeps);
:mod:`~stabljax.control.store` (Orbax: the one place checkpoints are written);
:mod:`~stabljax.control.saver`; :mod:`~stabljax.control.monitor`;
:mod:`~stabljax.control.remedies`; :mod:`~stabljax.control.attribution` and
:mod:`~stabljax.control.triage`; :mod:`~stabljax.control.rollback` (resume);
:mod:`~stabljax.control.session` (lock, preemption, the run loop); and
:mod:`~stabljax.control.controller`, which carries a rollback out.
"""

from stabljax.control.controller import RollbackController as RollbackController
from stabljax.control.data import DataIterator as DataIterator
from stabljax.control.data import GrainDatasetIterator as GrainDatasetIterator
from stabljax.control.data import GrainLoaderIterator as GrainLoaderIterator
from stabljax.control.data import IndexedBatches as IndexedBatches
from stabljax.control.data import PlainIterator as PlainIterator
from stabljax.control.data import as_data_iterator as as_data_iterator
from stabljax.control.detectors import Detection as Detection
from stabljax.control.detectors import Detector as Detector
from stabljax.control.detectors import SpikeDetector as SpikeDetector
from stabljax.control.drift import DivergenceDetector as DivergenceDetector
from stabljax.control.drift import SlowDivergenceDetector as SlowDivergenceDetector
from stabljax.control.drift import default_detectors as default_detectors
from stabljax.control.errors import CheckpointMismatch as CheckpointMismatch
from stabljax.control.errors import CheckpointSaveError as CheckpointSaveError
from stabljax.control.errors import DataExhausted as DataExhausted
from stabljax.control.errors import Preempted as Preempted
from stabljax.control.errors import TrainingDiverged as TrainingDiverged
from stabljax.control.events import EVENT_KINDS as EVENT_KINDS
from stabljax.control.events import SCHEMA_VERSION as SCHEMA_VERSION
from stabljax.control.events import Event as Event
from stabljax.control.events import EventKind as EventKind
from stabljax.control.events import EventLog as EventLog
from stabljax.control.events import EventSchemaError as EventSchemaError
from stabljax.control.events import JsonlMetricsWriter as JsonlMetricsWriter
from stabljax.control.events import TensorBoardMetricsWriter as TensorBoardMetricsWriter
from stabljax.control.events import read_events as read_events
from stabljax.control.policy import merge_ranges as merge_ranges
from stabljax.control.remedies import Remedy as Remedy
from stabljax.control.remedies import RollbackInfo as RollbackInfo
from stabljax.control.remedies import by_verdict as by_verdict
from stabljax.control.remedies import chain_remedies as chain_remedies
from stabljax.control.remedies import lower_lr as lower_lr
from stabljax.control.remedies import reset_second_moment as reset_second_moment
from stabljax.control.remedies import scale_hyperparam as scale_hyperparam
from stabljax.control.session import RunResult as RunResult
from stabljax.control.trends import mann_kendall as mann_kendall
from stabljax.control.trends import sen_slope as sen_slope
from stabljax.control.triage import TriageConfig as TriageConfig

__all__ = (
    "EVENT_KINDS",
    "SCHEMA_VERSION",
    "CheckpointMismatch",
    "CheckpointSaveError",
    "DataExhausted",
    "DataIterator",
    "Detection",
    "Detector",
    "DivergenceDetector",
    "Event",
    "EventKind",
    "EventLog",
    "EventSchemaError",
    "GrainDatasetIterator",
    "GrainLoaderIterator",
    "IndexedBatches",
    "JsonlMetricsWriter",
    "PlainIterator",
    "Preempted",
    "Remedy",
    "RollbackController",
    "RollbackInfo",
    "RunResult",
    "SlowDivergenceDetector",
    "SpikeDetector",
    "TensorBoardMetricsWriter",
    "TrainingDiverged",
    "TriageConfig",
    "as_data_iterator",
    "by_verdict",
    "chain_remedies",
    "default_detectors",
    "lower_lr",
    "mann_kendall",
    "merge_ranges",
    "read_events",
    "reset_second_moment",
    "scale_hyperparam",
    "sen_slope",
)
