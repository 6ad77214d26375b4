"""kernels/chunked_logprob.py: the tiled torch path against the reference in float64, forward and both gradients,
over tile shapes, padding, temperature, peaked and flat softmax; its memory bound; determinism; the no-grad mode."""

from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from kernels.chunked_logprob import MIN_TILE_COLS, plan_tiles
from kernels.lm_head_logprob import chunked_logprob_entropy
from kernels.reference import build_lm_head_problem, reference_logprob_entropy

F64 = torch.float64
N, H, V_ROWS = 64, 48, 300

# name -> (problem kwargs, temperature). V = 300 rows is no multiple of any tile width; vocab_size < 300 = padding.
CASES = {
    "peaked_abs50_padded_t0.7": (dict(vocab_size=290, max_abs_logit=50.0, sampled_fraction=0.5), 0.7),
    "flat_t1": (dict(vocab_size=300, logit_std=0.01), 1.0),
    "moderate_padded_t1.6": (dict(vocab_size=257, logit_std=4.0, sampled_fraction=0.25), 1.6),
}
# workspace (MiB) -> tiles of 64 x 300 (one tile), 64 x 128, and 2 x 128 (many row and column chunks).
WORKSPACES_MB = [128.0, 64 * 128 * 24 / 2**20, 2 * 128 * 24 / 2**20]


def _case(name: str, dtype=F64):
    kwargs, temperature = CASES[name]
    x, w, y = build_lm_head_problem(N, H, V_ROWS, dtype=dtype, seed=list(CASES).index(name), **kwargs)
    return x, w, y, kwargs["vocab_size"], temperature


def _upstream(n: int, dtype=F64):
    gen = torch.Generator().manual_seed(7)
    return torch.randn(n, generator=gen, dtype=dtype), torch.randn(n, generator=gen, dtype=dtype)


def _run(fn, x, w, y, g_lp, g_ent, **kwargs):
    """(logprobs, entropy, dX, dW) for loss = sum(g_lp * logprobs) + sum(g_ent * entropy); None upstream = unused."""
    x = x.detach().clone().requires_grad_(True)
    w = w.detach().clone().requires_grad_(True)
    lp, ent = fn(x, w, y, **kwargs)
    loss = 0.0
    if g_lp is not None:
        loss = loss + (lp * g_lp).sum()
    if g_ent is not None:
        loss = loss + (ent * g_ent).sum()
    loss.backward()
    return lp.detach(), ent.detach(), x.grad, w.grad


@pytest.mark.parametrize("workspace_mb", WORKSPACES_MB)
@pytest.mark.parametrize("case", list(CASES))
def test_chunked_matches_reference_forward_and_gradients_float64(case, workspace_mb):
    x, w, y, vocab_size, temperature = _case(case)
    g_lp, g_ent = _upstream(N)
    common = dict(temperature=temperature, vocab_size=vocab_size)
    got = _run(chunked_logprob_entropy, x, w, y, g_lp, g_ent, workspace_mb=workspace_mb, **common)
    want = _run(reference_logprob_entropy, x, w, y, g_lp, g_ent, **common)
    for name, a, b in zip(("logprobs", "entropy", "dX", "dW"), got, want):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-10, msg=lambda m, n=name: f"{n}: {m}")
    assert torch.count_nonzero(got[3][vocab_size:]) == 0  # padded rows of W get no gradient


@pytest.mark.parametrize(("use_logprobs", "use_entropy"), [(True, True), (True, False), (False, True)])
@pytest.mark.parametrize("workspace_mb", WORKSPACES_MB)
def test_chunked_softcap_matches_reference_float64(workspace_mb, use_logprobs, use_entropy):
    """Final-logit soft-capping (cap 20 on logits up to 50, temperature 0.7) over every tile shape, with either
    gradient alone: the backward's 1 - tanh^2 factor and the forward's cap agree with autograd on the reference."""
    x, w, y, vocab_size, temperature = _case("peaked_abs50_padded_t0.7")
    g_lp, g_ent = _upstream(N)
    g_lp, g_ent = (g_lp if use_logprobs else None), (g_ent if use_entropy else None)
    common = dict(temperature=temperature, vocab_size=vocab_size, softcap=20.0)
    got = _run(chunked_logprob_entropy, x, w, y, g_lp, g_ent, workspace_mb=workspace_mb, **common)
    want = _run(reference_logprob_entropy, x, w, y, g_lp, g_ent, **common)
    for name, a, b in zip(("logprobs", "entropy", "dX", "dW"), got, want):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-10, msg=lambda m, n=name: f"{n}: {m}")


@pytest.mark.parametrize(("use_logprobs", "use_entropy"), [(True, False), (False, True)])
def test_chunked_gradient_when_only_one_output_is_used(use_logprobs, use_entropy):
    x, w, y, vocab_size, temperature = _case("moderate_padded_t1.6")
    g_lp, g_ent = _upstream(N)
    g_lp, g_ent = (g_lp if use_logprobs else None), (g_ent if use_entropy else None)
    common = dict(temperature=temperature, vocab_size=vocab_size)
    got = _run(chunked_logprob_entropy, x, w, y, g_lp, g_ent, workspace_mb=WORKSPACES_MB[2], **common)
    want = _run(reference_logprob_entropy, x, w, y, g_lp, g_ent, **common)
    torch.testing.assert_close(got[2], want[2], rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(got[3], want[3], rtol=1e-10, atol=1e-10)


def test_chunked_frozen_weight_gets_only_hidden_gradient():
    x, w, y, vocab_size, _ = _case("flat_t1")
    x = x.clone().requires_grad_(True)
    lp, ent = chunked_logprob_entropy(x, w, y, vocab_size=vocab_size, workspace_mb=WORKSPACES_MB[0])
    (lp.sum() + ent.sum()).backward()
    x_ref = x.detach().clone().requires_grad_(True)
    lp_ref, ent_ref = reference_logprob_entropy(x_ref, w, y, vocab_size=vocab_size)
    (lp_ref.sum() + ent_ref.sum()).backward()
    assert w.grad is None
    torch.testing.assert_close(x.grad, x_ref.grad, rtol=1e-10, atol=1e-10)


def test_chunked_two_passes_are_bitwise_equal_forward_and_backward():
    x, w, y, vocab_size, temperature = _case("peaked_abs50_padded_t0.7", dtype=torch.float32)
    g_lp, g_ent = _upstream(N, torch.float32)
    kwargs = dict(temperature=temperature, vocab_size=vocab_size, workspace_mb=WORKSPACES_MB[2])
    first = _run(chunked_logprob_entropy, x, w, y, g_lp, g_ent, **kwargs)
    second = _run(chunked_logprob_entropy, x, w, y, g_lp, g_ent, **kwargs)
    for a, b in zip(first, second):
        assert torch.equal(a, b)


def test_chunked_no_grad_mode_returns_the_same_values_and_keeps_no_graph():
    x, w, y, vocab_size, temperature = _case("moderate_padded_t1.6", dtype=torch.float32)
    x.requires_grad_(True)
    lp, ent = chunked_logprob_entropy(x, w, y, temperature=temperature, vocab_size=vocab_size,
                                      workspace_mb=WORKSPACES_MB[0])
    with torch.no_grad():
        lp_ng, ent_ng = chunked_logprob_entropy(x, w, y, temperature=temperature, vocab_size=vocab_size,
                                      workspace_mb=WORKSPACES_MB[0])
    assert lp.grad_fn is not None and lp_ng.grad_fn is None and ent_ng.grad_fn is None
    assert torch.equal(lp.detach(), lp_ng) and torch.equal(ent.detach(), ent_ng)
    assert lp_ng.dtype == torch.float32


def test_chunked_float32_is_close_to_float64_reference_at_logits_up_to_50():
    x, w, y, vocab_size, temperature = _case("peaked_abs50_padded_t0.7")
    g_lp, g_ent = _upstream(N)
    got = _run(chunked_logprob_entropy, x.float(), w.float(), y, g_lp.float(), g_ent.float(),
               temperature=temperature, vocab_size=vocab_size, workspace_mb=WORKSPACES_MB[0])
    want = _run(reference_logprob_entropy, x, w, y, g_lp, g_ent, temperature=temperature, vocab_size=vocab_size)
    # fp32 logits of magnitude 70 (50 / 0.7) carry ~70 * 2^-24 * sqrt(H) ~ 3e-5 of rounding.
    for a, b in zip(got, want):
        torch.testing.assert_close(a.double(), b, rtol=1e-4, atol=2e-4)


def test_chunked_bfloat16_inputs_match_reference_on_the_same_rounded_inputs():
    x, w, y, vocab_size, temperature = _case("moderate_padded_t1.6")
    xb, wb = x.bfloat16(), w.bfloat16()
    lp, ent = chunked_logprob_entropy(xb, wb, y, temperature=temperature, vocab_size=vocab_size,
                                      workspace_mb=WORKSPACES_MB[0])
    lp_ref, ent_ref = reference_logprob_entropy(xb.double(), wb.double(), y, temperature=temperature,
                                                vocab_size=vocab_size)
    assert lp.dtype == torch.float32
    # bf16 products accumulate in fp32: only fp32 rounding separates the two.
    torch.testing.assert_close(lp.double(), lp_ref, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(ent.double(), ent_ref, rtol=1e-5, atol=1e-5)


class _LargestTensor(TorchDispatchMode):
    """Records the largest tensor any torch op returns while active."""

    def __init__(self):
        super().__init__()
        self.largest = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor):
                self.largest = max(self.largest, t.numel())
        return out


@pytest.mark.parametrize("softcap", [None, 30.0])
def test_chunked_never_creates_a_tokens_by_vocab_tensor_forward_or_backward(softcap):
    x, w, y = build_lm_head_problem(N, 8, V_ROWS, dtype=torch.float32, seed=11)  # H = 8: W (300 x 8) is small
    x.requires_grad_(True)
    w.requires_grad_(True)
    workspace_mb = 4 * MIN_TILE_COLS * 12 / 2**20  # float32 tiles of 4 x 128
    with _LargestTensor() as mode:
        lp, ent = chunked_logprob_entropy(x, w, y, workspace_mb=workspace_mb, softcap=softcap)
        (lp.sum() + ent.sum()).backward()
    assert mode.largest <= V_ROWS * 8  # dW (V, H) is the largest; a tile is 512, the logits would be 19,200


@pytest.mark.parametrize(("rows", "cols", "workspace", "per_elt"),
                         [(64, 300, 10**9, 12), (16384, 151936, 128 * 2**20, 2), (16384, 151936, 2**20, 12),
                          (5, 50, 1, 4)])
def test_tile_plan_stays_within_the_workspace(rows, cols, workspace, per_elt):
    plan = plan_tiles(rows, cols, workspace, per_elt)
    assert 1 <= plan.rows <= rows and 1 <= plan.cols <= cols
    assert plan.rows * plan.cols * per_elt <= max(workspace, MIN_TILE_COLS * per_elt)
    if rows * cols * per_elt <= workspace:
        assert (plan.rows, plan.cols) == (rows, cols)


def test_chunked_ids_outside_the_real_vocab_give_nan_not_a_wrong_value():
    x, w, y, vocab_size, _ = _case("peaked_abs50_padded_t0.7")
    y = y.clone()
    y[:2] = torch.tensor([vocab_size, -1])  # a padding row id and a negative id
    lp, ent = chunked_logprob_entropy(x, w, y, vocab_size=vocab_size, workspace_mb=WORKSPACES_MB[0])
    assert lp[:2].isnan().all() and not lp[2:].isnan().any() and not ent.isnan().any()
