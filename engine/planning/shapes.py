"""The shapes a plan sizes: the model's (`ModelDims`) and the cluster's (`ClusterShape`), and whether the config's
layout divides them.

Owns: the model dimensions the plan needs (`ModelDims`: a table of known hub models, a local `config.json`, or the
builtin tiny models; nothing is downloaded), Megatron's vocabulary padding (`megatron_padded_vocab`), the cluster
shape (`ClusterShape`: training / inference nodes, GPUs per node, GPU memory, and `resolve_cluster_shape`'s defaults
from the config), the layout checks that need model dimensions or the node split (TP inside a node, heads and layers
divisible, vLLM's TP, one rollout server per `rollout.vllm_nodes_per_server` inference nodes: `check_layout`), what each training node holds
(`node_roles`, Megatron's rank order), and `PlanError`, the planner's refusal.

Must not: import torch, Megatron or vLLM (it runs on a login node in a second), read the environment, touch the
network, or size memory (engine/planning/memory.py does).

Test: `pytest tests/unit/test_planner.py` (known models against the hub's config.json, the padding rule against
`engine.policy.model.padded_vocab_size`, every refusal with its arithmetic).
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace

from engine.config import ConfigError, EngineConfig
from engine.models.families import (
    FAMILIES,
    dense_layers,
    has_qk_norm,
    has_qkv_bias,
    moe_shape,
    shared_expert_width,
    spec_or_default,
)
from engine.validation import Derived

DEFAULT_GPUS_PER_NODE = 8
DEFAULT_GPU_MEMORY_GIB = 79.1
"""An H100 80GB as CUDA reports it to torch and vLLM (vLLM's start-up log on H100 80GB HBM3: "total_gpu_memory
(79.11GiB)"); pass `--gpu-memory-gib` for other GPUs."""
DEFAULT_RESERVE_GIB = 4.0


class PlanError(ConfigError):
    """A layout that does not divide, or a model the planner cannot size; the message shows the arithmetic."""


@dataclass(frozen=True, slots=True)
class ModelDims:
    """The Hugging Face config numbers the plan needs (Qwen2 / Llama / Qwen3: GQA, SwiGLU, RMSNorm; Qwen3-MoE and
    Mixtral: routed experts in every layer instead of the dense MLP; GLM-4.5: dense first layers, a shared expert;
    GPT-OSS: biases and sinks; DeepSeek-V3: multi-latent attention, built by engine/models/deepseek_v3/ with the
    down-projections replicated over TP, as sized here; Gemma 2 / 3 and Cohere 2: their norms per layer and
    sliding-window layers)."""

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
    qk_norm: bool = False
    """Qwen3: per-head RMSNorm of queries and keys, 2 x head_dim replicated weights per layer."""
    num_experts: int = 0
    """MoE: routed experts per layer (0 = dense MLP of intermediate_size)."""
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    dense_layers: int = 0
    """MoE: the first layers with a dense MLP of intermediate_size (GLM-4.5's first_k_dense_replace). The memory plan
    sizes every layer as an MoE layer (an upper bound: GLM-4.5 has 3 dense of 92); `total_params` counts exactly."""
    shared_expert_size: int = 0
    """MoE: the always-on shared expert's width (GLM-4.5: n_shared_experts x moe_intermediate_size), TP-split."""
    expert_bias: bool = False
    """MoE: the router's E float32 expert-score correction bias (GLM-4.5, DeepSeek-V3), replicated."""
    linear_bias: bool = False
    """GPT-OSS: biases on the attention output (h, replicated), the router (E) and both expert linears (2f + h per
    expert); its q/k/v bias is `qkv_bias`."""
    sinks: bool = False
    """GPT-OSS: one learned attention-sink logit per head (a per layer, TP-split)."""
    q_lora_rank: int = 0
    """DeepSeek-V3's multi-latent attention (MLA, 0 = none): the query's low-rank width (0 with MLA = a full-rank
    query projection)."""
    kv_lora_rank: int = 0
    """MLA: the compressed key / value latent width (what vLLM caches per token and layer, with the rope part)."""
    qk_rope_head_dim: int = 0
    """MLA: the per-head query / key dimensions that carry RoPE (the shared rope key is kv-latent-side)."""
    v_head_dim: int = 0
    """MLA: the per-head value dimension (`head_dim` is the query / key part without RoPE, qk_nope_head_dim)."""
    norms_per_layer: int = 2
    """Norm weights of h per layer: 2 (input, pre-MLP); Gemma 2 / 3: 4 (their post-attention / post-MLP norms too);
    Cohere 2: 1 (one norm feeds attention and MLP)."""
    sliding_window: int = 0
    """Gemma 2 / 3, Cohere 2, GPT-OSS: the keys a sliding-window layer attends to (0 = none); vLLM's KV cache holds
    about this many tokens per sequence on those layers (engine/planning/memory.py `kv_tokens_text`)."""
    sliding_layers: int = 0
    """How many of the layers use `sliding_window` (`layer_types`' sliding_attention)."""
    attention_softcap: bool = False
    """Gemma 2: the attention scores are soft-capped (tanh keeps one more s x s tensor for its backward)."""
    moe_map: str = ""
    """MoE: the converter's expert table of the family (a model_type: engine/policy/hf_convert.py `MOE_MAPS`), which
    the weight-sync plan sizes (engine/planning/sync_memory.py); "" = dense."""

    @property
    def d(self) -> int:
        return self.head_dim or self.hidden_size // self.num_heads

    @property
    def is_moe(self) -> bool:
        return self.num_experts > 0

    @property
    def is_mla(self) -> bool:
        return self.kv_lora_rank > 0

    def attention_params(self) -> tuple[int, int]:
        """(TP-split, replicated) parameters of one layer's attention. GQA: q, k, v, o (+ biases, sinks). MLA: the
        up-projections q_b (q_lora x a x (d + rope)), kv_b (kv_lora x a x (d + v)) and o (a x v x h) are split; the
        down-projections q_a (h x q_lora), kv_a (h x (kv_lora + rope)) and their RMSNorms are replicated."""
        h, a, g, d = self.hidden_size, self.num_heads, self.num_kv_heads, self.d
        if self.is_mla:
            qk, q_in = d + self.qk_rope_head_dim, self.q_lora_rank or h
            split = q_in * a * qk + self.kv_lora_rank * a * (d + self.v_head_dim) + a * self.v_head_dim * h
            down = h * self.q_lora_rank + self.q_lora_rank * bool(self.q_lora_rank)
            return split, down + h * (self.kv_lora_rank + self.qk_rope_head_dim) + self.kv_lora_rank
        split = h * a * d + 2 * h * g * d + a * d * h + ((a + 2 * g) * d if self.qkv_bias else 0)
        return split + a * self.sinks, h * self.linear_bias

    def layer_params(self) -> tuple[int, int]:
        """(TP-split parameters, TP-replicated parameters) of one decoder layer, its experts excepted
        (`expert_params`); an MoE layer's router (E x h, + E with a bias or an expert-score bias) is replicated."""
        h, d = self.hidden_size, self.d
        attention, replicated = self.attention_params()
        replicated += self.norms_per_layer * h + (2 * d if self.qk_norm else 0) + self.num_experts * (
            h + self.expert_bias + self.linear_bias)
        mlp = 3 * h * (self.shared_expert_size if self.is_moe else self.intermediate_size)
        return attention + mlp, replicated

    def expert_params(self) -> int:
        """Parameters of one layer's routed experts (E x 3 x h x f_moe: SwiGLU gate, up, down; GPT-OSS + E x (2 f_moe
        + h) biases); split over EP x ETP."""
        h, f = self.hidden_size, self.moe_intermediate_size
        return self.num_experts * (3 * h * f + (2 * f + h) * self.linear_bias)

    def total_params(self) -> int:
        """Parameters of the Hugging Face checkpoint (unpadded vocabulary)."""
        split, replicated = self.layer_params()
        embeddings = self.vocab_size * self.hidden_size * (1 if self.tie_word_embeddings else 2)
        moe_layer = split + replicated + self.expert_params()
        h = self.hidden_size  # a dense first layer: the MoE layer less router, bias, shared expert and experts
        dense_layer = moe_layer - self.expert_params() - self.num_experts * (
            h + self.expert_bias + self.linear_bias) + 3 * h * (self.intermediate_size - self.shared_expert_size)
        return (self.num_layers - self.dense_layers) * moe_layer + self.dense_layers * dense_layer + embeddings + h


KNOWN_MODELS: dict[str, ModelDims] = {
    name: ModelDims(**fields, moe_map=spec.model_types[0] if fields.get("num_experts") else "")
    for spec in FAMILIES for name, fields in spec.planner_models.items()}
"""Dimensions of the models the shipped configs name, from each model's config.json on the Hugging Face hub,
keyed by lower-case hub name, and of the builtin tiny models: every family's `planner_models` (its folder under
engine/models/)."""


def load_model_dims(name_or_path: str) -> ModelDims:
    """Dimensions of `model.name_or_path`: a local directory's config.json, else the table of known models.

    Raises:
        PlanError for a hub name not in the table (the planner never downloads).
    """
    config_file = Path(name_or_path) / "config.json"
    if config_file.is_file():  # MLA's widths (DeepSeek-V3) replace head_dim: `_mla_fields`
        hf = json.loads(config_file.read_text())
        hf = hf.get("text_config", hf)
        kind = hf.get("model_type")
        family = spec_or_default(kind)
        if family.planner_refusal:
            raise PlanError(f"model.name_or_path={name_or_path!r}: model_type {kind} ({family.planner_refusal}) is not "
                            "sized by the planner yet")
        head_dim = hf.get("head_dim") or 0
        config = SimpleNamespace(**hf)
        experts, top_k, expert_ffn = moe_shape(config)
        return dataclasses.replace(ModelDims(
            hidden_size=hf["hidden_size"], num_layers=hf["num_hidden_layers"], num_heads=hf["num_attention_heads"],
            num_kv_heads=hf.get("num_key_value_heads") or hf["num_attention_heads"],
            intermediate_size=hf["intermediate_size"], vocab_size=hf["vocab_size"],
            tie_word_embeddings=bool(hf.get("tie_word_embeddings", family.ties_embeddings_by_default)),
            qkv_bias=has_qkv_bias(config),
            head_dim=0 if head_dim * hf["num_attention_heads"] == hf["hidden_size"] else head_dim,  # MLA: below
            qk_norm=has_qk_norm(config),
            num_experts=experts, num_experts_per_tok=top_k, moe_intermediate_size=expert_ffn,
            dense_layers=dense_layers(config), shared_expert_size=shared_expert_width(config),
            moe_map=kind if experts else "",
        ), **family.planner_dims(hf), **_mla_fields(hf))
    dims = KNOWN_MODELS.get(name_or_path.lower())
    if dims is None:
        known = ", ".join(sorted({k for k in KNOWN_MODELS if not k.endswith("-instruct")}))
        raise PlanError(
            f"model.name_or_path={name_or_path!r}: the planner does not know this model's dimensions and does not "
            f"download; point model.name_or_path at a local directory with its config.json, or use one of: {known}"
        )
    return dims


def _mla_fields(hf: dict) -> dict:
    """A config.json's multi-latent attention widths (DeepSeek-V3: `kv_lora_rank` set), `head_dim` its
    qk_nope_head_dim; {} without MLA."""
    if not hf.get("kv_lora_rank"):
        return {}
    return dict(q_lora_rank=hf.get("q_lora_rank") or 0, kv_lora_rank=hf["kv_lora_rank"],
                qk_rope_head_dim=hf["qk_rope_head_dim"], v_head_dim=hf["v_head_dim"], head_dim=hf["qk_nope_head_dim"])


def megatron_padded_vocab(vocab_size: int, divisible_by: int, tp_size: int) -> int:
    """Megatron-LM's padding rule, as `engine.policy.model.padded_vocab_size` (which imports torch; a test ties them)."""
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
    """Server mode: `rollout.vllm_nodes_per_server` inference nodes per rollout server URL (one server without a
    list); colocate: 0."""
    if cfg.rollout.vllm_mode != "server":
        return 0
    urls = cfg.rollout.vllm_server_base_urls
    return (len(urls) if urls else 1) * cfg.rollout.vllm_nodes_per_server


def num_rollout_servers(cfg: EngineConfig, shape: ClusterShape) -> int:
    """Rollout server replicas in server mode, one per `rollout.vllm_nodes_per_server` inference nodes (each one vLLM
    engine, its TP over those nodes); 0 in colocate mode."""
    return shape.infer_nodes // cfg.rollout.vllm_nodes_per_server if cfg.rollout.vllm_mode == "server" else 0


def check_layout(cfg: EngineConfig, dims: ModelDims, shape: ClusterShape) -> None:
    """Refuse a layout that does not divide: every problem at once, each with its arithmetic.

    Raises:
        PlanError listing the problems.
    """
    par, rollout = cfg.parallel, cfg.rollout
    tp, pp, vpp, gpn = par.tp_size, par.pp_size, par.virtual_pipeline_size or 1, shape.gpus_per_node
    vtp = rollout.vllm_tensor_parallel_size
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
    if dims.is_moe and dims.num_experts % par.ep_size:
        problems.append(f"num_experts={dims.num_experts} is not divisible by parallel.ep_size={par.ep_size} "
                        f"({dims.num_experts} % {par.ep_size} = {dims.num_experts % par.ep_size})")
    if dims.is_moe and dims.moe_intermediate_size % par.expert_tp_size:
        problems.append(f"moe_intermediate_size={dims.moe_intermediate_size} is not divisible by "
                        f"parallel.expert_tp_size={par.expert_tp_size}")
    if not dims.is_moe and (par.ep_size > 1 or par.expert_tp_size > 1):
        problems.append(f"parallel.ep_size={par.ep_size} / expert_tp_size={par.expert_tp_size} need a mixture-of-experts "
                        "model; this one is dense")
    nodes = rollout.vllm_nodes_per_server
    if vtp > nodes * gpn:
        problems.append(
            f"rollout.vllm_tensor_parallel_size={vtp} > rollout.vllm_nodes_per_server x GPUs per node = {nodes} x "
            f"{gpn} = {nodes * gpn}: a rollout server's vLLM TP spans its nodes' GPUs only (raise "
            "rollout.vllm_nodes_per_server to span more nodes)"
        )
    if rollout.vllm_mode == "server":
        _check_rollout_servers(cfg, shape, problems)
    elif shape.infer_nodes:
        problems.append(
            f"rollout.vllm_mode='colocate' runs vLLM on the training GPUs: got {shape.infer_nodes} inference node(s); "
            "pass --infer-nodes 0 or set rollout.vllm_mode=server"
        )
    if problems:
        raise PlanError("layout does not divide:\n  - " + "\n  - ".join(problems))


def _check_rollout_servers(cfg: EngineConfig, shape: ClusterShape, problems: list[str]) -> None:
    """Server mode: one rollout server per `rollout.vllm_nodes_per_server` (K) inference nodes, and the trainer is
    given exactly those servers."""
    urls, n, k = cfg.rollout.vllm_server_base_urls, shape.infer_nodes, cfg.rollout.vllm_nodes_per_server
    per = "inference node" if k == 1 else f"{k} inference nodes (rollout.vllm_nodes_per_server)"
    servers = n // k
    if n < 1:
        problems.append("rollout.vllm_mode='server' needs inference nodes: got 0 (--infer-nodes)")
    elif n % k:
        problems.append(f"{n} inference nodes (--infer-nodes) do not split into rollout servers of "
                        f"rollout.vllm_nodes_per_server={k} nodes ({n} % {k} = {n % k})")
    elif urls is not None and len(urls) != servers:
        problems.append(
            f"rollout.vllm_server_base_urls lists {len(urls)} server(s) but {n} inference node(s) (--infer-nodes) run "
            f"{servers}: one rollout server runs per {per}, give one URL each (node 0's)"
        )
    elif urls is None and servers > 1:
        problems.append(
            f"{n} inference nodes run {servers} rollout servers (one per {per}) but the trainer is given one "
            f"(rollout.vllm_server_base_url or vllm_server_host/port): set rollout.vllm_server_base_urls to one URL "
            f"per server, e.g. [http://HOST0:PORT,http://HOST1:PORT] (launch/grpo_72b.slurm does), or use "
            f"--infer-nodes {k}"
        )


def node_roles(cfg: EngineConfig, shape: ClusterShape, derived: Derived, node_rank: int) -> str:
    """What training node `node_rank` holds under Megatron's rank order (TP fastest, then DP, then PP)."""
    tp, first = cfg.parallel.tp_size, node_rank * shape.gpus_per_node
    ranks = range(first, first + shape.gpus_per_node)
    stages = sorted({r // (tp * derived.dp_size) for r in ranks})
    replicas = sorted({(r // tp) % derived.dp_size for r in ranks})
    return (
        f"node rank {node_rank} of {shape.train_nodes}: global ranks {ranks.start}-{ranks.stop - 1}, pipeline "
        f"stage(s) {','.join(map(str, stages))}, data-parallel rank(s) {','.join(map(str, replicas))}"
    )
