"""Every committed GPU config checked at the commit it is quoted at: each config under configs/ that uses vLLM (on
random weights of its model's shape) and the Qwen3 shapes through the GRPO configs, each in a fresh process for a
few steps with no overrides, one ledger row `"bench": "config_check"` per config: config, shape, commit, exit code,
the plan's peak and each phase's program beside JAX's measured peak (`plan_gb`, `jax_peak_gb`), and, for a config
refused at start (exit 2), the refusal's first lines.

    python scripts/check_configs.py                         # everything (several device calls' worth)
    python scripts/check_configs.py --only qwen2.5-0.5b,qwen3-0.6b --steps 3 --ledger $OUT/results.jsonl
    python scripts/check_configs.py --only qwen2.5-7b-lora --steps 10 --step-rows   # + the run's `ppo_step` row
    python scripts/check_configs.py --list                  # what would run
    python scripts/check_configs.py --latest                # each check's latest ledger row, a markdown table

A config runs through scripts/bench_ppo_step.py --no-standalone: the synthetic task's prompts through the real data
and reward code, random weights of the model's shape (scripts/shapes.py).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

# (name, config, shape, overrides): the committed configs on their own model's shape, and the Qwen3 shapes through
# the GRPO configs (8B with LoRA: the 7B LoRA config's recipe on Qwen3-8B)
CHECKS = [
    ("qwen2.5-0.5b", "configs/gsm8k_qwen2.5_0.5b.yaml", "qwen2.5-0.5b", []),
    ("qwen2.5-1.5b", "configs/gsm8k_qwen2.5_1.5b.yaml", "qwen2.5-1.5b", []),
    ("qwen2.5-0.5b-ahead", "configs/gsm8k_qwen2.5_0.5b_ahead.yaml", "qwen2.5-0.5b", []),
    ("qwen2.5-1.5b-ahead", "configs/gsm8k_qwen2.5_1.5b_ahead.yaml", "qwen2.5-1.5b", []),
    ("qwen2.5-7b-lora", "configs/gsm8k_qwen2.5_7b_lora.yaml", "qwen2.5-7b", []),
    ("qwen2.5-7b-lora-ahead", "configs/gsm8k_qwen2.5_7b_lora_ahead.yaml", "qwen2.5-7b", []),
    ("qwen2.5-7b-lora-bypass", "configs/gsm8k_qwen2.5_7b_lora_bypass.yaml", "qwen2.5-7b", []),
    ("qwen2.5-7b", "configs/gsm8k_qwen2.5_7b.yaml", "qwen2.5-7b", []),
    # the change its refusal on one card names (the mesh to the devices present): the memory plan's refusal then,
    # whose own suggestions lead to the offload config below
    ("qwen2.5-7b-one-card", "configs/gsm8k_qwen2.5_7b.yaml", "qwen2.5-7b", ["mesh.fsdp=1"]),
    ("grpo-qwen2.5-7b", "configs/gsm8k_grpo_qwen2.5_7b.yaml", "qwen2.5-7b", []),
    ("qwen2.5-7b-offload", "configs/gsm8k_qwen2.5_7b_offload.yaml", "qwen2.5-7b", []),
    ("grpo-qwen2.5-0.5b", "configs/gsm8k_grpo_qwen2.5_0.5b.yaml", "qwen2.5-0.5b", []),
    ("grpo-qwen2.5-1.5b", "configs/gsm8k_grpo_qwen2.5_1.5b.yaml", "qwen2.5-1.5b", []),
    # random weights score 0 on every sample, so dynamic sampling drops every group and each step would run all 10
    # generation rounds of 6144 sequences (~10 min a step on an H200, measured at ebd1c06: the check ran out of
    # time in step 1); 2 rounds a step exercise the refill and the fill with dropped groups, and every round is
    # the same program and the same vLLM batch as the config's
    ("dapo-qwen2.5-0.5b", "configs/gsm8k_dapo_qwen2.5_0.5b.yaml", "qwen2.5-0.5b",
     ["algorithm.filter_groups.max_num_gen_batches=2"]),
    ("drgrpo-qwen2.5-0.5b", "configs/gsm8k_drgrpo_qwen2.5_0.5b.yaml", "qwen2.5-0.5b", []),
    ("gspo-qwen2.5-0.5b", "configs/gsm8k_gspo_qwen2.5_0.5b.yaml", "qwen2.5-0.5b", []),
    ("qwen3-0.6b", "configs/gsm8k_grpo_qwen2.5_0.5b.yaml", "qwen3-0.6b", []),
    ("qwen3-1.7b", "configs/gsm8k_grpo_qwen2.5_1.5b.yaml", "qwen3-1.7b", []),
    ("qwen3-4b", "configs/gsm8k_grpo_qwen2.5_1.5b.yaml", "qwen3-4b", []),
    ("qwen3-8b-lora", "configs/gsm8k_qwen2.5_7b_lora.yaml", "qwen3-8b", []),
]
# what one H200 must refuse at start (exit 2, naming the change): the 7B PPO config's mesh asks for 8 devices; on one,
# its states alone (178 GiB) exceed the card, and the change it names (offload) is qwen2.5-7b-offload
REFUSED_ON_ONE_CARD = {"qwen2.5-7b", "qwen2.5-7b-one-card"}


def vllm_configs() -> list[str]:
    """The committed configs whose rollouts use vLLM (each must appear in CHECKS: a test keeps them equal), as
    loaded (a config's engine may come from the files its `defaults:` list names)."""
    from jaxppo.config import load_config

    return [f"configs/{p.name}" for p in sorted((ROOT / "configs").glob("*.yaml"))
            if load_config(p).rollout.engine == "vllm"]


def run_one(name: str, config: str, shape: str, overrides: list[str], steps: int, timeout: float,
            workdir: Path, step_rows: str | None = None) -> dict:
    """One config in a fresh process: (exit code, its bench JSON or refusal, seconds). `step_rows`: the ledger the
    run's own `ppo_step` row goes to ("" for the repo's), else none."""
    out_json = workdir / f"{name}.json"
    log = workdir / f"{name}.log"
    ledger_args = ["--no-ledger"] if step_rows is None else (["--ledger", step_rows] if step_rows else [])
    cmd = [sys.executable, str(ROOT / "scripts" / "bench_ppo_step.py"), "--config", config, "--shape", shape,
           "--steps", str(steps), "--no-standalone", *ledger_args, "--json-out", str(out_json),
           "--workdir", str(workdir / name), *overrides]
    t0 = time.perf_counter()
    with open(log, "w") as f:
        try:
            rc = subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT, timeout=timeout, cwd=ROOT).returncode
        except subprocess.TimeoutExpired:
            rc = 124
    took = time.perf_counter() - t0
    text = log.read_text(errors="replace")
    result = {"name": name, "config": config, "shape": shape, "overrides": overrides, "exit_code": rc,
              "seconds": round(took, 1), "out_of_memory": "RESOURCE_EXHAUSTED" in text or "out of memory" in text}
    if out_json.is_file():
        result["bench"] = json.loads(out_json.read_text())
    if rc != 0:
        lines = [ln for ln in text.splitlines() if ln.startswith(("error:", "config error:", "  "))]
        result["refusal"] = "\n".join(lines[:12]) if rc == 2 else text[-3000:]
    return result


def row_of(result: dict, steps: int) -> dict:
    from scripts import ledger

    figures = {"exit_code": result["exit_code"], "seconds": result["seconds"],
               "out_of_memory": result["out_of_memory"]}
    bench = (result.get("bench") or {}).get("summary")
    if bench:
        med = bench["median_steps_3_to_n"]
        figures.update({
            "plan_gb": bench["memory_estimate_gb"], "plan_margin_gb": bench.get("memory_margin_gb"),
            "jax_peak_gb": max(bench.get("jax_peak_gb_per_step", [med.get("memory/jax_peak_gb", 0.0)])),
            "plan_phases_gb": {k: v for k, v in bench["memory_plan_gb"].items()},
            "held_gb": bench["memory_held_gb"], "token_budgets": bench.get("token_budgets"),
            "vllm_utilization": bench.get("vllm_utilization"),
            "vllm_sequences_at_once": bench.get("vllm_sequences_at_once"),
            "timing_s/step": med.get("timing_s/step"), "compiles_per_step": bench.get("compiles_per_step"),
            "late_compiles": bench.get("late_compiles")})
        if "host_memory" in bench:  # the process's host memory (scripts/host_memory.py) beside the plan's host bytes
            peaks = bench["host_memory"]["peaks"]
            figures.update({"plan_host_gb": (bench.get("offload") or {}).get("host_gb", 0.0),
                            "plan_host_peak_gb": (bench.get("offload") or {}).get("plan_host_peak_gb", 0.0),
                            "host_peak_gb": {k: v["gb"] for k, v in peaks.items()},
                            "host_peak_phase": {k: v["phase"] for k, v in peaks.items()}})
    if "refusal" in result:
        figures["refusal"] = result["refusal"]
    cmd = f"python scripts/check_configs.py --only {result['name']} --steps {steps}"
    return ledger.make_row("config_check", figures, config=result["config"], overrides=result["overrides"],
                           command=cmd, shape=result["shape"], check=result["name"], samples={"steps": steps})


def latest(rows: list[dict]) -> list[dict]:
    """Each check's latest `config_check` row (None where it never ran), in CHECKS' order."""
    last = {r["check"]: r for r in rows if r.get("bench") == "config_check"}
    return [last.get(name) for name, *_ in CHECKS]


def latest_table(rows: list[dict]) -> str:
    """A markdown table of each check's latest row: commit, exit code, steps, the plan's states + program and the
    margin it reserves beside JAX's measured peak, the plan's total over the peak (issue: peak <= total <= 1.10 x
    peak), compiles after the start, the step's seconds (the median of steps 3.. in a 10-step row)."""
    lines = ["| check | config (shape) | commit, date | exit | steps | plan + margin (GiB) | JAX peak (GiB) | "
             "total / peak | late compiles | step (s) |", "|---|---|---|---|---|---|---|---|---|---|"]
    for (name, config, shape, overrides), r in zip(CHECKS, latest(rows)):
        what = f"`{Path(config).name}` ({shape}{', ' + ' '.join(overrides) if overrides else ''})"
        if r is None:
            lines.append(f"| {name} | {what} | never run | | | | | | | |")
            continue
        f = r["figures"]
        cells = ["", "", "", "", ""]
        if f.get("jax_peak_gb"):
            margin = f.get("plan_margin_gb") or 0.0
            cells = [f"{f['plan_gb']:.3f} + {margin:.1f}", f"{f['jax_peak_gb']:.3f}",
                     f"{(f['plan_gb'] + margin) / f['jax_peak_gb']:.3f}", str(len(f.get("late_compiles") or [])),
                     f"{f.get('timing_s/step') or 0:.2f}"]
        exit_ = f"{f['exit_code']}" + (" (refused)" if f["exit_code"] == 2 else "") + \
            (" OUT OF MEMORY" if f["out_of_memory"] else "")
        lines.append(f"| {name} | {what} | {r['commit']}, {r['date']} | {exit_} | {r['samples']['steps']} | "
                     + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--only", default="", help="comma list of check names (default: all)")
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--timeout", type=float, default=900.0, help="seconds per config")
    p.add_argument("--workdir", default="/tmp/jaxppo_check_configs")
    p.add_argument("--ledger", default=None, help="ledger file for the rows (default: the repo's)")
    p.add_argument("--step-rows", action="store_true",
                   help="also record each run's own `ppo_step` row (its step phases; with --steps >= 10 the row a "
                        "figure quotes), so one run gives both rows")
    p.add_argument("--list", action="store_true")
    p.add_argument("--latest", action="store_true", help="print each check's latest ledger row as a markdown table")
    args = p.parse_args(argv)
    chosen = [c for c in CHECKS if not args.only or c[0] in args.only.split(",")]
    if args.list:
        for c in chosen:
            print(*c[:3])
        return 0
    from scripts import ledger

    if args.latest:
        print(latest_table(ledger.read(args.ledger)))
        return 0

    workdir = Path(args.workdir)
    workdir.mkdir(parents=True, exist_ok=True)
    failed = 0
    for name, config, shape, overrides in chosen:
        result = run_one(name, config, shape, overrides, args.steps, args.timeout, workdir,
                         (args.ledger or "") if args.step_rows else None)
        row = row_of(result, args.steps)
        ledger.append(row, args.ledger)
        f = row["figures"]
        print(f"{name:<22} exit {f['exit_code']}  {f['seconds']:6.0f} s  plan {f.get('plan_gb', float('nan')):6.1f} GiB"
              f"  JAX peak {f.get('jax_peak_gb', float('nan')):6.1f} GiB  step {f.get('timing_s/step') or 0:5.2f} s"
              f"  late compiles {len(f.get('late_compiles') or [])}"
              + ("  OUT OF MEMORY" if f["out_of_memory"] else ""), flush=True)
        for c in f.get("late_compiles") or []:
            print(f"  late: {c['program']} {c['gb']:.2f} GiB{' OVER THE PLAN' if c['over_plan'] else ''}: "
                  f"{c['differs'][:200]}", flush=True)
        if "refusal" in f:
            print("  " + f["refusal"].replace("\n", "\n  ")[:1500], flush=True)
        failed += f["exit_code"] not in (0, 2) or f["out_of_memory"]
    return 1 if failed else 0


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    sys.exit(main())
