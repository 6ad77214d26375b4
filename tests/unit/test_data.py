"""engine/train/data.py: local files, the builtin arithmetic task, prompt formats, chat templates and the length policy."""

from __future__ import annotations

import json
import re

import datasets
import pytest

from engine.config import DataConfig, GenerationConfig
from engine.models.tiny_model import build_tiny_tokenizer, read_corpus
from engine.train import data
from engine.train.data import (
    ARITHMETIC_NUM_TEST,
    ARITHMETIC_NUM_TRAIN,
    DatasetError,
    build_arithmetic_dataset,
    load_dataset_split,
    load_prompts,
    prepare_prompts,
)

ROWS = [
    {"prompt": "Question: what is 1 + 2? Answer:", "answer": "3", "level": 1},
    {"prompt": "Question: what is 40 - 8? Answer:", "answer": "32", "level": 2},
    {"prompt": "Question: what is 5 + 5? Answer:", "answer": "10", "level": 1},
]


@pytest.fixture(scope="module")
def tokenizer():
    return build_tiny_tokenizer()


def _write(tmp_path, name: str, rows: list[dict]):
    path = tmp_path / name
    if name.endswith(".jsonl"):
        path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    elif name.endswith(".json"):
        path.write_text(json.dumps(rows))
    elif name.endswith(".parquet"):
        datasets.Dataset.from_list(rows).to_parquet(str(path))
    elif name.endswith(".arrow"):
        saved = tmp_path / "saved"
        datasets.Dataset.from_list(rows).save_to_disk(str(saved))
        path = next(saved.glob("*.arrow"))
    return path


def test_builtin_arithmetic_rows_are_deterministic_correct_and_in_the_corpus_format():
    train = build_arithmetic_dataset("train")
    assert (len(train), len(build_arithmetic_dataset("test"))) == (ARITHMETIC_NUM_TRAIN, ARITHMETIC_NUM_TEST)
    assert train.column_names == ["prompt", "answer"]
    assert train[:5] == build_arithmetic_dataset("train")[:5]
    for row in train:
        match = re.fullmatch(r"Question: what is (\d+) ([+-]) (\d+)\? Answer:", row["prompt"])
        assert match, row
        a, op, b = int(match[1]), match[2], int(match[3])
        assert int(row["answer"]) == (a + b if op == "+" else a - b) >= 0
    assert {"+" in p for p in train["prompt"]} == {True, False}  # both operations occur


def test_builtin_arithmetic_test_split_overlaps_neither_train_nor_the_corpus():
    train = set(build_arithmetic_dataset("train")["prompt"])
    test = set(build_arithmetic_dataset("test")["prompt"])
    assert len(test) == ARITHMETIC_NUM_TEST and len(train) == ARITHMETIC_NUM_TRAIN
    assert not train & test
    corpus = read_corpus()
    for prompt in test:
        a, op, b = re.search(r"(\d+) ([+-]) (\d+)", prompt).groups()
        assert not re.search(rf"(?<!\d){a} \{op} {b}(?!\d)", corpus), prompt


def test_default_config_loads_the_builtin_train_and_test_splits(tokenizer):
    train = load_prompts(DataConfig(), tokenizer, GenerationConfig())
    test = load_prompts(DataConfig(), tokenizer, GenerationConfig(), split="test")
    assert (len(train), len(test)) == (ARITHMETIC_NUM_TRAIN, ARITHMETIC_NUM_TEST)
    assert not train.is_conversational and train.column_names == ["prompt", "answer"]
    assert load_prompts(DataConfig(dataset_test_split=None), tokenizer, split="test") is None


@pytest.mark.parametrize("name", ["rows.jsonl", "rows.json", "rows.parquet", "rows.arrow"])
def test_local_files_load_with_every_column_and_standard_prompts_tokenized_as_trl(tmp_path, tokenizer, name):
    path = _write(tmp_path, name, ROWS)
    prompts = load_prompts(DataConfig(dataset_name=str(path)), tokenizer)
    assert len(prompts) == 3 and prompts.column_names == ["prompt", "answer", "level"]
    batch = prompts.select([1])
    # TRL 1.16 tokenizes standard prompts with processing_class(text=prompts): no template, special tokens added
    assert batch.prompt_ids == tokenizer(text=[ROWS[1]["prompt"]])["input_ids"]
    assert batch.columns == {"answer": ["32"], "level": [2]}


def test_select_repeats_rows_in_the_given_order_as_the_repeat_sampler_needs(tokenizer):
    prompts = prepare_prompts(datasets.Dataset.from_list(ROWS), tokenizer)
    batch = prompts.select([2, 2, 0, 0])
    assert batch.prompts == [ROWS[2]["prompt"]] * 2 + [ROWS[0]["prompt"]] * 2
    assert batch.columns["answer"] == ["10", "10", "3", "3"] and len(batch.prompt_ids) == 4
    assert batch.prompt_ids[0] == batch.prompt_ids[1] != batch.prompt_ids[2]


def test_a_directory_of_split_files_and_a_save_to_disk_directory_give_their_splits(tmp_path, tokenizer):
    folder = tmp_path / "files"
    folder.mkdir()
    _write(folder, "train.jsonl", ROWS)
    _write(folder, "test.jsonl", ROWS[:1])
    assert len(load_dataset_split(str(folder), "test")) == 1
    saved = tmp_path / "saved_dict"
    datasets.DatasetDict({"train": datasets.Dataset.from_list(ROWS), "eval": datasets.Dataset.from_list(ROWS[:2])}
                         ).save_to_disk(str(saved))
    cfg = DataConfig(dataset_name=str(saved), dataset_test_split="eval")
    assert len(load_prompts(cfg, tokenizer, split="test")) == 2


def test_a_missing_split_lists_the_splits_that_exist(tmp_path, tokenizer):
    path = _write(tmp_path, "rows.jsonl", ROWS)
    with pytest.raises(DatasetError, match=r"has no split 'test'; its splits: \['train'\]"):
        load_prompts(DataConfig(dataset_name=str(path)), tokenizer, split="test")


def test_a_missing_local_file_is_an_error_not_a_hub_lookup(monkeypatch, tmp_path):
    monkeypatch.setattr(data.datasets, "load_dataset", lambda *a, **k: pytest.fail("went to the hub"))
    with pytest.raises(DatasetError, match="no such file or directory"):
        load_dataset_split(str(tmp_path / "missing.jsonl"), "train")


def test_a_failed_hub_load_names_the_dataset_and_suggests_a_local_copy(monkeypatch):
    calls = []

    def offline(*args, **kwargs):
        calls.append((args, kwargs))
        raise ConnectionError("Couldn't reach 'org/name' on the Hub")

    monkeypatch.setattr(data.datasets, "load_dataset", offline)
    with pytest.raises(DatasetError, match=r"could not load 'org/name' \(split 'train'\).*local copy"):
        load_dataset_split("org/name", "train", "main")
    assert calls == [(("org/name", "main"), {"split": "train"})]


def test_conversational_prompts_use_the_chat_template_with_chat_template_kwargs(tmp_path, tokenizer):
    rows = [{"prompt": [{"role": "user", "content": "what is 1 + 2?"}], "answer": "3"}]
    path = _write(tmp_path, "chat.jsonl", rows)
    plain = load_prompts(DataConfig(dataset_name=str(path)), tokenizer)
    assert plain.is_conversational
    expected = "<|im_start|>user\nwhat is 1 + 2?<|im_end|>\n<|im_start|>assistant\n"
    assert tokenizer.decode(plain.select([0]).prompt_ids[0]) == expected

    thinking = build_tiny_tokenizer()
    thinking.chat_template = thinking.chat_template + "{%- if enable_thinking %}{{- '<think>' }}{%- endif %}"
    on = load_prompts(DataConfig(dataset_name=str(path)), thinking, GenerationConfig(
        chat_template_kwargs={"enable_thinking": True}))
    off = load_prompts(DataConfig(dataset_name=str(path)), thinking, GenerationConfig())
    assert thinking.decode(on.select([0]).prompt_ids[0]) == expected + "<think>"
    assert thinking.decode(off.select([0]).prompt_ids[0]) == expected


def test_mixed_or_malformed_prompts_name_the_row():
    tokenizer = build_tiny_tokenizer()
    mixed = datasets.Dataset.from_dict({"prompt": [[{"role": "user", "content": "a"}], [{"role": "user"}]]})
    with pytest.raises(DatasetError, match=r"row 1: message .* needs 'role' and 'content'"):
        prepare_prompts(mixed, tokenizer)
    tokenizer.chat_template = None
    chat = datasets.Dataset.from_dict({"prompt": [[{"role": "user", "content": "a"}]]})
    with pytest.raises(DatasetError, match="no chat template"):
        prepare_prompts(chat, tokenizer)


def test_a_dataset_without_a_prompt_column_is_refused_with_its_columns(tokenizer):
    with pytest.raises(DatasetError, match=r"no 'prompt' column \(columns: \['question'\]\)"):
        prepare_prompts(datasets.Dataset.from_dict({"question": ["a"]}), tokenizer)


def test_an_overlong_prompt_is_an_error_naming_the_row_its_length_and_the_limit(tokenizer):
    rows = datasets.Dataset.from_list(ROWS + [{"prompt": "word " * 40, "answer": "0", "level": 3}])
    long_len = len(tokenizer(text="word " * 40)["input_ids"])
    with pytest.raises(DatasetError, match=rf"1 of 4 prompts are longer than data.max_prompt_length=20 tokens; "
                                           rf"the first is row 3 with {long_len} tokens.*never truncated"):
        prepare_prompts(rows, tokenizer, max_prompt_length=20)


def test_overlong_prompts_are_dropped_with_a_warning_under_the_drop_policy(tokenizer):
    rows = datasets.Dataset.from_list([{"prompt": "word " * 40, "answer": "0", "level": 3}] + ROWS)
    with pytest.warns(UserWarning, match=r"dropped 1 of 4 prompts longer than data.max_prompt_length=20"):
        prompts = prepare_prompts(rows, tokenizer, max_prompt_length=20, overlong_prompt_policy="drop")
    assert len(prompts) == 3 and prompts.num_dropped == 1
    assert prompts.select([0, 1, 2]).prompts == [r["prompt"] for r in ROWS]  # the rest, unchanged and in order
    assert prompts.max_prompt_tokens <= 20


def test_the_model_context_minus_the_completion_budget_also_limits_prompts(tokenizer):
    rows = datasets.Dataset.from_list(ROWS)
    longest = max(len(tokenizer(text=r["prompt"])["input_ids"]) for r in ROWS)
    with pytest.raises(DatasetError, match=r"max_model_length - max_completion_length = 40 - 30 = 10 tokens"):
        prepare_prompts(rows, tokenizer, max_model_length=40, max_completion_length=30)
    fits = prepare_prompts(rows, tokenizer, max_model_length=longest + 30, max_completion_length=30)
    assert fits.max_prompt_tokens == longest
