"""An option that would do nothing in its combination is refused when the config loads, with one
line naming its key and the key that makes it inert; the same option where it acts still loads."""

import pytest

from sat_jax.config import TrainConfig
from sat_jax.experiment import ConfigError, load_config
from sat_jax.tasks.config import TaskConfig

SOFT = ["train.overlong=soft", "train.overlong_cache=4", "rollout.max_new_tokens=8"]


@pytest.mark.parametrize(
    "overrides, keys",
    [
        (
            ["train.advantage_estimator=dr_grpo", "train.normalize_std=true"],
            ("normalize_std", "advantage_estimator 'dr_grpo'"),
        ),
        (
            ["train.advantage_estimator=dr_grpo", "train.normalize_std=false"],
            ("normalize_std", "advantage_estimator 'dr_grpo'"),
        ),
        (["train.filter_max_rounds=2"], ("filter_max_rounds", "filter_groups 'none'")),
        (
            ["train.filter_groups=none", "train.filter_max_rounds=4"],
            ("filter_max_rounds", "filter_groups 'none'"),
        ),
        (["train.overlong_cache=4"], ("overlong_cache", "overlong 'none'")),
        (["train.overlong_penalty=0.5"], ("overlong_penalty", "overlong 'none'")),
        (
            ["train.overlong=mask", "train.overlong_cache=4", "train.overlong_penalty=1.0"],
            ("overlong_cache and overlong_penalty", "overlong 'mask'"),
        ),
        (["train.row_tokens=64"], ("row_tokens", "without packing")),
        (["task.turn_discount=0.5"], ("turn_discount", "env 'single_turn'")),
        (
            ["task.env=calculator", "task.chat_template=true", "task.turn_discount=0.9"],
            ("turn_discount", "env 'calculator'"),
        ),
    ],
)
def test_an_inert_option_is_refused_in_one_line_naming_the_keys(overrides, keys):
    with pytest.raises(ConfigError) as info:
        load_config(None, overrides)
    message = str(info.value)
    assert "\n" not in message and "inert" in message
    for key in keys:
        assert key in message, message


@pytest.mark.parametrize(
    "overrides",
    [
        ["train.normalize_std=false"],
        ["train.normalize_std=true", "train.advantage_estimator=grpo"],
        ["train.advantage_estimator=dr_grpo"],
        ["train.filter_groups=all_equal", "train.filter_max_rounds=2"],
        [*SOFT, "train.overlong_penalty=0.5"],
        SOFT,
        ["train.overlong=mask"],
        ["train.packing=true", "train.row_tokens=64"],
        [],
    ],
)
def test_the_same_options_where_they_act_load(overrides):
    load_config(None, overrides)


def test_unset_options_mean_their_defaults_where_they_act():
    t = load_config(None).train
    assert t.divides_std and t.filter_rounds == 4 and t.soft_penalty == 1.0
    assert not load_config(None, ["train.advantage_estimator=dr_grpo"]).train.divides_std
    assert not load_config(None, ["train.normalize_std=false"]).train.divides_std
    t = load_config(None, ["train.filter_groups=all_equal", "train.filter_max_rounds=2", *SOFT,
                           "train.overlong_penalty=0.5"]).train  # fmt: skip
    assert (t.filter_rounds, t.soft_penalty) == (2, 0.5)


def test_turn_discount_acts_with_feedback():
    feedback = TaskConfig(env="feedback", chat_template=True, turn_discount=0.5)
    assert feedback.env_config.turn_discount == 0.5
    assert TaskConfig().env_config.turn_discount == 1.0


def test_direct_construction_refuses_the_same_combinations():
    with pytest.raises(ValueError, match="normalize_std is inert"):
        TrainConfig(advantage_estimator="dr_grpo", normalize_std=True)
    with pytest.raises(ValueError, match="turn_discount is inert"):
        TaskConfig(turn_discount=0.5)
