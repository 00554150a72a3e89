"""Validation metrics as verl computes them (mean@n, best@k / worst@k / maj@k by bootstrap, val-core / val-aux
names), checked against a literal re-statement of verl's loops, and `trainer.val_only` through real runs."""

from __future__ import annotations

import json
from collections import defaultdict

import numpy as np
import pytest

from jaxppo.validation import bootstrap, metric_names, process_validation_metrics, subset_sizes, summarise


# ------------------------------------------------------------------ the reference: verl's algorithm, loop by loop


def verl_bootstrap(data, subset_size, reduce_fns, n_bootstrap=1000, seed=42):
    np.random.seed(seed)
    lists = [[] for _ in reduce_fns]
    for _ in range(n_bootstrap):
        idx = np.random.choice(len(data), size=subset_size, replace=True)
        sample = [data[i] for i in idx]
        for i, fn in enumerate(reduce_fns):
            lists[i].append(fn(sample))
    return [(np.mean(v), np.std(v)) for v in lists]


def verl_maj(data):
    vote2vals = defaultdict(list)
    for d in data:
        vote2vals[d["pred"]].append(d["val"])
    counts = {k: len(v) for k, v in vote2vals.items()}
    return vote2vals[max(counts, key=counts.get)][0]


def reference_metrics(values, preds):
    out = {f"mean@{len(values)}": np.mean(values), f"std@{len(values)}": np.std(values)}
    for k in subset_sizes(len(values)):
        (bm, bs), (wm, ws) = verl_bootstrap(values, k, [np.max, np.min])
        out.update({f"best@{k}/mean": bm, f"best@{k}/std": bs, f"worst@{k}/mean": wm, f"worst@{k}/std": ws})
        [(mm, ms)] = verl_bootstrap([{"val": v, "pred": p} for v, p in zip(values, preds)], k, [verl_maj])
        out.update({f"maj@{k}/mean": mm, f"maj@{k}/std": ms})
    return out


@pytest.mark.parametrize("n", [2, 3, 5, 8])
def test_bootstrap_equals_verls_loops(n):
    rng = np.random.default_rng(n)
    values = rng.integers(0, 2, n).astype(float) * rng.uniform(0.5, 1.0, n)  # ties and distinct values
    preds = [str(x) for x in rng.integers(0, 3, n)]  # few answers: ties in the vote are common
    ours = {}
    for k in subset_sizes(n):
        ours.update(bootstrap(values, preds, k))
    ref = reference_metrics(list(values), preds)
    for key, value in ours.items():
        assert value == pytest.approx(ref[key], abs=1e-12), key
    assert set(ref) - set(ours) == {f"mean@{n}", f"std@{n}"}


def test_subset_sizes_are_verls():
    assert subset_sizes(2) == [2] and subset_sizes(4) == [2, 4] and subset_sizes(5) == [2, 4, 5]
    assert subset_sizes(16) == [2, 4, 8, 16]


def test_majority_vote_by_hand():
    # answers A A B, values 1 1 0: any draw of 3 whose majority is A scores 1; the vote's value is its first draw
    got = bootstrap(np.array([1.0, 1.0, 0.0]), ["A", "A", "B"], 3, n_bootstrap=4000)
    # P(majority A) over 3 draws with p(A) = 2/3: P(>= 2 A) = 3 (2/3)^2 (1/3) + (2/3)^3 = 20/27
    assert got["maj@3/mean"] == pytest.approx(20 / 27, abs=0.02)
    assert got["best@3/mean"] == pytest.approx(1 - (1 / 3) ** 3, abs=0.02)  # best is 1 unless all three are B


def test_names_core_and_aux_and_acc_as_the_core_variable():
    sources = ["a"] * 4 + ["b"] * 4
    uids = [0, 0, 1, 1, 2, 2, 3, 3]
    infos = {"reward": [1, 0, 1, 1, 0, 0, 1, 0], "pred": list("xyxxzzxy")}
    names = metric_names(process_validation_metrics(sources, uids, infos))
    assert names["val-core/a/reward/mean@2"] == pytest.approx((0.5 + 1.0) / 2)
    assert {"val-core/a/reward/best@2/mean", "val-core/a/reward/maj@2/mean", "val-aux/a/reward/worst@2/mean",
            "val-aux/a/reward/std@2", "val-core/b/reward/mean@2"} <= set(names)
    with_acc = metric_names(process_validation_metrics(sources, uids, {**infos, "acc": [1.0] * 8}))
    assert "val-core/a/acc/mean@2" in with_acc and "val-aux/a/reward/mean@2" in with_acc


def test_summarise_keeps_the_one_line_summary():
    records = [{"row": r, "source": s, "reward": v, "pred": None}
               for r, s, v in [(0, "a", 1.0), (0, "a", 0.0), (1, "b", 1.0), (1, "b", 1.0)]]
    out = summarise(records)
    assert out["val/score"] == 0.75 and out["val/a/score"] == 0.5 and out["val/b/score"] == 1.0
    assert out["val-core/a/reward/mean@2"] == 0.5 and out["val-core/b/reward/best@2/mean"] == 1.0


def test_a_user_functions_pred_is_the_vote_and_the_rules_extract_answers():
    from jaxppo.rewards import get_answer_extractor, score_batch

    res = score_batch(["s"] * 2, ["x", "y"], ["1", "1"],
                      reward_fn=lambda sol, gt, ex: {"score": 1.0, "pred": sol.upper(), "acc": 1})
    assert res.preds == ["X", "Y"] and set(res.extras) == {"acc"}
    gsm = get_answer_extractor("openai/gsm8k")
    assert gsm("so #### 1,200.") == gsm("#### 1200") == "1200" and gsm("no answer") is None
    boxed = get_answer_extractor("lighteval/MATH")
    assert boxed(r"\boxed{\frac{1}{2}}") == boxed(r"\boxed{ 1/2 }") == "1/2" and boxed(r"\boxed{x + 1}") == "x+1"


# ------------------------------------------------------------------ through the trainer


@pytest.mark.slow
def test_val_only_validates_the_newest_checkpoint_and_writes_none(tmp_path):
    from tests.train_helpers import FAST, ROOT, read_metrics, run_train

    run = tmp_path / "run"
    # a reward of the text itself (its CRC): a figure of the weights' greedy responses (the tiny model's answers
    # all score 0 this early)
    # two sampled responses per prompt, seeded: the same weights give the same samples
    common = [*FAST, f"custom_reward_function.path={ROOT / 'tests' / 'rewards' / 'user_reward.py'}",
              "custom_reward_function.name=digest", "rollout.val_kwargs.n=2", "rollout.val_kwargs.do_sample=true",
              "rollout.val_kwargs.temperature=1.0"]
    digest = "val-aux/synthetic/arithmetic/digest/mean@2"
    run_train(run, *common, "trainer.total_training_steps=2", "trainer.save_freq=2")
    m = read_metrics(run)
    for step in (1, 2):  # trained with the user's function: its score (the CRC's parity) and its extra entry
        assert 0 <= m[step]["critic/score/mean"] <= 1 and 0 <= m[step]["reward/extra/digest/mean"] < 1000
    assert m[0][digest] != m[2][digest]  # training moved the responses
    assert "val-core/synthetic/arithmetic/reward/best@2/mean" in m[2]
    ckpts = sorted(p.name for p in (run / "checkpoints").iterdir())
    # the training run's own validation settings: the same responses from the restored checkpoint
    res = run_train(run, *common, "trainer.val_only=true")
    assert "validated checkpoint" in res.stdout, res.stdout
    last = json.loads((run / "metrics.jsonl").read_text().splitlines()[-1])
    assert last["step"] == 2 and last[digest] == m[2][digest] and last["val/score"] == m[2]["val/score"]
    assert not any(k.startswith(("actor/", "critic/")) for k in last)
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ckpts  # nothing written


@pytest.mark.slow
def test_val_only_on_the_embedded_default_with_n_samples(tmp_path):
    from tests.train_helpers import FAST, run_train

    run = tmp_path / "run"
    res = run_train(run, *FAST, "trainer.val_only=true", "rollout.val_kwargs.n=4", "rollout.val_kwargs.temperature=1.0",
                    "rollout.val_kwargs.do_sample=true")
    # the built-in rule returns a number: acc = its score is the core variable, as verl's reward managers log it
    for key in ("val-core/synthetic/arithmetic/acc/mean@4", "val-core/synthetic/arithmetic/acc/best@4/mean",
                "val-core/synthetic/arithmetic/acc/maj@4/mean"):
        assert key in res.stdout
    rec = json.loads((run / "metrics.jsonl").read_text().splitlines()[-1])
    assert rec["val-aux/synthetic/arithmetic/reward/mean@4"] == rec["val-core/synthetic/arithmetic/acc/mean@4"]
    assert rec["step"] == 0 and rec["val-core/synthetic/arithmetic/acc/mean@4"] == pytest.approx(rec["val/score"])
    assert rec["val-core/synthetic/arithmetic/acc/best@4/mean"] >= rec["val/score"]
    assert not (run / "checkpoints").exists() and not (run / "warm_model").exists()  # nothing trained


def test_val_kwargs_are_checked():
    from jaxppo.config import load_config
    from jaxppo.errors import ConfigError

    with pytest.raises(ConfigError, match="rollout.val_kwargs.n"):
        load_config(None, ["rollout.val_kwargs.n=0"])
    with pytest.raises(ConfigError, match="do_sample=true needs"):
        load_config(None, ["rollout.val_kwargs.do_sample=true", "rollout.val_kwargs.temperature=0"])
