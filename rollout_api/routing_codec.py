"""The wire format of a trajectory's routing ids, in one place for both ends (docs/DESIGN.md §6).

`rollout_pb2.Routing` carries a C-order array [T, L, K] (T = prompt + completion tokens, L MoE
layers, K experts per token) as little-endian bytes of `dtype` "uint8" or "uint16". The server
encodes with `encode_routing`, the trainer decodes with `decode_routing`.

Only numpy and the generated proto: the trainer imports this without grpc or JetStream.
"""

from __future__ import annotations

import numpy as np

from rollout_api.proto import rollout_pb2

_DTYPES = ("uint8", "uint16")


def encode_routing(ids: np.ndarray) -> rollout_pb2.Routing:
    """The `Routing` message for routing ids.

    Args:
      ids: expert ids [T, L, K], uint8 or uint16 (any byte order).

    Returns:
      The message: little-endian C-order bytes, the shape and the dtype name.

    Raises:
      ValueError: `ids` is not 3-D or its dtype is not uint8/uint16.
    """
    ids = np.asarray(ids)
    name = ids.dtype.name
    if name not in _DTYPES:
        raise ValueError(f"routing ids must be uint8 or uint16, got dtype {ids.dtype}")
    if ids.ndim != 3:
        raise ValueError(f"routing ids must have shape [T, L, K], got shape {ids.shape}")
    wire = np.dtype(name).newbyteorder("<")
    return rollout_pb2.Routing(
        data=np.ascontiguousarray(ids, dtype=wire).tobytes(), shape=list(ids.shape), dtype=name
    )


def decode_routing(routing: rollout_pb2.Routing) -> np.ndarray:
    """The routing ids a `Routing` message carries.

    Args:
      routing: the message (e.g. `trajectory.routing`).

    Returns:
      A fresh array [T, L, K] of `routing.dtype` in native byte order.

    Raises:
      ValueError: an unknown dtype, a shape that is not 3 non-negative dims, or a byte count
        that does not match the shape.
    """
    if routing.dtype not in _DTYPES:
        raise ValueError(f"unknown routing dtype {routing.dtype!r} (expected uint8 or uint16)")
    shape = tuple(routing.shape)
    if len(shape) != 3 or min(shape) < 0:
        raise ValueError(f"routing shape must be [T, L, K] with dims >= 0, got {list(shape)}")
    wire = np.dtype(routing.dtype).newbyteorder("<")
    expected = int(np.prod(shape)) * wire.itemsize
    if len(routing.data) != expected:
        raise ValueError(
            f"routing data has {len(routing.data)} bytes, shape {list(shape)} of "
            f"{routing.dtype} needs {expected}"
        )
    return np.frombuffer(routing.data, wire).astype(routing.dtype).reshape(shape)
