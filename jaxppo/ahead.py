"""The next step's batch generated while this step trains, in two ways: rollouts one step ahead
(`trainer.async_rollout`; verl's one-step-off-policy recipe, here on the same GPU) and the rollout during the critic's
update (`trainer.rollout_during_critic_update`, on-policy).

The synchronous step generates its batch with the weights it then trains. One step ahead (lag 1), the rollout engine
stays awake and generates step k+1's batch in a background thread, with the weights of step k pushed just before,
while the trainer scores step k's batch, runs its forward passes and updates; step k+1 then takes that batch (waiting
for what is left of its generation) and launches step k+2's. Each batch is one update behind the weights that train on
it: the engine's log-probs are the behaviour policy's, corrected by `algorithm.rollout_correction` (bypass mode when
the config sets none, token-level truncated importance weights for a policy loss that is not PPO's:
jaxppo/config/loading.py).

    step k:   take batch k (sampled by theta_{k-1})  ->  push theta_k, launch batch k+1  ->  forward passes, update
              on batch k -> theta_{k+1}

During the critic's update (lag 0), the actor updates first and its new weights sample the next batch while the
critic updates (`jaxppo.step.update`'s `after_actor`): the two updates read the same batch and not each other's
results, so this is the synchronous step exactly, with the critic's update overlapped with the next generation.

    step k:   take batch k (sampled by theta_k)  ->  forward passes, actor update -> theta_{k+1}  ->  push theta_{k+1},
              launch batch k+1  ->  critic update on batch k

The engine computes on its own copy of the pushed weights one step ahead (vLLM: its parameters; the transformers
engine is told to copy, since the update donates the buffers its views would alias; during the critic's update
nothing donates the actor's buffers before the batch is taken, so views serve). A checkpoint waits for the batch in
flight and stores it (`state()` / `load_state()`: the batch, its rows and metrics, its lag), so a stopped run resumes
exactly where it stopped: the first step after a resume takes the stored batch instead of generating another. A
batch staler than the resuming run trains on (one step ahead's, resumed synchronously or during the critic's
update) is generated again, from its rows, with the checkpoint's weights (`stored_rows`).
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import time
from typing import Any

import numpy as np

from jaxppo.rollout import Rollouts, Sampled
from jaxppo.step import PPOState, StepContext, Timer, push_weights, sample


@dataclasses.dataclass
class Batch:
    """A batch sampled ahead: for which step, its samples and `batch/*` metrics, its phases' timings."""

    step: int
    sampled: Sampled
    metrics: dict[str, float]
    times: dict[str, float]


class Ahead:
    """The batch in flight (at most one) and the thread that generates it; `lag`: the updates between the weights
    that sample a batch and those that train on it (1 one step ahead, 0 during the critic's update)."""

    def __init__(self, ctx: StepContext, lag: int):
        self.ctx = ctx
        self.lag = lag
        self._pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="jaxppo-rollout-ahead")
        self._pending: concurrent.futures.Future | None = None
        self._ready: Batch | None = None  # a batch restored from a checkpoint, or waited for
        if lag and hasattr(ctx.engine, "copy_weights"):  # the transformers engine: its views would alias donated
            ctx.engine.copy_weights = True  # buffers (the update that runs beside the generation donates them)

    @property
    def in_flight(self) -> bool:
        return self._pending is not None or self._ready is not None

    def launch(self, state: PPOState, rows: np.ndarray, step: int, timer: Timer) -> None:
        """Push the actor's current weights into the (woken) engine (timed in `timer`, this thread's), then generate
        and score `rows` as step `step`'s batch in the background."""
        assert not self.in_flight, "one batch in flight at a time"
        push_weights(self.ctx, state.actor.params, timer)
        self._pending = self._pool.submit(self._sample, rows, step)

    def _sample(self, rows: np.ndarray, step: int) -> Batch:
        timer = Timer()
        sampled, metrics = sample(self.ctx, None, rows, step, timer, push=False)
        return Batch(step, sampled, metrics, timer.times)

    def wait(self) -> None:
        """Until the batch in flight is generated (it stays the next one to take); the engine is then free."""
        if self._pending is not None:
            self._ready, self._pending = self._pending.result(), None

    def take(self, step: int) -> tuple[Batch, float]:
        """The batch in flight for `step` and the seconds this thread waited for it."""
        t0 = time.perf_counter()
        self.wait()
        batch, self._ready = self._ready, None
        if batch is None or batch.step != step:
            raise RuntimeError(f"rollouts ahead: the batch in flight is for step {batch and batch.step}, not {step}")
        return batch, time.perf_counter() - t0

    def state(self) -> dict[str, Any] | None:
        """The batch in flight (waited for), as JSON for a checkpoint; None when there is none."""
        self.wait()
        b = self._ready
        if b is None:
            return None
        s, ro = b.sampled, b.sampled.rollouts
        return {"step": b.step, "rows": _enc(s.rows), "prompts": [_enc(p) for p in s.prompts],
                "response_ids": _enc(ro.response_ids), "response_mask": _enc(ro.response_mask),
                "logprobs": _enc(ro.logprobs), "finish_reasons": list(ro.finish_reasons),
                "prompt_index": _enc(ro.prompt_index), "scores": _enc(s.scores),
                "counts": {k: _enc(v) if isinstance(v, np.ndarray) else float(v) for k, v in s.counts.items()},
                "metrics": b.metrics, "times": b.times, "lag": self.lag}

    def accepts(self, state: dict[str, Any]) -> bool:
        """Whether a stored batch is as fresh as this run trains on (a lag-0 batch serves one step ahead too)."""
        return stored_lag(state) <= self.lag

    def load_state(self, state: dict[str, Any] | None) -> None:
        """Restore the batch a checkpoint stored as in flight (None: nothing was)."""
        self.wait()
        self._ready = None
        if state is None:
            return
        assert self.accepts(state), "a batch staler than this run trains on is generated again (stored_rows)"
        ro = Rollouts(_dec(state["response_ids"]), _dec(state["response_mask"]), _dec(state["logprobs"]),
                      list(state["finish_reasons"]), _dec(state["prompt_index"]))
        counts = {k: _dec(v) if isinstance(v, dict) else float(v) for k, v in state["counts"].items()}
        sampled = Sampled(_dec(state["rows"]), [_dec(p) for p in state["prompts"]], ro, _dec(state["scores"]), counts)
        self._ready = Batch(int(state["step"]), sampled, dict(state["metrics"]), dict(state["times"]))

    def close(self) -> None:
        self.wait()
        self._pool.shutdown()


def stored_lag(state: dict[str, Any]) -> int:
    """The lag of a stored batch (checkpoints from before the key were one step ahead's)."""
    return int(state.get("lag", 1))


def stored_rows(state: dict[str, Any]) -> np.ndarray:
    """The dataset rows of a stored batch: what to generate anew when the batch itself cannot be trained on."""
    return _dec(state["rows"])


def _enc(a: np.ndarray) -> dict[str, Any]:
    """An array as JSON, exactly (floats through Python's float, which holds every float32 / float64 value)."""
    a = np.asarray(a)
    return {"dtype": a.dtype.str, "shape": list(a.shape), "data": a.ravel().tolist()}


def _dec(d: dict[str, Any]) -> np.ndarray:
    return np.asarray(d["data"], dtype=np.dtype(d["dtype"])).reshape(d["shape"])


__all__ = ["Ahead", "Batch", "stored_lag", "stored_rows"]
