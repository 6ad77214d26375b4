"""The activation recompute that runs: `train.gradient_checkpointing` and the `train.recompute_*` settings, with their
defaults filled in and checked against a model's layers (`resolve_recompute` -> `Recompute`).

engine/policy/model.py hands the result to Megatron's TransformerConfig (`Recompute.megatron_kwargs`) and the memory
planner (engine/planning/memory.py) budgets the same result, so the planner assumes exactly the recompute that runs.
The settings' checks among themselves live with every other cross-field check (engine/validation.py).

Must not: build anything or import torch / Megatron (the planner runs without them).

Test: tests/unit/test_recompute.py; in Megatron: tests/distributed/test_grpo_step_layouts.py, test_qwen3_layouts.py,
test_routing_replay.py (a step with recompute equals the step without it).
"""

from __future__ import annotations

from dataclasses import dataclass

from engine.config import ConfigError, TrainConfig

RECOMPUTE_MODULES = ("core_attn", "layernorm", "mlp", "moe")
"""Megatron's selective-recompute modules that run on this engine's models (local spec and Transformer Engine)."""
REFUSED_RECOMPUTE_MODULES = {
    "moe_act": "recomputes the grouped-GEMM experts' activation only (megatron-core: moe_grouped_gemm), and this engine "
               "builds SequentialMLP experts; use 'moe' (the whole MoE layer)",
    "mla_up_proj": "recomputes multi-latent attention's up projection, and no supported model family has MLA",
    "shared_experts": "recomputes shared experts, and no supported model family has them (Qwen3-MoE routes only)",
}


@dataclass(frozen=True, slots=True)
class Recompute:
    """The activation recompute that runs: Megatron's TransformerConfig fields of the same names (granularity None =
    off), with the defaults filled in."""

    granularity: str | None
    method: str | None = None
    num_layers: int | None = None
    modules: tuple[str, ...] = ()

    def describe(self) -> str:
        """One line, as the planner prints it."""
        if self.granularity is None:
            return "none, every activation kept"
        if self.granularity == "selective":
            return f"selective, modules {list(self.modules)} in every layer"
        unit = "layer" if self.num_layers == 1 else "layers"
        if self.method == "uniform":
            return f"full, uniform, {self.num_layers} {unit} per unit"
        return f"full, block, the first {self.num_layers} {unit} of each model chunk"

    def megatron_kwargs(self) -> dict:
        """TransformerConfig's recompute keywords."""
        if self.granularity is None:
            return {"recompute_granularity": None}
        return {"recompute_granularity": self.granularity, "recompute_method": self.method,
                "recompute_num_layers": self.num_layers,
                "recompute_modules": list(self.modules) if self.granularity == "selective" else None}


def resolve_recompute(tr: TrainConfig, num_layers: int, num_chunks: int, is_moe: bool) -> Recompute:
    """The recompute that runs for a model of `num_layers` layers cut into `num_chunks` model chunks (pp_size x
    virtual_pipeline_size), `is_moe` when its MLPs are MoE layers.

    Raises:
        ConfigError when a setting cannot act on this model, with the arithmetic.
    """
    if not tr.gradient_checkpointing:
        return Recompute(None)
    if tr.recompute_granularity == "selective":
        modules = tuple(tr.recompute_modules if tr.recompute_modules is not None else ["core_attn"])
        idle = {"mlp": "an MoE model has no dense MLP (use 'moe')", "moe": "a dense model has no MoE layer (use 'mlp')"}
        wrong = [m for m in modules if m == ("mlp" if is_moe else "moe")]
        if wrong:
            raise ConfigError(f"train.recompute_modules: {wrong[0]!r} would recompute nothing: {idle[wrong[0]]}")
        return Recompute("selective", modules=modules)
    per_chunk = num_layers // num_chunks
    method = tr.recompute_method or "uniform"
    count = tr.recompute_num_layers or (1 if method == "uniform" else per_chunk)
    if method == "uniform" and per_chunk % count:
        raise ConfigError(
            f"train.recompute_num_layers={count} must divide the layers of a model chunk for the uniform method: "
            f"{num_layers} layers / {num_chunks} chunk(s) (pp_size x virtual_pipeline_size) = {per_chunk}, "
            f"{per_chunk} % {count} = {per_chunk % count}")
    if method == "block" and is_moe:
        raise ConfigError(
            "train.recompute_method=block is refused for MoE models: megatron-core 0.16.1's block method runs the "
            "layers it does not recompute without their padding mask (transformer_block.py _checkpointed_forward), so "
            "their routers' aux loss and z-loss would count padding (measured: grad norm 13.4 against 5.78 on the tiny "
            "Qwen3-MoE); use recompute_method=uniform")
    if method == "block" and count > per_chunk:
        raise ConfigError(
            f"train.recompute_num_layers={count} > the layers of a model chunk for the block method: {num_layers} "
            f"layers / {num_chunks} chunk(s) (pp_size x virtual_pipeline_size) = {per_chunk}")
    return Recompute("full", method, count)
