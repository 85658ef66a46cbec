"""sat_jax.tasks.envs: the environment interface, the episode driver, `task.env` and `feedback`."""

import dataclasses
import math
import pathlib
import re
import sys
import textwrap

import pytest

from sat_jax.experiment import ConfigError, load_config
from sat_jax.tasks import Prompt, TaskConfig
from sat_jax.tasks.envs import (
    RETRY_MESSAGE,
    SHIPPED,
    Calculator,
    EnvError,
    Environment,
    Episode,
    Feedback,
    SingleTurn,
    Step,
    load_environment,
)

PROMPT = Prompt(id="p0", text="12+7=", answer="19")
README = pathlib.Path(__file__).resolve().parents[3] / "README.md"


def env_config(**overrides):
    return dataclasses.replace(TaskConfig(chat_template=True), **overrides).env_config


class Countdown(Environment):
    """Never done by itself; says which turn it is. Loaded by name in the registry tests."""

    def step(self, text):
        return Step(observations=[{"role": "user", "content": f"turn {self.turn}"}], reward=0.5)


class DuckTyped:
    """The interface without the base class."""

    tools = ({"type": "function", "function": {"name": "noop"}},)

    def __init__(self, cfg):
        self.cfg = cfg

    def reset(self, prompt):
        return [{"role": "user", "content": prompt.text}]

    def step(self, text):
        return Step(reward=1.0, done=True)


class NoStep:
    def __init__(self, cfg):
        pass

    def reset(self, prompt):
        return []


class InheritsStep(Environment):
    pass


class TwoArguments(Environment):
    def __init__(self, cfg, extra):
        super().__init__(cfg)

    def step(self, text):
        return Step(done=True)


class BadTools(Countdown):
    tools = "calculator"


def returning(step_value=None, *, reset_value=None):
    """An environment class whose reset/step return the given values."""

    class Scripted(Environment):
        def reset(self, prompt):
            return super().reset(prompt) if reset_value is None else reset_value

        def step(self, text):
            return step_value

    return Scripted


# --- the interface and the episode driver --------------------------------------------------------


def test_single_turn_is_todays_task():
    cfg = env_config(system_prompt="Be brief.")
    episode = Episode(SingleTurn, PROMPT, cfg)
    assert episode.messages == [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "12+7="},
    ]
    assert episode.tools == []
    step = episode.step(" 19 ")
    assert step == Step(observations=[], reward=1.0, done=True)
    assert episode.done and episode.reward == 1.0 and episode.turns == 1
    assert Episode(SingleTurn, PROMPT, env_config()).step("18").reward == 0.0


def test_episode_ends_at_max_turns_and_sums_rewards():
    episode = Episode(Countdown, PROMPT, env_config(max_turns=3))
    steps = [episode.step(f"answer {i}") for i in range(3)]
    assert [s.done for s in steps] == [False, False, True]
    assert [list(s.observations) for s in steps[:2]] == [
        [{"role": "user", "content": "turn 1"}],
        [{"role": "user", "content": "turn 2"}],
    ]
    assert steps[2].observations == []  # the environment's observations of a final step are dropped
    assert episode.reward == 1.5 and episode.turns == 3
    assert [m["role"] for m in episode.messages] == [
        "user", "assistant", "user", "assistant", "user", "assistant"
    ]  # fmt: skip
    with pytest.raises(EnvError, match="done"):
        episode.step("more")


def test_the_caller_can_end_an_episode_early():
    episode = Episode(Countdown, PROMPT, env_config(max_turns=10))
    assert not episode.step("a").done
    step = episode.step("b", last=True)
    assert step.done and step.observations == [] and episode.reward == 1.0


def test_episode_exposes_the_token_budget_and_tools():
    episode = Episode(Calculator, PROMPT, env_config(max_episode_tokens=512))
    assert episode.max_episode_tokens == 512
    assert [t["function"]["name"] for t in episode.tools] == ["calculator"]


def test_a_duck_typed_class_works():
    assert load_environment("tests.sat_jax.tasks.test_envs:DuckTyped") is DuckTyped
    episode = Episode(DuckTyped, PROMPT, env_config())
    assert episode.tools == [{"type": "function", "function": {"name": "noop"}}]
    assert episode.step("x").reward == 1.0 and episode.done


@pytest.mark.parametrize(
    "step_value, message",
    [
        (None, "must return a Step, got NoneType"),
        ((["obs"], 1.0, True), "must return a Step, got tuple"),
        (Step(reward="1"), "reward must be a number"),
        (Step(reward=True), "reward must be a number"),
        (Step(reward=math.nan), "reward must be finite"),
        (Step(observations="Try again"), "expected a list of messages, got str"),
        (Step(observations={"role": "user"}), "expected a list of messages, got dict"),
        (Step(observations=["Try again"]), "message 0 is not a mapping"),
        (Step(observations=[{"content": "x"}]), "message 0 needs a 'role' string"),
        (Step(observations=[{"role": "user", "content": 3}]), "needs a 'content' string"),
    ],
)
def test_an_invalid_step_is_an_env_error(step_value, message):
    episode = Episode(returning(step_value), PROMPT, env_config())
    with pytest.raises(EnvError, match=f"Scripted.step.*{message}"):
        episode.step("x")


@pytest.mark.parametrize(
    "reset_value, message", [([], "returned no messages"), ("hi", "expected a list of messages")]
)
def test_an_invalid_reset_is_an_env_error(reset_value, message):
    with pytest.raises(EnvError, match=message):
        Episode(returning(reset_value=reset_value), PROMPT, env_config())


def test_exceptions_of_the_environment_are_env_errors():
    class Raises(Environment):
        def step(self, text):
            raise KeyError("boom")

    with pytest.raises(EnvError, match="Raises.step raised KeyError: 'boom'"):
        Episode(Raises, PROMPT, env_config()).step("x")
    with pytest.raises(EnvError, match="TwoArguments.*raised TypeError"):
        Episode(TwoArguments, PROMPT, env_config())


# --- task.env and TaskConfig -----------------------------------------------------------------------


def test_shipped_names_and_the_default():
    assert load_environment("") is SingleTurn
    assert {name: load_environment(name) for name in SHIPPED} == {
        "single_turn": SingleTurn,
        "feedback": Feedback,
        "calculator": Calculator,
    }
    assert load_environment("tests.sat_jax.tasks.test_envs:Countdown") is Countdown


@pytest.mark.parametrize(
    "spec, message",
    [
        ("calculater", "neither a shipped environment .* nor a user class written module:Class"),
        ("mod:", "neither a shipped environment"),
        ("a:b:c", "neither a shipped environment"),
        ("no_such_module_xyz:Env", "no module named 'no_such_module_xyz'"),
        ("tests.sat_jax.tasks.no_such:Env", "no module named 'tests.sat_jax.tasks.no_such'"),
        ("tests.sat_jax.tasks.test_envs:Missing", "has no attribute 'Missing'"),
        ("tests.sat_jax.tasks.test_envs:PROMPT", "is a Prompt, not a class"),
        (
            "tests.sat_jax.tasks.test_envs:NoStep",
            r"NoStep does not implement the environment interface \(no step;",
        ),
        ("tests.sat_jax.tasks.test_envs:InheritsStep", "InheritsStep does not override step"),
        ("tests.sat_jax.tasks.test_envs:TwoArguments", r"TwoArguments\(cfg\) must take"),
        ("tests.sat_jax.tasks.test_envs:BadTools", "BadTools.tools must be a list"),
    ],
)
def test_a_bad_env_name_says_what_is_wrong(spec, message):
    with pytest.raises(ValueError, match=f"^env {re.escape(repr(spec))}.*{message}"):
        load_environment(spec)


def test_a_user_module_that_fails_to_import(tmp_path, monkeypatch):
    (tmp_path / "env_broken_dep.py").write_text("import no_such_dependency_xyz\n")
    (tmp_path / "env_raises.py").write_text("raise RuntimeError('bad module')\n")
    (tmp_path / "env_good.py").write_text(
        textwrap.dedent(
            """
            from sat_jax.tasks.envs import Environment, Step

            class Echo(Environment):
                def step(self, text):
                    return Step(reward=float(text == self.prompt.answer), done=True)
            """
        )
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    for name in ("env_broken_dep", "env_raises", "env_good"):
        monkeypatch.delitem(sys.modules, name, raising=False)
    with pytest.raises(ValueError, match="importing 'env_broken_dep' failed: No module named"):
        load_environment("env_broken_dep:Env")
    with pytest.raises(ValueError, match="importing 'env_raises' failed: RuntimeError: bad"):
        load_environment("env_raises:Env")
    good = TaskConfig(env="env_good:Echo", chat_template=True)
    assert Episode(load_environment(good.env), PROMPT, good.env_config).step("19").reward == 1.0


@pytest.mark.parametrize(
    "override, message",
    [
        ("task.env=calculater", r"^task: env 'calculater' is neither"),
        ("task.env=no_such_module_xyz:Env", r"^task: env .*no module named"),
        ("task.env=feedback", r"^task: env 'feedback' needs chat_template: true"),
        ("task.max_turns=0", r"^task: max_turns must be >= 1"),
        ("task.max_episode_tokens=-1", r"^task: max_episode_tokens must be >= 0"),
        ("task.turn_discount=0", r"^task: turn_discount must be in \(0, 1\]"),
        ("task.turn_discount=1.5", r"^task: turn_discount must be in \(0, 1\]"),
    ],
)
def test_task_keys_are_checked_when_the_config_loads(override, message):
    with pytest.raises(ConfigError, match=message):
        load_config(None, [override])


def test_task_config_builds_the_env_part():
    cfg = TaskConfig(
        env="feedback",
        chat_template=True,
        reward="gsm8k",
        system_prompt="Think.",
        max_turns=3,
        max_episode_tokens=2048,
        turn_discount=0.5,
    )
    part = cfg.env_config
    assert (part.reward, part.system_prompt, part.max_turns) == ("gsm8k", "Think.", 3)
    assert (part.max_episode_tokens, part.turn_discount) == (2048, 0.5)
    assert TaskConfig().env == "" and load_environment(TaskConfig().env) is SingleTurn


# --- feedback --------------------------------------------------------------------------------------


def run(env_cls, cfg, answers):
    episode = Episode(env_cls, PROMPT, cfg)
    steps = []
    for text in answers:
        steps.append(episode.step(text))
        if steps[-1].done:
            break
    return episode, steps


def test_feedback_right_the_first_time():
    episode, steps = run(Feedback, env_config(max_turns=3), ["19"])
    assert steps == [Step(observations=[], reward=1.0, done=True)]
    assert episode.turns == 1


def test_feedback_asks_again_until_right_and_discounts():
    episode, steps = run(
        Feedback, env_config(env="feedback", max_turns=4, turn_discount=0.5), ["1", "2", "19"]
    )
    retry = [{"role": "user", "content": RETRY_MESSAGE}]
    assert [(list(s.observations), s.reward, s.done) for s in steps] == [
        (retry, 0.0, False),
        (retry, 0.0, False),
        ([], 0.25, True),
    ]
    assert episode.reward == 0.25
    assert episode.messages[1:] == [
        {"role": "assistant", "content": "1"},
        *retry,
        {"role": "assistant", "content": "2"},
        *retry,
        {"role": "assistant", "content": "19"},
    ]


def test_feedback_stops_at_max_turns():
    episode, steps = run(Feedback, env_config(max_turns=2), ["1", "2", "19"])
    assert len(steps) == 2 and steps[-1] == Step(observations=[], reward=0.0, done=True)
    assert episode.done and episode.reward == 0.0
    _, steps = run(Feedback, env_config(max_turns=2), ["1", "19"])
    assert steps[-1].reward == 1.0


# --- the README's example --------------------------------------------------------------------------


def test_the_readme_environment_runs_as_written():
    blocks = re.findall(
        r"^```python[ \t]*\n(.*?)^```[ \t]*$", README.read_text(), flags=re.M | re.S
    )
    [block] = [b for b in blocks if "(Environment):" in b]
    namespace = {}
    exec(compile(block, f"{README}:environment block", "exec"), namespace)
    guess = namespace["Guess"]
    assert issubclass(guess, Environment)
    episode = Episode(guess, Prompt(id="g", text="", answer="42"), env_config(max_turns=5))
    assert episode.messages == [{"role": "user", "content": "Guess my number between 1 and 100."}]
    hints = [list(episode.step(text).observations) for text in ("50", "I think 20", "hmm")]
    assert [h[0]["content"] for h in hints] == ["lower", "higher", "Answer with a number."]
    step = episode.step("It is 42")
    assert step.done and step.reward == pytest.approx(0.9**3) and episode.turns == 4
