"""Evaluation through the server's decoding core (docs/DESIGN.md §4): K samples per problem,
avg@K, pass@K and greedy accuracy, scored by the task's reward. ``sat-eval`` (train/eval_checkpoint.py)
and the trainer's periodic evaluation both run ``Evaluator``.

Completions come from ``sat_jax.completions`` over ``sat_jax.decoding`` (batched over ``server.slots`` slots with a KV cache,
the server's sampleable ids and stop ids): the K samples with the rollout's temperature / top-k /
top-p, the greedy one with top-k = 1. ``avg@K`` is the mean reward of all K·N samples, ``pass@K``
the mean over problems of the best of its K rewards (the fraction solved when rewards are 0/1),
greedy accuracy the mean reward of the greedy completions. Prompts longer than
``server.max_prefill_length`` are skipped and counted.

With a multi-turn ``task.env`` every sample is an episode, played as the rollout server plays it
(``sat_jax.tasks.envs.EpisodeRunner`` and ``completions.complete_episodes``: the environment's
opening with its tools, ``rollout.max_new_tokens`` per turn, ``task.max_episode_tokens`` per
episode); its reward is the episode's, and its text the whole transcript after the prompt.

The arithmetic task's held-out problems come from their own seed stream,
``task.seed + EVAL_SEED_OFFSET``, disjoint from the server's prompts (``task.seed``) and the
supervised warm-up's.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
from flax import nnx

from sat_jax import completions, decoding
from sat_jax.experiment import ExperimentConfig, make_tokenizer
from sat_jax.model import ModelConfig
from sat_jax.tasks import (
    CharTokenizer,
    Prompt,
    Tokenizer,
    arithmetic_task,
    make_reward,
    sampleable_mask,
)
from sat_jax.tasks.config import TaskConfig
from sat_jax.tasks.envs import EnvError, Episode, EpisodeRunner, load_environment

EVAL_SEED_OFFSET = 1_000_003
# Slots of the greedy helpers below, which have no server config to take them from.
HELPER_SLOTS = 32


def held_out_problems(task: TaskConfig, n: int) -> list[Prompt]:
    """``n`` evaluation problems, disjoint in stream from the training prompts."""
    stream = arithmetic_task(task, seed_offset=EVAL_SEED_OFFSET)
    return [stream.problem(i) for i in range(n)]


@dataclasses.dataclass(frozen=True, kw_only=True)
class EvalResult:
    """What one evaluation measured.

    Attributes:
      k: samples per problem.
      problems: problems evaluated (after skipping).
      skipped: problems whose prompt did not fit ``max_prefill_length``.
      avg_at_k, pass_at_k, greedy_accuracy: see the module docstring (0 with no problems).
      rows: per problem: id, answer, greedy completion and reward, the K rewards.
    """

    k: int
    problems: int
    skipped: int
    avg_at_k: float
    pass_at_k: float
    greedy_accuracy: float
    rows: tuple[dict[str, Any], ...]

    def table(self) -> str:
        """The console table."""
        head = f"{'problems':>9} {'skipped':>8} {f'avg@{self.k}':>8} {f'pass@{self.k}':>8} greedy"
        row = (
            f"{self.problems:>9} {self.skipped:>8} {self.avg_at_k:>8.3f} {self.pass_at_k:>8.3f} "
            f"{self.greedy_accuracy:>6.3f}"
        )
        return f"{head}\n{row}"

    def to_json(self) -> dict[str, Any]:
        """A JSON-able dict of every field."""
        return dataclasses.asdict(self) | {"rows": list(self.rows)}


class Evaluator:
    """Compiled decoding cores (sampled and greedy) for one model and tokenizer, reused across
    evaluations (new params of the same shapes do not recompile).

    Args:
      graphdef: the model's graphdef.
      model_cfg: its config.
      encode_prompt: prompt text -> the ids the policy continues (as the server encodes it).
      decode: completion ids -> text (stop and special ids dropped).
      stop_ids: ids that end a completion.
      sampleable_v: [V] bool, the ids sampling may produce.
      reward_fn: (completion text, answer) -> reward in [0, 1].
      max_new_tokens, max_prefill_length, slots, sampling, seed: as the server's
        (`max_new_tokens` is the completion's budget: a whole episode's with `episodes`).
      episodes: play each sample as a multi-turn episode of this runner (None: single answers);
        `turn_tokens` then bounds each turn.
    """

    def __init__(
        self,
        graphdef: nnx.GraphDef,
        model_cfg: ModelConfig,
        *,
        encode_prompt: Callable[[str], list[int]],
        decode: Callable[[Sequence[int]], str],
        stop_ids: Sequence[int],
        sampleable_v: np.ndarray,
        reward_fn: Callable[[str, str], float],
        max_new_tokens: int,
        max_prefill_length: int,
        slots: int,
        sampling: decoding.SamplingConfig,
        seed: int = 0,
        episodes: EpisodeRunner | None = None,
        turn_tokens: int = 0,
    ):
        self.encode_prompt, self.decode, self.reward_fn = encode_prompt, decode, reward_fn
        self.episodes, self.turn_tokens = episodes, turn_tokens
        self.stop_ids = tuple(stop_ids)
        core = functools.partial(
            decoding.DecodeCore,
            graphdef,
            model_cfg,
            slots=slots,
            max_prefill_length=max_prefill_length,
            max_decode_length=max_new_tokens,
            sampleable_v=sampleable_v,
            seed=seed,
        )
        self.sampled = core(sampling=sampling)
        self.greedy = core(sampling=decoding.SamplingConfig(top_k=1))

    @classmethod
    def from_config(cls, cfg: ExperimentConfig, graphdef: nnx.GraphDef) -> Evaluator:
        """The evaluator of an experiment: its tokenizer, reward, sampling and server shapes, and
        its environment when `task.env` is multi-turn."""
        tok = make_tokenizer(cfg)
        episodes = None
        if cfg.task.multi_turn:
            episodes = EpisodeRunner(load_environment(cfg.task.env), cfg.task.env_config, tok)
        return cls(
            graphdef,
            cfg.model,
            **_codec(tok, cfg.model),
            reward_fn=make_reward(cfg.task.reward),
            episodes=episodes,
            turn_tokens=cfg.rollout.max_new_tokens,
            max_new_tokens=cfg.completion_tokens,
            max_prefill_length=cfg.server.max_prefill_length,
            slots=cfg.server.slots,
            sampling=decoding.SamplingConfig.from_rollout(cfg.rollout),
            seed=cfg.server.seed,
        )

    def texts(self, params: Any, prompts: Sequence[list[int]], *, greedy: bool) -> list[str]:
        """Decoded completions of already-encoded prompts (greedy or sampled)."""
        if not prompts:
            return []
        core = self.greedy if greedy else self.sampled
        done = completions.complete(core, params, prompts, stop_ids=self.stop_ids)
        return [self.decode(c.ids) for c in done]

    def evaluate(self, params: Any, problems: Sequence[Prompt], *, k: int) -> EvalResult:
        """K samples and one greedy completion per problem, scored by the reward (k = 0: the
        greedy completions only; avg@K and pass@K are then 0)."""
        if k < 0:
            raise ValueError(f"k must be >= 0, got {k}")
        if self.episodes is not None:
            return self._evaluate_episodes(params, problems, k=k)
        limit = self.greedy.max_prefill_length
        encoded = [(p, self.encode_prompt(p.text)) for p in problems]
        kept = [(p, ids) for p, ids in encoded if 0 < len(ids) <= limit]
        prompts = [ids for _, ids in kept]
        greedy = self.texts(params, prompts, greedy=True)
        samples = self.texts(params, [ids for ids in prompts for _ in range(k)], greedy=False)
        rows = []
        for i, (p, _) in enumerate(kept):
            rewards = [self.reward_fn(t, p.answer) for t in samples[i * k : (i + 1) * k]]
            rows.append(
                {
                    "id": p.id,
                    "answer": p.answer,
                    "greedy": greedy[i],
                    "greedy_reward": self.reward_fn(greedy[i], p.answer),
                    "rewards": rewards,
                }
            )
        return _result(k, len(problems), rows)

    def _episodes(
        self, params: Any, runs: Sequence[tuple[Episode, list[int]]], *, greedy: bool
    ) -> list[str]:
        """Plays every (episode, opening ids) of `runs` to its end; returns the transcripts."""
        if not runs:
            return []

        def after_turn(i: int, ids: Sequence[int], finish: str, room: int) -> Any:
            episode = runs[i][0]
            try:
                return self.episodes.after_turn(episode, ids, finish_reason=finish, room=room)
            except (EnvError, ValueError):  # scored as it stands (the failed step adds nothing)
                episode.done = True
                return None

        done = completions.complete_episodes(
            self.greedy if greedy else self.sampled,
            params,
            [ids for _, ids in runs],
            stop_ids=self.stop_ids,
            turn_tokens=self.turn_tokens,
            after_turn=after_turn,
        )
        return [self.decode(c.ids) for c in done]

    def _evaluate_episodes(self, params: Any, problems: Sequence[Prompt], *, k: int) -> EvalResult:
        """`evaluate` with every sample a multi-turn episode, rewarded by its environment."""
        limit = self.greedy.max_prefill_length

        def start(p: Prompt) -> tuple[Episode, list[int]] | None:
            try:
                episode, ids = self.episodes.start(p)
            except (EnvError, ValueError):
                return None
            return (episode, ids) if 0 < len(ids) <= limit else None

        kept = [p for p in problems if start(p) is not None]
        greedy = [start(p) for p in kept]
        samples = [start(p) for p in kept for _ in range(k)]
        greedy_texts = self._episodes(params, greedy, greedy=True)
        self._episodes(params, samples, greedy=False)
        rows = []
        for i, p in enumerate(kept):
            rows.append(
                {
                    "id": p.id,
                    "answer": p.answer,
                    "greedy": greedy_texts[i],
                    "greedy_reward": greedy[i][0].reward,
                    "rewards": [e.reward for e, _ in samples[i * k : (i + 1) * k]],
                }
            )
        return _result(k, len(problems), rows)


def _result(k: int, total: int, rows: list[dict[str, Any]]) -> EvalResult:
    """The `EvalResult` of per-problem rows (`total` problems before skipping)."""
    mean = lambda xs: float(np.mean(xs)) if len(xs) else 0.0
    return EvalResult(
        k=k,
        problems=len(rows),
        skipped=total - len(rows),
        avg_at_k=mean([r for row in rows for r in row["rewards"]]),
        pass_at_k=mean([max(row["rewards"]) for row in rows if row["rewards"]]),
        greedy_accuracy=mean([row["greedy_reward"] for row in rows]),
        rows=tuple(rows),
    )


def _codec(tok: Tokenizer, model_cfg: ModelConfig) -> dict:
    """The tokenizer arguments of ``Evaluator``: prompts, decoding, stops and sampleable ids
    exactly as the rollout server uses them."""
    return dict(
        encode_prompt=tok.encode_prompt,
        decode=tok.decode,
        stop_ids=tuple(sorted(tok.stop_ids)),
        sampleable_v=sampleable_mask(tok, model_cfg.vocab_size),
    )


@functools.lru_cache(maxsize=8)
def _char_evaluator(
    graphdef: nnx.GraphDef, model_cfg: ModelConfig, alphabet: str, max_new_tokens: int, prefill: int
) -> Evaluator:
    return Evaluator(
        graphdef,
        model_cfg,
        **_codec(CharTokenizer(alphabet), model_cfg),
        reward_fn=make_reward("exact_match"),
        max_new_tokens=max_new_tokens,
        max_prefill_length=prefill,
        slots=HELPER_SLOTS,
        sampling=decoding.SamplingConfig(),
    )


def greedy_completions(
    graphdef: nnx.GraphDef,
    params: Any,
    problems: Sequence[Prompt],
    tokenizer: CharTokenizer,
    *,
    max_new_tokens: int,
) -> list[str]:
    """Greedy completions of ``BOS prompt`` with the character tokenizer (argmax over its
    sampleable ids), decoded up to the first EOS."""
    if not problems:
        return []
    prompts = [tokenizer.encode(p.text, bos=True) for p in problems]
    prefill = -(-max(map(len, prompts)) // 16) * 16  # a few compiled shapes, not one per length
    model_cfg = nnx.merge(graphdef, params).config
    evaluator = _char_evaluator(graphdef, model_cfg, tokenizer.alphabet, max_new_tokens, prefill)
    return evaluator.texts(params, prompts, greedy=True)


def greedy_accuracy(
    graphdef: nnx.GraphDef,
    params: Any,
    problems: Sequence[Prompt],
    tokenizer: CharTokenizer,
    *,
    max_new_tokens: int,
) -> float:
    """Exact-match accuracy of greedy completions (the task's reward, 0/1)."""
    completions = greedy_completions(
        graphdef, params, problems, tokenizer, max_new_tokens=max_new_tokens
    )
    hits = [c.strip() == p.answer.strip() for c, p in zip(completions, problems, strict=True)]
    return float(np.mean(hits)) if hits else 0.0


@functools.lru_cache(maxsize=4)
def _config_evaluator(cfg: ExperimentConfig, graphdef: nnx.GraphDef) -> Evaluator:
    return Evaluator.from_config(cfg, graphdef)


def held_out_accuracy(cfg: ExperimentConfig, graphdef: nnx.GraphDef, params: Any) -> float | None:
    """Greedy accuracy on ``train.eval.problems`` held-out problems (``Evaluator``, compiled once
    per config); None when evaluation is off or the task is not the arithmetic one."""
    if not cfg.train.eval.problems or cfg.task.source != "arithmetic":
        return None
    problems = held_out_problems(cfg.task, cfg.train.eval.problems)
    return _config_evaluator(cfg, graphdef).evaluate(params, problems, k=0).greedy_accuracy
