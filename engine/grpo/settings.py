"""The GRPO maths' settings: the choices it offers (Literal types) and the loss's hyperparameters, defined once.

Owns: `LossType`, `ImportanceSamplingLevel`, `KLEstimator`, `ISMode`, `ScaleRewards`, `MultiObjectiveAggregation`,
`TermsImplementation` (engine/config.py types its fields with them) and `PolicyLossConfig`, the record the loss reads. Meanings and
defaults are not here: every `PolicyLossConfig` field is the `grpo` config field of the same (TRL) name, documented
and defaulted once in engine/config.py (`max_completion_length`: the `generation` field). Build one with
`PolicyLossConfig.from_sections(cfg.grpo, cfg.generation)`.

Must not: import torch or anything of the engine's (engine/config.py imports this module, and loads without torch).

Test: `pytest tests/unit/test_trainer_config.py tests/unit/test_policy_loss.py -k config`.
"""

from __future__ import annotations

import dataclasses
import typing
from dataclasses import dataclass
from typing import Any, Literal

LossType = Literal["grpo", "bnpo", "dr_grpo", "dapo", "cispo", "sapo", "luspo", "vespo"]
ImportanceSamplingLevel = Literal["token", "sequence"]
KLEstimator = Literal["k1", "k2", "k3"]
ISMode = Literal["token_truncate", "token_mask", "sequence_truncate", "sequence_mask"]
ScaleRewards = Literal["group", "batch", "none"]
MultiObjectiveAggregation = Literal["sum_then_normalize", "normalize_then_sum"]
TermsImplementation = Literal["auto", "torch", "triton"]

LOSS_TYPES = typing.get_args(LossType)
IMPORTANCE_SAMPLING_LEVELS = typing.get_args(ImportanceSamplingLevel)
KL_ESTIMATORS = typing.get_args(KLEstimator)
IS_MODES = typing.get_args(ISMode)
SCALE_REWARDS = typing.get_args(ScaleRewards)
MULTI_OBJECTIVE_AGGREGATIONS = typing.get_args(MultiObjectiveAggregation)
TERMS_IMPLEMENTATIONS = typing.get_args(TermsImplementation)


@dataclass(frozen=True, kw_only=True)
class PolicyLossConfig:
    """The loss's hyperparameters: each field is the `grpo` config field of the same name (engine/config.py), except
    `max_completion_length` (`generation`; Dr. GRPO's constant L). No defaults: `from_sections` builds it."""

    loss_type: LossType
    importance_sampling_level: ImportanceSamplingLevel
    epsilon: float
    epsilon_high: float | None
    delta: float | None
    beta: float
    kl_estimator: KLEstimator
    use_bias_correction_kl: bool
    sapo_temperature_pos: float
    sapo_temperature_neg: float
    vespo_k_pos: float
    vespo_lambda_pos: float
    vespo_k_neg: float
    vespo_lambda_neg: float
    top_entropy_quantile: float
    entropy_coef: float
    use_adaptive_entropy: bool
    off_policy_mask_threshold: float | None
    max_completion_length: int

    def __post_init__(self) -> None:
        for name, allowed in (("loss_type", LOSS_TYPES), ("importance_sampling_level", IMPORTANCE_SAMPLING_LEVELS),
                              ("kl_estimator", KL_ESTIMATORS)):
            if getattr(self, name) not in allowed:
                raise ValueError(f"{name} must be one of {allowed}, got {getattr(self, name)!r}")
        if not 0.0 <= self.top_entropy_quantile <= 1.0:
            raise ValueError(f"top_entropy_quantile must be in [0, 1], got {self.top_entropy_quantile}")

    @classmethod
    def from_sections(cls, grpo: Any, generation: Any) -> PolicyLossConfig:
        """The loss settings of a run.

        Args:
            grpo: the `grpo` config section (engine/config.py `GRPOConfigSection`): every field but one comes from it.
            generation: the `generation` section: `max_completion_length`.
        """
        names = [f.name for f in dataclasses.fields(cls) if f.name != "max_completion_length"]
        return cls(**{name: getattr(grpo, name) for name in names},
                   max_completion_length=generation.max_completion_length)

    @property
    def epsilon_low(self) -> float:
        return self.epsilon

    @property
    def resolved_epsilon_high(self) -> float:
        return self.epsilon if self.epsilon_high is None else self.epsilon_high

    @property
    def is_entropy_bonus_enabled(self) -> bool:
        return self.entropy_coef != 0.0 or self.use_adaptive_entropy
