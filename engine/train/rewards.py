"""Reward functions: resolving `reward.reward_funcs` strings, and calling the functions with TRL's contract.

Owns: turning config strings into callables (the built-in names of `BUILTIN_REWARDS`, `module:function` import
paths, local reward-model directories: `RewardModelReward`), TRL's display names, and `RewardFunctions`, which calls
every function on one batch (sync ones in turn, async ones concurrently) and returns the (B, K) reward tensor that
`engine.grpo.advantages.compute_advantages` takes. The built-in functions themselves are
engine/train/builtin_rewards.py's.

TRL's contract and where this engine is stricter: `RewardFunctions`; the built-in names and reward models:
`build_reward_funcs`.

Must not: define reward functions (engine/train/builtin_rewards.py), aggregate or normalise rewards
(engine/grpo/advantages.py), gather across ranks, log (the caller passes `MetricLogger.log_extra` / `log_metric` as
the hooks), or read the root config.

Test: `pytest tests/unit/test_rewards.py`.
"""

from __future__ import annotations

import asyncio
import difflib
import functools
import importlib
import inspect
import logging
import math
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from engine.train.builtin_rewards import (
    SoftOverlongPunishment,
    accuracy_reward,
    exact_match_reward,
    think_answer_format_reward,
    think_format_reward,
)
from engine.train.data import preview

if TYPE_CHECKING:
    from engine.config import GenerationConfig, RewardConfig

RewardFunc = Callable[..., Any]
logger = logging.getLogger(__name__)

RESERVED_KWARGS = ("trainer_state", "log_extra", "log_metric")
"""Keyword arguments the caller adds next to the dataset columns."""
EXCLUDED_COLUMNS = ("prompt", "completion", "completion_ids")
"""Dataset columns TRL does not hand to reward functions."""
SOFT_PUNISH_CACHE_FRACTION = 0.2
"""`length`: the soft-punishment zone is the last 20% of max_completion_length (DAPO used 4096 of 20480)."""


class RewardFunctionError(RuntimeError):
    """A reward function that cannot be resolved, raised, or returned something other than B floats / None."""


# ---------------------------------------------------------------------------------------------------------------
# built-in names


def _length_reward(generation_cfg: GenerationConfig | None) -> SoftOverlongPunishment:
    """`length`: the soft overlong punishment sized from generation.max_completion_length."""
    if generation_cfg is None:
        raise RewardFunctionError("the 'length' reward needs generation.max_completion_length: pass generation_cfg")
    max_len = generation_cfg.max_completion_length
    return SoftOverlongPunishment(max_len, max(1, round(SOFT_PUNISH_CACHE_FRACTION * max_len)))


BUILTIN_REWARDS: dict[str, Callable[[GenerationConfig | None], RewardFunc]] = {
    "accuracy": lambda gen: accuracy_reward,
    "exact_match": lambda gen: exact_match_reward,
    "think_format": lambda gen: think_format_reward,
    "think_answer_format": lambda gen: think_answer_format_reward,
    "length": _length_reward,
}
"""Config name -> factory of the reward function (the generation section sizes `length`)."""
_BUILTIN_ALIASES = {f"{name}_reward": name for name in BUILTIN_REWARDS if name != "length"} | {
    "soft_overlong_punishment": "length", "soft_overlong_punishment_reward": "length"}


# ---------------------------------------------------------------------------------------------------------------
# reward models (local directories, hub ids)


def _hub_reward_model(name: str, generation_cfg: GenerationConfig | None) -> RewardModelReward:
    """A reward model by hub id, from its local snapshot; `rewards/<last component of the id>/...` as in TRL."""
    from engine.models.hub import resolve_hub_model

    try:
        snapshot = resolve_hub_model(name)
    except ValueError as err:
        raise RewardFunctionError(f"reward function {name!r} (a reward model's hub id): {err}") from err
    reward = RewardModelReward(snapshot, generation_cfg.chat_template_kwargs if generation_cfg is not None else None)
    reward.__name__ = name.split("/")[-1]
    return reward



class RewardModelReward:
    """A sequence-classification reward model from a local directory, called like a reward function.

    Scores as TRL does for a `PreTrainedModel` reward (`GRPOTrainer._calculate_rewards`): text = prompt + completion (standard)
    or the chat template of prompt + completion messages (conversational); right padding, no special tokens added;
    reward = logits[:, 0]. The model stays on CPU until `.to(device)`.
    """

    def __init__(self, model_dir: str | Path, chat_template_kwargs: Mapping[str, Any] | None = None):
        from transformers import AutoModelForSequenceClassification, AutoTokenizer

        model_dir = Path(model_dir)
        self.__name__ = model_dir.resolve().name  # TRL: the model id's last path component
        self.tokenizer = AutoTokenizer.from_pretrained(model_dir)
        if self.tokenizer.pad_token is None:
            self.tokenizer.pad_token = self.tokenizer.eos_token
        self.model = AutoModelForSequenceClassification.from_pretrained(model_dir, num_labels=1).eval()
        self.model.config.pad_token_id = self.tokenizer.pad_token_id
        self.chat_template_kwargs = dict(chat_template_kwargs or {})

    def to(self, device: str | torch.device) -> RewardModelReward:
        """Move the model; returns self."""
        self.model.to(device)
        return self

    def __call__(self, prompts: list, completions: list, **kwargs) -> list[float]:
        if prompts and not isinstance(prompts[0], str):
            texts = [
                self.tokenizer.apply_chat_template(list(p) + list(c), tokenize=False, **self.chat_template_kwargs)
                for p, c in zip(prompts, completions, strict=True)
            ]
        else:
            texts = [p + c for p, c in zip(prompts, completions, strict=True)]
        inputs = self.tokenizer(text=texts, return_tensors="pt", padding=True, padding_side="right",
                                add_special_tokens=False)
        device = next(self.model.parameters()).device
        with torch.inference_mode():
            logits = self.model(**{k: v.to(device) for k, v in inputs.items()}).logits  # (B, 1)
        return logits[:, 0].float().tolist()


# ---------------------------------------------------------------------------------------------------------------
# resolving and naming


def resolve_reward_func(spec: str | RewardFunc, generation_cfg: GenerationConfig | None = None) -> RewardFunc:
    """One reward function from a config string or a callable.

    Args:
        spec: a callable (returned as is); a built-in name (`BUILTIN_REWARDS`, or its function name); a
            `module:function` import path (dots allowed after the colon: `module:Class.method`); a local
            directory holding a sequence-classification reward model; or such a model's hub id (`org/model`, TRL's
            `reward_funcs="org/model"`): the Hugging Face cache first, offline with HF_HUB_OFFLINE=1, else
            downloaded (engine/models/hub.py), named by the id's last component as TRL names it.
        generation_cfg: sizes `length` (max_completion_length) and renders reward-model chats (chat_template_kwargs).
    Returns:
        The callable.
    Raises:
        RewardFunctionError: unknown name (with suggestions), failed import, missing attribute, not callable, a hub
            id neither cached nor downloadable.
    """
    if isinstance(spec, torch.nn.Module):
        raise RewardFunctionError(f"reward model objects ({type(spec).__name__}) are not supported: save it with its "
                                  "tokenizer (save_pretrained) and pass the directory")
    if callable(spec):
        return spec
    if not isinstance(spec, str):
        raise RewardFunctionError(f"a reward function must be a callable or a str, got {type(spec).__name__}")
    name = _BUILTIN_ALIASES.get(spec, spec)
    if name in BUILTIN_REWARDS:
        return BUILTIN_REWARDS[name](generation_cfg)
    path = Path(spec).expanduser()
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise RewardFunctionError(f"reward function {spec!r}: the directory has no config.json (not a model)")
        kwargs = generation_cfg.chat_template_kwargs if generation_cfg is not None else None
        return RewardModelReward(path, kwargs)
    if ":" in spec:
        return _import_reward_func(spec)
    if spec.count("/") == 1 and not spec.startswith((".", "/", "~")):
        return _hub_reward_model(spec, generation_cfg)
    known = sorted(BUILTIN_REWARDS)
    close = difflib.get_close_matches(spec, known + sorted(_BUILTIN_ALIASES), n=1)
    hint = f" Did you mean {close[0]!r}?" if close else ""
    raise RewardFunctionError(
        f"unknown reward function {spec!r}.{hint} Use a built-in name ({', '.join(known)}), a 'module:function' "
        "import path, or a local reward-model directory."
    )


def _import_reward_func(spec: str) -> RewardFunc:
    return import_callable(spec, "reward function", RewardFunctionError)


def import_callable(spec: str, what: str = "callable", error: type[Exception] = ValueError) -> Callable:
    """`module:attr.attr` -> the object, with errors (of type `error`) that name `what` and the spec."""
    module_name, _, attr_path = spec.partition(":")
    if not module_name or not attr_path:
        raise error(f"{what} {spec!r}: expected 'module:function'")
    try:
        obj: Any = importlib.import_module(module_name)
    except ImportError as exc:
        raise error(f"{what} {spec!r}: cannot import module {module_name!r}: {exc}") from exc
    for attr in attr_path.split("."):
        if not hasattr(obj, attr):
            raise error(f"{what} {spec!r}: {module_name!r} has no attribute {attr_path!r}")
        obj = getattr(obj, attr)
    if not callable(obj):
        raise error(f"{what} {spec!r} is a {type(obj).__name__}, not a callable")
    return obj


def get_callable_name(func: RewardFunc) -> str:
    """TRL's display name: partials unwrapped, then `__name__`, else the class name (callable instances)."""
    while isinstance(func, functools.partial):
        func = func.func
    return getattr(func, "__name__", type(func).__name__)


def is_async_callable(func: RewardFunc) -> bool:
    """Whether calling `func` returns a coroutine (functions, partials, instances with an async `__call__`)."""
    while isinstance(func, functools.partial):
        func = func.func
    return inspect.iscoroutinefunction(func) or inspect.iscoroutinefunction(getattr(func, "__call__", None))


def _unique_names(names: Sequence[str]) -> list[str]:
    """Append _2, _3, ... to repeated names, in order."""
    seen: dict[str, int] = {}
    unique = []
    for name in names:
        seen[name] = seen.get(name, 0) + 1
        unique.append(name if seen[name] == 1 else f"{name}_{seen[name]}")
    return unique


# ---------------------------------------------------------------------------------------------------------------
# calling


def build_reward_funcs(reward_cfg: RewardConfig, generation_cfg: GenerationConfig | None = None) -> RewardFunctions:
    """The configured reward functions.

    Args:
        reward_cfg: the `reward` section (reward_funcs, reward_weights).
        generation_cfg: the `generation` section (sizes `length`, renders reward-model chats); optional.
    Returns:
        `RewardFunctions`.

    Built-in names for `reward.reward_funcs`: accuracy, exact_match, think_format, think_answer_format, length (also
    under their function names). `accuracy` needs the reference answer in an `answer` column (or TRL's `solution`).
    Reward models: a local directory with an `AutoModelForSequenceClassification` checkpoint and its tokenizer is
    supported (scored as TRL does: prompt + completion text, or the chat template of prompt + completion messages;
    reward = logits[:, 0]); so is a hub id (`org/model`): the HF cache first, offline with HF_HUB_OFFLINE=1.
    """
    return RewardFunctions(reward_cfg.reward_funcs, reward_cfg.reward_weights, generation_cfg)


class RewardFunctions:
    """K reward functions called on one batch of B completions with TRL's contract; returns (B, K) float32.

    Use as a context manager, or call `close()`, to stop the event-loop thread of async functions.

    Contract (TRL 1.16 `GRPOTrainer._calculate_rewards`):
        func(prompts=..., completions=..., completion_ids=..., **reward_kwargs) -> list[float | None]   (B values)
        reward_kwargs = every dataset column except prompt / completion / completion_ids, as B-long lists aligned with
        the rows (a prompt's row repeated for each of its G completions), plus `trainer_state`, `log_extra(column,
        values)` and `log_metric(name, value)`. Sync functions run one after the other in the caller's thread; async
        functions (`async def`, or a callable instance with an async `__call__`, or a partial of either) run
        concurrently with `asyncio.gather` on a daemon event-loop thread started only if one exists. `None` means "not
        applicable" and becomes NaN. Names are TRL's `get_callable_name` (partials unwrapped, instances by `__name__`
        or class name; reward models by the directory's last component).
    Differences from TRL, all stricter: a function that raises is re-run row by row to name the first failing row (its
    log_extra / log_metric calls are discarded during that search); a non-numeric or infinite value is an error naming
    the row, and so is NaN (TRL's nansum would read it as None: return None for that); a row no function scored gets
    TRL's warning (its words, with the dataset's columns) and advantage 0, as in TRL; a dataset column that collides with
    `trainer_state` / `log_extra` / `log_metric` is an error; two functions with the same name get `_2`, `_3` suffixes
    so their metrics do not overwrite each other.
    """

    def __init__(
        self,
        reward_funcs: Sequence[str | RewardFunc] | str | RewardFunc,
        reward_weights: Sequence[float] | None = None,
        generation_cfg: GenerationConfig | None = None,
    ):
        """Args:
            reward_funcs: config strings and/or callables (see `resolve_reward_func`); a single one is allowed.
            reward_weights: K weights or None (all 1.0).
            generation_cfg: see `resolve_reward_func`.
        """
        specs = [reward_funcs] if isinstance(reward_funcs, str) or callable(reward_funcs) else list(reward_funcs)
        if not specs:
            raise RewardFunctionError("no reward functions: GRPO needs at least one (reward.reward_funcs)")
        self.funcs: list[RewardFunc] = [resolve_reward_func(spec, generation_cfg) for spec in specs]
        self.names: list[str] = _unique_names([get_callable_name(f) for f in self.funcs])
        if reward_weights is not None and len(reward_weights) != len(self.funcs):
            raise RewardFunctionError(
                f"{len(reward_weights)} reward_weights for {len(self.funcs)} reward functions {self.names}"
            )
        self.weights = None if reward_weights is None else torch.tensor(list(reward_weights), dtype=torch.float32)
        self.last_timings_s: dict[str, float] = {}
        """Seconds each function took in the last call (async ones: until their gather finished)."""
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        if any(is_async_callable(f) for f in self.funcs):
            self._loop = asyncio.new_event_loop()
            self._thread = threading.Thread(target=self._loop.run_forever, name="reward-event-loop", daemon=True)
            self._thread.start()

    def __enter__(self) -> RewardFunctions:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        """Stop the event-loop thread (if any); idempotent."""
        if self._loop is not None and self._thread is not None:
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(timeout=10)
            self._loop.close()
        self._loop, self._thread = None, None

    def __call__(
        self,
        prompts: Sequence[Any],
        completions: Sequence[Any],
        completion_ids: Sequence[Sequence[int]],
        columns: Mapping[str, Sequence[Any]] | None = None,
        *,
        trainer_state: Any = None,
        log_extra: Callable[[str, list], None] | None = None,
        log_metric: Callable[[str, float], None] | None = None,
    ) -> torch.Tensor:
        """Score B completions with every function.

        Args:
            prompts: B prompts (a prompt repeated for each of its completions).
            completions: B completions: str, or [{"role": "assistant", "content": ...}] for conversational prompts.
            completion_ids: B lists of completion token ids.
            columns: the other dataset columns, B values each (`PromptBatch.columns`).
            trainer_state: handed to the functions as `trainer_state` (curricula).
            log_extra, log_metric: TRL's hooks (e.g. `MetricLogger.log_extra` / `.log_metric`); None = discarded.
        Returns:
            (B, K) float32 rewards, NaN where a function returned None; column k is `self.names[k]`.
        Raises:
            RewardFunctionError naming the function (and the row) on an exception or a malformed return value.
        """
        num_rows = len(prompts)
        if len(completions) != num_rows or len(completion_ids) != num_rows:
            raise ValueError(f"{num_rows} prompts, {len(completions)} completions, {len(completion_ids)} id lists")
        kwargs = _reward_kwargs(columns or {}, num_rows)
        kwargs.update(trainer_state=trainer_state, log_extra=log_extra or _discard, log_metric=log_metric or _discard)
        ids = [list(c) for c in completion_ids]
        base = dict(prompts=list(prompts), completions=list(completions), completion_ids=ids)
        rewards = torch.full((num_rows, len(self.funcs)), float("nan"), dtype=torch.float32)  # (B, K)
        self.last_timings_s = {}
        pending = []
        for k, func in enumerate(self.funcs):
            if is_async_callable(func):
                pending.append(k)
                continue
            start = time.perf_counter()
            try:
                output = func(**base, **kwargs)
            except Exception as exc:  # noqa: BLE001 - re-raised with the function and the row
                raise self._failure(k, exc, base, kwargs) from exc
            self.last_timings_s[self.names[k]] = time.perf_counter() - start
            rewards[:, k] = self._to_column(k, output, num_rows)
        if pending:
            for k, output in self._run_async(pending, base, kwargs):
                rewards[:, k] = self._to_column(k, output, num_rows)
        unscorable = torch.isnan(rewards).all(dim=1)  # (B,)
        if bool(unscorable.any()):
            self._warn_unscorable(int(unscorable.nonzero()[0, 0]), base, kwargs)
        return rewards

    def _warn_unscorable(self, row: int, base: dict, kwargs: dict) -> None:
        """TRL's warning (its words) for the first row no function scored; the row's advantage becomes 0."""
        row_kwargs = {key: value[row] for key, value in kwargs.items()
                      if key not in RESERVED_KWARGS and isinstance(value, list)}
        row_kwargs |= {"prompt": base["prompts"][row], "completion": base["completions"][row]}
        logger.warning(f"All reward functions returned None for the following kwargs:\n{row_kwargs}\nPlease ensure "
                       f"that at least one reward function returns a valid reward. (reward functions: "
                       f"{', '.join(self.names)}; a function that returns None when it cannot find its reference-"
                       f"answer column is the usual cause; dataset columns: {sorted(set(kwargs) - set(RESERVED_KWARGS))})")

    def _run_async(self, indices: list[int], base: dict, kwargs: dict) -> list[tuple[int, Any]]:
        """Run the async functions concurrently on the event-loop thread; (k, output) in order."""
        start = time.perf_counter()

        async def one(k: int):
            try:
                return k, await self.funcs[k](**base, **kwargs), None
            except Exception as exc:  # noqa: BLE001 - reported below with the row
                return k, None, exc

        async def gather():
            return await asyncio.gather(*(one(k) for k in indices))

        assert self._loop is not None
        results = asyncio.run_coroutine_threadsafe(gather(), self._loop).result()
        for k, _, exc in results:
            self.last_timings_s[self.names[k]] = time.perf_counter() - start
            if exc is not None:
                raise self._failure(k, exc, base, kwargs) from exc
        return [(k, output) for k, output, _ in results]

    def _call_one(self, k: int, base: dict, kwargs: dict) -> Any:
        """Call function k (sync, or async on the loop) and return its output."""
        output = self.funcs[k](**base, **kwargs)
        if asyncio.iscoroutine(output) and self._loop is not None:
            output = asyncio.run_coroutine_threadsafe(output, self._loop).result()
        return output

    def _failure(self, k: int, exc: Exception, base: dict, kwargs: dict) -> RewardFunctionError:
        """The error for function k raising `exc`: re-run it row by row to find the first row that fails."""
        num_rows = len(base["prompts"])
        where = f"on a batch of {num_rows} completions (it did not fail on any single row)"
        for i in range(num_rows):
            row_base = {key: values[i : i + 1] for key, values in base.items()}
            row_kwargs = {key: (v[i : i + 1] if key not in RESERVED_KWARGS else v) for key, v in kwargs.items()}
            row_kwargs.update(log_extra=_discard, log_metric=_discard)
            try:
                self._call_one(k, row_base, row_kwargs)
            except Exception:  # noqa: BLE001 - this is the row we are looking for
                where = (f"on row {i} of {num_rows} (prompt {preview(base['prompts'][i], 80)}, completion "
                         f"{preview(base['completions'][i], 80)})")
                break
        columns = sorted(key for key in kwargs if key not in RESERVED_KWARGS)
        return RewardFunctionError(
            f"reward function {self.names[k]!r} (reward_funcs[{k}]) raised {type(exc).__name__}: {exc} {where}; "
            f"dataset columns it received: {columns}"
        )

    def _to_column(self, k: int, output: Any, num_rows: int) -> torch.Tensor:
        """Check one function's output (B floats or None) and turn it into a (B,) float32 column, None -> NaN."""
        name = f"reward function {self.names[k]!r} (reward_funcs[{k}])"
        if isinstance(output, torch.Tensor):
            output = output.detach().cpu().flatten().tolist()
        if isinstance(output, (str, bytes)) or not isinstance(output, Sequence) and not hasattr(output, "tolist"):
            raise RewardFunctionError(f"{name} returned a {type(output).__name__}; it must return a list of "
                                      f"{num_rows} floats (or None per not-applicable row)")
        values = list(output.tolist() if hasattr(output, "tolist") else output)
        if len(values) != num_rows:
            raise RewardFunctionError(f"{name} returned {len(values)} rewards for {num_rows} completions; it must "
                                      "return exactly one reward (or None) per completion")
        column = []
        for i, value in enumerate(values):
            if value is None:
                column.append(float("nan"))
                continue
            try:
                number = float(value)
            except (TypeError, ValueError):
                number = None
            if number is None or isinstance(value, str) or math.isinf(number):
                raise RewardFunctionError(f"{name} returned {value!r} for row {i}; a reward must be a finite "
                                          "number, or None when the function does not apply to the row")
            if math.isnan(number):  # NOTE: TRL's nansum would silently read it as None
                raise RewardFunctionError(f"{name} returned NaN for row {i} (a 0/0 or a failed parse?); a reward "
                                          "must be a finite number: return None, not NaN, when the function does "
                                          "not apply to the row")
            column.append(number)
        return torch.tensor(column, dtype=torch.float32)


def _reward_kwargs(columns: Mapping[str, Sequence[Any]], num_rows: int) -> dict[str, list]:
    """The dataset columns TRL hands to reward functions, checked for length and name collisions."""
    kwargs = {}
    for key, values in columns.items():
        if key in EXCLUDED_COLUMNS:
            continue
        if key in RESERVED_KWARGS:
            raise RewardFunctionError(f"dataset column {key!r} collides with the reward keyword argument {key!r}; "
                                      "rename the column")
        values = list(values)
        if len(values) != num_rows:
            raise ValueError(f"dataset column {key!r} has {len(values)} values for {num_rows} completions")
        kwargs[key] = values
    return kwargs


def _discard(*args: Any) -> None:
    """The default log_extra / log_metric hook: drops what it is given."""
