"""`response_format: json_object`'s token mask (sat_jax/json_mask.py; the engine's half,
rollout_server/json_mask.py): the byte automaton
accepts exactly the prefixes of one JSON object, the trie's mask equals a token-by-token check,
and a completion decoded under the mask is a JSON object whose log-probs are the masked
distribution's."""

from __future__ import annotations

import json
import threading

import jsonschema
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from rollout_server.json_mask import SlotFormats
from sat_jax.decoding import SEGMENT_COL, TOKEN_COL, VALID_COL
from sat_jax.json_automaton import JsonState, UnsupportedSchema, compile_schema, schema_step, step
from sat_jax.json_mask import (
    JsonObjectMask,
    JsonSchemaMask,
    mask_for,
    masked_logprobs,
    parse_response_format,
)
from sat_jax.tasks.hf_tokenizer import HFTokenizer
from tests.hf_fixtures import make_tokenizer

VALID = [
    "{}",
    ' { "a" : 1 } ',
    '{"a": [1, -2.5e+3, 0, 0.25E-1, true, false, null, "x\\u00e9\\n", {}, [], [[]]]}',
    '{"k": {"nested": {"deep": ["\\"quoted\\"", "\\\\"]}}, "n": -0}',
    '{"utf8": "é日本"}',
]
INVALID = [
    "[1]", '"a"', "1", "{,}", '{"a"}', '{"a":}', '{"a": 01}', '{"a": 1.}', '{"a": -}',
    '{"a": tru}', '{"a": 1,}', '{"a": [1,]}', '{"a": "\\x"}', '{"a": "\\u12g4"}', '{"a": 1}}',
    '{"a": 1} x', '{"a": "line\nbreak"}', "{'a': 1}",
]  # fmt: skip


def _run(text: str, max_depth: int = 32) -> JsonState | None:
    state: JsonState | None = JsonState()
    for b in text.encode():
        state = step(state, b, max_depth)
        if state is None:
            return None
    return state


@pytest.mark.parametrize("text", VALID)
def test_every_json_object_is_accepted_and_complete(text):
    state = _run(text.strip())
    assert state is not None and state.complete
    for k in range(len(text.strip().encode())):  # every prefix is a live state, not complete
        prefix = text.strip().encode()[:k].decode(errors="ignore")
        assert _run(prefix) is not None


@pytest.mark.parametrize("text", INVALID)
def test_what_is_no_json_object_is_refused(text):
    state = _run(text)
    assert state is None or not state.complete, text


def test_nesting_is_bounded():
    assert _run('{"a": [[1]]}', max_depth=3).complete
    assert _run('{"a": [[[1]]]}', max_depth=3) is None


JSON = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=5), inner, max_size=3),
    max_leaves=12,
)  # fmt: skip


@settings(max_examples=200, deadline=None)
@given(st.dictionaries(st.text(max_size=5), JSON, max_size=4), st.booleans(), st.booleans())
def test_json_dumps_of_any_object_is_accepted(obj, ascii_only, indent):
    text = json.dumps(obj, ensure_ascii=ascii_only, indent=2 if indent else None)
    state = _run(text)
    assert state is not None and state.complete, text


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    path = tmp_path_factory.mktemp("tok")
    make_tokenizer(path)
    return HFTokenizer(str(path), chat_template=True)


def test_the_tries_mask_is_every_token_checked_one_by_one(tok):
    vocab = len(tok) + 5  # padded rows: never allowed
    mask = JsonObjectMask(tok, vocab)
    ids = tok._tok('{"a": [1, "b\\u00e9", {"c": tr', add_special_tokens=False)["input_ids"]
    state = mask.start()
    for i in [None, *ids]:
        if i is not None:
            state = mask.advance(state, i)
        want = np.zeros(vocab, bool)
        for j in range(vocab):
            try:
                mask.advance(state, j)
                want[j] = j not in tok.stop_ids
            except ValueError:
                pass
        np.testing.assert_array_equal(mask.allowed(state), want)
    with pytest.raises(ValueError, match="cannot continue"):
        mask.advance(mask.start(), tok._tok("[", add_special_tokens=False)["input_ids"][0])


def test_a_constrained_completion_is_an_object_with_the_masked_logprobs(tok):
    """A policy steered towards a target text (its next token's logit raised), the rest random:
    every step samples from the masked distribution, whose log-prob is recorded; the target's
    own tokens are always allowed, and the completion ends with a stop id once it is whole."""
    vocab = len(tok)
    mask = JsonObjectMask(tok, vocab)
    target = '{"answer": 12, "steps": ["5 + 7", "é"], "ok": true}'
    plan = [*tok._tok(target, add_special_tokens=False)["input_ids"], min(tok.stop_ids)]
    rng = np.random.default_rng(0)
    state, out, logps = mask.start(), [], []
    for want in plan:
        allowed = mask.allowed(state)
        assert allowed[want]
        logits = rng.normal(size=vocab)
        logits[want] += 40.0
        logp = masked_logprobs(logits, allowed)
        # From the definition: the model's probabilities restricted to the mask, renormalized.
        p = np.exp(logits - logits.max())
        p = p / p.sum()
        renormalized = np.where(allowed, p, 0.0) / p[allowed].sum()
        np.testing.assert_allclose(np.exp(logp), renormalized, rtol=1e-12, atol=1e-300)
        assert np.all(np.isneginf(logp[~allowed]))
        token = int(rng.choice(vocab, p=np.exp(logp)))
        assert token == want  # the steering dominates; a disallowed id is never drawn
        logps.append((logp[token], np.log(p[token]), p[allowed].sum(), allowed.all()))
        out.append(token)
        if token in tok.stop_ids:
            break
        state = mask.advance(state, token)
    assert mask.complete(state) and out[-1] in tok.stop_ids
    assert json.loads(tok.decode(out)) == json.loads(target)
    # The recorded log-probs are the masked distribution's: the model's own minus the log of the
    # mass the mask kept (every step here took some away).
    for masked, full, mass, whole in logps:
        assert not whole and np.isclose(masked, full - np.log(mass), rtol=0, atol=1e-12)


# ---- json_schema -------------------------------------------------------------------------------

SCHEMA = {
    "type": "object",
    "title": "a reply",
    "properties": {
        "name": {"type": "string", "description": "who"},
        "age": {"type": "integer"},
        "score": {"type": "number"},
        "tags": {"type": "array", "items": {"enum": ["a", "b", 1, 12]}},
        "ok": {"type": "boolean"},
        "none": {"type": "null"},
        "anything": {},
        "free": {"type": "object"},
        "nested": {
            "type": "object",
            "properties": {'k"ey': {"const": 'v"1é'}},
            "required": ['k"ey'],
            "additionalProperties": False,
        },
    },
    "required": ["name", "age"],
}
SCHEMA_VALID = [
    '{"name":"x","age":3}',
    ' { "age" : -10 , "name" : "é\\n\\u00e9" }',
    '{"name":"","age":0,"tags":[1,12,"a"],"ok":true,"score":-1.5e3,"none":null}',
    '{"name":"n","age":7,"anything":[1,{"q":"2"}],"free":{"z":[]},"nested":{"k\\"ey":"v\\"1é"}}',
    '{"name":"n","age":7,"tags":[]}',
]
SCHEMA_INVALID = [
    '{"name":"x"}',  # a required property missing
    '{"name":"x","age":3.5}',  # not an integer
    '{"name":"x","age":1e3}',
    '{"name":"x","age":3,"extra":1}',  # undeclared
    '{"name":"x","age":3,"name":"y"}',  # twice
    '{"name":"x","age":3,"tags":[2]}',  # not in the enum
    '{"name":"x","age":3,"tags":[123]}',
    '{"name":1,"age":3}',
    '{"name":"x","age":3,}',
    '{"name":"x","age":3,"ok":tru}',
    '{"name":"x","age":3,"nested":{"k\\"ey":"v\\"1"}}',
    '{"name":"x","age":3,"nested":{}}',
    '["name"]',
    '{"name":"x","age":3} ',
]


def _run_schema(schema, text):
    nodes, state = compile_schema(schema), (("val", 0),)
    for b in text.encode():
        state = schema_step(nodes, state, b)
        if state is None:
            return None
    return state


@pytest.mark.parametrize("text", SCHEMA_VALID)
def test_every_instance_of_the_schema_is_accepted_and_every_prefix_is_live(text):
    jsonschema.validate(json.loads(text), SCHEMA)
    assert _run_schema(SCHEMA, text) == ()
    raw = text.encode()
    for k in range(len(raw)):
        state = _run_schema(SCHEMA, raw[:k].decode(errors="ignore"))
        assert state is not None and state != (), raw[:k]


@pytest.mark.parametrize("text", SCHEMA_INVALID)
def test_what_the_schema_refuses_is_never_a_whole_value(text):
    assert _run_schema(SCHEMA, text) != ()
    if text.strip().startswith("{") and text.count("{") == text.count("}"):
        assert _run_schema(SCHEMA, text) is None, text


INSTANCES = st.fixed_dictionaries(
    {"name": st.text(max_size=6), "age": st.integers()},
    optional={
        "score": st.floats(allow_nan=False, allow_infinity=False) | st.integers(),
        "tags": st.lists(st.sampled_from(["a", "b", 1, 12]), max_size=4),
        "ok": st.booleans(),
        "none": st.none(),
        "anything": JSON,
        "free": st.dictionaries(st.text(max_size=3), JSON, max_size=2),
        "nested": st.just({'k"ey': 'v"1é'}),
    },
)


@settings(max_examples=200, deadline=None)
@given(INSTANCES, st.booleans(), st.booleans(), st.randoms())
def test_json_dumps_of_any_instance_is_accepted(obj, ascii_only, indent, rnd):
    items = list(obj.items())
    rnd.shuffle(items)  # properties in any order
    # Enum and const values are taken in their one spelling (non-ASCII as it is).
    ascii_only = ascii_only and "nested" not in obj
    text = json.dumps(dict(items), ensure_ascii=ascii_only, indent=2 if indent else None)
    assert _run_schema(SCHEMA, text) == (), text


@pytest.mark.parametrize(
    ("schema", "keyword"),
    [
        ({"type": "object", "properties": {"a": {"type": "string", "pattern": "x"}}}, "pattern"),
        ({"type": "object", "properties": {"a": {"anyOf": [{"type": "string"}]}}}, "anyOf"),
        ({"type": "object", "properties": {"a": {"$ref": "#/$defs/x"}}}, "$ref"),
        ({"type": "object", "properties": {"a": {"type": ["string", "null"]}}}, "type"),
        ({"type": "object", "minProperties": 1}, "minProperties"),
        ({"type": "array", "items": {"type": "string"}}, "type"),  # the root is no object
        ({"type": "object", "properties": {"a": {}}, "required": ["b"]}, "required"),
        ({"type": "object", "properties": {"a": {"enum": []}}}, "enum"),
        ({"type": "object", "properties": {"a": {"const": [1]}}}, "enum"),
        ({"type": "object", "properties": {"a": {"type": "integer", "enum": ["x"]}}}, "enum"),
    ],
)
def test_what_is_not_enforced_exactly_is_refused_naming_the_keyword(schema, keyword):
    with pytest.raises(UnsupportedSchema) as e:
        compile_schema(schema)
    assert e.value.keyword == keyword and repr(keyword) in str(e.value)
    fmt = {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}
    with pytest.raises(UnsupportedSchema):
        parse_response_format(fmt)


def test_response_formats_have_one_canonical_string():
    assert parse_response_format({"type": "text"}) is None
    assert parse_response_format({"type": "json_object"}) == '{"type":"json_object"}'
    a = {"type": "json_schema", "json_schema": {"name": "a", "strict": True, "schema": SCHEMA}}
    b = {
        "type": "json_schema",
        "json_schema": {"name": "b", "schema": dict(reversed(SCHEMA.items()))},
    }
    assert parse_response_format(a) == parse_response_format(b)
    for bad in [
        {"type": "xml"},
        {"type": "json_schema"},
        "json",
        {"type": "json_schema", "json_schema": {}},
    ]:
        with pytest.raises(ValueError):
            parse_response_format(bad)


def test_the_schema_tries_mask_is_every_token_checked_one_by_one(tok):
    vocab = len(tok) + 3
    mask = JsonSchemaMask(SCHEMA, tok, vocab)
    text = '{"tags": [12, "a"], "name": "b\\u00e9", "age": -4, "ok": tr'
    state = mask.start()
    for i in [None, *tok._tok(text, add_special_tokens=False)["input_ids"]]:
        if i is not None:
            state = mask.advance(state, i)
        want = np.zeros(vocab, bool)
        for j in range(vocab):
            try:
                mask.advance(state, j)
                want[j] = True
            except ValueError:
                pass
        np.testing.assert_array_equal(mask.allowed(state), want)
    state = mask.advance(state, tok._tok("ue}", add_special_tokens=False)["input_ids"][0])


@pytest.mark.parametrize("text", SCHEMA_VALID)
def test_every_token_of_a_valid_reply_is_allowed_where_it_stands(tok, text):
    fmt = parse_response_format({"type": "json_schema", "json_schema": {"schema": SCHEMA}})
    mask = mask_for(fmt, tok, len(tok))
    assert mask is mask_for(fmt, tok, len(tok))  # built once per format
    state = mask.start()
    for i in tok._tok(text, add_special_tokens=False)["input_ids"]:
        assert mask.allowed(state)[i]
        state = mask.advance(state, i)
    assert mask.complete(state)
    np.testing.assert_array_equal(np.flatnonzero(mask.allowed(state)), sorted(tok.stop_ids))


# ---- the engine's per-slot formats ---------------------------------------------------------------


def _step_data(slots, tokens, segments, valid=None):
    """One generate step's [B, 8] output with the columns SlotFormats reads."""
    data = np.zeros((slots, 8), np.int32)
    data[:, TOKEN_COL] = tokens
    data[:, SEGMENT_COL] = segments
    data[:, VALID_COL] = 1 if valid is None else valid
    return data


def test_slot_formats_follow_each_constrained_turn_and_nothing_else(tok):
    """The state advances by the token each step sampled under it, from the turn's segment on;
    a stop id ends the format; a free slot's row is all True; with no slot constrained the step
    gets no mask and nothing is read."""
    vocab = len(tok)
    formats = SlotFormats(tok, vocab, slots=3)
    fmt = parse_response_format({"type": "json_object"})
    ids = tok._tok('{"a": 1}', add_special_tokens=False)["input_ids"]
    assert formats.allowed() is None
    formats.sampled(_step_data(3, [5, 5, 5], [0, 0, 0]))  # nothing constrained: not kept
    formats.advance()
    formats.set(1, fmt, segment=2)  # slot 1's next turn (segment 2) is constrained
    mask = mask_for(fmt, tok, vocab)
    state = mask.start()
    for i, token in enumerate(ids):
        rows = formats.allowed()
        assert rows[[0, 2]].all()
        np.testing.assert_array_equal(rows[1], mask.allowed(state))
        # The first step after the extension still carries an older segment for slot 0 / 2.
        formats.sampled(_step_data(3, [7, token, 9], [0, 2, 0]))
        formats.advance()
        state = mask.advance(state, token)
        if i == 1:  # a step of an older segment of slot 1 (before the extension) is skipped
            formats.sampled(_step_data(3, [7, ids[i + 1], 9], [0, 1, 0]))
            formats.advance()
    assert mask.complete(state)
    np.testing.assert_array_equal(np.flatnonzero(formats.allowed()[1]), sorted(tok.stop_ids))
    formats.sampled(_step_data(3, [7, min(tok.stop_ids), 9], [0, 2, 0]))
    formats.advance()
    assert formats.allowed() is None  # the stop id ended the constrained turn
    # A new request in the slot replaces the format; an invalid step (exhausted slot) keeps it.
    formats.set(0, fmt, segment=0)
    formats.sampled(_step_data(3, [ids[0], 0, 0], [0, 0, 0], valid=[0, 0, 0]))
    formats.advance()
    np.testing.assert_array_equal(formats.allowed()[0], mask.allowed(mask.start()))
    formats.set(0, None, segment=0)
    assert formats.allowed() is None


def test_a_prefills_format_is_carried_on_its_own_thread(tok):
    formats = SlotFormats(tok, len(tok), slots=1)
    formats.next_prefill('{"type":"json_object"}')
    seen = []
    other = threading.Thread(target=lambda: seen.append(formats.take_prefill_format()))
    other.start()
    other.join()
    assert seen == [None]
    assert formats.take_prefill_format() == '{"type":"json_object"}'
    assert formats.take_prefill_format() is None  # taken once


class _ByteTokenizer:
    """One id per ASCII byte (its value) and one id of 24 spaces; id 0 stops."""

    stop_ids = frozenset({0})
    WIDE = 128

    def __len__(self) -> int:
        return 129

    def decode(self, ids) -> str:
        return "".join(" " * 24 if i == self.WIDE else chr(i) for i in ids if i != 0)


def _ids(text: str) -> list[int]:
    return [ord(c) for c in text]


@pytest.mark.parametrize(
    "mask",
    [
        lambda tok: JsonObjectMask(tok, len(tok)),
        lambda tok: JsonSchemaMask(
            {"type": "object", "properties": {"a": {"type": "string"}, "b": {"enum": ["x  y"]}}},
            tok,
            len(tok),
        ),
    ],
    ids=["json_object", "json_schema"],
)
def test_whitespace_runs_between_tokens_are_bounded_not_inside_strings(mask):
    """Between JSON tokens at most MAX_WHITESPACE whitespace bytes in a row (a weak policy
    cannot pad a reply to its token limit); a longer run is never allowed, in one token or
    many, and a non-whitespace byte starts the count again; spaces inside a string, a key or an
    enum literal are content and unbounded."""
    from sat_jax.json_mask import MAX_WHITESPACE

    tok = _ByteTokenizer()
    m = mask(tok)
    state = m.start()
    for i in _ids("{") + _ids("\n" + " " * (MAX_WHITESPACE - 2)):
        state = m.advance(state, i)
    assert m.allowed(state)[ord(" ")] and not m.allowed(state)[tok.WIDE]
    state = m.advance(state, ord(" "))  # the run is MAX_WHITESPACE bytes long
    allowed = m.allowed(state)
    assert not allowed[ord(" ")] and not allowed[ord("\n")] and allowed[ord('"')]
    with pytest.raises(ValueError, match="cannot continue"):
        m.advance(state, ord("\t"))
    for i in _ids('"a"') + _ids(" " * MAX_WHITESPACE) + _ids(":"):
        state = m.advance(state, i)  # the key ended the run: a new one may start
    for i in _ids(' "') + [tok.WIDE] * 3 + _ids("  "):
        state = m.advance(state, i)  # 76 spaces inside a string: content
    assert m.allowed(state)[tok.WIDE] and m.allowed(state)[ord(" ")]
    state = m.advance(state, ord('"'))
    assert not m.allowed(state)[tok.WIDE]  # 24 whitespace bytes after a value: too many
    if isinstance(m, JsonSchemaMask):  # an enum literal's inner spaces are its own bytes
        for i in _ids(', "b": "x  y"}'):
            state = m.advance(state, i)
    else:
        state = m.advance(state, ord("}"))
    assert m.complete(state)
