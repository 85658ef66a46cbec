"""Completions and multi-turn episodes over a `DecodeCore`, on one thread (evaluation, tests,
benchmarks): continuous batching over the core's slots, as the rollout server runs them
(docs/DESIGN.md §6.1) but without JetStream's threads.

``complete`` generates one completion per prompt; ``complete_episodes`` runs one episode per
prompt, extending a slot's KV cache with the environment's inserted ids after each turn.

What the server and evaluation share is here, so that they cannot drift apart: the turn-end rule
(`turn_end`) and the bookkeeping of a completion's ids and per-id values (`TokenBuffer`, which
`rollout_server.driver` fills from JetStream's detokenize thread, into a `FinishedSample`).
"""

from __future__ import annotations

import dataclasses
from collections import deque
from collections.abc import Callable, Collection, Sequence
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


@dataclasses.dataclass(frozen=True, kw_only=True)
class FinishedSample:
    """One completed sample of a rollout request.

    Attributes:
      prompt_ids: [P] int32, exactly the tokenizer's prompt ids.
      completion_ids: [C] int32, the stop id included when `finish_reason == "stop"`.
      logprobs: [C] float32 behavior log-probs.
      versions: [C] int64 weights version per completion token.
      routing: [P + C, L, K] expert ids in the model's routing dtype.
      kept_counts: [C] int32 the sampler's kept-set size per completion token.
      finish_reason: "stop" or "length" (an episode's: "length" when any of its turns was cut).
      response_formats, format_index: constrained decoding (`rollout_api.records.Trajectory`'s
        fields): the formats its turns were sampled under and, per completion token, 0 (free)
        or 1 + the format's index; () and None when no turn was constrained.
    """

    prompt_ids: np.ndarray
    completion_ids: np.ndarray
    logprobs: np.ndarray
    versions: np.ndarray
    routing: np.ndarray
    finish_reason: str
    kept_counts: np.ndarray | None = None
    loss_mask: np.ndarray | None = None
    response_formats: tuple[str, ...] = ()
    format_index: np.ndarray | None = None


class TokenBuffer:
    """The per-token arrays of one request, allocated for `max_tokens` completion tokens when it
    gets its slot and filled one generate step at a time: the one bookkeeping of a completion's
    ids, of the rollout server (`rollout_server.driver`) and of evaluation (`complete_episodes`).

    Args:
      prompt_ids: [P] the prompt's ids.
      prompt_routing: [P, L, K] the prompt's routing ids (its dtype is the routing's).
      max_tokens: the most completion tokens the request may produce.
    """

    def __init__(
        self,
        prompt_ids: np.ndarray,
        prompt_routing: np.ndarray,
        max_tokens: int,
        *,
        masked: bool = False,
    ):
        p = len(prompt_ids)
        self.prompt_ids = np.asarray(prompt_ids, np.int32)
        self.tokens = np.empty(max_tokens, np.int32)
        self.logprobs = np.empty(max_tokens, np.float32)
        self.versions = np.empty(max_tokens, np.int64)
        self.kept = np.empty(max_tokens, np.int32)
        # Prompt then completion positions, so the finished routing needs no concatenation.
        self.routing = np.empty((p + max_tokens, *prompt_routing.shape[1:]), prompt_routing.dtype)
        self.routing[:p] = prompt_routing
        # Multi-turn: True where the policy generated the token (`insert` writes False).
        self.mask = np.empty(max_tokens, bool) if masked else None
        self.size = 0  # completion tokens written
        # Constrained decoding: the formats so far, each token's (0 = free; `set_format`).
        self.formats: list[str] = []
        self.format_index: np.ndarray | None = None
        self._format = 0

    def set_format(self, fmt: str | None) -> None:
        """The tokens `add` writes from now on (the turn starting here) are sampled under
        `fmt` (a canonical `response_format` string; None = free)."""
        if fmt is None:
            self._format = 0
            return
        if fmt not in self.formats:
            self.formats.append(fmt)
        if self.format_index is None:
            self.format_index = np.zeros(len(self.tokens), np.int32)
        self._format = self.formats.index(fmt) + 1

    def add(
        self,
        token: int,
        logp: np.floating,
        version: np.integer,
        routing: np.ndarray,
        kept: np.integer = 0,
    ) -> None:
        """Writes the next completion token's values (`routing`: [L, K]; `kept`: the sampler's
        kept-set size).

        Raises:
          IndexError: the buffer already holds `max_tokens` tokens.
        """
        n = self.size
        self.tokens[n], self.logprobs[n], self.versions[n] = token, logp, version
        self.kept[n] = kept
        self.routing[len(self.prompt_ids) + n] = routing
        if self.mask is not None:
            self.mask[n] = True
        if self.format_index is not None:
            self.format_index[n] = self._format
        self.size = n + 1

    def insert(self, tokens: np.ndarray) -> None:
        """Appends inserted (observation) tokens: loss mask 0, log-prob 0, the last generated
        token's version and kept count 0 (the trainer reads none of them); their routing is 0
        until `set_routing` writes what the cache extension recorded (the trainer replays it).

        Raises:
          ValueError: the buffer is not masked, or the tokens do not fit.
        """
        n, k = self.size, len(tokens)
        if self.mask is None:
            raise ValueError("insert needs a masked (multi-turn) buffer")
        if n + k > len(self.tokens):
            raise ValueError(f"{k} inserted tokens do not fit after {n} of {len(self.tokens)}")
        p = len(self.prompt_ids)
        self.tokens[n : n + k] = tokens
        self.logprobs[n : n + k] = 0.0
        self.versions[n : n + k] = self.versions[n - 1] if n else 0
        self.kept[n : n + k] = 0
        self.routing[p + n : p + n + k] = 0
        self.mask[n : n + k] = False
        if self.format_index is not None:
            self.format_index[n : n + k] = 0
        self.size = n + k

    def set_routing(self, start: int, routing: np.ndarray) -> None:
        """Writes the routing [n, L, K] of completion tokens start .. start + n − 1 (inserted
        tokens', recorded by the cache extension)."""
        p = len(self.prompt_ids)
        self.routing[p + start : p + start + len(routing)] = routing

    def sample(self, finish_reason: str) -> FinishedSample:
        """The finished sample: views of the filled part of the arrays."""
        n = self.size
        return FinishedSample(
            prompt_ids=self.prompt_ids,
            completion_ids=self.tokens[:n],
            logprobs=self.logprobs[:n],
            versions=self.versions[:n],
            routing=self.routing[: len(self.prompt_ids) + n],
            finish_reason=finish_reason,
            kept_counts=self.kept[:n],
            loss_mask=None if self.mask is None else self.mask[:n],
            response_formats=tuple(self.formats),
            format_index=None if self.format_index is None else self.format_index[:n],
        )


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


def turn_end(
    token: int,
    size: int,
    turn_start: int,
    *,
    stops: Collection[int],
    turn_tokens: int,
    max_tokens: int,
) -> str | None:
    """The turn-end rule, the rollout server's (`rollout_server.driver`) and evaluation's
    (`complete_episodes`): after `token` made the completion `size` ids long, of which the turn
    started at `turn_start`, the turn ends with "stop" at a stop id, with "length" once the turn
    has `turn_tokens` ids or the completion `max_tokens` (an episode with a turn cut so is
    overlong), and goes on otherwise (None)."""
    if token in stops:
        return "stop"
    if size - turn_start >= turn_tokens or size >= max_tokens:
        return "length"
    return None


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
    stops = frozenset(int(i) for i in stop_ids)
    c, budget = core.config, core.max_decode_length
    pending = deque(enumerate(prompts))
    running: dict[int, _Running] = {}
    results: list[Completion | None] = [None] * len(prompts)
    state = core.init_state(version)
    while pending or running:
        for slot in range(core.slots):
            if slot not in running and pending:
                index, ids = pending.popleft()
                state = core.insert(core.prefill_prompt(params, ids, version), state, slot)
                running[slot] = _Running.start(index, ids, budget, c)
        state, data = core.generate(params, state, jnp.int32(version))
        step = unpack_step(jax.device_get(data), c.num_moe_layers, c.num_experts_per_tok)
        for slot, e in list(running.items()):
            b = e.buffer
            token = int(step["token"][slot])
            b.add(token, *(step[k][slot] for k in ("logp", "version", "routing", "kept")))
            finish = turn_end(
                token, b.size, e.turn_start, stops=stops, turn_tokens=turn_tokens, max_tokens=budget
            )
            if finish is None:
                continue
            e.cut = e.cut or finish == "length"
            turn = b.tokens[e.turn_start : b.size].tolist()
            inserted = after_turn(e.index, turn, finish, budget - b.size)
            if inserted is not None and len(inserted):
                state = e.extend(core, params, state, slot, inserted, version)
                continue
            results[e.index] = e.result()
            del running[slot]
            state = core.evict(state, slot)
    return [r for r in results if r is not None]


@dataclasses.dataclass
class _Running:
    """One running episode of `complete_episodes`: its ids in a `TokenBuffer` and where its turn
    stands (what the rollout server keeps on its `RolloutRequest`)."""

    index: int
    buffer: TokenBuffer
    turn_start: int = 0
    segment: int = 0
    cut: bool = False  # a turn was cut by a limit: the episode is overlong

    @classmethod
    def start(cls, index: int, prompt: Sequence[int], budget: int, config: Any) -> _Running:
        """Prompt `index`'s episode, with room for `budget` completion ids (the prompt's routing
        is not recorded here: zeros)."""
        layers, k = config.num_moe_layers, config.num_experts_per_tok
        routing = np.zeros((len(prompt), layers, k), np.int32)
        return cls(index, TokenBuffer(np.asarray(prompt), routing, budget, masked=True))

    def extend(
        self, core: DecodeCore, params: Any, state: Any, slot: int, ids: Sequence[int], version: int
    ) -> Any:
        """Inserts `ids` after the turn (extending the slot's KV cache) and starts the next turn;
        returns the decode state.

        Raises:
          ValueError: they do not fit the budget with one more generated id.
        """
        b, n = self.buffer, self.buffer.size
        room = len(b.tokens) - n - 1
        if len(ids) > room:
            raise ValueError(f"after_turn returned {len(ids)} ids with room for {room}")
        extend = dict(start=len(b.prompt_ids) + n, generated=n + len(ids), version=version)
        state, routing = core.extend(params, state, slot, ids, **extend, segment=self.segment + 1)
        b.insert(np.asarray(ids, np.int32))
        b.set_routing(n, np.asarray(routing))
        self.turn_start, self.segment = b.size, self.segment + 1
        return state

    def result(self) -> Completion:
        """The episode's `Completion`."""
        b, n = self.buffer, self.buffer.size
        p = len(b.prompt_ids)
        return Completion(
            ids=tuple(b.tokens[:n].tolist()),
            logp=tuple(b.logprobs[:n].tolist()),
            finish="length" if self.cut else "stop",
            kept=tuple(b.kept[:n].tolist()),
            generated=tuple(b.mask[:n].tolist()),
            routing=b.routing[p : p + n].astype(np.int32),
        )
