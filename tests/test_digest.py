"""Checkpoint integrity against deliberate edits (issue 41): the per-leaf digest
(``verify="digest"``) and the keyed digest (``STABLJAX_CHECKPOINT_KEY``), against the real
store and controller, with forged files on disk.

The forgery: flipping the sign bit of two float32 values adds 2**31 to two uint32 words,
which leaves both of the fingerprint's wrap-around sums unchanged (every weight is odd and
2 * 2**31 = 0 mod 2**32), so the fingerprint cannot see it; a digest of the bytes must.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import shutil

import chex
import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
import pytest
import toy
from helpers import host

from stabljax.control import IndexedBatches, RollbackController
from stabljax.control.checkpoint.integrity import (
    ENV_KEY,
    META_VERSION,
    CheckpointKeyError,
    Seal,
    fingerprint,
    leaf_digests,
    meta_digest,
)
from stabljax.control.checkpoint.items import data_item
from stabljax.control.checkpoint.store import CheckpointStore
from stabljax.control.decide.policy import Ledger

KEY = "correct horse battery staple"
KW = dict(save_every=10, keep=3, rollback_margin=5, async_save=False, verify="digest")


def forge(state):
    """``state`` with the signs of two weights flipped: the same fingerprint."""
    w = np.array(state.params["w"])
    flat = w.reshape(-1)
    flat[0], flat[1] = -flat[0], -flat[1]
    return state.replace(params={**state.params, "w": jnp.asarray(w)})


def at(state, step):
    return state.replace(step=jnp.asarray(step, jnp.int32))


def open_store(directory, seal):
    s = CheckpointStore(directory, async_save=False, log=lambda *a, **k: None, keep=3)
    s.seal = seal
    return s


def write(directory, state, step, seal):
    store = open_store(directory, seal)
    meta = {"version": META_VERSION, "step": step, "data_index": step} | Ledger().to_meta()
    store.write(
        step,
        state,
        fingerprint(state),
        meta,
        data_item(IndexedBatches(lambda i: i, start=step), restore=False),
        1.0,
        wait=True,
        resume_only=False,
    )
    store.close()


def restore(directory, state, step, seal):
    store = open_store(directory, seal)
    try:
        abstract = jax.tree.map(ocp.utils.to_shape_dtype_struct, state)
        return store.restore(step, abstract, verify=True)
    finally:
        store.close()


def swap_state(directory, step, forged_directory):
    """Puts the forged checkpoint's arrays under ``directory``'s meta, as an editor would."""
    shutil.rmtree(directory / str(step) / "state")
    shutil.copytree(forged_directory / str(step) / "state", directory / str(step) / "state")


@pytest.fixture
def pair(toy, tmp_path):
    state = at(toy[0], 10)
    w = state.params["w"]
    w = jnp.arange(1.0, w.size + 1.0, dtype=w.dtype).reshape(w.shape)  # nonzero weights
    state = state.replace(params={**state.params, "w": w})
    forged = forge(state)
    # The premise: the forgery keeps the fingerprint and changes the values.
    np.testing.assert_array_equal(np.asarray(fingerprint(forged)), np.asarray(fingerprint(state)))
    assert not np.array_equal(np.asarray(forged.params["w"]), np.asarray(state.params["w"]))
    return state, forged


# ------------------------------------------------------------------------------ by hand


def test_leaf_digests_are_sha256_or_hmac_of_dtype_shape_and_bytes():
    tree = {"a": np.arange(6, dtype=np.float32).reshape(2, 3), "k": jax.random.key(3)}
    plain = dict(leaf_digests(tree))
    raw = np.arange(6, dtype=np.float32).tobytes()
    assert plain["['a']"] == hashlib.sha256(b"<f4[2, 3]" + raw).hexdigest()
    key_words = np.asarray(jax.random.key_data(tree["k"]))
    spec = f"{key_words.dtype.str}{list(key_words.shape)}".encode()
    assert plain["['k']"] == hashlib.sha256(spec + key_words.tobytes()).hexdigest()
    keyed = dict(leaf_digests(tree, b"k3y"))
    assert keyed["['a']"] == hmac.new(b"k3y", b"<f4[2, 3]" + raw, hashlib.sha256).hexdigest()
    # Same bytes, another shape: another digest.
    assert dict(leaf_digests({"a": tree["a"].reshape(3, 2)}))["['a']"] != plain["['a']"]


def test_the_keyed_meta_digest_is_an_hmac_of_the_canonical_json():
    meta = {"step": 3, "version": 1, "digest": "old"}
    body = json.dumps({"step": 3, "version": 1}, sort_keys=True).encode()
    assert meta_digest(meta) == hashlib.sha256(body).hexdigest()
    assert meta_digest(meta, b"k") == hmac.new(b"k", body, hashlib.sha256).hexdigest()


def test_seal_settings_are_checked():
    assert Seal.from_env("digest", {}).mode == "digest" and Seal.from_env(True, {}).key is None
    assert Seal.from_env(False, {ENV_KEY: "s"}).key == b"s"
    with pytest.raises(ValueError, match=f"{ENV_KEY} is set but empty"):
        Seal.from_env(True, {ENV_KEY: ""})
    for bad in ("sha256", 1, None):
        with pytest.raises(ValueError, match="verify must be True .*, False or 'digest'"):
            Seal.from_env(bad, {})
    with pytest.raises(ValueError, match="verify must be"):
        RollbackController("unused", verify="yes")
    assert "correct" not in repr(Seal.from_env(True, {ENV_KEY: KEY}))  # the key is not shown


# ------------------------------------------------------------------------ forged values


def test_forged_values_pass_the_fingerprint_but_not_the_digest(pair, tmp_path):
    state, forged = pair
    for mode in (True, "digest"):
        real, fake = tmp_path / f"{mode}-real", tmp_path / f"{mode}-fake"
        write(real, state, 10, Seal(mode))
        write(fake, forged, 10, Seal(mode))
        swap_state(real, 10, fake)
        if mode is True:  # what the fingerprint does not catch: the forgery loads
            got, _, _ = restore(real, state, 10, Seal(True))
            chex.assert_trees_all_equal(host(got.params), host(forged.params))
        else:
            with pytest.raises(ValueError, match=r"digest mismatch in leaf \.params\['w'\]"):
                restore(real, state, 10, Seal(mode))
            # Any controller setting checks the digests a checkpoint carries.
            with pytest.raises(ValueError, match="digest mismatch"):
                restore(real, state, 10, Seal(True))


def test_an_honest_digest_checkpoint_reads_back_bit_for_bit(pair, tmp_path):
    state, _ = pair
    for seal in (Seal("digest"), Seal("digest", KEY.encode())):
        d = tmp_path / str(seal.key is not None)
        write(d, state, 10, seal)
        got, meta, _ = restore(d, state, 10, seal)
        chex.assert_trees_all_equal(host(got), host(state))
        assert dict(meta["digests"]) == dict(leaf_digests(state, seal.key))
        assert ("key_id" in meta) == (seal.key is not None)


def test_a_forged_checkpoint_is_set_aside_and_the_previous_one_used(tmp_path):
    d = tmp_path / "run"
    state, step = toy.make_toy()
    with RollbackController(d, **KW) as ctl:
        state, _ = ctl.run(step, state, IndexedBatches(toy.batch_fn_factory(())), 30)
    # Forge checkpoint 30 with the library's own writer, then put its arrays under the
    # honest meta (what someone editing the values on shared storage would leave).
    saved, _, _ = restore(d, state, 30, Seal("digest"))
    write(tmp_path / "fake", forge(saved), 30, Seal("digest"))
    swap_state(d, 30, tmp_path / "fake")
    fresh, _ = toy.make_toy()
    with RollbackController(d, **KW) as ctl:
        got, data = ctl.restore_or_init(fresh, IndexedBatches(toy.batch_fn_factory(())))
        corrupt = [e for e in ctl.events if e.kind == "corrupt_checkpoint"]
    assert [e.step for e in corrupt] == [30]
    assert "digest mismatch in leaf .params['w']" in corrupt[0].details["reason"]
    assert int(got.step) == 20 and data.index == 20
    assert [p.name.split("-")[0] for p in (d / "stabljax-corrupt").iterdir()] == ["30"]


# --------------------------------------------------------------------------- the key


def edit_meta(directory, step, *, strip_key=False):
    """Moves the run to data index 10**9 and recomputes the plain SHA-256 meta digest."""
    path = directory / str(step) / "meta" / "metadata"
    meta = json.loads(path.read_text())
    meta["data_index"] = 10**9
    if strip_key:
        meta.pop("key_id")
    meta["digest"] = meta_digest(meta)
    path.write_text(json.dumps(meta))


def test_an_edited_meta_with_its_digest_recomputed_is_caught_only_with_the_key(pair, tmp_path):
    state, _ = pair
    plain, keyed = tmp_path / "plain", tmp_path / "keyed"
    write(plain, state, 10, Seal("digest"))
    write(keyed, state, 10, Seal("digest", KEY.encode()))
    edit_meta(plain, 10)
    edit_meta(keyed, 10)
    # Without the key, anyone who can write the checkpoint can recompute the digest.
    assert restore(plain, state, 10, Seal("digest"))[1]["data_index"] == 10**9
    with pytest.raises(ValueError, match="checkpoint 10: meta digest mismatch"):
        restore(keyed, state, 10, Seal("digest", KEY.encode()))


def test_a_keyed_meta_stripped_of_its_key_is_not_adopted(pair, tmp_path):
    state, _ = pair
    write(tmp_path, state, 10, Seal("digest", KEY.encode()))
    edit_meta(tmp_path, 10, strip_key=True)
    with pytest.raises(CheckpointKeyError, match=f"no keyed digest but {ENV_KEY} is set"):
        restore(tmp_path, state, 10, Seal("digest", KEY.encode()))


def test_a_wrong_or_missing_key_is_a_clear_error_and_nothing_is_set_aside(tmp_path, monkeypatch):
    d = tmp_path / "run"
    state, step = toy.make_toy()
    monkeypatch.setenv(ENV_KEY, KEY)
    with RollbackController(d, **KW) as ctl:
        ctl.run(step, state, IndexedBatches(toy.batch_fn_factory(())), 20)
    steps = sorted(p.name for p in d.iterdir() if p.name.isdigit())
    cases = [("another key", "sealed with another key than the one in " + ENV_KEY), (None, "")]
    for key, problem in cases:
        if key is None:
            monkeypatch.delenv(ENV_KEY)
            problem = f"was sealed with a key: set {ENV_KEY}"
        else:
            monkeypatch.setenv(ENV_KEY, key)
        fresh, _ = toy.make_toy()
        with RollbackController(d, **KW) as ctl:
            with pytest.raises(CheckpointKeyError, match=problem) as info:
                ctl.restore_or_init(fresh, IndexedBatches(toy.batch_fn_factory(())))
        assert "checkpoint 20 in" in str(info.value) and KEY not in str(info.value)
        assert sorted(p.name for p in d.iterdir() if p.name.isdigit()) == steps
        assert not (d / "stabljax-corrupt").exists()
    monkeypatch.setenv(ENV_KEY, KEY)  # the right key resumes
    fresh, _ = toy.make_toy()
    with RollbackController(d, **KW) as ctl:
        got, _ = ctl.restore_or_init(fresh, IndexedBatches(toy.batch_fn_factory(())))
    assert int(got.step) == 20


@pytest.mark.parametrize("save", ["async", "background"])
def test_every_save_path_writes_digests_that_verify(tmp_path, save):
    d = tmp_path / "run"
    state, step = toy.make_toy()
    kw = KW | dict(async_save=True, background_save=save == "background")
    with RollbackController(d, **kw) as ctl:
        state, _ = ctl.run(step, state, IndexedBatches(toy.batch_fn_factory(())), 30)
    for s in (10, 20, 30):
        got, meta, _ = restore(d, state, s, Seal("digest"))
        assert int(got.step) == s and dict(meta["digests"]) == dict(leaf_digests(got))
    chex.assert_trees_all_equal(host(got), host(state))  # 30 is the final state
