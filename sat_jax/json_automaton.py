"""The byte automata of `response_format` (docs/DESIGN.md §6.6): which bytes may come next so
that a reply stays a prefix of one JSON value of the format. `sat_jax.json_mask` walks them over
the tokenizer's token trie to get token masks.

`json_object`: RFC 8259 with an object at the top, nesting bounded by `max_depth` (`step` over
`JsonState`). `json_schema`: the subset enforced exactly (`compile_schema` to `SchemaNode`s,
`schema_step` over a tuple of frames); anything else is refused naming the keyword
(`UnsupportedSchema`). Inside strings any byte of 0x20 and above is taken (UTF-8 validity is the
tokenizer's); `in_string` / `schema_in_string` say where a byte is a string's content.
"""

from __future__ import annotations

import dataclasses
import json
from typing import Any

WHITESPACE = frozenset(b" \t\n\r")
"""The bytes JSON allows between tokens."""
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
    if b in WHITESPACE:
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


def compact_json(value: Any) -> bytes:
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
        nodes[at] = SchemaNode("lit", lits=tuple(dict.fromkeys(compact_json(v) for v in values)))
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
        return frames if b in WHITESPACE else _open(nodes, rest, top[1], b)
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
    if b in WHITESPACE:
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
    if b in WHITESPACE:
        return (*rest, top)
    if phase == "after":
        if b == ord(","):
            return (*rest, ("arr", i, "value"))
        return rest if b == ord("]") else None
    if phase == "open" and b == ord("]"):
        return rest
    return _open(nodes, (*rest, ("arr", i, "after")), nodes[i].items, b)


def in_string(state: JsonState) -> bool:
    """Whether a byte in `state` is a string's content (not whitespace between tokens)."""
    return state.mode in _STRING_MODES


def schema_in_string(frames: tuple) -> bool:
    """Whether a byte in schema state `frames` is content: inside a free string, a declared key
    or an enum / const literal (whose bytes are matched as they are)."""
    if not frames:
        return False
    top = frames[-1]
    if top[0] == "json":
        return in_string(top[2])
    return top[0] == "lit" or (top[0] == "obj" and top[3] == "inkey")
