"""The gRPC servicers: our Rollout service and JetStream's Orchestrator with input validation.

The protocol is docs/DESIGN.md §6's. Every malformed request gets INVALID_ARGUMENT and changes
nothing (§10); JetStream 0.2.2's own Orchestrator would crash or silently truncate on some of them
(see `jetstream_compat` for the fixes made at import).
"""

from __future__ import annotations

import asyncio
import functools
import hmac
import logging
import math
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import grpc

from rollout_server import jetstream_compat  # noqa: F401  (must precede jetstream imports)

# isort: split
from jetstream.core import orchestrator
from jetstream.core.proto import jetstream_pb2

from rollout_api import records
from rollout_api.client import DRAINING
from rollout_api.proto import rollout_pb2, rollout_pb2_grpc
from rollout_server import weights
from rollout_server.auth import has_token
from rollout_server.driver import RolloutDriver
from rollout_server.engine import MoEEngine
from rollout_server.rollout import RolloutLoop
from rollout_server.trainer_link import RunNotAttachedError
from sat_jax.model.config import LoRAConfig

log = logging.getLogger(__name__)

MAX_PULL_GROUPS = 4096
MAX_PULL_TIMEOUT_S = 600.0
MAX_SESSION_CACHE = 1024
MAX_VERSION = 2**31 - 1  # versions travel as int32 inside the engine
# A Decode text longer than this many characters per prompt token the engine takes is refused
# before it is tokenized (no tokenizer's tokens average that many characters).
MAX_CHARS_PER_TOKEN = 32


class RolloutService(rollout_pb2_grpc.RolloutServicer):
    """Pull / Ack / UpdateWeights / Stats / Health over a running `RolloutLoop` and `MoEEngine`.

    While the loop drains (SIGTERM, docs/DESIGN.md §6.5) Pull and Ack go on, a Pull with nothing
    left to hand out and every UpdateWeights answer UNAVAILABLE with `rollout_api.client.DRAINING`
    details, and Health answers not live.

    Blocking work runs off the event loop on bounded executors of its own: Pulls (which wait for
    groups) on `pull_threads` threads, acknowledgements on one, weight loads and swaps on another,
    so no number of waiting Pulls delays an UpdateWeights, Stats or Health. The token of every RPC
    but Health is checked by `auth.TokenInterceptor`; UpdateWeights checks it here (metadata or
    its `token` field).

    Args:
      loop: the rollout loop.
      engine: the engine whose weights UpdateWeights swaps.
      driver: the JetStream driver (for liveness).
      checkpoint_root: only checkpoints under it are loaded ("" disables UpdateWeights).
      token: the shared secret ("" = none required).
      max_version_jump: the most an UpdateWeights may raise the version by.
      pull_threads: Pulls served at once (`server.grpc_threads`); more wait for a thread.
      metrics: an optional `ServerMetrics`.
      loader: reads what UpdateWeights names (`weights.WeightsLoader`; under LoRA it keeps the
        base); default: whole params under `checkpoint_root`.
      accounting: the busy-time fields Stats adds (`loop_stats.LoopAccounting.stats`); None =
        none.
    """

    def __init__(
        self,
        *,
        loop: RolloutLoop,
        engine: MoEEngine,
        driver: RolloutDriver,
        checkpoint_root: str,
        token: str,
        max_version_jump: int,
        pull_threads: int,
        metrics=None,
        loader: weights.WeightsLoader | None = None,
        accounting: Callable[[], dict[str, Any]] | None = None,
    ):
        self._loop, self._engine, self._driver = loop, engine, driver
        self._accounting = accounting
        self._token, self._metrics = token, metrics
        self._loader = loader or weights.WeightsLoader(checkpoint_root, LoRAConfig())
        self._max_jump = max_version_jump
        self._update_lock = asyncio.Lock()
        self._pulls = ThreadPoolExecutor(pull_threads, thread_name_prefix="pull")
        self._acks = ThreadPoolExecutor(1, thread_name_prefix="ack")
        self._updates = ThreadPoolExecutor(1, thread_name_prefix="update-weights")
        # Set once a Pull was told that this draining server has nothing left (its trainer then
        # counts it as gone, and has sent every acknowledgement it owed with that Pull).
        self.drain_told = threading.Event()

    def close(self) -> None:
        """Stops the executors (running work finishes; queued work is dropped)."""
        for pool in (self._pulls, self._acks, self._updates):
            pool.shutdown(wait=False, cancel_futures=True)

    async def Pull(
        self, request: rollout_pb2.PullRequest, context: grpc.aio.ServicerContext
    ) -> rollout_pb2.PullResponse:
        """Acknowledges `ack_group_ids` and `reject_group_ids`, then leases up to `max_groups`
        finished groups, waiting
        up to `timeout_s` for the first. A Pull abandoned before its reply (deadline, cancelled,
        client gone) gives its groups back at once."""
        if not 1 <= request.max_groups <= MAX_PULL_GROUPS:
            await context.abort(
                grpc.StatusCode.INVALID_ARGUMENT, f"max_groups must be in [1, {MAX_PULL_GROUPS}]"
            )
        t = request.timeout_s
        if not (math.isfinite(t) and 0 <= t <= MAX_PULL_TIMEOUT_S):
            await context.abort(
                grpc.StatusCode.INVALID_ARGUMENT, f"timeout_s must be in [0, {MAX_PULL_TIMEOUT_S}]"
            )
        for name in ("ack_group_ids", "reject_group_ids", "return_group_ids"):
            if len(getattr(request, name)) > MAX_PULL_GROUPS:
                await context.abort(
                    grpc.StatusCode.INVALID_ARGUMENT, f"at most {MAX_PULL_GROUPS} {name}"
                )
        pull = functools.partial(
            self._loop.pull,
            request.max_groups,
            t,
            ack=list(request.ack_group_ids),
            reject=list(request.reject_group_ids),
            give_back=list(request.return_group_ids),
            run_id=request.run_id,
            trainer_version=request.trainer_version,
        )
        future = asyncio.get_running_loop().run_in_executor(self._pulls, pull)
        if self._metrics is not None:
            self._metrics.pull_started()
            future.add_done_callback(lambda _: self._metrics.pull_finished())
        try:
            groups = await asyncio.shield(future)
        except asyncio.CancelledError:
            future.add_done_callback(self._give_back)
            raise
        if context.cancelled() or context.done():
            self._loop.release(groups)
            return rollout_pb2.PullResponse()
        if not groups and self._loop.draining and not self._loop.stats()["groups_running"]:
            self.drain_told.set()
            await context.abort(
                grpc.StatusCode.UNAVAILABLE,
                f"{DRAINING} this server is shutting down (SIGTERM) and has no group left",
            )
        return pull_reply(groups, request, self._loop.capacity_tokens_per_s)

    def _give_back(self, future: asyncio.Future) -> None:
        if not future.cancelled() and future.exception() is None:
            self._loop.release(future.result())

    async def Ack(
        self, request: rollout_pb2.AckRequest, context: grpc.aio.ServicerContext
    ) -> rollout_pb2.AckResponse:
        """Removes the acknowledged groups for good (they count as consumed; rejected ones are
        replaced by admission)."""
        for name in ("group_ids", "reject_group_ids", "return_group_ids"):
            if len(getattr(request, name)) > MAX_PULL_GROUPS:
                await context.abort(
                    grpc.StatusCode.INVALID_ARGUMENT, f"at most {MAX_PULL_GROUPS} {name}"
                )
        ack = functools.partial(
            self._loop.ack,
            list(request.group_ids),
            reject=list(request.reject_group_ids),
            give_back=list(request.return_group_ids),
            run_id=request.run_id,
        )
        acked = await asyncio.get_running_loop().run_in_executor(self._acks, ack)
        return rollout_pb2.AckResponse(acked=acked)

    async def UpdateWeights(
        self, request: rollout_pb2.UpdateWeightsRequest, context: grpc.aio.ServicerContext
    ) -> rollout_pb2.UpdateWeightsResponse:
        """Loads the checkpoint (inside the checkpoint root) and swaps it in as `version`."""
        if self._token and not (
            has_token(context.invocation_metadata(), self._token)
            or hmac.compare_digest(request.token.encode(), self._token.encode())
        ):
            await context.abort(grpc.StatusCode.UNAUTHENTICATED, "bad or missing token")
        if not 0 <= request.version <= MAX_VERSION:
            await context.abort(
                grpc.StatusCode.INVALID_ARGUMENT, f"version must be in [0, {MAX_VERSION}]"
            )
        if self._loop.draining:
            await context.abort(
                grpc.StatusCode.UNAVAILABLE,
                f"{DRAINING} this server is shutting down (SIGTERM) and loads no more weights",
            )
        async with self._update_lock:
            current = self._engine.version
            error = self._refusal(request, current)
            if error is not None:
                await context.abort(*error)
            try:
                load_s, swap_s, path = await self._load_and_install(request)
            except ValueError as e:  # CheckpointPathError, or params swap_params refuses
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
            except RunNotAttachedError as e:
                await context.abort(grpc.StatusCode.FAILED_PRECONDITION, str(e))
        log.info(
            "weights swapped: version %d -> %d from %s (load %.3fs, swap %.3fs)",
            current,
            request.version,
            path,
            load_s,
            swap_s,
        )
        if self._metrics is not None:
            self._metrics.observe_swap(request.version, load_s + swap_s)
        return rollout_pb2.UpdateWeightsResponse(
            version=request.version, load_s=load_s, swap_s=swap_s
        )

    def _refusal(
        self, request: rollout_pb2.UpdateWeightsRequest, current: int
    ) -> tuple[grpc.StatusCode, str] | None:
        """Why an UpdateWeights to `request.version` from `current` is refused, or None."""
        if request.version < current:
            return (
                grpc.StatusCode.INVALID_ARGUMENT,
                f"version {request.version} is older than the current version {current}",
            )
        if request.version - current > self._max_jump:
            return (
                grpc.StatusCode.INVALID_ARGUMENT,
                f"version {request.version} jumps more than server.max_version_jump = "
                f"{self._max_jump} past the current version {current}",
            )
        try:
            self._loop.check_attached(request.new_admission_epoch, request.run_id)
        except RunNotAttachedError as e:
            return grpc.StatusCode.FAILED_PRECONDITION, str(e)
        return None

    async def _load_and_install(
        self, request: rollout_pb2.UpdateWeightsRequest
    ) -> tuple[float, float, str]:
        """Loads and installs the weights on the weights executor, in one hop (an idle server
        opens admission to the new version as soon as it is installed); (load s, swap s, path).
        The swap's seconds include the wait for the new state to be on disk."""
        return await asyncio.get_running_loop().run_in_executor(
            self._updates, self._load_and_install_now, request
        )

    def _load_and_install_now(
        self, request: rollout_pb2.UpdateWeightsRequest
    ) -> tuple[float, float, str]:
        start = time.perf_counter()
        loaded = self._loader.load(
            request.checkpoint_path, request.base_path, self._engine.current_params()[1]
        )
        load_s = time.perf_counter() - start
        self._loop.install_weights(
            request.version,
            str(loaded.path),
            loaded.params,
            new_epoch=request.new_admission_epoch,
            run_id=request.run_id,
            share=request.admission_share,
            share_until=request.share_until,
            base_path=self._loader.kept_base if request.base_path else "",
            push_bytes=loaded.nbytes,
            trainer_version=request.trainer_version,
        )
        return load_s, time.perf_counter() - start - load_s, str(loaded.path)

    async def Stats(
        self, request: rollout_pb2.StatsRequest, context: grpc.aio.ServicerContext
    ) -> rollout_pb2.StatsResponse:
        """The rollout loop's counters and the busy-time accounting."""
        extra = self._accounting() if self._accounting is not None else {}
        return rollout_pb2.StatsResponse(**self._loop.stats(), **extra)

    async def Health(
        self, request: rollout_pb2.HealthRequest, context: grpc.aio.ServicerContext
    ) -> rollout_pb2.HealthResponse:
        """Whether the rollout loop runs (not while it drains: a trainer does not take the server
        back), the weights version and the server's id."""
        return rollout_pb2.HealthResponse(
            live=bool(self._driver.live and self._loop.alive() and not self._loop.draining),
            version=self._engine.version,
            server_id=self._loop.persisted.server_id,
        )


def pull_reply(
    groups: list[rollout_pb2.Group], request: rollout_pb2.PullRequest, capacity: float
) -> rollout_pb2.PullResponse:
    """The Pull reply of leased groups (their queued messages, `records.to_proto`'s: arrays
    packed): a copy, without the texts unless the request asks for them (`include_texts`; the
    trainer reads none, docs/DESIGN.md §6.2). The queued messages keep theirs (a re-delivery may
    go to a Pull that asks)."""
    reply = rollout_pb2.PullResponse(groups=groups, capacity_tokens_per_s=capacity)
    if not request.include_texts:
        records.strip_texts(reply.groups)
    return reply


class ValidatingOrchestrator(orchestrator.LLMOrchestrator):
    """JetStream's stock Orchestrator service, rejecting requests that would crash or truncate.

    Args:
      driver: the running driver.
      engine: for the vocabulary, prompt and decode limits.
      max_prefill_backlog: Decode requests beyond this many queued prefills are refused
        (RESOURCE_EXHAUSTED); JetStream's own backlog is unbounded.
      max_prefill_length: the engine's longest prompt in tokens; a text longer than
        `MAX_CHARS_PER_TOKEN` times it is refused before it is tokenized.
    """

    def __init__(
        self,
        driver: RolloutDriver,
        engine: MoEEngine,
        *,
        max_prefill_backlog: int,
        max_prefill_length: int,
    ):
        super().__init__(driver=driver)
        self._engine = engine
        self._max_backlog = max_prefill_backlog
        self._max_text_chars = MAX_CHARS_PER_TOKEN * max_prefill_length

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
            text = request.text_content.text
            if len(text) > self._max_text_chars:
                return f"text_content longer than {self._max_text_chars} characters"
            try:
                # Empty: no prompt, whatever BOS the tokenizer would add.
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
        (RESOURCE_EXHAUSTED); validation (tokenizing) runs off the event loop."""
        error = await asyncio.get_running_loop().run_in_executor(None, self.validate, request)
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
