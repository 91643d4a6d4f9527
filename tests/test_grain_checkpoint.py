"""Grain pipelines under the controller: a trainer's own Orbax checkpoint of the wrapper,
the drain warning, and which pipelines resume exactly after a kill.

The train step here folds every batch it is fed into an order-sensitive float64-exact
fingerprint, so two runs are equal iff they were fed the same batches in the same order.
"""

from __future__ import annotations

import warnings

import flax.struct
import grain
import grain.python as grain_legacy
import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
import pytest

from stabljax.control import (
    GrainDatasetIterator,
    GrainLoaderIterator,
    IndexedBatches,
    RollbackController,
    SpikeDetector,
    as_data_iterator,
)

N = 4000  # records


@flax.struct.dataclass
class State:
    step: jax.Array
    seen: jax.Array  # an order-sensitive fingerprint of every record fed


@jax.jit
def feed(state, batch):
    x = jnp.asarray(batch, jnp.float32).reshape(-1)[:4]
    seen = state.seen * 1.0001 + jnp.sum(x * jnp.arange(1, 5))
    return State(state.step + 1, seen), {"loss": jnp.float32(1.0)}


def state0():
    return State(jnp.int32(0), jnp.float32(0.0))


class Square(grain.transforms.Map):
    def map(self, x):
        return np.asarray([x, x * x % 97], np.int64)


class Keep(grain.transforms.Filter):
    def filter(self, x):
        return x % 5 != 0


def _records():
    return list(range(N))


PIPELINES = {
    # name: (make a fresh iterable, exact after a kill)
    "MapDataset.map.batch": (
        lambda: grain.MapDataset.source(_records()).map(Square()).batch(4),
        True,
    ),
    "IterDataset.batch": (
        lambda: grain.MapDataset.source(_records()).to_iter_dataset().map(Square()).batch(4),
        True,
    ),
    "IterDataset.filter.batch": (
        lambda: grain.MapDataset.source(_records()).to_iter_dataset().filter(Keep()).batch(4),
        True,
    ),
    "IterDataset.pack": (
        lambda: (
            grain.experimental.FirstFitPackIterDataset(
                grain.MapDataset.source(_records())
                .map(lambda x: {"tokens": np.arange(x % 7 + 1, dtype=np.int32) + x})
                .to_iter_dataset(),
                length_struct={"tokens": 16},
                num_packing_bins=2,
            )
            .map(lambda packed: packed["tokens"])
            .batch(2)
        ),
        True,
    ),
    "DataLoader(Map, Batch)": (
        lambda: grain.DataLoader(
            data_source=_records(),
            sampler=grain.samplers.IndexSampler(N, shuffle=True, seed=3, num_epochs=1),
            operations=[Square(), grain.transforms.Batch(4)],
            worker_count=0,
        ),
        True,
    ),
    "DataLoader(MapOperation, BatchOperation)": (
        lambda: grain.DataLoader(
            data_source=_records(),
            sampler=grain.samplers.IndexSampler(N, shuffle=False, num_epochs=1),
            operations=[
                grain_legacy.MapOperation(lambda x: np.asarray([x, 1], np.int64)),
                grain_legacy.BatchOperation(4),
            ],
            worker_count=0,
        ),
        True,
    ),
    # Grain's deprecated PackAndBatchOperation keeps a partly filled batch outside the
    # loader's state (only the records seen are saved): a resume loses that batch's records.
    "DataLoader(PackAndBatchOperation)": (
        lambda: grain.DataLoader(
            data_source=_records(),
            sampler=grain.samplers.IndexSampler(N, shuffle=False, num_epochs=1),
            operations=[
                grain_legacy.MapOperation(
                    lambda x: {"tokens": np.arange(x % 7 + 1, dtype=np.int32) + x}
                ),
                grain.experimental.PackAndBatchOperation({"tokens": 16}, batch_size=2),
                grain_legacy.MapOperation(lambda packed: packed[0]["tokens"]),
            ],
            worker_count=0,
        ),
        False,
    ),
    "DataLoader(Filter, Batch)": (
        lambda: grain.DataLoader(
            data_source=_records(),
            sampler=grain.samplers.IndexSampler(N, shuffle=False, num_epochs=1),
            operations=[Keep(), grain.transforms.Batch(4)],
            worker_count=0,
        ),
        True,
    ),
}


def _controller(directory):
    return RollbackController(
        directory,
        save_every=10,
        keep=2,
        rollback_margin=5,
        async_save=False,
        detectors=[SpikeDetector()],
        preemption_signals=(),
    )


def _run_to(directory, make, steps, *, kill_at=None):
    """Trains to ``steps``; with ``kill_at``, stops dead there (no finish, no close, the
    lock dropped as a killed process's is) and returns None."""
    ctl = _controller(directory)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # "skipping will drain it"
        state, data = ctl.restore_or_init(state0(), make())
    while ctl.current_step < steps:
        state, metrics = feed(state, next(data))
        state, data = ctl.step(state, metrics, data)
        if kill_at is not None and ctl.current_step == kill_at:
            ctl._lock.release()  # what the kernel does for a killed process
            return None
    state, data = ctl.finish(state, data)
    ctl.close()
    return float(state.seen), data.index


@pytest.mark.parametrize("name", list(PIPELINES))
def test_which_pipelines_resume_exactly_after_a_kill(tmp_path, name):
    make, exact = PIPELINES[name]
    reference = _run_to(tmp_path / "ref", make, 40)
    _run_to(tmp_path / "run", make, 40, kill_at=27)  # the last checkpoint is step 20
    resumed = _run_to(tmp_path / "run", make, 40)
    assert (resumed == reference) == exact, (name, resumed, reference)


def _loader(ops, *, shuffle=False):
    return grain.DataLoader(
        data_source=_records(),
        sampler=grain.samplers.IndexSampler(N, shuffle=shuffle, seed=1, num_epochs=1),
        operations=ops,
        worker_count=0,
    )


def test_the_drain_warning_names_only_operations_that_change_the_record_count():
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # 1:1 legacy and current maps and one batch: cheap
        it = GrainLoaderIterator(iter(_loader([Square(), grain.transforms.Batch(4)])))
        legacy = [grain_legacy.MapOperation(lambda x: x), grain_legacy.BatchOperation(4)]
        assert GrainLoaderIterator(iter(_loader(legacy))).skip_is_cheap
    assert it.skip_is_cheap
    with pytest.warns(RuntimeWarning, match=r"operations Keep change the number of records"):
        GrainLoaderIterator(iter(_loader([Keep(), grain.transforms.Batch(4)])))
    two = [grain.transforms.Batch(2), grain.transforms.Batch(2)]
    with pytest.warns(RuntimeWarning, match="a second Batch"):
        GrainLoaderIterator(iter(_loader(two)))


@pytest.mark.parametrize("shuffle", [False, True])
def test_a_loader_wrapped_after_it_was_read_knows_its_position(shuffle):
    """A trainer restores its own checkpoint into the raw iterator, then wraps it."""
    raw = iter(_loader([Square(), grain.transforms.Batch(4)], shuffle=shuffle))
    for _ in range(7):
        next(raw)
    it = GrainLoaderIterator(raw)
    assert it.index == 7
    ref = iter(_loader([Square(), grain.transforms.Batch(4)], shuffle=shuffle))
    for _ in range(7):
        next(ref)
    np.testing.assert_array_equal(next(it), next(ref))


@pytest.mark.parametrize("kind", ["dataset", "loader"])
def test_grain_own_orbax_handler_saves_the_wrapper_and_either_iterator_restores_it(tmp_path, kind):
    def make():
        if kind == "dataset":
            return iter(grain.MapDataset.source(_records()).map(Square()).batch(4))
        return iter(_loader([Square(), grain.transforms.Batch(4)], shuffle=True))

    wrapper = as_data_iterator(make())
    assert isinstance(wrapper, GrainDatasetIterator if kind == "dataset" else GrainLoaderIterator)
    for _ in range(5):
        next(wrapper)
    wrapper.skipped_ranges = [(6, 9)]
    next(wrapper)  # batch 5
    next(wrapper)  # batch 9: the skip moved Grain too
    expected = as_data_iterator(make())
    expected.seek(10)
    want = np.asarray(next(expected))

    mngr = ocp.CheckpointManager(tmp_path / "own")
    mngr.save(1, args=ocp.args.Composite(data=grain.checkpoint.CheckpointSave(wrapper)))
    mngr.wait_until_finished()
    for target in (as_data_iterator(make()), make()):  # the wrapper, then the raw iterator
        mngr.restore(1, args=ocp.args.Composite(data=grain.checkpoint.CheckpointRestore(target)))
        if isinstance(target, GrainDatasetIterator | GrainLoaderIterator):
            assert target.index == 10
        np.testing.assert_array_equal(next(target), want)
    # ... and the wrapper restores what the raw iterator's handler wrote.
    raw = make()
    for _ in range(10):
        next(raw)
    mngr.save(2, args=ocp.args.Composite(data=grain.checkpoint.CheckpointSave(raw)))
    mngr.wait_until_finished()
    target = as_data_iterator(make())
    mngr.restore(2, args=ocp.args.Composite(data=grain.checkpoint.CheckpointRestore(target)))
    assert target.index == 10
    np.testing.assert_array_equal(next(target), want)
    mngr.close()


def test_indexed_batches_state_is_unchanged():
    it = IndexedBatches(lambda i: i)
    next(it)
    assert it.get_state() == {"index": 1}
