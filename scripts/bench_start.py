"""Trainer starts, each in a fresh process: does every start succeed, and how long does it take?

    python scripts/bench_start.py --config configs/gsm8k_qwen2.5_0.5b.yaml --shape qwen2.5-0.5b --starts 8 \
        [--clear first|every|none] [--first-steps 10] [--deadline-s 540] [config overrides]

Each start is `scripts/bench_ppo_step.py` in a new process: the trainer built on the committed config (in-process
vLLM with its default CUDA-graph mode unless the config says otherwise, JAX actor / critic / reference), then
one PPO step (which generates, scores, runs the forward passes and both updates). `--first-steps N` makes the
first start the step benchmark as well (N steps, medians of steps 3..N, standalone generation; its own ledger
row). `--deadline-s` stops launching starts that would not finish in time (the guess: the longest one-step start
so far, or before there is one, 0.6 x the first start's setup + first step: later starts find the caches the
first one built); what ran is reported and recorded either way. `--first-index K` numbers the starts from K
(a series continued in a second call).

`--clear` deletes the caches a start could depend on before the first start (`first`, the default), before
every start (`every`) or never: vLLM's (~/.cache/vllm: compiled graphs, model info), inductor's
(/tmp/torchinductor_*), Triton's (~/.triton), the CUDA driver's JIT cache (~/.nv/ComputeCache) and the page
cache (as root). JAX's compilation cache is kept (jaxppo's own, not vLLM's; it only shortens JAX's compile).

Reports, per start: exit code (134 = abort, e.g. a CUDA-graph capture failure), wall time, vLLM's init /
compile / capture seconds and the cudagraph mode in force; appends one `"bench": "gpu_starts"` ledger row.
Each start's output and the CUDA driver's error log (CUDA_LOG_FILE) are kept under --logs.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

CACHES = ["~/.cache/vllm", "~/.triton", "~/.nv/ComputeCache", "/tmp/torchinductor_*"]


def clear_caches() -> list[str]:
    """Delete the caches listed in CACHES (and drop the page cache when root); returns what was removed."""
    import glob

    removed = []
    for pattern in CACHES:
        for path in glob.glob(os.path.expanduser(pattern)):
            shutil.rmtree(path, ignore_errors=True)
            removed.append(path)
    if hasattr(os, "geteuid") and os.geteuid() == 0 and Path("/proc/sys/vm/drop_caches").exists():
        subprocess.run(["sync"], check=False)
        try:
            Path("/proc/sys/vm/drop_caches").write_text("3\n")
            removed.append("page cache")
        except OSError:
            pass
    return removed


def one_start(i: int, args, steps: int, logs: Path) -> dict:
    out_json = logs / f"start_{i}.json"
    cmd = [sys.executable, "-X", "faulthandler", str(ROOT / "scripts" / "bench_ppo_step.py"), "--config", args.config,
           "--shape", args.shape, "--steps", str(steps), "--json-out", str(out_json), "--workdir", args.workdir]
    if steps == 1:
        cmd += ["--no-ledger", "--no-standalone"]
    elif args.ledger:
        cmd += ["--ledger", args.ledger]
    cmd += args.overrides
    env = dict(os.environ, CUDA_LOG_FILE=str(logs / f"cuda_log_{i}.txt"), PYTHONUNBUFFERED="1")
    t0 = time.perf_counter()
    with open(logs / f"start_{i}.log", "w") as log:
        rc = subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=ROOT).returncode
    wall = time.perf_counter() - t0
    rec = {"start": i, "rc": rc, "ok": rc == 0, "wall_s": round(wall, 1), "steps": steps}
    if out_json.is_file():
        summary = json.loads(out_json.read_text())["summary"]
        rec.update({k: v for k, v in summary["start"].items()})
        rec["step_s"] = summary["median_steps_3_to_n"]["timing_s/step"]
    else:
        tail = (logs / f"start_{i}.log").read_text(errors="replace").splitlines()[-30:]
        rec["error"] = next((line for line in reversed(tail) if "error" in line.lower()), tail[-1] if tail else "")
    return rec


def next_start_guess(records: list[dict]) -> float:
    """Seconds the next one-step start will take: the longest one-step start so far; else 0.6 x the first
    start's setup + first step (it compiled what the later ones find in the caches), else its wall time."""
    one = [r["wall_s"] for r in records if r["steps"] == 1]
    if one:
        return max(one)
    r = records[-1]
    if r.get("setup_s") is not None and r.get("first_step_s") is not None:
        return 0.6 * (r["setup_s"] + r["first_step_s"])
    return r["wall_s"]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", required=True)
    p.add_argument("--shape", required=True)
    p.add_argument("--starts", type=int, default=8)
    p.add_argument("--clear", choices=["first", "every", "none"], default="first")
    p.add_argument("--first-steps", type=int, default=1, help="steps of the first start (>= 10: the step benchmark)")
    p.add_argument("--first-index", type=int, default=1, help="number of the first start (a continued series)")
    p.add_argument("--deadline-s", type=float, default=0.0, help="launch no start past this many seconds (0: none)")
    p.add_argument("--logs", default="/tmp/jaxppo_starts")
    p.add_argument("--workdir", default="/tmp/jaxppo_ppo_bench")
    p.add_argument("--json-out", default=None)
    p.add_argument("--ledger", default=None)
    p.add_argument("--no-ledger", action="store_true")
    p.add_argument("overrides", nargs="*")
    args = p.parse_args(argv)
    logs = Path(args.logs)
    logs.mkdir(parents=True, exist_ok=True)
    records, cleared = [], []
    t0 = time.perf_counter()
    first = args.first_index
    for i in range(first, first + args.starts):
        if args.deadline_s and records and time.perf_counter() - t0 + next_start_guess(records) > args.deadline_s:
            print(f"deadline: start {i} would end after {args.deadline_s:.0f} s; stopping", flush=True)
            break
        if args.clear == "every" or (args.clear == "first" and i == first):
            cleared.append({"before_start": i, "removed": clear_caches()})
        rec = one_start(i, args, args.first_steps if i == first else 1, logs)
        records.append(rec)
        print(json.dumps(rec), flush=True)
        if args.json_out:  # after every start: a call cut short still leaves what ran
            Path(args.json_out).write_text(json.dumps({"starts": records, "cleared": cleared}, indent=2))
    ok = sum(r["ok"] for r in records)
    print(f"\n{args.shape} ({args.config}): {ok} of {len(records)} starts succeeded")
    print(f"{'start':>5} {'rc':>4} {'wall s':>7} {'vLLM init s':>11} {'compile s':>9} {'capture s':>9}  cudagraph mode")
    for r in records:
        print(f"{r['start']:>5} {r['rc']:>4} {r['wall_s']:>7.1f} {r.get('vllm_start_s') or float('nan'):>11.1f} "
              f"{r.get('vllm_compile_s', float('nan')):>9.1f} {r.get('vllm_capture_s', float('nan')):>9.1f}  "
              f"{r.get('cudagraph_mode', r.get('error', ''))}")
    result = {"config": args.config, "shape": args.shape, "starts": records, "succeeded": ok, "cleared": cleared,
              "requested": args.starts}
    if args.json_out:
        Path(args.json_out).write_text(json.dumps(result, indent=2))
    if not args.no_ledger:
        from scripts import ledger

        modes = sorted({str(r.get("cudagraph_mode")) for r in records if r["ok"]})
        figures = {"starts": len(records), "succeeded": ok, "requested": args.starts, "cudagraph_modes": modes,
                   "wall_s": [r["wall_s"] for r in records],
                   "vllm_start_s": [r.get("vllm_start_s") for r in records],
                   "vllm_compile_s": [r.get("vllm_compile_s") for r in records],
                   "vllm_capture_s": [r.get("vllm_capture_s") for r in records]}
        row = ledger.make_row("gpu_starts", figures, config=args.config, overrides=list(args.overrides),
                              samples={"starts": len(records)}, shape=args.shape, cleared=cleared,
                              failures=[{"start": r["start"], "rc": r["rc"], "error": r.get("error")}
                                        for r in records if not r["ok"]])
        print(f"ledger: {ledger.append(row, args.ledger)}")
    return 0 if ok == len(records) == args.starts else 1


if __name__ == "__main__":
    sys.exit(main())
