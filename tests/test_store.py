"""control.checkpoint.store: the checkpoint store on its own (write, read, meta, fingerprint,
verification, corrupt set-aside, retention) and its pure helpers, by hand.

The controller's use of it (when to save, resume, roll back) is in test_controller.py.
"""

from __future__ import annotations

import json

import chex
import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
import pytest
from helpers import host

from stabljax.control.checkpoint.fsutil import atomic_write_json
from stabljax.control.checkpoint.integrity import (
    META_VERSION,
    check_compatible,
    describe_mismatch,
    fingerprint,
    leaf_specs,
    meta_digest,
)
from stabljax.control.checkpoint.items import data_item
from stabljax.control.checkpoint.store import CORRUPT, CheckpointStore, try_everywhere
from stabljax.control.data.iterators import IndexedBatches
from stabljax.control.decide.policy import Ledger
from stabljax.control.errors import CheckpointMismatch
from stabljax.control.hosts import host_scalars

# ------------------------------------------------------------------------ fingerprint


def test_fingerprint_by_hand():
    # Per leaf: the sum of its uint32 words, and the sum weighted by 1 + 2 * i * 0x9E3779B1
    # (mod 2**32) at position i of a 1-D leaf.
    got = np.asarray(fingerprint({"a": jnp.array([1, 2], jnp.int32), "b": jnp.int32(7)}))
    weighted = (1 * 1 + 2 * (1 + 2 * 0x9E3779B1)) % 2**32
    np.testing.assert_array_equal(got, np.array([3, weighted, 7, 7], np.uint32))


def test_fingerprint_sees_a_flipped_bit_a_swap_and_every_dtype():
    x = jnp.arange(12.0, dtype=jnp.float32).reshape(3, 4)
    base = np.asarray(fingerprint(x))
    flipped = jax.lax.bitcast_convert_type(x, jnp.uint32).at[1, 2].add(1)
    flipped = jax.lax.bitcast_convert_type(flipped, jnp.float32)
    assert not np.array_equal(np.asarray(fingerprint(flipped)), base)
    swapped = x.at[0, 0].set(x[2, 3]).at[2, 3].set(x[0, 0])
    got = np.asarray(fingerprint(swapped))
    assert got[0] == base[0] and got[1] != base[1]  # same words, other places
    tree = {
        "bf16": jnp.ones((2, 3), jnp.bfloat16),
        "bool": jnp.array([True, False]),
        "f64": np.ones(2, np.float64),
        "c64": jnp.ones(2, jnp.complex64),
        "key": jax.random.key(0),
    }
    assert np.asarray(fingerprint(tree)).shape == (2 * len(tree),)
    assert fingerprint({}).shape == (0,)


# ------------------------------------------------------------------------ meta helpers


def test_meta_digest_ignores_its_own_field_and_key_order_but_not_a_value():
    meta = {"version": 1, "step": 10, "skipped_ranges": [[3, 5]]}
    digest = meta_digest(meta)
    assert len(digest) == 64 and int(digest, 16) >= 0
    assert meta_digest({**meta, "digest": "anything"}) == digest
    assert meta_digest(dict(reversed(list(meta.items())))) == digest
    assert meta_digest({**meta, "skipped_ranges": [[3, 6]]}) != digest


def test_leaf_specs_and_describe_mismatch_name_every_difference():
    saved = leaf_specs({"w": jnp.zeros((4, 1)), "b": jnp.zeros(1), "n": None})
    assert saved == [["['b']", "float32", [1]], ["['n']", None, None], ["['w']", "float32", [4, 1]]]
    now = leaf_specs(
        {"w": jnp.zeros((4, 2)), "n": jnp.zeros(2, jnp.int32), "c": jnp.zeros(3, jnp.bfloat16)}
    )
    assert describe_mismatch(saved, now) == [
        "new leaf ['c'] (bfloat16[3]) not in the checkpoint",
        "leaf ['n'] is int32[2] now but was None in the checkpoint",
        "leaf ['w']: shape [4, 1] in the checkpoint, [4, 2] now",
        "leaf ['b'] of the checkpoint is gone from the state",
    ]
    assert describe_mismatch(saved, saved) == []


def test_check_compatible_lists_the_state_and_data_config_differences(tmp_path):
    tree = {"w": jnp.zeros((4, 1), jnp.float32)}
    meta = {"step": 30, "leaves": leaf_specs(tree), "data_config": {"batch": 16}}
    check_compatible(meta, tree, {"batch": 16}, tmp_path)  # the same: no error
    other = {"w": jnp.zeros((4, 1), jnp.bfloat16)}
    with pytest.raises(CheckpointMismatch) as info:
        check_compatible(meta, other, {"batch": 32}, tmp_path)
    text = str(info.value)
    assert f"cannot resume from checkpoint 30 in {str(tmp_path)!r}" in text
    assert "leaf ['w']: dtype float32 in the checkpoint, bfloat16 now" in text
    assert "data config {'batch': 16} in the checkpoint, {'batch': 32} now" in text
    assert isinstance(info.value, ValueError)


# ------------------------------------------------------------------------ host helpers


def test_host_scalars_reads_the_wanted_0d_entries_only():
    metrics = {
        "loss": jnp.float32(1.5),
        "skipped": jnp.bool_(False),
        "lr": 0.1,
        "hist": jnp.ones(3),
        "layers": {"w": jnp.float32(2.0)},
        "none": None,
    }
    assert host_scalars(metrics, None) == {"loss": 1.5, "skipped": False, "lr": 0.1}
    assert host_scalars(metrics, frozenset({"loss", "hist"})) == {"loss": 1.5}


def test_try_everywhere_turns_a_failure_into_none_and_a_corrupt_checkpoint_event():
    log = []

    def record(kind, step, **details):
        log.append((kind, step, details))

    assert try_everywhere(lambda: 5, record, 10) == 5 and log == []

    def boom():
        raise ValueError("boom")

    assert try_everywhere(boom, record, 10) is None
    assert log == [("corrupt_checkpoint", 10, {"reason": "ValueError: boom"})]
    assert try_everywhere(boom, record, None) is None and len(log) == 1


def test_atomic_write_json_replaces_whole_or_not_at_all(tmp_path):
    path = tmp_path / "record.json"
    atomic_write_json(path, {"rollbacks": 1})
    atomic_write_json(path, {"rollbacks": 2})
    assert json.loads(path.read_text()) == {"rollbacks": 2}
    with pytest.raises(ValueError):
        atomic_write_json(path, {"rollbacks": float("nan")})  # JSON has no NaN
    assert json.loads(path.read_text()) == {"rollbacks": 2}


# ---------------------------------------------------------------------- the store

# A failed tensorstore read leaves an Orbax coroutine that is finalised after its event
# loop closed ("Event loop is closed"): Orbax-internal noise, not a store error.
_ORBAX_NOISE = pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")


@pytest.fixture
def store(tmp_path):
    log = []
    s = CheckpointStore(
        tmp_path / "ckpt",
        async_save=False,
        log=lambda kind, step, **d: log.append((kind, step, d)),
        keep=3,
    )
    s.events = log
    yield s
    s.close()


def _at(state, step):
    return state.replace(step=jnp.asarray(step, jnp.int32))


def _write(store, state, step, *, print_of=None):
    """Writes ``state`` as checkpoint ``step``; its fingerprint is ``print_of``'s."""
    meta = {"version": META_VERSION, "step": step, "data_index": step} | Ledger().to_meta()
    data = IndexedBatches(lambda i: i, start=step)
    store.write(
        step,
        state,
        fingerprint(state if print_of is None else print_of),
        meta,
        data_item(data, restore=False),
        float(step),
        wait=True,
        resume_only=False,
    )


def _restore(store, state, step, *, verify=True):
    abstract = jax.tree.map(ocp.utils.to_shape_dtype_struct, state)
    return store.restore(step, abstract, IndexedBatches(lambda i: i), verify=verify)


def test_a_checkpoint_reads_back_bit_for_bit_with_its_meta_and_data_position(store, toy):
    state = _at(toy[0], 10)
    _write(store, state, 10)
    assert store.steps() == [10]
    assert [(k, s) for k, s, _ in store.events] == [("save", 10)]
    assert store.events[0][2] == {"data_index": 10, "smoothed_loss": 10.0}
    meta = store.read_meta(10)
    assert meta["step"] == 10 and meta["ckpt_losses"] == {"10": 10.0}
    assert meta["fingerprint"] == [int(v) for v in np.asarray(fingerprint(state))]
    assert meta["digest"] == meta_digest(meta)
    got, got_meta, data = _restore(store, state, 10)
    chex.assert_trees_all_equal(host(got), host(state))
    assert got_meta == meta and dict(data) == {"index": 10}


def test_a_state_whose_step_is_not_the_counted_one_is_refused(store, toy):
    with pytest.raises(ValueError, match="state.step is 0 but the controller counted 5"):
        _write(store, toy[0], 5)
    assert store.steps() == []


def test_verification_catches_values_that_do_not_match_the_fingerprint(store, toy):
    state = _at(toy[0], 10)
    other = state.replace(params=jax.tree.map(lambda x: x + 1, state.params))
    _write(store, state, 10, print_of=other)  # a well-formed checkpoint, wrong values
    with pytest.raises(ValueError, match="checkpoint 10: state fingerprint mismatch"):
        _restore(store, state, 10)
    got, _, _ = _restore(store, state, 10, verify=False)
    chex.assert_trees_all_equal(host(got), host(state))


def test_an_edited_ledger_fails_the_meta_digest(store, toy):
    _write(store, _at(toy[0], 10), 10)
    path = store.directory / "10" / "meta" / "metadata"
    meta = json.loads(path.read_text())
    meta["skipped_ranges"] = [[0, 5]]
    path.write_text(json.dumps(meta))
    with pytest.raises(ValueError, match="checkpoint 10: meta digest mismatch"):
        store.read_meta(10)


@_ORBAX_NOISE
def test_a_checkpoint_of_another_structure_does_not_restore(store, toy):
    state = _at(toy[0], 10)
    _write(store, state, 10)
    wider = state.replace(params={**state.params, "w": jnp.zeros((4, 2), jnp.float32)})
    with pytest.raises(ValueError):
        _restore(store, wider, 10)
    saved = store.read_meta(10)
    assert "leaves" not in saved  # the store writes what it is given: the Saver adds these
    lines = describe_mismatch(leaf_specs(state), leaf_specs(wider))
    assert lines == ["leaf .params['w']: shape [4, 1] in the checkpoint, [4, 2] now"]


@_ORBAX_NOISE
def test_the_first_restorable_sets_aside_the_unreadable_ones_before_it(store, toy):
    for step in (10, 20, 30):
        _write(store, _at(toy[0], step), step)
    (store.directory / "30" / "meta" / "metadata").write_text('{"version": 1, "st')
    store.events.clear()
    abstract = jax.tree.map(ocp.utils.to_shape_dtype_struct, toy[0])
    found = store.first_restorable([30, 20, 10], abstract, verify=True)
    assert found is not None and found[0] == 20 and found[1][1]["step"] == 20
    assert int(found[1][0].step) == 20 and found[1][2] is None  # no data item asked for
    assert [(k, s) for k, s, _ in store.events] == [("corrupt_checkpoint", 30)]
    assert store.steps() == [10, 20]
    assert [p.name.split("-")[0] for p in (store.directory / CORRUPT).iterdir()] == ["30"]


def test_retention_and_rollback_deletion(store, toy):
    for step in (10, 20, 30, 40):
        _write(store, _at(toy[0], step), step)
    # Orbax drops what retention leaves out once the next save has committed: keep=3.
    assert store.steps() == [20, 30, 40]
    store.resume_only.add(30)  # as a loaded meta item can say: 30 no longer counts
    store.retain()
    assert store.steps() == [20, 40] and set(store.scores) == {20, 40}
    store.delete_newer_than(20)
    assert store.steps() == [20] and store.scores == {20: 20.0}
    store.close()
    trash = [p for p in store.directory.iterdir() if p.name.startswith("stabljax-trash")]
    assert trash == []  # the sweeps removed what was deleted


def test_a_grain_position_is_read_without_touching_the_live_iterator(store, toy):
    """The store returns Grain's saved state; only DataIterator.restore applies it."""
    import grain

    from stabljax.control.data.grain_iterators import as_data_iterator

    def make():
        return as_data_iterator(iter(grain.MapDataset.range(1000)))

    data = make()
    for _ in range(7):
        next(data)
    state = _at(toy[0], 10)
    meta = {"version": META_VERSION, "step": 10, "data_index": data.index} | Ledger().to_meta()
    args = (fingerprint(state), meta, data_item(data, restore=False), 10.0)
    store.write(10, state, *args, wait=True, resume_only=False)
    live = make()
    for _ in range(3):
        next(live)
    abstract = jax.tree.map(ocp.utils.to_shape_dtype_struct, state)
    _, got_meta, saved = store.restore(10, abstract, live, verify=True)
    assert live.index == 3 and next(live) == 3  # untouched by the read
    assert saved["index"] == 7 == got_meta["data_index"] and "grain" in saved
    live.restore(7, [(8, 10)], state=saved)
    assert live.index == 7 and [next(live) for _ in range(2)] == [7, 10]


def test_a_foreign_numbered_folder_is_no_step_and_is_never_deleted(store, toy):
    for step in (10, 20, 30):
        _write(store, _at(toy[0], step), step)
    user = store.directory / "25"  # a user's folder, named like a step
    user.mkdir()
    (user / "notes.txt").write_text("mine")
    store.manager.reload()
    assert 25 in store.manager.all_steps()  # Orbax alone would count it
    assert store.steps() == [10, 20, 30] and store.foreign() == [25]
    store.keep = 1
    store.retain()
    assert store.steps() == [30] and store.foreign() == [25]
    store.delete_newer_than(10)
    store.delete([25])
    assert store.steps() == []
    assert (user / "notes.txt").read_text() == "mine"
    with pytest.warns(RuntimeWarning, match=r"25 is named like a checkpoint step.*left in place"):
        store.warn_foreign()
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        store.warn_foreign()  # once per folder


def test_a_foreign_folder_past_the_step_makes_a_save_fail_clearly(store, toy):
    (store.directory / "2024").mkdir()
    (store.directory / "2024" / "photo.jpg").write_bytes(b"\xff\xd8")
    store.manager.reload()
    with pytest.raises(RuntimeError, match=r"\[2024\] are named like steps.*move them out"):
        _write(store, _at(toy[0], 10), 10)
    assert (store.directory / "2024" / "photo.jpg").read_bytes() == b"\xff\xd8"
    assert store.steps() == []
