"""One episode of an environment: the driver the rollout server runs between assistant turns.

`Episode` owns what every environment would otherwise re-implement and could get wrong: it counts
turns and ends the episode at `max_turns` whatever the environment says, lets the server end it
early (the token budget, `max_episode_tokens`, is counted in tokens, which only the server sees),
checks what the environment returns (a user's class gets a message naming the bad value rather
than a failure deep in the chat template), sums the rewards, and keeps the conversation as
messages for logs and for rendering.

    episode = Episode(load_environment(task.env), prompt, task.env_config)
    messages = episode.messages            # render with tools=episode.tools, decode a turn
    step = episode.step(text)              # append step.observations' tokens unless step.done
    ...
    episode.reward                         # when episode.done
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from sat_jax.tasks.envs.base import EnvConfig, Environment, Message, Step
from sat_jax.tasks.prompt import Prompt


class EnvError(RuntimeError):
    """An environment raised, or returned something that is not a `Step` of valid messages."""


class Episode:
    """Drives one environment instance through one episode.

    Args:
      make_env: the environment class (or any callable `cfg -> environment`); the episode makes
        its own instance.
      prompt: the dataset row the episode starts from.
      cfg: the limits (`max_turns`, `max_episode_tokens`).

    Attributes:
      messages: the conversation so far: `reset`'s messages, then each assistant turn and the
        observations that followed it.
      tools: the environment's tool schemas (`tools=` of `apply_chat_template`; may be empty).
      turns: assistant turns stepped so far.
      reward: the sum of the steps' rewards.
      done: the episode has ended.
      max_episode_tokens: the server's token budget for everything after the prompt (0 = what
        the model's sequence length leaves).

    Raises:
      EnvError: the environment's constructor or `reset` raised, or `reset` returned no valid
        messages.
    """

    def __init__(
        self, make_env: Callable[[EnvConfig], Environment], prompt: Prompt, cfg: EnvConfig
    ):
        try:
            env = make_env(cfg)
        except Exception as e:
            raise EnvError(f"{_name(make_env)}({cfg}) raised {type(e).__name__}: {e}") from e
        self.env = env
        self.max_turns = cfg.max_turns
        self.max_episode_tokens = cfg.max_episode_tokens
        self.turns = 0
        self.reward = 0.0
        self.done = False
        try:
            opening = env.reset(prompt)
        except Exception as e:
            raise EnvError(f"{_name(env)}.reset raised {type(e).__name__}: {e}") from e
        self.messages: list[Message] = _check_messages(opening, f"{_name(env)}.reset")
        if not self.messages:
            raise EnvError(f"{_name(env)}.reset returned no messages")
        self.tools: list[dict[str, Any]] = [dict(t) for t in getattr(env, "tools", ())]

    def step(self, text: str, *, last: bool = False) -> Step:
        """Gives the environment one assistant turn; returns its checked answer.

        The step is final (`done`, with no observations) when the environment says so, at
        `max_turns`, or when the caller passes `last` (no room for another turn).

        Args:
          text: the assistant turn, decoded.
          last: the caller will not continue the episode (e.g. its token budget is spent).

        Returns:
          The observations to append (empty when done), this step's reward, and `done`.

        Raises:
          EnvError: the episode is already done, or the environment raised or returned an
            invalid step.
        """
        if self.done:
            raise EnvError("step on an episode that is done")
        self.turns += 1
        self.env.turn = self.turns
        name = _name(self.env)
        try:
            result = self.env.step(text)
        except Exception as e:
            raise EnvError(f"{name}.step raised {type(e).__name__}: {e}") from e
        if not isinstance(result, Step):
            raise EnvError(f"{name}.step must return a Step, got {type(result).__name__}")
        reward = result.reward
        if isinstance(reward, bool) or not isinstance(reward, int | float):
            raise EnvError(f"{name}.step: reward must be a number, got {reward!r}")
        if not math.isfinite(reward):
            raise EnvError(f"{name}.step: reward must be finite, got {reward}")
        done = bool(result.done) or last or self.turns >= self.max_turns
        observations = [] if done else _check_messages(result.observations, f"{name}.step")
        self.messages.append({"role": "assistant", "content": text})
        self.messages.extend(observations)
        self.reward += float(reward)
        self.done = done
        return Step(observations=observations, reward=float(reward), done=done)


def _check_messages(messages: Sequence[Mapping[str, Any]], where: str) -> list[Message]:
    if isinstance(messages, str | bytes | Mapping) or not isinstance(messages, Sequence):
        raise EnvError(f"{where}: expected a list of messages, got {type(messages).__name__}")
    checked = []
    for i, message in enumerate(messages):
        if not isinstance(message, Mapping):
            raise EnvError(f"{where}: message {i} is not a mapping: {message!r:.80}")
        role, content = message.get("role"), message.get("content")
        if not isinstance(role, str) or not role:
            raise EnvError(f"{where}: message {i} needs a 'role' string, got {role!r:.80}")
        if not isinstance(content, str):
            raise EnvError(f"{where}: message {i} needs a 'content' string, got {content!r:.80}")
        checked.append({str(k): v for k, v in message.items()})
    return checked


def _name(obj: object) -> str:
    return obj.__name__ if isinstance(obj, type) else type(obj).__name__
