"""`python -m jaxppo.compare logits`: runs both frameworks and reports parity as JSON."""

import json

import pytest

from tests.helpers import make_hf_checkpoint

from jaxppo.compare import main


def test_compare_logits_json_line(tiny_qwen, capsys):
    assert main(["--model", str(tiny_qwen), "--batch", "3", "--seq", "12", "--seed", "7"]) == 0
    report = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    for key in ("max_abs_logit_diff", "max_rel_logit_diff", "max_abs_logprob_diff"):
        assert key in report
    assert report["max_abs_logit_diff"] <= 1e-4 and report["max_abs_logprob_diff"] <= 1e-4
    assert report["valid_tokens"] < 3 * 12  # the batch really was padded


def test_compare_explicit_subcommand_bf16(tiny_qwen, capsys):
    assert main(["logits", "--model", str(tiny_qwen), "--dtype", "bfloat16", "--batch", "2", "--seq", "8"]) == 0
    report = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert report["dtype"] == "bfloat16" and 0 < report["max_abs_logprob_diff"] < 0.5


# ppo-step: one PPO step in jaxppo and in the plain torch reference (bridge/reference.py), jaxppo's default
# optimizer settings, lr raised so the second mini-batch sees a moved policy (ratio != 1, clipping active).
# Checked (<= 1e-4): log-probs, values, rewards, advantages, returns, losses, KL, clip fractions, entropies,
# gradient norms, each mini-batch's full gradient, and each framework's optimizer step against AdamW in float64
# on its own gradients (+ what float32 storage of the parameters rounds). The parameter update is checked against
# the difference float64 AdamW predicts from the two gradient sequences: Adam divides each element by its own
# magnitude, so near-zero gradient elements (rounding noise in both frameworks) make the update differ by more
# than the gradients do.
PARITY = ["actor.optim.lr=1e-3", "critic.optim.lr=1e-3"]


@pytest.fixture(scope="module")
def ref_policy(tmp_path_factory):
    return make_hf_checkpoint(tmp_path_factory.mktemp("ref_policy"), "qwen2", seed=11)


def check_report(report: dict) -> dict:
    rows = {r["quantity"]: r for r in report["rows"]}
    for name in ("old_logprobs", "values", "advantages", "returns", "actor/pg_loss[1]", "actor/ppo_kl[1]",
                 "actor/grad_norm[0]", "actor/grad_norm[1]", "critic/vf_loss[1]", "critic/grad_norm[1]",
                 "actor/gradient[0]", "actor/gradient[1]", "critic/gradient[1]", "actor/param_update",
                 "critic/param_update", "actor/optimizer_step (jax vs float64 AdamW)",
                 "critic/optimizer_step (torch vs float64 AdamW)"):
        assert name in rows, name
    assert rows["actor/pg_clipfrac[1]"]["torch"] > 0  # the second mini-batch really is off-policy
    # each row says what its difference is divided by; a loss near 0 by the scale of what it is made of
    assert all(r.get("relative_to") for r in rows.values()), [q for q, r in rows.items() if not r.get("relative_to")]
    assert "mean |advantage|" in rows["actor/pg_loss[1]"]["relative_to"]
    assert "mean |log-prob|" in rows["actor/ppo_kl[1]"]["relative_to"]
    assert rows["actor/param_update"]["relative_to"] == "||torch's update|| (L2)"
    # fp32: 1e-4 for all but the optimizer steps and updates, whose tolerance adds what float32 storage rounds
    assert all(r["tolerance"] == 1e-4 for q, r in rows.items() if "optimizer_step" not in q and "update" not in q)
    bad = {q: (r["rel_diff"], r["tolerance"]) for q, r in rows.items() if r["rel_diff"] > r["tolerance"]}
    assert not bad and report["failed"] == [], bad
    for name in ("actor", "critic"):  # at lr 1e-3 the storage rounding is small beside the step
        assert rows[f"{name}/optimizer_step (jax vs float64 AdamW)"]["tolerance"] < 2e-4
    for name in ("actor", "critic"):  # the update's difference is what the gradients' difference predicts
        r = rows[f"{name}/param_update"]
        assert r["torch"] > 0 and r["rel_diff"] == pytest.approx(r["predicted"], rel=0.2, abs=2e-5), r
    return rows


# (token-mean, no KL, no reference policy) runs on two more checkpoints below
@pytest.mark.parametrize("agg,kl", [("token-mean", "in_reward"), ("seq-mean-token-sum", "as_loss"),
                                    ("token-mean", "full")])
def test_ppo_step_matches_torch_reference(agg, kl, tiny_qwen, ref_policy, capsys):
    extra = {"none": [], "in_reward": ["algorithm.use_kl_in_reward=true", "algorithm.kl_ctrl.kl_coef=0.1"],
             "as_loss": ["actor.use_kl_loss=true", "actor.kl_loss_coef=0.1"],
             "full": ["actor.use_kl_loss=true", "actor.kl_loss_coef=0.1", "actor.kl_loss_type=full"]}[kl]
    ref = ["--ref", str(ref_policy)] if kl != "none" else []
    assert main(["ppo-step", "--model", str(tiny_qwen), *ref, "--batch", "32", "--seed", "3", *PARITY,
                 f"actor.loss_agg_mode={agg}", f"critic.loss_agg_mode={agg}", *extra]) == 0
    rows = check_report(json.loads(capsys.readouterr().out.strip().splitlines()[-1]))
    if kl != "none":
        assert "ref_logprobs" in rows
        assert abs(rows["ref_logprobs"]["torch"] - rows["old_logprobs"]["torch"]) > 0.1  # a different policy
    if kl == "in_reward":  # the KL penalty reaches every response token, not only the scored last one
        assert rows["token_rewards"]["jax"] != pytest.approx(0.0, abs=1e-3)
    if kl in ("as_loss", "full"):
        assert "actor/kl_loss[1]" in rows and rows["actor/kl_loss[1]"]["torch"] > 0


@pytest.mark.slow
@pytest.mark.parametrize("family,seed,kw", [("qwen2", 99, dict(vocab_size=277, tie=False)),
                                            ("llama", 5, dict(vocab_size=150, tie=True))])
def test_ppo_step_parity_holds_on_other_checkpoints(family, seed, kw, tmp_path, capsys):
    model = make_hf_checkpoint(tmp_path / "m", family, seed=seed, **kw)
    assert main(["ppo-step", "--model", str(model), "--batch", "32", "--seed", "3", *PARITY]) == 0
    check_report(json.loads(capsys.readouterr().out.strip().splitlines()[-1]))


def test_ppo_step_rejects_a_batch_that_does_not_split(tiny_qwen, capsys):
    assert main(["ppo-step", "--model", str(tiny_qwen), "--batch", "12"]) == 2
    assert "--mini-batches" in capsys.readouterr().err


def test_compare_logits_qwen3(tiny_qwen3, capsys):
    assert main(["--model", str(tiny_qwen3), "--batch", "3", "--seq", "12"]) == 0
    report = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert report["max_abs_logit_diff"] <= 1e-4 and report["valid_tokens"] < 3 * 12
