"""What the trainer builds from an ``ExperimentConfig`` before its loop (docs/DESIGN.md §7, §8):
the optimizer, the run's directories, the base policy, the batch shape, the sampleable ids, the
reference policy's log-probs and the server pool.

Pure builders, shared by ``train.main`` (the job), the benchmarks, the notebook and the tests; none
of them starts a loop. ``base_policy`` loads ``model.hf_path`` or runs (or loads) the cached supervised warm-up.
"""

from __future__ import annotations

import functools
import logging
import os
import time
import uuid
from collections.abc import Callable
from typing import Any

import jax
import numpy as np
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec

from rollout_api.client import read_ca
from sat_jax.experiment import ExperimentConfig, make_tokenizer
from sat_jax.model import hf
from sat_jax.parallel import sharding
from sat_jax.tasks import sampleable_mask as tokenizer_mask
from sat_jax.train_step import next_token_logprobs
from train import batching, warmup
from train.local_server import LocalServer
from train.remote import ServerPool

log = logging.getLogger("train")


def run_paths(cfg: ExperimentConfig) -> tuple[str, str, str]:
    """``(run_dir, checkpoint_dir, weights_dir)``; empty ``train.run_dir`` and
    ``train.checkpoint_dir`` mean ``runs/<name>`` and ``<run_dir>/checkpoints``."""
    run_dir = cfg.train.run_dir or os.path.join("runs", cfg.name)
    ckpt_dir = cfg.train.checkpoint_dir or os.path.join(run_dir, "checkpoints")
    return run_dir, ckpt_dir, os.path.join(run_dir, "weights")


def run_id(run_dir: str) -> str:
    """This run's id: random, made on the run's first start and kept in ``<run_dir>/run_id``, so
    a restarted trainer of the same run is the same run to the servers."""
    path = os.path.join(run_dir, "run_id")
    if not os.path.exists(path):
        os.makedirs(run_dir, exist_ok=True)
        tmp = f"{path}.{os.getpid()}.tmp"
        with open(tmp, "w") as f:
            f.write(uuid.uuid4().hex)
        os.replace(tmp, path)
    with open(path) as f:
        return f.read().strip()


def base_policy(cfg: ExperimentConfig, mesh: jax.sharding.Mesh) -> tuple[nnx.GraphDef, Any]:
    """The starting policy: ``model.hf_path``'s weights when set (no warm-up); else random init
    (``train.seed``), then the supervised warm-up when configured, cached under
    ``train.sft_cache_dir``."""
    if cfg.model.hf_path:
        return _load_hf(cfg, mesh)
    graphdef, params = sharding.init_sharded(cfg.model, mesh, cfg.train.seed)
    t = cfg.train
    if t.warmup_sft_steps:
        start = time.monotonic()
        params, cached = warmup.cached_warmup(
            t.sft_cache_dir,
            cfg.model,
            cfg.task,
            params,
            init_seed=t.seed,
            steps=t.warmup_sft_steps,
            batch=t.sft_batch,
            learning_rate=t.sft_learning_rate,
            seq_len=cfg.server.max_prefill_length + cfg.rollout.max_new_tokens,
        )
        how = f"loaded from {t.sft_cache_dir}" if cached else f"{t.warmup_sft_steps} steps"
        log.info("supervised warm-up: %s (%.1fs)", how, time.monotonic() - start)
    return graphdef, params


def _load_hf(cfg: ExperimentConfig, mesh: jax.sharding.Mesh) -> tuple[nnx.GraphDef, Any]:
    """``model.hf_path``'s weights in ``model.param_dtype``, each read straight into its sharding."""
    start = time.monotonic()
    _, abstract = sharding.abstract_model(cfg.model)
    shardings = sharding.param_shardings(abstract, mesh)
    graphdef, params = hf.load_params(cfg.model.hf_path, cfg.model, shardings)
    log.info("loaded %s (%.1fs)", cfg.model.hf_path, time.monotonic() - start)
    return graphdef, params


def batch_spec(cfg: ExperimentConfig) -> batching.BatchSpec:
    """The batch shape: every prompt fits the server's prefill, every completion its limit; the
    time axis is bucketed from ``train.length_bucket``."""
    m = cfg.model
    return batching.BatchSpec(
        batch_groups=cfg.rollout.batch_groups,
        group_size=cfg.rollout.group_size,
        seq_len=cfg.server.max_prefill_length + cfg.rollout.max_new_tokens,
        length_bucket=cfg.train.length_bucket,
        routing_lk=(m.num_moe_layers, m.num_experts_per_tok) if cfg.train.routing_replay else None,
        routing_dtype=np.dtype(m.routing_dtype).name,
        max_staleness=cfg.rollout.max_staleness,
        stale_policy=cfg.train.stale_policy,
        estimator=cfg.train.advantage_estimator,
        normalize_std=cfg.train.normalize_std,
        vocab_size=m.vocab_size,
        num_experts=m.num_experts,
    )


def sampleable_mask(cfg: ExperimentConfig) -> np.ndarray:
    """[V] bool: the ids the server samples from, over which the trainer renormalizes too
    (``sat_jax.tasks.sampleable_mask`` of the configured tokenizer)."""
    return tokenizer_mask(make_tokenizer(cfg), cfg.model.vocab_size)


def make_ref_logp(
    graphdef: nnx.GraphDef,
    ref_params: Any,
    mesh: jax.sharding.Mesh,
    temperature: float,
    vocab_mask: np.ndarray,
) -> Callable[[np.ndarray], np.ndarray]:
    """Reference-policy (the warm-up policy) log-probs of a batch's tokens, for the KL penalty.

    The result is replicated over ``mesh``, so every process reads the whole [B, T] array.
    """

    @functools.partial(jax.jit, out_shardings=NamedSharding(mesh, PartitionSpec()))
    def ref_logp(tokens_bt: jax.Array) -> jax.Array:
        logits = nnx.merge(graphdef, ref_params)(tokens_bt)
        return next_token_logprobs(
            logits, tokens_bt, temperature=temperature, vocab_mask=vocab_mask
        )

    return lambda tokens: np.asarray(ref_logp(tokens))


def connect(cfg: ExperimentConfig, server: LocalServer | None, *, run: str = "") -> ServerPool:
    """The configured servers (``train.servers`` and ``train.servers_file``), or the local child
    once it answers; a crashed child is restarted from the pool's retry loop. Calls carry
    ``server.token`` and the run's id ``run`` (``run_id``; "" = anonymous); with ``train.tls_ca``
    the channels are TLS. Down servers are probed on the pool's own thread."""
    t = cfg.train
    ca = read_ca(t.tls_ca)
    if server is not None:
        server.wait_ready(timeout_s=t.server_wait_s, root_certificates=ca)
    return ServerPool(
        t.servers if t.servers or t.servers_file else (server.address,),
        token=cfg.server.token,
        run_id=run,
        root_certificates=ca,
        max_message_bytes=cfg.server.max_message_bytes,
        retry_max_s=t.retry_max_s,
        server_wait_s=t.server_wait_s,
        grace_s=t.server_grace_s,
        servers_file=t.servers_file,
        background=True,
        on_retry=None if server is None else server.restart_if_exited,
    )
