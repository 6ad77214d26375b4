"""LoRA on the routed experts of an MoE policy: PEFT's `target_parameters` on transformers 5's 3-D expert
tensors (`mlp.experts.gate_up_proj` (E, 2f, h), `mlp.experts.down_proj` (E, h, f)), one (A, B) pair per expert.

Owns: `ExpertLoraAdapter` (the adapter of one local expert's linear_fc1 or linear_fc2 in Megatron's SequentialMLP:
A (r, in), B (out, r), delta W_e = scaling * B_e A_e, the same interface as engine/policy/lora.py LoraAdapter, so
`merged_lora`, `adapters_disabled` and the checkpoint treat both alike), `apply_expert_lora`, `expert_adapters`
and `expert_tensors_for_peft` / `initial_expert_tensors` (PEFT's ParamWrapper layout: lora_A (r * E, in) with expert
e's rows at [e * r, (e + 1) * r), lora_B (out, r * E) with expert e's columns at e, e + E, ... (PEFT reshapes B to
(out, r, E)); with both tensors targeted, gate_up_proj's wrapper is the inner one: its keys hold `base_layer.`;
GPT-OSS's transposed (E, h, 2f) experts hold the same A / B, B's rows in its interleaved gate / up order).
Experts are split over EP like the base weights (each rank holds its local experts' adapters; their gradients are
reduced where the expert weights' would be: `allreduce` copied); expert TP is 1 (engine/lora_settings.py refuses more).

Must not: read Megatron's global parallel state (groups come from ParallelState), know vLLM's layout.

Test: tests/distributed/test_lora_layouts.py (the engine's logits = peft.PeftModel's on the HF Qwen3-MoE and GPT-OSS;
the merged view and merged export; the step at EP2 = the single-process step; checkpoint resume at EP2; the initial
adapter), tests/integration/test_routing_replay_loop.py (the merged sync into vLLM in a bf16 EP2 run),
tests/unit/test_lora.py (settings and refusals), tests/unit/test_planner.py (the planner's count).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from engine.lora_settings import EXPERT_TARGETS, PEFT_PREFIX, LoraSettings


class ExpertLoraAdapter(torch.nn.Module):
    """The adapter of one expert's linear (`hf_name` gate_up_proj -> linear_fc1, down_proj -> linear_fc2):
    `lora_A[hf_name]` (r, in), `lora_B[hf_name]` (out, r), the expert's whole weight (expert TP 1)."""

    def __init__(self, linear: torch.nn.Module, hf_name: str, expert: int, settings: LoraSettings, config):
        super().__init__()
        out, in_features = linear.weight.shape
        if settings.r > min(out, in_features):
            raise ValueError(f"lora.lora_r (peft r)={settings.r} is larger than mlp.experts.{hf_name}'s smaller "
                             f"dimension ({out} x {in_features}): a rank above min(out, in) adds no capacity")
        self.hf_names, self.expert, self.scaling = [hf_name], expert, settings.scaling
        self.merged = self.disabled = False
        self.interleaved = False  # the HF gate_up_proj's rows interleave gate and up (set by apply_expert_lora)
        self.tp_group = linear.tp_group
        dtype = torch.float32 if settings.adapter_dtype == "float32" else config.params_dtype
        self.lora_A = torch.nn.ParameterDict({hf_name: torch.zeros(settings.r, in_features, dtype=dtype)})
        self.lora_B = torch.nn.ParameterDict({hf_name: torch.zeros(out, settings.r, dtype=dtype)})
        for param in self.parameters():  # reduced where the expert's weight is (expert-DP buffers at EP > 1)
            param.allreduce = getattr(linear.weight, "allreduce", True)

    def hook(self, linear, args, output):
        """Forward hook of the expert's linear: (out, bias) -> (out + scaling * B A x, bias), rounded once."""
        if self.merged or self.disabled:
            return output
        out, bias = output
        name = self.hf_names[0]
        a, b = self.lora_A[name], self.lora_B[name]
        return (out + self.scaling * F.linear(F.linear(args[0].to(a.dtype), a), b)).to(out.dtype), bias

    @torch.no_grad()
    def weight_delta(self) -> torch.Tensor:
        """scaling * B A (out, in) in fp32: the expert weight's LoRA update."""
        name = self.hf_names[0]
        return self.scaling * (self.lora_B[name].float() @ self.lora_A[name].float())

    def sharded_state_dict(self, prefix: str = "", sharded_offsets: tuple = (), metadata: dict | None = None):
        """Dist-checkpoint entries, placed on the expert axis by SequentialMLP's `sharded_offsets` like the weight."""
        from megatron.core.transformer.utils import make_sharded_tensors_for_checkpoint

        return make_sharded_tensors_for_checkpoint(self.state_dict(prefix="", keep_vars=True), prefix, {},
                                                   sharded_offsets, tp_group=self.tp_group,
                                                   dp_cp_group=(metadata or {}).get("dp_cp_group"))


def _local_experts(layer) -> list:
    experts = getattr(getattr(layer, "mlp", None), "experts", None)
    return list(getattr(experts, "local_experts", []) or [])


def expert_adapters(layer) -> list[ExpertLoraAdapter]:
    """The layer's expert adapters, local expert by local expert (gate_up_proj's before down_proj's)."""
    return [adapter for expert in _local_experts(layer) for path in EXPERT_TARGETS.values()
            if (adapter := getattr(getattr(expert, path), "lora", None)) is not None]


@torch.no_grad()
def apply_expert_lora(layer, settings: LoraSettings, ps, seed: int, attach, initial_a, interleaved: bool = False) -> int:
    """Attach adapters to every local expert's targeted linears of `layer` (none without routed experts) with
    `attach(linear, adapter)` (engine/policy/lora.py: hook, checkpoint entries); A is `initial_a(layer, name, r, in,
    seed)` of the global expert's name (the same at every EP). `interleaved`: the HF gate_up_proj interleaves gate
    and up (INTERLEAVED_GATE_UP), which the export follows. Returns the number of adapter parameters."""
    experts = _local_experts(layer)
    if settings.target_parameters and not experts and hasattr(getattr(layer, "mlp", None), "experts"):
        raise ValueError(f"lora.lora_target_parameters={list(settings.target_parameters)}: the experts are not "
                         "Megatron's SequentialMLP (moe_grouped_gemm), which expert adapters need")
    count, index = 0, layer.layer_number - 1
    for local, expert in enumerate(experts):
        global_expert = int(layer.mlp.local_expert_indices[local])  # ep_rank * local experts + local
        for hf_name in settings.target_parameters:
            linear = getattr(expert, EXPERT_TARGETS[hf_name])
            adapter = ExpertLoraAdapter(linear, hf_name, global_expert, settings, layer.config)
            adapter.interleaved = interleaved and hf_name == "gate_up_proj"
            a = adapter.lora_A[hf_name]
            a.copy_(initial_a(index, f"experts.{global_expert}.{hf_name}", a.shape[0], a.shape[1], seed))
            attach(linear, adapter)
            count += sum(p.numel() for p in adapter.parameters())
    return count


def expert_peft_key(layer: int, hf_name: str, targets: tuple[str, ...]) -> str:
    """PEFT's saved key prefix of the ParamWrapper adapting `mlp.experts.<hf_name>` of decoder layer `layer`."""
    nested = "base_layer." if hf_name == "gate_up_proj" and "down_proj" in targets else ""
    return f"{PEFT_PREFIX}{layer}.mlp.experts.{nested}"


def to_peft_layout(a: torch.Tensor, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-expert A (E, r, in), B (E, out, r) as PEFT's ParamWrapper weights: A (E * r, in), B (out, r * E) with
    B[:, k * E + e] = B_e[:, k]."""
    experts, rank, _ = a.shape
    return a.reshape(experts * rank, -1), b.permute(1, 2, 0).reshape(b.shape[1], rank * experts)


@torch.no_grad()
def expert_tensors_for_peft(layer_adapters: dict[int, list[ExpertLoraAdapter]], targets: tuple[str, ...],
                            ps) -> dict[str, torch.Tensor]:
    """Every expert adapter of this stage under PEFT's keys, gathered over EP (collective over `groups.ep`): global
    expert e = ep_rank * local + j, EP ranks in order."""
    tensors = {}
    for layer, adapters in layer_adapters.items():
        for hf_name in targets:
            mine = [adapter for adapter in adapters if adapter.hf_names[0] == hf_name]
            a = torch.stack([adapter.lora_A[hf_name].data for adapter in mine])
            b = torch.stack([adapter.lora_B[hf_name].data for adapter in mine])
            a, b = (_gather_ep(t, ps) for t in (a, b))
            if mine[0].interleaved:  # Megatron's [gate; up] rows -> HF's g0, u0, g1, u1, ...
                b = torch.stack(b.chunk(2, dim=1), dim=2).reshape(b.shape)
            key = expert_peft_key(layer, hf_name, targets)
            tensors[f"{key}lora_A.weight"], tensors[f"{key}lora_B.weight"] = to_peft_layout(a, b)
    return tensors


def _gather_ep(tensor: torch.Tensor, ps) -> torch.Tensor:
    if ps.ep_size == 1:
        return tensor.clone()
    shards = [torch.empty_like(tensor) for _ in range(ps.ep_size)]
    torch.distributed.all_gather(shards, tensor.contiguous(), group=ps.groups.ep)
    return torch.cat(shards)


def initial_expert_tensors(settings: LoraSettings, hf_config, layers: list[int], seed: int,
                           initial_a) -> dict[str, torch.Tensor]:
    """The expert adapters `apply_expert_lora(..., seed=seed, initial_a=initial_a)` starts from under PEFT's keys (A
    drawn per expert, B zero, float32), for the MoE decoder layers `layers` of `hf_config`."""
    from engine.models.families import moe_shape

    experts, _, ffn = moe_shape(hf_config)
    hidden, r, tensors = hf_config.hidden_size, settings.r, {}
    shapes = {"gate_up_proj": (2 * ffn, hidden), "down_proj": (hidden, ffn)}
    for layer in layers:
        for hf_name in settings.target_parameters:
            out, in_features = shapes[hf_name]
            a = torch.stack([initial_a(layer, f"experts.{e}.{hf_name}", r, in_features, seed)
                             for e in range(experts)])
            key = expert_peft_key(layer, hf_name, settings.target_parameters)
            tensors[f"{key}lora_A.weight"], tensors[f"{key}lora_B.weight"] = to_peft_layout(
                a, torch.zeros(experts, out, r))
    return tensors
