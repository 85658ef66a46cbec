"""The shared-token check of every RPC but the health checks (docs/DESIGN.md §10).

With `server.token` set, a call must carry gRPC metadata `authorization: Bearer <token>`; one
without it (or with another token) is refused with UNAUTHENTICATED before its handler runs, so it
changes nothing. The check is a server interceptor: it covers JetStream's Orchestrator service
(Decode) as well as ours. `UpdateWeights` may instead carry the token in its request field: the
interceptor lets it through and the servicer checks either (`RolloutService.UpdateWeights`).
"""

from __future__ import annotations

import hmac
from collections.abc import Awaitable, Callable

import grpc

from rollout_api.client import bearer_metadata

# Answered without a token: liveness probes (ours and JetStream's).
EXEMPT_METHODS = frozenset(
    {
        "/satjax.rollout.v1.Rollout/Health",
        "/jetstream_proto.Orchestrator/HealthCheck",
    }
)
# Checked by the servicer (metadata or the request's `token` field).
UPDATE_WEIGHTS_METHOD = "/satjax.rollout.v1.Rollout/UpdateWeights"
_DENIED = "missing or wrong token: send gRPC metadata 'authorization: Bearer <token>'"


def has_token(metadata, token: str) -> bool:
    """Whether `metadata` (invocation metadata: (key, value) pairs) carries `token` as a bearer
    token; constant-time in the token."""
    _, expected = bearer_metadata(token)[0]
    for key, value in metadata or ():
        if key == "authorization":
            got = value.encode() if isinstance(value, str) else value
            return hmac.compare_digest(got, expected.encode())
    return False


class TokenInterceptor(grpc.aio.ServerInterceptor):
    """Refuses every call but the exempt ones without the bearer token (UNAUTHENTICATED)."""

    def __init__(self, token: str):
        if not token:
            raise ValueError("TokenInterceptor needs a token")
        self._token = token

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        handler = await continuation(details)
        method = details.method
        if handler is None or method in EXEMPT_METHODS or method == UPDATE_WEIGHTS_METHOD:
            return handler
        if has_token(details.invocation_metadata, self._token):
            return handler
        return _denying(handler)


async def _deny(request, context: grpc.aio.ServicerContext):
    await context.abort(grpc.StatusCode.UNAUTHENTICATED, _DENIED)


async def _deny_stream(request, context: grpc.aio.ServicerContext):
    await context.abort(grpc.StatusCode.UNAUTHENTICATED, _DENIED)
    yield  # an async generator, like the streaming handler it replaces


def _denying(handler: grpc.RpcMethodHandler) -> grpc.RpcMethodHandler:
    """A handler of `handler`'s kind that refuses the call."""
    # The request stays unparsed (bytes): nothing of it is read.
    codec = {"request_deserializer": None, "response_serializer": handler.response_serializer}
    if handler.request_streaming:
        raise ValueError("no client-streaming RPC is served")
    if handler.response_streaming:
        return grpc.unary_stream_rpc_method_handler(_deny_stream, **codec)
    return grpc.unary_unary_rpc_method_handler(_deny, **codec)
