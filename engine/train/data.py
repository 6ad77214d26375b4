"""Prompt datasets: loading through Hugging Face `datasets`, the embedded `builtin:arithmetic` task, tokenizing the
prompts once (chat template for conversational prompts) and the prompt-length policy.

Owns: resolving `data.dataset_name` (a hub name, a local json / jsonl / parquet / arrow / csv file, a local directory
of such files or one written by `save_to_disk`, or `builtin:arithmetic`: `build_arithmetic_dataset`) to one split;
checking the `prompt` format, tokenizing the prompts as TRL 1.16 does and the overlong-prompt policy
(`prepare_prompts`: how, and why a prompt is never truncated).

Must not: generate, decode completions, sample batches (the trainer's repeat sampler picks indices and calls
`PromptDataset.select`), truncate a prompt, or read the root config (it takes `cfg.data` and `cfg.generation`).
Streaming / iterable datasets are not supported: the length policy needs every prompt tokenized before the first step.

Test: `pytest tests/unit/test_data.py` (local files in tmp_path, the tiny tokenizer; no network).
"""

from __future__ import annotations

import json
import random
import re
import warnings
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

import datasets

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

    from engine.config import DataConfig, GenerationConfig

BUILTIN_ARITHMETIC = "builtin:arithmetic"
ARITHMETIC_NUM_TRAIN = 2000
"""Rows of the builtin train split."""
ARITHMETIC_NUM_TEST = 200
"""Rows of the builtin test split (none of them in the train split or in the tiny corpus)."""
ARITHMETIC_MAX_OPERAND = 99
ARITHMETIC_SEED = 1234
ARITHMETIC_PROMPT = "Question: what is {a} {op} {b}? Answer:"
"""The corpus's question format (engine/models/assets/tiny_corpus.txt)."""

PROMPT_IDS_COLUMN = "__prompt_ids__"
"""The column holding the tokenized prompt; internal: it is not handed to reward functions."""

LOCAL_FORMATS = {".json": "json", ".jsonl": "json", ".parquet": "parquet", ".arrow": "arrow", ".csv": "csv"}
"""File suffix -> `datasets` packaged builder."""


class DatasetError(ValueError):
    """A dataset that cannot be used: missing file, split or column, malformed prompt, prompt too long."""


@dataclass(frozen=True)
class PromptBatch:
    """Rows picked from a `PromptDataset` (indices may repeat: TRL's sampler yields each prompt G times in a row)."""

    indices: list[int]
    prompts: list[Any]
    """B prompts: str (standard) or a list of {"role", "content"} messages (conversational)."""
    prompt_ids: list[list[int]]
    """B tokenized prompts (chat template applied for conversational prompts)."""
    columns: dict[str, list[Any]]
    """Every other dataset column, B values each, aligned with `prompts` (TRL's reward kwargs)."""


@dataclass(frozen=True)
class PromptDataset:
    """Tokenized, length-checked prompts; `dataset` holds the user's columns plus `PROMPT_IDS_COLUMN`."""

    dataset: datasets.Dataset
    is_conversational: bool
    max_prompt_tokens: int
    """The longest kept prompt, in tokens."""
    num_dropped: int
    """Rows dropped by `overlong_prompt_policy="drop"`."""

    def __len__(self) -> int:
        return len(self.dataset)

    @property
    def column_names(self) -> list[str]:
        """The user's columns (`prompt` first), without the internal token column."""
        return [name for name in self.dataset.column_names if name != PROMPT_IDS_COLUMN]

    def select(self, indices: Sequence[int]) -> PromptBatch:
        """The rows at `indices`, in that order (repeats allowed).

        Args:
            indices: B row indices into this dataset.
        Returns:
            `PromptBatch` with B prompts, B token-id lists and every other column as B-long lists.
        """
        indices = [int(i) for i in indices]
        rows = self.dataset[indices] if indices else {name: [] for name in self.dataset.column_names}
        columns = {name: rows[name] for name in self.column_names if name != "prompt"}
        return PromptBatch(indices, rows["prompt"], rows[PROMPT_IDS_COLUMN], columns)


# ---------------------------------------------------------------------------------------------------------------
# loading one split


def load_prompts(
    data_cfg: DataConfig,
    tokenizer: PreTrainedTokenizerBase,
    generation_cfg: GenerationConfig | None = None,
    *,
    split: Literal["train", "test"] = "train",
    max_model_length: int | None = None,
    dataset: datasets.Dataset | None = None,
) -> PromptDataset | None:
    """Load, check and tokenize one split of the configured dataset (or of an in-memory `dataset`).

    Args:
        data_cfg: the `data` section (dataset_name, dataset_config, split names, max_prompt_length,
            overlong_prompt_policy).
        tokenizer: the policy's tokenizer (its chat template renders conversational prompts).
        generation_cfg: the `generation` section: `chat_template_kwargs`, and `max_completion_length` for the
            context check. None = no template kwargs, no context check.
        split: "train" reads `data.dataset_train_split`, "test" reads `data.dataset_test_split`.
        max_model_length: the model's context in tokens (e.g. vLLM's max_model_len); with `generation_cfg`, prompts
            longer than max_model_length - max_completion_length count as overlong. None = no such check.
        dataset: an in-memory `datasets.Dataset` (the TRL-style `GRPOTrainer(train_dataset=...)`); when given, it
            is used instead of loading `data.dataset_name` and the split names are not read.
    Returns:
        `PromptDataset`, or None when `split="test"`, `data.dataset_test_split` is null and no `dataset` is given.
    Raises:
        DatasetError: missing file / split / `prompt` column, mixed or malformed prompts, an overlong prompt under
            the "error" policy, or nothing left after dropping.
    """
    if dataset is None:
        split_name = data_cfg.dataset_train_split if split == "train" else data_cfg.dataset_test_split
        if split_name is None:
            return None
        dataset = load_dataset_split(data_cfg.dataset_name, split_name, data_cfg.dataset_config)
    return prepare_prompts(
        dataset,
        tokenizer,
        max_prompt_length=data_cfg.max_prompt_length,
        overlong_prompt_policy=data_cfg.overlong_prompt_policy,
        chat_template_kwargs=generation_cfg.chat_template_kwargs if generation_cfg is not None else None,
        max_model_length=max_model_length,
        max_completion_length=generation_cfg.max_completion_length if generation_cfg is not None else None,
    )


def load_dataset_split(dataset_name: str, split: str, dataset_config: str | None = None) -> datasets.Dataset:
    """One split of a dataset, as a `datasets.Dataset`.

    Args:
        dataset_name: `builtin:arithmetic`; an existing local file (.json, .jsonl, .parquet, .arrow, .csv: one split
            named "train"); an existing local directory (written by `save_to_disk`, or holding data files whose
            names give the splits, e.g. train.jsonl / test.jsonl); otherwise a Hugging Face hub name.
        split: the split name.
        dataset_config: the hub dataset's configuration name (None = default).
    Returns:
        The split.
    Raises:
        DatasetError: unknown builtin, missing local path or split, unsupported file type, a hub load that failed.
    """
    if dataset_name.startswith("builtin:"):
        if dataset_name != BUILTIN_ARITHMETIC:
            raise DatasetError(f"unknown builtin dataset {dataset_name!r}; known: {BUILTIN_ARITHMETIC}")
        if split not in ("train", "test"):
            raise DatasetError(f"{BUILTIN_ARITHMETIC} has the splits 'train' and 'test', not {split!r}")
        return build_arithmetic_dataset(split)
    path = Path(dataset_name).expanduser()
    if path.is_file():
        builder = LOCAL_FORMATS.get(path.suffix.lower())
        if builder is None:
            raise DatasetError(
                f"data.dataset_name={dataset_name!r}: unsupported file type {path.suffix!r}; "
                f"supported: {', '.join(sorted(LOCAL_FORMATS))}"
            )
        return _pick_split(_load_local(builder, [path], dataset_name), split, dataset_name)
    if path.is_dir():
        if (path / "dataset_dict.json").is_file() or (path / "state.json").is_file():
            loaded = datasets.load_from_disk(str(path))
        else:
            files = sorted(p for p in path.rglob("*") if p.suffix.lower() in LOCAL_FORMATS)
            loaded = _load_local(None, files, dataset_name, lambda: datasets.load_dataset(str(path), dataset_config))
        return _pick_split(loaded, split, dataset_name)
    if path.suffix.lower() in LOCAL_FORMATS or dataset_name.startswith((".", "/", "~")):
        raise DatasetError(f"data.dataset_name={dataset_name!r}: no such file or directory")
    try:
        loaded = datasets.load_dataset(dataset_name, dataset_config, split=split)
    except Exception as exc:  # noqa: BLE001 - any hub failure gets the same advice
        raise DatasetError(
            f"could not load {dataset_name!r} (split {split!r}) from the Hugging Face hub: "
            f"{type(exc).__name__}: {exc}. Offline machines need a local copy: point data.dataset_name at a "
            "json/jsonl/parquet/arrow file or a save_to_disk directory"
        ) from exc
    if isinstance(loaded, datasets.IterableDataset):
        raise DatasetError(f"{dataset_name!r}: streaming (iterable) datasets are not supported")
    return loaded


def _load_local(builder: str | None, files: list[Path], name: str, load=None):
    """`datasets.load_dataset` of local files; a file it cannot read is a DatasetError naming the file and, for JSON
    Lines, the first malformed line (datasets' own error names neither)."""
    try:
        return load() if load is not None else datasets.load_dataset(builder, data_files=[str(f) for f in files])
    except Exception as exc:  # noqa: BLE001 - arrow, json and datasets' generation errors alike
        causes = [cause for f in files if (cause := _describe_unreadable(f)) is not None]
        detail = "; ".join(causes) if causes else f"{type(exc).__name__}: {_first_line(exc)}"
        raise DatasetError(f"data.dataset_name={name!r}: cannot read the data: {detail}. Nothing was loaded: fix or "
                           "remove the file") from exc


def _describe_unreadable(path: Path) -> str | None:
    """Why one local data file cannot be read (file, line, cause), or None when it reads on its own."""
    suffix = path.suffix.lower()
    try:
        if suffix in (".json", ".jsonl"):
            text = path.read_text(encoding="utf-8")
            if not text.strip():
                return f"{path} is empty (no rows)"
            if suffix == ".json" and text.lstrip().startswith("["):
                json.loads(text)
                return None
            for number, line in enumerate(text.splitlines(), start=1):  # JSON Lines (datasets reads .json so too)
                if not line.strip():
                    continue
                try:
                    row = json.loads(line)
                except json.JSONDecodeError as exc:
                    return f"{path} line {number}: malformed JSON ({exc.msg} at column {exc.colno})"
                if not isinstance(row, dict):
                    return f"{path} line {number}: a JSON {type(row).__name__}, not an object (one row per line)"
            return None
        if suffix == ".parquet":
            import pyarrow.parquet as pq

            pq.read_table(path)
    except json.JSONDecodeError as exc:
        return f"{path}: malformed JSON ({exc.msg} at line {exc.lineno} column {exc.colno})"
    except UnicodeDecodeError as exc:
        return f"{path}: not UTF-8 text ({exc.reason} at byte {exc.start})"
    except Exception as exc:  # noqa: BLE001 - pyarrow's errors (a torn or foreign file)
        return f"{path}: {type(exc).__name__}: {_first_line(exc)} (a torn or foreign file?)"
    return None


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__


def _pick_split(loaded: datasets.Dataset | datasets.DatasetDict, split: str, name: str) -> datasets.Dataset:
    """The named split of a DatasetDict (a bare Dataset counts as the split "train")."""
    if isinstance(loaded, datasets.Dataset):
        loaded = datasets.DatasetDict({"train": loaded})
    if split not in loaded:
        raise DatasetError(
            f"data.dataset_name={name!r} has no split {split!r}; its splits: {sorted(loaded)}. Set "
            "data.dataset_train_split / data.dataset_test_split (null disables the test split)"
        )
    return loaded[split]


# ---------------------------------------------------------------------------------------------------------------
# checking and tokenizing


def prepare_prompts(
    dataset: datasets.Dataset,
    tokenizer: PreTrainedTokenizerBase,
    *,
    max_prompt_length: int | None = None,
    overlong_prompt_policy: Literal["error", "drop"] = "error",
    chat_template_kwargs: Mapping[str, Any] | None = None,
    max_model_length: int | None = None,
    max_completion_length: int | None = None,
) -> PromptDataset:
    """Check the prompt format, tokenize every prompt and apply the overlong-prompt policy.

    Rows have a `prompt` that is either a str (standard) or a list of {"role", "content"} messages (conversational),
    with the same format in every row. Prompts are tokenized as TRL 1.16 does (`GRPOTrainer._generate_and_score_completions`): standard prompts
    with `tokenizer(text=prompts)` (special tokens added, no template), conversational ones with
    `apply_chat_template(add_generation_prompt=True, **chat_template_kwargs)`.

    Never truncates a prompt (silent truncation gives all-zero rewards nobody notices): a
    prompt longer than `data.max_prompt_length` (or longer than `max_model_length - max_completion_length`, when the
    caller passes the model's context) is an error naming the row, its length and the limit, or with
    `data.overlong_prompt_policy="drop"` the row is dropped with a warning that gives the count. TRL removed
    `max_prompt_length` (#4847) and lets vLLM fail or cut; this engine checks once, up front.

    Args:
        dataset: rows with a `prompt` column (str, or a list of {"role", "content"} messages) and any others.
        tokenizer: the policy's tokenizer.
        max_prompt_length: tokens; None = no limit of its own.
        overlong_prompt_policy: "error" raises on the first overlong prompt; "drop" removes overlong rows (warning).
        chat_template_kwargs: extra template variables for conversational prompts (TRL's `chat_template_kwargs`,
            e.g. {"enable_thinking": False}).
        max_model_length, max_completion_length: when both are given, a prompt must also leave room for a full
            completion: length <= max_model_length - max_completion_length.
    Returns:
        `PromptDataset`.
    Raises:
        DatasetError (see `load_prompts`).
    """
    if not isinstance(dataset, datasets.Dataset):
        raise DatasetError(f"expected a datasets.Dataset, got {type(dataset).__name__} (iterable: unsupported)")
    if "prompt" not in dataset.column_names:
        raise DatasetError(
            f"the dataset has no 'prompt' column (columns: {dataset.column_names}); rename the text column, e.g. "
            "dataset.rename_column('question', 'prompt')"
        )
    if PROMPT_IDS_COLUMN in dataset.column_names:
        raise DatasetError(f"the column name {PROMPT_IDS_COLUMN!r} is reserved for the tokenized prompts")
    if len(dataset) == 0:
        raise DatasetError("the dataset has no rows")
    limit, limit_reason = _prompt_limit(max_prompt_length, max_model_length, max_completion_length)
    is_conversational = _is_conversational_prompt(dataset[0]["prompt"])
    if is_conversational and getattr(tokenizer, "chat_template", None) is None:
        raise DatasetError(
            "the prompts are conversational (lists of messages) but the tokenizer has no chat template; "
            "use a tokenizer with one, or a dataset of plain-text prompts"
        )
    template_kwargs = dict(chat_template_kwargs or {})

    def tokenize(batch: dict, indices: list[int]) -> dict:
        for prompt, index in zip(batch["prompt"], indices):
            _check_prompt(prompt, index, is_conversational)
        if is_conversational:
            encoded = tokenizer.apply_chat_template(
                batch["prompt"], add_generation_prompt=True, tokenize=True, return_dict=True, **template_kwargs
            )
        else:
            encoded = tokenizer(text=batch["prompt"])
        return {PROMPT_IDS_COLUMN: [list(ids) for ids in encoded["input_ids"]]}

    tokenized = dataset.map(tokenize, batched=True, batch_size=512, with_indices=True, desc="tokenizing prompts")
    lengths = [len(ids) for ids in tokenized[PROMPT_IDS_COLUMN]]
    empty = [i for i, n in enumerate(lengths) if n == 0]
    if empty:  # the first completion token is predicted from the prompt's last one: a prompt needs one
        if len(empty) == len(lengths) and len(tokenizer) < 8:
            raise DatasetError(f"every prompt tokenized to 0 tokens: the tokenizer has {len(tokenizer)} token(s) (a "
                               "model directory without tokenizer files, for which transformers builds an empty one?)")
        raise DatasetError(f"{len(empty)} of {len(lengths)} prompts are empty (0 tokens); the first is row {empty[0]}: "
                           f"{preview(dataset[empty[0]]['prompt'])}. Remove or fill the empty prompts")
    overlong = [i for i, n in enumerate(lengths) if limit is not None and n > limit]
    if overlong and overlong_prompt_policy == "error":
        first = overlong[0]
        raise DatasetError(
            f"{len(overlong)} of {len(lengths)} prompts are longer than {limit_reason}; the first is row {first} "
            f"with {lengths[first]} tokens: {preview(dataset[first]['prompt'])}. Prompts are never truncated: "
            "raise the limit, or set data.overlong_prompt_policy=drop to skip them"
        )
    if overlong and overlong_prompt_policy != "drop":
        raise DatasetError(f"overlong_prompt_policy must be 'error' or 'drop', got {overlong_prompt_policy!r}")
    if overlong:
        if len(overlong) == len(lengths):
            raise DatasetError(f"every one of the {len(lengths)} prompts is longer than {limit_reason}")
        dropped = set(overlong)
        keep = [i for i in range(len(lengths)) if i not in dropped]
        warnings.warn(
            f"dropped {len(overlong)} of {len(lengths)} prompts longer than {limit_reason} "
            f"(data.overlong_prompt_policy=drop; first dropped rows {overlong[:8]})",
            stacklevel=2,
        )
        tokenized = tokenized.select(keep)
        lengths = [lengths[i] for i in keep]
    return PromptDataset(tokenized, is_conversational, max(lengths), len(overlong))


def _prompt_limit(
    max_prompt_length: int | None, max_model_length: int | None, max_completion_length: int | None
) -> tuple[int | None, str]:
    """The effective token limit and how it was derived (for messages)."""
    limit, reason = max_prompt_length, f"data.max_prompt_length={max_prompt_length} tokens"
    if max_model_length is not None and max_completion_length is not None:
        room = max_model_length - max_completion_length
        if room < 1:
            raise DatasetError(
                f"no room for a prompt: max_model_length - max_completion_length = {max_model_length} - "
                f"{max_completion_length} = {room}"
            )
        if limit is None or room < limit:
            limit = room
            reason = (
                f"the room left by the completion: max_model_length - max_completion_length = "
                f"{max_model_length} - {max_completion_length} = {room} tokens"
            )
    return limit, reason


def _is_conversational_prompt(prompt: Any) -> bool:
    """TRL's test: a list whose first element is a message dict."""
    return isinstance(prompt, list) and len(prompt) > 0 and isinstance(prompt[0], dict) and "role" in prompt[0]


def _check_prompt(prompt: Any, index: int, is_conversational: bool) -> None:
    """Raise DatasetError naming the row when the prompt is malformed or of the other format than row 0's."""
    kind = "conversational (a list of messages)" if is_conversational else "standard (a str)"
    if not isinstance(prompt, str) and not _is_conversational_prompt(prompt):
        raise DatasetError(f"row {index}: prompt {preview(prompt)} is neither a str (standard) nor a list of "
                           "{'role', 'content'} messages (conversational)")
    like = " like row 0's"
    if is_conversational:
        if not _is_conversational_prompt(prompt):
            raise DatasetError(f"row {index}: prompt {preview(prompt)} is not {kind}{like}")
        for message in prompt:
            # NOTE: Arrow stores messages as structs, so a missing key reads back as None.
            is_message = isinstance(message, dict) and isinstance(message.get("role"), str)
            if not is_message or message.get("content") is None:
                raise DatasetError(f"row {index}: message {preview(message)} needs 'role' and 'content' keys")
            if not isinstance(message["content"], (str, list)):
                raise DatasetError(f"row {index}: message {preview(message)} has content of type "
                                   f"{type(message['content']).__name__}; content must be a str (or a list of parts)")
    elif not isinstance(prompt, str):
        raise DatasetError(f"row {index}: prompt {preview(prompt)} is not {kind}{like}")


def preview(value: Any, limit: int = 120) -> str:
    """repr(value), shortened to `limit` characters (error messages quoting a user's row)."""
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


# ---------------------------------------------------------------------------------------------------------------
# the builtin arithmetic task


def build_arithmetic_dataset(split: Literal["train", "test"]) -> datasets.Dataset:
    """The builtin verifiable task: small additions and subtractions with their answers.

    Args:
        split: "train" (`ARITHMETIC_NUM_TRAIN` rows) or "test" (`ARITHMETIC_NUM_TEST` rows, disjoint from train and
            from the problems in the tiny corpus).
    Returns:
        A Dataset with columns `prompt` (str, "Question: what is 12 + 7? Answer:") and `answer` (str, "19");
        the same rows in every process and on every machine.

    The builtin task (`builtin:arithmetic`): every problem `a + b` or `a - b` (a >= b, results never negative) with
    operands 0..99 (10,000 + 5,050 = 15,050 problems), shuffled with a fixed seed; the test split takes the first
    `ARITHMETIC_NUM_TEST` problems that do not appear in the tiny model's corpus, the train split the first
    `ARITHMETIC_NUM_TRAIN` of the rest, so the splits never overlap. Rows match the corpus format:
        {"prompt": "Question: what is 12 + 7? Answer:", "answer": "19"}
    and a completion the reward functions score as correct looks like
        " <think> 12 + 7 = 19 </think> <answer>19</answer>".
    """
    if split not in ("train", "test"):
        raise DatasetError(f"{BUILTIN_ARITHMETIC} has the splits 'train' and 'test', not {split!r}")
    problems = [(a, "+", b) for a in range(ARITHMETIC_MAX_OPERAND + 1) for b in range(ARITHMETIC_MAX_OPERAND + 1)]
    problems += [(a, "-", b) for a in range(ARITHMETIC_MAX_OPERAND + 1) for b in range(a + 1)]
    random.Random(ARITHMETIC_SEED).shuffle(problems)
    in_corpus = _corpus_problems()
    test = [p for p in problems if p not in in_corpus][:ARITHMETIC_NUM_TEST]
    test_set = set(test)
    chosen = test if split == "test" else [p for p in problems if p not in test_set][:ARITHMETIC_NUM_TRAIN]
    return datasets.Dataset.from_dict({
        "prompt": [ARITHMETIC_PROMPT.format(a=a, op=op, b=b) for a, op, b in chosen],
        "answer": [str(a + b if op == "+" else a - b) for a, op, b in chosen],
    })


def _corpus_problems() -> set[tuple[int, str, int]]:
    """The (a, op, b) additions and subtractions written in the tiny model's corpus."""
    from engine.models.tiny_model import read_corpus

    return {(int(a), op, int(b)) for a, op, b in re.findall(r"(\d+) ([+-]) (\d+)", read_corpus())}
