"""Host offload of the optimizer state (jaxppo/offload.py): the same updates as without it, AdamW's moments in
pinned host memory between them, the memory plan counting them against the host instead of the card."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxppo.config import ActorConfig, OptimConfig
from jaxppo.engine import ActorEngine
from jaxppo.models import load_model
from jaxppo.offload import host_bytes, is_host
from jaxppo.sharding import make_mesh
from tests.engine_case import R_LEN, make_batch


@pytest.mark.parametrize("mesh_axes, loop", [({"data": -1}, "scan"), ({"data": 2, "fsdp": 4}, "scan"),
                                             ({"fsdp": 8}, "host")], ids=["data8", "data2_fsdp4", "fsdp8_host_loop"])
def test_three_updates_with_the_optimizer_state_offloaded_equal_those_without(tiny_qwen, mesh_axes, loop,
                                                                             monkeypatch):
    from jaxppo import offload

    # parameters over 16 KiB step a slice at a time (a 7B's stacked layers: 256 MiB), the rest whole: both paths
    monkeypatch.setattr(offload, "CHUNK_BYTES", 16 << 10)
    mesh = make_mesh(mesh_axes)
    optim = OptimConfig(lr=1e-2, weight_decay=0.01, grad_clip=1.0, eps=1e-3)
    acfg = ActorConfig(ppo_micro_batch_size_per_device=1, log_prob_micro_batch_size_per_device=1, optim=optim,
                       logprob_chunk_size=2, entropy_coeff=0.01, use_kl_loss=False)
    out = {}
    for offloaded in (False, True):
        module, params, cfg = load_model(tiny_qwen, mesh=mesh, dtype=jnp.float32)
        actor = ActorEngine(module, mesh, acfg, R_LEN)
        actor.optimizer_offload = offloaded
        actor.micro_batch_loop = loop  # host: the optimizer step is a program of its own (jaxppo/accumulate.py)
        state = actor.init_state(params)
        sliced = [offload._slices(p, p.sharding)[0] is not None for p in jax.tree.leaves(state.params)]
        assert any(sliced) and not all(sliced)
        moments = [x for x in jax.tree.leaves(state.opt_state) if x.ndim > 0]
        assert moments and all(is_host(x) == offloaded for x in moments)
        for seed in range(3):
            state, _ = actor.update(state, actor.shard_batch(make_batch(cfg.vocab_size, seed)))
            # between updates every moment is in pinned host memory (its sharding's memory kind)
            assert all(x.sharding.memory_kind == ("pinned_host" if offloaded else "device")
                       for x in jax.tree.leaves(state.opt_state) if x.ndim > 0)
        assert all(x.sharding.memory_kind == "device" for x in jax.tree.leaves(state.params))
        held = sum(sh.data.nbytes for x in jax.tree.leaves(state.opt_state) if x.ndim > 0
                   for sh in x.addressable_shards)  # what the moments' buffers take
        out[offloaded] = (jax.tree.map(np.asarray, state.params), host_bytes(state.opt_state), held)
    same = jax.tree.map(lambda a, b: float(np.max(np.abs(a - b))), out[False][0], out[True][0])
    assert max(jax.tree.leaves(same)) <= 1e-6, same
    # the plan's count is what the moments' buffers take: every local device's shard of mu and nu (a replica per
    # data-parallel device; the parameters fsdp does not split, on each of its devices)
    n_params = sum(x.size for x in jax.tree.leaves(out[True][0]))
    assert out[False][1] == 0 and out[True][1] == out[True][2]
    assert 2 * 4 * n_params * mesh.shape["data"] <= out[True][1] <= 2 * 4 * n_params * mesh.devices.size


def test_the_plan_counts_the_moments_on_the_host_and_refuses_what_the_host_cannot_hold(tmp_path, one_device,
                                                                                      monkeypatch):
    from jaxppo import start
    from jaxppo.config import load_config
    from jaxppo.errors import ConfigError
    from jaxppo.host_plan import CAP_ENV, PROCESS_BYTES, plan_host
    from tests.train_helpers import FAST, ROOT

    def prep(*extra):
        cfg = load_config(ROOT / "configs" / "default.yaml", [f"trainer.default_local_dir={tmp_path / 'run'}", *FAST,
                                                              "trainer.device_memory_gb=4", *extra])
        (tmp_path / "run").mkdir(exist_ok=True)  # no staging directory left behind (tests/test_memory_plan.py)
        return start.prepare(cfg, quiet=True).plan

    plain, off = prep(), prep("actor.optimizer_offload=true", "critic.optimizer_offload=true")
    moved = sum(off.host.values())
    assert not plain.host and set(off.host) == {"actor AdamW moments", "critic AdamW moments"}
    assert plain.resident - off.resident == moved > 0  # the card's states shrink by what the host holds
    assert "in host memory" in off.table() and "XLA pinned pool" in off.table()
    assert off.summary()["host_peak"] == off.host_plan.peak == off.host_plan.pool + off.host_plan.process
    assert off.host_plan.pool >= moved and off.host_plan.process == (PROCESS_BYTES if jax.default_backend() == "gpu"
                                                                     else 0)  # the allowance is the GPU process's
    peak = off.host_plan.peak
    with pytest.raises(ConfigError, match="more than 90%.*optimizer_offload"):
        plan_host(off.host, available=int(peak / 0.9) - 2**20).check()
    plan_host(off.host, available=int(peak / 0.9) + 2**20).check()
    # trainer.host_memory_gb stands for the host's RAM, as trainer.device_memory_gb for the card's
    with pytest.raises(ConfigError, match=r"more than 90% of the 0.0 GiB"):
        prep("actor.optimizer_offload=true", "trainer.host_memory_gb=0.00001")
    # a pinned cap the user set below what the states need: refused at start, naming the variable and the value
    monkeypatch.setenv(CAP_ENV, str(moved / 4 / 2**30))
    with pytest.raises(ConfigError, match=f"more pinned host memory.*{CAP_ENV} to at least"):
        prep("actor.optimizer_offload=true", "critic.optimizer_offload=true")


def test_a_run_with_offload_checkpoints_and_resumes_with_the_moments_still_on_the_host(tmp_path, one_device):
    """Two steps with both optimizers offloaded, a checkpoint each; a new trainer resumes from it and its restored
    moments are in pinned host memory again (orbax restores into the state's shardings, memory kind included)."""
    from jaxppo.config import load_config
    from jaxppo.train import make_engine_factory
    from jaxppo.trainer import PPOTrainer
    from tests.train_helpers import FAST, ROOT

    over = [f"trainer.default_local_dir={tmp_path / 'run'}", *FAST, "trainer.sft_warmup_steps=0", "trainer.test_freq=-1",
            "trainer.save_freq=1", "actor.optimizer_offload=true", "critic.optimizer_offload=true"]
    cfg = load_config(ROOT / "configs" / "default.yaml", [*over, "trainer.total_training_steps=2"])
    with PPOTrainer(cfg, make_engine_factory(cfg)) as trainer:
        trainer.fit()
        before = {k: jax.tree.map(np.asarray, getattr(trainer.state, k).opt_state) for k in ("actor", "critic")}
    cfg = load_config(ROOT / "configs" / "default.yaml", [*over, "trainer.total_training_steps=2",
                                                          "trainer.resume_mode=auto"])
    with PPOTrainer(cfg, make_engine_factory(cfg)) as trainer:
        assert trainer.step == 2
        for k in ("actor", "critic"):
            opt = getattr(trainer.state, k).opt_state
            assert all(x.sharding.memory_kind == "pinned_host" for x in jax.tree.leaves(opt) if x.ndim > 0)
            same = jax.tree.map(lambda a, b: bool(np.array_equal(np.asarray(a), b)), opt, before[k])
            assert all(jax.tree.leaves(same))
        # what the states hold: the moments counted in host memory, as the plan counts them, not on the card
        held, plan = trainer.held_memory(), trainer.plan
        for k in ("actor", "critic"):
            assert held[f"{k} AdamW moments (host memory)"] == plan.host[f"{k} AdamW moments"]
            assert held[f"{k} (trained params + AdamW)"] == pytest.approx(
                sum(x.nbytes for x in jax.tree.leaves(getattr(trainer.state, k).params)), abs=64)
        # measured over every live array in host memory (what benchmarks record beside the plan's host figure), once
        # the first run's moments are gone (`before` views their buffers: numpy shares a CPU array's memory)
        import gc

        from jaxppo.offload import host_resident_bytes

        del before
        gc.collect()
        assert host_resident_bytes() == sum(plan.host.values())
