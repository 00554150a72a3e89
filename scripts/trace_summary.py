"""Where the device time goes: a JAX profiler trace summarised per device into categories and top ops.

    python scripts/trace_summary.py <dir with *.trace.json.gz> [--top 15] [--json-out summary.json]

Reads the Perfetto / Chrome trace that `jax.profiler.trace(..., create_perfetto_trace=True)` writes (the
trainer's `trainer.profile_steps`, `scripts/mesh_sweep.py --profile`). Per device (a trace process
whose name contains `/device:`), the busy time of its streams is split into categories by op name:
collectives (all-reduce, all-gather, reduce-scatter, all-to-all, collective-permute), matmul (gemm /
cublas / cutlass / dot), attention (cudnn / flash / fmha), copies (memcpy / copy), other fusions; plus
the idle share of the traced window. Ops on several streams of one device can overlap; the busy time
is the union of all its op intervals and each category's time is summed over ops.
"""

from __future__ import annotations

import argparse
import gzip
import json
import sys
from collections import defaultdict
from pathlib import Path

CATEGORIES = (
    ("collective", ("all-reduce", "allreduce", "all-gather", "allgather", "reduce-scatter", "reducescatter",
                    "all-to-all", "collective-permute", "nccl")),
    ("attention", ("cudnn", "flash", "fmha", "attention", "sdpa")),
    ("matmul", ("gemm", "cublas", "cutlass", "dot", "matmul", "xmma", "sm90_", "nvjet")),
    ("copy", ("memcpy", "memset", "copy")),
)


def category(name: str) -> str:
    low = name.lower()
    for cat, keys in CATEGORIES:
        if any(k in low for k in keys):
            return cat
    return "other"


def load_events(path: Path) -> list[dict]:
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt") as f:
        data = json.load(f)
    return data["traceEvents"] if isinstance(data, dict) else data


def union_length(intervals: list[tuple[float, float]]) -> float:
    total, end = 0.0, float("-inf")
    for s, e in sorted(intervals):
        if e <= end:
            continue
        total += e - max(s, end)
        end = e
    return total


def summarise(events: list[dict], top: int = 15) -> dict[str, dict]:
    names = {e["pid"]: e.get("args", {}).get("name", "") for e in events
             if e.get("ph") == "M" and e.get("name") == "process_name"}
    devices = {pid for pid, n in names.items() if "/device:" in n}
    threads = {(e["pid"], e["tid"]): e.get("args", {}).get("name", "") for e in events
               if e.get("ph") == "M" and e.get("name") == "thread_name"}
    # a device's kernels run on its "Stream #n" lines; its "XLA Modules" / "Steps" lines span whole
    # programs and would make the device look always busy
    streams = {k for k, n in threads.items() if k[0] in devices and n.lower().startswith("stream")}
    use = (lambda e: (e["pid"], e["tid"]) in streams) if streams else (
        lambda e: not any(w in threads.get((e["pid"], e["tid"]), "").lower() for w in ("module", "step")))
    per = defaultdict(list)
    for e in events:
        if e.get("ph") == "X" and e.get("pid") in devices and e.get("dur", 0) > 0 and use(e):
            per[e["pid"]].append(e)
    out = {}
    for pid, evs in sorted(per.items(), key=lambda kv: names[kv[0]]):
        start = min(e["ts"] for e in evs)
        end = max(e["ts"] + e["dur"] for e in evs)
        busy = union_length([(e["ts"], e["ts"] + e["dur"]) for e in evs])
        cats, ops, counts = defaultdict(float), defaultdict(float), defaultdict(int)
        for e in evs:
            cats[category(e["name"])] += e["dur"]
            ops[e["name"]] += e["dur"]
            counts[e["name"]] += 1
        window = end - start
        out[names[pid]] = {
            "window_ms": window / 1e3, "busy_ms": busy / 1e3, "idle_frac": 1 - busy / window if window else 0.0,
            "categories_ms": {k: v / 1e3 for k, v in sorted(cats.items(), key=lambda kv: -kv[1])},
            "top_ops": [{"name": n, "ms": t / 1e3, "count": counts[n]}
                        for n, t in sorted(ops.items(), key=lambda kv: -kv[1])[:top]]}
    return out


def find_traces(root: Path) -> list[Path]:
    return sorted(root.rglob("*.trace.json.gz")) + sorted(root.rglob("*.trace.json"))


def print_summary(summary: dict[str, dict]) -> None:
    for dev, s in summary.items():
        cats = "  ".join(f"{k} {v:.1f}" for k, v in s["categories_ms"].items())
        print(f"{dev}: window {s['window_ms']:.1f} ms, busy {s['busy_ms']:.1f} ms (idle {s['idle_frac']:.0%}); "
              f"by category (ms): {cats}")
        for op in s["top_ops"]:
            print(f"    {op['ms']:9.2f} ms  x{op['count']:<5d} {op['name'][:110]}")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("trace", help="a trace file or a directory searched for *.trace.json.gz")
    p.add_argument("--top", type=int, default=15)
    p.add_argument("--json-out", default=None)
    args = p.parse_args(argv)
    root = Path(args.trace)
    paths = [root] if root.is_file() else find_traces(root)
    if not paths:
        print(f"{root}: no *.trace.json.gz found", file=sys.stderr)
        return 2
    result = {}
    for path in paths:
        print(f"== {path}")
        result[str(path)] = summarise(load_events(path), args.top)
        print_summary(result[str(path)])
    if args.json_out:
        Path(args.json_out).write_text(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
