"""engine/train/prompt_queue.py: the curriculum queue's policy (whole rounds from the front, in order; the dataset
when fewer than P wait; a cap with drops counted and warned about once; checkpoint state)."""

from __future__ import annotations

import json
import warnings

import pytest

from engine.train.data import PromptBatch
from engine.train.prompt_queue import PromptQueue


def _batch(names: list[str], **columns) -> PromptBatch:
    return PromptBatch(indices=list(range(len(names))), prompts=list(names),
                       prompt_ids=[[ord(n[0]), len(n)] for n in names], columns=dict(columns))


def test_rounds_come_from_the_front_in_order_and_only_when_a_whole_round_waits():
    queue = PromptQueue(capacity=8)
    queue.push(_batch(["a", "b", "c"], answer=["1", "2", "3"]))
    assert queue.take(4) is None and len(queue) == 3  # a partial round waits; nothing is taken
    queue.push(_batch(["d"], level=[7]))
    picked = queue.take(4)
    assert picked.prompts == ["a", "b", "c", "d"] and picked.prompt_ids[3] == [ord("d"), 1]
    assert picked.columns == {"answer": ["1", "2", "3", None], "level": [None, None, None, 7]}
    assert len(queue) == 0 and queue.metrics() == {"curriculum/queued": 0.0, "curriculum/dropped": 0.0}


def test_prompts_past_the_cap_are_dropped_counted_and_warned_about_once():
    queue = PromptQueue(capacity=3)
    assert queue.push(_batch(["a", "b"])) == 0
    with pytest.warns(UserWarning, match="data.dynamic_prompts_queue_rounds"):
        assert queue.push(_batch(["c", "d", "e"])) == 2
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert queue.push(_batch(["f"])) == 1
    assert not caught, "warned once per run, then only counted"
    assert [r["prompt"] for r in queue.rows] == ["a", "b", "c"]
    assert queue.metrics() == {"curriculum/queued": 3.0, "curriculum/dropped": 3.0}


def test_the_queue_survives_a_checkpoint_as_json():
    queue = PromptQueue(capacity=4)
    queue.push(_batch(["a", "b"], answer=["1", "2"]))
    queue.num_dropped = 5
    restored = PromptQueue(capacity=4)
    restored.restore(json.loads(json.dumps(queue.state())))
    assert restored.rows == queue.rows and restored.num_dropped == 5
    assert restored.take(2) == queue.take(2)
    empty = PromptQueue(capacity=4)
    empty.restore(None)
    assert len(empty) == 0


def test_a_queue_without_room_is_refused():
    with pytest.raises(ValueError, match="at least one prompt"):
        PromptQueue(capacity=0)
