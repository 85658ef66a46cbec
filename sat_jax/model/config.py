"""The model's one config dataclass and its named presets.

The field names follow HF Qwen3-MoE's config closely enough for `sat_jax.model.hf` to map one
onto the other field by field (`moe_intermediate_size` -> `expert_dim`, `intermediate_size` ->
`dense_dim`, `num_key_value_heads` -> `num_kv_heads`, `tie_word_embeddings` -> `tie_embeddings`).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax.numpy as jnp

DISPATCH_PATHS = ("auto", "ragged", "dense", "blocked", "gmm")
ATTENTION_PATHS = ("auto", "fused", "blockwise", "dense", "splash")
REMAT_POLICIES = ("none", "layer")
# What LoRA may adapt: "attention" (q, k, v, o), "mlp" (the dense layers' SwiGLU), "experts" (every
# routed expert's gate, up and down, per expert) and "router".
LORA_TARGETS = ("attention", "mlp", "experts", "router")
# Fields a config may set beside `hf_path`: how the model runs or is adapted, not what it is.
RUNTIME_FIELDS = (
    "dtype",
    "param_dtype",
    "dispatch",
    "max_seq_len",
    "router_aux_loss_coef",
    "attention",
    "attention_block",
    "logits_chunk",
    "remat",
    "lora",
)

# Anything `jnp.dtype` accepts: jnp.float32, "bfloat16", np.dtype("float32"), ...
DTypeLike = Any


@dataclasses.dataclass(frozen=True, kw_only=True)
class LoRAConfig:
    """Low-rank adapters on a frozen base: each targeted weight W is used as W + (alpha / rank) · A B.

    A maps W's input dims to `rank` (random, fan-in scaled), B maps `rank` to W's output dims
    (zeros, so a fresh adapter leaves the model exactly the base); the routed experts' A and B are
    stacked over the expert axis like their weights (`sat_jax.model.layers.add_lora`).

    Attributes:
      rank: r, the adapters' inner width; 0 turns LoRA off (no adapter parameters exist).
      alpha: the scale's numerator: the update is scaled by alpha / rank.
      targets: which weights get adapters, a subset of `LORA_TARGETS`: "attention" (q, k, v, o
        projections), "mlp" (the dense layers' SwiGLU), "experts" (the routed experts' gate, up
        and down), "router" (the MoE router).
    """

    rank: int = 0
    alpha: float = 16.0
    targets: tuple[str, ...] = ("attention", "experts")

    def __post_init__(self) -> None:
        if isinstance(self.rank, bool) or not isinstance(self.rank, int) or self.rank < 0:
            raise ValueError(f"lora.rank must be an int >= 0 (0 = off), got {self.rank!r}")
        alpha = self.alpha
        if isinstance(alpha, bool) or not isinstance(alpha, int | float) or not alpha > 0:
            raise ValueError(f"lora.alpha must be a positive number, got {alpha!r}")
        if not isinstance(self.targets, tuple):
            raise ValueError(f"lora.targets must be a tuple, got {type(self.targets).__name__}")
        if "shared_expert" in self.targets:
            raise ValueError(
                "lora.targets: 'shared_expert' cannot be adapted: Qwen3-MoE has no shared expert "
                f"(valid targets: {', '.join(LORA_TARGETS)})"
            )
        unknown = [t for t in self.targets if t not in LORA_TARGETS]
        if unknown:
            raise ValueError(
                f"lora.targets: unknown target {unknown[0]!r}; valid: {', '.join(LORA_TARGETS)}"
            )
        if len(set(self.targets)) != len(self.targets):
            raise ValueError(f"lora.targets lists a target twice: {self.targets}")
        if self.rank and not self.targets:
            raise ValueError("lora.targets is empty but lora.rank > 0: name what to adapt")

    @property
    def scale(self) -> float:
        """alpha / rank, the factor of the adapters' product (0 when off)."""
        return self.alpha / self.rank if self.rank else 0.0


@dataclasses.dataclass(frozen=True, kw_only=True)
class ModelConfig:
    """A decoder-only Qwen3-MoE-family transformer.

    Attributes:
      vocab_size: V, rows of the embedding table.
      d_model: D, the residual width.
      num_layers: decoder layers, dense and MoE together.
      num_heads: N, query heads.
      num_kv_heads: G, key/value heads; divides `num_heads` (grouped-query attention).
      head_dim: H, width of one head (not necessarily d_model / num_heads, as in Qwen3).
      num_experts: E, routed experts per MoE layer; 0 makes every layer dense.
      num_experts_per_tok: K, experts each token is sent to.
      expert_dim: F, hidden width of one expert's SwiGLU (HF `moe_intermediate_size`).
      dense_dim: hidden width of the SwiGLU in dense layers (HF `intermediate_size`).
      mlp_only_layers: layer indices forced dense.
      decoder_sparse_step: layer i is MoE only when (i + 1) % decoder_sparse_step == 0.
      norm_topk_prob: renormalize the K routing weights to sum to one.
      rope_theta: RoPE base.
      rms_norm_eps: epsilon inside every RMSNorm.
      tie_embeddings: reuse the embedding table as the output projection.
      max_seq_len: longest sequence (prompt + completion) the model is used with.
      dispatch: MoE dispatch path, "dense" (one-hot reference), "ragged" (sort + ragged_dot),
        "blocked" (sort + block-padded batched matmul, for CPU), "gmm" (sort + megablox grouped
        matmul, a TPU kernel; interpret mode elsewhere), or "auto" (chosen per backend and
        shape, see `sat_jax.model.moe.resolve_dispatch`).
      router_aux_loss_coef: weight of the load-balancing loss in `ModelOutput.aux_loss`.
      attention: path of the full forward's causal attention (`sat_jax.model.attention`):
        "fused" (`jax.nn.dot_product_attention`, cuDNN on GPU), "blockwise" (online softmax,
        memory linear in T), "splash" (the Pallas splash-attention TPU kernel; interpret mode
        elsewhere), "dense" (the [T, T] scores), or "auto" (fused on GPU, splash on TPU, else
        blockwise). Decoding always attends densely over the cache.
      attention_block: block length of the blockwise path; the splash kernel's blocks are it
        rounded up to a multiple of 128, at most 512 (`tpu_kernels.splash_block`).
      logits_chunk: positions per chunk of `Transformer.target_logprobs` (the trainer's
        log-probs of the sampled tokens): [B, chunk, V] float32 logits at a time.
      remat: "layer" recomputes each decoder layer's activations in the backward pass
        (`jax.checkpoint`), keeping only the residual stream between layers; "none" keeps all.
      dtype: compute dtype of matmuls; norms, softmaxes, the router and logits stay float32.
      param_dtype: storage dtype of the parameters (the trainer's master weights).
      lora: low-rank adapters (`LoRAConfig`); rank 0 (the default) is off and the parameters are
        exactly the base model's.
      hf_path: a Hugging Face Qwen3-MoE checkpoint directory (config.json, safetensors, tokenizer
        files) or "". When set, `sat_jax.experiment.load_config` takes the architecture from its
        config.json (only the runtime fields in `RUNTIME_FIELDS` may be overridden) and the
        server and trainer start from its weights (docs/DESIGN.md §11).
    """

    vocab_size: int
    d_model: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    num_experts: int
    num_experts_per_tok: int
    expert_dim: int
    dense_dim: int
    mlp_only_layers: tuple[int, ...] = ()
    decoder_sparse_step: int = 1
    norm_topk_prob: bool = True
    rope_theta: float
    rms_norm_eps: float = 1e-6
    tie_embeddings: bool
    max_seq_len: int
    dispatch: str = "auto"
    router_aux_loss_coef: float = 0.0
    attention: str = "auto"
    attention_block: int = 512
    logits_chunk: int = 1024
    remat: str = "none"
    dtype: DTypeLike = jnp.float32
    param_dtype: DTypeLike = jnp.float32
    lora: LoRAConfig = LoRAConfig()
    hf_path: str = ""

    def __post_init__(self) -> None:
        positive = (
            "vocab_size",
            "d_model",
            "num_layers",
            "num_heads",
            "num_kv_heads",
            "head_dim",
            "dense_dim",
            "max_seq_len",
            "decoder_sparse_step",
            "attention_block",
            "logits_chunk",
        )
        for name in positive:
            if not isinstance(getattr(self, name), int) or getattr(self, name) <= 0:
                raise ValueError(f"{name} must be a positive int, got {getattr(self, name)!r}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"num_kv_heads ({self.num_kv_heads}) must divide num_heads ({self.num_heads})"
            )
        if self.head_dim % 2:
            raise ValueError(f"head_dim must be even for RoPE, got {self.head_dim}")
        if self.num_experts < 0:
            raise ValueError(f"num_experts must be >= 0, got {self.num_experts}")
        if self.num_experts > 65536:
            raise ValueError(f"num_experts must fit uint16 routing ids, got {self.num_experts}")
        if self.num_experts > 0:
            if not 0 < self.num_experts_per_tok <= self.num_experts:
                raise ValueError(
                    f"num_experts_per_tok must be in [1, num_experts={self.num_experts}], "
                    f"got {self.num_experts_per_tok}"
                )
            if self.expert_dim <= 0:
                raise ValueError(f"expert_dim must be positive, got {self.expert_dim}")
        if not isinstance(self.mlp_only_layers, tuple):
            raise ValueError(f"mlp_only_layers must be a tuple, got {type(self.mlp_only_layers)}")
        for i in self.mlp_only_layers:
            if not 0 <= i < self.num_layers:
                raise ValueError(f"mlp_only_layers entry {i} outside [0, {self.num_layers})")
        if self.rope_theta <= 0:
            raise ValueError(f"rope_theta must be positive, got {self.rope_theta}")
        if self.rms_norm_eps <= 0:
            raise ValueError(f"rms_norm_eps must be positive, got {self.rms_norm_eps}")
        if self.dispatch not in DISPATCH_PATHS:
            raise ValueError(f"dispatch must be one of {DISPATCH_PATHS}, got {self.dispatch!r}")
        if self.attention not in ATTENTION_PATHS:
            raise ValueError(f"attention must be one of {ATTENTION_PATHS}, got {self.attention!r}")
        if self.remat not in REMAT_POLICIES:
            raise ValueError(f"remat must be one of {REMAT_POLICIES}, got {self.remat!r}")
        if self.router_aux_loss_coef < 0:
            raise ValueError(f"router_aux_loss_coef must be >= 0, got {self.router_aux_loss_coef}")
        for name in ("dtype", "param_dtype"):
            try:
                dt = jnp.dtype(getattr(self, name))
            except TypeError as e:
                raise ValueError(f"{name} is not a dtype: {getattr(self, name)!r}") from e
            if not jnp.issubdtype(dt, jnp.floating):
                raise ValueError(f"{name} must be a floating dtype, got {dt}")
        self._check_lora()

    def _check_lora(self) -> None:
        """A LoRA target must name weights this model has."""
        if not isinstance(self.lora, LoRAConfig):
            raise ValueError(f"lora must be a LoRAConfig, got {type(self.lora).__name__}")
        if not self.lora.rank:
            return
        moe = self.num_moe_layers
        missing = {
            "experts": "no MoE layers" if moe == 0 else "",
            "router": "no MoE layers" if moe == 0 else "",
            "mlp": "no dense layers (every layer is MoE)" if moe == self.num_layers else "",
        }
        for target in self.lora.targets:
            if missing.get(target):
                raise ValueError(f"lora.targets has {target!r} but the model has {missing[target]}")

    def is_moe_layer(self, i: int) -> bool:
        """HF Qwen3-MoE's rule for which decoder layers carry a sparse MoE block."""
        return (
            self.num_experts > 0
            and i not in self.mlp_only_layers
            and (i + 1) % self.decoder_sparse_step == 0
        )

    @property
    def moe_layer_indices(self) -> tuple[int, ...]:
        """Indices of the MoE layers; routing axis L enumerates them in this order."""
        return tuple(i for i in range(self.num_layers) if self.is_moe_layer(i))

    @property
    def num_moe_layers(self) -> int:
        """L, the number of MoE layers (the routing tensor's third axis)."""
        return len(self.moe_layer_indices)

    @property
    def routing_dtype(self) -> jnp.dtype:
        """Storage dtype of routing ids: uint8 when E <= 256, else uint16."""
        return jnp.dtype(jnp.uint8 if self.num_experts <= 256 else jnp.uint16)

    @property
    def params_dtype(self) -> jnp.dtype:
        return jnp.dtype(self.param_dtype)

    def replace(self, **overrides: Any) -> ModelConfig:
        """A copy with some fields changed (validated again)."""
        return dataclasses.replace(self, **overrides)

    @classmethod
    def preset(cls, name: str, **overrides: Any) -> ModelConfig:
        """A named preset from `PRESETS`, with optional field overrides."""
        if name not in PRESETS:
            raise ValueError(f"unknown preset {name!r}; known: {sorted(PRESETS)}")
        return PRESETS[name].replace(**overrides)


def runtime_overrides(cfg: ModelConfig) -> dict[str, Any]:
    """`cfg`'s `RUNTIME_FIELDS` and `hf_path`: what to pass `hf.load_qwen3_moe` so that the
    loaded module's config equals `cfg`."""
    names = (*RUNTIME_FIELDS, "hf_path")
    return {f.name: getattr(cfg, f.name) for f in dataclasses.fields(cfg) if f.name in names}


PRESETS: dict[str, ModelConfig] = {
    # Compiles in seconds on CPU; every model test uses it.
    "tiny": ModelConfig(
        vocab_size=64,
        d_model=64,
        num_layers=2,
        num_heads=4,
        num_kv_heads=2,
        head_dim=16,
        num_experts=8,
        num_experts_per_tok=2,
        expert_dim=32,
        dense_dim=128,
        rope_theta=10_000.0,
        tie_embeddings=False,
        max_seq_len=128,
    ),
    # About 100M parameters in total (about 30M active), for benchmarks.
    "small": ModelConfig(
        vocab_size=16_384,
        d_model=512,
        num_layers=8,
        num_heads=8,
        num_kv_heads=2,
        head_dim=64,
        num_experts=16,
        num_experts_per_tok=2,
        expert_dim=384,
        dense_dim=1536,
        rope_theta=1_000_000.0,
        tie_embeddings=False,
        max_seq_len=2048,
    ),
    # Qwen/Qwen3-30B-A3B's config.json.
    "qwen3_30b_a3b": ModelConfig(
        vocab_size=151_936,
        d_model=2048,
        num_layers=48,
        num_heads=32,
        num_kv_heads=4,
        head_dim=128,
        num_experts=128,
        num_experts_per_tok=8,
        expert_dim=768,
        dense_dim=6144,
        norm_topk_prob=True,
        rope_theta=1_000_000.0,
        rms_norm_eps=1e-6,
        tie_embeddings=False,
        max_seq_len=40_960,
    ),
}
