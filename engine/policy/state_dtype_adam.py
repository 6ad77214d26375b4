"""AdamW whose moments are stored in a lower precision (bfloat16), for `optimizer.optimizer_state_dtype`.

Megatron's precision-aware optimizer (bf16 Adam moments) needs Transformer Engine's FusedAdam. This AdamW does the
same without it, on CPU and on CUDA: `exp_avg` and `exp_avg_sq` are kept in bfloat16 (half the Adam state memory),
and each step loads them to float32, updates them and the parameter in float32 (torch AdamW's formula, operation for
operation), and rounds them back once, to nearest (no stochastic rounding). The parameter it updates is Megatron's
float32 main parameter (or its shard under the distributed optimizer): main weights and gradients stay float32.

Precision cost: each moment carries bf16's 8-bit mantissa (relative rounding error <= 2**-9 per step). With
beta2 = 0.999 a step changes the second moment by about 0.1%, below bf16's resolution: a second moment whose
gradients shrink decays slower than in float32 (round to nearest keeps it), so the step size shrinks later.

Owns: `StateDtypeAdamW` and `use_state_dtype(megatron_optimizer, dtype)`, which swaps it in for the torch AdamW
inside a Megatron optimizer (its param groups, state initialiser and checkpoint path unchanged).

Test: tests/unit/test_state_dtype_adam.py, tests/distributed/test_bf16_optimizer_states.py.
"""

from __future__ import annotations

import torch

MOMENTS = ("exp_avg", "exp_avg_sq")


class StateDtypeAdamW(torch.optim.Optimizer):
    """AdamW (decoupled weight decay, bias-corrected) with `exp_avg` / `exp_avg_sq` stored in `state_dtype`.

    With state_dtype=float32 it is torch.optim.AdamW's single-tensor path, bit for bit."""

    def __init__(self, params, lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8,
                 weight_decay: float = 1e-2, *, state_dtype: torch.dtype = torch.bfloat16):
        if state_dtype not in (torch.float32, torch.bfloat16):
            raise ValueError(f"StateDtypeAdamW stores Adam moments in float32 or bfloat16, not {state_dtype}")
        self.state_dtype = state_dtype
        super().__init__(params, {"lr": lr, "betas": tuple(betas), "eps": eps, "weight_decay": weight_decay})

    def initialize_state(self, param: torch.Tensor) -> None:
        """Zero moments in `state_dtype` and step 0 (also what a checkpoint load fills)."""
        self.state[param].update({key: torch.zeros_like(param, dtype=self.state_dtype) for key in MOMENTS})
        self.state[param].setdefault("step", torch.tensor(0.0))

    def load_state_dict(self, state_dict: dict) -> None:
        """torch's load casts every state tensor to its parameter's dtype (float32): the moments go back to
        `state_dtype` (exact for moments saved from it)."""
        super().load_state_dict(state_dict)
        for state in self.state.values():
            for key in MOMENTS:
                if key in state and state[key].dtype != self.state_dtype:
                    state[key] = state[key].to(self.state_dtype)

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            lr, (beta1, beta2), eps, weight_decay = group["lr"], group["betas"], group["eps"], group["weight_decay"]
            for param in group["params"]:
                if param.grad is None:
                    continue
                if param.dtype != torch.float32:
                    raise TypeError(f"StateDtypeAdamW updates float32 (main) parameters, got {param.dtype}: keep "
                                    "Megatron's float32 main parameters (bf16 / fp16 models get them by default)")
                state = self.state[param]
                if not all(key in state for key in MOMENTS):
                    self.initialize_state(param)
                state["step"] = state["step"] + 1  # a new tensor: a checkpoint load may share one step tensor
                step = float(state["step"])
                grad = param.grad.float()
                exp_avg = state["exp_avg"].float()  # a copy when stored in bf16; the state itself in float32
                exp_avg_sq = state["exp_avg_sq"].float()
                param.mul_(1 - lr * weight_decay)
                exp_avg.lerp_(grad, 1 - beta1)
                exp_avg_sq.mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
                step_size = lr / (1 - beta1**step)
                denom = (exp_avg_sq.sqrt() / (1 - beta2**step) ** 0.5).add_(eps)
                param.addcdiv_(exp_avg, denom, value=-step_size)
                if self.state_dtype != torch.float32:
                    state["exp_avg"].copy_(exp_avg)  # rounded to nearest, once per step
                    state["exp_avg_sq"].copy_(exp_avg_sq)
        return loss


def _init_state(opt, config=None) -> None:
    """Megatron's `init_state_fn` (called before a checkpoint load fills the state): moments in the state dtype."""
    for group in opt.param_groups:
        for param in group["params"]:
            if len(opt.state[param]) == 0:
                opt.initialize_state(param)


def use_state_dtype(optimizer, dtype: torch.dtype) -> None:
    """Replace the torch AdamW inside each of Megatron's (chained) optimizers by `StateDtypeAdamW(dtype)` over the
    same param groups (the same dicts: the LR schedule keeps setting their lr). Called right after
    `get_megatron_optimizer`, before any step, so there is no state to carry over."""
    for sub in getattr(optimizer, "chained_optimizers", [optimizer]):
        inner = getattr(sub, "optimizer", None)
        if inner is None:  # a rank without trained parameters in this group
            continue
        if type(inner) is not torch.optim.AdamW:
            raise ValueError(f"optimizer.optimizer_state_dtype={dtype} replaces torch.optim.AdamW, but Megatron built "
                             f"{type(inner).__name__}: use optimizer.optim=adam (Transformer Engine's FusedAdam has its "
                             "own precision-aware path)")
        if inner.state:
            raise RuntimeError("use_state_dtype must run before the first optimizer step (the AdamW has state)")
        defaults = inner.defaults
        replacement = StateDtypeAdamW([torch.zeros(0, requires_grad=True)], lr=defaults["lr"], betas=defaults["betas"],
                                      eps=defaults["eps"], weight_decay=defaults["weight_decay"], state_dtype=dtype)
        # The groups as they are, as Megatron's distributed optimizer sets them: its main-parameter shards are views
        # (non-leaf tensors) that torch's add_param_group would refuse.
        replacement.param_groups = inner.param_groups
        sub.optimizer = replacement
        sub.init_state_fn = _init_state
