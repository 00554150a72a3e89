"""`compare ppo-step`: one PPO step in jaxppo and in the plain torch reference on the same weights, batch and
config; per quantity both values, their relative difference and its tolerance in the compute dtype (CRITERIA)."""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np

from jaxppo.compare.models import Models, Setup, actor_part, critic_part, hf_numpy, jax_dtypes, load_both, setup
from jaxppo.compare.timing import time_phases
from jaxppo.compare.torch_step import adamw64, torch_step


def _rel(a, b, scale: float = 1e-6, mask=None) -> float:
    """max |a - b| / max(max |b|, scale): normwise relative difference (valid entries only)."""
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    if mask is not None:
        a, b = a[np.asarray(mask) > 0], b[np.asarray(mask) > 0]
    if a.size == 0:
        return 0.0
    return float(np.max(np.abs(a - b)) / max(float(np.max(np.abs(b))), scale))


def _sample_batch(weights, model_dir, cfg, dtype: str, device: str, num_seqs: int, prompt_len: int,
                  response_len: int, n: int, seed: int, pad_id: int, vocab: int):
    """Random prompts (lengths P/2..P, left-padded), responses sampled by the transformers rollout engine
    from the actor's `weights` ((HF name, array) pairs, pushed through DLPack), cut at random lengths 1..R (a
    random model rarely samples an EOS), random 0/1 scores."""
    from bridge.engines import make_engine
    from jaxppo.data import left_pad
    from jaxppo.rollout import Sampling, train_sequences

    rng = np.random.default_rng(seed)
    prompts = [rng.integers(0, vocab, size=int(k)) for k in rng.integers(max(prompt_len // 2, 1), prompt_len + 1,
                                                                            size=num_seqs // n)]
    engine = make_engine("hf", model_dir=model_dir, dtype=dtype, device=device, pad_token_id=pad_id)
    engine.update_weights(weights)
    ro = engine.generate([p.tolist() for p in prompts], Sampling(n=n, temperature=cfg.rollout.temperature,
                                                                  max_tokens=response_len, seed=seed))
    del engine
    for i, length in enumerate(rng.integers(1, response_len + 1, size=num_seqs)):
        ro.response_mask[i, length:] = 0.0
        ro.response_ids[i, length:] = pad_id
    p_ids, p_mask = left_pad(prompts, pad_id, prompt_len)
    batch = train_sequences(p_ids, p_mask, ro)
    scores = rng.integers(0, 2, size=num_seqs).astype(np.float32)
    return batch, scores, ro.prompt_index


# what `compare ppo-step` checks in each compute dtype (exit 1 when a row's difference exceeds its tolerance)
CRITERIA = {
    "float64": "every quantity, parameter updates included, within 1e-8 (JAX in x64 mode, torch in double: the "
               "same arithmetic, only the order of operations differs)",
    "float32": "forward values, losses, metrics and gradients within 1e-4; each optimizer step against AdamW in "
               "float64 on its own gradients within 1e-4 + what storing the parameters in float32 rounds away "
               "(half an ulp of each parameter per mini-batch, relative to the step: at a learning rate of 1e-6 "
               "an update is ~1e-6 against parameters of ~0.02-1, and that rounding alone is 1e-3 to 1e-2); the "
               "parameter update within what float64 AdamW predicts from the two gradient sequences + twice "
               "that rounding + 1e-4",
    "bfloat16": "none (reported only): bfloat16's rounding decides the differences; the float32 and float64 "
                "comparisons are the checks",
}
BASE_TOLERANCE = {"float64": 1e-8, "float32": 1e-4, "bfloat16": None}


def _side_by_side(J: dict, T: dict, rmask: np.ndarray, K: int, cfg: Any, dtype: str, actor: tuple, critic: tuple
                  ) -> list[dict]:
    """The report's rows: each quantity from both frameworks, their relative difference, what it is relative to
    and its tolerance in `dtype` (CRITERIA; None: not checked). `actor` / `critic`: (jaxppo's parameter update,
    torch's, the parameters before, the learning rate per mini-batch)."""
    import torch

    base = BASE_TOLERANCE[dtype]
    rows = []
    lp_scale = float(np.mean(np.abs(J["old_logprobs"][rmask > 0])))
    adv_scale = float(np.mean(np.abs(J["advantages"][rmask > 0])))

    def add(name, j, t, scale=1e-6, mask=None, scale_name=""):
        t = t.detach().double().cpu().numpy() if isinstance(t, torch.Tensor) else np.asarray(t)
        what = "max |torch| over valid tokens" if mask is not None else "|torch|"
        rows.append({"quantity": name, "jax": float(np.mean(np.asarray(j)[mask > 0])) if mask is not None else float(j),
                     "torch": float(np.mean(t[mask > 0])) if mask is not None else float(t),
                     "rel_diff": _rel(j, t, scale, mask), "tolerance": base,
                     "relative_to": f"max({what}, {scale_name} {scale:.3g})" if scale_name else what})

    for k in ("old_logprobs", "ref_logprobs", "values", "token_rewards", "advantages", "returns"):
        if J[k] is not None:
            add(k, J[k], T[k], mask=rmask)
    # a loss near 0 (ppo_kl on the first mini-batch, a pg_loss whose advantages cancel) is compared with the scale
    # of what it is made of, not with itself
    scales = {"ppo_kl": (lp_scale, "mean |log-prob|"), "kl_loss": (lp_scale, "mean |log-prob|"),
              "pg_loss": (adv_scale, "mean |advantage|"), "pg_clipfrac": (1.0, "a fraction's 1"),
              "vf_clipfrac": (1.0, "a fraction's 1")}
    for i in range(K):
        for k in ("pg_loss", "pg_clipfrac", "ppo_kl", "entropy", "grad_norm") + (("kl_loss",) if cfg.actor.use_kl_loss
                                                                                  else ()):
            scale, what = scales.get(k, (1e-6, ""))
            add(f"actor/{k}[{i}]", J["actor"][i][k], T["actor"][i][k], scale, scale_name=what)
        for k in ("vf_loss", "vf_clipfrac", "grad_norm"):
            scale, what = scales.get(k, (1e-6, ""))
            add(f"critic/{k}[{i}]", J["critic"][i][k], T["critic"][i][k], scale, scale_name=what)

    def l2_rel(a: dict, b: dict) -> float:
        """||a - b|| / ||b|| over every tensor (float64)."""
        num = sum(float(np.sum((np.asarray(a[n], np.float64) - np.asarray(b[n], np.float64)) ** 2)) for n in b)
        return float(np.sqrt(num / max(sum(float(np.sum(np.asarray(b[n], np.float64) ** 2)) for n in b), 1e-300)))

    def norm(a: dict) -> float:
        return float(np.sqrt(sum(float(np.sum(np.asarray(v, np.float64) ** 2)) for v in a.values())))

    def param_rows(name, jd, td, p0, lrs, sub_cfg):
        """The parameter update, and why its difference is what it is. Adam divides each gradient element by
        its own magnitude (+ eps), so elements whose gradient is rounding noise in both frameworks take steps
        decided by rounding, and a float32 parameter stores its update to half an ulp of the parameter. Checked:
        each mini-batch's gradients; each framework's optimizer step against AdamW in float64 applied to that
        framework's own gradients, within the storage rounding; the update's difference against what float64
        AdamW predicts from the two gradient sequences alone (CRITERIA)."""
        tn = {n: td[n].cpu().numpy().astype(np.float64) for n in jd}
        names = [n for n in jd if n in T[f"{name}_grads"][0]]  # a tied head is one torch parameter
        jg = [{n: g[n] for n in names} for g in J[f"{name}_grads"]]
        tg = [{n: g[n].numpy() for n in names} for g in T[f"{name}_grads"]]
        for i in range(K):
            rows.append({"quantity": f"{name}/gradient[{i}]", "jax": norm(jg[i]), "torch": norm(tg[i]),
                         "rel_diff": l2_rel(jg[i], tg[i]), "tolerance": base,
                         "relative_to": "||torch's gradient|| (L2, all tensors)"})
        pj, pt = adamw64(p0, jg, lrs, sub_cfg), adamw64(p0, tg, lrs, sub_cfg)
        jn, tnn = {n: jd[n] for n in names}, {n: tn[n] for n in names}
        # half an ulp of each stored parameter, per mini-batch, relative to float64 AdamW's step
        stored = {n: np.asarray(p0[n]) + jd[n] for n in names}
        ulp = {n: K * np.spacing(np.abs(stored[n]).astype(np.asarray(p0[n]).dtype)) / 2 for n in names}
        rounding = norm(ulp) / max(norm(pj), 1e-300) if dtype == "float32" else 0.0
        step_tol = None if base is None else base + rounding
        for who, got, want in (("jax", jn, pj), ("torch", tnn, pt)):
            rows.append({"quantity": f"{name}/optimizer_step ({who} vs float64 AdamW)", "jax": norm(got),
                         "torch": norm(want), "rel_diff": l2_rel(got, want), "tolerance": step_tol,
                         "storage_rounding": rounding, "relative_to": "||float64 AdamW's step|| (L2)"})
        predicted = l2_rel(pj, pt)
        rows.append({"quantity": f"{name}/param_update", "jax": norm(jd), "torch": norm(tn), "rel_diff": l2_rel(jd, tn),
                     "predicted": predicted, "storage_rounding": rounding,
                     "tolerance": None if base is None else (base if dtype == "float64"
                                                             else predicted + 2 * rounding + base),
                     "relative_to": "||torch's update|| (L2)"})

    param_rows("actor", *actor, cfg.actor.optim)
    param_rows("critic", *critic, cfg.critic.optim)
    return rows


@dataclasses.dataclass
class _JaxStep:
    """jaxppo's side of the step: its results by quantity (`J`), its engines and final states, the batch as sharded,
    the advantage function and rewards (for timing), the trained parameters' change."""

    J: dict
    actor: Any
    critic: Any
    a_state: Any
    c_state: Any
    sharded: Any
    adv_fn: Any
    rewards: Any
    token_scores: Any
    a0: dict
    c0: dict
    a_delta: dict
    c_delta: dict


def _jax_step(args, st: Setup, models: Models, batch_np: dict, scores, group_ids, minibatches, total: int,
              temp: float) -> _JaxStep:
    import jax
    import jax.numpy as jnp

    from jaxppo import ppo
    from jaxppo.engine import ActorEngine, CriticEngine
    from jaxppo.models import load_model
    from jaxppo.models.lora import is_adapter, zeros_like_adapters

    cfg, R, pdt, use_ref, full_kl = st.cfg, st.R, st.pdt, st.use_ref, st.full_kl
    alg = cfg.algorithm
    a_lora, c_lora = st.a_lora, st.c_lora
    rmask = batch_np["response_mask"]
    actor = ActorEngine(models.actor_mod, st.mesh, st.a_cfg, R, total, temp,
                        trainable=is_adapter if a_lora.rank else None)
    critic = CriticEngine(models.critic_mod, st.mesh, st.c_cfg, R, total,
                          trainable=(lambda p: is_adapter(p) or p[0] == "score") if c_lora.rank else None)
    actor_params = models.actor_params
    if not a_lora.rank:
        # (a copy: the actor's buffers are donated to its updates, and the exact-KL loss reads the reference there)
        ref_params = load_model(args.ref, **st.kw)[1] if (use_ref and args.ref) \
            else jax.tree.map(jnp.copy, actor_params)
    a_state, c_state = actor.init_state(actor_params), critic.init_state(models.critic_params)
    models.actor_params = models.critic_params = None  # donated to the states
    if a_lora.rank:  # the base with the adapters zeroed
        ref_params = zeros_like_adapters(a_state.params)
    # the trained parameters (under LoRA: the adapters)
    a0, c0 = hf_numpy(a_state.params, pdt), hf_numpy(c_state.params, pdt)
    sharded = actor.shard_batch(batch_np)
    J: dict = {}
    J["old_logprobs"] = np.asarray(actor.logprobs(a_state.params, sharded)[0])
    J["ref_logprobs"] = np.asarray(actor.logprobs(ref_params, sharded)[0]) if use_ref else None
    J["values"] = np.asarray(critic.values(c_state.params, sharded))
    token_scores = ppo.scores_to_token_level(jnp.asarray(scores), jnp.asarray(rmask))
    rewards = token_scores
    if alg.use_kl_in_reward:
        rewards, _ = ppo.apply_kl_penalty(token_scores, J["old_logprobs"], J["ref_logprobs"], rmask,
                                          alg.kl_ctrl.kl_coef, alg.kl_penalty)
    adv_fn = jax.jit(lambda r, m, v: ppo.compute_advantages("gae", r, m, values=v, group_ids=jnp.asarray(group_ids),
                                                            gamma=alg.gamma, lam=alg.lam))
    adv, ret = adv_fn(jnp.asarray(rewards), jnp.asarray(rmask), jnp.asarray(J["values"]))
    J["token_rewards"], J["advantages"], J["returns"] = np.asarray(rewards), np.asarray(adv), np.asarray(ret)

    J["critic"], J["actor"], J["critic_grads"], J["actor_grads"] = [], [], [], []
    ref_kw = {"ref_params": ref_params} if full_kl else {}
    for part in minibatches(batch_np, J):
        cb = critic.shard_batch(critic_part(part))
        J["critic_grads"].append(hf_numpy(critic.gradients(c_state.params, cb), pdt, np.float64))
        c_state, m = critic.update(c_state, cb)
        J["critic"].append(jax.device_get(m))
    for part in minibatches(batch_np, J):
        ab = actor.shard_batch(actor_part(part))
        J["actor_grads"].append(hf_numpy(actor.gradients(a_state.params, ab, ref_params if full_kl else None), pdt,
                                             np.float64))
        a_state, m = actor.update(a_state, ab, **ref_kw)
        J["actor"].append(jax.device_get(m))
    a_delta = {n: x - a0[n] for n, x in hf_numpy(a_state.params, pdt).items()}
    c_delta = {n: x - c0[n] for n, x in hf_numpy(c_state.params, pdt).items()}
    return _JaxStep(J, actor, critic, a_state, c_state, sharded, adv_fn, rewards, token_scores, a0, c0, a_delta,
                    c_delta)


def _sampled(args, st: Setup, models: Models) -> tuple[dict, np.ndarray, Any]:
    """The batch both frameworks train on: responses sampled by the engine from the actor's weights (in float32
    when the comparison runs in float64: only their tokens are used), then (batch, scores, group ids)."""
    from jaxppo.models.hf_io import export_hf_arrays
    from jaxppo.models.lora import LoRAWeights, is_adapter, split

    sdt = "float32" if st.f64 else args.dtype
    params = models.actor_params
    push = LoRAWeights(*reversed(split(params, is_adapter)), st.a_lora.scale, jax_dtypes()[sdt]) \
        if st.a_lora.rank else export_hf_arrays(params, jax_dtypes()[sdt])
    batch_np, scores, group_ids = _sample_batch(push, args.model, st.cfg, sdt, args.device, st.B, st.P, st.R,
                                                st.cfg.rollout.n, args.seed, models.mcfg.pad_token_id or 0,
                                                models.mcfg.vocab_size)
    if st.f64:
        batch_np = {k: v.astype(np.float64) if v.dtype == np.float32 else v for k, v in batch_np.items()}
        scores = scores.astype(np.float64)
    return batch_np, scores, group_ids


def ppo_step_report(args, overrides: list[str]) -> dict:
    """One PPO step of the GAE pipeline in jaxppo and in the plain torch reference, from the same weights and the
    same sampled batch: the report's rows compare every quantity (see the module's docstring)."""
    import jax

    from jaxppo.engine import lr_schedule

    st = setup(args, overrides)
    cfg, K, mb = st.cfg, st.K, st.mb
    models = load_both(args, st)
    batch_np, scores, group_ids = _sampled(args, st, models)
    rmask = batch_np["response_mask"]
    temp = cfg.rollout.temperature if cfg.rollout.temperature > 0 else 1.0

    def minibatches(base: dict, res: dict) -> list[dict]:
        """The K update mini-batches (contiguous, in order) of `base` + one framework's step results."""
        full = dict(base, **{k: res[k] for k in ("old_logprobs", "advantages", "values", "returns")})
        if st.use_ref:
            full["ref_logprobs"] = res["ref_logprobs"]
        return [{k: v[i * mb:(i + 1) * mb] for k, v in full.items()} for i in range(K)]

    total = K * cfg.actor.ppo_epochs
    j = _jax_step(args, st, models, batch_np, scores, group_ids, minibatches, total, temp)
    a_lr, c_lr = lr_schedule(cfg.actor.optim, total), lr_schedule(cfg.critic.optim, total)
    (T, tb, t_rewards, a_opt, c_opt, ta_delta, tc_delta, torch_batches) = torch_step(
        args, cfg, models.torch_models, models.t_name, batch_np, j.token_scores, minibatches, (a_lr, c_lr),
        st.use_ref, st.full_kl, temp, st.autocast)

    rows = _side_by_side(j.J, T, rmask, K, cfg, args.dtype,
                         (j.a_delta, ta_delta, j.a0, [float(a_lr(i)) for i in range(K)]),
                         (j.c_delta, tc_delta, j.c0, [float(c_lr(i)) for i in range(K)]))
    report = {"subcommand": "ppo-step", "model": args.model, "dtype": args.dtype, "device": args.device,
              "jax_backend": jax.default_backend(), "batch": st.B, "prompt_len": st.P, "response_len": st.R,
              "mini_batches": K, "micro_batches": args.micro_batches, "loss_agg_mode": cfg.actor.loss_agg_mode,
              "use_kl_in_reward": cfg.algorithm.use_kl_in_reward, "use_kl_loss": cfg.actor.use_kl_loss,
              "actor_lora_rank": st.a_lora.rank, "critic_lora_rank": st.c_lora.rank,
              "valid_response_tokens": int(rmask.sum()), "rows": rows, "adam_eps": cfg.actor.optim.eps,
              "max_rel_diff": max(r["rel_diff"] for r in rows if r["tolerance"] is not None),
              "criterion": CRITERIA[args.dtype],
              "failed": [r["quantity"] for r in rows if r["tolerance"] is not None and r["rel_diff"] > r["tolerance"]]}
    if args.time:
        t_actor, t_critic, _ = models.torch_models
        report["timing"] = time_phases(args, j.actor, j.critic, j.a_state, j.c_state, j.sharded,
                                       lambda: minibatches(batch_np, j.J), j.adv_fn, j.rewards, rmask, j.J, T,
                                       t_actor, t_critic, a_opt, c_opt, tb, torch_batches, t_rewards, cfg, st.R,
                                       temp, st.autocast, a_lr, c_lr)
    models.tmp.cleanup()
    return report
