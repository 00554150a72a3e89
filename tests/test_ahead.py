"""Rollouts one step ahead (`trainer.async_rollout`, jaxppo/ahead.py): which weights generate which batch, and the
config they imply. The stop-and-resume case is tests/test_operability.py's SIGTERM test, run both ways."""

from __future__ import annotations

import numpy as np
import pytest

from jaxppo.config import load_config
from jaxppo.errors import ConfigError
from tests.train_helpers import FAST, ROOT


def fingerprint(named, name: str = "model.norm.weight") -> float:
    """A fingerprint of a set of weights: the sum of one of them (HF names)."""
    return float(np.sum(np.asarray(dict(named)[name], np.float64)))


@pytest.mark.parametrize("lora", [False, True], ids=["full", "lora"])
def test_each_batch_is_generated_with_the_weights_of_the_step_before(tmp_path, one_device, monkeypatch, lora):
    """Every generation records the engine's weights; the trainer's weights are recorded before each step. One step
    ahead, step 1's batch and step 2's are sampled by the initial weights, step k's (k >= 2) by the weights step k-1
    trained with, and the importance weights of step 1 are 1 up to the engines' float32 difference (nothing is off-policy yet).
    Under LoRA the engine's weights are the merged ones, W + (alpha / r) B A, of the step before (a projection's,
    the norm being frozen)."""
    from bridge.engines.hf import HFEngine
    from jaxppo.models.lora import LoRAWeights
    from jaxppo.train import make_engine_factory
    from jaxppo.trainer import PPOTrainer

    seen = []
    plain = HFEngine.generate
    name = "model.layers.0.self_attn.q_proj.weight" if lora else "model.norm.weight"

    def generate(self, prompts, sampling):
        seen.append(fingerprint(((n, p.detach().numpy()) for n, p in self.model.named_parameters()), name))
        return plain(self, prompts, sampling)

    monkeypatch.setattr(HFEngine, "generate", generate)
    cfg = load_config(ROOT / "configs" / "default.yaml", [
        f"trainer.default_local_dir={tmp_path / 'run'}", *FAST, "trainer.sft_warmup_steps=0", "trainer.test_freq=-1",
        "trainer.save_freq=-1", "trainer.total_training_steps=4", "trainer.async_rollout=true",
        "algorithm.rollout_correction.rollout_is=token",  # its importance weights tell on-policy steps apart
        "actor.optim.lr=1e-2", "actor.optim.weight_decay=0.5",  # weights that move: each step's are told apart
        *(["actor.lora_rank=4", "actor.lora_alpha=8"] if lora else [])])
    with PPOTrainer(cfg, make_engine_factory(cfg)) as trainer:
        before, metrics = [], []
        for _ in range(4):
            weights = trainer.ctx.rollout_weights(trainer.state.actor.params)
            assert isinstance(weights, LoRAWeights) == lora
            before.append(fingerprint(weights, name))
            metrics.append(trainer.train_step())
        assert not trainer.ahead.in_flight  # nothing is launched past the last step
    assert len(set(np.round(before, 6))) == 4  # four different weights
    np.testing.assert_allclose(seen, [before[0], before[0], before[1], before[2]], rtol=0, atol=1e-5)
    # step 1: the engine's and the trainer's log-probs of the same weights (fp32, transformers vs JAX)
    dev = lambda m: max(m["rollout_corr/rollout_is_max"] - 1, 1 - m["rollout_corr/rollout_is_min"])  # noqa: E731
    assert dev(metrics[0]) < 1e-5
    assert all(dev(m) > 1e-3 for m in metrics[1:]), [dev(m) for m in metrics]  # one step off from then on
    assert metrics[0]["timing_s/gen_wait"] > 0 and all("timing_s/gen" in m for m in metrics)


def test_a_batch_taken_through_the_ahead_path_trains_as_the_synchronous_step_when_it_is_not_stale(tmp_path, one_device,
                                                                                                 monkeypatch):
    """The one-step-ahead path with its lag removed (each step launches its own batch with its own weights and takes
    it: the background thread, the engine's copy of the weights, `collect(sampled=...)`, the implied bypass mode)
    trains step for step as the synchronous step does. So what one step ahead costs in learning
    (docs/benchmarks/learning/cpu_async_vs_sync_2026-12-04) is the lag itself, not its code path: on the embedded
    default, seed 0, the two ran 8 steps with every logged figure equal to 5 digits (2026-12-04)."""
    from jaxppo import step as ppo_step
    from jaxppo.train import make_engine_factory
    from jaxppo.trainer import PPOTrainer

    def no_lag(self, timer):
        self.ahead.launch(self.state, self.sampler.next_batch(), self.step, timer)
        batch, _ = self.ahead.take(self.step)
        timer.times.update(batch.times)
        return ppo_step.collect(self.ctx, self.state, None, self.step, timer, sampled=(batch.sampled, batch.metrics))

    runs = {}
    for ahead in (False, True):
        cfg = load_config(ROOT / "configs" / "default.yaml", [
            f"trainer.default_local_dir={tmp_path / f'run_{ahead}'}", *FAST, "trainer.sft_warmup_steps=0",
            "trainer.test_freq=-1", "trainer.save_freq=-1", "trainer.total_training_steps=3",
            f"trainer.async_rollout={str(ahead).lower()}"])
        with monkeypatch.context() as m:
            if ahead:
                m.setattr(PPOTrainer, "_collect_ahead", no_lag)
            with PPOTrainer(cfg, make_engine_factory(cfg)) as trainer:
                runs[ahead] = [trainer.train_step() for _ in range(3)]
    keys = ["critic/score/mean", "actor/pg_loss", "actor/kl_loss", "actor/grad_norm", "critic/vf_loss",
            "critic/grad_norm", "actor/entropy"]
    for step, (sync, ahead) in enumerate(zip(runs[False], runs[True]), 1):
        assert "rollout_corr/rollout_is_mean" not in sync and ahead["timing_s/gen"] > 0
        for k in keys:  # the old log-probs: JAX's recomputation against the engine's (bypass), both float32
            assert ahead[k] == pytest.approx(sync[k], rel=1e-4, abs=1e-6), (step, k, sync[k], ahead[k])
    assert runs[False][-1]["actor/kl_loss"] > 0  # the weights moved: the equality is over steps that train


def test_async_rollout_implies_a_correction_and_a_helper_engine_and_refuses_what_it_cannot_run():
    base = ROOT / "configs" / "default.yaml"
    rc = load_config(base, ["trainer.async_rollout=true"]).algorithm.rollout_correction
    assert rc.bypass_mode and rc.rollout_is is None  # PPO's loss: its ratio against the policy that sampled
    other = load_config(base, ["trainer.async_rollout=true", "actor.policy_loss.loss_mode=gspo",
                               "actor.loss_agg_mode=seq-mean-token-mean"]).algorithm.rollout_correction
    assert not other.bypass_mode and other.rollout_is == "token" and other.rollout_is_threshold == "2.0"  # verl's IS
    sync = load_config(base).algorithm.rollout_correction  # the synchronous run: unchanged
    assert sync.rollout_is is None and not sync.bypass_mode
    own = load_config(base, ["trainer.async_rollout=true", "algorithm.rollout_correction.rollout_rs=token_k1",
                             "algorithm.rollout_correction.rollout_rs_threshold=0.5_2.0"]).algorithm.rollout_correction
    assert own.rollout_is is None and own.rollout_rs == "token_k1"  # the user's correction is theirs
    bypass = load_config(base, ["trainer.async_rollout=true", "algorithm.rollout_correction.bypass_mode=true",
                                "algorithm.adv_estimator=grpo", "rollout.n=2"]).algorithm.rollout_correction
    assert bypass.bypass_mode and bypass.rollout_is is None
    # with vLLM one step ahead, the engine goes to a helper process unless the user keeps it in the trainer's
    in_trainer = {(tuple(o), load_config(base, ["rollout.engine=vllm", *o]).rollout.engine_in_trainer) for o in (
        [], ["trainer.async_rollout=true"], ["trainer.async_rollout=true", "rollout.engine_in_trainer=true"],
        ["trainer.rollout_during_critic_update=true"], ["rollout.engine_in_trainer=false"])}
    assert in_trainer == {((), True), (("trainer.async_rollout=true",), False),
                          (("trainer.async_rollout=true", "rollout.engine_in_trainer=true"), True),
                          (("trainer.rollout_during_critic_update=true",), True),
                          (("rollout.engine_in_trainer=false",), False)}
    assert load_config(base, ["trainer.async_rollout=true"]).rollout.engine_in_trainer  # the transformers engine
    with pytest.raises(ConfigError, match="async_rollout.*filter_groups"):
        load_config(base, ["trainer.async_rollout=true", "algorithm.filter_groups.enable=true",
                           "algorithm.adv_estimator=grpo", "rollout.n=2"])
    from jaxppo.config import validate_processes

    with pytest.raises(ConfigError, match="one process"):
        validate_processes(load_config(base, ["trainer.async_rollout=true"]), 2)


def test_during_the_critic_update_the_run_is_the_synchronous_run_with_the_next_generation_beside_the_critic(
        tmp_path, one_device, monkeypatch):
    """`trainer.rollout_during_critic_update`: every batch is sampled by the weights that then train on it, every
    logged figure of every step equals the synchronous run's (the same computations, reordered), and the next
    batch's generation runs while the critic updates: generation k+1 starts before the critic's update of step k
    does, and is still in progress when that update starts (each side waits for the other's start; launched after
    the critic's update, or finished before it, one side's wait would time out)."""
    import threading

    from bridge.engines.hf import HFEngine
    from jaxppo import step as ppo_step
    from jaxppo.models.hf_io import HFWeights
    from jaxppo.train import make_engine_factory
    from jaxppo.trainer import PPOTrainer

    steps = 3
    runs, before, seen, late = {}, [], [], []
    cond = threading.Condition()
    count = {"gen": 0, "critic": 0}

    def until(what: str, n: int) -> bool:
        with cond:
            return cond.wait_for(lambda: count[what] >= n, timeout=120)

    def started(what: str) -> int:
        with cond:
            count[what] += 1
            cond.notify_all()
            return count[what]

    plain_generate, plain_update = HFEngine.generate, ppo_step._update

    def generate(self, prompts, sampling):
        seen.append(fingerprint((n, p.detach().numpy()) for n, p in self.model.named_parameters()))
        n = started("gen")
        if n >= 2 and not until("critic", n - 1):  # generation n runs during step n-1's critic update
            late.append(f"generation {n} ended before the critic's update of step {n - 1} started")
        return plain_generate(self, prompts, sampling)

    def update(ctx, engine, *args, **kwargs):
        if engine is ctx.critic:
            c = started("critic")
            if c < steps and not until("gen", c + 1):
                late.append(f"generation {c + 1} not launched before the critic's update of step {c}")
        return plain_update(ctx, engine, *args, **kwargs)

    for overlap in (False, True):
        cfg = load_config(ROOT / "configs" / "default.yaml", [
            f"trainer.default_local_dir={tmp_path / f'run_{overlap}'}", *FAST, "trainer.sft_warmup_steps=0",
            "trainer.test_freq=-1", "trainer.save_freq=-1", f"trainer.total_training_steps={steps}",
            f"trainer.rollout_during_critic_update={str(overlap).lower()}",
            "actor.optim.lr=1e-2"])  # weights that move: each step's are told apart
        with monkeypatch.context() as m:
            if overlap:
                m.setattr(HFEngine, "generate", generate)
                m.setattr(ppo_step, "_update", update)
            with PPOTrainer(cfg, make_engine_factory(cfg)) as trainer:
                runs[overlap] = []
                for _ in range(steps):
                    if overlap:
                        before.append(fingerprint(HFWeights(trainer.state.actor.params, np.float32)))
                    runs[overlap].append(trainer.train_step())
                assert not trainer.ahead.in_flight if overlap else trainer.ahead is None
    assert not late, late
    assert count == {"gen": steps, "critic": steps}
    assert len(set(np.round(before, 6))) == steps
    np.testing.assert_allclose(seen, before, rtol=0, atol=1e-6)  # on-policy: each batch by its step's weights
    for step, (sync, overlap) in enumerate(zip(runs[False], runs[True]), 1):
        figures = [k for k in sync if not k.startswith(("timing_s/", "perf/"))]
        assert len(figures) > 40 and set(figures) <= set(overlap)
        for k in figures:
            assert overlap[k] == pytest.approx(sync[k], rel=1e-6, abs=1e-7), (step, k, sync[k], overlap[k])
    assert runs[False][-1]["actor/kl_loss"] > 0  # the weights moved: the equality is over steps that train


def test_rollout_during_critic_update_refuses_what_it_cannot_run():
    from jaxppo.config import validate_processes

    base = ROOT / "configs" / "default.yaml"
    cfg = load_config(base, ["trainer.rollout_during_critic_update=true"])
    assert cfg.algorithm.rollout_correction == load_config(base).algorithm.rollout_correction  # on-policy: none implied
    with pytest.raises(ConfigError, match="needs a critic.*grpo"):
        load_config(base, ["trainer.rollout_during_critic_update=true", "algorithm.adv_estimator=grpo", "rollout.n=2"])
    with pytest.raises(ConfigError, match="set one"):
        load_config(base, ["trainer.rollout_during_critic_update=true", "trainer.async_rollout=true"])
    with pytest.raises(ConfigError, match="rollout_during_critic_update.*filter_groups"):
        load_config(base, ["trainer.rollout_during_critic_update=true", "algorithm.filter_groups.enable=true"])
    with pytest.raises(ConfigError, match="rollout_during_critic_update runs in one process"):
        validate_processes(cfg, 2)


@pytest.mark.parametrize("resume", ["trainer.async_rollout=false", "trainer.rollout_during_critic_update=true"],
                         ids=["synchronous", "during_critic_update"])
def test_a_batch_one_step_stale_is_generated_again_by_a_run_resumed_on_policy(tmp_path, one_device, monkeypatch,
                                                                              resume):
    """A checkpoint written one step ahead stores a batch sampled by the weights before its own; resumed by a run
    that trains on-policy, that batch is not trained on (nor dropped with its prompts): its rows are generated
    again with the checkpoint's weights, and the sampler continues after them, as the stopped run would have."""
    from jaxppo.ahead import Ahead
    from jaxppo.train import make_engine_factory
    from jaxppo.trainer import PPOTrainer

    stored = []
    plain = Ahead.state
    monkeypatch.setattr(Ahead, "state", lambda self: stored.append(plain(self)) or stored[-1])
    common = [*FAST, "trainer.sft_warmup_steps=0", "trainer.test_freq=-1", "trainer.total_training_steps=3"]
    cfg = load_config(ROOT / "configs" / "default.yaml", [
        f"trainer.default_local_dir={tmp_path / 'ahead'}", *common, "trainer.save_freq=2",
        "trainer.async_rollout=true"])
    with PPOTrainer(cfg, make_engine_factory(cfg)) as trainer:
        for _ in range(2):
            trainer.train_step()
        trainer.save_checkpoint()
        sampler_after = trainer.sampler.state()
    assert stored[0]["step"] == 2 and stored[0]["lag"] == 1  # step 3's batch (0-based step 2), one update stale
    rows = np.asarray(stored[0]["rows"]["data"])
    cfg = load_config(ROOT / "configs" / "default.yaml", [
        f"trainer.default_local_dir={tmp_path / 'resumed'}", *common, "trainer.save_freq=-1", resume,
        f"trainer.resume_mode={tmp_path / 'ahead' / 'checkpoints' / '2'}"])
    taken = []
    with PPOTrainer(cfg, make_engine_factory(cfg)) as trainer:
        assert trainer.step == 2 and not (trainer.ahead is not None and trainer.ahead.in_flight)
        plain_generate = trainer.ctx.engine.generate
        trainer.ctx.engine.generate = lambda prompts, s: taken.append(prompts) or plain_generate(prompts, s)
        trainer.train_step()
        assert trainer.sampler.state() == sampler_after  # the stored rows were not drawn from the sampler again
    expected = [trainer.train_ds.input_ids[i].tolist() for i in rows]
    assert taken == [expected]
