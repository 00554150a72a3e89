"""Independent float64 numpy implementations (plain loops, written from the papers / verl's torch code)."""

import numpy as np


def masked_mean(x, m):
    return (x * m).sum() / max(m.sum(), 1)


def whiten(x, m, eps=1e-8):
    n = m.sum()
    mean = masked_mean(x, m)
    var = masked_mean((x - mean) ** 2, m)
    var = var * n / (n - 1) if n > 1 else 0.0
    return np.where(m > 0, (x - mean) / np.sqrt(var + eps), 0.0)


def gae(rewards, values, mask, gamma, lam):
    b, t = rewards.shape
    adv = np.zeros((b, t))
    for i in range(b):
        valid = [j for j in range(t) if mask[i, j] > 0]  # masked tokens are skipped entirely
        last, next_v = 0.0, 0.0
        for j in reversed(valid):
            delta = rewards[i, j] + gamma * next_v - values[i, j]
            last = delta + gamma * lam * last
            adv[i, j] = last
            next_v = values[i, j]
    returns = np.where(mask > 0, adv + values, 0.0)
    return whiten(adv, mask), returns


def group_baselines(scores, groups):
    out = {}
    for g in set(groups.tolist()):
        out[g] = scores[groups == g]
    return out


def grpo(rewards, mask, groups, norm_by_std=True, eps=1e-6):
    scores = (rewards * mask).sum(-1)
    by = group_baselines(scores, groups)
    adv = np.zeros_like(scores)
    for i, g in enumerate(groups):
        s = by[g]
        mean, std = (s.mean(), s.std(ddof=1)) if len(s) > 1 else (0.0, 1.0)
        adv[i] = (scores[i] - mean) / (std + eps) if norm_by_std else scores[i] - mean
    return adv[:, None] * mask


def rloo(rewards, mask, groups):
    scores = (rewards * mask).sum(-1)
    adv = np.zeros_like(scores)
    for i, g in enumerate(groups):
        others = [scores[j] for j in range(len(scores)) if groups[j] == g and j != i]
        adv[i] = scores[i] - (np.mean(others) if others else 0.0)
    return adv[:, None] * mask


def reinforce_pp(rewards, mask, gamma):
    b, t = rewards.shape
    ret = np.zeros((b, t))
    for i in range(b):
        running = 0.0
        for j in reversed(range(t)):  # a masked token (an observation span) passes the return through
            if mask[i, j] > 0:
                running = rewards[i, j] + gamma * running
                ret[i, j] = running
    ret = np.where(mask > 0, ret, 0.0)
    return whiten(ret, mask), ret


def kl(lp, ref, kind):
    d = lp - ref
    if kind in ("k1", "kl"):
        return d
    if kind == "abs":
        return np.abs(d)
    if kind in ("k2", "mse"):
        return 0.5 * d * d
    if kind in ("k3", "low_var_kl"):
        x = np.clip(-d, -20, 20)
        return np.clip(np.exp(x) - x - 1, -10, 10)
    raise ValueError(kind)


def log_softmax(z):
    z = z - z.max(-1, keepdims=True)
    return z - np.log(np.exp(z).sum(-1, keepdims=True))


def full_kl(logits, ref_logits):
    lp, lq = log_softmax(logits), log_softmax(ref_logits)
    return (np.exp(lp) * (lp - lq)).sum(-1)


def agg(loss, mask, mode):
    seqs = [i for i in range(loss.shape[0]) if mask[i].sum() > 0]
    if mode == "token-mean":
        return (loss * mask).sum() / max(mask.sum(), 1)
    if mode == "seq-mean-token-sum":
        return sum((loss[i] * mask[i]).sum() for i in seqs) / max(len(seqs), 1)
    if mode == "seq-mean-token-mean":
        return sum((loss[i] * mask[i]).sum() / mask[i].sum() for i in seqs) / max(len(seqs), 1)
    if mode == "seq-mean-token-sum-norm":
        return sum((loss[i] * mask[i]).sum() for i in seqs) / (max(len(seqs), 1) * loss.shape[1])
    raise ValueError(mode)


def policy_loss(old, new, adv, mask, low, high, c, mode):
    out = np.zeros_like(adv)
    clipped = np.zeros_like(adv)
    lower = np.zeros_like(adv)
    for idx in np.ndindex(adv.shape):
        r = np.exp(np.clip(new[idx] - old[idx], -20, 20))
        a = adv[idx]
        unclipped, clip = -a * r, -a * min(max(r, 1 - low), 1 + high)
        loss = max(unclipped, clip)
        clipped[idx] = clip > unclipped
        if a < 0:
            lower[idx] = loss > -a * c
            loss = min(loss, -a * c)
        out[idx] = loss
    ppo_kl = masked_mean(-np.clip(new - old, -20, 20), mask)
    return agg(out, mask, mode), masked_mean(clipped, mask), masked_mean(lower, mask), ppo_kl


def value_loss(v, old_v, ret, mask, c, mode):
    clipped_v = np.clip(v, old_v - c, old_v + c)
    l1, l2 = (v - ret) ** 2, (clipped_v - ret) ** 2
    return 0.5 * agg(np.maximum(l1, l2), mask, mode), masked_mean((l2 > l1).astype(float), mask)


def entropy(logits):
    lp = log_softmax(logits)
    return -(np.exp(lp) * lp).sum(-1)
