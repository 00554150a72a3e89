"""PPO step time: the real loop (in-process vLLM + JAX actor, critic, reference) through `PPOTrainer`, on a
committed config, with random weights of a real architecture and synthetic GSM8K-schema prompts, and vLLM's
standalone generation of the same prompts measured in the same process afterwards.

    python scripts/bench_ppo_step.py --config configs/gsm8k_qwen2.5_0.5b.yaml --shape qwen2.5-0.5b --steps 10
    python -m jaxppo.launch --nproc 2 --script scripts/bench_ppo_step.py -- --config ... --shape ... mesh.data=2

Reports the median of each phase (`timing_s/*`) over steps 3..N (N >= 10 gives the 8 samples the ledger asks
for), tokens/s, MFU of the update phases (FLOPs as computed, against the card's specified peak), device
memory against the memory plan's estimate, whether `perf/compiles` stayed constant after step 3, the
start (vLLM's init, compile and CUDA-graph capture, as vLLM logs them; the cudagraph mode, prefix caching and
asynchronous scheduling in force), and the in-loop / standalone generation ratio. Appends one `"bench": "ppo_step"` row to the ledger (`--ledger`).

With several processes (one per GPU, each with its own in-process vLLM replica generating for its share of
the prompts), every process runs the same loop; metrics are global (the trainer reduces them), device memory
and the standalone generation are per process, and process 0 prints and records the summary.
"""

from __future__ import annotations

import argparse
import os
import dataclasses
import json
import logging
import re
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


class VLLMStartLog(logging.Handler):
    """Collects the start figures vLLM logs: compile, capture, engine init (seconds)."""

    PATTERNS = {"vllm_compile_s": r"torch\.compile took ([0-9.]+) s in total",
                "vllm_capture_s": r"Graph capturing finished in ([0-9.]+) secs",
                "vllm_engine_init_s": r"init engine .* took ([0-9.]+) s"}

    def __init__(self):
        super().__init__(logging.INFO)
        self.figures: dict[str, float] = {}

    def emit(self, record):
        msg = record.getMessage()
        for key, pat in self.PATTERNS.items():
            m = re.search(pat, msg)
            if m:
                self.figures[key] = float(m.group(1))


def benchmark_tokenizer(out: Path, vocab_size: int) -> Path:
    """A word-level tokenizer with the model's vocabulary size and Qwen's special-token ids, so a random
    model of the real shape can be driven through the real data / reward code."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    from jaxppo.data.synthetic import CHAT_TEMPLATE, INSTRUCTION, ITEMS, NAMES, OP_TEXT

    words = set(INSTRUCTION.replace('"', ' " ').replace(".", " . ").split()) | set(NAMES) | set(ITEMS)
    for t in OP_TEXT.values():
        words |= set(t.replace(".", " . ").split())
    words |= {"has", "How", "many", "does", "have", "?", ".", "####", "=", "+", "-", "*", "user", "assistant", "'"}
    words |= {str(i) for i in range(min(20000, vocab_size // 4))}
    base = 151643 if vocab_size > 151646 else vocab_size - 3  # Qwen's ids for the real shapes
    specials = {"<|endoftext|>": base, "<|im_start|>": base + 1, "<|im_end|>": base + 2}
    vocab = {w: i for i, w in enumerate(sorted(words))}
    vocab["[UNK]"] = len(vocab)
    i = len(vocab)
    while len(vocab) < vocab_size - len(specials):
        vocab[f"w{i}"] = i
        i += 1
    vocab = {w: (j if j < base else j + 3) for w, j in vocab.items()}
    vocab.update(specials)
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>",
                                   unk_token="[UNK]", chat_template=CHAT_TEMPLATE)
    fast.save_pretrained(str(out))
    return out


def offload_traffic(trainer, cfg) -> dict[str, float]:
    """What the optimizer offload moves per PPO step (each optimizer step brings every offloaded moment to the device
    and sends it back: jaxppo/offload.py), and the link's rate measured now in this process (1 GiB each way, pinned
    host memory, median of 3): the transfers' time at that rate, against the step's update phases."""
    import jax
    import jax.numpy as jnp

    moved = 0.0
    for name, sub in (("actor", cfg.actor), ("critic", cfg.critic)):
        held = trainer.plan.host.get(f"{name} AdamW moments", 0)
        moved += 2 * held * sub.ppo_epochs * (cfg.data.train_batch_size // sub.ppo_mini_batch_size)
    dev = jax.local_devices()[0]
    device = jax.sharding.SingleDeviceSharding(dev)
    host = device.with_memory_kind("pinned_host")
    x = jax.device_put(jnp.zeros((2**28,), jnp.float32), device).block_until_ready()  # 1 GiB
    rates = {}
    for way, src, dst in (("d2h", x, host), ("h2d", jax.device_put(x, host).block_until_ready(), device)):
        times = []
        for _ in range(4):
            t = time.perf_counter()
            jax.device_put(src, dst).block_until_ready()
            times.append(time.perf_counter() - t)
        rates[way] = 2**30 / median(times[1:]) / 1e9
    import resource

    from jaxppo.offload import host_resident_bytes

    host_plan = trainer.plan.host_plan
    return {"host_gb": sum(trainer.plan.host.values()) / 2**30,
            # the plan's host figures (jaxppo/host_plan.py): XLA's pinned pool for the states, and the process's peak
            "plan_pinned_pool_gb": (host_plan.pool or 0) / 2**30, "plan_host_peak_gb": host_plan.peak / 2**30,
            # measured: JAX's live arrays in host memory now, and the process's peak resident memory (vLLM, torch
            # and Python included), beside the plan's host figure above
            "host_arrays_gb": host_resident_bytes() / 2**30,
            "process_peak_rss_gb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20,
            "moved_gb_per_step": moved / 2**30,
            "link_h2d_GBps": rates["h2d"], "link_d2h_GBps": rates["d2h"],
            "transfer_s_at_link_rate": moved / 2 / 1e9 / rates["h2d"] + moved / 2 / 1e9 / rates["d2h"]}


def median(xs):
    import numpy as np

    return float(np.median(xs)) if len(xs) else float("nan")


def parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", required=True)
    p.add_argument("--shape", required=True, help="architecture of the random model (scripts/shapes.py)")
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--workdir", default="/tmp/jaxppo_ppo_bench")
    p.add_argument("--json-out", default=None)
    p.add_argument("--ledger", default=None, help="ledger file to append the result to (default: the repo's)")
    p.add_argument("--no-ledger", action="store_true", help="do not record the result (smoke tests)")
    p.add_argument("--no-standalone", action="store_true", help="skip the standalone generation (start tests)")
    p.add_argument("overrides", nargs="*")
    return p.parse_args(argv)


def capture_logs(cfg0, start_log: VLLMStartLog) -> None:
    """vLLM's start figures into `start_log`; the trainer's own log (the memory plan's table, every compile after
    the start, with what differs) into this run's output."""
    if cfg0.rollout.engine == "vllm":
        import vllm.logger  # noqa: F401  (configures vLLM's logger, which our collector then joins)
    logging.getLogger("vllm").addHandler(start_log)
    ours = logging.StreamHandler()
    ours.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    logging.getLogger("jaxppo").addHandler(ours)
    logging.getLogger("jaxppo").setLevel(logging.INFO)
    logging.getLogger("jaxppo").propagate = False  # (a library may give the root logger a handler too)
    logging.getLogger("jaxppo.plan").setLevel(logging.DEBUG)


def bench_inputs(args, work: Path, n_prompts: int) -> list[str]:
    """The random model of the shape, a tokenizer of its vocabulary and synthetic prompts for every step, written
    under `work`; the overrides that point the config at them."""
    from jaxppo.data.synthetic import ArithmeticTask, write_dataset
    from scripts.shapes import SHAPES, write_config_dir

    model_dir = write_config_dir(args.shape, work / args.shape)
    tok_dir = benchmark_tokenizer(work / "tokenizer", SHAPES[args.shape].vocab_size)
    train, _ = write_dataset(work / "data", ArithmeticTask(num_operands=8, max_digits=3, operators="+-*"),
                             train_size=n_prompts * (args.steps + 1), val_size=8)
    return list(args.overrides) + [
        f"model.path={model_dir}", "model.random_init=true", f"data.train_files=[{train}]", "data.val_files=[]",
        f"data.tokenizer={tok_dir}", f"trainer.total_training_steps={args.steps}", "trainer.test_freq=-1",
        "trainer.val_before_train=false", f"trainer.default_local_dir={work / 'run'}", "trainer.logger=[]",
        "trainer.resume_mode=disable"]


def run_steps(trainer, cfg, n_prompts: int, steps: int, rank: int, host=None) -> list[dict[str, float]]:
    """`steps` training steps, each one's metrics with the device's memory in use, JAX's peak and the tokens
    generated (per process); `host` (a HostMemory) is told where each step begins."""
    import jax
    import torch

    dev = jax.local_devices()[0]
    out = []
    for _ in range(steps):
        if host is not None:
            host.mark(f"step {trainer.step + 1}")
        with trainer.profiled(trainer.step + 1):  # trainer.profile_steps, as the trainer's own loop does
            m = trainer.train_step()
        if torch.cuda.is_available():
            free, total = torch.cuda.mem_get_info()
            m["memory/device_used_gb"] = (total - free) / 2**30
        m["memory/jax_peak_gb"] = (dev.memory_stats() or {}).get("peak_bytes_in_use", 0) / 2**30
        m["gen_tokens"] = float(m["response_length/mean"] * n_prompts * cfg.rollout.n / max(jax.process_count(), 1))
        out.append(m)
        if rank == 0:
            print(json.dumps({"step": len(out), **{k: round(v, 4) for k, v in m.items() if k.startswith(("timing_s",
                  "perf", "memory", "response_length/mean"))}}), flush=True)
    return out


def step_summary(args, trainer, cfg, steps, keep, plan, start, n_prompts: int) -> dict:
    """Medians of steps 3..N, compiles, the memory plan against what the states hold, the start."""
    import jax

    # a phase absent from a step did not run in it (one step ahead: the last step launches no next batch)
    med = {k: median([s.get(k, 0.0) for s in keep]) for k in sorted({k for s in keep for k in s})}
    compiles = [s["perf/compiles"] for s in steps]
    summary = {"config": args.config, "shape": args.shape, "steps": args.steps, "samples": len(keep),
               "prompts": n_prompts, "n": cfg.rollout.n, "response_len": cfg.data.max_response_length,
               "memory_plan": plan, "processes": jax.process_count(), "devices": jax.device_count(),
               "mesh": dict(trainer.mesh.shape), "median_steps_3_to_n": med, "start": start,
               "compiles_per_step": compiles, "compiles_constant_after_step3": len(set(compiles[2:])) <= 1,
               # programs compiled after the start (the plan compiled the others): what differed, GiB, over the plan
               "late_compiles": [{"program": c["program"], "differs": c["differs"][:300],
                                  "gb": round(c["bytes"] / 2**30, 3), "over_plan": c["over_plan"]}
                                 for c in trainer.late_compiles],
               "jax_peak_gb_per_step": [s["memory/jax_peak_gb"] for s in steps],
               # the compiled plan's peak (states + the largest program), its margin, and per component / phase
               "memory_estimate_gb": trainer.plan.peak / 2**30, "memory_margin_gb": trainer.plan.margin / 2**30,
               "memory_held_gb": {k: v / 2**30 for k, v in trainer.held_memory().items()},
               "memory_plan_gb": {**{k: v / 2**30 for k, v in trainer.plan.states.items()},
                                  **{f"program: {p.name}": p.program / 2**30 for p in trainer.plan.phases}},
               "vllm_utilization": trainer.vllm_utilization,
               "vllm_sequences_at_once": trainer.plan.vllm.sequences if trainer.plan.vllm else None,
               "token_budgets": vars(trainer.ctx.budgets) if trainer.ctx.budgets else None}
    if trainer.plan.host:
        summary["offload"] = offload_traffic(trainer, cfg)
    return summary


def standalone_generation(trainer, cfg, n_prompts: int, keep: list[dict]) -> dict:
    """Standalone generation as the loop generates, nothing else running: each repeat woken from sleep with the
    weights pushed (as every step), then new prompts of the same lengths (the prefix cache holds none of them, as
    in the loop; repeating one prompt set would skip its prefill); the same kept awake; the loop's figures beside."""
    import numpy as np

    from jaxppo import distributed as dist
    from jaxppo.step import Timer, rollout_sampling

    engine = trainer.engine
    share = dist.share(n_prompts, "prompts")  # this process's share, as in the loop
    num_rows = len(trainer.train_ds.input_ids)
    prompt_sets = iter(range(1, 100))

    def new_prompts() -> list[list[int]]:
        k = next(prompt_sets)
        return [trainer.train_ds.input_ids[(k * n_prompts + i) % num_rows].tolist()
                for i in np.arange(n_prompts)[share]]

    sampling = rollout_sampling(cfg, 1, step=1)  # the loop's on 7 steps of 8 (jaxppo/step.py)
    engine.wake()
    trainer.sync_weights()
    engine.generate(new_prompts()[:8], sampling)

    def standalone(sampling, repeats: int, cycle: bool = True) -> list[dict[str, float]]:
        """One record per repeat, as a step's: the generation's wall and CPU time, context switches, steal
        time (Timer) and its token count. `cycle`: put to sleep, woken and given the weights before each
        repeat, as in the loop; without it the engine stays awake with the weights it has"""
        out = []
        for _ in range(repeats):
            prompts = new_prompts()
            if cycle:
                engine.sleep()
                engine.wake()
                trainer.sync_weights()
            timer = Timer()
            with timer("gen"):
                ro = engine.generate(prompts, sampling)
            rec = dict(timer.times)
            rec["gen_tokens"] = float(ro.response_mask.sum())
            out.append(rec)
        return out

    def tps(records) -> list[float]:
        return [r["gen_tokens"] / r["timing_s/gen"] for r in records]

    # as many repeats as the loop has samples: generation time varies from one batch to the next by up to
    # 1.5x in both (seen 2026-12-01), so a median of 3 against a median of 8 was noise
    alone = standalone(sampling, len(keep))
    # the loop's generation throughput per replica, comparable with this replica's standalone figure
    in_loop, alone_tps = tps(keep), tps(alone)
    out = dict(gen_in_loop_tokens_per_s=median(in_loop), gen_standalone_tokens_per_s=median(alone_tps),
               gen_in_loop_over_standalone=median(in_loop) / median(alone_tps),
               gen_in_loop_best_over_standalone_best=max(in_loop) / max(alone_tps),
               gen_standalone_repeats=alone,
               # the same keys as a standalone record: the Timer's for the gen phase, the token count
               gen_in_loop_steps=[{k: v for k, v in s.items() if k.endswith("/gen") or k == "gen_tokens"}
                                  for s in keep])
    # the same repeats without the sleep / wake / weight push before each: what the cycle costs generation
    # (nothing measurable at 4fb8804, 2026-12-03: docs/benchmarks.md, "Kept awake")
    awake = standalone(sampling, len(keep), cycle=False)
    out.update(gen_standalone_awake_tokens_per_s=median(tps(awake)), gen_standalone_awake_repeats=awake)
    if not sampling.logprobs:  # what the engine's log-probs for every sample would cost
        every = dataclasses.replace(sampling, logprobs=True)
        out["gen_standalone_all_logprobs_tokens_per_s"] = median(tps(standalone(every, 3)))
    return out


def print_summary(summary: dict, n_prompts: int) -> None:
    med, compiles = summary["median_steps_3_to_n"], summary["compiles_per_step"]
    print(json.dumps(summary), flush=True)
    print(f"\n{summary['shape']}: {n_prompts} prompts x {summary['n']} x {summary['response_len']} tokens, "
          f"median of steps 3..{summary['steps']}")
    for k in sorted(k for k in med if k.startswith("timing_s/")):
        print(f"  {k:28} {med[k]:8.3f}")
    for k in ("perf/throughput", "perf/mfu/actor", "perf/mfu/critic", "perf/gc_s", "perf/gc_full_collections",
              "memory/device_used_gb", "memory/jax_peak_gb"):
        if k in med:
            print(f"  {k:28} {med[k]:8.3f}")
    print(f"  memory estimate {summary['memory_estimate_gb']:.1f} GiB; perf/compiles {compiles} "
          f"(constant after step 3: {summary['compiles_constant_after_step3']})")
    print("  memory held by the states (GiB per device): " + ", ".join(
        f"{k} {v:.2f}" for k, v in summary["memory_held_gb"].items()))
    print(f"  start: {json.dumps(summary['start'])}")
    if "offload" in summary:
        print(f"  offload: {json.dumps(summary['offload'])}")
    print("  host memory, sampled peaks (GiB): " + ", ".join(
        f"{k} {v['gb']:.2f} ({v['phase']})" for k, v in summary["host_memory"]["peaks"].items()))
    for label, look in summary["host_memory"].get("maps", {}).items():  # what the resident memory is, by mapping
        print(f"  host mappings, {label} ({look['phase']}, rss {look['rss']:.2f} GiB): " + "; ".join(
            f"{g['name']} {g['rss']:.2f} (anon {g['anon']:.2f}, locked {g['locked']:.2f}, x{g['n']})"
            for g in (look["groups"] or [])[:8]))
    if "gen_in_loop_over_standalone" in summary:
        print(f"  generation in loop {summary['gen_in_loop_tokens_per_s']:.0f} tok/s, standalone "
              f"{summary['gen_standalone_tokens_per_s']:.0f} tok/s, ratio {summary['gen_in_loop_over_standalone']:.3f}"
              + (f"; standalone with every sample's log-probs {summary['gen_standalone_all_logprobs_tokens_per_s']:.0f}"
                 " tok/s" if "gen_standalone_all_logprobs_tokens_per_s" in summary else ""))
        print(f"  best generation in loop / best standalone {summary['gen_in_loop_best_over_standalone_best']:.3f}")
        print("  each generation: wall s, process CPU s, involuntary context switches, machine steal s")
        print(f"  standalone kept awake (no sleep / wake / push between repeats) "
              f"{summary['gen_standalone_awake_tokens_per_s']:.0f} tok/s")
        for label, recs in (("loop", summary["gen_in_loop_steps"]), ("alone", summary["gen_standalone_repeats"]),
                            ("awake", summary["gen_standalone_awake_repeats"])):
            print(f"    {label:5} " + "  ".join(
                f"{r['timing_s/gen']:.2f}/{r.get('perf/cpu_s/gen', float('nan')):.2f}/"
                f"{r.get('perf/ctx_switches/gen', float('nan')):.0f}/{r.get('perf/steal_s/gen', float('nan')):.2f}"
                for r in recs))


def ledger_row(args, summary: dict) -> dict:
    from scripts import ledger

    med = summary["median_steps_3_to_n"]
    figures = {"step_s": med["timing_s/step"], **{k: v for k, v in med.items() if k.startswith((
               "timing_s/", "perf/mfu", "perf/throughput", "perf/gc", "memory/"))}}
    for k in ("gen_in_loop_over_standalone", "gen_in_loop_best_over_standalone_best",
              "gen_in_loop_tokens_per_s", "gen_standalone_tokens_per_s", "gen_standalone_awake_tokens_per_s",
              "gen_standalone_all_logprobs_tokens_per_s", "compiles_constant_after_step3", "memory_estimate_gb"):
        if k in summary:
            figures[k] = summary[k]
    figures.update({f"offload/{k}": v for k, v in summary.get("offload", {}).items()})
    # the process's host memory at its sampled peaks, by kind (scripts/host_memory.py; the phases in the raw JSON)
    figures.update({f"host/peak_{k}_gb": v["gb"] for k, v in summary["host_memory"]["peaks"].items()})
    return ledger.make_row("ppo_step", figures, config=args.config, overrides=list(args.overrides),
                           samples={"steps": summary["samples"], "standalone_generations": len(
                               summary.get("gen_standalone_repeats", []))}, shape=args.shape, start=summary["start"],
                           token_budgets=summary["token_budgets"], mesh=summary["mesh"],
                           memory_held_gb=summary["memory_held_gb"], memory_plan_gb=summary["memory_plan_gb"])


def main(argv=None) -> int:
    args = parse_args(argv)
    t_start = time.perf_counter()
    start_log = VLLMStartLog()
    from scripts.host_memory import HostMemory

    # this process's host memory by kind and phase (the memory plan counts only JAX's offloaded states there)
    host = HostMemory().start()
    host.mark("imports, data, plan")

    from jaxppo.distributed import initialize_from_env

    topo = initialize_from_env()  # several processes under jaxppo.launch / torchrun / SLURM
    rank = topo.process_id if topo else 0
    from jaxppo import memory
    from jaxppo.config import load_config

    # each process writes its own copy of the (deterministic) model config, tokenizer and data
    work = Path(args.workdir) / (f"p{rank}" if topo else "")
    cfg0 = load_config(args.config, args.overrides)
    capture_logs(cfg0, start_log)
    n_prompts = cfg0.data.train_batch_size
    overrides = bench_inputs(args, work, n_prompts)
    cfg = load_config(args.config, overrides)
    plan = {}
    if cfg.rollout.engine == "vllm":  # as `python -m jaxppo.train` does, before JAX starts on the GPU
        rc, cfg = memory.before_the_gpu(cfg, ["--config", args.config, *overrides])
        if rc:
            return rc
        plan = {k: os.environ.get(k) for k in ("XLA_PYTHON_CLIENT_PREALLOCATE", "XLA_PYTHON_CLIENT_MEM_FRACTION")}
    from jaxppo.train import make_engine_factory
    from jaxppo.trainer import PPOTrainer
    from scripts import ledger

    t0 = time.perf_counter()
    host.mark("trainer setup (states, rollout engine)")
    trainer = PPOTrainer(cfg, make_engine_factory(cfg))
    setup_s = time.perf_counter() - t0
    steps = run_steps(trainer, cfg, n_prompts, args.steps, rank, host)
    host.mark("after the steps")
    engine = trainer.engine
    start = {"setup_s": setup_s, "process_s": time.perf_counter() - t_start, "first_step_s": steps[0]["timing_s/step"],
             "vllm_start_s": getattr(engine, "start_s", None),
             "cudagraph_mode": engine.cudagraph_mode() if hasattr(engine, "cudagraph_mode") else "n/a",
             **(engine.host_options() if hasattr(engine, "host_options") else {}),
             **start_log.figures}
    keep = steps[2:] if len(steps) > 2 else steps
    summary = step_summary(args, trainer, cfg, steps, keep, plan, start, n_prompts)
    if not args.no_standalone:
        summary.update(standalone_generation(trainer, cfg, n_prompts, keep))
    host.stop()
    summary["host_memory"] = host.summary()
    summary["device"] = ledger.device()
    summary["versions"] = ledger.versions()
    if rank != 0:
        return 0
    print_summary(summary, n_prompts)
    if args.json_out:
        Path(args.json_out).write_text(json.dumps({"summary": summary, "steps": steps}, indent=2))
    if not args.no_ledger:
        print(f"ledger: {ledger.append(ledger_row(args, summary), args.ledger)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
