"""The built-in reward functions: each a plain function (or a picklable class) with TRL's reward-function signature,
`func(completions=..., **kwargs) -> list[float | None]`, one value per completion.

Owns: `accuracy_reward` (math-verify, as TRL's `accuracy_reward` for completions without an answer tag),
`exact_match_reward`, `think_format_reward` (TRL's pattern), `think_answer_format_reward` (the builtin arithmetic
task's format), `SoftOverlongPunishment` (DAPO's soft overlong punishment, the `length` reward), and what they share:
`completion_text` (the text of a str or conversational completion) and `extract_answer` (the last
`<answer>...</answer>`).

Must not: resolve config names or call functions on a batch (engine/train/rewards.py maps `reward.reward_funcs`
names to these and calls them with TRL's contract), aggregate rewards, or log (the `log_extra` hook is the caller's).

Test: `pytest tests/unit/test_rewards.py` (hand-made completions; equality with TRL's `accuracy_reward` and
`think_format_reward`).
"""

from __future__ import annotations

import logging
import math
import re
import threading
from collections.abc import Callable, Mapping
from typing import Any


def completion_text(completion: Any) -> str:
    """The text of one completion: a str as is; for a conversational completion (a list of messages) the content
    of the last assistant message (text parts joined when the content is a list of blocks)."""
    if isinstance(completion, str):
        return completion
    messages = [m for m in completion if isinstance(m, dict)]
    assistant = [m for m in messages if m.get("role", "assistant") == "assistant"] or messages
    if not assistant:
        return ""
    content = assistant[-1].get("content") or ""
    if isinstance(content, list):
        content = "".join(part.get("text", "") for part in content if isinstance(part, dict))
    return str(content)


_ANSWER_TAG = re.compile(r"<answer>(.*?)</answer>", re.DOTALL)


def extract_answer(text: str) -> str | None:
    """The content of the last `<answer>...</answer>` in `text`, stripped; None when there is none."""
    found = _ANSWER_TAG.findall(text)
    return found[-1].strip() if found else None


def _reference_answers(kwargs: Mapping[str, Any], func_name: str) -> list[Any]:
    """The `answer` column (or TRL's `solution`), with an error that lists what was there."""
    for column in ("answer", "solution"):
        if column in kwargs:
            return list(kwargs[column])
    columns = sorted(k for k, v in kwargs.items() if isinstance(v, (list, tuple)))  # not trainer_state / the hooks
    raise KeyError(f"{func_name} needs the reference answer in an 'answer' (or 'solution') column; columns: {columns}")


def accuracy_reward(completions: list, log_extra: Callable | None = None, **kwargs) -> list[float | None]:
    """1.0 if the completion's answer is mathematically equal to the reference answer, else 0.0 (math-verify).

    The answer is the last `<answer>...</answer>` when the completion has one (parsed as a number / expression /
    LaTeX); otherwise, as TRL's `accuracy_reward`, a LaTeX answer in the whole completion (\\boxed{} first, no
    anchor-less extraction). A reference answer math-verify cannot parse gives None (not applicable).

    Args:
        completions: B completions (str or message lists).
        log_extra: TRL's hook; receives the `gold_parsed` and `answer_parsed` columns.
        **kwargs: must hold `answer` (or `solution`): B reference answers.
    Returns:
        B floats or None.
    """
    from latex2sympy2_extended import NormalizationConfig
    from math_verify import LatexExtractionConfig, parse, verify

    answers = _reference_answers(kwargs, "accuracy_reward")
    # NOTE: math-verify's timeouts use signal.alarm, which works only in the main thread (as TRL does).
    in_main = threading.current_thread() is threading.main_thread()
    parse_timeout, verify_timeout = (10, 5) if in_main else (None, None)
    if not in_main:
        logging.getLogger("math_verify").setLevel(logging.ERROR)
    latex_only = [LatexExtractionConfig(
        normalization_config=NormalizationConfig(units=True), boxed_match_priority=0, try_extract_without_anchor=False
    )]
    rewards: list[float | None] = []
    gold_strs, answer_strs = [], []
    for completion, answer in zip(completions, answers, strict=True):
        gold = parse(str(answer), parsing_timeout=parse_timeout) if answer is not None else []
        if not gold:
            rewards.append(None)
            gold_strs.append("[unparseable]")
            answer_strs.append("[skipped]")
            continue
        text = completion_text(completion)
        tagged = extract_answer(text)
        if tagged is not None:
            predicted = parse(tagged, parsing_timeout=parse_timeout)
        else:
            predicted = parse(text, extraction_config=latex_only, extraction_mode="first_match",
                              parsing_timeout=parse_timeout)
        rewards.append(float(verify(gold, predicted, timeout_seconds=verify_timeout)) if predicted else 0.0)
        gold_strs.append(str(gold))
        answer_strs.append(str(predicted) if predicted else "[unparseable]")
    if log_extra is not None:
        log_extra("gold_parsed", gold_strs)
        log_extra("answer_parsed", answer_strs)
    return rewards


def reasoning_accuracy_reward(completions: list, log_extra: Callable | None = None,
                              reasoning_delimiters: list[str] | None = None, **kwargs) -> list[float | None]:
    """`accuracy_reward` on what follows the reasoning: the text after the last reasoning delimiter (`</think>` by
    default), as TRL's `reasoning_accuracy_reward`; a completion whose reasoning never ends scores 0.0 (a boxed
    answer inside unfinished reasoning does not count). An unparseable reference answer gives None."""
    delimiters = reasoning_delimiters or ["</think>"]
    finals, finished = [], []
    for completion in completions:
        text = completion_text(completion)
        cut = max((text.rfind(d) + len(d) for d in delimiters if d in text), default=-1)
        finished.append(cut >= 0)
        finals.append(text[cut:] if cut >= 0 else "")
    scores = accuracy_reward(finals, log_extra=log_extra, **kwargs)
    return [score if done or score is None else 0.0 for score, done in zip(scores, finished)]


def exact_match_reward(completions: list, **kwargs) -> list[float | None]:
    """1.0 if the last `<answer>...</answer>` equals the reference answer, else 0.0 (no verifier needed).

    Both sides are stripped; when both read as numbers they are compared as numbers ("19.0" == "19").
    A missing reference (None) gives None; a completion without an answer tag gets 0.0.

    Args:
        completions: B completions (str or message lists).
        **kwargs: must hold `answer` (or `solution`).
    Returns:
        B floats or None.
    """
    rewards: list[float | None] = []
    for completion, answer in zip(completions, _reference_answers(kwargs, "exact_match_reward"), strict=True):
        if answer is None:
            rewards.append(None)
            continue
        predicted = extract_answer(completion_text(completion))
        rewards.append(float(predicted is not None and _same_answer(predicted, str(answer).strip())))
    return rewards


def _same_answer(predicted: str, reference: str) -> bool:
    """String equality, or numeric equality when both parse as floats."""
    if predicted == reference:
        return True
    try:
        return math.isclose(float(predicted), float(reference), rel_tol=0.0, abs_tol=1e-9)
    except ValueError:
        return False


_THINK_FORMAT = re.compile(r"^<think>(?!.*<think>)(.*?)</think>.*$", re.DOTALL | re.MULTILINE)
_THINK_ANSWER_FORMAT = re.compile(
    r"^<think>(?!.*<think>).*?</think>\s*<answer>(?!.*<answer>).*?</answer>$", re.DOTALL
)


def think_format_reward(completions: list, **kwargs) -> list[float]:
    """1.0 if the completion starts with one `<think>...</think>` block, else 0.0 (TRL's `think_format_reward`,
    after stripping leading whitespace: a completion of "Answer:" usually starts with a space).

    Args:
        completions: B completions (str or message lists).
    Returns:
        B floats.
    """
    return [1.0 if _THINK_FORMAT.match(completion_text(c).lstrip()) else 0.0 for c in completions]


def think_answer_format_reward(completions: list, **kwargs) -> list[float]:
    """1.0 if the completion is exactly `<think>...</think> <answer>...</answer>` (whitespace around allowed,
    one of each tag), else 0.0: the builtin arithmetic task's format.

    Args:
        completions: B completions (str or message lists).
    Returns:
        B floats.
    """
    return [1.0 if _THINK_ANSWER_FORMAT.match(completion_text(c).strip()) else 0.0 for c in completions]


class SoftOverlongPunishment:
    """DAPO's soft overlong punishment (arXiv:2503.14476 eq. 13; TRL's `get_soft_overlong_punishment`), in tokens:
    0 up to L_max - L_cache, then linearly down to -1 at L_max, -1 beyond. A class, not a closure, so it pickles."""

    __name__ = "soft_overlong_punishment_reward"  # TRL's metric name

    def __init__(self, max_completion_len: int, soft_punish_cache: int):
        if not 0 <= soft_punish_cache <= max_completion_len:
            raise ValueError(f"need 0 <= soft_punish_cache={soft_punish_cache} <= {max_completion_len}")
        self.max_completion_len = max_completion_len
        self.soft_punish_cache = soft_punish_cache

    def __call__(self, completion_ids: list[list[int]], **kwargs) -> list[float]:
        free = self.max_completion_len - self.soft_punish_cache
        rewards = []
        for ids in completion_ids:
            length = len(ids)
            if length <= free:
                rewards.append(0.0)
            elif length <= self.max_completion_len:
                rewards.append((free - length) / self.soft_punish_cache)
            else:
                rewards.append(-1.0)
        return rewards
