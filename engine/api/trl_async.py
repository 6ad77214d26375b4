"""TRL's experimental asynchronous GRPO (`trl.experimental.async_grpo`, TRL 1.16) over this engine's server mode.

Owns: `AsyncGRPOConfig`, which takes TRL 1.16's AsyncGRPOConfig arguments (TrainingArguments' and its own) and maps
them onto `GRPOConfig`: vllm_mode='server' (a rollout server started with `grpo-engine vllm-serve`, where TRL needs
`trl vllm-serve`), `max_staleness` (generation runs at most that many policy versions ahead of training:
engine/train/rollout_pipeline.py), the sampling and clipping arguments by their names, `request_timeout` ->
vllm_request_timeout, `dtype` as the model dtype (TRL's default 'float32' leaves it to bf16 / fp16, mixed
precision over float32 master weights, as the command line does); TRL's AsyncGRPOConfig defaults where they differ
from GRPOConfig's (max_staleness 4, max_completion_length 2048, lr_scheduler_type 'constant', logging_steps 1, the
server at http://localhost:8000). Arguments with no counterpart here are accepted at TRL's default and refused by
name otherwise (`NO_COUNTERPART`). `AsyncGRPOTrainer`: GRPOTrainer with TRL's AsyncGRPOTrainer signature
(`rollout_worker` / `weight_transfer` objects refused by name: the engine's server protocol is its own).

Must not: implement rollout or training (the engine's server mode does), import trl.

Test: tests/unit/test_trl_script.py (the mapping and the refusals).
"""

from __future__ import annotations

from typing import Any

from engine.api.trl_config import GRPOConfig, _explicit

ASYNC_DEFAULTS: dict[str, Any] = {
    "vllm_mode": "server", "vllm_server_base_url": "http://localhost:8000", "max_staleness": 4,
    "max_completion_length": 2048, "lr_scheduler_type": "constant", "logging_steps": 1,
}
"""TRL 1.16 AsyncGRPOConfig's defaults that differ from GRPOConfig's, as engine fields (server mode always)."""

NO_COUNTERPART: dict[str, tuple[Any, str]] = {
    "fork_threshold_tokens": (1024, "TRL's rollout worker forks long multi-turn samples; the engine's agent loop "
                                    "advances every sample on its own"),
    "token_budget": (None, "batches are sized by per_device_train_batch_size / max_tokens_per_microbatch here"),
    "max_inflight_tasks": (-1, "the engine bounds generation by rounds ahead (max_staleness), not by tasks"),
    "queue_maxsize": (1024, "rounds generated ahead are bounded by max_staleness"),
    "weight_sync_timeout": (1800, "weight updates are requests bounded by request_timeout (vllm_request_timeout)"),
    "heartbeat_stale_after_s": (300.0, "the engine's server requests time out by request_timeout instead"),
    "weight_sync_steps": (1, "the engine syncs the weights after every optimizer step (the policy version)"),
}
"""TRL AsyncGRPOConfig arguments without a counterpart: name -> (TRL's default, why). The default is accepted (and
reads back); any other value raises NotImplementedError naming the argument."""

_RENAMED = {"request_timeout": "vllm_request_timeout"}


class AsyncGRPOConfig(GRPOConfig):
    """TRL 1.16's `AsyncGRPOConfig` over the engine's server mode with bounded staleness (module docstring). Reads
    back TRL's async arguments (`max_staleness`, `request_timeout`, `weight_sync_steps`, ...) and every
    GRPOConfig attribute."""

    def __init__(self, output_dir: str | None = None, **kwargs: Any):
        kwargs = _explicit(type(self), {"output_dir": output_dir, **kwargs})  # a parser's defaults are not choices
        output_dir = kwargs.pop("output_dir", None)
        settings = {}
        for name, (default, why) in NO_COUNTERPART.items():
            value = kwargs.pop(name, default)
            if value != default:
                raise NotImplementedError(f"AsyncGRPOConfig({name}={value!r}): no counterpart in this engine ({why}); "
                                          f"leave it at TRL's default {default!r}")
            settings[name] = value
        for trl_name, engine_name in _RENAMED.items():
            if trl_name in kwargs:
                kwargs[engine_name] = float(kwargs.pop(trl_name))
        dtype = kwargs.pop("dtype", "float32")
        if dtype not in (None, "float32", "auto"):
            kwargs["model_init_kwargs"] = {**_as_dict(kwargs.get("model_init_kwargs")), "dtype": dtype}
        settings["dtype"] = dtype
        if kwargs.get("vllm_mode", "server") != "server":
            raise ValueError(f"AsyncGRPOConfig(vllm_mode={kwargs['vllm_mode']!r}): asynchronous GRPO generates on a "
                             "rollout server (vllm_mode='server'); use GRPOConfig for colocated generation")
        kwargs = {**ASYNC_DEFAULTS, **kwargs}
        object.__setattr__(self, "_async_settings", settings)
        super().__init__(output_dir=output_dir, **kwargs)

    @property
    def request_timeout(self) -> float:
        """Seconds one request to the rollout server may take (the engine's vllm_request_timeout)."""
        return self.vllm_request_timeout

    def __getattr__(self, name: str) -> Any:
        if not name.startswith("_") and name in self.__dict__.get("_async_settings", {}):
            return self._async_settings[name]
        return super().__getattr__(name)

    def replace(self, **changes: Any) -> AsyncGRPOConfig:
        copy = super().replace(**changes)
        object.__setattr__(copy, "_async_settings", dict(self._async_settings))
        return copy


def _as_dict(value: Any) -> dict:
    import json

    return dict(json.loads(value) if isinstance(value, str) else value or {})


def _trainer_class():
    from engine.api.trl_trainer import GRPOTrainer

    class AsyncGRPOTrainer(GRPOTrainer):
        """TRL's experimental `AsyncGRPOTrainer` signature over GRPOTrainer: generation on the rollout server,
        at most `args.max_staleness` policy versions ahead of training."""

        def __init__(self, model: Any, reward_funcs: Any = None, args: AsyncGRPOConfig | None = None,
                     train_dataset: Any = None, processing_class: Any = None, callbacks: list | None = None,
                     optimizers: tuple = (None, None), peft_config: Any = None, tools: list | None = None,
                     environment_factory: Any = None, rollout_worker: Any = None, weight_transfer: Any = None):
            for name, value in (("rollout_worker", rollout_worker), ("weight_transfer", weight_transfer)):
                if value is not None:
                    raise NotImplementedError(f"AsyncGRPOTrainer({name}=...): not supported; the engine's rollout "
                                              "server (grpo-engine vllm-serve) generates and receives the weights "
                                              "through its own protocol")
            if args is None:
                args = AsyncGRPOConfig(output_dir=f"{str(model).rstrip('/').split('/')[-1]}-AsyncGRPO")
            elif not isinstance(args, AsyncGRPOConfig):
                raise TypeError(f"args must be engine.experimental.async_grpo.AsyncGRPOConfig, got "
                                f"{type(args).__module__}.{type(args).__name__}")
            super().__init__(model=model, reward_funcs=reward_funcs, args=args, train_dataset=train_dataset,
                             processing_class=processing_class, callbacks=callbacks, optimizers=optimizers,
                             peft_config=peft_config, tools=tools, environment_factory=environment_factory)

    AsyncGRPOTrainer.__qualname__ = "AsyncGRPOTrainer"
    return AsyncGRPOTrainer


def __getattr__(name: str) -> Any:
    if name == "AsyncGRPOTrainer":  # built on first use: GRPOTrainer's module imports the heavy stack
        globals()[name] = _trainer_class()
        return globals()[name]
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
