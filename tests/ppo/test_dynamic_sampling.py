"""DAPO's pieces: overlong reward shaping by hand, and dynamic sampling (groups without signal dropped, the batch
refilled from further generation rounds, filled when the rounds run out) through `jaxppo.step.sample` with a
scripted engine and reward."""

from types import SimpleNamespace

import numpy as np
import pytest

from jaxppo import step as ppo_step
from jaxppo.config import load_config
from jaxppo.rewards.shaping import groups_with_signal, overlong_penalty
from jaxppo.rollout import Rollouts


def test_overlong_penalty_by_hand():
    # R = 16, buffer 4, factor 0.5: free up to 12 tokens, then -0.125 per token to -0.5 at 16
    got = overlong_penalty(np.array([3, 12, 13, 14, 16]), 16, 4, 0.5)
    np.testing.assert_allclose(got, [0.0, 0.0, -0.125, -0.25, -0.5])


def test_groups_with_signal():
    metric = np.array([1, 1, 0, 1, 0, 0, 0.5])
    index = np.array([0, 0, 1, 1, 2, 2, 3])
    assert groups_with_signal(metric, index).tolist() == [1, 3]  # prompt 3 has one sample: kept, as verl does


class ScriptedEngine:
    """Prompt token t, sample j -> response [t, j]; generation rounds are counted."""

    def __init__(self):
        self.calls = 0

    def wake(self):
        pass

    def sleep(self):
        pass

    def update_weights(self, weights):
        pass

    def generate(self, prompts, sampling):
        self.calls += 1
        n = sampling.n
        ids = np.array([[p[0], j] for p in prompts for j in range(n)], np.int32)
        return Rollouts(ids, np.ones(ids.shape, np.float32), np.zeros(ids.shape, np.float32),
                        ["stop"] * len(ids), np.repeat(np.arange(len(prompts)), n).astype(np.int32))


def scripted_reward(solution, ground_truth, extra_info):
    """t % 3 == 0: every sample 1; == 1: every sample 0 (no signal); == 2: sample j scores j % 2 (signal)."""
    t, j = (int(x) for x in solution.split())
    return {0: 1.0, 1: 0.0, 2: float(j % 2)}[t % 3]


def acc_reward(solution, ground_truth, extra_info):
    """scripted_reward's score, and an 'acc' with signal only in prompt 0's group."""
    t, j = (int(x) for x in solution.split())
    return {"score": scripted_reward(solution, ground_truth, extra_info), "acc": float(j) if t == 0 else 0.0}


def make_ctx(*overrides):
    cfg = load_config(None, ["data.train_batch_size=4", "data.gen_batch_size=6", "rollout.n=2",
                             "actor.ppo_mini_batch_size=4", "critic.ppo_mini_batch_size=4",
                             "actor.log_prob_micro_batch_size_per_device=8", "critic.log_prob_micro_batch_size_per_device=8",
                             "algorithm.adv_estimator=grpo", "algorithm.filter_groups.enable=true",
                             "data.max_response_length=2", *overrides])
    ds = SimpleNamespace(input_ids=[np.array([t, 100 + t]) for t in range(60)], data_source=["s"] * 60,
                         ground_truth=[""] * 60, extra_info=[{}] * 60)
    tok = SimpleNamespace(pad_token_id=0, decode=lambda ids, skip_special_tokens=True: " ".join(map(str, ids)))
    return SimpleNamespace(cfg=cfg, train_ds=ds, engine=ScriptedEngine(), tokenizer=tok, P=2, R=2,
                           rollout_weights=lambda params: [], weights_dtype=None, reward_model=None,
                           reward_fn=scripted_reward)


def run(ctx):
    rounds = iter(np.arange(6 * k, 6 * k + 6) for k in range(1, 10))
    state = SimpleNamespace(actor=SimpleNamespace(params=None))
    return ppo_step.sample(ctx, state, np.arange(6), step=0, timer=ppo_step.Timer(), draw=lambda: next(rounds))


def test_groups_without_signal_are_dropped_and_the_batch_refilled(caplog):
    ctx = make_ctx()
    with caplog.at_level("INFO", logger="jaxppo.step"):
        got, metrics = run(ctx)
    # each further round is announced (a step of many rounds is minutes long on a GPU)
    assert [r.getMessage() for r in caplog.records if "dynamic sampling" in r.getMessage()] == [
        "dynamic sampling, step 0: 2 of 4 prompts' groups with signal after round 1 of at most 10; another round of "
        "6 prompts"]
    # round 1: prompts 0..5 -> 2 and 5 have signal; round 2: 6..11 -> 8 and 11: four prompts, the batch is full
    assert got.rows.tolist() == [2, 5, 8, 11] and ctx.engine.calls == 2
    assert metrics == {"batch/num_gen_batches": 2.0, "batch/generated_groups": 12.0, "batch/dropped_groups": 8.0,
                       "batch/filled_groups": 0.0}
    ro = got.rollouts
    assert ro.prompt_index.tolist() == [0, 0, 1, 1, 2, 2, 3, 3] and got.scores.tolist() == [0, 1] * 4
    assert ro.response_ids[:, 0].tolist() == [2, 2, 5, 5, 8, 8, 11, 11]  # each group's own samples


def test_filtering_on_acc_uses_the_score_of_a_function_that_returns_a_number():
    """verl's reward managers log acc = score for a function that returns a number, so its DAPO recipes'
    `filter_groups.metric=acc` works with one; a function's own 'acc' entry wins."""
    ctx = make_ctx("algorithm.filter_groups.metric=acc")
    got, metrics = run(ctx)
    assert got.rows.tolist() == [2, 5, 8, 11] and metrics["batch/dropped_groups"] == 8.0
    ctx = make_ctx("algorithm.filter_groups.metric=acc", "algorithm.filter_groups.max_num_gen_batches=2")
    ctx.reward_fn = acc_reward
    got, metrics = run(ctx)
    assert got.rows.tolist()[0] == 0 and metrics["batch/filled_groups"] > 0


def test_the_batch_is_filled_when_the_rounds_run_out():
    ctx = make_ctx("algorithm.filter_groups.max_num_gen_batches=1")
    got, metrics = run(ctx)
    assert ctx.engine.calls == 1 and len(got.rows) == 4 and metrics["batch/filled_groups"] == 2.0
    assert got.rows.tolist()[:2] == [2, 5]  # the groups with signal first, then dropped ones


def test_without_filtering_one_round_and_overlong_shaping():
    ctx = make_ctx("algorithm.filter_groups.enable=false", "data.gen_batch_size=0", "reward.overlong_buffer.enable=true",
                   "reward.overlong_buffer.len=1", "reward.overlong_buffer.penalty_factor=0.5",
                   "data.max_response_length=2")
    state = SimpleNamespace(actor=SimpleNamespace(params=None))
    got, metrics = ppo_step.sample(ctx, state, np.arange(4), step=0, timer=ppo_step.Timer())
    assert metrics == {} and ctx.engine.calls == 1 and got.rows.tolist() == [0, 1, 2, 3]
    # every response has 2 tokens = R, 1 past R - len: penalty -0.5 on top of the scripted score
    want = np.array([scripted_reward(f"{t} {j}", "", {}) for t in range(4) for j in range(2)]) - 0.5
    np.testing.assert_allclose(got.scores, want)
    assert got.counts["extra/overlong"].tolist() == [1.0] * 8


@pytest.mark.parametrize("overrides,message", [
    (["algorithm.filter_groups.enable=true", "rollout.n=1"], "rollout.n >= 2"),
    (["algorithm.filter_groups.enable=true", "data.gen_batch_size=4", "data.train_batch_size=8"], "gen_batch_size"),
    (["data.gen_batch_size=512"], "used by algorithm.filter_groups.enable=true only"),
    (["reward.overlong_buffer.enable=true", "reward.overlong_buffer.len=300"], "reward.overlong_buffer.len"),
    (["algorithm.filter_groups.metric=bogus"], "algorithm.filter_groups.metric"),
])
def test_bad_dynamic_sampling_settings_are_refused(overrides, message):
    from jaxppo.config import validate
    from jaxppo.errors import ConfigError

    with pytest.raises(ConfigError, match=message):
        validate(load_config(None, ["algorithm.adv_estimator=grpo", "rollout.n=2", "actor.ppo_mini_batch_size=8",
                                    "critic.ppo_mini_batch_size=8", "data.train_batch_size=8", *overrides]), 1)
