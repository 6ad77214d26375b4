"""LoRA adapters on the Megatron policy's parallel linears, from a `peft.LoraConfig`-like setting.

Owns (the setting, HF_TARGETS and their checks: engine/lora_settings.py): the adapters (`LoraAdapter`, one per
Megatron linear, one (A, B) pair per HF module fused into it, so q/k/v and gate/up keep PEFT's separate adapters),
`apply_lora` (freezes the base, attaches the adapters as forward hooks, initialises them by global name like
engine/policy/model.py `init_weights_by_name`; their dist-checkpoint entries are TP-sharded; PEFT's modules_to_save
(lm_head, embed_tokens) unfrozen and trained in full, their loaded weights kept for the reference), `merged_lora`
(W + scaling * B A in fp32, rounded once, for the weight sync and merged exports), `adapters_disabled` (the base
alone: the KL reference) and `lora_tensors_for_peft` (the gathered adapter tensors under PEFT's key names). Dropout
(lora_dropout) draws from torch's default generator, the same on every TP rank, as Megatron's hidden dropout (so the
input shards of a row-parallel adapter get one mask pattern on every rank; TP > 1 draws other masks than TP 1).

TP rules (x is the linear's input, h = x A^T of width r, delta = scaling * h B^T added to the base output):
  column-parallel (linear_qkv, linear_fc1): A (r, in) replicated, B (out / tp, r) sharded; h's gradient is summed
    over TP (`copy_to_tensor_model_parallel_region`); with sequence parallelism h is gathered over the sequence
    (x is s / tp tokens) and A's gradient is partial: A is marked `sequence_parallel` (Megatron's
    finalize_model_grads sums it over TP, like the norms).
  row-parallel (linear_proj, linear_fc2): A (r, in / tp) sharded, B (out, r) replicated; h is a partial sum,
    all-reduced (`reduce_from_tensor_model_parallel_region`) or, with sequence parallelism, reduce-scattered over
    the sequence, and then B's gradient is partial: B is marked `sequence_parallel`.
Adapter dtype (LoraSettings.adapter_dtype): "float32" (PEFT's default, `autocast_adapter_dtype=True`) holds A and B
in fp32 over a bf16 base: the branch runs in fp32 (x cast up at its input) and is added to the base output in fp32,
rounded once to the base's dtype (PEFT's `result + lora_B(lora_A(x)) * scaling`, then `.to(previous_dtype)`); their
gradients, Megatron DDP's buffers (grouped by dtype: the frozen base has none) and the optimizer state are fp32, the
parameter being its own main copy. "model": A and B in params_dtype, Megatron's optimizer keeping fp32 main copies.
The merge for sync/export is computed in fp32 from the parameters either way; adapter-only sync sends them in the
engine's dtype (vLLM holds LoRA weights in the model's dtype).

Must not: read Megatron's global parallel state (groups come from ParallelState), know vLLM's layout.

Test: tests/distributed/test_lora_layouts.py (logits = peft.PeftModel's at TP1 / TP2, the merged view and export;
the LoRA GRPO step at TP2, TP2+SP, PP2, DP2 = the single-process step; checkpoints TP2 -> TP2 / TP1 exact),
tests/unit/test_lora.py (bad ranks), tests/integration/test_lora_run.py (the run, merged sync, export, resume).
"""

from __future__ import annotations

import contextlib
import math
import zlib

import torch
import torch.nn.functional as F

from engine.lora_settings import EXPERT_TARGETS, HF_TARGETS, PEFT_PREFIX, LoraSettings, refuse_expert_adapters
from engine.models.families import INTERLEAVED_GATE_UP, NON_GATED_FAMILIES
from engine.policy.expert_lora import ExpertLoraAdapter, apply_expert_lora, expert_adapters, expert_tensors_for_peft

HF_PARENT = {"q_proj": "self_attn", "k_proj": "self_attn", "v_proj": "self_attn", "o_proj": "self_attn",
             "gate_proj": "mlp", "up_proj": "mlp", "down_proj": "mlp"}
ROW_PARALLEL = ("self_attention.linear_proj", "mlp.linear_fc2")
SAVED_MODULE_PATHS = {"embed_tokens": "embedding.word_embeddings", "lm_head": "output_layer"}
"""Each HF module of modules_to_save -> the Megatron module whose (vocab-parallel) weight is trained in full."""
PEFT_SAVED_KEYS = {"embed_tokens": "base_model.model.model.embed_tokens.weight",
                   "lm_head": "base_model.model.lm_head.weight"}
"""PEFT 0.21's saved key of each module of modules_to_save (its `modules_to_save.default.` infix dropped)."""
WEIGHT_SYNC_MODES = ("merged", "adapter")


def _part_sizes(linear_path: str, config) -> dict[str, int]:
    """Global output rows of each HF part of one Megatron linear (TP=1 layout)."""
    heads, groups, head_dim = config.num_attention_heads, config.num_query_groups, config.kv_channels
    if linear_path.endswith("linear_qkv"):
        return {"q": heads * head_dim, "k": groups * head_dim, "v": groups * head_dim}
    if linear_path.endswith("linear_fc1"):
        return {"gate": config.ffn_hidden_size, "up": config.ffn_hidden_size}
    if linear_path.endswith("linear_proj"):
        return {"all": config.hidden_size}
    return {"all": config.hidden_size}


def _in_features(linear_path: str, config) -> int:
    if linear_path.endswith("linear_proj"):
        return config.num_attention_heads * config.kv_channels
    if linear_path.endswith("linear_fc2"):
        return config.ffn_hidden_size
    return config.hidden_size


class LoraAdapter(torch.nn.Module):
    """The adapters of one Megatron linear: `lora_A[hf]` and `lora_B[hf]` for each HF module fused into it.

    Shapes on a TP rank (column-parallel): A (r, in), B (out_part / tp, r); (row-parallel): A (r, in / tp),
    B (out, r). Runs as a forward hook of the linear (`hook`): the base's own forward is untouched.
    """

    def __init__(self, linear_path: str, hf_names: list[str], settings: LoraSettings, config, ps):
        super().__init__()
        from megatron.core.tensor_parallel.layers import set_tensor_model_parallel_attributes

        self.linear_path, self.hf_names = linear_path, list(hf_names)
        self.is_row = linear_path in ROW_PARALLEL
        self.scaling, self.dropout = settings.scaling, settings.lora_dropout
        self.tp_group, self.tp_size = ps.groups.tp, ps.tp_size
        self.sequence_parallel = bool(config.sequence_parallel) and ps.tp_size > 1
        self.merged = False
        self.disabled = False  # `adapters_disabled`: the base alone (the KL reference)
        sizes, in_features, r = _part_sizes(linear_path, config), _in_features(linear_path, config), settings.r
        self.parts = [HF_TARGETS[name][1] for name in hf_names]
        self.local_sizes = {part: size // (1 if self.is_row else ps.tp_size) for part, size in sizes.items()}
        self.heads_per_group = config.num_attention_heads // config.num_query_groups
        self.head_dim = config.kv_channels
        for name in hf_names:
            out = sizes[HF_TARGETS[name][1]]
            if r > min(out, in_features):
                raise ValueError(f"lora.lora_r (peft r)={r} is larger than {name}'s smaller dimension "
                                 f"({out} x {in_features}): a rank above min(out, in) adds no capacity")
        dtype = torch.float32 if settings.adapter_dtype == "float32" else config.params_dtype
        self.lora_A, self.lora_B = torch.nn.ParameterDict(), torch.nn.ParameterDict()
        for name in hf_names:
            out = sizes[HF_TARGETS[name][1]]
            a_shape = (r, in_features // ps.tp_size) if self.is_row else (r, in_features)
            b_shape = (out, r) if self.is_row else (out // ps.tp_size, r)
            a = torch.nn.Parameter(torch.zeros(a_shape, dtype=dtype))
            b = torch.nn.Parameter(torch.zeros(b_shape, dtype=dtype))
            set_tensor_model_parallel_attributes(a, self.is_row and ps.tp_size > 1, 1, 1)
            set_tensor_model_parallel_attributes(b, not self.is_row and ps.tp_size > 1, 0, 1)
            (b if self.is_row else a).sequence_parallel = self.sequence_parallel
            self.lora_A[name], self.lora_B[name] = a, b

    def hook(self, linear, args, output):
        """Forward hook of the base linear: (out, bias) -> (out + scaling * delta(x), bias), added in the wider of
        the two dtypes and rounded once to out's (fp32 adapters on a bf16 base: as PEFT)."""
        if self.merged or self.disabled:
            return output
        out, bias = output
        return (out + self.delta(args[0])).to(out.dtype), bias

    def delta(self, x: torch.Tensor) -> torch.Tensor:
        """scaling * B A x in this rank's output layout; x (s or s / tp, b, in or in / tp)."""
        from megatron.core.tensor_parallel import mappings

        x = F.dropout(x, p=self.dropout, training=self.training) if self.dropout else x
        a = torch.cat([self.lora_A[n] for n in self.hf_names], dim=0)  # (parts * r, in_local)
        h = F.linear(x.to(a.dtype), a)  # (s_local, b, parts * r)
        if self.is_row:  # partial sums over the input shards
            h = (mappings.reduce_scatter_to_sequence_parallel_region(h, group=self.tp_group) if self.sequence_parallel
                 else mappings.reduce_from_tensor_model_parallel_region(h, group=self.tp_group))
        elif self.sequence_parallel:
            h = mappings.gather_from_sequence_parallel_region(h, group=self.tp_group)
        else:
            h = mappings.copy_to_tensor_model_parallel_region(h, group=self.tp_group)
        pieces = {self.parts[i]: F.linear(chunk, self.lora_B[n])
                  for i, (n, chunk) in enumerate(zip(self.hf_names, h.chunk(len(self.hf_names), dim=-1)))}
        return self.scaling * self._arrange(pieces, h.shape[:-1])

    def _arrange(self, pieces: dict[str, torch.Tensor], lead: torch.Size) -> torch.Tensor:
        """This rank's output layout from per-part outputs (missing parts are zero): QKV interleaved per query
        group [q heads of g; k_g; v_g], fc1 [gate; up] (engine/policy/hf_convert.py Kind)."""
        some = next(iter(pieces.values()))
        full = {p: pieces.get(p, some.new_zeros(*lead, size)) for p, size in self.local_sizes.items()}
        if "q" in full:
            groups = self.local_sizes["k"] // self.head_dim
            q = full["q"].reshape(*lead, groups, self.heads_per_group * self.head_dim)
            k, v = (full[p].reshape(*lead, groups, self.head_dim) for p in ("k", "v"))
            return torch.cat([q, k, v], dim=-1).reshape(*lead, -1)
        return torch.cat([full[p] for p in self.local_sizes], dim=-1)

    @torch.no_grad()
    def weight_delta(self) -> torch.Tensor:
        """scaling * B A for this rank's shard of the base weight, in fp32, in Megatron's local layout."""
        pieces = {}
        for name, part in zip(self.hf_names, self.parts):
            pieces[part] = self.lora_B[name].float() @ self.lora_A[name].float()  # (out_local, in_local)
        in_local = next(iter(pieces.values())).shape[1]
        rows = self._arrange({p: t.t() for p, t in pieces.items()}, torch.Size([in_local]))  # (in_local, out_local)
        return self.scaling * rows.t()

    def sharded_state_dict(self, prefix: str = "", sharded_offsets: tuple = (), metadata: dict | None = None):
        """Megatron dist-checkpoint entries: A split on dim 1 (row-parallel) or B on dim 0 (column-parallel)."""
        from megatron.core.transformer.utils import make_sharded_tensors_for_checkpoint

        state = self.state_dict(prefix="", keep_vars=True)
        axis = {k: (1 if k.startswith("lora_A") else 0) for k, v in state.items()
                if getattr(v, "tensor_model_parallel", False)}
        return make_sharded_tensors_for_checkpoint(state, prefix, axis, sharded_offsets, tp_group=self.tp_group,
                                                   dp_cp_group=(metadata or {}).get("dp_cp_group"))


def _linear(layer: torch.nn.Module, path: str) -> torch.nn.Module | None:
    """The layer's linear at `path` (`self_attention.linear_qkv`, ...), None where the layer has none (MoE layers
    have no `mlp.linear_fc1`)."""
    module = layer
    for part in path.split("."):
        module = getattr(module, part, None)
    return module


def lora_adapters(chunks) -> list[tuple[int, LoraAdapter]]:
    """(global layer index, adapter) of every adapter in the chunks (DDP-wrapped or not), expert adapters included."""
    found = []
    for chunk in chunks:
        model = getattr(chunk, "module", chunk)
        for layer in getattr(getattr(model, "decoder", None), "layers", []):
            for path in dict.fromkeys(p for p, _ in HF_TARGETS.values()):
                adapter = getattr(_linear(layer, path), "lora", None)
                if adapter is not None:
                    found.append((layer.layer_number - 1, adapter))
            found += [(layer.layer_number - 1, adapter) for adapter in expert_adapters(layer)]
    return found


def is_lora_param(name: str) -> bool:
    return ".lora.lora_A." in name or ".lora.lora_B." in name


def is_lora_trained(name: str, chunk: torch.nn.Module) -> bool:
    """Whether parameter / state entry `name` of `chunk` is trained by LoRA: an adapter, or the weight of a module of
    modules_to_save (`apply_lora` records them on the chunk)."""
    return is_lora_param(name) or name in getattr(chunk, "lora_saved_params", ())


def saved_modules(chunks) -> list[tuple[str, torch.nn.Module]]:
    """(HF name, Megatron module) of every module of modules_to_save held by the chunks (DDP-wrapped or not)."""
    found = []
    for chunk in chunks:
        model = getattr(chunk, "module", chunk)
        for name in getattr(model, "lora_saved_modules", ()):
            found.append((name, _linear(model, SAVED_MODULE_PATHS[name])))
    return found


@torch.no_grad()
def apply_lora(chunks: list[torch.nn.Module], settings: LoraSettings, ps, seed: int = 0) -> int:
    """Freeze every base parameter and attach adapters to the target linears of every layer of the chunks.

    A is PEFT's Kaiming-uniform (bound 1 / sqrt(in_features)) drawn from the global name (the same global adapter at
    every layout), B is zero. The modules of `settings.modules_to_save` this rank holds are then trained in full
    (`_train_saved_modules`). Returns the number of adapter parameters on this rank.
    """
    for chunk in chunks:
        if getattr(chunk.config, "gated_linear_unit", True) is False:  # a non-gated hybrid stack (its spec's gated_mlp)
            raise ValueError(f"lora.use_peft with {NON_GATED_FAMILIES}: adapters on its hybrid layers (Mamba-2 "
                             "in_proj / out_proj, attention-only and non-gated MLP-only layers) are not built; train "
                             "without LoRA")
        refuse_expert_adapters(settings, getattr(chunk, "hf_model_type", "this model"),
                               getattr(chunk.config, "num_moe_experts", None) or 0,
                               getattr(chunk.config, "expert_tensor_parallel_size", None) or 1)
        for param in chunk.parameters():
            param.requires_grad_(False)
        _train_saved_modules(chunk, settings.modules_to_save)
    count = 0
    for chunk in chunks:
        for layer in getattr(getattr(chunk, "decoder", None), "layers", []):
            by_linear: dict[str, list[str]] = {}
            for name in settings.target_modules:
                by_linear.setdefault(HF_TARGETS[name][0], []).append(name)
            for path, names in by_linear.items():
                linear = _linear(layer, path)
                if linear is None:  # e.g. DeepSeek-V3's multi-latent attention has no fused QKV / linear_proj
                    raise ValueError(f"lora.lora_target_modules (peft_config.target_modules) includes {names}, but "
                                     f"{getattr(chunk, 'hf_model_type', 'this model')}'s layers have no such linear "
                                     f"(Megatron's {path}); adapt other modules or its experts (target_parameters)")
                adapter = LoraAdapter(path, names, settings, chunk.config, ps)
                _init_adapter(adapter, layer.layer_number - 1, ps, seed)
                _attach(linear, adapter)
                count += sum(p.numel() for p in adapter.parameters())
            # target_parameters: per-expert adapters (engine/policy/expert_lora.py)
            count += apply_expert_lora(layer, settings, ps, seed, _attach, initial_lora_a,
                                       interleaved=getattr(chunk, "hf_model_type", "") in INTERLEAVED_GATE_UP)
        _make_inputs_require_grad(chunk)
    return count


def _attach(linear: torch.nn.Module, adapter: torch.nn.Module) -> None:
    """Make `adapter` the linear's `lora` (a forward hook; its checkpoint entries beside the linear's)."""
    linear.add_module("lora", adapter)
    object.__setattr__(adapter, "base_linear", linear)  # not a submodule: the linear owns the adapter
    linear.sharded_state_dict = _sharded_state_dict_with_adapter(linear, adapter)
    linear.register_forward_hook(adapter.hook)


def _train_saved_modules(chunk: torch.nn.Module, names: tuple[str, ...]) -> None:
    """Unfreeze the weight of each module of modules_to_save (lm_head: the vocab-parallel output layer, embed_tokens:
    the vocab-parallel word embedding) that this chunk holds, in its dtype as in full fine-tuning (Megatron's
    optimizer keeps fp32 main copies of a bf16 one), and keep a frozen copy of the loaded weight for
    `adapters_disabled` (PEFT's ModulesToSaveWrapper holds the original module next to the trained copy).

    Raises ValueError naming the setting when the model ties its embedding to the LM head: PEFT's copy would untie
    them, which this policy (one shared parameter) cannot hold."""
    if names and getattr(chunk, "share_embeddings_and_output_weights", False):
        raise ValueError(f"lora.lora_modules_to_save (peft_config.modules_to_save)={list(names)} on a model with tied "
                         "embeddings (tie_word_embeddings=true): PEFT would train an untied copy of the module, which "
                         "the policy's one shared embedding / LM head weight cannot hold; drop modules_to_save")
    chunk.lora_saved_modules, chunk.lora_saved_params = (), ()
    for name in names:
        module = _linear(chunk, SAVED_MODULE_PATHS[name])
        if module is None:  # another pipeline stage holds it
            continue
        module.weight.requires_grad_(True)
        object.__setattr__(module, "lora_original_weight", module.weight.detach().clone())  # not a parameter
        chunk.lora_saved_modules += (name,)
        chunk.lora_saved_params += (f"{SAVED_MODULE_PATHS[name]}.weight",)


def _sharded_state_dict_with_adapter(linear: torch.nn.Module, adapter: LoraAdapter):
    """The linear's dist-checkpoint entries with its adapter's, each split as its own TP attributes say.

    NOTE: Megatron's Column/RowParallelLinear.sharded_state_dict takes the linear's whole (recursive) state_dict and
    marks every entry but weight / bias as replicated over TP: the adapter's TP-sharded halves would be saved from one
    TP rank only and loaded into every rank (same shapes: silently wrong). The adapter is left out of the base's call
    and adds its own entries (`LoraAdapter.sharded_state_dict`)."""
    base_method = type(linear).sharded_state_dict

    def sharded_state_dict(prefix: str = "", sharded_offsets: tuple = (), metadata: dict | None = None):
        del linear._modules["lora"]
        try:
            entries = base_method(linear, prefix, sharded_offsets, metadata)
        finally:
            linear._modules["lora"] = adapter
        return entries | adapter.sharded_state_dict(f"{prefix}lora.", sharded_offsets, metadata)

    return sharded_state_dict


def initial_lora_a(layer: int, hf_name: str, r: int, in_features: int, seed: int) -> torch.Tensor:
    """The initial A (r, in_features), float32, of HF module `hf_name` of decoder layer `layer` (global index): PEFT's
    Kaiming-uniform bound 1 / sqrt(in_features), drawn from the global name and the seed (every layout alike)."""
    gen = torch.Generator().manual_seed(seed * 1_000_003 + zlib.crc32(f"{layer}.{hf_name}.lora_A".encode()))
    return (torch.rand(r, in_features, generator=gen) * 2 - 1) / math.sqrt(in_features)


def _init_adapter(adapter: LoraAdapter, layer: int, ps, seed: int) -> None:
    from engine.policy.model import take_tp_shard

    for name, a in adapter.lora_A.items():
        full = initial_lora_a(layer, name, a.shape[0], a.shape[1] * (ps.tp_size if adapter.is_row else 1), seed)
        a.copy_(take_tp_shard(full, a, ps.tp_rank, ps.tp_size).to(a.dtype))


def _make_inputs_require_grad(chunk: torch.nn.Module) -> None:
    """NOTE: with the embedding frozen, the first layer's input does not require grad, and Megatron's (reentrant)
    activation recompute then returns outputs without a graph: the adapters inside would get no gradient. The
    embedding's output is made to require grad (what transformers' `enable_input_require_grads` does for PEFT)."""
    embedding = getattr(chunk, "embedding", None)
    if embedding is not None:
        embedding.register_forward_hook(
            lambda module, args, output: output.requires_grad_(True) if torch.is_grad_enabled() else output)


@contextlib.contextmanager
def merged_lora(chunks):
    """Within the block every adapted base weight holds W + scaling * B A (computed in fp32, rounded once to W's
    dtype) and the adapters are off, so a reader of the base parameters (weight sync, HF export) sees the merged
    model; the original W objects are restored after (no unmerge rounding). No adapters: nothing happens.
    NOTE: the merged copies of the adapted weights exist together for the block (one extra copy of those weights on
    each rank, transient), as TRL's merge / unmerge around its sync holds the merged model."""
    saved = []
    try:
        for _, adapter in lora_adapters(chunks):
            weight = adapter.base_linear.weight
            saved.append((weight, weight.data, adapter))
            weight.data = (weight.data.float() + adapter.weight_delta()).to(weight.dtype)
            adapter.merged = True
        yield
    finally:
        for weight, data, adapter in saved:
            weight.data = data
            adapter.merged = False


@contextlib.contextmanager
def adapters_disabled(chunks):
    """Within the block the chunks run as their frozen base (every adapter off, the modules of modules_to_save back to
    their loaded weights): TRL's reference model with PEFT (`disable_adapter()`), which saves a second copy of the
    weights (engine/policy/reference.py `base_of`)."""
    adapters = [adapter for _, adapter in lora_adapters(chunks)]
    modules = [module for _, module in saved_modules(chunks)]
    saved = [(module.weight, module.weight.data) for module in modules]
    try:
        for adapter in adapters:
            adapter.disabled = True
        for module in modules:  # modules_to_save: the loaded weight, as PEFT's original_module
            module.weight.data = module.lora_original_weight
        yield
    finally:
        for adapter in adapters:
            adapter.disabled = False
        for weight, data in saved:
            weight.data = data


@torch.no_grad()
def lora_tensors_for_peft(chunks, ps) -> dict[str, torch.Tensor]:
    """Every adapter tensor of this pipeline stage, TP shards gathered (collective over the TP group), under PEFT's
    saved key names (`base_model.model.model.layers.<i>.self_attn.q_proj.lora_A.weight`, ...); expert adapters gathered
    over EP (collective over the EP group) in PEFT's ParamWrapper layout (engine/policy/expert_lora.py); and the
    weights of the modules of modules_to_save it holds (`PEFT_SAVED_KEYS`: the vocabulary's rows, Megatron's padding
    cut off)."""
    from engine.policy.model import merge_tp_shards

    tensors, experts = {}, {}
    for layer, adapter in lora_adapters(chunks):
        if isinstance(adapter, ExpertLoraAdapter):
            experts.setdefault(layer, []).append(adapter)
            continue
        for name in adapter.hf_names:
            key = f"{PEFT_PREFIX}{layer}.{HF_PARENT[name]}.{name}"
            for which, param in (("lora_A", adapter.lora_A[name]), ("lora_B", adapter.lora_B[name])):
                full = merge_tp_shards(_gather_tp(param.data, ps), param)
                tensors[f"{key}.{which}.weight"] = full.clone()  # at TP1 `full` is the live parameter
    for chunk in chunks:
        model = getattr(chunk, "module", chunk)
        for name in getattr(model, "lora_saved_modules", ()):
            param = _linear(model, SAVED_MODULE_PATHS[name]).weight
            full = merge_tp_shards(_gather_tp(param.data, ps), param)
            tensors[PEFT_SAVED_KEYS[name]] = full[:model.hf_vocab_size].clone()
    targets = tuple(n for n in EXPERT_TARGETS if any(a.hf_names == [n] for group in experts.values() for a in group))
    return tensors | expert_tensors_for_peft(experts, targets, ps)


def _gather_tp(tensor: torch.Tensor, ps) -> list[torch.Tensor]:
    """Every TP rank's shard of `tensor`, in TP-rank order (collective over the TP group)."""
    if ps.tp_size == 1:
        return [tensor]
    shards = [torch.empty_like(tensor) for _ in range(ps.tp_size)]
    torch.distributed.all_gather(shards, tensor.contiguous(), group=ps.groups.tp)
    return shards
