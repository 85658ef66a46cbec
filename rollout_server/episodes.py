"""Multi-turn episodes in the rollout server: the environment between turns, rendered as tokens.

`EpisodeRunner` is what the rollout loop asks at the two points of an episode that involve more
than tokens: its start (`start`: a fresh environment instance from the dataset row, its opening
messages rendered with the chat template and its tools) and the end of each assistant turn
(`after_turn`: the environment reads the decoded turn; its observation messages become the
chat template's delta ids, or the episode ends). Decoding, the KV cache and the per-token records
stay in the driver and engine (driver.py, engine.py); this module never touches them.

An episode ends when the environment says so, at `task.max_turns`, or when the next observation
would not fit the episode's token budget (`max_tokens`: `task.max_episode_tokens`, the engine's
per-slot completion capacity) with room for one generated token; a turn that reached the budget
itself is the last (the environment's `step` sees `last=True`). A turn cut at
`rollout.max_new_tokens`, or ended by a stop id other than the template's end-of-turn token, is
closed by the template's end-of-turn tokens, inserted before the observation (docs/DESIGN.md §2).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import numpy as np

from rollout_server.driver import TurnEnd
from sat_jax.tasks.arithmetic import Prompt
from sat_jax.tasks.envs import EnvConfig, Environment, Episode
from sat_jax.tasks.hf_tokenizer import HFTokenizer

log = logging.getLogger(__name__)


class EpisodeRunner:
    """Starts episodes and decides, after each turn, how they go on.

    Args:
      make_env: the environment class (`load_environment(task.env)`).
      cfg: its config (`TaskConfig.env_config`).
      tokenizer: an HF tokenizer with a chat template (renders messages and deltas).

    Raises:
      ValueError: the tokenizer cannot render chat messages.
    """

    def __init__(
        self, make_env: Callable[[EnvConfig], Environment], cfg: EnvConfig, tokenizer: Any
    ):
        if not isinstance(tokenizer, HFTokenizer) or not tokenizer.chat_template:
            raise ValueError(
                "multi-turn episodes need an HF tokenizer with task.chat_template: true"
            )
        self.make_env, self.cfg, self.tokenizer = make_env, cfg, tokenizer

    def start(self, prompt: Prompt) -> tuple[Episode, list[int]]:
        """A new episode of `prompt` and its opening ids (the messages of the environment's
        `reset`, with its tools, and the generation prompt).

        Raises:
          EnvError: the environment's constructor or `reset` failed.
          ValueError: the chat template cannot render the messages.
        """
        episode = Episode(self.make_env, prompt, self.cfg)
        return episode, self.tokenizer.encode_messages(episode.messages, tools=episode.tools)

    def after_turn(self, episode: Episode, turn: TurnEnd) -> np.ndarray | None:
        """Steps the environment with the decoded turn.

        Returns:
          The ids to insert before the next turn (the template's close of a cut turn, then the
          observations' delta up to the next generation prompt), or None when the episode ends
          (done, the last turn, or observations that do not fit the `room` left).

        Raises:
          EnvError: the environment raised or returned something invalid.
          ValueError: the chat template cannot render the observations.
        """
        text = self.tokenizer.decode(turn.ids)
        step = episode.step(text, last=turn.room <= 1)
        if step.done:
            return None
        closed = turn.finish_reason == "eos" and self.tokenizer.closes_turn(int(turn.ids[-1]))
        ids = self.tokenizer.observation_ids(
            step.observations, tools=episode.tools, close_turn=not closed
        )
        if not ids:
            # A template that renders nothing between two assistant turns: nothing to insert,
            # and the engine continues a slot only after inserted tokens.
            log.warning("the chat template rendered no tokens after a turn; ending the episode")
            episode.done = True
            return None
        if len(ids) + 1 > turn.room:
            episode.done = True  # out of tokens: the episode ends with the last turn
            return None
        return np.asarray(ids, np.int32)
