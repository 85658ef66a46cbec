"""`response_format` as a token mask: which ids may come next so that the reply stays a prefix of
one JSON value of the format (docs/DESIGN.md §6.6), and the trainer's replay of those masks.

A byte-level pushdown automaton walks a trie of the tokenizer's tokens by their raw bytes
(`token_bytes`: a token holding part of a UTF-8 character is its own bytes), so one walk per state
gives the mask of every id (`TokenMask`). `json_object`: RFC 8259 with an object at the top,
nesting bounded by `max_depth` (`step`, `JsonObjectMask`). `json_schema`: the subset enforced
exactly (`compile_schema`, `schema_step`, `JsonSchemaMask`); anything else is refused naming the
keyword (`UnsupportedSchema`). `parse_response_format` gives a format's canonical string and
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

import dataclasses
import itertools
import json
import re
import threading
from collections.abc import Sequence
from typing import Any

import numpy as np


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


_WS = frozenset(b" \t\n\r")
_DIGITS = frozenset(b"0123456789")
_HEX = frozenset(b"0123456789abcdefABCDEF")
_ESCAPES = frozenset(b'"\\/bfnrt')
_LITERALS = {ord("t"): b"rue", ord("f"): b"alse", ord("n"): b"ull"}
# Number states in which the number may end (the next byte then closes it).
_NUMBER_ENDS = frozenset({"zero", "int", "frac", "exp"})
_STRING_MODES = frozenset({"string", "escape", "hex"})


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
        if b in _WS and not self._in_string(inner):
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
        return state.mode in _STRING_MODES


def masked_logprobs(logits_v: np.ndarray, allowed_v: np.ndarray) -> np.ndarray:
    """[V] float64 log-probs of the constrained behavior distribution: the model's softmax
    renormalized over `allowed_v` (-inf elsewhere), what a constrained token's log-prob is."""
    z = np.where(allowed_v, np.asarray(logits_v, np.float64), -np.inf)
    top = np.max(z)
    return z - (top + np.log(np.sum(np.exp(z - top))))


# ---------------------------------------------------------------------------------------------
# json_schema: the subset enforced exactly.

# Keywords that only annotate (nothing to enforce).
_ANNOTATIONS = frozenset(
    {"title", "description", "$schema", "$id", "$comment", "default", "examples", "deprecated"}
)
_TYPES = ("object", "array", "string", "number", "integer", "boolean", "null")
_NUMBER_MODES = frozenset({"sign", "zero", "int", "dot", "frac", "e", "esign", "exp"})
_FRACTION_MODES = frozenset({"dot", "frac", "e", "esign", "exp"})


class UnsupportedSchema(ValueError):
    """A json_schema this server cannot enforce exactly; `keyword` names what is not served."""

    def __init__(self, keyword: str, why: str = "is not supported"):
        super().__init__(f"json_schema keyword {keyword!r} {why}")
        self.keyword = keyword


@dataclasses.dataclass(frozen=True)
class SchemaNode:
    """One compiled (sub)schema. `kind`: "object" (with `props`: (the name's JSON-escaped bytes,
    child node) each, `required`: indices into props), "array" (`items`: child node), "string",
    "number", "integer", "lit" (`lits`: the accepted values' JSON bytes, each in one spelling:
    enum and const of scalars, boolean, null), "any_object" (any JSON object) or "any" (any JSON value)."""

    kind: str
    props: tuple[tuple[bytes, int], ...] = ()
    required: frozenset[int] = frozenset()
    items: int = -1
    lits: tuple[bytes, ...] = ()


def _dumps(value: Any) -> bytes:
    return json.dumps(value, ensure_ascii=False, separators=(",", ":")).encode()


def compile_schema(schema: Any) -> tuple[SchemaNode, ...]:
    """The nodes of `schema` (node 0 its root, which must be an object).

    Served: type (one of object, array, string, number, integer, boolean, null), properties,
    required, items, enum, const, additionalProperties (replies hold the declared properties
    only, which satisfies any value of it) and the annotations (title, description, ...).

    Raises:
      UnsupportedSchema: any other keyword (anyOf, $ref, minimum, pattern, ...), a type list, or
        a root that is not an object; naming the keyword.
    """
    nodes: list[SchemaNode] = []
    _compile(schema, nodes, "schema")
    if nodes[0].kind not in ("object", "any_object"):
        raise UnsupportedSchema("type", "must be object at the root")
    return tuple(nodes)


def _compile(schema: Any, nodes: list[SchemaNode], where: str) -> int:
    if schema is True or schema == {}:
        nodes.append(SchemaNode("any"))
        return len(nodes) - 1
    if not isinstance(schema, dict):
        raise UnsupportedSchema(where, "must be a JSON object")
    for key in schema:
        if key not in _ANNOTATIONS and key not in (
            "type", "properties", "required", "items", "enum", "const", "additionalProperties"
        ):  # fmt: skip
            raise UnsupportedSchema(key)
    kind = schema.get("type")
    if kind is not None and kind not in _TYPES:
        raise UnsupportedSchema("type", f"must be one of {', '.join(_TYPES)} (got {kind!r})")
    at = len(nodes)
    nodes.append(SchemaNode("any"))  # placeholder: children come after their parent
    if "enum" in schema or "const" in schema:
        values = [schema["const"]] if "const" in schema else schema["enum"]
        if not isinstance(values, list) or not values:
            raise UnsupportedSchema("enum", "must be a non-empty list")
        if any(isinstance(v, (dict, list)) for v in values):
            raise UnsupportedSchema("enum", "values must be strings, numbers, booleans or null")
        values = [v for v in values if kind is None or _is_type(v, kind)]
        if not values:
            raise UnsupportedSchema("enum", f"has no value of type {kind}")
        nodes[at] = SchemaNode("lit", lits=tuple(dict.fromkeys(_dumps(v) for v in values)))
    elif kind in ("boolean", "null"):
        nodes[at] = SchemaNode("lit", lits=(b"true", b"false") if kind == "boolean" else (b"null",))
    elif kind == "object" or (kind is None and "properties" in schema):
        nodes[at] = _compile_object(schema, nodes)
    elif kind == "array" or (kind is None and "items" in schema):
        items = schema.get("items", True)
        nodes[at] = SchemaNode("array", items=_compile(items, nodes, "items"))
    elif kind in ("string", "number", "integer"):
        nodes[at] = SchemaNode(kind)
    return at


def _compile_object(schema: dict, nodes: list[SchemaNode]) -> SchemaNode:
    props = schema.get("properties", {})
    if not isinstance(props, dict):
        raise UnsupportedSchema("properties", "must be an object")
    required = schema.get("required", [])
    if not isinstance(required, list) or any(r not in props for r in required):
        raise UnsupportedSchema("required", "must list names that are in properties")
    if not props:
        return SchemaNode("any_object")
    names = list(props)
    children = tuple(
        (json.dumps(name, ensure_ascii=False)[1:-1].encode(), _compile(sub, nodes, name))
        for name, sub in props.items()
    )
    return SchemaNode(
        "object", props=children, required=frozenset(names.index(r) for r in required)
    )


def _is_type(value: Any, kind: str) -> bool:
    if kind in ("number", "integer"):
        ok = isinstance(value, (int, float)) and not isinstance(value, bool)
        return ok and (kind == "number" or float(value).is_integer())
    python = {"object": dict, "array": list, "string": str, "boolean": bool, "null": type(None)}
    return isinstance(value, python[kind])


# A schema state is a tuple of frames, the innermost last; () = the value is complete.
# ("val", node): a value of `node` comes next (leading whitespace allowed);
# ("json", node, JsonState): inside a string / number / unconstrained value (the JSON automaton);
# ("lit", node, prefix): inside one of the node's literal values;
# ("obj", node, seen, phase, key prefix, current property); ("arr", node, phase).


def schema_step(nodes: tuple[SchemaNode, ...], frames: tuple, b: int) -> tuple | None:
    """The schema state after byte `b`, or None where `b` cannot continue a value of it."""
    if not frames:
        return None
    top, rest = frames[-1], frames[:-1]
    kind = top[0]
    if kind == "val":
        return frames if b in _WS else _open(nodes, rest, top[1], b)
    if kind == "json":
        return _feed_json(nodes, rest, top, b)
    if kind == "lit":
        return _feed_lit(nodes, rest, top, b)
    if kind == "obj":
        return _feed_object(nodes, rest, top, b)
    return _feed_array(nodes, rest, top, b)


def _open(nodes: tuple[SchemaNode, ...], rest: tuple, i: int, b: int) -> tuple | None:
    """A value of node `i` starting with byte `b` (its parent, in `rest`, already after it)."""
    node = nodes[i]
    if node.kind == "object":
        return (*rest, ("obj", i, frozenset(), "open", b"", -1)) if b == ord("{") else None
    if node.kind == "array":
        return (*rest, ("arr", i, "open")) if b == ord("[") else None
    if node.kind == "lit":
        return _feed_lit(nodes, rest, ("lit", i, b""), b)
    if node.kind == "string":
        sub = JsonState((), "string", False) if b == 0x22 else None
    elif node.kind in ("number", "integer"):
        sub = _open_value((), b, 1) if b == ord("-") or b in _DIGITS else None
    elif node.kind == "any_object":
        sub = JsonState(("o",), "first_key") if b == ord("{") else None
    else:
        sub = _open_value((), b, 32)
    return _json_frame(rest, i, sub)


def _json_frame(rest: tuple, i: int, sub: JsonState | None) -> tuple | None:
    if sub is None:
        return None
    return rest if sub.complete else (*rest, ("json", i, sub))


def _feed_json(nodes: tuple[SchemaNode, ...], rest: tuple, top: tuple, b: int) -> tuple | None:
    i, sub = top[1], top[2]
    if sub.mode in _NUMBER_MODES and not sub.stack:  # a number ends at a byte not its own
        nxt = _number(sub.mode, b)
        if nxt is not None:
            if nodes[i].kind == "integer" and nxt in _FRACTION_MODES:
                return None
            return (*rest, ("json", i, JsonState((), nxt)))
        return schema_step(nodes, rest, b) if sub.mode in _NUMBER_ENDS else None
    return _json_frame(rest, i, step(sub, b, 32))


def _feed_lit(nodes: tuple[SchemaNode, ...], rest: tuple, top: tuple, b: int) -> tuple | None:
    i, prefix = top[1], top[2]
    lits, longer = nodes[i].lits, prefix + bytes((b,))
    if any(lit.startswith(longer) for lit in lits):
        if longer in lits and not any(
            len(lit) > len(longer) and lit.startswith(longer) for lit in lits
        ):
            return rest  # whole, and no other value goes on from it
        return (*rest, ("lit", i, longer))
    if prefix in lits:  # a whole number value (enum [1, 12]) ended: the parent takes `b`
        return schema_step(nodes, rest, b)
    return None


def _feed_object(nodes: tuple[SchemaNode, ...], rest: tuple, top: tuple, b: int) -> tuple | None:
    _, i, seen, phase, key, cur = top
    node = nodes[i]
    unseen = [j for j in range(len(node.props)) if j not in seen]
    if phase == "inkey":
        longer = key + bytes((b,))
        if any(node.props[j][0].startswith(longer) for j in unseen):
            return (*rest, ("obj", i, seen, "inkey", longer, -1))
        match = [j for j in unseen if node.props[j][0] == key]
        return (*rest, ("obj", i, seen, "colon", b"", match[0])) if b == 0x22 and match else None
    if b in _WS:
        return (*rest, top)
    if phase in ("open", "key") and b == 0x22 and unseen:
        return (*rest, ("obj", i, seen, "inkey", b"", -1))
    if phase == "colon":
        return (*rest, ("obj", i, seen, "value", b"", cur)) if b == ord(":") else None
    if phase == "value":
        after = (*rest, ("obj", i, seen | {cur}, "after", b"", -1))
        return _open(nodes, after, node.props[cur][1], b)
    if phase == "after" and b == ord(",") and unseen:
        return (*rest, ("obj", i, seen, "key", b"", -1))
    if phase in ("open", "after") and b == ord("}") and node.required <= seen:
        return rest
    return None


def _feed_array(nodes: tuple[SchemaNode, ...], rest: tuple, top: tuple, b: int) -> tuple | None:
    i, phase = top[1], top[2]
    if b in _WS:
        return (*rest, top)
    if phase == "after":
        if b == ord(","):
            return (*rest, ("arr", i, "value"))
        return rest if b == ord("]") else None
    if phase == "open" and b == ord("]"):
        return rest
    return _open(nodes, (*rest, ("arr", i, "after")), nodes[i].items, b)


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
        """Inside a free string, a declared key or an enum / const literal (whose bytes are
        matched as they are)."""
        if not state:
            return False
        top = state[-1]
        if top[0] == "json":
            return top[2].mode in _STRING_MODES
        return top[0] == "lit" or (top[0] == "obj" and top[3] == "inkey")


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
        return _dumps({"type": "json_object"}).decode()
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
