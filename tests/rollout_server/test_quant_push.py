"""Pre-quantized pushes (docs/DESIGN.md §6.1): for servers with `server.weight_dtype` int8 or fp8
the trainer quantizes the serving-dtype cast itself (`weight_sync.host_copy(..., weight_dtype)`),
the save records the format in the version's index, and the server installs the 8-bit values and
scales as they are, bit-identical to quantizing a full-precision push on install. A pre-quantized
push of another format is dequantized first; a format the server does not know, or values it
cannot install, are refused and the served weights and version stay; with the option off the
push and its files are exactly today's."""

from __future__ import annotations

import functools
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from rollout_server.engine import MoEEngine
from rollout_server.weights import CheckpointPathError, WeightsLoader
from sat_jax import params_io, quant
from sat_jax.decoding import SamplingConfig
from sat_jax.model import ModelConfig
from sat_jax.model.config import LoRAConfig
from sat_jax.tasks import CharTokenizer
from tests.random_models import random_params
from train.weight_sync import host_copy, push_format, push_weights

CFG = ModelConfig.preset("tiny", dispatch="dense")
TOK = CharTokenizer("0123456789+-*=() ")
BF16 = jnp.bfloat16


@functools.cache
def _masters():
    """(graphdef, the trainer's float32 master params)."""
    return random_params(CFG, seed=0)


def _engine(weight_dtype: str) -> MoEEngine:
    """An engine serving bfloat16 weights (`server.dtype`), quantized per ``weight_dtype``."""
    graphdef, masters = _masters()
    model = nnx.merge(graphdef, jax.tree.map(lambda x: x.astype(BF16) * 0.5, masters))
    return MoEEngine(
        model,
        tokenizer=TOK,
        slots=2,
        max_prefill_length=16,
        max_decode_length=4,
        sampling=SamplingConfig(),
        weight_dtype=weight_dtype,
    )


class InstallingPool:
    """A `ServerPool` whose `update_weights` does what a server's UpdateWeights does: the
    loader restores the version into the engine's layout, the engine installs it."""

    def __init__(self, engine: MoEEngine, root):
        self.engine = engine
        self.loader = WeightsLoader(str(root), LoRAConfig())
        self.nbytes: list[int] = []

    def update_weights(self, version, checkpoint_path, *, base_path="", **_):
        loaded = self.loader.load(checkpoint_path, base_path, self.engine.current_params()[1])
        self.engine.swap_params(version, loaded.params)
        self.nbytes.append(loaded.nbytes)


def _served(engine):
    return [np.asarray(x) for x in jax.tree.leaves(engine.served_params()[1])]


def _push(engine, tmp_path, weight_dtype, version=1, params=None):
    """The trainer's push of its masters (or ``params``) as ``version``, in ``weight_dtype``."""
    pool = InstallingPool(engine, tmp_path)
    copy = host_copy(_masters()[1] if params is None else params, BF16, weight_dtype)
    push_weights(pool, copy, version, str(tmp_path))
    return pool


@pytest.mark.parametrize("fmt", ["int8", "fp8"])
def test_a_pre_quantized_push_installs_bit_identical_to_quantizing_on_install(tmp_path, fmt):
    quantized, full = _engine(fmt), _engine(fmt)
    q_pool = _push(quantized, tmp_path / "q", fmt)
    f_pool = _push(full, tmp_path / "f", "bfloat16")
    assert quantized.version == full.version == 1
    assert params_io.stored_weight_dtype(tmp_path / "q" / "v1") == fmt
    assert params_io.stored_weight_dtype(tmp_path / "f" / "v1") == "bfloat16"
    for a, b in zip(_served(quantized), _served(full), strict=True):
        np.testing.assert_array_equal(a, b)
    # The served weights are the new version's, not the engine's initial ones.
    want = jax.jit(functools.partial(quant.quantize_params, fmt=fmt))(
        jax.tree.map(lambda x: x.astype(BF16), _masters()[1])
    )
    for a, b in zip(_served(quantized), jax.tree.leaves(want), strict=True):
        np.testing.assert_array_equal(a, np.asarray(b))
    assert q_pool.nbytes[0] < 0.6 * f_pool.nbytes[0]  # 8-bit values + scales vs bfloat16


def test_a_pre_quantized_push_of_another_format_is_dequantized_then_installed(tmp_path):
    """fp8 values to an int8 server: int8 of the dequantized fp8 weights; to an unquantized
    server: the dequantized weights themselves."""
    int8, plain = _engine("int8"), _engine("bfloat16")
    _push(int8, tmp_path / "a", "fp8")
    _push(plain, tmp_path / "b", "fp8")
    assert int8.version == plain.version == 1
    cast = jax.tree.map(lambda x: x.astype(BF16), _masters()[1])
    fp8 = quant.dequantize_params(quant.quantize_params(cast, "fp8"))
    for a, b in zip(_served(plain), jax.tree.leaves(fp8), strict=True):
        np.testing.assert_array_equal(a, np.asarray(b))
    want = jax.jit(functools.partial(quant.quantize_params, fmt="int8"))(fp8)
    for a, b in zip(_served(int8), jax.tree.leaves(want), strict=True):
        np.testing.assert_array_equal(a, np.asarray(b))


def test_a_push_of_a_format_the_server_cannot_install_changes_nothing(tmp_path):
    engine = _engine("int8")
    _push(engine, tmp_path, "int8", version=1)
    before = _served(engine)
    pool = InstallingPool(engine, tmp_path)
    path = tmp_path / "v2"
    params_io.save_flat(path, host_copy(_masters()[1], BF16, "int8"), durable=False)
    index = json.loads((path / params_io.FLAT_INDEX).read_text())
    index["weight_dtype"] = "int4"
    (path / params_io.FLAT_INDEX).write_text(json.dumps(index))
    with pytest.raises(CheckpointPathError, match="weight_dtype 'int4', which this server cannot"):
        pool.update_weights(2, str(path))
    assert engine.version == 1
    for a, b in zip(_served(engine), before, strict=True):
        np.testing.assert_array_equal(a, b)


def test_pre_quantized_values_that_cannot_be_installed_change_nothing(tmp_path):
    engine = _engine("int8")
    _push(engine, tmp_path, "int8", version=1)
    before = _served(engine)
    bad = host_copy(_masters()[1], BF16, "int8")
    w = bad["layers"][0]["attn"]["w_q_dnh"]
    bad["layers"][0]["attn"]["w_q_dnh"] = w.replace(scale=np.asarray(w.scale).copy() * np.nan)
    with pytest.raises(ValueError, match="pushed int8 weights hold inf or NaN"):
        engine.swap_params(2, bad)
    wrong = host_copy(_masters()[1], BF16, "int8")
    w = wrong["layers"][0]["attn"]["w_q_dnh"]
    wrong["layers"][0]["attn"]["w_q_dnh"] = w.replace(scale=np.asarray(w.scale)[..., :1])
    with pytest.raises(ValueError, match="does not match"):
        engine.swap_params(2, wrong)
    mixed = host_copy(_masters()[1], BF16, "int8")
    mixed["lm_head_dv"] = quant.quantize_params({"lm_head_dv": _masters()[1]["lm_head_dv"]}, "fp8")[
        "lm_head_dv"
    ]
    with pytest.raises(ValueError, match="mix weight formats"):
        engine.swap_params(2, mixed)
    assert engine.version == 1
    for a, b in zip(_served(engine), before, strict=True):
        np.testing.assert_array_equal(a, b)


def test_with_the_option_off_the_push_is_todays(tmp_path):
    """``server.weight_dtype`` bfloat16: the host copy and the version's files are exactly what
    they were without the key (no ``weight_dtype`` in the index)."""
    masters = _masters()[1]
    plain = host_copy(masters, BF16)
    off = host_copy(masters, BF16, push_format("bfloat16", str(tmp_path)))
    assert jax.tree.structure(off) == jax.tree.structure(plain)
    for a, b in zip(jax.tree.leaves(off), jax.tree.leaves(plain), strict=True):
        assert a.dtype == b.dtype
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    params_io.save_flat(tmp_path / "a", plain, durable=False)
    params_io.save_flat(tmp_path / "b", off, durable=False)
    for name in (params_io.FLAT_INDEX, params_io.FLAT_DATA):
        assert (tmp_path / "a" / name).read_bytes() == (tmp_path / "b" / name).read_bytes()
    assert "weight_dtype" not in json.loads((tmp_path / "a" / params_io.FLAT_INDEX).read_text())


def test_push_format_follows_the_servers_weight_dtype():
    assert push_format("int8", "/tmp/run/weights") == "int8"
    assert push_format("fp8", "/tmp/run/weights") == "fp8"
    assert push_format("bfloat16", "/tmp/run/weights") == "bfloat16"
    assert push_format("int8", "/tmp/run/weights", lora=True) == "bfloat16"
    assert push_format("fp8", "gs://bucket/run/weights") == "bfloat16"
    with pytest.raises(ValueError, match="server.weight_dtype must be one of"):
        push_format("int4", "/tmp/run/weights")


def test_a_lora_push_of_pre_quantized_weights_is_refused(tmp_path):
    params_io.save_flat(tmp_path / "base", host_copy(_masters()[1], BF16, "int8"))
    loader = WeightsLoader(str(tmp_path), LoRAConfig(rank=4, targets=("attention",)), {"a": 0})
    with pytest.raises(CheckpointPathError, match="a LoRA push's base and adapters are full"):
        loader.load(str(tmp_path / "base"), str(tmp_path / "base"), None)


def test_sharded_weights_record_the_format_and_load_pre_quantized(tmp_path):
    cast = jax.tree.map(lambda x: x.astype(BF16), _masters()[1])
    q = quant.quantize_params(cast, "fp8")
    part = params_io.save_shards(tmp_path / "v1", q, process=0)
    params_io.finish_shards(tmp_path / "v1", [part], weight_dtype="fp8")
    assert params_io.stored_weight_dtype(tmp_path / "v1") == "fp8"
    like = quant.abstract_quantized(
        jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, BF16), cast), "fp8"
    )
    back = params_io.load_params(tmp_path / "v1", like)
    assert quant.tree_format(back) == "fp8"
    for a, b in zip(jax.tree.leaves(back), jax.tree.leaves(q), strict=True):
        assert a.dtype == b.dtype
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_abstract_quantized_is_the_layout_quantize_params_makes():
    graphdef, masters = _masters()
    for fmt in ("int8", "fp8"):
        want = jax.eval_shape(functools.partial(quant.quantize_params, fmt=fmt), masters)
        got = quant.abstract_quantized(masters, fmt)
        assert jax.tree.structure(got) == jax.tree.structure(want)
        for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
            assert (a.shape, a.dtype) == (b.shape, b.dtype)
        assert quant.tree_format(got) == fmt
    assert quant.abstract_quantized(masters, "bfloat16") is masters
    assert quant.tree_format(masters) == "bfloat16"


@pytest.mark.slow  # starts server processes
def test_a_server_installs_a_pre_quantized_push_over_update_weights(server_factory, tmp_path):
    """Through the real UpdateWeights: a server with `server.weight_dtype` int8 installs the
    trainer's int8 push (and generates with it), refuses a format it cannot install with
    INVALID_ARGUMENT and keeps its version, and reloads the pre-quantized version on restart."""
    import grpc

    from rollout_api.proto import rollout_pb2
    from sat_jax import sharding
    from sat_jax.experiment import load_config
    from sat_jax.model import placement
    from tests.rollout_server.conftest import CONFIG, SHAPES, pull_all, stats

    root = tmp_path / "root"
    overrides = [
        f"server.state_dir={tmp_path / 'state'}",
        f"server.checkpoint_root={root}",
        "server.weight_dtype=int8",
    ]
    cfg = load_config(str(CONFIG), [*SHAPES, *overrides])
    mesh = sharding.make_mesh(sharding.MeshConfig(), jax.devices()[:1])
    _, masters = placement.init_sharded(cfg.serving_model, mesh, 3)
    root.mkdir()
    fmt = push_format(cfg.server.weight_dtype, str(root))
    push_weights(None, host_copy(masters, None, fmt), 1, str(root))
    assert params_io.stored_weight_dtype(root / "v1") == "int8"
    server = server_factory(overrides)
    stub = server.rollout_stub()
    request = rollout_pb2.UpdateWeightsRequest(version=1, checkpoint_path=str(root / "v1"))
    assert stub.UpdateWeights(request, timeout=60).version == 1
    groups = pull_all(stub, 1)
    assert {v for t in groups[0].trajectories for v in t.versions} == {1}

    push_weights(None, host_copy(masters, None, fmt), 2, str(root))
    index = json.loads((root / "v2" / params_io.FLAT_INDEX).read_text())
    (root / "v2" / params_io.FLAT_INDEX).write_text(json.dumps({**index, "weight_dtype": "int4"}))
    request = rollout_pb2.UpdateWeightsRequest(version=2, checkpoint_path=str(root / "v2"))
    with pytest.raises(grpc.RpcError) as refused:
        stub.UpdateWeights(request, timeout=60)
    assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "weight_dtype 'int4'" in refused.value.details()
    assert stats(stub).version == 1
    assert "dequantized" not in server.log()  # the int8 push was installed as it is
    server.kill()

    again = server_factory(overrides)
    assert f"restored weights version 1 from {(root / 'v1').resolve()}" in again.log()
    assert stats(again.rollout_stub()).version == 1
    assert again.stop() == 0


def test_a_sharded_pre_quantized_push_keeps_its_sharding_and_loads_onto_the_servers(tmp_path):
    """The trainer's quantized copy stays sharded (no gather); sharded weights of it load onto a
    server's shardings, scales unsharded over the contraction axes (`abstract_quantized`)."""
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:2]), ("x",))
    on = lambda *spec: jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec(*spec))
    rng = np.random.default_rng(0)
    masters = {
        "lm_head_dv": jax.device_put(rng.standard_normal((4, 6), np.float32), on(None, "x")),
        "w_q_dnh": jax.device_put(rng.standard_normal((4, 2, 3), np.float32), on("x")),
        "final_norm": {"scale": jnp.ones(4, jnp.float32)},
    }
    copy = host_copy(masters, BF16, "int8")
    assert copy["lm_head_dv"].q.sharding == on(None, "x").with_memory_kind("pinned_host")
    assert copy["w_q_dnh"].q.sharding == on("x").with_memory_kind("pinned_host")
    want = quant.quantize_params(jax.tree.map(lambda x: x.astype(BF16), masters), "int8")
    for a, b in zip(jax.tree.leaves(copy), jax.tree.leaves(want), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    part = params_io.save_shards(tmp_path / "v1", copy, process=0)
    params_io.finish_shards(tmp_path / "v1", [part], weight_dtype=quant.tree_format(copy))
    served = {  # the server shards the other way
        "lm_head_dv": jax.ShapeDtypeStruct((4, 6), BF16, sharding=on("x")),
        "w_q_dnh": jax.ShapeDtypeStruct((4, 2, 3), BF16, sharding=on(None, "x")),
        "final_norm": {"scale": jax.ShapeDtypeStruct((4,), BF16, sharding=on())},
    }
    like = quant.abstract_quantized(served, params_io.stored_weight_dtype(tmp_path / "v1"))
    assert like["lm_head_dv"].scale.sharding == on(None)
    back = params_io.load_params(tmp_path / "v1", like)
    assert back["lm_head_dv"].q.sharding == on("x")
    assert back["w_q_dnh"].scale.sharding == on(None, "x")
    for a, b in zip(jax.tree.leaves(back), jax.tree.leaves(want), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
