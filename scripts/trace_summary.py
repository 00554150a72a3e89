"""Where the device time goes: a JAX profiler trace summarised per device into categories and top ops.

    python scripts/trace_summary.py <dir with *.trace.json.gz> [--top 15] [--json-out summary.json]

Reads the Perfetto / Chrome trace that `jax.profiler.trace(..., create_perfetto_trace=True)` writes (the
trainer's `trainer.profile_steps`, `scripts/mesh_sweep.py --profile`). Per device (a trace process
whose name contains `/device:`), the busy time of its streams is split into categories by op name:
collectives (all-reduce, all-gather, reduce-scatter, all-to-all, collective-permute), matmul (gemm /
cublas / cutlass / dot), attention (cudnn / flash / fmha), copies (memcpy / copy), other fusions; plus
the idle share of the traced window. Ops on several streams of one device can overlap; the busy time
is the union of all its op intervals and each category's time is summed over ops.

A torch profiler trace (`torch_trace.json`, the trainer's `trainer.profile_tools=[torch]`: on a GPU, CUPTI's record
of every kernel of the process, the rollout engine's and XLA's) is summarised per CUDA stream the same way, plus
what a one-GPU step needs told apart: how long two or more streams ran kernels at once (generation beside
training), how busy the GPU was inside each named region (`gen`: GPU work against Python and waiting), and the CUDA
runtime calls' time on the CPU (launches, synchronisation).
"""

from __future__ import annotations

import argparse
import gzip
import json
import sys
from collections import defaultdict
from pathlib import Path

CATEGORIES = (
    ("sampling", ("sampl", "topk", "top_k", "argmax", "multinomial", "exponential", "gumbel")),
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


def breakdown(evs: list[dict], top: int) -> dict:
    """Ops' time by category and the `top` ops by time, with their counts (ms)."""
    cats, ops, counts = defaultdict(float), defaultdict(float), defaultdict(int)
    for e in evs:
        cats[category(e["name"])] += e["dur"]
        ops[e["name"]] += e["dur"]
        counts[e["name"]] += 1
    return {"categories_ms": {k: v / 1e3 for k, v in sorted(cats.items(), key=lambda kv: -kv[1])},
            "top_ops": [{"name": n, "ms": t / 1e3, "count": counts[n]}
                        for n, t in sorted(ops.items(), key=lambda kv: -kv[1])[:top]]}


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
        window = end - start
        out[names[pid]] = {
            "window_ms": window / 1e3, "busy_ms": busy / 1e3, "idle_frac": 1 - busy / window if window else 0.0,
            **breakdown(evs, top)}
    return out


GPU_EVENTS = ("kernel", "gpu_memcpy", "gpu_memset")


def merged(intervals: list[tuple[float, float]]) -> list[tuple[float, float]]:
    out: list[list[float]] = []
    for s, e in sorted(intervals):
        if out and s <= out[-1][1]:
            out[-1][1] = max(out[-1][1], e)
        else:
            out.append([s, e])
    return [(s, e) for s, e in out]


def at_least_two(per_stream: list[list[tuple[float, float]]]) -> float:
    """Time during which two or more of the streams (each a list of merged intervals) are busy."""
    edges = sorted([(s, 1) for iv in per_stream for s, _ in iv] + [(e, -1) for iv in per_stream for _, e in iv],
                   key=lambda x: (x[0], x[1]))
    total, depth, last = 0.0, 0, None
    for t, d in edges:
        if depth >= 2:
            total += t - last
        depth += d
        last = t
    return total


def clipped(intervals: list[tuple[float, float]], lo: float, hi: float) -> float:
    return sum(max(0.0, min(e, hi) - max(s, lo)) for s, e in intervals)


def summarise_torch(events: list[dict], top: int = 15) -> dict:
    """A torch profiler trace: GPU work per (device, stream), the time two or more streams ran at once, each named
    region's GPU busy share, and the CUDA runtime calls' CPU time by name (times in ms)."""
    xs = [e for e in events if e.get("ph") == "X" and e.get("dur", 0) > 0]
    kernels = [e for e in xs if e.get("cat") in GPU_EVENTS]
    by_stream = defaultdict(list)
    for e in kernels:
        a = e.get("args", {})
        by_stream[(a.get("device", e.get("pid")), a.get("stream", e.get("tid")))].append(e)
    streams, unions = {}, {}
    for (dev, stream), evs in sorted(by_stream.items(), key=lambda kv: str(kv[0])):
        unions[(dev, stream)] = merged([(e["ts"], e["ts"] + e["dur"]) for e in evs])
        streams[f"device {dev} stream {stream}"] = {
            "busy_ms": sum(e - s for s, e in unions[(dev, stream)]) / 1e3, "kernels": len(evs),
            **breakdown(evs, top)}
    gpu = merged([iv for u in unions.values() for iv in u])
    regions = defaultdict(lambda: {"count": 0, "wall_ms": 0.0, "gpu_busy_ms": 0.0})
    for e in xs:
        if e.get("cat") == "user_annotation":
            r = regions[e["name"]]
            r["count"] += 1
            r["wall_ms"] += e["dur"] / 1e3
            r["gpu_busy_ms"] += clipped(gpu, e["ts"], e["ts"] + e["dur"]) / 1e3
    for r in regions.values():
        r["gpu_busy_frac"] = r["gpu_busy_ms"] / r["wall_ms"] if r["wall_ms"] else 0.0
    runtime = defaultdict(lambda: [0.0, 0])
    for e in xs:
        if e.get("cat") == "cuda_runtime":
            runtime[e["name"]][0] += e["dur"] / 1e3
            runtime[e["name"]][1] += 1
    window = (max(e for _, e in gpu) - min(s for s, _ in gpu)) if gpu else 0.0
    return {"window_ms": window / 1e3, "gpu_busy_ms": sum(e - s for s, e in gpu) / 1e3,
            "streams_at_once_ms": at_least_two(list(unions.values())) / 1e3, "streams": streams,
            "regions": dict(sorted(regions.items(), key=lambda kv: -kv[1]["wall_ms"])),
            "cuda_runtime_ms": {n: {"ms": v[0], "count": v[1]}
                                for n, v in sorted(runtime.items(), key=lambda kv: -kv[1][0])[:top]}}


def is_torch_trace(path: Path, events: list[dict]) -> bool:
    return path.name.startswith("torch_trace") or any(e.get("cat") in GPU_EVENTS for e in events[:10000])


def print_torch_summary(s: dict) -> None:
    print(f"GPU: window {s['window_ms']:.1f} ms, busy {s['gpu_busy_ms']:.1f} ms; two or more streams at once "
          f"{s['streams_at_once_ms']:.1f} ms")
    for name, st in s["streams"].items():
        cats = "  ".join(f"{k} {v:.1f}" for k, v in st["categories_ms"].items())
        print(f"  {name}: busy {st['busy_ms']:.1f} ms, {st['kernels']} kernels; by category (ms): {cats}")
        for op in st["top_ops"]:
            print(f"    {op['ms']:9.2f} ms  x{op['count']:<6d} {op['name'][:100]}")
    for name, r in s["regions"].items():
        print(f"  region {name!r} x{r['count']}: wall {r['wall_ms']:.1f} ms, GPU busy {r['gpu_busy_ms']:.1f} ms "
              f"({r['gpu_busy_frac']:.0%})")
    for name, r in s["cuda_runtime_ms"].items():
        print(f"  cuda runtime {name}: {r['ms']:.1f} ms x{r['count']}")


def find_traces(root: Path) -> list[Path]:
    return sorted(root.rglob("*.trace.json.gz")) + sorted(root.rglob("*.trace.json")) + \
        sorted(root.rglob("torch_trace.json*"))


def summarise_latest(root: Path, top: int = 15) -> dict[str, dict] | None:
    """The newest JAX trace under `root` (what `jax.profiler.trace(str(root), create_perfetto_trace=True)` wrote)
    summarised per device (`summarise`); None where the profiler wrote none (a CPU backend without a device trace)."""
    traces = find_traces(root)
    return summarise(load_events(traces[-1]), top=top) if traces else None


def print_summary(summary: dict[str, dict]) -> None:
    for dev, s in summary.items():
        cats = "  ".join(f"{k} {v:.1f}" for k, v in s["categories_ms"].items())
        print(f"{dev}: window {s['window_ms']:.1f} ms, busy {s['busy_ms']:.1f} ms (idle {s['idle_frac']:.0%}); "
              f"by category (ms): {cats}")
        for op in s["top_ops"]:
            print(f"    {op['ms']:9.2f} ms  x{op['count']:<5d} {op['name'][:110]}")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("trace", help="a trace file or a directory searched for *.trace.json.gz and torch_trace.json")
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
        events = load_events(path)
        if is_torch_trace(path, events):
            result[str(path)] = summarise_torch(events, args.top)
            print_torch_summary(result[str(path)])
        else:
            result[str(path)] = summarise(events, args.top)
            print_summary(result[str(path)])
    if args.json_out:
        Path(args.json_out).write_text(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
