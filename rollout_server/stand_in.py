"""A stand-in engine for measuring the loop without its compute (docs/DESIGN.md §9): a JetStream
engine that holds a real `MoEEngine` and answers prefill, insert and generate itself, with no
model work, and whose every generate step sleeps
`step_s` (the per-token decode time measured on the real engine) and emits, for every busy slot,
a token drawn uniformly from the sampleable non-stop ids, then a stop id once the slot's
completion reaches `tokens`. Its log-probs are the uniform distribution's, its versions the
weights version in use, its routing experts 0 … K−1 in every layer, so the groups it makes pass
the trainer's checks. Everything else is the real server's: the weights (UpdateWeights loads and
swaps them as usual), the driver, the rollout loop, admission, delivery, Pull and Ack.

Selected only by its own command, never by a config key:

    python -m rollout_server.stand_in --config FILE stand_in.step_s=0.004 stand_in.tokens=7 [k=v ...]

(`benchmarks/async_vs_sync.py --stand-in` starts it through `train.local_server.LocalServer`'s
``module``). Multi-turn episodes are not supported (an extension fails the slot, as a failed
real extension does).
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import logging
import math
import sys
import time
from typing import Any

import numpy as np

from rollout_server import jetstream_compat  # noqa: F401  (must precede jetstream imports)

# isort: split
from jetstream.engine import engine_api

from rollout_server.engine import MoEEngine
from sat_jax.decoding import (
    KEPT_COL,
    LENGTH_COL,
    LOGP_COL,
    ROUTING_COL,
    SEGMENT_COL,
    TOKEN_COL,
    VALID_COL,
    VERSION_COL,
)

log = logging.getLogger("rollout_server.stand_in")  # also when run as __main__

PREFIX = "stand_in."  # the command's own k=v arguments


@dataclasses.dataclass(frozen=True)
class StandInPrefix:
    """What the stand-in's prefill hands to insert: the prompt ids (no device arrays)."""

    prompt_ids: np.ndarray
    true_length: int


@dataclasses.dataclass
class StandInState:
    """The stand-in's decode state, on the host: per slot, the tokens generated (−1 = free) and
    the completion length it ends at (the stop id included)."""

    generated_b: np.ndarray
    target_b: np.ndarray


class StandInEngine(engine_api.Engine):
    """A JetStream engine whose prefill / insert / generate are the stand-in's (module docstring);
    everything else (the weights and their swaps, the tokenizer, the decode clock, the slots, the
    mesh) is the `MoEEngine` it holds, built from the same arguments.

    Args:
      step_s: seconds each generate step sleeps (≥ 0).
      tokens: completion tokens per request, the stop id included, on average (≥ 1): a request
        gets ⌊tokens⌋ or ⌈tokens⌉ of them, drawn so the mean is `tokens` (capped at the request's
        limit by the driver, which then ends it as "length").
      *args, **kwargs: `MoEEngine`'s.
    """

    def __init__(self, *args: Any, step_s: float, tokens: float, sleep=time.sleep, **kwargs: Any):
        if not (math.isfinite(step_s) and step_s >= 0):
            raise ValueError(f"stand_in.step_s must be a finite number >= 0, got {step_s}")
        if tokens < 1:
            raise ValueError(f"stand_in.tokens must be >= 1, got {tokens}")
        self.real = MoEEngine(*args, **kwargs)
        self.step_s, self.tokens, self._sleep = float(step_s), float(tokens), sleep
        stops = sorted(self.real.tokenizer.stop_ids)
        if not stops:
            raise ValueError("the stand-in engine needs a tokenizer with a stop id")
        self._stop_id = stops[0]
        sampleable = np.flatnonzero(self.real.sampleable_ids)
        self._ids = np.setdiff1d(sampleable, stops).astype(np.int32)
        self._logp = np.float32(-math.log(len(sampleable)))
        self._rng = np.random.default_rng(0)
        self._calls = self._prompt_tokens = 0
        self._last_prompt = b""
        self._slot_prompts: dict[int, tuple[np.ndarray, np.ndarray]] = {}

    def __getattr__(self, name: str) -> Any:
        """What the stand-in does not answer itself is the real engine's."""
        if name == "real":  # not set yet: __init__ failed before it
            raise AttributeError(name)
        return getattr(self.real, name)

    # JetStream's engine API that `MoEEngine` implements (the base class's own would answer
    # otherwise, not `__getattr__`), answered by the real engine.
    def load_params(self, *args: Any, **kwargs: Any) -> Any:
        return self.real.load_params(*args, **kwargs)

    def get_prefix_destination_sharding(self) -> Any:
        return self.real.get_prefix_destination_sharding()

    def get_tokenizer(self) -> Any:
        return self.real.get_tokenizer()

    def build_tokenizer(self, metadata: Any) -> Any:
        return self.real.build_tokenizer(metadata)

    @property
    def max_concurrent_decodes(self) -> int:
        return self.real.max_concurrent_decodes

    @property
    def max_prefill_length(self) -> int:
        return self.real.max_prefill_length

    @property
    def samples_per_slot(self) -> int:
        return self.real.samples_per_slot

    @property
    def mesh(self) -> Any:
        return self.real.mesh

    @property
    def colocated_cpus(self) -> Any:
        return self.real.colocated_cpus

    def slot_prompt(self, slot: int) -> tuple[np.ndarray, np.ndarray]:
        """(prompt ids [P], prompt routing [P, L, K]) of the request last inserted into `slot`."""
        if slot not in self._slot_prompts:
            raise KeyError(f"slot {slot} holds no prompt (nothing inserted)")
        return self._slot_prompts[slot]

    @property
    def prefill_calls(self) -> int:
        return self._calls

    @property
    def prefill_tokens(self) -> int:
        return self._prompt_tokens

    @property
    def extend_tokens(self) -> int:
        return 0

    def prefill(self, *, padded_tokens: Any, true_length: int, **kwargs: Any) -> StandInPrefix:
        ids = np.asarray(padded_tokens, np.int32)[:true_length].copy()
        if ids.tobytes() != self._last_prompt:  # a group's samples share one, as in `DecodeCore`
            self._calls += 1
            self._prompt_tokens += int(true_length)
            self._last_prompt = ids.tobytes()
        return StandInPrefix(ids, int(true_length))

    def insert(self, prefix: Any, decode_state: StandInState, slot: int, **kwargs) -> StandInState:
        cfg = self.config
        n = prefix.true_length
        routing = np.zeros((n, cfg.num_moe_layers, cfg.num_experts_per_tok), cfg.routing_dtype)
        routing[:] = np.arange(cfg.num_experts_per_tok)
        self._slot_prompts[slot] = (prefix.prompt_ids, routing)
        decode_state.generated_b[slot] = 0
        whole = math.floor(self.tokens)
        decode_state.target_b[slot] = whole + (self._rng.random() < self.tokens - whole)
        return decode_state

    def init_decode_state(self, *args: Any, **kwargs: Any) -> StandInState:
        b = self.max_concurrent_decodes
        return StandInState(np.full((b,), -1, np.int64), np.ones((b,), np.int64))

    def schedule_extend(self, slot: int, tokens: np.ndarray, **kwargs: Any) -> None:
        raise NotImplementedError("the stand-in engine runs single-turn requests only")

    def generate(
        self, params: Any, decode_state: StandInState, **kwargs: Any
    ) -> tuple[StandInState, engine_api.ResultTokens]:
        """Sleeps `step_s`, then one token for every busy slot (see the module docstring)."""
        self.decode_clock.dispatched()  # the sleep is the step's work
        self._sleep(self.step_s)
        cfg = self.config
        k, layers = cfg.num_experts_per_tok, cfg.num_moe_layers
        gen = decode_state.generated_b
        busy = gen >= 0
        b = gen.shape[0]
        data = np.zeros((b, ROUTING_COL + layers * k), np.int32)
        tokens = self._rng.choice(self._ids, size=b).astype(np.int32)
        gen[busy] += 1
        done = busy & (gen >= decode_state.target_b)
        tokens[done] = self._stop_id
        data[:, TOKEN_COL] = tokens
        data[:, VALID_COL] = busy
        data[:, LENGTH_COL] = np.where(busy, gen, 0)
        data[:, LOGP_COL] = np.full(b, self._logp, np.float32).view(np.int32)
        data[:, VERSION_COL] = self.version
        data[:, KEPT_COL] = len(self._ids) + 1
        data[:, SEGMENT_COL] = 0
        data[:, ROUTING_COL:] = np.tile(np.arange(k, dtype=np.int32), layers)
        gen[done] = -1  # the slot is free once its stop id is out
        return decode_state, engine_api.ResultTokens(
            data=data,
            tokens_idx=(TOKEN_COL, TOKEN_COL + 1),
            valid_idx=(VALID_COL, VALID_COL + 1),
            length_idx=(LENGTH_COL, LENGTH_COL + 1),
            samples_per_slot=1,
        )


def split_args(argv: list[str]) -> tuple[dict[str, str], list[str]]:
    """The command's own ``stand_in.KEY=VALUE`` arguments, and the rest (for `sat-serve`).

    Raises:
      ValueError: a ``stand_in.`` key other than ``step_s`` or ``tokens``, or one missing.
    """
    own, rest = {}, []
    for arg in argv:
        if arg.startswith(PREFIX):
            key, _, value = arg[len(PREFIX) :].partition("=")
            if key not in ("step_s", "tokens"):
                raise ValueError(
                    f"unknown stand-in argument {arg!r} (stand_in.step_s, stand_in.tokens)"
                )
            own[key] = value
        else:
            rest.append(arg)
    missing = [k for k in ("step_s", "tokens") if k not in own]
    if missing:
        raise ValueError(f"missing stand_in.{missing[0]}=VALUE")
    return own, rest


def main(argv: list[str] | None = None) -> None:
    """`sat-serve`'s command with the stand-in engine (its arguments: the module docstring)."""
    from rollout_server.persistence import StateDirLockedError, StateStore
    from sat_jax import cli

    argv = sys.argv[1:] if argv is None else argv
    try:
        own, rest = split_args(argv)
        step_s, tokens = float(own["step_s"]), float(own["tokens"])
    except ValueError as e:
        print(f"stand-in: {e}", file=sys.stderr)
        sys.exit(2)
    command = cli.Command("sat-serve", __doc__)
    cfg = command.load_config(command.parse(rest))
    cli.log_to_stderr("rollout_server")
    with command.exit_on(StateDirLockedError, OSError):
        store = StateStore(cfg.server.state_dir)
    from rollout_server import process

    engine = functools.partial(StandInEngine, step_s=step_s, tokens=tokens)
    log.info("stand-in engine: %.4f s per step, %.2f tokens per request", step_s, tokens)
    sys.exit(asyncio.run(process.serve(cfg, store, engine_class=engine)))


if __name__ == "__main__":
    main()
