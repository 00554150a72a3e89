"""Operating a run: profiler traces of chosen steps, the health monitor and its actions, NaN/inf never
reaching the parameters, early stopping, and SIGTERM -> checkpoint -> exact resume."""

import gzip
import logging
import signal
import subprocess

import jax
import numpy as np
import pytest

from jaxppo import step as ppo_step
from jaxppo.config import load_config
from jaxppo.trainer import PPOTrainer
from jaxppo.train import make_engine_factory
from tests.train_helpers import (FAST, ROOT, assert_resumed_as_straight, assert_resumed_at_checkpoint, logged_step,
                                 read_metrics, run_train, start_train, stop_checkpoint, wait_until)

# the FAST default on the 8 host devices of the test process (data=8: one sequence per device per micro-batch)
MESH8 = ["mesh.data=-1", "actor.ppo_micro_batch_size_per_device=1", "critic.ppo_micro_batch_size_per_device=1",
         "actor.log_prob_micro_batch_size_per_device=2", "critic.log_prob_micro_batch_size_per_device=2",
         "trainer.sft_warmup_steps=0", "trainer.val_before_train=false", "trainer.test_freq=-1"]


def make_trainer(tmp_path, *overrides, cls=PPOTrainer):
    cfg = load_config(ROOT / "configs" / "default.yaml",
                      [*FAST, *MESH8, f"trainer.default_local_dir={tmp_path / 'run'}", *overrides])
    return cls(cfg, make_engine_factory(cfg))


def host(tree):
    return [np.array(x) for x in jax.tree.leaves(jax.device_get(tree))]


def same(a, b) -> bool:
    return all(np.array_equal(x, y, equal_nan=False) for x, y in zip(a, b))


def nan_from_second_call(monkeypatch, name: str, poison):
    """Wrap `jaxppo.step.<name>` so that from its second call on (the run's second step, counted across the
    trainers of one test) its result goes through `poison`."""
    calls = [0]
    inner = getattr(ppo_step, name)

    def wrapped(*args, **kwargs):
        calls[0] += 1
        out = inner(*args, **kwargs)
        return poison(out) if calls[0] >= 2 else out

    monkeypatch.setattr(ppo_step, name, wrapped)


def nan_scores(monkeypatch):
    """The reward phase returns NaN scores from the second step on."""
    nan_from_second_call(monkeypatch, "score", lambda out: (np.full_like(out[0], np.nan), out[1]))


def nan_advantages(monkeypatch):
    """Advantages and returns become NaN from the second step on: the losses and gradients of every
    mini-batch are NaN while the rewards stay finite (so only the in-update guard can catch it)."""
    def poison(out):
        state, rewards, adv, ret, m = out
        return state, rewards, np.full_like(adv, np.nan), np.full_like(ret, np.nan), m

    nan_from_second_call(monkeypatch, "advantages", poison)


class KLBlowUp(PPOTrainer):
    """Old log-probs shifted by +3 nats: the actor's ppo_kl (old - new) is ~3, far above 0.05."""

    def __init__(self, *a, **k):
        super().__init__(*a, **k)
        inner = self.actor.logprobs
        self.actor.logprobs = lambda params, batch, *args, **kw: tuple(
            (lp + 3.0 if i == 0 else lp) for i, lp in enumerate(inner(params, batch, *args, **kw)))


@pytest.mark.slow
def test_profile_of_one_step_has_every_phase(tmp_path):
    tr = make_trainer(tmp_path, "trainer.total_training_steps=1", "trainer.profile_steps=[1]",
                      "trainer.logger=[jsonl]")
    tr.fit()
    out = tmp_path / "run" / "profile" / "step_1"
    perfetto = list(out.rglob("*.trace.json.gz"))
    assert list(out.rglob("*.xplane.pb")) and perfetto, sorted(out.rglob("*"))
    jax_trace = gzip.decompress(perfetto[0].read_bytes()).decode()
    torch_trace = (out / "torch_trace.json").read_text()
    for phase in ("gen", "sync", "reward", "old_log_prob", "values", "adv", "update_critic", "update_actor"):
        assert f'"{phase}"' in jax_trace, phase
    for phase in ("gen", "sync"):  # the torch engine's side of the step, under the same names
        assert f'"{phase}"' in torch_trace, phase


@pytest.mark.slow
def test_profile_tools_picks_the_profilers(tmp_path):
    """trainer.profile_tools=[torch, python]: torch's trace (on a GPU CUPTI takes one subscriber: its record of every
    kernel, XLA's too, is then torch's), with the step's regions, and cProfile's record of the step's host
    functions, the engine's generation and the updates among them; no JAX trace."""
    import pstats

    tr = make_trainer(tmp_path, "trainer.total_training_steps=1", "trainer.profile_steps=[1]",
                      "trainer.profile_tools=[torch,python]", "trainer.logger=[jsonl]")
    tr.fit()
    out = tmp_path / "run" / "profile" / "step_1"
    assert not list(out.rglob("*.trace.json.gz")) and not list(out.rglob("*.xplane.pb"))
    assert '"gen"' in (out / "torch_trace.json").read_text()
    stats = pstats.Stats(str(out / "python_profile.pstats")).stats  # {(file, line, function): (.., calls, ..)}
    funcs = {fn for (_, _, fn) in stats}
    assert {"generate", "update"} <= funcs, sorted(funcs)[:50]
    text = (out / "python_profile.txt").read_text()
    # the summary's two tables; the step itself heads the cumulative one (the engine's generate, fast on a warm
    # compile cache, need not be among the 40 that follow it: the .pstats above has every function)
    assert "== by tottime" in text and "train_step" in text.split("== by cumulative")[1].split("\n\n\n")[0]
    # the one step and nothing after it: what follows the step (metrics, logging, checkpoint) is not in it
    assert [v[1] for (_, _, fn), v in stats.items() if fn == "train_step"] == [1]
    assert "_after_step" not in funcs


@pytest.mark.slow
def test_nan_rewards_are_skipped_counted_and_never_reach_the_parameters(tmp_path, monkeypatch):
    nan_scores(monkeypatch)
    tr = make_trainer(tmp_path, "trainer.total_training_steps=3", "trainer.max_bad_steps=5")
    tr.fit()  # step 1 clean, steps 2-3 NaN rewards
    m = read_metrics(tmp_path / "run")
    assert m[1]["health/skipped_steps"] == 0 and m[1]["health/nonfinite"] == 0
    before_actor, before_critic = host(tr.actor_state), host(tr.critic_state)
    tr2 = make_trainer(tmp_path, "trainer.total_training_steps=4", "trainer.max_bad_steps=5")
    assert tr2.step == 3 and same(host(tr2.actor_state), before_actor)  # resumed from the final checkpoint
    tr2.fit()  # one more NaN step
    assert same(host(tr2.actor_state), before_actor) and same(host(tr2.critic_state), before_critic)
    m = read_metrics(tmp_path / "run")
    for step in (2, 3, 4):
        assert m[step]["health/skipped_steps"] == 1 and m[step]["health/nonfinite"] == 1, step
        assert "actor/pg_loss" not in m[step]
    assert [m[s]["health/bad_steps"] for s in (1, 2, 3, 4)] == [0, 1, 2, 3]


@pytest.mark.slow
def test_nan_gradients_are_skipped_and_the_run_stops_after_max_bad_steps(tmp_path, monkeypatch):
    nan_advantages(monkeypatch)
    tr = make_trainer(tmp_path, "trainer.total_training_steps=6", "trainer.save_freq=1", "trainer.max_bad_steps=2")
    snapshots = {}
    step = tr.train_step
    tr.train_step = lambda: (snapshots.setdefault(tr.step, host(tr.actor_state.params)), step())[1]
    tr.fit()
    m = read_metrics(tmp_path / "run")
    assert sorted(m) == [1, 2, 3] and tr.exit_code == 3 and "max_bad_steps" in tr.stop_reason
    for s in (2, 3):
        assert m[s]["actor/nonfinite_updates"] == m[s]["actor/skipped_updates"] == 2  # both mini-batches
        assert m[s]["critic/nonfinite_updates"] == 2
    assert not same(snapshots[0], snapshots[1])  # the clean step moved the parameters
    assert same(snapshots[1], host(tr.actor_state.params))  # the NaN steps did not
    assert int(tr.actor_state.step) == 2  # optimizer steps: only the clean step's two mini-batches
    ckpts = sorted(int(p.name) for p in (tmp_path / "run" / "checkpoints").iterdir() if p.name.isdigit())
    assert ckpts == [1, 2]  # step 3 (the second bad one) wrote nothing
    restored = make_trainer(tmp_path, "trainer.total_training_steps=6")
    assert restored.step == 2 and same(host(restored.actor_state.params), snapshots[1])


@pytest.mark.slow
@pytest.mark.parametrize("action", ["warn", "skip_update", "stop"])
def test_kl_blow_up_triggers_the_configured_action(action, tmp_path, caplog):
    tr = make_trainer(tmp_path, "trainer.total_training_steps=3", f"trainer.health.ppo_kl_high.action={action}",
                      cls=KLBlowUp)
    before = host(tr.actor_state.params)
    with caplog.at_level(logging.WARNING, logger="jaxppo.health"):
        tr.fit()
    m = read_metrics(tmp_path / "run")
    reports = [r for r in caplog.records if "actor/ppo_kl" in r.getMessage() and "ppo_kl_high" not in r.getMessage()]
    assert len(reports) == 1, [r.getMessage() for r in caplog.records]  # once per episode, not per step
    assert "kl" in reports[0].getMessage().lower() and action in reports[0].getMessage()
    assert m[1]["actor/ppo_kl"] > 2.0 and m[1]["health/ppo_kl_high"] == 1
    if action == "warn":
        assert sorted(m) == [1, 2, 3] and not same(before, host(tr.actor_state.params))
        assert all(m[s]["health/ppo_kl_high"] == 1 for s in (1, 2, 3))
    elif action == "skip_update":
        assert sorted(m) == [1, 2, 3] and same(before, host(tr.actor_state.params))
        assert all(m[s]["actor/skipped_updates"] == 2 for s in (1, 2, 3))
    else:
        assert sorted(m) == [1] and tr.exit_code == 3 and "ppo_kl" in tr.stop_reason
        assert (tmp_path / "run" / "checkpoints" / "1").is_dir()  # stop writes a checkpoint first


@pytest.mark.slow
def test_early_stopping_ends_the_run_with_a_checkpoint(tmp_path):
    class Flat(PPOTrainer):
        def validate(self):
            return {"val/score": 0.5, "val/x/score": 0.5}

    tr = make_trainer(tmp_path, "trainer.total_training_steps=10", "trainer.test_freq=1",
                      "trainer.val_before_train=true", "trainer.early_stop_patience=2", cls=Flat)
    tr.fit()
    assert tr.step == 2 and tr.exit_code == 0 and tr.stop_reason.startswith("early stop")
    assert (tmp_path / "run" / "checkpoints" / "2").is_dir()


def test_health_monitor_reports_once_per_episode():
    from jaxppo.health import HealthConfig, HealthMonitor

    mon = HealthMonitor(HealthConfig(recover_steps=2))
    seq = [0.2, 0.2, 0.01, 0.2, 0.01, 0.01, 0.2]  # actor/ppo_kl: high, high, ok, high, ok, ok (ends), high
    firing = []
    for v in seq:
        m = {"actor/ppo_kl": v}
        mon.report(m)
        firing.append(m["health/ppo_kl_high"])
    assert firing == [1, 1, 0, 1, 0, 0, 1]
    assert mon.findings == 2  # the second episode began only after two healthy steps in a row
    m = {"actor/ppo_kl": 0.01, "critic/score/mean": float("nan")}
    assert [f.rule for f in mon.report(m)] == ["nonfinite"] and m["health/nonfinite"] == 1.0
    # a metric measured only on some steps (the engine's log-probs: every 8th): steps without it are no evidence,
    # so they neither fire nor end the episode
    mon = HealthMonitor(HealthConfig(recover_steps=2))
    firing = []
    for v in (0.5, None, None, None, 0.5, None, 0.01, 0.01, 0.5):
        m = {} if v is None else {"rollout/logprob_diff_mean": v}
        mon.report(m)
        firing.append(m.get("health/logprob_mismatch"))
    assert firing == [1, None, None, None, 1, None, 0, 0, 1]
    assert mon.findings == 2  # one episode until two measured healthy steps, then a second
    # one actor update a step: its actor/ppo_kl is the KL of the weights that sampled against themselves (0
    # however far the update moves them), so "barely moving" is not judged from it; "too far" still is
    for single, fires in ((False, True), (True, False)):
        m = {"actor/ppo_kl": 0.0}
        assert any(f.rule == "ppo_kl_low" for f in HealthMonitor(HealthConfig(), single).report(m)) == fires
    m = {"actor/ppo_kl": 0.2}
    assert [f.rule for f in HealthMonitor(HealthConfig(), single_update=True).report(m)] == ["ppo_kl_high"]


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["", "trainer.async_rollout=true", "trainer.rollout_during_critic_update=true"],
                         ids=["synchronous", "rollouts_one_step_ahead", "rollout_during_critic_update"])
def test_sigterm_writes_a_checkpoint_and_resume_continues_exactly(tmp_path, mode):
    """Stopped by SIGTERM, the run writes a checkpoint and the same command resumes it: the steps after it equal
    those of a run never stopped. One step ahead (trainer.async_rollout) a batch is in flight at every stop; the
    checkpoint stores it and the resumed run trains on it (generating it again would sample with other weights);
    during the critic's update the next batch is in flight at every stop too."""
    ahead = bool(mode)
    common = [*FAST, "trainer.total_training_steps=5", "trainer.save_freq=-1", "trainer.test_freq=-1",
              "trainer.seed=5", "trainer.sft_warmup_steps=0", *([mode] if mode else [])]
    straight = tmp_path / "straight"
    run_train(straight, *common)
    run = tmp_path / "stopped"
    proc = start_train(run, *common, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    wait_until(lambda: logged_step(run, 2), proc, "step 2")
    proc.send_signal(signal.SIGTERM)
    out, _ = proc.communicate(timeout=300)
    assert proc.returncode == 0, out[-3000:]
    assert "SIGTERM" in out and "resume" in out
    ckpt = stop_checkpoint(run, 5)
    res = run_train(run, *common)
    assert_resumed_as_straight(straight, run, res.stderr + res.stdout, ckpt, 5, in_flight=ahead)


@pytest.mark.slow
def test_sigint_stops_with_a_checkpoint_and_the_same_command_resumes(tmp_path):
    common = [*FAST, "trainer.total_training_steps=4", "trainer.save_freq=-1", "trainer.test_freq=-1",
              "trainer.sft_warmup_steps=0"]
    run = tmp_path / "run"
    proc = start_train(run, *common, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    wait_until(lambda: logged_step(run, 1), proc, "step 1")
    proc.send_signal(signal.SIGINT)
    out, _ = proc.communicate(timeout=300)
    assert proc.returncode == 0 and "SIGINT" in out and "resume" in out, out[-3000:]
    ckpts = [int(p.name) for p in (run / "checkpoints").iterdir() if p.name.isdigit()]
    assert len(ckpts) == 1 and 1 <= ckpts[0] < 4
    res = run_train(run, *common)
    assert assert_resumed_at_checkpoint(run, res.stderr + res.stdout) == ckpts[0]
    assert sorted(read_metrics(run)) == [0, 1, 2, 3, 4]  # (step 0: the validation before training)


@pytest.mark.slow
def test_a_reward_function_that_fails_on_most_samples_stops_the_run_before_any_update(tmp_path, caplog):
    """A user's reward that returns no number (here a string) scores 0 on every sample: training on that is a bug,
    not noise. The `reward_errors` rule (default: more than half the samples, `stop`) skips the step's update, writes
    a checkpoint and ends the run (exit 3) naming the rule and the fix; with `action=warn` the run goes on."""
    reward = tmp_path / "bad_reward.py"
    reward.write_text("def compute_score(data_source, solution_str, ground_truth, extra_info=None):\n"
                      "    return 'yes'\n")
    tr = make_trainer(tmp_path, "trainer.total_training_steps=3", f"custom_reward_function.path={reward}")
    before = host(tr.actor_state.params)
    with caplog.at_level(logging.WARNING, logger="jaxppo.health"):
        tr.fit()
    m = read_metrics(tmp_path / "run")
    assert sorted(m) == [1] and tr.exit_code == 3 and "reward/error_ratio = 1" in tr.stop_reason, tr.stop_reason
    assert m[1]["reward/errors"] == 16 and m[1]["health/reward_errors"] == 1 and m[1]["health/skipped_steps"] == 1
    assert "fix it" in caplog.text and same(before, host(tr.actor_state.params))
    assert (tmp_path / "run" / "checkpoints" / "1").is_dir()
    warn = make_trainer(tmp_path / "w", "trainer.total_training_steps=2", f"custom_reward_function.path={reward}",
                        "trainer.health.reward_errors.action=warn")
    warn.fit()
    assert warn.exit_code == 0 and sorted(read_metrics(tmp_path / "w" / "run")) == [1, 2]


@pytest.mark.parametrize("fails_in", ["generate", "push"])
def test_an_engine_error_is_the_one_raised_when_the_sleep_after_it_fails_too(fails_in, caplog):
    """`jaxppo.step.awake`: on the way out of a failed call the engine is put back to sleep; when that sleep fails
    too (the failure ended the engine's process), the first error is the one raised, the sleep's is logged. The
    calls the engine saw are the ordinary ones, and a call that succeeds still sleeps (and raises its sleep's error)."""
    from types import SimpleNamespace

    calls = []

    class Engine:
        def wake(self):
            calls.append("wake")

        def update_weights(self, weights):
            calls.append("update_weights")
            if fails_in == "push":
                raise RuntimeError("push failed")

        def sleep(self):
            calls.append("sleep")
            raise ConnectionResetError("the engine's process is gone")

    ctx = SimpleNamespace(engine=Engine(), cfg=SimpleNamespace(rollout=SimpleNamespace(free_cache_engine=True)),
                          rollout_weights=lambda params: params)
    with caplog.at_level(logging.WARNING), pytest.raises(RuntimeError, match=f"{fails_in} failed"):
        with ppo_step.awake(ctx, {}):
            raise RuntimeError("generate failed")
    assert calls == ["wake", "update_weights", "sleep"]
    assert "sleep failed" in caplog.text and "process is gone" in caplog.text
    if fails_in == "generate":
        with pytest.raises(ConnectionResetError):  # no error before it: the sleep's own is raised
            with ppo_step.awake(ctx, {}):
                pass
