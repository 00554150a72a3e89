"""A run's start, in the order memory demands: the data and the model's shape, the engines and the memory plan
compiled from abstract states (nothing allocated, no run directory written: a run that cannot fit, or
`trainer.plan_only`, stops here), then the run directory, JAX's share of the card, the rollout engine, and the
real states in the shardings the plan compiled for."""

from __future__ import annotations

import dataclasses
import logging
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp

from jaxppo import memory
from jaxppo.build import Build, build, model_configs, model_kwargs, with_lora
from jaxppo.config import Config, uses_critic
from jaxppo.data import ResumableSampler
from jaxppo.models import load_model
from jaxppo.plan import Plan, make_plan
from jaxppo.setup import DTYPES, check_tokenizer, prepare_data, tiny_model_config
from jaxppo.step import PPOState

log = logging.getLogger(__name__)


@dataclasses.dataclass
class Prepared:
    """What the plan was made from; nothing of it is on the device yet."""

    cfg: Config
    mesh: jax.sharding.Mesh
    tokenizer: Any
    tokenizer_dir: Path
    train_ds: Any
    val_ds: Any
    sampler: ResumableSampler
    total_steps: int
    build: Build
    plan: Plan
    staging: Path | None  # a temporary directory holding the synthetic task's data until the run directory exists


def enable_compilation_cache(path: str) -> None:
    """JAX's persistent compilation cache: a restarted run (or the next start of the same shapes) loads its
    compiled programs instead of compiling them again (minutes at 1.5B+ with unrolled layers)."""
    if path:
        jax.config.update("jax_compilation_cache_dir", str(Path(path).expanduser()))
        if "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS" not in os.environ:  # yours wins (the tests cache all: 0)
            jax.config.update("jax_persistent_cache_min_compile_time_secs", 2.0)


def prepare(cfg: Config, quiet: bool = False) -> Prepared:
    """Data, model shapes, engines, abstract states and the compiled memory plan (ConfigError if it cannot fit)."""
    from jaxppo.sharding import make_mesh

    t = cfg.trainer
    enable_compilation_cache(t.compilation_cache_dir)  # the plan's compiles too (a plan-only child's probes)
    run_dir = Path(t.default_local_dir)
    # the synthetic task's data and tokenizer are made in the run directory once it exists, else in a staging
    # directory moved into it after the plan: a refused or plan-only start leaves nothing behind. Several
    # processes share what process 0 writes, so they use the run directory itself.
    staging = None
    if jax.process_count() > 1:
        from jaxppo.setup import make_run_dir

        make_run_dir(cfg)
    elif not run_dir.is_dir():
        staging = Path(tempfile.mkdtemp(prefix="jaxppo-start-"))
    mesh = make_mesh(cfg.mesh.axes())
    try:
        tokenizer, tokenizer_dir, train_ds, val_ds = prepare_data(cfg, staging or run_dir)
        # dynamic sampling draws generation rounds of data.gen_batch_size prompts (see ppo_step.sample)
        round_size = (cfg.data.gen_batch_size or cfg.data.train_batch_size) if cfg.algorithm.filter_groups.enable \
            else cfg.data.train_batch_size
        sampler = ResumableSampler(len(train_ds), round_size, cfg.data.seed, cfg.data.shuffle)
        total_steps = t.total_training_steps or t.total_epochs * sampler.batches_per_epoch
        if cfg.model.path is not None:
            actor_cfg, critic_cfg = model_configs(cfg, Path(cfg.model.path))
            check_tokenizer(tokenizer, tokenizer_dir, actor_cfg, Path(cfg.model.path))
        else:
            actor_cfg = tiny_model_config(cfg, len(tokenizer), tokenizer.eos_token_id, tokenizer.pad_token_id)
            critic_cfg = actor_cfg if uses_critic(cfg) else None
        b = build(cfg, mesh, actor_cfg, critic_cfg, total_steps)
        lengths = [len(ids) for ds in (train_ds,) for ids in ds.input_ids]
        plan = make_plan(cfg, b, memory.card_bytes(t.device_memory_gb), (min(lengths), max(lengths)))
    except BaseException:
        if staging is not None:
            shutil.rmtree(staging, ignore_errors=True)
        raise
    if not quiet:
        log.info("%s\ntoken budgets per device per micro-batch: %s\nupdate micro-batch loop: %s", plan.table(),
                 plan.budgets, b.loops)
    return Prepared(cfg, mesh, tokenizer, Path(tokenizer_dir), train_ds, val_ds, sampler, total_steps, b, plan,
                    staging)


def adopt(prep: Prepared, run_dir: Path) -> None:
    """Move the staged synthetic data and tokenizer into the run directory (made after the plan)."""
    if prep.staging is None:
        return
    for name in ("data", "tokenizer"):
        src, dst = prep.staging / name, run_dir / name
        if src.exists() and not dst.exists():
            shutil.move(str(src), str(dst))
    if prep.tokenizer_dir.is_relative_to(prep.staging):
        prep.tokenizer_dir = run_dir / prep.tokenizer_dir.relative_to(prep.staging)
    for ds in (prep.train_ds, prep.val_ds):
        if ds is not None:
            ds.files = [str(run_dir / Path(f).relative_to(prep.staging)) if Path(f).is_relative_to(prep.staging)
                        else f for f in ds.files]
    discard(prep)


def discard(prep: Prepared) -> None:
    """Remove what `prepare` staged outside the run directory (a start that ends before `adopt`)."""
    if prep.staging is not None:
        shutil.rmtree(prep.staging, ignore_errors=True)
        prep.staging = None


def create_states(cfg: Config, b: Build, start_dir: Path, seed: int) -> PPOState:
    """The actor's (and critic's) real train states, read from `start_dir` into the shardings the plan compiled
    for (under LoRA the adapters; the frozen base goes to the engine); the reference in the compute dtype."""
    a_lora, c_lora = b.actor_lora, b.critic_lora
    kw = dict(mesh=b.mesh, random_init=cfg.model.random_init)
    _, actor_params, _ = load_model(start_dir, rng=jax.random.PRNGKey(seed + 2), **kw, **with_lora(cfg, a_lora))
    actor_state = b.actor.init_state(actor_params)  # under LoRA: the adapters; the base is b.actor.frozen
    del actor_params
    ref_params = b.ref  # None without a KL term; {} under LoRA: the base module on the frozen weights, nothing held
    if ref_params:
        # stored in the compute dtype: its forward pass casts every weight to it anyway, so its log-probs are
        # bit-identical to those of an fp32 copy at half (bf16) the memory (a copy either way: the actor's buffers
        # are donated to its updates)
        # (one program for the whole tree, each output in its parameter's sharding; a copy, never the input's
        # buffer forwarded: copy_p has no forwarding rule)
        compute = DTYPES[cfg.model.dtype]
        ref_params = jax.jit(
            lambda ps: jax.tree.map(lambda p: p.astype(compute) if p.dtype != compute else jnp.copy(p), ps),
            out_shardings=jax.tree.map(lambda p: p.sharding, actor_state.params))(actor_state.params)
    critic_state = None
    if b.critic is not None:
        _, critic_params, _ = load_model(cfg.model.critic_path or start_dir, "value", rng=jax.random.PRNGKey(seed + 1),
                                         **kw, **with_lora(cfg, c_lora))
        critic_state = b.critic.init_state(critic_params)
    return PPOState(actor_state, critic_state, ref_params, cfg.algorithm.kl_ctrl.kl_coef)


def warm_kwargs(cfg: Config, mesh: jax.sharding.Mesh) -> dict[str, Any]:
    """load_model keywords of the warm start (the whole model, no adapters)."""
    return dict(model_kwargs(cfg), mesh=mesh, random_init=cfg.model.random_init)


__all__ = ["Prepared", "prepare", "adopt", "create_states", "warm_kwargs", "enable_compilation_cache"]
