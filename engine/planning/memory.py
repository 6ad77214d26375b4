"""The memory model: every per-GPU memory term of a config on a cluster shape, each with its arithmetic and the
formula it comes from, summed into one `Budget` per kind of GPU (training, inference).

Owns: `Term` / `Budget`, the sequence bound (`sequence_lengths`), the training GPU's terms (weights, gradients,
optimizer states, reference, activations, the loss workspace, a colocated vLLM: `training_budget`) and the inference
GPU's (vLLM weights, KV cache: `inference_budget`), and how bytes and counts read in arithmetic (`format_gib`,
`format_count`).

Must not: import torch, Megatron or vLLM (it runs on a login node in a second), check that the layout divides
(engine/planning/shapes.py does, before any term is sized), or print (engine/planning/planner.py assembles and
formats the plan). It takes the root config because memory is a cross-section question (like `engine.validation`).

Each formula and its source (Megatron-LM, Korthikanti et al. 2022, Narayanan et al. 2021, vLLM) is in the docstring
of the function that computes the term. Bytes; s = tokens per sequence, b = micro-batch size, h = hidden size, a / g =
query / KV heads, d = head dim, f = MLP size, L = layers, V = padded vocabulary, t = TP, p = PP.

Test: `pytest tests/unit/test_planner.py` (hand-computed cases, the published tables and logs cited in the functions).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from engine.config import EngineConfig
from engine.lora_settings import lora_settings_from_config, vllm_max_lora_rank
from engine.planning.shapes import ClusterShape, ModelDims, PlanError, megatron_padded_vocab, num_rollout_servers
from engine.recompute import Recompute, resolve_recompute
from engine.validation import Derived

GIB = 2**30
VLLM_BLOCK_SIZE = 16
"""Tokens per KV-cache block (vLLM's default `block_size` on GPU)."""
VLLM_VOCAB_PADDING = 64
"""vLLM pads the embedding / LM head rows to a multiple of this (`DEFAULT_VOCAB_PADDING_SIZE`)."""
PER_TOKEN_LOSS_FLOATS = 16
"""float32 values per completion token around the fused loss (see `loss_terms`)."""


@dataclass(frozen=True, slots=True)
class Term:
    """One memory term of one GPU: its name, its arithmetic as printed, and its bytes."""

    label: str
    arithmetic: str
    nbytes: float


@dataclass(slots=True)
class Budget:
    """One kind of GPU: the memory terms of its worst case and the limit they must stay under.

    Every budget ends with a `reserve` term, `reserve_gib` (default 4 GiB): what the formulas leave out. CUDA
    context, NCCL buffers and allocator fragmentation on training GPUs; vLLM's profiled activation peak, CUDA graphs
    and non-torch memory on inference GPUs. It is an assumption, printed, and set with `--reserve-gib` once measured.
    """

    title: str
    terms: list[Term]
    limit_bytes: float
    limit_text: str
    notes: list[str] = field(default_factory=list)
    hint: str = ""
    """What to change when it does not fit."""

    @property
    def total_bytes(self) -> float:
        return sum(t.nbytes for t in self.terms)

    @property
    def fits(self) -> bool:
        return self.total_bytes <= self.limit_bytes


def format_gib(nbytes: float) -> str:
    return f"{nbytes / GIB:.2f} GiB"


def format_count(x: float) -> str:
    """A count as it reads best in arithmetic: 72.71e9, 877.7e6, 8192."""
    if x >= 1e9:
        return f"{x / 1e9:.2f}e9"
    if x >= 1e6:
        return f"{x / 1e6:.1f}e6"
    return f"{x:.0f}" if float(x).is_integer() else f"{x:.2f}"


def sequence_lengths(cfg: EngineConfig) -> tuple[int, int, str]:
    """(prompt tokens, completion tokens, where the prompt bound comes from) of the longest sequence."""
    completion = cfg.generation.max_completion_length
    if cfg.data.max_prompt_length is not None:
        return cfg.data.max_prompt_length, completion, "data.max_prompt_length"
    if cfg.rollout.vllm_max_model_length is not None:
        return cfg.rollout.vllm_max_model_length - completion, completion, "rollout.vllm_max_model_length - completion"
    raise PlanError(
        "the planner needs a bound on the sequence length: set data.max_prompt_length (tokens; longer prompts are "
        "refused, never cut) or rollout.vllm_max_model_length"
    )


def _optimizer_bytes(cfg: EngineConfig) -> tuple[int, int, int, str]:
    """(weight, main-grad, optimizer-state) bytes per parameter and the optimizer's description.

    Megatron Core user guide, "Distributed Optimizer" table
    (https://docs.nvidia.com/megatron-core/developer-guide/latest/distrib_optimizer.html): bf16 params with fp32
    grads 18 B without the distributed optimizer, 6 + 12/dp with it; fp32 params 16 B, 8 + 8/dp. That is weights
    2 B + main grads 4 B (fp32: `grad_reduce_in_fp32=True` in engine/policy/optimizer.py) + fp32 master 4 B + Adam m, v
    8 B, the last 12 B sharded over DP by the distributed optimizer. SGD keeps one state (4 B) instead of two.
    optimizer.optimizer_state_dtype=bfloat16 stores Adam's m, v in 2 B each (4 B).
    """
    weight = 4 if cfg.model.dtype == "float32" else 2
    master = 0 if weight == 4 else 4
    adam, bf16_moments = cfg.optimizer.optim == "adam", cfg.optimizer.optimizer_state_dtype == "bfloat16"
    states = (4 if bf16_moments else 8) if adam else 4
    parts = (["fp32 master"] if master else []) + ([f"Adam m, v{' (bf16)' * bf16_moments}"] if adam else ["SGD momentum"])
    return weight, 4, master + states, " + ".join(parts)


def _stage_params(dims: ModelDims, cfg: EngineConfig, stage: int) -> tuple[float, str]:
    """Parameters one GPU of pipeline stage `stage` holds, with the arithmetic.

    Worst pipeline stage: (L/p) * layer / t + V*h/t for the stage that holds the embedding (the first) or the output
    layer (the last; a tied embedding is kept there as a copy when p > 1). Megatron-LM's accounting,
    `megatron/training/theoretical_memory_usage.py::compute_weight_and_optimizer_memory` ("most loaded shard":
    (block/p + embedding)/t, plus a second embedding when untied and p = 1). We count exactly: layer = h*a*d +
    2*h*g*d + a*d*h (QKV, output) + QKV bias + 3*h*f (SwiGLU) split over t, plus 2*h norm weights that Megatron
    replicates over TP. V is Megatron's padded vocabulary (`engine.policy.model.padded_vocab_size`).
    """
    tp, pp = cfg.parallel.tp_size, cfg.parallel.pp_size
    vocab = megatron_padded_vocab(dims.vocab_size, cfg.model.make_vocab_size_divisible_by, tp)
    split, replicated = dims.layer_params()
    layers = dims.num_layers // pp
    params = layers * (split / tp + replicated)
    text = f"{layers} layers x ({format_count(split)} / {tp} + {format_count(replicated)})"
    tables = (stage == 0) + (stage == pp - 1 and (pp > 1 or not dims.tie_word_embeddings))
    if tables:
        params += tables * vocab * dims.hidden_size / tp
        text += f" + {tables} x {vocab} x {dims.hidden_size} / {tp}"
    if stage == pp - 1:
        params += dims.hidden_size
    return params, text


def _stage_expert_params(dims: ModelDims, cfg: EngineConfig) -> tuple[float, str]:
    """Routed-expert parameters one GPU holds: its stage's layers x E x 3*h*f_moe / (ep x expert_tp).

    Mixture of experts (Qwen3-MoE): a layer's routed experts, E x 3*h*f_moe parameters (SwiGLU gate, up, down of width
    f_moe = moe_intermediate_size), are split over ep x expert_tp ranks (Megatron's expert grid: expert_tp x ep x
    expert_dp x pp = world size), the rest of the layer (attention; the router, E x h, replicated) as in
    `_stage_params`. Expert gradients follow the expert weights; under the distributed optimizer expert Adam states
    are sharded over expert_dp = tp*dp / (ep*expert_tp) (Megatron's `expt_dp` group, `_expert_dp`), the rest over dp.
    MoE activations: `activation_term`, the token dispatch: `alltoall_term`. vLLM (no expert parallelism here) splits
    every expert over its TP ranks (`_vllm_weights`).
    """
    if not dims.is_moe:
        return 0.0, ""
    par = cfg.parallel
    layers, split = dims.num_layers // par.pp_size, par.ep_size * par.expert_tp_size
    params = layers * dims.expert_params() / split
    text = (f"experts: {layers} layers x {dims.num_experts} x 3 x {dims.hidden_size} x {dims.moe_intermediate_size} / "
            f"(ep {par.ep_size} x expert_tp {par.expert_tp_size})")
    return params, text


def _expert_dp(cfg: EngineConfig, derived: Derived) -> int:
    """Expert data-parallel size: the ranks of a stage (tp x dp) over ep x expert_tp (Megatron's expert grid)."""
    par = cfg.parallel
    return max(par.tp_size * derived.dp_size // (par.ep_size * par.expert_tp_size), 1)


def alltoall_term(cfg: EngineConfig, dims: ModelDims) -> Term:
    """MoE token dispatch of one layer: each token's k routed copies (s*b*k x h) leave for the experts' ranks and
    come back (dispatch and combine buffers, model dtype), held while that layer runs (full recompute: one layer at a
    time; without recompute the permuted copies are counted in the activations' k*f_moe term)."""
    prompt, completion, _ = sequence_lengths(cfg)
    s, b, k, h = prompt + completion, cfg.train.per_device_train_batch_size, dims.num_experts_per_tok, dims.hidden_size
    wbytes = _optimizer_bytes(cfg)[0]
    t = cfg.parallel.tp_size if cfg.parallel.sequence_parallel else 1
    nbytes = 2 * s * b * k * h * wbytes / t
    text = (f"2 (dispatch, combine) x s*b*k*h = 2 x {s}*{b}*{k}*{h} x {wbytes} B{' / tp ' + str(t) + ' (SP)' if t > 1 else ''}"
            " (tokens balanced over experts)")
    return Term("MoE all-to-all", text, nbytes)


def _in_flight(cfg: EngineConfig, stage: int, num_microbatches: int) -> tuple[float, str]:
    """Micro-batches whose activations stage `stage` holds at the 1F1B peak.

    Narayanan et al. 2021 (https://arxiv.org/abs/2104.04473) §2.2 and Megatron-LM's `compute_activation_memory`:
    stage k of the 1F1B schedule holds min(p - k, M) micro-batches; the interleaved schedule holds
    p * (1 + (p - 1)/(p * vpp)) on the first stage.
    """
    pp, vpp = cfg.parallel.pp_size, cfg.parallel.virtual_pipeline_size
    if pp == 1:
        return 1, "1 micro-batch"
    if vpp and vpp > 1:
        value = pp * (1 + (pp - 1) / (pp * vpp))
        return value, f"{pp} x (1 + {pp - 1}/({pp}*{vpp})) = {value:.2f} micro-batches (interleaved)"
    value = min(pp - stage, num_microbatches)
    return value, f"min(pp - stage, M) = min({pp} - {stage}, {num_microbatches}) = {value} micro-batches"


def plan_recompute(cfg: EngineConfig, dims: ModelDims) -> Recompute:
    """The activation recompute the trainer will run for this model and layout (what Megatron is given)."""
    chunks = cfg.parallel.pp_size * (cfg.parallel.virtual_pipeline_size or 1)
    return resolve_recompute(cfg.train, dims.num_layers, chunks, dims.is_moe)


def attention_activations(dims: ModelDims) -> float:
    """The attention's TP-split activations per layer in units of s*b*h (2-byte elements): GQA's Q 2 + K, V 4*g/a +
    output 2 = 4 + 4*g/a; MLA (DeepSeek-V3) per head Q and K of d + rope, V and output of v: 4*a*(d + rope + v)/h
    (DeepSeek-V3: 4*128*(128 + 64 + 128)/7168 = 22.86; its latents, q_lora + kv_lora + rope per token, are small)."""
    if dims.is_mla:
        return 4 * dims.num_heads * (dims.d + dims.qk_rope_head_dim + dims.v_head_dim) / dims.hidden_size
    return 4 + 4 * dims.num_kv_heads / dims.num_heads


def score_bytes(dims: ModelDims) -> int:
    """Bytes an eager attention keeps per score element: Megatron's local attention the paper's 5 (scores 2, softmax
    2, dropout mask 1; GPT-OSS's too); Gemma's and Cohere 2's windowed core attention (engine/models/gemma/layers.py)
    6, its float32 softmax output 4 and the probabilities cast back 2, and 2 more with Gemma 2's soft-capping (tanh
    keeps its output for the backward)."""
    if not dims.sliding_window or dims.sinks:
        return 5
    return 6 + 2 * dims.attention_softcap


def kv_tokens_text(dims: ModelDims, tokens: int) -> tuple[int, str]:
    """KV-cache token slots one sequence of `tokens` (block-rounded) takes over all layers, with the arithmetic. vLLM's
    hybrid KV-cache manager (its default) keeps a sliding-window layer's blocks of the last `sliding_window` tokens
    only (SlidingWindowSpec: the window rounded up to blocks, plus the block being written); full layers keep every
    token. Gemma-3-27B at 32k: 52 sliding layers x 1040 + 10 full x 32768 slots, 5.3x fewer than 62 x 32768."""
    full = dims.num_layers - dims.sliding_layers
    if not dims.sliding_layers:
        return dims.num_layers * tokens, f"{dims.num_layers} layers x {tokens} tokens"
    window = min(tokens, (-(-dims.sliding_window // VLLM_BLOCK_SIZE) + 1) * VLLM_BLOCK_SIZE)
    return (full * tokens + dims.sliding_layers * window,
            f"({full} full layers x {tokens} + {dims.sliding_layers} sliding layers x {window} (window "
            f"{dims.sliding_window} + a block)) tokens")


def activation_term(cfg: EngineConfig, dims: ModelDims, stage: int, num_microbatches: int) -> Term:
    """Activation memory of one GPU of pipeline stage `stage`, with the recompute that runs (`plan_recompute`).

    Per layer, Korthikanti et al. 2022, "Reducing Activation Recomputation in Large Transformer Models"
    (https://arxiv.org/abs/2205.05198), Table 2 and §4: s*b*h*(34 + 5*a*s/h) without parallelism; with TP
    s*b*h*(10 + 24/t + 5*a*s/(h*t)); with TP and sequence parallelism s*b*h*(34 + 5*a*s/h)/t. Of the 34: 10 are
    held whole on every TP rank without SP (two norm inputs 4, QKV and fc1 inputs 4, two dropout masks 2) and 24 are
    split by TP (Q, K 4, V 2, attention output 2, fc1 output and fc2 input 16 for f = 4h). We generalise the split
    part to GQA and SwiGLU: Q 2 + K, V 4*g/a + attention output 2 + SwiGLU fc1 output (gate, up) 4*f/h + fc2 input
    2*f/h, i.e. 4 + 4*g/a + 6*f/h (a GeLU MLP's 4*f/h becomes 6*f/h; Megatron-LM's own `compute_activation_memory`
    uses 18 + 4*f/h, not counting SwiGLU's gate half). The 5*a*s/h term is the attention score matrix: fused (flash)
    attention, which Transformer Engine's layer spec uses, never stores it (the paper's "selective recompute" row,
    s*b*h*34/t), so it is counted only for `model.transformer_impl: local` with `model.attention_implementation: eager` or GPT-OSS's own attention
(SDPA, the local spec's default, keeps none either). MoE: the MLP's 6*f/h becomes
    6*k*f_moe/h (each token's k routed copies, tokens assumed balanced over experts).

    Recompute, as it runs (`train.gradient_checkpointing` and `train.recompute_*`, resolved by
    `engine.recompute.resolve_recompute`, the same function that configures Megatron). Full, uniform, n layers per
    unit: each unit keeps only its input, 2*s*b*h (/t under SP: the input is the sequence-parallel shard), for
    L_stage / n units, plus the working set of the one unit (n layers) recomputed at a time in the backward. Paper §4
    "full activation recomputation: 2*s*b*h*L". Full, block, n layers per model chunk: those n x vpp layers of the
    stage keep their input only, the others everything, plus one recomputed layer's working set. Selective: every
    layer keeps everything but what its recomputed modules would hold: `core_attn` the attention scores (the 5*a*s/h
    term, local spec with eager attention only), `mlp` / `moe` the MLP's inside (6*f/h, or 6*k*f_moe/h; its input is the norm output kept
    anyway), plus that part of the one layer being recomputed in the backward. None: every layer keeps everything.
    These are the paper's stored activations; the backward's transient gradient buffers are not counted (measured
    against this model: benchmarks/bench_recompute.py).
    """
    prompt, completion, _ = sequence_lengths(cfg)
    s, b, h, t = prompt + completion, cfg.train.per_device_train_batch_size, dims.hidden_size, cfg.parallel.tp_size
    sp, rc = cfg.parallel.sequence_parallel, plan_recompute(cfg, dims)
    sbh = s * b * h
    ffn = dims.num_experts_per_tok * dims.moe_intermediate_size if dims.is_moe else dims.intermediate_size
    # SDPA and TE's fused attention keep no s x s scores; GPT-OSS (sinks) has its own eager attention on the local spec
    own = bool(dims.sinks or dims.sliding_window)  # and so have the windowed families: `score_bytes`
    eager = cfg.model.transformer_impl == "local" and (cfg.model.attention_implementation == "eager" or own)
    scores = score_bytes(dims) * dims.num_heads * s / h if eager else 0.0
    mlp = 6 * ffn / h  # MoE: each token's k routed copies of f_moe
    split = attention_activations(dims) + mlp + scores
    full_split, removed = split, 0.0
    if rc.granularity == "selective":  # the recomputed modules' insides are not kept
        removed = scores * ("core_attn" in rc.modules) + mlp * bool({"mlp", "moe"} & set(rc.modules))
        split -= removed
    per_layer = sbh * (10 + split) / t if sp else sbh * (10 + split / t)
    layer_text = f"(10 + {split:.2f}) / {t}" if sp else f"(10 + {split:.2f} / {t})"
    layers = dims.num_layers // cfg.parallel.pp_size
    in_flight, in_flight_text = _in_flight(cfg, stage, num_microbatches)
    sbh_text = f"s*b*h = {s}*{b}*{h} = {format_count(sbh)}"
    stored, stored_text = (2 * sbh / t, f"2 / {t}") if sp else (2 * sbh, "2")
    if rc.granularity == "full" and rc.method == "uniform":
        units = layers // rc.num_layers
        nbytes = units * in_flight * stored + rc.num_layers * per_layer
        text = (f"full recompute, uniform: {layers} layers / {rc.num_layers} = {units} units x {in_flight_text} x "
                f"{stored_text} x s*b*h + one unit recomputed {rc.num_layers} x {layer_text} x s*b*h; {sbh_text}")
    elif rc.granularity == "full":
        recomputed = rc.num_layers * (cfg.parallel.virtual_pipeline_size or 1)
        nbytes = in_flight * (recomputed * stored + (layers - recomputed) * per_layer) + per_layer
        text = (f"full recompute, block: {in_flight_text} x ({recomputed} layers x {stored_text} + "
                f"{layers - recomputed} layers x {layer_text}) x s*b*h + one layer recomputed; {sbh_text}")
    elif rc.granularity == "selective":  # plus what one layer's recomputed modules hold again in its backward
        nbytes = layers * in_flight * per_layer + sbh * removed / t
        text = (f"selective recompute {list(rc.modules)} (split part {full_split:.2f} -> {split:.2f}): {layers} layers "
                f"x {in_flight_text} x {layer_text} x s*b*h + one layer's recomputed part {removed:.2f} / {t} x s*b*h; "
                f"{sbh_text}")
    else:
        nbytes = layers * in_flight * per_layer
        text = f"no recompute: {layers} layers x {in_flight_text} x {layer_text} x s*b*h; {sbh_text}"
    return Term("activations", text, nbytes)


def loss_terms(cfg: EngineConfig, dims: ModelDims) -> tuple[Term, str]:
    """The fused loss's memory on the last stage, and a note with the logits it never materialises.

    The fused kernel's `kernels.loss_workspace_mb` bound on its tile temporaries, the final hidden states gathered out
    of the sequence-parallel region 2*s*b*h, the N = b * max_completion_length completion rows X (N, h) in the model
    dtype and the float32 dX accumulator (N, h) (kernels/chunked_logprob.py, "Memory"), 16 float32 per-token
    values (softmax statistics, saved lse and E[z], log-prob, entropy, their upstream gradients, old / reference /
    sampling log-probs, ratio, KL, mask), and unless `kernels.loss_pass` is "two" the one-pass loss's float32 dW
    (V/t, h) held until the backward (kernels/onepass_logprob.py; counted under "auto" even for a loss that runs two
    passes: an upper bound). Never the (N, V/t) logits; the plan prints what those would take.
    """
    prompt, completion, _ = sequence_lengths(cfg)
    b, h, t = cfg.train.per_device_train_batch_size, dims.hidden_size, cfg.parallel.tp_size
    num_tokens = b * completion
    wbytes = _optimizer_bytes(cfg)[0]
    workspace = cfg.kernels.loss_workspace_mb * 2**20
    hidden = wbytes * (prompt + completion) * b * h
    rows = num_tokens * h * (wbytes + 4)
    stats = num_tokens * PER_TOKEN_LOSS_FLOATS * 4
    vocab = megatron_padded_vocab(dims.vocab_size, cfg.model.make_vocab_size_divisible_by, t)
    logits = num_tokens * (vocab / t) * 4
    text = (
        f"{cfg.kernels.loss_workspace_mb} MiB workspace + final hidden {wbytes} B x {prompt + completion}*{b}*{h} + "
        f"N = {b}*{completion} = {num_tokens} rows x {h} x ({wbytes} B X + 4 B dX) + N x {PER_TOKEN_LOSS_FLOATS} x 4 B"
    )
    onepass_dw = 0 if cfg.kernels.loss_pass == "two" else vocab // t * h * 4  # an upper bound under "auto"
    text += f" + one-pass dW {vocab // t} x {h} x 4 B" if onepass_dw else ""
    note = (
        f"the fused loss never holds the logits: N x V/tp x 4 B = {num_tokens} x {vocab // t} x 4 B = {format_gib(logits)}"
        " (and as much again for their gradient)"
    )
    return Term("loss workspace", text, workspace + hidden + rows + stats + onepass_dw), note



def _adapter_bytes(cfg: EngineConfig) -> tuple[int, int, str]:
    """(weight, optimizer-state) bytes per adapter parameter and the optimizer's description: float32 adapters
    (lora.lora_adapter_dtype, PEFT's default) are their own fp32 master, so a bf16 run's 2 B weight + 12 B master and
    Adam (`_optimizer_bytes`) become 4 B + 8 B; "model" adapters cost what the model's parameters do."""
    weight, _, states, text = _optimizer_bytes(cfg)
    if cfg.lora.lora_adapter_dtype == "float32" and weight != 4:
        return 4, states - 4, text.replace("fp32 master + ", "") + "; float32 adapters: their own master"
    return weight, states, text


def _stage_adapter_params(dims: ModelDims, cfg: EngineConfig, *, tp: int | None = None, layers: int | None = None,
                          r: int | None = None) -> tuple[float, str]:
    """LoRA adapter parameters one GPU holds (engine/policy/lora.py's TP rules; vLLM's LoRA layers shard alike), with
    the arithmetic; tp / layers / r default to the trainer's (parallel.tp_size, a pipeline stage's, lora.lora_r).

    Per layer and target of input width i, output width o, rank r: column-parallel (q/k/v, gate/up) A r*i replicated
    + B o*r / tp; row-parallel (o_proj, down_proj) A r*i / tp + B o*r replicated."""
    if not cfg.lora.use_peft:
        return 0.0, ""
    h, a, g, d, f = dims.hidden_size, dims.num_heads, dims.num_kv_heads, dims.d, dims.intermediate_size
    sizes = {"q_proj": (h, a * d, False), "k_proj": (h, g * d, False), "v_proj": (h, g * d, False),
             "o_proj": (a * d, h, True), "gate_proj": (h, f, False), "up_proj": (h, f, False), "down_proj": (f, h, True)}
    settings = lora_settings_from_config(cfg.lora)
    tp, r = tp or cfg.parallel.tp_size, r or settings.r
    layers = layers or dims.num_layers // cfg.parallel.pp_size
    per_layer = sum(r * i / (tp if row else 1) + o * r / (1 if row else tp)
                    for i, o, row in (sizes[name] for name in settings.target_modules))
    text = (f"adapters: {layers} layers x r {r} x ({' + '.join(settings.target_modules)}; column: A r*in + B out*r/"
            f"{tp}, row: A r*in/{tp} + B out*r)")
    if settings.target_parameters:  # per expert (engine/policy/expert_lora.py): EP splits them, expert TP is 1
        fe, local = dims.moe_intermediate_size, dims.num_experts // cfg.parallel.ep_size
        sizes = {"gate_up_proj": r * (h + 2 * fe), "down_proj": r * (fe + h)}
        per_layer += local * sum(sizes[name] for name in settings.target_parameters)
        text += (f" + {local} local experts x ({' + '.join(settings.target_parameters)}: r*(in + out) each; "
                 "MoE layers counted as all layers)")
    return layers * per_layer, text


def _saved_modules_term(dims: ModelDims, cfg: EngineConfig, stage: int, shard: int) -> list[Term]:
    """LoRA's modules_to_save on pipeline stage `stage` (embed_tokens on the first, lm_head on the last): each
    V/tp x h trained in full as in full fine-tuning (fp32 main grad, `_optimizer_bytes`' state over `shard`), plus
    the frozen copy of its loaded weight kept for the KL reference (engine/policy/lora.py); [] without them."""
    if not cfg.lora.use_peft or not cfg.lora.lora_modules_to_save:
        return []
    names = [n for n, held in (("embed_tokens", stage == 0), ("lm_head", stage == cfg.parallel.pp_size - 1))
             if held and n in cfg.lora.lora_modules_to_save]
    if not names:
        return []
    tp = cfg.parallel.tp_size
    vocab = megatron_padded_vocab(dims.vocab_size, cfg.model.make_vocab_size_divisible_by, tp)
    params = len(names) * vocab * dims.hidden_size / tp
    wbytes, gbytes, obytes, _ = _optimizer_bytes(cfg)
    return [Term("modules_to_save", f"{' + '.join(names)}: {len(names)} x {vocab} x {dims.hidden_size} / {tp} = "
                 f"{format_count(params)} params x ({wbytes} B original copy + {gbytes} B grad + {obytes} B "
                 f"optimizer / {shard})", params * (wbytes + gbytes + obytes / shard))]


def _vllm_lora_slot(dims: ModelDims, cfg: EngineConfig) -> list[Term]:
    """Adapter-only sync (`lora.lora_weight_sync=adapter`): vLLM's LoRA slot on one engine GPU (one adapter,
    `max_loras` 1, stacked at vLLM's max_lora_rank, sharded at vLLM's TP as the trainer's TP rules say), allocated
    with the model, before the KV cache is sized; [] otherwise."""
    if not (cfg.lora.use_peft and cfg.lora.lora_weight_sync == "adapter"):
        return []
    rank = vllm_max_lora_rank(cfg.lora.lora_r)
    params, text = _stage_adapter_params(dims, cfg, tp=cfg.rollout.vllm_tensor_parallel_size,
                                         layers=dims.num_layers, r=rank)
    return [Term("LoRA slot", f"vLLM's max_lora_rank {rank}: {text} = {format_count(params)} params x "
                 f"{_optimizer_bytes(cfg)[0]} B", params * _optimizer_bytes(cfg)[0])]


def _stage_terms(cfg: EngineConfig, dims: ModelDims, derived: Derived, stage: int) -> list[Term]:
    """Training memory of one GPU of pipeline stage `stage`, before any colocated vLLM. With LoRA the base (and the
    experts) are frozen: gradients and optimizer state are the adapters' only (`_stage_adapter_params`)."""
    params, params_text = _stage_params(dims, cfg, stage)
    experts, experts_text = _stage_expert_params(dims, cfg)
    adapters, adapters_text = _stage_adapter_params(dims, cfg)
    wbytes, gbytes, obytes, opt_text = _optimizer_bytes(cfg)
    dist = cfg.optimizer.use_distributed_optimizer
    shard = derived.dp_size if dist else 1
    shard_text = f" / dp {derived.dp_size} (distributed optimizer)" if dist else " (not distributed: replicated over DP)"
    trained = adapters if adapters else params
    total = adapters if adapters else params + experts
    abytes, obytes, opt_text = _adapter_bytes(cfg) if adapters else (wbytes, obytes, opt_text)
    terms = [
        Term("weights", f"{params_text} = {format_count(params)} params x {wbytes} B" + (" (frozen)" if adapters else ""),
             params * wbytes),
        Term("main grads", f"{format_count(total)} x {gbytes} B (fp32, grad_reduce_in_fp32)", total * gbytes),
        Term("optimizer", f"{format_count(trained)} x {obytes} B ({opt_text}){shard_text}", trained * obytes / shard),
    ]
    if adapters:
        terms.insert(1, Term("adapter weights", f"{adapters_text} = {format_count(adapters)} params x {abytes} B",
                             adapters * abytes))
    if experts and adapters:
        terms.insert(1, Term("expert weights", f"{experts_text} = {format_count(experts)} params x {wbytes} B (frozen)",
                             experts * wbytes))
    elif experts:
        edp = _expert_dp(cfg, derived) if dist else 1
        edp_text = (f" / expert dp = tp*dp/(ep*expert_tp) = {edp} (distributed optimizer)" if dist
                    else " (not distributed)")
        terms.insert(1, Term("expert weights", f"{experts_text} = {format_count(experts)} params x {wbytes} B",
                             experts * wbytes))
        terms.append(Term("expert optimizer", f"{format_count(experts)} x {obytes} B{edp_text}", experts * obytes / edp))
    terms += _saved_modules_term(dims, cfg, stage, shard)
    if cfg.grpo.beta > 0 and adapters:  # LoRA: the reference is the policy's base, adapters off (no copy)
        terms.append(Term("reference", "the policy's frozen base with adapters disabled (no copy)", 0.0))
    elif cfg.grpo.beta > 0:
        on_gpu = not cfg.model.offload_reference
        terms.append(Term(
            "reference", f"{format_count(params)} x {wbytes} B" if on_gpu else "offloaded to CPU (model.offload_reference)",
            params * wbytes if on_gpu else 0.0,
        ))
    terms.append(activation_term(cfg, dims, stage, derived.num_microbatches))
    if dims.is_moe:
        terms.append(alltoall_term(cfg, dims))
    return terms


def training_budget(cfg: EngineConfig, dims: ModelDims, shape: ClusterShape, derived: Derived,
                    sync_terms=lambda stage: []) -> Budget:
    """The worst pipeline stage's GPU (first: most activations; last: the LM head and the loss); `sync_terms(stage)`:
    the weight sync's terms of a stage (engine/planning/sync_memory.py `training_sync_terms`)."""
    pp, cap = cfg.parallel.pp_size, shape.gpu_memory_gib * GIB
    loss, loss_note = loss_terms(cfg, dims)
    reserve = Term("reserve", "CUDA context, NCCL buffers, fragmentation (--reserve-gib)", shape.reserve_gib * GIB)
    stages = {0: _stage_terms(cfg, dims, derived, 0) + sync_terms(0)}
    stages[pp - 1] = (_stage_terms(cfg, dims, derived, pp - 1) + sync_terms(pp - 1) if pp > 1 else stages[0]) + [loss]
    notes = [loss_note]
    if cfg.rollout.vllm_mode == "colocate":
        stages = {k: _with_colocated_vllm(cfg, terms, shape) for k, terms in stages.items()}
    totals = {k: sum(t.nbytes for t in terms) for k, terms in stages.items()}
    worst = max(totals, key=lambda k: (totals[k], -k))
    name = "first" if worst == 0 else "last"
    title = f"training GPU, {name} pipeline stage" + (f" (the larger of {pp} stages)" if pp > 1 else "")
    if pp > 1:
        other = pp - 1 if worst == 0 else 0
        notes.insert(0, f"{'last' if other else 'first'} stage: {format_gib(totals[other] + reserve.nbytes)}")
    hint = (
        "raise parallel.pp_size or tp_size, add training nodes (the distributed optimizer shards Adam over DP), lower "
        "train.per_device_train_batch_size, or recompute more (train.gradient_checkpointing, train.recompute_granularity=full, "
        "recompute_method=uniform)"
    )
    return Budget(title, stages[worst] + [reserve], cap, f"{shape.gpu_memory_gib:g} GiB per GPU", notes, hint)


def _with_colocated_vllm(cfg: EngineConfig, terms: list[Term], shape: ClusterShape) -> list[Term]:
    """Colocate: vLLM's share sits next to the trainer's state; with sleep mode only while generating, when the
    activations and the loss workspace are free, so it adds max(0, share - (activations + loss)).

    The share is `rollout.vllm_gpu_memory_utilization` x GPU memory, next to the trainer's weights, gradients and
    optimizer states; without sleep mode the whole share. Inside the share the same vLLM accounting as on an
    inference node applies (`inference_budget`).
    """
    rollout = cfg.rollout
    share = rollout.vllm_gpu_memory_utilization * shape.gpu_memory_gib * GIB
    share_text = f"{rollout.vllm_gpu_memory_utilization} x {shape.gpu_memory_gib:g} GiB = {format_gib(share)}"
    if not rollout.vllm_enable_sleep_mode:
        return terms + [Term("vLLM (colocated)", f"{share_text}, held through training (sleep mode off)", share)]
    transient = sum(t.nbytes for t in terms if t.label in ("activations", "loss workspace"))
    text = (
        f"sleep mode: generation takes {share_text} while activations + loss ({format_gib(transient)}) are free: "
        f"max(0, {share / GIB:.2f} - {transient / GIB:.2f})"
    )
    return terms + [Term("vLLM (colocated)", text, max(0.0, share - transient))]


def _vllm_weights(dims: ModelDims, vtp: int) -> tuple[float, str, float]:
    """Parameters one vLLM rank holds (KV heads replicated when TP > KV heads), with the arithmetic, and how many of
    them are the decoder layers' split linear weights (what block-FP8 serving quantizes)."""
    h, d = dims.hidden_size, dims.d
    split, replicated = dims.layer_params()
    kv_replication = max(vtp // dims.num_kv_heads, 1)
    split += (kv_replication - 1) * 2 * h * dims.num_kv_heads * d
    vocab = -(-dims.vocab_size // VLLM_VOCAB_PADDING) * VLLM_VOCAB_PADDING
    tables = 1 if dims.tie_word_embeddings else 2
    split += dims.expert_params()  # vLLM's fused MoE splits every expert over its TP ranks (no expert parallelism)
    params = dims.num_layers * (split / vtp + replicated) + tables * vocab * h / vtp + h
    text = f"{dims.num_layers} x ({format_count(split)} / {vtp} + {format_count(replicated)}) + {tables} x {vocab} x {h} / {vtp}"
    return params, text, dims.num_layers * split / vtp


def _engine_sequences(cfg: EngineConfig, shape: ClusterShape, derived: Derived) -> tuple[int, int, str]:
    """(vLLM engines, completions on the busiest engine per generation round, the arithmetic).

    Server mode (`rollout.vllm_mode: server`): every `rollout.vllm_nodes_per_server` (K) inference nodes run one
    rollout server (engine/rollout/server.py), one vLLM engine at `rollout.vllm_tensor_parallel_size` over their GPUs
    (K = 1: TP inside the node; K > 1: vLLM's multi-node executor, engine/rollout/server_nodes.py). M inference nodes
    = M / K independent replicas; the trainer is given their URLs in `rollout.vllm_server_base_urls` (checked by
    shapes.py `check_layout`) and splits each round's P prompts among them in list order, so the busiest server gets
    ceil(P / (M / K)) prompts x G completions. A TP smaller than K nodes' GPUs leaves K x GPUs per node - TP GPUs idle
    per server: the plan says so, and does not refuse it (a small model at TP 1 or 2 is legitimate).
    """
    vtp, g = cfg.rollout.vllm_tensor_parallel_size, cfg.grpo.num_generations
    prompts = derived.num_prompts_per_generation
    servers = num_rollout_servers(cfg, shape)
    if servers:
        per_server = -(-prompts // servers)
        text = f"ceil({prompts} prompts / {servers} server(s)) = {per_server} prompts x {g} generations"
        return servers, per_server * g, text
    engines = shape.train_gpus // vtp
    seqs = -(-prompts * g // engines)
    return engines, seqs, f"ceil({prompts} prompts x {g} generations / {engines} engines)"


def inference_budget(cfg: EngineConfig, dims: ModelDims, shape: ClusterShape, derived: Derived) -> Budget:
    """One vLLM GPU: weights at vLLM's TP and the KV cache of its engine's share of a generation round, within
    vLLM's share of the GPU.

    vLLM's accounting (`Worker.determine_available_memory`, logged at start-up as "the current vLLM instance can use
    total_gpu_memory x gpu_memory_utilization ... the rest of the memory reserved for KV Cache"): an engine may use
    `gpu_memory_utilization` x GPU memory for weights (params * 2 B / its TP; KV heads replicated when TP > g), its
    profiled activation peak and CUDA graphs (our `reserve`), and the KV cache. KV cache per token per GPU = 2 (K and
    V) * L * max(g/TP, 1) * d * 2 B (vLLM's `AttentionSpec.page_size_bytes` per token), in blocks of 16 tokens; the
    configured batch is every completion of one generation round on its engine (in server mode the busiest replica's
    share, `_engine_sequences`), each at max prompt + max_completion_length tokens: the worst case vLLM must hold to
    run the round in one wave.
    """
    rollout, vtp = cfg.rollout, cfg.rollout.vllm_tensor_parallel_size
    server = rollout.vllm_mode == "server"
    engines, seqs, seqs_text = _engine_sequences(cfg, shape, derived)
    prompt, completion, _ = sequence_lengths(cfg)
    tokens = -(-(prompt + completion) // VLLM_BLOCK_SIZE) * VLLM_BLOCK_SIZE
    kv_heads = max(dims.num_kv_heads // vtp, 1)
    params, weights_text, linear = _vllm_weights(dims, vtp)
    wbytes = kv_bytes = _optimizer_bytes(cfg)[0]
    weight_bytes, weights_text = params * wbytes, f"{weights_text} = {format_count(params)} params x {wbytes} B"
    if rollout.vllm_weight_dtype == "fp8":  # 1 B + a float32 scale per 128 x 128 block (engine/rollout/fp8_sync.py)
        weight_bytes = linear * (1 + 4 / 128**2) + (params - linear) * wbytes
        weights_text += f", of which {format_count(linear)} FP8 linear weights at 1 B + 4 B / 128^2 (scales)"
    kv_bytes = 1 if rollout.vllm_kv_cache_dtype == "fp8" else kv_bytes
    slots, slots_text = kv_tokens_text(dims, tokens)  # per sequence, over the layers
    per_token = 2 * kv_heads * dims.d * kv_bytes * slots / tokens  # averaged over the sequence's tokens
    kv_text = f"2 (K, V) x {slots_text} x {kv_heads} KV head(s) x {dims.d} x {kv_bytes} B / {tokens} tokens"
    if dims.is_mla:  # vLLM's MLA caches the latent and the rope key, whole on every TP rank
        latent = dims.kv_lora_rank + dims.qk_rope_head_dim
        per_token = dims.num_layers * latent * kv_bytes
        kv_text = f"MLA latent {dims.num_layers} layers x ({dims.kv_lora_rank} + {dims.qk_rope_head_dim}) x {kv_bytes} B"
    share = rollout.vllm_gpu_memory_utilization * shape.gpu_memory_gib * GIB
    reserve = shape.reserve_gib * GIB
    terms = [
        Term("weights", weights_text, weight_bytes),
        Term(
            "KV cache",
            f"{kv_text} = {per_token / 1024:g} KiB/token "
            f"x {seqs} sequences ({seqs_text}) x {tokens} tokens ({prompt} + {completion}, in blocks of "
            f"{VLLM_BLOCK_SIZE})",
            seqs * tokens * per_token,
        ),
        Term("reserve", "vLLM's activation peak, CUDA graphs, non-torch memory (--reserve-gib)", reserve),
    ]
    slot = _vllm_lora_slot(dims, cfg)
    terms[1:1] = slot
    room = share - weight_bytes - reserve - sum(t.nbytes for t in slot)
    concurrency = max(room, 0) / (tokens * per_token)
    nodes = rollout.vllm_nodes_per_server
    if server:
        where = f"{engines} rollout server(s), one per {'inference node' if nodes == 1 else f'{nodes} inference nodes'}"
    else:
        where = f"{engines} engine(s) on the training GPUs (colocated)"
    title = f"inference GPU (vLLM TP {vtp}, {where}, {seqs} sequences per engine)"
    notes = [f"KV room = share - weights{' - LoRA slot' if slot else ''} - reserve = {format_gib(room)}: {concurrency:.2f} sequences of {tokens} tokens "
             f"at once (vLLM logs it as 'Maximum concurrency for {tokens} tokens per request')"]
    idle = nodes * shape.gpus_per_node - vtp
    if server and idle > 0:
        where = (f"each inference node uses vLLM TP {vtp} of its {shape.gpus_per_node} GPUs: {idle} idle per node"
                 if nodes == 1 else f"each rollout server uses vLLM TP {vtp} of its {nodes} x {shape.gpus_per_node} "
                 f"GPUs: {idle} idle per server")
        notes.append(f"{where}; raise rollout.vllm_tensor_parallel_size to use them")
    limit_text = f"vLLM's share {rollout.vllm_gpu_memory_utilization} x {shape.gpu_memory_gib:g} GiB = {format_gib(share)}"
    hint = (
        f"the KV room holds {concurrency:.2f} sequences at full length: lower the generation round "
        f"(per_device_train_batch_size x dp x steps_per_generation = {derived.generation_batch_size}) or "
        "generation.max_completion_length, or raise rollout.vllm_tensor_parallel_size"
        + (", or add inference nodes (rollout server replicas)" if server else "")
    )
    return Budget(title, terms, share, limit_text, notes, hint)
