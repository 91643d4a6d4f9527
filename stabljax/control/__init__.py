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
"""

from stabljax.control.checkpoints import CheckpointMismatch as CheckpointMismatch
from stabljax.control.checkpoints import CheckpointSaveError as CheckpointSaveError
from stabljax.control.controller import RollbackController as RollbackController
from stabljax.control.data import DataIterator as DataIterator
from stabljax.control.data import GrainDatasetIterator as GrainDatasetIterator
from stabljax.control.data import GrainLoaderIterator as GrainLoaderIterator
from stabljax.control.data import IndexedBatches as IndexedBatches
from stabljax.control.data import PlainIterator as PlainIterator
from stabljax.control.data import as_data_iterator as as_data_iterator
from stabljax.control.data import merge_ranges as merge_ranges
from stabljax.control.detect import Detection as Detection
from stabljax.control.detect import Detector as Detector
from stabljax.control.detect import DivergenceDetector as DivergenceDetector
from stabljax.control.detect import SlowDivergenceDetector as SlowDivergenceDetector
from stabljax.control.detect import SpikeDetector as SpikeDetector
from stabljax.control.detect import default_detectors as default_detectors
from stabljax.control.detect import mann_kendall as mann_kendall
from stabljax.control.detect import sen_slope as sen_slope
from stabljax.control.events import EVENT_KINDS as EVENT_KINDS
from stabljax.control.events import SCHEMA_VERSION as SCHEMA_VERSION
from stabljax.control.events import Event as Event
from stabljax.control.events import EventKind as EventKind
from stabljax.control.events import EventLog as EventLog
from stabljax.control.events import EventSchemaError as EventSchemaError
from stabljax.control.events import read_events as read_events
from stabljax.control.ledger import TrainingDiverged as TrainingDiverged
from stabljax.control.lifecycle import DataExhausted as DataExhausted
from stabljax.control.lifecycle import Preempted as Preempted
from stabljax.control.lifecycle import RunResult as RunResult
from stabljax.control.triage import TriageConfig as TriageConfig
from stabljax.control.writers import JsonlMetricsWriter as JsonlMetricsWriter
from stabljax.control.writers import TensorBoardMetricsWriter as TensorBoardMetricsWriter

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
    "RollbackController",
    "RunResult",
    "SlowDivergenceDetector",
    "SpikeDetector",
    "TensorBoardMetricsWriter",
    "TrainingDiverged",
    "TriageConfig",
    "as_data_iterator",
    "default_detectors",
    "mann_kendall",
    "merge_ranges",
    "read_events",
    "sen_slope",
)
