"""What the memory plan compiles for, and how it searches: the worst-case batches of a run's data (padded, or
packed at a token budget) as abstract arrays in the engine's shardings, and the search over the ladder of token
budgets (`jaxppo/plan.py` uses both)."""

from __future__ import annotations

from typing import Any, Callable

import jax
import numpy as np

from jaxppo import memory
from jaxppo.sharding import batch_sharding

LADDER_STEP = 1024  # token budgets are multiples of this
# the most rungs one search compiles at once: over the test curves a width of 3 takes 2.1 rounds on average (1: 4.5,
# 2: 2.6) and wider ones barely fewer (8: 2.0) for nearly twice the compiles (10.7 against 6.0), which on a GPU host
# compete for its cores (the 7B LoRA config's planning child took 4.5 min at up to 8 rungs a round at 9be2f87; at
# 6897c20, at 2 a round, about 2.5 min by its log's timestamps, at another budget)
MAX_SEARCH_WIDTH = 3
AUTO_MAX_BUDGET = memory.AUTO_MAX_BUDGET


def _fake_batch(rows: int, prompt_len: int, response_len: int, prompt_tokens: int) -> dict[str, np.ndarray]:
    """A padded host batch in the engine's layout whose every sequence has `prompt_tokens` prompt tokens and a
    full-length response (the most response tokens per packed row when prompt_tokens is 1)."""
    t = prompt_len + response_len
    mask = np.zeros((rows, t), np.int32)
    mask[:, prompt_len - prompt_tokens:] = 1
    return {"input_ids": np.zeros((rows, t), np.int32), "attention_mask": mask,
            "positions": np.maximum(np.cumsum(mask, 1) - 1, 0).astype(np.int32),
            "response_mask": np.ones((rows, response_len), np.float32)}


def _with_keys(batch: dict[str, np.ndarray], keys: tuple[str, ...], response_len: int) -> dict[str, np.ndarray]:
    rows = batch["input_ids"].shape[0]
    return dict(batch, **{k: np.zeros((rows, response_len), np.float32) for k in keys})


def _abstract_padded(engine: Any, batch: dict[str, np.ndarray]) -> dict[str, jax.ShapeDtypeStruct]:
    """What `engine.shard_batch` makes of this process's host batch, as ShapeDtypeStructs."""
    out = {}
    for k, v in batch.items():
        shape = (v.shape[0] * jax.process_count(),) + v.shape[1:]
        out[k] = jax.ShapeDtypeStruct(shape, v.dtype, sharding=batch_sharding(engine.mesh, v.ndim, 0))
    return out


def row_allowance(row_len: int, shortest_prompt: int, response_len: int, seqs: int) -> tuple[int, int]:
    """(response-token slots, sequences) a packed row of `row_len` tokens can hold at the data's shortest prompt:
    the slots of full-length responses (and what the rest of the row holds of one more, shorter, response), the
    sequences of half-length ones; at most `seqs` of either."""
    R = response_len
    full = row_len // (shortest_prompt + R)
    rest = min(max(row_len - full * (shortest_prompt + R) - shortest_prompt, 0), R)
    slots = min(seqs * R, full * R + rest)
    runs = min(seqs, row_len // (shortest_prompt + max(R // 2, 1)))
    return max(slots, 1), max(runs, 1)


def window_allowance(window_len: int, shortest_prompt: int, seqs: int) -> int:
    """Runs that can start in one attention window of `window_len` columns (`jaxppo.packing.attention_windows`):
    the sequences, each at least the data's shortest prompt long (so one start per that many columns at most, and
    at most `seqs`), and a piece of the unused tail. Whatever the responses' lengths, no window holds more: a row of
    several windows caps none of its sequences (`jaxppo.packing._row_caps`)."""
    return min(seqs, (window_len - 1) // max(shortest_prompt, 1) + 1) + 1


def _abstract_packed(engine: Any, batch: dict[str, np.ndarray], budget: int, what: str, shortest_prompt: int
                     ) -> tuple[dict[str, jax.ShapeDtypeStruct], tuple[int, int, int, int]]:
    """What `engine.shard_packed(engine.pack(...))` makes of the worst case at `budget`, and its packed shape key
    (`jaxppo.packing.Packed.shape_key`): `batch` holds every sequence at the longest prompt and a full response
    (the most tokens: the longest rows, the most micro-batches); each row of the length that batch packs into gets
    as many response-token slots and sequences (runs) as a row of that length can hold at the shortest prompt
    (`row_allowance`). The run packs within this shape (`jaxppo.packing.Caps`, row length included): a batch of
    full-length responses at the data's prompts packs into it exactly (no program compiled after the start), and
    shorter responses than half-length get more rows, not more runs per row. The allowance is the row's, not the
    budget's: a worst case that packs into rows shorter than the budget (fewer tokens computed) holds fewer. A row
    of several attention windows (the engine's `attention_window`) gets each window's most runs instead
    (`window_allowance`)."""
    from jaxppo.packing import bucket, pack

    local = engine.batch_shards // jax.process_count()
    R = engine.response_length
    seqs = -(-batch["input_ids"].shape[0] // local)
    window = getattr(engine, "attention_window", None)
    first = pack(batch, R, budget, local, what, window=window)
    row_len, windows = first.shape_key[2], first.arrays["segment_starts"].shape[2]
    slots, runs = row_allowance(row_len, shortest_prompt, R, seqs)
    runs = runs + 1 if windows == 1 else window_allowance(row_len // windows, shortest_prompt, seqs)
    packed = pack(batch, R, budget, local, what, min_slots=bucket(slots), min_runs=bucket(runs), window=window)
    out = {}
    for k, v in packed.arrays.items():
        shape = (v.shape[0], v.shape[1] * jax.process_count()) + v.shape[2:]
        out[k] = jax.ShapeDtypeStruct(shape, v.dtype, sharding=batch_sharding(engine.mesh, v.ndim, 1))
    return out, packed.shape_key


# ------------------------------------------------------------------ the budget search


def ladder(seq_len: int, top: int = AUTO_MAX_BUDGET) -> list[int]:
    low = -(-seq_len // LADDER_STEP) * LADDER_STEP
    return list(range(low, max(top, low) + 1, LADDER_STEP))


def plan_threads() -> int:
    """Programs compiled at once by the plan (XLA compiles outside the GIL): `JAXPPO_PLAN_THREADS`, else half the
    host's CPUs up to 8 (a GPU compile is mostly one thread; a CPU compile already uses several)."""
    import os

    n = os.environ.get("JAXPPO_PLAN_THREADS")
    return max(1, int(n) if n else min(8, (os.cpu_count() or 2) // 2))


def search_budget(cost: Callable[[int], int], avail: int | None, rungs: list[int], seed: int,
                  width: int | Callable[[], int] = 1) -> tuple[int | None, int, int]:
    """The largest rung whose `cost` (compiling its program) is <= `avail`, how many rungs were compiled and in how
    many rounds; None
    when even the smallest does not fit. `seed` (the fitted constants' guess) is compiled first, then the ladder's
    end on the other side of `avail`; a curve through the bytes seen so far (a line, then a quadratic: attention
    that materialises its scores grows with the square of the row) predicts the rung, which is compiled to verify;
    a prediction that misses twice on one side gives way to bisection. `width` > 1: each round compiles up to
    `width` rungs at once in threads (the seed with both ends of the ladder; the prediction with its neighbours),
    for fewer rounds of compile time at the price of more compiles; the answer is the same. A callable `width` is
    asked at each round (the threads a search may use grow as the other phases' searches end)."""
    costs: dict[int, int] = {}
    rounds = [0]
    wide = width if callable(width) else (lambda n=width: n)

    def at(*bs: int) -> list[int]:
        todo = [b for b in dict.fromkeys(bs) if b not in costs]
        rounds[0] += bool(todo)
        if len(todo) > 1:
            from concurrent.futures import ThreadPoolExecutor

            with ThreadPoolExecutor(len(todo), thread_name_prefix="jaxppo-plan") as ex:
                costs.update(zip(todo, ex.map(cost, todo)))
        else:
            costs.update((b, cost(b)) for b in todo)
        return [costs[b] for b in bs]

    if avail is None:
        at(seed)
        return seed, len(costs), rounds[0]
    seed = min(rungs, key=lambda r: abs(r - seed))
    w = wide()
    if w >= 3:
        at(seed, rungs[-1], rungs[0])
    elif w == 2:
        at(seed, rungs[-1])
    lo, hi = (seed, rungs[-1]) if at(seed)[0] <= avail else (rungs[0], seed)
    if at(lo)[0] > avail:
        return None, len(costs), rounds[0]
    if at(hi)[0] <= avail:
        return hi, len(costs), rounds[0]
    moved = ""
    for _ in range(10):  # lo fits, hi does not; the rungs between them are untried
        inside = [r for r in rungs if lo < r < hi]
        if not inside:
            return lo, len(costs), rounds[0]
        w = wide()
        if len(inside) <= w:
            picks = inside
        else:
            if moved.endswith(("lolo", "hihi")):
                pick = inside[len(inside) // 2]
            else:
                xs = np.array(sorted(costs), float)
                fit = np.polyfit(xs, [costs[int(x)] for x in xs], min(2, len(xs) - 1))
                pred = np.polyval(fit, np.array(inside, float))
                pick = max([r for r, c in zip(inside, pred) if c <= avail], default=inside[0])
            i = inside.index(pick)  # the prediction and the rungs nearest it, up to `width`
            near = sorted(range(len(inside)), key=lambda j: (abs(j - i), j < i))[:w]
            picks = [inside[j] for j in sorted(near)]
        at(*picks)
        fits = [r for r in picks if costs[r] <= avail]
        over = [r for r in picks if costs[r] > avail]
        if fits:
            lo, moved = max(fits), moved + "lo"
        if over:
            hi, moved = min([r for r in over if r > lo], default=hi), moved + "hi"
    return lo, len(costs), rounds[0]


__all__ = ["ladder", "search_budget", "plan_threads", "LADDER_STEP", "AUTO_MAX_BUDGET", "MAX_SEARCH_WIDTH"]
