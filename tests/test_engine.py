"""Sharded engine: mesh invariance, micro-batch invariance, chunked log-probs, two real processes."""

import pickle
import subprocess
import sys
from pathlib import Path

import jax
import numpy as np
import pytest

from jaxppo import ppo
from jaxppo.config import ActorConfig, OptimConfig
from jaxppo.engine import ActorEngine, lr_schedule
from jaxppo.models import load_model
from jaxppo.sharding import make_mesh
from tests.engine_case import R_LEN, make_batch, run_case
from tests.train_helpers import train_env

ROOT = Path(__file__).resolve().parents[1]
# fp32 throughout; reductions run in a different order on each mesh, so results agree to rounding (~1e-6)
PARAM_TOL, LOSS_TOL = 5e-5, 1e-5


def single_device_mesh():
    return make_mesh({"data": 1}, devices=jax.devices()[:1])


def assert_same(a, b, tol=PARAM_TOL):
    for k in a:
        if k.endswith("_params"):
            jax.tree.map(lambda x, y: np.testing.assert_allclose(x, y, atol=tol, err_msg=k), a[k], b[k])
        else:
            np.testing.assert_allclose(a[k], b[k], atol=LOSS_TOL, rtol=1e-5, err_msg=k)


@pytest.fixture(scope="module")
def reference(tiny_qwen):
    return run_case(tiny_qwen, single_device_mesh(), micro_per_device=8)


@pytest.mark.parametrize("shape", [{"data": 8}, {"fsdp": 8}, {"tensor": 2, "data": 4},
                                   {"data": 2, "fsdp": 2, "tensor": 2}])
def test_mesh_invariance(tiny_qwen, reference, shape):
    assert_same(run_case(tiny_qwen, make_mesh(shape), micro_per_device=1), reference)


@pytest.mark.parametrize("shape", [{"fsdp": 8}, {"data": 2, "fsdp": 4}])
def test_mesh_invariance_gathering_once_per_update(tiny_qwen, reference, shape):
    """fsdp_gather=update: whole parameters per device, gradients reduce-scattered once per mini-batch."""
    assert_same(run_case(tiny_qwen, make_mesh(shape), micro_per_device=1, fsdp_gather="update"), reference)


def test_bf16_gradient_reduction(tiny_qwen, reference):
    """mesh.grad_reduce_dtype=bfloat16: each device's gradient sum is rounded to bf16 before the sum across
    devices: the same update to bf16 precision, not bit-equal; refused where devices hold shards."""
    from jaxppo.errors import ConfigError

    out = run_case(tiny_qwen, make_mesh({"data": 4, "fsdp": 2}), micro_per_device=1, fsdp_gather="update",
                   grad_reduce_dtype="bfloat16")
    for k in ("actor/grad_norm", "critic/grad_norm"):
        np.testing.assert_allclose(out[k], reference[k], rtol=1e-2)
    assert abs(float(out["actor/grad_norm"]) - float(reference["actor/grad_norm"])) > 1e-7  # really rounded
    module, _, _ = load_model(tiny_qwen)
    with pytest.raises(ConfigError, match="grad_reduce_dtype"):
        ActorEngine(module, make_mesh({"fsdp": 8}), ActorConfig(), R_LEN, grad_reduce_dtype="bfloat16")


# one mode per normaliser the engine passes (token count, sequence count, a constant); every mode's micro-batch
# sums are checked against float64 in tests/ppo/test_losses.py
@pytest.mark.parametrize("mode", ["token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm"])
def test_micro_batch_invariance(tiny_qwen, reference, mode):
    """Eight micro-batches of one row give the update of one micro-batch of eight (token-mean's is `reference`)."""
    mesh = single_device_mesh()
    whole = reference if mode == "token-mean" else run_case(tiny_qwen, mesh, micro_per_device=8, mode=mode)
    rows = run_case(tiny_qwen, mesh, micro_per_device=1, mode=mode)
    assert rows["actor/grad_norm"] > 0 and rows["critic/grad_norm"] > 0
    assert_same(rows, whole)


@pytest.mark.parametrize("shape", [{"data": 1}, {"fsdp": 8}, {"tensor": 2, "data": 4}])
def test_micro_batches_summed_by_the_host_give_the_scans_update(tiny_qwen, reference, shape):
    """model.micro_batch_loop=host (one program per micro-batch, the sum donated from one to the next, then the
    optimizer step): eight micro-batches of one row give the update of one micro-batch of eight, on one device and
    where the partitioner places the gradients (fsdp gathered per layer, tensor parallelism)."""
    devices = jax.devices()[:1] if shape == {"data": 1} else None
    out = run_case(tiny_qwen, make_mesh(shape, devices=devices), micro_per_device=1, micro_batch_loop="host")
    assert_same(out, reference)


@pytest.mark.parametrize("shape, fsdp_gather, reduce_dtype", [
    ({"data": 2}, "layer", "float32"), ({"fsdp": 2}, "update", "float32"),
    ({"data": 2, "fsdp": 2}, "update", "float32"), ({"data": 2}, "layer", "bfloat16")])
def test_the_host_loop_where_each_device_sums_its_own_gradients(tiny_qwen, reference, shape, fsdp_gather,
                                                                reduce_dtype):
    """Data parallel and gather-once fsdp (each device holds whole parameters): the host loop keeps a sum per device
    between its programs and reduces it once, in the optimizer step's; micro-batches of one row (two or four per
    device) give the update of one micro-batch of eight, and equal the scan's on the same mesh (with the bf16
    reduction too, which rounds each device's sum before the sum across devices in both)."""
    from jaxppo.accumulate import HostLoop

    mesh = make_mesh(shape, devices=jax.devices()[:int(np.prod(list(shape.values())))])
    engines = []
    out = run_case(tiny_qwen, mesh, micro_per_device=1, micro_batch_loop="host", fsdp_gather=fsdp_gather,
                   grad_reduce_dtype=reduce_dtype, engines=engines)
    assert all(isinstance(e._update_jit, HostLoop) and e.local_accumulation for e in engines)
    scan = run_case(tiny_qwen, mesh, micro_per_device=1, fsdp_gather=fsdp_gather, grad_reduce_dtype=reduce_dtype)
    # the bf16 reduction: a last-bit difference in a device's float32 sum (the two programs fuse differently) can
    # round it to the neighbouring bf16 value
    assert_same(out, scan, tol=1e-6 if reduce_dtype == "float32" else PARAM_TOL)
    if reduce_dtype == "float32":
        assert_same(out, reference)
    else:
        for k in ("actor/grad_norm", "critic/grad_norm"):
            np.testing.assert_allclose(out[k], reference[k], rtol=1e-2)


def test_chunked_logprobs_match_full_softmax(tiny_qwen, reference):
    module, params, cfg = load_model(tiny_qwen)
    b = make_batch(cfg.vocab_size)
    logits = module.apply({"params": params}, b["input_ids"], b["positions"], b["attention_mask"],
                          method="forward_logits")[:, -R_LEN - 1:-1]
    logp = jax.nn.log_softmax(logits, -1)
    expected = np.take_along_axis(np.asarray(logp), b["input_ids"][:, -R_LEN:, None], -1)[..., 0]
    np.testing.assert_allclose(reference["logprobs"], expected, atol=2e-5)
    np.testing.assert_allclose(reference["entropy"], np.asarray(ppo.entropy_from_logits(logits)), atol=2e-5)


def test_update_changes_parameters_and_reports_metrics(tiny_qwen, reference):
    _, params, _ = load_model(tiny_qwen)
    moved = np.abs(reference["actor_params"]["model"]["norm"]["weight"] - np.asarray(params["model"]["norm"]["weight"]))
    assert moved.max() > 1e-4
    for k in ("pg_loss", "pg_clipfrac", "ppo_kl", "entropy", "grad_norm", "lr", "kl_loss"):
        assert np.isfinite(reference[f"actor/{k}"]), k
    for k in ("vf_loss", "vf_clipfrac", "vpred_mean", "grad_norm"):
        assert np.isfinite(reference[f"critic/{k}"]), k
    assert reference["actor/lr"] == pytest.approx(1e-2)


def test_lr_schedule_warmup_then_cosine():
    s = lr_schedule(OptimConfig(lr=1.0, lr_warmup_steps=10, lr_schedule="cosine", min_lr_ratio=0.1), 110)
    assert float(s(0)) == 0.0 and float(s(5)) == pytest.approx(0.5) and float(s(10)) == pytest.approx(1.0)
    assert float(s(60)) == pytest.approx(0.1 + 0.9 * 0.5, rel=1e-5) and float(s(110)) == pytest.approx(0.1)


@pytest.mark.slow
def test_two_processes_match_one(tiny_qwen, reference, tmp_path):
    """Two CPU processes (4 devices each) joined by jax.distributed over localhost = one process."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = train_env(4, JAX_PLATFORMS="cpu")
    procs = [subprocess.Popen([sys.executable, str(ROOT / "tests/multiprocess_worker.py"), str(tiny_qwen),
                               f"127.0.0.1:{port}", str(rank), str(tmp_path / f"out{rank}.pkl")], env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for rank in range(2)]
    try:
        outs = [p.communicate(timeout=300)[0] for p in procs]
    finally:
        for p in procs:
            p.kill()
    assert all(p.returncode == 0 for p in procs), "\n".join(o[-3000:] for o in outs)
    for rank in range(2):
        with open(tmp_path / f"out{rank}.pkl", "rb") as f:
            assert_same(pickle.load(f), reference)


COLLECTIVES = ("all-reduce", "all-gather", "reduce-scatter", "all-to-all", "collective-permute")


def _collectives_inside_loops(hlo: str) -> tuple[list[str], bool]:
    """(collectives in the body of any while loop or what it calls, whether any collective runs outside)."""
    import re

    comps = {c.split(" ", 2)[1 if c.startswith("ENTRY") else 0].lstrip("%"): c for c in re.split(r"\n(?=\S)", hlo)
             if c.startswith(("%", "ENTRY"))}
    calls = r"(?:body|condition|calls|to_apply|branch_computations|called_computations)=\{?([^}\s,]+(?:, %[^}\s,]+)*)"
    callees = lambda text: set(re.findall(r"%([\w.\-]+)", " ".join(re.findall(calls, text))))
    bodies = {n for c in comps.values() for n in re.findall(r"body=%([\w.\-]+)", c)}
    assert bodies  # the micro-batch loop is a loop in the compiled program
    seen, todo = set(), list(bodies)
    while todo:
        n = todo.pop()
        if n not in seen and n in comps:
            seen.add(n)
            todo.extend(callees(comps[n]))
    hits = lambda c: [l.strip()[:100] for l in c.split("\n")[1:] if any(f" {k}" in l for k in COLLECTIVES)]
    inner = [h for n in seen for h in hits(comps[n])]
    return inner, any(hits(c) for n, c in comps.items() if n not in seen)


@pytest.mark.parametrize("shape,gather,once", [({"data": 8}, "layer", True), ({"data": 2, "fsdp": 4}, "update", True),
                                               ({"data": 2, "fsdp": 4}, "layer", False)])
def test_collectives_once_per_mini_batch(tiny_qwen, shape, gather, once):
    """Whole parameters per device (pure data parallelism, or fsdp gathered once per update): no collective
    inside the micro-batch loop of the compiled update or forward pass, only before / after it. fsdp
    gathered per layer (the contrast) has them inside."""
    from jaxppo.config import ActorConfig
    from jaxppo.engine import ActorEngine

    mesh = make_mesh(shape)
    module, params, cfg = load_model(tiny_qwen, mesh=mesh)
    acfg = ActorConfig(ppo_micro_batch_size_per_device=1, log_prob_micro_batch_size_per_device=1, logprob_chunk_size=8,
                       optim=OptimConfig(lr=1e-3))
    engine = ActorEngine(module, mesh, acfg, R_LEN, fsdp_gather=gather)
    assert engine.local_accumulation == once
    parts = [make_batch(cfg.vocab_size, seed=i) for i in range(4)]
    batch = engine.shard_batch({k: np.concatenate([p[k] for p in parts]) for k in parts[0]})  # 4 micro-batches
    engine.logprobs(params, batch)
    engine.update(engine.init_state(params), batch)
    with engine._ctx():
        update_hlo = engine._update_jit.compile(engine.init_state(params), batch, engine._extra()).as_text()
        forward_hlo = engine._forward_jit.compile(params, engine.frozen, batch, False, None).as_text()
    inner, entry = _collectives_inside_loops(update_hlo)
    assert entry and (not inner) == once, inner
    if "fsdp" in shape:
        inner, entry = _collectives_inside_loops(forward_hlo)
        assert entry and (not inner) == once, inner


@pytest.mark.parametrize("shape", [{"fsdp": 8}, {"tensor": 2, "data": 4}])
def test_optimizer_state_sharded_like_parameters(tiny_qwen, shape):
    """Adam's moments live in their parameters' shardings (an fsdp device holds 1/fsdp of them), at
    creation and after an update: left to the partitioner they came out replicated, so fsdp saved no
    optimizer memory (a 7B actor on two H200s did not fit)."""
    import optax

    mesh = make_mesh(shape)
    module, params, cfg = load_model(tiny_qwen, mesh=mesh)
    engine = ActorEngine(module, mesh, ActorConfig(ppo_micro_batch_size_per_device=1, logprob_chunk_size=8,
                                                   optim=OptimConfig(lr=1e-3)), R_LEN)
    state = engine.init_state(params)
    batch = engine.shard_batch({k: np.concatenate([make_batch(cfg.vocab_size, seed=i)[k] for i in range(2)])
                                for k in make_batch(cfg.vocab_size, seed=0)})

    def check(state):
        moments = []
        optax.tree_map_params(engine.tx, lambda m, p: moments.append((m, p)) or m, state.opt_state, state.params)
        assert len(moments) == 2 * len(jax.tree.leaves(params))  # mu and nu for every parameter
        sharded = 0
        for m, p in moments:
            assert m.sharding.is_equivalent_to(p.sharding, m.ndim), (m.sharding, p.sharding)
            assert m.addressable_shards[0].data.shape == p.addressable_shards[0].data.shape
            sharded += m.addressable_shards[0].data.size < m.size
        assert sharded > 0  # the check can fail: some moments really are split across devices

    check(state)
    state, _ = engine.update(state, batch)
    check(state)


@pytest.mark.parametrize("loss_mode, agg, scale", [("vanilla", "token-mean", None), ("gspo", "seq-mean-token-mean", None),
                                                   ("vanilla", "seq-mean-token-sum-norm", 7.0)])
def test_the_actor_update_trains_on_the_configured_loss_with_the_importance_weights(tiny_qwen, loss_mode, agg, scale):
    """The update's pg_loss is the configured policy loss of the engine's own log-probs with the batch's rollout
    importance weights and loss_scale_factor (computed on the host from the same inputs): dropping the weights,
    the loss mode or the scale in engine.py fails this."""
    from jaxppo.config.schema import PolicyLossConfig
    from jaxppo.ppo.policy_losses import compute_policy_loss

    mesh = single_device_mesh()
    module, params, cfg = load_model(tiny_qwen, mesh=mesh)
    acfg = ActorConfig(ppo_micro_batch_size_per_device=8, log_prob_micro_batch_size_per_device=8, logprob_chunk_size=2,
                       loss_agg_mode=agg, use_kl_loss=False, entropy_coeff=0.0, loss_scale_factor=scale,
                       policy_loss=PolicyLossConfig(loss_mode=loss_mode), clip_ratio_low=0.05, clip_ratio_high=0.05,
                       optim=OptimConfig(lr=1e-3))
    actor = ActorEngine(module, mesh, acfg, R_LEN)
    batch = make_batch(cfg.vocab_size)
    rng = np.random.default_rng(3)
    batch["is_weights"] = rng.uniform(0.0, 2.0, batch["response_mask"].shape).astype(np.float32)
    b = actor.shard_batch(batch)
    logprobs, _ = actor.logprobs(params, b)
    _, metrics = actor.update(actor.init_state(params), b)
    mask = batch["response_mask"]
    want, _ = compute_policy_loss(loss_mode, batch["old_logprobs"], np.asarray(logprobs), batch["advantages"], mask,
                                  acfg, agg, is_weights=batch["is_weights"], horizon=scale or R_LEN)
    unweighted, _ = compute_policy_loss(loss_mode, batch["old_logprobs"], np.asarray(logprobs), batch["advantages"],
                                        mask, acfg, agg, horizon=scale or R_LEN)
    assert abs(float(want) - float(unweighted)) > 1e-3  # the weights matter here
    np.testing.assert_allclose(float(metrics["pg_loss"]), float(want), rtol=1e-5, atol=1e-6)
