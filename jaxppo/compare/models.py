"""What `compare ppo-step` loads into both frameworks: the config and the batch's split, the actor, critic and
reference in jaxppo and in transformers, parameters as {HF name: array}, and the parts of a mini-batch each update
reads."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import numpy as np

DTYPES = ("float32", "bfloat16", "float64")


def jax_dtypes() -> dict:
    import jax.numpy as jnp

    return {"float32": jnp.float32, "bfloat16": jnp.bfloat16, "float64": jnp.float64}


def hf_numpy(tree: Any, dtype: Any, cast: Any = None) -> dict[str, np.ndarray]:
    """A parameter tree as {HF name: numpy array}, exported in `dtype` (then cast to `cast`, if given)."""
    from jaxppo.models.hf_io import export_hf_arrays

    return {n: np.asarray(x, cast) for n, x in export_hf_arrays(tree, dtype)}


@dataclasses.dataclass
class Setup:
    """What ppo-step runs: the config, the batch's split (B prompts x responses, P / R tokens, K mini-batches of
    mb rows, per_dev rows per micro-batch and device), the dtypes of both frameworks, the mesh and engines' configs,
    which KL terms and LoRA adapters are on."""

    cfg: Any
    B: int
    P: int
    R: int
    K: int
    mb: int
    f64: bool
    pdt: Any  # the trained parameters' dtype in both frameworks
    tdt: str
    autocast: Any
    mesh: Any
    kw: dict  # load_model's keyword arguments
    a_cfg: Any
    c_cfg: Any
    use_ref: bool
    full_kl: bool
    a_lora: Any
    c_lora: Any


def setup(args, overrides: list[str]) -> Setup:
    import jax
    import jax.numpy as jnp
    import torch

    from jaxppo.config import load_config
    from jaxppo.errors import ConfigError
    from jaxppo.models.lora import spec_from
    from jaxppo.sharding import make_mesh

    cfg = load_config(args.config, overrides)
    if cfg.algorithm.adv_estimator != "gae":
        raise ConfigError("ppo-step compares the GAE pipeline (actor + critic); algorithm.adv_estimator must be gae")
    B, K = args.batch, args.mini_batches
    shards = jax.device_count()
    mb = B // K
    if B % K or mb % args.micro_batches or (mb // args.micro_batches) % shards:
        raise ConfigError(f"--batch {B} must split into --mini-batches {K} x --micro-batches {args.micro_batches} "
                          f"x {shards} devices")
    per_dev = mb // args.micro_batches // shards
    f64 = args.dtype == "float64"  # JAX in x64 mode (main), torch in double: the same update end to end
    pdt = jnp.float64 if f64 else jnp.float32
    mesh = make_mesh({"data": -1})
    impl = cfg.model.attention_impl or ("cudnn" if jax.default_backend() == "gpu" and args.dtype != "float32" else None)
    kw = dict(mesh=mesh, dtype=jax_dtypes()[args.dtype], param_dtype=pdt, remat=cfg.model.remat, attention_impl=impl)
    a_cfg = dataclasses.replace(cfg.actor, ppo_micro_batch_size_per_device=per_dev,
                                log_prob_micro_batch_size_per_device=per_dev)
    c_cfg = dataclasses.replace(cfg.critic, ppo_micro_batch_size_per_device=per_dev,
                                log_prob_micro_batch_size_per_device=per_dev)
    # LoRA (actor.lora_rank / critic.lora_rank > 0): jaxppo's adapters against peft's on the same base, from the
    # same adapter initialisation; the reference is the base with the adapters off in both
    a_lora, c_lora = spec_from(cfg.actor), spec_from(cfg.critic)
    if a_lora.rank and args.ref:
        raise ConfigError("--ref with actor.lora_rank > 0: under LoRA the reference policy is the base model "
                          "(--model) with the adapters off")
    return Setup(cfg, B, args.prompt_len, args.response_len, K, mb, f64, pdt, "float64" if f64 else "float32",
                  torch.bfloat16 if args.dtype == "bfloat16" else None, mesh, kw, a_cfg, c_cfg,
                  cfg.actor.use_kl_loss or cfg.algorithm.use_kl_in_reward,
                  cfg.actor.use_kl_loss and cfg.actor.kl_loss_type == "full", a_lora, c_lora)


@dataclasses.dataclass
class Models:
    """The same weights in both frameworks: jaxppo's modules and parameters, the torch actor, critic and reference
    (bridge/reference.py; peft's adapters under LoRA), the torch parameter-name map, the config of the model."""

    actor_mod: Any
    actor_params: Any
    critic_mod: Any
    critic_params: Any
    mcfg: Any
    torch_models: tuple  # (actor, critic, reference)
    t_name: Any
    tmp: Any  # the temporary directory of a critic written for torch (cleaned up by the caller)


def load_both(args, st: Setup) -> Models:
    import tempfile

    import jax

    from bridge import reference as ref_torch
    from jaxppo.models import load_model, save_hf_checkpoint
    from jaxppo.models.lora import is_adapter, split

    cfg, kw, a_lora, c_lora = st.cfg, st.kw, st.a_lora, st.c_lora
    actor_mod, actor_params, mcfg = load_model(args.model, rng=jax.random.PRNGKey(args.seed + 2), lora=a_lora, **kw)
    critic_mod, critic_params, _ = load_model(args.critic or args.model, "value", rng=jax.random.PRNGKey(args.seed),
                                              lora=c_lora, **kw)
    tmp = tempfile.TemporaryDirectory(prefix="jaxppo-compare-")
    critic_dir = args.critic or str(save_hf_checkpoint(split(critic_params, is_adapter)[1], mcfg,
                                                       Path(tmp.name) / "critic", head="value"))
    t_load = lambda d: ref_torch.load_hf_model(d, st.tdt, args.device, inv_freq=mcfg.inv_freq())  # noqa: E731
    t_actor, t_critic = t_load(args.model).train(), t_load(critic_dir).train()
    if cfg.model.remat != "none":
        for m in (t_actor, t_critic):
            m.gradient_checkpointing_enable()
    t_name = ref_torch.peft_to_hf if (a_lora.rank or c_lora.rank) else (lambda n: n)
    if a_lora.rank:
        t_actor = ref_torch.wrap_lora(t_actor, a_lora.rank, a_lora.alpha, a_lora.targets,
                                      hf_numpy(split(actor_params, is_adapter)[0], st.pdt))
    if c_lora.rank:
        t_critic = ref_torch.wrap_lora(t_critic, c_lora.rank, c_lora.alpha, c_lora.targets,
                                       hf_numpy(split(critic_params, is_adapter)[0], st.pdt), train_head=True)
    if st.f64:  # peft's adapters as well
        t_actor, t_critic = t_actor.double(), t_critic.double()
    if a_lora.rank:
        t_ref = ref_torch.AdaptersOff(t_actor)
    else:
        t_ref = t_load(args.ref) if (st.use_ref and args.ref) else t_actor
    return Models(actor_mod, actor_params, critic_mod, critic_params, mcfg, (t_actor, t_critic, t_ref), t_name, tmp)


def critic_part(part: dict) -> dict:
    """What the critic update reads of a mini-batch."""
    return {k: part[k] for k in ("input_ids", "attention_mask", "positions", "response_mask", "values", "returns")}


def actor_part(part: dict) -> dict:
    """What the actor update reads of a mini-batch (all but the critic's targets)."""
    return {k: v for k, v in part.items() if k not in ("values", "returns")}
