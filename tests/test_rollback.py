"""The ledger, the crash record, the give-up message, the rollback decision
(stabljax.control.decide.policy, re-exported by stabljax.control.resume) and the data position
(DataIterator.restore), against hand-computed expectations.

Resume and the rollback executor, which need Orbax, run in test_controller.py.
"""

from __future__ import annotations

import json
import warnings

import pytest

from stabljax.control.checkpoint.jsonio import MalformedJSONError
from stabljax.control.checkpoint.store import RECORD
from stabljax.control.data.iterators import IndexedBatches, PlainIterator
from stabljax.control.decide.policy import (
    ADVICE,
    HISTORY,
    Ledger,
    decide,
    diverged_message,
    losses_before,
)
from stabljax.control.detect.detectors import Detection
from stabljax.control.resume import read_record


def _detection(action, step=40, onset=35, reason="loss spike"):
    return Detection("spike", step, onset, action, reason, 9.0)


# ------------------------------------------------------------------------------ ledger


def test_ledger_meta_round_trip_merges_overlapping_ranges():
    meta = {
        "skipped_ranges": [[40, 41], [10, 20], [15, 30]],
        "rollbacks": 2,
        "last_rollback": {"restored": 10},
        "history": [{"a": 1}],
    }
    ledger = Ledger.from_meta(meta)
    assert ledger.ranges == [(10, 30), (40, 41)]
    assert ledger.skipped == 20 + 1
    assert ledger.rollbacks == 2 and ledger.last_rollback == {"restored": 10}
    assert ledger.to_meta() == {
        "skipped_ranges": [[10, 30], [40, 41]],
        "rollbacks": 2,
        "last_rollback": {"restored": 10},
        "history": [{"a": 1}],
    }
    assert Ledger.from_meta(json.loads(json.dumps(ledger.to_meta()))) == ledger


def test_after_rollback_returns_a_new_ledger_and_keeps_the_last_history_entries():
    entries = [{"n": i} for i in range(HISTORY)]
    before = Ledger([(10, 20)], HISTORY, entries[-1], entries)
    after = before.after_rollback({"n": HISTORY}, (18, 25))
    assert after.ranges == [(10, 25)] and after.rollbacks == HISTORY + 1
    assert after.last_rollback == {"n": HISTORY}
    assert [h["n"] for h in after.history] == list(range(1, HISTORY + 1))
    # The ledger it came from is untouched (a failed rollback must not change it).
    assert before.ranges == [(10, 20)] and before.rollbacks == HISTORY
    assert len(before.history) == HISTORY


def test_merge_record_adopts_only_a_newer_record():
    ledger = Ledger([(5, 8)], 1)
    assert not ledger.merge_record(None)
    old = {"rollbacks": 1, "skipped_ranges": [[50, 60]]}
    assert not ledger.merge_record(old)
    assert ledger.ranges == [(5, 8)] and ledger.rollbacks == 1
    new = {"rollbacks": 2, "skipped_ranges": [[7, 12]], "last_rollback": {"restored": 0}}
    assert ledger.merge_record(new)
    assert ledger.ranges == [(5, 12)] and ledger.rollbacks == 2
    assert ledger.last_rollback == {"restored": 0} and ledger.history == []


def test_record_holds_what_a_restart_needs():
    ledger = Ledger([(10, 37)], 1, {"restored": 10}, [{"restored": 10}])
    record = ledger.record(target_step=10, data_index=37, time=123.0)
    assert record == {
        "rollbacks": 1,
        "target_step": 10,
        "data_index": 37,
        "skipped_ranges": [[10, 37]],
        "last_rollback": {"restored": 10},
        "history": [{"restored": 10}],
        "time": 123.0,
    }


def test_a_missing_rollback_record_reads_as_none(tmp_path):
    assert read_record(tmp_path) is None


@pytest.mark.parametrize(
    "text, problem",
    [
        ('{"rollbacks": 1, "target_st', "not valid JSON"),  # torn
        ('{"rollbacks": 1, "data_index": 3}', "'target_step' is missing"),
        ('{"rollbacks": "one", "target_step": 1, "data_index": 3}', "'rollbacks' must be"),
        ("[1, 2]", "expected a JSON object"),
    ],
    ids=["torn", "no_target", "not_int", "not_a_dict"],
)
def test_a_malformed_rollback_record_is_an_error_naming_the_file(tmp_path, text, problem):
    # A record is renamed into place whole, so a bad one was edited: never adopted, and
    # never silently dropped either (issue 41).
    (tmp_path / RECORD).write_text(text)
    with pytest.raises(MalformedJSONError, match=problem) as info:
        read_record(tmp_path)
    assert str(info.value).startswith(str(tmp_path / RECORD))


def test_a_rollback_record_reads_back(tmp_path):
    record = Ledger([(10, 37)], 1).record(target_step=10, data_index=37, time=0.0)
    (tmp_path / RECORD).write_text(json.dumps(record))
    assert read_record(tmp_path) == record


# ---------------------------------------------------------------------------- message


def test_losses_before_keeps_the_last_n_up_to_the_step_and_names_non_finite():
    recent = [(1, 1.0, False), (2, float("nan"), True), (3, 3.0, False), (4, 4.0, False)]
    assert losses_before(recent, 3, n=2) == [[2, "nan", True], [3, 3.0, False]]
    assert losses_before(recent, 9, n=12) == [
        [1, 1.0, False],
        [2, "nan", True],
        [3, 3.0, False],
        [4, 4.0, False],
    ]
    assert losses_before(recent, 0) == []


def test_the_give_up_message_by_hand():
    entry = {
        "detected": 40,
        "onset": 35,
        "restored": 20,
        "range": [20, 41],
        "reason": "loss spike",
        "losses": [[33, 1.0, False], [34, 2.5, False]],
    }
    ledger = Ledger().after_rollback(entry, (20, 41))
    losses = [[45, 1.25, False], [46, "inf", True]]
    text = diverged_message("Training diverged.", 46, ["a", "b"], losses, ledger)
    assert text.splitlines() == [
        "Training diverged.",
        "Now, at step 46: a; b",
        "Losses before it (step: loss, * = update skipped by a guard): 45: 1.25, 46: inf*",
        "Rollbacks so far:",
        "  1. at step 40 (onset 35) -> step 20, skipped batches [20, 41): loss spike; "
        "losses before: 33: 1, 34: 2.5",
        "Skipped data ranges: [(20, 41)] (21 batches).",
        ADVICE,
    ]


def test_the_give_up_message_without_rollbacks_has_no_history_section():
    text = diverged_message("Stopped.", 7, ["x"], [], Ledger())
    assert "Rollbacks so far" not in text
    assert "Skipped data ranges: [] (0 batches)." in text


# ---------------------------------------------------------------------------- decide


@pytest.mark.parametrize("found", [[], [_detection("record")], [_detection("warn")]])
def test_nothing_to_decide_without_a_detection_that_rolls_back_or_raises(found):
    assert decide(found, Ledger(), step=40, max_rollbacks=3) is None


@pytest.mark.parametrize("action", ["rollback", "rollback_best"])
def test_a_rollback_detection_rolls_back_while_rollbacks_remain(action):
    found = [_detection("record"), _detection(action)]
    decision = decide(found, Ledger(rollbacks=2), step=40, max_rollbacks=3)
    assert decision.action == "rollback"
    assert decision.detections == [found[1]] and decision.headline == ""


def test_the_rollback_past_max_rollbacks_gives_up():
    found = [_detection("rollback")]
    decision = decide(found, Ledger(rollbacks=3), step=40, max_rollbacks=3)
    assert decision.action == "give_up" and decision.detections == found
    assert decision.headline == (
        "Training diverged: 3 rollback(s) (max_rollbacks=3) did not get past the trouble."
    )


def test_a_raising_detection_gives_up_even_with_rollbacks_left():
    raising = _detection("raise", step=25, reason="loss scale stuck")
    found = [_detection("rollback"), raising]
    decision = decide(found, Ledger(), step=25, max_rollbacks=3)
    assert decision.action == "give_up" and decision.detections == [raising]
    assert decision.headline == "Training stopped at step 25: a detector raised."


# ---------------------------------------------------------------------- the data position
# DataIterator.restore is the one writer of the data position after a checkpoint is read.


def test_restore_moves_forward_and_back():
    data = IndexedBatches(lambda i: i)
    data.restore(12, [])
    assert data.index == 12 and next(data) == 12
    data.restore(4, [])  # a narrowed skip goes back
    assert data.index == 4 and next(data) == 4


class _Recorded(IndexedBatches):
    """IndexedBatches that records how it was moved."""

    def __init__(self, start):
        super().__init__(lambda i: i, start=start)
        self.calls = []

    def set_state(self, state):
        self.calls.append(("set_state", state))
        super().set_state(state)

    def _set_index(self, index):
        self.calls.append(("set_index", index))
        super()._set_index(index)

    def seek(self, index):
        self.calls.append(("seek", index))
        super().seek(index)

    def rewind(self, index):
        self.calls.append(("rewind", index))
        super().rewind(index)


def test_restore_applies_the_saved_data_state_first_then_moves():
    data = _Recorded(start=50)
    data.restore(30, [(31, 33)], state={"index": 20})
    assert data.calls == [("set_state", {"index": 20}), ("set_index", 20), ("seek", 30)]
    assert data.skipped_ranges == [(31, 33)] and [next(data) for _ in range(2)] == [30, 33]
    data = _Recorded(start=50)
    data.restore(25, [])
    assert data.calls == [("rewind", 25)] and next(data) == 25


def test_restore_replaces_the_skipped_ranges():
    data = IndexedBatches(lambda i: i)
    data.restore(0, [(2, 4)])
    data.restore(0, [(1, 2), (5, 6)])
    assert [next(data) for _ in range(4)] == [0, 2, 3, 4]


def test_restore_past_the_end_of_the_data_stops():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # a plain iterator warns that skipping drains
        data = PlainIterator(iter(range(10)), warn=False)
    with pytest.raises(StopIteration):
        data.restore(12, [])
    with pytest.raises(ValueError, match="cannot move back"):
        PlainIterator(iter(range(10)), start=5, warn=False).restore(2, [])
