"""A slow float64 NumPy reference of docs/DESIGN.md §3, written from the equations (token by token).

It shares no code with ``sat_jax.objectives``: the quantile is a full sort, ψ and the clip are
spelled out per token, and the gradient with respect to ``logp`` is derived by hand from the
piecewise-linear surrogate (which branch of the min is active), not by autodiff.
"""

from __future__ import annotations

import math
from fractions import Fraction

import numpy as np


def quantile_inverted_cdf(values, level: float) -> float:
    """inf{x : F̂(x) ≥ level}: the element at 1-indexed position ceil(level·n) of the sorted values."""
    xs = np.sort(np.asarray(values, np.float64))
    n = len(xs)
    if n == 0:
        return 0.0
    rank = math.ceil(Fraction(level).limit_denominator(10_000) * n)
    return float(xs[rank - 1])


def m2po_masked(d_sampler, act, threshold, advantages=None, token_set="all") -> np.ndarray:
    """M2PO's mask as AReaL words it, over the candidates (every active token, or with
    ``token_set="trust_region"`` those with A > 0 and d > 0 or A < 0 and d < 0, the paper's):
    sort their (log r)² descending, mask the fewest largest after which the rest's mean is below
    τ (all but the smallest one when none is); tokens tied with the smallest masked value are
    masked with it, unless that is the smallest value: those are kept (docs/DESIGN.md §3.6)."""
    d = np.asarray(d_sampler, np.float64)
    m2 = d**2
    cand = np.asarray(act, bool).copy()
    if token_set == "trust_region":
        a = np.asarray(advantages, np.float64)
        cand &= ((a > 0) & (d > 0)) | ((a < 0) & (d < 0))
    desc = sorted((float(v) for v in m2[cand]), reverse=True)
    n = len(desc)
    k = next((k for k in range(n) if sum(desc[k:]) / (n - k) < threshold), max(n - 1, 0))
    cutoff = desc[k - 1] if k > 0 else math.inf
    if n and cutoff <= desc[-1]:  # never mask the smallest
        cutoff = min((v for v in desc if v > desc[-1]), default=math.inf)
    return cand & (m2 >= cutoff)


def reference_ess(logp, behavior_logp, mask, clamp_limit=20.0) -> float:
    """(Σ w)² / (N·Σ w²) over the N active tokens, w = exp(logp − behavior_logp) clamped."""
    act = np.asarray(mask) > 0
    d = np.asarray(logp, np.float64)[act] - np.asarray(behavior_logp, np.float64)[act]
    if clamp_limit is not None:
        d = np.clip(d, -clamp_limit, clamp_limit)
    w = np.exp(d)
    return float(w.sum() ** 2 / (len(w) * (w**2).sum())) if len(w) else 0.0


def reference_ess_sequence(logp, behavior_logp, mask, clamp_limit=20.0) -> float:
    """(Σ w)² / (B·Σ w²) over the B responses with an active token, w_i = exp(s_i) and s_i the
    sum of logp − behavior_logp over response i's active tokens, clamped (VCPO's authors)."""
    act = np.asarray(mask) > 0
    d = np.asarray(logp, np.float64) - np.asarray(behavior_logp, np.float64)
    s = [d[b][act[b]].sum() for b in range(act.shape[0]) if act[b].any()]
    if clamp_limit is not None:
        s = [min(max(x, -clamp_limit), clamp_limit) for x in s]
    w = np.exp(np.asarray(s, np.float64))
    return float(w.sum() ** 2 / (len(w) * (w**2).sum())) if len(w) else 0.0


def reference_policy_loss(
    logp, behavior_logp, advantages, mask, cfg, old_logp=None, ref_logp=None, fresh_mask=None
):
    """Returns (loss, metrics, grad_logp) in float64 for a ``PolicyLossConfig``-like ``cfg``.

    SAT's quantile and gate read d_SAT = logp − behavior_logp (its per-response mean at sequence
    level), whatever ``old_logp`` is; the ratio and its clip read d = logp − old_logp.
    """
    logp = np.asarray(logp, np.float64)
    beh = np.asarray(behavior_logp, np.float64)
    adv = np.asarray(advantages, np.float64)
    act = np.asarray(mask) > 0
    old = beh if old_logp is None else np.asarray(old_logp, np.float64)
    B, T = logp.shape
    L = cfg.log_ratio_clamp

    def clamp(x):
        return x if L is None else min(max(x, -L), L)

    def log_ratio(base):
        """Per token (token level) or per response broadcast to its tokens (sequence level)."""
        out = np.zeros((B, T))
        for b in range(B):
            toks = [t for t in range(T) if act[b, t]]
            for t in toks:
                out[b, t] = logp[b, t] - base[b, t]
            if cfg.ratio_level == "sequence":
                s = sum(logp[b, t] - base[b, t] for t in toks) / max(len(toks), 1)
                for t in toks:
                    out[b, t] = s
        return out

    d = log_ratio(old)  # the ratio's
    d_sat = log_ratio(beh)  # SAT's: staleness against the sampler
    active_d = [abs(d_sat[b, t]) for b in range(B) for t in range(T) if act[b, t]]
    sat = cfg.sat
    q = quantile_inverted_cdf(active_d, sat.quantile) if sat.enabled else 0.0

    # Sequence-level corrections, per response from its active tokens' old − behavior.
    seq_w, seq_masked = np.ones(B), np.zeros(B, bool)
    for b in range(B):
        toks = [t for t in range(T) if act[b, t]]
        total = sum(old[b, t] - beh[b, t] for t in toks)
        if cfg.seq_tis_cap is not None:  # min(e^S, C), written in log space
            seq_w[b] = math.exp(min(total, math.log(cfg.seq_tis_cap)))
        if cfg.seq_mask_range is not None:
            g = np.exp(total / max(len(toks), 1))
            seq_masked[b] = not cfg.seq_mask_range[0] <= g <= cfg.seq_mask_range[1]

    m2_threshold = getattr(cfg, "m2_threshold", None)
    m2_mask = np.zeros((B, T), bool)
    if m2_threshold:
        m2_mask = m2po_masked(logp - beh, act, m2_threshold, adv, cfg.m2_token_set)

    def psi(u):
        return 1.0 / (1.0 + (u / q) ** sat.exponent)

    S = np.zeros((B, T))  # surrogate value (after weights)
    dS_dd = np.zeros((B, T))  # derivative of S w.r.t. the token's (or sequence's) log-ratio
    m = {k: [] for k in ("clip_low", "clip_high", "gate", "eps_low", "eps_high", "c", "dual", "r")}
    extra = {k: [] for k in ("tis", "icepop", "tv")}
    for b in range(B):
        for t in range(T):
            if not act[b, t]:
                continue
            a, dd, ds_ = adv[b, t], d[b, t], d_sat[b, t]
            in_clamp = L is None or -L <= dd <= L
            r = math.exp(clamp(dd))
            c_lo = c_hi = 1.0
            gate = sat.enabled and q > 0 and abs(ds_) > q
            if gate:
                c_hi, c_lo = psi(max(ds_, 0.0)), psi(max(-ds_, 0.0))
            e_lo, e_hi = cfg.clip_low * c_lo, cfg.clip_high * c_hi
            lo, hi = 1.0 - e_lo, 1.0 + e_hi
            clipped = min(max(r, lo), hi)
            unclipped_value, clipped_value = r * a, clipped * a
            if unclipped_value <= clipped_value:
                s, ds = unclipped_value, r * a * in_clamp
            else:
                s, ds = clipped_value, 0.0
            dual = False
            if cfg.dual_clip is not None and a < 0 and cfg.dual_clip * a > s:
                s, ds, dual = cfg.dual_clip * a, 0.0, True
            weight = 1.0
            if cfg.dppo_tv_delta is not None:
                outward = a * (r - 1.0) > 0
                tv = abs(math.exp(logp[b, t]) - math.exp(old[b, t])) > cfg.dppo_tv_delta
                extra["tv"].append(outward and tv)
                if outward and tv:
                    ds = 0.0
            if cfg.tis_cap is not None:
                w = min(math.exp(old[b, t] - beh[b, t]), cfg.tis_cap)
                weight *= w
                extra["tis"].append(w)
            if cfg.icepop_range is not None:
                k = math.exp(old[b, t] - beh[b, t])
                w = k if cfg.icepop_range[0] <= k <= cfg.icepop_range[1] else 0.0
                weight *= w
                extra["icepop"].append(w > 0)
            weight *= seq_w[b] * (not seq_masked[b]) * (not m2_mask[b, t])
            S[b, t], dS_dd[b, t] = s * weight, ds * weight
            m["clip_low"].append(a < 0 and r < lo)
            m["clip_high"].append(a > 0 and r > hi)
            m["gate"].append(gate)
            m["eps_low"].append(e_lo)
            m["eps_high"].append(e_hi)
            m["c"].append(min(c_lo, c_hi))
            m["dual"].append(dual)
            m["r"].append(r)

    # Aggregation weights: loss = Σ w_bt·(−S_bt), over the tokens of the responses MIS keeps
    # (a rejected response leaves the denominator, as in verl).
    n_b = act.sum(axis=1)
    kept = act & ~seq_masked[:, None]
    k_b = kept.sum(axis=1)
    agg_w = np.zeros((B, T))
    if cfg.loss_agg == "token_mean":
        agg_w[kept] = 1.0 / max(kept.sum(), 1)
    else:
        n_seq = max(int((k_b > 0).sum()), 1)
        for b in range(B):
            if k_b[b]:
                agg_w[b, kept[b]] = 1.0 / (k_b[b] * n_seq)
    pg_loss = float(np.sum(-S * agg_w))

    # dloss/dlogp: token level d_bt depends on logp_bt only; sequence level d_b is the mean.
    grad = np.zeros((B, T))
    g_d = -dS_dd * agg_w
    for b in range(B):
        if cfg.ratio_level == "token":
            grad[b] = g_d[b]
        elif n_b[b]:
            grad[b, act[b]] = g_d[b].sum() / n_b[b]

    metrics = {"pg_loss": pg_loss}
    loss = pg_loss
    if ref_logp is not None:
        ref = np.asarray(ref_logp, np.float64)
        kl = np.zeros((B, T))
        dkl = np.zeros((B, T))
        for b, t in zip(*np.nonzero(kept), strict=True):
            diff = logp[b, t] - ref[b, t]
            if cfg.kl_estimator == "k1":
                kl[b, t], dkl[b, t] = diff, 1.0
            elif cfg.kl_estimator == "k2":
                kl[b, t], dkl[b, t] = 0.5 * diff**2, diff
            else:
                x = min(max(-diff, -20.0), 20.0)
                raw = math.exp(x) - x - 1.0
                kl[b, t] = min(max(raw, -10.0), 10.0)
                inside = -20.0 < -diff < 20.0 and -10.0 < raw < 10.0
                dkl[b, t] = (1.0 - math.exp(x)) * inside
        metrics["kl_ref"] = float(np.sum(kl * agg_w))
        if cfg.kl_coef > 0:
            loss += cfg.kl_coef * metrics["kl_ref"]
            grad += cfg.kl_coef * dkl * agg_w
    metrics["loss"] = loss

    def mean(xs):
        return float(np.mean(xs)) if len(xs) else 0.0

    lr_b = [logp[b, t] - beh[b, t] for b, t in zip(*np.nonzero(act), strict=True)]
    rb = [math.exp(clamp(x)) for x in lr_b]
    fresh = act if fresh_mask is None else act & (np.asarray(fresh_mask) > 0)
    fresh_k3 = [
        math.exp(clamp(logp[b, t] - beh[b, t])) - 1.0 - clamp(logp[b, t] - beh[b, t])
        for b, t in zip(*np.nonzero(fresh), strict=True)
    ]
    metrics.update(
        mismatch_abs_mean=mean([abs(x) for x in lr_b]),
        is_deviation_frac=mean([abs(r - 1.0) > 1.5 for r in rb]),
        kl_k3=mean([r - 1.0 - clamp(x) for r, x in zip(rb, lr_b, strict=True)]),
        sampler_kl=mean(fresh_k3),
        fresh_tokens=float(fresh.sum()),
        clip_frac_low=mean(m["clip_low"]),
        clip_frac_high=mean(m["clip_high"]),
        ratio_mean=mean(m["r"]),
        sat_q=q,
        sat_gate_rate=mean(m["gate"]),
        sat_eps_low_mean=mean(m["eps_low"]) if m["eps_low"] else 0.0,
        sat_eps_high_mean=mean(m["eps_high"]) if m["eps_high"] else 0.0,
        sat_c_min=min(m["c"]) if (m["c"] and sat.enabled) else 1.0,
        active_tokens=float(act.sum()),
        ess_token=reference_ess(logp, beh, act, L),
        ess_sequence=reference_ess_sequence(logp, beh, act, L),
    )
    metrics["ess"] = metrics["ess_" + getattr(cfg, "ess_level", "sequence")]
    if cfg.dual_clip is not None:
        metrics["dual_clip_frac"] = mean(m["dual"])
    if cfg.tis_cap is not None:
        metrics["tis_weight_mean"] = mean(extra["tis"])
    if cfg.icepop_range is not None:
        metrics["icepop_kept_frac"] = mean(extra["icepop"])
    responses = n_b > 0  # the sequence metrics average over responses with an active token
    if cfg.seq_tis_cap is not None:
        metrics["seq_tis_weight_mean"] = mean(seq_w[responses])
    if cfg.seq_mask_range is not None:
        metrics["seq_masked_frac"] = mean(seq_masked[responses])
    if cfg.dppo_tv_delta is not None:
        metrics["dppo_tv_masked_frac"] = mean(extra["tv"])
    if m2_threshold:
        metrics["m2po_masked_frac"] = mean(m2_mask[act])
        metrics["m2po_second_moment"] = mean([x * x for x in lr_b])
    return loss, metrics, grad
