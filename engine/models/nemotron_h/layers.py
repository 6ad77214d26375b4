"""Nemotron-H's Mamba-2 mixer in pure PyTorch, as a Megatron module, and the hybrid stack's one-mixer layers.

Owns: `ssd_scan` (the Mamba-2 state-space scan, chunked, a pure function of tensors), `gated_group_rms_norm` (HF's
gated RMSNorm grouped by n_groups), `mamba_mixer_class` (the mixer in Megatron's (s, b, H) layout, TP-sharded by
head: in_proj column-parallel with its z / x / B / C / dt blocks each split (`partition_blocks`), the depthwise conv,
dt_bias / A_log / D / the norm split by head, out_proj row-parallel; a rank holds whole groups of heads, so the
grouped norm and the B / C of its heads are local: no communication beyond the two linears') and
`nemotron_h_layer_specs` (per decoder layer: the mixer, attention without RoPE, the relu2 MLP or the MoE layer, each
after its one RMSNorm, as attention-only or MLP-only TransformerLayers: Megatron's own hybrid-stack layout).

Why not megatron-core's MambaMixer: megatron/core/ssm/mamba_mixer.py imports the mamba_ssm and causal_conv1d CUDA
kernels (ImportError without them; neither has a CPU build). Prefill / training only: no decode state (the trainer
scores whole sequences). Packed rows (`train.padding_free`, the block-causal mask layout): the conv and the scan run
per sequence (`sequence_rows`: each sequence of a row becomes a row of its own, padded at its end, and back), so no
state crosses a sequence boundary; the THD layout (Transformer Engine only) is refused.

Must not: read Megatron's global parallel state, import vLLM.

Test: tests/unit/test_families.py (`ssd_scan` = the step-by-step recurrence; logits = HF's at TP1),
tests/distributed/test_family_layouts.py (logits = HF at TP2 / PP2; export byte-exact; GRPO step at TP2 = TP1).
"""

from __future__ import annotations

import dataclasses

import torch
import torch.nn.functional as F

from engine.models.nemotron_h import layer_kinds, mamba_blocks


def ssd_scan(x: torch.Tensor, dt: torch.Tensor, A: torch.Tensor, B: torch.Tensor, C: torch.Tensor,
             chunk_size: int) -> torch.Tensor:
    """The Mamba-2 scan y_t = C_t . h_t, h_t = exp(dt_t A) h_{t-1} + dt_t B_t x_t^T (h_0 = 0), in float32.

    Chunked: within a chunk of `chunk_size` steps the output is the masked quadratic form (like attention with a
    decay), across chunks the (heads, head_dim, state) state is carried by a loop over chunks. The D skip term is
    the caller's.

    Args:
        x: (b, T, h, p) inputs per head.  dt: (b, T, h) step sizes (after bias, softplus and clamp).
        A: (h,) negative decay rates.  B, C: (b, T, g, n) input / output projections of g groups (h % g == 0).
        chunk_size: steps per chunk (the result does not depend on it up to rounding).
    Returns:
        (b, T, h, p) float32.
    """
    b, T, h, p = x.shape
    heads_per_group = h // B.shape[2]
    B = B.float().repeat_interleave(heads_per_group, dim=2)  # (b, T, h, n)
    C = C.float().repeat_interleave(heads_per_group, dim=2)
    dt = dt.float()
    xdt = x.float() * dt[..., None]  # (b, T, h, p)
    log_decay = dt * A.float()  # (b, T, h), <= 0
    pad = (-T) % chunk_size
    if pad:
        xdt, B, C = (F.pad(t, (0, 0, 0, 0, 0, pad)) for t in (xdt, B, C))
        log_decay = F.pad(log_decay, (0, 0, 0, pad))
    c, L = (T + pad) // chunk_size, chunk_size
    xdt, B, C = (t.reshape(b, c, L, h, -1) for t in (xdt, B, C))  # (b, c, L, h, p or n)
    cum = log_decay.reshape(b, c, L, h).cumsum(dim=2)  # (b, c, L, h): log decay from the chunk start
    causal = torch.ones(L, L, dtype=torch.bool, device=x.device).tril()  # (t, s): s <= t
    gaps = cum[:, :, :, None, :] - cum[:, :, None, :, :]  # (b, c, t, s, h): log decay from s to t
    decay = torch.exp(gaps.masked_fill(~causal[None, None, :, :, None], float("-inf")))
    scores = torch.einsum("bcthn,bcshn->bctsh", C, B) * decay  # (b, c, t, s, h)
    y = torch.einsum("bctsh,bcshp->bcthp", scores, xdt)  # within-chunk part
    to_end = torch.exp(cum[:, :, -1:, :] - cum)  # (b, c, L, h): decay from each step to its chunk's end
    chunk_states = torch.einsum("bclhn,bclh,bclhp->bchpn", B, to_end, xdt)  # (b, c, h, p, n)
    state = x.new_zeros((b, h, p, B.shape[-1]), dtype=torch.float32)
    starts = []
    for k in range(c):  # the state entering chunk k
        starts.append(state)
        state = torch.exp(cum[:, k, -1, :])[:, :, None, None] * state + chunk_states[:, k]
    starts = torch.stack(starts, dim=1)  # (b, c, h, p, n)
    y = y + torch.einsum("bclhn,bchpn->bclhp", C, starts) * torch.exp(cum)[..., None]
    return y.reshape(b, c * L, h, p)[:, :T]


def sequence_rows(attention_mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Where each sequence of packed rows lies, from the block-causal mask (engine/policy/packing.py
    `block_causal_mask`, True = masked): a position starts a sequence when it may not see the one before it.

    Args:
        attention_mask: (rows, 1, W, W) bool.
    Returns:
        `gather` (n, L) int64: flat position (row * W + t) of step j of sequence i, rows * W (a zero row) past its
        end; `sequence` (rows * W,) and `step` (rows * W,): each flat position's sequence and step in it.
    """
    rows, width = attention_mask.shape[0], attention_mask.shape[-1]
    starts = torch.ones(rows, width, dtype=torch.bool, device=attention_mask.device)
    starts[:, 1:] = attention_mask[:, 0].diagonal(offset=-1, dim1=-2, dim2=-1)  # t cannot see t - 1
    sequence = starts.reshape(-1).cumsum(0) - 1  # (rows * W,)
    lengths = torch.bincount(sequence)
    first = lengths.cumsum(0) - lengths  # flat position where each sequence starts
    step = torch.arange(rows * width, device=sequence.device) - first[sequence]
    gather = torch.full((len(lengths), int(lengths.max())), rows * width, dtype=torch.long, device=sequence.device)
    gather[sequence, step] = torch.arange(rows * width, device=sequence.device)
    return gather, sequence, step


def gated_group_rms_norm(y: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor, group_size: int,
                         eps: float) -> torch.Tensor:
    """HF's gated RMSNorm (Zamba2RMSNormGated, norm after the gate): y * silu(gate) normalised over each group of
    `group_size` channels, in float32, times the weight (the result's dtype: y's and the weight's promoted)."""
    h = y.float() * F.silu(gate.float())
    grouped = h.view(*h.shape[:-1], -1, group_size)  # (..., groups, group_size)
    grouped = grouped * torch.rsqrt(grouped.pow(2).mean(-1, keepdim=True) + eps)
    return weight * grouped.view(h.shape).to(y.dtype)


def _tp_param(shape, config, tp_group, blocks: tuple[int, ...] | None = None) -> torch.nn.Parameter:
    """A parameter split along dim 0 over TP (Megatron's attributes; `partition_blocks`: its global row blocks, each
    split over TP, for engine/policy/model.py take_tp_shard / merge_tp_shards)."""
    from megatron.core.tensor_parallel.layers import set_tensor_model_parallel_attributes

    on_gpu = torch.cuda.is_available() and not config.use_cpu_initialization  # where Megatron puts its own
    device = torch.cuda.current_device() if on_gpu else "cpu"
    param = torch.nn.Parameter(torch.empty(shape, dtype=config.params_dtype, device=device))
    set_tensor_model_parallel_attributes(param, True, 0, 1)
    if blocks is not None:
        param.partition_blocks = blocks
    return param


def mamba_mixer_class():
    """The `MambaMixer` module class (built lazily: Megatron is imported inside)."""
    from megatron.core.tensor_parallel import ColumnParallelLinear
    from megatron.core.transformer.module import MegatronModule

    class MambaMixer(MegatronModule):
        """HF's NemotronHMamba2Mixer (its PyTorch path, `torch_forward` in earlier transformers) in Megatron's layout:
        (s, b, H) in, (out, None) back, as a TransformerLayer's `self_attention` is. `hf_config` comes through the
        spec's params."""

        def __init__(self, config, layer_number: int = 1, pg_collection=None, hf_config=None, row_parallel=None,
                     **unused):
            super().__init__(config)
            self.tp_group = tp_group = pg_collection.tp
            tp_size = tp_group.size()
            self.blocks = mamba_blocks(hf_config)  # global (z, x, B, C, dt)
            self.local = tuple(size // tp_size for size in self.blocks)
            self.num_heads, self.head_dim = self.local[4], int(hf_config.mamba_head_dim)
            self.state_size, self.chunk_size = int(hf_config.ssm_state_size), int(hf_config.chunk_size)
            self.group_size = self.blocks[0] // int(hf_config.n_groups)
            self.eps, self.dt_min = float(hf_config.layer_norm_epsilon), float(hf_config.time_step_min)
            self.in_proj = ColumnParallelLinear(config.hidden_size, sum(self.blocks), config=config,
                                                init_method=config.init_method, bias=False, gather_output=False,
                                                skip_bias_add=True, tp_group=tp_group)
            self.in_proj.weight.partition_blocks = self.blocks
            conv_blocks, conv_local = self.blocks[1:4], sum(self.local[1:4])
            kernel = int(hf_config.conv_kernel)
            self.conv1d = torch.nn.Module()
            self.conv1d.weight = _tp_param((conv_local, 1, kernel), config, tp_group, conv_blocks)
            self.conv1d.bias = (_tp_param((conv_local,), config, tp_group, conv_blocks)
                                if hf_config.use_conv_bias else None)
            self.dt_bias = _tp_param((self.num_heads,), config, tp_group)
            self.A_log = _tp_param((self.num_heads,), config, tp_group)
            self.D = _tp_param((self.num_heads,), config, tp_group)
            self.norm = torch.nn.Module()
            self.norm.weight = _tp_param((self.local[0],), config, tp_group)
            self.out_proj = row_parallel(self.blocks[0], config.hidden_size, config=config,
                                         init_method=config.output_layer_init_method, bias=False,
                                         input_is_parallel=True, skip_bias_add=True, tp_group=tp_group)
            with torch.no_grad():  # HF's init; a checkpoint or init_weights_by_name overwrites it
                for param in (self.conv1d.weight, self.dt_bias, self.A_log, self.D):
                    torch.nn.init.normal_(param, std=0.02)
                torch.nn.init.ones_(self.norm.weight)
                if self.conv1d.bias is not None:
                    torch.nn.init.zeros_(self.conv1d.bias)

        def sharded_state_dict(self, prefix="", sharded_offsets=(), metadata=None):
            """Megatron's distributed-checkpoint entries: every parameter split over TP along dim 0, in_proj's and
            the conv's blocks saved as tensors of their own (`<name>.z` / `.x` / `.B` / `.C` / `.dt`: Megatron's
            MambaMixer layout, megatron/core/ssm/mamba_mixer.py), so a checkpoint loads at another TP size."""
            from megatron.core.ssm.mamba_mixer import _split_tensor_factory
            from megatron.core.transformer.utils import (
                ensure_metadata_has_dp_cp_group,
                make_sharded_tensors_for_checkpoint,
                sharded_state_dict_default,
            )

            metadata = ensure_metadata_has_dp_cp_group(metadata)
            state = {}
            self._save_to_state_dict(state, "", keep_vars=True)  # A_log, D, dt_bias
            for name in ("conv1d", "norm"):
                state |= getattr(self, name).state_dict(prefix=f"{name}.", keep_vars=True)
            out = make_sharded_tensors_for_checkpoint(state, prefix, {k: 0 for k in state}, sharded_offsets,
                                                      tp_group=self.tp_group, dp_cp_group=metadata["dp_cp_group"])
            for name in ("in_proj", "out_proj"):
                out |= sharded_state_dict_default(getattr(self, name), f"{prefix}{name}.", sharded_offsets, metadata,
                                                  tp_group=self.tp_group)
            out[f"{prefix}in_proj.weight"] = _split_tensor_factory(out[f"{prefix}in_proj.weight"], list(self.local),
                                                                   ["z", "x", "B", "C", "dt"], 0)
            for name in ("conv1d.weight", "conv1d.bias"):
                if f"{prefix}{name}" in out:
                    out[f"{prefix}{name}"] = _split_tensor_factory(out[f"{prefix}{name}"], list(self.local[1:4]),
                                                                   ["x", "B", "C"], 0)
            return out

        def forward(self, hidden_states, attention_mask=None, packed_seq_params=None, **unused):
            if packed_seq_params is not None:
                raise ValueError("nemotron_h: the THD packed layout (Transformer Engine) is not supported by the "
                                 "Mamba-2 mixer; the local spec's block-causal mask layout is")
            projected, _ = self.in_proj(hidden_states)  # (T, b, P / tp); SP: gathered to the whole sequence
            projected = projected.transpose(0, 1)  # (b, T, P / tp)
            if attention_mask is None:
                y = self._mix(projected)
            else:  # packed rows: one row per sequence, and back (`sequence_rows`)
                b, T, P = projected.shape
                gather, sequence, step = sequence_rows(attention_mask)
                flat = torch.cat([projected.reshape(b * T, P), projected.new_zeros(1, P)])  # (b * T + 1, P)
                y = self._mix(flat[gather])[sequence, step].reshape(b, T, -1)  # (n, L, .) -> (b, T, inner / tp)
            out, bias = self.out_proj(y.to(hidden_states.dtype).transpose(0, 1).contiguous())  # (T, b, H)
            return out, bias

        def _mix(self, projected):
            """(b, T, P / tp) in_proj outputs of whole sequences -> (b, T, inner / tp) gated-norm outputs."""
            z_size, x_size, b_size, c_size, dt_size = self.local
            z, xbc, dt = projected.split([z_size, x_size + b_size + c_size, dt_size], dim=-1)
            T = xbc.shape[1]
            weight = self.conv1d.weight
            conv = F.conv1d(xbc.transpose(1, 2).to(weight.dtype), weight, self.conv1d.bias,
                            padding=weight.shape[-1] - 1, groups=weight.shape[0])[..., :T]  # (b, channels, T)
            xbc = F.silu(conv).transpose(1, 2).to(xbc.dtype)  # (b, T, channels)
            x, B, C = xbc.split([x_size, b_size, c_size], dim=-1)
            dt = F.softplus(dt + self.dt_bias.to(dt.dtype)).clamp(min=self.dt_min)  # (b, T, h)
            A = -torch.exp(self.A_log.float())
            x = x.reshape(*x.shape[:2], self.num_heads, self.head_dim)  # (b, T, h, p)
            groups = b_size // self.state_size
            B, C = (t.reshape(*t.shape[:2], groups, self.state_size) for t in (B, C))  # (b, T, g, n)
            y = ssd_scan(x, dt, A, B, C, self.chunk_size)  # (b, T, h, p) float32
            y = y + self.D[:, None] * x.float()
            return gated_group_rms_norm(y.reshape(*y.shape[:2], -1), z, self.norm.weight, self.group_size, self.eps)

    return MambaMixer


def nemotron_h_layer_specs(spec, row_parallel, hf_config, dense_spec=None) -> list:
    """One layer spec per decoder layer (global order) from the project's finished local spec: a Mamba layer (the
    mixer as `self_attention` after the input norm), an attention layer (no MLP) or an MLP layer (no attention; its
    norm is the pre-MLP norm); with MoE ('E') layers `spec` is the MoE spec (its MLP a MoELayer: an 'E' layer is an
    MLP-only layer of it) and `dense_spec` the dense one ('-' layers)."""
    from megatron.core.transformer.identity_op import IdentityFuncOp, IdentityOp
    from megatron.core.transformer.spec_utils import ModuleSpec

    layer = spec.submodules
    dense = (dense_spec or spec).submodules
    no_mlp = dict(pre_mlp_layernorm=IdentityOp, mlp=IdentityOp, mlp_bda=IdentityFuncOp)
    mixer = ModuleSpec(module=mamba_mixer_class(), params={"hf_config": hf_config, "row_parallel": row_parallel})
    kinds = {
        "attention": dataclasses.replace(layer, **no_mlp),
        "mlp": dataclasses.replace(dense, input_layernorm=IdentityOp, self_attention=IdentityOp,
                                   self_attn_bda=IdentityFuncOp),
        "moe": dataclasses.replace(layer, input_layernorm=IdentityOp, self_attention=IdentityOp,
                                   self_attn_bda=IdentityFuncOp),
        "mamba": dataclasses.replace(layer, self_attention=mixer, **no_mlp),
    }
    return [dataclasses.replace(spec, submodules=kinds[kind]) for kind in layer_kinds(hf_config)]
