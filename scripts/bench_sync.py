"""Weight push JAX -> in-process vLLM, vs the device-copy floor; generation throughput; log-prob mismatch.

    python scripts/bench_sync.py --model qwen2.5-0.5b,qwen2.5-1.5b,qwen2.5-7b

Per model shape (random weights): vLLM starts first (dummy weights), then JAX creates fp32 master
parameters. Two pushes, both `VLLMEngine.update_weights`: the trainer's, `HFWeights(params, bf16)`,
which on GPU is the direct copy (`bridge.push.DirectCopy`: DLPack views of the fp32 master buffers,
cast inside the copy into vLLM's fused parameters: one Triton launch per parameter, `bridge/cast_copy.py`;
timed too with torch's batched `_foreach_copy_` instead, `push_foreach_s`), and for comparison a
plain iterator of the same tensors through vLLM's `load_weights` (per tensor a layer slice + cast in
JAX, a DLPack view, vLLM's Python weight loader). After both, vLLM's parameters are compared bit for
bit. Push time is `VLLMEngine.push_weights`; `update_weights` adds `reset_prefix_cache()`, timed
apart (it is the same for any push). The floor is the bf16 model bytes over the measured device-to-device copy bandwidth. Extra memory
is what JAX holds beyond the parameters while the push runs (sampled at every tensor) plus torch's
peak above its baseline. Mismatch: |vLLM sampled-token log-prob - jaxppo bf16 log-prob| on the same tokens.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import sys
import time
from pathlib import Path

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("VLLM_USE_FLASHINFER_SAMPLER", "0")
os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import numpy as np  # noqa: E402


def copy_bandwidth(torch, nbytes: int = 2 << 30) -> float:
    src = torch.empty(nbytes // 2, dtype=torch.bfloat16, device="cuda")
    dst = torch.empty_like(src)
    dst.copy_(src)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(10):
        dst.copy_(src)
    torch.cuda.synchronize()
    bw = 10 * nbytes / (time.perf_counter() - t0)
    del src, dst
    return bw


def run_model(name: str, args) -> dict:
    import jax
    import jax.numpy as jnp
    import torch

    from bridge.dlpack import to_torch
    from bridge.engines.vllm import VLLMEngine
    from jaxppo.config import ActorConfig
    from jaxppo.data import left_pad
    from jaxppo.engine import ActorEngine
    from jaxppo.models import abstract_params, build_model, init_params
    from jaxppo.models.hf_io import HFWeights, export_hf_arrays
    from jaxppo.rollout import Sampling, train_sequences
    from jaxppo.sharding import make_mesh, param_shardings
    from scripts.shapes import SHAPES, write_config_dir

    cfg = SHAPES[name]
    model_dir = write_config_dir(name, Path(args.workdir) / name)
    t0 = time.perf_counter()
    engine = VLLMEngine(model_dir, dtype="bfloat16", gpu_memory_utilization=args.gpu_mem, max_model_len=1024,
                        enforce_eager=args.eager, eos_token_ids=(), enable_sleep_mode=False)
    start_s = time.perf_counter() - t0
    mesh = make_mesh({"data": 1}, devices=jax.devices()[:1])
    module = build_model(cfg, dtype=jnp.bfloat16, param_dtype=jnp.float32, remat="full", attention_impl="cudnn")
    params = init_params(module, jax.random.PRNGKey(0), param_shardings(abstract_params(module), mesh))
    jax.block_until_ready(params)
    dev = jax.local_devices()[0]
    model_bytes = sum(x.size * 2 for x in jax.tree.leaves(params))  # what is pushed: bf16
    largest = max(int(np.prod(x.shape[1:] if x.ndim == 3 or (x.ndim == 2 and x.shape[0] == cfg.num_hidden_layers)
                               else x.shape)) * 2 for x in jax.tree.leaves(params))
    bw = copy_bandwidth(torch)

    def push(direct: bool, watch: bool = False) -> tuple[float, int, int]:
        """One push, timed; with `watch`, JAX's live bytes sampled at every tensor (untimed)."""
        base = dev.memory_stats()["bytes_in_use"]
        torch.cuda.reset_peak_memory_stats()
        tbase = torch.cuda.memory_allocated()
        extra = [0]

        def watched(items):  # the load_weights path: JAX's live bytes at every tensor
            for item in items:
                extra[0] = max(extra[0], dev.memory_stats()["bytes_in_use"] - base)
                yield item

        weights = HFWeights(params, jnp.bfloat16)
        source = weights if direct else iter(weights)  # a plain iterator goes through vLLM's load_weights
        if watch and direct:  # the direct push allocates only where it builds its sources: look there
            srcs = engine.direct_plan(weights).sources(params)
            extra[0] = dev.memory_stats()["bytes_in_use"] - base
            del srcs
        elif watch:
            source = watched(source)
        torch.cuda.synchronize()
        t = time.perf_counter()
        engine.push_weights(source)  # update_weights = push_weights + reset_prefix_cache (timed below)
        torch.cuda.synchronize()
        took = time.perf_counter() - t
        return took, extra[0], torch.cuda.max_memory_allocated() - tbase

    def breakdown() -> dict:
        """The direct push in parts: building the source views (host), the batched copy alone (device)."""
        plan, t_src, t_copy = engine.direct_plan(HFWeights(params)), [], []
        for _ in range(args.reps):
            torch.cuda.synchronize()
            t = time.perf_counter()
            srcs = plan.sources(params)
            t_src.append(time.perf_counter() - t)
            torch.cuda.synchronize()
            t = time.perf_counter()
            torch._foreach_copy_(plan._dsts, srcs)
            torch.cuda.synchronize()
            t_copy.append(time.perf_counter() - t)
            del srcs
        return {"direct_sources_s": float(np.median(t_src)), "direct_foreach_copy_s": float(np.median(t_copy))}

    results = {}
    for direct in (False, True):  # load_weights first, then the direct copy (what the trainer uses)
        push(direct)  # warm-up: compiles the per-shape slice / cast programs, builds the plan
        results[direct] = (float(np.median([push(direct)[0] for _ in range(args.reps)])),) + push(direct, watch=True)[1:]
    direct_used = engine._plan is not None
    parts = breakdown() if direct_used else {}
    if direct_used:  # the same direct push with torch's batched cast-copy instead of the Triton kernel
        from bridge import cast_copy

        parts["triton"] = cast_copy.triton is not None
        engine._plan.kernel = "foreach"
        push(True)
        parts["push_foreach_s"] = float(np.median([push(True)[0] for _ in range(args.reps)]))
        engine._plan.kernel = "auto"
    t_reset = []
    for _ in range(args.reps):
        t = time.perf_counter()
        engine.llm.reset_prefix_cache()
        t_reset.append(time.perf_counter() - t)
    parts["reset_prefix_cache_s"] = float(np.median(t_reset))
    # the direct copy leaves vLLM's parameters bit-identical to vLLM's own loader
    vparams = dict(engine.model().named_parameters())
    push(True)
    after_direct = {n: p.detach().clone() for n, p in vparams.items()}
    push(False)
    identical = all(torch.equal(after_direct[n], p) for n, p in vparams.items())
    del after_direct
    push(True)  # generation and the mismatch below run on the direct copy's weights
    push_s, jax_extra, torch_extra = results[True]
    # the same tensors copied with plain torch (no JAX, no names): per-tensor launch cost, no vLLM
    views = [(n, to_torch(a)) for n, a in export_hf_arrays(params, jnp.bfloat16)]
    dsts = [torch.empty_like(v) for _, v in views]
    torch.cuda.synchronize()
    t = time.perf_counter()
    for d, (_, v) in zip(dsts, views):
        d.copy_(v)
    torch.cuda.synchronize()
    per_tensor_copy_s = time.perf_counter() - t
    n_tensors = len(views)
    del views, dsts

    rng = np.random.default_rng(0)
    prompts = [rng.integers(0, cfg.vocab_size, args.prompt_len).tolist() for _ in range(args.prompts)]
    sampling = Sampling(n=1, temperature=1.0, max_tokens=args.gen_len, seed=0)
    engine.update_weights(HFWeights(params, jnp.bfloat16))
    engine.generate(prompts[:8], sampling)
    t = time.perf_counter()
    ro = engine.generate(prompts, sampling)
    gen_s = time.perf_counter() - t
    gen_tps = float(ro.response_mask.sum()) / gen_s

    # mismatch on a subset: jaxppo bf16 log-probs of the tokens vLLM sampled
    k = args.mismatch_prompts
    sub = type(ro)(ro.response_ids[:k], ro.response_mask[:k], ro.logprobs[:k], ro.finish_reasons[:k],
                   ro.prompt_index[:k])
    p_ids, p_mask = left_pad([np.asarray(p) for p in prompts[:k]], 0)
    batch = train_sequences(p_ids, p_mask, sub)
    bf16_params = jax.tree.map(lambda x: x.astype(jnp.bfloat16), params)
    actor = ActorEngine(module, mesh, ActorConfig(log_prob_micro_batch_size_per_device=8, logprob_chunk_size=256),
                        args.gen_len, temperature=1.0)
    lp = np.asarray(actor.logprobs(bf16_params, actor.shard_batch(batch))[0])
    m = sub.response_mask > 0
    diff = np.abs(lp - sub.logprobs)[m]
    out = {"model": name, "model_gb": model_bytes / 2**30, "push_s": push_s, "copy_bw_gbs": bw / 1e9,
           "floor_s": model_bytes / bw, "push_over_floor": push_s / (model_bytes / bw),
           "tensors": n_tensors, "direct_copy": direct_used, **parts, "direct_equals_load_weights": identical,
           "load_weights_push_s": results[False][0], "load_weights_extra_jax_mb": results[False][1] / 2**20,
           "load_weights_extra_torch_mb": results[False][2] / 2**20, "torch_per_tensor_copy_s": per_tensor_copy_s,
           "extra_jax_mb": jax_extra / 2**20, "extra_torch_mb": torch_extra / 2**20,
           "largest_param_mb": largest / 2**20, "vllm_start_s": start_s, "gen_tokens_per_s": gen_tps,
           "gen_prompts": args.prompts, "gen_len": args.gen_len, "logprob_diff_mean": float(diff.mean()),
           "logprob_diff_max": float(diff.max()), "device": torch.cuda.get_device_name(),
           "versions": {"jax": jax.__version__, "torch": torch.__version__}}
    try:
        import vllm

        out["versions"]["vllm"] = vllm.__version__
    except ImportError:
        pass
    del engine, params, bf16_params
    gc.collect()
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="qwen2.5-0.5b")
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--prompts", type=int, default=256)
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--gen-len", type=int, default=256)
    p.add_argument("--mismatch-prompts", type=int, default=32)
    p.add_argument("--gpu-mem", type=float, default=0.35)
    p.add_argument("--eager", action="store_true")
    p.add_argument("--workdir", default="/tmp/jaxppo_bench")
    p.add_argument("--json-out", default=None)
    args = p.parse_args(argv)
    import torch

    if not torch.cuda.is_available():
        print("bench_sync.py needs a CUDA GPU: it times copies into vLLM's CUDA parameters against a device copy "
              "floor", file=sys.stderr)
        return 2
    names = args.model.split(",")
    if len(names) == 1:
        row = run_model(names[0], args)
        print("RESULT " + json.dumps(row), flush=True)
        rows = [row]
    else:  # one process per model: an in-process vLLM engine does not give its memory back when deleted
        import subprocess

        rows = []
        for name in names:
            cmd = [sys.executable, __file__, "--model", name, "--reps", str(args.reps), "--prompts", str(args.prompts),
                   "--prompt-len", str(args.prompt_len), "--gen-len", str(args.gen_len), "--mismatch-prompts",
                   str(args.mismatch_prompts), "--gpu-mem", str(args.gpu_mem), "--workdir", args.workdir]
            cmd += ["--eager"] if args.eager else []
            out = subprocess.run(cmd, capture_output=True, text=True)
            lines = [l for l in out.stdout.splitlines() if l.startswith("RESULT ")]
            if out.returncode != 0 or not lines:
                print(f"{name}: failed (exit {out.returncode})\n{out.stdout[-2000:]}\n{out.stderr[-4000:]}", flush=True)
                continue
            rows.append(json.loads(lines[-1][7:]))
            print(json.dumps(rows[-1]), flush=True)
    print(f"\n{'model':14} {'GB':>5} {'push s':>7} {'floor s':>7} {'x floor':>7} {'foreach s':>9} {'x floor':>7} "
          f"{'extra MB (jax/torch)':>21} "
          f"{'largest MB':>10} {'views/copy ms':>13} {'reset ms':>8} {'load_weights s':>14} {'bit-equal':>9} {'gen tok/s':>9} {'|dlp| mean/max':>15}")
    for r in rows:
        fe = r.get("push_foreach_s", float("nan"))
        print(f"{r['model']:14} {r['model_gb']:5.2f} {r['push_s']:7.4f} {r['floor_s']:7.4f} {r['push_over_floor']:7.2f} "
              f"{fe:9.4f} {fe / r['floor_s']:7.2f} "
              f"{r['extra_jax_mb']:10.0f}/{r['extra_torch_mb']:<10.0f} {r['largest_param_mb']:10.0f} "
              f"{1e3 * r.get('direct_sources_s', 0):6.2f}/{1e3 * r.get('direct_foreach_copy_s', 0):<6.2f} "
              f"{1e3 * r.get('reset_prefix_cache_s', 0):8.2f} "
              f"{r['load_weights_push_s']:14.4f} {str(r['direct_equals_load_weights']):>9} "
              f"{r['gen_tokens_per_s']:9.0f} {r['logprob_diff_mean']:7.4f}/{r['logprob_diff_max']:.3f}")
    if args.json_out:
        Path(args.json_out).write_text(json.dumps(rows, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
