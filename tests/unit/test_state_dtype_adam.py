"""The AdamW behind optimizer.optimizer_state_dtype (engine/policy/state_dtype_adam.py), on one process.

The float32 mode must be torch's AdamW bit for bit (the same formula); the bfloat16 mode must keep 2-byte moments
and stay within bf16's rounding of the float32 trajectory. Bound: a rounded moment is off by <= 2**-9 relative, so
one update m / sqrt(v) is off by <= ~1.5 * 2**-9 relative (sqrt halves v's error); an Adam update is at most
lr * (1 - beta1) / sqrt(1 - beta2) ~ 3.2 lr elementwise, so <= ~0.01 lr per step, and the moments carry earlier
roundings forward. The tests allow lr * 2**-5 (0.031 lr) per step; 5 steps measured 0.016 lr in all, 20 steps 0.06 lr.
"""

import pytest
import torch

from engine.policy.state_dtype_adam import StateDtypeAdamW

LR, STEPS = 1e-2, 5


def _trajectory(make, steps: int = STEPS, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    params = [torch.nn.Parameter(torch.randn(64, 48, generator=gen)), torch.nn.Parameter(torch.randn(300, generator=gen))]
    opt = make(params)
    for _ in range(steps):
        for p in params:
            p.grad = torch.randn(p.shape, generator=gen) * torch.rand((), generator=gen)
        opt.step()
    return params, opt


def _torch_adamw(params):
    return torch.optim.AdamW(params, lr=LR, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.1)


def _ours(dtype):
    return lambda params: StateDtypeAdamW(params, lr=LR, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.1,
                                          state_dtype=dtype)


def test_float32_state_is_torch_adamw_bit_for_bit():
    expected, _ = _trajectory(_torch_adamw)
    actual, _ = _trajectory(_ours(torch.float32))
    for a, e in zip(actual, expected):
        assert torch.equal(a, e)


@pytest.mark.parametrize("steps", [1, STEPS])
def test_bf16_moments_stay_within_bf16_rounding_of_the_float32_step(steps):
    expected, _ = _trajectory(_torch_adamw, steps)
    actual, _ = _trajectory(_ours(torch.bfloat16), steps)
    for a, e in zip(actual, expected):
        assert (a - e).abs().max() <= steps * LR * 2**-5
    if steps == 1:  # the first step uses the float32 moments it computed: rounding only affects later steps
        assert all(torch.equal(a, e) for a, e in zip(actual, expected))
    else:  # the bf16 moments acted: later steps differ from float32
        assert any(not torch.equal(a, e) for a, e in zip(actual, expected))


def test_bf16_moments_are_stored_in_two_bytes_and_are_the_rounded_float32_moments():
    params, opt = _trajectory(_ours(torch.bfloat16), steps=1)
    _, reference = _trajectory(_torch_adamw, steps=1)
    for p, ref_p in zip(params, reference.param_groups[0]["params"]):
        for key in ("exp_avg", "exp_avg_sq"):
            moment = opt.state[p][key]
            assert moment.dtype == torch.bfloat16 and moment.element_size() * moment.numel() == 2 * p.numel()
            assert torch.equal(moment, reference.state[ref_p][key].to(torch.bfloat16))


def test_state_dict_round_trip_keeps_bf16_moments_exactly():
    params, opt = _trajectory(_ours(torch.bfloat16), steps=3)
    saved = {k: {n: t.clone() for n, t in v.items()} for k, v in opt.state_dict()["state"].items()}
    fresh = StateDtypeAdamW([torch.nn.Parameter(p.detach().clone()) for p in params], lr=LR, state_dtype=torch.bfloat16)
    fresh.load_state_dict(opt.state_dict())  # torch casts state to the parameter dtype; the moments go back to bf16
    for i, state in enumerate(fresh.state_dict()["state"].values()):
        for key in ("exp_avg", "exp_avg_sq"):
            assert state[key].dtype == torch.bfloat16 and torch.equal(state[key], saved[i][key])
        assert float(state["step"]) == 3


def test_other_state_dtypes_and_low_precision_params_are_refused_by_name():
    with pytest.raises(ValueError, match="float32 or bfloat16"):
        StateDtypeAdamW([torch.nn.Parameter(torch.zeros(2))], state_dtype=torch.float16)
    param = torch.nn.Parameter(torch.zeros(2, dtype=torch.bfloat16))
    param.grad = torch.ones(2, dtype=torch.bfloat16)
    with pytest.raises(TypeError, match="float32 \\(main\\) parameters"):
        StateDtypeAdamW([param]).step()
