"""The benchmark harness's and the metric logger's CUDA paths (gpu-marked; their CPU paths are tested in tests/unit):
peak memory and timing through the caching allocator, NVML readings per GPU."""

from __future__ import annotations

import pytest
import torch

from benchmarks.harness import capture_env, peak_memory_fn, time_fn
from engine.train.metric_logger import GpuMonitor

pytestmark = pytest.mark.gpu


def test_cuda_timing_and_peak_memory_see_a_256_mib_buffer():
    num_bytes = 256 * 2**20
    timing = time_fn(
        lambda: torch.empty(num_bytes, dtype=torch.uint8, device="cuda").fill_(1), device="cuda", warmup=1, n_iters=5
    )
    assert timing.n_iters == 5 and 0 < timing.p20_ms <= timing.p50_ms <= timing.p80_ms
    memory = peak_memory_fn(lambda: torch.empty(num_bytes, dtype=torch.uint8, device="cuda"), device="cuda")
    assert num_bytes <= memory.extra_bytes < num_bytes + 2**21, memory
    assert capture_env("cuda").device == torch.cuda.get_device_name()


def test_gpu_readings_report_memory_and_utilisation_per_gpu():
    readings = GpuMonitor().read()
    assert readings["gpu/0/memory_total_gb"] > 1 and 0 <= readings["gpu/0/utilization_pct"] <= 100
