"""Sharded engine: mesh invariance, micro-batch invariance, chunked log-probs, two real processes."""

import os
import pickle
import subprocess
import sys
from pathlib import Path

import jax
import numpy as np
import pytest

from jaxppo import ppo
from jaxppo.config import OptimConfig
from jaxppo.engine import lr_schedule
from jaxppo.models import load_model
from jaxppo.sharding import make_mesh
from tests.engine_case import R_LEN, make_batch, run_case

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


@pytest.mark.parametrize("mode", list(ppo.LOSS_AGG_MODES))
def test_micro_batch_invariance(tiny_qwen, mode):
    mesh = single_device_mesh()
    runs = {m: run_case(tiny_qwen, mesh, micro_per_device=m, mode=mode) for m in (1, 2, 4)}
    assert runs[1]["actor/grad_norm"] > 0 and runs[1]["critic/grad_norm"] > 0
    assert_same(runs[2], runs[1])
    assert_same(runs[4], runs[1])


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
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=4", JAX_PLATFORMS="cpu",
               PYTHONPATH=str(ROOT))
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


def test_data_parallel_gradients_reduced_once_per_mini_batch(tiny_qwen):
    """Pure data parallelism: no all-reduce inside the micro-batch loop, only after it (compiled HLO)."""
    import re

    from jaxppo.config import ActorConfig
    from jaxppo.engine import ActorEngine

    module, params, cfg = load_model(tiny_qwen, mesh=make_mesh({"data": 8}))
    mesh = make_mesh({"data": 8})
    engine = ActorEngine(module, mesh, ActorConfig(ppo_micro_batch_size_per_device=1, logprob_chunk_size=8,
                                                   optim=OptimConfig(lr=1e-3)), R_LEN)
    assert engine.local_accumulation
    parts = [make_batch(cfg.vocab_size, seed=i) for i in range(4)]
    batch = engine.shard_batch({k: np.concatenate([p[k] for p in parts]) for k in parts[0]})  # 4 micro-batches
    state = engine.init_state(params)
    engine.update(state, batch)
    with engine._ctx():
        hlo = engine._update_jit.lower(engine.init_state(params), batch).compile().as_text()
    computations = re.split(r"\n(?=\S)", hlo)
    entry = next(c for c in computations if c.startswith("ENTRY"))
    inner = [c.split("\n")[0][:80] for c in computations if not c.startswith("ENTRY") and "all-reduce" in c]
    assert " while(" in entry  # the micro-batch scan is a loop in the compiled program
    assert "all-reduce" in entry and not inner, inner
