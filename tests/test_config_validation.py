"""Bad configuration exits with code 2 before anything is built: every key with a closed set of values, every
size relation the engine would otherwise assert, and a run that cannot fit the card's memory."""

from __future__ import annotations

import json
import re
import subprocess
import sys

import pytest

from jaxppo.config import CLOSED_SETS, _registry_sets
from jaxppo.errors import ConfigError
from jaxppo.train import main
from tests.train_helpers import ROOT, train_env

BAD = {"model.dtype": "fp8", "model.param_dtype": "fp8"}  # the value the audit found slipping through
CLOSED = [(key, BAD.get(key, "bogus")) for key in sorted({**CLOSED_SETS, **_registry_sets()})]
CLOSED.append(("trainer.logger", "[console,bogus]"))


def run_main(tmp_path, *overrides) -> tuple[int, str]:
    return main([f"trainer.default_local_dir={tmp_path / 'run'}", *overrides]), str(tmp_path / "run")


@pytest.mark.parametrize("key,value", CLOSED, ids=[k for k, _ in CLOSED])
def test_a_closed_set_key_with_an_unknown_value_exits_2(key, value, tmp_path, capsys):
    rc, run = run_main(tmp_path, f"{key}={value}")
    err = capsys.readouterr().err
    assert rc == 2, err
    assert key in err and "known" in err and "Traceback" not in err, err
    assert not (tmp_path / "run").exists()  # no run directory, data or model written


# the audit's example: 8 prompts x 4 samples, and the default's forward micro-batch of 256 sequences per device
SMALL_BATCH = ["data.train_batch_size=8", "actor.ppo_mini_batch_size=8", "critic.ppo_mini_batch_size=8",
               "actor.ppo_micro_batch_size_per_device=32", "critic.ppo_micro_batch_size_per_device=32"]
RELATIONS = [
    # the default's forward micro-batch (256 sequences per device) does not divide 8 prompts x 4 samples
    (SMALL_BATCH, "log_prob_micro_batch_size_per_device"),
    (["actor.ppo_micro_batch_size_per_device=3"], "actor.ppo_micro_batch_size_per_device (3)"),
    (["actor.ppo_mini_batch_size=24"], "does not divide data.train_batch_size"),
    (["rollout.top_p=1.5"], "rollout.top_p"),
    (["rollout.top_k=0"], "rollout.top_k"),
    (["algorithm.adv_estimator=grpo", "rollout.n=1"], "rollout.n >= 2"),
    (["actor.use_dynamic_bsz=true", "actor.ppo_max_token_len_per_device=16"], "smaller than one sequence"),
    (["rollout.gpu_memory_utilization=0.97"], "rollout.gpu_memory_utilization"),
    (["reward.timeout_s=-1"], "reward.timeout_s"),
    (["actor.tis_threshold=-1"], "actor.tis_threshold"),
    (["trainer.max_to_keep=0"], "trainer.max_to_keep"),
    (["trainer.resume_mode=/no/such/checkpoint"], "trainer.resume_mode"),
    (["model.path=/no/such/model"], "model.path"),
    (["mesh.data=4"], "needs 4 devices"),
    (["custom_reward_function.path=/no/such/reward.py"], "custom_reward_function.path: /no/such/reward.py does not"),
    ([f"custom_reward_function.path={ROOT / 'tests' / 'rewards' / 'user_reward.py'}", "custom_reward_function.name=nope"],
     "custom_reward_function.name:"),
    (["actor.lora_rank=-1"], "actor.lora_rank must be >= 0"),
    (["actor.lora_rank=8", "actor.target_modules=q_proj,lm_head"], "actor.target_modules 'q_proj,lm_head': unknown"),
    (["critic.lora_rank=8", "critic.lora_alpha=0"], "critic.lora_alpha must be positive"),
    (["actor.lora_rank=8", "mesh.fsdp_gather=update"], "needs mesh.fsdp_gather=layer"),
]


@pytest.mark.parametrize("overrides,message", RELATIONS, ids=[r[1][:40] for r in RELATIONS])
def test_impossible_sizes_and_paths_are_refused(overrides, message):
    """What `jaxppo.train` checks before building anything, for one device (this test process has eight)."""
    from jaxppo.config import load_config, validate, validate_paths
    from jaxppo.errors import ConfigError

    with pytest.raises(ConfigError, match=re.escape(message)):
        cfg = load_config("configs/default.yaml", overrides)
        validate(cfg, 1)
        validate_paths(cfg)


def run_cli(tmp_path, *overrides) -> subprocess.CompletedProcess:
    """`python -m jaxppo.train` as a user runs it: one device."""
    return subprocess.run([sys.executable, "-m", "jaxppo.train", f"trainer.default_local_dir={tmp_path / 'run'}",
                           *overrides], capture_output=True, text=True, timeout=300, env=train_env(), cwd=ROOT)


def test_a_size_relation_exits_2_from_the_command_line(tmp_path):
    res = run_cli(tmp_path, *SMALL_BATCH)
    assert res.returncode == 2 and "log_prob_micro_batch_size_per_device" in res.stderr, res.stderr[-2000:]
    assert "Traceback" not in res.stderr and not (tmp_path / "run").exists()


@pytest.fixture(scope="module")
def shapes(tmp_path_factory):
    from scripts.shapes import write_config_dir

    d = tmp_path_factory.mktemp("shapes")
    return {name: write_config_dir(name, d / name) for name in ("qwen2.5-0.5b", "qwen2.5-7b")}


def test_a_run_that_cannot_fit_the_card_exits_2_and_says_what_to_change(shapes, tmp_path):
    res = run_cli(tmp_path, f"model.path={shapes['qwen2.5-7b']}", "model.random_init=true",
                  "trainer.device_memory_gb=141", "actor.use_kl_loss=true")
    err = res.stderr
    assert res.returncode == 2, err[-3000:]
    assert "does not fit the card" in err and "mesh.fsdp=" in err and "memory plan per device" in err
    assert "actor (weights + AdamW)" in err
    assert not (tmp_path / "run").exists()


def test_the_memory_plan_budgets_follow_the_card(shapes):
    from jaxppo import memory
    from jaxppo.config import load_config

    def plan(gb, *extra):
        cfg = load_config("configs/gsm8k_qwen2.5_0.5b.yaml", [f"model.path={shapes['qwen2.5-0.5b']}",
                                                              f"trainer.device_memory_gb={gb}", *extra])
        return memory.plan_for_config(cfg, 1)

    big_est, big = plan(141)
    small_est, small = plan(40)
    assert big_est.fits and small_est.fits
    assert small.actor_update < big.actor_update and small.critic_update <= big.critic_update
    assert small_est.total <= small_est.jax_limit
    # a user's budget is taken as given, and checked: too large for the small card is refused
    est, given = plan(40, "actor.ppo_max_token_len_per_device=32768")
    assert given.actor_update == 32768
    cfg = load_config("configs/gsm8k_qwen2.5_0.5b.yaml", [f"model.path={shapes['qwen2.5-0.5b']}",
                                                          "trainer.device_memory_gb=40",
                                                          "actor.ppo_max_token_len_per_device=32768"])
    with pytest.raises(ConfigError, match="lower actor.ppo_max_token_len_per_device"):
        memory.check(cfg, est, given)
    json.dumps(vars(big))  # the budgets are plain numbers (they go to the ledger)
