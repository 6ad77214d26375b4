"""The checkpoint an FP8 engine starts from (`rollout.vllm_weight_dtype: fp8`): a block-FP8 copy of the policy's.

vLLM's `fp8` method reads FP8-serialized checkpoints only (vllm 0.32 dropped online FP8 quantization from it), so
the engine cannot start from the policy's bf16 / fp32 checkpoint with FP8 layers. `write_fp8_engine_checkpoint`
writes a copy whose FP8 weights (engine/rollout/fp8_sync.py `is_fp8_weight`) are quantized with the sync's own
quantizer (the same bytes the first sync would send) and whose config.json carries `quantization_config: {quant_method:
fp8, activation_scheme: dynamic, weight_block_size: [128, 128]}`; every other file is linked. Every sync overwrites the
weights after that.

Must not: import vLLM; write next to the user's checkpoint (the copy goes in a fresh temporary directory).

Test: tests/unit/test_fp8_sync.py (a tiny checkpoint: the copy's payload and scales are the reference quantizer's,
the rest bit-equal, the config names the block).
"""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path

from safetensors.torch import load_file, save_file

from engine.config import ConfigError, RolloutConfig
from engine.rollout.fp8_sync import FP8_BLOCK, fp8_engine_kwargs, fp8_machine_problems, quantize_bucket

QUANTIZATION_CONFIG = {"quant_method": "fp8", "activation_scheme": "dynamic", "weight_block_size": list(FP8_BLOCK)}
"""What vLLM's `Fp8Config.from_config` reads: FP8-serialized weights, activations quantized per token group at run
time, one scale per 128 x 128 weight block."""


def write_fp8_engine_checkpoint(model_dir: str | Path, out_dir: str | Path | None = None) -> Path:
    """A block-FP8 copy of the HF checkpoint in `model_dir` (safetensors files), in `out_dir` (default: a new
    temporary directory); returns its path.

    Raises:
        ValueError naming the directory when it has no safetensors files or is already quantized.
    """
    model_dir = Path(model_dir)
    files = sorted(model_dir.glob("*.safetensors"))
    config = json.loads((model_dir / "config.json").read_text())
    if not files:
        raise ValueError(f"rollout.vllm_weight_dtype=fp8: {model_dir} has no *.safetensors files to quantize")
    if config.get("quantization_config"):
        raise ValueError(f"rollout.vllm_weight_dtype=fp8: {model_dir} is already quantized "
                         f"({config['quantization_config'].get('quant_method')!r}); give the policy's own checkpoint")
    out = Path(out_dir) if out_dir is not None else Path(tempfile.mkdtemp(prefix="grpo-fp8-engine-"))
    out.mkdir(parents=True, exist_ok=True)
    index = {}
    for path in files:
        tensors = quantize_bucket(list(load_file(path).items()))
        save_file({name: t.contiguous() for name, t in tensors}, out / path.name, metadata={"format": "pt"})
        index |= {name: path.name for name, _ in tensors}
    for path in model_dir.iterdir():
        if path.suffix != ".safetensors" and path.name not in ("config.json", "model.safetensors.index.json"):
            os.symlink(path.resolve(), out / path.name)
    if (model_dir / "model.safetensors.index.json").is_file():
        (out / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": index}, indent=1))
    (out / "config.json").write_text(json.dumps(config | {"quantization_config": QUANTIZATION_CONFIG}, indent=1))
    return out


def fp8_engine_settings(model_dir: str | Path, rollout: RolloutConfig, on_gpu: bool) -> tuple[str | Path, dict]:
    """(the checkpoint the engine starts from, vLLM keywords) of `rollout.vllm_weight_dtype` and
    `rollout.vllm_kv_cache_dtype`: the block-FP8 copy and `quantization="fp8"` for fp8 weights, `kv_cache_dtype`.

    Raises:
        ConfigError naming each setting this machine's vLLM cannot run, and why (`fp8_machine_problems`), before
        anything is written or loaded.
    """
    problems = fp8_machine_problems(rollout.vllm_weight_dtype, rollout.vllm_kv_cache_dtype, on_gpu)
    if problems:
        raise ConfigError("; ".join(problems))
    if rollout.vllm_weight_dtype == "fp8":
        model_dir = write_fp8_engine_checkpoint(model_dir)
    return model_dir, fp8_engine_kwargs(rollout.vllm_weight_dtype, rollout.vllm_kv_cache_dtype)
