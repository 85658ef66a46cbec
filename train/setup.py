"""What the trainer builds from an ``ExperimentConfig`` before its loop (docs/DESIGN.md §7, §8):
the run's directories, the base policy, the batch shape, the sampleable ids and the server pool
(the optimizer is ``cfg.train.optimizer.make(cfg.train.steps)``; the reference policy's log-probs, for the KL
penalty, are computed inside the train step from the base policy's params).

Pure builders, shared by ``train.main`` (the job), the benchmarks, the notebook and the tests; none
of them starts a loop. ``base_policy`` loads ``model.hf_path`` or runs (or loads) the cached supervised warm-up.
"""

from __future__ import annotations

import logging
import math
import os
import time
import uuid
from typing import Any

import jax
import numpy as np
from flax import nnx

from sat_jax import sharding
from sat_jax.config import Connection
from sat_jax.experiment import ConfigError, ExperimentConfig, make_tokenizer
from sat_jax.model import hf, placement
from sat_jax.model.config import LoRAConfig
from sat_jax.model.lora import init_lora, join_lora, split_lora
from sat_jax.tasks import sampleable_mask as tokenizer_mask
from train import batching, warmup
from train.local_server import LocalServer
from train.remote import ServerPool

log = logging.getLogger("train")


def run_paths(cfg: ExperimentConfig) -> tuple[str, str, str]:
    """``(run_dir, checkpoint_dir, weights_dir)``; empty ``train.run_dir`` and
    ``train.checkpoint.dir`` mean ``runs/<name>`` and ``<run_dir>/checkpoints``."""
    run_dir = cfg.train.run_dir or os.path.join("runs", cfg.name)
    return run_dir, cfg.train.checkpoint.directory(run_dir), os.path.join(run_dir, "weights")


def check_run(cfg: ExperimentConfig) -> None:
    """Refuses, before anything starts, a run that could only fail later: a local server child
    whose ``server.checkpoint_root`` does not hold the run's weights directory (every push
    would be refused by the child).

    Raises:
      ConfigError: one line naming the keys.
    """
    root = cfg.server.checkpoint_root
    if not cfg.train.client.local_server or not root:
        return
    run_dir, _, weights_dir = run_paths(cfg)
    inside = os.path.commonpath([os.path.realpath(root), os.path.realpath(weights_dir)])
    if inside != os.path.realpath(root):
        raise ConfigError(
            f"train.run_dir: the run's weights ({weights_dir}) are outside server.checkpoint_root "
            f"({root}), so the local server would refuse every push; set "
            f"server.checkpoint_root={run_dir} (or leave it unset: it then follows train.run_dir)"
        )


def connection(cfg: ExperimentConfig) -> Connection:
    """The server pool's ``Connection``: ``train.client.*`` with ``train.tls_ca`` and the
    servers' ``server.token`` and ``server.max_message_bytes`` (``ClientConfig.connection``).

    Raises:
      OSError: ``train.tls_ca`` cannot be read.
    """
    return cfg.train.client.connection(
        token=cfg.server.token,
        max_message_bytes=cfg.server.max_message_bytes,
        tls_ca=cfg.train.tls_ca,
    )


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
    (``train.seed``), then the supervised warm-up its part configures (``train.warmup.run``:
    cached under ``train.warmup.cache_dir``). Under LoRA (``model.lora.rank`` > 0) that is the base,
    and the adapters are fresh (``init_lora``, seeded by ``train.seed``; B = 0)."""
    if cfg.model.hf_path:
        return _load_hf(cfg, mesh)
    # Under LoRA the warm-up trains the base alone (the cache is a full run's), then fresh
    # adapters (B = 0) join it: step 0 is exactly the warmed-up base.
    base_cfg = cfg.model.replace(lora=LoRAConfig())
    _, params = placement.init_sharded(base_cfg, mesh, cfg.train.seed)
    seq_len = cfg.server.max_prefill_length + cfg.rollout.max_new_tokens
    params = warmup.run(
        cfg.train.warmup, base_cfg, cfg.task, params, init_seed=cfg.train.seed, seq_len=seq_len
    )
    graphdef, abstract = placement.abstract_model(cfg.model)
    if cfg.model.lora.rank:
        shardings = split_lora(sharding.param_shardings(abstract, mesh))[1]
        params = join_lora(params, init_lora(cfg.model, shardings, cfg.train.seed))
    return graphdef, params


def _load_hf(cfg: ExperimentConfig, mesh: jax.sharding.Mesh) -> tuple[nnx.GraphDef, Any]:
    """``model.hf_path``'s weights in ``model.param_dtype``, each read straight into its sharding."""
    start = time.monotonic()
    _, abstract = placement.abstract_model(cfg.model)
    shardings = sharding.param_shardings(abstract, mesh)
    graphdef, params = hf.load_params(cfg.model.hf_path, cfg.model, shardings)
    log.info("loaded %s (%.1fs)", cfg.model.hf_path, time.monotonic() - start)
    return graphdef, params


def batch_spec(cfg: ExperimentConfig) -> batching.BatchSpec:
    """The batch spec (``BatchSpec.from_config``): every prompt fits the server's prefill, every
    completion (a multi-turn episode's generated and inserted tokens) ``cfg.completion_tokens``;
    packed rows' counts are multiples of the train mesh's data-parallel shards; the task's
    tokenizer replays constrained decoding's masks (``response_format``)."""
    return batching.BatchSpec.from_config(
        cfg.rollout,
        cfg.train,
        cfg.model,
        seq_len=cfg.server.max_prefill_length + cfg.completion_tokens,
        row_multiple=_batch_shards(cfg.train.mesh),
        tokenizer=make_tokenizer(cfg),
    )


def _batch_shards(mesh: sharding.MeshConfig) -> int:
    """The data-parallel shards of the train mesh (a packed batch's row count is a multiple)."""
    sizes = mesh.axis_sizes(jax.device_count())
    return math.prod(sizes[a] for a in sharding.batch_axes(sizes))


def sampleable_mask(cfg: ExperimentConfig) -> np.ndarray:
    """[V] bool: the ids the server samples from, over which the trainer renormalizes too
    (``sat_jax.tasks.sampleable_mask`` of the configured tokenizer)."""
    return tokenizer_mask(make_tokenizer(cfg), cfg.model.vocab_size)


def connect(cfg: ExperimentConfig, server: LocalServer | None, *, run: str = "") -> ServerPool:
    """The configured servers (``train.client.servers`` and ``train.client.servers_file``), or the local child
    once it answers; a crashed child is restarted from the pool's retry loop. Calls carry
    ``server.token`` and the run's id ``run`` (``run_id``; "" = anonymous); with ``train.tls_ca``
    the channels are TLS (``connection``). Down servers are probed on the pool's own
    thread."""
    client = cfg.train.client
    conn = connection(cfg)
    if server is not None:
        server.wait_ready(timeout_s=client.wait_s, root_certificates=conn.root_certificates)
    return ServerPool(
        (server.address,) if client.local_server else client.servers,
        token=conn.token,
        run_id=run,
        root_certificates=conn.root_certificates,
        max_message_bytes=conn.max_message_bytes,
        retry_max_s=conn.retry_max_s,
        server_wait_s=conn.server_wait_s,
        grace_s=conn.grace_s,
        servers_file=conn.servers_file,
        background=True,
        on_retry=None if server is None else server.restart_if_exited,
        batch_groups=cfg.rollout.batch_groups,
        max_staleness=cfg.rollout.max_staleness,
    )
