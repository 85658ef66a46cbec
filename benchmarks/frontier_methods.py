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
# The field's large-lag corrections, each on GRPO's clip (docs/DESIGN.md §3.4, §3.6), and SAT with
# each microbatch's own threshold: name -> (PolicyLossConfig fields, the step's microbatches).
# TIS, IcePop and sequence masking weigh behavior -> proximal (the trainer's own log-probs before
# the update, as grid.py gives TIS), so their clip ratio is 1 at the step's single update and only
# the correction limits the step. IcePop's band and MIS's window are this study's choices, not
# the sources': IcePop (Ring-1T) uses [0.5, 5]; verl's geometric rejection sampling suggests
# [1/1.001, 1.001] (both sized for trainer-sampler mismatch, not staleness; RESULTS.md).
MICROBATCH_Q_K = 4
ICEPOP_RANGE = (0.5, 2.0)
SEQ_MASK_RANGE = (0.95, 1.05)
M2_THRESHOLD = 0.04  # M2PO's τ (the paper's)
FIELD = {
    "GRPO+SAT-mbq": ({"sat": objectives.SATConfig(threshold_scope="microbatch")}, MICROBATCH_Q_K),
    "GRPO+TIS": ({"tis_cap": grid.TIS_CAP}, 1),
    "GRPO+IcePop": ({"icepop_range": ICEPOP_RANGE}, 1),
    "GRPO+SeqMask": ({"seq_mask_range": SEQ_MASK_RANGE}, 1),
    "GRPO+DPPO-TV": ({"dppo_tv_delta": grid.DPPO_TV_DELTA}, 1),
    "GRPO+M2PO": ({"m2_threshold": M2_THRESHOLD}, 1),
    "GRPO+VCPO": ({"ess_scaling": True, "opob_baseline": True}, 1),
}
LARGE_LAG = tuple(FIELD)
# GSPO's sequence log-ratio |s_b| has a 0.9 quantile of 0.03–0.13 at lr 1e-3 (RESULTS.md, the
# comparison grid) and 0.16–0.75 at 2e-3, lag 8 (a pilot), beyond a window of 2e-3–5e-2 on nearly
# every step; GRPO's own window is the narrowest that puts q inside it on part of the steps.
GSPO_WIDE_CLIP = 0.2
GSPO_WIDE = ("GSPOwide", "GSPOwide+SAT")
METHODS = GRPO_FAMILY + LARGE_LAG + GSPO_WIDE
LAGS = (8, 32, 128, 64, 1)  # the full grid's lags, the ones that matter most first
DEFAULT_SAT = (0.9, 2.0)  # (quantile, exponent): SATConfig's defaults
# The sampler of every cell but the sampler row set's: the trainer's own float32 model, no
# truncation. The row set's (issue 35): bfloat16 weights and matmuls, top-p 0.9, for these methods.
DEFAULT_SAMPLER = ("float32", 1.0)  # (dtype, top_p)
SAMPLER_ROW_SET = ("bfloat16", 0.9)
SAMPLER_METHODS = ("GRPO", "GRPO+SAT", "GRPO+TIS", "GRPO+M2PO", "GRPO+VCPO")


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

    @property
    def knobs(self) -> tuple[float, float]:
        return (self.quantile, self.exponent)

    @property
    def sampler(self) -> tuple[str, float]:
        return (self.sampler_dtype, self.top_p)

    @property
    def row(self) -> str:
        """The report's row: the method, and the sampler where it is not the default."""
        return row_label(self.method, self.sampler)

    @property
    def name(self) -> str:
        knob = "" if self.knobs == DEFAULT_SAT else f"_q{self.quantile:g}_p{self.exponent:g}"
        dtype = "" if self.sampler_dtype == DEFAULT_SAMPLER[0] else f"_{self.sampler_dtype}"
        top_p = "" if self.top_p == DEFAULT_SAMPLER[1] else f"_top_p{self.top_p:g}"
        return f"{self.method}_lag{self.lag}_lr{self.lr:g}{knob}{dtype}{top_p}_seed{self.seed}"


def row_label(method: str, sampler: tuple[str, float] = DEFAULT_SAMPLER) -> str:
    """``method``, or ``method [dtype, top-p p]`` for a cell sampled otherwise than by default."""
    if sampler == DEFAULT_SAMPLER:
        return method
    return f"{method} [{sampler[0]}, top-p {sampler[1]:g}]"


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
