"""Several processes joined by jax.distributed (gloo on localhost): `python -m jaxppo.launch` runs the same
PPO steps as one process with the same global batch, and a dead process ends the run, not a hang."""

import os
import signal
import subprocess
import sys
import time

import pytest

from jaxppo.distributed import topology_from_env
from tests.train_helpers import (FAST, ROOT, comparable, logged_step, read_metrics, run_python, train_env,
                                 wait_until)

# greedy rollouts (the transformers engine samples with one torch RNG per process, so sampled rollouts
# differ with the process count), no shuffling: the same sequences in the same mini-batches either way
SAME = [*FAST, "trainer.total_training_steps=2", "trainer.sft_warmup_steps=0", "rollout.temperature=0",
        "actor.shuffle=false", "critic.shuffle=false", "trainer.test_freq=2", "mesh.data=-1", "trainer.seed=4"]


def _env(devices: int) -> dict:
    # the suite's other worker keeps both cores busy: a process's heartbeat can wait longer than JAX's 100 s (a
    # fresh-clone CI run at a0aed1f lost the packed two-process run to it, both tasks declared dead at 100 s)
    return train_env(devices, JAX_PLATFORMS="cpu", JAXPPO_HEARTBEAT_TIMEOUT_S="900")


# the adaptive KL controller in the reward: its horizon counts the step's samples over all processes (it once
# counted one process's), so its coefficient is compared like every other metric
ADAPTIVE = ["algorithm.use_kl_in_reward=true", "algorithm.kl_ctrl.type=adaptive", "algorithm.kl_ctrl.horizon=10",
            "algorithm.kl_ctrl.kl_coef=0.1"]
PACKED = ["actor.use_dynamic_bsz=true", "critic.use_dynamic_bsz=true", "actor.ppo_max_token_len_per_device=128",
          "actor.log_prob_max_token_len_per_device=128", "critic.ppo_max_token_len_per_device=128",
          "critic.forward_max_token_len_per_device=128"]


@pytest.fixture(scope="module")
def one_process_run(tmp_path_factory):
    """The reference: one process, two devices, padded (packed == padded is tests/test_packing.py's)."""
    one = tmp_path_factory.mktemp("one")
    run_python("-m", "jaxppo.train", f"trainer.default_local_dir={one}", *SAME, *ADAPTIVE, env=_env(2))
    return one


# fsdp across the two processes, parameters gathered once per update, gradients reduce-scattered once
FSDP_ONCE = ["mesh.data=1", "mesh.fsdp=2", "mesh.fsdp_gather=update"]


@pytest.mark.slow
# the data split across processes, packed (the committed configs' layout) against one process padded; fsdp across
# the processes, padded (a third case, padded data-parallel, ran 50 s of CI for what these two cover)
@pytest.mark.parametrize("layout", ["packed", "fsdp_update"])
def test_two_processes_match_one(layout, one_process_run, tmp_path):
    one, two = one_process_run, tmp_path / "two"
    args = SAME + ADAPTIVE + {"packed": PACKED, "fsdp_update": FSDP_ONCE}[layout]
    res = subprocess.run([sys.executable, "-m", "jaxppo.launch", "--nproc", "2", "--",
                          f"trainer.default_local_dir={two}", *args],
                         cwd=ROOT, env=_env(1), capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stderr[-6000:]
    assert res.stderr.count("jaxppo.launch: process") == 2
    a, b = read_metrics(one), read_metrics(two)
    assert sorted(a) == sorted(b) == [0, 1, 2]
    assert "val/score" in b[0] and "actor/pg_loss" in b[2]
    # step 1: reference == policy, so the KL is 0 and the error clips at -0.2; the horizon counts 8 prompts x 2
    # samples = 16 (one process's 8 would give 0.1 x (1 - 0.2 x 8 / 10) = 0.084)
    assert b[1]["actor/kl_coef"] == pytest.approx(0.1 * (1 - 0.2 * 16 / 10), rel=1e-6)
    assert b[2]["actor/kl_coef"] != b[1]["actor/kl_coef"]  # the controller moves
    for step in (0, 1, 2):
        ra, rb = comparable(a[step]), comparable(b[step])
        assert ra.keys() == rb.keys(), step
        for k in ra:
            assert rb[k] == pytest.approx(ra[k], rel=1e-4, abs=1e-5), (step, k)
    assert (two / "checkpoints" / "2").is_dir()


@pytest.mark.slow
def test_a_dead_process_stops_the_others(tmp_path):
    run = tmp_path / "run"
    proc = subprocess.Popen([sys.executable, "-m", "jaxppo.launch", "--nproc", "2", "--grace", "5", "--",
                             f"trainer.default_local_dir={run}", *SAME, "trainer.total_training_steps=200"],
                            cwd=ROOT, env=_env(1), stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True)
    pids = []
    while len(pids) < 2:
        line = proc.stderr.readline()
        assert line, "launcher ended before starting its processes"
        if line.startswith("jaxppo.launch: process"):
            pids.append(int(line.split("pid")[1]))
    wait_until(lambda: logged_step(run, 1), proc, "step 1")
    os.kill(pids[1], signal.SIGKILL)
    t0 = time.monotonic()
    rest = proc.communicate(timeout=120)[1]
    assert time.monotonic() - t0 < 60  # grace 5 s + reaping, not a hang
    assert proc.returncode != 0
    assert "process 1 exited with code -9; stopping the other 1" in rest
    with pytest.raises(ProcessLookupError):
        os.kill(pids[0], 0)


def test_topology_from_launcher_torchrun_and_slurm_environments():
    t = topology_from_env({"JAXPPO_COORDINATOR": "h:1", "JAXPPO_NUM_PROCESSES": "4", "JAXPPO_PROCESS_ID": "2",
                           "JAXPPO_LOCAL_DEVICE_IDS": "2"})
    assert (t.coordinator, t.num_processes, t.process_id, t.local_device_ids) == ("h:1", 4, 2, (2,))
    # torchrun / SLURM: the rank's GPU is moved to the front of CUDA_VISIBLE_DEVICES, so JAX takes device 0 like
    # torch and vLLM do (before: local_device_ids=(LOCAL_RANK,), another GPU than vLLM's cuda:0 after reordering)
    t = topology_from_env({"MASTER_ADDR": "m", "MASTER_PORT": "29500", "WORLD_SIZE": "8", "RANK": "5",
                           "LOCAL_RANK": "1"})
    assert (t.coordinator, t.num_processes, t.process_id, t.local_device_ids) == ("m:29500", 8, 5, (0,))
    t = topology_from_env({"MASTER_ADDR": "m", "MASTER_PORT": "1", "SLURM_NTASKS": "2", "SLURM_PROCID": "1",
                           "SLURM_LOCALID": "0"})
    assert (t.num_processes, t.process_id, t.local_device_ids) == (2, 1, (0,))
    assert topology_from_env({}) is None


def test_each_torchrun_or_slurm_rank_gets_its_own_gpu_first():
    from jaxppo.distributed import own_gpu_first

    torchrun = {"MASTER_ADDR": "m", "MASTER_PORT": "1", "WORLD_SIZE": "4", "CUDA_VISIBLE_DEVICES": "4,5,6,7"}
    orders = [own_gpu_first(dict(torchrun, RANK=str(r), LOCAL_RANK=str(r))) for r in range(4)]
    assert orders == ["4,5,6,7", "5,6,7,4", "6,7,4,5", "7,4,5,6"]
    assert len({o.split(",")[0] for o in orders}) == 4  # device 0 of each rank is a different GPU
    slurm = {"SLURM_NTASKS": "2", "SLURM_PROCID": "1", "SLURM_LOCALID": "1", "CUDA_VISIBLE_DEVICES": "0,1"}
    assert own_gpu_first(slurm) == "1,0"
    launched = dict(torchrun, LOCAL_RANK="2", JAXPPO_NUM_PROCESSES="4")  # jaxppo.launch reordered already
    assert own_gpu_first(launched) is None


def test_mesh_sweep_prints_one_row_per_mesh(tmp_path):
    out = tmp_path / "sweep.json"
    res = run_python("scripts/mesh_sweep.py", "--model", "tiny", "--meshes", "single;fsdp=2,gather=update", "--batch",
                     "4", "--seq", "16", "--steps", "1", "--json-out", str(out), env=_env(2))
    import json

    rows = json.loads(out.read_text())
    assert [r["mesh"] for r in rows] == ["single", "fsdp=2,gather=update"]
    assert [r["devices"] for r in rows] == [1, 2]
    for r in rows:
        assert r["step_s"] > 0 and r["update_tokens_per_s"] > 0 and 0 < r["mfu_actor"] < 1
    assert "vs 1 dev" in res.stdout


def test_launcher_puts_each_process_gpu_first():
    from jaxppo.launch import gpu_env

    envs = [gpu_env(i, ["2", "3", "5"]) for i in range(3)]
    assert [e["CUDA_VISIBLE_DEVICES"] for e in envs] == ["2,3,5", "3,5,2", "5,2,3"]
    assert all(e["JAXPPO_LOCAL_DEVICE_IDS"] == "0" for e in envs)


def test_a_torchrun_rank_sees_its_own_gpu_first_before_jax_starts(monkeypatch):
    """initialize_from_env under torchrun: CUDA_VISIBLE_DEVICES is reordered (rank 1 of 2: GPU 1 first) before
    jax.distributed.initialize, which then gets this process's first visible GPU."""
    import jax

    from jaxppo.distributed import initialize_from_env

    seen = {}
    env = {"WORLD_SIZE": "2", "RANK": "1", "LOCAL_RANK": "1", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29999",
           "CUDA_VISIBLE_DEVICES": "0,1", "JAX_PLATFORMS": "cuda"}
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    monkeypatch.delenv("JAXPPO_NUM_PROCESSES", raising=False)
    monkeypatch.setenv("JAXPPO_HEARTBEAT_TIMEOUT_S", "321")
    monkeypatch.setattr(jax.config, "update", lambda *a: None)
    monkeypatch.setattr(jax.distributed, "initialize", lambda **kw: seen.update(
        kw, visible=os.environ["CUDA_VISIBLE_DEVICES"]))
    topo = initialize_from_env()
    assert topo.num_processes == 2 and topo.process_id == 1
    assert seen["visible"] == "1,0" and seen["local_device_ids"] == [0] and seen["process_id"] == 1
    assert seen["heartbeat_timeout_seconds"] == 321  # JAXPPO_HEARTBEAT_TIMEOUT_S reaches jax.distributed


@pytest.mark.parametrize("override,message", [
    ("data.train_batch_size=9", "data.train_batch_size (9) does not split over 2 processes"),
    ("actor.ppo_mini_batch_size=3", "actor.ppo_mini_batch_size x rollout.n does not split over 2 processes"),
])
def test_validate_processes_refuses_batches_that_do_not_split(override, message):
    from jaxppo.config import load_config, validate_processes
    from jaxppo.errors import ConfigError

    base = ["data.train_batch_size=12", "actor.ppo_mini_batch_size=6", "critic.ppo_mini_batch_size=6",
            "rollout.n=1", "actor.ppo_micro_batch_size_per_device=1", "critic.ppo_micro_batch_size_per_device=1"]
    validate_processes(load_config(None, base), 2)  # splits: no error
    cfg = load_config(None, [*base, override] if "train_batch" not in override else
                      [*base, override, "actor.ppo_mini_batch_size=9", "critic.ppo_mini_batch_size=9"])
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)")):
        validate_processes(cfg, 2)
