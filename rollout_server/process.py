"""The running rollout server (docs/DESIGN.md §6), which `sat-serve` starts once its config is
valid.

build tokenizer and model (`model.hf_path`'s weights, or a random init) → engine → JetStream driver (our subclass) → rollout loop → one gRPC server with
JetStream's Orchestrator service and our Rollout service → serve until SIGINT, or SIGTERM and a
drain of up to `server.drain_s` (docs/DESIGN.md §6.5).
"""

from __future__ import annotations

import asyncio
import logging
import math
import signal
from collections.abc import Callable
from typing import Any

from rollout_server import jetstream_compat  # noqa: F401  (must precede jetstream imports)

# isort: split

import grpc
import jax
import prometheus_client as prom
from flax import nnx
from jetstream.core.proto import jetstream_pb2_grpc

from rollout_api.proto import rollout_pb2_grpc
from rollout_server import weights
from rollout_server.auth import TokenInterceptor
from rollout_server.driver import RolloutDriver
from rollout_server.engine import MoEEngine
from rollout_server.http_api import HttpApi, HttpLimits, server_ssl_context
from rollout_server.loop_stats import IdleMeter, LoopAccounting
from rollout_server.metrics import ServerMetrics
from rollout_server.persistence import RolloutState, StateStore
from rollout_server.rollout import RolloutLoop
from rollout_server.service import RolloutService, ValidatingOrchestrator
from rollout_server.sessions import Generator, SessionLimits, SessionManager
from sat_jax import sharding
from sat_jax.config import ServerConfig
from sat_jax.decoding import SamplingConfig
from sat_jax.experiment import ExperimentConfig, make_tokenizer
from sat_jax.model import Transformer, hf, placement
from sat_jax.model.config import runtime_overrides
from sat_jax.model.lora import abstract_adapters
from sat_jax.tasks import make_reward, prompt_source
from sat_jax.tasks.envs import EpisodeRunner, load_environment

log = logging.getLogger("rollout_server")

# What a PullResponse may add to its groups' bytes and stay under the gRPC message limit.
_PULL_RESPONSE_HEADROOM_BYTES = 1024 * 1024


def serving_mesh(cfg: ExperimentConfig) -> jax.sharding.Mesh:
    """The engine's mesh (`server.mesh`): its explicit sizes over the first devices, or every
    device when an axis is -1."""
    sizes = [getattr(cfg.server.mesh, a) for a in sharding.MESH_AXES]
    devices = jax.devices() if -1 in sizes else jax.devices()[: math.prod(sizes)]
    return sharding.make_mesh(cfg.server.mesh, devices)


def initial_model(cfg: ExperimentConfig, mesh: jax.sharding.Mesh) -> Transformer:
    """The weights the server holds as version 0, in `server.dtype`, each in its sharding on
    `mesh`: `model.hf_path`'s (no random init), else a random init (`server.seed`)."""
    model_cfg = cfg.serving_model
    if model_cfg.hf_path:
        return hf.load_qwen3_moe(model_cfg.hf_path, mesh=mesh, **runtime_overrides(model_cfg))
    return nnx.merge(*placement.init_sharded(model_cfg, mesh, cfg.server.seed))


def lora_adapters(cfg: ExperimentConfig, mesh: jax.sharding.Mesh) -> Any:
    """The LoRA adapters a trainer of `cfg` pushes, as abstract arrays in the serving dtype and
    their shardings on the engine's `mesh` (what `UpdateWeights` restores them into)."""
    served = cfg.serving_model.replace(lora=cfg.model.lora)
    return abstract_adapters(served, mesh)


def session_limits(s: ServerConfig) -> SessionLimits:
    """The HTTP sessions' limits from `server.*`: open sessions, idle time, forks."""
    return SessionLimits(
        max_sessions=s.http_max_sessions,
        idle_s=s.http_session_idle_s,
        fork=s.http_session_fork,
    )


class RolloutServer:
    """Everything the process runs; `start()` inside an asyncio loop, `stop()` to end.

    Args:
      cfg: the experiment.
      store: the state store of `server.state_dir`, holding its lock (`sat-serve` opens it before
        importing anything heavy, so a second server on the directory fails at once).
      engine_class: builds the engine from `MoEEngine`'s arguments (`MoEEngine`, or one that
        answers as it does; the loop
        benchmark's stand-in passes `rollout_server.stand_in.StandInEngine`).
    """

    def __init__(
        self,
        cfg: ExperimentConfig,
        store: StateStore,
        engine_class: Callable[..., Any] = MoEEngine,
    ):
        self.cfg = cfg
        self.store = store
        self.fatal: BaseException | None = None
        self.tokenizer = make_tokenizer(cfg)
        mesh = serving_mesh(cfg)
        log.info(
            "engine mesh %s on %d %s devices",
            dict(mesh.shape),
            mesh.size,
            mesh.devices.flat[0].platform,
        )
        self.engine = engine_class(
            initial_model(cfg, mesh),
            mesh=mesh,
            tokenizer=self.tokenizer,
            slots=cfg.server.slots,
            max_prefill_length=cfg.server.max_prefill_length,
            max_decode_length=cfg.completion_tokens,  # an episode's, multi-turn
            sampling=SamplingConfig.from_rollout(cfg.rollout),
            seed=cfg.server.seed,
            weight_dtype=cfg.server.weight_dtype,
            kv_cache_dtype=cfg.server.kv_cache_dtype,
        )
        self.loader = weights.WeightsLoader(
            cfg.server.checkpoint_root,
            cfg.model.lora,
            lora_adapters(cfg, mesh) if cfg.model.lora.rank else None,
        )
        persisted = self._restore_weights()
        self.driver = RolloutDriver.interleaved(self.engine)
        self.generator = Generator(self.driver, self.engine, self.tokenizer)
        self.sessions = self._session_manager()
        self.loop = self._rollout_loop(persisted)
        self.accounting = LoopAccounting(
            self.engine.decode_clock,
            IdleMeter(lambda: self.loop.stats()["admission_open"], self.driver.idle_slots),
        )
        self.metrics = ServerMetrics(
            self.loop.stats,
            self.driver.prefill_backlog_size,
            prom.CollectorRegistry(),
            accounting=self.accounting.stats,
        )
        self.grpc_server: grpc.aio.Server | None = None
        self.service: RolloutService | None = None
        self.http: HttpApi | None = None

    def _restore_weights(self) -> RolloutState:
        """Loads the state directory's state (the one load: the rollout loop takes it from here)
        and installs the weights it names; when they cannot be loaded, goes back to the initial
        weights (the next UpdateWeights starts a fresh admission epoch)."""
        persisted = self.store.load()
        if persisted.checkpoint_path and not self._reload(
            persisted.version, persisted.checkpoint_path, persisted.base_path
        ):
            persisted.version, persisted.checkpoint_path, persisted.base_path = 0, "", ""
            persisted.epoch_version = 0
            self.store.save(persisted)
        return persisted

    def _session_manager(self) -> SessionManager | None:
        """With ``server.http_sessions``, the manager of the HTTP agents' sessions."""
        s = self.cfg.server
        if not s.http_sessions:
            return None
        return SessionManager(self.generator, make_reward(self.cfg.task.reward), session_limits(s))

    def _rollout_loop(self, persisted: RolloutState) -> RolloutLoop:
        """The admission and generation loop over the configured prompts, from the state
        `persisted` (loaded by `_restore_weights`)."""
        cfg, s = self.cfg, self.cfg.server
        prompts, rows_skipped = prompt_source(cfg.task)
        episodes = None
        if cfg.task.multi_turn and self.sessions is None:
            env = load_environment(cfg.task.env)
            episodes = EpisodeRunner(env, cfg.task.env_config, self.tokenizer)
        return RolloutLoop(
            driver=self.driver,
            engine=self.engine,
            prompts=prompts,
            reward_fn=make_reward(cfg.task.reward),
            tokenizer=self.tokenizer,
            cfg=cfg.rollout,
            store=self.store,
            state=persisted,
            wait_for_weights=s.wait_for_weights,
            max_response_bytes=s.max_message_bytes - _PULL_RESPONSE_HEADROOM_BYTES,
            rows_skipped=rows_skipped,
            lease_s=s.lease_s,
            episodes=episodes,
            sessions=self.sessions,
        )

    def _reload(self, version: int, path: str, base_path: str) -> bool:
        """Installs the persisted weights (under LoRA, the adapters over their base); False
        (logged) when they cannot be loaded, or when a crash of the machine tore them (pushes
        are written without fsync, so their CRC is checked here)."""
        try:
            like = self.engine.current_params()[1]
            loaded = self.loader.load(path, base_path, like, verify=True)
            self.engine.swap_params(version, loaded.params)
        except ValueError as e:  # CheckpointPathError, or params swap_params refuses
            log.error("cannot restore the persisted weights (%s); starting from version 0", e)
            return False
        log.info("restored weights version %d from %s", version, loaded.path)
        return True

    async def start(self) -> None:
        """Binds (failing if the port is taken), then starts serving and generating."""
        try:
            await self._start()
        except BaseException:
            await self.stop()
            raise

    async def _start(self) -> None:
        s = self.cfg.server
        options = [
            ("grpc.max_send_message_length", s.max_message_bytes),
            # Requests are small: a larger one is refused before it is parsed.
            ("grpc.max_receive_message_length", s.max_request_bytes),
            # gRPC enables SO_REUSEPORT by default: a second server would silently share the port.
            ("grpc.so_reuseport", 0),
        ]
        self.grpc_server = grpc.aio.server(
            options=options,
            interceptors=[TokenInterceptor(s.token)] if s.token else None,
            maximum_concurrent_rpcs=s.max_concurrent_rpcs,
        )
        orchestrator = ValidatingOrchestrator(
            self.driver,
            self.engine,
            max_prefill_backlog=4 * s.slots,
            max_prefill_length=s.max_prefill_length,
        )
        jetstream_pb2_grpc.add_OrchestratorServicer_to_server(orchestrator, self.grpc_server)
        self.service = RolloutService(
            loop=self.loop,
            engine=self.engine,
            driver=self.driver,
            checkpoint_root=s.checkpoint_root,
            token=s.token,
            max_version_jump=s.max_version_jump,
            pull_threads=s.grpc_threads,
            metrics=self.metrics,
            loader=self.loader,
            accounting=self.accounting.stats,
        )
        rollout_pb2_grpc.add_RolloutServicer_to_server(self.service, self.grpc_server)
        address = f"[{s.host}]:{s.port}" if ":" in s.host else f"{s.host}:{s.port}"
        if s.tls_cert:
            with open(s.tls_key, "rb") as key, open(s.tls_cert, "rb") as cert:
                credentials = grpc.ssl_server_credentials([(key.read(), cert.read())])
            self.port = self.grpc_server.add_secure_port(address, credentials)
        else:
            self.port = self.grpc_server.add_insecure_port(address)
        if s.metrics_port:
            self.metrics.serve(s.metrics_port, s.metrics_host)
        await self.grpc_server.start()
        if s.http_port:
            await self._start_http()
        self.loop.start()
        self.accounting.idle.start()
        log.info(
            "serving on %s:%d (metrics port %d), weights version %d",
            s.host,
            self.port,
            s.metrics_port,
            self.engine.version,
        )
        if s.wait_for_weights and not self.loop.persisted.checkpoint_path:
            log.info("waiting for the first UpdateWeights before generating")

    async def _start_http(self) -> None:
        """The OpenAI-compatible endpoint on ``server.http_port``, over the same engine."""
        s = self.cfg.server
        self.http = HttpApi(
            generator=self.generator,
            sessions=self.sessions,
            limits=HttpLimits(
                max_body_bytes=s.http_max_body_bytes,
                max_messages=s.http_max_messages,
                max_requests=s.http_max_requests,
                sampling_override=s.http_sampling == "override",
                reasoning_parser=s.http_reasoning_parser,
            ),
            token=s.token,
            model_name=self.cfg.model.hf_path.rstrip("/").rsplit("/", 1)[-1] or "sat-jax",
            default_tokens=self.cfg.rollout.max_new_tokens,
        )
        tls = server_ssl_context(s.tls_cert, s.tls_key) if s.tls_cert else None
        self.http_port = await self.http.start(s.host, s.http_port, tls)
        log.info("HTTP (OpenAI-compatible) on %s:%d", s.host, self.http_port)

    async def stop(self) -> None:
        """Stops the rollout loop (saving its state), the gRPC server (1 s grace), the driver,
        and releases the state directory."""
        self.accounting.idle.stop()
        self.loop.stop()
        if self.http is not None:
            await self.http.stop()
        if self.grpc_server is not None:
            await self.grpc_server.stop(grace=1)
        if self.service is not None:
            self.service.close()
        self.driver.stop()
        self.store.close()


async def serve(
    cfg: ExperimentConfig, store: StateStore, engine_class: Callable[..., Any] = MoEEngine
) -> int:
    """Runs the server (with `store`, see `RolloutServer`) until SIGINT (exit code 0), SIGTERM
    (drained for up to `server.drain_s`, see `drain`; exit code 0) or until generation fails (the
    state is saved and the exit code is 1: a supervisor restarts the server where it was)."""
    server = RolloutServer(cfg, store, engine_class)
    done = asyncio.Event()
    loop = asyncio.get_running_loop()
    draining: list[asyncio.Task] = []

    def on_fatal(error: BaseException) -> None:  # called on a driver thread
        server.fatal = error
        loop.call_soon_threadsafe(done.set)

    def on_sigterm() -> None:
        if draining or cfg.server.drain_s <= 0:
            if draining:
                log.info("second SIGTERM: stopping now")
            done.set()
            return
        told = server.service.drain_told.is_set if server.service else lambda: True
        draining.append(loop.create_task(drain(server.loop, cfg.server.drain_s, done, told)))

    server.driver.on_fatal = on_fatal
    await server.start()
    loop.add_signal_handler(signal.SIGINT, done.set)
    loop.add_signal_handler(signal.SIGTERM, on_sigterm)
    await done.wait()
    log.info("stopping")
    await server.stop()
    if server.fatal is not None:
        log.error("generation failed (%r); state saved, exiting with code 1", server.fatal)
        return 1
    return 0


async def drain(
    rollout: RolloutLoop,
    drain_s: float,
    done: asyncio.Event,
    told: Callable[[], bool] = lambda: True,
) -> None:
    """A preemption notice (SIGTERM; docs/DESIGN.md §6.5): closes admission, then sets `done` once
    every group made has been acknowledged (`RolloutLoop.drained`) and the trainer was told so
    (`told`: a Pull found nothing left), after `drain_s` seconds, or when something else (a second
    SIGTERM, a failure) set it first. The trainer meanwhile pulls the running groups as they
    finish and the queued ones; whatever it has not acknowledged by the stop stays in the saved
    state and is re-issued when the server restarts."""
    log.info("SIGTERM: draining for up to %.0fs (a second SIGTERM stops at once)", drain_s)
    rollout.drain()
    deadline = asyncio.get_running_loop().time() + drain_s
    while not done.is_set():
        if rollout.drained() and told():
            log.info("drained: every group made was acknowledged")
            break
        left = deadline - asyncio.get_running_loop().time()
        if left <= 0:
            log.info("drain time (server.drain_s = %.0fs) over: the rest is saved", drain_s)
            break
        try:
            await asyncio.wait_for(done.wait(), min(left, 0.05))
        except TimeoutError:
            pass
    done.set()
