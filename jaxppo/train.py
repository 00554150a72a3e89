"""`python -m jaxppo.train [--config FILE] [key=value ...]`: PPO on the embedded default (CPU, synthetic
arithmetic, a tiny model) unless a config says otherwise.

`trainer.val_only=true` validates (the run's newest checkpoint, or the model) and exits.

Exit codes: 0 done (or validated), early-stopped, or stopped by SIGINT / SIGTERM (a checkpoint is written first; the
same command resumes); 2 bad configuration or input (nothing is built before the config is checked);
3 ended by the health monitor (a rule with action `stop`, or trainer.max_bad_steps NaN/inf steps).
"""

from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path

from jaxppo.errors import JaxppoError

DEFAULT_CONFIG = Path(__file__).resolve().parent.parent / "configs" / "default.yaml"


def make_engine_factory(cfg):
    """The composition root's one torch-aware piece: the rollout engine, imported lazily from `bridge`."""

    def factory(model_dir, trainer):
        from bridge.engines import make_engine

        tok = trainer.tokenizer
        return make_engine(cfg.rollout.engine, model_dir=model_dir, dtype=trainer.engine_dtype,
                           eos_token_ids=trainer.eos_ids, pad_token_id=tok.pad_token_id,
                           gpu_memory_utilization=trainer.vllm_utilization,
                           enforce_eager=cfg.rollout.enforce_eager, cudagraph_mode=cfg.rollout.cudagraph_mode,
                           cudagraph_capture_sizes=cfg.rollout.cudagraph_capture_sizes,
                           max_num_seqs=cfg.rollout.max_num_seqs,
                           max_num_batched_tokens=cfg.rollout.max_num_batched_tokens,
                           enable_chunked_prefill=cfg.rollout.enable_chunked_prefill,
                           enable_prefix_caching=cfg.rollout.enable_prefix_caching,
                           engine_kwargs=cfg.rollout.engine_kwargs.vllm, seed=cfg.trainer.seed,
                           engine_processes=cfg.rollout.engine_processes,
                           engine_in_trainer=cfg.rollout.engine_in_trainer,
                           max_model_len=cfg.data.max_prompt_length + cfg.data.max_response_length)

    return factory


def parse(argv: list[str]):
    p = argparse.ArgumentParser(prog="python -m jaxppo.train", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", default=None, help=f"YAML config (default: {DEFAULT_CONFIG.name} when it exists)")
    p.add_argument("--plan-json", default=None, help="with trainer.plan_only: also write the plan as JSON to this file")
    p.add_argument("overrides", nargs="*", help="dotted key=value overrides, e.g. data.train_batch_size=64")
    return p.parse_args(argv)


def refuse_a_run_dir_in_use(cfg) -> None:
    """A run directory another process trains in is refused now (ConfigError), before the memory plan's minutes;
    the trainer then holds it for the run (`jaxppo.setup.lock_run_dir`). One process only: the processes of a
    multi-process run share their directory, which process 0 holds."""
    from jaxppo.distributed import topology_from_env
    from jaxppo.setup import lock_run_dir

    t = cfg.trainer
    if Path(t.default_local_dir).is_dir() and not (t.plan_only or t.val_only) and topology_from_env() is None:
        lock_run_dir(Path(t.default_local_dir)).close()


def main(argv: list[str] | None = None) -> int:
    args = parse(list(sys.argv[1:] if argv is None else argv))
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    # orbax logs every file it writes at INFO; tensorboardX each tag it renames (verl's "@" in val-core names)
    for noisy in ("absl", "orbax", "jax._src.xla_bridge", "tensorboardX"):
        logging.getLogger(noisy).setLevel(logging.WARNING)
    from jaxppo.config import load_config, validate, validate_paths

    path = args.config if args.config is not None else (DEFAULT_CONFIG if DEFAULT_CONFIG.is_file() else None)
    try:
        cfg = load_config(path, args.overrides)
        refuse_a_run_dir_in_use(cfg)
        if cfg.rollout.engine == "vllm":  # before JAX touches the GPU: see jaxppo/memory.py
            from jaxppo import memory

            # the run's MPS daemon if asked, then the plan compiled in a child process, so that JAX here takes exactly
            # its need as one allocation and vLLM the rest; this process then runs with the budgets and split it chose
            rc, cfg = memory.before_the_gpu(cfg, [*(["--config", str(path)] if path else []), *args.overrides])
            if rc:
                return rc
        from jaxppo.distributed import initialize_from_env

        initialize_from_env()  # several processes (jaxppo.launch, torchrun, SLURM): one global mesh
        import jax

        validate(cfg, jax.device_count())
        validate_paths(cfg)
        if jax.process_count() > 1:
            from jaxppo.config import validate_processes

            validate_processes(cfg, jax.process_count())
    except JaxppoError as e:
        print(f"config error: {e}", file=sys.stderr)
        return 2
    if cfg.trainer.val_only:
        return validate_only(cfg)
    if cfg.trainer.plan_only:
        return plan_only(cfg, args.plan_json)
    from jaxppo.trainer import PPOTrainer

    try:
        with PPOTrainer(cfg, make_engine_factory(cfg)) as trainer:
            final = trainer.fit()
    except JaxppoError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    summary = "  ".join(f"{k}={v:.4f}" for k, v in sorted(final.items()) if k.startswith(("val/", "critic/score/mean")))
    head = "done" if trainer.stop_reason is None else f"stopped ({trainer.stop_reason})"
    print(f"{head}: step {trainer.step}/{trainer.total_steps}  {summary}  run dir: {trainer.run_dir}")
    return trainer.exit_code


def plan_only(cfg, plan_json: str | None = None) -> int:
    """`trainer.plan_only=true`: compile the step's programs, print the memory plan, exit 0 if it fits, 2 if not
    (saying what to change); no rollout engine, no states, no run directory. `plan_json`: the plan as JSON too
    (what a training process reads from the child that planned for it, `jaxppo.memory.plan_in_child`)."""
    import json

    from jaxppo import start

    try:
        prep = start.prepare(cfg, quiet=True)
    except JaxppoError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    start.discard(prep)
    if plan_json:
        Path(plan_json).write_text(json.dumps(prep.plan.summary()))
    print(prep.plan.table())
    print(f"token budgets per device per micro-batch: {prep.plan.budgets}")
    print(f"update micro-batch loop: {prep.build.loops}")
    print(f"plan: fits ({prep.plan.need / 2**30:.2f} GiB per device for JAX"
          + (f", {prep.plan.jax_limit / 2**30:.2f} GiB allowed)" if prep.plan.jax_limit else "; no card to check)"))
    return 0


def validate_only(cfg) -> int:
    """`trainer.val_only=true`: validate once (jaxppo/validation.py), print the metrics, exit 0."""
    from jaxppo.validation import validate_only as run

    try:
        step, metrics, what = run(cfg, make_engine_factory(cfg))
    except JaxppoError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    for k in sorted(metrics):
        if k.startswith(("val-core/", "val/")):
            print(f"{k} = {metrics[k]:.4f}")
    print(f"validated {what} (step {step}): val/score={metrics.get('val/score', float('nan')):.4f}  "
          f"run dir: {cfg.trainer.default_local_dir}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
