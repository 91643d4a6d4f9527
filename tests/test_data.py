"""Data iterators: positions, O(1) skipping equal to draining, skipped ranges, states."""

from __future__ import annotations

import json
import warnings

import grain
import numpy as np
import pytest

from stabljax.control.data.grain_iterators import (
    GrainDatasetIterator,
    GrainLoaderIterator,
    as_data_iterator,
)
from stabljax.control.data.iterators import (
    IndexedBatches,
    PlainIterator,
    first_allowed,
    merge_ranges,
)


@pytest.mark.parametrize(
    "ranges, merged",
    [
        ([], []),
        ([(3, 5)], [(3, 5)]),
        ([(5, 9), (0, 2)], [(0, 2), (5, 9)]),
        ([(0, 5), (5, 7)], [(0, 7)]),
        ([(0, 5), (2, 3)], [(0, 5)]),
        ([(4, 4), (6, 2)], []),
        ([[10, 20], [15, 30], [0, 1]], [(0, 1), (10, 30)]),
    ],
)
def test_merge_ranges(ranges, merged):
    assert merge_ranges(ranges) == merged


def test_merge_ranges_rejects_negative_start():
    with pytest.raises(ValueError, match=">= 0"):
        merge_ranges([(-1, 3)])


def test_first_allowed():
    r = merge_ranges([(2, 4), (10, 12)])
    got = [first_allowed(i, r) for i in range(14)]
    assert got == [0, 1, 4, 4, 4, 5, 6, 7, 8, 9, 12, 12, 12, 13]


def test_indexed_batches_skip_is_free_and_exact():
    calls = []

    def batch_fn(i):
        calls.append(i)
        return i * 10

    it = IndexedBatches(batch_fn, start=2)
    assert it.index == 2 and it.skip_is_cheap
    assert next(it) == 20
    it.skip(1000)
    assert it.index == 1003 and next(it) == 10030
    assert calls == [2, 1003]  # nothing fetched for the skipped indices
    it.skip(0)
    assert it.index == 1004


def test_skipped_ranges_are_never_yielded_even_when_passed_later():
    it = IndexedBatches(lambda i: i)
    it.skipped_ranges = [(3, 5), (7, 8), (20, 25)]
    got = [next(it) for _ in range(8)]
    assert got == [0, 1, 2, 5, 6, 8, 9, 10]
    # A position inside a range moves to its end before fetching.
    it2 = IndexedBatches(lambda i: i, start=21)
    it2.skipped_ranges = [(20, 25)]
    assert next(it2) == 25 and it2.index == 26


def test_state_round_trip_is_json():
    it = IndexedBatches(lambda i: i)
    for _ in range(5):
        next(it)
    state = json.loads(json.dumps(it.get_state()))
    it2 = IndexedBatches(lambda i: i)
    it2.set_state(state)
    assert it2.index == 5 and next(it2) == 5


def test_indexed_batches_bad_input():
    with pytest.raises(TypeError, match="callable"):
        IndexedBatches([1, 2, 3])
    with pytest.raises(ValueError, match="start"):
        IndexedBatches(lambda i: i, start=-1)
    it = IndexedBatches(lambda i: i, start=5)
    with pytest.raises(ValueError, match="forward"):
        it.skip(-1)
    with pytest.raises(ValueError, match="back"):
        it.seek(4)


def test_plain_iterator_warns_and_drains():
    with pytest.warns(RuntimeWarning, match="drain"):
        it = PlainIterator(iter(range(100)))
    assert not it.skip_is_cheap
    it.skip(10)
    assert next(it) == 10
    it.skipped_ranges = [(12, 15)]
    assert [next(it) for _ in range(3)] == [11, 15, 16]
    # Restoring on a fresh iterator drains forward; going back is an error.
    with pytest.warns(RuntimeWarning):
        fresh = PlainIterator(iter(range(100)))
    fresh.set_state(it.get_state())
    assert next(fresh) == 17
    with pytest.raises(ValueError, match="back"):
        fresh.set_state({"index": 3})


def _drain_reference(make, k, n, m=3):
    it = make()
    for _ in range(k + n):
        next(it)
    return [np.asarray(next(it)) for _ in range(m)]


@pytest.mark.parametrize(
    "make",
    [
        lambda: grain.MapDataset.range(1000).batch(4),
        lambda: grain.MapDataset.range(1000).shuffle(seed=3).map(lambda x: x * 2).batch(5),
        lambda: grain.MapDataset.range(1000).batch(4).to_iter_dataset(),
    ],
    ids=["batched", "shuffled-mapped", "iter-dataset"],
)
@pytest.mark.parametrize("k, n", [(0, 7), (3, 11), (5, 0)])
def test_grain_dataset_iterator_skip_equals_draining(make, k, n):
    it = as_data_iterator(make())
    assert isinstance(it, GrainDatasetIterator) and it.skip_is_cheap
    for _ in range(k):
        next(it)
    it.skip(n)
    assert it.index == k + n
    got = [np.asarray(next(it)) for _ in range(3)]
    for a, b in zip(got, _drain_reference(lambda: iter(make()), k, n), strict=True):
        np.testing.assert_array_equal(a, b)


def test_grain_dataset_iterator_that_cannot_seek_is_drained_with_a_warning():
    def make():
        return grain.MapDataset.range(200).to_iter_dataset().filter(lambda x: x % 3 != 0)

    with pytest.warns(RuntimeWarning, match="drain"):
        it = GrainDatasetIterator(iter(make()))
    next(it)
    it.skip(5)
    assert int(next(it)) == int(_drain_reference(lambda: iter(make()), 1, 5)[0])


def test_grain_dataset_iterator_state_round_trip():
    ds = grain.MapDataset.range(100).batch(4)
    it = GrainDatasetIterator(iter(ds))
    for _ in range(3):
        next(it)
    state = json.loads(json.dumps(it.get_state()))
    it2 = GrainDatasetIterator(iter(ds))
    it2.set_state(state)
    assert it2.index == 3
    np.testing.assert_array_equal(next(it2), [12, 13, 14, 15])


class _Source:
    def __len__(self):
        return 997

    def __getitem__(self, i):
        return np.int64(i)

    def __repr__(self):
        return "Source(997)"


def _loader(ops, shard=None, workers=0):
    so = grain.sharding.ShardOptions(*shard) if shard else grain.sharding.NoSharding()
    sampler = grain.samplers.IndexSampler(997, shard_options=so, shuffle=True, seed=3, num_epochs=3)
    return grain.DataLoader(
        data_source=_Source(),
        sampler=sampler,
        operations=ops,
        worker_count=workers,
        shard_options=so,
    )


@pytest.mark.parametrize("shard", [None, (1, 2)])
@pytest.mark.parametrize("k, n", [(0, 5), (3, 7), (7, 130)])  # 130 crosses an epoch of a shard
def test_grain_loader_skip_through_state_equals_draining(shard, k, n):
    ops = [grain.transforms.Batch(4)]
    loader = _loader(ops, shard)
    it = as_data_iterator(loader)
    assert isinstance(it, GrainLoaderIterator) and it.skip_is_cheap
    for _ in range(k):
        next(it)
    it.skip(n)
    got = [np.asarray(next(it)) for _ in range(3)]
    ref = _drain_reference(lambda: iter(_loader(ops, shard)), k, n)
    for a, b in zip(got, ref, strict=True):
        np.testing.assert_array_equal(a, b)


def test_grain_loader_with_a_filter_is_drained_with_a_warning():
    class DropOdd(grain.transforms.Filter):
        def filter(self, x):
            return x % 2 == 0

    ops = [DropOdd(), grain.transforms.Batch(4)]
    with pytest.warns(RuntimeWarning, match="drain"):
        it = GrainLoaderIterator(iter(_loader(ops)), loader=_loader(ops))
    assert not it.skip_is_cheap
    it.skip(4)
    np.testing.assert_array_equal(next(it), _drain_reference(lambda: iter(_loader(ops)), 0, 4)[0])


@pytest.mark.slow
def test_grain_loader_skip_with_worker_processes():
    import absl.flags

    if not absl.flags.FLAGS.is_parsed():
        absl.flags.FLAGS(["pytest"])  # grain's worker processes read absl flags
    ops = [grain.transforms.Batch(4)]
    for k, n in [(0, 5), (3, 7)]:
        it = GrainLoaderIterator(iter(_loader(ops, workers=2)), loader=_loader(ops, workers=2))
        for _ in range(k):
            next(it)
        it.skip(n)
        got = np.asarray(next(it))
        np.testing.assert_array_equal(
            got, _drain_reference(lambda: iter(_loader(ops, workers=2)), k, n, m=1)[0]
        )


def test_as_data_iterator_dispatch_and_errors():
    it = IndexedBatches(lambda i: i)
    assert as_data_iterator(it) is it
    assert isinstance(as_data_iterator(iter(grain.MapDataset.range(4))), GrainDatasetIterator)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with pytest.raises(RuntimeWarning, match="plain iterator"):
            as_data_iterator([1, 2, 3])
    with pytest.raises(TypeError, match="IndexedBatches"):
        as_data_iterator(lambda i: i)
    with pytest.raises(TypeError, match="iterable"):
        as_data_iterator(3)
