"""The sampling settings a rollout engine receives, and which log-probs of the sampled tokens it must report.

Owns: `sampling_kwargs(gen)` (the `generation` section as vLLM `SamplingParams` keyword arguments, TRL's
`generation_kwargs` merged over the named fields, as TRL's vLLM path does), the translation of the Hugging Face
`GenerationConfig` names a TRL user passes in `generation_kwargs` (TRL hands them to `generate()` when vLLM is off;
this engine always samples with vLLM), the errors for keys vLLM has no meaning for, and
`sampling_logprobs_mode(gen)`: the vLLM `logprobs_mode` whose sampled-token log-probs are of the trainer's
distribution (which distribution, and why not vLLM's processed one: there).

Must not: import vLLM (engine/rollout/vllm_engine.py builds `SamplingParams` from `sampling_kwargs`) or anything of
the engine's but its config.

Test: tests/unit/test_sampling_settings.py (the key table against vLLM's `SamplingParams`, the mode choice);
tests/integration/test_trl_api_run.py (a top_k / top_p run learns, IS weights ~1).
"""

from __future__ import annotations

from typing import Any

from engine.config import GenerationConfig

VLLM_SAMPLING_KEYS = frozenset({
    "allowed_token_ids", "bad_words", "frequency_penalty", "ignore_eos", "include_stop_str_in_output",
    "logit_bias", "max_tokens", "min_p", "min_tokens", "presence_penalty", "repetition_penalty", "skip_special_tokens",
    "spaces_between_special_tokens", "stop", "stop_token_ids", "structured_outputs", "temperature",
    "thinking_token_budget", "top_k", "top_p", "extra_args",
})
"""vLLM 0.32 `SamplingParams` fields a user may set through `generation_kwargs` (checked against vLLM by the unit
test); the rest are the engine's own (n, logprobs, seed, ...) or output plumbing."""

ENGINE_OWNED_KEYS = {
    "n": "the engine samples grpo.num_generations completions per prompt",
    "logprobs": "the engine asks for the sampled token's log-prob (the trainer's IS correction reads it)",
    "prompt_logprobs": "the engine never scores prompts while sampling",
    "seed": "the engine seeds every prompt from the run's seed (exact resume)",
    "num_return_sequences": "the engine samples grpo.num_generations completions per prompt",
}
"""Keys refused with the reason: the engine sets them itself."""

BEAM_SEARCH_KEYS = ("length_penalty", "early_stopping", "num_beam_groups", "diversity_penalty", "constraints")
"""transformers `GenerationConfig` settings that act only in beam search (`num_beams` > 1)."""

HF_TO_VLLM = {"max_new_tokens": "max_tokens", "min_new_tokens": "min_tokens"}
"""Hugging Face `GenerationConfig` names with a vLLM `SamplingParams` equivalent under another name."""

_RESHAPING_DEFAULTS = {"top_k": (0, -1, None), "top_p": (1.0, None), "min_p": (0.0, None),
                       "repetition_penalty": (1.0, None), "presence_penalty": (0.0, None),
                       "frequency_penalty": (0.0, None), "min_tokens": (0, None), "logit_bias": (None, {}),
                       "allowed_token_ids": (None, []), "bad_words": (None, [])}
"""Sampling keys that change the sampled distribution past the temperature, with the values that leave it alone."""


def translate_generation_kwargs(kwargs: dict[str, Any] | None, where: str = "generation.generation_kwargs") -> dict:
    """TRL's `generation_kwargs` as vLLM `SamplingParams` keyword arguments.

    vLLM keys pass unchanged (TRL's vLLM path); Hugging Face `GenerationConfig` names that sampling with vLLM can
    honour are translated (`do_sample=True` and `num_beams=1` are what vLLM does anyway; `max_new_tokens` ->
    `max_tokens`, `min_new_tokens` -> `min_tokens`). Anything else raises ValueError naming the key and why.
    """
    out: dict[str, Any] = {}
    for key, value in (kwargs or {}).items():
        if key in ENGINE_OWNED_KEYS:
            raise ValueError(f"{where}[{key!r}] cannot be set: {ENGINE_OWNED_KEYS[key]}")
        if key == "do_sample":
            if value is not True:
                raise ValueError(f"{where}['do_sample']={value!r}: GRPO samples its completions with vLLM (greedy "
                                 "decoding would give every completion of a group the same reward); remove the key")
        elif key == "num_beams":
            if value != 1:
                raise ValueError(f"{where}['num_beams']={value!r}: vLLM's SamplingParams has no beam search (the "
                                 "engine samples with vLLM; TRL's vLLM path passes the key to SamplingParams too, "
                                 "which raises TypeError; only TRL without vLLM beam-samples, with transformers' "
                                 "generate()); remove the key or set it to 1")
        elif key in BEAM_SEARCH_KEYS:
            raise ValueError(f"{where}[{key!r}]: a beam-search setting of transformers' generate() (it acts only "
                             "with num_beams > 1); the engine samples with vLLM, which has no beam search: remove "
                             "the key")
        elif key in HF_TO_VLLM:
            out[HF_TO_VLLM[key]] = value
        elif key in VLLM_SAMPLING_KEYS:
            out[key] = value
        else:
            raise ValueError(f"{where}[{key!r}]: vLLM's SamplingParams has no such setting and the engine samples "
                             f"with vLLM (accepted: {', '.join(sorted(VLLM_SAMPLING_KEYS | set(HF_TO_VLLM)))}, "
                             "do_sample=True, num_beams=1)")
    return out


def sampling_kwargs(gen: GenerationConfig) -> dict[str, Any]:
    """The `generation` section as vLLM `SamplingParams` keyword arguments (generation_kwargs override the rest)."""
    kwargs = dict(temperature=gen.temperature, top_p=gen.top_p, top_k=gen.top_k if gen.top_k > 0 else -1,
                  min_p=gen.min_p or 0.0, repetition_penalty=gen.repetition_penalty,
                  max_tokens=gen.max_completion_length)
    return kwargs | translate_generation_kwargs(gen.generation_kwargs)


def reshaping_settings(gen: GenerationConfig) -> list[str]:
    """The settings that change the sampled distribution past the temperature (`key=value`), [] if none."""
    kwargs = sampling_kwargs(gen)
    return [f"{k}={kwargs[k]!r}" for k, neutral in _RESHAPING_DEFAULTS.items()
            if k in kwargs and kwargs[k] not in neutral]


def sampling_logprobs_mode(gen: GenerationConfig) -> str | None:
    """vLLM's `logprobs_mode` whose sampled-token log-probs equal the trainer's `log softmax(z / T)[y]`.

    Returns "processed_logprobs" (temperature only), "raw_logprobs" (truncation or penalties at T = 1), or None
    (truncation or penalties at T != 1: vLLM 0.32 reports no log-prob of that distribution).

    Which distribution. The trainer's log-probs are the model's own softmax at the sampling
    temperature over the whole vocabulary, `log softmax(z / T)[y]`, as TRL's and verl's trainers compute them: that
    is the policy being optimised. vLLM's `processed_logprobs` (what TRL asks vLLM for) are taken after penalties,
    min_p, top_k and top_p, i.e. renormalised over the truncated support: with `top_k=10, top_p=0.9` on the tiny
    models they sit ~3.3 nats/token above the trainer's, the IS weight exp(sum of the differences) is ~1e-12 and
    nothing learns (TRL's open issue huggingface/trl#6789). Making the trainer compute the processed distribution
    instead would need the sampler's kept-token set per position inside the fused LM-head kernel (vocab-parallel
    top-p is a global sort) and would change the objective to the truncated policy; we keep the trainer's (TRL's and
    verl's) objective and ask vLLM for the same quantity: with truncation or penalties in play, `raw_logprobs` (the
    model's softmax before any processing) equals it at T = 1. vLLM 0.32 has no mode "after temperature, before
    truncation", so for T != 1 with truncation no vLLM log-prob is of the trainer's distribution: this returns None,
    the engine reports NaN (unavailable), and engine/validation.py refuses the settings that would silently read
    them (the vLLM IS correction, the off-policy mask). The truncation itself (sampling from the truncated policy,
    training the full one) stays uncorrected, as in TRL and verl.
    """
    if not reshaping_settings(gen):
        return "processed_logprobs"
    return "raw_logprobs" if float(sampling_kwargs(gen)["temperature"]) == 1.0 else None


def reports_trainer_logprobs(engine_mode: str, gen: GenerationConfig) -> bool:
    """Whether an engine built with `engine_mode` reports the trainer's log-probs for sampling settings `gen`."""
    needed = sampling_logprobs_mode(gen)
    if needed is None:
        return False
    at_unit_temperature = not reshaping_settings(gen) and float(sampling_kwargs(gen)["temperature"]) == 1.0
    return needed == engine_mode or at_unit_temperature
