"""jaxppo/host_plan.py: the pinned pool XLA's host allocator grows to, its cap, and the host check."""

import json
import os
from pathlib import Path

import pytest

from jaxppo.errors import ConfigError
from jaxppo.host_plan import (CAP_ENV, DEFAULT_CAP, FIRST_REGION, PROCESS_BYTES, GiB, HostPlan, cap_in_force,
                              pinned_pool, raised_cap, set_cap)

ROOT = Path(__file__).resolve().parents[1]
RECORD = ROOT / "docs/benchmarks/raw/config_check/2026-12-04_grpo-qwen2.5-7b_host_mappings_935eedf.json"


def bfc_regions(in_use: int, cap: int) -> list[int] | None:
    """tsl's BFCAllocator with allow_growth and no frees, written out: each allocation that the free space cannot
    hold extends the pool by the current region size (doubling after each extension), clipped to what the cap has
    left. Allocations here: 1 MiB each, as a stand-in for many arrays smaller than the regions."""
    regions, free, region, chunk = [], 0, FIRST_REGION, 2**20
    for _ in range(-(-in_use // chunk)):
        if free < chunk:
            left = cap - sum(regions)
            if left < chunk:
                return None
            regions.append(min(region, left))
            free += regions[-1]
            region *= 2
        free -= chunk
    return regions


@pytest.mark.parametrize("in_use_gb", [0.001, 0.5, 3.0, 31.9, 32.1, 57.73, 63.9])
def test_the_pool_is_what_the_allocator_grows_to(in_use_gb):
    in_use = int(in_use_gb * GiB)
    regions = bfc_regions(in_use, DEFAULT_CAP)
    assert pinned_pool(in_use, DEFAULT_CAP) == sum(regions) >= in_use


def test_the_pool_matches_the_h200_record_of_the_7b_grpo_config():
    """On the H200 the 7B GRPO config's 57.73 GiB of host arrays sat in 15 pinned regions of 64.06 GiB (the
    process's /dev/zero mappings, sampled by scripts/host_memory.py): what the model says for them."""
    bench = json.loads(RECORD.read_text())
    bench = bench.get("bench", bench)
    summary = bench.get("summary", bench)
    arrays = summary["offload"]["host_arrays_gb"] * GiB
    pinned = next(g for g in summary["host_memory"]["maps"]["after the steps"]["groups"]
                  if g["name"].startswith("/dev/zero"))
    regions = bfc_regions(int(arrays), DEFAULT_CAP)
    assert len(regions) == 15 and pinned["n"] in (15, 16)  # the 16th: torch's own small pinned buffers
    assert abs(pinned_pool(int(arrays), DEFAULT_CAP) / GiB - pinned["rss"]) < 0.1
    # and the plan's peak for it, against the process's measured peak resident memory
    plan = HostPlan({"actor AdamW moments": int(arrays)}, DEFAULT_CAP, "default", pinned_pool(int(arrays),
                                                                                              DEFAULT_CAP), None)
    assert summary["host_memory"]["peaks"]["rss_peak"]["gb"] <= plan.peak / GiB


def test_past_the_cap_the_states_do_not_fit_and_the_plan_raises_the_cap_or_refuses(monkeypatch):
    in_use = 70 * GiB
    assert pinned_pool(in_use, DEFAULT_CAP) is None and bfc_regions(in_use, DEFAULT_CAP) is None
    monkeypatch.delenv(CAP_ENV, raising=False)
    cap, source = cap_in_force(in_use, can_raise=True)
    assert cap == raised_cap(in_use) >= in_use * 1.05 and "raised" in source
    assert pinned_pool(in_use, cap) is not None
    assert cap_in_force(in_use, can_raise=False)[0] == DEFAULT_CAP  # JAX already started: the default stands
    set_cap(in_use)
    assert int(os.environ[CAP_ENV]) * GiB == cap
    # a user's value wins, and is checked
    monkeypatch.setenv(CAP_ENV, "40")
    set_cap(in_use)
    assert os.environ[CAP_ENV] == "40"
    cap, source = cap_in_force(in_use, can_raise=True)
    plan = HostPlan({"actor AdamW moments": in_use}, cap, source, pinned_pool(in_use, cap), 10**15)
    with pytest.raises(ConfigError, match=f"{CAP_ENV}=40 in the environment.*at least {raised_cap(in_use) // GiB}"):
        plan.check()
    # under the default nothing is set
    monkeypatch.delenv(CAP_ENV)
    set_cap(10 * GiB)
    assert CAP_ENV not in os.environ


def test_the_host_check_counts_the_pool_and_the_process_not_the_arrays():
    in_use = 40 * GiB  # the pool grows to 64 GiB for it
    plan = HostPlan({"actor AdamW moments": in_use}, DEFAULT_CAP, "default", pinned_pool(in_use, DEFAULT_CAP),
                    int(60 * GiB / 0.9))
    assert plan.peak == 64 * GiB - FIRST_REGION + PROCESS_BYTES
    with pytest.raises(ConfigError, match="pinned pool 64.0 GiB"):
        plan.check()  # the arrays (40) fit 90% of 66.7 GiB; the pool and the process (76) do not
    HostPlan(plan.states, plan.cap, plan.cap_source, plan.pool, int(plan.peak / 0.9) + 1).check()
    assert HostPlan({}, DEFAULT_CAP, "default", 0, 0).peak == 0  # nothing offloaded: nothing counted or checked
