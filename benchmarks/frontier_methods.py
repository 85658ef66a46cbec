"""The frontier's methods and cells: each method's policy loss and train-step shape, and a run's
coordinates (method, lag, learning rate, seed, SAT's knobs) and file name.

Used by ``benchmarks/frontier.py`` (its runs) and ``benchmarks/frontier_report.py`` (its tables).
"""

from __future__ import annotations

import dataclasses
import math

import grid

from sat_jax import objectives

GRPO_FAMILY = ("GRPO", "GRPO+SAT", "GRPO+R3", "GRPO+SAT+R3")
# The field's large-lag corrections, each on GRPO's clip (docs/DESIGN.md §3.4, §3.6) unless named
# otherwise, and SAT with each microbatch's own threshold: name -> (PolicyLossConfig fields, the
# step's microbatches). TIS, IcePop and sequence masking weigh behavior -> proximal (the
# trainer's own log-probs before the update, as grid.py gives TIS), so their clip ratio is 1 at
# the step's single update and only the correction limits the step. IcePop's and MIS's rows use
# the sources' bands (IcePop, Ring-1T: [0.5, 5]; verl's geometric rejection sampling:
# [1/1.001, 1.001]); the bands the first study chose are the ``-ours`` variants.
MICROBATCH_Q_K = 4
ICEPOP_RANGE = (0.5, 5.0)
ICEPOP_RANGE_OURS = (0.5, 2.0)
SEQ_MASK_RANGE = (1 / 1.001, 1.001)
SEQ_MASK_RANGE_OURS = (0.95, 1.05)
M2_THRESHOLD = 0.04  # M2PO's τ (the paper's)
VCPO_SEQ_TIS_CAP = 8.0  # VCPO's authors: sequence-level TIS at 8
# "No clip": ε_low just below 1 (the lower bound 1e-6) and ε_high 1e9, so r·A is never clipped at
# the ratios a run sees.
NO_CLIP = {"clip_low": 1.0 - 1e-6, "clip_high": 1e9}
FIELD = {
    "GRPO+SAT-mbq": ({"sat": objectives.SATConfig(threshold_scope="microbatch")}, MICROBATCH_Q_K),
    "GRPO+TIS": ({"tis_cap": grid.TIS_CAP}, 1),
    "GRPO+IcePop": ({"icepop_range": ICEPOP_RANGE}, 1),
    "GRPO+IcePop-ours": ({"icepop_range": ICEPOP_RANGE_OURS}, 1),
    "GRPO+SeqMask": ({"seq_mask_range": SEQ_MASK_RANGE}, 1),
    "GRPO+SeqMask-ours": ({"seq_mask_range": SEQ_MASK_RANGE_OURS}, 1),
    "GRPO+DPPO-TV": ({"dppo_tv_delta": grid.DPPO_TV_DELTA}, 1),
    # M2PO: the paper's trust-region token set (default), and AReaL's every token.
    "GRPO+M2PO": ({"m2_threshold": M2_THRESHOLD}, 1),
    "GRPO+M2PO-all": ({"m2_threshold": M2_THRESHOLD, "m2_token_set": "all"}, 1),
    # M2PO as the paper's objective has it: no ε-clip, the trust-region mask alone. On GRPO's
    # clip the trust-region tokens with (log r)² above τ lie beyond ε = 0.2 (log 1.2² ≈ 0.033 <
    # τ = 0.04) and are already clipped, so there the mask barely changes the gradient.
    "M2PO": ({**NO_CLIP, "m2_threshold": M2_THRESHOLD}, 1),
    # VCPO's two parts on GRPO's clip, the ESS per trajectory (the authors') or per token (the
    # first study's), and each part alone.
    "GRPO+VCPO": ({"ess_scaling": True, "opob_baseline": True}, 1),
    "GRPO+VCPO-tok": ({"ess_scaling": True, "opob_baseline": True, "ess_level": "token"}, 1),
    "GRPO+ESS": ({"ess_scaling": True}, 1),
    "GRPO+OPOB": ({"opob_baseline": True}, 1),
    # VCPO as its authors run it: no PPO clip, sequence-level TIS at 8, ESS scaling, OPOB.
    "VCPO": (
        {**NO_CLIP, "seq_tis_cap": VCPO_SEQ_TIS_CAP, "ess_scaling": True, "opob_baseline": True},
        1,
    ),
}
# The positive control: unclipped importance-weighted policy gradient (r·A with r = π/μ to the
# sampler), which nothing protects from stale samples.
CONTROL = {"ISPG": (NO_CLIP, 1)}
FIELD.update(CONTROL)
LARGE_LAG = tuple(FIELD)
# GSPO's sequence log-ratio |s_b| has a 0.9 quantile of 0.03–0.13 at lr 1e-3 (RESULTS.md, the
# comparison grid) and 0.16–0.75 at 2e-3, lag 8 (a pilot), beyond a window of 2e-3–5e-2 on nearly
# every step; GRPO's own window is the narrowest that puts q inside it on part of the steps.
GSPO_WIDE_CLIP = 0.2
GSPO_WIDE = ("GSPOwide", "GSPOwide+SAT")
METHODS = GRPO_FAMILY + LARGE_LAG + GSPO_WIDE
LAGS = (8, 32, 128, 64, 1)  # the full grid's lags, the ones that matter most first
# How the behavior policy lags (``behavior_version``): "sync", weights published every n updates
# (the realized lag cycles 1..n); "constant", update u trains on version u − n (after the first
# n updates, which train on the base policy at lags 0..n−1).
LAG_MODES = ("sync", "constant")
DEFAULT_SAT = (0.9, 2.0)  # (quantile, exponent): SATConfig's defaults
# The sampler of every cell but the sampler row set's: the trainer's own float32 model, no
# truncation. The row set's (issue 35): bfloat16 weights and matmuls, top-p 0.9, for these methods.
DEFAULT_SAMPLER = ("float32", 1.0)  # (dtype, top_p)
SAMPLER_ROW_SET = ("bfloat16", 0.9)
SAMPLER_METHODS = ("GRPO", "GRPO+SAT", "GRPO+TIS", "GRPO+M2PO", "GRPO+VCPO")
# The "8-bit rollouts" row set (issue 47): the sampler serves the policy as a rollout server with
# 8-bit weights and an 8-bit KV cache does (``sat_jax.quant``: ``server.weight_dtype``,
# ``server.kv_cache_dtype``), in bfloat16 otherwise, no truncation; each cell runs beside the
# same cell sampled in bfloat16 unquantized (``QUANT_BASELINE``), paired by seed.
QUANT_METHODS = ("GRPO", "GRPO+SAT", "GRPO+TIS", "GRPO+IcePop", "GRPO+SeqMask")
QUANT_ROW_SET = ("fp8", "fp8")  # (weight format, KV cache format)
QUANT_BASELINE = ("bfloat16", 1.0)  # the paired cells' sampler: (dtype, top_p)
NOT_QUANTIZED = ("bfloat16", "bfloat16")


@dataclasses.dataclass(frozen=True)
class Cell:
    method: str
    lag: int
    lr: float
    seed: int
    quantile: float = DEFAULT_SAT[0]
    exponent: float = DEFAULT_SAT[1]
    sampler_dtype: str = DEFAULT_SAMPLER[0]
    top_p: float = DEFAULT_SAMPLER[1]
    lag_mode: str = "sync"  # LAG_MODES
    weight_dtype: str = "bfloat16"  # the sampler's served weights (quant.FORMATS)
    kv_cache_dtype: str = "bfloat16"  # the sampler's KV cache format (quant.FORMATS)

    @property
    def knobs(self) -> tuple[float, float]:
        return (self.quantile, self.exponent)

    @property
    def sampler(self) -> tuple[str, float]:
        return (self.sampler_dtype, self.top_p)

    @property
    def quantized(self) -> tuple[str, str]:
        """(weight format, KV cache format) of the sampler; ("bfloat16", "bfloat16") = none."""
        return (self.weight_dtype, self.kv_cache_dtype)

    @property
    def row(self) -> str:
        """The report's row: the method, and the sampler where it is not the default."""
        return row_label(self.method, self.sampler, self.quantized)

    @property
    def name(self) -> str:
        knob = "" if self.knobs == DEFAULT_SAT else f"_q{self.quantile:g}_p{self.exponent:g}"
        dtype = "" if self.sampler_dtype == DEFAULT_SAMPLER[0] else f"_{self.sampler_dtype}"
        top_p = "" if self.top_p == DEFAULT_SAMPLER[1] else f"_top_p{self.top_p:g}"
        mode = "" if self.lag_mode == "sync" else f"_{self.lag_mode}"
        lag = f"lag{self.lag}{mode}"
        q = "" if self.quantized == NOT_QUANTIZED else "_w{}_kv{}".format(*self.quantized)
        return f"{self.method}_{lag}_lr{self.lr:g}{knob}{dtype}{top_p}{q}_seed{self.seed}"


def behavior_version(update: int, lag: int, mode: str) -> int:
    """The weights version (updates applied) that samples update ``update`` (0-based)."""
    if mode == "sync":
        return grid.behavior_version(update, lag)
    if mode == "constant":
        return max(update - lag, 0)
    raise ValueError(f"unknown lag mode {mode!r}; choose from {', '.join(LAG_MODES)}")


def sample_key(cell: Cell):
    """The cell's sampling key: its seed with its lag and lag mode folded in, so runs of one seed
    at different lags draw different completions from the first update (the first study's
    lags shared one seed's samples until their behavior versions parted)."""
    import jax

    key = jax.random.fold_in(jax.random.key(cell.seed), cell.lag)
    return jax.random.fold_in(key, LAG_MODES.index(cell.lag_mode))


def row_label(
    method: str,
    sampler: tuple[str, float] = DEFAULT_SAMPLER,
    quantized: tuple[str, str] = ("bfloat16", "bfloat16"),
) -> str:
    """``method``, or ``method [dtype, top-p p]`` for a cell sampled otherwise than by default,
    with ``, <w> weights, <kv> cache`` for an 8-bit sampler."""
    if sampler == DEFAULT_SAMPLER and quantized == NOT_QUANTIZED:
        return method
    q = "" if quantized == NOT_QUANTIZED else ", {} weights, {} cache".format(*quantized)
    return f"{method} [{sampler[0]}, top-p {sampler[1]:g}{q}]"


def row_order(row: str) -> tuple[int, str]:
    """Sort key of report rows: the methods in ``METHODS`` order, each default sampler first."""
    method, _, sampler = row.partition(" [")
    return (METHODS.index(method), sampler)


def row_method(row: str) -> str:
    """The method of a report row (``row_label``'s inverse, without the sampler)."""
    return row.partition(" [")[0]


def loss_config(method: str, quantile: float = 0.9, exponent: float = 2.0):
    """The ``PolicyLossConfig`` and routing-replay switch of a frontier method and SAT knobs."""
    if method not in METHODS:
        raise ValueError(f"unknown frontier method {method!r}; choose from {', '.join(METHODS)}")
    if method in FIELD:
        cfg, replay = dataclasses.replace(grid.loss_config("GRPO")[0], **FIELD[method][0]), False
    else:
        cfg, replay = grid.loss_config(method.replace("GSPOwide", "GSPO"))
    if method.startswith("GSPOwide"):
        cfg = dataclasses.replace(cfg, clip_low=GSPO_WIDE_CLIP, clip_high=GSPO_WIDE_CLIP)
    if cfg.sat.enabled:
        sat = dataclasses.replace(cfg.sat, quantile=quantile, exponent=exponent)
        cfg = dataclasses.replace(cfg, sat=sat)
    return cfg, replay


def microbatches(method: str) -> int:
    """The train step's microbatches for a method (SAT's per-microbatch threshold needs k > 1)."""
    return FIELD[method][1] if method in FIELD else 1


def needs_proximal(cfg: objectives.PolicyLossConfig) -> bool:
    """Whether the config weighs behavior -> proximal, so the batch needs ``old_logp``."""
    return bool(cfg.rollout_corrections)


def sat_reach(cfg: objectives.PolicyLossConfig) -> float:
    """``grid.sat_reach`` for a config: SAT can act only while its threshold q lies below it."""
    return max(math.log1p(cfg.clip_high), -math.log1p(-cfg.clip_low))
