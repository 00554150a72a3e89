"""jaxppo's PPO math against verl 0.9.1's own functions (`verl.trainer.ppo.core_algos`), run on the same random
inputs in float64: masks with empty rows and holes, groups of one to five samples in shuffled order, micro-batch
splits. verl is an optional test extra (`pip install -e .[verl-oracle]` and `verl==0.9.1 --no-deps`, as
scripts/env.sh does; its imports need ray, tensordict and codetiming, nothing of it is copied here). Differences
that are intended are listed in docs/verl_keys.md with the reason."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

torch = pytest.importorskip("torch")
core = pytest.importorskip("verl.trainer.ppo.core_algos", reason="verl 0.9.1 (the verl-oracle extra)")
from verl.trainer.config import AlgoConfig  # noqa: E402
from verl.workers.config import ActorConfig  # noqa: E402

from jaxppo import ppo  # noqa: E402
from jaxppo.ppo.kl import KLControlConfig  # noqa: E402

TOL = 1e-6
SEEDS = range(6)


def batch(seed: int, b: int = 13, t: int = 9, holes: bool = False):
    """Random response masks (some rows empty, others full; `holes`: masked spans inside the response, as a
    multi-turn observation), outcome scores at each row's last valid token (ties on purpose), groups of 1..5."""
    rng = np.random.default_rng(seed)
    lengths = rng.integers(0, t + 1, b)
    lengths[0], lengths[1] = 0, t
    mask = (np.arange(t)[None, :] < lengths[:, None]).astype(np.float64)
    if holes:
        mask *= rng.random((b, t)) > 0.25
    scores = np.where(rng.random(b) < 0.6, rng.integers(0, 2, b), rng.normal(size=b)).astype(np.float64)
    rewards = np.zeros((b, t))
    for i in range(b):
        valid = np.flatnonzero(mask[i])
        if valid.size:
            rewards[i, valid[-1]] = scores[i]
    sizes, left = [], b
    while left:
        sizes.append(min(int(rng.integers(1, 6)), left))
        left -= sizes[-1]
    groups = rng.permutation(np.repeat(np.arange(len(sizes)), sizes))
    return rng, mask, rewards, groups


def close(a, b, what):
    a, b = np.asarray(a, np.float64), np.asarray(b.detach().numpy() if hasattr(b, "detach") else b, np.float64)
    assert a.shape == b.shape, (what, a.shape, b.shape)
    np.testing.assert_allclose(a, b, rtol=TOL, atol=TOL, err_msg=what)


def t64(x):
    return torch.tensor(np.asarray(x), dtype=torch.float64)


# ---------------------------------------------------------------- advantage estimators

OUTCOME = ["grpo", "rloo", "opo", "gpg", "reinforce_plus_plus_baseline"]


@pytest.mark.parametrize("name, norm", [(n, True) for n in OUTCOME + ["grpo_passk"]]
                         + [("grpo", False), ("grpo_passk", False)])  # the two that read norm_adv_by_std_in_grpo
def test_outcome_estimators_equal_verls(name, norm):
    for seed in SEEDS:
        rng, mask, rewards, groups = batch(seed)
        if name == "grpo_passk":  # verl refuses groups of one (jaxppo checks rollout.n >= 2 at start)
            groups = np.repeat(np.arange(len(groups) // 2 + 1), 2)[:len(groups)]
            groups[-1] = groups[-2]
        cfg = AlgoConfig(norm_adv_by_std_in_grpo=norm)
        want, want_ret = core.get_adv_estimator_fn(name)(
            token_level_rewards=t64(rewards), response_mask=t64(mask), index=groups.copy(), config=cfg,
            **({"norm_adv_by_std_in_grpo": norm} if name == "grpo" else {}))  # as ray_trainer passes it
        got, got_ret = ppo.compute_advantages(name, jnp.asarray(rewards), jnp.asarray(mask),
                                              group_ids=jnp.asarray(groups), norm_adv_by_std_in_grpo=norm)
        if name == "opo":  # a group whose responses are all empty: verl's baseline is 0 / 0 (NaN), jaxppo's 0
            want, want_ret = (torch.nan_to_num(x, nan=0.0) for x in (want, want_ret))
        close(got, want, f"{name} advantages, seed {seed}")
        close(got_ret, want_ret, f"{name} returns, seed {seed}")

@pytest.mark.parametrize("holes", [False, True])
def test_remax_equals_verls(holes):
    """ReMax: the return-to-go minus the greedy response's reward (per sequence), masked spans included."""
    for seed in SEEDS:
        rng, mask, rewards, _ = batch(seed, holes=holes)
        rewards = rewards + rng.normal(size=rewards.shape) * mask * 0.1  # rewards on every token, not only the last
        base = rng.normal(size=mask.shape[0])
        want, want_ret = core.get_adv_estimator_fn("remax")(token_level_rewards=t64(rewards), response_mask=t64(mask),
                                                            reward_baselines=t64(base))
        got, got_ret = ppo.compute_advantages("remax", jnp.asarray(rewards), jnp.asarray(mask),
                                              reward_baselines=jnp.asarray(base))
        close(got, want, f"remax advantages, seed {seed}")
        close(got_ret, want_ret, f"remax returns, seed {seed}")



@pytest.mark.parametrize("holes", [False, True])
def test_gae_and_reinforce_plus_plus_equal_verls(holes):
    for seed in SEEDS:
        rng, mask, _, _ = batch(seed, holes=holes)
        rewards = rng.normal(size=mask.shape) * mask
        values = rng.normal(size=mask.shape)
        gamma, lam = float(rng.uniform(0.8, 1.0)), float(rng.uniform(0.8, 1.0))
        adv, ret = core.compute_gae_advantage_return(t64(rewards), t64(values), t64(mask), gamma, lam)
        got_adv, got_ret = ppo.compute_advantages("gae", jnp.asarray(rewards), jnp.asarray(mask),
                                                  values=jnp.asarray(values), gamma=gamma, lam=lam)
        if not holes:  # with holes verl's returns keep values at masked positions; jaxppo zeroes them (unused)
            close(got_ret, ret * t64(mask), f"gae returns, seed {seed}")
        close(np.asarray(got_adv) * mask, adv * t64(mask), f"gae advantages, seed {seed}")
        adv, ret = core.get_adv_estimator_fn("reinforce_plus_plus")(
            token_level_rewards=t64(rewards), response_mask=t64(mask), config=AlgoConfig(gamma=gamma))
        got_adv, got_ret = ppo.compute_advantages("reinforce_plus_plus", jnp.asarray(rewards), jnp.asarray(mask),
                                                  gamma=gamma)
        close(got_adv, adv, f"reinforce++ advantages, seed {seed}")
        close(got_ret, ret, f"reinforce++ returns, seed {seed}")


# ---------------------------------------------------------------- losses, aggregated over micro-batches

MODES = ["token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm"]


def micro_batches(rng, b: int, k: int = 3) -> list[np.ndarray]:
    return np.array_split(rng.permutation(b), k)


def actor_config(rng, mode: str, policy: dict | None = None, **batch_info) -> ActorConfig:
    from verl.workers.config.actor import PolicyLossConfig

    cfg = ActorConfig(strategy="fsdp", ppo_micro_batch_size_per_gpu=1, rollout_n=1,
                      clip_ratio_low=float(rng.uniform(0.1, 0.3)), clip_ratio_high=float(rng.uniform(0.1, 0.4)),
                      clip_ratio_c=float(rng.uniform(2.0, 10.0)), loss_agg_mode=mode,
                      tau_pos=float(rng.uniform(0.8, 1.2)), tau_neg=float(rng.uniform(1.0, 1.5)),
                      policy_loss=PolicyLossConfig(**(policy or {})))
    cfg.global_batch_info.update(dp_size=1, **batch_info)
    return cfg


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("weights", [False, True])
def test_the_clipped_policy_loss_summed_over_micro_batches_equals_verls(mode, weights):
    """verl's engine workers (`verl.workers.utils.losses.ppo_loss`) normalise each micro-batch by the mini-batch's
    token and sequence counts (`batch_num_tokens`, `global_batch_size`) and sum; so does jaxppo."""
    for seed in SEEDS:
        rng, mask, _, _ = batch(seed)
        b, t = mask.shape
        old, new = rng.normal(-1.0, 0.5, (b, t)), rng.normal(-1.0, 0.5, (b, t))
        adv = rng.normal(size=(b, t))
        isw = rng.uniform(0.0, 2.0, (b, t)) if weights else None
        num_tokens, num_seqs = mask.sum(), (mask.sum(-1) > 0).sum()
        scale = None if seed % 2 else float(t + 3)  # verl's loss_scale_factor (seq-mean-token-sum-norm)
        cfg = actor_config(rng, mode, batch_num_tokens=num_tokens, global_batch_size=num_seqs,
                           loss_scale_factor=scale)
        want = got = 0.0
        for rows in micro_batches(rng, b):
            w_loss, _ = core.compute_policy_loss_vanilla(
                t64(old[rows]), t64(new[rows]), t64(adv[rows]), t64(mask[rows]), mode, cfg,
                None if isw is None else t64(isw[rows]))
            g_loss, _ = ppo.policy_loss(
                jnp.asarray(old[rows]), jnp.asarray(new[rows]), jnp.asarray(adv[rows]), jnp.asarray(mask[rows]),
                cfg.clip_ratio_low, cfg.clip_ratio_high, cfg.clip_ratio_c, mode,
                is_weights=None if isw is None else jnp.asarray(isw[rows]), num_tokens=num_tokens,
                num_seqs=num_seqs, horizon=scale)
            want, got = want + float(w_loss), got + float(g_loss)
        close(got, want, f"{mode} policy loss, seed {seed}")
        # the metrics of one micro-batch (verl averages them over micro-batches: see docs/verl_keys.md)
        cfg_local = actor_config(rng, mode)
        _, w_m = core.compute_policy_loss_vanilla(t64(old), t64(new), t64(adv), t64(mask), mode, cfg_local)
        _, g_m = ppo.policy_loss(jnp.asarray(old), jnp.asarray(new), jnp.asarray(adv), jnp.asarray(mask),
                                 cfg_local.clip_ratio_low, cfg_local.clip_ratio_high, cfg_local.clip_ratio_c, mode)
        for k in ("pg_clipfrac", "pg_clipfrac_lower", "ppo_kl"):
            close(g_m[k], w_m[f"actor/{k}"], f"{k}, seed {seed}")


@pytest.mark.parametrize("mode", MODES)
def test_agg_loss_and_the_value_loss_equal_verls(mode):
    for seed in SEEDS:
        rng, mask, _, _ = batch(seed)
        b, t = mask.shape
        loss_mat = rng.normal(size=(b, t))
        num_tokens, num_seqs = mask.sum(), (mask.sum(-1) > 0).sum()
        close(ppo.agg_loss(jnp.asarray(loss_mat), jnp.asarray(mask), mode),
              core.agg_loss(t64(loss_mat), t64(mask), mode), f"agg {mode}, seed {seed}")
        vpreds, values, returns = (rng.normal(size=(b, t)) for _ in range(3))
        clip = float(rng.uniform(0.1, 0.6))
        want = got = 0.0
        for rows in micro_batches(rng, b):
            w, _ = core.compute_value_loss(t64(vpreds[rows]), t64(returns[rows]), t64(values[rows]),
                                           t64(mask[rows]), clip, mode, batch_num_tokens=num_tokens,
                                           global_batch_size=num_seqs)
            g, _ = ppo.value_loss(jnp.asarray(vpreds[rows]), jnp.asarray(values[rows]), jnp.asarray(returns[rows]),
                                  jnp.asarray(mask[rows]), clip, mode, num_tokens=num_tokens, num_seqs=num_seqs)
            want, got = want + float(w), got + float(g)
        close(got, want, f"value loss {mode}, seed {seed}")


# ---------------------------------------------------------------- KL

@pytest.mark.parametrize("kind", ["kl", "k1", "abs", "mse", "k2", "low_var_kl", "k3"])
def test_kl_estimators_equal_verls(kind):
    rng = np.random.default_rng(0)
    logp, ref = rng.normal(-2.0, 1.5, (7, 11)), rng.normal(-2.0, 1.5, (7, 11))
    close(ppo.kl_penalty(jnp.asarray(logp), jnp.asarray(ref), kind), core.kl_penalty(t64(logp), t64(ref), kind), kind)


def test_the_adaptive_kl_controller_equals_verls():
    cfg = KLControlConfig(type="adaptive", kl_coef=0.05, target_kl=0.1, horizon=1000)
    verl_ctrl = core.AdaptiveKLController(init_kl_coef=0.05, target_kl=0.1, horizon=1000)
    coef = 0.05
    for kl, n in [(0.02, 64), (0.5, 128), (0.1, 32), (0.13, 256), (0.0, 64)]:
        verl_ctrl.update(kl, n)
        coef = float(ppo.update_kl_coef(cfg, coef, kl, n))
        assert abs(coef - verl_ctrl.value) <= TOL * abs(verl_ctrl.value), (kl, n)


# ---------------------------------------------------------------- the policy losses of 2025

def loss_inputs(seed: int, empty_rows: bool = True):
    rng, mask, _, _ = batch(seed)
    if not empty_rows:
        mask[mask.sum(-1) == 0, 0] = 1.0
    b, t = mask.shape
    old = rng.normal(-1.0, 0.5, (b, t))
    new = old + rng.normal(0.0, 0.3, (b, t))
    adv = np.repeat(rng.normal(size=(b, 1)), t, 1) if seed % 2 else rng.normal(size=(b, t))
    return rng, mask, old, new, adv


def jaxppo_actor(cfg: ActorConfig):
    """jaxppo's actor config with verl's settings."""
    from jaxppo.config import load_config

    p = cfg.policy_loss
    return load_config(None, [f"actor.clip_ratio_low={cfg.clip_ratio_low}", f"actor.clip_ratio_high={cfg.clip_ratio_high}",
                              f"actor.clip_ratio_c={cfg.clip_ratio_c}", f"actor.tau_pos={cfg.tau_pos}",
                              f"actor.tau_neg={cfg.tau_neg}", f"actor.policy_loss.loss_mode={p.loss_mode}",
                              f"actor.policy_loss.clip_cov_ratio={p.clip_cov_ratio}",
                              f"actor.policy_loss.clip_cov_lb={p.clip_cov_lb}",
                              f"actor.policy_loss.clip_cov_ub={p.clip_cov_ub}",
                              f"actor.policy_loss.kl_cov_ratio={p.kl_cov_ratio}",
                              f"actor.policy_loss.ppo_kl_coef={p.ppo_kl_coef}"]
                       + ([f"actor.policy_loss.dro_beta={p.dro_beta}"] if p.dro_beta else [])).actor


def loss_and_grad(name, cfg, old, new, adv, mask, mode, isw=None, segment=None, layout=None, **norm):
    """jaxppo's loss and its gradient with respect to the new log-probs."""
    import jax

    from jaxppo.ppo.policy_losses import compute_policy_loss

    def f(lp):
        return compute_policy_loss(name, jnp.asarray(old), lp, jnp.asarray(adv), jnp.asarray(mask), cfg, mode,
                                   is_weights=None if isw is None else jnp.asarray(isw), segment=segment, **norm)

    (loss, metrics), grad = jax.value_and_grad(f, has_aux=True)(jnp.asarray(new))
    return loss, metrics, grad


def verl_loss_and_grad(name, cfg, old, new, adv, mask, mode, isw=None):
    lp = t64(new).requires_grad_(True)
    loss, metrics = core.get_policy_loss_fn(name)(t64(old), lp, t64(adv), t64(mask), mode, cfg,
                                                  None if isw is None else t64(isw))
    loss.backward()
    return loss, metrics, lp.grad


NEW_LOSSES = ["gspo", "gpg", "cispo", "sapo", "geo_mean", "kl_cov", "clip_cov", "dro"]


@pytest.mark.parametrize("name", NEW_LOSSES)
@pytest.mark.parametrize("mode", ["token-mean", "seq-mean-token-mean"])
def test_the_policy_losses_of_2025_and_their_gradients_equal_verls(name, mode):
    """One micro-batch (verl's engine path with the mini-batch's counts): the loss, its gradient with respect to
    the log-probs and the metrics both log. geo_mean averages over sequences, so rows are never empty here (verl
    counts an empty row in its mean: docs/verl_keys.md); clip_cov drops every eligible token (verl draws
    `clip_cov_ratio` of the tokens at random among them, jaxppo takes those of the largest covariance)."""
    for seed in SEEDS:
        rng, mask, old, new, adv = loss_inputs(seed, empty_rows=name != "geo_mean")
        isw = rng.uniform(0.2, 2.0, mask.shape) if seed % 3 == 0 else None
        num_tokens, num_seqs = mask.sum(), (mask.sum(-1) > 0).sum()
        policy = dict(loss_mode=name, clip_cov_ratio=0.9, clip_cov_lb=-0.5, clip_cov_ub=0.5, kl_cov_ratio=0.2,
                      dro_beta=0.3)
        cfg = actor_config(rng, mode, policy, batch_num_tokens=num_tokens, global_batch_size=num_seqs)
        w_loss, w_m, w_grad = verl_loss_and_grad(name, cfg, old, new, adv, mask, mode, isw)
        g_loss, g_m, g_grad = loss_and_grad(name, jaxppo_actor(cfg), old, new, adv, mask, mode, isw,
                                            num_tokens=num_tokens, num_seqs=num_seqs)
        close(g_loss, w_loss, f"{name} {mode} loss, seed {seed}")
        close(np.asarray(g_grad) * mask, w_grad * t64(mask), f"{name} {mode} gradient, seed {seed}")
        for k in ("pg_clipfrac", "pg_clipfrac_lower", "ppo_kl"):
            if f"actor/{k}" in w_m:
                close(g_m[k], w_m[f"actor/{k}"], f"{name} {k}, seed {seed}")


@pytest.mark.parametrize("name", ["gspo", "geo_mean", "vanilla", "sapo"])
def test_a_sequence_level_loss_is_the_same_on_packed_rows(name):
    """Packed rows hold several sequences: `segment` finds each token's sequence, so a loss computed on the packed
    layout equals the padded one (the sequences' tokens laid side by side in one row)."""
    from jaxppo.config import load_config

    cfg = load_config(None, [f"actor.policy_loss.loss_mode={name}"]).actor
    for seed in SEEDS:
        rng, mask, old, new, adv = loss_inputs(seed, empty_rows=False)
        lengths = mask.sum(-1).astype(int)
        pack = lambda x: np.concatenate([x[i, :lengths[i]] for i in range(len(x))])[None, :]  # noqa: E731
        segment = np.concatenate([np.full(n, i + 1) for i, n in enumerate(lengths)])[None, :]
        weight = pack(mask / lengths[:, None])
        num_tokens, num_seqs = mask.sum(), float(len(lengths))
        mode = "seq-mean-token-mean"
        padded = loss_and_grad(name, cfg, old, new, adv, mask, mode, num_tokens=num_tokens, num_seqs=num_seqs)
        packed = loss_and_grad(name, cfg, pack(old), pack(new), pack(adv), pack(mask), mode,
                               segment=jnp.asarray(segment), num_tokens=num_tokens, num_seqs=num_seqs,
                               token_weight=jnp.asarray(weight))
        close(packed[0], padded[0], f"{name} packed loss, seed {seed}")
        close(packed[2], pack(np.asarray(padded[2])), f"{name} packed gradient, seed {seed}")


def test_an_unknown_policy_loss_exits_2_listing_the_known_ones(tmp_path, capsys):
    from jaxppo.train import main

    rc = main([f"trainer.default_local_dir={tmp_path / 'run'}", "actor.policy_loss.loss_mode=grpo_plus"])
    err = capsys.readouterr().err
    assert rc == 2 and "'grpo_plus' unknown" in err and "gspo" in err and "cispo" in err, err
    assert not (tmp_path / "run").exists()


# ---------------------------------------------------------------- rollout correction

RC_CASES = [dict(rollout_is="token", rollout_is_threshold="2.0"),
            dict(rollout_is="sequence", rollout_is_threshold="3.0", rollout_is_batch_normalize=True),
            dict(rollout_is="token", rollout_is_threshold="0.5_1.8", rollout_is_batch_normalize=True),
            dict(rollout_rs="token_k1", rollout_rs_threshold="0.7_1.4"),
            dict(rollout_rs="token_k2,token_k3", rollout_rs_threshold="0.05"),
            dict(rollout_rs="seq_mean_k1,seq_sum_k2,seq_max_k3", rollout_rs_threshold="0.8_1.25,0.3,0.08"),
            dict(rollout_is="sequence", rollout_is_threshold="5.0", rollout_rs="seq_mean_k3,seq_sum_k1",
                 rollout_rs_threshold="0.02,2.0")]


@pytest.mark.parametrize("case", RC_CASES, ids=lambda c: "+".join(f"{k}={v}" for k, v in c.items()))
def test_rollout_correction_weights_mask_and_metrics_equal_verls(case):
    from verl.trainer.ppo.rollout_corr_helper import compute_rollout_correction_and_rejection_mask

    from jaxppo.config import load_config
    from jaxppo.ppo.rollout_correction import rollout_correction

    rc = load_config(None, [f"algorithm.rollout_correction.{k}={v}" for k, v in case.items()]).algorithm.rollout_correction
    for seed in SEEDS:
        rng, mask, _, _ = batch(seed, holes=seed % 2 == 1)
        old = rng.normal(-1.5, 0.6, mask.shape)
        rollout = old + rng.normal(0.0, 0.25, mask.shape)
        w_proto, w_mask, w_m = compute_rollout_correction_and_rejection_mask(
            t64(old), t64(rollout), t64(mask), rollout_is=case.get("rollout_is"),
            rollout_is_threshold=case.get("rollout_is_threshold", 2.0),
            rollout_is_batch_normalize=case.get("rollout_is_batch_normalize", False),
            rollout_rs=case.get("rollout_rs"), rollout_rs_threshold=case.get("rollout_rs_threshold"))
        g_w, g_mask, g_m = rollout_correction(old, rollout, mask, rc)
        assert (g_w is None) == (w_proto is None)
        if g_w is not None:
            close(g_w, w_proto.batch["rollout_is_weights"], f"weights {case}, seed {seed}")
        close(g_mask, w_mask, f"mask {case}, seed {seed}")
        assert set(g_m) == set(w_m), (sorted(set(g_m) - set(w_m)), sorted(set(w_m) - set(g_m)))  # verl's names
        for k, v in g_m.items():
            close(v, w_m[k], f"{k} {case}, seed {seed}")


def test_an_unknown_rejection_option_exits_2_listing_the_known_ones(tmp_path, capsys):
    from jaxppo.train import main

    rc = main([f"trainer.default_local_dir={tmp_path / 'run'}", "algorithm.rollout_correction.rollout_rs=token_k4",
               "algorithm.rollout_correction.rollout_rs_threshold=2.0"])
    err = capsys.readouterr().err
    assert rc == 2 and "token_k4" in err and "seq_mean_k1" in err, err


@pytest.mark.parametrize("seed", range(3))
def test_validation_metrics_with_numeric_answers_equal_verls(seed):
    """verl's own `process_validation_metrics` on answers given as numbers: 1, 1.0 and True are one answer in its
    vote (a dict's keys); best / worst / maj@k from the same bootstrap draws (a numeric `pred` is also summarised
    as a variable, in both)."""
    from verl.trainer.ppo.metric_utils import process_validation_metrics as verls

    from jaxppo.validation import process_validation_metrics

    rng = np.random.default_rng(seed)
    n, prompts = 6, 5
    answers = [1, 1.0, True, 2, 2.0, 3]
    preds = [answers[i] for i in rng.integers(0, len(answers), n * prompts)]
    scores = [float(p == 1) + 0.1 * float(rng.integers(0, 3)) for p in preds]
    sources = ["a"] * (n * 3) + ["b"] * (n * 2)
    uids = [f"u{i // n}" for i in range(n * prompts)]
    infos = {"score": scores, "pred": preds}
    ours, ref = process_validation_metrics(sources, uids, infos), verls(sources, uids, infos)
    assert set(ours) == set(ref)
    for src in ref:
        for var in ref[src]:
            for name, value in ref[src][var].items():
                assert ours[src][var][name] == pytest.approx(value, abs=1e-12), (src, var, name)


# responses for DAPO's math rule: "Answer:" lines (case, spacing, units, TeX shorthand, thousands separators,
# equations), the \boxed{} fallback (exact, within the last 100 characters), neither, and answers past 300 characters
DAPO_CASES = [
    ("so the total is 12.\nAnswer: 12", "12"), ("answer : $1,234$ dollars", "1234"), ("ANSWER: x = \\frac12", "\\frac{1}{2}"),
    ("Answer: \\sqrt2 units", "\\sqrt{2}"), ("Answer: 5 degrees\nAnswer: 7", "7"), ("Answer: 5 degrees\nAnswer: 7", "5"),
    ("Answer: \\text{(B)}", "(B)"), ("Answer: 3^\\circ", "3"), ("the result is \\boxed{42}", "42"),
    ("the result is \\boxed{42}", "42.0"), ("\\boxed{\\frac{1}{2}} and more text", "\\frac{1}{2}"),
    ("no final answer at all", "3"), ("", "[INVALID]"), ("Answer: " + "9" * 5 + "\n" + "x" * 400, "99999"),
    ("x" * 400 + "Answer: 10 meters", "10"), ("Answer: an integer 4", "4"), ("Answer: $\\boxed{16}$.", "16"),
    ("Answer: 2,5", "2,5"), ("Answer: \\overline{AB}", "AB"), ("\\boxed{7}" + "y" * 120, "7"),
]


@pytest.mark.parametrize("case", range(len(DAPO_CASES)))
def test_dapos_math_rule_equals_verls(case):
    """jaxppo's port of DAPO's "Answer:" rule against verl's `math_dapo.compute_score`: score, acc and pred; and
    the routing of verl's default_compute_score (math_dapo, math, aime*) reaches it."""
    from verl.utils.reward_score import math_dapo as verls

    from jaxppo.rewards.math_dapo import compute_score
    from jaxppo.rewards.registry import get_answer_extractor, get_reward_fn

    response, truth = DAPO_CASES[case]
    ref = verls.compute_score(response, truth)
    ours = compute_score(response, truth)
    assert (ours["score"], bool(ours["acc"]), ours["pred"]) == (ref["score"], bool(ref["acc"]), ref["pred"])
    for source in ("math_dapo", "math", "math_dapo_reasoning", "aime2024", "aime25"):
        assert get_reward_fn(source)(response, truth, {}) == ours
        assert get_answer_extractor(source)(response) == ref["pred"]


# ---------------------------------------------------------------- bypass mode (the correction in the loss)

BYPASS_CASES = [dict(loss_type="ppo_clip"), dict(loss_type="reinforce"),
                dict(loss_type="reinforce", rollout_is="sequence", rollout_is_threshold="2.0"),
                dict(loss_type="reinforce", rollout_is="token", rollout_is_threshold="0.5_2.0"),
                dict(loss_type="ppo_clip", rollout_rs="seq_mean_k1", rollout_rs_threshold="0.9_1.1"),
                dict(loss_type="ppo_clip", rollout_rs="seq_mean_k3", rollout_rs_threshold="0.01"),
                dict(loss_type="reinforce", rollout_rs="token_k1,seq_max_k2", rollout_rs_threshold="0.5_2.0,0.2"),
                dict(loss_type="reinforce", rollout_is="token", rollout_is_threshold="2.0", rollout_rs="seq_sum_k1",
                     rollout_rs_threshold="0.3_3.0")]


@pytest.mark.parametrize("case", range(len(BYPASS_CASES)))
@pytest.mark.parametrize("mode", ["token-mean", "seq-mean-token-mean"])
def test_bypass_mode_loss_and_gradient_equal_verls(case, mode):
    """jaxppo's bypass loss (`jaxppo/ppo/bypass.py`) against verl's `compute_policy_loss_bypass_mode` on one
    micro-batch with the mini-batch's counts: the loss and its gradient with respect to the current log-probs."""
    import jax

    from jaxppo.config import load_config
    from jaxppo.ppo.bypass import bypass_policy_loss

    spec = BYPASS_CASES[case]
    for seed in SEEDS:
        rng, mask, rollout, new, adv = loss_inputs(seed)
        num_tokens, num_seqs = mask.sum(), (mask.sum(-1) > 0).sum()
        cfg = actor_config(rng, mode, batch_num_tokens=num_tokens, global_batch_size=num_seqs)
        verl_rc = {"rollout_is": None, "rollout_is_threshold": 2.0, "rollout_rs": None, "rollout_rs_threshold": None,
                   "rollout_is_batch_normalize": False, **spec}
        object.__setattr__(cfg, "policy_loss", {"rollout_correction": verl_rc, "loss_mode": "bypass_mode"})
        lp = t64(new).requires_grad_(True)
        w_loss, _ = core.compute_policy_loss_bypass_mode(t64(rollout), lp, t64(adv), t64(mask), mode, cfg)
        w_loss.backward()
        ours = load_config(None, [f"actor.clip_ratio_low={cfg.clip_ratio_low}",
                                  f"actor.clip_ratio_high={cfg.clip_ratio_high}", f"actor.clip_ratio_c={cfg.clip_ratio_c}",
                                  "algorithm.rollout_correction.bypass_mode=true"]
                           + [f"algorithm.rollout_correction.{k}={v}" for k, v in spec.items()])
        rc = ours.algorithm.rollout_correction

        def f(x):
            return bypass_policy_loss(rc, jnp.asarray(rollout), x, jnp.asarray(adv), jnp.asarray(mask), ours.actor, mode,
                                      num_tokens=num_tokens, num_seqs=num_seqs)[0]

        g_loss, g_grad = jax.value_and_grad(f)(jnp.asarray(new))
        close(g_loss, w_loss, f"{spec} {mode} loss, seed {seed}")
        close(np.asarray(g_grad) * mask, lp.grad * t64(mask), f"{spec} {mode} gradient, seed {seed}")


@pytest.mark.parametrize("case", [2, 4, 6, 7])  # the sequence-level weights and rejections
def test_bypass_mode_is_the_same_on_packed_rows(case):
    """Packed rows (several sequences a row, `segment`): the in-loss weights and rejections find each token's
    sequence, so the loss equals the padded layout's."""
    import jax

    from jaxppo.config import load_config
    from jaxppo.ppo.bypass import bypass_policy_loss

    spec = BYPASS_CASES[case]
    cfg = load_config(None, ["algorithm.rollout_correction.bypass_mode=true"]
                      + [f"algorithm.rollout_correction.{k}={v}" for k, v in spec.items()])
    rc = cfg.algorithm.rollout_correction
    for seed in SEEDS:
        rng, mask, rollout, new, adv = loss_inputs(seed, empty_rows=False)
        lengths = mask.sum(-1).astype(int)
        pack = lambda x: np.concatenate([x[i, :lengths[i]] for i in range(len(x))])[None, :]  # noqa: E731
        segment = np.concatenate([np.full(n, i + 1) for i, n in enumerate(lengths)])[None, :]
        norm = dict(num_tokens=mask.sum(), num_seqs=float(len(lengths)))

        def loss(lr, lp, a, m, seg=None):
            return jax.value_and_grad(lambda x: bypass_policy_loss(rc, jnp.asarray(lr), x, jnp.asarray(a),
                                                                   jnp.asarray(m), cfg.actor, segment=seg,
                                                                   **norm)[0])(jnp.asarray(lp))

        padded = loss(rollout, new, adv, mask)
        packed = loss(pack(rollout), pack(new), pack(adv), pack(mask), jnp.asarray(segment))
        close(packed[0], padded[0], f"{spec} packed loss, seed {seed}")
        close(packed[1], pack(np.asarray(padded[1])), f"{spec} packed gradient, seed {seed}")
