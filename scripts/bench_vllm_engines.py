"""One batch's generation split over several vLLM engines, each in its own process, on one card: whether engines
side by side beat one engine's host-bound decode loop.

    python scripts/bench_vllm_engines.py --shape qwen2.5-0.5b --prompts 256 --tokens 256 --engines 1,2,4 \
        --max-model-len 768 --no-prefix-caching --engine-kwargs '{"async_scheduling": false}'

At the 0.5B PPO config's generation (256 prompts x 256 tokens) one in-process engine keeps the H200 busy ~19 % of
the time: its scheduler, input preparation and output processing are Python, once a decode step, per sequence.
With K engines each takes prompts / K of every call (its own process, its own Python, `--gpu-memory-utilization / K`
of the card, started one after the other as vLLM checks its share is free); the host work of the K runs overlaps,
and their kernels share the card (time-sliced between processes without MPS). Per K: one warm-up call, then
`--repeats` calls; each call starts in every engine at once (the workers are told together) and lasts until the
last engine returns: its wall time, the batch's tokens/s, and each engine's own wall and CPU seconds. Generation
is the floor's way (one seed, no log-probs: `no_logprobs` of scripts/bench_vllm_sampling.py, which builds the
requests), responses to --tokens (ignore_eos). Ledger `vllm_engines`, one row per run with every K's figures.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def _worker(conn, index: int, model_dir: str, engine_args: dict, vocab: int, prompts: int, tokens: int,
            prompt_len: int) -> None:
    """One engine: build it, say ready (with its resolved host options), then for each ("go", seed) generate its
    share and answer its start / end (CLOCK_MONOTONIC, one clock for every process), CPU seconds and tokens;
    "stop" ends it."""
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # the engine core in this process: one process an engine
    import numpy as np

    from bridge.engines import make_engine
    from scripts.bench_vllm_sampling import request

    try:
        engine = make_engine("vllm", model_dir=model_dir, **engine_args)
        conn.send(("ready", engine.host_options()))
        rng = np.random.default_rng(1000 + index)
        while True:
            msg = conn.recv()
            if msg[0] == "stop":
                break
            batch, params = request(engine, "no_logprobs", rng, vocab, prompts, 1, tokens, prompt_len,
                                    seed=msg[1] * 1009 + index)
            t, c = time.monotonic(), time.process_time()
            outs = engine.llm.generate(batch, params, use_tqdm=False)
            end, cpu = time.monotonic(), time.process_time() - c
            conn.send(("done", t, end, cpu, sum(len(o.token_ids) for out in outs for o in out.outputs)))
    except BaseException as e:  # noqa: BLE001 - the parent reports it
        conn.send(("error", f"engine {index}: {type(e).__name__}: {e}"))
        raise


def _recv(conn, what: str, timeout: float = 900.0):
    if not conn.poll(timeout):
        raise RuntimeError(f"no answer from an engine process ({what}) in {timeout:.0f} s")
    msg = conn.recv()
    if msg[0] == "error":
        raise RuntimeError(msg[1])
    return msg


def measure(k: int, model_dir: Path, engine_args: dict, vocab: int, prompts: int, tokens: int, prompt_len: int,
            repeats: int) -> dict:
    """K engine processes, each `prompts // k` prompts a call: median call wall time and tokens/s of the whole
    batch, the engines' median own wall / CPU seconds, every call's figures."""
    if prompts % k:
        raise ValueError(f"--prompts {prompts} does not split over {k} engines")
    ctx = mp.get_context("spawn")
    share = {**engine_args, "gpu_memory_utilization": engine_args["gpu_memory_utilization"] / k}
    procs, conns, options = [], [], None
    t0 = time.monotonic()
    try:
        for i in range(k):  # one after the other: each engine checks at start that its share of the card is free
            parent, child = ctx.Pipe()
            p = ctx.Process(target=_worker, args=(child, i, str(model_dir), share, vocab, prompts // k, tokens,
                                                  prompt_len), daemon=True)
            p.start()
            procs.append(p)
            conns.append(parent)
            options = _recv(parent, "start")[1]
        start_s = time.monotonic() - t0
        calls = []
        for r in range(repeats + 1):  # call 0 warms up (graph sizes, allocator)
            for c in conns:
                c.send(("go", r))
            done = [_recv(c, "generate") for c in conns]
            wall = max(d[2] for d in done) - min(d[1] for d in done)
            got = sum(d[4] for d in done)
            if got != prompts * tokens:
                raise RuntimeError(f"{k} engines: {got} tokens generated, {prompts * tokens} expected")
            if r:
                calls.append({"wall_s": wall, "tokens_per_s": got / wall,
                              "engine_wall_s": [d[2] - d[1] for d in done], "engine_cpu_s": [d[3] for d in done]})
        for c in conns:
            c.send(("stop",))
    finally:
        for p in procs:
            p.join(timeout=60)
            if p.is_alive():
                p.kill()
    return {"engines": k, "prompts_per_engine": prompts // k, "start_s": start_s, "host_options": options,
            "wall_s": statistics.median(c["wall_s"] for c in calls),
            "tokens_per_s": statistics.median(c["tokens_per_s"] for c in calls),
            "engine_wall_s": statistics.median(w for c in calls for w in c["engine_wall_s"]),
            "engine_cpu_s": statistics.median(w for c in calls for w in c["engine_cpu_s"]),
            "calls": calls}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shape", required=True)
    p.add_argument("--prompts", type=int, default=256)
    p.add_argument("--tokens", type=int, default=256)
    p.add_argument("--prompt-len", type=int, default=80)
    p.add_argument("--repeats", type=int, default=8)
    p.add_argument("--engines", default="1,2", help="comma list: the numbers of engine processes, run in turn")
    p.add_argument("--dtype", default=None, help="default: bfloat16 on a GPU, float32 on CPU")
    p.add_argument("--gpu-memory-utilization", type=float, default=0.8, help="the card's share of all engines together")
    p.add_argument("--max-model-len", type=int, default=None, help="default: prompt length + tokens")
    p.add_argument("--no-prefix-caching", action="store_true")
    p.add_argument("--engine-kwargs", default="{}", type=json.loads, help="further vLLM engine arguments as JSON")
    p.add_argument("--workdir", default="/tmp/jaxppo_bench_vllm_engines")
    p.add_argument("--json-out", default=None)
    p.add_argument("--ledger", default=None, help="ledger file (default: the repo's)")
    p.add_argument("--no-ledger", action="store_true")
    args = p.parse_args(argv)
    counts = [int(k) for k in args.engines.split(",")]
    for k in counts:
        if k < 1 or args.prompts % k:
            p.error(f"--engines: {k} engines cannot split {args.prompts} prompts evenly")
    os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")  # JAX is imported (bridge) but never used
    import torch

    from scripts import ledger
    from scripts.shapes import SHAPES, write_config_dir

    gpu = torch.cuda.is_available()
    model_dir = write_config_dir(args.shape, Path(args.workdir) / args.shape)
    max_model_len = args.max_model_len or args.prompt_len + args.tokens
    engine_args = {"dtype": args.dtype or ("bfloat16" if gpu else "float32"), "pad_token_id": 0, "eos_token_ids": (),
                   "gpu_memory_utilization": args.gpu_memory_utilization, "max_model_len": max_model_len,
                   "enable_prefix_caching": not args.no_prefix_caching, "engine_kwargs": args.engine_kwargs}
    figures = {}
    for k in counts:
        f = measure(k, model_dir, engine_args, SHAPES[args.shape].vocab_size, args.prompts, args.tokens,
                    args.prompt_len, args.repeats)
        figures[f"engines_{k}"] = f
        print(f"{k} engine(s) x {f['prompts_per_engine']} prompts: {f['tokens_per_s']:9.0f} tokens/s  "
              f"call {f['wall_s']:.3f} s  (an engine: wall {f['engine_wall_s']:.3f} s, cpu {f['engine_cpu_s']:.3f} s; "
              f"started in {f['start_s']:.0f} s)", flush=True)
    print(f"{args.shape}: {args.prompts} prompts x {args.tokens} tokens ({'GPU' if gpu else 'CPU'}); vLLM "
          f"{', '.join(f'{k} {v}' for k, v in {**(f['host_options'] or {}), **args.engine_kwargs}.items())}")
    row = ledger.make_row("vllm_engines", figures, shape=args.shape, prompts=args.prompts, tokens=args.tokens,
                          prompt_len=args.prompt_len, max_model_len=max_model_len,
                          engine_args={**(f["host_options"] or {}), **args.engine_kwargs},
                          gpu_memory_utilization=args.gpu_memory_utilization, samples={"repeats": args.repeats},
                          command=None if argv is None else " ".join(["python scripts/bench_vllm_engines.py", *argv]))
    if args.json_out:
        Path(args.json_out).write_text(json.dumps(row, indent=2))
    if not args.no_ledger:
        ledger.append(row, args.ledger)
    return 0


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    sys.exit(main())
