"""`response_format: json_object` as a token mask: which ids may come next so that the reply stays
a prefix of one JSON object (docs/DESIGN.md §6.6).

The host half of constrained decoding. A byte-level pushdown automaton for JSON (RFC 8259, the
top-level value an object, nesting bounded by `max_depth`) walks a trie of the tokenizer's tokens
by their raw bytes (`chat.token_bytes`: a token holding part of a UTF-8 character is its own
bytes), so one walk gives the mask of every id. The behavior distribution of a constrained token
is the model's renormalized over that mask (`masked_logprobs`): its log-probs are the ones to
record and to train on, as the top-k / top-p kept set's are (§2). The engine half, not built yet:
the sampler taking a per-slot [V] mask at each step, and the trainer renormalizing over the same
mask (a kept count does not describe it).

Inside strings any byte of 0x20 and above is taken (UTF-8 validity is the tokenizer's); once the
object closes only a stop id may follow (no trailing whitespace to loop on).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np

from rollout_server.chat import token_bytes

_WS = frozenset(b" \t\n\r")
_DIGITS = frozenset(b"0123456789")
_HEX = frozenset(b"0123456789abcdefABCDEF")
_ESCAPES = frozenset(b'"\\/bfnrt')
_LITERALS = {ord("t"): b"rue", ord("f"): b"alse", ord("n"): b"ull"}
# Number states in which the number may end (the next byte then closes it).
_NUMBER_ENDS = frozenset({"zero", "int", "frac", "exp"})


@dataclasses.dataclass(frozen=True)
class JsonState:
    """Where a JSON prefix stands: `stack` of open containers ("o" object, "a" array), `mode`
    (what may come next) and `aux` (the rest of a literal, the hex digits a `\\u` still needs,
    or whether a string is a key)."""

    stack: tuple[str, ...] = ()
    mode: str = "start"
    aux: Any = None

    @property
    def complete(self) -> bool:
        return self.mode == "done"


def _after_value(stack: tuple[str, ...]) -> JsonState:
    return JsonState(stack, "after" if stack else "done")


def step(state: JsonState, b: int, max_depth: int = 32) -> JsonState | None:
    """The state after byte `b`, or None where `b` cannot continue a JSON object."""
    st, mode = state.stack, state.mode
    if mode == "string":
        if b == 0x22:  # the closing quote
            return JsonState(st, "colon") if state.aux else _after_value(st)
        if b == 0x5C:
            return JsonState(st, "escape", state.aux)
        return state if b >= 0x20 else None
    if mode == "escape":
        if b == ord("u"):
            return JsonState(st, "hex", (state.aux, 4))
        return JsonState(st, "string", state.aux) if b in _ESCAPES else None
    if mode == "hex":
        key, left = state.aux
        if b not in _HEX:
            return None
        return JsonState(st, "string", key) if left == 1 else JsonState(st, "hex", (key, left - 1))
    if mode == "literal":
        rest = state.aux
        if b != rest[0]:
            return None
        return JsonState(st, "literal", rest[1:]) if len(rest) > 1 else _after_value(st)
    if mode in ("sign", "zero", "int", "dot", "frac", "e", "esign", "exp"):
        nxt = _number(mode, b)
        if nxt is not None:
            return JsonState(st, nxt)
        if mode not in _NUMBER_ENDS:
            return None
        return step(_after_value(st), b, max_depth)  # the byte ends the number
    if b in _WS:
        return None if mode == "done" else state
    if mode == "start":
        return JsonState(("o",), "first_key") if b == ord("{") else None
    if mode in ("first_key", "key"):
        if b == 0x22:
            return JsonState(st, "string", True)
        return _after_value(st[:-1]) if b == ord("}") and mode == "first_key" else None
    if mode == "colon":
        return JsonState(st, "value") if b == ord(":") else None
    if mode == "after":
        if b == ord(","):
            return JsonState(st, "key" if st[-1] == "o" else "value")
        if b == ord("}" if st[-1] == "o" else "]"):
            return _after_value(st[:-1])
        return None
    if mode in ("value", "first_value"):
        if mode == "first_value" and b == ord("]"):
            return _after_value(st[:-1])
        return _open_value(st, b, max_depth)
    return None  # "done": only a stop id


def _open_value(st: tuple[str, ...], b: int, max_depth: int) -> JsonState | None:
    if b == 0x22:
        return JsonState(st, "string", False)
    if b in (ord("{"), ord("[")):
        if len(st) >= max_depth:
            return None
        return (
            JsonState((*st, "o"), "first_key")
            if b == ord("{")
            else JsonState((*st, "a"), "first_value")
        )
    if b in _LITERALS:
        return JsonState(st, "literal", _LITERALS[b])
    if b == ord("-"):
        return JsonState(st, "sign")
    if b in _DIGITS:
        return JsonState(st, "zero" if b == ord("0") else "int")
    return None


def _number(mode: str, b: int) -> str | None:
    """The number's next state after `b`, or None when `b` does not continue it."""
    digit = b in _DIGITS
    if mode == "sign":
        return ("zero" if b == ord("0") else "int") if digit else None
    if mode in ("zero", "int"):
        if digit and mode == "int":
            return "int"
        return "dot" if b == ord(".") else "e" if b in (ord("e"), ord("E")) else None
    if mode in ("dot", "frac"):
        if digit:
            return "frac"
        return "e" if mode == "frac" and b in (ord("e"), ord("E")) else None
    if mode == "e":
        return "exp" if digit else "esign" if b in (ord("+"), ord("-")) else None
    return "exp" if digit else None  # "esign", "exp"


class JsonObjectMask:
    """The ids that keep a reply a prefix of one JSON object, per state (`allowed`).

    Args:
      tokenizer: the engine's (`decode`, `stop_ids`; an HF one's vocabulary pieces give the raw
        bytes of partial UTF-8 tokens).
      vocab_size: V, the mask's length (the model's, padded rows never allowed).
      max_depth: the deepest nesting allowed (bounds the automaton).
      cache_size: masks kept per state (the states of a reply repeat: inside a string, after a
        value at a depth).
    """

    def __init__(self, tokenizer: Any, vocab_size: int, *, max_depth=32, cache_size=4096):
        self.vocab_size, self.max_depth, self._cache_size = vocab_size, max_depth, cache_size
        self.stop_ids = np.array(sorted(int(i) for i in tokenizer.stop_ids), np.int64)
        self._trie: dict[int, Any] = {}  # byte -> (child trie, ids ending there)
        self._bytes: dict[int, bytes] = {}
        for i in range(min(vocab_size, len(tokenizer))):
            if i in tokenizer.stop_ids:
                continue
            raw = bytes(token_bytes(tokenizer, i, tokenizer.decode([i])))
            if not raw:  # a special token with no text: never inside JSON
                continue
            self._bytes[i] = raw
            node = self._trie
            for b in raw[:-1]:
                node = node.setdefault(b, ({}, []))[0]
            node.setdefault(raw[-1], ({}, []))[1].append(i)
        self._masks: dict[JsonState, np.ndarray] = {}

    def start(self) -> JsonState:
        return JsonState()

    def advance(self, state: JsonState, token_id: int) -> JsonState:
        """The state after `token_id`.

        Raises:
          ValueError: the token is not allowed in `state`.
        """
        raw = self._bytes.get(int(token_id))
        out = state if raw is not None else None
        for b in raw or ():
            out = step(out, b, self.max_depth)
            if out is None:
                break
        if out is None:
            raise ValueError(f"token {token_id} cannot continue the JSON object here")
        return out

    def allowed(self, state: JsonState) -> np.ndarray:
        """[V] bool: the ids that may follow `state` (stop ids only once the object is
        complete)."""
        mask = self._masks.get(state)
        if mask is not None:
            return mask
        mask = np.zeros(self.vocab_size, bool)
        if state.complete:
            mask[self.stop_ids] = True
        else:
            pending = [(self._trie, state)]
            while pending:
                node, at = pending.pop()
                for b, (child, ids) in node.items():
                    nxt = step(at, b, self.max_depth)
                    if nxt is None:
                        continue
                    if ids:
                        mask[ids] = True
                    if child:
                        pending.append((child, nxt))
        if len(self._masks) >= self._cache_size:
            self._masks.pop(next(iter(self._masks)))
        self._masks[state] = mask
        return mask


def masked_logprobs(logits_v: np.ndarray, allowed_v: np.ndarray) -> np.ndarray:
    """[V] float64 log-probs of the constrained behavior distribution: the model's softmax
    renormalized over `allowed_v` (-inf elsewhere), what a constrained token's log-prob is."""
    z = np.where(allowed_v, np.asarray(logits_v, np.float64), -np.inf)
    top = np.max(z)
    return z - (top + np.log(np.sum(np.exp(z - top))))
