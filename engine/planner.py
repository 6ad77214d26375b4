"""The memory planner: per-GPU memory of a config on a cluster shape, before anything is launched.

Owns: the model dimensions the plan needs (`ModelDims`: a table of known hub models, a local `config.json`, or the
builtin tiny models; nothing is downloaded), the cluster shape (`ClusterShape`: training / inference nodes, GPUs
per node, GPU memory), the layout checks that need model dimensions or the node split (TP inside a node, heads and
layers divisible, vLLM's TP, one rollout server per inference node), and the arithmetic of every memory term,
printed as arithmetic (`build_plan`, `format_plan`). `grpo-engine plan` and `grpo-engine train --dry-run` call it;
`launch/*.slurm` runs it before starting any node.

Must not: import torch, Megatron or vLLM (it runs on a login node in a second), read the environment, or touch the
network. It takes the root config because memory is a cross-section question (like `engine.validation`).

The formulas and where they come from (bytes; s = tokens per sequence, b = micro-batch size, h = hidden size,
a / g = query / KV heads, d = head dim, f = MLP size, L = layers, V = padded vocabulary, t = TP, p = PP):

- Parameters per GPU, worst pipeline stage: (L/p) * layer / t + V*h/t for the stage that holds the embedding (the
  first) or the output layer (the last; a tied embedding is kept there as a copy when p > 1). Megatron-LM's
  accounting, `megatron/training/theoretical_memory_usage.py::compute_weight_and_optimizer_memory` ("most loaded
  shard": (block/p + embedding)/t, plus a second embedding when untied and p = 1). We count exactly: layer =
  h*a*d + 2*h*g*d + a*d*h (QKV, output) + QKV bias + 3*h*f (SwiGLU) split over t, plus 2*h norm weights that
  Megatron replicates over TP. V is Megatron's padded vocabulary (`engine.model.padded_vocab_size`).
- Bytes per parameter, Megatron Core user guide, "Distributed Optimizer" table
  (https://docs.nvidia.com/megatron-core/developer-guide/latest/distrib_optimizer.html): bf16 params with fp32
  grads 18 B without the distributed optimizer, 6 + 12/dp with it; fp32 params 16 B, 8 + 8/dp. That is weights
  2 B + main grads 4 B (fp32: `grad_reduce_in_fp32=True` in engine/optimizer.py) + fp32 master 4 B + Adam m, v
  8 B, the last 12 B sharded over DP by the distributed optimizer. SGD keeps one state (4 B) instead of two.
- Activations per layer, Korthikanti et al. 2022, "Reducing Activation Recomputation in Large Transformer Models"
  (https://arxiv.org/abs/2205.05198), Table 2 and §4: s*b*h*(34 + 5*a*s/h) without parallelism; with TP
  s*b*h*(10 + 24/t + 5*a*s/(h*t)); with TP and sequence parallelism s*b*h*(34 + 5*a*s/h)/t. Of the 34: 10 are
  held whole on every TP rank without SP (two norm inputs 4, QKV and fc1 inputs 4, two dropout masks 2) and 24 are
  split by TP (Q, K 4, V 2, attention output 2, fc1 output and fc2 input 16 for f = 4h). We generalise the split
  part to GQA and SwiGLU: Q 2 + K, V 4*g/a + attention output 2 + SwiGLU fc1 output (gate, up) 4*f/h + fc2 input
  2*f/h, i.e. 4 + 4*g/a + 6*f/h (a GeLU MLP's 4*f/h becomes 6*f/h; Megatron-LM's own `compute_activation_memory`
  uses 18 + 4*f/h, not counting SwiGLU's gate half). The 5*a*s/h term is the
  attention score matrix: fused (flash) attention, which Transformer Engine's layer spec uses, never stores it
  (the paper's "selective recompute" row, s*b*h*34/t), so it is counted only for `model.transformer_impl: local`.
- Full recompute (`train.gradient_checkpointing`, Megatron's full/uniform recompute of every layer) keeps only each
  layer's input, 2*s*b*h per layer (/t under SP: the input is the sequence-parallel shard), plus one layer's
  working set while that layer is recomputed in the backward. Paper §4 "full activation recomputation: 2*s*b*h*L".
- Micro-batches in flight, Narayanan et al. 2021 (https://arxiv.org/abs/2104.04473) §2.2 and Megatron-LM's
  `compute_activation_memory`: stage k of the 1F1B schedule holds min(p - k, M) micro-batches; the interleaved
  schedule holds p * (1 + (p - 1)/(p * vpp)) on the first stage.
- The loss workspace (last stage): the fused kernel's `kernels.loss_workspace_mb` bound on its tile temporaries,
  the final hidden states gathered out of the sequence-parallel region 2*s*b*h, the N = b * max_completion_length
  completion rows X (N, h) in the model dtype and the float32 dX accumulator (N, h) (kernels/chunked_logprob.py,
  "Memory"), and 16 float32 per-token values (softmax statistics, saved lse and E[z], log-prob, entropy, their
  upstream gradients, old / reference / sampling log-probs, ratio, KL, mask). Never the (N, V/t) logits; the
  plan prints what those would take, for comparison.
- Server mode (`rollout.vllm_mode: server`): each inference node runs one rollout server (engine/rollout_server.py),
  one vLLM engine at `rollout.vllm_tensor_parallel_size` (TP stays inside the node; vLLM spans nodes only under Ray,
  which we do not use). M inference nodes = M independent replicas; the trainer is given their URLs in
  `rollout.vllm_server_base_urls` (one per node, checked here) and splits each round's P prompts among them in list
  order, so the busiest server gets ceil(P / M) prompts x G completions. A TP smaller than the node leaves
  GPUs per node - TP GPUs idle on every inference node: the plan says so, and does not refuse it (a small model at
  TP 1 or 2 is legitimate; to use the whole node, raise the TP or run more nodes).
- Inference, vLLM's accounting (`Worker.determine_available_memory`, logged at start-up as "the current vLLM
  instance can use total_gpu_memory x gpu_memory_utilization ... the rest of the memory reserved for KV Cache"):
  an engine may use `gpu_memory_utilization` x GPU memory for weights (params * 2 B / its TP; KV heads replicated
  when TP > g), its profiled activation peak and CUDA graphs (our `reserve`), and the KV cache. KV cache per token
  per GPU = 2 (K and V) * L * max(g/TP, 1) * d * 2 B (vLLM's `AttentionSpec.page_size_bytes` per token), in blocks
  of 16 tokens; the configured batch is every completion of one generation round on its engine (in server mode
  the busiest replica's share, above), each at max prompt + max_completion_length tokens: the worst case vLLM must
  hold to run the round in one wave.
- Colocated vLLM (`rollout.vllm_mode: colocate`): its share, `gpu_memory_utilization` x GPU memory, sits next to
  the trainer's weights, gradients and optimizer states. With sleep mode it is held only while generating, when
  the activations and the loss workspace are free, so it adds max(0, share - (activations + loss)); without, the
  whole share. Inside the share the same vLLM accounting as on an inference node applies.
- `reserve_gib` (default 4 GiB) is what the formulas leave out: CUDA context, NCCL buffers and allocator
  fragmentation on training GPUs; vLLM's profiled activation peak, CUDA graphs and non-torch memory on inference
  GPUs. It is an assumption, printed, and set with `--reserve-gib` once measured.

Test: `pytest tests/unit/test_planner.py` (hand-computed cases, the published tables and logs cited above).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

from engine.config import ConfigError, EngineConfig
from engine.validation import Derived, validate

GIB = 2**30
VLLM_BLOCK_SIZE = 16
"""Tokens per KV-cache block (vLLM's default `block_size` on GPU)."""
VLLM_VOCAB_PADDING = 64
"""vLLM pads the embedding / LM head rows to a multiple of this (`DEFAULT_VOCAB_PADDING_SIZE`)."""
PER_TOKEN_LOSS_FLOATS = 16
"""float32 values per completion token around the fused loss (see the module docstring)."""
DEFAULT_GPUS_PER_NODE = 8
DEFAULT_GPU_MEMORY_GIB = 79.1
"""An H100 80GB as CUDA reports it to torch and vLLM (vLLM's start-up log on H100 80GB HBM3: "total_gpu_memory
(79.11GiB)"); pass `--gpu-memory-gib` for other GPUs."""
DEFAULT_RESERVE_GIB = 4.0


class PlanError(ConfigError):
    """A layout that does not divide, or a model the planner cannot size; the message shows the arithmetic."""


@dataclass(frozen=True, slots=True)
class ModelDims:
    """The Hugging Face config numbers the plan needs (Qwen2 / Llama: GQA, SwiGLU, RMSNorm)."""

    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    intermediate_size: int
    vocab_size: int
    tie_word_embeddings: bool
    qkv_bias: bool
    head_dim: int = 0
    """0 = hidden_size / num_heads."""

    @property
    def d(self) -> int:
        return self.head_dim or self.hidden_size // self.num_heads

    def layer_params(self) -> tuple[int, int]:
        """(TP-split parameters, TP-replicated parameters) of one decoder layer."""
        h, a, g, d = self.hidden_size, self.num_heads, self.num_kv_heads, self.d
        attention = h * a * d + 2 * h * g * d + a * d * h + ((a + 2 * g) * d if self.qkv_bias else 0)
        return attention + 3 * h * self.intermediate_size, 2 * h

    def total_params(self) -> int:
        """Parameters of the Hugging Face checkpoint (unpadded vocabulary)."""
        split, replicated = self.layer_params()
        embeddings = self.vocab_size * self.hidden_size * (1 if self.tie_word_embeddings else 2)
        return self.num_layers * (split + replicated) + embeddings + self.hidden_size


def _qwen2(h, layers, heads, kv, ffn, vocab, tied):
    return ModelDims(h, layers, heads, kv, ffn, vocab, tie_word_embeddings=tied, qkv_bias=True)


def _llama(h, layers, heads, kv, ffn, vocab):
    return ModelDims(h, layers, heads, kv, ffn, vocab, tie_word_embeddings=False, qkv_bias=False)


_QWEN25 = {
    "0.5b": _qwen2(896, 24, 14, 2, 4864, 151936, True),
    "7b": _qwen2(3584, 28, 28, 4, 18944, 152064, False),
    "72b": _qwen2(8192, 80, 64, 8, 29568, 152064, False),
}
_LLAMA_8B = _llama(4096, 32, 32, 8, 14336, 128256)
_LLAMA_70B = _llama(8192, 80, 64, 8, 28672, 128256)

KNOWN_MODELS: dict[str, ModelDims] = {
    **{f"qwen/qwen2.5-{size}{suffix}": dims for size, dims in _QWEN25.items() for suffix in ("", "-instruct")},
    **{f"meta-llama/{name}{suffix}": dims for name, dims in [
        ("llama-3.1-8b", _LLAMA_8B), ("meta-llama-3.1-8b", _LLAMA_8B), ("meta-llama-3-8b", _LLAMA_8B),
        ("llama-3.1-70b", _LLAMA_70B), ("meta-llama-3.1-70b", _LLAMA_70B), ("llama-3.3-70b", _LLAMA_70B),
    ] for suffix in ("", "-instruct")},
    # engine/tiny_model.py: hidden 128, 4 layers, 4 / 2 heads, MLP 352, vocabulary 400, untied.
    "builtin:tiny-qwen2": _qwen2(128, 4, 4, 2, 352, 400, False),
    "builtin:tiny-qwen2-arith": _qwen2(128, 4, 4, 2, 352, 400, False),  # the demo's warm start: same shape
    "builtin:tiny-llama": _llama(128, 4, 4, 2, 352, 400),
}
"""Dimensions of the models the shipped configs name, from each model's config.json on the Hugging Face hub,
keyed by lower-case hub name. Qwen2 has a QKV bias, Llama none."""


def load_model_dims(name_or_path: str) -> ModelDims:
    """Dimensions of `model.name_or_path`: a local directory's config.json, else the table of known models.

    Raises:
        PlanError for a hub name not in the table (the planner never downloads).
    """
    config_file = Path(name_or_path) / "config.json"
    if config_file.is_file():
        hf = json.loads(config_file.read_text())
        hf = hf.get("text_config", hf)
        head_dim = hf.get("head_dim") or 0
        return ModelDims(
            hidden_size=hf["hidden_size"], num_layers=hf["num_hidden_layers"], num_heads=hf["num_attention_heads"],
            num_kv_heads=hf.get("num_key_value_heads") or hf["num_attention_heads"],
            intermediate_size=hf["intermediate_size"], vocab_size=hf["vocab_size"],
            tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
            qkv_bias=bool(hf.get("attention_bias", hf.get("model_type") == "qwen2")),
            head_dim=0 if head_dim * hf["num_attention_heads"] == hf["hidden_size"] else head_dim,
        )
    dims = KNOWN_MODELS.get(name_or_path.lower())
    if dims is None:
        known = ", ".join(sorted({k for k in KNOWN_MODELS if not k.endswith("-instruct")}))
        raise PlanError(
            f"model.name_or_path={name_or_path!r}: the planner does not know this model's dimensions and does not "
            f"download; point model.name_or_path at a local directory with its config.json, or use one of: {known}"
        )
    return dims


def megatron_padded_vocab(vocab_size: int, divisible_by: int, tp_size: int) -> int:
    """Megatron-LM's padding rule, as `engine.model.padded_vocab_size` (which imports torch; a test ties them)."""
    multiple = divisible_by * tp_size
    return -(-vocab_size // multiple) * multiple


@dataclass(frozen=True, slots=True)
class ClusterShape:
    """Where the job runs: the node split and the GPUs (not config fields: command-line options)."""

    train_nodes: int
    infer_nodes: int
    gpus_per_node: int
    gpu_memory_gib: float = DEFAULT_GPU_MEMORY_GIB
    reserve_gib: float = DEFAULT_RESERVE_GIB

    @property
    def train_gpus(self) -> int:
        return self.train_nodes * self.gpus_per_node


SHAPE_OPTIONS = ("train_nodes", "infer_nodes", "gpus_per_node", "gpu_memory_gib", "reserve_gib")
"""The keyword arguments of `resolve_cluster_shape`, one command-line option each (`--train-nodes`, ...)."""


def resolve_cluster_shape(cfg: EngineConfig, *, train_nodes: int | None = None, infer_nodes: int | None = None,
                          gpus_per_node: int | None = None, gpu_memory_gib: float | None = None,
                          reserve_gib: float | None = None) -> ClusterShape:
    """The cluster shape from command-line values, defaulting from the config's layout.

    Defaults: 8 GPUs per node (or the layout's GPU count when smaller, e.g. 1 for a one-GPU config), as many
    training nodes as tp*pp*dp needs; in `rollout.vllm_mode: server` one inference node per URL of
    `rollout.vllm_server_base_urls` (1 when unset), in colocate mode 0.
    """
    par = cfg.parallel
    layout_gpus = par.tp_size * par.pp_size * (par.dp_size or 1)
    gpn = gpus_per_node or min(DEFAULT_GPUS_PER_NODE, layout_gpus)
    shape = ClusterShape(
        train_nodes=train_nodes if train_nodes is not None else -(-layout_gpus // gpn),
        infer_nodes=infer_nodes if infer_nodes is not None else _default_infer_nodes(cfg),
        gpus_per_node=gpn,
        gpu_memory_gib=gpu_memory_gib if gpu_memory_gib is not None else DEFAULT_GPU_MEMORY_GIB,
        reserve_gib=reserve_gib if reserve_gib is not None else DEFAULT_RESERVE_GIB,
    )
    if min(shape.train_nodes, shape.gpus_per_node) < 1 or shape.infer_nodes < 0 or shape.gpu_memory_gib <= 0:
        raise PlanError(f"cluster shape: node and GPU counts must be >= 1 and memory > 0, got {shape}")
    return shape


def _default_infer_nodes(cfg: EngineConfig) -> int:
    """Server mode: one inference node per rollout server URL (1 without a list); colocate: 0."""
    if cfg.rollout.vllm_mode != "server":
        return 0
    urls = cfg.rollout.vllm_server_base_urls
    return len(urls) if urls else 1


def num_rollout_servers(cfg: EngineConfig, shape: ClusterShape) -> int:
    """Rollout server replicas: one per inference node in server mode (each one vLLM engine), 0 in colocate mode."""
    return shape.infer_nodes if cfg.rollout.vllm_mode == "server" else 0


# ---------------------------------------------------------------------------------------------------------------
# the plan: terms with their arithmetic


@dataclass(frozen=True, slots=True)
class Term:
    label: str
    arithmetic: str
    nbytes: float


@dataclass(slots=True)
class Budget:
    """One kind of GPU: the memory terms of its worst case and the limit they must stay under."""

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


@dataclass(slots=True)
class Plan:
    header: list[str]
    budgets: list[Budget]
    derived: Derived
    shape: ClusterShape

    @property
    def problems(self) -> list[str]:
        return [
            f"{b.title}: total {_gib(b.total_bytes)} > {b.limit_text}; {b.hint}" for b in self.budgets if not b.fits
        ]

    def budget(self, prefix: str) -> Budget:
        return next(b for b in self.budgets if b.title.startswith(prefix))


def _gib(nbytes: float) -> str:
    return f"{nbytes / GIB:.2f} GiB"


def _n(x: float) -> str:
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


def check_layout(cfg: EngineConfig, dims: ModelDims, shape: ClusterShape) -> None:
    """Refuse a layout that does not divide: every problem at once, each with its arithmetic.

    Raises:
        PlanError listing the problems.
    """
    par, ro = cfg.parallel, cfg.rollout
    tp, pp, vpp, gpn = par.tp_size, par.pp_size, par.virtual_pipeline_size or 1, shape.gpus_per_node
    vtp = ro.vllm_tensor_parallel_size
    problems = []
    if gpn % tp:
        problems.append(
            f"parallel.tp_size={tp} must divide the GPUs per node ({gpn} % {tp} = {gpn % tp}): a TP group must stay "
            "inside one node (NVLink); use pipeline or data parallelism across nodes"
        )
    if dims.num_layers % (pp * vpp):
        problems.append(
            f"num_hidden_layers={dims.num_layers} is not divisible by pp_size*virtual_pipeline_size = {pp}*{vpp} = "
            f"{pp * vpp} ({dims.num_layers} % {pp * vpp} = {dims.num_layers % (pp * vpp)})"
        )
    if dims.num_heads % tp or dims.num_kv_heads % tp:
        problems.append(
            f"num_attention_heads={dims.num_heads} and num_key_value_heads={dims.num_kv_heads} must both be divisible "
            f"by parallel.tp_size={tp} (Megatron splits whole query groups)"
        )
    if dims.num_heads % vtp or (dims.num_kv_heads % vtp and vtp % dims.num_kv_heads):
        problems.append(
            f"rollout.vllm_tensor_parallel_size={vtp} must divide num_attention_heads={dims.num_heads} and divide or "
            f"be a multiple of num_key_value_heads={dims.num_kv_heads} (vLLM replicates KV heads only in whole copies)"
        )
    if vtp > gpn:
        problems.append(
            f"rollout.vllm_tensor_parallel_size={vtp} > {gpn} GPUs per node: vLLM's TP spans nodes only under Ray, "
            "which this engine does not use"
        )
    if ro.vllm_mode == "server":
        _check_rollout_servers(cfg, shape, problems)
    elif shape.infer_nodes:
        problems.append(
            f"rollout.vllm_mode='colocate' runs vLLM on the training GPUs: got {shape.infer_nodes} inference node(s); "
            "pass --infer-nodes 0 or set rollout.vllm_mode=server"
        )
    if problems:
        raise PlanError("layout does not divide:\n  - " + "\n  - ".join(problems))


def _check_rollout_servers(cfg: EngineConfig, shape: ClusterShape, problems: list[str]) -> None:
    """Server mode: one rollout server per inference node, and the trainer is given exactly those servers."""
    urls, n = cfg.rollout.vllm_server_base_urls, shape.infer_nodes
    if n < 1:
        problems.append("rollout.vllm_mode='server' needs inference nodes: got 0 (--infer-nodes)")
    elif urls is not None and len(urls) != n:
        problems.append(
            f"rollout.vllm_server_base_urls lists {len(urls)} server(s) but there are {n} inference node(s) "
            f"(--infer-nodes): one rollout server runs per inference node, give one URL each"
        )
    elif urls is None and n > 1:
        problems.append(
            f"{n} inference nodes but the trainer is given one server (rollout.vllm_server_base_url or "
            f"vllm_server_host/port): set rollout.vllm_server_base_urls to one URL per inference node, e.g. "
            f"[http://HOST0:PORT,http://HOST1:PORT] (launch/grpo_72b.slurm does), or use --infer-nodes 1"
        )


def _optimizer_bytes(cfg: EngineConfig) -> tuple[int, int, int, str]:
    """(weight, main-grad, optimizer-state) bytes per parameter and the optimizer's description."""
    weight = 4 if cfg.model.dtype == "float32" else 2
    master = 0 if weight == 4 else 4
    states = 8 if cfg.optimizer.optim == "adam" else 4
    parts = (["fp32 master"] if master else []) + (["Adam m, v"] if states == 8 else ["SGD momentum"])
    return weight, 4, master + states, " + ".join(parts)


def _stage_params(dims: ModelDims, cfg: EngineConfig, stage: int) -> tuple[float, str]:
    """Parameters one GPU of pipeline stage `stage` holds, with the arithmetic."""
    tp, pp = cfg.parallel.tp_size, cfg.parallel.pp_size
    vocab = megatron_padded_vocab(dims.vocab_size, cfg.model.make_vocab_size_divisible_by, tp)
    split, replicated = dims.layer_params()
    layers = dims.num_layers // pp
    params = layers * (split / tp + replicated)
    text = f"{layers} layers x ({_n(split)} / {tp} + {_n(replicated)})"
    tables = (stage == 0) + (stage == pp - 1 and (pp > 1 or not dims.tie_word_embeddings))
    if tables:
        params += tables * vocab * dims.hidden_size / tp
        text += f" + {tables} x {vocab} x {dims.hidden_size} / {tp}"
    if stage == pp - 1:
        params += dims.hidden_size
    return params, text


def _in_flight(cfg: EngineConfig, stage: int, num_microbatches: int) -> tuple[float, str]:
    """Micro-batches whose activations stage `stage` holds at the 1F1B peak."""
    pp, vpp = cfg.parallel.pp_size, cfg.parallel.virtual_pipeline_size
    if pp == 1:
        return 1, "1 micro-batch"
    if vpp and vpp > 1:
        value = pp * (1 + (pp - 1) / (pp * vpp))
        return value, f"{pp} x (1 + {pp - 1}/({pp}*{vpp})) = {value:.2f} micro-batches (interleaved)"
    value = min(pp - stage, num_microbatches)
    return value, f"min(pp - stage, M) = min({pp} - {stage}, {num_microbatches}) = {value} micro-batches"


def activation_term(cfg: EngineConfig, dims: ModelDims, stage: int, num_microbatches: int) -> Term:
    """Activation memory of one GPU of pipeline stage `stage` (module docstring: Korthikanti et al. 2022)."""
    prompt, completion, _ = sequence_lengths(cfg)
    s, b, h, t = prompt + completion, cfg.train.per_device_train_batch_size, dims.hidden_size, cfg.parallel.tp_size
    sp = cfg.parallel.sequence_parallel
    sbh = s * b * h
    split = 4 + 4 * dims.num_kv_heads / dims.num_heads + 6 * dims.intermediate_size / h
    if cfg.model.transformer_impl == "local":
        split += 5 * dims.num_heads * s / h
    per_layer = sbh * (10 + split) / t if sp else sbh * (10 + split / t)
    layer_text = f"(10 + {split:.2f}) / {t}" if sp else f"(10 + {split:.2f} / {t})"
    layers = dims.num_layers // cfg.parallel.pp_size
    in_flight, in_flight_text = _in_flight(cfg, stage, num_microbatches)
    sbh_text = f"s*b*h = {s}*{b}*{h} = {_n(sbh)}"
    if cfg.train.gradient_checkpointing:
        stored = 2 * sbh / t if sp else 2 * sbh
        nbytes = layers * in_flight * stored + per_layer
        text = (
            f"full recompute: {layers} layers x {in_flight_text} x 2{' / ' + str(t) if sp else ''} x s*b*h + one "
            f"layer recomputed {layer_text} x s*b*h; {sbh_text}"
        )
    else:
        nbytes = layers * in_flight * per_layer
        text = f"no recompute: {layers} layers x {in_flight_text} x {layer_text} x s*b*h; {sbh_text}"
    return Term("activations", text, nbytes)


def loss_terms(cfg: EngineConfig, dims: ModelDims) -> tuple[Term, str]:
    """The fused loss's memory on the last stage, and a note with the logits it never materialises."""
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
    note = (
        f"the fused loss never holds the logits: N x V/tp x 4 B = {num_tokens} x {vocab // t} x 4 B = {_gib(logits)}"
        " (and as much again for their gradient)"
    )
    return Term("loss workspace", text, workspace + hidden + rows + stats), note


def _stage_terms(cfg: EngineConfig, dims: ModelDims, d: Derived, stage: int) -> list[Term]:
    """Training memory of one GPU of pipeline stage `stage`, before any colocated vLLM."""
    params, params_text = _stage_params(dims, cfg, stage)
    wbytes, gbytes, obytes, opt_text = _optimizer_bytes(cfg)
    dist = cfg.optimizer.use_distributed_optimizer
    shard = d.dp_size if dist else 1
    shard_text = f" / dp {d.dp_size} (distributed optimizer)" if dist else " (not distributed: replicated over DP)"
    terms = [
        Term("weights", f"{params_text} = {_n(params)} params x {wbytes} B", params * wbytes),
        Term("main grads", f"{_n(params)} x {gbytes} B (fp32, grad_reduce_in_fp32)", params * gbytes),
        Term("optimizer", f"{_n(params)} x {obytes} B ({opt_text}){shard_text}", params * obytes / shard),
    ]
    if cfg.grpo.beta > 0:
        on_gpu = not cfg.model.offload_reference
        terms.append(Term(
            "reference", f"{_n(params)} x {wbytes} B" if on_gpu else "offloaded to CPU (model.offload_reference)",
            params * wbytes if on_gpu else 0.0,
        ))
    terms.append(activation_term(cfg, dims, stage, d.num_microbatches))
    return terms


def _training_budget(cfg: EngineConfig, dims: ModelDims, shape: ClusterShape, d: Derived) -> Budget:
    """The worst pipeline stage's GPU (first: most activations; last: the LM head and the loss)."""
    pp, cap = cfg.parallel.pp_size, shape.gpu_memory_gib * GIB
    loss, loss_note = loss_terms(cfg, dims)
    reserve = Term("reserve", "CUDA context, NCCL buffers, fragmentation (--reserve-gib)", shape.reserve_gib * GIB)
    stages = {0: _stage_terms(cfg, dims, d, 0)}
    stages[pp - 1] = (_stage_terms(cfg, dims, d, pp - 1) if pp > 1 else stages[0]) + [loss]
    notes = [loss_note]
    if cfg.rollout.vllm_mode == "colocate":
        stages = {k: _with_colocated_vllm(cfg, terms, shape) for k, terms in stages.items()}
    totals = {k: sum(t.nbytes for t in terms) for k, terms in stages.items()}
    worst = max(totals, key=lambda k: (totals[k], -k))
    name = "first" if worst == 0 else "last"
    title = f"training GPU, {name} pipeline stage" + (f" (the larger of {pp} stages)" if pp > 1 else "")
    if pp > 1:
        other = pp - 1 if worst == 0 else 0
        notes.insert(0, f"{'last' if other else 'first'} stage: {_gib(totals[other] + reserve.nbytes)}")
    hint = (
        "raise parallel.pp_size or tp_size, add training nodes (the distributed optimizer shards Adam over DP), lower "
        "train.per_device_train_batch_size or turn on train.gradient_checkpointing"
    )
    return Budget(title, stages[worst] + [reserve], cap, f"{shape.gpu_memory_gib:g} GiB per GPU", notes, hint)


def _with_colocated_vllm(cfg: EngineConfig, terms: list[Term], shape: ClusterShape) -> list[Term]:
    """Colocate: vLLM's share sits next to the trainer's state; with sleep mode only while generating, when the
    activations and the loss workspace are free, so it adds max(0, share - (activations + loss))."""
    ro = cfg.rollout
    share = ro.vllm_gpu_memory_utilization * shape.gpu_memory_gib * GIB
    share_text = f"{ro.vllm_gpu_memory_utilization} x {shape.gpu_memory_gib:g} GiB = {_gib(share)}"
    if not ro.vllm_enable_sleep_mode:
        return terms + [Term("vLLM (colocated)", f"{share_text}, held through training (sleep mode off)", share)]
    transient = sum(t.nbytes for t in terms if t.label in ("activations", "loss workspace"))
    text = (
        f"sleep mode: generation takes {share_text} while activations + loss ({_gib(transient)}) are free: "
        f"max(0, {share / GIB:.2f} - {transient / GIB:.2f})"
    )
    return terms + [Term("vLLM (colocated)", text, max(0.0, share - transient))]


def _vllm_weights(dims: ModelDims, vtp: int) -> tuple[float, str]:
    """Parameters one vLLM rank holds (KV heads replicated when TP > KV heads), with the arithmetic."""
    h, d = dims.hidden_size, dims.d
    split, replicated = dims.layer_params()
    kv_replication = max(vtp // dims.num_kv_heads, 1)
    split += (kv_replication - 1) * 2 * h * dims.num_kv_heads * d
    vocab = -(-dims.vocab_size // VLLM_VOCAB_PADDING) * VLLM_VOCAB_PADDING
    tables = 1 if dims.tie_word_embeddings else 2
    params = dims.num_layers * (split / vtp + replicated) + tables * vocab * h / vtp + h
    text = f"{dims.num_layers} x ({_n(split)} / {vtp} + {_n(replicated)}) + {tables} x {vocab} x {h} / {vtp}"
    return params, text


def _engine_sequences(cfg: EngineConfig, shape: ClusterShape, d: Derived) -> tuple[int, int, str]:
    """(vLLM engines, completions on the busiest engine per generation round, the arithmetic)."""
    vtp, g = cfg.rollout.vllm_tensor_parallel_size, cfg.grpo.num_generations
    prompts = d.num_prompts_per_generation
    servers = num_rollout_servers(cfg, shape)
    if servers:
        per_server = -(-prompts // servers)
        text = f"ceil({prompts} prompts / {servers} server(s)) = {per_server} prompts x {g} generations"
        return servers, per_server * g, text
    engines = shape.train_gpus // vtp
    seqs = -(-prompts * g // engines)
    return engines, seqs, f"ceil({prompts} prompts x {g} generations / {engines} engines)"


def _inference_budget(cfg: EngineConfig, dims: ModelDims, shape: ClusterShape, d: Derived) -> Budget:
    """One vLLM GPU: weights at vLLM's TP and the KV cache of its engine's share of a generation round, within
    vLLM's share of the GPU."""
    ro, vtp = cfg.rollout, cfg.rollout.vllm_tensor_parallel_size
    server = ro.vllm_mode == "server"
    engines, seqs, seqs_text = _engine_sequences(cfg, shape, d)
    prompt, completion, _ = sequence_lengths(cfg)
    tokens = -(-(prompt + completion) // VLLM_BLOCK_SIZE) * VLLM_BLOCK_SIZE
    kv_heads = max(dims.num_kv_heads // vtp, 1)
    params, weights_text = _vllm_weights(dims, vtp)
    wbytes = _optimizer_bytes(cfg)[0]
    per_token = 2 * dims.num_layers * kv_heads * dims.d * wbytes
    share = ro.vllm_gpu_memory_utilization * shape.gpu_memory_gib * GIB
    reserve = shape.reserve_gib * GIB
    terms = [
        Term("weights", f"{weights_text} = {_n(params)} params x {wbytes} B", params * wbytes),
        Term(
            "KV cache",
            f"2 (K, V) x {dims.num_layers} layers x {kv_heads} KV head(s) x {dims.d} x {wbytes} B = "
            f"{per_token / 1024:g} KiB/token "
            f"x {seqs} sequences ({seqs_text}) x {tokens} tokens ({prompt} + {completion}, in blocks of "
            f"{VLLM_BLOCK_SIZE})",
            seqs * tokens * per_token,
        ),
        Term("reserve", "vLLM's activation peak, CUDA graphs, non-torch memory (--reserve-gib)", reserve),
    ]
    room = share - params * wbytes - reserve
    concurrency = max(room, 0) / (tokens * per_token)
    if server:
        where = f"{engines} rollout server(s), one per inference node"
    else:
        where = f"{engines} engine(s) on the training GPUs (colocated)"
    title = f"inference GPU (vLLM TP {vtp}, {where}, {seqs} sequences per engine)"
    notes = [f"KV room = share - weights - reserve = {_gib(room)}: {concurrency:.2f} sequences of {tokens} tokens "
             f"at once (vLLM logs it as 'Maximum concurrency for {tokens} tokens per request')"]
    idle = shape.gpus_per_node - vtp
    if server and idle > 0:
        notes.append(
            f"each inference node uses vLLM TP {vtp} of its {shape.gpus_per_node} GPUs: {idle} idle per node "
            f"(one engine per rollout server); raise rollout.vllm_tensor_parallel_size to use them"
        )
    limit_text = f"vLLM's share {ro.vllm_gpu_memory_utilization} x {shape.gpu_memory_gib:g} GiB = {_gib(share)}"
    hint = (
        f"the KV room holds {concurrency:.2f} sequences at full length: lower the generation round "
        f"(per_device_train_batch_size x dp x steps_per_generation = {d.generation_batch_size}) or "
        "generation.max_completion_length, or raise rollout.vllm_tensor_parallel_size"
        + (", or add inference nodes (rollout server replicas)" if server else "")
    )
    return Budget(title, terms, share, limit_text, notes, hint)


def build_plan(cfg: EngineConfig, shape: ClusterShape, dims: ModelDims | None = None) -> Plan:
    """Validate the config at the shape's world size, check the layout divides, and size every GPU kind.

    Args:
        cfg: the whole config (memory depends on most sections).
        shape: the cluster shape (`resolve_cluster_shape`).
        dims: model dimensions; None = `load_model_dims(cfg.model.name_or_path)`.
    Returns:
        the Plan; `plan.problems` lists what does not fit (empty = fits).
    Raises:
        ConfigError (validation) or PlanError (layout, model, sequence bound), with the arithmetic.
    """
    dims = dims or load_model_dims(cfg.model.name_or_path)
    d = validate(cfg, shape.train_gpus)
    check_layout(cfg, dims, shape)
    par = cfg.parallel
    prompt, completion, source = sequence_lengths(cfg)
    split, replicated = dims.layer_params()
    tables = 1 if dims.tie_word_embeddings else 2
    header = [
        f"model: {cfg.model.name_or_path}: {_n(dims.total_params())} params = {dims.num_layers} layers x "
        f"{_n(split + replicated)} + {tables} x {dims.vocab_size} x {dims.hidden_size} "
        f"({'tied' if dims.tie_word_embeddings else 'untied'} embeddings) + {dims.hidden_size}",
        f"cluster: {shape.train_nodes} training node(s) + {shape.infer_nodes} inference node(s), "
        f"{shape.gpus_per_node} GPUs per node, {shape.gpu_memory_gib:g} GiB per GPU",
        _rollout_line(cfg, shape, d),
        f"training layout: tp*pp*dp = {par.tp_size}*{par.pp_size}*{d.dp_size} = {d.world_size} GPUs = "
        f"{shape.train_nodes} node(s) x {shape.gpus_per_node}; {dims.num_layers} layers / pp {par.pp_size} = "
        f"{dims.num_layers // par.pp_size} per stage",
        f"batch: {d.micro_batch_size} completion(s) x ({prompt} prompt ({source}) + {completion} completion = "
        f"{prompt + completion} tokens) per micro-batch, {d.num_microbatches} micro-batches per step, "
        f"{d.generation_batch_size} completions per generation round",
    ]
    budgets = [_training_budget(cfg, dims, shape, d), _inference_budget(cfg, dims, shape, d)]
    return Plan(header, budgets, d, shape)


def _rollout_line(cfg: EngineConfig, shape: ClusterShape, d: Derived) -> str:
    """Where generation runs: the server replicas and how a round's prompts are split, or the colocated engines."""
    vtp, prompts = cfg.rollout.vllm_tensor_parallel_size, d.num_prompts_per_generation
    servers = num_rollout_servers(cfg, shape)
    if not servers:
        return (f"rollout: colocated, train GPUs / vLLM TP = {shape.train_gpus} / {vtp} = {shape.train_gpus // vtp} "
                f"engine(s) on the training GPUs")
    return (
        f"rollout: {servers} rollout server replica(s), one per inference node, each one vLLM engine at TP {vtp} on "
        f"{vtp} of {shape.gpus_per_node} GPUs; {prompts} prompts per round split among them: at most "
        f"ceil({prompts} / {servers}) = {-(-prompts // servers)} per server"
    )


def node_roles(cfg: EngineConfig, shape: ClusterShape, d: Derived, node_rank: int) -> str:
    """What training node `node_rank` holds under Megatron's rank order (TP fastest, then DP, then PP)."""
    tp, first = cfg.parallel.tp_size, node_rank * shape.gpus_per_node
    ranks = range(first, first + shape.gpus_per_node)
    stages = sorted({r // (tp * d.dp_size) for r in ranks})
    replicas = sorted({(r // tp) % d.dp_size for r in ranks})
    return (
        f"node rank {node_rank} of {shape.train_nodes}: global ranks {ranks.start}-{ranks.stop - 1}, pipeline "
        f"stage(s) {','.join(map(str, stages))}, data-parallel rank(s) {','.join(map(str, replicas))}"
    )


def format_plan(plan: Plan) -> str:
    """The plan as text: header, then per GPU kind each term with its arithmetic, the total and the verdict."""
    lines = list(plan.header)
    for budget in plan.budgets:
        lines.append("")
        lines.append(f"{budget.title}, per GPU:")
        for term in budget.terms:
            lines.append(f"  {term.label:<16} {term.arithmetic} = {_gib(term.nbytes)}")
        verdict = "fits" if budget.fits else "DOES NOT FIT"
        free = budget.limit_bytes - budget.total_bytes
        lines.append(
            f"  {'total':<16} {_gib(budget.total_bytes)} of {budget.limit_text}: {verdict} "
            f"({_gib(abs(free))} {'free' if free >= 0 else 'over'})"
        )
        lines.extend(f"  note: {note}" for note in budget.notes)
    return "\n".join(lines)

