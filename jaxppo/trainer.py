"""The PPO loop: rollout -> rewards -> old / ref log-probs, values -> advantages -> critic and actor
updates -> weight sync, with `timing_s/*` for each phase and verl's metric names."""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import signal
import sys
import threading
import time
from pathlib import Path
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np

from jaxppo import distributed as dist
from jaxppo import ppo
from jaxppo.checkpoint import RunCheckpointer, restore_from
from jaxppo.config import Config, to_yaml
from jaxppo.data import ResumableSampler, left_pad
from jaxppo.errors import ConfigError
from jaxppo.engine import ActorEngine, CriticEngine
from jaxppo.health import HealthMonitor, update_guards
from jaxppo.metrics import MetricsLogger, stats
from jaxppo.models import load_model, save_hf_checkpoint
from jaxppo.models.hf_io import HFWeights
from jaxppo.perf import measure_matmul_peak, train_flops_per_token
from jaxppo.rewards import score_batch
from jaxppo.rollout import RolloutEngine, Sampling, train_sequences
from jaxppo.setup import DTYPES, attention_impl, engine_dtype, prepare_data, prepare_model_dir
from jaxppo.sharding import make_mesh
from jaxppo.warmstart import sft_warm_start

log = logging.getLogger(__name__)
EngineFactory = Callable[[Path, Any], RolloutEngine]


class Timer:
    """Wall time per named phase (`timing_s/<name>`), each phase also a named region of the JAX
    profiler trace and, while torch is being profiled, of the torch trace."""

    def __init__(self, torch_regions: bool = False):
        self.times: dict[str, float] = {}
        self.torch_regions = torch_regions

    @contextlib.contextmanager
    def __call__(self, name: str):
        t0 = time.perf_counter()
        with contextlib.ExitStack() as stack:
            stack.enter_context(jax.profiler.TraceAnnotation(name))
            if self.torch_regions:
                import torch

                stack.enter_context(torch.profiler.record_function(name))
            yield
        self.times[f"timing_s/{name}"] = self.times.get(f"timing_s/{name}", 0.0) + time.perf_counter() - t0


class _Abandoned(Exception):
    """A stop signal arrived before the step's updates began: the step is dropped, not half-done."""


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


class PPOTrainer:
    def __init__(self, cfg: Config, engine_factory: EngineFactory):
        self.cfg = cfg
        t = cfg.trainer
        self.run_dir = Path(t.default_local_dir)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.main = jax.process_index() == 0  # writes the config, metrics and logs; every process checkpoints
        if self.main:
            (self.run_dir / "config.yaml").write_text(to_yaml(cfg))
        self.mesh = make_mesh(cfg.mesh.axes())
        self.tokenizer, self.tokenizer_dir, self.train_ds, self.val_ds = prepare_data(cfg, self.run_dir)
        self.model_dir = prepare_model_dir(cfg, self.run_dir, self.tokenizer)
        self.n, self.R, self.P = cfg.rollout.n, cfg.data.max_response_length, cfg.data.max_prompt_length
        self.sampler = ResumableSampler(len(self.train_ds), cfg.data.train_batch_size, cfg.data.seed, cfg.data.shuffle)
        self.total_steps = t.total_training_steps or t.total_epochs * self.sampler.batches_per_epoch
        self.eos_ids = tuple(sorted({self.tokenizer.eos_token_id}))
        self.engine_dtype = engine_dtype(cfg)
        # the rollout engine starts before JAX allocates anything: vLLM checks at start that its share of
        # the card is free (JAX grows into the rest; see docs/memory.md)
        self.engine = engine_factory(self.model_dir, self)
        self.engine.sleep()

        kw = dict(mesh=self.mesh, dtype=DTYPES[cfg.model.dtype], param_dtype=DTYPES[cfg.model.param_dtype],
                  remat=cfg.model.remat, attention_impl=attention_impl(cfg), random_init=cfg.model.random_init,
                  attention_window=self.P + self.R, scan_unroll=cfg.model.scan_unroll)
        self.actor_module, actor_params, self.model_cfg = load_model(self.model_dir, **kw)
        a, c = cfg.actor, cfg.critic
        n_seq = cfg.data.train_batch_size * self.n
        steps_per = lambda sub: sub.ppo_epochs * (cfg.data.train_batch_size // sub.ppo_mini_batch_size)
        self.actor = ActorEngine(self.actor_module, self.mesh, a, self.R,
                                 a.optim.total_steps or self.total_steps * steps_per(a), cfg.rollout.temperature,
                                 cfg.mesh.fsdp_gather, cfg.mesh.grad_reduce_dtype)
        self.warm_dir = self.run_dir / "warm_model"
        if t.sft_warmup_steps > 0 and not (self.warm_dir / "config.json").is_file():
            actor_params = sft_warm_start(self, actor_params)
            save_hf_checkpoint(actor_params, self.model_cfg, self.warm_dir)
        start_dir = self.warm_dir if (self.warm_dir / "config.json").is_file() else self.model_dir
        if start_dir != self.model_dir:
            _, actor_params, _ = load_model(start_dir, **kw)
        self.use_ref = cfg.actor.use_kl_loss or cfg.algorithm.use_kl_in_reward
        self.ref_params = jax.tree.map(jnp.copy, actor_params) if self.use_ref else None
        self.actor_state = self.actor.init_state(actor_params)
        self.use_critic = cfg.algorithm.adv_estimator == "gae"
        if self.use_critic:
            self.critic_module, critic_params, _ = load_model(cfg.model.critic_path or start_dir, "value",
                                                              rng=jax.random.PRNGKey(t.seed + 1), **kw)
            self.critic = CriticEngine(self.critic_module, self.mesh, c, self.R,
                                       c.optim.total_steps or self.total_steps * steps_per(c), cfg.mesh.fsdp_gather,
                                       cfg.mesh.grad_reduce_dtype)
            self.critic_state = self.critic.init_state(critic_params)
        self.actor.guards = update_guards(t.health, "actor")
        if self.use_critic:
            self.critic.guards = update_guards(t.health, "critic")
        self.health = HealthMonitor(t.health)
        self.kl_coef = cfg.algorithm.kl_ctrl.kl_coef
        self._adv_fn = None
        self.step = 0
        self.bad_steps = 0  # consecutive steps with NaN/inf
        self.best_val: float | None = None
        self.vals_since_best = 0
        self.stop_reason: str | None = None  # why fit() ended early
        self.exit_code = 0
        self._signal: str | None = None
        self._profiling = False
        self.checkpointer = RunCheckpointer(self.run_dir / "checkpoints", t.max_to_keep)
        self._maybe_resume()
        self.peak_flops = measure_matmul_peak()
        self.flops_per_token = train_flops_per_token(self.model_cfg, self.P + self.R)
        log.info("run dir %s: %d train prompts, %d steps, %d sequences per step", self.run_dir, len(self.train_ds),
                 self.total_steps, n_seq)

    # ------------------------------------------------------------------ checkpoints

    def _states(self) -> dict[str, Any]:
        states = {"actor": self.actor_state}
        if self.use_critic:
            states["critic"] = self.critic_state
        return states

    def _meta(self) -> dict[str, Any]:
        return {"step": self.step, "kl_coef": float(self.kl_coef), "sampler": self.sampler.state(),
                "seed": self.cfg.trainer.seed, "health": self.health.state(), "bad_steps": self.bad_steps,
                "best_val": self.best_val, "vals_since_best": self.vals_since_best}

    def save_checkpoint(self) -> None:
        if self.step in self.checkpointer.manager.all_steps():
            return
        self.checkpointer.save(self.step, self._states(), self._meta())
        log.info("checkpoint saved: %s/%d", self.checkpointer.directory, self.step)

    def _maybe_resume(self) -> None:
        mode = self.cfg.trainer.resume_mode
        if mode == "disable":
            return
        if mode == "auto":
            step = self.checkpointer.latest_step()
            if step is None:
                return
            states, meta = self.checkpointer.restore(step, self._states())
        else:
            step, states, meta = restore_from(mode, self._states())
        self.actor_state = states["actor"]
        if self.use_critic:
            self.critic_state = states["critic"]
        self.step, self.kl_coef = int(meta["step"]), float(meta["kl_coef"])
        self.sampler.load_state(meta["sampler"])
        if "health" in meta:
            self.health.load_state(meta["health"])
            self.bad_steps, self.vals_since_best = int(meta["bad_steps"]), int(meta["vals_since_best"])
            self.best_val = meta["best_val"]
        log.info("resumed from step %d", self.step)

    # ------------------------------------------------------------------ phases

    def sync_weights(self) -> None:
        """Push the actor's current weights into the (awake) rollout engine. Done at every wake: a
        sleeping engine may have dropped its weights (vLLM sleep level 2), and the push is cheap."""
        self.engine.update_weights(HFWeights(self.actor_state.params, DTYPES[self.engine_dtype]))

    @contextlib.contextmanager
    def awake(self, timer: Timer | None = None):
        """The rollout engine woken with the actor's current weights, put back to sleep on exit; each
        phase timed (timing_s/wake, sync, sleep)."""
        timer = timer or Timer()
        with timer("wake"):
            self.engine.wake()
        try:
            with timer("sync"):
                self.sync_weights()
            yield
        finally:
            with timer("sleep"):
                self.engine.sleep()

    def generate(self, prompt_ids: list[np.ndarray], sampling: Sampling, timer: Timer | None = None):
        """wake -> push weights -> generate (timing_s/gen) -> sleep."""
        timer = timer or Timer()
        with self.awake(timer), timer("gen"):
            return self.engine.generate([p.tolist() for p in prompt_ids], sampling)

    def decode(self, rollouts) -> list[str]:
        return [self.tokenizer.decode(ids[: int(n)], skip_special_tokens=True)
                for ids, n in zip(rollouts.response_ids, rollouts.lengths)]

    def score(self, rows: np.ndarray, rollouts) -> tuple[np.ndarray, int]:
        ds = self.train_ds
        src = rows[rollouts.prompt_index]
        res = score_batch([ds.data_source[i] for i in src], self.decode(rollouts), [ds.ground_truth[i] for i in src],
                          [ds.extra_info[i] for i in src])
        return res.scores, res.num_errors + res.num_timeouts

    def _advantages(self, token_scores, old_lp, ref_lp, values, rmask, group_ids):
        """Host arrays of this process's rows in, its rows out; batch statistics (whitening, group
        baselines, the KL controller's current KL) are over all processes' rows."""
        alg = self.cfg.algorithm
        metrics = {}
        rewards = token_scores
        if alg.use_kl_in_reward:
            rewards, current_kl = ppo.apply_kl_penalty(token_scores, old_lp, ref_lp, rmask, self.kl_coef,
                                                       alg.kl_penalty)
            current_kl = float(np.mean(dist.gather_rows(np.array([float(current_kl)]))))  # equal shares
            metrics["actor/reward_kl_penalty"] = float(current_kl)
            if np.isfinite(float(current_kl)):  # a NaN batch must not poison the controller
                self.kl_coef = float(ppo.update_kl_coef(ppo.KLControlConfig(**dataclasses.asdict(alg.kl_ctrl)),
                                                        self.kl_coef, float(current_kl), len(group_ids)))
        if self._adv_fn is None:
            self._adv_fn = jax.jit(lambda r, m, v, g: ppo.compute_advantages(
                alg.adv_estimator, r, m, values=v, group_ids=g, gamma=alg.gamma, lam=alg.lam,
                norm_adv_by_std_in_grpo=alg.norm_adv_by_std_in_grpo))
        g = self.actor.shard_batch({"r": np.asarray(rewards, np.float32), "m": np.asarray(rmask, np.float32),
                                    "g": np.asarray(group_ids, np.int32),
                                    **({} if values is None else {"v": np.asarray(values, np.float32)})})
        adv, ret = self._adv_fn(g["r"], g["m"], g.get("v"), g["g"])
        return np.asarray(rewards), dist.local_rows(adv), dist.local_rows(ret), metrics

    def _update(self, engine, state, batch: dict[str, np.ndarray], sub, seed: int):
        """ppo_epochs x mini-batches of `batch` (host arrays); returns the new state and mean metrics."""
        n = batch["input_ids"].shape[0]  # this process's rows
        n_mini = self.cfg.data.train_batch_size // sub.ppo_mini_batch_size  # mini-batches per epoch
        rng = np.random.default_rng(seed)
        out = []
        for _ in range(sub.ppo_epochs):
            order = rng.permutation(n) if sub.shuffle else np.arange(n)
            for i in range(n_mini):  # strided: a mini-batch is the same rows whatever the number of processes
                rows = order[i::n_mini]
                part = {k: v[rows] for k, v in batch.items()}
                if sub.use_dynamic_bsz:
                    packed = engine.pack(part, sub.ppo_max_token_len_per_device,
                                         f"{'actor' if engine is self.actor else 'critic'}.ppo_max_token_len_per_device")
                    state, m = engine.update(state, engine.shard_packed(packed))
                else:
                    state, m = engine.update(state, engine.shard_batch(part))
                out.append(m)
        return state, jax.device_get(out)

    # ------------------------------------------------------------------ one step

    def _stop_requested(self) -> bool:
        """A stop signal seen by any process (a collective when there are several: all agree)."""
        if dist.any_process(self._signal is not None):
            self._signal = self._signal or "SIGTERM (another process)"
            return True
        return False

    def _interrupt_point(self) -> None:
        if self._stop_requested():
            raise _Abandoned()

    def train_step(self) -> dict[str, float]:
        """One PPO step. A stop signal during the phases before the updates abandons the step (sampler
        and KL controller restored, nothing updated); once the updates begin the step completes."""
        timer = Timer(torch_regions=self._profiling and "torch" in sys.modules)
        metrics: dict[str, float] = {}
        start = (self.sampler.state(), self.kl_coef)
        try:
            with timer("step"):
                pre, skip, batches = self._rollout_phases(timer, metrics)
                if not skip:
                    self._update_phases(timer, metrics, *batches)
        except _Abandoned:
            self.sampler.load_state(start[0])
            self.kl_coef = start[1]
            raise
        self.step += 1
        metrics.update(timer.times)
        metrics.update(pre)
        metrics.update(self._perf_metrics(timer.times, pre["perf/total_num_tokens"]))
        metrics["health/skipped_steps"] = float(skip)
        return metrics

    def _rollout_phases(self, timer: Timer, metrics: dict[str, float]):
        """gen -> reward -> old / ref log-probs, values -> advantages, then the health rules known before
        the updates. Returns (rollout metrics over all processes, skip the updates, (actor batch, critic
        batch or None) of this process's rows)."""
        cfg = self.cfg
        rows = self.sampler.next_batch()  # the global batch; this process generates for its share
        mine = dist.share(len(rows), "prompts of data.train_batch_size")
        rows = rows[mine]
        prompts = [self.train_ds.input_ids[i] for i in rows]
        sampling = Sampling(n=self.n, temperature=cfg.rollout.temperature, top_p=cfg.rollout.top_p,
                            top_k=cfg.rollout.top_k, max_tokens=self.R, seed=cfg.trainer.seed * 1_000_003 + self.step)
        ro = self.generate(prompts, sampling, timer)
        self._interrupt_point()
        with timer("reward"):
            scores, reward_errors = self.score(rows, ro)
        scores = self._inject_scores(scores)
        p_ids, p_mask = left_pad(prompts, self.tokenizer.pad_token_id, self.P)
        batch = train_sequences(p_ids, p_mask, ro)
        rmask = batch["response_mask"]
        a_in, a_out = self._forward_input(self.actor, cfg.actor.use_dynamic_bsz,
                                          cfg.actor.log_prob_max_token_len_per_device, batch,
                                          "actor.log_prob_max_token_len_per_device")
        with timer("old_log_prob"):
            old_lp = a_out(self.actor.logprobs(self.actor_state.params, a_in)[0])
        ref_lp = None
        if self.use_ref:
            with timer("ref"):
                ref_lp = a_out(self.actor.logprobs(self.ref_params, a_in)[0])
        values = None
        if self.use_critic:
            c_in, c_out = self._forward_input(self.critic, cfg.critic.use_dynamic_bsz,
                                              cfg.critic.forward_max_token_len_per_device, batch,
                                              "critic.forward_max_token_len_per_device")
            with timer("values"):
                values = c_out(self.critic.values(self.critic_state.params, c_in))
        self._interrupt_point()
        with timer("adv"):
            token_scores = np.asarray(ppo.scores_to_token_level(jnp.asarray(scores), jnp.asarray(rmask)))
            rewards, adv, ret, kl_metrics = self._advantages(token_scores, old_lp, ref_lp, values, rmask,
                                                             ro.prompt_index + mine.start)
        metrics.update(kl_metrics)
        batch.update(old_logprobs=old_lp, advantages=adv)
        if ref_lp is not None:
            batch["ref_logprobs"] = ref_lp
        if cfg.actor.tis_threshold is not None:
            batch["is_weights"] = np.asarray(ppo.truncated_is_weights(old_lp, ro.logprobs, rmask,
                                                                      cfg.actor.tis_threshold))
        cbatch = None
        if self.use_critic:
            cbatch = {k: batch[k] for k in ("input_ids", "attention_mask", "positions", "response_mask")}
            cbatch.update(values=values, returns=ret)
        local = {"scores": scores, "rewards": rewards.sum(-1), "adv": adv, "ret": ret, "old_lp": old_lp,
                 "rollout_lp": ro.logprobs, "rmask": rmask, "lengths": ro.lengths.astype(np.float64),
                 "prompt_lengths": p_mask.sum(-1)[ro.prompt_index].astype(np.float64),
                 "reward_errors": np.array([float(reward_errors)])}
        if values is not None:
            local["values"] = values
        g = {k: dist.gather_rows(v) for k, v in local.items()}  # metrics are global
        pre = self._rollout_metrics(g)
        pre["reward/errors"] = float(g["reward_errors"].sum())
        found = self.health.decide(pre, "pre")
        skip = any(f.action in ("skip_update", "stop") for f in found)
        self._interrupt_point()
        return pre, skip, (batch, cbatch)

    def _forward_input(self, engine, dynamic: bool, budget: int, batch: dict[str, np.ndarray], what: str):
        """(device batch, output -> host [b, r] array): padded, or packed into `budget`-token rows."""
        if not dynamic:
            return engine.shard_batch(batch), dist.local_rows
        packed = engine.pack({k: batch[k] for k in ("input_ids", "attention_mask", "positions", "response_mask")},
                             budget, what)
        n = batch["input_ids"].shape[0]
        return engine.shard_packed(packed), lambda x: packed.unpack(dist.local_rows(x, axis=1), n)

    def _update_phases(self, timer: Timer, metrics: dict[str, float], batch: dict[str, np.ndarray],
                       cbatch: dict[str, np.ndarray] | None) -> None:
        cfg = self.cfg
        if self.use_critic:
            with timer("update_critic"):
                self.critic_state, cm = self._update(self.critic, self.critic_state, cbatch, cfg.critic,
                                                     cfg.trainer.seed + 7919 * self.step)
            metrics.update(_mean_metrics(cm, "critic"))
        if self.step >= cfg.trainer.critic_warmup:
            with timer("update_actor"):
                self.actor_state, am = self._update(self.actor, self.actor_state, batch, cfg.actor,
                                                    cfg.trainer.seed + 104729 * self.step)
            metrics.update(_mean_metrics(am, "actor"))

    def _inject_scores(self, scores: np.ndarray) -> np.ndarray:
        """Test hook: scores as the reward phase returned them (subclasses inject faults here)."""
        return scores

    def _rollout_metrics(self, g: dict[str, np.ndarray]) -> dict[str, float]:
        """The step's rollout / advantage metrics from every process's rows (`g`)."""
        rmask = g["rmask"]
        m: dict[str, float] = {"actor/kl_coef": self.kl_coef, "training/global_step": float(self.step + 1),
                               "training/epoch": float(self.sampler.state()["epoch"])}
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
        m["response_length/clip_ratio"] = float(np.mean(g["lengths"] >= self.R))
        m.update(stats("prompt_length", g["prompt_lengths"]))
        m.update({k: float(v) for k, v in ppo.rollout_mismatch_metrics(g["old_lp"], g["rollout_lp"], rmask).items()})
        m["perf/total_num_tokens"] = float(g["prompt_lengths"].sum() + g["lengths"].sum())
        return m

    def _perf_metrics(self, times, tokens: float) -> dict[str, float]:
        m: dict[str, float] = {}
        n_dev = jax.device_count()
        m["perf/compiles"] = float(self.actor.compiles() + (self.critic.compiles() if self.use_critic else 0))
        m["perf/throughput"] = tokens / times["timing_s/step"] / n_dev
        if "timing_s/update_actor" in times:
            flops = self.flops_per_token * tokens * self.cfg.actor.ppo_epochs
            m["perf/mfu/actor"] = flops / times["timing_s/update_actor"] / (self.peak_flops * n_dev)
        return m

    # ------------------------------------------------------------------ validation and the loop

    def validate(self) -> dict[str, float]:
        """Score the validation set (each process its share; weights pushed once), `val/<source>/score`."""
        if self.val_ds is None:
            return {}
        ds, bs = self.val_ds, self.cfg.data.val_batch_size
        temp = self.cfg.rollout.val_temperature
        mine = np.array_split(np.arange(len(ds)), jax.process_count())[jax.process_index()]
        scores, index = [], []
        with self.awake():
            for start in range(0, len(mine), bs):
                rows = mine[start:start + bs]
                ro = self.engine.generate([ds.input_ids[i].tolist() for i in rows],
                                          Sampling(n=1, temperature=temp, max_tokens=self.R, seed=self.cfg.trainer.seed))
                res = score_batch([ds.data_source[i] for i in rows], self.decode(ro),
                                  [ds.ground_truth[i] for i in rows], [ds.extra_info[i] for i in rows])
                scores.extend(res.scores.tolist())
                index.extend(rows.tolist())
        scores = dist.gather_ragged(np.asarray(scores, np.float64), np.nan)
        sources = [ds.data_source[i] for i in dist.gather_ragged(np.asarray(index, np.int64), -1)]
        out = {}
        for src in sorted(set(sources)):
            out[f"val/{src}/score"] = float(np.mean([s for s, d in zip(scores, sources) if d == src]))
        out["val/score"] = float(np.mean(scores))
        return out

    @contextlib.contextmanager
    def _stop_signals(self):
        """SIGINT / SIGTERM ask the run to stop at the next phase boundary and write a checkpoint; a second
        signal interrupts at once."""
        if threading.current_thread() is not threading.main_thread():
            yield
            return

        def handler(signum, frame):
            if self._signal is not None:
                raise KeyboardInterrupt
            self._signal = signal.Signals(signum).name
            log.warning("%s received: stopping after the current phase, then writing a checkpoint (send it again "
                        "to abort at once)", self._signal)

        old = {sig: signal.signal(sig, handler) for sig in (signal.SIGINT, signal.SIGTERM)}
        try:
            yield
        finally:
            for sig, h in old.items():
                signal.signal(sig, h)

    @contextlib.contextmanager
    def _maybe_profile(self, step: int):
        """A JAX profiler trace (TensorBoard / Perfetto) of step `step` when it is in trainer.profile_steps;
        torch's profiler alongside when torch is loaded (the rollout engine), with the same region names."""
        t = self.cfg.trainer
        if step not in t.profile_steps:
            yield
            return
        out = Path(t.profile_dir or self.run_dir / "profile") / f"step_{step}"
        out.mkdir(parents=True, exist_ok=True)
        torch_prof = None
        if "torch" in sys.modules:
            import torch

            acts = [torch.profiler.ProfilerActivity.CPU]
            if torch.cuda.is_available():
                acts.append(torch.profiler.ProfilerActivity.CUDA)
            torch_prof = torch.profiler.profile(activities=acts)
        self._profiling = True
        try:
            opts = jax.profiler.ProfileOptions()
            opts.python_tracer_level = 0  # Python call tracing floods the trace (and caps it) with no phase in it
            with jax.profiler.trace(str(out), create_perfetto_trace=True, profiler_options=opts):
                if torch_prof is not None:
                    with torch_prof:
                        yield
                else:
                    yield
        finally:
            self._profiling = False
            if torch_prof is not None:
                torch_prof.export_chrome_trace(str(out / "torch_trace.json"))
            log.info("profile of step %d written to %s (tensorboard --logdir %s, or the *.trace.json.gz / "
                     "torch_trace.json in https://ui.perfetto.dev)", step, out, out)

    def _early_stop(self, val: dict[str, float]) -> bool:
        t = self.cfg.trainer
        if t.early_stop_patience <= 0 or not val:
            return False
        if t.early_stop_metric not in val:
            raise ConfigError(f"trainer.early_stop_metric {t.early_stop_metric!r} is not a validation metric; "
                              f"known: {sorted(val)}")
        v = float(val[t.early_stop_metric])
        sign = 1.0 if t.early_stop_mode == "max" else -1.0
        if self.best_val is None or sign * (v - self.best_val) > t.early_stop_min_delta:
            self.best_val, self.vals_since_best = v, 0
            return False
        self.vals_since_best += 1
        return self.vals_since_best >= t.early_stop_patience

    def fit(self) -> dict[str, float]:
        """Steps until done, early stop, a health stop, too many bad steps or a stop signal; sets
        `stop_reason` and `exit_code` (0; 3 when the run's health ended it)."""
        t = self.cfg.trainer
        logger = MetricsLogger(self.run_dir, list(t.logger) if self.main else [], total_steps=self.total_steps,
                               start_step=self.step, project=t.project_name, name=t.experiment_name)
        last: dict[str, float] = {}
        try:
            with self._stop_signals():
                if t.val_before_train and self.step == 0:
                    last = self.validate()
                    self._early_stop(last)
                    logger.log(0, last)
                while self.step < self.total_steps and not self._stop_requested():
                    try:
                        with self._maybe_profile(self.step + 1):
                            metrics = self.train_step()
                    except _Abandoned:
                        break
                    found = self.health.report(metrics)
                    bad = any(f.rule == "nonfinite" for f in found) or metrics.get("actor/nonfinite_updates", 0) \
                        or metrics.get("critic/nonfinite_updates", 0)
                    self.bad_steps = self.bad_steps + 1 if bad else 0
                    metrics["health/bad_steps"] = float(self.bad_steps)
                    done = self.step >= self.total_steps
                    stop = [f for f in found if f.action == "stop"]
                    if t.test_freq > 0 and (self.step % t.test_freq == 0 or done) and not self._stop_requested():
                        val = self.validate()
                        metrics.update(val)
                        if self._early_stop(val):
                            self.stop_reason = (f"early stop: {t.early_stop_metric} did not improve on "
                                                f"{self.best_val:.4f} in {t.early_stop_patience} validations")
                    logger.log(self.step, metrics)
                    last = metrics
                    if self.bad_steps >= t.max_bad_steps:
                        good = self.checkpointer.latest_step()
                        self.stop_reason = (f"{self.bad_steps} consecutive steps with NaN/inf (trainer.max_bad_steps)"
                                            f"; no checkpoint written, the last good one is step {good}")
                        self.exit_code = 3
                        break
                    if stop:
                        self.stop_reason = "health: " + ", ".join(f"{f.metric} = {f.value:.4g} ({f.rule})" for f in stop)
                        self.exit_code = 3
                    if (t.save_freq > 0 and self.step % t.save_freq == 0) or done or self.stop_reason:
                        self.save_checkpoint()
                    if self.stop_reason:
                        break
                if self._stop_requested():
                    self.save_checkpoint()
                    self.stop_reason = (f"{self._signal}: stopped at step {self.step}, checkpoint written to "
                                        f"{self.checkpointer.directory}/{self.step}; run the same command again to "
                                        f"resume (trainer.resume_mode=auto)")
        finally:
            logger.close()
            self.checkpointer.close()
        if self.stop_reason:
            log.warning("%s", self.stop_reason)
        return last
