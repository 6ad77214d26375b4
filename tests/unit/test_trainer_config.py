"""The trainer's loss hyperparameters come from the `grpo` section by TRL field name, none forgotten; its user hooks
(GFPO filter, curriculum) are the objects given in memory, else the config's import paths."""

import pytest

from engine.config import KernelsConfig, load_config
from engine.grpo.policy_loss import PolicyLossConfig
from engine.train.run import resolve_hooks
from engine.validation import validate


def test_loss_config_takes_every_field_from_grpo_section():
    cfg = load_config(None, ["grpo.loss_type=cispo", "grpo.epsilon_high=5.0", "grpo.beta=0.04", "grpo.delta=1.5",
                             "grpo.use_bias_correction_kl=false", "grpo.top_entropy_quantile=0.2",
                             "generation.max_completion_length=77"])
    loss = PolicyLossConfig.from_sections(cfg.grpo, cfg.generation)
    assert (loss.loss_type, loss.epsilon_high, loss.beta, loss.delta) == ("cispo", 5.0, 0.04, 1.5)
    assert loss.use_bias_correction_kl is False and loss.top_entropy_quantile == 0.2
    assert loss.max_completion_length == 77
    defaults = load_config(None)  # the loss has no defaults of its own: the config's are the ones it runs with
    assert PolicyLossConfig.from_sections(defaults.grpo, defaults.generation).use_bias_correction_kl is True


def test_the_config_types_its_fields_with_the_maths_own_choices():
    import typing

    from engine.config import GRPOConfigSection, RewardConfig
    from engine.grpo import settings

    grpo, reward = typing.get_type_hints(GRPOConfigSection), typing.get_type_hints(RewardConfig)
    assert (grpo["loss_type"], grpo["scale_rewards"], grpo["kl_estimator"]) == (
        settings.LossType, settings.ScaleRewards, settings.KLEstimator)
    assert (grpo["importance_sampling_level"], grpo["vllm_importance_sampling_mode"]) == (
        settings.ImportanceSamplingLevel, settings.ISMode)
    assert reward["multi_objective_aggregation"] == settings.MultiObjectiveAggregation
    assert typing.get_type_hints(KernelsConfig)["loss_terms_implementation"] == settings.TermsImplementation


def test_the_kernels_section_offers_exactly_the_kernels_implementations():
    import typing

    from kernels import IMPLEMENTATIONS  # kernels/ imports torch: engine/config.py cannot import its Literal

    assert typing.get_args(typing.get_type_hints(KernelsConfig)["loss_implementation"]) == IMPLEMENTATIONS


def harder_first(prompts, completions, rewards, metas):
    return prompts


class GroupFilter:
    def __call__(self, group_completions, group_rewards, **kwargs):
        return group_rewards


def test_hook_objects_win_and_a_recorded_description_is_never_imported():
    group_filter = GroupFilter()
    cfg, got_filter, got_hook = resolve_hooks(load_config(None, ["grpo.num_remains_in_group=2"]), group_filter,
                                              harder_first)
    assert got_filter is group_filter and got_hook is harder_first
    assert cfg.grpo.group_filter_func == f"{__name__}:GroupFilter()"  # recorded, so num_remains_in_group validates
    assert cfg.data.dynamic_prompts_fn == f"{__name__}:harder_first"
    validate(cfg, world_size=1)
    # a resumed TRL-API run: the config names the objects by description only, and the objects are given again
    recorded = load_config(None, ["grpo.group_filter_func=__main__:GroupFilter()",
                                  "data.dynamic_prompts_fn=__main__:main.<locals>.curriculum_fn"])
    cfg, got_filter, got_hook = resolve_hooks(recorded, group_filter, harder_first)
    assert (got_filter, got_hook) == (group_filter, harder_first) and cfg == recorded


def test_hooks_named_in_the_config_are_imported():
    cfg = load_config(None, [f"data.dynamic_prompts_fn={__name__}:harder_first"])
    assert resolve_hooks(cfg) == (cfg, None, harder_first)
    assert resolve_hooks(load_config(None, [])) == (load_config(None, []), None, None)


def test_a_description_without_its_object_says_to_pass_the_object_again():
    cfg = load_config(None, ["grpo.group_filter_func=__main__:GroupFilter()"])
    with pytest.raises(ValueError, match=r"grpo.group_filter_func '__main__:GroupFilter\(\)'.*pass the object again"):
        resolve_hooks(cfg)
    with pytest.raises(TypeError, match="dynamic_prompts_fn must be a callable, got str"):
        resolve_hooks(load_config(None, []), dynamic_prompts_fn="not:called")
