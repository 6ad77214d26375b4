"""The GPU suite: one command that runs everything a GPU can show (benchmarks/gpu/suite.py), the scripts that carry
its wheels to the lent machine and run it there (fetch_wheels.sh, run.sh), and its parts (lm_head.py, policy_step.py,
trl_step.py, longest_fit.py, summary.py). PLAN.md is the command sequence for a session that gets a GPU.

Like the rest of `benchmarks/`: programs that write rows, never imported by `engine/` or `kernels/`. Tested on CPU by
tests/integration/test_gpu_suite.py (`python -m benchmarks.gpu.suite --cpu`).
"""
