"""A short supervised warm start on the dataset's worked solutions (`extra_info.answer`), logged as
part of the run. The embedded default uses it: PPO from a random tiny model would need hours, PPO
from a model that knows the answer format shows learning in minutes."""

from __future__ import annotations

import dataclasses
import logging
from typing import Any

import numpy as np

from jaxppo.config import OptimConfig
from jaxppo.data import ResumableSampler, left_pad
from jaxppo.distributed import share
from jaxppo.engine import ActorEngine

log = logging.getLogger(__name__)


def sft_batches(trainer, rows: np.ndarray) -> dict[str, np.ndarray]:
    ds, tok, P, R = trainer.train_ds, trainer.tokenizer, trainer.P, trainer.R
    prompts = [ds.input_ids[i] for i in rows]
    answers = []
    for i in rows:
        text = ds.extra_info[i].get("answer")
        if text is None:
            raise ValueError(f"sft warm start needs extra_info.answer (row {i} of {ds.files})")
        ids = tok(text, add_special_tokens=False)["input_ids"][: R - 1] + [tok.eos_token_id]
        answers.append(ids)
    p_ids, p_mask = left_pad(prompts, tok.pad_token_id, P)
    r_ids = np.full((len(rows), R), tok.pad_token_id, np.int32)
    r_mask = np.zeros((len(rows), R), np.float32)
    for j, a in enumerate(answers):
        r_ids[j, : len(a)], r_mask[j, : len(a)] = a, 1.0
    mask = np.concatenate([p_mask, r_mask.astype(np.int32)], 1)
    return {"input_ids": np.concatenate([p_ids, r_ids], 1), "attention_mask": mask,
            "positions": np.maximum(np.cumsum(mask, 1) - 1, 0).astype(np.int32), "response_mask": r_mask}


def sft_warm_start(trainer, params: Any) -> Any:
    t, c = trainer.cfg.trainer, trainer.cfg
    acfg = dataclasses.replace(c.actor, optim=OptimConfig(lr=t.sft_lr, lr_warmup_steps=min(10, t.sft_warmup_steps),
                                                          weight_decay=0.0))
    engine = ActorEngine(trainer.actor_module, trainer.mesh, acfg, trainer.R, max(t.sft_warmup_steps, 1),
                         fsdp_gather=c.mesh.fsdp_gather, grad_reduce_dtype=c.mesh.grad_reduce_dtype)
    state = engine.init_state(params)
    # the step's sequence count, rounded down to whole micro-batches on every batch shard (at least one each)
    unit = acfg.ppo_micro_batch_size_per_device * engine.batch_shards
    bs = max(unit, min(c.data.train_batch_size * c.rollout.n, len(trainer.train_ds)) // unit * unit)
    sampler = ResumableSampler(len(trainer.train_ds), bs, seed=c.data.seed + 1)
    ema = None  # the batch nll smoothed over ~5 steps: where the warm start stops with sft_target_nll
    for step in range(t.sft_warmup_steps):
        rows = sampler.next_batch()
        rows = rows[share(len(rows), "warm-start sequences")]  # this process's share of the global batch
        state, m = engine.sft_update(state, engine.shard_batch(sft_batches(trainer, rows)))
        done = False
        if t.sft_target_nll > 0:
            nll = float(m["nll"])
            ema = nll if ema is None else 0.8 * ema + 0.2 * nll
            done = ema <= t.sft_target_nll
        if step % 20 == 0 or step == t.sft_warmup_steps - 1 or done:
            log.info("sft warm start step %d/%d: nll %.4f%s", step + 1, t.sft_warmup_steps, float(m["nll"]),
                     f" (smoothed {ema:.4f}: target {t.sft_target_nll} reached)" if done else "")
        if done:
            break
    return state.params
