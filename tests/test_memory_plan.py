"""The memory plan from the compiled programs (jaxppo/plan.py), through real compiles on CPU: the budget search picks
smaller budgets for a smaller card, `trainer.plan_only` exits 0 / 2 and creates nothing, a start compiles each
program once and the run calls those executables, a run that cannot fit exits 2 before the rollout engine starts,
and the GPU checks of the committed configs (ledger rows `config_check`) stay within the plan."""

from __future__ import annotations

import tempfile

import jax
import numpy as np
import pytest

from jaxppo.config import load_config
from tests.train_helpers import FAST, ROOT

# critic-free (no critic, no reference): the actor's forward and update, packed, with the forward's budget given
# so the search runs on the update alone
PACKED = [*FAST, "algorithm.adv_estimator=grpo", "actor.use_dynamic_bsz=true",
          "actor.log_prob_max_token_len_per_device=2048", "trainer.memory_margin_gb=0.001"]


# a program's bytes against its token budget, as the budget search may meet them
COST_CURVES = {"linear": lambda b: 10 + 2 * b, "quadratic": lambda b: 10 + b + b * b / 1000,
               "jump": lambda b: 10 + 3 * b + (5000 if b > 20000 else 0)}


def prepared(tmp_path, *overrides):
    from jaxppo import start

    cfg = load_config(ROOT / "configs" / "default.yaml", [f"trainer.default_local_dir={tmp_path / 'run'}",
                                                          *overrides])
    # the run directory exists: the start writes its data there, not into a staging directory under the system's
    # temporary directory that only the trainer's next steps would remove (each such test left one behind)
    (tmp_path / "run").mkdir(exist_ok=True)
    return start.prepare(cfg, quiet=True)


def test_search_budget_finds_the_largest_rung_that_fits_with_few_compiles():
    from jaxppo.plan import ladder, search_budget

    rungs = ladder(768)
    for name, f in COST_CURVES.items():
        for avail in (5_000, 30_000, 60_000, 10**9, 5):
            seen = []
            got, n, rounds = search_budget(lambda b: (seen.append(b), f(b))[1], avail, rungs, 16384)
            assert got == max([r for r in rungs if f(r) <= avail], default=None), (name, avail)
            assert n == len(set(seen)) == rounds <= 6, (name, avail, seen)


def test_the_search_compiles_several_rungs_at_once_and_finds_the_same_budget_in_fewer_rounds():
    import threading

    from jaxppo.plan import ladder, search_budget

    rungs = ladder(768)
    for name, f in COST_CURVES.items():
        for avail in (5_000, 30_000, 60_000, 10**9, 5):
            _, _, one_at_a_time = search_budget(f, avail, rungs, 16384)
            for width in (2, 3, 4):
                threads = set()

                def cost(b):
                    threads.add(threading.current_thread().name)
                    return f(b)

                got, n, rounds = search_budget(cost, avail, rungs, 16384, width)
                assert got == max([r for r in rungs if f(r) <= avail], default=None), (width, name, avail)
                assert rounds <= min(one_at_a_time, 4) and n <= width * rounds, (width, name, avail, n, rounds)
                assert any(t.startswith("jaxppo-plan") for t in threads), (width, name, avail)
            # a width that grows while the search runs (the other phases' searches ending): the same answer, each
            # round within the width it was given then
            given: list[int] = []

            def growing():
                given.append(min(1 + len(given), 4))
                return given[-1]

            sizes: list[int] = []

            def batch_cost(b):
                sizes.append(b)
                return f(b)

            got, n, rounds = search_budget(batch_cost, avail, rungs, 16384, growing)
            assert got == max([r for r in rungs if f(r) <= avail], default=None), (name, avail)
            assert rounds <= one_at_a_time and n <= sum(given) + 2, (name, avail, n, rounds, given)


def test_a_search_wider_than_its_cap_would_save_few_rounds_for_many_more_compiles():
    """Why one search compiles at most MAX_SEARCH_WIDTH rungs at once (the rest of the threads idle rather than
    compile rungs the search will not need): over the test curves, limits and seeds, 8 at once takes nearly as many
    rounds as the cap and far more compiles (on a GPU host the compiles compete for its cores)."""
    from jaxppo.plan_search import MAX_SEARCH_WIDTH, ladder, search_budget

    rungs = ladder(768)
    tally = {w: [0, 0] for w in (1, MAX_SEARCH_WIDTH, 8)}
    for f in COST_CURVES.values():
        for frac in (0.05, 0.2, 0.4, 0.6, 0.8, 0.95):
            avail = f(rungs[0]) + frac * (f(rungs[-1]) - f(rungs[0]))
            for seed in (1024, 8192, 16384, 30720):
                for w, t in tally.items():
                    _, n, rounds = search_budget(f, avail, rungs, seed, w)
                    t[0], t[1] = t[0] + n, t[1] + rounds
    (n1, r1), (nc, rc), (n8, r8) = tally.values()
    assert rc < 0.6 * r1  # the cap's parallel rounds save most of one-at-a-time's
    assert rc - r8 < 0.1 * rc and n8 > 1.5 * nc, tally  # wider: under a tenth fewer rounds, half again the compiles


def test_a_smaller_card_gets_a_smaller_budget(tmp_path, one_device):
    big = prepared(tmp_path, *PACKED, "trainer.device_memory_gb=20").plan
    small = prepared(tmp_path, *PACKED, "trainer.device_memory_gb=0.12").plan
    assert big.budgets.actor_update == 32768  # the ladder's top fits a 20 GB card
    assert 1024 <= small.budgets.actor_update < big.budgets.actor_update
    assert small.budgets.actor_forward == big.budgets.actor_forward == 2048  # given: compiled and checked only
    for plan in (big, small):
        assert plan.fits and plan.need <= plan.jax_limit
        update = next(p for p in plan.phases if p.name == "actor update")
        assert update.memory.temps > 0 and update.program == update.memory.beside(
            sum(v for k, v in plan.states.items() if k.startswith("actor")))
        # the start's planning time, phase by phase: a searched budget's rounds and seconds are in the table
        assert 1 <= update.rounds <= update.compiles and update.seconds > 0
        assert f"({update.compiles} compiled in {update.rounds} round" in plan.table()
        assert plan.summary()["phases"]["actor update"]["rounds"] == update.rounds
        forward = next(p for p in plan.phases if p.name == "actor forward")
        assert forward.rounds == 0 and f"({forward.compiles} compiled)" in plan.table()  # given: no search
    # the next rung up does not fit the small card: the search stopped at the largest that does
    from jaxppo import start

    over = small.budgets.actor_update + 1024
    cfg = load_config(ROOT / "configs" / "default.yaml", [f"trainer.default_local_dir={tmp_path / 'run'}", *PACKED,
                                                          "trainer.device_memory_gb=0.12",
                                                          f"actor.ppo_max_token_len_per_device={over}"])
    from jaxppo.errors import ConfigError

    with pytest.raises(ConfigError, match="lower actor.ppo_max_token_len_per_device"):
        start.prepare(cfg, quiet=True)


def test_the_phases_planned_in_threads_choose_what_one_thread_chooses(tmp_path, one_device, monkeypatch):
    """The GPU's planning child compiles the phases' probes at once (JAXPPO_PLAN_THREADS): the same budgets and
    bytes as one at a time, with the phases' searches in threads of their own (GRPO: the forward pass at its given
    budget and the update's search, each in its thread, the update compiling two rungs a round)."""
    import threading

    from jaxppo import programs

    args = [*PACKED, "trainer.device_memory_gb=0.12"]
    monkeypatch.setenv("JAXPPO_PLAN_THREADS", "1")
    one = prepared(tmp_path, *args).plan
    seen = set()
    memory_of = programs.Program.memory

    def spy(self, *a):
        t = threading.current_thread()
        seen.add((t.name, t.ident))
        return memory_of(self, *a)

    monkeypatch.setattr(programs.Program, "memory", spy)
    monkeypatch.setenv("JAXPPO_PLAN_THREADS", "4")
    many = prepared(tmp_path, *args).plan
    assert 0 < one.budgets.actor_update < 32768 and one.budgets.actor_forward == 2048
    assert many.budgets == one.budgets
    assert [(p.name, p.program) for p in many.phases] == [(p.name, p.program) for p in one.phases]
    assert len({t for t in seen if t[0].startswith("jaxppo-plan")}) >= 3, seen  # two jobs, and the update's rungs


def test_plan_only_exits_0_or_2_and_creates_nothing(tmp_path, capsys, one_device, monkeypatch):
    """... but its compiles go to JAX's persistent cache (a GPU start plans in a plan-only child: a 7B plan's
    probes took 6.5 minutes at every start before they did)."""
    import jax
    from jax._src import compilation_cache

    from jaxppo.train import main

    # this test's own temporary directory: other test processes stage their starts in the shared one meanwhile
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(tmp))
    run, cache = tmp_path / "run", tmp_path / "xla"
    old = jax.config.jax_compilation_cache_dir, jax.config.jax_persistent_cache_min_compile_time_secs
    compilation_cache.reset_cache()  # this process's cache starts again at the directory the run names
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
    # the start keeps only compiles of >= 2 s unless the environment names a threshold (scripts/test.sh does: 0);
    # name it here too, so the test does not depend on how pytest was started
    monkeypatch.setenv("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
    try:
        assert main([f"trainer.default_local_dir={run}", *FAST, "trainer.plan_only=true",
                     "trainer.device_memory_gb=4", f"trainer.compilation_cache_dir={cache}"]) == 0
    finally:
        jax.config.update("jax_compilation_cache_dir", old[0])
        jax.config.update("jax_persistent_cache_min_compile_time_secs", old[1])
        compilation_cache.reset_cache()
    assert cache.is_dir() and any(cache.iterdir())
    out = capsys.readouterr().out
    assert "memory plan per device" in out and "actor update" in out and "plan: fits" in out
    assert "update micro-batch loop: actor scan, critic scan" in out  # auto, full fine-tuning
    assert main([f"trainer.default_local_dir={run}", *FAST, "trainer.plan_only=true",
                 "trainer.device_memory_gb=0.0001"]) == 2
    err = capsys.readouterr().err
    assert "does not fit the card" in err and "states alone" in err and "mesh.fsdp=" in err, err
    assert tempfile.gettempdir() == str(tmp)
    staged = list(tmp.glob("jaxppo-start-*"))  # (torch, imported on the way, puts its compile cache there)
    assert not run.exists() and not staged, staged  # no run directory, no staged data left


@pytest.mark.parametrize("extra, n_programs", [([], 4), (["model.micro_batch_loop=scan", "actor.lora_rank=8"], 5),
                                               (["actor.lora_rank=8"], 7),
                                               (["model.micro_batch_loop=host", "actor.lora_rank=8"], 9),
                                               (["model.micro_batch_loop=host", "mesh.data=2"], 8)],
                         ids=["full", "lora_scan", "lora_auto", "lora_host_loop", "host_loop_data2"])
def test_a_start_compiles_each_program_once_and_the_run_calls_those_executables(tmp_path, request, extra,
                                                                                n_programs):
    """XLA's own compile events, by program: each of the step's programs is compiled once per argument signature
    (the plan's executables are the ones the steps call: no second compile of the same program); under LoRA the
    reference's own program (the base module) among them; with the host's micro-batch loop each update is three
    programs (the empty sum, one micro-batch, the optimizer step), all compiled by the plan, also where each of two
    devices keeps its own sum between them (data parallel: the sums' shardings as the empty sum's program gives
    them). The default loop, `auto`, is the host's for the LoRA actor and the scan for the fully trained critic."""
    from jax._src import monitoring

    request.getfixturevalue("two_devices" if "mesh.data=2" in extra else "one_device")

    from jaxppo.train import make_engine_factory
    from jaxppo.trainer import PPOTrainer

    compiled: list[str] = []

    def listener(event, duration, **kw):
        if event == "/jax/core/compile/backend_compile_duration" and "jaxppo_" in kw.get("fun_name", ""):
            compiled.append(kw["fun_name"])

    monitoring.register_event_duration_secs_listener(listener)
    try:
        cfg = load_config(ROOT / "configs" / "default.yaml",
                          [f"trainer.default_local_dir={tmp_path / 'run'}", *FAST, "trainer.sft_warmup_steps=0",
                           "trainer.total_training_steps=2", "trainer.test_freq=-1", "actor.use_kl_loss=true", *extra])
        with PPOTrainer(cfg, make_engine_factory(cfg)) as trainer:
            programs = [p for e in (trainer.actor, trainer.critic) for p in e.programs()]
            assert len(programs) == n_programs  # the forwards and updates, and LoRA's reference
            assert trainer.actor.local_accumulation == trainer.critic.local_accumulation == ("mesh.data=2" in extra)
            planned = {p.name: p.compiles() for p in programs}
            assert all(planned.values()), planned  # every program compiled by the plan, before any state existed
            if "actor.lora_rank=8" in extra:  # the reference is the base module: no arrays of its own
                assert not jax.tree.leaves(trainer.state.ref_params) and "reference" not in trainer.held_memory()
                assert not any(k.startswith("reference") for k in trainer.plan.states), trainer.plan.states
            trainer.fit()
            after = {p.name: p.compiles() for p in programs}
    finally:
        monitoring.unregister_event_duration_listener(listener)
    assert after == planned  # the steps ran the plan's executables: none compiled again
    for p in programs:
        assert compiled.count(f"jit({p.jitted.__name__})") == p.compiles(), (p.name, compiled)


def test_a_run_that_cannot_fit_exits_2_before_the_rollout_engine_starts(tmp_path, capsys, one_device, monkeypatch):
    from jaxppo import train

    started = []
    monkeypatch.setattr(train, "make_engine_factory", lambda cfg: lambda *a: started.append(1))
    rc = train.main([f"trainer.default_local_dir={tmp_path / 'run'}", *FAST, "rollout.engine=vllm",
                     "trainer.device_memory_gb=0.001"])
    err = capsys.readouterr().err
    assert rc == 2 and not started and "does not fit the card" in err and "Traceback" not in err, err
    assert not (tmp_path / "run").exists()


def test_the_split_gives_vllm_the_rest_or_checks_the_configured_share(tmp_path, one_device):
    from jaxppo import memory
    from jaxppo.errors import ConfigError
    from jaxppo.plan import VLLM_OVERHEAD

    card = 10 * 2**30
    auto = prepared(tmp_path, *FAST, "rollout.engine=vllm", "trainer.device_memory_gb=10").plan
    v = auto.vllm
    assert auto.jax_limit == auto.need  # JAX: its compiled peak + margin
    assert v.bytes == int((1 - memory.MARGIN) * card) - auto.need and v.utilization == pytest.approx(v.bytes / card)
    assert v.sequences == (v.bytes - v.weights - VLLM_OVERHEAD) // v.kv_per_sequence > 0
    given = prepared(tmp_path, *FAST, "rollout.engine=vllm", "trainer.device_memory_gb=10",
                     "rollout.gpu_memory_utilization=0.5").plan
    assert given.vllm.utilization == 0.5 and given.jax_limit == int((1 - 0.5 - memory.MARGIN) * card)
    with pytest.raises(ConfigError, match="vLLM's share .* cannot hold"):
        prepared(tmp_path, *FAST, "rollout.engine=vllm", "trainer.device_memory_gb=10",
                 "rollout.gpu_memory_utilization=0.01")


def test_a_program_too_large_beside_the_whole_batch_runs_beside_vllm_in_waves(tmp_path, one_device, monkeypatch):
    """Automatic split: when the actor update does not fit at the smallest budget beside vLLM holding the whole
    batch at once, the search tries again beside vLLM running it in waves (half as many sequences at once each
    time) and the run starts with vLLM holding as many as fit; the 7B PPO offload config was refused on one H200
    (2026-12-03) for want of this. A KV cache of one sequence as large as the run's whole need makes the card's
    size decide between whole batch, half and refusal."""
    from jaxppo import memory, plan as plan_mod
    from jaxppo.errors import ConfigError
    from jaxppo.plan import VLLM_OVERHEAD, ladder

    base = [*PACKED, "rollout.engine=vllm"]
    cfg = load_config(ROOT / "configs" / "default.yaml", [f"trainer.default_local_dir={tmp_path / 'r'}", *base])
    smallest = ladder(cfg.data.max_prompt_length + cfg.data.max_response_length)[0]
    # the run's need with the update at the smallest budget, on a card that holds anything
    need0 = prepared(tmp_path, *base, "trainer.device_memory_gb=1000",
                     f"actor.ppo_max_token_len_per_device={smallest}").plan.need
    weights, kv = 2**20, need0  # one sequence's KV cache as large as JAX's whole need
    monkeypatch.setattr(plan_mod, "vllm_sizes", lambda cfg, model: (weights, kv))
    seqs = cfg.data.train_batch_size * cfg.rollout.n  # 16: the whole batch
    # room for JAX beside half the batch's KV cache, and 1 MiB more: not beside the whole batch
    card = (weights + VLLM_OVERHEAD + kv * (seqs // 2) + need0 + 2**20) / (1 - memory.MARGIN)
    plan = prepared(tmp_path, *base, f"trainer.device_memory_gb={card / 2**30}").plan
    assert plan.fits and plan.budgets.actor_update >= smallest
    assert plan.vllm.sequences == seqs // 2 and plan.vllm.bytes >= plan.vllm.minimum
    whole = weights + VLLM_OVERHEAD + kv * seqs
    assert whole + plan.need > (1 - memory.MARGIN) * card  # beside the whole batch it would not have fit
    assert "run in 2 waves" in plan.table()
    # a card that cannot hold JAX's need beside even one sequence: refused, naming the phase and the budget
    small = (weights + VLLM_OVERHEAD + kv + need0 // 2) / (1 - memory.MARGIN)
    with pytest.raises(ConfigError, match=f"actor update does not fit at the smallest budget .*={smallest}"):
        prepared(tmp_path, *base, f"trainer.device_memory_gb={small / 2**30}")


def test_under_dynamic_sampling_vllm_is_sized_for_a_generation_round(tmp_path, one_device, monkeypatch):
    """DAPO's dynamic sampling asks vLLM for a round of data.gen_batch_size prompts at a time, not the step's
    train_batch_size: the automatic split makes room for a round's KV cache and the plan counts a round's waves
    (the DAPO config's plan said "the step's 2048 run in 1 wave" for rounds of 6144)."""
    from jaxppo import memory, plan as plan_mod
    from jaxppo.plan import VLLM_OVERHEAD

    base = [*PACKED, "rollout.engine=vllm", "data.train_batch_size=4", "rollout.n=2", "actor.ppo_mini_batch_size=4"]
    need0 = prepared(tmp_path, *base, "trainer.device_memory_gb=1000").plan.need
    weights, kv = 2**20, need0
    monkeypatch.setattr(plan_mod, "vllm_sizes", lambda cfg, model: (weights, kv))
    # room for JAX beside 12 sequences' KV cache: the step's 8 at once, a round's 16 in 2 waves
    card = (weights + VLLM_OVERHEAD + kv * 12 + need0 + 2**20) / (1 - memory.MARGIN)
    plain = prepared(tmp_path, *base, f"trainer.device_memory_gb={card / 2**30}").plan
    assert plain.vllm.generation_sequences == 8 and "the step's 8 run in 1 wave" in plain.table()
    rounds = prepared(tmp_path, *base, "algorithm.filter_groups.enable=true", "data.gen_batch_size=8",
                      f"trainer.device_memory_gb={card / 2**30}").plan
    assert rounds.vllm.generation_sequences == 16 and 12 <= rounds.vllm.sequences < 16
    assert "a generation round's 16 run in 2 waves" in rounds.table()


def test_vllm_is_sized_for_the_sequences_its_scheduler_runs_at_once(tmp_path, one_device, monkeypatch):
    """rollout.max_num_seqs (verl's key of that name): vLLM never runs more sequences at once, so the automatic split
    makes room for their KV cache and no more, and JAX's budgets are searched in the rest. On a card with room for
    JAX's whole need beside 4 sequences' KV cache (not beside the batch's 16), max_num_seqs=4 plans the budgets of a
    card without limit; without it the search gets less room."""
    from jaxppo import memory, plan as plan_mod
    from jaxppo.plan import VLLM_OVERHEAD

    base = [*PACKED, "rollout.engine=vllm"]
    roomy = prepared(tmp_path, *base, "trainer.device_memory_gb=1000").plan
    weights, kv = 2**20, roomy.need // 4
    monkeypatch.setattr(plan_mod, "vllm_sizes", lambda cfg, model: (weights, kv))
    card_gb = (weights + VLLM_OVERHEAD + kv * 4 + roomy.need + 2**20) / (1 - memory.MARGIN) / 2**30
    capped = prepared(tmp_path, *base, "rollout.max_num_seqs=4", f"trainer.device_memory_gb={card_gb}").plan
    assert capped.budgets == roomy.budgets and capped.vllm.max_seqs == 4
    assert capped.vllm.sequences >= 4 and "the step's 16 run in 4 waves" in capped.table()
    plain = prepared(tmp_path, *base, f"trainer.device_memory_gb={card_gb}").plan
    assert plain.vllm.max_seqs == plan_mod.VLLM_MAX_SEQS
    assert plain.budgets.actor_update < roomy.budgets.actor_update or plain.vllm.sequences < 16


def test_engine_processes_are_counted_in_vllms_share(tmp_path, one_device, monkeypatch):
    """rollout.engine_processes=2: vLLM's share holds each engine's weights, the shared copy they load pushes from,
    the second engine's graphs and CUDA context, and one KV cache of a sequence per engine; what is left holds the
    sequences, and each engine starts with its half of the share less the copy and the second context. On the same
    card the plan has 1 weights + overhead + context fewer bytes of KV cache than with one engine. With
    rollout.engine_in_trainer=false every engine is a helper: one context more, and the share split the same way."""
    from jaxppo import plan as plan_mod
    from jaxppo.plan import ENGINE_CONTEXT, VLLM_OVERHEAD

    base = [*PACKED, "rollout.engine=vllm", "trainer.device_memory_gb=80"]
    weights, kv = 3 * 2**30, 2**24
    monkeypatch.setattr(plan_mod, "vllm_sizes", lambda cfg, model: (weights, kv))
    one = prepared(tmp_path, *base).plan.vllm
    two = prepared(tmp_path, *base, "rollout.engine_processes=2").plan.vllm
    assert (one.engines, two.engines) == (1, 2) and two.bytes == one.bytes  # JAX's need decides the split
    assert two.fixed == 3 * weights + VLLM_OVERHEAD + ENGINE_CONTEXT
    assert one.sequences - two.sequences == (2 * weights + VLLM_OVERHEAD + ENGINE_CONTEXT) // kv
    assert two.minimum == two.fixed + VLLM_OVERHEAD + 2 * kv
    assert two.max_seqs == 2 * one.max_seqs  # each engine's scheduler runs max_num_seqs
    # the engines' starting shares and the copy and context beside them fill the share
    each = two.engine_utilization / two.utilization * two.bytes
    assert abs(2 * each + weights + ENGINE_CONTEXT - two.bytes) < 2
    assert one.engine_utilization == one.utilization
    assert "2 engine processes at" in prepared(tmp_path, *base, "rollout.engine_processes=2").plan.table()
    # rollout.engine_in_trainer=false: every engine a helper, each with a context of its own
    out = prepared(tmp_path, *base, "rollout.engine_in_trainer=false").plan
    alone = out.vllm
    assert (alone.engines, alone.helpers, alone.bytes) == (1, 1, one.bytes)
    assert alone.fixed == 2 * weights + ENGINE_CONTEXT  # the helper's weights and the shared copy
    assert abs(alone.engine_utilization / alone.utilization * alone.bytes + weights + ENGINE_CONTEXT
               - alone.bytes) < 2
    assert "1 engine process at" in out.table() and "none in the trainer" in out.table()
    both = prepared(tmp_path, *base, "rollout.engine_processes=2", "rollout.engine_in_trainer=false").plan.vllm
    assert both.fixed == two.fixed + ENGINE_CONTEXT
    assert abs(2 * both.engine_utilization / both.utilization * both.bytes + weights + 2 * ENGINE_CONTEXT
               - both.bytes) < 2


def test_a_helper_engine_that_does_not_fit_names_the_in_trainer_engine_as_the_change(tmp_path, one_device,
                                                                                      monkeypatch):
    """One step ahead with vLLM implies the engine in a helper process, which needs its own weights, the shared copy
    and a CUDA context beside the trainer's share: on a card where only the engine in the trainer's process fits,
    the refusal names rollout.engine_in_trainer=true and what it spares."""
    from jaxppo import memory, plan as plan_mod
    from jaxppo.errors import ConfigError
    from jaxppo.plan import ENGINE_CONTEXT, VLLM_OVERHEAD

    base = [*PACKED, "rollout.engine=vllm", "trainer.async_rollout=true",
            "algorithm.rollout_correction.rollout_is=token"]
    weights, kv = 2 * 2**30, 2**20
    monkeypatch.setattr(plan_mod, "vllm_sizes", lambda cfg, model: (weights, kv))
    need = prepared(tmp_path, *base, "rollout.engine_in_trainer=true", "trainer.device_memory_gb=1000").plan.need
    card = (need + weights + VLLM_OVERHEAD + kv + ENGINE_CONTEXT) / (1 - memory.MARGIN)  # less than a helper needs
    kept = prepared(tmp_path, *base, "rollout.engine_in_trainer=true", f"trainer.device_memory_gb={card / 2**30}")
    assert kept.plan.vllm.in_trainer and kept.plan.vllm.bytes >= kept.plan.vllm.minimum
    with pytest.raises(ConfigError, match=r"rollout.engine_in_trainer=true: 2.5 GiB less"):
        prepared(tmp_path, *base, f"trainer.device_memory_gb={card / 2**30}")


def test_engine_processes_need_vllm(tmp_path):
    from jaxppo.errors import ConfigError

    with pytest.raises(ConfigError, match="rollout.engine_processes=2 needs rollout.engine=vllm"):
        load_config(ROOT / "configs" / "default.yaml", ["rollout.engine_processes=2"])
    with pytest.raises(ConfigError, match="rollout.engine_processes must be >= 1"):
        load_config(ROOT / "configs" / "default.yaml", ["rollout.engine=vllm", "rollout.engine_processes=0"])
    with pytest.raises(ConfigError, match="rollout.engine_in_trainer=false needs rollout.engine=vllm"):
        load_config(ROOT / "configs" / "default.yaml", ["rollout.engine_in_trainer=false"])


def test_jax_takes_its_share_as_one_allocation_and_the_planning_child_grows_on_demand():
    from jaxppo import memory

    assert memory.backend_env(0.2) == {"XLA_PYTHON_CLIENT_PREALLOCATE": "true",
                                       "XLA_PYTHON_CLIENT_MEM_FRACTION": "0.750"}
    assert memory.backend_env(0.2, grow=True)["XLA_PYTHON_CLIENT_PREALLOCATE"] == "false"
    assert memory.backend_env(0.0)["XLA_PYTHON_CLIENT_MEM_FRACTION"] == f"{1 - memory.AUTO_FALLBACK - memory.MARGIN:.3f}"
    with pytest.raises(ValueError, match="gpu_memory_utilization"):
        memory.backend_env(0.96)


def test_the_gpu_plans_log_line_says_whether_vllm_sleeps_while_jax_trains(monkeypatch):
    """`rollout.free_cache_engine=false` keeps the engine awake: the plan's line said "asleep" for it too (the 7B LoRA
    bypass config's check, 2026-12-07)."""
    from types import SimpleNamespace

    from jaxppo import memory

    monkeypatch.setenv("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.5")
    plan = SimpleNamespace(vllm=SimpleNamespace(utilization=0.4, bytes=32 * memory.GiB), need=40 * memory.GiB)
    line = memory.describe(plan, 40 * memory.GiB)
    assert "80 GiB card" in line and "32.0 GiB (weights + KV cache, asleep during training)" in line
    assert "kept awake during training" in memory.describe(plan, 40 * memory.GiB, asleep=False)


def test_a_gpu_run_takes_the_budgets_and_the_split_of_the_plan_its_child_compiled(tmp_path, monkeypatch):
    """`memory.plan_in_child` through a real child process (on CPU, the card given): the run gets the child's
    budgets as given ones, vLLM the card beside JAX's need, and JAX one allocation of that need."""
    from jaxppo import memory

    for k in ("XLA_PYTHON_CLIENT_PREALLOCATE", "XLA_PYTHON_CLIENT_MEM_FRACTION", "XLA_FLAGS"):  # one device there
        monkeypatch.delenv(k, raising=False)
    monkeypatch.setenv("PYTHONPATH", str(ROOT))
    args = [f"trainer.default_local_dir={tmp_path / 'run'}", *PACKED, "rollout.engine=vllm",
            "trainer.device_memory_gb=20", "actor.log_prob_max_token_len_per_device=0"]
    cfg = load_config(ROOT / "configs" / "default.yaml", args)
    rc, run_cfg = memory.plan_in_child(cfg, ["--config", str(ROOT / "configs" / "default.yaml"), *args])
    assert rc == 0
    a = run_cfg.actor
    assert a.ppo_max_token_len_per_device == a.log_prob_max_token_len_per_device == 32768  # the child's choice
    u = run_cfg.rollout.gpu_memory_utilization
    share = float(__import__("os").environ["XLA_PYTHON_CLIENT_MEM_FRACTION"])
    assert __import__("os").environ["XLA_PYTHON_CLIENT_PREALLOCATE"] == "true"
    assert 0 < u < 1 - memory.MARGIN and share == pytest.approx(1 - memory.MARGIN - u, abs=2e-4)
    assert not (tmp_path / "run").exists()  # the child planned only
    bad = [*args[:-2], "trainer.device_memory_gb=0.0001"]
    rc, _ = memory.plan_in_child(load_config(ROOT / "configs" / "default.yaml", bad),
                                 ["--config", str(ROOT / "configs" / "default.yaml"), *bad])
    assert rc == 2


def test_every_gpu_config_check_on_record_stayed_within_its_plan():
    """The GPU checks of the committed configs (scripts/check_configs.py): none ran out of memory, and where a run
    finished, JAX's measured peak <= the plan's total (its states and largest program, plus the margin it reserves)
    and the plan's states + program <= 1.10 x the measured peak. (The 7B LoRA check at 9be2f87 peaked 2.4 MB above
    its states + program: an update compiled in step 1 for a smaller shape, which XLA gave 1.5 MB more.) Each check's
    latest row is a run that finished, or a refusal at start where one card must refuse."""
    from scripts import ledger
    from scripts.check_configs import CHECKS, REFUSED_ON_ONE_CARD, latest, vllm_configs

    assert set(vllm_configs()) <= {c for _, c, _, _ in CHECKS}  # every committed vLLM config is checked
    rows = [r for r in ledger.read() if r["bench"] == "config_check"]
    for row in rows:
        f = row["figures"]
        assert not f["out_of_memory"], (row["check"], row["commit"])
        assert f["exit_code"] in (0, 2), (row["check"], row["commit"], f.get("refusal"))
        if f["exit_code"] == 0 and "jax_peak_gb" in f:
            total = f["plan_gb"] + (f.get("plan_margin_gb") or 0.0)
            assert f["jax_peak_gb"] <= total and f["plan_gb"] <= 1.10 * f["jax_peak_gb"], (row["check"], row["commit"], f)
        if f.get("plan_host_peak_gb"):  # the host plan (jaxppo/host_plan.py), from the rows that carry it
            assert f["host_peak_gb"]["rss_peak"] <= f["plan_host_peak_gb"], (row["check"], row["commit"], f)
    assert np.all([isinstance(r["figures"]["exit_code"], int) for r in rows])
    for (name, *_), row in zip(CHECKS, latest(rows)):
        assert row is not None, f"{name}: never checked on the GPU (scripts/check_configs.py --only {name})"
        assert row["figures"]["exit_code"] == (2 if name in REFUSED_ON_ONE_CARD else 0), (name, row["commit"])


def test_a_compile_after_the_start_is_logged_with_what_differs_and_a_warning_when_larger_than_planned(caplog):
    """Once the run has started, a program compiled for a signature the plan did not see is logged, naming the
    argument that differs; a warning when XLA asks more for it than for the plan's largest program (the Qwen3-8B
    LoRA check on the H200 compiled a 136 GiB program in its first step against a 68 GiB share, 2026-12-03)."""
    import dataclasses
    import logging

    import jax.numpy as jnp

    from jaxppo import memory
    from jaxppo.plan import Phase, Plan, watch_late_compiles
    from jaxppo.programs import Memory, Program

    prog = Program(lambda x, y: (x * 2, y + 1), name="double")
    prog(jnp.ones(4), jnp.ones(4))  # what the plan compiled
    small = Memory(0, 0, 0, 4096, 0)
    plan = Plan({"states": 2**20}, [Phase("double", None, None, small, 4096, 1)], 0, 2**30, 2**30, None,
                memory.TokenBudgets(0, 0, 0, 0))
    record = watch_late_compiles(plan, [prog])
    with caplog.at_level(logging.DEBUG, logger="jaxppo"):
        prog(jnp.ones(4), jnp.ones(4))  # the planned signature: no compile, nothing logged
        assert not caplog.records
        prog(jnp.ones(2), jnp.ones(4))  # smaller: logged, no warning
        prog(jnp.ones(4), jnp.ones((1024, 1024)))  # 4 MiB of output against a 4 KiB plan
    info, warn = caplog.records
    assert info.levelno == logging.DEBUG and "leaf 0: ((4,), 'float32', False) -> ((2,), 'float32', False)" \
        in info.getMessage() and "MORE THAN PLANNED" not in info.getMessage()
    assert warn.levelno == logging.WARNING and "double compiled after the start" in warn.getMessage()
    assert "leaf 1: ((4,), 'float32', False) -> ((1024, 1024), 'float32', False)" in warn.getMessage()
    assert "MORE THAN PLANNED by 4.0 MiB, beyond the margin" in warn.getMessage() and prog.compiles() == 3
    # the run's record of them (benchmarks put it in their rows)
    assert [(r["program"], r["over_plan"]) for r in record] == [("double", False), ("double", True)]
    assert "leaf 0" in record[0]["differs"] and record[1]["bytes"] >= 4 * 2**20
    # a few MiB over the planned program (XLA can give a smaller shape more) is said to be within the margin
    roomy = dataclasses.replace(plan, margin=2**30)
    watch_late_compiles(roomy, [prog])
    with caplog.at_level(logging.DEBUG, logger="jaxppo"):
        prog(jnp.ones(4), jnp.ones((1024, 1025)))
    assert "MORE THAN PLANNED by 4.0 MiB, within the 1.0 GiB margin" in caplog.records[-1].getMessage()
    # a program that cannot fit JAX's share beside the states at all: a clear error before it runs out of memory
    from jaxppo.errors import ConfigError

    tight = Plan({"states": 2**20}, [Phase("double", None, None, small, 4096, 1)], 0, 2**30, 2**21, None,
                 memory.TokenBudgets(0, 0, 0, 0))
    watch_late_compiles(tight, [prog])
    with pytest.raises(ConfigError, match=r"double was compiled after the start .*leaf 0.* more than JAX's share"):
        prog(jnp.ones(8), jnp.ones((1024, 1024)))


def test_short_responses_pack_within_the_planned_shape_and_its_memory(tmp_path, one_device):
    """Responses much shorter than the plan's worst case (full-length) fit more sequences into a row: held to the
    plan's shape, the rows get no more runs, slots or tokens than the program the plan measured, so the program
    compiled for them needs no more memory than the planned one; without the caps the same batch packs into a
    row with more runs than planned (the test can fail)."""
    from jaxppo.packing import pack
    from jaxppo.plan_search import _fake_batch
    from jaxppo.programs import abstract

    prep = prepared(tmp_path, *PACKED, "data.max_response_length=24", "actor.log_prob_max_token_len_per_device=192")
    b, plan = prep.build, prep.plan
    what = "actor.log_prob_max_token_len_per_device"
    planned = plan.packed_shapes()[what]
    phase = next(p for p in plan.phases if p.name == "actor forward")
    shortest = min(len(ids) for ids in prep.train_ds.input_ids)
    batch = _fake_batch(16, 48, 24, shortest)
    batch["attention_mask"][:, 48 + 2:] = 0  # two response tokens each: many sequences per row
    batch["response_mask"][:, 2:] = 0
    free = pack(batch, 24, 192, b.actor.batch_shards, what)
    assert free.shape_key[3] > planned[3], (free.shape_key, planned)
    b.actor.hold_to_plan(plan.packed_shapes())
    held = b.actor.pack(batch, 192, what)
    _, slots, row, runs = held.shape_key
    assert slots <= planned[1] and row <= planned[2] and runs <= planned[3], (held.shape_key, planned)
    mem = b.actor.compile_logprobs(b.actor_state.params, b.actor_frozen, abstract(b.actor.shard_packed(held)), False,
                                   b.truncation, False)
    assert mem.temps + mem.outputs <= phase.memory.temps + phase.memory.outputs


def test_a_run_packs_its_rows_within_the_shapes_the_plan_compiled(tmp_path, one_device):
    """The trainer holds each packed phase's rows to the shape the plan compiled at that budget (the caps above), and
    its steps run within them."""
    from jaxppo.packing import Caps
    from jaxppo.train import make_engine_factory
    from jaxppo.trainer import PPOTrainer

    cfg = load_config(ROOT / "configs" / "default.yaml",
                      [f"trainer.default_local_dir={tmp_path / 'run'}", *PACKED, "trainer.sft_warmup_steps=0",
                       "trainer.total_training_steps=3", "trainer.test_freq=-1", "data.max_response_length=24",
                       "actor.ppo_max_token_len_per_device=96", "actor.log_prob_max_token_len_per_device=192"])
    with PPOTrainer(cfg, make_engine_factory(cfg)) as trainer:
        planned = trainer.plan.packed_shapes()
        assert set(planned) == {"actor.ppo_max_token_len_per_device", "actor.log_prob_max_token_len_per_device"}
        assert trainer.actor._shape_caps == {what: Caps.of(key) for what, key in planned.items()}
        trainer.fit()
        seen = {what: set(keys) for what, keys in trainer.actor._packed_shapes.items()}
    for what, (_, slots, row, runs) in planned.items():
        assert seen[what], what
        for key in seen[what]:
            assert key[1] <= slots and key[2] <= row and key[3] <= runs, (what, key, planned[what])
