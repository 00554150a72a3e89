"""`python -m jaxppo.compare`: the same checkpoint and batch in jaxppo (JAX) and transformers (torch).

Subcommands:
  logits (default)  forward pass parity on random left-padded batches.
  ppo-step          one PPO step (old / ref log-probs, values, advantages, critic and actor updates) in
                    jaxppo and in the plain torch reference (bridge/reference.py), same weights, same
                    batch, same config; per quantity both values and their relative difference, and with
                    --time the median time of each phase in each framework.

The last line printed is one JSON object (machine-readable); a table precedes it.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

SUBCOMMANDS = ("logits", "ppo-step")
DTYPES = ("float32", "bfloat16", "float64")


def _jax_dtypes() -> dict:
    import jax.numpy as jnp

    return {"float32": jnp.float32, "bfloat16": jnp.bfloat16, "float64": jnp.float64}


def random_left_padded_batch(rng: np.random.Generator, batch: int, seq: int, vocab: int):
    """Token ids, attention mask (left padding of random length < seq/2) and HF-style position ids."""
    ids = rng.integers(0, vocab, size=(batch, seq), dtype=np.int64)
    mask = np.ones((batch, seq), np.int64)
    for row, pad in enumerate(rng.integers(0, max(seq // 2, 1), size=batch)):
        mask[row, :pad] = 0
    positions = np.maximum(np.cumsum(mask, axis=1) - 1, 0)
    return ids, mask, positions


def _log_softmax(x: np.ndarray) -> np.ndarray:
    x = x.astype(np.float64)
    m = x.max(-1, keepdims=True)
    return x - m - np.log(np.exp(x - m).sum(-1, keepdims=True))


def logits_report(model_dir: str, dtype: str, batch: int, seq: int, seed: int, device: str) -> dict:
    import jax
    import jax.numpy as jnp

    from bridge.reference import hf_logits, load_hf_model
    from jaxppo.models import load_model

    jdtype = _jax_dtypes()[dtype]
    head = "value" if _is_score(model_dir) else "lm"
    module, params, cfg = load_model(model_dir, head, dtype=jdtype, param_dtype=jdtype)
    ids, mask, pos = random_left_padded_batch(np.random.default_rng(seed), batch, seq, cfg.vocab_size)

    method = "forward_logits" if head == "lm" else "__call__"
    fwd = jax.jit(lambda p, i, q, s: module.apply({"params": p}, i, q, s, method=method))
    t0 = time.perf_counter()
    ours = np.asarray(jax.block_until_ready(fwd(params, jnp.asarray(ids), jnp.asarray(pos), jnp.asarray(mask))))
    ours = ours.astype(np.float64 if dtype == "float64" else np.float32)
    t_jax = time.perf_counter() - t0
    t0 = time.perf_counter()
    theirs = hf_logits(load_hf_model(model_dir, dtype, device, inv_freq=cfg.inv_freq()), ids, mask, pos)
    t_torch = time.perf_counter() - t0
    if head == "value":
        theirs = theirs[..., 0]

    valid = mask.astype(bool)
    diff = np.abs(ours - theirs)[valid]
    rel = diff / np.maximum(np.abs(theirs[valid]), 1e-6)
    report = {
        "subcommand": "logits", "model": model_dir, "dtype": dtype, "batch": batch, "seq": seq, "seed": seed,
        "valid_tokens": int(valid.sum()),
        "max_abs_logit_diff": float(diff.max()),
        "mean_abs_logit_diff": float(diff.mean()),
        "max_rel_logit_diff": float(rel.max()),
        "max_abs_logit": float(np.abs(theirs[valid]).max()),
        "jax_s": round(t_jax, 3), "torch_s": round(t_torch, 3),
    }
    if head == "lm":
        lp_diff = np.abs(_log_softmax(ours) - _log_softmax(theirs))[valid]
        report["max_abs_logprob_diff"] = float(lp_diff.max())
        report["argmax_agreement"] = float((ours.argmax(-1) == theirs.argmax(-1))[valid].mean())
    return report


def _is_score(model_dir: str) -> bool:
    from jaxppo.models import load_config

    return load_config(model_dir)[1] == "score"


# ---------------------------------------------------------------- ppo-step


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


def _hf_numpy(tree: Any, dtype: Any, cast: Any = None) -> dict[str, np.ndarray]:
    """A parameter tree as {HF name: numpy array}, exported in `dtype` (then cast to `cast`, if given)."""
    from jaxppo.models.hf_io import export_hf_arrays

    return {n: np.asarray(x, cast) for n, x in export_hf_arrays(tree, dtype)}


@dataclasses.dataclass
class _Setup:
    """What ppo-step runs: the config, the batch's split (B prompts x responses, P / R tokens, K mini-batches of
    mb rows, per_dev rows per micro-batch and device), the dtypes of both frameworks, the mesh and engines' configs,
    which KL terms and LoRA adapters are on."""

    cfg: Any
    B: int
    P: int
    R: int
    K: int
    mb: int
    f64: bool
    pdt: Any  # the trained parameters' dtype in both frameworks
    tdt: str
    autocast: Any
    mesh: Any
    kw: dict  # load_model's keyword arguments
    a_cfg: Any
    c_cfg: Any
    use_ref: bool
    full_kl: bool
    a_lora: Any
    c_lora: Any


def _setup(args, overrides: list[str]) -> _Setup:
    import jax
    import jax.numpy as jnp
    import torch

    from jaxppo.config import load_config
    from jaxppo.errors import ConfigError
    from jaxppo.models.lora import spec_from
    from jaxppo.sharding import make_mesh

    cfg = load_config(args.config, overrides)
    if cfg.algorithm.adv_estimator != "gae":
        raise ConfigError("ppo-step compares the GAE pipeline (actor + critic); algorithm.adv_estimator must be gae")
    B, K = args.batch, args.mini_batches
    shards = jax.device_count()
    mb = B // K
    if B % K or mb % args.micro_batches or (mb // args.micro_batches) % shards:
        raise ConfigError(f"--batch {B} must split into --mini-batches {K} x --micro-batches {args.micro_batches} "
                          f"x {shards} devices")
    per_dev = mb // args.micro_batches // shards
    f64 = args.dtype == "float64"  # JAX in x64 mode (main), torch in double: the same update end to end
    pdt = jnp.float64 if f64 else jnp.float32
    mesh = make_mesh({"data": -1})
    impl = cfg.model.attention_impl or ("cudnn" if jax.default_backend() == "gpu" and args.dtype != "float32" else None)
    kw = dict(mesh=mesh, dtype=_jax_dtypes()[args.dtype], param_dtype=pdt, remat=cfg.model.remat, attention_impl=impl)
    a_cfg = dataclasses.replace(cfg.actor, ppo_micro_batch_size_per_device=per_dev,
                                log_prob_micro_batch_size_per_device=per_dev)
    c_cfg = dataclasses.replace(cfg.critic, ppo_micro_batch_size_per_device=per_dev,
                                log_prob_micro_batch_size_per_device=per_dev)
    # LoRA (actor.lora_rank / critic.lora_rank > 0): jaxppo's adapters against peft's on the same base, from the
    # same adapter initialisation; the reference is the base with the adapters off in both
    a_lora, c_lora = spec_from(cfg.actor), spec_from(cfg.critic)
    if a_lora.rank and args.ref:
        raise ConfigError("--ref with actor.lora_rank > 0: under LoRA the reference policy is the base model "
                          "(--model) with the adapters off")
    return _Setup(cfg, B, args.prompt_len, args.response_len, K, mb, f64, pdt, "float64" if f64 else "float32",
                  torch.bfloat16 if args.dtype == "bfloat16" else None, mesh, kw, a_cfg, c_cfg,
                  cfg.actor.use_kl_loss or cfg.algorithm.use_kl_in_reward,
                  cfg.actor.use_kl_loss and cfg.actor.kl_loss_type == "full", a_lora, c_lora)


@dataclasses.dataclass
class _Models:
    """The same weights in both frameworks: jaxppo's modules and parameters, the torch actor, critic and reference
    (bridge/reference.py; peft's adapters under LoRA), the torch parameter-name map, the config of the model."""

    actor_mod: Any
    actor_params: Any
    critic_mod: Any
    critic_params: Any
    mcfg: Any
    torch_models: tuple  # (actor, critic, reference)
    t_name: Any
    tmp: Any  # the temporary directory of a critic written for torch (cleaned up by the caller)


def _load_both(args, st: _Setup) -> _Models:
    import tempfile

    import jax

    from bridge import reference as ref_torch
    from jaxppo.models import load_model, save_hf_checkpoint
    from jaxppo.models.lora import is_adapter, split

    cfg, kw, a_lora, c_lora = st.cfg, st.kw, st.a_lora, st.c_lora
    actor_mod, actor_params, mcfg = load_model(args.model, rng=jax.random.PRNGKey(args.seed + 2), lora=a_lora, **kw)
    critic_mod, critic_params, _ = load_model(args.critic or args.model, "value", rng=jax.random.PRNGKey(args.seed),
                                              lora=c_lora, **kw)
    tmp = tempfile.TemporaryDirectory(prefix="jaxppo-compare-")
    critic_dir = args.critic or str(save_hf_checkpoint(split(critic_params, is_adapter)[1], mcfg,
                                                       Path(tmp.name) / "critic", head="value"))
    t_load = lambda d: ref_torch.load_hf_model(d, st.tdt, args.device, inv_freq=mcfg.inv_freq())  # noqa: E731
    t_actor, t_critic = t_load(args.model).train(), t_load(critic_dir).train()
    if cfg.model.remat != "none":
        for m in (t_actor, t_critic):
            m.gradient_checkpointing_enable()
    t_name = ref_torch.peft_to_hf if (a_lora.rank or c_lora.rank) else (lambda n: n)
    if a_lora.rank:
        t_actor = ref_torch.wrap_lora(t_actor, a_lora.rank, a_lora.alpha, a_lora.targets,
                                      _hf_numpy(split(actor_params, is_adapter)[0], st.pdt))
    if c_lora.rank:
        t_critic = ref_torch.wrap_lora(t_critic, c_lora.rank, c_lora.alpha, c_lora.targets,
                                       _hf_numpy(split(critic_params, is_adapter)[0], st.pdt), train_head=True)
    if st.f64:  # peft's adapters as well
        t_actor, t_critic = t_actor.double(), t_critic.double()
    if a_lora.rank:
        t_ref = ref_torch.AdaptersOff(t_actor)
    else:
        t_ref = t_load(args.ref) if (st.use_ref and args.ref) else t_actor
    return _Models(actor_mod, actor_params, critic_mod, critic_params, mcfg, (t_actor, t_critic, t_ref), t_name, tmp)


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


def _jax_step(args, st: _Setup, models: _Models, batch_np: dict, scores, group_ids, minibatches, total: int,
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
    actor = ActorEngine(models.actor_mod, st.mesh, st.a_cfg, R, total, temp, trainable=is_adapter if a_lora.rank else None)
    critic = CriticEngine(models.critic_mod, st.mesh, st.c_cfg, R, total,
                          trainable=(lambda p: is_adapter(p) or p[0] == "score") if c_lora.rank else None)
    actor_params = models.actor_params
    if not a_lora.rank:
        # (a copy: the actor's buffers are donated to its updates, and the exact-KL loss reads the reference there)
        ref_params = load_model(args.ref, **st.kw)[1] if (use_ref and args.ref) else jax.tree.map(jnp.copy, actor_params)
    a_state, c_state = actor.init_state(actor_params), critic.init_state(models.critic_params)
    models.actor_params = models.critic_params = None  # donated to the states
    if a_lora.rank:  # the base with the adapters zeroed
        ref_params = zeros_like_adapters(a_state.params)
    a0, c0 = _hf_numpy(a_state.params, pdt), _hf_numpy(c_state.params, pdt)  # the trained parameters (under LoRA: the adapters)
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
        cb = critic.shard_batch(_critic_part(part))
        J["critic_grads"].append(_hf_numpy(critic.gradients(c_state.params, cb), pdt, np.float64))
        c_state, m = critic.update(c_state, cb)
        J["critic"].append(jax.device_get(m))
    for part in minibatches(batch_np, J):
        ab = actor.shard_batch(_actor_part(part))
        J["actor_grads"].append(_hf_numpy(actor.gradients(a_state.params, ab, ref_params if full_kl else None), pdt,
                                              np.float64))
        a_state, m = actor.update(a_state, ab, **ref_kw)
        J["actor"].append(jax.device_get(m))
    a_delta = {n: x - a0[n] for n, x in _hf_numpy(a_state.params, pdt).items()}
    c_delta = {n: x - c0[n] for n, x in _hf_numpy(c_state.params, pdt).items()}
    return _JaxStep(J, actor, critic, a_state, c_state, sharded, adv_fn, rewards, token_scores, a0, c0, a_delta,
                    c_delta)


def _sampled(args, st: _Setup, models: _Models) -> tuple[dict, np.ndarray, Any]:
    """The batch both frameworks train on: responses sampled by the engine from the actor's weights (in float32
    when the comparison runs in float64: only their tokens are used), then (batch, scores, group ids)."""
    from jaxppo.models.hf_io import export_hf_arrays
    from jaxppo.models.lora import LoRAWeights, is_adapter, split

    sdt = "float32" if st.f64 else args.dtype
    params = models.actor_params
    push = LoRAWeights(*reversed(split(params, is_adapter)), st.a_lora.scale, _jax_dtypes()[sdt]) \
        if st.a_lora.rank else export_hf_arrays(params, _jax_dtypes()[sdt])
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

    st = _setup(args, overrides)
    cfg, K, mb = st.cfg, st.K, st.mb
    models = _load_both(args, st)
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
    (T, tb, t_rewards, a_opt, c_opt, ta_delta, tc_delta, torch_batches) = _torch_step(
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
        report["timing"] = _time_phases(args, j.actor, j.critic, j.a_state, j.c_state, j.sharded,
                                        lambda: minibatches(batch_np, j.J), j.adv_fn, j.rewards, rmask, j.J, T,
                                        t_actor, t_critic, a_opt, c_opt, tb, torch_batches, t_rewards, cfg, st.R,
                                        temp, st.autocast, a_lr, c_lr)
    models.tmp.cleanup()
    return report


def _torch_step(args, cfg, models: tuple, t_name, batch_np: dict, token_scores, minibatches, lrs: tuple,
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


def _critic_part(part: dict) -> dict:
    """What the critic update reads of a mini-batch."""
    return {k: part[k] for k in ("input_ids", "attention_mask", "positions", "response_mask", "values", "returns")}


def _actor_part(part: dict) -> dict:
    """What the actor update reads of a mini-batch (all but the critic's targets)."""
    return {k: v for k, v in part.items() if k not in ("values", "returns")}


def _median_time(fn, repeats: int, sync) -> float:
    fn()
    sync()  # warm-up (compiles)
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - t0)
    return float(np.median(times))


def _time_phases(args, actor, critic, a_state, c_state, sharded, jax_batches, adv_fn, rewards, rmask, J, T, t_actor,
                 t_critic, a_opt, c_opt, tb, torch_batches, t_rewards, cfg, R, temp, autocast, a_lr, c_lr) -> dict:
    """Median wall time of each phase, each framework, same call. Updates run on the evolving states."""
    import jax
    import jax.numpy as jnp
    import torch

    from bridge import reference as ref_torch

    state = {"a": a_state, "c": c_state}
    out = {"jax": {}, "torch": {}}
    last = {}

    def jsync():
        jax.block_until_ready(last.get("x"))

    def upd(kind):
        engine, select = (actor, _actor_part) if kind == "a" else (critic, _critic_part)
        for part in jax_batches():
            state[kind], last["x"] = engine.update(state[kind], engine.shard_batch(select(part)))

    jx = {"old_log_prob": lambda: last.__setitem__("x", actor.logprobs(state["a"].params, sharded)),
          "values": lambda: last.__setitem__("x", critic.values(state["c"].params, sharded)),
          "adv": lambda: last.__setitem__("x", adv_fn(jnp.asarray(rewards), jnp.asarray(rmask),
                                                      jnp.asarray(J["values"]))),
          "update_critic": lambda: upd("c"), "update_actor": lambda: upd("a")}
    for name, fn in jx.items():
        out["jax"][name] = _median_time(fn, args.repeats, jsync)

    cuda = tb["input_ids"].is_cuda
    tsync = torch.cuda.synchronize if cuda else (lambda: None)

    def t_no_grad(fn):
        def run():
            with torch.no_grad():
                fn()
        return run

    tx = {"old_log_prob": t_no_grad(lambda: ref_torch.response_logprobs(t_actor, tb, R, temp, autocast)),
          "values": t_no_grad(lambda: ref_torch.response_values(t_critic, tb, R, autocast)),
          "adv": t_no_grad(lambda: ref_torch.gae(t_rewards, T["values"], tb["response_mask"], cfg.algorithm.gamma,
                                                 cfg.algorithm.lam)),
          "update_critic": lambda: [ref_torch.critic_update(t_critic, c_opt, p, cfg.critic, R, float(c_lr(0)),
                                                            args.micro_batches, autocast) for p in torch_batches()],
          "update_actor": lambda: [ref_torch.actor_update(t_actor, a_opt, p, cfg.actor, R, float(a_lr(0)),
                                                          args.micro_batches, temp, autocast) for p in torch_batches()]}
    for name, fn in tx.items():
        out["torch"][name] = _median_time(fn, args.repeats, tsync)
    out["speedup"] = {k: out["torch"][k] / out["jax"][k] for k in out["jax"]}
    return out


def _print_table(report: dict) -> None:
    width = max(len(k) for k in report)
    for k, v in report.items():
        if k in ("rows", "timing"):
            continue
        print(f"{k:<{width}}  {v}")
    if "rows" in report:
        print(f"\n{'quantity':<48} {'jax':>14} {'torch':>14} {'rel diff':>10} {'tolerance':>10}  relative to")
        for r in report["rows"]:
            notes = [f"float64 AdamW on the two gradient sequences predicts {r['predicted']:.2e}"] \
                if "predicted" in r else []
            if r.get("storage_rounding"):
                notes.append(f"float32 storage rounds {r['storage_rounding']:.2e}")
            tol = "-" if r["tolerance"] is None else f"{r['tolerance']:.2e}"
            flag = "  FAIL" if r["tolerance"] is not None and r["rel_diff"] > r["tolerance"] else ""
            print(f"{r['quantity']:<48} {r['jax']:>14.6g} {r['torch']:>14.6g} {r['rel_diff']:>10.2e} {tol:>10}  "
                  f"{r.get('relative_to', '')}" + (f"  ({'; '.join(notes)})" if notes else "") + flag)
    if "timing" in report:
        t = report["timing"]
        print(f"\n{'phase (median s)':<18} {'jax':>10} {'torch':>10} {'torch/jax':>10}")
        for k in t["jax"]:
            print(f"{k:<18} {t['jax'][k]:>10.4f} {t['torch'][k]:>10.4f} {t['speedup'][k]:>10.2f}")


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] not in SUBCOMMANDS + ("-h", "--help"):
        argv.insert(0, "logits")
    parser = argparse.ArgumentParser(prog="python -m jaxppo.compare", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="cmd", required=True)
    lg = sub.add_parser("logits", help="forward-pass parity with transformers")
    lg.add_argument("--model", required=True, help="Hugging Face model directory")
    lg.add_argument("--dtype", choices=DTYPES, default="float32", help="float64: JAX in x64 mode, torch in double")
    lg.add_argument("--batch", type=int, default=4)
    lg.add_argument("--seq", type=int, default=32)
    lg.add_argument("--seed", type=int, default=0)
    lg.add_argument("--device", choices=["cpu", "cuda"], default="cpu", help="where the torch model runs")
    ps = sub.add_parser("ppo-step", help="one PPO step in jaxppo and in plain torch, side by side",
                        description="Trailing key=value arguments are jaxppo config overrides (loss_agg_mode, "
                                    "KL, clip ratios, optimizer, ...), e.g. actor.loss_agg_mode=seq-mean-token-sum "
                                    "algorithm.use_kl_in_reward=true actor.use_kl_loss=true")
    ps.add_argument("--model", required=True, help="actor: Hugging Face causal-LM directory")
    ps.add_argument("--critic", default=None, help="critic: token-classification directory (default: the actor "
                                                   "with a new value head, the same in both frameworks)")
    ps.add_argument("--ref", default=None, help="reference policy directory (default: the actor)")
    ps.add_argument("--config", default=None, help="jaxppo YAML config (default: built-in defaults)")
    ps.add_argument("--dtype", choices=DTYPES, default="float32",
                    help="compute dtype (fp32 master weights in both; bf16 = autocast in torch; float64: JAX in "
                         "x64 mode and torch in double, float64 master weights, every quantity within 1e-8). Exit "
                         "1 when a quantity exceeds its tolerance (the report's `criterion`)")
    ps.add_argument("--device", choices=["cpu", "cuda"], default="cpu", help="where the torch side runs")
    ps.add_argument("--batch", type=int, default=8, help="sequences (prompts x rollout.n)")
    ps.add_argument("--prompt-len", type=int, default=16)
    ps.add_argument("--response-len", type=int, default=16)
    ps.add_argument("--mini-batches", type=int, default=2, help="optimizer steps per update (the 2nd sees ratio != 1)")
    ps.add_argument("--micro-batches", type=int, default=2, help="gradient-accumulation micro-batches per mini-batch")
    ps.add_argument("--seed", type=int, default=0)
    ps.add_argument("--time", action="store_true", help="also time each phase in each framework (median)")
    ps.add_argument("--repeats", type=int, default=5)
    ps.add_argument("--out", default=None, help="also write the JSON report here")
    args, rest = parser.parse_known_args(argv)
    bad = [r for r in rest if "=" not in r or r.startswith("-")]
    if bad or (rest and args.cmd != "ppo-step"):
        parser.error(f"unrecognized arguments: {' '.join(bad or rest)}")

    import contextlib

    import jax

    from jaxppo.errors import JaxppoError

    try:  # float64: JAX's x64 mode for this comparison only (the process's other work keeps its dtypes)
        with jax.enable_x64(True) if args.dtype == "float64" else contextlib.nullcontext():
            if args.cmd == "logits":
                report = logits_report(args.model, args.dtype, args.batch, args.seq, args.seed, args.device)
            else:
                os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")  # torch shares the accelerator
                report = ppo_step_report(args, rest)
    except JaxppoError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    _print_table(report)
    line = json.dumps(report)
    if getattr(args, "out", None):
        Path(args.out).write_text(line + "\n")
    print(line)
    if report.get("failed"):
        print(f"error: over the tolerance ({report['criterion']}): {', '.join(report['failed'])}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
