"""The trainer's loss hyperparameters come from the `grpo` section by TRL field name, none forgotten."""

from engine.config import load_config
from engine.trainer import build_loss_config


def test_loss_config_takes_every_field_from_grpo_section():
    cfg = load_config(None, ["grpo.loss_type=cispo", "grpo.epsilon_high=5.0", "grpo.beta=0.04", "grpo.delta=1.5",
                             "grpo.use_bias_correction_kl=false", "grpo.top_entropy_quantile=0.2",
                             "generation.max_completion_length=77"])
    loss = build_loss_config(cfg)
    assert (loss.loss_type, loss.epsilon_high, loss.beta, loss.delta) == ("cispo", 5.0, 0.04, 1.5)
    assert loss.use_bias_correction_kl is False and loss.top_entropy_quantile == 0.2
    assert loss.max_completion_length == 77
