"""Validation as verl reports it: `rollout.val_kwargs.n` responses per validation prompt (greedy unless
`do_sample`), scored by the run's reward, summarised per data source with verl's bootstrapped estimates.

    val-core/<source>/acc/mean@N          mean score of all N responses per prompt (N = val_kwargs.n)
    val-core/<source>/acc/best@N/mean     best of N responses drawn with replacement from each prompt's N, over
                                          1000 bootstrap draws (seed 42), averaged over prompts; `maj@N/mean` the
                                          score of the majority answer in the same draws
    val-aux/<source>/...                  the `/std` of each, worst@k, std@N, best@k / maj@k for k = 2, 4, ... < N,
                                          and the other numeric entries of a user's reward function (`acc`, ...)
    val/<source>/score, val/score         mean score over every response (the one-line summary)

Majority voting needs each response's answer: a user's function gives it as `pred` in its dict result (verl's
key); the built-in rules extract it (`jaxppo.rewards.get_answer_extractor`). The core variable is `acc`, as in
verl's reward managers: a function that returns a number (the built-in rules) has acc = its score; a function that
returns a dict has the `acc` it gives, and without one `reward` (its score) is the core variable.

`validate_only` is `trainer.val_only=true`: the newest checkpoint of the run directory (or `trainer.resume_mode`'s
checkpoint), else the run's warm-start model, else `model.path` / the embedded default's model, validated with
no training state built (no optimizer, critic or reference) and nothing trained or checkpointed.
"""

from __future__ import annotations

import dataclasses
import logging
from collections import defaultdict
from typing import Any, Callable, Sequence

import numpy as np

from jaxppo import distributed as dist
from jaxppo.rewards import get_answer_extractor, score_batch
from jaxppo.rollout import Sampling

log = logging.getLogger(__name__)
N_BOOTSTRAP = 1000  # verl's
SEED = 42  # verl's


# ------------------------------------------------------------------ verl's estimates (pure)


def subset_sizes(n: int) -> list[int]:
    """The k of best@k / worst@k / maj@k: 2, 4, 8, ... below n, then n (verl)."""
    ks, k = [], 2
    while k < n:
        ks.append(k)
        k *= 2
    return ks + [n]


def _or_invalid(pred: Any) -> Any:
    return "[INVALID]" if pred is None else pred


def answer_codes(preds: Sequence) -> list[int]:
    """One code per distinct answer, answers equal as Python compares them (verl counts votes in a dict: 1, 1.0
    and True are one answer, "1" another); an unhashable answer (a list) by its repr."""
    seen: dict = {}
    out = []
    for p in preds:
        try:
            key = ("value", p)
            hash(key)
        except TypeError:
            key = ("repr", repr(p))
        out.append(seen.setdefault(key, len(seen)))
    return out


def bootstrap(values: np.ndarray, preds: Sequence | None, k: int, seed: int = SEED,
              n_bootstrap: int = N_BOOTSTRAP) -> dict[str, float]:
    """verl's `bootstrap_metric` for one prompt's responses: `n_bootstrap` draws of k of them with replacement
    (numpy's legacy generator seeded with `seed`: the same draws as verl's seeded `np.random.choice` loop), and
    the mean / std over draws of the best, the worst and (given each response's answer) the majority answer's
    value (`calc_maj_val`: the most frequent answer, ties to the one drawn first; the value of its first draw)."""
    values = np.asarray(values, np.float64)
    idx = np.random.RandomState(seed).randint(0, len(values), (n_bootstrap, k))
    drawn = values[idx]
    best, worst = drawn.max(1), drawn.min(1)
    out = {f"best@{k}/mean": best.mean(), f"best@{k}/std": best.std(),
           f"worst@{k}/mean": worst.mean(), f"worst@{k}/std": worst.std()}
    if preds is not None:
        codes = np.array(answer_codes(preds))
        votes = codes[idx][:, :, None] == np.arange(codes.max() + 1)  # [draws, k, answers]
        counts = votes.sum(1)
        first = np.where(votes.any(1), votes.argmax(1), k)  # where each answer is first drawn
        first = np.where(counts == counts.max(1, keepdims=True), first, k)  # only the most frequent answers
        maj = drawn[np.arange(n_bootstrap), first.min(1)]
        out.update({f"maj@{k}/mean": maj.mean(), f"maj@{k}/std": maj.std()})
    return {key: float(v) for key, v in out.items()}


def process_validation_metrics(data_sources: Sequence[str], uids: Sequence, infos: dict[str, Sequence],
                               seed: int = SEED) -> dict[str, dict[str, dict[str, float]]]:
    """verl's `process_validation_metrics`: per data source, variable and metric, the mean over prompts (`uids`)
    of each prompt's mean@n, std@n and bootstrapped best / worst / maj@k. `infos` holds one value per response
    for each variable, None where a response has none (left out, as verl does); a variable whose first value is a
    string is not summarised (a numeric `pred` is, as in verl), and `pred` (answers) is used for voting where
    every response of the prompt has one."""
    groups: dict[str, dict[Any, list[int]]] = defaultdict(lambda: defaultdict(list))
    for i, (src, uid) in enumerate(zip(data_sources, uids)):
        groups[src][uid].append(i)
    preds = infos.get("pred")
    out: dict[str, dict[str, dict[str, float]]] = {}
    for src, by_uid in groups.items():
        per_var: dict[str, dict[str, list[float]]] = defaultdict(lambda: defaultdict(list))
        for rows in by_uid.values():
            votes = None if preds is None else [preds[i] for i in rows]
            for var, vals in infos.items():
                vals = [vals[i] for i in rows if vals[i] is not None]
                if not vals or isinstance(vals[0], str):
                    continue
                has_votes = votes is not None and len(votes) == len(vals) and all(p is not None for p in votes)
                vals = np.asarray(vals, np.float64)
                n = len(vals)
                m = {f"mean@{n}": float(vals.mean())}
                if n > 1:
                    m[f"std@{n}"] = float(vals.std())
                    for k in subset_sizes(n):
                        m.update(bootstrap(vals, votes if has_votes else None, k, seed))
                for key, v in m.items():
                    per_var[var][key].append(v)
        out[src] = {var: {key: float(np.mean(v)) for key, v in ms.items()} for var, ms in per_var.items()}
    return out


def metric_names(summary: dict[str, dict[str, dict[str, float]]]) -> dict[str, float]:
    """verl's naming: `val-core/<source>/<var>/<metric>` for the core variable's (`acc` if present, else
    `reward`) mean / best / maj at the largest n; everything else under `val-aux/`."""
    out = {}
    for src, per_var in summary.items():
        core = "acc" if "acc" in per_var else "reward"
        for var, metrics in per_var.items():
            n_max = max(int(name.split("@")[-1].split("/")[0]) for name in metrics)
            for name, value in metrics.items():
                is_core = var == core and name.startswith(("mean", "maj", "best")) and f"@{n_max}" in name
                out[f"{'val-core' if is_core else 'val-aux'}/{src}/{var}/{name}"] = value
    return out


# ------------------------------------------------------------------ generation and scoring


def val_sampling(cfg: Any) -> Sampling:
    """`rollout.val_kwargs` as the engines' Sampling (greedy unless do_sample; no log-probs: validation scores
    answers only)."""
    v = cfg.rollout.val_kwargs
    if not v.do_sample:
        return Sampling(n=v.n, temperature=0.0, max_tokens=cfg.data.max_response_length, seed=cfg.trainer.seed,
                        logprobs=False)
    return Sampling(n=v.n, temperature=v.temperature, top_p=v.top_p, top_k=v.top_k,
                    max_tokens=cfg.data.max_response_length, seed=cfg.trainer.seed, logprobs=False)


def validate(ctx: Any, actor_params: Any) -> dict[str, float]:
    """Generate `val_kwargs.n` responses per validation prompt (each process its share; weights pushed once),
    score them with the run's reward and summarise them (module docstring). `ctx`: a `jaxppo.step.StepContext`."""
    from jaxppo.step import awake, decode

    ds = ctx.val_ds
    if ds is None:
        return {}
    cfg = ctx.cfg
    sampling = val_sampling(cfg)
    mine = np.array_split(np.arange(len(ds)), dist.process_count())[dist.process_index()]
    records: list[dict[str, Any]] = []
    with awake(ctx, actor_params):
        for start in range(0, len(mine), cfg.data.val_batch_size):
            rows = mine[start:start + cfg.data.val_batch_size]
            ro = ctx.engine.generate([ds.input_ids[i].tolist() for i in rows], sampling)
            src = rows[ro.prompt_index]
            texts = decode(ctx, ro)
            sources = [ds.data_source[i] for i in src]
            res = score_batch(sources, texts, [ds.ground_truth[i] for i in src], [ds.extra_info[i] for i in src],
                              num_workers=cfg.reward.num_workers, timeout_s=cfg.reward.timeout_s,
                              reward_fn=ctx.reward_fn, default_rule=cfg.reward.default_rule)
            # the built-in rules' answers; a response without one votes as "[INVALID]" (verl's math_dapo rule's
            # answer then), so every prompt has its majority vote (verl drops it where an answer is missing)
            preds = res.preds or [_or_invalid(get_answer_extractor(s, cfg.reward.default_rule)(t))
                                  for s, t in zip(sources, texts)]
            for j, row in enumerate(src):
                rec = {"row": int(row), "source": sources[j], "reward": float(res.scores[j]), "pred": preds[j]}
                extras = {k: float(v[j]) for k, v in res.extras.items() if np.isfinite(v[j])}
                rec.update(extras)
                if not extras:  # a function that returned a number: acc = score, as verl's reward managers
                    rec["acc"] = rec["reward"]
                records.append(rec)
    records = [r for part in dist.gather_objects(records) for r in part]
    return summarise(records)


def summarise(records: list[dict[str, Any]]) -> dict[str, float]:
    """Validation metrics of per-response records (`row`, `source`, `reward`, `pred`, extra numeric keys)."""
    if not records:
        return {}
    keys = sorted({k for r in records for k in r} - {"row", "source"})
    # a variable that some responses lack (an extra a user's function gave only sometimes, or NaN) is left out
    infos = {k: [r.get(k) for r in records] for k in keys}
    infos = {k: v for k, v in infos.items() if k == "pred" or all(x is not None for x in v)}
    sources = [r["source"] for r in records]
    out = metric_names(process_validation_metrics(sources, [r["row"] for r in records], infos))
    scores = np.array([r["reward"] for r in records], np.float64)
    for src in sorted(set(sources)):
        out[f"val/{src}/score"] = float(scores[np.array(sources) == src].mean())
    out["val/score"] = float(scores.mean())
    return out


# ------------------------------------------------------------------ trainer.val_only


@dataclasses.dataclass
class _EngineInputs:
    """What an engine factory reads from the run (the trainer passes itself)."""

    tokenizer: Any
    engine_dtype: str
    eos_ids: tuple[int, ...]
    vllm_utilization: float = 0.5  # vLLM's share of the card (no trainer states beside it)


def validate_only(cfg: Any, engine_factory: Callable) -> tuple[int, dict[str, float], str]:
    """`trainer.val_only=true`: validate and log once. Returns (the step validated: the checkpoint's, else 0;
    the metrics; what was validated). No optimizer, critic or reference is built; no checkpoint is written."""
    from jaxppo.checkpoint import find_checkpoint, restore_actor
    from jaxppo.config import config_dict, to_yaml
    from jaxppo.metrics import MetricsLogger
    from jaxppo.models import load_model
    from jaxppo.rewards import custom as custom_reward
    from jaxppo.setup import DTYPES, engine_dtype, make_run_dir, prepare_data, prepare_model_dir, write_atomic
    from jaxppo.sharding import make_mesh
    from jaxppo.step import StepContext

    t = cfg.trainer
    run_dir = make_run_dir(cfg)
    mesh = make_mesh(cfg.mesh.axes())
    tokenizer, _, _, val_ds = prepare_data(cfg, run_dir)
    model_dir = prepare_model_dir(cfg, run_dir, tokenizer)
    compute = DTYPES[cfg.model.dtype]
    ckpt = find_checkpoint(run_dir, t.resume_mode)
    if ckpt is not None:  # float32 (LoRA: merged); the push casts to the engine's dtype
        params = restore_actor(ckpt, mesh).params
        what, step = f"checkpoint {ckpt}", int(ckpt.name)
    else:
        warm = run_dir / "warm_model"
        source = warm if (warm / "config.json").is_file() else model_dir
        _, params, _ = load_model(source, mesh=mesh, dtype=compute, param_dtype=compute)
        what, step = f"model {source}", 0
    log.info("validating %s (%d prompts x %d responses)", what, 0 if val_ds is None else len(val_ds),
             cfg.rollout.val_kwargs.n)
    push_dtype = engine_dtype(cfg)
    engine = engine_factory(model_dir, _EngineInputs(tokenizer, push_dtype, (tokenizer.eos_token_id,),
                                                     cfg.rollout.gpu_memory_utilization or 0.5))
    if cfg.rollout.free_cache_engine:
        engine.sleep()
    ctx = StepContext(cfg, None, None, engine, None, val_ds, tokenizer, DTYPES[push_dtype],
                      reward_fn=custom_reward.from_config(cfg))
    metrics = validate(ctx, params)
    main = dist.is_main()
    if main and not (run_dir / "config.yaml").exists():  # a training run's own config stays as it was
        write_atomic(run_dir / "config.yaml", to_yaml(cfg))
    logger = MetricsLogger(run_dir, [s for s in t.logger if s != "console"] if main else [], total_steps=step,
                           start_step=step, project=t.project_name, name=t.experiment_name,
                           config=config_dict(cfg))
    logger.log(step, metrics)
    logger.close()
    return step, metrics, what


__all__ = ["validate", "validate_only", "summarise", "process_validation_metrics", "metric_names", "bootstrap",
           "subset_sizes", "val_sampling"]
