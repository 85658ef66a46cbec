"""Client helpers for the Rollout service: channel options and a stub.

Only grpc and the generated modules: the trainer can use this without JetStream.
"""

from __future__ import annotations

import grpc
import numpy as np

from rollout_server.proto import rollout_pb2, rollout_pb2_grpc
from rollout_server.routing_codec import decode_routing

DEFAULT_MAX_MESSAGE_BYTES = 256 * 1024 * 1024


def channel_options(max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES) -> list[tuple[str, int]]:
    """gRPC options raising the 4 MB default message limit both ways (for real batches)."""
    return [
        ("grpc.max_send_message_length", max_message_bytes),
        ("grpc.max_receive_message_length", max_message_bytes),
    ]


def connect(
    address: str,
    max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES,
    *,
    root_certificates: bytes | None = None,
) -> tuple[grpc.Channel, rollout_pb2_grpc.RolloutStub]:
    """A channel to `address` ("host:port") and a Rollout stub on it; TLS when
    `root_certificates` (PEM) is given."""
    options = channel_options(max_message_bytes)
    if root_certificates is None:
        channel = grpc.insecure_channel(address, options=options)
    else:
        credentials = grpc.ssl_channel_credentials(root_certificates=root_certificates)
        channel = grpc.secure_channel(address, credentials, options=options)
    return channel, rollout_pb2_grpc.RolloutStub(channel)


def routing_array(trajectory: rollout_pb2.Trajectory) -> np.ndarray:
    """Deprecated alias of `routing_codec.decode_routing(trajectory.routing)`; goes once the
    trainer calls `decode_routing`."""
    return decode_routing(trajectory.routing)
