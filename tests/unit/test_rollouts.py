"""engine/rollout/rollouts.py: a rollout's rows and the MoE routes that travel with them (concat, select, JSON form,
the routes' compact encoding)."""

import json

import numpy as np
import pytest

from engine.rollout.rollouts import Rollout, decode_routes, encode_routes


def _rollout(num_rows: int, start: int = 0, routes: bool = True, largest: int = 7) -> Rollout:
    rng = np.random.default_rng(start)
    prompts = [[start + i, 1, 2] for i in range(num_rows)]
    completions = [list(range(2 + i)) for i in range(num_rows)]
    out = Rollout(prompts, completions, [[-0.5] * len(c) for c in completions], [i % 2 == 0 for i in range(num_rows)])
    if routes:
        out.routed_experts = [rng.integers(0, largest + 1, (len(p) + len(c) - 1, 3, 2)) for p, c in zip(prompts, completions)]
    return out


@pytest.mark.parametrize("largest", [255, 300], ids=["uint8", "int32"])
def test_routes_survive_json_exactly_in_the_narrowest_encoding(largest):
    rollout = _rollout(4, largest=largest)
    rollout.routed_experts[0][0, 0, 0] = largest  # the largest id decides the width
    encoded = json.loads(json.dumps(rollout.to_json(with_prompts=False)))
    assert encoded["routed_experts"]["dtype"] == ("uint8" if largest < 256 else "int32")
    back = Rollout.from_json(encoded, rollout.prompt_ids)
    assert back.completion_ids == rollout.completion_ids and back.is_truncated == rollout.is_truncated
    for a, b in zip(back.routed_experts, rollout.routed_experts):
        assert a.dtype == np.int64 and np.array_equal(a, b)
    assert decode_routes(encode_routes([])) == []


def test_concat_and_select_keep_each_rows_routes_with_it():
    a, b = _rollout(2, start=0), _rollout(3, start=10)
    both = Rollout.concat([a, Rollout.empty(), b])  # an engine with no prompts adds nothing, not a missing route
    assert len(both) == 5 and both.prompt_ids == a.prompt_ids + b.prompt_ids
    assert [r.shape for r in both.routed_experts] == [r.shape for r in a.routed_experts + b.routed_experts]
    picked = both.select([4, 0, 4])
    assert picked.prompt_ids == [b.prompt_ids[2], a.prompt_ids[0], b.prompt_ids[2]]
    assert np.array_equal(picked.routed_experts[1], a.routed_experts[0])
    assert np.array_equal(picked.routed_experts[2], b.routed_experts[2])
    assert Rollout.concat([a, _rollout(1, routes=False)]).routed_experts is None, "routes of some rows only: none"
    assert Rollout.concat([_rollout(2, routes=False)]).select([1]).routed_experts is None


def test_a_server_answer_with_routes_for_the_wrong_number_of_rows_is_refused():
    values = _rollout(3).to_json()
    values["routed_experts"]["rows"].pop()
    with pytest.raises(ValueError, match="2 rows of routed experts for 3 completions"):
        Rollout.from_json(values)
