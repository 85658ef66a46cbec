"""The gRPC servicers: our Rollout service and JetStream's Orchestrator with input validation.

The protocol is docs/DESIGN.md §6's. Every malformed request gets INVALID_ARGUMENT and changes
nothing (§10); JetStream 0.2.2's own Orchestrator would crash or silently truncate on some of them
(see `jetstream_compat` for the fixes made at import).
"""

from __future__ import annotations

import asyncio
import hmac
import logging
import math
import time

import grpc

from rollout_server import jetstream_compat  # noqa: F401  (must precede jetstream imports)

# isort: split
from jetstream.core import orchestrator
from jetstream.core.proto import jetstream_pb2

from rollout_server import weights
from rollout_server.driver import RolloutDriver
from rollout_server.engine import MoEEngine
from rollout_server.proto import rollout_pb2, rollout_pb2_grpc
from rollout_server.rollout import RolloutLoop

log = logging.getLogger(__name__)

MAX_PULL_GROUPS = 4096
MAX_PULL_TIMEOUT_S = 600.0
MAX_SESSION_CACHE = 1024
MAX_VERSION = 2**31 - 1  # versions travel as int32 inside the engine


class RolloutService(rollout_pb2_grpc.RolloutServicer):
    """Pull / UpdateWeights / Stats / Health over a running `RolloutLoop` and `MoEEngine`.

    Args:
      loop: the rollout loop.
      engine: the engine whose weights UpdateWeights swaps.
      driver: the JetStream driver (for liveness).
      checkpoint_root: only checkpoints under it are loaded ("" disables UpdateWeights).
      token: the shared secret UpdateWeights must carry ("" = none required).
      metrics: an optional `ServerMetrics`.
    """

    def __init__(
        self,
        *,
        loop: RolloutLoop,
        engine: MoEEngine,
        driver: RolloutDriver,
        checkpoint_root: str,
        token: str,
        metrics=None,
    ):
        self._loop, self._engine, self._driver = loop, engine, driver
        self._root, self._token, self._metrics = checkpoint_root, token, metrics
        self._update_lock = asyncio.Lock()

    async def Pull(
        self, request: rollout_pb2.PullRequest, context: grpc.aio.ServicerContext
    ) -> rollout_pb2.PullResponse:
        """Up to `max_groups` finished groups, waiting up to `timeout_s` for the first."""
        if not 1 <= request.max_groups <= MAX_PULL_GROUPS:
            await context.abort(
                grpc.StatusCode.INVALID_ARGUMENT, f"max_groups must be in [1, {MAX_PULL_GROUPS}]"
            )
        t = request.timeout_s
        if not (math.isfinite(t) and 0 <= t <= MAX_PULL_TIMEOUT_S):
            await context.abort(
                grpc.StatusCode.INVALID_ARGUMENT, f"timeout_s must be in [0, {MAX_PULL_TIMEOUT_S}]"
            )
        groups = await asyncio.to_thread(self._loop.pull, request.max_groups, t)
        return rollout_pb2.PullResponse(groups=groups)

    async def UpdateWeights(
        self, request: rollout_pb2.UpdateWeightsRequest, context: grpc.aio.ServicerContext
    ) -> rollout_pb2.UpdateWeightsResponse:
        """Loads the checkpoint (inside the checkpoint root) and swaps it in as `version`."""
        if self._token and not hmac.compare_digest(request.token.encode(), self._token.encode()):
            await context.abort(grpc.StatusCode.PERMISSION_DENIED, "bad or missing token")
        if not 0 <= request.version <= MAX_VERSION:
            await context.abort(
                grpc.StatusCode.INVALID_ARGUMENT, f"version must be in [0, {MAX_VERSION}]"
            )
        async with self._update_lock:
            current = self._engine.version
            if request.version < current:
                await context.abort(
                    grpc.StatusCode.INVALID_ARGUMENT,
                    f"version {request.version} is older than the current version {current}",
                )
            try:
                start = time.perf_counter()
                path, params = await asyncio.to_thread(
                    weights.load_under_root,
                    request.checkpoint_path,
                    self._root,
                    self._engine.current_params()[1],
                )
                loaded = time.perf_counter()
                await asyncio.to_thread(
                    self._loop.install_weights,
                    request.version,
                    str(path),
                    params,
                    new_epoch=request.new_admission_epoch,
                )
                swapped = time.perf_counter()
            except ValueError as e:  # CheckpointPathError, or params swap_params refuses
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        log.info(
            "weights swapped: version %d -> %d from %s (load %.3fs, swap %.3fs)",
            current,
            request.version,
            path,
            loaded - start,
            swapped - loaded,
        )
        if self._metrics is not None:
            self._metrics.observe_swap(request.version, swapped - start)
        return rollout_pb2.UpdateWeightsResponse(
            version=request.version, load_s=loaded - start, swap_s=swapped - loaded
        )

    async def Stats(
        self, request: rollout_pb2.StatsRequest, context: grpc.aio.ServicerContext
    ) -> rollout_pb2.StatsResponse:
        """The rollout loop's counters."""
        return rollout_pb2.StatsResponse(**self._loop.stats())

    async def Health(
        self, request: rollout_pb2.HealthRequest, context: grpc.aio.ServicerContext
    ) -> rollout_pb2.HealthResponse:
        """Whether the rollout loop runs, and the weights version."""
        return rollout_pb2.HealthResponse(
            live=bool(self._driver.live and self._loop.alive()), version=self._engine.version
        )


class ValidatingOrchestrator(orchestrator.LLMOrchestrator):
    """JetStream's stock Orchestrator service, rejecting requests that would crash or truncate.

    Args:
      driver: the running driver.
      engine: for the vocabulary, prompt and decode limits.
      max_prefill_backlog: Decode requests beyond this many queued prefills are refused
        (RESOURCE_EXHAUSTED); JetStream's own backlog is unbounded.
    """

    def __init__(self, driver: RolloutDriver, engine: MoEEngine, max_prefill_backlog: int):
        super().__init__(driver=driver)
        self._engine = engine
        self._max_backlog = max_prefill_backlog

    def validate(self, request: jetstream_pb2.DecodeRequest) -> str | None:
        """The reason `request` is invalid, or None."""
        engine = self._engine
        which = request.WhichOneof("content")
        if which is None:
            return "one of text_content or token_content is required"
        if len(request.session_cache) > MAX_SESSION_CACHE:
            return f"session_cache longer than {MAX_SESSION_CACHE} characters"
        if not 1 <= request.max_tokens <= engine.max_decode_length:
            return f"max_tokens must be in [1, {engine.max_decode_length}]"
        if which == "token_content":
            if request.session_cache:
                return "token_content cannot be combined with session_cache"
            ids = list(request.token_content.token_ids)
            vocab = engine.tokenizer.vocab_size
            if any(not 0 <= i < vocab for i in ids):
                return f"token ids must be in [0, {vocab})"
            n = len(ids)
        else:
            try:
                text = request.text_content.text  # empty: no prompt, whatever a BOS adds
                n = len(engine.tokenizer.encode_prompt(text)) if text else 0
            except ValueError as e:
                return str(e)
        try:
            engine.check_prompt_length(n)
        except ValueError as e:
            return str(e)
        return None

    async def Decode(
        self, request: jetstream_pb2.DecodeRequest, context: grpc.aio.ServicerContext | None = None
    ):
        """JetStream's Decode after `validate` (INVALID_ARGUMENT) and the backlog bound
        (RESOURCE_EXHAUSTED)."""
        error = self.validate(request)
        if error is not None:
            if context is None:
                raise ValueError(error)
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, error)
        if self._driver.prefill_backlog_size() >= self._max_backlog:
            if context is None:
                raise RuntimeError("prefill backlog full")
            await context.abort(
                grpc.StatusCode.RESOURCE_EXHAUSTED, "the prefill backlog is full; retry later"
            )
        async for response in super().Decode(request, context):
            yield response
