"""Rollout routing replay (R3) and the router-agreement metric for MoE policies, on top of Megatron's RouterReplay.

R3 (rollout routing replay; NVIDIA/Megatron-LM#4168): the experts the inference engine routed each token to are
replayed in the training forward, so training and sampling run the same experts even where their routers disagree
(bf16 kernels, different reductions): without it ~10% of routing decisions differ and GRPO runs on Qwen3-30B-A3B
collapsed. Measured on the tiny MoE: benchmarks/bench_routing_replay.py.

Owns: setting each router per forward (`begin_forward`: replay or record, the routes' layout and token order;
`end_forward` / `finish_schedule`: the routes activation recompute replays), the agreement metric
(`router_agreement` ... `take_router_agreement`) and the engine's routes as tensors (`pad_routes`, `routes_dtype`).

Must not: read Megatron's global parallel state (each router's own `router_replay` object is set, never the static
list of all instances, which other models built in the same process would also be on), or touch vLLM.

Test: tests/distributed/test_routing_replay.py (EP2, and TP2 x EP2 with sequence parallelism).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from engine.policy.microbatch import MicroBatch
from engine.policy.parallel import ParallelState


def _moe_routers(chunk: torch.nn.Module):
    """(global layer index, router) of every MoE layer of a model chunk."""
    for layer in getattr(getattr(chunk, "decoder", None), "layers", []):
        router = getattr(getattr(layer, "mlp", None), "router", None)
        if router is not None:
            yield layer.layer_number - 1, router


def _router_order(per_token: torch.Tensor, ps: ParallelState) -> torch.Tensor:
    """(b, T, ...) -> (s*b [/tp], ...): the router's token order (this TP rank's sequence shard under SP).

    Megatron's router sees the layer input (s, b, H) flattened to (s*b, H), so route row s_i*b + b_i is token
    (b_i, s_i); under sequence parallelism each TP rank holds s/tp of the sequence.
    """
    x = per_token.transpose(0, 1)  # (T, b, ...)
    if ps.sequence_parallel and ps.tp_size > 1:
        step = x.shape[0] // ps.tp_size
        x = x[ps.tp_rank * step: (ps.tp_rank + 1) * step]
    return x.reshape(-1, *x.shape[2:]).to(ps.device)


def _layer_routes(routes: torch.Tensor, layer: int, ps: ParallelState) -> torch.Tensor:
    """(s*b [/tp], k) top-k ids of one layer in the router's token order, from (b, T, L, k)."""
    return _router_order(routes[:, :, layer, :].long(), ps)


def _recomputed_layers(chunk: torch.nn.Module, will_backward: bool) -> set[int]:
    """Local indices of the MoE layers of `chunk` whose forward runs again in the backward of this forward: every
    layer (full, uniform), the first recompute_num_layers (full, block), or the MoE layers themselves (selective
    `moe`); none without a backward (forward-only passes, no grad) or in eval mode (full recompute trains only)."""
    if not will_backward or not torch.is_grad_enabled():
        return set()
    config, layers = chunk.config, list(getattr(getattr(chunk, "decoder", None), "layers", []))
    if config.recompute_granularity == "full" and chunk.decoder.training:
        count = config.recompute_num_layers if config.recompute_method == "block" else len(layers)
        return set(range(min(count, len(layers))))
    return {i for i, layer in enumerate(layers) if getattr(getattr(layer, "mlp", None), "moe_layer_recompute", False)}


def begin_forward(chunk: torch.nn.Module, batch: MicroBatch, ps: ParallelState, replay: bool,
                  will_backward: bool = False) -> bool:
    """Set every MoE router of `chunk` for this micro-batch's forward; returns whether routes were recorded (so
    `router_agreement` can be asked after the forward).

    A micro-batch that carries `routed_experts` (b, T, L, k) int64 (global layer L, top-k expert ids; what vLLM
    returns per sequence as `routed_experts` [seq_len, L, k]) is either
    - replayed (`model.moe_enable_routing_replay`): each MoE layer's router takes the given top-k instead of computing
      it (Megatron's `RouterReplayAction.REPLAY_FORWARD`; the probabilities are the router's own scores at those
      experts, renormalised as usual, so the router still gets gradients), or
    - recorded and compared (off): `router_agreement` counts the (token, layer) pairs where the trainer picked the
      same set of k experts as the engine, over the real tokens only.
    Positions the engine gave no routes for (padding; the last sampled token, which vLLM never runs) must still hold
    k distinct ids (`pad_routes`). Packed micro-batches (`input_ids` rows, engine/policy/packing.py) carry the routes
    in the same rows as `input_routes` (rows, W, L, k) with `input_routes_valid` (rows, W), True where the engine
    routed the token. Recompute: `end_forward`.

    replay: True = use the batch's `routed_experts`; False = record the trainer's own choice.
    will_backward: a training forward whose backward follows (recomputed layers then keep their top-k: `end_forward`).
    """
    from megatron.core.transformer.moe.router_replay import RouterReplayAction

    routes = model_input_routes(batch)
    recomputed = _recomputed_layers(chunk, will_backward)
    recording = False
    for index, (layer, router) in enumerate(_moe_routers(chunk)):
        replayer = getattr(router, "router_replay", None)
        if replayer is None:
            if routes is not None and replay:
                raise ValueError("the batch carries routed_experts but the model was built without routing replay "
                                 "(model.moe_enable_routing_replay)")
            continue
        # NOTE: not clear_indices(), which would also empty the queue earlier forwards left for their recompute
        replayer.target_topk_idx = replayer.recorded_topk_idx = None
        replayer.keep_for_recompute = index in recomputed
        if routes is not None and replay:
            replayer.target_topk_idx = _layer_routes(routes, layer, ps)
            replayer.set_router_replay_action(RouterReplayAction.REPLAY_FORWARD)
        elif routes is not None or replayer.keep_for_recompute:  # record: the metric, or what the recompute replays
            replayer.set_router_replay_action(RouterReplayAction.RECORD)
            recording = recording or routes is not None
        else:
            replayer.clear_router_replay_action()
    return recording


def model_input_routes(batch: MicroBatch) -> torch.Tensor | None:
    """The engine's routes in the model input's layout: (rows, W, L, k) of a packed micro-batch, else (b, T, L, k)."""
    return batch.input_routes if batch.is_packed else batch.routed_experts


def router_agreement(chunk: torch.nn.Module, batch: MicroBatch, ps: ParallelState) -> tuple[int, int]:
    """(agreeing, total) (token, layer) pairs of the last recorded forward of `chunk`: the trainer's top-k set equals
    the engine's, over the tokens the engine routed (`input_routes_valid`, or each row's `lengths` - 1 first ones).
    Under sequence parallelism summed over the TP group (each TP rank routes its part of the sequence), so every TP
    rank returns the whole sequence's counts."""
    routes = model_input_routes(batch)  # (b, T, L, k)
    num_rows, seq_len = routes.shape[:2]
    if batch.is_packed:
        valid = batch.input_routes_valid  # (rows, W)
    else:
        lengths = torch.full((num_rows,), seq_len) if batch.lengths is None else batch.lengths
        valid = torch.arange(seq_len)[None, :] < (lengths[:, None] - 1)  # (b, T): vLLM never runs the last token
    mask = _router_order(valid, ps)  # (s*b,)
    agree = total = 0
    for layer, router in _moe_routers(chunk):
        recorded = router.router_replay.get_recorded_indices()  # (s*b [/tp], k)
        engine = _layer_routes(routes, layer, ps)
        same = (recorded.sort(dim=-1).values == engine.sort(dim=-1).values).all(dim=-1)  # (s*b,)
        agree += int(same[mask].sum())
        total += int(mask.sum())
    if ps.sequence_parallel and ps.tp_size > 1:  # each TP rank routed its own s / tp of the sequence: sum them
        counts = torch.tensor([agree, total], dtype=torch.int64)
        torch.distributed.all_reduce(counts, group=ps.groups.tp)
        agree, total = (int(c) for c in counts)
    return agree, total


def record_router_agreement(chunk: torch.nn.Module, batch: MicroBatch, ps: ParallelState) -> None:
    """Add the last recorded forward's agreement to `chunk`'s running count (tp_rank 0: every TP rank holds the whole
    sequence's counts, `router_agreement`)."""
    agree, total = router_agreement(chunk, batch, ps)
    if ps.tp_rank == 0:
        counts = getattr(chunk, "router_agreement_counts", (0, 0))
        chunk.router_agreement_counts = (counts[0] + agree, counts[1] + total)


def take_router_agreement(chunks: list[torch.nn.Module], ps: ParallelState) -> float | None:
    """The fraction of (token, layer) pairs routed alike by trainer and engine since the last call, over every
    rank's chunks (a collective: every rank calls it); the counts are reset. None when nothing was compared.

    The agreement is accumulated per model chunk (`record_router_agreement`); the loop reads it after the
    old-log-prob forward, where trainer and engine hold the same weights."""
    counts = torch.tensor([getattr(getattr(c, "module", c), "router_agreement_counts", (0, 0)) for c in chunks],
                          dtype=torch.float64).sum(0)  # (2,); chunks may sit inside Megatron's DDP wrapper
    clear_router_agreement(chunks)
    counts = counts.to(ps.device)
    dist.all_reduce(counts)
    return float(counts[0] / counts[1]) if counts[1] > 0 else None


def clear_router_agreement(chunks: list[torch.nn.Module]) -> None:
    """Reset the running counts of `chunks` (local: no collective)."""
    for chunk in chunks:
        getattr(chunk, "module", chunk).router_agreement_counts = (0, 0)


def end_forward(chunk: torch.nn.Module) -> None:
    """After a forward: each router to be recomputed queues the top-k it used (replayed or its own) for its
    recomputed forward and stands at REPLAY_BACKWARD; the others are cleared (the next forward routes by itself
    unless `begin_forward` sets it).

    Activation recompute (`train.gradient_checkpointing`): a recomputed layer runs its forward again in the backward,
    and its router must take the same experts then, or the gradient belongs to another forward. Every forward that
    will be recomputed (a training forward, grad enabled, of a layer that full recompute or selective `moe` recompute
    covers: `_recomputed_layers`) keeps the top-k its router used, the replayed routes or its own choice alike, in
    Megatron's per-router FIFO (`RouterReplay.replay_backward_list`), and between forwards the routers stand at
    `REPLAY_BACKWARD`, so each recomputed forward pops the top-k of its own forward. Megatron's schedules run the
    backwards of a model chunk in the order of its forwards (1F1B, interleaved or not), which is the FIFO's order.
    `run_schedule` starts every pass with empty queues and checks they are empty after it (`finish_schedule`). The
    agreement is counted once per forward, in `forward_step`, never in a recomputed forward (which does not record).
    """
    from megatron.core.transformer.moe.router_replay import RouterReplayAction

    for _, router in _moe_routers(chunk):
        replayer = getattr(router, "router_replay", None)
        if replayer is None:
            continue
        if getattr(replayer, "keep_for_recompute", False):
            used = (replayer.target_topk_idx if replayer.router_replay_action == RouterReplayAction.REPLAY_FORWARD
                    else replayer.recorded_topk_idx)
            replayer.replay_backward_list.append(used)
        replayer.target_topk_idx = replayer.recorded_topk_idx = None
        replayer.keep_for_recompute = False
        if replayer.replay_backward_list:
            replayer.set_router_replay_action(RouterReplayAction.REPLAY_BACKWARD)
        else:
            replayer.clear_router_replay_action()


def finish_schedule(chunks: list[torch.nn.Module], check: bool) -> None:
    """After (and, with check=False, before) a schedule pass: every router cleared; with `check`, raise if a
    recomputed forward did not take the top-k its forward left (the queues must be empty after the backwards)."""
    for chunk in chunks:
        for layer, router in _moe_routers(getattr(chunk, "module", chunk)):
            replayer = getattr(router, "router_replay", None)
            if replayer is None:
                continue
            left = len(replayer.replay_backward_list)
            replayer.clear_indices()
            replayer.clear_router_replay_action()
            if check and left:
                raise RuntimeError(f"MoE layer {layer}: {left} forward(s) kept routes for a recomputed forward that "
                                   "never ran (activation recompute and routing replay out of step)")


def pad_routes(routes: list, seq_len: int, num_layers: int, top_k: int, dtype: torch.dtype = torch.long) -> torch.Tensor:
    """(b, T, L, k) from per-row engine routes ([n_i, L, k] arrays, n_i <= T), the rest filled with 0..k-1.
    `dtype`: a narrow one (uint8 for up to 256 experts) keeps a round's routes small; the router takes int64."""
    out = torch.arange(top_k, dtype=dtype).expand(len(routes), seq_len, num_layers, top_k).clone()
    for i, row in enumerate(routes):
        row = torch.as_tensor(row).to(dtype)
        if row.numel():
            out[i, : row.shape[0]] = row
    return out


def routes_dtype(routes: list) -> torch.dtype:
    """The narrowest dtype that holds every expert id of `routes`."""
    largest = max((int(torch.as_tensor(r).max()) for r in routes if torch.as_tensor(r).numel()), default=0)
    return torch.uint8 if largest < 256 else torch.int16
