"""One generate call's completions (`Rollout`) and the MoE routes that travel with them.

Owns: `Rollout` (prompt-major rows: prompt ids, completion ids, the engine's sampled-token log-probs, truncation,
for multi-turn rows the tool mask (0 on tool tokens: in the context, no gradient), and for MoE policies the experts
the engine routed every token to), its row operations (`concat`, `select`), its
JSON form (`to_json` / `from_json`: HTTP answers of the rollout server, async-rollout rounds in checkpoints), the
routes' compact encoding (`encode_routes` / `decode_routes`: base64 of the narrowest integer type, because a round's
routes are tokens x layers x top-k ids: as JSON lists they would dwarf everything else), and whether an engine
returns routes and one completion's routes from vLLM's output (`wants_routed_experts`, `routes_of`).

Routes of one row: an integer array [n, L, k]: for each of the first n tokens of prompt + completion (n = prompt +
completion - 1: the last sampled token is never fed to the model), for each of the L decoder layers (global index;
dense layers hold whatever the engine reports, the trainer reads MoE layers only), the top-k expert ids the engine's
router picked. This is vLLM's `CompletionOutput.routed_experts` layout. engine/policy/routing_replay.py replays or
compares them.

Must not: import vLLM (engine/rollout/vllm_engine.py fills `routed_experts`), or know the trainer's micro-batch layout.

Test: tests/unit/test_rollouts.py.
"""

from __future__ import annotations

import base64
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from engine.models.families import has_routed_experts

if TYPE_CHECKING:
    from engine.config import RolloutConfig

ROW_FIELDS = ("prompt_ids", "completion_ids", "sampling_logprobs", "is_truncated")
"""The per-row fields every rollout has (`routed_experts` is optional)."""


@dataclass
class Rollout:
    """Completions of one generate call: rows are prompt-major (prompt 0's G completions first)."""

    prompt_ids: list[list[int]]
    completion_ids: list[list[int]]
    sampling_logprobs: list[list[float]]
    """The engine's log-prob of each sampled token, after temperature."""
    is_truncated: list[bool]
    """True when the completion hit max_completion_length without a stop token."""
    stats: dict[str, float] = field(default_factory=dict)
    routed_experts: list[np.ndarray] | None = None
    """MoE: per row, the engine's routed experts [prompt + completion - 1, layers, top-k] (integer array), for routing
    replay (engine/policy/routing_replay.py). None when the engine was not asked for routes."""
    tool_mask: list[list[int]] | None = None
    """Multi-turn rows (engine/agent/): per row, one 0/1 per completion token, 0 on the tokens of tool messages
    (they are context, never trained on); TRL's `tool_mask`. None = every completion token is the model's."""

    def __len__(self) -> int:
        return len(self.completion_ids)

    @classmethod
    def empty(cls) -> Rollout:
        return cls([], [], [], [])

    @classmethod
    def concat(cls, parts: list[Rollout]) -> Rollout:
        """The rows of `parts`, in order. Routes are kept only when every non-empty part has them (all engines of a
        run are asked alike; a part without them is an engine that was not)."""
        out = cls.empty()
        for part in parts:
            for name in ROW_FIELDS:
                getattr(out, name).extend(getattr(part, name))
        filled = [p for p in parts if len(p)]
        if filled and all(p.routed_experts is not None for p in filled):
            out.routed_experts = [r for p in filled for r in p.routed_experts]
        if any(p.tool_mask is not None for p in filled):  # a part without one: all its tokens are the model's
            out.tool_mask = [m for p in filled for m in (p.tool_mask or [[1] * len(c) for c in p.completion_ids])]
        return out

    def select(self, rows: list[int]) -> Rollout:
        """The rows `rows` (indices, any order, repeats allowed)."""
        pick = lambda values: [values[i] for i in rows]  # noqa: E731
        out = Rollout(*(pick(getattr(self, name)) for name in ROW_FIELDS))
        if self.routed_experts is not None:
            out.routed_experts = pick(self.routed_experts)
        if self.tool_mask is not None:
            out.tool_mask = pick(self.tool_mask)
        return out

    def to_json(self, with_prompts: bool = True) -> dict:
        """JSON values (the routes base64-encoded; `with_prompts=False` leaves the prompt ids out: the server's
        answer, whose client knows them)."""
        out = {name: getattr(self, name) for name in ROW_FIELDS if with_prompts or name != "prompt_ids"}
        if self.routed_experts is not None:
            out["routed_experts"] = encode_routes(self.routed_experts)
        if self.tool_mask is not None:
            out["tool_mask"] = self.tool_mask
        return out

    @classmethod
    def from_json(cls, values: dict, prompt_ids: list[list[int]] | None = None) -> Rollout:
        """Inverse of `to_json`; `prompt_ids` when the values carry none."""
        prompts = values["prompt_ids"] if prompt_ids is None else prompt_ids
        out = cls(prompts, *(values[name] for name in ROW_FIELDS[1:]))
        if values.get("routed_experts") is not None:
            out.routed_experts = decode_routes(values["routed_experts"])
        out.tool_mask = values.get("tool_mask")
        if len(out.routed_experts or out.completion_ids) != len(out.completion_ids):
            raise ValueError(f"{len(out.routed_experts)} rows of routed experts for {len(out.completion_ids)} completions")
        return out


def encode_routes(routes: list[np.ndarray]) -> dict:
    """{"dtype", "layers", "top_k", "rows": [base64 of each row's [n, L, k] ids]} (uint8 when every id fits)."""
    arrays = [np.asarray(r) for r in routes]
    shapes = {a.shape[1:] for a in arrays if a.size}
    if len(shapes) > 1:
        raise ValueError(f"routed experts of different (layers, top-k) shapes in one rollout: {sorted(shapes)}")
    layers, top_k = shapes.pop() if shapes else (0, 0)
    largest = max((int(a.max()) for a in arrays if a.size), default=0)
    dtype = np.uint8 if largest < 256 else np.int32
    rows = [base64.b64encode(np.ascontiguousarray(a, dtype=dtype).tobytes()).decode("ascii") for a in arrays]
    return {"dtype": np.dtype(dtype).name, "layers": layers, "top_k": top_k, "rows": rows}


def decode_routes(encoded: dict) -> list[np.ndarray]:
    """Inverse of `encode_routes`: one int64 array [n, L, k] per row."""
    dtype, layers, top_k = np.dtype(encoded["dtype"]), int(encoded["layers"]), int(encoded["top_k"])
    out = []
    for row in encoded["rows"]:
        flat = np.frombuffer(base64.b64decode(row), dtype=dtype).astype(np.int64)
        out.append(flat.reshape(-1, layers, top_k) if layers else flat.reshape(0, 0, 0))
    return out


def wants_routed_experts(rollout: RolloutConfig, model_dir: str | Path) -> bool:
    """Whether the engine returns routed experts: `rollout.vllm_return_routed_experts`, None = for MoE models (the
    model directory's config.json names routed experts)."""
    if rollout.vllm_return_routed_experts is not None:
        return rollout.vllm_return_routed_experts
    config = Path(model_dir) / "config.json"
    if not config.is_file():
        return False
    return has_routed_experts(json.loads(config.read_text()))  # Nemotron-H: by its layer kinds


def routes_of(fed: list[int], completion, captured: dict | None, row: int):
    """The routed experts [len(fed), L, k] of one completion (`fed`: prompt + completion without its last token,
    the tokens the engine ran), from vLLM's output or this project's recorder (keyed by the fed tokens)."""
    if captured is None:
        routes = getattr(completion, "routed_experts", None)
    else:
        routes = captured.get(tuple(fed))
    if routes is None:
        raise RuntimeError(f"the engine returned no routed experts for completion row {row} ({len(fed)} tokens run)")
    routes = np.asarray(routes)
    if routes.shape[0] < len(fed):
        raise RuntimeError(f"the engine's routed experts of completion row {row} cover {routes.shape[0]} of the "
                           f"{len(fed)} tokens it ran")
    return routes[: len(fed)]
