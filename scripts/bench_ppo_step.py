"""PPO step time on one GPU: the real loop (in-process vLLM + JAX actor, critic, reference) on random weights
of a real architecture and synthetic GSM8K-schema prompts, with vLLM's standalone generation throughput
for the same prompts measured in the same call.

    python scripts/bench_ppo_step.py --config configs/gsm8k_qwen2.5_0.5b.yaml --shape qwen2.5-0.5b --steps 6
    python -m jaxppo.launch --nproc 2 --script scripts/bench_ppo_step.py -- --config ... --shape ... mesh.data=2

With several processes (one per GPU, each with its own in-process vLLM replica generating for its share
of the prompts), every process runs the same loop; metrics are global (the trainer reduces them), device
memory and the standalone generation are per process, and process 0 prints the summary.

Prints per phase (`timing_s/*`) the mean over steps 3..N, tokens/s, MFU of the update phases, device memory
after each step, and the in-loop / standalone generation ratio; `--json-out` writes everything.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


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


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", required=True)
    p.add_argument("--shape", required=True, help="architecture of the random model (scripts/shapes.py)")
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--workdir", default="/tmp/jaxppo_ppo_bench")
    p.add_argument("--json-out", default=None)
    p.add_argument("overrides", nargs="*")
    args = p.parse_args(argv)

    from jaxppo.distributed import initialize_from_env

    topo = initialize_from_env()  # several processes under jaxppo.launch / torchrun / SLURM
    rank = topo.process_id if topo else 0
    from jaxppo.config import load_config

    # each process writes its own copy of the (deterministic) model config, tokenizer and data
    work = Path(args.workdir) / (f"p{rank}" if topo else "")
    cfg0 = load_config(args.config, args.overrides)
    from jaxppo import memory

    plan = memory.apply(cfg0.rollout.gpu_memory_utilization)
    import jax
    import numpy as np

    from jaxppo.data.synthetic import ArithmeticTask, write_dataset
    from scripts.shapes import SHAPES, write_config_dir

    model_dir = write_config_dir(args.shape, work / args.shape)
    tok_dir = benchmark_tokenizer(work / "tokenizer", SHAPES[args.shape].vocab_size)
    n_prompts = cfg0.data.train_batch_size
    train, _ = write_dataset(work / "data", ArithmeticTask(num_operands=8, max_digits=3, operators="+-*"),
                             train_size=n_prompts * (args.steps + 1), val_size=8)
    overrides = list(args.overrides) + [
        f"model.path={model_dir}", "model.random_init=true", f"data.train_files=[{train}]", "data.val_files=[]",
        f"data.tokenizer={tok_dir}", f"trainer.total_training_steps={args.steps}", "trainer.test_freq=-1",
        "trainer.val_before_train=false", f"trainer.default_local_dir={work / 'run'}", "trainer.logger=[]",
        "trainer.resume_mode=disable"]
    cfg = load_config(args.config, overrides)
    from jaxppo.train import make_engine_factory
    from jaxppo.trainer import PPOTrainer

    import torch

    t0 = time.perf_counter()
    trainer = PPOTrainer(cfg, make_engine_factory(cfg))
    setup_s = time.perf_counter() - t0
    dev = jax.local_devices()[0]
    steps = []
    for _ in range(args.steps):
        m = trainer.train_step()
        if torch.cuda.is_available():
            free, total = torch.cuda.mem_get_info()
            m["memory/device_used_gb"] = (total - free) / 2**30
        m["memory/jax_peak_gb"] = (dev.memory_stats() or {}).get("peak_bytes_in_use", 0) / 2**30
        steps.append(m)
        if rank == 0:
            print(json.dumps({"step": len(steps), **{k: round(v, 4) for k, v in m.items() if k.startswith(("timing_s",
                  "perf", "memory", "response_length/mean"))}}), flush=True)

    # standalone vLLM generation: same prompts and lengths, engine awake, nothing else running
    from jaxppo.rollout import Sampling

    from jaxppo import distributed as dist

    rows = np.arange(n_prompts)[dist.share(n_prompts, "prompts")]  # this process's share, as in the loop
    prompts = [trainer.train_ds.input_ids[i].tolist() for i in rows]
    sampling = Sampling(n=cfg.rollout.n, temperature=cfg.rollout.temperature, max_tokens=cfg.data.max_response_length,
                        seed=1)
    trainer.engine.wake()
    trainer.sync_weights()
    trainer.engine.generate(prompts[:8], sampling)
    t0 = time.perf_counter()
    ro = trainer.engine.generate(prompts, sampling)
    standalone_s = time.perf_counter() - t0
    standalone_tps = float(ro.response_mask.sum()) / standalone_s

    keep = steps[2:] if len(steps) > 2 else steps
    mean = {k: float(np.mean([s[k] for s in keep])) for k in keep[0]}
    # the loop's generation throughput per replica, comparable with this replica's standalone figure
    in_loop_tps = mean["response_length/mean"] * len(rows) * cfg.rollout.n / mean["timing_s/gen"]
    summary = {"config": args.config, "shape": args.shape, "steps": args.steps, "setup_s": setup_s,
               "prompts": n_prompts, "n": cfg.rollout.n, "response_len": cfg.data.max_response_length,
               "memory_plan": plan, "processes": jax.process_count(), "devices": jax.device_count(),
               "mesh": dict(trainer.mesh.shape), "mean_steps_3_to_n": mean, "gen_in_loop_tokens_per_s": in_loop_tps,
               "gen_standalone_tokens_per_s": standalone_tps, "gen_in_loop_over_standalone": in_loop_tps / standalone_tps,
               "device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu", "versions": {"jax": jax.__version__, "torch": torch.__version__}}
    try:
        import vllm

        summary["versions"]["vllm"] = vllm.__version__
    except ImportError:
        pass
    if rank != 0:
        return 0
    print(json.dumps(summary), flush=True)
    print(f"\n{args.shape}: {n_prompts} prompts x {cfg.rollout.n} x {cfg.data.max_response_length} tokens, "
          f"mean of steps 3..{args.steps}")
    for k in sorted(k for k in mean if k.startswith("timing_s/")):
        print(f"  {k:28} {mean[k]:8.3f}")
    for k in ("perf/throughput", "perf/mfu/actor", "memory/device_used_gb", "memory/jax_peak_gb"):
        if k in mean:
            print(f"  {k:28} {mean[k]:8.3f}")
    print(f"  generation in loop {in_loop_tps:.0f} tok/s, standalone {standalone_tps:.0f} tok/s, "
          f"ratio {in_loop_tps / standalone_tps:.2f}")
    if args.json_out:
        Path(args.json_out).write_text(json.dumps({"summary": summary, "steps": steps}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
