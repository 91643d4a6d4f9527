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
* :class:`WarningDetector`, :class:`WarningResponse` — a warning from leading indicators
  and the reversible LR cut it can drive (``RollbackController(warning_response=...)``).

The sub-packages, by concept (BUILD.md's Layout says what each module owns):
:mod:`~stabljax.control.detect` (the detectors and the monitor running them),
:mod:`~stabljax.control.checkpoint` (the Orbax store and the run directory's files),
:mod:`~stabljax.control.data` (iterators and Grain's state), :mod:`~stabljax.control.decide`
(the pure policy and the remedies), :mod:`~stabljax.control.diagnose` (triage, screening);
beside them the controller, the session and loop contract, resume, hosts, events and errors.
No import circle (``tests/test_architecture.py``).
"""

from stabljax.control.checkpoint.fsutil import UnsafePathError as UnsafePathError
from stabljax.control.checkpoint.integrity import CheckpointKeyError as CheckpointKeyError
from stabljax.control.checkpoint.jsonio import MalformedJSONError as MalformedJSONError
from stabljax.control.controller import RollbackController as RollbackController
from stabljax.control.data.grain_iterators import GrainDatasetIterator as GrainDatasetIterator
from stabljax.control.data.grain_iterators import GrainLoaderIterator as GrainLoaderIterator
from stabljax.control.data.grain_iterators import as_data_iterator as as_data_iterator
from stabljax.control.data.iterators import DataIterator as DataIterator
from stabljax.control.data.iterators import IndexedBatches as IndexedBatches
from stabljax.control.data.iterators import PlainIterator as PlainIterator
from stabljax.control.decide.policy import merge_ranges as merge_ranges
from stabljax.control.decide.remedies import Remedy as Remedy
from stabljax.control.decide.remedies import RollbackInfo as RollbackInfo
from stabljax.control.decide.remedies import WarningResponse as WarningResponse
from stabljax.control.decide.remedies import by_verdict as by_verdict
from stabljax.control.decide.remedies import chain_remedies as chain_remedies
from stabljax.control.decide.remedies import lower_lr as lower_lr
from stabljax.control.decide.remedies import reset_second_moment as reset_second_moment
from stabljax.control.decide.remedies import scale_hyperparam as scale_hyperparam
from stabljax.control.detect.detectors import Detection as Detection
from stabljax.control.detect.detectors import Detector as Detector
from stabljax.control.detect.detectors import SpikeDetector as SpikeDetector
from stabljax.control.detect.drift import DivergenceDetector as DivergenceDetector
from stabljax.control.detect.drift import SlowDivergenceDetector as SlowDivergenceDetector
from stabljax.control.detect.drift import default_detectors as default_detectors
from stabljax.control.detect.trends import mann_kendall as mann_kendall
from stabljax.control.detect.trends import sen_slope as sen_slope
from stabljax.control.detect.warning import WarningDetector as WarningDetector
from stabljax.control.diagnose.triage import TriageConfig as TriageConfig
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
from stabljax.control.session import RunResult as RunResult

__all__ = (
    "EVENT_KINDS",
    "SCHEMA_VERSION",
    "CheckpointKeyError",
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
    "MalformedJSONError",
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
    "UnsafePathError",
    "WarningDetector",
    "WarningResponse",
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
