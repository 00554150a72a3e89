"""The memory plan against what XLA asked for on the H200, as the benchmark ledger records it: the plan must be an
upper bound of every recorded request and peak (else a planned run can run out of memory), and a tight one
(else the budgets it picks leave the card idle)."""

from __future__ import annotations

from pathlib import Path

import pytest

from scripts import ledger

ROOT = Path(__file__).resolve().parents[1]
H200_GB = 139.8  # what the H200 reports (memory_stats bytes_limit / fraction)
BUDGET_KEYS = {"actor_update": "actor.ppo_max_token_len_per_device",
               "actor_forward": "actor.log_prob_max_token_len_per_device",
               "critic_update": "critic.ppo_max_token_len_per_device",
               "critic_forward": "critic.forward_max_token_len_per_device"}


def ledger_rows(bench: str) -> list[dict]:
    return [r for r in ledger.read() if r["bench"] == bench]


@pytest.fixture(scope="module")
def shape_dir(tmp_path_factory):
    from scripts.shapes import write_config_dir

    d = tmp_path_factory.mktemp("shapes")
    return lambda name: write_config_dir(name, d / name)


def plan(shape_dir, row: dict, extra: list[str]):
    """(the memory estimate, each phase's bytes) of a ledger row's config on the H200, with `extra` overrides."""
    from jaxppo import memory
    from jaxppo.config import load_config, uses_critic
    from jaxppo.models.config import load_config as load_model_config

    cfg = load_config(str(ROOT / row["config"]), [*row.get("overrides", []), *extra,
                                                  f"model.path={shape_dir(row['shape'])}",
                                                  f"trainer.device_memory_gb={H200_GB}"])
    est, budgets = memory.plan_for_config(cfg, 1)
    model = load_model_config(cfg.model.path)[0]
    critic = model if uses_critic(cfg) else None
    return est, memory.phases(cfg, model, critic, 1, budgets)


def test_jax_takes_its_share_of_the_card_in_one_allocation():
    """Grown on demand, XLA's allocator adds doubling regions it never returns, and an update's temporaries (one
    buffer) then fit neither those regions' free chunks nor what is left to grow into (docs/memory.md)."""
    from jaxppo import memory

    env = memory.plan(0.2)
    assert env == {"XLA_PYTHON_CLIENT_PREALLOCATE": "true", "XLA_PYTHON_CLIENT_MEM_FRACTION": "0.750"}
    with pytest.raises(ValueError, match="gpu_memory_utilization"):
        memory.plan(0.96)


def test_the_plan_bounds_every_request_xla_made(shape_dir):
    rows = ledger_rows("memory_requests")
    requests = [(row, q) for row in rows for q in row["figures"]["requests"]]
    assert len(requests) >= 4
    for row, q in requests:
        key = BUDGET_KEYS[q["phase"].replace(" ", "_")]
        tokens = q.get("row_tokens", q["budget"])  # the plan assumes rows as long as the budget
        _, phases = plan(shape_dir, row, [f"{key}={tokens}"])
        planned = sum(phases[q["phase"]].values()) / 2**30
        assert q["gib"] <= planned <= 1.1 * q["gib"], (q, planned)


def test_the_plan_bounds_the_peaks_measured_through_the_trainer(shape_dir):
    """Each step benchmark's peak (XLA's peak_bytes_in_use over 10 steps) under the plan at its token budgets,
    overhead included (the buffers that live beside the planned components: batches, outputs, workspaces)."""
    rows = [r for r in ledger_rows("ppo_step") if "memory/jax_peak_gb" in r["figures"] and r.get("token_budgets")]
    assert {r["config"] for r in rows} >= {"configs/gsm8k_qwen2.5_0.5b.yaml", "configs/gsm8k_qwen2.5_1.5b.yaml",
                                           "configs/gsm8k_qwen2.5_7b_lora.yaml"}
    for row in rows:
        has_critic = "perf/mfu/critic" in row["figures"]  # critic-free runs' critic budgets are not config keys
        given = [f"{BUDGET_KEYS[k]}={v}" for k, v in row["token_budgets"].items()
                 if v and (has_critic or k.startswith("actor"))]
        est, _ = plan(shape_dir, row, given)
        planned = est.total / 2**30
        measured = row["figures"]["memory/jax_peak_gb"]
        assert measured <= planned, (row["config"], row["commit"], measured, planned)
