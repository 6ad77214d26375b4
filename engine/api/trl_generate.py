"""TRL's rollout-dispatch seam on `GRPOTrainer`: the private `_generate(prompts)` and `_generate_single_turn(...)`,
with TRL 1.16's signatures and return shapes, and a user's override of either acting over the engine's rollout.

Owns:
- `generate`: TRL's `_generate`: `rollout_func(prompts, trainer)` when the trainer has one (TRL's key check and
  message; weights synced first when the step moved, as TRL), else `_generate_single_turn` on the prompts tokenized
  as the engine tokenizes dataset prompts; returns TRL's 8-tuple `(prompt_ids, completion_ids, tool_mask,
  completions, logprobs, extra_fields, images, tool_images)`.
- `generate_single_turn`: one completion per row from the engine's vLLM engine, which exists only inside a round
  of `train()` / `evaluate()` (engine/agent/rollout_func.py `current_round`); outside one, an error.
- `dispatch_override`: a class overriding either method gets a `rollout_func(prompts, trainer)` calling it, which
  the loop calls each round instead of its own generation (rank 0, the user's process: TRL's `rollout_func` seam,
  engine/agent/agentic_rollout.py); its rows train. Chosen at construction (`patched_since_construction`).
- `EngineWeightSync`: `trainer.vllm_generation`; `sync_weights()` has nothing to do (vLLM is synced every round).

Differences from TRL: text models only; the rewards see the completions decoded from the returned ids, not the
returned `completions`; the completion metrics are the engine's, computed from the rollout the loop receives.

Must not: import vLLM or Megatron, or run the loop. Test: tests/unit/test_trl_generate.py,
tests/integration/test_agentic.py (an override over a real run).
"""

from __future__ import annotations

import copy
from typing import Any

REQUIRED_KEYS = ("prompt_ids", "completion_ids", "logprobs")
"""What TRL requires of `rollout_func`'s dict."""

DISPATCH_METHODS = ("_generate", "_generate_single_turn")
"""TRL's private generation methods a subclass may override (GRPOTrainer binds `generate` / `generate_single_turn`)."""


class EngineWeightSync:
    """`trainer.vllm_generation`: TRL's generation backend handle, as far as `_generate` uses it."""

    def sync_weights(self) -> None:
        """Nothing to do: the engine syncs the policy into vLLM at every round's end (engine/train/loop.py), so
        the weights vLLM holds when a round generates are already the trainer's."""


def generate(trainer: Any, prompts: list) -> tuple:
    """TRL's `GRPOTrainer._generate` (module docstring). `prompts`: one per row (G copies of each prompt in a
    round). Raises ValueError with TRL's message when `rollout_func`'s dict lacks a required key."""
    prompts = copy.deepcopy(prompts)
    rollout_func = getattr(trainer, "rollout_func", None)
    if rollout_func is not None:
        if getattr(trainer, "use_vllm", False) and trainer.state.global_step != trainer._last_loaded_step:
            trainer.vllm_generation.sync_weights()
            trainer._last_loaded_step = trainer.state.global_step
        output = rollout_func(prompts, trainer)
        missing = sorted(set(REQUIRED_KEYS) - set(output))
        if missing:
            raise ValueError(f"rollout_func must return keys {missing} in its output dict.")
        extra_fields = {k: v for k, v in output.items() if k not in REQUIRED_KEYS}
        prompt_ids, completion_ids, logprobs = (output[k] for k in REQUIRED_KEYS)
        tool_mask = extra_fields.pop("env_mask", None)  # TRL: env_mask is the tool mask (1 = the model's tokens)
    else:
        prompt_ids = tokenize_prompts(trainer, prompts)
        completion_ids, logprobs = trainer._generate_single_turn(prompt_ids, None, {}, _num_generations(trainer))
        extra_fields, tool_mask = {}, None
    texts = trainer.processing_class.batch_decode(completion_ids, skip_special_tokens=True)
    conversational = bool(prompts) and isinstance(prompts[0], list)
    completions = [[{"role": "assistant", "content": t}] for t in texts] if conversational else list(texts)
    return prompt_ids, completion_ids, tool_mask, completions, logprobs, extra_fields, None, []


def generate_single_turn(trainer: Any, prompt_ids: list, images: Any, multimodal_fields: dict | None,
                         num_generations: int, has_tool_images: bool = False) -> tuple[list, list]:
    """TRL's `GRPOTrainer._generate_single_turn`: one completion per row of `prompt_ids` by the engine's vLLM
    engine, `(completion_ids, logprobs)` (the sampling log-prob of each token, after temperature). Rows that are G
    consecutive copies of the round's prompts get the seeds the engine's own generation would use.

    Raises:
        NotImplementedError: images or multimodal fields (text models only).
        RuntimeError: called outside a round of train() / evaluate(), where no vLLM engine runs.
    """
    from engine.agent.multi_turn import MultiTurnSettings, Sample, generate_multi_turn
    from engine.agent.rollout_func import current_round
    from engine.agent.toolbox import Toolbox

    if images is not None or multimodal_fields or has_tool_images:
        raise NotImplementedError("_generate_single_turn: images / multimodal fields are not supported (text "
                                  "models only)")
    live = current_round()
    if live is None:
        raise RuntimeError("_generate_single_turn (and _generate without rollout_func) generate with the engine's "
                           "vLLM engine, which runs only inside a round of train() / evaluate(): call it from an "
                           "override of _generate / _generate_single_turn, or pass rollout_func")
    g = live.num_generations
    same_rows = live.seeds is not None and len(prompt_ids) == len(live.seeds) * g
    seeds = [(live.seeds[i // g] * 1009 + i % g) % 2**31 if same_rows else None for i in range(len(prompt_ids))]
    toolbox = Toolbox([], max_concurrent=1, timeout_s=None)
    try:
        rollout, _ = generate_multi_turn(live.engine, [Sample(list(ids), seed) for ids, seed in zip(prompt_ids, seeds)],
                                         trainer.processing_class, toolbox,
                                         MultiTurnSettings(live.max_completion_length, 0),  # 0 tool rounds: one turn
                                         live.cancelled)
    finally:
        toolbox.close()
    return rollout.completion_ids, rollout.sampling_logprobs


def tokenize_prompts(trainer: Any, prompts: list) -> list[list[int]]:
    """The prompts' token ids as the engine tokenizes dataset prompts (engine/train/data.py `prepare_prompts`:
    TRL's way, with `chat_template_kwargs`); a prompt over max_prompt_length is an error, never truncated."""
    import datasets

    from engine.train.data import PROMPT_IDS_COLUMN, prepare_prompts

    cfg = trainer.engine_config
    prepared = prepare_prompts(datasets.Dataset.from_dict({"prompt": prompts}), trainer.processing_class,
                               max_prompt_length=cfg.data.max_prompt_length, overlong_prompt_policy="error",
                               chat_template_kwargs=cfg.generation.chat_template_kwargs)
    return [list(ids) for ids in prepared.dataset[PROMPT_IDS_COLUMN]]


def _num_generations(trainer: Any) -> int:
    from engine.agent.rollout_func import current_round

    live = current_round()
    return live.num_generations if live is not None else trainer.engine_config.grpo.num_generations


def overridden(trainer_class: type) -> list[str]:
    """The dispatch methods `trainer_class` overrides (a user's subclass of GRPOTrainer, which binds this
    module's functions), in TRL's call order."""
    own = {"_generate": generate, "_generate_single_turn": generate_single_turn}
    return [name for name in DISPATCH_METHODS if getattr(trainer_class, name, None) is not own[name]]


def patched_since_construction(trainer: Any, at_construction: list[str]) -> None:
    """RuntimeError when a dispatch method was overridden after construction (on the class, or assigned on the
    instance, e.g. `unittest.mock.patch.object`) of a trainer built without one: its rollout is the engine's own,
    chosen then, so the patch would silently not act. (Built with one, every round calls `trainer._generate`
    afresh, so later patches act.)"""
    now = [n for n in DISPATCH_METHODS if n in vars(trainer) or n in overridden(type(trainer))]
    if now and not at_construction:
        raise RuntimeError(f"{', '.join(now)} changed on the trainer after "
                           "GRPOTrainer(...) was built: the rollout is chosen at construction, so override "
                           "_generate / _generate_single_turn in a subclass (or patch the class) before building it")


def dispatch_override(trainer: Any, rollout_func: Any, tools: Any, environment_factory: Any) -> Any:
    """The `rollout_func` the engine gets: the user's as given when no dispatch method is overridden, else
    `_as_rollout_func(trainer)` (which calls the override; a `rollout_func` given too is reached through TRL's
    `_generate`). Raises ValueError for an override together with tools / environment_factory (the engine's
    multi-turn loop would replace `_generate`'s). The override runs on rank 0 (colocated at vLLM TP > 1 the other
    ranks of its vLLM TP group mirror its engine steps: engine/rollout/colocated_turns.py). With rounds generated
    ahead (`rollout.max_staleness` > 0) the override runs as any rollout_func does then: in rank 0's background thread, on a view of the trainer
    (engine/api/trl_agentic.py `BoundRolloutFunc.for_round_ahead`)."""
    names = overridden(type(trainer))
    if not names:
        return rollout_func
    which = " and ".join(f"{type(trainer).__name__}.{n}" for n in names)
    if tools or environment_factory is not None:
        raise ValueError(f"{which} overrides TRL's rollout dispatch, but tools / environment_factory make the "
                         "engine run its own multi-turn loop instead: drop the override or the agentic arguments")
    return _as_rollout_func


def _as_rollout_func(prompts: list, trainer: Any) -> dict:
    """`trainer._generate(prompts)` (the user's override, or TRL's `_generate` calling an overridden
    `_generate_single_turn`) as the dict of TRL's `rollout_func` contract that engine/agent/rollout_func.py
    checks and trains from: its `tool_mask` as `env_mask`, its extra fields as reward-function columns."""
    result = trainer._generate(prompts)
    if not isinstance(result, tuple) or len(result) != 8:
        raise ValueError(f"{type(trainer).__name__}._generate must return TRL's 8-tuple (prompt_ids, completion_ids, "
                         "tool_mask, completions, logprobs, extra_fields, images, tool_images), got "
                         f"{type(result).__name__}{f' of {len(result)}' if isinstance(result, tuple) else ''}")
    prompt_ids, completion_ids, tool_mask, _completions, logprobs, extra_fields, images, tool_images = result
    if images is not None or tool_images:
        raise NotImplementedError(f"{type(trainer).__name__}._generate returned images: text models only")
    if logprobs is None:
        raise ValueError(f"{type(trainer).__name__}._generate returned logprobs=None: the engine needs the sampling "
                         "log-prob of every completion token (its importance-sampling correction and old log-probs)")
    output = {"prompt_ids": prompt_ids, "completion_ids": completion_ids, "logprobs": logprobs,
              **dict(extra_fields or {})}
    if tool_mask is not None:
        output["env_mask"] = tool_mask
    return output
