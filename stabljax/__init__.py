"""stabljax: training-stability components for JAX (Optax, Flax NNX, Orbax, Grain).

The public API is flat (``stabljax.safe_adamw``, ``stabljax.RollbackController``); the
modules are layered (``stabljax.optim`` -> step modules -> ``stabljax.control``), beside
``stabljax.init`` (init plans and checks) and ``stabljax.reference`` (the reference
Transformer and corpus), see BUILD.md.
"""

from stabljax.control import CheckpointMismatch as CheckpointMismatch
from stabljax.control import CheckpointSaveError as CheckpointSaveError
from stabljax.control import DataExhausted as DataExhausted
from stabljax.control import DataIterator as DataIterator
from stabljax.control import Detection as Detection
from stabljax.control import DivergenceDetector as DivergenceDetector
from stabljax.control import Event as Event
from stabljax.control import EventLog as EventLog
from stabljax.control import EventSchemaError as EventSchemaError
from stabljax.control import GrainDatasetIterator as GrainDatasetIterator
from stabljax.control import GrainLoaderIterator as GrainLoaderIterator
from stabljax.control import IndexedBatches as IndexedBatches
from stabljax.control import JsonlMetricsWriter as JsonlMetricsWriter
from stabljax.control import Preempted as Preempted
from stabljax.control import RollbackController as RollbackController
from stabljax.control import RunResult as RunResult
from stabljax.control import SlowDivergenceDetector as SlowDivergenceDetector
from stabljax.control import SpikeDetector as SpikeDetector
from stabljax.control import TensorBoardMetricsWriter as TensorBoardMetricsWriter
from stabljax.control import TrainingDiverged as TrainingDiverged
from stabljax.control import TriageConfig as TriageConfig
from stabljax.control import read_events as read_events
from stabljax.init import ArchSpec as ArchSpec
from stabljax.init import InitPlan as InitPlan
from stabljax.init import InitReport as InitReport
from stabljax.init import check_init as check_init
from stabljax.init import init_plan as init_plan
from stabljax.losses import cross_entropy_with_z_loss as cross_entropy_with_z_loss
from stabljax.losses import z_loss as z_loss
from stabljax.optim.adam import ScaleByAdamAtan2State as ScaleByAdamAtan2State
from stabljax.optim.adam import ScaleBySafeAdamState as ScaleBySafeAdamState
from stabljax.optim.adam import adamw_atan2 as adamw_atan2
from stabljax.optim.adam import safe_adam as safe_adam
from stabljax.optim.adam import safe_adamw as safe_adamw
from stabljax.optim.adam import scale_by_adam_atan2 as scale_by_adam_atan2
from stabljax.optim.adam import scale_by_safe_adam as scale_by_safe_adam
from stabljax.optim.clipping import ClipByAdagcState as ClipByAdagcState
from stabljax.optim.clipping import ClipByPercentileState as ClipByPercentileState
from stabljax.optim.clipping import ClipByZScoreState as ClipByZScoreState
from stabljax.optim.clipping import ClipSpikesPerCoordinateState as ClipSpikesPerCoordinateState
from stabljax.optim.clipping import clip_by_adagc as clip_by_adagc
from stabljax.optim.clipping import clip_by_percentile as clip_by_percentile
from stabljax.optim.clipping import clip_by_zscore as clip_by_zscore
from stabljax.optim.clipping import clip_spikes_per_coordinate as clip_spikes_per_coordinate
from stabljax.optim.guards import SkipNonfiniteState as SkipNonfiniteState
from stabljax.optim.guards import SkipSpikesState as SkipSpikesState
from stabljax.optim.guards import SpikeRule as SpikeRule
from stabljax.optim.guards import any_skipped as any_skipped
from stabljax.optim.guards import skip_nonfinite as skip_nonfinite
from stabljax.optim.guards import skip_spikes as skip_spikes
from stabljax.optim.guards import skip_step as skip_step
from stabljax.optim.guards import skip_streak as skip_streak
from stabljax.optim.qk_clip import QKClipState as QKClipState
from stabljax.optim.qk_clip import QKHeads as QKHeads
from stabljax.optim.qk_clip import QKLayer as QKLayer
from stabljax.optim.qk_clip import qk_clip as qk_clip
from stabljax.precision import DynamicLossScale as DynamicLossScale
from stabljax.precision import LossScaleState as LossScaleState
from stabljax.precision import Precision as Precision
from stabljax.reference.corpus import default_corpus as default_corpus
from stabljax.reference.corpus import lm_batch_fn as lm_batch_fn
from stabljax.reference.nn import TransformerConfig as TransformerConfig
from stabljax.reference.nn import TransformerLM as TransformerLM
from stabljax.step import TrainState as TrainState
from stabljax.step import lm_loss as lm_loss
from stabljax.step import make_train_step as make_train_step
from stabljax.step import nnx_apply as nnx_apply
from stabljax.step import nnx_merge as nnx_merge
from stabljax.step import recommended_compiler_options as recommended_compiler_options
from stabljax.telemetry import adam_eps_report as adam_eps_report
from stabljax.telemetry import layer_metrics_to_host as layer_metrics_to_host

__version__ = "0.2.0"


__all__ = (
    "ArchSpec",
    "CheckpointMismatch",
    "CheckpointSaveError",
    "ClipByAdagcState",
    "ClipByPercentileState",
    "ClipByZScoreState",
    "ClipSpikesPerCoordinateState",
    "DataExhausted",
    "DataIterator",
    "Detection",
    "DivergenceDetector",
    "DynamicLossScale",
    "Event",
    "EventLog",
    "EventSchemaError",
    "GrainDatasetIterator",
    "GrainLoaderIterator",
    "IndexedBatches",
    "InitPlan",
    "InitReport",
    "JsonlMetricsWriter",
    "LossScaleState",
    "Precision",
    "Preempted",
    "QKClipState",
    "QKHeads",
    "QKLayer",
    "RollbackController",
    "RunResult",
    "ScaleByAdamAtan2State",
    "ScaleBySafeAdamState",
    "SkipNonfiniteState",
    "SkipSpikesState",
    "SlowDivergenceDetector",
    "SpikeDetector",
    "SpikeRule",
    "TensorBoardMetricsWriter",
    "TrainState",
    "TrainingDiverged",
    "TransformerConfig",
    "TransformerLM",
    "TriageConfig",
    "adam_eps_report",
    "adamw_atan2",
    "any_skipped",
    "check_init",
    "clip_by_adagc",
    "clip_by_percentile",
    "clip_by_zscore",
    "clip_spikes_per_coordinate",
    "cross_entropy_with_z_loss",
    "default_corpus",
    "init_plan",
    "layer_metrics_to_host",
    "lm_batch_fn",
    "lm_loss",
    "make_train_step",
    "nnx_apply",
    "nnx_merge",
    "qk_clip",
    "read_events",
    "recommended_compiler_options",
    "safe_adam",
    "safe_adamw",
    "scale_by_adam_atan2",
    "scale_by_safe_adam",
    "skip_nonfinite",
    "skip_spikes",
    "skip_step",
    "skip_streak",
    "z_loss",
)
