"""The memory planner: per-GPU memory of a config on a cluster shape, before anything is launched.

Owns: `build_plan` (validate the config at the shape's world size, check the layout divides, size every kind of
GPU), `Plan` (the header lines, one `Budget` per GPU kind, what does not fit) and `format_plan` (every term printed as
arithmetic, the totals and the verdicts). `grpo-engine plan` and `grpo-engine train --dry-run` call it;
`launch/*.slurm` runs it before starting any node. The model and cluster shapes and the layout checks are
engine/planning/shapes.py's; every memory term, and the formulas with their sources, engine/planning/memory.py's.

Must not: import torch, Megatron or vLLM (the weight-sync plan it sizes, engine/planning/sync_memory.py, is arithmetic
over the converter's name map, engine/policy/hf_map.py; tests/unit/test_planner_imports.py), read the environment, or
touch the network. It takes the root config because memory is a cross-section question (like
`engine.validation`).

Test: `pytest tests/unit/test_planner.py` (hand-computed cases, the published tables and logs the memory model
cites, the shipped configs' headers).
"""

from __future__ import annotations

from dataclasses import dataclass

from engine.config import EngineConfig
from engine.lora_settings import lora_settings_from_config, refuse_expert_adapters
from engine.planning.memory import (
    Budget,
    format_count,
    format_gib,
    inference_budget,
    plan_recompute,
    sequence_lengths,
    training_budget,
)
from engine.planning.shapes import (
    ClusterShape,
    ModelDims,
    PlanError,
    check_layout,
    load_model_dims,
    num_rollout_servers,
)
from engine.planning.sync_memory import receive_budget, training_sync_terms
from engine.validation import Derived, validate


@dataclass(slots=True)
class Plan:
    """A config's plan on a cluster shape: the header lines and one budget per kind of GPU."""

    header: list[str]
    budgets: list[Budget]
    derived: Derived
    shape: ClusterShape

    @property
    def problems(self) -> list[str]:
        """One line per budget that does not fit: its total, its limit and what to change."""
        return [f"{b.title}: total {format_gib(b.total_bytes)} > {b.limit_text}; {b.hint}"
                for b in self.budgets if not b.fits]

    def budget(self, prefix: str) -> Budget:
        return next(b for b in self.budgets if b.title.startswith(prefix))


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
    derived = validate(cfg, shape.train_gpus)
    check_layout(cfg, dims, shape)
    if cfg.lora.use_peft:  # as the run refuses it (engine/train/run.py), before sizing adapters it would not build
        try:
            refuse_expert_adapters(lora_settings_from_config(cfg.lora), cfg.model.name_or_path,
                                   dims.num_experts, cfg.parallel.expert_tp_size)
        except ValueError as exc:
            raise PlanError(str(exc)) from None
    par = cfg.parallel
    prompt, completion, source = sequence_lengths(cfg)
    split, replicated = dims.layer_params()
    tables = 1 if dims.tie_word_embeddings else 2
    header = [
        f"model: {cfg.model.name_or_path}: {format_count(dims.total_params())} params = {dims.num_layers} layers x "
        f"{format_count(split + replicated + dims.expert_params())}"
        f"{_experts_text(dims)} + {tables} x {dims.vocab_size} x {dims.hidden_size} "
        f"({'tied' if dims.tie_word_embeddings else 'untied'} embeddings) + {dims.hidden_size}",
        f"cluster: {shape.train_nodes} training node(s) + {shape.infer_nodes} inference node(s), "
        f"{shape.gpus_per_node} GPUs per node, {shape.gpu_memory_gib:g} GiB per GPU",
        _rollout_line(cfg, shape, derived),
        *_async_lines(cfg, derived, *sequence_lengths(cfg)[:2]),
        *_routes_lines(cfg, dims, derived, prompt, completion),
        f"training layout: tp*pp*dp = {par.tp_size}*{par.pp_size}*{derived.dp_size} = {derived.world_size} GPUs = "
        f"{shape.train_nodes} node(s) x {shape.gpus_per_node}; {dims.num_layers} layers / pp {par.pp_size} = "
        f"{dims.num_layers // par.pp_size} per stage",
        f"activation recompute: {plan_recompute(cfg, dims).describe()} (train.gradient_checkpointing, "
        "train.recompute_*)",
        f"batch: {derived.micro_batch_size} completion(s) x ({prompt} prompt ({source}) + {completion} completion = "
        f"{prompt + completion} tokens) per micro-batch, {derived.num_microbatches} micro-batches per step, "
        f"{derived.generation_batch_size} completions per generation round",
    ]
    budgets = [training_budget(cfg, dims, shape, derived, lambda stage: training_sync_terms(cfg, dims, stage)),
               inference_budget(cfg, dims, shape, derived)]
    receive = receive_budget(cfg, dims, shape)
    budgets += [receive] if receive else []
    return Plan(header, budgets, derived, shape)


def _experts_text(dims: ModelDims) -> str:
    """How much of a layer its routed experts are, and how many run per token."""
    if not dims.is_moe:
        return ""
    active = dims.num_layers * dims.num_experts_per_tok * dims.expert_params() // dims.num_experts
    return (f" (of which experts {dims.num_experts} x 3 x {dims.hidden_size} x {dims.moe_intermediate_size}; "
            f"{dims.num_experts_per_tok} routed per token: {format_count(active)} expert params active)")


def _rollout_line(cfg: EngineConfig, shape: ClusterShape, derived: Derived) -> str:
    """Where generation runs: the server replicas and how a round's prompts are split, or the colocated engines."""
    vtp, prompts = cfg.rollout.vllm_tensor_parallel_size, derived.num_prompts_per_generation
    servers = num_rollout_servers(cfg, shape)
    if not servers:
        return (f"rollout: colocated, train GPUs / vLLM TP = {shape.train_gpus} / {vtp} = {shape.train_gpus // vtp} "
                f"engine(s) on the training GPUs")
    nodes = cfg.rollout.vllm_nodes_per_server
    per = ("one per inference node" if nodes == 1 else
           f"one per {nodes} inference nodes (rollout.vllm_nodes_per_server: vLLM's TP across them)")
    return (
        f"rollout: {servers} rollout server replica(s), {per}, each one vLLM engine at TP {vtp} on {vtp} of "
        f"{nodes * shape.gpus_per_node} GPUs; {prompts} prompts per round split among them: at most "
        f"ceil({prompts} / {servers}) = {-(-prompts // servers)} per server"
    )


def _async_lines(cfg: EngineConfig, derived: Derived, prompt: int, completion: int) -> list[str]:
    """Asynchronous rollout (`rollout.max_staleness` k > 0, engine/train/rollout_pipeline.py): what it costs."""
    k = cfg.rollout.max_staleness
    if k == 0 or cfg.rollout.vllm_mode != "server":
        return []
    held = k * derived.generation_batch_size * (prompt + completion) * 12  # int64 token id + float32 log-prob per token
    return [f"asynchronous rollout: max_staleness {k}: round r is sampled by policy version r - {k} while the trainer "
            f"trains; no extra GPU memory on either side (one weight copy each, the push happens between rounds); "
            f"the {k} complete round(s) waiting are token ids and log-probs on the trainer's hosts and in each "
            f"checkpoint: {k} x {derived.generation_batch_size} completions x {prompt + completion} tokens x 12 B = "
            f"{held / 2**20:.1f} MiB as packed numbers (Python lists and the checkpoint's JSON take a few times that)"]


def _routes_lines(cfg: EngineConfig, dims: ModelDims, derived: Derived, prompt: int, completion: int) -> list[str]:
    """MoE: the routed experts every round carries (engine/rollout/rollouts.py), for routing replay or the agreement
    metric: host memory on every training rank (the round is held whole) and HTTP transfer in server mode."""
    if not dims.is_moe or cfg.rollout.vllm_return_routed_experts is False:
        return []
    width = 1 if dims.num_experts <= 256 else 2  # uint8 ids up to 256 experts (int16 in the trainer beyond)
    per_round = derived.generation_batch_size * (prompt + completion) * dims.num_layers * dims.num_experts_per_tok * width
    use = "replayed in training (R3)" if cfg.model.moe_enable_routing_replay else "compared (moe/router_agreement)"
    return [f"routed experts: {use}; per round {derived.generation_batch_size} completions x {prompt + completion} tokens x "
            f"{dims.num_layers} layers x top-{dims.num_experts_per_tok} x {width} B = {per_round / 2**30:.2f} GiB "
            f"on every training rank's host (and over HTTP from the servers); "
            f"rollout.vllm_return_routed_experts=false drops them"]


def format_plan(plan: Plan) -> str:
    """The plan as text: header, then per GPU kind each term with its arithmetic, the total and the verdict."""
    lines = list(plan.header)
    for budget in plan.budgets:
        lines.append("")
        lines.append(f"{budget.title}, per GPU:")
        for term in budget.terms:
            lines.append(f"  {term.label:<16} {term.arithmetic} = {format_gib(term.nbytes)}")
        verdict = "fits" if budget.fits else "DOES NOT FIT"
        free = budget.limit_bytes - budget.total_bytes
        lines.append(
            f"  {'total':<16} {format_gib(budget.total_bytes)} of {budget.limit_text}: {verdict} "
            f"({format_gib(abs(free))} {'free' if free >= 0 else 'over'})"
        )
        lines.extend(f"  note: {note}" for note in budget.notes)
    return "\n".join(lines)
