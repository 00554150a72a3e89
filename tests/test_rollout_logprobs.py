"""Which samples the engine returns log-probs for, and the mismatch metrics over exactly those."""

import numpy as np
import pytest

from jaxppo.config import load_config
from jaxppo.metrics import rollout_metrics
from jaxppo.rollout import pack_responses
from jaxppo.step import MISMATCH_EVERY, rollout_sampling


@pytest.mark.parametrize("overrides,always", [
    ([], False),
    (["rollout.calculate_log_probs=true"], True),
    (["actor.tis_threshold=2.0"], True),  # truncated IS trains on every token's engine log-prob
])
def test_rollout_sampling_asks_for_what_is_used(overrides, always):
    cfg = load_config("configs/default.yaml", overrides)
    asked = [rollout_sampling(cfg, 3, step).logprobs for step in range(2 * MISMATCH_EVERY + 1)]
    assert asked == [always or step % MISMATCH_EVERY == 0 for step in range(2 * MISMATCH_EVERY + 1)]
    s = rollout_sampling(cfg, 3, 1)
    assert (s.n, s.temperature, s.max_tokens, s.seed) == (cfg.rollout.n, cfg.rollout.temperature,
                                                          cfg.data.max_response_length, 3)


def test_pack_responses_marks_unasked_logprobs_nan():
    samples = [([5, 6, 7], [-0.5, -1.0, -1.5], "length"), ([5], [-0.25], "stop")] * 2  # 2 prompts x 2 samples
    ro = pack_responses(samples, 4, 0, n=2)
    np.testing.assert_array_equal(ro.logprobs[0], [-0.5, -1.0, -1.5, 0.0])
    np.testing.assert_array_equal(ro.logprobs[1], [-0.25, 0.0, 0.0, 0.0])
    unasked = pack_responses(samples, 4, 0, n=2, logprobs=False)
    assert np.isnan(unasked.logprobs).all()
    np.testing.assert_array_equal(unasked.response_ids, ro.response_ids)
    np.testing.assert_array_equal(unasked.response_mask, ro.response_mask)


def _mismatch_reference(trainer_lp, rollout_lp, mask):
    m = mask > 0
    pt, pr = np.exp(trainer_lp[m].astype(np.float64)), np.exp(rollout_lp[m].astype(np.float64))
    return {"rollout/probs_diff_mean": np.mean(np.abs(pt - pr)), "rollout/probs_diff_max": np.max(np.abs(pt - pr)),
            "rollout/probs_pearson": np.corrcoef(pt, pr)[0, 1],
            "rollout/logprob_diff_mean": np.mean(np.abs(trainer_lp[m] - rollout_lp[m]))}


def test_mismatch_metrics_over_the_asked_samples_only():
    rng = np.random.default_rng(0)
    b, r = 16, 8
    trainer_lp = -rng.exponential(1.0, (b, r)).astype(np.float32)
    rollout_lp = (trainer_lp + rng.normal(0, 0.05, (b, r))).astype(np.float32)
    rmask = (np.arange(r)[None] < rng.integers(1, r + 1, b)[:, None]).astype(np.float32)
    asked = np.arange(b) % 4 == 0
    engine_lp = np.where(asked[:, None], rollout_lp, np.nan).astype(np.float32)
    g = {"scores": rng.normal(size=b), "rewards": rng.normal(size=b), "adv": rng.normal(size=(b, r)),
         "ret": rng.normal(size=(b, r)), "lengths": rmask.sum(-1), "prompt_lengths": np.full(b, 5.0),
         "rmask": rmask, "sampling_lp": trainer_lp, "rollout_lp": engine_lp}
    got = rollout_metrics(g, 0, 0.001, r)
    want = _mismatch_reference(trainer_lp, rollout_lp, rmask * asked[:, None])
    for k, v in want.items():
        np.testing.assert_allclose(got[k], v, rtol=1e-4, atol=1e-6, err_msg=k)
    g["rollout_lp"] = np.full_like(engine_lp, np.nan)
    assert "rollout/logprob_diff_mean" not in rollout_metrics(g, 0, 0.001, r)
