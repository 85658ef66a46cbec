"""`response_format` as a token mask: which ids may come next so that the reply stays a prefix of
one JSON value of the format (docs/DESIGN.md §6.6), and the trainer's replay of those masks.

A byte-level pushdown automaton (`sat_jax.json_automaton`) walks a trie of the tokenizer's tokens
by their raw bytes (`token_bytes`: a token holding part of a UTF-8 character is its own bytes), so
one walk per state gives the mask of every id (`TokenMask`). `json_object`: RFC 8259 with an
object at the top (`JsonObjectMask`). `json_schema`: the subset enforced exactly
(`JsonSchemaMask`); anything else is refused naming the keyword
(`json_automaton.UnsupportedSchema`). `parse_response_format` gives a format's canonical string and
`mask_for` its mask, a pure function of (format, tokenizer, V).

The behavior distribution of a constrained token is the model's renormalized over the mask
(`masked_logprobs`): its log-probs are the ones recorded, as the top-k / top-p kept set's are
(§2). The server's engine samples under these masks (`rollout_server.json_mask.SlotFormats`);
the trainer rebuilds them from a trajectory's formats and tokens (`constrained_runs`,
`MaskTable`: one row per distinct (format, state) of a batch, bit-packed) and scores each
constrained token under its mask, so its log-prob is the masked distribution's too.

Inside strings any byte of 0x20 and above is taken (UTF-8 validity is the tokenizer's); between
tokens at most `MAX_WHITESPACE` whitespace bytes in a row; once the value is whole only a stop id
may follow (no trailing whitespace to loop on).
"""

from __future__ import annotations

import itertools
import json
import re
import threading
from collections.abc import Sequence
from typing import Any

import numpy as np

from sat_jax.json_automaton import (
    WHITESPACE,
    JsonState,
    compact_json,
    compile_schema,
    in_string,
    schema_in_string,
    schema_step,
    step,
)


def _bytes_to_unicode() -> dict[str, int]:
    """GPT-2's byte-level BPE alphabet, reversed: each vocabulary character's byte."""
    bs = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1)]
    bs += list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {chr(c): b for b, c in zip(bs, cs, strict=True)}


_BYTE_OF = _bytes_to_unicode()


def token_bytes(tokenizer: Any, token_id: int, text: str) -> list[int]:
    """The raw bytes of one token: its decoded text's UTF-8 when that is whole, else from the
    vocabulary piece (byte-level BPE characters, or SentencePiece's `<0xNN>` byte pieces), so a
    token holding part of a UTF-8 character has its own bytes rather than U+FFFD's."""
    if "\ufffd" not in text:
        return list(text.encode())
    hf = getattr(tokenizer, "_tok", None)
    piece = hf.convert_ids_to_tokens(int(token_id)) if hf is not None else None
    if isinstance(piece, str):
        if re.fullmatch(r"<0x[0-9A-Fa-f]{2}>", piece):
            return [int(piece[3:5], 16)]
        if piece and all(c in _BYTE_OF for c in piece):
            return [_BYTE_OF[c] for c in piece]
    return list(text.encode())


class TokenTrie:
    """The tokenizer's ids by their raw bytes: a trie (byte -> (child, ids ending there)), each
    id's bytes, and the stop ids. Built once per (tokenizer, V) and shared by every format's mask
    (`trie_of`).

    Args:
      tokenizer: the engine's (`decode`, `stop_ids`; an HF one's vocabulary pieces give the raw
        bytes of partial UTF-8 tokens).
      vocab_size: V, a mask's length (the model's, padded rows never allowed).
    """

    def __init__(self, tokenizer: Any, vocab_size: int):
        self.vocab_size = vocab_size
        self.stop_ids = np.array(sorted(int(i) for i in tokenizer.stop_ids), np.int64)
        self.root: dict[int, Any] = {}
        self.bytes: dict[int, bytes] = {}
        for i in range(min(vocab_size, len(tokenizer))):
            if i in tokenizer.stop_ids:
                continue
            raw = bytes(token_bytes(tokenizer, i, tokenizer.decode([i])))
            if not raw:  # a special token with no text: never inside JSON
                continue
            self.bytes[i] = raw
            node = self.root
            for b in raw[:-1]:
                node = node.setdefault(b, ({}, []))[0]
            node.setdefault(raw[-1], ({}, []))[1].append(i)


_TRIES: dict[tuple[int, int], TokenTrie] = {}
_TRIES_LOCK = threading.Lock()


def trie_of(tokenizer: Any, vocab_size: int) -> TokenTrie:
    """The `TokenTrie` of (tokenizer, V), built on first use and kept (a few per process)."""
    key = (id(tokenizer), vocab_size)
    with _TRIES_LOCK:
        entry = _TRIES.get(key)
        if entry is None or entry[0] is not tokenizer:
            if len(_TRIES) >= 8:
                _TRIES.pop(next(iter(_TRIES)))
            entry = _TRIES[key] = (tokenizer, TokenTrie(tokenizer, vocab_size))
        return entry[1]


MAX_WHITESPACE = 20
"""The most whitespace bytes in a row a constrained reply may hold between tokens of JSON (a
newline and 19 spaces of indentation; inside strings a space is content and not counted). JSON
allows any run there: unbounded, a weak policy pads a reply with whitespace until its token
limit (vLLM's and outlines' grammars bound it the same way)."""


class TokenMask:
    """The ids that keep a reply a prefix of one accepted byte string, per automaton state.

    A subclass gives `_start()`, `_step(state, byte)` (None: the byte cannot follow),
    `_complete(state)` (the value is whole: only a stop id may follow) and `_in_string(state)`
    (a byte there is a string's content). A mask's state is the subclass's with the length of
    the whitespace run it ends in, bounded by `MAX_WHITESPACE`. One walk of the trie per new
    state gives the mask of every id; masks are cached per state (the states of a reply repeat:
    inside a string, after a value). A state no id can continue (a tokenizer lacking a byte the
    format needs) allows the stop ids, so sampling never meets an empty set.

    Args:
      tokenizer: the engine's (see `TokenTrie`).
      vocab_size: V, the mask's length.
      cache_size: masks kept.
    """

    def __init__(self, tokenizer: Any, vocab_size: int, *, cache_size: int = 4096):
        self.trie = trie_of(tokenizer, vocab_size)
        self.vocab_size, self.stop_ids = vocab_size, self.trie.stop_ids
        self._cache_size = cache_size
        self._masks: dict[Any, np.ndarray] = {}
        self._lock = threading.Lock()

    def _start(self) -> Any:
        raise NotImplementedError

    def _step(self, state: Any, b: int) -> Any:
        raise NotImplementedError

    def _complete(self, state: Any) -> bool:
        raise NotImplementedError

    def _in_string(self, state: Any) -> bool:
        raise NotImplementedError

    def start(self) -> tuple[Any, int]:
        """The state before a reply's first token."""
        return self._start(), 0

    def _byte(self, state: tuple[Any, int], b: int) -> tuple[Any, int] | None:
        """The state after byte `b` (None: it cannot follow), counting whitespace runs."""
        inner, run = state
        nxt = self._step(inner, b)
        if nxt is None:
            return None
        if b in WHITESPACE and not self._in_string(inner):
            return (nxt, run + 1) if run < MAX_WHITESPACE else None
        return nxt, 0

    def complete(self, state: tuple[Any, int]) -> bool:
        """Whether `state` is a whole value (only a stop id may follow)."""
        return self._complete(state[0])

    def advance(self, state: Any, token_id: int) -> Any:
        """The state after `token_id`.

        Raises:
          ValueError: the token is not allowed in `state`.
        """
        raw = self.trie.bytes.get(int(token_id))
        out = state if raw is not None and not self.complete(state) else None
        for b in raw or ():
            out = self._byte(out, b)
            if out is None:
                break
        if out is None:
            raise ValueError(f"token {token_id} cannot continue the JSON value here")
        return out

    def allowed(self, state: Any) -> np.ndarray:
        """[V] bool: the ids that may follow `state` (stop ids only once the value is
        complete)."""
        with self._lock:
            mask = self._masks.get(state)
        if mask is not None:
            return mask
        mask = np.zeros(self.vocab_size, bool)
        if not self.complete(state):
            pending = [(self.trie.root, state)]
            while pending:
                node, at = pending.pop()
                for b, (child, ids) in node.items():
                    nxt = self._byte(at, b)
                    if nxt is None:
                        continue
                    if ids:
                        mask[ids] = True
                    if child and not self.complete(nxt):
                        pending.append((child, nxt))
        if not mask.any():
            mask[self.stop_ids] = True
        with self._lock:
            if len(self._masks) >= self._cache_size:
                self._masks.pop(next(iter(self._masks)))
            self._masks[state] = mask
        return mask


class JsonObjectMask(TokenMask):
    """`json_object`: the ids that keep a reply a prefix of one JSON object (`step`).

    Args:
      tokenizer, vocab_size, cache_size: as in `TokenMask`.
      max_depth: the deepest nesting allowed (bounds the automaton).
    """

    def __init__(self, tokenizer: Any, vocab_size: int, *, max_depth=32, cache_size=4096):
        super().__init__(tokenizer, vocab_size, cache_size=cache_size)
        self.max_depth = max_depth

    def _start(self) -> JsonState:
        return JsonState()

    def _step(self, state: JsonState, b: int) -> JsonState | None:
        return step(state, b, self.max_depth)

    def _complete(self, state: JsonState) -> bool:
        return state.complete

    def _in_string(self, state: JsonState) -> bool:
        return in_string(state)


def masked_logprobs(logits_v: np.ndarray, allowed_v: np.ndarray) -> np.ndarray:
    """[V] float64 log-probs of the constrained behavior distribution: the model's softmax
    renormalized over `allowed_v` (-inf elsewhere), what a constrained token's log-prob is."""
    z = np.where(allowed_v, np.asarray(logits_v, np.float64), -np.inf)
    top = np.max(z)
    return z - (top + np.log(np.sum(np.exp(z - top))))


class JsonSchemaMask(TokenMask):
    """`json_schema`: the ids that keep a reply a prefix of one JSON value valid under the
    schema (`compile_schema`'s subset; objects hold declared properties only, each once, the
    required ones all before the close).

    Args:
      schema: the JSON schema (its root an object).
      tokenizer, vocab_size, cache_size: as in `TokenMask`.

    Raises:
      UnsupportedSchema: see `compile_schema`.
    """

    def __init__(self, schema: Any, tokenizer: Any, vocab_size: int, *, cache_size=4096):
        self.nodes = compile_schema(schema)
        super().__init__(tokenizer, vocab_size, cache_size=cache_size)

    def _start(self) -> tuple:
        return (("val", 0),)

    def _step(self, state: tuple, b: int) -> tuple | None:
        return schema_step(self.nodes, state, b)

    def _complete(self, state: tuple) -> bool:
        return not state

    def _in_string(self, state: tuple) -> bool:
        return schema_in_string(state)


def parse_response_format(value: Any) -> str | None:
    """The canonical format string of an OpenAI `response_format` (what a trajectory carries and
    `mask_for` rebuilds a mask from), or None for text.

    Raises:
      UnsupportedSchema: a json_schema outside the served subset (naming the keyword).
      ValueError: a malformed value (one line saying what is wrong).
    """
    if not isinstance(value, dict) or value.get("type") not in (
        "text",
        "json_object",
        "json_schema",
    ):
        raise ValueError('response_format must be {"type": "text" | "json_object" | "json_schema"}')
    if value["type"] == "text":
        return None
    if value["type"] == "json_object":
        return compact_json({"type": "json_object"}).decode()
    spec = value.get("json_schema")
    if not isinstance(spec, dict) or not isinstance(spec.get("schema"), dict):
        raise ValueError("response_format json_schema needs json_schema.schema, a JSON object")
    compile_schema(spec["schema"])
    return json.dumps(
        {"type": "json_schema", "schema": spec["schema"]}, sort_keys=True, separators=(",", ":")
    )


_MASKS: dict[tuple[str, int, int], TokenMask] = {}


def mask_for(fmt: str, tokenizer: Any, vocab_size: int) -> TokenMask:
    """The `TokenMask` of canonical format `fmt` (`parse_response_format`) over `tokenizer`'s
    ids: a pure function of (fmt, tokenizer, V), so the server and the trainer build the same
    one; kept per format (the server's masks and their state caches are reused)."""
    key = (fmt, id(tokenizer), vocab_size)
    with _TRIES_LOCK:
        mask = _MASKS.get(key)
    if mask is None or mask.trie is not trie_of(tokenizer, vocab_size):
        spec = json.loads(fmt)
        if spec["type"] == "json_object":
            mask = JsonObjectMask(tokenizer, vocab_size)
        else:
            mask = JsonSchemaMask(spec["schema"], tokenizer, vocab_size)
        with _TRIES_LOCK:
            if len(_MASKS) >= 64:
                _MASKS.pop(next(iter(_MASKS)))
            _MASKS[key] = mask
    return mask


# ---------------------------------------------------------------------------------------------
# The trainer's replay: each constrained token's mask rebuilt from the trajectory.


def constrained_runs(format_index: np.ndarray) -> list[tuple[int, int, int]]:
    """(start, end, i) of each constrained reply of a trajectory, from its per-completion-token
    format index (0 = free, i >= 1 = its `response_formats[i - 1]`): the maximal runs of one
    nonzero index. A turn's reply is one run (the turns of an episode are apart by observation
    tokens, index 0), and its automaton starts fresh at the run's first token."""
    idx = np.asarray(format_index, np.int64)
    bounds = np.flatnonzero(np.diff(np.concatenate([[0], idx, [0]])))
    return [(int(a), int(b), int(idx[a])) for a, b in itertools.pairwise(bounds) if idx[a] != 0]


def mask_words(vocab_size: int) -> int:
    """W: the uint32 words of one bit-packed [V] mask (`MaskTable.packed`)."""
    return -(-vocab_size // 32)


def table_rows(needed: int, multiple: int = 1, least: int = 8) -> int:
    """M, the rows of a batch's mask table that holds `needed`: the smallest
    `multiple · 2^k` (k >= 0) that is at least `needed` and `least`, so a run compiles a few
    table shapes and the rows split evenly over `multiple` data shards."""
    m = max(1, multiple)
    while m < max(needed, least):
        m *= 2
    return m


class MaskTable:
    """The masks of one batch's constrained tokens, rebuilt with the trainer's tokenizer: each
    distinct mask once (by (format, state), then by its bits), so a batch's table holds the
    states its replies pass through, not one row per token.

    `trajectory` replays a trajectory's constrained runs and gives each completion token its
    row (1-based, 0 = free); `packed` is the [M, W] uint32 table (bit v % 32 of word v // 32 set
    = id v allowed) the train step unpacks per chunk of positions.

    Args:
      tokenizer: the trainer's (the server's, when they match; a mismatch shows as a sampled
        token the replay does not allow).
      vocab_size: V, the model's.
    """

    def __init__(self, tokenizer: Any, vocab_size: int):
        self.tokenizer, self.vocab_size = tokenizer, vocab_size
        self._by_state: dict[tuple[str, Any], int] = {}
        self._by_bits: dict[bytes, int] = {}
        self._rows: list[np.ndarray] = []

    def __len__(self) -> int:
        return len(self._rows)

    def row(self, fmt: str, state: Any, allowed: np.ndarray) -> int:
        """The 1-based row of `allowed` ([V] bool), the mask of `fmt` in `state`: a new row, or
        the row of the same bits."""
        key = (fmt, state)
        row = self._by_state.get(key)
        if row is None:
            words = np.zeros(mask_words(self.vocab_size) * 4, np.uint8)
            bits = np.packbits(allowed, bitorder="little")
            words[: bits.size] = bits
            row = self._by_bits.setdefault(words.tobytes(), len(self._rows) + 1)
            if row == len(self._rows) + 1:
                self._rows.append(words.view("<u4"))
            self._by_state[key] = row
        return row

    def _mask(self, fmt: str) -> TokenMask:
        try:
            return mask_for(fmt, self.tokenizer, self.vocab_size)
        except (ValueError, KeyError, TypeError) as e:
            raise ValueError(f"response format {fmt[:60]!r} cannot be rebuilt ({e})") from None

    def replay(self, fmt: str, tokens: Sequence[int], offset: int = 0) -> np.ndarray:
        """int32 [n]: the row of each token of one constrained reply under `fmt`, the
        automaton started fresh at its first token and advanced by each.

        Raises:
          ValueError: a token the replayed state does not allow, or one after the stop id that
            ended the reply (naming its completion position: `offset` + its index).
        """
        mask = self._mask(fmt)
        stops = frozenset(mask.stop_ids.tolist())
        state, ended = mask.start(), False
        rows = np.empty(len(tokens), np.int32)
        for j, token in enumerate(np.asarray(tokens, np.int64).tolist()):
            where = f"completion token {offset + j} (id {token})"
            if ended:
                raise ValueError(f"{where} follows the stop id that ended its constrained reply")
            allowed = mask.allowed(state)
            if not (0 <= token < self.vocab_size and allowed[token]):
                raise ValueError(f"{where} is not allowed by its response_format's mask here")
            rows[j] = self.row(fmt, state, allowed)
            if token in stops:
                ended = True
            else:
                state = mask.advance(state, token)
        return rows

    def trajectory(
        self, formats: Sequence[str], format_index: np.ndarray, completion_ids: np.ndarray
    ) -> np.ndarray:
        """int32 [C]: each completion token's row (0 = free), every constrained run replayed.

        Raises:
          ValueError: a format index past `formats`, a format that cannot be rebuilt, or a
            token its replay does not allow (`replay`).
        """
        rows = np.zeros(len(completion_ids), np.int32)
        for start, end, i in constrained_runs(format_index):
            if not 0 < i <= len(formats):
                raise ValueError(
                    f"format index {i} at completion token {start} (of {len(formats)})"
                )
            rows[start:end] = self.replay(formats[i - 1], completion_ids[start:end], start)
        return rows

    def packed(self, multiple: int = 1) -> np.ndarray:
        """uint32 [M, W]: the rows (row r at index r − 1), M = `table_rows` of them, the rows
        past them all 0 (never indexed)."""
        table = np.zeros(
            (table_rows(len(self._rows), multiple), mask_words(self.vocab_size)), np.uint32
        )
        for r, words in enumerate(self._rows):
            table[r] = words
        return table
