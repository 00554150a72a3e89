"""One PPO step, as functions over explicit state: the algorithm in one place.

    sample      generate responses with the actor's current weights pushed into the rollout engine (DLPack)
                and score them (rules, a user's function and / or a reward model; DAPO's overlong shaping);
                with dynamic sampling, drop the groups without signal and refill from further prompts;
    collect     sample, then run the forward passes (old and reference log-probs, values) and compute
                advantages over every process's rows;
    update      the critic's and the actor's mini-batch updates (micro-batches accumulated inside one
                jitted scan per mini-batch, jaxppo/engine.py).

Validation (n responses per prompt, verl's mean@n / best@n / maj@n) is `jaxppo/validation.py`.

`PPOState` is everything the step changes (the actor's and critic's train states, the reference
parameters, the KL coefficient); `StepContext` is what it computes with (engines, datasets, config). A
step that is abandoned (a stop signal before its updates) simply discards the state it was building. The
run's lifecycle around it (checkpoints, signals, validation cadence, profiling, early stop, health
decisions) lives in `jaxppo/trainer.py`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import sys
import time
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np

from jaxppo import distributed as dist
from jaxppo import perf, ppo
from jaxppo.config import Config
from jaxppo.data import left_pad
from jaxppo.engine import ActorEngine, CriticEngine, TrainState
from jaxppo.metrics import rollout_metrics
from jaxppo.models.hf_io import HFWeights
from jaxppo.perf import step_flops
from jaxppo.ppo import rollout_correction as rollout_corr
from jaxppo.rewards import score_batch
from jaxppo.rewards.shaping import groups_with_signal, overlong_penalty
from jaxppo.rollout import RolloutEngine, Rollouts, Sampled, Sampling, train_sequences

log = logging.getLogger(__name__)


class Timer:
    """Wall time per named phase (`timing_s/<name>`), each phase also a named region of the JAX profiler
    trace and, while torch is being profiled, of the torch trace. For the phases in `cpu_phases` also the
    process's CPU time (`perf/cpu_s/<name>`, all threads) and involuntary context switches
    (`perf/ctx_switches/<name>`), and on Linux the machine's steal time (`perf/steal_s/<name>`, summed over its
    CPUs: a virtual machine's CPUs taken by the host): generation of a small model is bound by the engine's
    Python work, and these tell a slow generation that did more work from one that waited for a CPU."""

    def __init__(self, torch_regions: bool = False, cpu_phases: tuple[str, ...] = ("gen",)):
        self.times: dict[str, float] = {}
        self.torch_regions = torch_regions
        self.cpu_phases = cpu_phases

    def add(self, key: str, value: float) -> None:
        self.times[key] = self.times.get(key, 0.0) + value

    @contextlib.contextmanager
    def __call__(self, name: str):
        cpu = name in self.cpu_phases
        if cpu:
            c0, s0, st0 = time.process_time(), perf.involuntary_switches(), perf.steal_seconds()
        t0 = time.perf_counter()
        with contextlib.ExitStack() as stack:
            stack.enter_context(jax.profiler.TraceAnnotation(name))
            if self.torch_regions and "torch" in sys.modules:
                import torch

                stack.enter_context(torch.profiler.record_function(name))
            yield
        self.add(f"timing_s/{name}", time.perf_counter() - t0)
        if cpu:
            self.add(f"perf/cpu_s/{name}", time.process_time() - c0)
            self.add(f"perf/ctx_switches/{name}", float(perf.involuntary_switches() - s0))
            st1 = perf.steal_seconds()
            if st0 is not None and st1 is not None:
                self.add(f"perf/steal_s/{name}", st1 - st0)


@dataclasses.dataclass(frozen=True)
class PPOState:
    """What a PPO step changes."""

    actor: TrainState
    critic: TrainState | None  # None: no critic (GRPO, RLOO, REINFORCE++)
    ref_params: Any  # the reference policy in the compute dtype (its forward casts to it anyway); None: no KL;
    # {} under LoRA (the base module on the actor's frozen weights)
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


# without rollout.calculate_log_probs the engine returns log-probs on every 8th step (the first included), for
# every sample: the rollout/* mismatch metrics and the health rule see a broken weight sync on step 0 and every
# 8th after it. In vLLM the log-probs cost on every decode step once any request of the batch asks for them (a
# batch tensor to host, a Python object per token), and a small model's generation is bound by that CPU work
# (docs/benchmarks.md, "PPO step": generation with and without them)
MISMATCH_EVERY = 8


def rollout_sampling(cfg: Config, seed: int | None, step: int) -> Sampling:
    """The training rollouts' sampling at `step`: rollout.n / temperature / top_p / top_k,
    data.max_response_length; the engine's log-probs always when something trains on them
    (rollout.calculate_log_probs, actor.tis_threshold, rollout correction, bypass mode), else on every
    MISMATCH_EVERY-th step."""
    r = cfg.rollout
    always = r.calculate_log_probs or cfg.actor.tis_threshold is not None or rollout_corr.enabled(cfg) \
        or rollout_corr.bypass(cfg)
    return Sampling(n=r.n, temperature=r.temperature, top_p=r.top_p, top_k=r.top_k,
                    max_tokens=cfg.data.max_response_length, seed=seed,
                    logprobs=always or step % MISMATCH_EVERY == 0)


def push_weights(ctx: StepContext, actor_params: Any, timer: Timer) -> None:
    """Wake the rollout engine and push the actor's weights into it (timed as `wake` and `sync`)."""
    with timer("wake"):
        ctx.engine.wake()
    with timer("sync"):
        weights = ctx.rollout_weights(actor_params) if ctx.rollout_weights else HFWeights(actor_params,
                                                                                         ctx.weights_dtype)
        ctx.engine.update_weights(weights)


@contextlib.contextmanager
def awake(ctx: StepContext, actor_params: Any, timer: Timer | None = None):
    """The rollout engine woken with the actor's current weights pushed in (every wake: a sleeping vLLM may
    have dropped them), put back to sleep on exit unless `rollout.free_cache_engine=false` keeps it awake. On the way
    out of a failed call the first error is the one raised: a sleep that fails then (an engine whose process the
    failure ended) is logged, not raised in its place."""
    timer = timer or Timer()
    sleep = ctx.cfg.rollout.free_cache_engine
    try:
        push_weights(ctx, actor_params, timer)
        yield
    except BaseException:
        if sleep:
            try:
                ctx.engine.sleep()
            except Exception as e:  # noqa: BLE001 - the error propagating is the one to see
                log.warning("the rollout engine's sleep failed on the way out of the error below: %s: %s",
                            type(e).__name__, e)
        raise
    if sleep:
        with timer("sleep"):
            ctx.engine.sleep()


def decode(ctx: StepContext, rollouts: Rollouts) -> list[str]:
    """Each response's text (up to its length, special tokens dropped): what the reward functions score."""
    return [ctx.tokenizer.decode(ids[: int(n)], skip_special_tokens=True)
            for ids, n in zip(rollouts.response_ids, rollouts.lengths)]


# ------------------------------------------------------------------ phases


def score(ctx: StepContext, ds: Any, rows: np.ndarray, rollouts: Rollouts,
          batch: dict[str, np.ndarray]) -> tuple[np.ndarray, dict[str, float]]:
    """Per-sequence scores of this process's rollouts: the rule reward of each row's data source (or the
    user's function), a reward model's score at the last response token (`model.reward_model_path`),
    or their sum (`reward.reward_model_combine=add`). Returns (scores, counts): this process's error and timeout
    counts, and per-sample arrays: `model_score`, and `extra/<key>` for the other entries of a user's function's
    dict results (NaN where absent)."""
    cfg = ctx.cfg.reward
    counts: dict[str, float] = {}
    use_rule = ctx.reward_model is None or cfg.reward_model_combine == "add"
    scores = np.zeros(len(rollouts.prompt_index), np.float32)
    if use_rule:
        src = rows[rollouts.prompt_index]
        res = score_batch([ds.data_source[i] for i in src], decode(ctx, rollouts), [ds.ground_truth[i] for i in src],
                          [ds.extra_info[i] for i in src], num_workers=cfg.num_workers, timeout_s=cfg.timeout_s,
                          reward_fn=ctx.reward_fn, default_rule=cfg.default_rule)
        scores = scores + res.scores
        counts.update(errors=float(res.num_errors + res.num_timeouts), timeouts=float(res.num_timeouts))
        counts.update({f"extra/{k}": v for k, v in res.extras.items()})
    if ctx.reward_model is not None:
        rm = np.asarray(ctx.reward_model.score(batch["input_ids"], batch["attention_mask"]), np.float32)
        counts["model_score"] = rm
        scores = scores + rm
    return scores, counts


def advantages(ctx: StepContext, state: PPOState, token_scores: np.ndarray, old_lp: np.ndarray, ref_lp, values,
               rmask: np.ndarray, group_ids: np.ndarray, baselines: np.ndarray | None = None
               ) -> tuple[PPOState, np.ndarray, np.ndarray, np.ndarray, dict[str, float]]:
    """Token rewards (with the KL penalty when it is in the reward), advantages and returns of this process's
    rows; batch statistics (whitening, group baselines, the KL controller's current KL and sample count) are
    over every process's rows. Returns (state with the controller's new coefficient, rewards, advantages,
    returns, metrics). `baselines`: ReMax's greedy responses' rewards, per sequence."""
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
                               **({} if values is None else {"v": np.asarray(values, np.float32)}),
                               **({} if baselines is None else {"b": np.asarray(baselines, np.float32)})})
    adv, ret = _advantage_fn(ctx)(g["r"], g["m"], g.get("v"), g["g"], g.get("b"))
    return (dataclasses.replace(state, kl_coef=kl_coef), np.asarray(rewards), dist.local_rows(adv),
            dist.local_rows(ret), metrics)


_ADV_FNS: dict[int, Callable] = {}


def _advantage_fn(ctx: StepContext) -> Callable:
    """The jitted estimator of this run's config (one per context)."""
    key = id(ctx)
    if key not in _ADV_FNS:
        alg = ctx.cfg.algorithm
        _ADV_FNS[key] = jax.jit(lambda r, m, v, g, b: ppo.compute_advantages(
            alg.adv_estimator, r, m, values=v, group_ids=g, gamma=alg.gamma, lam=alg.lam,
            norm_adv_by_std_in_grpo=alg.norm_adv_by_std_in_grpo, reward_baselines=b))
    return _ADV_FNS[key]


def forward_input(engine, dynamic: bool, budget: int, batch: dict[str, np.ndarray], what: str):
    """(device batch, output -> host [b, r] array): padded, or packed into `budget`-token rows."""
    if not dynamic:
        return engine.shard_batch(batch), dist.local_rows
    packed = engine.pack({k: batch[k] for k in ("input_ids", "attention_mask", "positions", "response_mask")},
                         budget, what)
    n = batch["input_ids"].shape[0]
    return engine.shard_packed(packed), lambda x: packed.unpack(dist.local_rows(x, axis=1), n)


def shaped_scores(ctx: StepContext, rows: np.ndarray, prompts: list[np.ndarray], rollouts: Rollouts
                  ) -> tuple[np.ndarray, np.ndarray, dict[str, Any]]:
    """(scores, the scores with DAPO's overlong penalty if enabled (`reward.overlong_buffer`), counts) of this
    process's rollouts of `prompts` (dataset rows `rows`): `score`, and the penalty's `extra/` entries."""
    ob = ctx.cfg.reward.overlong_buffer
    p_ids, p_mask = left_pad(prompts, ctx.tokenizer.pad_token_id, ctx.P)
    raw, counts = score(ctx, ctx.train_ds, rows, rollouts, train_sequences(p_ids, p_mask, rollouts))
    if not ob.enable:
        return raw, raw, counts
    penalty = overlong_penalty(rollouts.lengths, ctx.R, ob.len, ob.penalty_factor)
    counts.update({"extra/overlong_reward": penalty, "extra/overlong": (penalty < 0).astype(np.float64)})
    return raw, (raw + penalty).astype(np.float32), counts


def greedy_baselines(ctx: StepContext, rows: np.ndarray, prompts: list[np.ndarray], step: int, timer: Timer
                     ) -> np.ndarray:
    """ReMax: one greedy response per prompt (verl generates it beside the sampled ones), scored as the samples
    are (`shaped_scores`: the overlong penalty included); its reward per prompt."""
    cfg = ctx.cfg
    greedy = Sampling(n=1, temperature=0.0, max_tokens=cfg.data.max_response_length, seed=cfg.trainer.seed + step,
                      logprobs=False)
    with timer("gen_max"):
        ro = ctx.engine.generate([p.tolist() for p in prompts], greedy)
    with timer("reward"):
        _, scores, _ = shaped_scores(ctx, rows, prompts, ro)
    out = np.zeros(len(prompts), np.float32)
    out[ro.prompt_index] = scores
    return out


def sample(ctx: StepContext, state: PPOState, rows: np.ndarray, step: int, timer: Timer,
           interrupt: Callable[[], None] = lambda: None,
           draw: Callable[[], np.ndarray] | None = None, push: bool = True) -> tuple[Sampled, dict[str, float]]:
    """Generate and score this process's share of the step's prompts (`rows`: the global batch's dataset rows),
    the scores shaped by DAPO's overlong penalty if enabled (`reward.overlong_buffer`).

    With `algorithm.filter_groups` (DAPO's dynamic sampling) `rows` is a generation round of
    `data.gen_batch_size` prompts: groups whose samples all share the filter metric are dropped and further
    rounds (`draw()`: the next round's rows) run until every process holds its share of `data.train_batch_size`
    prompts with signal (the processes decide together, so they draw the same rounds), at most
    `max_num_gen_batches` rounds; then the batch is filled with dropped groups. Returns (this process's samples
    for the step, global `batch/*` metrics). `push=False`: the engine is awake with the weights to sample with
    already pushed (rollouts one step ahead, jaxppo/ahead.py); `state` is then not read."""
    cfg = ctx.cfg
    fg = cfg.algorithm.filter_groups
    want = dist.share(cfg.data.train_batch_size, "prompts of data.train_batch_size")
    n_want = want.stop - want.start
    pad_id = ctx.tokenizer.pad_token_id
    kept: list[Sampled] = []
    spare: list[Sampled] = []
    generated = dropped = filled = rounds = 0
    with awake(ctx, state.actor.params, timer) if push else contextlib.nullcontext():
        while True:
            mine = rows[dist.share(len(rows), "prompts of a generation round")]
            prompts = [ctx.train_ds.input_ids[i] for i in mine]
            # round 0 samples as a run without filtering does; later rounds with other seeds
            sampling = rollout_sampling(cfg, cfg.trainer.seed * 1_000_003 + step + 7_919 * rounds, step)
            with timer("gen"):
                ro = ctx.engine.generate([p.tolist() for p in prompts], sampling)
            for key, seconds in getattr(ctx.engine, "call_timings", dict)().items():  # several engine processes
                timer.add(key, seconds)
            interrupt()
            with timer("reward"):
                raw, scores, counts = shaped_scores(ctx, mine, prompts, ro)
            if cfg.algorithm.adv_estimator == "remax":  # ReMax's baseline: each prompt's greedy response's reward
                counts["reward_baseline"] = greedy_baselines(ctx, mine, prompts, step, timer)[ro.prompt_index]
            got = Sampled(mine, prompts, ro, scores, counts)
            rounds += 1
            if not fg.enable:
                kept.append(got)
                break
            # acc: a function's own 'acc' entry, else its score (verl's reward managers log acc = score for a
            # function that returns a number)
            metric = {"score": raw, "seq_reward": scores, "acc": counts.get("extra/acc", raw)}[fg.metric]
            keep = groups_with_signal(np.asarray(metric), ro.prompt_index)
            kept.append(got.take(keep))
            spare.append(got.take(np.setdiff1d(np.arange(len(mine)), keep)))
            generated, dropped = generated + len(mine), dropped + len(mine) - len(keep)
            short = sum(len(k.rows) for k in kept) < n_want
            if not dist.any_process(short):
                break
            if fg.max_num_gen_batches and rounds >= fg.max_num_gen_batches:
                if short:  # filled with groups that carry no signal: the step keeps its shapes
                    filled = n_want - sum(len(k.rows) for k in kept)
                    kept.append(Sampled.concat(spare, pad_id).take(np.arange(filled)))
                    log.warning("dynamic sampling: %d of %d groups without signal after %d generation rounds "
                                "(algorithm.filter_groups.max_num_gen_batches); the batch is filled with them",
                                filled, n_want, rounds)
                break
            if draw is None:
                raise ValueError("dynamic sampling needs draw() for further generation rounds")
            # a step of many rounds (a dataset too hard for the model: every group scores alike) is minutes long
            log.info("dynamic sampling, step %d: %d of %d prompts' groups with signal after round %d%s; another round "
                     "of %d prompts", step, sum(len(k.rows) for k in kept), n_want, rounds,
                     f" of at most {fg.max_num_gen_batches}" if fg.max_num_gen_batches else "", len(rows))
            interrupt()
            rows = draw()
    out = Sampled.concat(kept, pad_id) if len(kept) > 1 else kept[0]
    if len(out.rows) > n_want:
        out = out.take(np.arange(n_want))
    metrics = {}
    if fg.enable:
        totals = dist.gather_rows(np.array([[generated, dropped, filled]], np.float64)).sum(0)
        metrics = {"batch/num_gen_batches": float(rounds), "batch/generated_groups": totals[0],
                   "batch/dropped_groups": totals[1], "batch/filled_groups": totals[2]}
    return out, metrics


def old_logprobs(ctx: StepContext, state: PPOState, ro: Rollouts, rmask: np.ndarray, a_in: Any, a_out: Callable,
                 step: int, timer: Timer) -> tuple[np.ndarray | None, np.ndarray, np.ndarray]:
    """The old policy's log-probs of the sampled tokens, the trainer's under the engine's sampling distribution
    and the engine's own (the last two for the rollout/* mismatch metrics; NaN where unknown): in bypass mode the
    engine's are the old policy's; where the update gives them itself (`old_from_update`) none, unless the engine
    returned its own this step (the metrics compare them); else the actor's forward pass."""
    cfg = ctx.cfg
    if rollout_corr.bypass(cfg):  # verl's bypass mode: the policy that sampled is the old policy, not recomputed
        if ro.logprobs is None or not np.isfinite(ro.logprobs[rmask > 0]).all():
            raise RuntimeError("algorithm.rollout_correction.bypass_mode: the rollout engine returned no log-probs")
        old_lp = ro.logprobs.astype(np.float32)
        return old_lp, old_lp, np.full_like(old_lp, np.nan)  # no trainer's log-probs: no gap to report
    if ctx.actor.old_from_update and not rollout_sampling(cfg, None, step).logprobs:
        return None, np.full(rmask.shape, np.nan, np.float32), ro.logprobs
    with timer("old_log_prob"):
        out = ctx.actor.logprobs(state.actor.params, a_in, truncation=ctx.truncation)
        old_lp = a_out(out[0])
        sampling_lp = a_out(out[2]) if ctx.truncation else old_lp
    return old_lp, sampling_lp, ro.logprobs


def collect(ctx: StepContext, state: PPOState, rows: np.ndarray | None, step: int, timer: Timer,
            interrupt: Callable[[], None] = lambda: None,
            draw: Callable[[], np.ndarray] | None = None,
            sampled: tuple[Sampled, dict[str, float]] | None = None) -> tuple[PPOState, Experience]:
    """gen -> reward -> old / ref log-probs, values -> advantages for the global batch `rows` (dataset rows of
    the step's prompts; this process generates for its share; `draw`: further rounds of dynamic sampling), or for
    the batch already `sampled` (rollouts one step ahead: jaxppo/ahead.py).
    `interrupt()` is called between phases (it raises to abandon the step)."""
    cfg = ctx.cfg
    budgets = ctx.budgets
    got, batch_metrics = sampled or sample(ctx, state, rows, step, timer, interrupt, draw)
    rows, prompts, ro, scores, reward_counts = got.rows, got.prompts, got.rollouts, got.scores, got.counts
    mine = dist.share(cfg.data.train_batch_size, "prompts of data.train_batch_size")
    interrupt()
    p_ids, p_mask = left_pad(prompts, ctx.tokenizer.pad_token_id, ctx.P)
    batch = train_sequences(p_ids, p_mask, ro)
    rmask = batch["response_mask"]
    a_in, a_out = forward_input(ctx.actor, cfg.actor.use_dynamic_bsz, budgets.actor_forward, batch,
                                "actor.log_prob_max_token_len_per_device")
    old_lp, sampling_lp, rollout_lp = old_logprobs(ctx, state, ro, rmask, a_in, a_out, step, timer)
    ref_lp = None
    if state.ref_params is not None and needs_ref_logprobs(cfg):
        with timer("ref"):
            ref_lp = a_out(ctx.actor.ref_logprobs(state.ref_params, a_in))
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
                                                          ro.prompt_index + mine.start,
                                                          reward_counts.get("reward_baseline"))
    batch.update(advantages=adv)
    if not ctx.actor.old_from_update:  # else the update's loss takes them from its own forward pass
        batch["old_logprobs"] = old_lp
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
    rc_metrics = {}
    if rollout_corr.enabled(cfg) and not rollout_corr.bypass(cfg):
        # verl's rollout correction (decoupled): weights, rejected tokens out of the actor's loss mask; in bypass
        # mode the loss computes them from the current policy (jaxppo/ppo/bypass.py)
        weights, actor_mask, rc_metrics = rollout_corr.rollout_correction(
            old_lp, ro.logprobs, rmask, cfg.algorithm.rollout_correction,
            total=lambda v: dist.gather_rows(np.asarray(v, np.float64)[None]).sum(0))
        if weights is not None:
            batch["is_weights"] = weights.astype(np.float32)
        batch["response_mask"] = actor_mask.astype(rmask.dtype)
    local = {"scores": scores, "rewards": rewards.sum(-1), "adv": adv, "ret": ret, "sampling_lp": sampling_lp,
             "rollout_lp": rollout_lp, "rmask": rmask, "lengths": ro.lengths.astype(np.float64),
             "prompt_lengths": p_mask.sum(-1)[ro.prompt_index].astype(np.float64),
             "reward_counts": np.array([float(reward_counts.get("errors", 0.0)), float(reward_counts.get("timeouts", 0.0)),
                                        float(np.sum(reward_counts.get("model_score", 0.0)))])}
    if values is not None:
        local["values"] = values
    g = {k: dist.gather_rows(v) for k, v in local.items()}  # metrics are global
    # a user's reward function's extra entries: the union of keys over processes, NaN where a sample has none
    keys = sorted({k for ks in dist.gather_objects(sorted(k for k in reward_counts if k.startswith("extra/")))
                   for k in ks})
    extras = {k: dist.gather_rows(reward_counts.get(k, np.full(len(scores), np.nan))) for k in keys}
    metrics = rollout_metrics(g, step, state.kl_coef, ctx.R)
    metrics.update(kl_metrics)
    metrics.update(batch_metrics)
    metrics.update(rc_metrics)
    counts = g["reward_counts"].reshape(-1, 3).sum(0)
    metrics["reward/errors"], metrics["reward/timeouts"] = float(counts[0]), float(counts[1])
    metrics["reward/error_ratio"] = float(counts[0]) / max(len(g["scores"]), 1)  # errors include the timeouts
    if ctx.reward_model is not None:
        metrics["reward/model_score/mean"] = float(counts[2]) / max(len(g["scores"]), 1)
    for k, v in extras.items():
        if np.isfinite(v).any():
            metrics[f"reward/{k}/mean"] = float(np.nanmean(v))
    lengths = g["prompt_lengths"] + g["lengths"]
    return state, Experience(batch, cbatch, metrics, lengths, g["lengths"])


def single_update(cfg: Config) -> bool:
    """The step makes one actor update: `actor.ppo_epochs` = 1 and one mini-batch."""
    return cfg.actor.ppo_epochs == 1 and cfg.actor.ppo_mini_batch_size == cfg.data.train_batch_size


def old_from_update(cfg: Config) -> bool:
    """Whether the actor's update takes the old policy's log-probs from its own forward pass (detached) instead of
    a forward pass of their own before it: the step's one update (`actor.ppo_epochs` = 1, one mini-batch) starts
    from the weights that sampled, so the old policy is the current one and the PPO ratio is 1 at its only
    gradient, as recomputed (up to rounding); and nothing before the update reads them (no KL in the reward, no
    rollout correction or truncated IS, which compare them with the engine's; synchronous rollouts)."""
    return (single_update(cfg) and not cfg.algorithm.use_kl_in_reward and cfg.actor.tis_threshold is None
            and not rollout_corr.enabled(cfg) and not rollout_corr.bypass(cfg) and not cfg.trainer.async_rollout)


def update_keys(cfg: Config, has_ref: bool) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """The per-token arrays the actor's and the critic's update batches carry beside the sequences (what `collect`
    puts there; the memory plan compiles the updates for them)."""
    actor = ["advantages"] if old_from_update(cfg) else ["old_logprobs", "advantages"]
    if has_ref and needs_ref_logprobs(cfg):
        actor.append("ref_logprobs")
    rc = cfg.algorithm.rollout_correction
    if cfg.actor.tis_threshold is not None or (rc.rollout_is is not None and not rc.bypass_mode):
        actor.append("is_weights")
    return tuple(actor), ("values", "returns")


def needs_ref_logprobs(cfg: Config) -> bool:
    """Reference log-probs of the sampled tokens: KL in the reward, or a KL loss with a per-token estimator
    (the exact KL, `kl_loss_type=full`, runs the reference inside the update instead)."""
    a = cfg.actor
    return cfg.algorithm.use_kl_in_reward or (a.use_kl_loss and a.kl_loss_type != "full")


def update(ctx: StepContext, state: PPOState, exp: Experience, step: int, timer: Timer,
           after_actor: Callable[[PPOState], None] | None = None) -> tuple[PPOState, dict]:
    """The critic's and (after `trainer.critic_warmup` steps) the actor's mini-batch updates. Both read the step's
    batch and neither reads the other's result, so their order is free: the critic's first (verl's order), or with
    `after_actor` the actor's first, then `after_actor(state)` (the state with the new actor), then the critic's
    (the next batch, launched there with the new weights, is generated while the critic updates:
    `trainer.rollout_during_critic_update`, jaxppo/ahead.py)."""
    cfg = ctx.cfg
    budgets = ctx.budgets
    metrics: dict[str, float] = {}

    def critic(state: PPOState) -> PPOState:
        if ctx.critic is None:
            return state
        with timer("update_critic"):
            new, cm = _update(ctx, ctx.critic, state.critic, exp.critic_batch, cfg.critic, budgets.critic_update,
                              "critic.ppo_max_token_len_per_device", cfg.trainer.seed + 7919 * step)
        metrics.update(_mean_metrics(cm, "critic"))
        return dataclasses.replace(state, critic=new)

    def actor(state: PPOState) -> PPOState:
        if step < cfg.trainer.critic_warmup:
            return state
        with timer("update_actor"):
            new, am = _update(ctx, ctx.actor, state.actor, exp.batch, cfg.actor, budgets.actor_update,
                              "actor.ppo_max_token_len_per_device", cfg.trainer.seed + 104729 * step, state.ref_params)
        metrics.update(_mean_metrics(am, "actor"))
        return dataclasses.replace(state, actor=new)

    if after_actor is None:
        return actor(critic(state)), metrics
    state = actor(state)
    after_actor(state)
    return critic(state), metrics


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


__all__ = ["update_keys", "single_update", "old_from_update", "old_logprobs", "needs_ref_logprobs", "Timer",
           "PPOState", "StepContext", "Experience", "awake", "decode", "sample", "collect", "update", "score",
           "advantages", "perf_metrics"]
