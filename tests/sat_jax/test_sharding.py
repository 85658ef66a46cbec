"""Mesh config, logical-axis rules, per-parameter specs and sharded init (8 simulated devices)."""

from __future__ import annotations

import jax
import numpy as np
import pytest
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from sat_jax import sharding
from sat_jax.model import LoRAConfig, ModelConfig, Transformer, placement
from sat_jax.model.lora import join_lora, split_lora

MeshConfig = sharding.MeshConfig
TINY = ModelConfig.preset("tiny", mlp_only_layers=(0,))


@pytest.mark.parametrize(
    ("cfg", "sizes"),
    [
        (MeshConfig(), {"data": 1, "fsdp": 8, "expert": 1, "tensor": 1}),
        (MeshConfig(data=8, fsdp=1), {"data": 8, "fsdp": 1, "expert": 1, "tensor": 1}),
        (MeshConfig(data=2, fsdp=2, expert=2), {"data": 2, "fsdp": 2, "expert": 2, "tensor": 1}),
        (MeshConfig(fsdp=2, tensor=4), {"data": 1, "fsdp": 2, "expert": 1, "tensor": 4}),
        (MeshConfig(expert=4, fsdp=-1), {"data": 1, "fsdp": 2, "expert": 4, "tensor": 1}),
        (MeshConfig(data=-1, fsdp=1, tensor=2), {"data": 4, "fsdp": 1, "expert": 1, "tensor": 2}),
    ],
)
def test_make_mesh_resolves_sizes(cfg: MeshConfig, sizes: dict[str, int]) -> None:
    mesh = sharding.make_mesh(cfg)
    assert dict(mesh.shape) == sizes
    assert mesh.axis_names == sharding.MESH_AXES
    assert mesh.devices.size == 8


@pytest.mark.parametrize(
    ("kwargs", "error", "message"),
    [
        (dict(data=0), ValueError, "MeshConfig.data must be >= 1 or -1"),
        (dict(tensor=-2), ValueError, "MeshConfig.tensor must be >= 1 or -1"),
        (dict(data=-1, fsdp=-1), ValueError, "at most one axis may be -1, got data, fsdp"),
        (dict(expert=2.0), TypeError, "MeshConfig.expert must be an int"),
        (dict(fsdp=True), TypeError, "MeshConfig.fsdp must be an int"),
    ],
)
def test_mesh_config_validation_names_the_field(kwargs: dict, error: type, message: str) -> None:
    with pytest.raises(error, match=message):
        MeshConfig(**kwargs)


@pytest.mark.parametrize(
    ("cfg", "message"),
    [
        (MeshConfig(data=2, fsdp=2, expert=1, tensor=1), "has 4 devices but 8 are available"),
        (MeshConfig(fsdp=-1, tensor=3), "8 devices are not divisible by the product 3"),
    ],
)
def test_mesh_device_count_mismatch_is_a_clear_error(cfg: MeshConfig, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        sharding.make_mesh(cfg)


def test_mesh_on_a_device_subset() -> None:
    mesh = sharding.make_mesh(MeshConfig(fsdp=-1, expert=2), jax.devices()[:4])
    assert dict(mesh.shape)["fsdp"] == 2 and set(mesh.devices.flat) == set(jax.devices()[:4])


@pytest.mark.parametrize(
    ("text", "want"),
    [
        ("fsdp=64", MeshConfig(data=1, fsdp=64, expert=1, tensor=1)),
        ("data=2, fsdp=-1,tensor=4", MeshConfig(data=2, fsdp=-1, expert=1, tensor=4)),
        ("expert=8", MeshConfig(data=1, fsdp=1, expert=8, tensor=1)),
    ],
)
def test_parse(text: str, want: MeshConfig) -> None:
    assert MeshConfig.parse(text) == want


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("", "empty mesh string"),
        ("fsdp", "bad mesh entry 'fsdp'"),
        ("pp=2", "bad mesh entry"),
        ("fsdp=2,fsdp=4", "given twice"),
        ("fsdp=two", "is not an integer"),
    ],
)
def test_parse_errors(text: str, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        MeshConfig.parse(text)


SIZES = {"data": 2, "fsdp": 4, "expert": 2, "tensor": 2}


@pytest.mark.parametrize(
    ("names", "shape", "want"),
    [
        (("batch", "length"), (16, 5), P(("data", "fsdp"), None)),
        (("vocab", "embed"), (64, 64), P("tensor", "fsdp")),
        (("exp", "embed", "mlp"), (8, 64, 32), P("expert", "fsdp", "tensor")),
        (("embed", "q_heads", "head_dim"), (64, 4, 16), P("fsdp", "tensor", None)),
        (("norm",), (16,), P(None)),
        (("embed", None), (64, 3), P("fsdp", None)),
        # Not divisible: the mesh axes are dropped (replicated), not an error.
        (("embed", "kv_heads", "head_dim"), (64, 1, 16), P("fsdp", None, None)),
        (("exp", "embed", "mlp"), (3, 6, 32), P(None, None, "tensor")),
        # Partially divisible multi-axis entry keeps the divisible prefix.
        (("batch",), (2,), P("data")),
        # A mesh axis is used once per spec: the second "embed" stays unsharded.
        (("embed", "embed"), (64, 64), P("fsdp", None)),
    ],
)
def test_logical_to_spec(names: tuple, shape: tuple, want: P) -> None:
    assert sharding.logical_to_spec(names, shape=shape, mesh=SIZES) == want


def test_logical_to_spec_without_shape_or_mesh_and_errors() -> None:
    assert sharding.logical_to_spec(("exp", "embed", "mlp")) == P("expert", "fsdp", "tensor")
    # Axes missing from the mesh are dropped.
    assert sharding.logical_to_spec(("batch",), mesh={"data": 2}) == P("data")
    with pytest.raises(ValueError, match="logical axis 'bogus' has no entry"):
        sharding.logical_to_spec(("bogus",))
    with pytest.raises(ValueError, match="do not match shape"):
        sharding.logical_to_spec(("embed",), shape=(2, 2))


def _specs(mesh_sizes: dict[str, int], **kwargs) -> dict:
    _, abstract = placement.abstract_model(TINY)
    return sharding.param_specs(abstract, mesh_sizes, **kwargs)


def test_param_specs_follow_the_rules_and_exceptions() -> None:
    specs = _specs({"data": 1, "fsdp": 2, "expert": 2, "tensor": 2})
    attn, moe = specs["layers"][1]["attn"], specs["layers"][1]["mlp"]
    assert specs["embedding_vd"] == P("tensor", "fsdp")
    assert specs["lm_head_dv"] == P("fsdp", "tensor")
    assert specs["final_norm"]["scale"] == P(None)
    assert attn["w_q_dnh"] == P("fsdp", "tensor", None)
    assert attn["w_k_dgh"] == P("fsdp", "tensor", None)  # 2 kv heads / tensor=2
    assert attn["w_o_nhd"] == P("tensor", None, "fsdp")
    assert moe["w_gate_edf"] == P("expert", "fsdp", "tensor")
    assert moe["w_down_efd"] == P("expert", "tensor", "fsdp")
    assert moe["w_router_de"] == P()  # the exceptions list: routers stay replicated
    dense = specs["layers"][0]["mlp"]
    assert dense["w_gate_df"] == P("fsdp", "tensor") and dense["w_down_fd"] == P("tensor", "fsdp")
    # 2 kv heads cannot split 4 ways: replicated along that dimension only.
    wide = _specs({"data": 1, "fsdp": 2, "expert": 1, "tensor": 4})
    assert wide["layers"][1]["attn"]["w_k_dgh"] == P("fsdp", None, None)


def test_param_specs_custom_exceptions_first_match_wins() -> None:
    sizes = {"data": 1, "fsdp": 2, "expert": 2, "tensor": 2}
    exceptions = ((r"w_q_dnh$", P(None, "tensor")), (r"attn/w_", P()), (r"embedding", P("fsdp")))
    specs = _specs(sizes, exceptions=exceptions)
    assert specs["layers"][0]["attn"]["w_q_dnh"] == P(None, "tensor")
    assert specs["layers"][0]["attn"]["w_k_dgh"] == P()
    assert specs["embedding_vd"] == P("fsdp")
    assert specs["layers"][1]["mlp"]["w_router_de"] == P("fsdp", "expert")  # default list unused
    with pytest.raises(ValueError, match="does not divide"):
        _specs({**sizes, "fsdp": 3}, exceptions=((r"embedding", P("fsdp")),))
    with pytest.raises(ValueError, match="unknown mesh axes"):
        _specs(sizes, exceptions=((r"embedding", P("pipeline")),))
    with pytest.raises(ValueError, match="parameter 'embedding_vd'.*'vocab' has no entry"):
        _specs(sizes, rules=(("embed", "fsdp"),), exceptions=())


def test_init_sharded_places_each_param_as_the_rules_say() -> None:
    # Placement on the other meshes is checked by test_train_step (same param_shardings).
    mesh = sharding.make_mesh(MeshConfig(fsdp=2, tensor=4))
    graphdef, params = placement.init_sharded(TINY, mesh, rng=0)
    _, abstract = placement.abstract_model(TINY)
    shardings = sharding.param_shardings(abstract, mesh)
    got = jax.tree_util.tree_flatten_with_path(params)[0]
    assert len(got) == len(jax.tree.leaves(shardings))
    for (path, leaf), want in zip(got, jax.tree.leaves(shardings), strict=True):
        assert isinstance(want, NamedSharding)
        assert leaf.sharding == want, jax.tree_util.keystr(path)
    assert params["layers"][1]["mlp"]["w_up_edf"].sharding.spec == P("expert", "fsdp", "tensor")
    # Same values as the plain, unsharded constructor with the same seed: the random bits are
    # identical; jit may fuse the truncated-normal transform differently (1 ulp).
    plain = nnx.to_pure_dict(nnx.state(Transformer(TINY, rngs=nnx.Rngs(0))))
    for a, b in zip(jax.tree.leaves(params), jax.tree.leaves(plain), strict=True):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-6, atol=1e-7)
    assert isinstance(nnx.merge(graphdef, params), Transformer)


def test_batch_spec() -> None:
    assert sharding.batch_spec(8, SIZES, ndim=3) == P(("data", "fsdp"), None, None)
    with pytest.raises(ValueError, match="batch size 6 is not divisible by the 8 data shards"):
        sharding.batch_spec(6, SIZES)


def test_split_and_join_lora_part_any_tree_of_the_params_layout() -> None:
    cfg = TINY.replace(lora=LoRAConfig(rank=2, targets=("attention", "router")))
    _, abstract = placement.abstract_model(cfg)
    params = nnx.to_pure_dict(abstract)
    base, adapters = split_lora(params)
    assert jax.tree.structure(base) == jax.tree.structure(
        nnx.to_pure_dict(placement.abstract_model(TINY)[1])
    )
    names = {str(p[-1].key) for p, _ in jax.tree_util.tree_leaves_with_path(adapters)}
    assert names == {
        f"{w}_lora_{x}" for w in ("w_q_dnh", "w_k_dgh", "w_v_dgh", "w_o_nhd") for x in "ab"
    } | {"w_router_de_lora_a", "w_router_de_lora_b"}
    assert "mlp" not in adapters["layers"][0]  # a dense layer: no router
    assert jax.tree.structure(join_lora(base, adapters)) == jax.tree.structure(params)
    # Specs (a tuple subclass) split as leaves, not as containers.
    specs = sharding.param_specs(abstract, {"fsdp": 2, "tensor": 2})
    spec_base, spec_adapters = split_lora(specs)
    assert spec_adapters["layers"][1]["attn"]["w_o_nhd_lora_a"] == P("tensor", None, None)
    assert join_lora(spec_base, spec_adapters) == specs
    # Without adapters: the tree itself and nothing.
    assert split_lora(base) == (base, {})
    with pytest.raises(ValueError, match="in both parts"):
        join_lora(base, base)
