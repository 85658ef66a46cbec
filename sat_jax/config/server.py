"""The rollout server process: the ``server.*`` keys (docs/DESIGN.md §6, §10, §12).

Only the process's own settings (addresses, limits, persistence, its mesh and serving dtype);
what it samples is ``rollout.*`` and what it serves is ``model.*``.
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp

from sat_jax.sharding import MeshConfig

_LOOPBACK_HOSTS = ("127.0.0.1", "localhost", "::1")
# `server.weight_dtype` / `server.kv_cache_dtype` (`sat_jax.quant.FORMATS`).
_QUANT_FORMATS = ("bfloat16", "int8", "fp8")
# Frozen, so one shared default instance is safe.
_ONE_DEVICE_MESH = MeshConfig(fsdp=1)


@dataclasses.dataclass(frozen=True, kw_only=True)
class ServerConfig:
    """The rollout server process.

    Attributes:
      host: bind address; anything but loopback requires `token`.
      port: gRPC port for JetStream's Orchestrator and our Rollout service.
      metrics_port: Prometheus port; 0 disables it.
      metrics_host: the Prometheus port's bind address (loopback unless set otherwise).
      token: shared secret every RPC but Health must carry as gRPC metadata
        `authorization: Bearer <token>` ("" = none, loopback only; docs/DESIGN.md §10).
      checkpoint_root: `UpdateWeights` loads checkpoints only under this directory ("" refuses
        every path).
      state_dir: where prompt position and unpulled prompts persist ("" = no persistence).
      wait_for_weights: generate nothing until the first `UpdateWeights` (or weights restored
        from `state_dir`); False = also sample with the server's own random initial weights as
        version 0 (a stand-alone demo; a trainer drops those groups).
      slots: concurrent decodes (the decode batch).
      max_prefill_length: longest prompt in tokens (as the tokenizer encodes it); a power of two
        in [16, 32768] (JetStream). Longer prompts are skipped and counted.
      max_message_bytes: gRPC message size limit of replies (a Pull's groups).
      max_request_bytes: the largest request the server reads (its gRPC receive limit); the
        largest legitimate one (a Decode prompt, a Pull's acknowledgements) is well under 1 MiB.
      grpc_threads: threads that wait for and hand out groups (Pull); UpdateWeights has its own.
      max_concurrent_rpcs: RPCs served at once; more are refused with RESOURCE_EXHAUSTED.
      lease_s: a pulled group not acknowledged within this many seconds returns to the queue.
      drain_s: on SIGTERM (a preemption notice: Cloud TPU spot/preemptible VMs and GKE send it)
        the server stops admitting, lets the trainer pull its running and finished groups for up
        to this many seconds, saves its state and exits with status 0; what is left is re-issued
        when it restarts on its `state_dir` (docs/DESIGN.md §6.5). 0 = stop at once, as SIGINT
        does. A second SIGTERM ends the drain at once.
      max_version_jump: UpdateWeights may raise the weights version by at most this much.
      seed: sampling PRNG seed.
      tls_cert, tls_key: PEM files; when both are set the gRPC port and the HTTP port
        (`http_port`) serve TLS only. A non-loopback `host` with an `http_port` needs them.
      dtype: storage dtype of the served weights ("" = `model.param_dtype`); pushed weights are
        cast to it, e.g. float32 trainer weights served in bfloat16 (docs/DESIGN.md §11).
      mesh: the engine's device mesh, the trainer's `MeshConfig` and logical-axis rules (params
        by the rules, the KV cache's heads over `tensor`); the default is one device, and a -1
        axis takes every device (docs/DESIGN.md §12).
      http_port: the OpenAI-compatible HTTP endpoint's port on `host` (0 = off): chat and
        completions on the rollouts' engine, with `token` as its bearer token (docs/DESIGN.md
        §6.6).
      http_sessions: admitted samples are played by external agents as HTTP sessions instead of
        in-server episodes (needs `http_port` and `task.chat_template`).
      http_max_body_bytes, http_max_messages: the largest request body and the most messages
        of a chat request.
      http_max_sessions: sessions taken and not ended at once (more are refused with 429).
      http_max_requests: requests without a session generating at once (more get 429).
      http_session_idle_s: a taken session with no request for this long is dropped and its
        sample generated again.
      http_sampling: "strict" (a request's temperature, top_p, seed... other than the server's
        sampler is refused with 400) or "override" (they are served with the server's sampler,
        whose log-probs are the ones that train, and the reply's `sampling` says so): for agent
        frameworks that send their own settings.
      http_reasoning_parser: "" (a reply's `<think>...</think>` stays in `content`) or "qwen3"
        (it goes to `reasoning_content`, as vLLM's qwen3 reasoning parser does).
      http_session_fork: a session request whose history diverges from the session's starts a
        new segment of the sample (re-prefilled from the new history) instead of a 400
        `history_mismatch`.
      weight_dtype: "bfloat16" (the served weights as they are, in `dtype`), "int8" or "fp8"
        (float8_e4m3fn): the server quantizes what it installs per output channel (experts,
        attention projections, dense MLPs, the LM head; router, norms and embedding stay) and
        dequantizes on use; behavior log-probs are the quantized model's (docs/DESIGN.md §6.1).
      kv_cache_dtype: "bfloat16" (the decode KV cache in `dtype`), "int8" or "fp8": the cache
        stored 8-bit with a float32 scale per position and KV head, written in place.
    """

    host: str = "127.0.0.1"
    port: int = 9000
    metrics_port: int = 0
    metrics_host: str = "127.0.0.1"
    token: str = ""
    checkpoint_root: str = ""
    state_dir: str = ""
    wait_for_weights: bool = True
    slots: int = 8
    max_prefill_length: int = 32
    max_message_bytes: int = 256 * 1024 * 1024
    max_request_bytes: int = 4 * 1024 * 1024
    grpc_threads: int = 8
    max_concurrent_rpcs: int = 64
    lease_s: float = 300.0
    drain_s: float = 20.0
    max_version_jump: int = 1_000_000
    seed: int = 0
    tls_cert: str = ""
    tls_key: str = ""
    dtype: str = ""
    mesh: MeshConfig = _ONE_DEVICE_MESH
    http_port: int = 0
    http_sessions: bool = False
    http_max_body_bytes: int = 1024 * 1024
    http_max_messages: int = 256
    http_max_sessions: int = 256
    http_max_requests: int = 64
    http_session_idle_s: float = 600.0
    http_sampling: str = "strict"
    http_reasoning_parser: str = ""
    http_session_fork: bool = False
    weight_dtype: str = "bfloat16"
    kv_cache_dtype: str = "bfloat16"

    def __post_init__(self) -> None:
        self._check_http()
        if self.dtype:
            _check_float_dtype(self.dtype)
        self._check_quantization()
        if self.host not in _LOOPBACK_HOSTS and not self.token:
            raise ValueError(f"host {self.host!r} is not loopback: a token is required")
        for name in ("port", "metrics_port"):
            if not 0 <= getattr(self, name) < 65536:
                raise ValueError(f"{name} must be in [0, 65535], got {getattr(self, name)}")
        for name in ("slots", "grpc_threads", "max_concurrent_rpcs", "max_version_jump"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")
        if not self.lease_s > 0:
            raise ValueError(f"lease_s must be > 0, got {self.lease_s}")
        if not 0 <= self.drain_s <= 3600:
            raise ValueError(f"drain_s must be in [0, 3600], got {self.drain_s}")
        n = self.max_prefill_length
        if n < 16 or n > 32768 or n & (n - 1):
            raise ValueError(f"max_prefill_length must be a power of two in [16, 32768], got {n}")
        if bool(self.tls_cert) != bool(self.tls_key):
            raise ValueError("tls_cert and tls_key must be set together")
        if self.max_message_bytes < 1024 * 1024:
            raise ValueError(f"max_message_bytes must be >= 1 MiB, got {self.max_message_bytes}")
        if self.max_request_bytes < 64 * 1024:
            raise ValueError(f"max_request_bytes must be >= 64 KiB, got {self.max_request_bytes}")

    def _check_quantization(self) -> None:
        for key in ("weight_dtype", "kv_cache_dtype"):
            fmt = getattr(self, key)
            if fmt not in _QUANT_FORMATS:
                raise ValueError(
                    f"server.{key} must be one of {', '.join(_QUANT_FORMATS)}, got {fmt!r}"
                )
            if fmt != "bfloat16" and self.dtype and jnp.dtype(self.dtype).itemsize < 2:
                raise ValueError(
                    f"server.{key} {fmt} needs server.dtype of 16 or 32 bits, got {self.dtype}"
                )

    def _check_http(self) -> None:
        if not 0 <= self.http_port < 65536:
            raise ValueError(f"http_port must be in [0, 65535], got {self.http_port}")
        if self.http_port and self.http_port == self.port:
            raise ValueError(f"http_port {self.http_port} is the gRPC port")
        if self.http_sessions and not self.http_port:
            raise ValueError("http_sessions needs an http_port")
        if self.http_session_fork and not self.http_sessions:
            raise ValueError("http_session_fork needs http_sessions")
        if self.http_port and self.host not in _LOOPBACK_HOSTS and not self.tls_cert:
            raise ValueError(
                f"http_port on the non-loopback host {self.host!r} needs tls_cert and tls_key "
                "(the bearer token would cross the network in clear)"
            )
        if self.http_max_body_bytes < 1024:
            raise ValueError(f"http_max_body_bytes must be >= 1024, got {self.http_max_body_bytes}")
        for name in ("http_max_messages", "http_max_sessions", "http_max_requests"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")
        if self.http_sampling not in ("strict", "override"):
            raise ValueError(
                f"http_sampling must be strict or override, got {self.http_sampling!r}"
            )
        if self.http_reasoning_parser not in ("", "qwen3"):
            raise ValueError(
                f"http_reasoning_parser must be '' or qwen3, got {self.http_reasoning_parser!r}"
            )
        if not self.http_session_idle_s > 0:
            raise ValueError(f"http_session_idle_s must be > 0, got {self.http_session_idle_s}")


def _check_float_dtype(name: str) -> None:
    try:
        dtype = jnp.dtype(name)
    except TypeError as e:
        raise ValueError(f"dtype {name!r} is not a dtype") from e
    if not jnp.issubdtype(dtype, jnp.floating):
        raise ValueError(f"dtype must be a floating dtype, got {dtype}")
