"""The card's split between vLLM and JAX, JAX's reservation, and the fitted constants that seed the compiled
memory plan's budget search (`jaxppo/plan.py` decides; docs/memory.md).

The split: `jaxppo.plan` compiles the step's programs and knows what JAX needs per device; JAX takes exactly that
(`reserve`: one allocation made and freed before anything else, so XLA's allocator holds it as one region that
the states and every program's temporaries are carved from), then vLLM starts with the rest of the card (less
MARGIN for CUDA contexts), or with `rollout.gpu_memory_utilization` when set. JAX runs with
`XLA_PYTHON_CLIENT_PREALLOCATE=false` and `XLA_PYTHON_CLIENT_MEM_FRACTION` as a ceiling only; both must be set
before JAX initialises its GPU backend, which is why `jaxppo.train` calls `apply` first.

Why one region: grown on demand, XLA's BFC allocator adds regions of doubling size (2 MiB, 4 MiB, ..., 32 GiB) and
never returns them; an executable's temporaries are one contiguous buffer. On the H200 the 1.5B PPO run's states
(37.4 GiB) had grown the pool to 64 GiB of regions by the first update, and the critic update's 49.5 GiB temporary
then fit neither a free chunk of those regions nor the 40.9 GiB left to grow into (2026-12-01, docs/benchmarks.md
"PPO step"). Until 2026-12-02 JAX preallocated `1 - u - MARGIN` of the card at start for the same reason; the
reservation gives the same single region, sized by the compiler's plan instead of a guess made before it.

The constants below were fitted as upper bounds of what XLA asked for on the H200 (jax 0.11.2, packed rows,
unrolled layers, dots_attn) at three model shapes; they failed on the first shapes they were not fitted to (the 7B
LoRA update asked 125 GiB against a plan of 65). They now only give the budget search its first guess.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any

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


AUTO_VLLM_FLOOR = 0.03  # of the card kept from JAX's ceiling with an automatic split (vLLM's weights, one sequence)


def backend_env(gpu_memory_utilization: float) -> dict[str, str]:
    """Environment for JAX beside in-process vLLM: no preallocation (JAX reserves its planned need, `reserve`), and a
    ceiling of 1 - u - MARGIN of the card (automatic split, u = 0: 1 - MARGIN - AUTO_VLLM_FLOOR)."""
    u = gpu_memory_utilization
    if not 0.0 <= u < 1.0 - MARGIN:
        raise ValueError(f"rollout.gpu_memory_utilization must be in [0, {1 - MARGIN}), got {u}")
    ceiling = 1.0 - u - MARGIN if u > 0 else 1.0 - MARGIN - AUTO_VLLM_FLOOR
    return {"XLA_PYTHON_CLIENT_PREALLOCATE": "false", "XLA_PYTHON_CLIENT_MEM_FRACTION": f"{ceiling:.3f}"}


def apply(gpu_memory_utilization: float) -> dict[str, str]:
    """Set `backend_env`'s variables (those the user set explicitly win) and return what is in force."""
    env = backend_env(gpu_memory_utilization)
    for k, v in env.items():
        os.environ.setdefault(k, v)
    return {k: os.environ[k] for k in env}


def reserve(nbytes: int) -> None:
    """Make XLA's allocator hold `nbytes` on the first GPU as one region, before anything else is allocated there: one
    buffer of that size, freed at once (the allocator keeps the region). Nothing on CPU, with `nbytes` 0, or where
    JAX preallocated its share anyway."""
    import jax

    if nbytes <= 0 or jax.default_backend() != "gpu" or \
            os.environ.get("XLA_PYTHON_CLIENT_PREALLOCATE", "true").lower() != "false":
        return
    import jax.numpy as jnp

    rows = -(-int(nbytes) // (4 << 20))  # 4 MiB rows: no dimension past int32
    block = jax.device_put(jnp.zeros((rows, 1 << 20), jnp.float32), jax.local_devices()[0])
    block.block_until_ready()
    block.delete()


def pool_bytes() -> int | None:
    """What XLA's allocator holds on the first GPU (its regions, used or free); None elsewhere."""
    import jax

    if jax.default_backend() != "gpu":
        return None
    stats = jax.local_devices()[0].memory_stats() or {}
    return stats.get("pool_bytes", stats.get("bytes_reserved"))


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


def describe(plan: Any, jax_limit_bytes: int | None) -> str:
    """One line for the log: the card, vLLM's share, JAX's reservation and ceiling."""
    if not jax_limit_bytes or plan is None or plan.vllm is None:
        return "GPU memory plan: JAX grows on demand"
    card = jax_limit_bytes / jax_fraction()
    return (f"GPU memory plan: {card / GiB:.0f} GiB card; vLLM {plan.vllm.utilization:.3f} = {plan.vllm.bytes / GiB:.1f} "
            f"GiB (weights + KV cache, asleep during training); JAX reserves {plan.need / GiB:.1f} GiB (its compiled "
            f"peak + margin; ceiling {jax_fraction():.2f} of the card)")
