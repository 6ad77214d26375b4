"""Colocated mode's `RolloutEngine` (engine/rollout/protocol.py): a vLLM engine in every training process.

Owns: `ColocatedRollout`: a round is shared out among the engines (each vLLM TP group generates a contiguous share
of the prompts, woken for it and put to sleep after) and gathered, so every rank holds the whole round; the weight
sync is engine/rollout/colocated_sync.py's, verified against the plan of what each engine rank holds; one sample's
next turn goes into this rank's engine (`ColocatedEngine.add_turn`), which runs it with the other turns in flight;
a multi-turn round at vLLM TP > 1 is driven by rank 0 while the other ranks of its vLLM TP group mirror every engine
call (`driven_turns` / `follow_turns`: engine/rollout/colocated_turns.py).
With LoRA the sync sends the adapters merged into the base (`lora.lora_weight_sync=merged`) or only the adapters into
vLLM's LoRA slot (`adapter`: engine/rollout/adapter_sync.py; every request then names the adapter).

Must not: import vLLM (engine/rollout/vllm_engine.py), or read Megatron's global parallel state (it gets `ps`).

Test: tests/integration/test_trainer.py (the loop, colocated), tests/integration/test_weight_sync.py (turns),
tests/integration/test_agentic.py (a multi-turn run at vLLM TP 2),
tests/integration/test_lora_adapter_sync.py (adapter sync);
tests/unit/test_rollout_protocol.py (the protocol's methods).
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator
from pathlib import Path

import torch
import torch.distributed as dist

from engine.config import ConfigError, GenerationConfig, RolloutConfig
from engine.lora_settings import LoraSettings
from engine.policy.hf_map import ModelDims
from engine.policy.lora import merged_lora
from engine.policy.parallel import ParallelState, new_layout_group
from engine.rollout.adapter_sync import sync_adapter
from engine.rollout.colocated_sync import build_colocated_plan, sync_colocated
from engine.rollout.colocated_turns import MirroredTurns, follow_turns
from engine.rollout.fp8_sync import fp8_layout_problems
from engine.rollout.protocol import TurnRequest, TurnResult
from engine.rollout.rollouts import Rollout


class ColocatedRollout:
    """This rank's vLLM engine, and the trainer's world it shares rounds with (module docstring)."""

    runs_apart = False

    def __init__(self, engine, ps: ParallelState, dims: ModelDims, *, engine_tp: int, bucket_mb: float,
                 ffn_hidden_size: int, dtype: str, adapter: LoraSettings | None = None, fp8: bool = False):
        """
        Args:
            engine: this rank's engine/rollout/vllm_engine.py `ColocatedEngine`.
            engine_tp: `rollout.vllm_tensor_parallel_size` (ranks rank // engine_tp share one engine).
            bucket_mb: `rollout.weight_sync_bucket_mb`.
            adapter: the LoRA setting when only adapters are synced (`lora.lora_weight_sync=adapter`; the engine
                started with LoRA support), else None (full or merged weights).
            fp8: `rollout.vllm_weight_dtype: fp8`: syncs send block-FP8 payload and scales (engine/rollout/fp8_sync.py).
        """
        self.engine, self.ps, self.dims = engine, ps, dims
        self.adapter, self.dtype = adapter, getattr(torch, dtype)
        self.engine_tp, self.bucket_mb = engine_tp, bucket_mb
        self.plan = build_colocated_plan(dims, engine_tp, ffn_hidden_size=ffn_hidden_size, dtype=dtype)
        """What each engine rank holds of every HF tensor (the digests' reference)."""
        self.fp8 = fp8
        self.mirrors_turns = engine_tp > 1 and ps.world_size > 1
        """Multi-turn rounds are driven by rank 0 and mirrored by the other ranks of its vLLM TP group."""
        self._turn_group = None  # rank 0's vLLM TP group (None: it is the whole world)
        if self.mirrors_turns and ps.world_size > engine_tp:
            self._turn_group = new_layout_group(list(range(engine_tp)))  # collective: every rank makes it

    @classmethod
    def build(cls, model_dir: str | Path, rollout: RolloutConfig, generation: GenerationConfig, ps: ParallelState,
              dims: ModelDims, *, seed: int, dtype: str, ffn_hidden_size: int,
              adapter: LoraSettings | None = None) -> ColocatedRollout:
        """Start this rank's engine from `model_dir` (the policy's checkpoint: no first sync is needed; with
        `adapter`, vLLM's LoRA support on: engine/rollout/vllm_lora.py)."""
        from engine.rollout.vllm_engine import ColocatedEngine
        from engine.rollout.vllm_lora import lora_engine_options

        engine_tp = rollout.vllm_tensor_parallel_size
        if rollout.vllm_weight_dtype == "fp8":  # before the engine starts: layouts vLLM's FP8 layers refuse
            plan = build_colocated_plan(dims, engine_tp, ffn_hidden_size=ffn_hidden_size, dtype=dtype)
            for problem in fp8_layout_problems(plan):
                raise ConfigError(problem)
        options = lora_engine_options(adapter.r) if adapter is not None else {}
        engine = ColocatedEngine(model_dir, rollout, generation, seed=seed + ps.rank // engine_tp, dtype=dtype,
                                 world_size=ps.world_size, **options)
        return cls(engine, ps, dims, engine_tp=engine_tp, bucket_mb=rollout.weight_sync_bucket_mb,
                   ffn_hidden_size=ffn_hidden_size, dtype=dtype, adapter=adapter,
                   fp8=rollout.vllm_weight_dtype == "fp8")

    def generate(self, prompt_ids: list[list[int]], num_generations: int, seeds: list[int] | None = None) -> Rollout:
        """Every engine generates a contiguous share of the prompts (the ranks of one vLLM TP group the same share);
        the shares are gathered so every rank holds the whole round, prompt-major (collective)."""
        num_groups, group = self.ps.world_size // self.engine_tp, self.ps.rank // self.engine_tp
        share = -(-len(prompt_ids) // num_groups)
        mine = prompt_ids[group * share : (group + 1) * share]
        mine_seeds = seeds[group * share : (group + 1) * share] if seeds is not None else None
        self.engine.wake_up()
        local = self.engine.generate(mine, num_generations, seeds=mine_seeds) if mine else Rollout.empty()
        self.engine.sleep()
        gathered: list = [None] * self.ps.world_size
        dist.all_gather_object(gathered, local)
        return Rollout.concat(gathered[:: self.engine_tp])

    def generate_async(self, prompt_ids: list[list[int]], num_generations: int,
                       seeds: list[int] | None = None) -> GeneratedRollout:
        """`generate`, run now: the engine shares the trainer's devices, so nothing overlaps (collective now)."""
        return GeneratedRollout(self.generate(prompt_ids, num_generations, seeds))

    def prompt_logprobs(self, sequences: list[list[int]], temperature: float) -> list[list[float]]:
        return self.engine.prompt_logprobs(sequences, temperature)

    def prompt_logprobs_each(self, sequences: list[list[int]], temperature: float) -> list[list[list[float]]]:
        """One replica: this rank's engine."""
        return [self.engine.prompt_logprobs(sequences, temperature)]

    def sync_weights(self, chunks: list, *, verify: bool) -> dict[str, float]:
        """Bucketed in-process loads on every rank (engine/rollout/colocated_sync.py), digests checked with
        `verify` (collective). LoRA adapters are sent merged into their base weights (engine/policy/lora.py), or
        alone into the engine's LoRA slot (`adapter`: engine/rollout/adapter_sync.py)."""
        if self.adapter is not None:
            from engine.policy.peft_adapter import peft_config_of

            config = peft_config_of(self.adapter).to_dict()
            return sync_adapter(chunks, self.ps, self.engine, self.adapter, config, self.dtype, verify=verify,
                                plan=self.plan)
        with merged_lora(chunks):
            return sync_colocated(chunks, self.ps, self.dims, self.engine, self.bucket_mb,
                                  self.plan if verify else None, fp8=self.fp8)

    def submit_turn(self, request: TurnRequest) -> None:
        """Into this rank's engine (with engine TP > 1 every rank of its TP group makes the same turn calls)."""
        self.engine.add_turn(request)

    def collect_turns(self, timeout_s: float | None = None) -> list[TurnResult]:
        """Steps the engine (every turn in flight advances together) until one finishes or, after a whole step,
        `timeout_s` has passed (a short one, when the caller has tool calls running: one step)."""
        return self.engine.step_turns(timeout_s)

    @contextlib.contextmanager
    def driven_turns(self) -> Iterator:
        """Rank 0: the channel a multi-turn round's turns go through. At vLLM TP > 1 a `MirroredTurns`: each engine
        step is broadcast first to the other ranks of rank 0's vLLM TP group (they are in `follow_turns`), and they
        are released when the block ends (after a check that their engines finished the same turns, unless the block
        raised); else this engine itself."""
        if not self.mirrors_turns:
            yield self
            return
        channel = MirroredTurns(self.engine, self._turn_group, src=self.ps.rank)
        completed = False
        try:
            yield channel
            completed = True
        finally:
            channel.end(completed)

    def follow_turns(self) -> None:
        """Every rank but 0, while rank 0 drives a multi-turn round in `driven_turns`: the other ranks of its vLLM TP
        group run the same engine steps (engine/rollout/colocated_turns.py `follow_turns`); any other rank returns."""
        if self.mirrors_turns and 0 < self.ps.rank < self.engine_tp:
            follow_turns(self.engine, self._turn_group, src=0)

    def turn_channel(self) -> ColocatedRollout:
        """Itself: the in-process engine steps one driver's turns (rounds are never generated ahead colocated)."""
        return self

    def recover(self, lost: Exception) -> None:
        """Nothing to recover: the engine lives in this process."""
        raise lost

    def sleep(self) -> None:
        self.engine.sleep()

    def wake_up(self) -> None:
        self.engine.wake_up()

    def close(self) -> None:
        self.engine.close()


class GeneratedRollout:
    """A `PendingRollout` that is already complete (colocated `generate_async`)."""

    regenerated = False

    def __init__(self, rollout: Rollout):
        self.rollout, self.done_at = rollout, time.perf_counter()

    def result(self) -> Rollout:
        return self.rollout
