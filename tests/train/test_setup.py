"""train.setup: what the trainer builds from a config (optimizer, paths, base policy, batch shape,
sampleable ids, and the server pool, live against a fake Rollout service). The reference policy's
log-probs are the train step's (tests/sat_jax/step/test_microbatches.py)."""

from __future__ import annotations

import jax
import numpy as np
import pytest

from sat_jax import sharding
from sat_jax.experiment import load_config
from tests.train.test_remote import FakeRollout, serve
from train import membership, setup

MiB = 1024 * 1024


def test_optimizer_warms_the_learning_rate_up_from_0():
    cfg = load_config(
        None,
        [
            "train.steps=10",
            "train.optimizer.lr_warmup_steps=2",
            "train.optimizer.lr_schedule=linear",
            "train.optimizer.grad_clip=1.0",
            "train.optimizer.learning_rate=0.5",
        ],
    )
    opt = cfg.train.optimizer.make(cfg.train.steps)
    params = {"w": np.zeros(2, np.float32)}
    state = opt.init(params)
    grads = {"w": np.asarray([3.0, 4.0], np.float32)}
    # Warm-up step 0 has learning rate 0; the next update moves the params against the gradient.
    updates, state = opt.update(grads, state, params)
    assert np.all(np.asarray(updates["w"]) == 0)
    updates, state = opt.update(grads, state, params)
    assert np.all(np.asarray(updates["w"]) < 0)


def test_run_paths_default_under_runs_and_follow_the_config():
    cfg = load_config(None, ["name=exp"])
    assert setup.run_paths(cfg) == (
        "runs/exp",
        "runs/exp/checkpoints",
        "runs/exp/weights",
    )
    cfg = load_config(None, ["train.run_dir=/r", "train.checkpoint.dir=gs://b/c"])
    assert setup.run_paths(cfg) == ("/r", "gs://b/c", "/r/weights")


def test_base_policy_warms_up_through_the_configured_cache(monkeypatch, tmp_path):
    calls = []

    def cached_warmup(root, model_cfg, task, params, **kw):
        calls.append((root, kw))
        return params, True

    monkeypatch.setattr(setup.warmup, "cached_warmup", cached_warmup)
    cache = str(tmp_path / "cache")
    cfg = load_config(None, ["train.warmup.steps=7", f"train.warmup.cache_dir={cache}"])
    mesh = sharding.make_mesh(cfg.train.mesh, jax.devices()[:1])
    setup.base_policy(cfg, mesh)
    seq_len = cfg.server.max_prefill_length + cfg.rollout.max_new_tokens
    assert calls == [
        (
            cache,
            dict(
                init_seed=0,
                steps=7,
                batch=cfg.train.warmup.batch,
                learning_rate=3e-3,
                seq_len=seq_len,
            ),
        )
    ]
    calls.clear()
    setup.base_policy(load_config(None, ["train.warmup.steps=0"]), mesh)
    assert calls == []  # no warm-up configured


def test_batch_spec_and_sampleable_mask_come_from_the_config():
    cfg = load_config(
        None,
        ["rollout.batch_groups=3", "rollout.group_size=5", "train.stale_policy=keep"],
    )
    spec = setup.batch_spec(cfg)
    assert (spec.batch_groups, spec.group_size, spec.rows) == (3, 5, 15)
    assert spec.seq_len == cfg.server.max_prefill_length + cfg.rollout.max_new_tokens
    assert spec.routing_lk == (cfg.model.num_moe_layers, cfg.model.num_experts_per_tok)
    assert (spec.stale_policy, spec.routing_dtype) == ("keep", "uint8")
    assert setup.batch_spec(load_config(None, ["train.routing_replay=false"])).routing_lk is None
    mask = setup.sampleable_mask(cfg)
    assert mask.shape == (cfg.model.vocab_size,)
    assert not mask[0] and not mask[1] and mask[2]  # pad, bos out; eos in
    assert mask.sum() == len(cfg.task.alphabet) + 1


class _Recorder:
    def __init__(self):
        self.kwargs = None

    def __call__(self, addresses, **kwargs):
        self.kwargs = dict(addresses=tuple(addresses), **kwargs)
        return self


def test_connect_passes_every_server_setting_of_the_config(monkeypatch, tmp_path):
    ca = tmp_path / "ca.pem"
    ca.write_bytes(b"PEM")
    recorder = _Recorder()
    monkeypatch.setattr(setup, "ServerPool", recorder)
    cfg = load_config(
        None,
        [
            "train.client.servers=[h1:1, h2:2]",
            f"server.max_message_bytes={3 * MiB}",
            "server.token=s3cret",
            "train.client.retry_max_s=2.5",
            "train.client.wait_s=42",
            "train.client.grace_s=3",
            f"train.client.servers_file={tmp_path / 'servers'}",
            f"train.tls_ca={ca}",
        ],
    )
    setup.connect(cfg, None, run="run-7")
    assert recorder.kwargs == dict(
        addresses=("h1:1", "h2:2"),
        token="s3cret",
        run_id="run-7",
        root_certificates=b"PEM",
        max_message_bytes=3 * MiB,
        retry_max_s=2.5,
        server_wait_s=42.0,
        grace_s=3.0,
        servers_file=str(tmp_path / "servers"),
        background=True,
        on_retry=None,
        batch_groups=cfg.rollout.batch_groups,
        max_staleness=cfg.rollout.max_staleness,
    )


def test_connect_waits_for_the_local_server_and_restarts_it_on_retry(monkeypatch):
    recorder = _Recorder()
    monkeypatch.setattr(setup, "ServerPool", recorder)

    class LocalStandIn:
        address = "127.0.0.1:1234"
        ready = False

        def wait_ready(self, *, timeout_s, root_certificates=None):
            self.ready = timeout_s

        def restart_if_exited(self):
            pass

    local = LocalStandIn()
    setup.connect(load_config(None, ["train.client.wait_s=77"]), local)
    assert local.ready == 77.0 and recorder.kwargs["addresses"] == (local.address,)
    assert recorder.kwargs["on_retry"] == local.restart_if_exited


@pytest.mark.parametrize("limit_mib, fits", [(1, False), (8, True)])
def test_the_configured_message_limit_reaches_the_pool(limit_mib, fits):
    # A live fake server sends 2 MiB groups: a pool built from a config with a smaller
    # server.max_message_bytes refuses them, naming the key; a larger one receives them.
    for address in serve(FakeRollout(payload_bytes=2 * MiB)):
        cfg = load_config(
            None,
            [
                f"train.client.servers=[{address}]",
                f"server.max_message_bytes={limit_mib * MiB}",
                "train.client.retry_max_s=0.1",
                "train.client.wait_s=30",
            ],
        )
        with setup.connect(cfg, None) as pool:
            if fits:
                assert len(pool.pull(1, timeout_s=1.0)) == 1
            else:
                with pytest.raises(
                    membership.MessageTooLargeError, match="server.max_message_bytes"
                ):
                    pool.pull(1, timeout_s=1.0)
