"""The GPU memory plan: how the card is split between vLLM and JAX, what JAX will hold, and the token
budgets that fit — estimated from the model's shape before anything is allocated (docs/memory.md).

The split: vLLM takes `rollout.gpu_memory_utilization` (u) of the card for weights + KV cache and checks at
start that it is free; JAX takes 1 - u - MARGIN of it as one allocation at start
(`XLA_PYTHON_CLIENT_PREALLOCATE=true`, `XLA_PYTHON_CLIENT_MEM_FRACTION`), so the two never compete. vLLM sleeps
while JAX trains (KV cache freed, weights dropped: level 2) and wakes for generation. The variables must be
set before JAX initialises its GPU backend, which is why `jaxppo.train` applies the plan first.

Why JAX preallocates: grown on demand, XLA's BFC allocator adds regions of doubling size (2 MiB, 4 MiB, ...,
32 GiB) and never returns them; an executable's temporaries are one contiguous buffer. On the H200 the 1.5B
PPO run's states (37.4 GiB) had grown the pool to 64 GiB of regions by the first update, and the critic
update's 49.5 GiB (budget 12288) or 56.0 GiB (16384) temporary then fit neither a free chunk of those
regions nor the 40.9 GiB left to grow into: out of memory with 67 GiB of the limit unused (2026-12-01,
docs/benchmarks.md "PPO step"). One region of the whole limit has no such ceiling.

What JAX holds, per device (sharded states divided by mesh.fsdp x mesh.tensor):
  actor        fp32 master weights + AdamW's two moments (12 bytes per parameter)
  critic       the same for the value model (no vocabulary head)
  reference    the reference policy in the compute dtype (2 bytes per parameter in bf16)
  update       an update's gradients and optimizer temporaries: UPDATE_PER_PARAM x the trained parameters'
               fp32 bytes, for the larger of the two models (one update runs at a time)
  activations  per token of a micro-batch, by remat policy, plus the vocabulary head's logits
  overhead     CUDA context, cuDNN / cuBLAS workspaces, batch buffers
An update's temporaries are empirical, fitted as an upper bound to what XLA asked for on the H200 (jax 0.11.2,
packed rows, unrolled layers, dots_attn): the 1.5B critic update asked 49.45 GiB at a 12288-token budget,
56.03 GiB at 16384, 71.26 GiB at 23552 and 74.21 GiB at 32768 (rows of ~24.5k tokens) — about 26 GiB that
does not grow with the budget (UPDATE_PER_PARAM = 4.5 x its 5.75 GiB of fp32 parameters) plus 25
hidden-sized bf16 vectors per token per decoder layer (plan: 50.5, 58.7, 73.1, 75.1 GiB); the 0.5B step
(budgets 32768) peaked at 51.8 GiB, 11.9 GiB of it states (plan: 53.0); the 1.5B step at its planned budgets
(critic update 14336) at 94.5 GiB, 37.4 of it states, 2.6 GiB above states + the planned critic update: the
overhead (3 GiB) covers such buffers, and the peaks are checked against the plan with it. With full remat the
1.5B critic asked 30.9 GiB at ~24.5k tokens (3 vectors beside the same constant). `dots` and `none` are scaled from
dots_attn by the residuals they keep (not measured). Rows shorter than the budget hold less: an upper bound.
tests/test_memory_plan.py checks the plan against these requests as the ledger records them.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any

from jaxppo.errors import ConfigError
from jaxppo.models.config import ModelConfig

MARGIN = 0.05  # CUDA context, cuBLAS / cuDNN workspaces, NCCL buffers, fragmentation
GiB = 2**30
OVERHEAD_BYTES = 3 * GiB  # per device, besides the components below: buffers live beside an update (the 1.5B
# committed config peaked 2.6 GiB above its states + planned critic update on 2026-12-01; 2 GiB was too little)
ACT_PER_LAYER = {"full": 3.0, "dots": 24.5, "dots_attn": 25.0, "none": 35.0}  # hidden-sized vectors per token per layer
UPDATE_PER_PARAM = 4.5  # an update's gradients + optimizer temporaries, per fp32 byte of the trained parameters
FORWARD_PER_TOKEN = 25.0  # hidden-sized vectors per token of a forward-only pass (one layer's transients)
HEAD_TEMPS = 3  # float32 [tokens, vocab] temporaries of a head chunk: logits, softmax, cotangent
AUTO_MAX_BUDGET = 32768  # the largest token budget chosen automatically (per device per micro-batch)
AUTO_HEADROOM = 0.9  # automatic budgets fill at most this fraction of JAX's limit (fragmentation, estimate error)
DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}


# ------------------------------------------------------------------ the vLLM / JAX split


def plan(gpu_memory_utilization: float) -> dict[str, str]:
    """Environment for JAX given vLLM's share of the card."""
    if not 0.0 < gpu_memory_utilization < 1.0 - MARGIN:
        raise ValueError(f"rollout.gpu_memory_utilization must be in (0, {1 - MARGIN}), got {gpu_memory_utilization}")
    jax_share = 1.0 - gpu_memory_utilization - MARGIN
    return {"XLA_PYTHON_CLIENT_PREALLOCATE": "true", "XLA_PYTHON_CLIENT_MEM_FRACTION": f"{jax_share:.3f}"}


def apply(gpu_memory_utilization: float) -> dict[str, str]:
    """Set the plan's variables (those the user set explicitly win) and return what is in force."""
    env = plan(gpu_memory_utilization)
    for k, v in env.items():
        os.environ.setdefault(k, v)
    return {k: os.environ[k] for k in env}


def jax_fraction() -> float:
    return float(os.environ.get("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.75"))


def card_bytes(device_memory_gb: float = 0.0) -> float | None:
    """The accelerator's memory: `trainer.device_memory_gb` when set (> 0), else read from the first JAX
    device (its allocator's limit over the fraction it was given); None on CPU."""
    if device_memory_gb > 0:
        return device_memory_gb * GiB
    import jax

    dev = jax.local_devices()[0]
    if dev.platform == "cpu":
        return None
    limit = (dev.memory_stats() or {}).get("bytes_limit")
    return float(limit) / jax_fraction() if limit else None


# ------------------------------------------------------------------ estimates


@dataclasses.dataclass(frozen=True)
class TokenBudgets:
    """Packed tokens per device per micro-batch, by phase (the `*_max_token_len_per_device` in force)."""

    actor_update: int
    actor_forward: int
    critic_update: int
    critic_forward: int


def trainable_params(cfg: Any, actor: ModelConfig, critic: ModelConfig | None) -> tuple[float, float]:
    """(actor, critic) bytes of one gradient per device-unsharded copy: every parameter in param_dtype, or under
    LoRA the float32 adapters (and the critic's float32 value head)."""
    from jaxppo.models.lora import adapter_params, spec_from

    sa, sc = spec_from(cfg.actor), spec_from(cfg.critic)
    master = DTYPE_BYTES[cfg.model.param_dtype]
    g_actor = 4 * adapter_params(actor, sa) if sa.rank else master * actor.num_params()
    g_critic = 0.0
    if critic is not None:
        head = critic.hidden_size + 1
        g_critic = (4 * (adapter_params(critic, sc) + head) if sc.rank
                    else master * (critic.num_params(with_head=False) + head))
    return g_actor, g_critic


def state_bytes(cfg: Any, actor: ModelConfig, critic: ModelConfig | None, shards: int) -> dict[str, float]:
    """What JAX holds for the whole run, per device. Under LoRA a model is its frozen base in the compute dtype
    plus float32 adapters with AdamW (12 bytes per adapter parameter), and the reference is that same base
    with the adapters off (no copy)."""
    from jaxppo.models.lora import spec_from

    m = cfg.model
    compute = DTYPE_BYTES[m.dtype]
    lora_a, lora_c = spec_from(cfg.actor).rank > 0, spec_from(cfg.critic).rank > 0
    n_actor = actor.num_params()
    g_actor, g_critic = trainable_params(cfg, actor, critic)  # one gradient's bytes; weights + 2 moments: 3x
    out = {}
    if lora_a:
        out["actor base (frozen, compute dtype)"] = compute * n_actor / shards
        out["actor adapters (fp32 + AdamW)"] = 3 * g_actor / shards
    else:
        out["actor (weights + AdamW)"] = 3 * g_actor / shards
    if critic is not None:
        if lora_c:
            out["critic base (frozen, compute dtype)"] = compute * critic.num_params(with_head=False) / shards
            out["critic adapters + head (fp32 + AdamW)"] = 3 * g_critic / shards
        else:
            out["critic (weights + AdamW)"] = 3 * g_critic / shards
    if (cfg.actor.use_kl_loss or cfg.algorithm.use_kl_in_reward) and not lora_a:
        out["reference (compute dtype)"] = compute * n_actor / shards
    if cfg.mesh.fsdp_gather == "update" and cfg.mesh.fsdp > 1:
        out["gathered compute copy"] = DTYPE_BYTES[m.dtype] * n_actor  # whole, during an update / forward pass
    return out


def activation_bytes(cfg: Any, model: ModelConfig, tokens: int, rows: int, training: bool, lm_head: bool) -> float:
    """Activations of one micro-batch of `tokens` tokens in `rows` rows on one device."""
    s = DTYPE_BYTES[cfg.model.dtype]
    per_token = (ACT_PER_LAYER[cfg.model.remat] * model.num_hidden_layers if training else FORWARD_PER_TOKEN)
    out = per_token * model.hidden_size * s * tokens / max(cfg.mesh.tensor, 1)
    if lm_head:
        a = cfg.actor
        chunk = rows * min(a.logprob_chunk_size, cfg.data.max_response_length) * model.vocab_size * 4 * HEAD_TEMPS
        kept = 0.0
        if training and not a.logprob_remat:  # every response token's logits kept for the backward pass
            # (padded rows hold at most R response tokens each; a packed row, up to all of its tokens)
            responses = tokens if a.use_dynamic_bsz else rows * cfg.data.max_response_length
            kept = responses * model.vocab_size * 4
        out += chunk + kept
    return out


def _phase_tokens(cfg: Any, sub: Any, budget: int, per_device: int) -> tuple[int, int]:
    """(tokens, rows) of one micro-batch on one device: a packed row of `budget` tokens, or `per_device`
    padded sequences."""
    seq = cfg.data.max_prompt_length + cfg.data.max_response_length
    if sub.use_dynamic_bsz:
        return budget, 1
    return per_device * seq, per_device


@dataclasses.dataclass
class MemoryEstimate:
    components: dict[str, float]  # bytes per device, the peak phase's
    peak_phase: str
    jax_limit: float | None  # bytes JAX may use per device (None: unknown card)
    card: float | None
    vllm_bytes: float | None  # vLLM's share of the card
    vllm_needs: float  # weights + a full batch's KV cache + activations and graphs

    @property
    def total(self) -> float:
        return sum(self.components.values())

    @property
    def fits(self) -> bool:
        return self.jax_limit is None or self.total <= self.jax_limit

    def table(self) -> str:
        gb = lambda b: f"{b / GiB:7.1f} GiB"  # noqa: E731
        lines = [f"memory plan per device (peak phase: {self.peak_phase}):"]
        lines += [f"  {k:<38}{gb(v)}" for k, v in self.components.items()]
        lines.append(f"  {'JAX total':<38}{gb(self.total)}")
        if self.card:
            lines.append(f"  {'JAX limit':<38}{gb(self.jax_limit)}  ({self.jax_limit / self.card:.2f} of a "
                         f"{self.card / GiB:.0f} GiB card)")
            if self.vllm_bytes is not None:
                lines.append(f"  {'vLLM share':<38}{gb(self.vllm_bytes)}  (needs about {self.vllm_needs / GiB:.1f} "
                             "GiB: weights, the batch's KV cache, graphs)")
        return "\n".join(lines)


def vllm_needs(cfg: Any, model: ModelConfig) -> float:
    """Weights in the compute dtype, the KV cache of a whole step's sequences at full length, and ~1.5 GiB of
    activations, CUDA graphs and allocator slack."""
    d = cfg.data
    s = DTYPE_BYTES[cfg.model.dtype]
    kv_per_token = 2 * model.num_hidden_layers * model.num_key_value_heads * model.head_dim * s
    seqs = d.train_batch_size * cfg.rollout.n
    return model.num_params() * s + kv_per_token * seqs * (d.max_prompt_length + d.max_response_length) + 1.5 * GiB


def phases(cfg: Any, actor: ModelConfig, critic: ModelConfig | None, shards: int,
           budgets: TokenBudgets) -> dict[str, dict[str, float]]:
    """What each phase of a step holds beside the run's states, per device: {phase: {component: bytes}}."""
    out = {}
    a, c = cfg.actor, cfg.critic
    t_actor, t_critic = trainable_params(cfg, actor, critic)
    t, r = _phase_tokens(cfg, a, budgets.actor_forward, a.log_prob_micro_batch_size_per_device)
    out["actor forward"] = {"activations (actor forward)": activation_bytes(cfg, actor, t, r, False, True)}
    t, r = _phase_tokens(cfg, a, budgets.actor_update, a.ppo_micro_batch_size_per_device)
    out["actor update"] = {"update temporaries (actor)": UPDATE_PER_PARAM * t_actor / shards,
                           "activations (actor update)": activation_bytes(cfg, actor, t, r, True, True)}
    if critic is not None:
        t, r = _phase_tokens(cfg, c, budgets.critic_forward, c.log_prob_micro_batch_size_per_device)
        out["critic forward"] = {"activations (critic forward)": activation_bytes(cfg, critic, t, r, False, False)}
        t, r = _phase_tokens(cfg, c, budgets.critic_update, c.ppo_micro_batch_size_per_device)
        out["critic update"] = {"update temporaries (critic)": UPDATE_PER_PARAM * t_critic / shards,
                                "activations (critic update)": activation_bytes(cfg, critic, t, r, True, False)}
    return out


def estimate(cfg: Any, actor: ModelConfig, critic: ModelConfig | None, shards: int, card: float | None,
             budgets: TokenBudgets) -> MemoryEstimate:
    """JAX's peak per device over the step's phases (forward passes, critic update, actor update)."""
    fixed = state_bytes(cfg, actor, critic, shards)
    phases_ = phases(cfg, actor, critic, shards, budgets)
    peak = max(phases_, key=lambda k: sum(phases_[k].values()))
    comps = dict(fixed, **phases_[peak], overhead=float(OVERHEAD_BYTES))
    u = cfg.rollout.gpu_memory_utilization
    vllm = cfg.rollout.engine == "vllm"
    limit = None
    if card is not None:
        limit = (1.0 - u - MARGIN) * card if vllm else jax_fraction() * card
    return MemoryEstimate(comps, peak, limit, card, u * card if (card and vllm) else None,
                          vllm_needs(cfg, actor) if vllm else 0.0)


def token_budgets(cfg: Any, actor: ModelConfig, critic: ModelConfig | None, shards: int,
                  card: float | None) -> TokenBudgets:
    """The token budgets in force: a user's (> 0) as given, else (0: auto) the largest multiple of 1024 up to
    AUTO_MAX_BUDGET whose phase fits JAX's share of the card beside the run's states (or AUTO_MAX_BUDGET's
    half, 16384, when the card is unknown)."""
    a, c = cfg.actor, cfg.critic
    seq = cfg.data.max_prompt_length + cfg.data.max_response_length
    fixed = sum(state_bytes(cfg, actor, critic, shards).values()) + OVERHEAD_BYTES
    t_actor, t_critic = trainable_params(cfg, actor, critic or actor)
    # an update's temporaries, keyed by lm_head (the actor's phases have it)
    update_temps = {True: UPDATE_PER_PARAM * t_actor, False: UPDATE_PER_PARAM * t_critic}
    limit = None
    if card is not None:
        u = cfg.rollout.gpu_memory_utilization if cfg.rollout.engine == "vllm" else 1.0 - jax_fraction() - MARGIN
        limit = (1.0 - u - MARGIN) * card

    def pick(given: int, model: ModelConfig, training: bool, lm_head: bool) -> int:
        if given > 0:
            return given
        if limit is None:
            return AUTO_MAX_BUDGET // 2
        grads = update_temps[lm_head] / shards if training else 0.0
        best = 0
        for budget in range(1024, AUTO_MAX_BUDGET + 1, 1024):
            if fixed + grads + activation_bytes(cfg, model, budget, 1, training, lm_head) <= AUTO_HEADROOM * limit:
                best = budget
        return max(best, seq)  # at least one sequence: if even that does not fit, the estimate says so

    no_critic = critic is None  # critic-free estimators: no critic phases, budgets 0
    return TokenBudgets(actor_update=pick(a.ppo_max_token_len_per_device, actor, True, True),
                        actor_forward=pick(a.log_prob_max_token_len_per_device, actor, False, True),
                        critic_update=0 if no_critic else pick(c.ppo_max_token_len_per_device, critic, True, False),
                        critic_forward=0 if no_critic else pick(c.forward_max_token_len_per_device, critic, False,
                                                                False))


def check(cfg: Any, est: MemoryEstimate, budgets: TokenBudgets) -> None:
    """A configuration that cannot fit raises ConfigError (exit 2) saying what to change."""
    if est.card is None:
        return
    advice = []
    if not est.fits:
        over = est.total - est.jax_limit
        advice.append(f"JAX needs about {est.total / GiB:.1f} GiB per device at its peak ({est.peak_phase}) but may "
                      f"use {est.jax_limit / GiB:.1f} GiB ({over / GiB:.1f} GiB over)")
        states = sum(v for k, v in est.components.items() if not k.startswith(("activations", "overhead")))
        sub = "actor" if "actor" in est.peak_phase else "critic"
        if states + OVERHEAD_BYTES > AUTO_HEADROOM * est.jax_limit:
            shards = cfg.mesh.fsdp * cfg.mesh.tensor
            need = int(-(-states * shards // (0.6 * est.jax_limit)))
            advice.append(f"the weights, optimizer states and gradients alone need {states / GiB:.1f} GiB per device: "
                          f"shard them over more devices (mesh.fsdp={max(need, 2)} or more)")
        elif getattr(cfg, sub).use_dynamic_bsz:
            key = ("ppo_max_token_len_per_device" if "update" in est.peak_phase else
                   ("log_prob_max_token_len_per_device" if sub == "actor" else "forward_max_token_len_per_device"))
            advice.append(f"lower {sub}.{key} (now {getattr(budgets, est.peak_phase.replace(' ', '_'))}; 0 picks the "
                          f"largest that fits)")
        else:
            advice.append(f"lower {sub}.ppo_micro_batch_size_per_device / log_prob_micro_batch_size_per_device, or "
                          f"pack sequences ({sub}.use_dynamic_bsz=true with token budgets 0: the largest that fits)")
        if est.vllm_bytes and est.vllm_bytes > 1.5 * est.vllm_needs:
            advice.append(f"lower rollout.gpu_memory_utilization (now {cfg.rollout.gpu_memory_utilization}: "
                          f"{est.vllm_bytes / GiB:.1f} GiB for vLLM, which needs about {est.vllm_needs / GiB:.1f})")
    if est.vllm_bytes is not None and est.vllm_bytes < est.vllm_needs * 0.5:
        advice.append(f"vLLM's share ({est.vllm_bytes / GiB:.1f} GiB, rollout.gpu_memory_utilization="
                      f"{cfg.rollout.gpu_memory_utilization}) cannot hold the weights and a useful KV cache (about "
                      f"{est.vllm_needs / GiB:.1f} GiB for the whole batch): raise it")
    if advice:
        raise ConfigError("the run does not fit the card:\n  " + "\n  ".join(advice) + "\n" + est.table())


def plan_for_config(cfg: Any, num_devices: int) -> tuple[MemoryEstimate, TokenBudgets] | None:
    """The memory estimate and token budgets of a config, from the model directories' config.json alone
    (nothing loaded or allocated); None for the embedded default (its tiny model is made at start)."""
    if cfg.model.path is None:
        return None
    from jaxppo.models.config import load_config as load_model_config
    from jaxppo.sharding import resolve_mesh_shape

    actor, _ = load_model_config(cfg.model.path)
    from jaxppo.config import uses_critic

    critic = None
    if uses_critic(cfg):
        critic = load_model_config(cfg.model.critic_path)[0] if cfg.model.critic_path else actor
    sizes = resolve_mesh_shape(cfg.mesh.axes(), num_devices)
    shards = sizes["fsdp"] * sizes["tensor"]
    card = card_bytes(cfg.trainer.device_memory_gb)
    budgets = token_budgets(cfg, actor, critic, shards, card)
    return estimate(cfg, actor, critic, shards, card, budgets), budgets


def held_bytes(tree: Any, device: Any = None) -> int:
    """Bytes of the distinct device buffers behind `tree`'s arrays on `device` (default: the first local one): what
    a state really holds there, an array and its views counted once."""
    import jax

    device = device or jax.local_devices()[0]
    seen = {}
    for x in jax.tree.leaves(tree):
        if isinstance(x, jax.Array):
            for shard in x.addressable_shards:
                if shard.device == device:
                    seen[shard.data.unsafe_buffer_pointer()] = shard.data.nbytes
    return sum(seen.values())


def describe(gpu_memory_utilization: float, jax_limit_bytes: int | None) -> str:
    """One line for the log; `jax_limit_bytes` is JAX's `bytes_limit` (its fraction of the card)."""
    jax_frac = jax_fraction()
    total_bytes = jax_limit_bytes / jax_frac if jax_limit_bytes else None
    if total_bytes:
        gb = total_bytes / GiB
        return (f"GPU memory plan: {gb:.0f} GiB card; vLLM {gpu_memory_utilization:.2f} = "
                f"{gb * gpu_memory_utilization:.1f} GiB (weights + KV cache, asleep during training); "
                f"JAX {jax_frac:.2f} = {gb * jax_frac:.1f} GiB (one allocation at start)")
    return f"GPU memory plan: vLLM {gpu_memory_utilization:.2f} of the card, JAX up to {jax_frac:.2f}"
