"""The card's split between vLLM and JAX, and the fitted constants that seed the compiled memory plan's budget
search (`jaxppo/plan.py` decides; docs/memory.md).

The split, one process with in-process vLLM on a GPU: the plan is compiled in a child process (`plan_in_child`:
JAX there grows on demand and the budget search's probes skip autotuning), which says what JAX needs per device.
The training process then takes exactly that (plus PLAN_SLACK) as one allocation at start
(`XLA_PYTHON_CLIENT_PREALLOCATE=true`, `XLA_PYTHON_CLIENT_MEM_FRACTION`), vLLM starts with the rest of the card
less MARGIN for CUDA contexts (or with `rollout.gpu_memory_utilization` when set), and the budgets the child chose
are given to the run. The variables must be set before JAX initialises its GPU backend, which is why
`jaxppo.train` does this first. Several processes (jax.distributed) plan in-process against the configured split.

Why one allocation, and why the plan cannot take it in-process: grown on demand, XLA's BFC allocator adds regions of
doubling size (2 MiB, 4 MiB, ..., 32 GiB, 64 GiB) and never returns them; an executable's temporaries are one
contiguous buffer. On the H200 the 1.5B PPO run's states (37.4 GiB) had grown the pool to 64 GiB of regions by the
first update, and the critic update's 49.5 GiB temporary then fit neither a free chunk of those regions nor the
40.9 GiB left to grow into (2026-12-01, docs/benchmarks.md "PPO step"). Reserving the need in-process after the plan
(one buffer made and freed) gets a power-of-two region instead: 64 GiB for the 0.5B run's 47.2 GiB need
(2026-12-02), the difference lost to vLLM. The fraction of a preallocation is read only when JAX starts.

The constants below were fitted as upper bounds of what XLA asked for on the H200 (jax 0.11.2, packed rows,
unrolled layers, dots_attn) at three model shapes; they failed on the first shapes they were not fitted to (the 7B
LoRA update asked 125 GiB against a plan of 65). They now only give the budget search its first guess.
"""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path
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


AUTO_FALLBACK = 0.25  # vLLM's share under an automatic split that no plan resolved (several processes)


def backend_env(gpu_memory_utilization: float, grow: bool = False) -> dict[str, str]:
    """Environment for JAX beside in-process vLLM: its share 1 - u - MARGIN of the card taken as one allocation at
    start (with an automatic split, u = 0, where no plan chose u: vLLM AUTO_FALLBACK); `grow`: taken on demand up
    to that (the child process that plans, which must leave the card to its parent)."""
    u = gpu_memory_utilization
    if not 0.0 <= u < 1.0 - MARGIN:
        raise ValueError(f"rollout.gpu_memory_utilization must be in [0, {1 - MARGIN}), got {u}")
    share = 1.0 - (u or AUTO_FALLBACK) - MARGIN
    return {"XLA_PYTHON_CLIENT_PREALLOCATE": "false" if grow else "true",
            "XLA_PYTHON_CLIENT_MEM_FRACTION": f"{share:.3f}"}


def apply(gpu_memory_utilization: float) -> dict[str, str]:
    """Set `backend_env`'s variables (those the user set explicitly win) and return what is in force."""
    env = backend_env(gpu_memory_utilization)
    for k, v in env.items():
        os.environ.setdefault(k, v)
    return {k: os.environ[k] for k in env}


PLAN_SLACK = 1 * GiB  # added to the planned need for JAX's allocation: the autotuned programs may ask a little
# more than the plan's probes (seen: 0.2 GiB at 0.5B)
BUDGET_KEYS = {"actor_update": "actor.ppo_max_token_len_per_device",
               "actor_forward": "actor.log_prob_max_token_len_per_device",
               "critic_update": "critic.ppo_max_token_len_per_device",
               "critic_forward": "critic.forward_max_token_len_per_device"}


def before_the_gpu(cfg: Any, argv: list[str]) -> tuple[int, Any]:
    """What a vLLM run's process does before JAX touches the GPU (`python -m jaxppo.train`, bench_ppo_step.py):
    the run's own CUDA MPS daemon when `rollout.cuda_mps` asks (jaxppo/mps.py: first, so that the plan's child and
    the engines are its clients), then the card's split: the plan compiled in a child process (`plan_in_child`,
    ARGV the run's config arguments) or the configured split (`apply`). Returns (exit code, the config to run)."""
    from jaxppo import mps

    mps.start(cfg)
    if plans_in_a_child(cfg):
        return plan_in_child(cfg, argv)
    apply(cfg.rollout.gpu_memory_utilization)
    return 0, cfg


def plans_in_a_child(cfg: Any) -> bool:
    """The plan runs in a child process where it decides JAX's allocation: in-process vLLM on a GPU, one process
    (jax.distributed runs plan in-process against their configured split), training (not plan_only / val_only)."""
    import shutil

    from jaxppo.distributed import topology_from_env

    t = cfg.trainer
    gpu = os.environ.get("JAX_PLATFORMS", "") in ("", "cuda", "gpu") and shutil.which("nvidia-smi") is not None
    return (gpu and not t.plan_only and not t.val_only and os.environ.get("JAXPPO_PLAN_CHILD") != "1"
            and topology_from_env() is None)


def plan_in_child(cfg: Any, argv: list[str]) -> tuple[int, Any]:
    """Run `python -m jaxppo.train ARGV trainer.plan_only=true` in a child (JAX growing on demand there, the budget
    search's probes compiled without autotuning) and take its plan: the token budgets it chose become given
    budgets, vLLM's share its `gpu_memory_utilization`, and JAX here preallocates the planned need as one region
    (`XLA_PYTHON_CLIENT_MEM_FRACTION`), and its pinned host pool may grow to hold the offloaded states
    (`jaxppo.host_plan.set_cap`). Returns (exit code: 2 when the run cannot fit, the child's refusal
    printed; the config to run)."""
    import json
    import subprocess
    import sys
    import tempfile

    from jaxppo.host_plan import set_cap

    with tempfile.TemporaryDirectory(prefix="jaxppo-plan-") as tmp:
        out = Path(tmp) / "plan.json"
        env = dict(os.environ, JAXPPO_PLAN_CHILD="1", JAXPPO_PROBE_WITHOUT_AUTOTUNE="1",
                   **backend_env(cfg.rollout.gpu_memory_utilization, grow=True))
        res = subprocess.run([sys.executable, "-m", "jaxppo.train", "--plan-json", str(out), *argv,
                              "trainer.plan_only=true"], env=env, stdout=subprocess.PIPE, text=True)
        if res.returncode != 0:
            return res.returncode, cfg
        plan = json.loads(out.read_text())
    log = __import__("logging").getLogger(__name__)
    log.info("memory plan (compiled in a child process):\n%s", plan["table"])
    given = [f"{BUDGET_KEYS[k]}={v}" for k, v in plan["budgets"].items() if v > 0]
    card, need = plan["card"], plan["need"]
    u = cfg.rollout.gpu_memory_utilization
    if u == 0 and plan["vllm"] is not None:  # automatic: JAX its need (+ slack), vLLM the rest
        jax_share = min((need + PLAN_SLACK) / card, 1.0 - MARGIN - 0.01)
        u = max(1.0 - MARGIN - jax_share, 0.01)
        given.append(f"rollout.gpu_memory_utilization={u:.4f}")
    else:
        jax_share = 1.0 - u - MARGIN
    os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "true")
    os.environ.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION", f"{jax_share:.4f}")
    set_cap(sum(plan["host"].values()))  # XLA's pinned host pool may grow to what the offloaded states need
    return 0, load_config_like(cfg, given)


def load_config_like(cfg: Any, overrides: list[str]) -> Any:
    """`cfg` with dotted overrides applied (through the loader, so they are checked like a user's)."""
    import tempfile

    from jaxppo.config import load_config, to_yaml

    with tempfile.NamedTemporaryFile("w", suffix=".yaml") as f:
        f.write(to_yaml(cfg))
        f.flush()
        return load_config(f.name, overrides)


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
        # a chunk holds `logprob_chunk_size` response tokens of each row: of a padded row at most its response, of a
        # packed row at most the row
        per_row = min(a.logprob_chunk_size, tokens // rows if a.use_dynamic_bsz else cfg.data.max_response_length)
        chunk = rows * per_row * model.vocab_size * 4 * HEAD_TEMPS
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
    a state really holds there, an array and its views counted once; arrays in host memory are not counted."""
    import jax

    from jaxppo.offload import is_host

    device = device or jax.local_devices()[0]
    seen = {}
    for x in jax.tree.leaves(tree):
        if isinstance(x, jax.Array) and not is_host(x):  # host-resident (offloaded) leaves: not the device's
            for shard in x.addressable_shards:
                if shard.device == device:
                    seen[shard.data.unsafe_buffer_pointer()] = shard.data.nbytes
    return sum(seen.values())


def describe(plan: Any, jax_limit_bytes: int | None, asleep: bool = True) -> str:
    """One line for the log: the card, vLLM's share (`asleep`: freed while JAX trains, `rollout.free_cache_engine`),
    JAX's reservation and ceiling."""
    if not jax_limit_bytes or plan is None or plan.vllm is None:
        return "GPU memory plan: JAX grows on demand"
    card = jax_limit_bytes / jax_fraction()
    state = "asleep" if asleep else "kept awake"
    return (f"GPU memory plan: {card / GiB:.0f} GiB card; vLLM {plan.vllm.utilization:.3f} = {plan.vllm.bytes / GiB:.1f} "
            f"GiB (weights + KV cache, {state} during training); JAX reserves {plan.need / GiB:.1f} GiB (its compiled "
            f"peak + margin; ceiling {jax_fraction():.2f} of the card)")
