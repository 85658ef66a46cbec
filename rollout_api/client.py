"""Client helpers for the Rollout service: channel options and a stub.

Only grpc and the generated modules: the trainer can use this without JetStream.
"""

from __future__ import annotations

import grpc

from rollout_api.proto import rollout_pb2_grpc

# How a draining server (SIGTERM, docs/DESIGN.md §6.5) answers a Pull it has nothing left for and
# any UpdateWeights: UNAVAILABLE with details starting with this; the trainer then counts it as
# leaving at once, without the grace a failing server gets.
DRAINING = "draining:"


def is_draining(error: grpc.RpcError) -> bool:
    """Whether `error` is a draining server's answer (`DRAINING`)."""
    code = error.code() if hasattr(error, "code") else None
    details = (error.details() if hasattr(error, "details") else "") or ""
    return code == grpc.StatusCode.UNAVAILABLE and details.startswith(DRAINING)


def channel_options(max_message_bytes: int) -> list[tuple[str, int]]:
    """gRPC options raising the 4 MB default message limit both ways (for real batches)."""
    return [
        ("grpc.max_send_message_length", max_message_bytes),
        ("grpc.max_receive_message_length", max_message_bytes),
    ]


def bearer_metadata(token: str) -> tuple[tuple[str, str], ...]:
    """The gRPC metadata carrying `token` (`authorization: Bearer <token>`); none for ""."""
    return (("authorization", f"Bearer {token}"),) if token else ()


def connect(
    address: str,
    max_message_bytes: int,
    *,
    root_certificates: bytes | None = None,
) -> tuple[grpc.Channel, rollout_pb2_grpc.RolloutStub]:
    """A channel to a rollout server and a Rollout stub on it.

    Args:
      address: "host:port".
      max_message_bytes: the gRPC message limit both ways (`server.max_message_bytes`).
      root_certificates: PEM certificates to verify the server with (TLS); None = plaintext.

    Returns:
      (the channel, the stub); the caller closes the channel.
    """
    options = channel_options(max_message_bytes)
    if root_certificates is None:
        channel = grpc.insecure_channel(address, options=options)
    else:
        credentials = grpc.ssl_channel_credentials(root_certificates=root_certificates)
        channel = grpc.secure_channel(address, credentials, options=options)
    return channel, rollout_pb2_grpc.RolloutStub(channel)
