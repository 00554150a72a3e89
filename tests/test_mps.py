"""`rollout.cuda_mps` (jaxppo/mps.py): the run's own CUDA MPS daemon, started before the GPU is touched, named in
the environment every process of the run inherits, and stopped only once the trainer's process has ended. No GPU
here: a stand-in `nvidia-cuda-mps-control` on PATH records how it was called."""

from __future__ import annotations

import os
import select
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from jaxppo import mps
from jaxppo.config import load_config
from jaxppo.errors import ConfigError, JaxppoError

ROOT = Path(__file__).resolve().parent.parent
HELPER = ["rollout.engine=vllm", "rollout.engine_in_trainer=false", "rollout.cuda_mps=true"]


def fake_control(tmp_path: Path, exit_code: int = 0) -> Path:
    """A stand-in control binary: one line per call to $FAKE_MPS_LOG (its arguments, the pipe directory it was
    given, what came on stdin for a command, and whether $FAKE_TRAINER_PID was still running then)."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    exe = bin_dir / mps.CONTROL
    exe.write_text(textwrap.dedent(f"""\
        #!/bin/bash
        state=$(awk '{{print $3}}' /proc/$FAKE_TRAINER_PID/stat 2>/dev/null)
        if [ -n "$state" ] && [ "$state" != Z ]; then alive=1; else alive=0; fi
        if [ "$1" = -d ]; then cmd="-d"; else cmd=$(cat); fi
        if [ "$cmd" = quit ] && [ -n "$FAKE_QUIT_HANGS" ]; then exec sleep 60; fi
        echo "cmd=$cmd pipe=$CUDA_MPS_PIPE_DIRECTORY log=$CUDA_MPS_LOG_DIRECTORY trainer_alive=$alive" >> "$FAKE_MPS_LOG"
        [ {exit_code} = 0 ] || echo "An instance of this daemon is already running"
        exit {exit_code}
        """))
    exe.chmod(0o755)
    return bin_dir


def test_cuda_mps_needs_a_vllm_helper_process():
    """With one process there is nothing to share the card with: refused at load, naming the key."""
    for overrides in (["rollout.cuda_mps=true"], ["rollout.engine=vllm", "rollout.cuda_mps=true"]):
        with pytest.raises(ConfigError, match="rollout.cuda_mps=true needs vLLM in a helper process"):
            load_config(None, overrides)
    assert load_config(None, HELPER).rollout.cuda_mps
    assert load_config(None, ["rollout.engine=vllm", "rollout.engine_processes=2", "rollout.cuda_mps=true"])


def test_a_missing_control_binary_is_refused_naming_the_key(tmp_path, monkeypatch):
    monkeypatch.setenv("PATH", str(tmp_path))
    with pytest.raises(ConfigError, match=f"rollout.cuda_mps=true: {mps.CONTROL} is not on PATH"):
        mps.start(load_config(None, HELPER))
    assert mps.start(load_config(None, HELPER[:2])) is None  # the key off: nothing asked of PATH


def test_a_daemon_that_fails_to_start_leaves_nothing_behind(tmp_path, monkeypatch):
    monkeypatch.setenv("PATH", f"{fake_control(tmp_path, exit_code=1)}:{os.environ['PATH']}")
    monkeypatch.setenv("FAKE_MPS_LOG", str(tmp_path / "calls.log"))
    monkeypatch.setenv("FAKE_TRAINER_PID", str(os.getpid()))
    for k in mps.ENV_KEYS:
        monkeypatch.delenv(k, raising=False)
    monkeypatch.setattr(mps.tempfile, "tempdir", str(tmp_path))  # where the daemon's directory would be
    with pytest.raises(JaxppoError, match="failed \\(exit 1\\): An instance of this daemon is already running"):
        mps.start(load_config(None, HELPER))
    assert not any(k in os.environ for k in mps.ENV_KEYS)
    assert not list(tmp_path.glob("jaxppo-mps-*"))


def test_the_daemon_serves_the_whole_run_and_quits_after_the_trainer_ends(tmp_path):
    """The trainer's process starts the daemon (`-d`) with a directory of its own, a process it starts sees the
    same directory, and `quit` reaches the daemon only once the trainer's process has ended; the directory is
    removed then. A `start` that stopped the daemon itself, or never, fails here."""
    calls = tmp_path / "calls.log"
    env = dict(os.environ, PATH=f"{fake_control(tmp_path)}:{os.environ['PATH']}", FAKE_MPS_LOG=str(calls),
               PYTHONPATH=str(ROOT))
    trainer = textwrap.dedent(f"""\
        import os, subprocess, sys
        os.environ["FAKE_TRAINER_PID"] = str(os.getpid())
        from jaxppo import mps
        from jaxppo.config import load_config
        watcher = mps.start(load_config(None, {HELPER!r}))
        child = subprocess.run([sys.executable, "-c", "import os; print(os.environ['CUDA_MPS_PIPE_DIRECTORY'])"],
                               stdout=subprocess.PIPE, text=True, check=True).stdout.strip()
        print(watcher.pid, os.environ["CUDA_MPS_PIPE_DIRECTORY"], child)
        """)
    out = subprocess.run([sys.executable, "-c", trainer], env=env, stdout=subprocess.PIPE, text=True, check=True,
                         cwd=tmp_path).stdout.split()
    watcher_pid, where, seen_by_child = int(out[-3]), out[-2], out[-1]
    try:
        ready, _, _ = select.select([os.pidfd_open(watcher_pid)], [], [], 120)
        assert ready, "the watcher did not end within 120 s of the trainer's exit"
    except ProcessLookupError:
        pass  # it has ended already
    lines = calls.read_text().splitlines()
    assert lines == [f"cmd=-d pipe={where} log={where} trainer_alive=1",
                     f"cmd=quit pipe={where} log={where} trainer_alive=0"]
    assert seen_by_child == where and Path(where).name.startswith("jaxppo-mps-")
    assert not Path(where).exists()


def test_a_daemon_that_does_not_answer_quit_is_named_with_the_command_to_stop_it(tmp_path):
    """The watcher waits QUIT_TIMEOUT_S for the daemon's answer to `quit`; past it, the run's stderr gets the command
    that stops the daemon by hand (not a traceback), and the directory the daemon may still use is kept."""
    env = dict(os.environ, PATH=f"{fake_control(tmp_path)}:{os.environ['PATH']}", FAKE_MPS_LOG=str(tmp_path / "log"),
               FAKE_QUIT_HANGS="1", PYTHONPATH=str(ROOT))
    trainer = textwrap.dedent(f"""\
        import os
        os.environ["FAKE_TRAINER_PID"] = str(os.getpid())
        from jaxppo import mps
        from jaxppo.config import load_config
        mps.QUIT_TIMEOUT_S = 1.0
        mps.start(load_config(None, {HELPER!r}))
        print(os.environ["CUDA_MPS_PIPE_DIRECTORY"])
        """)
    # stderr stays open in the watcher until it has ended: run() returns once the watcher has given up on the daemon
    proc = subprocess.run([sys.executable, "-c", trainer], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                          text=True, check=True, cwd=tmp_path, timeout=50)
    where = proc.stdout.split()[-1]
    assert (f"the run's MPS daemon did not quit (no answer to quit within 1 s); stop it with "
            f"`echo quit | CUDA_MPS_PIPE_DIRECTORY={where} ") in proc.stderr
    assert "Traceback" not in proc.stderr
    assert Path(where).is_dir()
    import shutil

    shutil.rmtree(where)  # kept for a daemon that may still run; here there is none


def test_a_trainer_built_without_the_daemon_is_refused(monkeypatch):
    """PPOTrainer built directly (not through `python -m jaxppo.train`) with rollout.cuda_mps=true and no daemon named
    in the environment: refused before JAX starts, naming what to call. With a daemon named (the run's or the
    user's), or in the plan's child, nothing is asked."""
    from jaxppo.trainer import PPOTrainer

    for k in mps.ENV_KEYS:
        monkeypatch.delenv(k, raising=False)
    with pytest.raises(ConfigError, match="no MPS daemon is named .*jaxppo.memory.before_the_gpu"):
        PPOTrainer(load_config(None, HELPER), engine_factory=None)
    mps.check_started(load_config(None, [*HELPER, "trainer.plan_only=true"]))
    mps.check_started(load_config(None, HELPER[:2]))
    monkeypatch.setenv(mps.ENV_KEYS[0], "/tmp/somewhere")
    mps.check_started(load_config(None, HELPER))


def test_a_plan_only_run_starts_no_daemon(tmp_path, monkeypatch):
    """The memory plan's child (`trainer.plan_only=true`) runs under its parent's daemon: it starts none."""
    monkeypatch.setenv("PATH", str(tmp_path))  # no control binary: a start would raise
    assert mps.start(load_config(None, [*HELPER, "trainer.plan_only=true"])) is None


def test_the_cli_starts_the_daemon_before_the_memory_plan(tmp_path, monkeypatch):
    """`python -m jaxppo.train`: the daemon comes first, before the plan's child (the first process to touch the
    GPU), so that every process of the run is its client."""
    from jaxppo import memory, train

    order = []

    class Planned(Exception):
        pass

    def plans_in_a_child(cfg):
        order.append("plan")
        raise Planned

    monkeypatch.setattr(mps, "start", lambda cfg: order.append(("mps", cfg.rollout.cuda_mps)))
    monkeypatch.setattr(memory, "plans_in_a_child", plans_in_a_child)
    with pytest.raises(Planned):
        train.main([*HELPER, f"trainer.default_local_dir={tmp_path / 'run'}"])
    assert order == [("mps", True), "plan"]


def test_the_trainers_priority_needs_mps_and_every_engine_in_a_helper():
    """`rollout.cuda_mps_trainer_priority=below_normal` is the trainer's process's place among the daemon's clients:
    refused without the daemon, and with an engine in the trainer's process (it would take that priority too)."""
    low = "rollout.cuda_mps_trainer_priority=below_normal"
    assert load_config(None, [*HELPER, low]).rollout.cuda_mps_trainer_priority == "below_normal"
    for overrides in ([*HELPER[:2], low],
                      ["rollout.engine=vllm", "rollout.engine_processes=2", "rollout.cuda_mps=true", low]):
        with pytest.raises(ConfigError, match="rollout.cuda_mps_trainer_priority=below_normal needs "
                                              "rollout.cuda_mps=true and every engine in a helper process"):
            load_config(None, overrides)
    with pytest.raises(ConfigError, match="rollout.cuda_mps_trainer_priority"):
        load_config(None, [*HELPER, "rollout.cuda_mps_trainer_priority=low"])


def test_the_run_sets_the_trainers_mps_priority_and_its_helpers(tmp_path):
    """`mps.start` with `rollout.cuda_mps_trainer_priority`, in a process of its own: the CUDA_MPS_CLIENT_PRIORITY
    its CUDA context would then be made with, and what a helper engine's process is to take over it; one case after
    another, the environment reset between them."""
    cases = [  # the key, a priority the user set for the whole run, what the trainer then has, what helpers take
        ("below_normal", None, "1", {mps.PRIORITY_KEY: "0"}),  # the trainer's process below normal, helpers normal
        ("normal", None, None, {}),  # nothing set: the daemon's default for every client
        ("normal", "1", "1", {}),  # a priority the user gave the whole run stays the helpers' too
    ]
    env = dict(os.environ, PATH=f"{fake_control(tmp_path)}:{os.environ['PATH']}", FAKE_MPS_LOG=str(tmp_path / "log"),
               PYTHONPATH=str(ROOT))
    trainer = textwrap.dedent(f"""\
        import json, os
        os.environ["FAKE_TRAINER_PID"] = str(os.getpid())
        from jaxppo import mps
        from jaxppo.config import load_config
        for priority, user_priority in {[(key, user) for key, user, _, _ in cases]!r}:
            for k in (mps.PRIORITY_KEY, mps.HELPER_PRIORITY_KEY):
                os.environ.pop(k, None)
            if user_priority is not None:
                os.environ[mps.PRIORITY_KEY] = user_priority
            mps.start(load_config(None, {HELPER!r} + [f"rollout.cuda_mps_trainer_priority={{priority}}"]))
            print(json.dumps([os.environ.get(mps.PRIORITY_KEY), mps.helper_environment()]))
        """)
    import json

    out = subprocess.run([sys.executable, "-c", trainer], env=env, stdout=subprocess.PIPE, text=True, check=True,
                         cwd=tmp_path, timeout=120).stdout.splitlines()[-3:]
    assert [json.loads(line) for line in out] == [[sees, helpers] for _, _, sees, helpers in cases]


def _report_environment(q) -> None:
    q.put({k: os.environ.get(k) for k in (mps.PRIORITY_KEY, "JAX_PLATFORMS")})


def test_a_helper_engine_is_spawned_with_the_helpers_priority_and_jax_on_cpu(monkeypatch):
    """bridge/engines/vllm_processes.py starts each helper (a spawned interpreter) inside `_helper_environment`:
    the helper's process has the priority `mps.helper_environment` names and JAX on CPU, and this process's own
    environment is as it was after the start."""
    import multiprocessing

    from bridge.engines.vllm_processes import _helper_environment

    monkeypatch.setenv(mps.PRIORITY_KEY, "1")  # as mps.start leaves a trainer of below-normal priority
    monkeypatch.setenv(mps.HELPER_PRIORITY_KEY, "0")
    monkeypatch.delenv("JAX_PLATFORMS", raising=False)
    ctx = multiprocessing.get_context("spawn")
    q = ctx.Queue()
    proc = ctx.Process(target=_report_environment, args=(q,))
    with _helper_environment():
        proc.start()
    try:
        assert q.get(timeout=120) == {mps.PRIORITY_KEY: "0", "JAX_PLATFORMS": "cpu"}
    finally:
        proc.join(timeout=120)
    assert os.environ[mps.PRIORITY_KEY] == "1" and "JAX_PLATFORMS" not in os.environ
