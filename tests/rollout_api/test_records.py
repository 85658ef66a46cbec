"""The wire's records: record → proto → bytes → record is the identity (routing in uint8 and
uint16, an empty completion, no routing), and every way a pulled group can be wrong is refused
with a message naming it."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from rollout_api import records
from rollout_api.proto import rollout_pb2
from rollout_api.routing_codec import encode_routing

L, K = 2, 3
LIMITS = records.GroupLimits(vocab_size=50, num_experts=300, routing_lk=(L, K))


def trajectory(
    c: int = 2, *, dtype=np.uint8, with_routing: bool = True, **kw
) -> records.Trajectory:
    p = 3
    fields = dict(
        prompt_ids=np.array([1, 5, 6], np.int32),
        completion_ids=np.arange(10, 10 + c, dtype=np.int32),
        behavior_logprobs=-np.linspace(0.25, 1.0, c, dtype=np.float32),
        versions=np.arange(c, dtype=np.int64) + 2**33,  # needs int64
        routing=(np.arange((p + c) * L * K).reshape(p + c, L, K) % 200).astype(dtype)
        if with_routing
        else None,
        reward=0.5,
        finish_reason="stop",
        completion_text="12",
    )
    return records.Trajectory(**(fields | kw))


def group(*trajectories: records.Trajectory) -> records.Group:
    return records.Group(
        group_id=7,
        prompt_id="p7",
        prompt_text="1+2=",
        answer="3",
        server_id="srv",
        trajectories=trajectories or (trajectory(),),
    )


def wire(g: records.Group) -> rollout_pb2.Group:
    """``to_proto``, through bytes, as a Pull delivers it."""
    return rollout_pb2.Group.FromString(records.to_proto(g).SerializeToString())


_DTYPES = {
    "prompt_ids": np.int32,
    "completion_ids": np.int32,
    "behavior_logprobs": np.float32,
    "versions": np.int64,
    "kept_counts": np.int32,
    "loss_mask": np.int64,
}


def values(t: rollout_pb2.Trajectory, name: str) -> list:
    """A per-token field of a message as a list (the packed form, as this server sends it)."""
    if not t.HasField(f"{name}_packed"):
        return []
    return records.unpack_array(getattr(t, f"{name}_packed"), _DTYPES[name]).tolist()


def set_values(t: rollout_pb2.Trajectory, name: str, new: list) -> None:
    """Sets a per-token field of a message (its packed form, as this server writes it)."""
    array = np.array(new, _DTYPES[name] if name != "loss_mask" else np.int32)
    getattr(t, f"{name}_packed").CopyFrom(records.pack_array(array))


def old_form(m: rollout_pb2.Group) -> rollout_pb2.Group:
    """The message as a server before packing wrote it: the repeated fields."""
    m = rollout_pb2.Group.FromString(m.SerializeToString())
    for t in m.trajectories:
        for name in _DTYPES:
            if t.HasField(f"{name}_packed"):
                getattr(t, name).extend(values(t, name))
                t.ClearField(f"{name}_packed")
    return m


def assert_same(a: records.Group, b: records.Group) -> None:
    for f in ("group_id", "prompt_id", "prompt_text", "answer", "server_id", "key"):
        assert getattr(a, f) == getattr(b, f), f
    assert len(a.trajectories) == len(b.trajectories)
    for x, y in zip(a.trajectories, b.trajectories, strict=True):
        for f in dataclasses.fields(x):
            u, v = getattr(x, f.name), getattr(y, f.name)
            if isinstance(u, np.ndarray):
                assert u.dtype == v.dtype and u.shape == v.shape, f.name
                np.testing.assert_array_equal(u, v, err_msg=f.name)
            else:
                assert u == v, f.name


@pytest.mark.parametrize("dtype", [np.uint8, np.uint16])
def test_round_trip(dtype):
    g = group(trajectory(dtype=dtype), trajectory(3, dtype=dtype, finish_reason="length"))
    back = records.decode_group(wire(g), LIMITS)
    assert_same(g, back)
    assert back.key == "srv/7" and back.trajectories[0].routing.dtype == dtype
    assert records.to_proto(g).trajectories[1].finish_reason == rollout_pb2.FINISH_REASON_LENGTH


def test_an_empty_completion_round_trips():
    g = group(trajectory(0, finish_reason="length", completion_text=""))
    back = records.decode_group(wire(g), LIMITS)
    assert_same(g, back)
    t = back.trajectories[0]
    assert t.completion_ids.shape == t.versions.shape == t.behavior_logprobs.shape == (0,)
    assert t.routing.shape == (3, L, K) and t.num_tokens == 3


def test_kept_counts_round_trip_and_are_absent_without_truncation():
    kept = trajectory(3, kept_counts=np.array([1, 20, 20_000], np.int32))
    message = wire(group(kept, trajectory(3)))
    back = records.decode_group(message, dataclasses.replace(LIMITS, vocab_size=20_000))
    np.testing.assert_array_equal(back.trajectories[0].kept_counts, [1, 20, 20_000])
    assert back.trajectories[0].kept_counts.dtype == np.int32
    assert back.trajectories[1].kept_counts is None  # nothing on the wire
    assert len(message.trajectories[1].kept_counts) == 0
    assert not message.trajectories[1].HasField("kept_counts_packed")
    # Packed: 1 byte per count below 256 (uint8), 2 below 65,536 (uint16).
    small = trajectory(3, kept_counts=np.array([5, 6, 7], np.int32))
    plain = trajectory(3)
    extra = records.to_proto(group(small)).ByteSize() - records.to_proto(group(plain)).ByteSize()
    # The three counts; the PackedArray's tag (2 bytes: field 16) and length, its data's tag and
    # length, its dtype's tag, length and name ("uint8").
    assert extra == 3 + 3 + 2 + 7
    wider = trajectory(3, kept_counts=np.array([5, 6, 700], np.int32))
    wider_extra = (
        records.to_proto(group(wider)).ByteSize() - records.to_proto(group(small)).ByteSize()
    )
    assert wider_extra == 3 + 1  # a byte more per count, "uint16" a character longer than "uint8"


def test_no_routing_without_replay():
    g = group(trajectory(with_routing=False))
    message = wire(g)
    assert not message.trajectories[0].HasField("routing")
    assert_same(g, records.decode_group(message))
    # A trainer that replays no routing does not decode it (nor check it).
    message.trajectories[0].routing.CopyFrom(rollout_pb2.Routing(data=b"junk", dtype="int8"))
    no_replay = dataclasses.replace(LIMITS, routing_lk=None)
    assert records.decode_group(message, no_replay).trajectories[0].routing is None


def test_an_unknown_finish_reason_is_unspecified():
    message = wire(group())
    message.trajectories[0].finish_reason = 7  # a reason of a newer server
    assert records.decode_group(message).trajectories[0].finish_reason == ""


def _set(path: str, value):
    """A change of the wire message: (field of trajectory 0, new value)."""

    def change(t: rollout_pb2.Trajectory) -> None:
        if isinstance(value, rollout_pb2.Routing):
            t.routing.CopyFrom(value)
        elif path == "clear":
            t.ClearField(value)
        elif isinstance(value, list):
            set_values(t, path, value)
        else:
            setattr(t, path, value)

    return change


R = np.zeros((5, L, K), np.uint8)


@pytest.mark.parametrize(
    "change, message",
    [
        (_set("completion_ids", [10, 50]), "completion token id 50 outside [0, 50) (the vocab"),
        (_set("prompt_ids", [1, -1, 6]), "prompt token id -1 outside [0, 50)"),
        (_set("behavior_logprobs", [-0.5]), "2 completion tokens but 1 behavior log-probs"),
        (_set("versions", [1, 2, 3]), "but 2 behavior log-probs and 3 versions"),
        (_set("prompt_ids", []), "prompt_ids is empty"),
        (_set("behavior_logprobs", [-0.5, float("nan")]), "log-prob is not finite"),
        (_set("reward", float("inf")), "reward inf is not finite"),
        (_set("clear", "routing"), "no routing (the trainer replays routing)"),
        (
            _set("", rollout_pb2.Routing(data=b"\0" * 3, shape=[1, 1, 2], dtype="uint8")),
            "unreadable routing (routing data has 3 bytes",
        ),
        (
            _set("", rollout_pb2.Routing(data=b"\0" * 4, shape=[2, 2], dtype="uint8")),
            "unreadable routing (routing shape must be [T, L, K]",
        ),
        (_set("", encode_routing(np.zeros((4, L, K), np.uint8))), "routing has 4 positions"),
        (_set("", encode_routing(np.zeros((5, L, K + 1), np.uint8))), "(L, K) = (2, 4), expect"),
        (
            _set("", encode_routing(np.full((5, L, K), 300, np.uint16))),
            "routing id 300 outside [0, 300) (the experts)",
        ),
        (_set("kept_counts", [3]), "2 completion tokens but 1 kept counts"),
        (_set("kept_counts", [3, 0]), "a kept count is 0, must be >= 1"),
        (_set("kept_counts", [3, 51]), "a kept count 51 exceeds the vocabulary 50"),
        (_set("loss_mask", [1, 0, 1]), "loss_mask has 3 entries, expected one per completion"),
        (_set("loss_mask", [1]), "loss_mask has 1 entries, expected one per completion"),
        (_set("loss_mask", [1, 2]), "loss_mask[1] is 2; entries must be 0 or 1"),
        (_set("loss_mask", [0, 1]), "loss_mask[0] is 0: the first completion token is the policy"),
    ],
)
def test_every_invalid_group_is_refused_naming_what_is_wrong(change, message):
    m = wire(group(trajectory(), trajectory()))
    change(m.trajectories[1])
    with pytest.raises(records.InvalidGroupError, match=r"^group srv/7, trajectory 1: ") as info:
        records.decode_group(m, LIMITS)
    assert message in str(info.value)
    [invalid] = records.decode_pulled([m], LIMITS)
    assert isinstance(invalid, records.InvalidGroup)
    assert (invalid.key, invalid.group_id, invalid.prompt_id) == ("srv/7", 7, "p7")
    assert message in invalid.problem


def test_range_checks_need_the_limits():
    m = wire(group())
    set_values(m.trajectories[0], "completion_ids", [10_000, 11])
    assert records.decode_group(m).trajectories[0].completion_ids[0] == 10_000
    with pytest.raises(records.InvalidGroupError, match="token id 10000"):
        records.decode_group(m, LIMITS)


def test_decode_pulled_keeps_the_order():
    good, bad = wire(group()), wire(dataclasses.replace(group(), group_id=8))
    set_values(bad.trajectories[0], "prompt_ids", [99, 5, 6])
    out = records.decode_pulled([good, bad, good], LIMITS)
    assert [type(g).__name__ for g in out] == ["Group", "InvalidGroup", "Group"]
    assert [g.key for g in out] == ["srv/7", "srv/8", "srv/7"]


@pytest.mark.parametrize(
    "fields, message",
    [
        (dict(prompt_ids=np.array([1, 5, 6], np.int64)), "prompt_ids must be a 1-D int32"),
        (dict(versions=[1, 2]), "versions must be a 1-D int64 array, got list"),
        (dict(routing=np.zeros((5, L, K), np.int32)), "routing must be a uint8/uint16"),
        (dict(routing=np.zeros((5, L), np.uint8)), "routing must be a uint8/uint16"),
        (dict(finish_reason="eos"), "unknown finish_reason 'eos'"),
        (dict(kept_counts=np.array([1, 2], np.int64)), "kept_counts must be a 1-D int32"),
        (dict(kept_counts=np.array([1], np.int32)), "2 completion tokens but 1 kept counts"),
        (dict(loss_mask=np.array([1, 0], np.uint8)), "loss_mask must be a 1-D bool array"),
        (dict(loss_mask=np.array([True])), "2 completion tokens but 1 loss mask entries"),
        (dict(loss_mask=np.array([False, True])), "loss_mask starts with an inserted token"),
        (
            dict(loss_mask=np.array([True, False]), behavior_logprobs=np.array([np.nan, 0], "f4")),
            "a behavior log-prob is not finite",
        ),
        (
            dict(loss_mask=np.array([True, False]), kept_counts=np.array([0, 1], np.int32)),
            "a kept count is 0, must be >= 1",
        ),
    ],
)
def test_a_record_is_well_formed_by_construction(fields, message):
    with pytest.raises(ValueError, match=message):
        trajectory(**fields)


def multi_turn(**kw) -> records.Trajectory:
    """Two turns and an end-of-turn token closing the second: generated, observation (3 tokens),
    generated, inserted; the inserted positions' log-probs, versions and kept counts are
    garbage (unspecified on the wire); their routing is real (the extension recorded it)."""
    gen = np.array([1, 1, 0, 0, 0, 1, 1, 0], bool)
    obs = ~gen
    t = trajectory(8, dtype=np.uint16, kept_counts=np.full(8, 7, np.int32), **kw)
    behavior, versions = t.behavior_logprobs.copy(), t.versions.copy()
    kept = t.kept_counts.copy()
    behavior[obs] = [np.nan, np.inf, -np.inf, 1e30]
    versions[obs] = -(2**40)
    kept[obs] = [0, -3, 10**6, 0]
    return dataclasses.replace(
        t, loss_mask=gen, behavior_logprobs=behavior, versions=versions, kept_counts=kept
    )


def test_a_multi_turn_loss_mask_round_trips_one_entry_per_token():
    t = multi_turn()
    m = wire(group(t, trajectory(8, dtype=np.uint16)))
    assert values(m.trajectories[0], "loss_mask") == [1, 1, 0, 0, 0, 1, 1, 0]
    assert values(m.trajectories[1], "loss_mask") == []  # single-turn: nothing on the wire
    assert list(m.trajectories[1].loss_mask) == []
    back = records.decode_group(m, LIMITS)  # garbage at inserted positions is not an error
    assert_same(group(t, trajectory(8, dtype=np.uint16)), back)
    assert back.trajectories[0].loss_mask.dtype == np.bool_
    assert back.trajectories[1].loss_mask is None
    assert back.trajectories[0].num_generated == 4 and back.trajectories[1].num_generated == 8
    np.testing.assert_array_equal(back.trajectories[1].generated, np.ones(8, bool))


def test_the_loss_mask_costs_one_byte_per_token_and_nothing_for_single_turn():
    plain = trajectory(8)
    t = dataclasses.replace(plain, loss_mask=multi_turn().loss_mask)
    extra = records.to_proto(group(t)).ByteSize() - records.to_proto(group(plain)).ByteSize()
    # Eight bytes (uint8); the PackedArray's tag (2 bytes: field 17) and length, its data's tag
    # and length, its dtype's tag, length and name ("uint8").
    assert extra == 8 + 3 + 2 + 7
    # No mask (a single-turn trajectory) is sent as nothing.
    assert list(records.to_proto(group(plain)).trajectories[0].loss_mask) == []
    assert not records.to_proto(group(plain)).trajectories[0].HasField("loss_mask_packed")


def test_an_old_servers_trajectory_is_all_generated():
    """A message without the field (a server from before multi-turn) decodes to loss_mask None."""
    m = wire(group())
    m.trajectories[0].ClearField("loss_mask")
    m.trajectories[0].ClearField("loss_mask_packed")
    assert records.decode_group(m, LIMITS).trajectories[0].loss_mask is None


@pytest.mark.parametrize("make", [lambda: group(), lambda: group(multi_turn(), trajectory(8))])
def test_an_old_servers_repeated_fields_decode_as_the_packed_ones(make):
    """A message of a server from before packing (the repeated fields) decodes to the same
    record; this server sends no per-token repeated field and no per-token Python list."""
    g = make()
    m = wire(g)
    for t in m.trajectories:
        assert all(len(getattr(t, name)) == 0 for name in _DTYPES)
    old = old_form(m)
    assert all(not t.HasField("prompt_ids_packed") for t in old.trajectories)
    assert_same(records.decode_group(m, LIMITS), records.decode_group(old, LIMITS))
    assert_same(g, records.decode_group(old, LIMITS))


@pytest.mark.parametrize(
    "name, packed, message",
    [
        (
            "prompt_ids",
            rollout_pb2.PackedArray(data=b"\0" * 8, dtype="int64"),
            "packed dtype 'int64'",
        ),
        ("completion_ids", rollout_pb2.PackedArray(data=b"\0" * 3, dtype="int32"), "3 bytes are"),
        ("behavior_logprobs", rollout_pb2.PackedArray(data=b"", dtype="float64"), "'float64'"),
        ("versions", rollout_pb2.PackedArray(data=b"\0", dtype="bool"), "packed dtype 'bool'"),
    ],
)
def test_an_unreadable_packed_array_is_refused(name, packed, message):
    m = wire(group(trajectory(), trajectory()))
    getattr(m.trajectories[1], f"{name}_packed").CopyFrom(packed)
    with pytest.raises(records.InvalidGroupError, match=r"^group srv/7, trajectory 1: ") as info:
        records.decode_group(m, LIMITS)
    assert f"unreadable {name} (" in str(info.value) and message in str(info.value)


@pytest.mark.parametrize(
    "array, dtype",
    [
        (np.array([0, 255], np.int32), "uint8"),
        (np.array([0, 256], np.int32), "uint16"),
        (np.array([-1, 5], np.int32), "int32"),
        (np.array([0, 2**40], np.int64), "int64"),
        (np.array([True, False]), "uint8"),
        (np.array([-0.5, np.nan], np.float32), "float32"),
        (np.zeros(0, np.int32), "uint8"),
    ],
)
def test_pack_array_is_the_narrowest_dtype_and_round_trips(array, dtype):
    packed = records.pack_array(array)
    assert packed.dtype == dtype
    assert len(packed.data) == array.size * np.dtype(dtype).itemsize
    target = np.uint8 if array.dtype == np.bool_ else array.dtype
    back = records.unpack_array(packed, target)
    assert back.dtype == target and back.flags.writeable
    np.testing.assert_array_equal(back, array.astype(target))


def test_strip_texts_leaves_everything_else():
    m = wire(group(trajectory(), trajectory()))
    kept = rollout_pb2.Group.FromString(m.SerializeToString())
    records.strip_texts([m])
    assert m.prompt_text == m.answer == "" and all(t.completion_text == "" for t in m.trajectories)
    for f in ("prompt_text", "answer"):
        kept.ClearField(f)
    for t in kept.trajectories:
        t.ClearField("completion_text")
    assert m == kept
    back = records.decode_group(m, LIMITS)
    assert back.prompt_text == "" and back.trajectories[0].completion_text == ""


@pytest.mark.parametrize(
    "values",
    [[], [1, 1, 1, 1, 1], [1, 0, 0, 0, 0], [1, 1, 0, 1, 0]],
)
def test_loss_mask_decode_and_encode(values):
    mask = records.decode_loss_mask(values, 5)
    if not values:
        assert mask is None and records.encode_loss_mask(mask) == []
        return
    np.testing.assert_array_equal(mask, np.array(values, bool))
    assert records.encode_loss_mask(mask) == values


@pytest.mark.parametrize(
    "position, value, message",
    [
        (0, 300, r"routing id 300 outside \[0, 300\)"),  # a prompt position: replayed
        (3, 300, r"routing id 300 outside \[0, 300\)"),  # the first (generated) completion token
        # An observation: the extension recorded it and R3 replays it, so it is checked too.
        (5, 300, r"routing id 300 outside \[0, 300\)"),
        (5, 299, None),
    ],
)
def test_routing_is_checked_at_every_replayed_position(position, value, message):
    t = multi_turn()
    routing = t.routing.copy()
    routing[position] = value
    m = wire(group(dataclasses.replace(t, routing=routing)))
    if message is None:
        records.decode_group(m, LIMITS)
    else:
        with pytest.raises(records.InvalidGroupError, match=message):
            records.decode_group(m, LIMITS)


def test_kept_counts_over_the_vocabulary_are_refused_only_at_generated_tokens():
    t = multi_turn()
    kept = t.kept_counts.copy()
    kept[2] = 51  # an observation token
    records.decode_group(wire(group(dataclasses.replace(t, kept_counts=kept))), LIMITS)
    kept[1] = 51
    with pytest.raises(records.InvalidGroupError, match="a kept count 51 exceeds"):
        records.decode_group(wire(group(dataclasses.replace(t, kept_counts=kept))), LIMITS)


def test_a_forked_groups_sessions_round_trip_and_cost_nothing_without_forks():
    plain = group(trajectory(), trajectory())
    assert plain.sessions == () and wire(plain).sessions == []
    assert plain.session_ids.tolist() == [0, 1]
    # Without forks the message is the one a server without the field sends.
    assert (
        records.to_proto(plain).SerializeToString()
        == records.to_proto(dataclasses.replace(plain)).SerializeToString()
    )
    assert not records.to_proto(plain).ListFields()[-1][0].name == "sessions"
    forked = dataclasses.replace(plain, trajectories=(trajectory(),) * 3, sessions=(0, 0, 1))
    back = records.decode_group(wire(forked))
    assert back.sessions == (0, 0, 1) and back.session_ids.tolist() == [0, 0, 1]


@pytest.mark.parametrize(
    "sessions, message",
    [((0, 1), "2 sessions for 3 trajectories"), ((0, 2, 2), "in order"), ((1, 1, 1), "in order")],
)
def test_bad_sessions_are_refused_where_the_group_is_built_and_where_it_is_pulled(
    sessions, message
):
    three = (trajectory(),) * 3
    with pytest.raises(ValueError, match=message):
        dataclasses.replace(group(), trajectories=three, sessions=sessions)
    m = wire(group(*three))
    m.sessions.extend(sessions)
    with pytest.raises(records.InvalidGroupError, match=f"group srv/7: .*{message}"):
        records.decode_group(m)


FORMATS = ('{"type":"json_object"}', '{"schema":{"type":"object"},"type":"json_schema"}')


def test_response_formats_round_trip_one_byte_per_token_and_nothing_when_free():
    t = dataclasses.replace(
        multi_turn(),
        response_formats=FORMATS,
        format_index=np.array([1, 1, 0, 0, 0, 2, 2, 0], np.int32),
    )
    m = wire(group(t, trajectory(8)))
    packed = m.trajectories[0].format_index_packed
    assert packed.dtype == "uint8" and len(packed.data) == 8
    assert list(m.trajectories[0].response_formats) == list(FORMATS)
    assert not m.trajectories[1].HasField("format_index_packed")
    back = records.decode_group(m, LIMITS)
    assert_same(group(t, trajectory(8)), back)
    assert back.trajectories[1].response_formats == () and back.trajectories[1].format_index is None


@pytest.mark.parametrize(
    ("index", "formats", "message"),
    [
        ([1, 1, 0, 0, 0, 3, 3, 0], FORMATS, r"a format index outside \[0, 2\]"),
        ([1, 1, 1, 0, 0, 2, 2, 0], FORMATS, "an inserted token has a response format"),
        ([1, 1, 0], FORMATS, "8 completion tokens but 3 format indices"),
        (None, FORMATS, "2 response formats but no format index"),
    ],
)
def test_a_format_index_that_does_not_fit_is_refused(index, formats, message):
    index = None if index is None else np.array(index, np.int32)
    with pytest.raises(ValueError, match=message):
        dataclasses.replace(multi_turn(), response_formats=formats, format_index=index)
    if index is not None and len(index) == 8:  # and where it is pulled, naming the trajectory
        m = wire(group(trajectory(8, loss_mask=multi_turn().loss_mask)))
        m.trajectories[0].response_formats.extend(formats)
        m.trajectories[0].format_index_packed.CopyFrom(records.pack_array(index))
        with pytest.raises(records.InvalidGroupError, match=f"trajectory 0: .*{message}"):
            records.decode_group(m, LIMITS)
