"""`python -m rollout_server ... server.mesh.tensor=2 server.mesh.expert=4` on 8 simulated CPU
devices: the behavior log-probs it serves are the model's log-softmax (temperature 1, no
truncation) from a full forward of the pushed params on one device."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from rollout_api.proto import rollout_pb2
from sat_jax.experiment import load_config, make_tokenizer
from sat_jax.model import Transformer, token_logprobs
from sat_jax.params_io import save_params
from sat_jax.tasks import sampleable_mask
from tests.rollout_server.conftest import CONFIG, SHAPES, pull_all, random_params

pytestmark = pytest.mark.slow  # starts a server process on 8 simulated devices

MESH = ["server.mesh.tensor=2", "server.mesh.expert=4"]  # tiny: 2 KV heads, 8 experts
VERSION = 3
GROUPS = 3


def test_sharded_server_logprobs_are_the_models_log_softmax(server_factory, tmp_path):
    overrides = [
        *MESH,
        f"server.checkpoint_root={tmp_path / 'ckpt'}",
        "rollout.temperature=1.0",
        "rollout.top_k=0",
        "rollout.top_p=1.0",
    ]
    cfg = load_config(str(CONFIG), [*SHAPES, *overrides])
    params = random_params("tiny", seed=7)
    path = tmp_path / "ckpt" / f"v{VERSION}"
    save_params(path, params)
    server = server_factory(overrides, devices=8)
    stub = server.rollout_stub()
    request = rollout_pb2.UpdateWeightsRequest(version=VERSION, checkpoint_path=str(path))
    assert stub.UpdateWeights(request, timeout=120).version == VERSION
    groups = pull_all(stub, GROUPS, timeout_s=240)
    assert "engine mesh {'data': 1, 'fsdp': 1, 'expert': 4, 'tensor': 2}" in server.log()

    model_cfg = cfg.serving_model
    graphdef = nnx.split(nnx.eval_shape(lambda: Transformer(model_cfg, rngs=nnx.Rngs(0))))[0]
    mask_v = sampleable_mask(make_tokenizer(cfg), model_cfg.vocab_size)
    forward = jax.jit(lambda p, seq: nnx.merge(graphdef, p)(seq))
    for group in groups:
        for t in group.trajectories:
            assert list(t.versions) == [VERSION] * len(t.completion_ids)  # waited for weights
            prompt, completion = list(t.prompt_ids), list(t.completion_ids)
            seq = jnp.asarray([prompt + completion], jnp.int32)
            logits_btv = forward(params, seq)
            ref = token_logprobs(logits_btv[:, :-1], seq[:, 1:], vocab_mask=mask_v)[0]
            np.testing.assert_allclose(
                np.asarray(t.behavior_logprobs),
                np.asarray(ref[len(prompt) - 1 :]),
                atol=1e-4,
                rtol=1e-5,
            )
    assert server.stop() == 0, server.log()
