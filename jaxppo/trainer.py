"""The run around the PPO step: building it, the loop, checkpoints and resume, validation cadence, stop
signals, profiling, health decisions and early stopping. The step itself (rollout -> rewards -> forward passes
-> advantages -> updates) is `jaxppo/step.py`."""

from __future__ import annotations

import contextlib
import gc
import logging
import signal
import threading
from pathlib import Path
from typing import Any, Callable

import jax
import numpy as np

from jaxppo import distributed as dist
from jaxppo import memory
from jaxppo import mps
from jaxppo import start
from jaxppo.plan import bind_plan
from jaxppo import step as ppo_step
from jaxppo import validation
from jaxppo.checkpoint import RunCheckpointer, restore_from, settings_changed
from jaxppo.config import Config, config_dict, to_yaml
from jaxppo.engine import ActorEngine, CriticEngine
from jaxppo.errors import CheckpointError, ConfigError
from jaxppo.health import HealthMonitor
from jaxppo.metrics import MetricsLogger
from jaxppo.models import load_model, save_hf_checkpoint
from jaxppo.ahead import Ahead, stored_lag, stored_rows
from jaxppo.models.hf_io import HFWeights
from jaxppo.models.lora import LoRAWeights
from jaxppo.rewards import custom as custom_reward
from jaxppo.rewards.workers import pool as reward_pool, resolve as resolve_workers
from jaxppo.perf import device_peak_flops, flops_model, gc_clock
from jaxppo.rollout import RolloutEngine
from jaxppo.setup import (DTYPES, check_warm_model, engine_dtype, lock_run_dir, make_run_dir, prepare_model_dir,
                          truncate_metrics, write_atomic)
from jaxppo.profiling import profiled_step
from jaxppo.step import PPOState, StepContext, Timer, single_update
from jaxppo.warmstart import sft_warm_start

log = logging.getLogger(__name__)
EngineFactory = Callable[[Path, Any], RolloutEngine]


class _Abandoned(Exception):
    """A stop signal arrived before the step's updates began: the step is dropped, not half-done."""


def _step_context(cfg: Config, prep: Any, engine: RolloutEngine, budgets: Any, push_dtype: Any) -> StepContext:
    """What every step reads (jaxppo/step.py): the engines the start built (their health guards set where the plan
    compiled their updates), the rollout engine, the datasets, the reward (a reward model, a user's function), the
    token budgets, how the actor's weights reach the engine (LoRA: merged from base and adapters), FLOPs per token."""
    b = prep.build
    reward_model = None
    if cfg.model.reward_model_path:
        from jaxppo.rewards.model import RewardModel

        reward_model = RewardModel(cfg.model.reward_model_path, dtype=DTYPES[cfg.model.dtype])
    actor = b.actor
    if b.actor_lora.rank:
        rollout_weights = lambda adapters: LoRAWeights(actor.frozen, adapters, b.actor_lora.scale, push_dtype)  # noqa: E731
    else:
        rollout_weights = lambda params: HFWeights(params, push_dtype)  # noqa: E731
    return StepContext(cfg, actor, b.critic, engine, prep.train_ds, prep.val_ds, prep.tokenizer, push_dtype,
                       reward_model=reward_model, reward_fn=custom_reward.from_config(cfg), budgets=budgets,
                       rollout_weights=rollout_weights,
                       flops={"actor": flops_model(b.actor_cfg, lora=b.actor_lora),
                              "critic": flops_model(b.critic_cfg or b.actor_cfg, False, b.critic_lora)})


class PPOTrainer:
    def __init__(self, cfg: Config, engine_factory: EngineFactory):
        self.cfg = cfg
        t = cfg.trainer
        mps.check_started(cfg)  # before JAX's backend starts here (the next line)
        self.main = jax.process_index() == 0  # writes the config, metrics and logs; every process checkpoints
        # the memory plan first, from abstract states (jaxppo/start.py): a run that cannot fit stops here
        prep = start.prepare(cfg)
        self.plan, self.mesh, self.sampler, self.total_steps = prep.plan, prep.mesh, prep.sampler, prep.total_steps
        try:
            self.run_dir = make_run_dir(cfg)
            # one process trains in a run directory (process 0 for all of a multi-process run): before anything in
            # it is read or written
            self._run_lock = lock_run_dir(self.run_dir) if self.main else None
            start.adopt(prep, self.run_dir)
        except BaseException:  # a directory refused or held by another run: nothing staged is left behind
            start.discard(prep)
            raise
        self.tokenizer, self.tokenizer_dir, self.train_ds = prep.tokenizer, prep.tokenizer_dir, prep.train_ds
        self.model_dir = prepare_model_dir(cfg, self.run_dir, self.tokenizer)
        b = prep.build
        self.model_cfg, self.actor_module = b.actor_cfg, b.actor.module
        self.eos_ids = tuple(sorted({self.tokenizer.eos_token_id}))
        self.engine_dtype = engine_dtype(cfg)
        self.use_critic = b.critic is not None
        self.warm_dir = self.run_dir / "warm_model"
        check_warm_model(self.warm_dir, self.model_cfg, self.model_dir)
        # before the rollout engine starts: vLLM checks at start that its share of the card is free (docs/memory.md)
        # late_compiles: each program compiled after the start (what differed, its bytes)
        self.plan, self.late_compiles = bind_plan(cfg, self.plan, [e for e in (b.actor, b.critic) if e is not None])
        engine = engine_factory(self.model_dir, self)
        if cfg.rollout.free_cache_engine:
            engine.sleep()
        if t.sft_warmup_steps > 0 and not (self.warm_dir / "config.json").is_file():
            # the warm start trains the whole model (no adapters); LoRA starts from its result
            self.actor_module, warm_params, _ = load_model(self.model_dir, **start.warm_kwargs(cfg, self.mesh))
            warm_params = sft_warm_start(self, warm_params)
            save_hf_checkpoint(warm_params, self.model_cfg, self.warm_dir)
            del warm_params
            self.actor_module = b.actor.module
        self.start_dir = self.warm_dir if (self.warm_dir / "config.json").is_file() else self.model_dir
        self.state = start.create_states(cfg, b, self.start_dir, t.seed)
        self.ctx = _step_context(cfg, prep, engine, self.plan.budgets, DTYPES[self.engine_dtype])
        reward_workers = resolve_workers(cfg.reward.num_workers)
        if reward_workers:  # spawned now: their imports overlap with the rest of setup
            reward_pool(reward_workers).start()
        self.health = HealthMonitor(t.health, single_update=single_update(cfg))
        self.step = 0
        self.bad_steps = 0  # consecutive steps with NaN/inf
        self.best_val: float | None = None
        self.vals_since_best = 0
        self.stop_reason: str | None = None  # why fit() ended early
        self.exit_code = 0
        self._signal: str | None = None
        self._profiling = False
        self.checkpointer = RunCheckpointer(self.run_dir / "checkpoints", t.max_to_keep)
        self._saved_step: int | None = None  # the step this process last checkpointed
        # the next batch generated while the step trains (jaxppo/ahead.py): one step ahead, or during the critic's
        # update; the batch in flight
        self.ahead = Ahead(self.ctx, lag=1) if t.async_rollout else \
            Ahead(self.ctx, lag=0) if t.rollout_during_critic_update else None
        self._redo_rows: np.ndarray | None = None  # a stored batch's rows to generate again (a staler batch)
        self._maybe_resume()
        if self.main:  # only once setup and resume succeeded: a failed start leaves the run's record as it was
            write_atomic(self.run_dir / "config.yaml", to_yaml(cfg))
            truncate_metrics(self.run_dir / "metrics.jsonl", self.step)
        self.peak_flops, peak_source = device_peak_flops()
        # what setup built (modules, the engine, datasets, states' Python objects) lives for the run: frozen out
        # of the collector's walks (as vLLM's engine does with its own), so a full collection during a step walks
        # only what the step allocates
        gc.collect()
        gc.freeze()
        self.gc_clock = gc_clock()
        log.info("run dir %s: %d train prompts, %d steps, %d sequences per step; MFU against %.4g TFLOP/s per device "
                 "(%s)", self.run_dir, len(self.train_ds), self.total_steps, cfg.data.train_batch_size * cfg.rollout.n,
                 self.peak_flops / 1e12, peak_source)

    # the step's engines and states, by their old names (tests, scripts)
    @property
    def actor(self) -> ActorEngine:
        return self.ctx.actor

    @property
    def critic(self) -> CriticEngine | None:
        return self.ctx.critic

    @property
    def engine(self) -> RolloutEngine:
        return self.ctx.engine

    @property
    def vllm_utilization(self) -> float:
        """What vLLM is started with (each engine, with rollout.engine_processes > 1): the plan's split (automatic: the
        card beside JAX's need), or the config's."""
        v = self.plan.vllm
        return v.engine_utilization if v is not None else (self.cfg.rollout.gpu_memory_utilization or 0.5)

    @property
    def val_ds(self):
        return self.ctx.val_ds

    @property
    def actor_state(self):
        return self.state.actor

    @property
    def critic_state(self):
        return self.state.critic

    @property
    def P(self) -> int:  # noqa: N802 - used by the warm start
        return self.cfg.data.max_prompt_length

    @property
    def R(self) -> int:  # noqa: N802
        return self.cfg.data.max_response_length

    # ------------------------------------------------------------------ checkpoints

    def _states(self) -> dict[str, Any]:
        states = {"actor": self.state.actor}
        if self.state.critic is not None:
            states["critic"] = self.state.critic
        return states

    def _meta(self) -> dict[str, Any]:
        return {"step": self.step, "kl_coef": float(self.state.kl_coef), "sampler": self.sampler.state(),
                "seed": self.cfg.trainer.seed, "health": self.health.state(), "bad_steps": self.bad_steps,
                "best_val": self.best_val, "vals_since_best": self.vals_since_best,
                "ahead": self.ahead.state() if self.ahead is not None else None}

    def save_checkpoint(self) -> None:
        """Checkpoint the current step (once: a stop right after a cadence save writes nothing more). A step on
        disk from before a resume is replaced (`RunCheckpointer.save`)."""
        if self._saved_step == self.step:
            return
        self.checkpointer.save(self.step, self._states(), self._meta())
        self._saved_step = self.step
        log.info("checkpoint saved: %s/%d", self.checkpointer.directory, self.step)

    def _maybe_resume(self) -> None:
        mode = self.cfg.trainer.resume_mode
        if mode == "disable":
            return
        try:
            if mode == "auto":
                found = self.checkpointer.restore_newest(self._states())
                if found is None:
                    return
                step, states, meta = found
            else:
                step, states, meta = restore_from(mode, self._states())
        except CheckpointError as e:  # the settings that changed since the run that wrote it, when they are known
            given = Path(mode).absolute()  # RUN/checkpoints/<step> or RUN/checkpoints
            ckpt_run = self.run_dir if mode == "auto" else (given.parent if given.name.isdigit() else given).parent
            changed = settings_changed(ckpt_run, self.cfg)
            if not changed:
                raise
            raise CheckpointError(f"{e} (the settings that changed since the run that wrote it, by its "
                                  f"{ckpt_run / 'config.yaml'}: {'; '.join(changed)})") from None
        self.state = PPOState(states["actor"], states.get("critic"), self.state.ref_params, float(meta["kl_coef"]))
        self.step = int(meta["step"])
        if mode == "auto" or self.checkpointer.directory in (Path(mode).absolute(), Path(mode).absolute().parent):
            self._saved_step = self.step  # the step is on disk in this run's checkpoints: not written again
        self.sampler.load_state(meta["sampler"])
        stored = meta.get("ahead")  # the batch that was in flight (None from a synchronous run's checkpoint)
        if stored is not None and (self.ahead is None or not self.ahead.accepts(stored)):
            # sampled by weights older than this run trains on: its rows are generated again with the checkpoint's
            self._redo_rows, stored = stored_rows(stored), None
            log.info("the checkpoint's batch in flight was sampled %d update(s) behind the weights it was to train; "
                     "this run trains on fresher batches, so it generates those prompts again",
                     stored_lag(meta["ahead"]))
        if self.ahead is not None:
            self.ahead.load_state(stored)
        if "health" in meta:
            self.health.load_state(meta["health"])
            self.bad_steps, self.vals_since_best = int(meta["bad_steps"]), int(meta["vals_since_best"])
            self.best_val = meta["best_val"]
        log.info("resumed from step %d%s", self.step, ", the next step's batch as it was in flight" if stored else "")

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
        """One PPO step (jaxppo/step.py). A stop signal during the phases before the updates abandons the step
        (nothing of it is kept: the sampler is rewound, the state it was building is dropped); once the
        updates begin the step completes. The health monitor's pre-update rules may skip the updates."""
        timer = Timer(torch_regions=self._profiling)
        sampler_start, redo_start = self.sampler.state(), self._redo_rows
        gc_s, gc_full = self.gc_clock.seconds, self.gc_clock.collections[2]
        try:
            with timer("step"):
                if self.ahead is not None:
                    state, exp = self._collect_ahead(timer)
                else:
                    state, exp = ppo_step.collect(self.ctx, self.state, self._next_rows(), self.step, timer,
                                                  self._interrupt_point, draw=self.sampler.next_batch)
                found = self.health.decide(exp.metrics, "pre")
                skip = any(f.action in ("skip_update", "stop") for f in found)
                if self.ahead is None:
                    self._interrupt_point()
                update_metrics: dict[str, float] = {}
                launch = self._launch_beside_critic(timer)
                if not skip:
                    state, update_metrics = ppo_step.update(self.ctx, state, exp, self.step, timer, after_actor=launch)
                elif launch is not None:
                    launch(state)
        except _Abandoned:
            self.sampler.load_state(sampler_start)
            self._redo_rows = redo_start
            raise
        self.state = state
        self.step += 1
        metrics = dict(update_metrics, **timer.times, **exp.metrics)
        metrics["training/epoch"] = float(self.sampler.state()["epoch"])
        metrics.update(ppo_step.perf_metrics(self.ctx, timer.times, exp, self.peak_flops))
        metrics["health/skipped_steps"] = float(skip)
        metrics["perf/gc_s"] = self.gc_clock.seconds - gc_s
        metrics["perf/gc_full_collections"] = float(self.gc_clock.collections[2] - gc_full)
        return metrics

    def _next_rows(self) -> np.ndarray:
        """The next step's prompts: a stored batch's to generate again after a resume, else the sampler's."""
        rows, self._redo_rows = self._redo_rows, None
        return self.sampler.next_batch() if rows is None else rows

    def _collect_ahead(self, timer: Timer):
        """The batch in flight (jaxppo/ahead.py): this step's batch, sampled during the previous step (or now, on
        the first); one step ahead, the next step's is launched with the current weights before this one trains. A
        stop signal ends the run at the step's end: the next batch is already being generated (or this one was),
        and the checkpoint stores it."""
        ahead = self.ahead
        if not ahead.in_flight:
            ahead.launch(self.state, self._next_rows(), self.step, timer)
        batch, waited = ahead.take(self.step)
        timer.times.update(batch.times)  # the generation's own phases (gen, reward), run in the background
        timer.times["timing_s/gen_wait"] = waited
        if ahead.lag == 1 and self.step + 1 < self.total_steps:
            ahead.launch(self.state, self.sampler.next_batch(), self.step + 1, timer)
        return ppo_step.collect(self.ctx, self.state, None, self.step, timer, sampled=(batch.sampled, batch.metrics))

    def _launch_beside_critic(self, timer: Timer):
        """During the critic's update (`trainer.rollout_during_critic_update`): what launches the next step's batch
        with the updated actor's weights, called between the two updates; None otherwise (and after the last
        step)."""
        if self.ahead is None or self.ahead.lag != 0 or self.step + 1 >= self.total_steps:
            return None
        return lambda state: self.ahead.launch(state, self.sampler.next_batch(), self.step + 1, timer)

    @property
    def memory_estimate(self):
        """The memory plan (jaxppo/plan.py), by its older name (scripts)."""
        return self.plan

    def held_memory(self) -> dict[str, int]:
        """Bytes the run's states hold on the first local device, by component (the measured side of the memory
        plan's fixed components; activations and gradients come and go inside the jitted steps)."""
        from jaxppo.offload import host_bytes

        s, ctx = self.state, self.ctx
        out = {}
        for name, sub, engine in (("actor", s.actor, ctx.actor), ("critic", s.critic, ctx.critic)):
            if sub is None:
                continue
            out[f"{name} (trained params + AdamW)"] = memory.held_bytes((sub.params, sub.opt_state))
            if engine.frozen is not None:
                out[f"{name} base (frozen)"] = memory.held_bytes(engine.frozen)
            on_host = host_bytes(sub.opt_state)  # offloaded (jaxppo/offload.py): in this host's memory, not the card's
            if on_host:
                out[f"{name} AdamW moments (host memory)"] = on_host
        if s.ref_params:  # under LoRA {}: the base, nothing held
            out["reference"] = memory.held_bytes(s.ref_params)
        return out

    def sync_weights(self) -> None:
        """Push the actor's current weights into the (awake) rollout engine."""
        self.engine.update_weights(self.ctx.rollout_weights(self.state.actor.params))

    def validate(self) -> dict[str, float]:
        return validation.validate(self.ctx, self.state.actor.params)

    # ------------------------------------------------------------------ lifecycle

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
    def profiled(self, step: int):
        """A profiler trace of step `step` when it is in trainer.profile_steps: JAX's (TensorBoard / Perfetto) and
        torch's (the rollout engine; on a GPU every kernel of the process) as trainer.profile_tools names, torch's
        only when torch is loaded, both with the same region names; `python`: cProfile of the step's thread
        (the host's side: which functions, the engine's among them, the time went to). vLLM engines in helper
        processes profile each generation they run for the step with the same tools (`engine<j>_call<n>/`)."""
        t = self.cfg.trainer
        if step not in t.profile_steps:
            yield
            return
        out = Path(t.profile_dir or self.run_dir / "profile") / f"step_{step}"
        self._profiling = True
        try:
            with profiled_step(out, t.profile_tools, getattr(self.ctx.engine, "profile_calls", None)):
                yield
        finally:
            self._profiling = False
            log.info("profile of step %d written to %s (tensorboard --logdir %s, or the *.trace.json.gz / "
                     "torch_trace.json in https://ui.perfetto.dev; scripts/trace_summary.py %s)", step, out, out, out)

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

    def close(self) -> None:
        """Gives back what the trainer holds of the process: the objects that setup froze out of the garbage
        collector go back to it (`gc.unfreeze()`, as vLLM's engine does at shutdown), so that a later trainer
        in the same process (tests, notebooks, sweeps) does not keep this one's cyclic garbage for good."""
        if self.ahead is not None:
            self.ahead.close()
        close_engine = getattr(self.ctx.engine, "close", None)  # an engine with processes of its own ends them
        if close_engine is not None:
            close_engine()
        if self._run_lock is not None:  # the run directory is free for the next run
            self._run_lock.close()
            self._run_lock = None
        gc.unfreeze()

    def __enter__(self) -> "PPOTrainer":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def fit(self) -> dict[str, float]:
        """Steps until done, early stop, a health stop, too many bad steps or a stop signal; sets
        `stop_reason` and `exit_code` (0; 3 when the run's health ended it)."""
        t = self.cfg.trainer
        logger = MetricsLogger(self.run_dir, list(t.logger) if self.main else [], total_steps=self.total_steps,
                               start_step=self.step, project=t.project_name, name=t.experiment_name,
                               config=config_dict(self.cfg))
        last: dict[str, float] = {}
        try:
            with self._stop_signals():
                if t.val_before_train and self.step == 0:
                    last = self.validate()
                    self._early_stop(last)
                    logger.log(0, last)
                while self.step < self.total_steps and not self._stop_requested():
                    try:
                        with self.profiled(self.step + 1):
                            metrics = self.train_step()
                    except _Abandoned:
                        break
                    last = self._after_step(metrics, logger)
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

    def _after_step(self, metrics: dict[str, float], logger: MetricsLogger) -> dict[str, float]:
        """Health report, validation cadence, early stop, logging, checkpoint cadence of one finished step."""
        t = self.cfg.trainer
        found = self.health.report(metrics)
        bad = any(f.rule == "nonfinite" for f in found) or metrics.get("actor/nonfinite_updates", 0) \
            or metrics.get("critic/nonfinite_updates", 0)
        self.bad_steps = self.bad_steps + 1 if bad else 0
        metrics["health/bad_steps"] = float(self.bad_steps)
        done = self.step >= self.total_steps
        stop = [f for f in found if f.action == "stop"]
        if t.test_freq > 0 and (self.step % t.test_freq == 0 or done) and not self._stop_requested():
            if self.ahead is not None:
                self.ahead.wait()  # the engine generates one batch at a time: the one in flight first
            val = self.validate()
            metrics.update(val)
            if self._early_stop(val):
                self.stop_reason = (f"early stop: {t.early_stop_metric} did not improve on "
                                    f"{self.best_val:.4f} in {t.early_stop_patience} validations")
        logger.log(self.step, metrics)
        if self.bad_steps >= t.max_bad_steps:
            good = self.checkpointer.latest_step()
            self.stop_reason = (f"{self.bad_steps} consecutive steps with NaN/inf (trainer.max_bad_steps)"
                                f"; no checkpoint written, the last good one is step {good}")
            self.exit_code = 3
            return metrics
        if stop:
            self.stop_reason = "health: " + ", ".join(f"{f.metric} = {f.value:.4g} ({f.rule})" for f in stop)
            self.exit_code = 3
        if (t.save_freq > 0 and self.step % t.save_freq == 0) or done or self.stop_reason:
            self.save_checkpoint()
        return metrics


__all__ = ["PPOTrainer"]
