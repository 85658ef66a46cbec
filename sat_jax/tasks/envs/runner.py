"""Episodes of an environment as token ids: what a decoder asks at the two points of an episode
that involve more than tokens.

`EpisodeRunner.start` makes a fresh environment instance from a dataset row and renders its opening
messages with the chat template and its tools; `after_turn` gives the environment the decoded
turn and renders its observation messages as the chat template's delta ids, or says the episode
ends. Decoding, the KV cache and the per-token records stay with the caller: the rollout server's
driver and engine (docs/DESIGN.md §6.1) and the evaluator's `sat_jax.completions.complete_episodes`
both run episodes through it, so an evaluation plays episodes exactly as training does.

An episode ends when the environment says so, at `task.max_turns`, or when the next observation
would not fit the episode's token budget (`room`: what `task.max_episode_tokens` leaves) with room
for one generated token; a turn that reached the budget itself is the last (the environment's
`step` sees `last=True`). A turn cut at `rollout.max_new_tokens`, or ended by a stop id other
than the template's end-of-turn token, is closed by the template's end-of-turn tokens, inserted
before the observation (docs/DESIGN.md §2).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from sat_jax.tasks.envs.base import EnvConfig, Environment
from sat_jax.tasks.envs.episode import Episode
from sat_jax.tasks.hf_tokenizer import HFTokenizer
from sat_jax.tasks.prompt import Prompt

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

    def after_turn(
        self, episode: Episode, ids: Sequence[int], *, finish_reason: str, room: int
    ) -> np.ndarray | None:
        """Steps the environment with the decoded turn.

        Args:
          episode: the episode `start` made.
          ids: the turn's generated ids (its stop id included when it ended on one).
          finish_reason: "stop" (a stop id ended the turn) or "length" (a limit did).
          room: completion tokens the episode has left.

        Returns:
          The ids to insert before the next turn (the template's close of a cut turn, then the
          observations' delta up to the next generation prompt), or None when the episode ends
          (done, the last turn, or observations that do not fit the `room` left).

        Raises:
          EnvError: the environment raised or returned something invalid.
          ValueError: the chat template cannot render the observations.
        """
        text = self.tokenizer.decode(ids)
        step = episode.step(text, last=room <= 1)
        if step.done:
            return None
        closed = finish_reason == "stop" and self.tokenizer.closes_turn(int(ids[-1]))
        inserted = self.tokenizer.observation_ids(
            step.observations, tools=episode.tools, close_turn=not closed
        )
        if not inserted:
            # A template that renders nothing between two assistant turns: nothing to insert,
            # and the engine continues a slot only after inserted tokens.
            log.warning("the chat template rendered no tokens after a turn; ending the episode")
            episode.done = True
            return None
        if len(inserted) + 1 > room:
            episode.done = True  # out of tokens: the episode ends with the last turn
            return None
        return np.asarray(inserted, np.int32)
