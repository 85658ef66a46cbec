"""Completions and multi-turn episodes over a `DecodeCore`, on one thread (evaluation, tests,
benchmarks): continuous batching over the core's slots, as the rollout server runs them
(docs/DESIGN.md §6.1) but without JetStream's threads.

``complete`` generates one completion per prompt; ``complete_episodes`` runs one episode per
prompt, extending a slot's KV cache with the environment's inserted ids after each turn.
"""

from __future__ import annotations

import dataclasses
from collections import deque
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from sat_jax.decoding import DecodeCore, unpack_step


@dataclasses.dataclass(frozen=True)
class Completion:
    """One request's completion ids (ending in the stop id when one was sampled), their behavior
    log-probs, why it ended ("stop" or "length"), and each token's kept-set size (the
    truncation replay's input; the sampleable vocabulary's size without truncation). An episode
    (`complete_episodes`) also has `generated`: True where the policy generated the id, False
    where the environment inserted it (log-prob 0 and kept 0 there); () = all generated.
    `routing` is every id's [len(ids), L, K] int32 routing ids: a generated id's from its decode
    step, an inserted id's from the cache extension (what the trainer replays)."""

    ids: tuple[int, ...]
    logp: tuple[float, ...]
    finish: str
    kept: tuple[int, ...] = ()
    generated: tuple[bool, ...] = ()
    routing: np.ndarray | None = None


def complete(
    core: DecodeCore,
    params: Any,
    prompts: Sequence[Sequence[int]],
    *,
    stop_ids: Sequence[int] = (),
    version: int = 0,
) -> list[Completion]:
    """Generates a completion of every prompt, ``core.slots`` at a time (continuous batching).

    A slot is refilled as soon as its request ends: at a stop id (kept as the last id) or after
    ``core.max_decode_length`` tokens.

    Raises:
      ValueError: a prompt is empty or longer than ``core.max_prefill_length``.
    """
    done = complete_episodes(
        core,
        params,
        prompts,
        stop_ids=stop_ids,
        turn_tokens=core.max_decode_length,
        after_turn=lambda *_: None,  # every completion is one turn
        version=version,
    )
    return [dataclasses.replace(c, generated=()) for c in done]


# after_turn(index, turn_ids, finish, room) -> ids to insert, or None to end the episode.
AfterTurn = Callable[[int, Sequence[int], str, int], "Sequence[int] | None"]


@dataclasses.dataclass
class _Episode:
    """One running episode's ids and per-id values, in completion order."""

    index: int
    prompt: int  # prompt length
    ids: list[int] = dataclasses.field(default_factory=list)
    logp: list[float] = dataclasses.field(default_factory=list)
    kept: list[int] = dataclasses.field(default_factory=list)
    generated: list[bool] = dataclasses.field(default_factory=list)
    routing: list[np.ndarray] = dataclasses.field(default_factory=list)
    turn_start: int = 0
    segment: int = 0
    cut: bool = False  # a turn was cut by a limit: the episode is overlong

    def add(self, step: dict[str, np.ndarray], slot: int) -> int:
        """Appends the slot's token of ``step``; returns it."""
        token = int(step["token"][slot])
        self.ids.append(token)
        self.logp.append(float(step["logp"][slot]))
        self.kept.append(int(step["kept"][slot]))
        self.generated.append(True)
        self.routing.append(step["routing"][slot])
        return token

    def insert(self, ids: Sequence[int], routing_nlk: np.ndarray) -> None:
        """Appends inserted ids with the routing the cache extension recorded for them."""
        n = len(ids)
        self.ids += [int(i) for i in ids]
        self.logp += [0.0] * n
        self.kept += [0] * n
        self.generated += [False] * n
        self.routing += list(routing_nlk)
        self.turn_start, self.segment = len(self.ids), self.segment + 1

    def result(self) -> Completion:
        return Completion(
            ids=tuple(self.ids),
            logp=tuple(self.logp),
            finish="length" if self.cut else "stop",
            kept=tuple(self.kept),
            generated=tuple(self.generated),
            routing=np.stack(self.routing).astype(np.int32),
        )


def complete_episodes(
    core: DecodeCore,
    params: Any,
    prompts: Sequence[Sequence[int]],
    *,
    stop_ids: Sequence[int],
    turn_tokens: int,
    after_turn: AfterTurn,
    version: int = 0,
) -> list[Completion]:
    """Runs one multi-turn episode per prompt, ``core.slots`` at a time, as the rollout server
    does (docs/DESIGN.md §6.1) but on one thread: a turn ends at a stop id or after
    ``turn_tokens`` tokens (or when the episode's ``core.max_decode_length`` is reached), then
    ``after_turn(index, turn_ids, finish, room)`` (finish "stop" or "length"; room = completion
    tokens left) returns the ids to insert, or None to end the episode; inserted ids extend the
    slot's KV cache (``DecodeCore.extend``) and decoding goes on in the same slot.

    Returns:
      Per prompt, its completion: every turn and inserted id, with ``generated`` marking which is
      which; ``finish`` is "length" when any turn was cut (at ``turn_tokens`` or the episode's
      budget), else "stop": the episode's overlong test, as the rollout server records it.

    Raises:
      ValueError: a prompt is empty or too long, or ``after_turn`` returned ids that do not fit
        ``room`` with one more token.
    """
    for i, ids in enumerate(prompts):
        if not 0 < len(ids) <= core.max_prefill_length:
            raise ValueError(
                f"prompt {i} has {len(ids)} tokens; it must have 1 to {core.max_prefill_length}"
            )
    stops = set(int(i) for i in stop_ids)
    c, budget = core.config, core.max_decode_length
    pending = deque(enumerate(prompts))
    running: dict[int, _Episode] = {}
    results: list[Completion | None] = [None] * len(prompts)
    state = core.init_state(version)
    while pending or running:
        for slot in range(core.slots):
            if slot not in running and pending:
                index, ids = pending.popleft()
                state = core.insert(core.prefill_prompt(params, ids, version), state, slot)
                running[slot] = _Episode(index=index, prompt=len(ids))
        state, data = core.generate(params, state, jnp.int32(version))
        step = unpack_step(jax.device_get(data), c.num_moe_layers, c.num_experts_per_tok)
        for slot, e in list(running.items()):
            token, n = e.add(step, slot), len(e.ids)
            if token in stops:
                finish = "stop"
            elif n - e.turn_start >= turn_tokens or n >= budget:
                finish, e.cut = "length", True
            else:
                continue
            inserted = after_turn(e.index, e.ids[e.turn_start :], finish, budget - n)
            if inserted is not None and len(inserted):
                if n + len(inserted) + 1 > budget:
                    raise ValueError(
                        f"after_turn returned {len(inserted)} ids with room for {budget - n - 1}"
                    )
                extend = dict(start=e.prompt + n, generated=n + len(inserted), version=version)
                state, routing = core.extend(
                    params, state, slot, inserted, **extend, segment=e.segment + 1
                )
                e.insert(inserted, np.asarray(routing))
                continue
            results[e.index] = e.result()
            del running[slot]
            state = core.evict(state, slot)
    return [r for r in results if r is not None]
