"""The plain torch reference's PPO step (bridge/reference.py) for `compare ppo-step`, and AdamW in float64, what
the two frameworks' parameter updates are checked against."""

from __future__ import annotations

import numpy as np


def torch_step(args, cfg, models: tuple, t_name, batch_np: dict, token_scores, minibatches, lrs: tuple,
               use_ref: bool, full_kl: bool, temp: float, autocast) -> tuple:
    """The plain torch reference's step (bridge/reference.py) on the same batch: old / ref log-probs, values,
    rewards and GAE, then the critic's and the actor's updates over the mini-batches, keeping each mini-batch's
    gradients. Returns (its results T, the batch as tensors, the token rewards, the two optimizers, the actor's
    and the critic's parameter updates, the mini-batch iterator)."""
    import torch

    from bridge import reference as ref_torch

    t_actor, t_critic, t_ref = models
    a_lr, c_lr = lrs
    alg, R, K, dev = cfg.algorithm, args.response_len, args.mini_batches, args.device
    tb = {k: torch.as_tensor(v, device=dev) for k, v in batch_np.items()}
    tb = {k: (v.long() if k in ("input_ids", "attention_mask", "positions") else v) for k, v in tb.items()}
    T: dict = {}
    with torch.no_grad():
        T["old_logprobs"] = ref_torch.response_logprobs(t_actor, tb, R, temp, autocast)[0]
        T["ref_logprobs"] = ref_torch.response_logprobs(t_ref, tb, R, temp, autocast)[0] if use_ref else None
        T["values"] = ref_torch.response_values(t_critic, tb, R, autocast)
        t_mask = tb["response_mask"]
        t_scores = torch.as_tensor(np.array(token_scores), device=dev)
        t_rewards = t_scores
        if alg.use_kl_in_reward:
            t_rewards = t_scores - alg.kl_ctrl.kl_coef * ref_torch.kl_estimate(
                T["old_logprobs"], T["ref_logprobs"], alg.kl_penalty) * t_mask
        T["token_rewards"] = t_rewards
        T["advantages"], T["returns"] = ref_torch.gae(t_rewards, T["values"], t_mask, alg.gamma, alg.lam)
    a_opt = ref_torch.make_adamw(t_actor, cfg.actor.optim)
    c_opt = ref_torch.make_adamw(t_critic, cfg.critic.optim)
    ta0, tc0 = ref_torch.trainable_state(t_actor, t_name), ref_torch.trainable_state(t_critic, t_name)

    torch_batches = lambda: minibatches(tb, T)  # noqa: E731

    T["critic_grads"] = [{} for _ in range(K)]
    T["actor_grads"] = [{} for _ in range(K)]
    T["critic"] = [ref_torch.critic_update(t_critic, c_opt, part, cfg.critic, R, float(c_lr(i)), args.micro_batches,
                                           autocast, grads=T["critic_grads"][i])
                   for i, part in enumerate(torch_batches())]
    T["actor"] = [ref_torch.actor_update(t_actor, a_opt, part, cfg.actor, R, float(a_lr(i)), args.micro_batches, temp,
                                         autocast, ref_model=t_ref if full_kl else None, grads=T["actor_grads"][i])
                  for i, part in enumerate(torch_batches())]
    ta_delta = {k: v - ta0[k] for k, v in ref_torch.trainable_state(t_actor, t_name).items()}
    tc_delta = {k: v - tc0[k] for k, v in ref_torch.trainable_state(t_critic, t_name).items()}
    for key in ("actor_grads", "critic_grads"):  # peft's names -> jaxppo's
        T[key] = [{t_name(n): g for n, g in d.items()} for d in T[key]]
    return T, tb, t_rewards, a_opt, c_opt, ta_delta, tc_delta, torch_batches


def adamw64(p0: dict, grads: list[dict], lrs: list[float], optim) -> dict:
    """The total update of global-norm clipping + AdamW (optax's and torch's: decoupled weight decay on the
    pre-step parameters, bias-corrected moments, eps outside the square root) over the gradient sequence
    `grads`, from parameters `p0`, in float64: the exact arithmetic both frameworks approximate."""
    p = {n: np.asarray(p0[n], np.float64) for n in grads[0]}
    m = {n: np.zeros_like(v) for n, v in p.items()}
    v2 = {n: np.zeros_like(v) for n, v in p.items()}
    b1, b2 = optim.betas
    for t, (g, lr) in enumerate(zip(grads, lrs), start=1):
        total = np.sqrt(sum(float(np.sum(np.asarray(x, np.float64) ** 2)) for x in g.values()))
        scale = min(1.0, optim.grad_clip / total) if total > 0 else 1.0
        for n in p:
            gn = np.asarray(g[n], np.float64) * scale
            m[n] = b1 * m[n] + (1 - b1) * gn
            v2[n] = b2 * v2[n] + (1 - b2) * gn * gn
            step = (m[n] / (1 - b1**t)) / (np.sqrt(v2[n] / (1 - b2**t)) + optim.eps)
            p[n] = p[n] - lr * (step + optim.weight_decay * p[n])
    return {n: p[n] - np.asarray(p0[n], np.float64) for n in p}
