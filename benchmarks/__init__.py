"""Benchmarks of the GRPO engine: programs that measure and append rows to `benchmarks/results/*.csv`.

Owns: the shared measurement harness (`harness.py`: timing, peak memory, environment capture, the results CSV),
the figure script (`plot.py`) and one `bench_*.py` program per measured thing. Benchmarks are programs, not
tests: they write rows and never assert timings. Nothing in `engine/` or `kernels/` may import this package; it
may import them.

Run a benchmark from the repository root, e.g. `python -m benchmarks.bench_gemm`; redraw every figure with
`python -m benchmarks.plot`. The harness itself is tested by `tests/unit/test_bench_harness.py`.
"""
