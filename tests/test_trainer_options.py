"""Trainer options through real (tiny, in-process) runs: critic-free estimators with resume, truncated IS,
critic warm-up, several PPO epochs, early stopping on a metric to minimise, checkpoint retention, the
rollout engine kept awake, a reward model as (or added to) the reward, a reward function that hangs, and
the reference weights stored in the compute dtype."""

from __future__ import annotations

import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxppo import step as ppo_step
from jaxppo.trainer import PPOTrainer
from tests.helpers import make_hf_checkpoint
from tests.test_operability import host, make_trainer, same
from jaxppo.config import load_config
from tests.train_helpers import FAST, ROOT, read_metrics

pytestmark = pytest.mark.slow


@pytest.mark.parametrize("estimator", ["grpo", "rloo", "reinforce_plus_plus"])
def test_critic_free_estimators_train_and_resume(estimator, tmp_path):
    args = (f"algorithm.adv_estimator={estimator}", "trainer.save_freq=1")
    tr = make_trainer(tmp_path, "trainer.total_training_steps=2", *args)
    assert tr.critic is None and tr.state.critic is None
    before = host(tr.actor_state.params)
    tr.fit()
    m = read_metrics(tmp_path / "run")
    assert sorted(m) == [1, 2]
    assert "actor/pg_loss" in m[2] and not any(k.startswith(("critic/vf_loss", "critic/values")) for k in m[2])
    assert not same(before, host(tr.actor_state.params))
    resumed = make_trainer(tmp_path, "trainer.total_training_steps=3", *args)
    assert resumed.step == 2 and same(host(resumed.actor_state.params), host(tr.actor_state.params))
    resumed.fit()
    assert sorted(read_metrics(tmp_path / "run")) == [1, 2, 3] and resumed.step == 3


def test_truncated_is_weights_reach_the_actor_batch(tmp_path, monkeypatch):
    seen = []
    inner = ppo_step.update

    def spy(ctx, state, exp, step, timer, **kw):
        seen.append((exp.batch.get("is_weights"), exp.batch["response_mask"]))
        return inner(ctx, state, exp, step, timer, **kw)

    monkeypatch.setattr(ppo_step, "update", spy)
    tr = make_trainer(tmp_path, "trainer.total_training_steps=1", "actor.tis_threshold=1.5")
    tr.fit()
    w, rmask = seen[0]
    valid = rmask > 0
    assert w is not None and w.shape == rmask.shape
    assert np.all(w[valid] > 0) and np.all(w[valid] <= 1.5 + 1e-6) and np.all(w[~valid] == 0)


def test_critic_warmup_updates_only_the_critic_first(tmp_path):
    tr = make_trainer(tmp_path, "trainer.total_training_steps=2", "trainer.critic_warmup=1")
    before = host(tr.actor_state.params)
    snapshots = []
    step = tr.train_step
    tr.train_step = lambda: (snapshots.append(host(tr.actor_state.params)), step())[1]
    tr.fit()
    m = read_metrics(tmp_path / "run")
    assert "critic/vf_loss" in m[1] and "actor/pg_loss" not in m[1]
    assert "critic/vf_loss" in m[2] and "actor/pg_loss" in m[2]
    assert same(before, snapshots[1])  # step 1 left the actor alone
    assert int(tr.actor_state.step) == 2  # optimizer steps: step 2's two mini-batches only


def test_ppo_epochs_repeat_the_mini_batches(tmp_path):
    tr = make_trainer(tmp_path, "trainer.total_training_steps=1", "actor.ppo_epochs=2", "critic.ppo_epochs=3")
    tr.fit()
    assert int(tr.actor_state.step) == 2 * 2 and int(tr.critic_state.step) == 3 * 2  # epochs x mini-batches


def test_early_stopping_on_a_metric_to_minimise(tmp_path):
    values = iter([0.5, 0.4, 0.45, 0.6, 0.7, 0.8])  # best 0.4 at step 1, worse after it

    class Rising(PPOTrainer):
        def validate(self):
            return {"val/loss": next(values)}

    tr = make_trainer(tmp_path, "trainer.total_training_steps=10", "trainer.test_freq=1", "trainer.val_before_train=true",
                      "trainer.early_stop_patience=2", "trainer.early_stop_metric=val/loss", "trainer.early_stop_mode=min",
                      cls=Rising)
    tr.fit()
    assert tr.best_val == pytest.approx(0.4) and tr.step == 3 and tr.stop_reason.startswith("early stop")


def test_max_to_keep_retains_the_newest_checkpoints(tmp_path):
    tr = make_trainer(tmp_path, "trainer.total_training_steps=3", "trainer.save_freq=1", "trainer.max_to_keep=1")
    tr.fit()
    kept = sorted(int(p.name) for p in (tmp_path / "run" / "checkpoints").iterdir() if p.name.isdigit())
    assert kept == [3]


@pytest.mark.parametrize("free", [True, False])
def test_free_cache_engine_decides_whether_the_engine_sleeps(free, tmp_path):
    tr = make_trainer(tmp_path, "trainer.total_training_steps=2", f"rollout.free_cache_engine={str(free).lower()}")
    calls = {"sleep": 0, "wake": 0}
    for name in calls:
        inner = getattr(tr.engine, name)
        setattr(tr.engine, name, lambda inner=inner, name=name: (calls.__setitem__(name, calls[name] + 1), inner())[1])
    tr.fit()
    assert calls["wake"] >= 2  # every generation wakes the engine
    assert (calls["sleep"] >= 2) if free else (calls["sleep"] == 0)


@pytest.mark.parametrize("combine", ["replace", "add"])
def test_a_reward_model_scores_through_the_trainer(combine, tmp_path, tokenizer_dir, monkeypatch):
    from jaxppo.data import load_tokenizer
    from jaxppo.rewards.model import RewardModel

    vocab = len(load_tokenizer(tokenizer_dir))
    rm_dir = make_hf_checkpoint(tmp_path / "rm", "qwen2", head="score", vocab_size=vocab, seed=4)
    rule_scores = []
    inner = ppo_step.score_batch

    def rule_spy(*a, **k):
        res = inner(*a, **k)
        rule_scores.append(res.scores.copy())
        return res

    monkeypatch.setattr(ppo_step, "score_batch", rule_spy)
    model_scores = []
    score = RewardModel.score
    monkeypatch.setattr(RewardModel, "score", lambda self, ids, mask: model_scores.append(
        np.asarray(score(self, ids, mask))) or model_scores[-1])
    tr = make_trainer(tmp_path, "trainer.total_training_steps=1", f"data.tokenizer={tokenizer_dir}",
                      f"model.reward_model_path={rm_dir}", f"reward.reward_model_combine={combine}",
                      "trainer.val_before_train=false", "trainer.test_freq=-1")
    tr.fit()
    m = read_metrics(tmp_path / "run")[1]
    rm = model_scores[0]
    expected = rm if combine == "replace" else rm + rule_scores[0]
    assert (len(rule_scores) == 0) if combine == "replace" else (len(rule_scores) == 1)
    assert m["critic/score/mean"] == pytest.approx(float(np.mean(expected)), rel=1e-5, abs=1e-6)
    assert m["reward/model_score/mean"] == pytest.approx(float(np.mean(rm)), rel=1e-5, abs=1e-6)
    assert np.std(rm) > 0  # a real model's scores, not a constant


def test_a_hanging_reward_function_is_cut_off_and_counted(tmp_path, monkeypatch):
    from jaxppo.rewards import registry

    real = registry.get_reward_fn("synthetic/arithmetic")

    def sometimes_hangs(solution, ground_truth, extra_info):
        if len(solution) % 3 == 0:
            time.sleep(10**6)
        return real(solution, ground_truth, extra_info)

    monkeypatch.setattr(registry, "get_reward_fn", lambda *a: sometimes_hangs)
    # in the trainer's process (its SIGALRM timer): the worker processes' limits are tests/rewards/test_workers.py's
    tr = make_trainer(tmp_path, "trainer.total_training_steps=1", "reward.timeout_s=0.2", "trainer.val_before_train=false",
                      "trainer.test_freq=-1", "reward.num_workers=0")
    t0 = time.monotonic()
    tr.fit()
    m = read_metrics(tmp_path / "run")[1]
    assert m["reward/timeouts"] >= 1 and m["reward/errors"] >= m["reward/timeouts"]
    assert time.monotonic() - t0 < 120 and "actor/pg_loss" in m


def test_reference_weights_in_the_compute_dtype_give_identical_log_probs(tmp_path):
    tr = make_trainer(tmp_path, "trainer.total_training_steps=1", "model.dtype=bfloat16", "actor.use_kl_loss=true",
                      "trainer.sft_warmup_steps=0")
    ref = tr.state.ref_params
    assert all(x.dtype == jnp.bfloat16 for x in jax.tree.leaves(ref))
    fp32_copy = jax.tree.map(lambda p: jnp.array(p, copy=True), tr.actor_state.params)  # what it used to be
    assert all(x.dtype == jnp.float32 for x in jax.tree.leaves(fp32_copy))
    rng = np.random.default_rng(0)
    b, p, r = 16, tr.P, tr.R
    ids = rng.integers(1, tr.model_cfg.vocab_size, (b, p + r)).astype(np.int32)
    mask = np.ones((b, p + r), np.int32)
    mask[:, : p // 2] = 0
    batch = {"input_ids": ids * mask, "attention_mask": mask, "positions": np.maximum(np.cumsum(mask, 1) - 1, 0)
             .astype(np.int32), "response_mask": np.ones((b, r), np.float32)}
    dev = tr.actor.shard_batch(batch)
    lp_bf16 = np.asarray(tr.actor.logprobs(ref, dev)[0])
    lp_fp32 = np.asarray(tr.actor.logprobs(fp32_copy, dev)[0])
    np.testing.assert_array_equal(lp_bf16, lp_fp32)  # bit-identical: the forward casts to bf16 either way


def test_wandb_receives_the_resolved_config(tmp_path, monkeypatch):
    import sys
    import types

    calls = {}

    class Run:
        def log(self, metrics, step):
            calls.setdefault("logged", []).append(step)

        def finish(self):
            calls["finished"] = True

    fake = types.ModuleType("wandb")
    fake.init = lambda **kw: (calls.__setitem__("init", kw), Run())[1]
    monkeypatch.setitem(sys.modules, "wandb", fake)
    tr = make_trainer(tmp_path, "trainer.total_training_steps=1", "trainer.logger=[wandb]", "actor.optim.lr=0.00042")
    tr.fit()
    config = calls["init"]["config"]
    assert config["actor"]["optim"]["lr"] == pytest.approx(0.00042)
    assert config["trainer"]["total_training_steps"] == 1 and config["rollout"]["n"] == 2
    assert calls["logged"] and calls["finished"]


def test_close_gives_the_trainer_back_to_the_garbage_collector(tmp_path):
    """Setup freezes its objects out of the collector; `close()` unfreezes them, so a trainer dropped in a
    process that goes on (tests, notebooks) is collected, cycles and all."""
    import gc
    import weakref

    gc.unfreeze()
    with make_trainer(tmp_path, "trainer.total_training_steps=1") as tr:
        assert gc.get_freeze_count() > 0
        ref = weakref.ref(tr)
    assert gc.get_freeze_count() == 0
    del tr
    gc.collect()
    assert ref() is None


def test_wandb_receives_the_resolved_config_in_val_only(tmp_path, monkeypatch):
    import sys
    import types

    from jaxppo.config import load_config
    from jaxppo.train import make_engine_factory
    from jaxppo.validation import validate_only
    from tests.test_operability import MESH8
    from tests.train_helpers import FAST, ROOT

    import importlib.machinery

    calls = {}
    fake = types.ModuleType("wandb")
    fake.__spec__ = importlib.machinery.ModuleSpec("wandb", None)  # transformers asks whether wandb is installed
    fake.init = lambda **kw: (calls.__setitem__("init", kw),
                              types.SimpleNamespace(log=lambda m, step: None, finish=lambda: None))[1]
    monkeypatch.setitem(sys.modules, "wandb", fake)
    cfg = load_config(ROOT / "configs" / "default.yaml",
                      [*FAST, *MESH8, f"trainer.default_local_dir={tmp_path / 'run'}", "trainer.val_only=true",
                       "trainer.logger=[wandb]", "actor.optim.lr=0.00042"])
    validate_only(cfg, make_engine_factory(cfg))
    config = calls["init"]["config"]
    assert config["actor"]["optim"]["lr"] == pytest.approx(0.00042) and config["trainer"]["val_only"] is True


@pytest.mark.parametrize("extra", [[], ["algorithm.rollout_correction.loss_type=reinforce",
                                         "algorithm.rollout_correction.rollout_is=sequence",
                                         "algorithm.rollout_correction.rollout_rs=seq_mean_k1",
                                         "algorithm.rollout_correction.rollout_rs_threshold=0.5_2.0"]],
                         ids=["ppo_clip", "reinforce_is_rs"])
def test_bypass_mode_trains_on_the_engines_log_probs_without_recomputing_them(extra, tmp_path, one_device,
                                                                              monkeypatch):
    """verl's bypass mode (`algorithm.rollout_correction.bypass_mode`; verl's bypass_ppo_clip and bypass_pg_*
    presets): the actor's update gets the rollout engine's log-probs as the old policy's, the trainer's forward
    pass for them never runs (no reference here, so the actor's forward program is not called at all during the
    steps), and the weights and rejection are left to the loss (none in the update batch)."""
    from bridge.engines.hf import HFEngine
    from jaxppo.engine import ActorEngine
    from jaxppo.train import make_engine_factory
    from jaxppo.trainer import PPOTrainer

    sampled, trained, forwards = [], [], []
    generate, update, logprobs = HFEngine.generate, ActorEngine.update, ActorEngine.logprobs

    def spy_generate(self, prompts, sampling):
        ro = generate(self, prompts, sampling)
        if sampling.logprobs:  # the training rollouts (validation asks for none)
            sampled.append((ro.logprobs.copy(), ro.response_mask.copy()))
        return ro

    def spy_update(self, state, minibatch, *a, **kw):
        assert "is_weights" not in minibatch and self.bypass is not None
        trained.append(np.asarray(minibatch["old_logprobs"]))
        return update(self, state, minibatch, *a, **kw)

    monkeypatch.setattr(HFEngine, "generate", spy_generate)
    monkeypatch.setattr(ActorEngine, "update", spy_update)
    monkeypatch.setattr(ActorEngine, "logprobs", lambda *a, **kw: forwards.append(1) or logprobs(*a, **kw))
    cfg = load_config(ROOT / "configs" / "default_grpo.yaml",
                      [f"trainer.default_local_dir={tmp_path / 'run'}", *FAST, "trainer.sft_warmup_steps=0",
                       "trainer.total_training_steps=2", "trainer.test_freq=-1", "actor.use_kl_loss=false",
                       "actor.ppo_mini_batch_size=8", "algorithm.rollout_correction.bypass_mode=true", *extra])
    with PPOTrainer(cfg, make_engine_factory(cfg)) as trainer:
        trainer.fit()
    assert len(sampled) == 2 and len(trained) == 2 and not forwards
    for (lp, mask), old in zip(sampled, trained):  # one mini-batch a step: the same rows, maybe reordered
        valid = mask > 0
        got = np.sort(np.asarray(old).reshape(-1)[np.asarray(old).reshape(-1) != 0])
        assert np.allclose(np.sort(lp[valid].astype(np.float32)), got, atol=0, rtol=0)
    metrics = read_metrics(tmp_path / "run")[2]
    assert "timing_s/old_log_prob" not in metrics and "rollout/logprob_diff_mean" not in metrics
    assert metrics["actor/ppo_kl"] != 0.0  # the ratio is against the policy that sampled, not the trainer's


def test_one_update_a_step_takes_the_old_log_probs_from_its_own_forward_pass(tmp_path, one_device, monkeypatch,
                                                                             caplog):
    """`actor.ppo_epochs` = 1 and one mini-batch, nothing reading the old log-probs before the update (GRPO, no KL
    in the reward, no rollout correction): the trainer runs no forward pass for them except on the steps the
    engine returns its log-probs (the rollout/* metrics and the health rule compare the two), the update batch
    carries none, the PPO ratio is 1 (ppo_kl and the clip fractions exactly 0; the health rule for a policy barely
    moving does not read it), and the run ends where the same run recomputing them ends (fp32, the same samples:
    the weights within 1e-5; bit-equal on CPU)."""
    import jaxppo.build
    from jaxppo.engine import ActorEngine
    from jaxppo.train import make_engine_factory

    reward = tmp_path / "distinct.py"  # a score a random model's samples differ in: advantages that move the weights
    reward.write_text("def compute_score(data_source, solution_str, ground_truth, extra_info=None):\n"
                      "    return len(set(solution_str)) / 10.0\n")

    def run(name, skip):
        forwards, batches = [], []
        monkeypatch.setattr(ppo_step, "old_from_update", lambda cfg: skip)
        monkeypatch.setattr(jaxppo.build, "old_from_update", lambda cfg: skip)
        logprobs, update = ActorEngine.logprobs, ActorEngine.update
        monkeypatch.setattr(ActorEngine, "logprobs", lambda *a, **kw: forwards.append(1) or logprobs(*a, **kw))
        monkeypatch.setattr(ActorEngine, "update",
                            lambda self, st, mb, *a, **kw: batches.append((self.old_from_update, sorted(mb)))
                            or update(self, st, mb, *a, **kw))
        cfg = load_config(ROOT / "configs" / "default_grpo.yaml",
                          [f"trainer.default_local_dir={tmp_path / name}", *FAST, "trainer.sft_warmup_steps=0",
                           "trainer.total_training_steps=3", "trainer.test_freq=-1", "actor.use_kl_loss=false",
                           "actor.ppo_mini_batch_size=8", "model.dtype=float32", "actor.optim.lr_warmup_steps=0",
                           f"custom_reward_function.path={reward}", "reward.num_workers=0"])
        assert ppo_step.update_keys(cfg, False)[0] == (("advantages",) if skip else ("old_logprobs", "advantages"))
        with PPOTrainer(cfg, make_engine_factory(cfg)) as trainer:
            before = jax.device_get(trainer.state.actor.params)
            trainer.fit()
            params = jax.device_get(trainer.state.actor.params)
        moved = max(jax.tree.leaves(jax.tree.map(lambda a, b: float(np.max(np.abs(a - b))), params, before)))
        assert moved > 1e-3, moved  # three updates moved the weights
        return forwards, batches, read_metrics(tmp_path / name), params

    cfg = load_config(ROOT / "configs" / "default_grpo.yaml", [*FAST, "actor.ppo_mini_batch_size=8"])
    assert ppo_step.old_from_update(cfg)  # the rule itself, before the runs replace it
    for extra in (["actor.ppo_mini_batch_size=4"], ["actor.ppo_epochs=2"], ["algorithm.use_kl_in_reward=true"],
                  ["actor.tis_threshold=2.0"], ["algorithm.rollout_correction.rollout_is=token"],
                  ["algorithm.rollout_correction.bypass_mode=true"], ["trainer.async_rollout=true"]):
        assert not ppo_step.old_from_update(load_config(ROOT / "configs" / "default_grpo.yaml",
                                                        [*FAST, "actor.ppo_mini_batch_size=8", *extra])), extra
    forwards, batches, metrics, params = run("skip", True)
    assert len(forwards) == 1  # step 1's, the step the engine returned its log-probs on (every 8th from the first)
    assert batches and all(flag and "old_logprobs" not in keys for flag, keys in batches)
    assert "timing_s/old_log_prob" in metrics[1] and "rollout/logprob_diff_mean" in metrics[1]
    for s in (2, 3):
        assert "timing_s/old_log_prob" not in metrics[s] and "rollout/logprob_diff_mean" not in metrics[s]
    for s in (1, 2, 3):
        assert metrics[s]["actor/ppo_kl"] == 0.0 and metrics[s]["actor/pg_clipfrac"] == 0.0, metrics[s]
    assert "barely moving" not in caplog.text  # the health rule does not read a KL that is 0 by construction
    forwards, batches, again, recomputed = run("recompute", False)
    assert len(forwards) == 3 and all(not flag and "old_logprobs" in keys for flag, keys in batches)
    for s in (1, 2, 3):
        assert again[s]["critic/score/mean"] == metrics[s]["critic/score/mean"]  # the same samples
    diffs = jax.tree.leaves(jax.tree.map(lambda a, b: float(np.max(np.abs(a - b))), params, recomputed))
    assert max(diffs) < 1e-5, max(diffs)


def test_bypass_mode_refuses_what_it_does_not_do(tmp_path, capsys):
    from jaxppo.train import main

    base = [f"trainer.default_local_dir={tmp_path / 'run'}", *FAST, "algorithm.rollout_correction.bypass_mode=true"]
    for extra, says in ((["algorithm.rollout_correction.rollout_is=token",
                          "algorithm.rollout_correction.rollout_is_batch_normalize=true"], "is not built"),
                        (["algorithm.rollout_correction.loss_type=pg"], "known: ['ppo_clip', 'reinforce']"),
                        (["actor.tis_threshold=2.0"], "drop one"),
                        (["actor.policy_loss.loss_mode=gspo"], "set it to vanilla")):
        assert main([*base, *extra]) == 2
        assert says in capsys.readouterr().err
    assert not (tmp_path / "run").exists()


def test_remax_trains_against_each_prompts_greedy_reward(tmp_path, one_device, monkeypatch):
    """ReMax (`algorithm.adv_estimator=remax`): each step also generates one greedy response per prompt
    (`timing_s/gen_max`), scores it as the samples are, and each sample's advantage is its return-to-go minus
    its prompt's greedy reward."""
    from jaxppo.train import make_engine_factory

    seen = []
    advantages, greedy = ppo_step.advantages, ppo_step.greedy_baselines

    def spy_advantages(ctx, state, token_scores, old_lp, ref_lp, values, rmask, group_ids, baselines=None):
        out = advantages(ctx, state, token_scores, old_lp, ref_lp, values, rmask, group_ids, baselines)
        seen.append((np.asarray(token_scores), np.asarray(rmask), np.asarray(group_ids), baselines, out[2]))
        return out

    greedy_out = []
    monkeypatch.setattr(ppo_step, "advantages", spy_advantages)
    monkeypatch.setattr(ppo_step, "greedy_baselines",
                        lambda *a, **kw: greedy_out.append(greedy(*a, **kw)) or greedy_out[-1])
    cfg = load_config(ROOT / "configs" / "default_grpo.yaml",
                      [f"trainer.default_local_dir={tmp_path / 'run'}", *FAST, "trainer.sft_warmup_steps=0",
                       "trainer.total_training_steps=2", "trainer.test_freq=-1", "algorithm.adv_estimator=remax",
                       "rollout.n=2"])
    with PPOTrainer(cfg, make_engine_factory(cfg)) as trainer:
        trainer.fit()
    assert len(seen) == 2 and len(greedy_out) == 2
    for (scores, mask, groups, base, adv), per_prompt in zip(seen, greedy_out):
        assert base is not None and len(per_prompt) == cfg.data.train_batch_size
        np.testing.assert_array_equal(base, per_prompt[groups])  # each sample gets its own prompt's greedy reward
        returns = np.flip(np.cumsum(np.flip(scores * mask, -1), -1), -1)
        np.testing.assert_allclose(adv, returns - base[:, None] * mask, atol=1e-6)
    metrics = read_metrics(tmp_path / "run")
    assert all("timing_s/gen_max" in metrics[s] for s in (1, 2))
