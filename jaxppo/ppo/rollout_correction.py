"""Rollout correction as verl defines it (`algorithm.rollout_correction`; verl 0.9.1's
`verl/trainer/ppo/rollout_corr_helper.py`): the trainer's policy and the engine that sampled differ (bf16 vLLM
against fp32 JAX, or a rollout one step behind), so the PPO loss is reweighted and the worst tokens or sequences
are dropped. On the host, in float64, once per step from the trainer's old log-probs and the engine's:

  rollout_is            token | sequence: importance weights pi_trainer / pi_rollout per token, or their product
                        over the sequence; truncated at the upper threshold (TIS), or zeroed outside
                        "lower_upper" (IcePop); `rollout_is_batch_normalize` rescales them to mean 1 over the batch
  rollout_rs            rejection: comma-separated options token_k1|k2|k3, seq_sum_k1|k2|k3, seq_mean_k1|k2|k3
                        (seq_mean_k1: the geometric mean ratio), seq_max_k2|k3, each with its threshold in
                        `rollout_rs_threshold` (k1: "lower_upper" ratio bounds, else an upper bound); rejected
                        tokens leave the actor's loss mask

  bypass_mode           the rollout engine's log-probs are the old policy's: the trainer skips recomputing them,
                        and the options above are computed in the loss from the current policy instead of here
                        (jaxppo/ppo/bypass.py, loss_type ppo_clip | reinforce). Without the trainer's log-probs
                        there is no gap to measure on the host: the `rollout/*` and `rollout_corr/*` metrics are
                        not logged.

Metrics under verl's names (`rollout_corr/...`); tests/ppo/test_verl_oracle.py checks weights, mask and every metric
here against verl's functions.
"""

from __future__ import annotations

import math
from typing import Any, Callable

import numpy as np

from jaxppo.errors import ConfigError

SAFETY_BOUND = 20.0
BYPASS_LOSSES = ("ppo_clip", "reinforce")  # verl's loss_type in bypass mode (reinforce: not built yet)
IS_LEVELS = ("token", "sequence")
RS_OPTIONS = ("token_k1", "token_k2", "token_k3", "seq_sum_k1", "seq_sum_k2", "seq_sum_k3", "seq_mean_k1",
              "seq_mean_k2", "seq_mean_k3", "seq_max_k2", "seq_max_k3")


def _mmean(x: np.ndarray, m: np.ndarray, axis=None) -> np.ndarray:
    return (x * m).sum(axis) / (m.sum(axis) + 1e-8)  # verl_F.masked_mean


def parse_is_threshold(spec: Any) -> tuple[float, float | None]:
    """(upper, lower or None) of `rollout_is_threshold`: a number (TIS) or "lower_upper" (IcePop)."""
    text = str(spec).strip()
    try:
        lower, upper = (float(text.split("_", 1)[0]), float(text.split("_", 1)[1])) if "_" in text \
            else (None, float(text))
    except ValueError:
        raise ConfigError(f"algorithm.rollout_correction.rollout_is_threshold {spec!r}: a number or "
                          "'lower_upper'") from None
    if upper <= 0 or (lower is not None and not 0 < lower <= upper):
        raise ConfigError(f"algorithm.rollout_correction.rollout_is_threshold {spec!r}: bounds must be positive, "
                          "lower <= upper")
    return upper, lower


def parse_rs(options: str, spec: Any) -> dict[str, tuple[float | None, float]]:
    """option -> (lower, upper) of `rollout_rs` / `rollout_rs_threshold` (one threshold shared, or one each)."""
    opts = list(dict.fromkeys(o.strip() for o in str(options).split(",") if o.strip()))
    bad = [o for o in opts if o not in RS_OPTIONS]
    if not opts or bad:
        raise ConfigError(f"algorithm.rollout_correction.rollout_rs {options!r}: unknown option(s) {bad}; known: "
                          f"{list(RS_OPTIONS)}")
    if spec is None:
        raise ConfigError("algorithm.rollout_correction.rollout_rs needs rollout_rs_threshold")
    specs = [s.strip() for s in str(spec).split(",") if s.strip()]
    if len(specs) not in (1, len(opts)):
        raise ConfigError(f"algorithm.rollout_correction.rollout_rs_threshold {spec!r}: one threshold, or one per "
                          f"option ({len(opts)})")
    specs = specs * len(opts) if len(specs) == 1 else specs
    out = {}
    for o, s in zip(opts, specs):
        try:
            if o.endswith("k1"):
                lo, hi = (float(s.split("_", 1)[0]), float(s.split("_", 1)[1])) if "_" in s \
                    else (1.0 / float(s), float(s))
                ok = 0 < lo <= hi
            else:
                lo, hi = None, float(s)
                ok = "_" not in s and hi > 0
        except ValueError:
            ok = False
        if not ok:
            raise ConfigError(f"algorithm.rollout_correction.rollout_rs_threshold {s!r} for {o}: k1 options take "
                              "positive 'lower_upper' ratio bounds (or one upper bound), the others one positive "
                              "upper bound")
        out[o] = (lo, hi)
    return out


def is_weights(log_ratio: np.ndarray, mask: np.ndarray, level: str, threshold: Any,
               batch_normalize: bool = False, total: Callable[[np.ndarray], np.ndarray] = lambda v: v
               ) -> tuple[np.ndarray, dict[str, float]]:
    """Importance weights (0 at masked tokens) and their metrics (verl's compute_rollout_correction_weights).
    `total`: sums an array over every process's rows (the batch normalisation's mean is the whole batch's)."""
    upper, lower = parse_is_threshold(threshold)
    if level == "token":
        lr_metrics = log_ratio
        raw = np.exp(np.clip(log_ratio, -SAFETY_BOUND, SAFETY_BOUND))
    elif level == "sequence":
        lr_metrics = (log_ratio * mask).sum(-1, keepdims=True)
        raw = np.broadcast_to(np.exp(np.clip(lr_metrics, -SAFETY_BOUND, SAFETY_BOUND)), log_ratio.shape)
    else:
        raise ConfigError(f"algorithm.rollout_correction.rollout_is {level!r} unknown; known: {list(IS_LEVELS)}")
    raw = raw * mask
    w = np.minimum(raw, upper) if lower is None else np.where((raw >= lower) & (raw <= upper), raw, 0.0)
    lo = 1.0 / upper if lower is None else lower
    m: dict[str, float] = {"rollout_is_mean": float(_mmean(w, mask))}
    if level == "sequence":
        m["rollout_is_max"] = float(np.exp(min(lr_metrics.max(), SAFETY_BOUND)))
        m["rollout_is_min"] = float(np.exp(lr_metrics.min()))
        m["rollout_is_ratio_fraction_high"] = float((lr_metrics > math.log(upper)).mean())
        m["rollout_is_ratio_fraction_low"] = float((lr_metrics < math.log(lo)).mean())
    else:
        m["rollout_is_ratio_fraction_high"] = float(_mmean((raw > upper).astype(float), mask))
        m["rollout_is_ratio_fraction_low"] = float(_mmean((raw < lo).astype(float), mask))
        m["rollout_is_max"] = float(np.where(mask > 0, w, -np.inf).max())
        m["rollout_is_min"] = float(np.where(mask > 0, w, np.inf).min())
    clamped = np.clip(w, 0.0, upper)
    mean_c = _mmean(clamped, mask)
    m["rollout_is_std"] = float(np.sqrt(max(_mmean(clamped ** 2, mask) - mean_c ** 2, 0.0))) if mask.sum() > 1 else 0.0
    m["rollout_is_eff_sample_size"] = float(1.0 / _mmean((clamped / (mean_c + 1e-8)) ** 2, mask))
    seq_w = _mmean(w, mask, -1)  # every row, as verl (an empty row's mean is 0)
    raw_seq = _mmean(raw, mask, -1)
    m.update({"rollout_is_seq_mean": float(seq_w.mean()),
              "rollout_is_seq_std": float(seq_w.std(ddof=1)) if seq_w.size > 1 else 0.0,
              "rollout_is_seq_max": float(seq_w.max()), "rollout_is_seq_min": float(seq_w.min()),
              "rollout_is_seq_max_deviation": float(np.abs(seq_w - 1.0).max()),
              "rollout_is_seq_fraction_high": float((raw_seq > upper).mean()),
              "rollout_is_seq_fraction_low": float((raw_seq < lo).mean())})
    if lower is not None:
        m["rollout_is_oob_ratio"] = float(_mmean(((raw < lower) | (raw > upper)).astype(float), mask))
    if batch_normalize:
        if level == "token":
            num, den = total(np.array([(w * mask).sum(), mask.sum()]))
            mean = num / (den + 1e-8)
        else:
            valid = (mask.sum(-1) > 0).astype(float)
            num, den = total(np.array([(_mmean(w, mask, -1) * valid).sum(), valid.sum()]))
            mean = num / max(den, 1e-8)
        if mean > 1e-8:
            w = w / mean
        m["rollout_is_batch_norm_factor"] = float(mean) if mean > 1e-8 else 1.0
    return np.asarray(w, np.float64), m


def rejection_mask(log_ratio: np.ndarray, mask: np.ndarray, options: str, threshold: Any
                   ) -> tuple[np.ndarray, dict[str, float]]:
    """The response mask without the rejected tokens / sequences, and the fractions rejected (verl's
    compute_rollout_rejection_mask)."""
    specs = parse_rs(options, threshold)
    lr = np.clip(log_ratio, -SAFETY_BOUND, SAFETY_BOUND)
    k = {"k1": -lr, "k2": 0.5 * lr ** 2, "k3": np.exp(lr) - 1.0 - lr}
    valid_tok, valid_seq = mask > 0, mask.sum(-1) > 0
    keep_all = np.ones_like(mask, dtype=float)
    m: dict[str, float] = {}
    for o, (lo, hi) in specs.items():
        stat = k[o[-2:]]
        if o.startswith("token"):
            per_tok = stat
        elif o.startswith("seq_sum"):
            per_tok = np.broadcast_to((stat * mask).sum(-1, keepdims=True), mask.shape)
        elif o.startswith("seq_mean"):
            per_tok = np.broadcast_to(_mmean(stat, mask, -1)[:, None], mask.shape)
        else:  # seq_max
            mx = np.where(valid_tok, stat, -np.inf).max(-1)
            per_tok = np.broadcast_to(np.where(np.isneginf(mx), 0.0, mx)[:, None], mask.shape)
        k1 = o.endswith("k1")
        keep = (per_tok >= math.log(lo)) & (per_tok <= math.log(hi)) if k1 else per_tok <= hi
        keep_f = keep.astype(float)
        keep_all = keep_all * keep_f
        m.update(_rs_metrics(f"rollout_rs_{o}", per_tok, mask, valid_seq, o.startswith("token"),
                             math.log(hi) if k1 else hi, math.log(lo) if k1 else 0.0, k1))
        m[f"rollout_rs_{o}_masked_fraction"] = float(_mmean(1.0 - keep_f, mask))
        seq_keep = ~((~keep) & valid_tok).any(-1)
        m[f"rollout_rs_{o}_seq_masked_fraction"] = float(((~seq_keep) & valid_seq).sum() / valid_seq.sum()) \
            if valid_seq.any() else 0.0
    m["rollout_rs_masked_fraction"] = float(_mmean(1.0 - keep_all, mask))
    m["rollout_rs_seq_masked_fraction"] = float((~((keep_all > 0.5) & valid_tok) & valid_tok).any(-1).mean())
    return mask * keep_all, m


def _rs_metrics(prefix: str, stat: np.ndarray, mask: np.ndarray, valid_seq: np.ndarray, token_level: bool,
                hi: float, lo: float, use_lo: bool) -> dict[str, float]:
    """One rejection option's statistic (verl's compute_rs_metrics): its range, the fractions beyond its bounds,
    per token and per sequence."""
    valid_tok = mask > 0
    seq = _mmean(stat, mask, -1)[valid_seq]
    m = {f"{prefix}_mean": float(_mmean(stat, mask))}
    if not token_level and seq.size:
        m[f"{prefix}_max"], m[f"{prefix}_min"] = float(seq.max()), float(seq.min())
        m[f"{prefix}_fraction_high"] = float((seq > hi).mean())
        m[f"{prefix}_fraction_low"] = float((seq < lo).mean()) if use_lo else 0.0
    else:
        m[f"{prefix}_max"] = float(np.where(valid_tok, stat, -np.inf).max())
        m[f"{prefix}_min"] = float(np.where(valid_tok, stat, np.inf).min())
        m[f"{prefix}_fraction_high"] = float(_mmean((stat > hi).astype(float), mask))
        m[f"{prefix}_fraction_low"] = float(_mmean((stat < lo).astype(float), mask)) if use_lo else 0.0
    if mask.sum() > 1:
        c = np.clip(stat, lo if use_lo else 0.0, hi)
        m[f"{prefix}_std"] = float(np.sqrt(max(_mmean(c ** 2, mask) - _mmean(c, mask) ** 2, 0.0)))
    else:
        m[f"{prefix}_std"] = 0.0
    if seq.size:
        m.update({f"{prefix}_seq_mean": float(seq.mean()),
                  f"{prefix}_seq_std": float(seq.std(ddof=1)) if seq.size > 1 else 0.0,
                  f"{prefix}_seq_max": float(seq.max()), f"{prefix}_seq_min": float(seq.min()),
                  f"{prefix}_seq_max_deviation": float(np.abs(seq).max()),
                  f"{prefix}_seq_fraction_high": float((seq > hi).mean())})
        if use_lo:
            m[f"{prefix}_seq_fraction_low"] = float((seq < lo).mean())
    else:
        m.update({f"{prefix}_{k}": 0.0 for k in ("seq_mean", "seq_std", "seq_max", "seq_min", "seq_max_deviation",
                                                   "seq_fraction_high", "seq_fraction_low")})
    return m


def offpolicy_metrics(old: np.ndarray, rollout: np.ndarray, mask: np.ndarray) -> dict[str, float]:
    """How far the rollout's distribution is from the trainer's (verl's compute_offpolicy_metrics)."""
    lp_t, lp_r = _mmean(old, mask, -1), _mmean(rollout, mask, -1)
    lr = old - rollout
    diff = lp_r - lp_t
    rho = np.exp(np.clip(lr, -SAFETY_BOUND, SAFETY_BOUND))
    seq = np.clip((lr * mask).sum(-1), -SAFETY_BOUND, SAFETY_BOUND)
    return {"training_ppl": float(np.exp(-lp_t).mean()), "training_log_ppl": float((-lp_t).mean()),
            "kl": float(_mmean(rollout - old, mask)), "k3_kl": float(_mmean(np.exp(lr) - lr - 1.0, mask)),
            "rollout_ppl": float(np.exp(-lp_r).mean()), "rollout_log_ppl": float((-lp_r).mean()),
            "log_ppl_diff": float(diff.mean()), "log_ppl_abs_diff": float(np.abs(diff).mean()),
            "log_ppl_diff_max": float(diff.max()), "log_ppl_diff_min": float(diff.min()),
            "ppl_ratio": float(np.exp(diff).mean()), "chi2_token": float(_mmean(rho ** 2, mask) - 1.0),
            "chi2_seq": float(np.exp(2.0 * seq).mean() - 1.0)}


def rollout_correction(old_logprobs: np.ndarray, rollout_logprobs: np.ndarray, response_mask: np.ndarray, rc: Any,
                       total: Callable[[np.ndarray], np.ndarray] = lambda v: v
                       ) -> tuple[np.ndarray | None, np.ndarray, dict[str, float]]:
    """(importance weights or None, the actor's loss mask, `rollout_corr/*` metrics) for one batch
    (verl's compute_rollout_correction_and_rejection_mask), `rc` the algorithm.rollout_correction config;
    `total` sums over every process's rows (several processes: the batch normalisation's mean is global)."""
    old, ro = np.asarray(old_logprobs, np.float64), np.asarray(rollout_logprobs, np.float64)
    mask = np.asarray(response_mask, np.float64)
    log_ratio = old - ro
    metrics: dict[str, float] = {}
    weights = None
    if rc.rollout_is is not None:
        weights, m = is_weights(log_ratio, mask, rc.rollout_is, rc.rollout_is_threshold, rc.rollout_is_batch_normalize,
                                total)
        metrics.update(m)
    out_mask = mask
    if rc.rollout_rs is not None:
        out_mask, m = rejection_mask(log_ratio, mask, rc.rollout_rs, rc.rollout_rs_threshold)
        metrics.update(m)
    metrics.update(offpolicy_metrics(old, ro, mask))
    return weights, out_mask, {f"rollout_corr/{k}": v for k, v in metrics.items()}


def enabled(cfg: Any) -> bool:
    """Whether the decoupled correction runs (weights or rejection from the trainer's and the engine's log-probs)."""
    rc = cfg.algorithm.rollout_correction
    return rc.rollout_is is not None or rc.rollout_rs is not None


def bypass(cfg: Any) -> bool:
    """verl's bypass mode: the engine's log-probs are the old policy's (no recomputation)."""
    return bool(cfg.algorithm.rollout_correction.bypass_mode)


__all__ = ["rollout_correction", "is_weights", "rejection_mask", "offpolicy_metrics", "enabled", "bypass",
           "RS_OPTIONS", "IS_LEVELS", "BYPASS_LOSSES"]
