"""The environment interface: what answers the policy between the turns of a multi-turn episode.

An episode starts from one prompt (a dataset row: its id, text and reference answer). The
environment turns it into the first chat messages (`reset`); after each assistant turn it reads the
decoded assistant text and returns the next observation messages (a user turn, tool results, or
none), a reward and whether the episode is done (`step`). That is the whole interface, the shape
SkyRL-gym's `BaseTextEnv`, Tunix's agentic environments and verl's interactions share:

    class Guess(Environment):
        def reset(self, prompt):
            self.answer = prompt.answer
            return [{"role": "user", "content": prompt.text}]

        def step(self, text):
            right = self.reward_fn(text, self.answer)
            if right or self.turn == self.cfg.max_turns:
                return Step(reward=right, done=True)
            return Step(observations=[{"role": "user", "content": "Again."}])

One instance serves one episode (its state lives in the instance), so the rollout server makes a
new one per sample: `cls(cfg)` then `reset(prompt)`. `Episode` (episode.py) drives it and enforces
the limits (`EnvConfig.max_turns`; the server enforces `max_episode_tokens`). The episode's reward
is the sum of its steps' rewards; the shipped environments reward only the final step.

Pure Python, no server or model dependency (docs/DESIGN.md §2).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any

from sat_jax.tasks.prompt import Prompt
from sat_jax.tasks.rewards import make_reward

Message = dict[str, str]
"""A chat message as HF chat templates take it: {"role": "user" | "tool" | ..., "content": ...}."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class EnvConfig:
    """What an environment is configured with: the `task.*` keys it reads (`TaskConfig.env_config`
    builds it; like the other config parts it holds no defaults).

    Attributes:
      reward: the name of the reward of a final answer (`task.reward`; `make_reward`).
      system_prompt: a system message placed before the first user message ("" = none).
      max_turns: the most assistant turns of an episode (`task.max_turns`).
      max_episode_tokens: the most tokens after the prompt, generated and inserted together
        (`task.max_episode_tokens`; 0 = what the model's sequence length leaves). The server
        enforces it; an environment may read it.
      turn_discount: `feedback` multiplies the reward of an answer at turn k by
        `turn_discount ** (k - 1)` (`task.turn_discount`; 1.0 = no discount).
    """

    reward: str
    system_prompt: str
    max_turns: int
    max_episode_tokens: int
    turn_discount: float

    def __post_init__(self) -> None:
        if self.max_turns < 1:
            raise ValueError(f"max_turns must be >= 1, got {self.max_turns}")
        if self.max_episode_tokens < 0:
            raise ValueError(f"max_episode_tokens must be >= 0, got {self.max_episode_tokens}")
        if not 0.0 < self.turn_discount <= 1.0:
            raise ValueError(f"turn_discount must be in (0, 1], got {self.turn_discount}")


@dataclasses.dataclass(frozen=True, kw_only=True)
class Step:
    """What an environment returns after an assistant turn.

    Attributes:
      observations: the messages that follow the assistant turn (a user turn, tool results);
        empty when none. Ignored when `done`.
      reward: this step's reward; the episode's reward is the sum over its steps.
      done: the episode ends here.
    """

    observations: Sequence[Message] = ()
    reward: float = 0.0
    done: bool = False


class Environment:
    """Base class of environments: one instance per episode (see the module docstring).

    Subclasses implement `reset` and `step`; `tools` lists the tools the chat template should
    describe to the model. A user class need not subclass this one: any class constructed as
    `cls(cfg)` with `reset` and `step` of these signatures will do (`load_environment` checks).

    Attributes:
      cfg: the environment's config.
      reward_fn: the reward of a final answer, `(completion, reference) -> [0, 1]`.
      turn: the assistant turns stepped so far (`Episode` counts them; 1 inside the first `step`).
      tools: JSON schemas of the tools (the `tools=` argument of `apply_chat_template`, which
        Qwen3's template renders into the system turn); empty when the environment has none.
    """

    tools: Sequence[Mapping[str, Any]] = ()

    def __init__(self, cfg: EnvConfig):
        self.cfg = cfg
        self.reward_fn = make_reward(cfg.reward)
        self.turn = 0

    def reset(self, prompt: Prompt) -> list[Message]:
        """The messages that open the episode: by default the system prompt (if any) and the
        prompt's text as a user message.

        Args:
          prompt: the dataset row: `id`, `text` and the reference `answer`.

        Returns:
          The conversation so far, ending with the message the model answers first.
        """
        self.prompt = prompt
        system = [{"role": "system", "content": self.cfg.system_prompt}]
        return [
            *(system if self.cfg.system_prompt else []),
            {"role": "user", "content": prompt.text},
        ]

    def step(self, text: str) -> Step:
        """Reads one assistant turn and answers it.

        Args:
          text: the assistant turn as decoded text (special tokens skipped).

        Returns:
          The observations that follow, this step's reward and whether the episode is done.
        """
        raise NotImplementedError


class SingleTurn(Environment):
    """Today's single-turn task as an environment: one answer, scored by `task.reward`, done."""

    def step(self, text: str) -> Step:
        return Step(reward=self.reward_fn(text, self.prompt.answer), done=True)
