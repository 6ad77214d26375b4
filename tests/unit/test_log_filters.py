"""engine/log_filters.py: the known-harmless vLLM records and Python warnings are dropped when not verbose, anything
else from the same loggers stays, and GRPO_ENGINE_VERBOSE / logging.verbose turn the filtering off."""

import logging
import os
import warnings

import pytest

from engine import log_filters
from engine.log_filters import HARMLESS_VLLM_LOGS, VERBOSE_ENV, is_verbose, quiet_library_logs


@pytest.fixture
def clean_logging(monkeypatch):
    """No verbosity from the environment; the filters this test adds to vLLM's loggers are removed afterwards."""
    monkeypatch.delenv(VERBOSE_ENV, raising=False)
    monkeypatch.delenv("VLLM_LOGGING_LEVEL", raising=False)
    yield
    for entry in HARMLESS_VLLM_LOGS:
        logger = logging.getLogger(entry.logger)
        for f in [f for f in logger.filters if isinstance(f, log_filters._HarmlessLogFilter)]:
            logger.removeFilter(f)


def _passes(logger_name: str, message: str, *args, level: int = logging.WARNING) -> bool:
    logger = logging.getLogger(logger_name)
    record = logger.makeRecord(logger_name, level, __file__, 1, message, args, None)
    return bool(logger.filter(record))


def test_known_harmless_vllm_warnings_are_dropped_and_others_from_the_same_loggers_kept(clean_logging):
    layerwise = "vllm.model_executor.model_loader.reload.layerwise"
    loader = "vllm.model_executor.models.utils"
    assert _passes(layerwise, "%s: Failed to load weights", "RotaryEmbedding")  # before: nothing filtered
    assert quiet_library_logs() is False
    assert not _passes(layerwise, "%s: Failed to load weights", "RotaryEmbedding")
    assert not _passes(layerwise, "%s: Failed to load weights", "Llama3RotaryEmbedding")
    assert _passes(layerwise, "%s: Failed to load weights", "QKVParallelLinear"), "a real layer failing must show"
    assert _passes(layerwise, "%s: Failed to load weights", "RotaryEmbedding", level=logging.ERROR)
    assert not _passes(loader, "Attempted to load weight %s with dtype %s into parameter with dtype %s",
                       "lm_head.weight", "torch.float32", "torch.bfloat16")
    assert _passes(loader, "Attempted to load weight %s with dtype %s into parameter with dtype %s",
                   "lm_head.weight", "torch.bfloat16", "torch.float8_e4m3fn"), "a lossy, unexpected cast must show"
    assert not _passes("vllm.v1.worker.cpu_worker", "%s is not found in LD_PRELOAD. For best performance, ...",
                       "libtcmalloc")
    assert _passes("vllm.v1.worker.cpu_worker", "Node %s is not in available memory nodes %s.", 0, [1])
    inplace = "vllm.model_executor.model_loader.reload.inplace"
    unloaded = "Following weights were not loaded from checkpoint: %s"
    assert not _passes(inplace, unloaded, {"model.layers.0.self_attn.mla_attn.mla_attn.W_UV",
                                           "model.layers.3.self_attn.mla_attn.mla_attn.W_UK_T"})  # derived, MLA
    assert _passes(inplace, unloaded, {"model.layers.0.self_attn.mla_attn.mla_attn.W_UV",
                                       "model.layers.0.self_attn.kv_b_proj.weight"}), "a real weight not loaded shows"
    quiet_library_logs()  # a second call adds no second filter
    assert sum(isinstance(f, log_filters._HarmlessLogFilter) for f in logging.getLogger(layerwise).filters) == 1


def test_every_harmless_entry_matches_the_message_it_names(clean_logging):
    quiet_library_logs()
    examples = {
        "vllm.engine.arg_utils": "The global random seed is set to 42. Since VLLM_ENABLE_V1_MULTIPROCESSING is set to "
                                 "False, this may affect the random state of the Python process that launched vLLM.",
        "vllm.triton_utils.importing": "Triton is installed, but doesn't include CPU backend. Disabling Triton.",
        "vllm.platforms.cpu": "Reset SSM cache type to float32 for accelerated GDN mamba backend 'none'.",
        "vllm.config.vllm": "Model Runner V2 requires Triton; using the V1 model runner instead.",
    }
    for name, message in examples.items():
        assert not _passes(name, message), (name, message)
    assert len({e.reason for e in HARMLESS_VLLM_LOGS}) == len(HARMLESS_VLLM_LOGS), "one reason per warning"


def test_megatron_and_vllm_python_warnings_are_ignored_and_others_shown(clean_logging):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        quiet_library_logs()
        warnings.warn("Transformer Engine and Apex are not installed. Falling back to Torch optimizers.", UserWarning)
        warnings.warn("Apex is not installed. Falling back to Torch Norm", UserWarning)
        warnings.warn("Something Megatron really means", UserWarning)
    assert [str(w.message) for w in caught] == ["Something Megatron really means"]


def test_verbose_from_the_config_or_the_environment_filters_nothing(clean_logging, monkeypatch):
    assert not is_verbose() and is_verbose(True)
    assert quiet_library_logs(verbose=True) is True
    assert _passes("vllm.model_executor.model_loader.reload.layerwise", "RotaryEmbedding: Failed to load weights")
    assert "VLLM_LOGGING_LEVEL" not in os.environ
    monkeypatch.setenv(VERBOSE_ENV, "1")
    assert is_verbose(False) and quiet_library_logs() is True
    monkeypatch.setenv(VERBOSE_ENV, "0")
    assert quiet_library_logs() is False
    assert os.environ["VLLM_LOGGING_LEVEL"] == "WARNING"


def test_a_vllm_level_the_user_exported_is_kept(clean_logging, monkeypatch):
    monkeypatch.setenv("VLLM_LOGGING_LEVEL", "DEBUG")
    quiet_library_logs()
    assert os.environ["VLLM_LOGGING_LEVEL"] == "DEBUG"
