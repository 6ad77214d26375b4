"""Generation with vLLM: the only module that imports vLLM (STYLE.md rule 4).

Owns: `ColocatedEngine`, a vLLM engine living inside the training process (vLLM's engine core in-process,
`VLLM_ENABLE_V1_MULTIPROCESSING=0`; with several trainer ranks every rank builds its engine with vLLM's
`external_launcher` backend on the trainer's own torch.distributed world, as TRL's colocate mode does), and what it
offers the trainer:
- `generate(prompt_ids, num_generations)`: G sampled completions per prompt with the sampled tokens' log-probs
  (after temperature: `logprobs_mode="processed_logprobs"`, the quantity the trainer's log-probs are compared
  with) and whether each completion was cut by max_completion_length;
- `prompt_logprobs(sequences)`: the engine's log-probs of given token sequences (weight-sync verification);
- `load_weights(named_tensors)`: vLLM's own in-place reload path (`reload_weights`) with Hugging Face names and
  full tensors; in-process, so the tensors are not copied between processes;
- `sleep()` / `wake_up()` around training where vLLM supports it (GPU), `close()`.
Sampling follows the `generation` section (TRL names): temperature, top_p, top_k (0 = off), min_p, repetition
penalty, max_completion_length, generation_kwargs (override the rest).

Must not: know Megatron's layout (engine/weight_sync.py converts), touch Megatron's parallel state.

Test: tests/integration/test_rollout.py.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path

import torch

from engine.config import GenerationConfig, RolloutConfig


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


def _sampling_params(gen: GenerationConfig, num_generations: int, seed: int | None):
    from vllm import SamplingParams

    kwargs = dict(
        n=num_generations, temperature=gen.temperature, top_p=gen.top_p, top_k=gen.top_k if gen.top_k > 0 else -1,
        min_p=gen.min_p or 0.0, repetition_penalty=gen.repetition_penalty, max_tokens=gen.max_completion_length,
        logprobs=0, seed=seed,
    )
    kwargs.update(gen.generation_kwargs or {})
    return SamplingParams(**kwargs)


class ColocatedEngine:
    """A vLLM engine in the training process (see the module docstring)."""

    def __init__(self, model_dir: str | Path, rollout: RolloutConfig, generation: GenerationConfig, *,
                 seed: int, dtype: str, world_size: int = 1):
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
        on_gpu = torch.cuda.is_available()
        if not on_gpu:
            os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")  # GiB of host memory for the KV cache
        from vllm import LLM

        kwargs = {}
        if world_size > 1:
            kwargs["distributed_executor_backend"] = "external_launcher"
            # NOTE: vLLM's CPU TP communicator names its shared memory after VLLM_DIST_IDENT, which is empty under
            # external_launcher: two runs on one machine (or a killed run's leftovers) would share segments.
            # The rendezvous port is unique among the jobs running on a machine and the same on all their ranks.
            os.environ.setdefault("VLLM_DIST_IDENT", f"grpo-{os.environ.get('MASTER_PORT', '0')}")
        self.generation = generation
        self.can_sleep = on_gpu and rollout.vllm_enable_sleep_mode
        self.llm = LLM(
            model=str(model_dir), dtype=dtype, seed=seed, tensor_parallel_size=rollout.vllm_tensor_parallel_size,
            gpu_memory_utilization=rollout.vllm_gpu_memory_utilization, max_model_len=rollout.vllm_max_model_length,
            enable_sleep_mode=self.can_sleep, enforce_eager=not on_gpu, logprobs_mode="processed_logprobs",
            enable_prefix_caching=False,
            model_impl=rollout.vllm_model_impl, **kwargs,
        )

    def generate(self, prompt_ids: list[list[int]], num_generations: int, seeds: list[int] | None = None) -> Rollout:
        """G completions for each prompt (token ids in, token ids out).

        seeds: one sampling seed per prompt (vLLM's per-request generator: the G completions of a prompt draw
        from it in turn), which makes a round reproducible whatever ran before (exact resume); None = the
        engine's global generator.
        """
        from vllm.inputs import TokensPrompt

        if seeds is not None and len(seeds) != len(prompt_ids):
            raise ValueError(f"{len(seeds)} seeds for {len(prompt_ids)} prompts")
        params = ([_sampling_params(self.generation, num_generations, s) for s in seeds] if seeds is not None
                  else _sampling_params(self.generation, num_generations, None))
        outputs = self.llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompt_ids], params, use_tqdm=False)
        rollout = Rollout([], [], [], [])
        for prompt, output in zip(prompt_ids, outputs):
            for completion in output.outputs:
                ids = list(completion.token_ids)
                rollout.prompt_ids.append(list(prompt))
                rollout.completion_ids.append(ids)
                rollout.sampling_logprobs.append([lp[t].logprob for t, lp in zip(ids, completion.logprobs)])
                rollout.is_truncated.append(completion.finish_reason == "length")
        return rollout

    def prompt_logprobs(self, sequences: list[list[int]], temperature: float) -> list[list[float]]:
        """The engine's log-prob of every token of each sequence after the first, at `temperature`."""
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        params = SamplingParams(max_tokens=1, prompt_logprobs=0, temperature=temperature)
        outputs = self.llm.generate([TokensPrompt(prompt_token_ids=s) for s in sequences], params, use_tqdm=False)
        return [[lp[t].logprob for t, lp in zip(seq[1:], out.prompt_logprobs[1:])] for seq, out in zip(sequences, outputs)]

    def load_weights(self, named_tensors) -> None:
        """Load (HF name, full tensor) pairs through vLLM's in-place reload path; then drop cached prefixes."""
        self.llm.collective_rpc("reload_weights", kwargs={"weights_iterator": iter(named_tensors)})
        if self.llm.reset_prefix_cache() is False:
            raise RuntimeError("vLLM refused to reset its prefix cache after a weight load (requests still running?)")

    def sleep(self) -> None:
        """Free the engine's accelerator memory for training (level 1 keeps weights in host memory)."""
        if self.can_sleep:
            self.llm.sleep(level=1)

    def wake_up(self) -> None:
        if self.can_sleep:
            self.llm.wake_up()

    def close(self) -> None:
        """Shut the engine down (before the trainer's process groups are destroyed)."""
        engine = getattr(self.llm, "llm_engine", None)
        if engine is not None and hasattr(engine, "engine_core"):
            engine.engine_core.shutdown()
        self.llm = None
