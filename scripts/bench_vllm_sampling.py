"""Standalone vLLM generation on a model shape with random weights, the ways of asking for samples side by side in
one process on one engine (alternating, so drift hits all alike): what a seed per request and log-probs cost.

    python scripts/bench_vllm_sampling.py --shape qwen2.5-0.5b --prompts 256 --n 1 --tokens 256
    python scripts/bench_vllm_sampling.py --shape qwen2.5-0.5b --prompts 256 --n 5 --tokens 256 --ledger ...

Ways (`--ways`, comma list):
  seed_per_request  a SamplingParams per prompt with its own seed, log-probs as dicts (jaxppo's engine to 2026-12-03):
                    vLLM gives each such request its own generator and samples those one request at a time
  one_seed          one SamplingParams, torch.manual_seed before the call, log-probs as dicts
  one_seed_flat     the same with flat_logprobs=True: what `bridge.engines.vllm.VLLMEngine.generate` asks now
                    (its `sampling_params`)
  no_logprobs       one seed, no log-probs: the floor for sampling alone
Prompts are random token ids of the data's length; responses run to --tokens (no EOS: ignore_eos), so every way
generates the same number of tokens. Each repeat: wall and CPU time of the call, tokens/s. Ledger `vllm_sampling`,
with the engine's arguments in force (`engine_args`: prefix caching, asynchronous scheduling, and any given).

Engine arguments, one engine per process (compare them in separate runs of one call):
  --no-prefix-caching   rollout.enable_prefix_caching=false (on by default, as verl)
  --engine-kwargs JSON  further vLLM EngineArgs, as rollout.engine_kwargs.vllm: '{"async_scheduling": false}'
  --cpus LIST           the process (and every thread vLLM starts) held to these CPUs, e.g. 3 or 2,3 or 0-3: whether
                        the host-bound generation's spread between calls (1.45-2.47 s for the same 1.5B batch in one
                        process, 2026-12-07) follows where the scheduler puts its threads. The row keeps the CPUs in
                        force and their SMT siblings (`cpu_placement`).

`--profile-way WAY[,WAY]` then runs one more call of each way named under cProfile (the host's side of a generation: which of
vLLM's functions the time goes to, per decode step) and prints the functions that took the most time of their own
and in all; `--json-out` keeps them. The profiler slows Python down, so that call is not one of the timed ones.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

WAYS = ("seed_per_request", "one_seed", "one_seed_flat", "no_logprobs")


def params_for(engine, way: str, prompts: int, n: int, tokens: int, seed: int):
    """The SamplingParams of one call (a list: one per prompt) and whether to seed the default generator;
    `one_seed_flat` and `no_logprobs` are the engine's own (`VLLMEngine.sampling_params`)."""
    from jaxppo.rollout import Sampling

    def changed(params, **kw):  # a copy with attributes set (SamplingParams is a msgspec struct, not a dataclass)
        params = params.clone()
        for k, v in kw.items():
            setattr(params, k, v)
        return params

    ours = engine.sampling_params(Sampling(n=n, temperature=1.0, max_tokens=tokens, logprobs=way != "no_logprobs"))
    if way in ("one_seed_flat", "no_logprobs"):
        return [ours] * prompts, True
    dicts = changed(ours, flat_logprobs=False)  # log-probs as a dict and a Logprob object a token
    if way == "one_seed":
        return [dicts] * prompts, True
    if way == "seed_per_request":
        return [changed(dicts, seed=seed * 1_000_003 + i) for i in range(prompts)], False
    raise ValueError(f"--ways: unknown way {way!r}; known: {', '.join(WAYS)}")


def request(engine, way: str, rng, vocab: int, prompts: int, n: int, tokens: int, prompt_len: int, seed: int):
    """One call's fresh random prompts (token ids of `prompt_len`, drawn from `rng`) and its SamplingParams, the
    default generator seeded where the way asks for it."""
    import torch
    from vllm.inputs import TokensPrompt

    batch = [TokensPrompt(prompt_token_ids=rng.integers(10, vocab - 10, prompt_len).tolist()) for _ in range(prompts)]
    params, seed_default = params_for(engine, way, prompts, n, tokens, seed)
    if seed_default:
        torch.manual_seed(seed)
    return batch, params


def measure(engine, vocab: int, ways: list[str], prompts: int, n: int, tokens: int, prompt_len: int,
            repeats: int) -> dict[str, dict]:
    """Per way: median tokens/s, wall and CPU seconds of a call, and every repeat's tokens/s. The ways alternate
    within each repeat after one warm-up call each; every call gets fresh random prompts."""
    import numpy as np

    rng = np.random.default_rng(0)
    expected = prompts * n * tokens

    def call(way: str, seed: int) -> dict[str, float]:
        batch, params = request(engine, way, rng, vocab, prompts, n, tokens, prompt_len, seed)
        t, c = time.perf_counter(), time.process_time()
        outs = engine.llm.generate(batch, params, use_tqdm=False)
        wall, cpu = time.perf_counter() - t, time.process_time() - c
        got = sum(len(o.token_ids) for out in outs for o in out.outputs)
        if got != expected:
            raise RuntimeError(f"{way}: {got} tokens generated, {expected} expected")
        return {"wall_s": wall, "cpu_s": cpu, "tokens_per_s": got / wall}

    for w in ways:  # warm-up: each way's first call (graph sizes, allocator)
        call(w, 0)
    runs: dict[str, list[dict[str, float]]] = {w: [] for w in ways}
    for r in range(repeats):
        for w in ways:
            runs[w].append(call(w, r + 1))
    return {w: {"tokens_per_s": statistics.median(x["tokens_per_s"] for x in runs[w]),
                "wall_s": statistics.median(x["wall_s"] for x in runs[w]),
                "cpu_s": statistics.median(x["cpu_s"] for x in runs[w]),
                "tokens_per_s_all": [x["tokens_per_s"] for x in runs[w]],
                "wall_s_all": [round(x["wall_s"], 3) for x in runs[w]]} for w in ways}


def profile_call(engine, vocab: int, way: str, prompts: int, n: int, tokens: int, prompt_len: int,
                 top: int = 30) -> dict:
    """One call of `way` under cProfile: its wall time under the profiler, the number of engine steps (passes of
    the scheduler's `schedule`) and the `top` functions by own time and by cumulative time, each
    [function, calls, own s, cumulative s]."""
    import cProfile
    import pstats

    import numpy as np

    batch, params = request(engine, way, np.random.default_rng(1), vocab, prompts, n, tokens, prompt_len, seed=1)
    prof = cProfile.Profile()
    t = time.perf_counter()
    prof.runcall(engine.llm.generate, batch, params, use_tqdm=False)
    wall = time.perf_counter() - t
    stats = pstats.Stats(prof).stats  # {(file, line, name): (primitive calls, calls, own s, cumulative s, callers)}

    def name(key) -> str:
        file, line, fn = key
        return f"{'/'.join(Path(file).parts[-3:])}:{line}({fn})" if line else fn

    rows = [[name(k), v[1], round(v[2], 4), round(v[3], 4)] for k, v in stats.items()]
    # one scheduler pass an engine step (the engine core's step function is named and placed differently across
    # releases: 0.26.0 on the GPU ran 258 passes where a count of `step` found none)
    steps = sum(v[1] for k, v in stats.items()
                if k[2] == "schedule" and k[0].replace("\\", "/").endswith("v1/core/sched/scheduler.py"))
    return {"way": way, "wall_s_profiled": wall, "engine_steps": steps,
            "by_own_time": sorted(rows, key=lambda r: -r[2])[:top],
            "by_cumulative_time": sorted(rows, key=lambda r: -r[3])[:top]}


def parse_cpus(text: str) -> set[int]:
    """"0-3,8" -> {0, 1, 2, 3, 8}."""
    cpus: set[int] = set()
    for part in filter(None, text.split(",")):
        lo, _, hi = part.partition("-")
        cpus.update(range(int(lo), int(hi or lo) + 1))
    return cpus


def cpu_placement() -> dict:
    """The CPUs this process may run on, how many the machine has, and each allowed CPU's SMT siblings as the
    kernel lists them ("2,10": CPUs 2 and 10 share one core; absent where /sys does not say)."""
    cpus = sorted(os.sched_getaffinity(0))
    siblings = {}
    for cpu in cpus:
        f = Path(f"/sys/devices/system/cpu/cpu{cpu}/topology/thread_siblings_list")
        if f.exists():
            siblings[str(cpu)] = f.read_text().strip()
    return {"cpus": cpus, "cpu_count": os.cpu_count(), "siblings": siblings}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shape", required=True)
    p.add_argument("--prompts", type=int, default=256)
    p.add_argument("--n", type=int, default=1)
    p.add_argument("--tokens", type=int, default=256)
    p.add_argument("--prompt-len", type=int, default=80)
    p.add_argument("--repeats", type=int, default=8)
    p.add_argument("--ways", default=",".join(WAYS))
    p.add_argument("--profile-way", default="",
                   help="comma list of ways: then one call of each under cProfile (not timed with the others)")
    p.add_argument("--dtype", default=None, help="default: bfloat16 on a GPU, float32 on CPU")
    p.add_argument("--gpu-memory-utilization", type=float, default=0.8)
    p.add_argument("--max-model-len", type=int, default=None,
                   help="vLLM's max_model_len (default: prompt length + tokens; the trainer's is max_prompt_length + "
                        "max_response_length, 768 in the committed configs)")
    p.add_argument("--no-prefix-caching", action="store_true",
                   help="vLLM without prefix caching (rollout.enable_prefix_caching=false; on by default, as verl)")
    p.add_argument("--engine-kwargs", default="{}", type=json.loads,
                   help='further vLLM engine arguments as JSON, as rollout.engine_kwargs.vllm: \'{"async_scheduling": false}\'')
    p.add_argument("--cpus", default=None, type=parse_cpus, help="hold the process to these CPUs: 3, 2,3, 0-3")
    p.add_argument("--workdir", default="/tmp/jaxppo_bench_vllm_sampling")
    p.add_argument("--json-out", default=None)
    p.add_argument("--ledger", default=None, help="ledger file (default: the repo's)")
    p.add_argument("--no-ledger", action="store_true")
    args = p.parse_args(argv)
    ways, profiled = args.ways.split(","), [w for w in args.profile_way.split(",") if w]
    for flag, chosen in (("--ways", ways), ("--profile-way", profiled)):
        for w in chosen:
            if w not in WAYS:
                p.error(f"{flag}: unknown way {w!r}; known: {', '.join(WAYS)}")
    if args.cpus:  # before any thread starts: vLLM's and torch's threads inherit it
        os.sched_setaffinity(0, args.cpus)
    placement = cpu_placement()
    # JAX is imported (bridge's weight types) but never used here: it must not take the card vLLM is given
    os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
    import torch

    from bridge.engines import make_engine
    from scripts import ledger
    from scripts.shapes import SHAPES, write_config_dir

    gpu = torch.cuda.is_available()
    model_dir = write_config_dir(args.shape, Path(args.workdir) / args.shape)
    max_model_len = args.max_model_len or args.prompt_len + args.tokens
    engine = make_engine("vllm", model_dir=model_dir, dtype=args.dtype or ("bfloat16" if gpu else "float32"),
                         pad_token_id=0, eos_token_ids=(), gpu_memory_utilization=args.gpu_memory_utilization,
                         max_model_len=max_model_len, enable_prefix_caching=not args.no_prefix_caching,
                         engine_kwargs=args.engine_kwargs)
    engine_args = {**engine.host_options(), **args.engine_kwargs}
    figures = measure(engine, SHAPES[args.shape].vocab_size, ways, args.prompts, args.n, args.tokens,
                      args.prompt_len, args.repeats)
    print(f"{args.shape}: {args.prompts} prompts x {args.n} x {args.tokens} tokens, {args.repeats} repeats each "
          f"({'GPU' if gpu else 'CPU'}); vLLM {', '.join(f'{k} {v}' for k, v in engine_args.items())}; "
          f"CPUs {placement['cpus']} of {placement['cpu_count']}")
    for w, f in figures.items():
        print(f"  {w:<18} {f['tokens_per_s']:10.0f} tokens/s  wall {f['wall_s']:.3f} s  cpu {f['cpu_s']:.3f} s  "
              f"(each call's wall s: {' '.join(f'{x:.2f}' for x in f['wall_s_all'])})")
    extra = {"profiles": []}
    for way in profiled:
        prof = profile_call(engine, SHAPES[args.shape].vocab_size, way, args.prompts, args.n, args.tokens,
                            args.prompt_len)
        print(f"cProfile of one {way} call: {prof['wall_s_profiled']:.3f} s under the profiler, "
              f"{prof['engine_steps']} engine steps")
        for key, col in (("by_own_time", 2), ("by_cumulative_time", 3)):
            print(f"  {key.replace('_', ' ')} (s):")
            for r in prof[key]:
                print(f"    {r[col]:9.3f}  {r[1]:8d} calls  {r[0]}")
        extra["profiles"].append(prof)
    row = ledger.make_row("vllm_sampling", figures, shape=args.shape, prompts=args.prompts, n=args.n,
                          tokens=args.tokens, prompt_len=args.prompt_len, max_model_len=max_model_len,
                          engine_args=engine_args, cpu_placement=placement,
                          samples={"repeats": args.repeats},
                          command=None if argv is None else " ".join(["python scripts/bench_vllm_sampling.py", *argv]))
    if args.json_out:
        Path(args.json_out).write_text(json.dumps({**row, **extra}, indent=2))
    if not args.no_ledger:
        ledger.append(row, args.ledger)
    return 0


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    sys.exit(main())
