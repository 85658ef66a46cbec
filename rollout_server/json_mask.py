"""The engine's half of `response_format`: each constrained slot's automaton state and mask rows
(`SlotFormats`, docs/DESIGN.md §6.6). The automata, the canonical format strings and the masks
are `sat_jax.json_mask`'s, shared with the trainer, which replays the same masks.
"""

from __future__ import annotations

import dataclasses
import threading
from typing import Any

import numpy as np

from sat_jax.decoding import SEGMENT_COL, TOKEN_COL, VALID_COL
from sat_jax.json_mask import TokenMask, mask_for


@dataclasses.dataclass
class _SlotFormat:
    mask: TokenMask
    state: Any
    segment: int
    pending: bool = False  # a step sampled under `state`; its token is not read yet


class SlotFormats:
    """The engine's per-slot constrained decoding (docs/DESIGN.md §6.6): each constrained slot's
    format mask and automaton state, the [B, V] allowed rows of the next step, and the state's
    advance by the token that step sampled.

    Used on the engine's generate thread only (insert, extensions and steps run there), except
    `next_prefill` / `take_prefill_format`, which carry a request's format from the driver to
    the engine's prefill on the prefill thread (thread-local). While any slot is constrained a
    step waits for the previous step's tokens before it is dispatched (the next mask depends on
    them), so decoding loses its one-step overlap of host and device; with none constrained
    nothing is read and the engine runs the unmasked program.

    Args:
      tokenizer: the engine's.
      vocab_size: V, the model's.
      slots: B.
    """

    def __init__(self, tokenizer: Any, vocab_size: int, slots: int):
        self.tokenizer, self.vocab_size, self.slots = tokenizer, vocab_size, slots
        self._slots: dict[int, _SlotFormat] = {}
        self._local = threading.local()
        self._last_step: Any = None  # the previous step's output while any slot is constrained

    def next_prefill(self, fmt: str | None) -> None:
        """The format of the request this thread prefills next."""
        self._local.fmt = fmt

    def take_prefill_format(self) -> str | None:
        fmt, self._local.fmt = getattr(self._local, "fmt", None), None
        return fmt

    def set(self, slot: int, fmt: str | None, *, segment: int) -> None:
        """`slot`'s turn from `segment` on is constrained to `fmt` (None: free)."""
        if fmt is None:
            self._slots.pop(slot, None)
        else:
            mask = mask_for(fmt, self.tokenizer, self.vocab_size)
            self._slots[slot] = _SlotFormat(mask, mask.start(), segment)

    def active(self, slot: int) -> bool:
        return slot in self._slots

    def advance(self) -> None:
        """Moves each constrained slot's state past the token the previous step sampled under
        it (a stop id, or a token the state refuses, frees the slot of its format)."""
        if self._last_step is None:
            return
        data, self._last_step = np.asarray(self._last_step), None
        for slot, f in list(self._slots.items()):
            if not f.pending:
                continue
            f.pending = False
            if not data[slot, VALID_COL] or data[slot, SEGMENT_COL] != f.segment:
                continue
            token = int(data[slot, TOKEN_COL])
            try:
                f.state = f.mask.advance(f.state, token)
            except ValueError:  # a stop id: the constrained turn is over
                del self._slots[slot]

    def allowed(self) -> np.ndarray | None:
        """[B, V] bool rows of the next step (all True for free slots), or None when no slot is
        constrained."""
        if not self._slots:
            return None
        allowed_bv = np.ones((self.slots, self.vocab_size), bool)
        for slot, f in self._slots.items():
            allowed_bv[slot] = f.mask.allowed(f.state)
        return allowed_bv

    def sampled(self, step: Any) -> None:
        """Notes the step just dispatched (its tokens are read by the next `advance`)."""
        if self._slots:
            for f in self._slots.values():
                f.pending = True
            self._last_step = step
