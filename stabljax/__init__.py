"""stabljax: training-stability components for JAX (Optax, Flax NNX, Orbax, Grain).

The top level is flat, as optax's is: the transforms (``stabljax.safe_adamw``,
``stabljax.skip_spikes``), the jitted train step (``stabljax.make_train_step``) and the
rollback controller with what drives it (``stabljax.RollbackController``, its detectors,
data iterators and ``TriageConfig``). Everything else lives in its subpackage:

- :mod:`stabljax.reference`: the reference Transformer and corpus (``TransformerLM``,
  ``TransformerConfig``, ``default_corpus``, ``lm_batch_fn``).
- :mod:`stabljax.init`: init plans and the check at init (``ArchSpec``, ``InitPlan``,
  ``InitReport``, ``init_plan``, ``check_init``).
- :mod:`stabljax.control`: the events and metrics writers (``Event``, ``EventLog``,
  ``EventSchemaError``, ``read_events``, ``JsonlMetricsWriter``,
  ``TensorBoardMetricsWriter``) and the controller's less common types (``Detection``,
  ``RunResult``, ``Preempted``, ``DataExhausted``, ``CheckpointMismatch``,
  ``CheckpointSaveError``).
- :mod:`stabljax.telemetry`: host-side telemetry helpers (``adam_eps_report``,
  ``layer_metrics_to_host``).

The modules are layered (``stabljax.optim`` -> step modules -> ``stabljax.control``), see
BUILD.md.
"""

from stabljax import control as control
from stabljax import init as init
from stabljax import reference as reference
from stabljax import telemetry as telemetry
from stabljax.control.controller import RollbackController as RollbackController
from stabljax.control.data.grain_iterators import GrainDatasetIterator as GrainDatasetIterator
from stabljax.control.data.grain_iterators import GrainLoaderIterator as GrainLoaderIterator
from stabljax.control.data.iterators import DataIterator as DataIterator
from stabljax.control.data.iterators import IndexedBatches as IndexedBatches
from stabljax.control.detect.detectors import SpikeDetector as SpikeDetector
from stabljax.control.detect.drift import DivergenceDetector as DivergenceDetector
from stabljax.control.detect.drift import SlowDivergenceDetector as SlowDivergenceDetector
from stabljax.control.diagnose.triage import TriageConfig as TriageConfig
from stabljax.control.errors import TrainingDiverged as TrainingDiverged
from stabljax.losses import cross_entropy_with_z_loss as cross_entropy_with_z_loss
from stabljax.losses import lm_loss as lm_loss
from stabljax.losses import z_loss as z_loss
from stabljax.nnx_bridge import nnx_apply as nnx_apply
from stabljax.nnx_bridge import nnx_merge as nnx_merge
from stabljax.optim.adam import ScaleBySafeAdamState as ScaleBySafeAdamState
from stabljax.optim.adam import safe_adam as safe_adam
from stabljax.optim.adam import safe_adamw as safe_adamw
from stabljax.optim.adam import scale_by_safe_adam as scale_by_safe_adam
from stabljax.optim.atan2 import ScaleByAdamAtan2State as ScaleByAdamAtan2State
from stabljax.optim.atan2 import adamw_atan2 as adamw_atan2
from stabljax.optim.atan2 import scale_by_adam_atan2 as scale_by_adam_atan2
from stabljax.optim.clipping import ClipByAdagcState as ClipByAdagcState
from stabljax.optim.clipping import ClipByPercentileState as ClipByPercentileState
from stabljax.optim.clipping import ClipByZScoreState as ClipByZScoreState
from stabljax.optim.clipping import ClipSpikesPerCoordinateState as ClipSpikesPerCoordinateState
from stabljax.optim.clipping import clip_by_adagc as clip_by_adagc
from stabljax.optim.clipping import clip_by_percentile as clip_by_percentile
from stabljax.optim.clipping import clip_by_zscore as clip_by_zscore
from stabljax.optim.clipping import clip_spikes_per_coordinate as clip_spikes_per_coordinate
from stabljax.optim.guards.core import SkipNonfiniteState as SkipNonfiniteState
from stabljax.optim.guards.core import SkipSpikesState as SkipSpikesState
from stabljax.optim.guards.core import SpikeRule as SpikeRule
from stabljax.optim.guards.core import skip_step as skip_step
from stabljax.optim.guards.multisteps import (
    skip_nonfinite_micro_batch as skip_nonfinite_micro_batch,
)
from stabljax.optim.guards.skips import any_skipped as any_skipped
from stabljax.optim.guards.skips import skip_nonfinite as skip_nonfinite
from stabljax.optim.guards.skips import skip_spikes as skip_spikes
from stabljax.optim.guards.skips import skip_streak as skip_streak
from stabljax.optim.guards.skips import spike_rebaselines as spike_rebaselines
from stabljax.optim.qk_clip import QKClipState as QKClipState
from stabljax.optim.qk_clip import QKHeads as QKHeads
from stabljax.optim.qk_clip import QKLayer as QKLayer
from stabljax.optim.qk_clip import qk_clip as qk_clip
from stabljax.precision import DynamicLossScale as DynamicLossScale
from stabljax.precision import LossScaleState as LossScaleState
from stabljax.precision import Precision as Precision
from stabljax.step import TrainState as TrainState
from stabljax.step import make_train_step as make_train_step
from stabljax.step import recommended_compiler_options as recommended_compiler_options

__version__ = "0.2.0"

__all__ = (
    "ClipByAdagcState",
    "ClipByPercentileState",
    "ClipByZScoreState",
    "ClipSpikesPerCoordinateState",
    "DataIterator",
    "DivergenceDetector",
    "DynamicLossScale",
    "GrainDatasetIterator",
    "GrainLoaderIterator",
    "IndexedBatches",
    "LossScaleState",
    "Precision",
    "QKClipState",
    "QKHeads",
    "QKLayer",
    "RollbackController",
    "ScaleByAdamAtan2State",
    "ScaleBySafeAdamState",
    "SkipNonfiniteState",
    "SkipSpikesState",
    "SlowDivergenceDetector",
    "SpikeDetector",
    "SpikeRule",
    "TrainState",
    "TrainingDiverged",
    "TriageConfig",
    "adamw_atan2",
    "any_skipped",
    "clip_by_adagc",
    "clip_by_percentile",
    "clip_by_zscore",
    "clip_spikes_per_coordinate",
    "cross_entropy_with_z_loss",
    "lm_loss",
    "make_train_step",
    "nnx_apply",
    "nnx_merge",
    "qk_clip",
    "recommended_compiler_options",
    "safe_adam",
    "safe_adamw",
    "scale_by_adam_atan2",
    "scale_by_safe_adam",
    "skip_nonfinite",
    "skip_nonfinite_micro_batch",
    "skip_spikes",
    "skip_step",
    "skip_streak",
    "spike_rebaselines",
    "z_loss",
)
