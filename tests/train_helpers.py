"""Small runs of `python -m jaxppo.train` for the trainer tests."""

from __future__ import annotations

import json
import os
import subprocess
import time
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# the embedded default, shrunk to seconds: same task, tokenizer, model family and loop, without the supervised warm
# start: five steps of it taught a 64-wide model nothing a test could see (nll 5.96 -> 5.30) and cost each run's first
# start a program to trace and compile, the steps and a model to write: a 3-step run forked as the tests fork it took
# 18.1-19.2 s with them, 14.3-15.2 s without (2-core AMD EPYC, 2026-12-06). WARM puts it back where the warm start's
# record is under test (tests/test_nothing_lost.py); the learning runs, the recipes' and LoRA's warm up as the
# embedded default does.
FAST = ["data.train_batch_size=8", "data.max_response_length=12", "data.synthetic_train_size=200",
        "data.synthetic_val_size=16", "actor.ppo_mini_batch_size=4", "critic.ppo_mini_batch_size=4",
        "actor.ppo_micro_batch_size_per_device=4", "critic.ppo_micro_batch_size_per_device=4",
        "actor.log_prob_micro_batch_size_per_device=8", "critic.log_prob_micro_batch_size_per_device=8",
        "rollout.n=2", "model.tiny_hidden_size=64", "trainer.sft_warmup_steps=0", "trainer.test_freq=2",
        "trainer.logger=[jsonl]"]
WARM = ["trainer.sft_warmup_steps=5"]


# a GSM8K recipe config (configs/gsm8k_*.yaml) pointed at the embedded default's task, shrunk like FAST: the
# recipe's algorithm, loss, sampling and packing settings on the synthetic data, with the tiny model and the
# transformers engine on CPU. Packed rows of 512 tokens (a mini-batch of 4 prompts' samples fills two or three):
# the recipes' automatic budgets (0) would plan rows of 16384 for a step of ~2400 tokens, every row then held to
# that planned shape, and a step took 7.5 s instead of 0.75 (the automatic budget is tests/test_memory_plan.py's)
ON_EMBEDDED_TASK = ["data.train_files=[]", "data.val_files=[]", "model.path=null", "rollout.engine=hf",
                    "model.dtype=float32", "model.remat=none", "data.max_prompt_length=48",
                    "data.max_response_length=12", "data.train_batch_size=8", "data.val_batch_size=16",
                    "data.synthetic_train_size=200", "data.synthetic_val_size=16", "data.synthetic_operators=+",
                    "actor.ppo_mini_batch_size=4", "critic.ppo_mini_batch_size=4", "model.tiny_hidden_size=64",
                    "trainer.sft_warmup_steps=5", "trainer.sft_lr=3e-3", "trainer.test_freq=3",
                    "trainer.save_freq=-1", "trainer.logger=[jsonl]", "actor.ppo_max_token_len_per_device=512",
                    "actor.log_prob_max_token_len_per_device=512", "critic.ppo_max_token_len_per_device=512",
                    "critic.forward_max_token_len_per_device=512"]


# The suite's programs are compiled by LLVM at its lowest optimisation level (tests/conftest.py sets it for the test
# processes, train_env for the runs they start): XLA's CPU compiles are most of the suite's work, and at level 0
# tests/test_engine.py took 379 s of CPU instead of 569 s (2-core AMD EPYC, 2026-12-03), same results. The learning
# runs (`learns`, the warm start, the LoRA run) compile as a user's run does (`optimized=True`): their hundreds of
# steps at the embedded default's scale run faster for it, and their thresholds were seen that way.
# XLA's older loop emitters for fusions instead of its MLIR fusion emitters (`--xla_cpu_use_fusion_emitters=false`):
# the MLIR pipeline was most of what was left of a compile. Five compile-heavy test files from a cold compilation
# cache (test_compare, test_recipes, test_packing, test_trainer_options, test_ahead; two workers, 2-core AMD EPYC,
# 2026-12-06): 485 s -> 341 s, every test passing; a FAST 2-step run's first start 19.2 -> 13.3 s, its steps ~20 %
# slower (0.45 -> 0.54 s), which the suite's few steps a run do not notice. The embedded default's step at the
# optimised level is 5 % slower with the older emitters (5.21 -> 5.46 s): the learning runs keep XLA's defaults.
FAST_COMPILE = "--xla_backend_optimization_level=0 --xla_cpu_use_fusion_emitters=false"


def train_env(devices: int = 1, optimized: bool = False, **extra: str) -> dict:
    """The environment of a run in a subprocess: `devices` CPU devices (one, like a user's run); XLA's CPU code
    compiled at LLVM's lowest level unless `optimized` (FAST_COMPILE)."""
    env = dict(os.environ, PYTHONPATH=str(ROOT), **extra)
    flags = [] if optimized else [FAST_COMPILE]
    if devices > 1:
        flags.append(f"--xla_force_host_platform_device_count={devices}")
    env.pop("XLA_FLAGS", None)
    if flags:
        env["XLA_FLAGS"] = " ".join(flags)
    return env


def run_train(run_dir: Path, *overrides: str, check: bool = True, timeout: float = 600,
              extra_env: dict | None = None, config: str | Path | None = None,
              optimized: bool = False) -> subprocess.CompletedProcess:
    """`python -m jaxppo.train [--config config] trainer.default_local_dir=run_dir overrides...` in a process of its
    own (`run_python`)."""
    head = ["--config", str(config)] if config is not None else []
    return run_python("-m", "jaxppo.train", *head, f"trainer.default_local_dir={run_dir}", *overrides, check=check,
                      timeout=timeout, env=train_env(optimized=optimized, **(extra_env or {})))


def start_train(run_dir: Path, *overrides: str, optimized: bool = False, stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL) -> ForkedRun | subprocess.Popen:
    """`python -m jaxppo.train` started in the background (`start_python`)."""
    return start_python("-m", "jaxppo.train", f"trainer.default_local_dir={run_dir}", *overrides,
                        env=train_env(optimized=optimized), stdout=stdout, stderr=stderr)


def read_metrics(run_dir: Path) -> dict[int, dict]:
    """step -> metrics, the last record of each step winning (a resumed run repeats steps)."""
    out = {}
    for rec in all_records(run_dir):
        out.setdefault(rec["step"], {}).update(rec)
    return out


# ------------------------------------------------------------------ processes forked from one that has the imports

# A run of `python -m jaxppo.train` spends ~9 s of CPU importing jax, torch, transformers and jaxppo before it does
# anything (-X importtime, 2-core AMD EPYC, 2026-12-04), and the suite starts over a hundred runs and scripts. Each
# pytest-xdist worker keeps one fork server (multiprocessing's forkserver) that has imported them
# (tests/train_preload.py); `python -m jaxppo.train ...` or `python scripts/x.py ...` is then a child forked from it:
# a process of its own (pid, signals, exit code, environment, working directory) that runs the module or script as
# __main__ with runpy, as the interpreter would, from the interpreter's state minus the imports. JAX's backend,
# torch's threads and logging's set-up start in the child, from its own environment. JAXPPO_TEST_FORK=0 starts
# fresh interpreters instead (subprocess.Popen). The README's commands and the multi-process tests (jaxppo.launch)
# always run fresh interpreters. The server keeps the modules as they were when it started: a file edited while a
# test session runs reaches its later runs as a new __main__ (jaxppo.train, read again by runpy) beside the old
# imports, which fail in ways the code never does (seen: a config field the new train.py passes and the preloaded
# schema lacks). Run long sessions from a checkout nobody edits (a clone).

_FORKSERVER = None


def _forkserver():
    global _FORKSERVER
    if _FORKSERVER is None:
        import multiprocessing

        _FORKSERVER = multiprocessing.get_context("forkserver")
        _FORKSERVER.set_forkserver_preload(["tests.train_preload"])
    return _FORKSERVER


def run_python(*args: str, env: dict | None = None, timeout: float = 600,
               check: bool = True) -> subprocess.CompletedProcess:
    """`python *args` (`-m module ...` or `script.py ...`) from the repository root, its output captured, in a
    process of its own (`start_python`). `check`: a non-zero exit fails the test with the output."""
    proc = start_python(*args, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
        raise
    res = subprocess.CompletedProcess([sys.executable, *args], proc.returncode, out, err)
    if check and res.returncode != 0:
        raise AssertionError(res.stdout[-3000:] + res.stderr[-5000:])
    return res


def start_python(*args: str, env: dict | None = None, stdout=subprocess.DEVNULL,
                 stderr=subprocess.DEVNULL) -> ForkedRun | subprocess.Popen:
    """`python *args` from the repository root, started in the background: a `ForkedRun` (a child of the test
    worker's fork server), or with JAXPPO_TEST_FORK=0 a fresh interpreter (subprocess.Popen). `env`: the process's
    whole environment (`train_env()` unless given). Output discarded unless `stdout` / `stderr` is
    subprocess.PIPE (`stderr=subprocess.STDOUT` joins the two), read as text by `communicate()`."""
    env = train_env() if env is None else env
    if os.environ.get("JAXPPO_TEST_FORK", "1") == "0":
        return subprocess.Popen([sys.executable, *args], cwd=ROOT, env=env, stdout=stdout, stderr=stderr, text=True)
    return ForkedRun(list(args), env, stdout, stderr)


def _forked(args: list[str], env: dict, out: str | None, err: str | None) -> None:
    """The child: `python *args` from the repository root (runpy runs the module or script as __main__). Exits
    with SystemExit's code, or 1 with the traceback on stderr for an uncaught exception, after the interpreter's
    own exit steps (non-daemon threads joined, atexit handlers run)."""
    import atexit
    import logging
    import runpy
    import threading
    import traceback

    os.environ.clear()
    os.environ.update(env)
    os.chdir(ROOT)
    for fd, path in ((1, out), (2, err)):
        if path is not None:
            target = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND)
            os.dup2(target, fd)
            os.close(target)
    # a fresh interpreter's logging: the preloaded imports' own set-up (absl's basicConfig when orbax imports)
    # would otherwise win over the program's basicConfig
    for handler in list(logging.root.handlers):
        logging.root.removeHandler(handler)
    logging.root.setLevel(logging.WARNING)
    code = 0
    try:
        if args[0] == "-m":
            sys.argv = [args[1], *args[2:]]  # runpy puts the module's file in argv[0]
            sys.path.insert(0, str(ROOT))
            sys.modules.pop(args[1], None)  # the module runs afresh as __main__, as under `python -m`
            runpy.run_module(args[1], run_name="__main__", alter_sys=True)
        else:
            sys.argv = list(args)
            sys.path.insert(0, str(Path(args[0]).resolve().parent))
            runpy.run_path(args[0], run_name="__main__")
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) or e.code is None else (print(e.code, file=sys.stderr) or 1)
    except BaseException:  # noqa: BLE001 - what the interpreter does with an uncaught exception
        traceback.print_exc()
        code = 1
    threading._shutdown()
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        if stream is not None and not stream.closed:  # a program may close them (json.tool does)
            stream.flush()
    os._exit(code or 0)


class ForkedRun:
    """A process forked by `_forked`, with the part of subprocess.Popen's interface the tests use."""

    def __init__(self, args: list[str], env: dict, stdout, stderr):
        import tempfile

        if stdout not in (subprocess.PIPE, subprocess.DEVNULL, None) or \
                stderr not in (subprocess.PIPE, subprocess.DEVNULL, None, subprocess.STDOUT):
            raise ValueError(f"unsupported streams {stdout!r}, {stderr!r}")
        self._dir = tempfile.mkdtemp(prefix="jaxppo-proc-") if subprocess.PIPE in (stdout, stderr) else None

        def sink(stream, name: str) -> str | None:  # where the child writes: a file read back, /dev/null, or its own
            return (os.path.join(self._dir, name) if stream == subprocess.PIPE else
                    os.devnull if stream == subprocess.DEVNULL else None)

        out = sink(stdout, "stdout")
        err = out if stderr == subprocess.STDOUT else sink(stderr, "stderr")
        self._read = [path if stream == subprocess.PIPE else None for path, stream in ((out, stdout), (err, stderr))]
        self.args = [sys.executable, *args]
        self._proc = _forkserver().Process(target=_forked, args=(args, env, out, err))
        self._proc.start()
        self.pid = self._proc.pid
        self.returncode = None

    def poll(self) -> int | None:
        if self.returncode is None and not self._proc.is_alive():
            self._proc.join()
            self.returncode = self._proc.exitcode
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        self._proc.join(timeout)
        if self.poll() is None:
            raise subprocess.TimeoutExpired(self.args, timeout)
        return self.returncode

    def send_signal(self, sig: int) -> None:
        if self.poll() is None:
            os.kill(self.pid, sig)

    def kill(self) -> None:
        import signal

        self.send_signal(signal.SIGKILL)

    def communicate(self, timeout: float | None = None) -> tuple[str | None, str | None]:
        import shutil

        self.wait(timeout)
        out, err = (None if path is None else Path(path).read_text(errors="replace") for path in self._read)
        if self._dir is not None:
            shutil.rmtree(self._dir, ignore_errors=True)
        return out, err


def wait_until(ready, proc: subprocess.Popen, what: str, timeout: float = 300) -> None:
    """Poll the file-system condition `ready()` while `proc` runs (fails if it ends first or times out)."""
    deadline = time.monotonic() + timeout
    while not ready():
        assert proc.poll() is None, f"run ended before {what}"
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)


def _metrics_lines(run_dir: Path) -> tuple[list[str], str]:
    """A run's metrics.jsonl as (its complete lines, what follows the last newline). The rest is a line being written,
    or one a SIGKILL cut: Linux can stop a write at a page boundary when a fatal signal is pending, so a kill can
    leave part of a line (seen in CI: a record cut after its 2811th character). The trainer drops such a line when
    it resumes (`setup.truncate_metrics`)."""
    text = (Path(run_dir) / "metrics.jsonl").read_text()
    *lines, rest = text.split("\n")
    return [line for line in lines if line], rest


def logged_step(run_dir: Path, step: int) -> bool:
    """Whether the run has written step `step`'s record whole."""
    path = Path(run_dir) / "metrics.jsonl"
    return path.is_file() and any(json.loads(line)["step"] == step for line in _metrics_lines(run_dir)[0])


def all_records(run_dir: Path, killed: bool = False) -> list[dict]:
    """Every metrics record in the order written (a resumed run appends after the interrupted one). `killed`: the run
    was killed and not resumed since, so its last line may be cut short (left out); otherwise every line is whole."""
    lines, rest = _metrics_lines(run_dir)
    assert killed or not rest, f"metrics.jsonl ends in a partial line: {rest[:80]!r}"
    return [json.loads(line) for line in lines]


def comparable(rec: dict) -> dict:
    """A step's metrics that two runs of the same computation agree on (timings and throughput aside)."""
    return {k: v for k, v in rec.items() if not k.startswith(("timing_s/", "perf/", "time"))}


def assert_same_step(a: dict, b: dict, step: int) -> None:
    """Two runs' records of step `step` of the same computation: the same metrics, equal to float32's rounding
    (timings and throughput aside)."""
    import pytest

    ra, rb = comparable(a), comparable(b)
    assert ra.keys() == rb.keys(), step
    for k in ra:
        assert ra[k] == pytest.approx(rb[k], rel=1e-5, abs=1e-6), (step, k)


def stop_checkpoint(run: Path, steps: int) -> int:
    """The one checkpoint a run stopped by a signal wrote (after step 2 and before its last step `steps`)."""
    ckpts = [int(p.name) for p in (run / "checkpoints").iterdir() if p.name.isdigit()]
    assert len(ckpts) == 1 and 2 <= ckpts[0] < steps, ckpts
    return ckpts[0]


def assert_resumed_as_straight(straight: Path, run: Path, output: str, ckpt: int, steps: int, in_flight: bool) -> None:
    """A run stopped at checkpoint `ckpt` and resumed by the same command (`output`: the resumed process's): it
    resumed there, with the batch that was in flight when `in_flight`, and every step after it logged what the
    `straight` run, never stopped, logged (timings aside)."""
    assert assert_resumed_at_checkpoint(run, output) == ckpt
    assert ("the next step's batch as it was in flight" in output) == in_flight
    a, b = read_metrics(straight), read_metrics(run)
    assert sorted(b) == list(range(steps + 1))
    for step in range(ckpt + 1, steps + 1):
        assert_same_step(a[step], b[step], step)


def assert_resumed_at_checkpoint(run_dir: Path, output: str) -> int:
    """The second process of a run resumed from its checkpoint: it says so, and no step up to the checkpoint was
    logged twice (a run that silently started over would repeat steps 1..N). Returns the step resumed from."""
    import re

    found = re.findall(r"resumed from step (\d+)", output)
    assert found, "the resumed process did not report resuming"
    step = int(found[-1])
    steps = [r["step"] for r in all_records(run_dir)]
    assert step >= 1 and all(steps.count(s) == 1 for s in range(1, step + 1)), (step, steps)
    return step


# ------------------------------------------------------------------ the embedded default's warm start, built once

# what the warm start reads (jaxppo/warmstart.py, jaxppo/setup.py): the data, the model, the mesh, the actor's
# micro-batching, the batch size (prompts x samples), the seed and the warm start's own settings
_WARM_KEYS = ("data", "model", "mesh", "actor.ppo_micro_batch_size_per_device", "actor.logprob_chunk_size",
              "actor.logprob_remat", "rollout.n", "trainer.seed", "trainer.sft_warmup_steps", "trainer.sft_lr")


def warm_start_key(*overrides: str, config: str | Path | None = None) -> str:
    import dataclasses
    import hashlib

    from jaxppo.config import load_config

    cfg = load_config(config or ROOT / "configs" / "default.yaml", overrides)
    parts = {}
    for key in _WARM_KEYS:
        node = cfg
        for name in key.split("."):
            node = getattr(node, name)
        parts[key] = dataclasses.asdict(node) if dataclasses.is_dataclass(node) else node
    for name in ("val_files", "synthetic_val_size", "val_batch_size"):  # validation only
        parts["data"].pop(name)
    return hashlib.sha256(json.dumps(parts, sort_keys=True, default=str).encode()).hexdigest()[:16]


def seed_warm_start(run_dir: Path, cache_root: Path, *overrides: str, config: str | Path | None = None) -> None:
    """Put the embedded default's warm-start model for `overrides` into `run_dir/warm_model`, where the trainer
    takes it instead of warming up again (jaxppo/trainer.py). The warm start itself runs once per test run for
    each setting that it reads (`_WARM_KEYS`), in `python -m jaxppo.train`, under a file lock shared by the
    pytest-xdist workers; it is deterministic on one machine, so every test gets the model it would have
    trained. The learning tests then measure the PPO phase, as their first validation (step 0) always did."""
    import shutil

    from filelock import FileLock

    key = warm_start_key(*overrides, config=config)
    cache = Path(cache_root) / f"warm_{key}"
    with FileLock(str(cache) + ".lock"):
        if not (cache / "warm_model" / "config.json").is_file():
            shutil.rmtree(cache, ignore_errors=True)
            run_train(cache, *overrides, "trainer.total_training_steps=1", "trainer.val_before_train=false",
                      "trainer.test_freq=-1", "trainer.save_freq=-1", "trainer.logger=[jsonl]", timeout=900,
                      config=config, optimized=True)
    Path(run_dir).mkdir(parents=True, exist_ok=True)
    shutil.copytree(cache / "warm_model", Path(run_dir) / "warm_model")


def shared_tmp(tmp_path_factory) -> Path:
    """A directory shared by this test run's pytest-xdist workers (and by nothing else)."""
    uid = os.environ.get("PYTEST_XDIST_TESTRUNUID")
    base = tmp_path_factory.getbasetemp()
    root = base.parent / f"shared_{uid}" if uid else base / "shared"
    root.mkdir(parents=True, exist_ok=True)
    return root


def learns(tmp_path_factory, config: str, steps: int, *overrides: str) -> tuple[float, float, float, float]:
    """(validation at step 0, at `steps`; training score over the first 10 steps, over the last 10)."""
    run = tmp_path_factory.mktemp("learn") / "run"
    args = [f"trainer.total_training_steps={steps}", f"trainer.test_freq={steps}", "trainer.save_freq=-1",
            "trainer.logger=[jsonl]", *overrides]
    seed_warm_start(run, shared_tmp(tmp_path_factory), *args, config=ROOT / "configs" / config)
    run_train(run, *args, timeout=1200, config=ROOT / "configs" / config, optimized=True)
    metrics = read_metrics(run)
    score = [metrics[s]["critic/score/mean"] for s in range(1, steps + 1)]
    return metrics[0]["val/score"], metrics[steps]["val/score"], sum(score[:10]) / 10, sum(score[-10:]) / 10
