"""A fixed actor/critic update problem shared by the engine tests and the multi-process worker."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from jaxppo.config import ActorConfig, CriticConfig, OptimConfig
from jaxppo.engine import ActorEngine, CriticEngine
from jaxppo.models import load_model

B, P_LEN, R_LEN = 8, 6, 5


def make_batch(vocab: int, seed: int = 0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    ids = rng.integers(0, vocab, (B, P_LEN + R_LEN)).astype(np.int32)
    mask = np.ones((B, P_LEN + R_LEN), np.int32)
    for i, pad in enumerate(rng.integers(0, 3, B)):
        mask[i, :pad] = 0
    rlen = rng.integers(1, R_LEN + 1, B)
    rlen[0] = 1  # a one-token response
    rmask = (np.arange(R_LEN)[None] < rlen[:, None]).astype(np.float32)
    mask[:, P_LEN:] = rmask
    return dict(
        input_ids=ids, attention_mask=mask, positions=np.maximum(np.cumsum(mask, 1) - 1, 0).astype(np.int32),
        response_mask=rmask,
        old_logprobs=(rng.normal(size=(B, R_LEN)) * 0.1 - 4.6).astype(np.float32),
        ref_logprobs=(rng.normal(size=(B, R_LEN)) * 0.1 - 4.6).astype(np.float32),
        advantages=rng.normal(size=(B, R_LEN)).astype(np.float32),
        values=rng.normal(size=(B, R_LEN)).astype(np.float32),
        returns=rng.normal(size=(B, R_LEN)).astype(np.float32),
    )


def run_case(ckpt, mesh, micro_per_device: int, mode: str = "token-mean", use_kl_loss: bool = True,
             process_rows: slice | None = None, fsdp_gather: str = "layer",
             grad_reduce_dtype: str = "float32", micro_batch_loop: str = "scan",
             engines: list | None = None) -> dict[str, np.ndarray]:
    """One actor and one critic update; returns losses, grad norms and updated parameters on the host (`engines`:
    a list the two engines are appended to)."""
    # eps=1e-3: Adam maps a near-zero gradient to +-lr whatever its rounding, which would hide real
    # differences behind sign noise; with a larger eps parameter updates are proportional to gradients.
    optim = OptimConfig(lr=1e-2, weight_decay=0.01, grad_clip=1.0, eps=1e-3)
    acfg = ActorConfig(ppo_micro_batch_size_per_device=micro_per_device, log_prob_micro_batch_size_per_device=
                       micro_per_device, logprob_chunk_size=2, loss_agg_mode=mode, use_kl_loss=use_kl_loss,
                       entropy_coeff=0.01, optim=optim)
    ccfg = CriticConfig(ppo_micro_batch_size_per_device=micro_per_device, log_prob_micro_batch_size_per_device=
                        micro_per_device, loss_agg_mode=mode, optim=optim)
    module, params, cfg = load_model(ckpt, mesh=mesh, dtype=jnp.float32)
    batch = make_batch(cfg.vocab_size)
    if process_rows is not None:
        batch = {k: v[process_rows] for k, v in batch.items()}
    actor = ActorEngine(module, mesh, acfg, R_LEN, fsdp_gather=fsdp_gather, grad_reduce_dtype=grad_reduce_dtype)
    actor.micro_batch_loop = micro_batch_loop
    b = actor.shard_batch(batch)
    logprobs, entropy = actor.logprobs(params, b, with_entropy=True)
    state, am = actor.update(actor.init_state(params), b)
    cmodule, cparams, _ = load_model(ckpt, "value", mesh=mesh, dtype=jnp.float32)
    critic = CriticEngine(cmodule, mesh, ccfg, R_LEN, fsdp_gather=fsdp_gather,
                          grad_reduce_dtype=grad_reduce_dtype)
    critic.micro_batch_loop = micro_batch_loop
    values = critic.values(cparams, b)
    cstate, cm = critic.update(critic.init_state(cparams), b)
    from jax.experimental import multihost_utils

    gather = lambda x: np.asarray(multihost_utils.process_allgather(x, tiled=True))
    out = {f"actor/{k}": gather(v) for k, v in am.items()}
    out.update({f"critic/{k}": gather(v) for k, v in cm.items()})
    out["logprobs"], out["entropy"], out["values"] = gather(logprobs), gather(entropy), gather(values)
    out["actor_params"] = jax.tree.map(gather, state.params)
    out["critic_params"] = jax.tree.map(gather, cstate.params)
    if engines is not None:
        engines.extend([actor, critic])
    return out
