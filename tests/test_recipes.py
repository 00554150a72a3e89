"""The recipe configs (GRPO, DAPO, Dr.GRPO, GSPO): what defines each method is in its YAML, each runs end to end on
the embedded default's task, and DAPO's dynamic sampling refills the batch through the trainer."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from jaxppo.config import Config, load_config
from tests.train_helpers import ON_EMBEDDED_TASK, ROOT, read_metrics, run_train

CONFIGS = ROOT / "configs"
RECIPES = {"grpo": "gsm8k_grpo_qwen2.5_0.5b.yaml", "dapo": "gsm8k_dapo_qwen2.5_0.5b.yaml",
           "drgrpo": "gsm8k_drgrpo_qwen2.5_0.5b.yaml", "gspo": "gsm8k_gspo_qwen2.5_0.5b.yaml"}


def recipe(name: str, *overrides: str) -> Config:
    return load_config(CONFIGS / RECIPES[name], overrides)


@pytest.mark.parametrize("path", sorted(CONFIGS.glob("*.yaml")), ids=lambda p: p.name)
def test_every_committed_config_loads(path):
    load_config(path)  # types, closed sets and size relations (devices and paths are checked at start)


def test_each_recipe_sets_what_defines_its_method():
    grpo, dapo, dr, gspo = recipe("grpo"), recipe("dapo"), recipe("drgrpo"), recipe("gspo")
    for cfg in (grpo, dapo, dr, gspo):  # group baselines, no critic, no KL in the reward
        assert cfg.algorithm.adv_estimator == "grpo" and cfg.rollout.n >= 4 and not cfg.algorithm.use_kl_in_reward
    # GRPO (DeepSeekMath): std-normalised group advantages, KL to the reference as a loss
    assert grpo.algorithm.norm_adv_by_std_in_grpo and grpo.actor.use_kl_loss and grpo.actor.kl_loss_type == "low_var_kl"
    # DAPO: clip-higher, token-mean, no KL, dynamic sampling, overlong shaping
    a = dapo.actor
    assert (a.clip_ratio_low, a.clip_ratio_high, a.loss_agg_mode, a.use_kl_loss) == (0.2, 0.28, "token-mean", False)
    fg, ob = dapo.algorithm.filter_groups, dapo.reward.overlong_buffer
    assert fg.enable and fg.max_num_gen_batches > 0 and dapo.data.gen_batch_size > dapo.data.train_batch_size
    assert ob.enable and 0 < ob.len < dapo.data.max_response_length and ob.penalty_factor == 1.0
    # Dr. GRPO: no std normalisation, the token sum over a constant
    assert not dr.algorithm.norm_adv_by_std_in_grpo and dr.actor.loss_agg_mode == "seq-mean-token-sum-norm"
    assert not dr.actor.use_kl_loss
    # GSPO: the sequence-level ratio with verl's recipe's narrow clip, the loss averaged per sequence, no KL
    g = gspo.actor
    assert (g.policy_loss.loss_mode, g.clip_ratio_low, g.clip_ratio_high, g.loss_agg_mode, g.use_kl_loss) == (
        "gspo", 0.0003, 0.0004, "seq-mean-token-mean", False)
    for cfg in (grpo, dapo, dr):
        assert cfg.actor.policy_loss.loss_mode == "vanilla"


def test_the_grpo_recipes_differ_in_the_model_only():
    small = dataclasses.asdict(recipe("grpo"))
    large = dataclasses.asdict(load_config(CONFIGS / "gsm8k_grpo_qwen2.5_1.5b.yaml"))
    assert large["model"].pop("path").endswith("1.5B-Instruct") and small["model"].pop("path").endswith("0.5B-Instruct")
    for cfg in (small, large):
        cfg["trainer"].pop("default_local_dir")
    assert small == large


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(RECIPES))
def test_recipe_runs_three_steps_on_the_embedded_task(name, tmp_path):
    # DAPO: the tiny model's answers all score 0 this early, so each round drops every group; two rounds a step,
    # then the batch is filled (the refill itself is the next test's)
    extra = (["data.gen_batch_size=16", "reward.overlong_buffer.len=4", "algorithm.filter_groups.max_num_gen_batches=2"]
             if name == "dapo" else [])
    run_train(tmp_path / "run", *ON_EMBEDDED_TASK, "trainer.total_training_steps=3", *extra,
              config=CONFIGS / RECIPES[name])
    m = read_metrics(tmp_path / "run")
    assert sorted(m) == [0, 1, 2, 3] and "val/score" in m[3]
    for step in (1, 2, 3):
        assert np.isfinite(m[step]["actor/pg_loss"]) and not any(k.startswith("critic/vf") for k in m[step])
        assert ("actor/kl_loss" in m[step]) == (name == "grpo")
    if name == "dapo":
        assert 1 <= m[3]["batch/num_gen_batches"] <= 2 and "reward/extra/overlong/mean" in m[3]


@pytest.mark.slow
def test_dynamic_sampling_refills_the_batch_through_the_trainer(tmp_path, monkeypatch):
    """A reward of the text's CRC parity with two samples per prompt: about half the groups agree (no signal) and
    are dropped; the trainer draws further rounds until the batch is full of groups with signal."""
    from jaxppo import step as ppo_step
    from jaxppo.train import make_engine_factory
    from jaxppo.trainer import PPOTrainer

    cfg = recipe("dapo", *ON_EMBEDDED_TASK, "data.gen_batch_size=8", "reward.overlong_buffer.len=4", "rollout.n=2",
                 "trainer.total_training_steps=2", "trainer.val_before_train=false", "trainer.test_freq=-1",
                 f"custom_reward_function.path={ROOT / 'tests' / 'rewards' / 'user_reward.py'}",
                 "custom_reward_function.name=digest", f"trainer.default_local_dir={tmp_path / 'run'}")
    seen = []
    inner = ppo_step.update

    def spy(ctx, state, exp, step, timer, **kw):
        seen.append((exp.batch["input_ids"].shape[0], exp.metrics))
        return inner(ctx, state, exp, step, timer, **kw)

    monkeypatch.setattr(ppo_step, "update", spy)
    trainer = PPOTrainer(cfg, make_engine_factory(cfg))
    trainer.fit()
    assert len(seen) == 2
    for rows, m in seen:
        assert rows == cfg.data.train_batch_size * cfg.rollout.n  # the batch is full
        assert m["batch/num_gen_batches"] >= 2 and m["batch/dropped_groups"] > 0 and m["batch/filled_groups"] == 0
        assert m["batch/generated_groups"] == 8 * m["batch/num_gen_batches"]
        # every group kept has signal: the two samples of each prompt disagree
        assert m["critic/score/mean"] == pytest.approx(0.5 + m["reward/extra/overlong_reward/mean"], abs=1e-6)
    # the sampler moved past every round it drew (the next step starts on fresh prompts)
    assert trainer.sampler.state()["index"] == sum(8 * m["batch/num_gen_batches"] for _, m in seen)
