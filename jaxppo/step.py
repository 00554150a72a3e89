"""One PPO step, as functions over explicit state: the algorithm in one place.

    collect     sample prompts' responses with the actor's current weights pushed into the rollout engine
                (DLPack), score them (rules and / or a reward model), run the forward passes (old and
                reference log-probs, values), compute advantages over every process's rows;
    update      the critic's and the actor's mini-batch updates (micro-batches accumulated inside one
                jitted scan per mini-batch, jaxppo/engine.py);
    validate    greedy (or sampled) generation on the validation set, scored per data source.

`PPOState` is everything the step changes (the actor's and critic's train states, the reference
parameters, the KL coefficient); `StepContext` is what it computes with (engines, datasets, config). A
step that is abandoned (a stop signal before its updates) simply discards the state it was building. The
run's lifecycle around it (checkpoints, signals, validation cadence, profiling, early stop, health
decisions) lives in `jaxppo/trainer.py`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import sys
import time
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np

from jaxppo import distributed as dist
from jaxppo import ppo
from jaxppo.config import Config
from jaxppo.data import left_pad
from jaxppo.engine import ActorEngine, CriticEngine, TrainState
from jaxppo.metrics import stats
from jaxppo.models.hf_io import HFWeights
from jaxppo.perf import step_flops
from jaxppo.rewards import score_batch
from jaxppo.rollout import RolloutEngine, Rollouts, Sampling, train_sequences


class Timer:
    """Wall time per named phase (`timing_s/<name>`), each phase also a named region of the JAX profiler
    trace and, while torch is being profiled, of the torch trace."""

    def __init__(self, torch_regions: bool = False):
        self.times: dict[str, float] = {}
        self.torch_regions = torch_regions

    @contextlib.contextmanager
    def __call__(self, name: str):
        t0 = time.perf_counter()
        with contextlib.ExitStack() as stack:
            stack.enter_context(jax.profiler.TraceAnnotation(name))
            if self.torch_regions and "torch" in sys.modules:
                import torch

                stack.enter_context(torch.profiler.record_function(name))
            yield
        self.times[f"timing_s/{name}"] = self.times.get(f"timing_s/{name}", 0.0) + time.perf_counter() - t0


@dataclasses.dataclass(frozen=True)
class PPOState:
    """What a PPO step changes."""

    actor: TrainState
    critic: TrainState | None  # None: no critic (GRPO, RLOO, REINFORCE++)
    ref_params: Any  # the reference policy in the compute dtype (its forward casts to it anyway); None: no KL
    kl_coef: float  # the in-reward KL coefficient (the adaptive controller moves it)


@dataclasses.dataclass
class StepContext:
    """What a PPO step computes with, built once by the trainer."""

    cfg: Config
    actor: ActorEngine
    critic: CriticEngine | None
    engine: RolloutEngine
    train_ds: Any
    val_ds: Any
    tokenizer: Any
    weights_dtype: Any  # dtype of the weights pushed into the rollout engine
    reward_model: Any = None  # jaxppo.rewards.model.RewardModel (model.reward_model_path)
    reward_fn: Callable | None = None  # a user's reward function, else the one registered for the data source
    budgets: Any = None  # jaxppo.memory.TokenBudgets: packed tokens per device per micro-batch, by phase
    rollout_weights: Callable | None = None  # actor params -> what the engine's update_weights takes (HFWeights,
    # or LoRAWeights: the base with the adapters merged)
    flops: dict[str, Any] = dataclasses.field(default_factory=dict)  # "actor" / "critic" -> jaxppo.perf.FlopsModel

    @property
    def P(self) -> int:  # noqa: N802 - the prompt length, as in the papers
        return self.cfg.data.max_prompt_length

    @property
    def R(self) -> int:  # noqa: N802
        return self.cfg.data.max_response_length

    @property
    def truncation(self) -> tuple[int, float] | None:
        """(top_k, top_p) when the rollout engine samples from a truncated distribution, else None."""
        r = self.cfg.rollout
        return (r.top_k, r.top_p) if (r.top_k > 0 or r.top_p < 1.0) else None


@dataclasses.dataclass
class Experience:
    """One step's rollouts turned into update batches (this process's rows, host arrays) and the metrics
    known before the updates (over every process's rows)."""

    batch: dict[str, np.ndarray]  # the actor's update batch
    critic_batch: dict[str, np.ndarray] | None
    metrics: dict[str, float]
    seq_lengths: np.ndarray  # every process's sequences: prompt + response tokens (MFU's FLOPs)
    response_lengths: np.ndarray


# ------------------------------------------------------------------ the rollout engine


@contextlib.contextmanager
def awake(ctx: StepContext, actor_params: Any, timer: Timer | None = None):
    """The rollout engine woken with the actor's current weights pushed in (every wake: a sleeping vLLM may
    have dropped them), put back to sleep on exit unless `rollout.free_cache_engine=false` keeps it awake."""
    timer = timer or Timer()
    with timer("wake"):
        ctx.engine.wake()
    try:
        with timer("sync"):
            weights = ctx.rollout_weights(actor_params) if ctx.rollout_weights else HFWeights(actor_params,
                                                                                             ctx.weights_dtype)
            ctx.engine.update_weights(weights)
        yield
    finally:
        if ctx.cfg.rollout.free_cache_engine:
            with timer("sleep"):
                ctx.engine.sleep()


def generate(ctx: StepContext, actor_params: Any, prompts: list[np.ndarray], sampling: Sampling,
             timer: Timer | None = None) -> Rollouts:
    """wake -> push weights -> generate (timing_s/gen) -> sleep."""
    timer = timer or Timer()
    with awake(ctx, actor_params, timer), timer("gen"):
        return ctx.engine.generate([p.tolist() for p in prompts], sampling)


def decode(ctx: StepContext, rollouts: Rollouts) -> list[str]:
    return [ctx.tokenizer.decode(ids[: int(n)], skip_special_tokens=True)
            for ids, n in zip(rollouts.response_ids, rollouts.lengths)]


# ------------------------------------------------------------------ phases


def score(ctx: StepContext, ds: Any, rows: np.ndarray, rollouts: Rollouts,
          batch: dict[str, np.ndarray]) -> tuple[np.ndarray, dict[str, float]]:
    """Per-sequence scores of this process's rollouts: the rule reward of each row's data source (or the
    user's function), a reward model's score at the last response token (`model.reward_model_path`),
    or their sum (`reward.reward_model_combine=add`). Returns (scores, this process's counts); a user's function
    that returns a dict adds its other entries as per-sample arrays under `extra/<key>` (NaN where absent)."""
    cfg = ctx.cfg.reward
    counts: dict[str, float] = {}
    use_rule = ctx.reward_model is None or cfg.reward_model_combine == "add"
    scores = np.zeros(len(rollouts.prompt_index), np.float32)
    if use_rule:
        src = rows[rollouts.prompt_index]
        res = score_batch([ds.data_source[i] for i in src], decode(ctx, rollouts), [ds.ground_truth[i] for i in src],
                          [ds.extra_info[i] for i in src], num_workers=cfg.num_workers, timeout_s=cfg.timeout_s,
                          reward_fn=ctx.reward_fn)
        scores = scores + res.scores
        counts.update(errors=float(res.num_errors + res.num_timeouts), timeouts=float(res.num_timeouts))
        counts.update({f"extra/{k}": v for k, v in res.extras.items()})
    if ctx.reward_model is not None:
        rm = np.asarray(ctx.reward_model.score(batch["input_ids"], batch["attention_mask"]), np.float32)
        counts["model_score_sum"] = float(rm.sum())
        scores = scores + rm
    return scores, counts


def advantages(ctx: StepContext, state: PPOState, token_scores: np.ndarray, old_lp: np.ndarray, ref_lp, values,
               rmask: np.ndarray, group_ids: np.ndarray) -> tuple[PPOState, np.ndarray, np.ndarray, np.ndarray,
                                                                 dict[str, float]]:
    """Token rewards (with the KL penalty when it is in the reward), advantages and returns of this process's
    rows; batch statistics (whitening, group baselines, the KL controller's current KL and sample count) are
    over every process's rows. Returns (state with the controller's new coefficient, rewards, advantages,
    returns, metrics)."""
    alg = ctx.cfg.algorithm
    metrics = {}
    rewards = token_scores
    kl_coef = state.kl_coef
    if alg.use_kl_in_reward:
        rewards, current_kl = ppo.apply_kl_penalty(token_scores, old_lp, ref_lp, rmask, kl_coef, alg.kl_penalty)
        current_kl = float(np.mean(dist.gather_rows(np.array([float(current_kl)]))))  # equal shares
        metrics["actor/reward_kl_penalty"] = current_kl
        if np.isfinite(current_kl):  # a NaN batch must not poison the controller
            n_global = ctx.cfg.data.train_batch_size * ctx.cfg.rollout.n  # the whole step's samples
            kl_coef = float(ppo.update_kl_coef(ppo.KLControlConfig(**dataclasses.asdict(alg.kl_ctrl)), kl_coef,
                                               current_kl, n_global))
    g = ctx.actor.shard_batch({"r": np.asarray(rewards, np.float32), "m": np.asarray(rmask, np.float32),
                               "g": np.asarray(group_ids, np.int32),
                               **({} if values is None else {"v": np.asarray(values, np.float32)})})
    adv, ret = _advantage_fn(ctx)(g["r"], g["m"], g.get("v"), g["g"])
    return (dataclasses.replace(state, kl_coef=kl_coef), np.asarray(rewards), dist.local_rows(adv),
            dist.local_rows(ret), metrics)


_ADV_FNS: dict[int, Callable] = {}


def _advantage_fn(ctx: StepContext) -> Callable:
    """The jitted estimator of this run's config (one per context)."""
    key = id(ctx)
    if key not in _ADV_FNS:
        alg = ctx.cfg.algorithm
        _ADV_FNS[key] = jax.jit(lambda r, m, v, g: ppo.compute_advantages(
            alg.adv_estimator, r, m, values=v, group_ids=g, gamma=alg.gamma, lam=alg.lam,
            norm_adv_by_std_in_grpo=alg.norm_adv_by_std_in_grpo))
    return _ADV_FNS[key]


def forward_input(engine, dynamic: bool, budget: int, batch: dict[str, np.ndarray], what: str):
    """(device batch, output -> host [b, r] array): padded, or packed into `budget`-token rows."""
    if not dynamic:
        return engine.shard_batch(batch), dist.local_rows
    packed = engine.pack({k: batch[k] for k in ("input_ids", "attention_mask", "positions", "response_mask")},
                         budget, what)
    n = batch["input_ids"].shape[0]
    return engine.shard_packed(packed), lambda x: packed.unpack(dist.local_rows(x, axis=1), n)


def collect(ctx: StepContext, state: PPOState, rows: np.ndarray, step: int, timer: Timer,
            interrupt: Callable[[], None] = lambda: None) -> tuple[PPOState, Experience]:
    """gen -> reward -> old / ref log-probs, values -> advantages for the global batch `rows` (dataset rows of
    the step's prompts; this process generates for its share). `interrupt()` is called between phases (it
    raises to abandon the step)."""
    cfg = ctx.cfg
    budgets = ctx.budgets
    mine = dist.share(len(rows), "prompts of data.train_batch_size")
    rows = rows[mine]
    prompts = [ctx.train_ds.input_ids[i] for i in rows]
    r = cfg.rollout
    sampling = Sampling(n=r.n, temperature=r.temperature, top_p=r.top_p, top_k=r.top_k, max_tokens=ctx.R,
                        seed=cfg.trainer.seed * 1_000_003 + step)
    ro = generate(ctx, state.actor.params, prompts, sampling, timer)
    interrupt()
    p_ids, p_mask = left_pad(prompts, ctx.tokenizer.pad_token_id, ctx.P)
    batch = train_sequences(p_ids, p_mask, ro)
    rmask = batch["response_mask"]
    with timer("reward"):
        scores, reward_counts = score(ctx, ctx.train_ds, rows, ro, batch)
    a_in, a_out = forward_input(ctx.actor, cfg.actor.use_dynamic_bsz, budgets.actor_forward, batch,
                                "actor.log_prob_max_token_len_per_device")
    with timer("old_log_prob"):
        out = ctx.actor.logprobs(state.actor.params, a_in, truncation=ctx.truncation)
        old_lp = a_out(out[0])
        sampling_lp = a_out(out[2]) if ctx.truncation else old_lp
    ref_lp = None
    if state.ref_params is not None and _needs_ref_logprobs(cfg):
        with timer("ref"):
            ref_lp = a_out(ctx.actor.logprobs(state.ref_params, a_in)[0])
    values = None
    if ctx.critic is not None:
        c_in, c_out = forward_input(ctx.critic, cfg.critic.use_dynamic_bsz, budgets.critic_forward, batch,
                                    "critic.forward_max_token_len_per_device")
        with timer("values"):
            values = c_out(ctx.critic.values(state.critic.params, c_in))
    interrupt()
    with timer("adv"):
        token_scores = np.asarray(ppo.scores_to_token_level(jnp.asarray(scores), jnp.asarray(rmask)))
        state, rewards, adv, ret, kl_metrics = advantages(ctx, state, token_scores, old_lp, ref_lp, values, rmask,
                                                          ro.prompt_index + mine.start)
    batch.update(old_logprobs=old_lp, advantages=adv)
    if ref_lp is not None:
        batch["ref_logprobs"] = ref_lp
    if cfg.actor.tis_threshold is not None:
        # the correction runs from the distribution that actually sampled (the engine's, truncated when top-k /
        # top-p truncate) to the trainer's policy over the full vocabulary
        batch["is_weights"] = np.asarray(ppo.truncated_is_weights(old_lp, ro.logprobs, rmask, cfg.actor.tis_threshold))
    cbatch = None
    if ctx.critic is not None:
        cbatch = {k: batch[k] for k in ("input_ids", "attention_mask", "positions", "response_mask")}
        cbatch.update(values=values, returns=ret)
    local = {"scores": scores, "rewards": rewards.sum(-1), "adv": adv, "ret": ret, "sampling_lp": sampling_lp,
             "rollout_lp": ro.logprobs, "rmask": rmask, "lengths": ro.lengths.astype(np.float64),
             "prompt_lengths": p_mask.sum(-1)[ro.prompt_index].astype(np.float64),
             "reward_counts": np.array([reward_counts.get(k, 0.0) for k in ("errors", "timeouts", "model_score_sum")])}
    if values is not None:
        local["values"] = values
    g = {k: dist.gather_rows(v) for k, v in local.items()}  # metrics are global
    # a user's reward function's extra entries: the union of keys over processes, NaN where a sample has none
    keys = sorted({k for ks in dist.gather_objects(sorted(k for k in reward_counts if k.startswith("extra/")))
                   for k in ks})
    extras = {k: dist.gather_rows(reward_counts.get(k, np.full(len(scores), np.nan))) for k in keys}
    metrics = rollout_metrics(ctx, state, step, g)
    metrics.update(kl_metrics)
    counts = g["reward_counts"].reshape(-1, 3).sum(0)
    metrics["reward/errors"], metrics["reward/timeouts"] = float(counts[0]), float(counts[1])
    if ctx.reward_model is not None:
        metrics["reward/model_score/mean"] = float(counts[2]) / max(len(g["scores"]), 1)
    for k, v in extras.items():
        if np.isfinite(v).any():
            metrics[f"reward/{k}/mean"] = float(np.nanmean(v))
    lengths = g["prompt_lengths"] + g["lengths"]
    return state, Experience(batch, cbatch, metrics, lengths, g["lengths"])


def _needs_ref_logprobs(cfg: Config) -> bool:
    """Reference log-probs of the sampled tokens: KL in the reward, or a KL loss with a per-token estimator
    (the exact KL, `kl_loss_type=full`, runs the reference inside the update instead)."""
    a = cfg.actor
    return cfg.algorithm.use_kl_in_reward or (a.use_kl_loss and a.kl_loss_type != "full")


def update(ctx: StepContext, state: PPOState, exp: Experience, step: int, timer: Timer) -> tuple[PPOState, dict]:
    """The critic's, then (after `trainer.critic_warmup` steps) the actor's mini-batch updates."""
    cfg = ctx.cfg
    budgets = ctx.budgets
    metrics: dict[str, float] = {}
    if ctx.critic is not None:
        with timer("update_critic"):
            critic, cm = _update(ctx, ctx.critic, state.critic, exp.critic_batch, cfg.critic, budgets.critic_update,
                                 "critic.ppo_max_token_len_per_device", cfg.trainer.seed + 7919 * step)
        state = dataclasses.replace(state, critic=critic)
        metrics.update(_mean_metrics(cm, "critic"))
    if step >= cfg.trainer.critic_warmup:
        with timer("update_actor"):
            actor, am = _update(ctx, ctx.actor, state.actor, exp.batch, cfg.actor, budgets.actor_update,
                                "actor.ppo_max_token_len_per_device", cfg.trainer.seed + 104729 * step, state.ref_params)
        state = dataclasses.replace(state, actor=actor)
        metrics.update(_mean_metrics(am, "actor"))
    return state, metrics


def _update(ctx: StepContext, engine, train_state: TrainState, batch: dict[str, np.ndarray], sub, budget: int,
            what: str, seed: int, extra: Any = None):
    """ppo_epochs x mini-batches of `batch` (host arrays); returns the new state and mean metrics."""
    n = batch["input_ids"].shape[0]  # this process's rows
    n_mini = ctx.cfg.data.train_batch_size // sub.ppo_mini_batch_size  # mini-batches per epoch
    rng = np.random.default_rng(seed)
    out = []
    kw = {} if extra is None else {"ref_params": extra}
    for _ in range(sub.ppo_epochs):
        order = rng.permutation(n) if sub.shuffle else np.arange(n)
        for i in range(n_mini):  # strided: a mini-batch is the same rows whatever the number of processes
            rows = order[i::n_mini]
            part = {k: v[rows] for k, v in batch.items()}
            if sub.use_dynamic_bsz:
                device_batch = engine.shard_packed(engine.pack(part, budget, what))
            else:
                device_batch = engine.shard_batch(part)
            train_state, m = engine.update(train_state, device_batch, **kw)
            out.append(m)
    return train_state, jax.device_get(out)


def _mean_metrics(items: list[dict[str, Any]], prefix: str) -> dict[str, float]:
    """Mean over mini-batches; the skip counters are summed (`<prefix>/skipped_updates`, ...)."""
    keys = items[0].keys() if items else []
    out = {}
    for k in keys:
        vals = [float(m[k]) for m in items]
        if k in ("skipped", "nonfinite"):
            out[f"{prefix}/{k}_updates"] = float(np.sum(vals))
        else:
            out[f"{prefix}/{k}"] = float(np.mean(vals))
    return out


# ------------------------------------------------------------------ metrics


def rollout_metrics(ctx: StepContext, state: PPOState, step: int, g: dict[str, np.ndarray]) -> dict[str, float]:
    """The step's rollout / advantage metrics from every process's rows (`g`). The rollout-vs-trainer
    mismatch compares the engine's log-probs with the trainer's under the same distribution: the one the
    engine samples from (after top-k / top-p when they truncate)."""
    rmask = g["rmask"]
    m: dict[str, float] = {"actor/kl_coef": state.kl_coef, "training/global_step": float(step + 1)}
    m.update(stats("critic/score", g["scores"]))
    m.update(stats("critic/rewards", g["rewards"]))
    m.update(stats("critic/advantages", g["adv"], rmask))
    m.update(stats("critic/returns", g["ret"], rmask))
    if "values" in g:
        values, ret = g["values"], g["ret"]
        m.update(stats("critic/values", values, rmask))
        v = rmask > 0
        var_ret = np.var(ret[v])
        m["critic/vf_explained_var"] = float(1.0 - np.var(ret[v] - values[v]) / (var_ret + 1e-8))
    m.update(stats("response_length", g["lengths"]))
    m["response_length/clip_ratio"] = float(np.mean(g["lengths"] >= ctx.R))
    m.update(stats("prompt_length", g["prompt_lengths"]))
    m.update({k: float(v) for k, v in ppo.rollout_mismatch_metrics(g["sampling_lp"], g["rollout_lp"], rmask).items()})
    m["perf/total_num_tokens"] = float(g["prompt_lengths"].sum() + g["lengths"].sum())
    return m


def perf_metrics(ctx: StepContext, times: dict[str, float], exp: Experience, peak_flops: float) -> dict[str, float]:
    """Throughput and MFU of the update phases: FLOPs as computed (causal attention over each sequence's own
    length, the vocabulary head over response tokens only), against `peak_flops` per device."""
    m: dict[str, float] = {}
    n_dev = jax.device_count()
    tokens = float(exp.seq_lengths.sum())
    m["perf/compiles"] = float(ctx.actor.compiles() + (ctx.critic.compiles() if ctx.critic is not None else 0))
    m["perf/throughput"] = tokens / times["timing_s/step"] / n_dev
    m["perf/peak_tflops"] = peak_flops / 1e12
    cfg = ctx.cfg
    for name, sub, head in (("actor", cfg.actor, True), ("critic", cfg.critic, False)):
        t = times.get(f"timing_s/update_{name}")
        if t and name in ctx.flops:
            flops = step_flops(ctx.flops[name], exp.seq_lengths, exp.response_lengths if head else None) * sub.ppo_epochs
            m[f"perf/mfu/{name}"] = flops / t / (peak_flops * n_dev)
    return m


# ------------------------------------------------------------------ validation


def validate(ctx: StepContext, actor_params: Any) -> dict[str, float]:
    """Score the validation set (each process its share; weights pushed once), `val/<source>/score`."""
    ds = ctx.val_ds
    if ds is None:
        return {}
    bs = ctx.cfg.data.val_batch_size
    mine = np.array_split(np.arange(len(ds)), jax.process_count())[jax.process_index()]
    scores, index = [], []
    reward = ctx.cfg.reward
    with awake(ctx, actor_params):
        for start in range(0, len(mine), bs):
            rows = mine[start:start + bs]
            ro = ctx.engine.generate([ds.input_ids[i].tolist() for i in rows],
                                     Sampling(n=1, temperature=ctx.cfg.rollout.val_temperature, max_tokens=ctx.R,
                                              seed=ctx.cfg.trainer.seed))
            res = score_batch([ds.data_source[i] for i in rows], decode(ctx, ro), [ds.ground_truth[i] for i in rows],
                              [ds.extra_info[i] for i in rows], num_workers=reward.num_workers,
                              timeout_s=reward.timeout_s, reward_fn=ctx.reward_fn)
            scores.extend(res.scores.tolist())
            index.extend(rows.tolist())
    scores = dist.gather_ragged(np.asarray(scores, np.float64), np.nan)
    sources = [ds.data_source[i] for i in dist.gather_ragged(np.asarray(index, np.int64), -1)]
    out = {}
    for src in sorted(set(sources)):
        out[f"val/{src}/score"] = float(np.mean([s for s, d in zip(scores, sources) if d == src]))
    out["val/score"] = float(np.mean(scores))
    return out


__all__ = ["Timer", "PPOState", "StepContext", "Experience", "awake", "generate", "collect", "update", "score",
           "advantages", "validate", "rollout_metrics", "perf_metrics"]
