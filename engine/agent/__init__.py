"""Multi-turn (agentic) rollouts, TRL's `tools=` / `environment_factory=` / `rollout_func=`: the tool
calls a completion makes and the tokens of a tool message (chat_tokens.py), the tools themselves, run concurrently
in a bounded pool with a per-call timeout (toolbox.py), the environments pooled and reset per rollout
(environments.py), the loop that advances every sample on its own through the engine's `submit_turn` /
`collect_turns` (multi_turn.py), and the user's own rollout function checked against TRL's contract
(rollout_func.py).

May import: engine.config, engine.rollout.
"""
