"""Multi-turn generation through a `RolloutEngine` (engine/rollout/protocol.py), the same scenario for both
implementations: tests/integration/test_weight_sync.py (colocated) and tests/integration/test_rollout_server.py
(two servers)."""

from engine.rollout.protocol import TurnRequest

PROMPTS = {"a": [5, 6, 7], "b": [8, 9, 10, 11]}
MAX_TOKENS = {"a": 3, "b": 8, "a2": 4}
TOOL_TOKENS = [12, 13]
"""Stand-in for a tool message's tokens, appended to sample a's first turn before its second."""


def run_turns(engine, temperature: float) -> dict:
    """Samples a and b start together; as soon as a's first turn is back, its second turn (a's prompt + that turn's
    tokens + `TOOL_TOKENS`) is submitted while b may still run. Returns the keys collected, each turn's length and
    budget, and the largest gap between a turn's sampled-token log-probs and the engine's prompt log-probs of the
    same tokens after the same context (small only if each turn continued exactly the token ids it was given)."""
    prompts = dict(PROMPTS)
    for key, seed in (("a", 1), ("b", 2)):
        engine.submit_turn(TurnRequest(key, prompts[key], max_tokens=MAX_TOKENS[key], seed=seed))
    done = {}
    while len(done) < 3:
        finished = engine.collect_turns(timeout_s=120)
        assert finished, f"no turn finished; done so far: {sorted(done)}"
        for result in finished:
            done[result.key] = result
            if result.key == "a":
                prompts["a2"] = prompts["a"] + result.completion_ids + TOOL_TOKENS
                engine.submit_turn(TurnRequest("a2", prompts["a2"], max_tokens=MAX_TOKENS["a2"], seed=3))
    keys = ["a", "b", "a2"]
    sequences = [prompts[k] + done[k].completion_ids for k in keys]
    held = engine.prompt_logprobs(sequences, temperature)
    gap = 0.0
    for k, row in zip(keys, held):
        turn = done[k].sampling_logprobs
        gap = max([gap] + [abs(a - b) for a, b in zip(turn, row[len(prompts[k]) - 1:])])
    return {"keys": sorted(done), "lengths": {k: len(done[k].completion_ids) for k in keys},
            "within_budget": all(0 < len(done[k].completion_ids) <= MAX_TOKENS[k] for k in keys),
            "logprob_gap": gap, "a2_prompt": prompts["a2"]}
