"""The bad-input catalogue, unit level: each class of bad input fails with an error that names the cause
(file, line, row, column, function, value as applicable), and nothing is lost or corrupted on the way.

Every class of the catalogue and the test that holds it (this module unless another is named):

| area | bad input | test |
|---|---|---|
| config | a wrong type (str for a number, float for an int, ...) | test_config.py::test_config_wrong_type_names_full_path |
| config | an unknown key | test_config.py::test_config_unknown_nested_key_names_full_path_and_suggests |
| config | a layout that does not fit the world (tp*pp*dp, vLLM TP, VPP) | test_validation.py::test_validate_refuses_with_actionable_message |
| config | sizes that do not divide or fit (batch geometry, context) | test_validation.py::test_validate_refuses_with_actionable_message |
| config | a torn / malformed YAML file | test_a_torn_yaml_config_names_the_file_and_the_line |
| data | no `prompt` column | test_data.py::test_a_dataset_without_a_prompt_column_is_refused_with_its_columns |
| data | empty prompts | test_empty_prompts_are_refused_naming_the_row |
| data | prompts longer than the model's context | test_data.py::test_the_model_context_minus_the_completion_budget_also_limits_prompts |
| data | non-string prompt or message content | test_non_string_prompts_and_message_contents_name_the_row_and_the_type |
| data | a corrupt JSON Lines line | test_a_corrupt_jsonl_line_names_the_file_and_the_line |
| data | a torn or foreign parquet file | test_a_torn_parquet_file_is_named |
| data | an empty data file | test_an_empty_data_file_is_named |
| rewards | a function that raises | test_rewards.py::test_a_raising_function_is_reported_with_its_name_and_the_failing_row |
| rewards | the wrong number of rewards | test_rewards.py::test_a_wrong_return_value_names_the_function_and_the_row |
| rewards | NaN | test_a_nan_reward_names_the_function_and_the_row |
| rewards | inf, non-numeric values, a scalar | test_rewards.py::test_a_wrong_return_value_names_the_function_and_the_row |
| rewards | None everywhere (every function, every row) | test_none_from_every_function_for_every_row_is_an_error |
| models | missing files (config.json, a weight shard, only .bin weights, no tokenizer) | test_a_model_directory_missing_a_file_names_the_file |
| models | a local model directory without config.json given to the trainer (not a hub id) | test_the_trainer_checks_a_local_model_directory_but_not_a_hub_id |
| models | the tokenizer's files missing (transformers builds an empty tokenizer) | test_an_empty_tokenizer_is_named_not_reported_as_empty_prompts |
| models | a wrong architecture (model_type) | test_an_unsupported_architecture_is_named_before_any_attribute_error |
| models | a tokenizer larger than the model's vocabulary | test_a_tokenizer_larger_than_the_vocabulary_is_refused |
| models | a padded-vocab token id in a completion | test_a_padded_vocab_token_id_in_a_completion_names_row_position_and_id |
| server | no token / a wrong token / not a Bearer credential | tests/integration/test_bad_inputs_server.py |
| server | malformed JSON, a JSON body that is not an object | tests/integration/test_bad_inputs_server.py |
| server | an oversized body, a body that never arrives (slow client) | tests/integration/test_bad_inputs_server.py |
| server | a dead server | tests/integration/test_bad_inputs_server.py::test_a_dead_server_is_named_with_its_url_and_the_cause |
| server | a server of another model | tests/integration/test_bad_inputs_server.py::test_a_trainer_of_another_model_is_refused_before_any_transfer |
| checkpoint | another model | test_checkpoint.py::test_checkpoint_of_another_model_is_refused_naming_the_fields; tests/distributed/test_bad_checkpoints.py |
| checkpoint | another optimizer (distributed vs not, Adam vs SGD) | tests/distributed/test_bad_checkpoints.py |
| checkpoint | a torn data file | tests/distributed/test_bad_checkpoints.py::test_a_torn_checkpoint_file_is_named_and_left_as_it_was |
| checkpoint | a Megatron writer process killed mid-save (the save used to wait forever) | test_a_killed_checkpoint_writer_fails_the_save_instead_of_hanging_it |
| checkpoint | a kill during rotation (half-deleted checkpoint) or saves killed earlier (.tmp leftovers) | test_killed_rotations_and_saves_leave_nothing_half_deleted_and_leftovers_are_removed |
| checkpoint | a torn trainer_state.json, a partial save | test_checkpoint.py::test_corrupt_or_foreign_trainer_state_is_a_clear_error, ::test_latest_ignores_partial_temporaries_and_incomplete_directories |

Run: `pytest tests/unit/test_bad_inputs.py` (no model, no vLLM, no process group: a few seconds).
"""  # noqa: E501 - the catalogue keeps one row per class

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import datasets
import pytest
import torch

from engine.config import ConfigError, DataConfig, ModelConfig, load_config
from engine.models.model_dir import ModelDirError, check_model_dir
from engine.models.tiny_model import build_tiny_tokenizer, resolve_builtin_model
from engine.policy.batch import check_completion_ids, pack_completions
from engine.train.data import DatasetError, load_prompts, prepare_prompts
from engine.train.rewards import RewardFunctionError, RewardFunctions

MODEL = "builtin:tiny-qwen2-arith"


@pytest.fixture(scope="module")
def tokenizer():
    return build_tiny_tokenizer()


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    return resolve_builtin_model(MODEL, tmp_path_factory.mktemp("models"))


def _copy_model(model_dir: Path, dest: Path, skip: tuple[str, ...] = ()) -> Path:
    dest.mkdir()
    for file in model_dir.iterdir():
        if file.is_file() and file.name not in skip:
            shutil.copy(file, dest / file.name)
    return dest


# --- config ------------------------------------------------------------------------------------------------------


def test_a_torn_yaml_config_names_the_file_and_the_line(tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text("grpo:\n  beta: 0.04\ntrain:\n  max_steps: [3\n")  # cut off mid-list
    with pytest.raises(ConfigError, match=rf"(?s){path}: not valid YAML: .*line 4") as info:
        load_config(path)
    assert "max_steps" in str(info.value)


# --- data --------------------------------------------------------------------------------------------------------


def test_empty_prompts_are_refused_naming_the_row(tokenizer):
    rows = datasets.Dataset.from_dict({"prompt": ["Question: what is 1 + 2? Answer:", "", "2 + 2"]})
    with pytest.raises(DatasetError, match=r"1 of 3 prompts are empty \(0 tokens\); the first is row 1: ''"):
        prepare_prompts(rows, tokenizer)
    chat = datasets.Dataset.from_dict({"prompt": [[{"role": "user", "content": "a"}], []]})
    with pytest.raises(DatasetError, match=r"row 1: prompt \[\] is neither a str"):
        prepare_prompts(chat, tokenizer)


def test_non_string_prompts_and_message_contents_name_the_row_and_the_type(tokenizer):
    with pytest.raises(DatasetError, match=r"row 0: prompt 7 is neither a str \(standard\) nor a list of"):
        prepare_prompts(datasets.Dataset.from_dict({"prompt": [7, 8]}), tokenizer)
    with pytest.raises(DatasetError, match=r"row 1: prompt None is neither a str"):
        prepare_prompts(datasets.Dataset.from_dict({"prompt": ["a", None]}), tokenizer)
    numbers = datasets.Dataset.from_list([{"prompt": [{"role": "user", "content": 5}]}] * 2)
    with pytest.raises(DatasetError, match=r"row 0: message .* has content of type int; content must be a str"):
        prepare_prompts(numbers, tokenizer)


def test_a_corrupt_jsonl_line_names_the_file_and_the_line(tmp_path, tokenizer):
    path = tmp_path / "train.jsonl"
    path.write_text('{"prompt": "a", "answer": "1"}\n{"prompt": "b", "answer": "2"}\n{"prompt": "c", "answ\n'
                    '{"prompt": "d", "answer": "4"}\n')
    before = path.read_bytes()
    with pytest.raises(DatasetError, match=rf"cannot read the data: {path} line 3: malformed JSON \(.* at column"):
        load_prompts(DataConfig(dataset_name=str(path)), tokenizer)
    path.with_suffix(".json").write_text('[{"prompt": "a"}, 5]')  # a JSON array with a non-row in it
    with pytest.raises(DatasetError, match=r"cannot read the data"):
        load_prompts(DataConfig(dataset_name=str(path.with_suffix(".json"))), tokenizer)
    assert path.read_bytes() == before, "the data file must be left as it was"


def test_a_torn_parquet_file_is_named(tmp_path, tokenizer):
    whole = tmp_path / "whole.parquet"
    datasets.Dataset.from_list([{"prompt": f"Question: what is {i} + 1? Answer:"} for i in range(64)]).to_parquet(
        str(whole))
    torn = tmp_path / "train.parquet"
    torn.write_bytes(whole.read_bytes()[: whole.stat().st_size // 2])  # a copy cut off half way
    with pytest.raises(DatasetError, match=rf"cannot read the data: {torn}: ArrowInvalid: .*torn or foreign file"):
        load_prompts(DataConfig(dataset_name=str(torn)), tokenizer)


def test_an_empty_data_file_is_named(tmp_path, tokenizer):
    path = tmp_path / "train.jsonl"
    path.write_text("")
    with pytest.raises(DatasetError, match=rf"{path} is empty \(no rows\)"):
        load_prompts(DataConfig(dataset_name=str(path)), tokenizer)


# --- rewards -----------------------------------------------------------------------------------------------------


def _score(funcs: RewardFunctions, completions: list[str], columns: dict | None = None) -> torch.Tensor:
    return funcs(["Q"] * len(completions), completions, [[1, 2]] * len(completions), columns or {})


def test_a_nan_reward_names_the_function_and_the_row():
    def ratio(completions, **kwargs):
        return [c.count("1") / c.count("2") if c.count("2") else math.nan for c in completions]  # 0/0 -> NaN

    with pytest.raises(RewardFunctionError, match=r"'ratio' \(reward_funcs\[0\]\) returned NaN for row 1 .*return "
                                                  r"None, not NaN"):
        _score(RewardFunctions([ratio]), ["12", "33", "22"])


def test_none_from_every_function_for_a_row_is_trls_warning_and_nan(caplog):
    def needs_solution(completions, solution=None, **kwargs):  # the dataset calls it `answer`: never found
        return [None if solution is None else float(c == s) for c, s in zip(completions, solution or completions)]

    def only_code(completions, **kwargs):
        return [None] * len(completions)

    funcs = RewardFunctions([needs_solution, only_code])
    with caplog.at_level("WARNING"):
        rewards = _score(funcs, ["a", "b", "c"], {"answer": ["1", "2", "3"]})
    assert torch.isnan(rewards).all()  # TRL: NaN rows, advantage 0 (engine/grpo/advantages.py)
    assert "All reward functions returned None for the following kwargs:\n{'answer': '1', 'prompt': 'Q', " in caplog.text
    assert "(reward functions: needs_solution, only_code;" in caplog.text and "dataset columns: ['answer']" in caplog.text
    caplog.clear()
    mixed = RewardFunctions([lambda completions, **kw: [None, 1.0], lambda completions, **kw: [None, None]])
    with caplog.at_level("WARNING"):
        scored = _score(mixed, ["a", "b"])
    assert torch.isnan(scored[0]).all() and scored[1, 0] == 1.0 and "'completion': 'a'" in caplog.text
    caplog.clear()
    with caplog.at_level("WARNING"):
        _score(RewardFunctions([lambda completions, **kw: [1.0, None], lambda completions, **kw: [None, 2.0]]), ["a", "b"])
    assert not caplog.text  # a row scored by some function is not warned about


# --- models ------------------------------------------------------------------------------------------------------


def test_a_model_directory_missing_a_file_names_the_file(model_dir, tmp_path):
    check_model_dir(model_dir, need_tokenizer=True)  # the shipped model is whole
    no_config = _copy_model(model_dir, tmp_path / "no_config", skip=("config.json",))
    with pytest.raises(ModelDirError, match=rf"{no_config} has no config.json: it is not a Hugging Face model"):
        check_model_dir(no_config)
    torn_config = _copy_model(model_dir, tmp_path / "torn_config")
    (torn_config / "config.json").write_text('{"model_type": "qwen2", "vocab_si')
    with pytest.raises(ModelDirError, match=r"config.json is not valid JSON .*a torn copy"):
        check_model_dir(torn_config)
    sharded = _copy_model(model_dir, tmp_path / "sharded", skip=("model.safetensors",))
    (sharded / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {
        "model.embed_tokens.weight": "model-00001-of-00002.safetensors",
        "lm_head.weight": "model-00002-of-00002.safetensors"}}))
    shutil.copy(model_dir / "model.safetensors", sharded / "model-00001-of-00002.safetensors")
    with pytest.raises(ModelDirError, match=r"1 safetensors shard\(s\) named by model.safetensors.index.json are "
                                            r"missing: model-00002-of-00002.safetensors"):
        check_model_dir(sharded)
    pickled = _copy_model(model_dir, tmp_path / "pickled", skip=("model.safetensors",))
    torch.save({}, pickled / "pytorch_model.bin")
    with pytest.raises(ModelDirError, match=r"holds PyTorch .bin/.pt weights only; this engine reads safetensors"):
        check_model_dir(pickled)
    no_tokenizer = _copy_model(model_dir, tmp_path / "no_tokenizer", skip=("tokenizer.json", "tokenizer_config.json"))
    with pytest.raises(ModelDirError, match=r"has no tokenizer \(none of tokenizer.json"):
        check_model_dir(no_tokenizer, need_tokenizer=True)
    assert sorted(p.name for p in model_dir.iterdir()) == sorted(p.name for p in (tmp_path / "torn_config").iterdir())


def test_the_trainer_checks_a_local_model_directory_but_not_a_hub_id(model_dir, tmp_path):
    from engine.models.model_dir import resolve_model_dir

    # what build_run reads model.name_or_path with: before transformers' "should have a `model_type` key" message
    no_config = _copy_model(model_dir, tmp_path / "no_config", skip=("config.json",))
    with pytest.raises(ModelDirError, match=rf"{no_config} has no config.json: it is not a Hugging Face model"):
        resolve_model_dir(str(no_config), tmp_path / "run", need_tokenizer=True)
    no_tokenizer = _copy_model(model_dir, tmp_path / "no_tokenizer", skip=("tokenizer.json", "tokenizer_config.json"))
    with pytest.raises(ModelDirError, match=r"has no tokenizer"):
        resolve_model_dir(str(no_tokenizer), tmp_path / "run", need_tokenizer=True)
    assert resolve_model_dir(str(no_tokenizer), tmp_path / "run", need_tokenizer=False) == no_tokenizer  # own one
    # a hub id is no local directory: transformers resolves it (engine/models/hub.py), nothing is checked here
    assert resolve_model_dir("Qwen/Qwen2.5-0.5B-Instruct", tmp_path / "run", need_tokenizer=True) == Path(
        "Qwen/Qwen2.5-0.5B-Instruct")
    assert (resolve_model_dir(MODEL, tmp_path / "run", need_tokenizer=True) / "config.json").is_file()


def test_an_empty_tokenizer_is_named_not_reported_as_empty_prompts(model_dir, tmp_path):
    from transformers import AutoTokenizer

    bare = _copy_model(model_dir, tmp_path / "bare", skip=("tokenizer.json", "tokenizer_config.json",
                                                           "chat_template.jinja"))
    empty = AutoTokenizer.from_pretrained(bare)  # transformers builds a 1-token tokenizer without complaint
    rows = datasets.Dataset.from_dict({"prompt": ["Question: what is 1 + 2? Answer:", "2 + 2"]})
    with pytest.raises(DatasetError, match=rf"every prompt tokenized to 0 tokens: the tokenizer has {len(empty)} "
                                           r"token\(s\) \(a model directory without tokenizer files"):
        prepare_prompts(rows, empty)


def test_an_unsupported_architecture_is_named_before_any_attribute_error():
    from transformers import GPT2Config, MistralConfig

    from engine.policy.model import policy_shape

    for config in (GPT2Config(vocab_size=400, n_embd=128, n_layer=2, n_head=4), MistralConfig(vocab_size=400)):
        with pytest.raises(ValueError, match=rf"model_type '{config.model_type}' \({type(config).__name__}\) is not "
                                             r"supported; supported: qwen2, llama"):
            policy_shape(config, ModelConfig(), tp_size=1)


def test_a_tokenizer_larger_than_the_vocabulary_is_refused(model_dir, tmp_path):
    grown = _copy_model(model_dir, tmp_path / "grown")
    tokenizer = build_tiny_tokenizer()
    tokenizer.add_tokens(["<tool_call>", "</tool_call>"])  # added without resizing the embeddings
    tokenizer.save_pretrained(grown)
    with pytest.raises(ModelDirError, match=r"the tokenizer has 402 tokens but the model's vocabulary \(config.json "
                                            r"vocab_size, the embedding rows\) is 400: ids 400..401 cannot be embedded"):
        check_model_dir(grown)


def test_a_padded_vocab_token_id_in_a_completion_names_row_position_and_id():
    batch = pack_completions([[5, 6], [7]], [[8, 9, 10], [11, 450]], pad_token_id=0)  # 450: a padding row of 512
    check_completion_ids(batch.completion_ids[:1], batch.completion_mask[:1], vocab_size=400)  # row 0 is fine
    with pytest.raises(ValueError, match=r"completion row 1 .*token 1: id 450 is outside the model's vocabulary "
                                         r"\[0, 400\) \(1 such tokens\): ids from 400 up are padding rows"):
        check_completion_ids(batch.completion_ids, batch.completion_mask, vocab_size=400)
    masked = batch.completion_mask.clone()
    masked[1, 1] = 0  # a masked position (padding) is never read: not an error
    check_completion_ids(batch.completion_ids, masked, vocab_size=400)


# --- checkpoint --------------------------------------------------------------------------------------------------


def _writer(count_queue, seconds: float) -> None:
    import time

    time.sleep(seconds)
    count_queue.task_done()


def test_a_killed_checkpoint_writer_fails_the_save_instead_of_hanging_it(tmp_path):
    """Megatron's save waits on a JoinableQueue for forked writers that report when done; one killed never does."""
    import multiprocessing as mp
    import os
    import signal
    import time

    from engine.train.checkpoint import CheckpointError
    from engine.train.checkpoint_writers import WriterWatch

    ctx = mp.get_context("fork")
    count_queue = ctx.JoinableQueue()
    logged = []
    start = time.monotonic()
    with pytest.raises(CheckpointError, match=rf"writer process (\d+) was killed by signal SIGKILL while writing "
                                              rf"{tmp_path}: the save cannot finish"):
        with WriterWatch(tmp_path, CheckpointError, logged.append, poll_s=0.01, exit_after_failure=False):
            writers = []
            for seconds in (0.05, 60.0):
                count_queue.put(len(writers))
                writers.append(ctx.Process(target=_writer, args=(count_queue, seconds)))
                writers[-1].start()
            os.kill(writers[1].pid, signal.SIGKILL)
            count_queue.join()  # what Megatron's write_preloaded_data_multiproc blocks in
    assert time.monotonic() - start < 10 and logged and "SIGKILL" in logged[0]
    for writer in writers:
        writer.join(timeout=10)  # multiprocessing still reaps its own children (the watch never did)
    assert [w.exitcode for w in writers] == [0, -signal.SIGKILL]
    assert signal.getsignal(signal.SIGUSR2) == signal.SIG_DFL, "the watch restores the previous handler"
    with WriterWatch(tmp_path, CheckpointError, logged.append, poll_s=0.01):  # a save whose writers finish: silent
        count_queue = ctx.JoinableQueue()  # the killed writer's task is still open in the old one
        quick = ctx.Process(target=_writer, args=(count_queue, 0.0))
        count_queue.put(0)
        quick.start()
        count_queue.join()
        quick.join()
    assert len(logged) == 1


def test_killed_rotations_and_saves_leave_nothing_half_deleted_and_leftovers_are_removed(tmp_path):
    from engine.train.checkpoint import FORMAT, list_checkpoints, remove_leftovers, rotate_checkpoints

    def fake(name: str, step: int) -> Path:
        path = tmp_path / name
        (path / "rng").mkdir(parents=True)
        (path / "metadata.json").write_text("{}")
        (path / "__0_0.distcp").write_bytes(b"x" * 64)
        (path / "trainer_state.json").write_text(json.dumps({"format": FORMAT, "progress": {"step": step}}))
        return path

    for step in (2, 4, 6):
        fake(f"checkpoint-{step}", step)
    fake("checkpoint-3.tmp", 3)  # a save killed before its rename
    fake("checkpoint-9.tmp", 9)  # a later save of a run that was then resumed from an earlier step: kept
    half = fake("checkpoint-1.deleting", 1)  # a rotation killed mid-delete
    (half / "trainer_state.json").unlink()
    removed = remove_leftovers(tmp_path, 6)
    assert sorted(p.name for p in removed) == ["checkpoint-1.deleting", "checkpoint-3.tmp"]
    assert rotate_checkpoints(tmp_path, 2) == [tmp_path / "checkpoint-2"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["checkpoint-4", "checkpoint-6", "checkpoint-9.tmp"]
    assert [s for s, _ in list_checkpoints(tmp_path)] == [4, 6]
