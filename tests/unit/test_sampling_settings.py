"""The sampling settings vLLM receives and which of its log-probs are the trainer's (engine/sampling_settings.py).

vLLM's `SamplingParams` fields are read from its source with `ast` (importing vLLM costs ~20 s here); the run that
shows the chosen log-probs are the trainer's is tests/integration/test_trainer.py::test_top_k_top_p_run_learns_*.
"""

import ast
import importlib.util
from pathlib import Path

import pytest

from engine.config import ConfigError, GenerationConfig, load_config
from engine.sampling_settings import (
    ENGINE_OWNED_KEYS,
    VLLM_SAMPLING_KEYS,
    reports_trainer_logprobs,
    reshaping_settings,
    sampling_kwargs,
    sampling_logprobs_mode,
    translate_generation_kwargs,
)
from engine.validation import validate


def _vllm_sampling_params_fields() -> set[str]:
    source = Path(importlib.util.find_spec("vllm").submodule_search_locations[0]) / "sampling_params.py"
    tree = ast.parse(source.read_text())
    cls = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "SamplingParams")
    return {n.target.id for n in cls.body if isinstance(n, ast.AnnAssign) and isinstance(n.target, ast.Name)}


def test_every_accepted_key_is_a_vllm_sampling_param_and_owned_keys_are_refused():
    fields = _vllm_sampling_params_fields()
    assert VLLM_SAMPLING_KEYS <= fields, VLLM_SAMPLING_KEYS - fields
    for key in ("n", "logprobs", "seed"):
        assert key in fields and key in ENGINE_OWNED_KEYS
        with pytest.raises(ValueError, match=rf"generation_kwargs\['{key}'\] cannot be set"):
            translate_generation_kwargs({key: 1}, "generation_kwargs")


def test_hf_generation_names_map_to_vllm_and_meaningless_keys_are_named():
    assert translate_generation_kwargs({"do_sample": True, "num_beams": 1, "max_new_tokens": 7, "min_new_tokens": 2,
                                        "top_k": 50}) == {"max_tokens": 7, "min_tokens": 2, "top_k": 50}
    for kwargs, key in (({"do_sample": True, "top_k": 50, "num_beams": 2, "length_penalty": -0.1}, "num_beams"),
                        ({"length_penalty": -0.1}, "length_penalty"), ({"do_sample": False}, "do_sample"),
                        ({"no_repeat_ngram_size": 3}, "no_repeat_ngram_size")):
        with pytest.raises(ValueError, match=rf"generation.generation_kwargs\['{key}'\]"):
            translate_generation_kwargs(kwargs)
    with pytest.raises(ValueError, match=r"\['length_penalty'\]: a beam-search setting"):
        translate_generation_kwargs({"length_penalty": -0.1})


def test_the_logprobs_mode_is_the_one_whose_logprobs_are_the_trainers():
    plain, hot = GenerationConfig(), GenerationConfig(temperature=0.7)
    truncated = GenerationConfig(top_k=10, top_p=0.9)
    assert sampling_logprobs_mode(plain) == sampling_logprobs_mode(hot) == "processed_logprobs"
    assert reshaping_settings(truncated) == ["top_k=10", "top_p=0.9"]
    assert sampling_logprobs_mode(truncated) == "raw_logprobs"  # T = 1: the model's own softmax
    for gen in (GenerationConfig(min_p=0.01), GenerationConfig(repetition_penalty=1.1),
                GenerationConfig(generation_kwargs={"top_k": 5}), GenerationConfig(generation_kwargs={"presence_penalty": 0.5})):
        assert sampling_logprobs_mode(gen) == "raw_logprobs", gen
    assert sampling_logprobs_mode(GenerationConfig(temperature=0.7, top_p=0.9)) is None  # vLLM has no such mode
    assert sampling_kwargs(GenerationConfig(generation_kwargs={"top_k": 5}))["top_k"] == 5  # kwargs override
    # an engine built for one setting and asked for another (a server) reports NaN rather than another distribution
    assert reports_trainer_logprobs("raw_logprobs", plain) and reports_trainer_logprobs("processed_logprobs", plain)
    assert not reports_trainer_logprobs("processed_logprobs", truncated)
    assert not reports_trainer_logprobs("raw_logprobs", hot)


def test_validation_refuses_settings_that_would_read_logprobs_of_another_distribution():
    def check(*overrides):
        validate(load_config("configs/tiny_cpu.yaml", list(overrides)), 1)

    check("generation.top_k=10", "generation.top_p=0.9")
    check("generation.temperature=0.7", "generation.top_p=0.9", "grpo.vllm_importance_sampling_correction=false")
    with pytest.raises(ConfigError, match=r"generation.temperature=0.7 with top_p=0.9: .*grpo.vllm_importance_sampling"
                                          r"_correction=True would read them; set generation.temperature=1.0"):
        check("generation.temperature=0.7", "generation.top_p=0.9")
    with pytest.raises(ConfigError, match=r"grpo.off_policy_mask_threshold=0.5"):
        check("generation.temperature=0.7", "generation.top_k=5", "grpo.vllm_importance_sampling_correction=false",
              "grpo.off_policy_mask_threshold=0.5")
    with pytest.raises(ConfigError, match=r"generation.generation_kwargs\['num_beams'\]=2: vLLM's SamplingParams has "
                                          r"no beam search"):
        check("generation.generation_kwargs={num_beams: 2}")
    with pytest.raises(ConfigError, match=r"generation_kwargs\['temperature'\]=0.5 differs from generation.temperature"):
        check("generation.generation_kwargs={temperature: 0.5}")
