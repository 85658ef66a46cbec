"""LoRA adapters as whole trees: split from and joined to the base, initialized fresh, and exported
as a PEFT adapter directory (``sat-export --adapter``).

The adapters themselves are layers (``sat_jax.model.layers``: ``LoRA``, ``LORA_A`` / ``LORA_B``,
``is_lora_path``) configured by ``model.lora.*`` (``LoRAConfig``, ``sat_jax.model.config``); they sit
below the ``Transformer``, which this module builds on. ``merged_weight`` folds an adapter into its
base weight (the merged HF export, ``sat_jax.model.hf_export``).

``split_lora`` parts a params tree (or any tree of the same nested-dict layout: shardings, specs,
shapes) into the frozen base and the adapters, ``join_lora`` puts them back together, and
``init_lora`` makes fresh adapters on their own (for a base read from a checkpoint).

PEFT export:

    export_peft_adapter(params, cfg, "runs/x/adapter", base_model="Qwen/Qwen3-30B-A3B")
    # then, in torch:
    model = peft.PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base), "runs/x/adapter")

writes ``adapter_config.json`` and ``adapter_model.safetensors`` with PEFT's key names
(``base_model.model.model.layers.{i}.self_attn.q_proj.lora_A.weight``, ...), for transformers ≥ 5
(whose Qwen3-MoE fuses the experts into 3-D parameters) and peft ≥ 0.18 (``target_parameters``).
Every target of ``model.lora.targets`` maps exactly, with PEFT's scale lora_alpha / r = ours:

- "attention": standard LoRA on ``self_attn.{q,k,v,o}_proj`` (``target_modules``). Ours is
  W [*in, *out] + s · A [*in, r] B [r, *out]; HF's weight is [out, in], so PEFT's
  ``lora_A.weight`` [r, in] is A flattened and transposed and ``lora_B.weight`` [out, r] is B's.
- "experts": PEFT's ``ParamWrapper`` on ``mlp.experts.gate_up_proj`` [E, 2F, D] (the inner
  wrapper, keys ``mlp.experts.base_layer.lora_*``) and ``mlp.experts.down_proj`` [E, D, F] (the
  outer one, keys ``mlp.experts.lora_*``), one rank-r block per expert (PEFT lays the experts out
  as ``lora_A`` [E·r, in], expert-major, and ``lora_B`` [out, r·E], expert-minor). gate and up are
  fused in HF, so their adapters become one rank-2r adapter: A = [A_gate; A_up] and
  B = diag(B_gate, B_up), with ``rank_pattern`` 2r and ``alpha_pattern`` 2·alpha (scale unchanged)
  — the same conversion peft applies to adapters of the unfused layout.
- "mlp" (dense layers) and "router": ``ParamWrapper`` on ``mlp.{gate,up,down}_proj.weight`` and
  ``mlp.gate.weight`` (``target_parameters``: on transformers 5 peft rewrites the module names
  gate_proj / up_proj / down_proj to the experts' fused parameters, so they cannot be
  ``target_modules`` here).

The adapters are written in their own dtype; PEFT casts them to the base's on load. On load
peft 0.21 warns that the gate_up rank / alpha patterns "did not match any targeted module": that
check looks at ``target_modules`` only; the patterns do apply to the parameter targets (the tests
compare the loaded adapters with the written ones).
"""

from __future__ import annotations

import json
import pathlib
from collections.abc import Iterator, Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh

from sat_jax import sharding
from sat_jax.model import placement
from sat_jax.model.config import ModelConfig
from sat_jax.model.layers import LORA_A, LORA_B, is_lora_path
from sat_jax.model.safetensors import safetensors_header
from sat_jax.model.transformer import Transformer


def split_lora(tree: Mapping) -> tuple[dict, dict]:
    """``(base, adapters)``: a nested dict of the params' layout (``nnx.to_pure_dict``; leaves may
    be arrays, shardings, specs, shapes) parted by ``sat_jax.model.layers.is_lora_path``.

    Sub-dicts left empty are dropped, so without adapters ``base`` is ``tree`` and ``adapters``
    is ``{}``. ``join_lora(*split_lora(tree))`` equals ``tree``.
    """
    base: dict = {}
    adapters: dict = {}
    for path, leaf in _flat_dict(tree):
        _put(adapters if is_lora_path(path) else base, path, leaf)
    return base, adapters


def join_lora(base: Mapping, adapters: Mapping) -> dict:
    """The full params tree of ``split_lora``'s two parts (``nnx.merge`` takes it whole)."""
    out: dict = {}
    for part in (base, adapters):
        for path, leaf in _flat_dict(part):
            _put(out, path, leaf)
    return out


def _flat_dict(tree: Mapping, prefix: tuple = ()) -> list[tuple[tuple, Any]]:
    out = []
    for key, value in tree.items():
        if isinstance(value, Mapping):
            out += _flat_dict(value, (*prefix, key))
        else:
            out.append(((*prefix, key), value))
    return out


def _put(tree: dict, path: tuple, leaf: Any) -> None:
    for key in path[:-1]:
        tree = tree.setdefault(key, {})
    if path[-1] in tree:
        raise ValueError(f"parameter {'/'.join(map(str, path))} is in both parts")
    tree[path[-1]] = leaf


def abstract_adapters(model_cfg: ModelConfig, mesh: Mesh) -> dict:
    """The LoRA adapters of ``model_cfg`` as ``jax.ShapeDtypeStruct``s in their shardings on
    ``mesh`` (the rules'), nothing allocated: what a loader restores adapters into.

    Raises:
      ValueError: ``model_cfg.lora.rank`` is 0.
    """
    if not model_cfg.lora.rank:
        raise ValueError("abstract_adapters needs model_cfg.lora.rank > 0")
    _, abstract = placement.abstract_model(model_cfg)
    shardings = split_lora(sharding.param_shardings(abstract, mesh))[1]
    shapes = split_lora(nnx.to_pure_dict(abstract))[1]
    return jax.tree.map(
        lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), shapes, shardings
    )


def init_lora(model_cfg: ModelConfig, shardings: Any = None, rng: int | jax.Array = 0) -> dict:
    """Fresh LoRA adapters of ``model_cfg``: those of ``init_sharded(model_cfg, mesh, rng)`` (A
    random, fan-in scaled; B zero), for a base that comes from elsewhere (an HF checkpoint).

    The model's init runs under ``jax.jit`` with only the adapters as outputs, so the base's
    random init is dead code XLA drops: nothing of the base is computed or allocated.

    Args:
      model_cfg: a config with ``lora.rank`` > 0.
      shardings: the adapters' shardings (a nested dict, e.g. ``split_lora`` of
        ``param_shardings``), or None for the default device.
      rng: an int seed or a PRNG key.
    """
    if not model_cfg.lora.rank:
        raise ValueError("init_lora needs model_cfg.lora.rank > 0")
    key = jax.random.key(rng) if isinstance(rng, int) else rng

    def init(key: jax.Array) -> dict:
        model = Transformer(model_cfg, rngs=nnx.Rngs(key))
        return split_lora(nnx.to_pure_dict(nnx.state(model)))[1]

    return jax.jit(init, out_shardings=shardings)(key)


@jax.jit
def merged_weight(w: jax.Array, a: jax.Array, b: jax.Array, scale: jax.Array) -> jax.Array:
    """W + scale · A B in float32 (full-precision product), cast to W's dtype.

    The product contracts A's last (rank) axis with B's first non-batch axis, batched over the
    leading axes they share (the expert axis of stacked experts), as
    ``sat_jax.model.layers.lora_weight`` does.

    Args:
      w: the base weight [*batch, *in, *out].
      a: its adapter A [*batch, *in, r]; b: its adapter B [*batch, r, *out].
      scale: alpha / r.
    """
    nb = a.ndim + b.ndim - 2 - w.ndim
    batch = tuple(range(nb))
    delta = jax.lax.dot_general(
        a.astype(jnp.float32),
        b.astype(jnp.float32),
        (((a.ndim - 1,), (nb,)), (batch, batch)),
        precision=jax.lax.Precision.HIGHEST,
    )
    return (w.astype(jnp.float32) + scale * delta).astype(w.dtype)


ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"
PEFT_PREFIX = "base_model.model."
# peft's own spelling of the fused gate_up rank / alpha patterns (transformers_weight_conversion).
GATE_UP_PATTERN = r".*\.gate_up_proj"
_ATTENTION = {
    "w_q_dnh": "q_proj",
    "w_k_dgh": "k_proj",
    "w_v_dgh": "v_proj",
    "w_o_nhd": "o_proj",
}
_DENSE = {"w_gate_df": "gate_proj", "w_up_df": "up_proj", "w_down_fd": "down_proj"}


class AdapterExportError(ValueError):
    """The adapters cannot be written as a PEFT adapter (the message names what and why)."""


def peft_config(cfg: ModelConfig, *, base_model: str | None = None) -> dict[str, Any]:
    """The ``adapter_config.json`` dict of ``cfg.lora`` (``peft.LoraConfig`` field names).

    Raises:
      AdapterExportError: LoRA is off.
    """
    lora = cfg.lora
    if not lora.rank:
        raise AdapterExportError("a PEFT adapter export needs model.lora.rank > 0")
    modules = sorted(_ATTENTION.values()) if "attention" in lora.targets else None
    params = []
    rank_pattern, alpha_pattern = {}, {}
    if "experts" in lora.targets:
        params += ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]
        rank_pattern[GATE_UP_PATTERN] = 2 * lora.rank
        alpha_pattern[GATE_UP_PATTERN] = 2 * lora.alpha
    if "mlp" in lora.targets:
        params += [f"mlp.{name}.weight" for name in _DENSE.values()]
    if "router" in lora.targets:
        params.append("mlp.gate.weight")
    return {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": base_model,
        "r": lora.rank,
        "lora_alpha": lora.alpha,
        "target_modules": modules,
        "target_parameters": params or None,
        "rank_pattern": rank_pattern,
        "alpha_pattern": alpha_pattern,
        "lora_dropout": 0.0,
        "bias": "none",
        "fan_in_fan_out": False,
        "use_rslora": False,
        "use_dora": False,
        "init_lora_weights": True,
        "inference_mode": True,
    }


def _linear(a: np.ndarray, b: np.ndarray, in_dims: int) -> tuple[np.ndarray, np.ndarray]:
    """PEFT's (lora_A [r, in], lora_B [out, r]) of our A [*in, r], B [r, *out]."""
    r = a.shape[-1]
    fan_in = int(np.prod(a.shape[:in_dims]))
    return a.reshape(fan_in, r).T, b.reshape(r, -1).T


def _experts(a: np.ndarray, b: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """PEFT's ParamWrapper (lora_A [E·r, in], lora_B [out, r·E]) of our stacked A [E, in, r],
    B [E, r, out]: lora_A row e·r + j is expert e's A[:, j]; lora_B column j·E + e its B[j, :]."""
    e, fan_in, r = a.shape
    return a.transpose(0, 2, 1).reshape(e * r, fan_in), b.transpose(2, 1, 0).reshape(-1, r * e)


def _gate_up(ag: np.ndarray, bg: np.ndarray, au: np.ndarray, bu: np.ndarray) -> tuple:
    """The rank-2r adapter of the fused gate_up_proj: A = [A_gate, A_up] along the rank,
    B = diag(B_gate, B_up) (gate's rows first, as in HF's gate_up_proj)."""
    e, r, f = bg.shape
    b = np.zeros((e, 2 * r, 2 * f), bg.dtype)
    b[:, :r, :f], b[:, r:, f:] = bg, bu
    return _experts(np.concatenate([ag, au], axis=-1), b)


def _tensors(adapters: dict, cfg: ModelConfig) -> Iterator[tuple[str, np.ndarray]]:
    """(PEFT key, host array) of every adapter, layer by layer.

    Raises:
      AdapterExportError: an adapter this module does not know how to express.
    """
    get = lambda x: np.asarray(jax.device_get(x))
    for path, _ in jax.tree_util.tree_leaves_with_path(adapters):
        keys = [str(getattr(k, "key", k)) for k in path]
        if len(keys) != 4 or keys[0] != "layers" or keys[2] not in ("attn", "mlp"):
            raise AdapterExportError(
                f"no PEFT form for the LoRA adapter {'/'.join(keys)}; export the merged "
                "checkpoint instead (sat-export without --adapter)"
            )
    for i in sorted(adapters.get("layers", {}), key=int):
        layer = adapters["layers"][i]
        p = f"{PEFT_PREFIX}model.layers.{i}."
        pairs = lambda mod: {
            k[: -len(LORA_A)]: (get(v), get(mod[k[: -len(LORA_A)] + LORA_B]))
            for k, v in mod.items()
            if k.endswith(LORA_A)
        }
        found = {("attn", k): v for k, v in pairs(layer.get("attn", {})).items()}
        found |= {("mlp", k): v for k, v in pairs(layer.get("mlp", {})).items()}
        out: list[tuple[str, tuple[np.ndarray, np.ndarray]]] = []
        for (module, name), (a, b) in sorted(found.items()):
            if module == "attn" and name in _ATTENTION:
                in_dims = 2 if name == "w_o_nhd" else 1
                out.append((f"self_attn.{_ATTENTION[name]}", _linear(a, b, in_dims)))
            elif module == "mlp" and name in _DENSE:
                out.append((f"mlp.{_DENSE[name]}", _linear(a, b, 1)))
            elif module == "mlp" and name == "w_router_de":
                out.append(("mlp.gate", _linear(a, b, 1)))
            elif module == "mlp" and name == "w_down_efd":
                out.append(("mlp.experts", _experts(a, b)))
            elif module == "mlp" and name == "w_gate_edf":
                gate_up = _gate_up(a, b, *found[("mlp", "w_up_edf")])
                out.append(("mlp.experts.base_layer", gate_up))
            elif not (module == "mlp" and name == "w_up_edf"):  # up goes with gate
                raise AdapterExportError(
                    f"no PEFT form for the LoRA adapter of layers/{i}/{module}/{name}; export "
                    "the merged checkpoint instead (sat-export without --adapter)"
                )
        for module, (lora_a, lora_b) in out:
            yield f"{p}{module}.lora_A.weight", lora_a
            yield f"{p}{module}.lora_B.weight", lora_b


def export_peft_adapter(
    params: Any, cfg: ModelConfig, out: str | pathlib.Path, *, base_model: str | None = None
) -> pathlib.Path:
    """Writes the LoRA adapters of ``params`` as a PEFT adapter directory.

    Args:
      params: the whole model's params or only the adapters (a nested dict or ``nnx.State``);
        anything but the adapters is ignored.
      cfg: their model config (``cfg.lora.rank`` > 0).
      out: the directory; created, and it must be empty if it exists.
      base_model: ``base_model_name_or_path`` to record (e.g. ``model.hf_path``).

    Returns:
      The output directory.

    Raises:
      FileExistsError: ``out`` exists and is not empty.
      AdapterExportError: LoRA is off, or an adapter has no PEFT form (nothing is written).
    """
    out = pathlib.Path(out)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise FileExistsError(f"export directory {out} exists and is not empty")
    if isinstance(params, nnx.State):
        params = nnx.to_pure_dict(params)
    config = peft_config(cfg, base_model=base_model)
    # Adapters are small (a fraction of the model): all of them on the host at once is fine.
    tensors = list(_tensors(split_lora(params)[1], cfg))
    entries = [(k, tuple(v.shape), v.dtype) for k, v in tensors]
    out.mkdir(parents=True, exist_ok=True)
    with open(out / ADAPTER_WEIGHTS, "wb") as f:
        f.write(safetensors_header(entries))
        for _, array in tensors:
            f.write(np.ascontiguousarray(array).tobytes())
    (out / ADAPTER_CONFIG).write_text(json.dumps(config, indent=2))
    return out
