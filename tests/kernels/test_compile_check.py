"""kernels/compile_check.py: every Triton kernel compiles for sm_90 and sm_80 at the launches a GPU run makes, within
the shared-memory limit, without register spills; and the check does fail on a spilling configuration.

Runs the module in a subprocess without TRITON_INTERPRET (tests/conftest.py sets it for this process, and interpreted
kernels cannot be compiled). No GPU is needed: ptxas ships in the triton wheel. 54 LM-head and token-term
compilations, the final-logit soft-cap variants included; the one-pass row kernels add 40 small ones, the fused
one-pass GEMMs (kernels/onepass_fused.py) a few dozen more, the fused layer kernels (`LAYER_KERNELS`) about 0.5 s
each; the check compiles as many at once as there are CPUs (about 140 s of CPU
in all). The limit is generous for a machine shared with other work.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from benchmarks.gpu import lm_head
from engine.config import KernelsConfig
from kernels.compile_check import LAUNCH_POINTS, LAUNCH_WORKSPACES_MB, MAX_SPILL_BYTES, SHARED_MEMORY_LIMIT_BYTES

ROOT = Path(__file__).resolve().parents[2]
KERNELS = {"_stats_fwd_kernel", "_dz_kernel", "_grpo_token_terms_kernel", "_workspace_stats_kernel",
           "_workspace_dz_kernel", "_fused_logits_stats_kernel", "_fused_dx_kernel", "_fused_dw_kernel"}
FLOAT32_ONLY = {"_grpo_token_terms_kernel", "_workspace_stats_kernel"}
"""Kernels whose operands are float32 whatever the problem's dtype (the terms' log-probs, the one-pass workspace)."""
LAYER_KERNELS = {"_rms_norm_fwd_kernel", "_rms_norm_bwd_kernel", "_glu_fwd_kernel", "_glu_bwd_kernel", "_rope_kernel"}
"""kernels/rms_norm.py, glu.py, rope.py: element-wise and row kernels, most without shared memory."""
NO_SHARED_MEMORY = {"_grpo_token_terms_kernel", "_workspace_stats_kernel", "_workspace_dz_kernel"} | LAYER_KERNELS
"""Element-wise / row kernels: no GEMM operands staged in shared memory."""


def _run_check(*args: str) -> tuple[int, list[dict]]:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run([sys.executable, "-m", "kernels.compile_check", "--json", *args], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=900)
    rows = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    assert rows, f"no report rows; rc {proc.returncode}\n{proc.stderr[-3000:]}"
    return proc.returncode, rows


def test_launch_points_are_the_gpu_suites_sweep():
    points = {(n, h, lm_head.GPU["vocab"]) for n in map(int, lm_head.GPU["tokens"].split(","))
              for h in map(int, lm_head.GPU["hidden"].split(","))}
    assert points <= set(LAUNCH_POINTS)
    assert KernelsConfig().loss_workspace_mb in LAUNCH_WORKSPACES_MB  # the slabs an engine run launches by default


def test_every_kernel_compiles_for_sm90_and_sm80_without_spills():
    returncode, rows = _run_check("--arch", "90,80", "--dtype", "bfloat16,float32")
    failed = [(r["kernel"], r["arch"], r["dtype"], r["variant"], r["error"]) for r in rows if r["error"]]
    assert returncode == 0 and not failed, failed
    seen = {(r["kernel"], r["arch"], r["dtype"]) for r in rows}
    assert seen == {(k, a, d) for k in KERNELS | LAYER_KERNELS for a in (90, 80) for d in ("bfloat16", "float32")
                    if k not in FLOAT32_ONLY or d == "float32"}
    capped = {(r["kernel"], r["arch"], r["dtype"]) for r in rows if "HAS_SOFTCAP=True" in r["variant"]}
    assert capped == {(k, a, d) for k in KERNELS - {"_grpo_token_terms_kernel"} for a in (90, 80)
                      for d in ("bfloat16", "float32")
                      if k not in FLOAT32_ONLY or d == "float32"}  # Gemma 2's final-logit soft-cap compiled too
    for r in rows:
        assert r["spill_stores"] + r["spill_loads"] <= MAX_SPILL_BYTES and r["registers"] <= 255, r
        assert 0 < r["shared_bytes"] <= SHARED_MEMORY_LIMIT_BYTES[r["arch"]] or r["kernel"] in NO_SHARED_MEMORY, r


def test_check_fails_on_spilling_tiles():
    # float32 at 128 x 128 x 64 spills in the forward under Triton 3.9 (11 KB) and 3.6 (336 B); the bf16 forward at
    # those tiles spilled 8 B under 3.9 only, so it could not show the check failing everywhere
    returncode, rows = _run_check("--arch", "90", "--dtype", "float32", "--tiles", "128,128,64,8,3",
                                 "--kernels", "_stats_fwd_kernel")
    stats = [r for r in rows if r["kernel"] == "_stats_fwd_kernel"]
    assert returncode == 1 and stats and all("spills" in r["error"] for r in stats), stats
