"""Nothing a user has written is lost, and nothing fails silently (issue: a hostile user's pass).

A corrupt newest checkpoint: resume walks back to the newest that restores and later saves replace the bad ones. A
run directory reused with another model: exit 2 naming the mismatch, its config.yaml as it was. metrics.jsonl holds
each step once after a resume (a line a kill cut is dropped). Export never deletes what it did not write. Setup
errors are one line with exit 2. A full disk during a save names the cause."""

from __future__ import annotations

import json
import os
import shutil
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from jaxppo.checkpoint import RunCheckpointer
from jaxppo.export import MARKER, main as export_main
from jaxppo.train import main as train_main
from tests.helpers import make_hf_checkpoint
from tests.train_helpers import FAST, ROOT, WARM, all_records, run_train, train_env

BASE = [*FAST, *WARM, "trainer.total_training_steps=4", "trainer.save_freq=1", "trainer.max_to_keep=4",
        "trainer.test_freq=-1"]


@pytest.fixture(scope="module")
def base_run(tmp_path_factory) -> Path:
    """A 4-step run of the shrunk default with a checkpoint after every step (1, 2, 3, 4)."""
    run = tmp_path_factory.mktemp("base") / "run"
    run_train(run, *BASE)
    assert sorted(int(p.name) for p in (run / "checkpoints").iterdir() if p.name.isdigit()) == [1, 2, 3, 4]
    return run


def copy_run(base_run: Path, tmp_path: Path) -> Path:
    run = tmp_path / "run"
    shutil.copytree(base_run, run)
    return run


def corrupt(step_dir: Path, how: str) -> None:
    if how == "metadata":  # its array metadata deleted
        (step_dir / "actor" / "_METADATA").unlink()
    else:  # every data file of the actor's arrays cut to half its length
        files = [f for f in (step_dir / "actor").rglob("*") if f.is_file() and f.parent.name == "d"]
        assert files
        for f in files:
            os.truncate(f, f.stat().st_size // 2)


def steps_on_disk(run: Path) -> list[int]:
    return RunCheckpointer(run / "checkpoints").all_steps()


def restores(run: Path, step: int) -> bool:
    """Every array of the step's actor and critic reads back."""
    import orbax.checkpoint as ocp

    try:
        for item in ("actor", "critic"):
            ocp.StandardCheckpointer().restore(run / "checkpoints" / str(step) / item)
        return True
    except Exception:  # noqa: BLE001
        return False


def step_counts(run: Path) -> dict[int, int]:
    counts: dict[int, int] = {}
    for rec in all_records(run):
        counts[rec["step"]] = counts.get(rec["step"], 0) + 1
    return counts


@pytest.mark.slow
def test_resume_walks_back_past_corrupt_checkpoints_and_later_saves_replace_them(base_run, tmp_path):
    run = copy_run(base_run, tmp_path)
    corrupt(run / "checkpoints" / "4", "metadata")
    corrupt(run / "checkpoints" / "3", "data")
    assert not restores(run, 4) and not restores(run, 3) and restores(run, 2)
    # what a run killed after logging steps 3-5 but before checkpointing them leaves in metrics.jsonl
    with open(run / "metrics.jsonl", "a") as f:
        for step in (3, 4, 5):
            f.write(json.dumps({"step": step, "critic/score/mean": 0.5}) + "\n")
    res = run_train(run, *BASE[:-3], "trainer.total_training_steps=5", "trainer.save_freq=1", "trainer.max_to_keep=4",
                    "trainer.test_freq=-1")
    out = res.stdout + res.stderr
    assert "checkpoints/4 does not restore" in out and "checkpoints/3 does not restore" in out, out[-3000:]
    assert "resumed from step 2" in out
    assert steps_on_disk(run) == [2, 3, 4, 5] and all(restores(run, s) for s in (2, 3, 4, 5))
    counts = step_counts(run)
    assert all(counts[s] == 1 for s in range(1, 6)), counts  # each step logged once


@pytest.mark.slow
def test_a_save_after_resuming_by_hand_from_an_older_step_replaces_the_newer_ones(base_run, tmp_path):
    run = copy_run(base_run, tmp_path)
    corrupt(run / "checkpoints" / "4", "data")
    res = run_train(run, *BASE[:-2], "trainer.max_to_keep=2", "trainer.test_freq=-1",
                    f"trainer.resume_mode={run / 'checkpoints' / '2'}")
    assert "resumed from step 2" in res.stdout + res.stderr
    # steps 3 and 4 written again (the corrupt 4 replaced, not kept over the good ones by rotation)
    assert steps_on_disk(run) == [3, 4] and restores(run, 3) and restores(run, 4)
    assert step_counts(run)[3] == 1 and step_counts(run)[4] == 1


def test_no_checkpoint_that_restores_exits_2_and_keeps_the_run_as_it_was(base_run, tmp_path, capsys, one_device):
    run = copy_run(base_run, tmp_path)
    for step in (1, 2, 3, 4):
        corrupt(run / "checkpoints" / str(step), "metadata")
    before = (run / "config.yaml").read_bytes(), (run / "metrics.jsonl").read_bytes()
    rc = train_main([f"trainer.default_local_dir={run}", *BASE])
    err = capsys.readouterr().err
    assert rc == 2 and "no checkpoint restores" in err and "Traceback" not in err, err
    assert ((run / "config.yaml").read_bytes(), (run / "metrics.jsonl").read_bytes()) == before
    assert steps_on_disk(run) == [1, 2, 3, 4]  # nothing deleted


@pytest.fixture(scope="module")
def other_model(tmp_path_factory, base_run) -> Path:
    """An HF checkpoint of another shape (hidden 32 against the run's 64) with the run's vocabulary."""
    vocab = json.loads((base_run / "init_model" / "config.json").read_text())["vocab_size"]
    return make_hf_checkpoint(tmp_path_factory.mktemp("other"), "qwen2", hidden_size=32, intermediate_size=64,
                              vocab_size=vocab)


@pytest.mark.parametrize("change,message", [
    (["model.tiny_hidden_size=128"], "embedded model has another shape (hidden_size=64 there, 128 now"),
    (["model.path={other}", "data.tokenizer={run}/tokenizer"], "warm_model was made from another model"),
    (["model.path={other}", "data.tokenizer={run}/tokenizer", "trainer.sft_warmup_steps=0"],
     "checkpoints were written with another model"),
    # adapters where the run trained the whole model: the setting that changed is named
    (["actor.lora_rank=4"], "config.yaml: actor.lora_rank: 0 -> 4)"),
    (["data.synthetic_train_size=300"], "synthetic data was made with other settings"),
])
def test_another_model_on_an_existing_run_exits_2_and_leaves_its_record(change, message, base_run, other_model,
                                                                       tmp_path, capsys, one_device):
    run = copy_run(base_run, tmp_path)
    if "trainer.sft_warmup_steps=0" in change:  # a run that had no warm start: its checkpoints are the model's
        shutil.rmtree(run / "warm_model")
    before = {p: (run / p).read_bytes() for p in ("config.yaml", "metrics.jsonl")}
    change = [c.format(other=other_model, run=run) for c in change]
    rc = train_main([f"trainer.default_local_dir={run}", *BASE, "trainer.total_training_steps=6", *change])
    err = capsys.readouterr().err
    assert rc == 2 and message in err and "Traceback" not in err, err
    assert len(err.strip().splitlines()) == 1, err
    assert {p: (run / p).read_bytes() for p in before} == before
    assert steps_on_disk(run) == [1, 2, 3, 4]


def test_restore_actor_refuses_a_config_that_describes_another_model(base_run, other_model, tmp_path, capsys):
    """The run's config.yaml pointed at another model (what a failed resume used to leave): the export names the
    mismatch instead of writing a model whose config.json disagrees with its tensors."""
    run = copy_run(base_run, tmp_path)
    cfg = (run / "config.yaml").read_text().replace("  path: null\n", f"  path: {other_model}\n", 1)
    (run / "config.yaml").write_text(cfg)
    rc = export_main(["--ckpt", str(run / "checkpoints" / "4"), "--out", str(tmp_path / "hf")])
    err = capsys.readouterr().err
    assert rc == 2 and "shape (" in err and "does not describe the model" in err, err
    assert not (tmp_path / "hf").exists()


def _mode(p: Path) -> int:
    return stat.S_IMODE(p.stat().st_mode)


def test_export_never_deletes_what_it_did_not_write(base_run, tmp_path, capsys, monkeypatch):
    ckpt = str(base_run / "checkpoints" / "4")
    umask = os.umask(0o022)
    try:
        out = tmp_path / "hf"
        assert export_main(["--ckpt", ckpt, "--out", str(out)]) == 0
        assert (out / MARKER).is_file() and (out / "model.safetensors").is_file() and (out / "tokenizer.json").is_file()
        # group- and world-readable as a normal save under this umask (the temporary directory was private)
        assert _mode(out) == 0o755 and all(_mode(f) == 0o644 for f in out.iterdir()), \
            {f.name: oct(_mode(f)) for f in [out, *out.iterdir()]}
        (out / "notes.txt").write_text("mine")
        assert export_main(["--ckpt", ckpt, "--out", str(out)]) == 0  # an earlier export: written over
        assert (out / "notes.txt").read_text() == "mine"

        mine = tmp_path / "results"
        mine.mkdir()
        (mine / "precious.txt").write_text("do not delete")
        capsys.readouterr()
        assert export_main(["--ckpt", ckpt, "--out", str(mine)]) == 2
        err = capsys.readouterr().err
        assert "not empty" in err and "--force" in err and len(err.strip().splitlines()) == 1, err
        assert sorted(p.name for p in mine.iterdir()) == ["precious.txt"]
        monkeypatch.chdir(mine)  # `--out .`
        assert export_main(["--ckpt", ckpt, "--out", "."]) == 2
        assert sorted(p.name for p in mine.iterdir()) == ["precious.txt"]
        assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]  # no staging left behind
        assert export_main(["--ckpt", ckpt, "--out", ".", "--force"]) == 0
        assert (mine / "precious.txt").read_text() == "do not delete" and (mine / "model.safetensors").is_file()

        a_file = tmp_path / "model.bin"
        a_file.write_text("x")
        assert export_main(["--ckpt", ckpt, "--out", str(a_file)]) == 2 and a_file.read_text() == "x"
    finally:
        os.umask(umask)


def test_export_of_a_corrupt_checkpoint_exits_2_with_one_line(base_run, tmp_path, capsys):
    run = copy_run(base_run, tmp_path)
    corrupt(run / "checkpoints" / "3", "metadata")
    corrupt(run / "checkpoints" / "2", "data")
    for step in (3, 2):
        assert export_main(["--ckpt", str(run / "checkpoints" / str(step)), "--out", str(tmp_path / "hf")]) == 2
        err = capsys.readouterr().err
        assert "does not" in err and "Traceback" not in err and len(err.strip().splitlines()) == 1, err
        assert not (tmp_path / "hf").exists()


def test_export_of_a_run_takes_its_newest_checkpoint_that_restores(base_run, tmp_path, capsys):
    """`--ckpt RUN` (or RUN/checkpoints) exports the newest checkpoint that restores, as a resume would take it: the
    newest, cut by a kill, is named in a warning and the one before exported (the same bytes as exporting that step
    by name); a run whose checkpoints all fail, or a directory without any, exits 2 with nothing written."""
    run = copy_run(base_run, tmp_path)
    corrupt(run / "checkpoints" / "4", "data")
    assert export_main(["--ckpt", str(run / "checkpoints" / "3"), "--out", str(tmp_path / "by_step")]) == 0
    capsys.readouterr()
    for i, ckpt in enumerate((run, run / "checkpoints")):
        out = tmp_path / f"by_run{i}"
        assert export_main(["--ckpt", str(ckpt), "--out", str(out)]) == 0
        err = capsys.readouterr().err
        assert f"{run / 'checkpoints' / '4'}" in err and "older checkpoint" in err, err
        assert json.loads((out / MARKER).read_text())["checkpoint"] == str(run / "checkpoints" / "3")
        assert (out / "model.safetensors").read_bytes() == (tmp_path / "by_step" / "model.safetensors").read_bytes()
    for step in (1, 2, 3):
        corrupt(run / "checkpoints" / str(step), "metadata")
    assert export_main(["--ckpt", str(run), "--out", str(tmp_path / "none")]) == 2
    assert "no checkpoint under" in capsys.readouterr().err and not (tmp_path / "none").exists()
    assert export_main(["--ckpt", str(tmp_path / "by_step"), "--out", str(tmp_path / "none")]) == 2
    assert "no checkpoint here" in capsys.readouterr().err and not (tmp_path / "none").exists()


# ------------------------------------------------------------------ setup errors: one line, exit 2


def _parquet_with_source(src: Path, dst: Path, source: str) -> Path:
    import pyarrow as pa
    import pyarrow.parquet as pq

    table = pq.read_table(src)
    table = table.set_column(table.column_names.index("data_source"), "data_source",
                             pa.array([source] * table.num_rows))
    pq.write_table(table, dst)
    return dst


def test_setup_errors_exit_2_with_one_line(base_run, tiny_qwen, tokenizer_dir, tmp_path, capsys, one_device,
                                          monkeypatch):
    """...and nothing is left behind elsewhere either: the data and tokenizer a start stages in the system's
    temporary directory before its run directory exists are removed when the start ends there."""
    import tempfile

    staging = tmp_path / "system_tmp"
    staging.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(staging))
    a_file = tmp_path / "not_a_dir"
    a_file.write_text("x")
    data = base_run / "data" / "train.parquet"
    gsm8k_typo = _parquet_with_source(data, tmp_path / "typo.parquet", "gsm8k")
    cases = [
        (["data.synthetic_train_size=4"], "fewer than the 8 a step draws (data.train_batch_size)", True),
        ([f"data.train_files=[{data}]", f"data.val_files=[{data}]"], "set data.tokenizer (or model.path)", False),
        ([f"trainer.default_local_dir={a_file}"], "is a file, not a directory", False),
        (["trainer.default_local_dir=/proc/self/jaxppo_run"], "trainer.default_local_dir: cannot create", False),
        ([f"model.path={tiny_qwen}", f"data.tokenizer={tokenizer_dir}"], "more than the model's vocabulary", True),
        ([f"data.train_files=[{gsm8k_typo}]", f"data.val_files=[{data}]", f"data.tokenizer={base_run}/tokenizer"],
         "no reward rule for data_source ['gsm8k']; known: [", True),
    ]
    for i, (overrides, message, makes_dir) in enumerate(cases):
        run = tmp_path / f"run{i}"
        rc = train_main([f"trainer.default_local_dir={run}", *FAST, *overrides])
        err = capsys.readouterr().err
        assert rc == 2 and message in err and "Traceback" not in err, (overrides, err)
        assert len(err.strip().splitlines()) == 1, err
        if not makes_dir:
            assert not run.exists()
        assert not (run / "config.yaml").exists()  # written only once setup succeeded
        assert list(staging.iterdir()) == [], (overrides, list(staging.iterdir()))


def test_an_unknown_data_source_is_scored_by_the_default_rule_when_one_is_named(base_run, tmp_path):
    from jaxppo.config import load_config
    from jaxppo.data import PromptSpec, load_prompt_dataset, load_tokenizer
    from jaxppo.errors import DataError
    from jaxppo.setup import check_reward_sources

    ds = load_prompt_dataset([_parquet_with_source(base_run / "data" / "train.parquet", tmp_path / "t.parquet",
                                                   "gsm8k")], load_tokenizer(base_run / "tokenizer"),
                             PromptSpec(max_prompt_length=48))
    with pytest.raises(DataError, match="reward.default_rule"):
        check_reward_sources(load_config(None, []), [ds])
    check_reward_sources(load_config(None, ["reward.default_rule=openai/gsm8k"]), [ds])
    from jaxppo.rewards import score_batch

    res = score_batch(["gsm8k"], ["so #### 3"], ["3"], default_rule="openai/gsm8k")
    assert res.scores.tolist() == [1.0]  # GSM8K's rule, not the \boxed{} math rule (which scores it 0)


@pytest.mark.slow
def test_a_full_disk_during_a_save_names_the_cause(tmp_path):
    """The checkpoint directory on a 1 MiB tmpfs (a mount namespace of the test's own): the first save fails."""
    if shutil.which("unshare") is None:
        pytest.skip("needs unshare (util-linux) for a private tmpfs")
    run = tmp_path / "run"
    (run / "checkpoints").mkdir(parents=True)
    args = [sys.executable, "-m", "jaxppo.train", f"trainer.default_local_dir={run}", *FAST,
            "trainer.total_training_steps=1", "trainer.test_freq=-1"]
    script = f"mount -t tmpfs -o size=1m tmpfs {run / 'checkpoints'} && exec \"$@\""
    probe = subprocess.run(["unshare", "-rm", "sh", "-c", f"mount -t tmpfs -o size=1m tmpfs {tmp_path}"],
                           capture_output=True)
    if probe.returncode != 0:
        pytest.skip(f"no private mount here: {probe.stderr.decode()[:200]}")
    res = subprocess.run(["unshare", "-rm", "sh", "-c", script, "sh", *args], capture_output=True, text=True,
                         timeout=600, env=train_env(), cwd=ROOT)
    assert res.returncode == 2, res.stderr[-3000:]
    last = res.stderr.strip().splitlines()[-1]
    assert last.startswith("error: ") and "checkpoints/1" in last and "no space left on the device" in last, \
        res.stderr[-3000:]
    assert "Traceback" not in res.stderr, res.stderr[-3000:]


@pytest.mark.slow
def test_a_reward_that_exits_costs_its_samples_only_and_the_run_finishes(tmp_path):
    """sys.exit(0) and os._exit(1) from the user's reward function, with the default reward.num_workers (worker
    processes): each such sample scores 0 and is counted, the run writes its metrics and checkpoint and says done."""
    reward = tmp_path / "exits.py"
    reward.write_text(
        "import os, sys\n"
        "def compute_score(data_source, solution_str, ground_truth, extra_info=None):\n"
        "    if ground_truth.endswith('3'):\n"
        "        sys.exit(0)\n"
        "    if ground_truth.endswith('7'):\n"
        "        os._exit(1)\n"
        "    return float(solution_str.strip().endswith(ground_truth))\n")
    run = tmp_path / "run"
    res = run_train(run, *FAST, "trainer.total_training_steps=2", "trainer.test_freq=-1",
                    f"custom_reward_function.path={reward}")
    assert "done: step 2/2" in res.stdout, res.stdout[-2000:] + res.stderr[-3000:]
    recs = {r["step"]: r for r in all_records(run)}
    assert recs[1]["reward/errors"] + recs[2]["reward/errors"] > 0  # some ground truths end in 3 or 7
    assert steps_on_disk(run) == [2]


def test_a_run_directory_in_use_by_another_process_is_refused_and_left_as_it_was(base_run, tmp_path, capsys):
    """The same command started twice (or a scheduler's requeue while the first still runs): the second process
    exits 2 naming the first (its pid), before the memory plan and without touching the run's files; once the
    first ends, however it ends, the directory is free. The process holding it may lock it again."""
    import signal as sig

    from jaxppo.setup import RUN_LOCK, lock_run_dir

    run = copy_run(base_run, tmp_path)
    holder = subprocess.Popen([sys.executable, "-c", "import sys; from pathlib import Path; "
                               "from jaxppo.setup import lock_run_dir; f = lock_run_dir(Path(sys.argv[1])); "
                               "print('held', flush=True); sys.stdin.read()", str(run)],
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=train_env(), cwd=ROOT)
    try:
        assert holder.stdout.readline().strip() == "held"
        before = {p: p.read_bytes() for p in run.rglob("*") if p.is_file() and p.name != RUN_LOCK}
        assert train_main([*BASE, f"trainer.default_local_dir={run}", "trainer.total_training_steps=6"]) == 2
        err = capsys.readouterr().err
        assert f"in use by a running jaxppo process (pid {holder.pid} on" in err and len(err.strip().splitlines()) == 1
        assert {p: p.read_bytes() for p in run.rglob("*") if p.is_file() and p.name != RUN_LOCK} == before
    finally:
        holder.send_signal(sig.SIGKILL)  # an unclean end frees it too
        holder.wait()
    mine = lock_run_dir(run)
    again = lock_run_dir(run)  # this process again (a trainer re-created in one process)
    assert f"pid {os.getpid()} on" in (run / RUN_LOCK).read_text()
    again.close()
    mine.close()


def test_a_metrics_line_cut_by_a_kill_is_dropped_when_the_run_resumes(tmp_path):
    """A SIGKILL can cut the line being written (CI saw a record end after its 2811th character). Resuming from the
    step-2 checkpoint keeps the whole records up to step 2 and drops the cut one; the test helpers read a killed run's
    records without the cut line and refuse it anywhere else."""
    from jaxppo.metrics import JsonlSink
    from jaxppo.setup import truncate_metrics
    from tests.train_helpers import logged_step

    path = tmp_path / "metrics.jsonl"
    sink = JsonlSink(path)
    for step in range(4):
        sink.log(step, {"a": float(step)})
    sink.close()
    path.write_text(path.read_text() + json.dumps({"step": 4, "a": 4.0})[:12])
    assert logged_step(tmp_path, 3) and not logged_step(tmp_path, 4)
    assert [r["step"] for r in all_records(tmp_path, killed=True)] == [0, 1, 2, 3]
    with pytest.raises(AssertionError, match="partial line"):
        all_records(tmp_path)
    truncate_metrics(path, 2)
    sink = JsonlSink(path)
    sink.log(3, {"a": 3.5})
    sink.close()
    assert [(r["step"], r["a"]) for r in all_records(tmp_path)] == [(0, 0.0), (1, 1.0), (2, 2.0), (3, 3.5)]
