"""The SFT warm start (engine/demo/warm_start.py) and the model it ships, `builtin:tiny-qwen2-arith`.

The shipped model must: load from its builtin name without building anything, answer held-out prompts in the
trained format and stop, know most sums (greedy numbers right) while its greedy answers mostly miss the closing
tag the `accuracy` reward needs (so neither random weights nor a perfect model pass), and give mixed groups at
temperature 1. The script itself is checked by a 3-step run.

Run: `python -m pytest tests/unit/test_warm_start.py` (about 10 s on 2 CPU cores, most of it importing
transformers).
"""

import json
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig

from engine.demo import warm_start
from engine.demo.warm_start import (
    WELL_FORMED_PATTERN,
    collate,
    evaluate_held_out,
    generate_completions,
    is_correct,
    number_of,
    tokenize_example,
)
from engine.models.tiny_model import TINY_VOCAB_SIZE, build_tiny_model, resolve_builtin_model
from engine.train.data import build_arithmetic_dataset

SHIPPED = "builtin:tiny-qwen2-arith"
ASSET_DIR = Path(warm_start.__file__).parents[1] / "models" / "assets" / "tiny-qwen2-arith"
NUM_HELD_OUT = 40

# Measured on the first 40 test prompts (engine/models/assets/tiny-qwen2-arith/warm_start.json has all 200): greedy
# number right 0.80, greedy accuracy 0.0; at T=1 (seeds 0, 1, 2) accuracy 0.22 / 0.26 / 0.21, closes the tag
# 0.31 / 0.31 / 0.29, mixed groups 0.62 / 0.55 / 0.60. The bands leave room for other CPUs and torch builds;
# random weights give 0 numbers right, a perfect model (always closed, always right) greedy accuracy 1.
GREEDY_NUMBER_BAND = (0.65, 0.97)
GREEDY_ACCURACY_BAND = (0.0, 0.25)
SAMPLED_ACCURACY_BAND = (0.08, 0.45)


@pytest.fixture(scope="module")
def shipped(tmp_path_factory):
    """(path, model, tokenizer) of the shipped model, resolved through its builtin name."""
    cache = tmp_path_factory.mktemp("cache")
    path = resolve_builtin_model(SHIPPED, cache)
    assert not any(cache.iterdir())  # shipped: nothing built or copied
    model = AutoModelForCausalLM.from_pretrained(path).eval()
    return path, model, AutoTokenizer.from_pretrained(path)


@pytest.fixture(scope="module")
def held_out():
    return build_arithmetic_dataset("test").select(range(NUM_HELD_OUT))


def test_builtin_name_resolves_to_package_data(shipped):
    path, model, tokenizer = shipped
    assert path.resolve() == ASSET_DIR.resolve()
    assert model.config.model_type == "qwen2" and model.dtype == torch.float32
    assert len(tokenizer) == model.config.vocab_size == TINY_VOCAB_SIZE
    assert set(GenerationConfig.from_pretrained(path).eos_token_id) == {0, 2}
    saved = json.loads((path / "generation_config.json").read_text())
    assert not {"do_sample", "temperature", "top_k", "top_p"} & saved.keys()  # vLLM would adopt them
    with safe_open(path / "model.safetensors", framework="pt") as f:
        assert {f.get_slice(name).get_dtype() for name in f.keys()} == {"F32"}


def test_shipped_model_has_the_factory_tokenizer_and_trained_weights(shipped, tmp_path):
    """A changed corpus changes the tokenizer and the held-out split: the shipped model must then be retrained."""
    path, model, _ = shipped
    random_dir = build_tiny_model(tmp_path, "qwen2", seed=0)
    shipped_tok, factory_tok = (json.loads((d / "tokenizer.json").read_text()) for d in (path, random_dir))
    assert shipped_tok["model"] == factory_tok["model"]  # vocabulary and merges
    assert shipped_tok["added_tokens"] == factory_tok["added_tokens"]
    shipped_cfg, factory_cfg = (json.loads((d / "config.json").read_text()) for d in (path, random_dir))
    shipped_cfg.pop("transformers_version"), factory_cfg.pop("transformers_version")
    assert shipped_cfg == factory_cfg
    random_model = AutoModelForCausalLM.from_pretrained(random_dir)
    trained = dict(model.named_parameters())
    assert any(not torch.equal(p, trained[name]) for name, p in random_model.named_parameters())


def test_shipped_model_greedy_answers_are_well_formed_and_stop(shipped, held_out):
    _, model, tokenizer = shipped
    completions = generate_completions(model, tokenizer, held_out["prompt"][:8], do_sample=False)
    for [(text, stopped)] in completions:
        assert stopped, text
        assert WELL_FORMED_PATTERN.match(text), text


def test_shipped_model_knows_sums_but_mostly_misses_the_closing_tag(shipped, held_out):
    _, model, tokenizer = shipped
    greedy = [outs[0][0] for outs in generate_completions(model, tokenizer, held_out["prompt"], do_sample=False)]
    numbers_right = sum(number_of(text) == int(a) for text, a in zip(greedy, held_out["answer"])) / NUM_HELD_OUT
    accuracy = sum(is_correct(text, a) for text, a in zip(greedy, held_out["answer"])) / NUM_HELD_OUT
    assert GREEDY_NUMBER_BAND[0] <= numbers_right <= GREEDY_NUMBER_BAND[1], numbers_right
    assert GREEDY_ACCURACY_BAND[0] <= accuracy <= GREEDY_ACCURACY_BAND[1], accuracy


def test_shipped_model_t1_samples_are_partly_right_with_mixed_groups(shipped):
    _, model, tokenizer = shipped
    metrics = evaluate_held_out(model, tokenizer, NUM_HELD_OUT, num_samples=4, seed=0)
    assert SAMPLED_ACCURACY_BAND[0] <= metrics.sampled_accuracy <= SAMPLED_ACCURACY_BAND[1], metrics
    assert metrics.mixed_group_fraction >= 0.25, metrics
    assert 0.1 <= metrics.sampled_closed_rate <= 0.6, metrics
    assert metrics.well_formed_rate >= 0.9 and metrics.stop_rate == 1.0, metrics


def test_loss_targets_are_the_completion_tokens_only():
    examples = [([5, 6, 7], [8, 9, 0]), ([5, 6], [8, 0])]
    input_ids, labels = collate(examples, pad_id=0)
    assert input_ids.tolist() == [[5, 6, 7, 8, 9], [5, 6, 8, 0, 0]]
    assert labels.tolist() == [[-100, -100, 8, 9, 0], [-100, 8, 0, -100, -100]]


def test_completion_formats_and_what_the_accuracy_reward_gives_them(shipped):
    _, _, tokenizer = shipped
    prompt_ids, closed = tokenize_example(tokenizer, "Question: what is 90 - 24? Answer:", "66")
    assert prompt_ids == tokenizer("Question: what is 90 - 24? Answer:")["input_ids"]
    assert tokenizer.decode(closed) == " <answer>66</answer><|endoftext|>" and len(closed) == 9
    _, unclosed = tokenize_example(tokenizer, "Question: what is 90 - 24? Answer:", "66", closed=False)
    assert tokenizer.decode(unclosed) == " <answer>66<|endoftext|>"
    assert is_correct(" <answer>66</answer>", "66") and not is_correct(" <answer>66", "66")
    assert not is_correct(" <answer>65</answer>", "66")
    from engine.train.builtin_rewards import accuracy_reward

    assert accuracy_reward([" <answer>66</answer>", " <answer>66"], answer=["66", "66"]) == [1.0, 0.0]


def test_script_tiny_run_writes_a_loadable_model_and_restores_torch_settings(tmp_path):
    threads, deterministic = torch.get_num_threads(), torch.are_deterministic_algorithms_enabled()
    out = tmp_path / "warm"
    code = warm_start.main([str(out), "--steps", "3", "--warmup-steps", "1", "--unclosed-steps", "1",
                            "--num-train-rows", "16", "--batch-size", "8", "--num-eval-prompts", "2",
                            "--num-samples", "2", "--num-threads", "1"])
    assert code == 0
    assert torch.get_num_threads() == threads
    assert torch.are_deterministic_algorithms_enabled() == deterministic
    model = AutoModelForCausalLM.from_pretrained(out)
    assert AutoTokenizer.from_pretrained(out).eos_token_id == 0
    random_model = AutoModelForCausalLM.from_pretrained(build_tiny_model(tmp_path / "random", "qwen2", seed=0))
    changed = dict(model.named_parameters())
    assert any(not torch.equal(p, changed[name]) for name, p in random_model.named_parameters())
    record = json.loads((out / "warm_start.json").read_text())
    assert record["args"]["steps"] == 3 and record["held_out"]["num_prompts"] == 2


def test_script_rejects_out_of_range_arguments(tmp_path):
    with pytest.raises(SystemExit):
        warm_start.parse_args([str(tmp_path), "--num-train-rows", "2001"])
    with pytest.raises(SystemExit):
        warm_start.parse_args([str(tmp_path), "--steps", "10", "--unclosed-steps", "11"])


def test_shipped_builtin_is_listed_and_refuses_tied_embeddings(tmp_path):
    with pytest.raises(ValueError, match="builtin:tiny-qwen2-arith"):
        resolve_builtin_model("builtin:tiny-qwen2-arithmetic", tmp_path)
    with pytest.raises(ValueError, match="untied"):
        resolve_builtin_model(SHIPPED, tmp_path, tie_word_embeddings=True)
    assert resolve_builtin_model(SHIPPED, tmp_path, seed=7) == resolve_builtin_model(SHIPPED, tmp_path)
    assert not any(tmp_path.iterdir())
