"""What a run trains, built before anything is allocated: the modules, the actor and critic engines, and their
states as abstract arrays (shapes, dtypes and shardings) that the memory plan compiles the step's programs
against (`jaxppo/plan.py`). The trainer then creates the real states in exactly these shardings, so the programs
compiled for the plan are the ones it runs."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import flax.linen as nn
import jax

from jaxppo.config import Config, uses_critic
from jaxppo.engine import ActorEngine, CriticEngine, TrainState
from jaxppo.health import update_guards
from jaxppo.models import ModelConfig, abstract_params, build_model
from jaxppo.models.lora import LoraSpec, is_adapter, spec_from
from jaxppo.programs import device_bytes
from jaxppo.setup import DTYPES, attention_impl
from jaxppo.sharding import param_shardings
from jaxppo.step import old_from_update


@dataclasses.dataclass
class Build:
    cfg: Config
    mesh: jax.sharding.Mesh
    actor_cfg: ModelConfig
    critic_cfg: ModelConfig | None
    actor: ActorEngine
    critic: CriticEngine | None
    actor_lora: LoraSpec
    critic_lora: LoraSpec
    actor_state: TrainState  # abstract (ShapeDtypeStructs with shardings)
    actor_frozen: Any  # LoRA: the frozen base, abstract; else None
    critic_state: TrainState | None
    critic_frozen: Any
    ref: Any  # the reference policy's parameters, abstract; None without a KL term

    @property
    def shards(self) -> int:
        return self.mesh.shape["fsdp"] * self.mesh.shape["tensor"]

    @property
    def loops(self) -> str:
        """The updates' micro-batch loops, for the start's log: `actor host, critic scan`."""
        engines = [("actor", self.actor), ("critic", self.critic)]
        return ", ".join(f"{name} {e.micro_batch_loop}" for name, e in engines if e is not None)

    @property
    def truncation(self) -> tuple[int, float] | None:
        r = self.cfg.rollout
        return (r.top_k, r.top_p) if (r.top_k > 0 or r.top_p < 1.0) else None

    @property
    def needs_ref_logprobs(self) -> bool:
        from jaxppo.step import needs_ref_logprobs

        return needs_ref_logprobs(self.cfg)

    def state_bytes(self) -> dict[str, int]:
        """What the run holds on one device for its whole length, by component."""
        out = {}
        if self.actor_frozen is not None:
            out["actor base (frozen, compute dtype)"] = device_bytes(self.actor_frozen)
            out["actor adapters (fp32 + AdamW)"] = device_bytes(self.actor_state)
        else:
            out["actor (weights + AdamW)" if not self.offloaded(self.actor_state)
                else "actor (weights; AdamW in host memory)"] = device_bytes(self.actor_state)
        if self.critic_state is not None:
            if self.critic_frozen is not None:
                out["critic base (frozen, compute dtype)"] = device_bytes(self.critic_frozen)
                out["critic adapters + head (fp32 + AdamW)"] = device_bytes(self.critic_state)
            else:
                out["critic (weights + AdamW)" if not self.offloaded(self.critic_state)
                    else "critic (weights; AdamW in host memory)"] = device_bytes(self.critic_state)
        if self.ref:  # under LoRA {}: the base module, nothing of its own
            out["reference (compute dtype)"] = device_bytes(self.ref)
        return out

    @staticmethod
    def offloaded(state: Any) -> bool:
        from jaxppo.offload import is_host

        return any(is_host(x) for x in jax.tree.leaves(state.opt_state))

    def host_state_bytes(self) -> dict[str, int]:
        """What the run keeps in this host's memory (offloaded optimizer states: jaxppo/offload.py)."""
        from jaxppo.offload import host_bytes

        out = {f"{name} AdamW moments": host_bytes(state.opt_state)
               for name, state in (("actor", self.actor_state), ("critic", self.critic_state)) if state is not None}
        return {k: v for k, v in out.items() if v}


def model_kwargs(cfg: Config) -> dict[str, Any]:
    """build_model / load_model keyword arguments of a run's models."""
    return dict(dtype=DTYPES[cfg.model.dtype], param_dtype=DTYPES[cfg.model.param_dtype], remat=cfg.model.remat,
                attention_impl=attention_impl(cfg),
                attention_window=cfg.data.max_prompt_length + cfg.data.max_response_length,
                scan_unroll=cfg.model.scan_unroll)


def with_lora(cfg: Config, spec: LoraSpec) -> dict[str, Any]:
    """Under LoRA the frozen base is stored in the compute dtype."""
    kw = model_kwargs(cfg)
    return dict(kw, lora=spec, param_dtype=kw["dtype"]) if spec.rank else kw


def critic_score_bias(critic_path: str | None) -> bool:
    """A critic checkpoint's value head has a bias when its `score.bias` is stored; a new head has one."""
    if not critic_path:
        return True
    from jaxppo.models.config import load_config as load_model_config
    from jaxppo.models.hf_io import SafetensorsIndex

    _, kind = load_model_config(critic_path)
    return "score.bias" in SafetensorsIndex(critic_path).files if kind == "score" else True


def abstract_of(module: nn.Module, mesh: jax.sharding.Mesh) -> Any:
    boxed = abstract_params(module)
    shardings = param_shardings(boxed, mesh)
    return jax.tree.map(lambda x, sh: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sh), nn.unbox(boxed), shardings)


def build(cfg: Config, mesh: jax.sharding.Mesh, actor_cfg: ModelConfig, critic_cfg: ModelConfig | None,
          total_steps: int) -> Build:
    """Modules, engines and abstract states of a run of `total_steps` PPO steps (the schedules' length)."""
    a, c = cfg.actor, cfg.critic
    R = cfg.data.max_response_length
    steps_per = lambda sub: sub.ppo_epochs * (cfg.data.train_batch_size // sub.ppo_mini_batch_size)  # noqa: E731
    actor_lora, critic_lora = spec_from(a), spec_from(c)
    module = build_model(actor_cfg, "lm", **with_lora(cfg, actor_lora))
    actor = ActorEngine(module, mesh, a, R, a.optim.total_steps or total_steps * steps_per(a), cfg.rollout.temperature,
                        cfg.mesh.fsdp_gather, cfg.mesh.grad_reduce_dtype,
                        trainable=is_adapter if actor_lora.rank else None)
    # the health guards are part of the compiled update (jaxppo/health.py): set before the plan compiles it
    actor.guards = update_guards(cfg.trainer.health, "actor")
    actor.micro_batch_loop = resolve_micro_batch_loop(cfg.model.micro_batch_loop, bool(actor_lora.rank))
    actor.optimizer_offload = a.optimizer_offload  # before the state's shardings are made (jaxppo/offload.py)
    # verl's bypass mode: the policy loss corrects the rollout's gap itself (jaxppo/ppo/bypass.py)
    actor.bypass = cfg.algorithm.rollout_correction if cfg.algorithm.rollout_correction.bypass_mode else None
    # one update a step from the weights that sampled: no forward pass for the old log-probs (jaxppo/step.py)
    actor.old_from_update = old_from_update(cfg)
    actor_state, actor_frozen = actor.abstract_state(abstract_of(module, mesh))
    ref = None
    if cfg.actor.use_kl_loss or cfg.algorithm.use_kl_in_reward:
        compute = DTYPES[cfg.model.dtype]
        # under LoRA the reference is the base module on the frozen weights: no arrays of its own (jaxppo/start.py)
        ref = {} if actor_lora.rank else jax.tree.map(
            lambda x: jax.ShapeDtypeStruct(x.shape, compute, sharding=x.sharding), actor_state.params)
    critic = critic_state = critic_frozen = None
    if uses_critic(cfg):
        critic_module = build_model(critic_cfg, "value", score_bias=critic_score_bias(cfg.model.critic_path),
                                    **with_lora(cfg, critic_lora))
        critic = CriticEngine(critic_module, mesh, c, R, c.optim.total_steps or total_steps * steps_per(c),
                              cfg.mesh.fsdp_gather, cfg.mesh.grad_reduce_dtype,
                              trainable=(lambda p: is_adapter(p) or p[0] == "score") if critic_lora.rank else None)
        critic.guards = update_guards(cfg.trainer.health, "critic")
        critic.optimizer_offload = c.optimizer_offload
        critic.micro_batch_loop = resolve_micro_batch_loop(cfg.model.micro_batch_loop, bool(critic_lora.rank))
        critic_state, critic_frozen = critic.abstract_state(abstract_of(critic_module, mesh))
    return Build(cfg, mesh, actor_cfg, critic_cfg if critic is not None else None, actor, critic, actor_lora,
                 critic_lora, actor_state, actor_frozen, critic_state, critic_frozen, ref)


def resolve_micro_batch_loop(choice: str, lora: bool) -> str:
    """`model.micro_batch_loop` for one engine (jaxppo/accumulate.py): `auto` is `host` where the engine trains LoRA
    adapters and `scan` under full fine-tuning. Measured on an H100 (docs/benchmarks.md, 2026-12-07): XLA's loop over
    micro-batches carries a compute-dtype copy of the frozen weights that one micro-batch's program does not (7B:
    12.15 GiB; the plan's update budget 2048 -> 7168 tokens, the update 6.29 -> 5.49 s), while under full fine-tuning
    the weights are the trained state the update holds anyway: the same probes, budgets and pace at 0.5B and 1.5B."""
    if choice != "auto":
        return choice
    return "host" if lora else "scan"


def model_configs(cfg: Config, model_dir: Path) -> tuple[ModelConfig, ModelConfig | None]:
    """(actor, critic) model configs from config.json: the critic's own checkpoint, else the actor's shape."""
    from jaxppo.models.config import load_config as load_model_config

    actor, _ = load_model_config(model_dir)
    if not uses_critic(cfg):
        return actor, None
    return actor, (load_model_config(cfg.model.critic_path)[0] if cfg.model.critic_path else actor)


__all__ = ["Build", "build", "model_configs", "model_kwargs", "with_lora", "critic_score_bias"]
