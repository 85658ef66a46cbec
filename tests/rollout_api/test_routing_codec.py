"""The routing wire format: decode ∘ encode is the identity; malformed messages are refused."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from rollout_api.proto import rollout_pb2
from rollout_api.routing_codec import decode_routing, encode_routing


@settings(max_examples=60, deadline=None)
@given(
    hnp.arrays(
        dtype=st.sampled_from([np.dtype("<u1"), np.dtype("<u2"), np.dtype(">u2")]),
        shape=hnp.array_shapes(min_dims=3, max_dims=3, min_side=0, max_side=6),
    )
)
def test_round_trip_through_the_wire(ids):
    message = rollout_pb2.Trajectory(routing=encode_routing(ids))
    wire = rollout_pb2.Trajectory.FromString(message.SerializeToString())
    out = decode_routing(wire.routing)
    assert out.dtype == np.dtype(ids.dtype.name) and out.dtype.isnative
    assert out.shape == ids.shape
    np.testing.assert_array_equal(out, ids)


def test_wire_bytes_are_little_endian_c_order():
    ids = np.arange(2 * 3 * 2, dtype=np.uint16).reshape(2, 3, 2) * 300
    routing = encode_routing(np.asfortranarray(ids))
    assert routing.dtype == "uint16" and list(routing.shape) == [2, 3, 2]
    assert routing.data == ids.astype("<u2").tobytes(order="C")


def test_decode_is_writable_copy():
    routing = encode_routing(np.zeros((1, 1, 2), np.uint8))
    out = decode_routing(routing)
    out[0, 0, 0] = 5  # a frombuffer view of the message would be read-only
    assert decode_routing(routing)[0, 0, 0] == 0


@pytest.mark.parametrize(
    ("ids", "match"),
    [
        (np.zeros((2, 1, 2), np.int32), "uint8 or uint16"),
        (np.zeros((2, 1, 2), np.uint32), "uint8 or uint16"),
        (np.zeros((2, 2), np.uint8), r"shape \[T, L, K\]"),
    ],
)
def test_encode_refuses(ids, match):
    with pytest.raises(ValueError, match=match):
        encode_routing(ids)


@pytest.mark.parametrize(
    ("routing", "match"),
    [
        (rollout_pb2.Routing(data=b"\0" * 4, shape=[1, 1, 1], dtype="int32"), "dtype 'int32'"),
        (rollout_pb2.Routing(data=b"", shape=[0, 1, 1], dtype=""), "dtype ''"),
        (rollout_pb2.Routing(data=b"\0" * 3, shape=[1, 1, 2], dtype="uint8"), "3 bytes"),
        (rollout_pb2.Routing(data=b"\0" * 2, shape=[1, 1, 2], dtype="uint16"), "needs 4"),
        (rollout_pb2.Routing(data=b"\0" * 2, shape=[2], dtype="uint8"), "shape"),
        (rollout_pb2.Routing(data=b"", shape=[-1, 1, 0], dtype="uint8"), "shape"),
    ],
)
def test_decode_refuses(routing, match):
    with pytest.raises(ValueError, match=match):
        decode_routing(routing)
