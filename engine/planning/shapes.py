"""The shapes a plan sizes: the model's (`ModelDims`) and the cluster's (`ClusterShape`), and whether the config's
layout divides them.

Owns: the model dimensions the plan needs (`ModelDims`: a table of known hub models, a local `config.json`, or the
builtin tiny models; nothing is downloaded), Megatron's vocabulary padding (`megatron_padded_vocab`), the cluster
shape (`ClusterShape`: training / inference nodes, GPUs per node, GPU memory, and `resolve_cluster_shape`'s defaults
from the config), the layout checks that need model dimensions or the node split (TP inside a node, heads and layers
divisible, vLLM's TP, one rollout server per inference node: `check_layout`), what each training node holds
(`node_roles`, Megatron's rank order), and `PlanError`, the planner's refusal.

Must not: import torch, Megatron or vLLM (it runs on a login node in a second), read the environment, touch the
network, or size memory (engine/planning/memory.py does).

Test: `pytest tests/unit/test_planner.py` (known models against the hub's config.json, the padding rule against
`engine.policy.model.padded_vocab_size`, every refusal with its arithmetic).
"""

from __future__ import annotations

import json
from types import SimpleNamespace
from dataclasses import dataclass
from pathlib import Path

from engine.config import ConfigError, EngineConfig
from engine.models.families import moe_shape
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
    Mixtral: routed experts in every layer instead of the dense MLP)."""

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

    @property
    def d(self) -> int:
        return self.head_dim or self.hidden_size // self.num_heads

    @property
    def is_moe(self) -> bool:
        return self.num_experts > 0

    def layer_params(self) -> tuple[int, int]:
        """(TP-split parameters, TP-replicated parameters) of one decoder layer, its experts excepted
        (`expert_params`); an MoE layer's router (E x h) is replicated."""
        h, a, g, d = self.hidden_size, self.num_heads, self.num_kv_heads, self.d
        attention = h * a * d + 2 * h * g * d + a * d * h + ((a + 2 * g) * d if self.qkv_bias else 0)
        replicated = 2 * h + (2 * d if self.qk_norm else 0) + self.num_experts * h
        return attention + (0 if self.is_moe else 3 * h * self.intermediate_size), replicated

    def expert_params(self) -> int:
        """Parameters of one layer's routed experts (E x 3 x h x f_moe: SwiGLU gate, up, down); split over EP x ETP."""
        return self.num_experts * 3 * self.hidden_size * self.moe_intermediate_size

    def total_params(self) -> int:
        """Parameters of the Hugging Face checkpoint (unpadded vocabulary)."""
        split, replicated = self.layer_params()
        embeddings = self.vocab_size * self.hidden_size * (1 if self.tie_word_embeddings else 2)
        return self.num_layers * (split + replicated + self.expert_params()) + embeddings + self.hidden_size


def _qwen2(h, layers, heads, kv, ffn, vocab, tied):
    return ModelDims(h, layers, heads, kv, ffn, vocab, tie_word_embeddings=tied, qkv_bias=True)


def _llama(h, layers, heads, kv, ffn, vocab):
    return ModelDims(h, layers, heads, kv, ffn, vocab, tie_word_embeddings=False, qkv_bias=False)


_QWEN25 = {
    "0.5b": _qwen2(896, 24, 14, 2, 4864, 151936, True),
    "7b": _qwen2(3584, 28, 28, 4, 18944, 152064, False),
    "72b": _qwen2(8192, 80, 64, 8, 29568, 152064, False),
}
def _qwen3(h, layers, heads, kv, ffn, vocab, tied, experts=0, top_k=0, moe_ffn=0):
    return ModelDims(h, layers, heads, kv, ffn, vocab, tie_word_embeddings=tied, qkv_bias=False, head_dim=128,
                     qk_norm=True, num_experts=experts, num_experts_per_tok=top_k, moe_intermediate_size=moe_ffn)


_QWEN3 = {
    "8b": _qwen3(4096, 36, 32, 8, 12288, 151936, False),
    "30b-a3b": _qwen3(2048, 48, 32, 4, 6144, 151936, False, 128, 8, 768),
    "235b-a22b": _qwen3(4096, 94, 64, 4, 12288, 151936, False, 128, 8, 1536),
}
_MIXTRAL_8X7B = ModelDims(4096, 32, 32, 8, 14336, 32000, False, False, num_experts=8, num_experts_per_tok=2,
                          moe_intermediate_size=14336)
_LLAMA_8B = _llama(4096, 32, 32, 8, 14336, 128256)
_LLAMA_70B = _llama(8192, 80, 64, 8, 28672, 128256)

KNOWN_MODELS: dict[str, ModelDims] = {
    **{f"qwen/qwen2.5-{size}{suffix}": dims for size, dims in _QWEN25.items() for suffix in ("", "-instruct")},
    **{f"qwen/qwen3-{size}{suffix}": dims for size, dims in _QWEN3.items() for suffix in ("", "-base")},
    "qwen/qwen3-30b-a3b-instruct-2507": _QWEN3["30b-a3b"],
    "qwen/qwen3-235b-a22b-instruct-2507": _QWEN3["235b-a22b"],
    **{f"meta-llama/{name}{suffix}": dims for name, dims in [
        ("llama-3.1-8b", _LLAMA_8B), ("meta-llama-3.1-8b", _LLAMA_8B), ("meta-llama-3-8b", _LLAMA_8B),
        ("llama-3.1-70b", _LLAMA_70B), ("meta-llama-3.1-70b", _LLAMA_70B), ("llama-3.3-70b", _LLAMA_70B),
    ] for suffix in ("", "-instruct")},
    # engine/models/tiny_model.py: hidden 128, 4 layers, 4 / 2 heads, MLP 352, vocabulary 400, untied.
    "builtin:tiny-qwen2": _qwen2(128, 4, 4, 2, 352, 400, False),
    "builtin:tiny-qwen2-arith": _qwen2(128, 4, 4, 2, 352, 400, False),  # the demo's warm start: same shape
    "builtin:tiny-llama": _llama(128, 4, 4, 2, 352, 400),
    "builtin:tiny-qwen3": ModelDims(128, 4, 4, 2, 352, 400, False, False, head_dim=64, qk_norm=True),
    "builtin:tiny-qwen3_moe": ModelDims(128, 4, 4, 2, 352, 400, False, False, head_dim=64, qk_norm=True, num_experts=4,
                                        num_experts_per_tok=2, moe_intermediate_size=64),
    "builtin:tiny-mixtral": ModelDims(128, 4, 4, 2, 64, 400, False, False, num_experts=4, num_experts_per_tok=2,
                                      moe_intermediate_size=64),
    **{f"mistralai/mixtral-8x7b{suffix}": _MIXTRAL_8X7B for suffix in ("-v0.1", "-instruct-v0.1")},
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
        experts, top_k, expert_ffn = moe_shape(SimpleNamespace(**hf))
        return ModelDims(
            hidden_size=hf["hidden_size"], num_layers=hf["num_hidden_layers"], num_heads=hf["num_attention_heads"],
            num_kv_heads=hf.get("num_key_value_heads") or hf["num_attention_heads"],
            intermediate_size=hf["intermediate_size"], vocab_size=hf["vocab_size"],
            tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
            qkv_bias=bool(hf.get("attention_bias", hf.get("model_type") == "qwen2")),
            head_dim=0 if head_dim * hf["num_attention_heads"] == hf["hidden_size"] else head_dim,
            qk_norm=hf.get("model_type") in ("qwen3", "qwen3_moe"),
            num_experts=experts, num_experts_per_tok=top_k, moe_intermediate_size=expert_ffn,
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
    """Server mode: one inference node per rollout server URL (1 without a list); colocate: 0."""
    if cfg.rollout.vllm_mode != "server":
        return 0
    urls = cfg.rollout.vllm_server_base_urls
    return len(urls) if urls else 1


def num_rollout_servers(cfg: EngineConfig, shape: ClusterShape) -> int:
    """Rollout server replicas: one per inference node in server mode (each one vLLM engine), 0 in colocate mode."""
    return shape.infer_nodes if cfg.rollout.vllm_mode == "server" else 0


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
    if vtp > gpn:
        problems.append(
            f"rollout.vllm_tensor_parallel_size={vtp} > {gpn} GPUs per node: vLLM's TP spans nodes only under Ray, "
            "which this engine does not use"
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
