"""The memory plan from the compiled programs (docs/memory.md).

Before any state is allocated or the rollout engine starts, each program of the step is compiled for the run's
real shapes and shardings from abstract arguments (the actor's and critic's updates, the log-prob, reference and
value forward passes, a reward model's scoring), and XLA's own account of it (`compiled.memory_analysis()`:
arguments, outputs, aliases, temporaries) decides:

  budgets   each packed phase's token budget: the largest on a ladder (multiples of 1024 from one sequence up to
            AUTO_MAX_BUDGET) whose program, beside the states that live for the whole run, fits JAX's share with
            `trainer.memory_margin_gb` to spare. The fitted constants of `jaxppo.memory` only seed the search:
            two compiles give a line through the program's bytes, the rung it predicts is compiled to verify.
            A user's budget (> 0) is compiled and checked, never changed. Padded phases have one shape.
  split     with in-process vLLM, `rollout.gpu_memory_utilization` 0 (automatic): JAX gets its planned peak plus
            the margin, vLLM the rest of the card (less MARGIN for CUDA contexts); an explicit value wins and is
            checked. The budgets are searched beside room for vLLM to hold the whole batch at once; a program
            that does not fit there even at the smallest budget is searched again beside vLLM running the batch
            in waves, half as many sequences at a time each try, down to what vLLM needs to run at all (its
            weights, graphs and activations, the KV cache of one max-length sequence). The plan says how many
            sequences its cache holds at once (the rest run in waves).

The executables compiled here are the ones the run calls (`jaxppo.programs.Program`): padded phases compile
exactly once per start. A run that cannot fit at any budget raises ConfigError (exit 2) before vLLM starts,
saying what to change.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import threading
import time
from typing import Any, Callable

import jax

from jaxppo import memory
from jaxppo.errors import ConfigError
from jaxppo.host_plan import HostPlan, plan_host
from jaxppo.plan_search import (_abstract_packed, _abstract_padded, _fake_batch, _with_keys, ladder,
                                MAX_SEARCH_WIDTH, plan_threads, search_budget)
from jaxppo.programs import Memory, device_bytes

log = logging.getLogger(__name__)
GiB = 2**30
VLLM_OVERHEAD = 2 * GiB  # vLLM beside weights and KV cache: CUDA graphs, the profile run's activations, sampler
VLLM_MAX_SEQS = 1024  # sequences vLLM schedules at once at most (its default max_num_seqs on large GPUs)
ENGINE_CONTEXT = GiB // 2  # a helper engine process's CUDA context and workspaces (bridge/engines/vllm_processes.py)


def vllm_max_seqs(cfg: Any) -> int:
    """The most sequences vLLM runs at once: rollout.max_num_seqs, else vLLM's default on a large GPU."""
    return cfg.rollout.max_num_seqs or VLLM_MAX_SEQS


@dataclasses.dataclass(frozen=True)
class Phase:
    """One program of the step as planned, bytes per device."""

    name: str
    budget_key: str | None  # the config key of its token budget (packed), None for padded micro-batches
    budget: int | None
    memory: Memory
    program: int  # what it adds beside the resident states while it runs (Memory.beside)
    compiles: int  # budgets compiled to choose it (probes, and the one kept)
    shape: tuple[int, int, int, int] | None = None  # packed: the (micro-batches, slots, row length, runs) compiled
    rounds: int = 0  # rounds of compiles at once the budget search took (0: none, a given budget)
    seconds: float = 0.0  # the budget search's wall time (the start's planning time, phase by phase)


@dataclasses.dataclass(frozen=True)
class VllmShare:
    bytes: int  # vLLM's share of the card
    weights: int
    kv_per_sequence: int  # KV cache of one max-length sequence
    sequences: int  # max-length sequences its KV cache holds at once
    generation_sequences: int  # sequences one generation call asks for: the step's, or a dynamic-sampling round's
    utilization: float  # what vLLM is started with (its share as a fraction of the card)
    round: bool = False  # generation_sequences is a round of dynamic sampling (algorithm.filter_groups)
    max_seqs: int = VLLM_MAX_SEQS  # what vLLM's schedulers run at once at most (rollout.max_num_seqs each)
    engines: int = 1  # vLLM engines, each in its own process (rollout.engine_processes)
    in_trainer: bool = True  # the first engine is the trainer's own (rollout.engine_in_trainer)

    @property
    def helpers(self) -> int:
        """Engines in processes of their own, each with its own CUDA context."""
        return self.engines - self.in_trainer

    @property
    def fixed(self) -> int:
        """What vLLM's share holds beside its KV caches and one engine's graphs and activations."""
        return vllm_fixed(self.weights, self.engines, self.in_trainer)

    @property
    def minimum(self) -> int:
        return self.fixed + VLLM_OVERHEAD + self.kv_per_sequence * self.engines

    @property
    def engine_utilization(self) -> float:
        """What each engine is started with: the share, less the shared copy of the pushed weights and the helper
        engines' CUDA contexts, split evenly (one engine in the trainer: the share)."""
        if self.helpers == 0:
            return self.utilization
        each = (self.bytes - self.weights - self.helpers * ENGINE_CONTEXT) / self.engines
        return self.utilization * max(each, 0) / max(self.bytes, 1)


@dataclasses.dataclass
class Plan:
    states: dict[str, int]  # what lives for the whole run, per device
    phases: list[Phase]
    margin: int
    card: int | None  # the device's memory (None: unknown: nothing is checked)
    jax_limit: int | None  # JAX's share
    vllm: VllmShare | None
    budgets: memory.TokenBudgets
    # each phase group's chosen programs compiled as the run compiles them, (name, memory, resident argument
    # bytes) each: what `finalize` runs once JAX holds its share (autotuning allocates from it)
    finals: list[Callable[[], list[tuple[str, Memory, int]]]] = dataclasses.field(default_factory=list, repr=False)
    host_plan: HostPlan | None = None  # offloaded states, in this host's RAM (jaxppo/host_plan.py)

    @property
    def host(self) -> dict[str, int]:
        """The offloaded states, bytes on this host by component (empty: nothing offloaded)."""
        return self.host_plan.states if self.host_plan else {}

    @property
    def resident(self) -> int:
        return sum(self.states.values())

    @property
    def peak_phase(self) -> Phase:
        return max(self.phases, key=lambda p: p.program)

    @property
    def peak(self) -> int:
        """JAX's planned peak per device: the states and the largest program beside them."""
        return self.resident + (self.peak_phase.program if self.phases else 0)

    @property
    def need(self) -> int:
        return self.peak + self.margin

    def packed_shapes(self) -> dict[str, tuple[int, int, int, int]]:
        """Each packed budget key's compiled (micro-batches, slots, row length, runs): the most a run's rows hold."""
        return {p.budget_key: p.shape for p in self.phases if p.budget_key and p.shape}

    @property
    def fits(self) -> bool:
        return self.jax_limit is None or self.need <= self.jax_limit

    def summary(self) -> dict[str, Any]:
        """The plan as plain numbers (bytes per device): what a training process takes from the child that planned
        for it, and what scripts record."""
        return {"need": self.need, "peak": self.peak, "margin": self.margin, "card": self.card,
                "jax_limit": self.jax_limit, "states": dict(self.states), "budgets": dataclasses.asdict(self.budgets),
                "phases": {p.name: {"budget": p.budget, "program": p.program, "temps": p.memory.temps,
                                    "compiles": p.compiles, "rounds": p.rounds, "search_s": round(p.seconds, 1)}
                           for p in self.phases},
                "vllm": None if self.vllm is None else dataclasses.asdict(self.vllm), "host": dict(self.host),
                "host_peak": self.host_plan.peak if self.host_plan else 0,
                "table": self.table()}

    def table(self) -> str:
        gb = lambda b: f"{b / GiB:8.2f} GiB" if b >= GiB else f"{b / 2**20:8.1f} MiB"  # noqa: E731
        lines = ["memory plan per device (XLA's compiled programs):", "  resident states:"]
        lines += [f"    {k:<40}{gb(v)}" for k, v in self.states.items()]
        lines.append(f"    {'total':<40}{gb(self.resident)}")
        lines.append("  phases (program: batch, temporaries and outputs beside the states):")
        for p in self.phases:
            budget = f"budget {p.budget:>6}" if p.budget else "padded      "
            lines.append(f"    {p.name:<20}{budget}  program {gb(p.program)}  states + program "
                         f"{gb(self.resident + p.program)}  ({p.compiles} compiled"
                         + (f" in {p.rounds} round{'s' * (p.rounds > 1)}, {p.seconds:.0f} s" if p.rounds else "")
                         + ")")
        lines.append(f"  {'peak (' + self.peak_phase.name + ')' if self.phases else 'peak':<42}{gb(self.peak)}  "
                     f"+ margin {self.margin / GiB:.1f} GiB = {gb(self.need)}")
        if self.jax_limit is not None:
            lines.append(f"  {'JAX limit':<42}{gb(self.jax_limit)}  of a {self.card / GiB:.1f} GiB card")
        if self.host:
            lines += self.host_plan.lines()
        if self.vllm is not None:
            v = self.vllm
            waves = -(-v.generation_sequences // max(min(v.sequences, v.max_seqs), 1))
            capped = f" (vLLM's max_num_seqs: {v.max_seqs} at most)" if v.max_seqs < v.sequences else ""
            engines = "weights " if v.helpers == 0 else (
                f"{v.engines} engine process{'es' if v.engines > 1 else ''} at {v.engine_utilization:.3f} each"
                f"{'' if v.in_trainer else ', none in the trainer'}; weights x {v.engines}, their shared copy, the "
                "other engines' graphs, the helpers' contexts ")
            lines.append(f"  {'vLLM share':<42}{gb(v.bytes)}  (gpu_memory_utilization {v.utilization:.3f}: {engines}"
                         f"{v.fixed / GiB:.1f} GiB + ~{VLLM_OVERHEAD / GiB:.0f} GiB graphs / activations + KV cache "
                         f"for {v.sequences} max-length sequences at once{capped}; "
                         f"{'a generation round' if v.round else 'the step'}'s {v.generation_sequences} run in "
                         f"{waves} wave{'s' if waves > 1 else ''})")
        return "\n".join(lines)


# ------------------------------------------------------------------ the plan


def vllm_fixed(weights: int, engines: int, in_trainer: bool = True) -> int:
    """vLLM's bytes beside its KV caches and one engine's graphs and activations (VLLM_OVERHEAD): its weights; with
    helper engine processes (several engines, or one not in the trainer's process) each engine's weights, the shared
    copy the helpers load pushed weights from, each further engine's graphs and activations and each helper's CUDA
    context."""
    helpers = engines - in_trainer
    if helpers == 0:
        return weights
    return engines * weights + weights + (engines - 1) * VLLM_OVERHEAD + helpers * ENGINE_CONTEXT


def vllm_sizes(cfg: Any, model: Any) -> tuple[int, int]:
    """(weights, KV cache of one max-length sequence) of the rollout engine, in the compute dtype."""
    s = memory.DTYPE_BYTES[cfg.model.dtype]
    kv_per_token = 2 * model.num_hidden_layers * model.num_key_value_heads * model.head_dim * s
    seq = cfg.data.max_prompt_length + cfg.data.max_response_length
    return int(model.num_params() * s), int(kv_per_token * seq)


def _limits(cfg: Any, card: int | None, states: dict[str, int], margin: int, weights: int, kv_seq: int,
            gen_seqs: int, shards: int) -> tuple[int | None, list[int | None]]:
    """(JAX's share when fixed: an explicit split, or no vLLM; the room beside the states that a packed phase's
    budget is searched in, in turn). With an automatic split: beside room for the KV cache of a whole generation
    call (`gen_seqs`: the step's sequences, or a dynamic-sampling round's), then, for a program that does not fit
    there even at the smallest budget, beside vLLM running them in waves, half as many at once each time, down to
    one max-length sequence. ConfigError when the states alone do not fit."""
    r = cfg.rollout
    fixed = vllm_fixed(weights, r.engine_processes, r.engine_in_trainer)
    resident = sum(states.values())
    vllm = r.engine == "vllm" and card is not None
    usable = None if card is None else int((1.0 - memory.MARGIN) * card)
    at_once = vllm_max_seqs(cfg) * r.engine_processes  # each engine's scheduler runs max_num_seqs at most
    if vllm and r.gpu_memory_utilization > 0:
        jax_limit = search_limit = int((1.0 - r.gpu_memory_utilization - memory.MARGIN) * card)
    elif vllm:  # automatic: room for vLLM to run every sequence of the step at once if the card allows
        jax_limit = None
        search_limit = usable - (fixed + VLLM_OVERHEAD + kv_seq * min(gen_seqs, at_once))
    elif card is not None:
        jax_limit = search_limit = int(memory.jax_fraction() * card) if cfg.trainer.device_memory_gb <= 0 else card
    else:
        return None, [None]
    limits = [search_limit - resident - margin]
    if vllm and r.gpu_memory_utilization == 0:
        seqs = min(gen_seqs, at_once)
        while seqs > 1:
            seqs = -(-seqs // 2)
            limits.append(usable - (fixed + VLLM_OVERHEAD + kv_seq * seqs) - resident - margin)
    if max(limits) <= 0:  # the states alone do not fit: nothing to compile
        largest = resident + margin + max(limits)
        plan = Plan(states, [], margin, card, jax_limit if jax_limit is not None else largest, None,
                    memory.TokenBudgets(0, 0, 0, 0))
        raise ConfigError("the run does not fit the card:\n  " + "\n  ".join(
            [f"the states alone take {resident / GiB:.1f} GiB per device (+ margin {margin / GiB:.1f}) of the "
             f"{largest / GiB:.1f} GiB JAX may use" + (" beside vLLM's minimum" if vllm else "")]
            + _what_to_change(cfg, plan, shards, weights)) + "\n" + plan.table())
    return jax_limit, [x for x in limits if x > 0]


# one phase's search, run with the number of rungs it may compile at once: its phases, a function compiling their
# final programs, and the budget it chose ({key: budget}; empty for a padded phase)
Search = Callable[[Callable[[], int] | int], tuple[list[Phase], Callable[[], list[tuple[str, Memory, int]]],
                                                   dict[str, int]]]


@dataclasses.dataclass(frozen=True)
class _PhaseSearches:
    """What every phase's search shares: the run's config and build, the data's lengths (P + R: the longest
    sequence; the data's shortest and longest prompt), the ladder of budgets, the limits JAX's share may take (beside
    the whole batch's KV cache, then vLLM in waves) and, for a refusal, the resident states and the margin."""

    cfg: Any
    build: Any
    P: int
    R: int
    shortest: int
    longest: int
    rungs: list[int]
    limits: list[int]
    resident: int
    margin: int

    def search(self, names: tuple[str, ...], sub: Any, budget_key: str, given: int, seed: int, rows: int,
               keys: tuple, programs: tuple[tuple[Callable[[dict, bool], Memory], int], ...]) -> Search:
        """The search of the programs that share one budget key ((compile(batch, probe), resident argument bytes)
        each): padded (no budget) or packed (the largest budget that fits, or `given`)."""
        if not sub.use_dynamic_bsz:
            return lambda width: self._padded(names, rows, keys, programs)
        return lambda width: self._packed(names, budget_key, given, seed, rows, keys, programs, width)

    def _padded(self, names, rows, keys, programs):
        P, R = self.P, self.R
        batch = _abstract_padded(self.build.actor, _with_keys(_fake_batch(rows, P, R, P), keys, R))
        out = []
        for n, (fn, resident_args) in zip(names, programs):
            mem = fn(batch, True)
            out.append(Phase(n, None, None, mem, mem.beside(resident_args), 1))
        return out, lambda: [(n, fn(batch, False), r) for n, (fn, r) in zip(names, programs)], {}

    def _packed(self, names, budget_key, given, seed, rows, keys, programs, width):
        name, host = names[0], _with_keys(_fake_batch(rows, self.P, self.R, self.longest), keys, self.R)
        probed: dict[int, list[Memory]] = {}
        shapes: dict[int, tuple[int, int, int, int]] = {}  # each budget's packed shape key

        def measure(budget: int, probe: bool) -> list[Memory]:
            batch, shapes[budget] = _abstract_packed(self.build.actor, host, budget, budget_key, self.shortest)
            return [fn(batch, probe) for fn, _ in programs]

        def worst(mems: list[Memory]) -> int:
            return max(m.beside(r) for m, (_, r) in zip(mems, programs))

        def cost(budget: int) -> int:
            if budget not in probed:  # compiled once, whichever search asks
                t = time.perf_counter()
                probed[budget] = measure(budget, True)
                log.info("plan probe: %s at budget %d: %.2f GiB beside the states, compiled in %.1f s", name, budget,
                         worst(probed[budget]) / GiB, time.perf_counter() - t)
            return worst(probed[budget])

        t0, rounds = time.perf_counter(), 0
        if given > 0:
            budget, tries = given, 1
            cost(given)
        else:
            for limit in self.limits:  # beside the whole batch's KV cache, then vLLM in waves
                budget, _, n_rounds = search_budget(cost, limit, self.rungs, seed, width)
                rounds += n_rounds
                if budget is not None:
                    break
            tries = len(probed)
            if budget is None:  # the largest share JAX was offered (vLLM at its fewest sequences at once)
                raise ConfigError(_refusal(self.cfg, self.build, name, budget_key, self.rungs[0], self.resident,
                                           self.margin, self.resident + self.margin + self.limits[-1],
                                           worst(probed[self.rungs[0]])))
        took = time.perf_counter() - t0
        out = [Phase(n, budget_key, budget, m, m.beside(r), tries, shapes[budget], rounds, took)
               for n, m, (_, r) in zip(names, probed[budget], programs)]
        return out, lambda: [(n, m, r) for n, m, (_, r) in zip(names, measure(budget, False), programs)], \
            {budget_key: budget}


def _phase_searches(searches: _PhaseSearches, seeds: Any) -> list[Search]:
    """The step's phases as searches, one per budget key: the actor's forward (with the reference's, at its
    budget), the critic's forward and update, the actor's update."""
    from jaxppo.step import update_keys

    cfg, build = searches.cfg, searches.build
    a, r, procs = cfg.actor, cfg.rollout, jax.process_count()
    rows_step = cfg.data.train_batch_size * r.n // procs
    actor_keys, critic_keys = update_keys(cfg, build.ref is not None)
    a_state, a_frozen, trunc = build.actor_state, build.actor_frozen, build.truncation
    forward = [("actor forward", (lambda b, probe: build.actor.compile_logprobs(a_state.params, a_frozen, b, False,
                                                                                 trunc, probe),
                                  device_bytes((a_state.params, a_frozen))))]
    if build.ref is not None and build.needs_ref_logprobs:  # the reference's log-probs run at the same budget
        forward.append(("reference forward", (lambda b, probe: build.actor.compile_ref_logprobs(build.ref, a_frozen, b,
                                                                                               probe),
                                              device_bytes((build.ref, a_frozen)))))
    out = [searches.search(tuple(n for n, _ in forward), a, "actor.log_prob_max_token_len_per_device",
                           a.log_prob_max_token_len_per_device, seeds.actor_forward, rows_step, (),
                           tuple(p for _, p in forward))]
    if build.critic is not None:
        c, c_state, c_frozen = cfg.critic, build.critic_state, build.critic_frozen
        out.append(searches.search(("critic forward",), c, "critic.forward_max_token_len_per_device",
                                   c.forward_max_token_len_per_device, seeds.critic_forward, rows_step, (),
                                   ((lambda b, probe: build.critic.compile_values(c_state.params, c_frozen, b, probe),
                                     device_bytes((c_state.params, c_frozen))),)))
        out.append(searches.search(("critic update",), c, "critic.ppo_max_token_len_per_device",
                                   c.ppo_max_token_len_per_device, seeds.critic_update,
                                   c.ppo_mini_batch_size * r.n // procs, critic_keys,
                                   ((lambda b, probe: build.critic.compile_update(c_state, b, c_frozen, probe=probe),
                                     device_bytes((c_state, c_frozen))),)))
    ref_in_update = build.ref if build.actor.full_kl else None
    out.append(searches.search(("actor update",), a, "actor.ppo_max_token_len_per_device",
                               a.ppo_max_token_len_per_device, seeds.actor_update, a.ppo_mini_batch_size * r.n // procs,
                               actor_keys,
                               ((lambda b, probe: build.actor.compile_update(a_state, b, a_frozen, ref_in_update,
                                                                             probe),
                                 device_bytes((a_state, a_frozen, ref_in_update))),)))
    return out


def _run_searches(jobs: list[Search]) -> list:
    """The phases' searches at once, in threads (XLA compiles outside the GIL), each with its share of the threads:
    the searches still running share them, so the last ones (the updates') compile more rungs a round."""
    threads = plan_threads()
    if threads <= 1 or len(jobs) <= 1:
        return [job(max(1, min(MAX_SEARCH_WIDTH, threads))) for job in jobs]
    from concurrent.futures import ThreadPoolExecutor

    running = [len(jobs)]
    lock = threading.Lock()
    width = lambda: max(1, min(MAX_SEARCH_WIDTH, threads // running[0]))  # noqa: E731

    def until_done(job):
        try:
            return job(width)
        finally:
            with lock:
                running[0] -= 1

    with ThreadPoolExecutor(len(jobs), thread_name_prefix="jaxppo-plan") as ex:
        return [f.result() for f in [ex.submit(until_done, job) for job in jobs]]


def make_plan(cfg: Any, build: Any, card: int | None, prompt_lengths: tuple[int, int] | None = None) -> Plan:
    """Compile the step's programs for `build` (a `jaxppo.build.Build`: engines and abstract states) and choose
    the budgets and the vLLM / JAX split; raises ConfigError when nothing fits, saying what to change.
    `prompt_lengths`: (shortest, longest) prompt of the data, in tokens (default: 1 and data.max_prompt_length)."""
    d, r = cfg.data, cfg.rollout
    margin = int(cfg.trainer.memory_margin_gb * GiB)
    states = build.state_bytes()
    host = plan_host(build.host_state_bytes(), int(cfg.trainer.host_memory_gb * GiB) or None)  # 0: this host's own
    host.check()
    resident = sum(states.values())
    gen_seqs = generation_sequences(cfg)
    weights, kv_seq = vllm_sizes(cfg, build.actor_cfg)
    jax_limit, limits = _limits(cfg, card, states, margin, weights, kv_seq, gen_seqs, build.shards)
    P, R = d.max_prompt_length, d.max_response_length
    shortest, longest = prompt_lengths or (1, P)
    searches = _PhaseSearches(cfg, build, P, R, shortest, longest, ladder(P + R), limits, resident, margin)
    seeds = memory.token_budgets(cfg, build.actor_cfg, build.critic_cfg, build.shards, card)
    results = _run_searches(_phase_searches(searches, seeds))
    phases = [ph for out, _, _ in results for ph in out]
    finals = [final for _, final, _ in results]
    chosen = {k: v for _, _, c in results for k, v in c.items()}
    budgets = memory.TokenBudgets(
        actor_update=chosen.get("actor.ppo_max_token_len_per_device", 0),
        actor_forward=chosen.get("actor.log_prob_max_token_len_per_device", 0),
        critic_update=chosen.get("critic.ppo_max_token_len_per_device", 0),
        critic_forward=chosen.get("critic.forward_max_token_len_per_device", 0))
    plan = Plan(states, phases, margin, card, jax_limit, None, budgets, finals, host)
    if r.engine == "vllm" and card is not None:
        plan = _split(cfg, plan, weights, kv_seq, gen_seqs)
    check(cfg, plan)
    return plan


def finalize(cfg: Any, plan: Plan, held: Callable[[], int | None] = lambda: None) -> Plan:
    """Compile each chosen program as the run runs it (kept for the run; on a GPU with autotuning, which allocates
    from JAX's share: call once that is reserved) and re-plan with XLA's memory for those. `held`: what JAX holds
    after the compiles (its allocator's pool); with an automatic split vLLM gets the card beside that. ConfigError when the
    programs no longer fit what was reserved, saying what to change."""
    phases = {p.name: p for p in plan.phases}
    for final in plan.finals:
        for name, mem, resident_args in final():
            phases[name] = dataclasses.replace(phases[name], memory=mem, program=mem.beside(resident_args))
    out = dataclasses.replace(plan, phases=[phases[p.name] for p in plan.phases], finals=[])
    if plan.vllm is not None and cfg.rollout.gpu_memory_utilization == 0:
        weights, kv = plan.vllm.weights, plan.vllm.kv_per_sequence
        out = _split(cfg, out, weights, kv, plan.vllm.generation_sequences, held=max(held() or 0, out.need))
        if out.need > plan.need:
            raise ConfigError(f"the run does not fit the card: its programs compiled with autotuning need "
                              f"{(out.need - plan.need) / GiB:.2f} GiB more than the plan reserved "
                              f"({plan.need / GiB:.1f} GiB): raise trainer.memory_margin_gb or lower the token "
                              "budgets\n" + out.table())
    check(cfg, out)
    return out


def bind_plan(cfg: Any, plan: Plan, engines: list[Any]) -> tuple[Plan, list[dict[str, Any]]]:
    """The plan as the run keeps it: its chosen programs compiled as the run runs them (`finalize`: kept, the plan's
    own where it compiled them in this process), every later compile watched (`watch_late_compiles`, whose record
    comes back with the plan), and each packed phase's rows held to the shape its program was compiled for
    (`DeviceBatches.hold_to_plan`)."""
    plan = finalize(cfg, plan, memory.pool_bytes)
    log.info("memory plan with the programs the run calls:\n%s", plan.table())
    late = watch_late_compiles(plan, [p for e in engines for p in e.programs()])
    for e in engines:
        e.hold_to_plan(plan.packed_shapes())
    if plan.vllm is not None and jax.default_backend() == "gpu":
        log.info(memory.describe(plan, (jax.local_devices()[0].memory_stats() or {}).get("bytes_limit"),
                                 cfg.rollout.free_cache_engine))
    return plan, late


# the token budget each of the step's programs runs at (jaxppo.programs.Program names)
PROGRAM_BUDGETS = {"actor update": "actor.ppo_max_token_len_per_device",
                   "critic update": "critic.ppo_max_token_len_per_device",
                   "actor log-probs": "actor.log_prob_max_token_len_per_device",
                   "critic values": "critic.forward_max_token_len_per_device"}


def watch_late_compiles(plan: Plan, programs: list[Any]) -> list[dict[str, Any]]:
    """Log each of `programs` (jaxppo.programs.Program) compiled once the run has started, naming what differs: a
    signature the plan did not compile (a packed phase's further bucket, at debug level, or a miss). A warning when
    XLA asks more for it than for the plan's largest program; ConfigError (exit 2) when it cannot fit JAX's share
    beside the states at all, instead of an out-of-memory error when it runs. Returns the record it appends each
    such compile to (program, what differs, bytes beside the arguments, more than planned), for the run's
    benchmarks."""
    record: list[dict[str, Any]] = []

    def late(program: Any, exe: Any, diff: str) -> None:
        mem = Memory.of(exe)
        own = mem.temps + max(mem.outputs - mem.aliases, 0)
        planned = plan.peak_phase.program if plan.phases else 0
        over = own > planned
        record.append({"program": program.name, "differs": diff, "bytes": own, "over_plan": over})
        if over and plan.jax_limit and plan.resident + own > plan.jax_limit:  # it cannot run: say why, now
            key = PROGRAM_BUDGETS.get(program.name)
            raise ConfigError(
                f"{program.name} was compiled after the start for arguments the memory plan did not compile ({diff}) "
                f"and needs {own / GiB:.1f} GiB beside the states' {plan.resident / GiB:.1f} GiB, more than JAX's "
                f"share of {plan.jax_limit / GiB:.1f} GiB (the plan's largest program: {planned / GiB:.1f} GiB): "
                + (f"lower {key} (0 lets the plan choose), " if key else "")
                + "and please report it with this message: the plan should have compiled this shape")
        within = own - planned <= plan.margin  # XLA can give a smaller shape a few MiB more than the planned one
        (log.warning if over else log.debug)(
            "%s compiled after the start (%s): temporaries + outputs %.2f GiB, arguments %.2f GiB; the plan's largest "
            "program %.2f GiB beside %.2f GiB of states%s%s", program.name, diff, own / GiB, mem.arguments / GiB,
            planned / GiB, plan.resident / GiB,
            f", JAX's share {plan.jax_limit / GiB:.1f} GiB" if plan.jax_limit else "",
            (f": MORE THAN PLANNED by {(own - planned) / 2**20:.1f} MiB, "
             + (f"within the {plan.margin / GiB:.1f} GiB margin" if within else "beyond the margin")) if over else "")
    for p in programs:
        p.late = late
    return record


def generation_sequences(cfg: Any) -> int:
    """Sequences one generation call asks vLLM for: the step's (data.train_batch_size x rollout.n), or under dynamic
    sampling a round's (data.gen_batch_size x rollout.n; jaxppo.step.sample)."""
    d = cfg.data
    prompts = (d.gen_batch_size or d.train_batch_size) if cfg.algorithm.filter_groups.enable else d.train_batch_size
    return prompts * cfg.rollout.n


def _split(cfg: Any, plan: Plan, weights: int, kv_seq: int, gen_seqs: int, held: int | None = None) -> Plan:
    """vLLM's share: the rest of the card beside what JAX holds (`held`, else its need: automatic), or the
    configured fraction."""
    card = plan.card
    u = cfg.rollout.gpu_memory_utilization
    if u > 0:
        share = int(u * card)
        jax_limit = plan.jax_limit
    else:
        share = int((1.0 - memory.MARGIN) * card) - (held if held is not None else plan.need)
        jax_limit = plan.need
        u = max(share, 0) / card
    engines, in_trainer = cfg.rollout.engine_processes, cfg.rollout.engine_in_trainer
    held = max(share - vllm_fixed(weights, engines, in_trainer) - VLLM_OVERHEAD, 0) // max(kv_seq, 1)
    return dataclasses.replace(plan, jax_limit=jax_limit,
                               vllm=VllmShare(share, weights, kv_seq, int(held), gen_seqs, float(u),
                                              cfg.algorithm.filter_groups.enable, vllm_max_seqs(cfg) * engines, engines,
                                              in_trainer))


def check(cfg: Any, plan: Plan) -> None:
    """ConfigError (exit 2) when the plan does not fit the card, saying what to change."""
    if plan.card is None:
        return
    advice = []
    shards = cfg.mesh.fsdp * cfg.mesh.tensor
    if not plan.fits:
        over = plan.need - plan.jax_limit
        p = plan.peak_phase
        advice.append(f"JAX needs {plan.need / GiB:.1f} GiB per device at its peak ({p.name}: states "
                      f"{plan.resident / GiB:.1f} + program {p.program / GiB:.1f} + margin {plan.margin / GiB:.1f}) "
                      f"but may use {plan.jax_limit / GiB:.1f} GiB ({over / GiB:.1f} GiB over)")
        advice += _what_to_change(cfg, plan, shards)
    v = plan.vllm
    if v is not None and v.bytes < v.minimum:
        advice.append(f"vLLM's share ({v.bytes / GiB:.1f} GiB) cannot hold its weights ({v.weights / GiB:.1f} GiB), "
                      f"graphs and one max-length sequence's KV cache (needs {v.minimum / GiB:.1f} GiB)"
                      + ("" if cfg.rollout.gpu_memory_utilization else ": the trainer's states leave too little")
                      + "; " + ("raise rollout.gpu_memory_utilization, or set it to 0 (automatic)"
                               if cfg.rollout.gpu_memory_utilization else
                               "; ".join(_what_to_change(cfg, plan, shards)[1:]) or "use more devices"))
    if advice:
        raise ConfigError("the run does not fit the card:\n  " + "\n  ".join(advice) + "\n" + plan.table())


def _what_to_change(cfg: Any, plan: Plan, shards: int, weights: int | None = None) -> list[str]:
    """The changes that would make `plan` fit, most direct first; `weights`: vLLM's weights in bytes, where the
    plan has no vLLM share yet."""
    out = []
    p = plan.peak_phase if plan.phases else None
    if p is None:
        pass
    elif p.budget_key and p.budget and p.budget > ladder(cfg.data.max_prompt_length + cfg.data.max_response_length)[0]:
        out.append(f"lower {p.budget_key} (now {p.budget}; 0 picks the largest that fits)")
    elif not p.budget_key:
        sub = "critic" if p.name.startswith("critic") else "actor"
        out.append(f"lower {sub}'s micro-batch sizes, or pack sequences ({sub}.use_dynamic_bsz=true with token "
                   "budgets 0: the largest that fits)")
    r = cfg.rollout
    weights = plan.vllm.weights if plan.vllm is not None else weights
    if r.engine == "vllm" and not r.engine_in_trainer and weights is not None:
        spared = vllm_fixed(weights, r.engine_processes, False) - vllm_fixed(weights, r.engine_processes, True)
        out.append(f"keep the first vLLM engine in the trainer's process (rollout.engine_in_trainer=true: "
                   f"{spared / GiB:.1f} GiB less, its helper's weights, the shared copy and its context)")
    if cfg.rollout.engine == "vllm" and cfg.rollout.gpu_memory_utilization > 0:
        out.append(f"lower rollout.gpu_memory_utilization (now {cfg.rollout.gpu_memory_utilization}), or set it to 0 "
                   "(automatic: vLLM gets what JAX leaves)")
    if not plan.phases or plan.resident + plan.margin > 0.6 * (plan.jax_limit or plan.card):
        need = max(2, math.ceil(plan.resident * shards / (0.6 * (plan.jax_limit or plan.card))))
        offload = [f"{s}.optimizer_offload=true" for s in ("actor", "critic")
                   if getattr(cfg, s).lora_rank == 0 and not getattr(cfg, s).optimizer_offload
                   and (s == "actor" or any(k.startswith("critic") for k in plan.states))]
        out.append(f"the states alone take {plan.resident / GiB:.1f} GiB per device: train adapters "
                   f"(actor.lora_rank / critic.lora_rank), "
                   + (f"keep AdamW's moments in host memory ({', '.join(offload)}), " if offload else "")
                   + f"or shard over more devices (mesh.fsdp={need} or more)")
    return out


def _refusal(cfg: Any, build: Any, name: str, key: str, smallest: int, resident: int, margin: int, limit: int,
             program: int) -> str:
    return (f"the run does not fit the card: {name} does not fit at the smallest budget ({key}={smallest}): states "
            f"{resident / GiB:.1f} GiB + program {program / GiB:.1f} GiB + margin {margin / GiB:.1f} GiB > "
            f"{limit / GiB:.1f} GiB for JAX; train adapters (actor.lora_rank / critic.lora_rank), shorten "
            "data.max_prompt_length / max_response_length, or shard over more devices (mesh.fsdp)")


__all__ = ["Plan", "Phase", "VllmShare", "make_plan", "finalize", "bind_plan", "watch_late_compiles", "check", "search_budget",
           "ladder"]
