"""CPU smoke tests of the benchmark scripts on tiny shapes: each runs end to end, prints its table, and
writes a well-formed ledger row. GPU-only measurements skip with the reason."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from scripts import ledger
from tests.train_helpers import ROOT, run_python


def run_script(name: str, *args: str, timeout: float = 900) -> subprocess.CompletedProcess:
    """`python scripts/<name> args...` in a process of its own (tests/train_helpers.py run_python); exit 0."""
    return run_python(str(ROOT / "scripts" / name), *args, timeout=timeout)


# a committed GSM8K config shrunk to a CPU run: the same packing, remat, unroll and kept-logits settings
TINY_STEP = ["data.train_batch_size=4", "data.max_prompt_length=192", "data.max_response_length=8",
             "actor.ppo_mini_batch_size=2", "critic.ppo_mini_batch_size=2", "rollout.enforce_eager=true"]


def check_row(row: dict, bench: str) -> None:
    for key in ledger.REQUIRED + ("figures",):
        assert key in row, key
    assert row["bench"] == bench and row["versions"]["jax"] and row["date"].count("-") == 2


@pytest.mark.slow
def test_bench_start_and_the_step_benchmark_of_its_first_start_on_a_committed_config(tmp_path):
    """scripts/bench_start.py counts its starts and records them; its first start is scripts/bench_ppo_step.py over
    four steps (`--first-steps`), whose figures and ledger row are checked here too (one run serves both scripts)."""
    engine = "hf"  # the script's plumbing; the vLLM engine's own tests are tests/bridge/test_vllm_engine.py
    led, logs = tmp_path / "results.jsonl", tmp_path / "logs"
    res = run_script("bench_start.py", "--config", "configs/gsm8k_qwen2.5_0.5b.yaml", "--shape", "tiny", "--starts",
                     "2", "--first-steps", "4", "--clear", "none", "--logs", str(logs), "--workdir", str(tmp_path / "w"),
                     "--ledger", str(led), *TINY_STEP, f"rollout.engine={engine}", "trainer.profile_steps=[4]",
                     "trainer.profile_tools=[python]", f"trainer.profile_dir={tmp_path / 'prof'}")
    assert "2 of 2 starts succeeded" in res.stdout
    start_row = ledger.read(led)[-1]
    check_row(start_row, "gpu_starts")
    assert start_row["figures"]["starts"] == 2 and start_row["figures"]["succeeded"] == 2
    assert start_row["failures"] == [] and start_row["figures"]["wall_s"][0] > 0
    out = logs / "start_1.json"  # the first start's step benchmark
    log = (logs / "start_1.log").read_text()
    assert "median of steps 3..4" in log and "ratio" in log
    # trainer.profile_steps is honoured as in the trainer's loop: the profile of step 4 and of no other
    assert [p.name for p in (tmp_path / "prof").iterdir()] == ["step_4"]
    assert "train_step" in (tmp_path / "prof" / "step_4" / "python_profile.txt").read_text()
    summary = json.loads(out.read_text())["summary"]
    assert summary["samples"] == 2 and summary["median_steps_3_to_n"]["timing_s/step"] > 0
    assert summary["token_budgets"]["actor_update"] > 0  # packing is on in the committed config
    # every compile after the start is on record, none of them larger than the plan's largest program
    late, compiles = summary["late_compiles"], summary["compiles_per_step"]
    assert compiles[-1] - compiles[0] <= len(late) < compiles[-1]  # those after step 1 are all late; the plan's not
    assert not any(c["over_plan"] for c in late)
    # standalone generation repeated as often as the loop has samples, each with its CPU time
    assert len(summary["gen_standalone_repeats"]) == len(summary["gen_in_loop_steps"]) == summary["samples"]
    assert all(r["perf/cpu_s/gen"] > 0 and r["gen_tokens"] > 0 for r in summary["gen_standalone_repeats"])
    assert all(r["perf/cpu_s/gen"] > 0 for r in summary["gen_in_loop_steps"])
    # and as often again kept awake (no sleep / wake / push between repeats)
    assert len(summary["gen_standalone_awake_repeats"]) == summary["samples"]
    assert summary["gen_standalone_awake_tokens_per_s"] > 0
    held = summary["memory_held_gb"]  # measured per component, beside the plan's
    assert held.keys() == {"actor (trained params + AdamW)", "critic (trained params + AdamW)", "reference"}
    assert held["actor (trained params + AdamW)"] == pytest.approx(
        summary["memory_plan_gb"]["actor (weights + AdamW)"], rel=0.01)
    # the process's host memory by kind, sampled from before the trainer to after the steps
    host = summary["host_memory"]
    assert list(host["snapshots"]) == ["imports, data, plan", "trainer setup (states, rollout engine)",
                                       *[f"step {i}" for i in range(1, 5)], "after the steps"]
    assert host["peaks"]["anon"]["gb"] >= max(s["anon"] for s in host["snapshots"].values()) > 0
    assert host["peaks"]["anon"]["phase"] in host["snapshots"]
    rows = [r for r in ledger.read(led) if r["bench"] == "ppo_step"]  # the one-step starts write none
    assert len(rows) == 1
    check_row(rows[0], "ppo_step")
    assert rows[0]["config"] == "configs/gsm8k_qwen2.5_0.5b.yaml" and rows[0]["samples"]["steps"] == 2
    assert rows[0]["figures"]["host/peak_anon_gb"] == host["peaks"]["anon"]["gb"]
    # check_configs' row of such a run: JAX's peak beside the plan, the host's peaks beside the plan's host bytes
    from scripts import check_configs

    result = {"name": "qwen2.5-0.5b", "config": "configs/gsm8k_qwen2.5_0.5b.yaml", "shape": "tiny", "overrides": [],
              "exit_code": 0, "seconds": 1.0, "out_of_memory": False, "bench": json.loads(out.read_text())}
    f = check_configs.row_of(result, 4)["figures"]
    assert f["jax_peak_gb"] == max(summary["jax_peak_gb_per_step"]) and f["plan_gb"] == summary["memory_estimate_gb"]
    assert f["plan_host_gb"] == 0.0  # nothing offloaded
    assert f["host_peak_gb"]["anon"] == host["peaks"]["anon"]["gb"]
    assert f["host_peak_phase"]["anon"] == host["peaks"]["anon"]["phase"]
    assert rows[0]["figures"]["step_s"] == pytest.approx(summary["median_steps_3_to_n"]["timing_s/step"])


def test_host_memory_names_the_phase_of_each_peak():
    """scripts/host_memory.py: an array allocated in a phase and freed in the next makes the anonymous peak, in the
    phase that allocated it, at least the array's size above where that phase began; mapped files are counted apart."""
    import numpy as np

    from scripts.host_memory import HostMemory

    h = HostMemory(interval=10.0).start()  # the marks sample; the thread's first tick is after the test
    h.mark("allocate")
    a = np.ones(256 * 2**20 // 8)  # 256 MiB, every page written
    h.mark("free")
    del a
    h.mark("after")
    h.stop()
    peaks, snaps = h.peaks(), h.snapshots
    assert peaks["anon"]["phase"] == "allocate"
    assert peaks["anon"]["gb"] - snaps["allocate"]["anon"] >= 0.25 * 0.98
    assert snaps["after"]["anon"] < snaps["free"]["anon"] - 0.2  # freed: given back to the system
    assert set(h.maps) >= {"allocate", "free", "after"} and h.maps["free"]["groups"]  # what it was, by mapping
    assert peaks["rss_peak"]["gb"] >= peaks["anon"]["gb"] and 0 < peaks["file"]["gb"] < peaks["rss"]["gb"]


def test_host_mappings_name_a_large_anonymous_block_and_the_files_apart():
    """scripts/host_memory.mappings: an anonymous block of 1.5 GiB, every page written, is a group of its own with its
    resident size; shared libraries are grouped by path; the groups' resident sizes add up to at most the process's."""
    import numpy as np

    from scripts.host_memory import mappings, status

    a = np.ones(3 * 2**30 // 2 // 8)  # 1.5 GiB
    groups = mappings(top=1000)
    rss = status()["rss"]
    own = [g for g in groups if g["name"].startswith("[anon") and "GiB mapped" in g["name"]]
    assert any(1.5 * 0.99 <= g["rss"] <= 1.6 and g["anon"] >= 1.5 * 0.99 and g["n"] == 1 for g in own), own
    libs = [g for g in groups if g["name"].endswith(".so") or ".so." in g["name"]]
    assert libs and all(g["name"].startswith("/") for g in libs)
    assert len({g["name"] for g in groups}) == len(groups)
    assert sum(g["rss"] for g in groups) <= rss + 0.01
    del a


@pytest.mark.slow
def test_bench_update_prints_jax_and_torch_configurations(tmp_path):
    led = tmp_path / "results.jsonl"
    res = run_script("bench_update.py", "--model", "tiny", "--batch", "2", "--seq", "32", "--steps", "2", "--chunk", "8",
                     "--torch", "ckpt,nockpt", "--lora", "8", "--ledger", str(led), "--workdir", str(tmp_path / "w"))
    assert "JAX / fastest torch" in res.stdout and "no checkpointing" in res.stdout and "LoRA r=8" in res.stdout
    row = ledger.read(led)[-1]
    check_row(row, "update")
    f = row["figures"]
    assert f["torch_best"] in ("ckpt", "nockpt") and f["jax_over_torch_best"] > 0 and 0 < f["jax_mfu"]
    # LoRA beside full fine-tuning, counted from the shape: full = fp32 weights + AdamW's two moments (12 bytes
    # per parameter); LoRA = the bf16 base (2) + fp32 adapters with AdamW (12 per adapter parameter); the optimizer's
    # step counters are a few scalars beside them
    from jaxppo.models.lora import LoraSpec, adapter_params
    from scripts.shapes import SHAPES

    n, a = SHAPES["tiny"].num_params(), adapter_params(SHAPES["tiny"], LoraSpec(8, 16.0))
    assert f["jax_state_gb"] * 2**30 == pytest.approx(12 * n, abs=64)
    assert f["jax_lora8_state_gb"] * 2**30 == pytest.approx(2 * n + 12 * a, abs=64) and f["jax_lora8_step_s"] > 0


@pytest.mark.slow
def test_bench_update_runs_each_micro_batch_loop_side_by_side(tmp_path):
    led = tmp_path / "results.jsonl"
    res = run_script("bench_update.py", "--model", "tiny", "--batch", "4", "--seq", "32", "--steps", "2", "--chunk", "8",
                     "--micro", "1", "--torch", "", "--lora", "8", "--no-full", "--loop", "scan,host", "--ledger",
                     str(led), "--workdir", str(tmp_path / "w"))
    assert "LoRA r=8, scan loop" in res.stdout and "LoRA r=8, host loop" in res.stdout
    row = ledger.read(led)[-1]
    assert row["loops"] == ["scan", "host"] and row["micro"] == 1
    f = row["figures"]
    assert f["jax_lora8_step_s"] > 0 and f["jax_lora8_host_step_s"] > 0 and "jax_step_s" not in f


@pytest.mark.slow
def test_bench_packing_runs_on_cpu(tmp_path):
    out = tmp_path / "p.json"
    res = run_script("bench_packing.py", "--model", "tiny", "--seqs", "8", "--micro", "2", "--budget", "512",
                     "--steps", "1", "--json-out", str(out))
    assert out.is_file() and "packed" in res.stdout.lower()


@pytest.mark.slow
def test_bench_packing_times_head_chunks_and_lora(tmp_path):
    """The head's chunk sizes side by side (`--chunk`), the log-prob pass timed (`--forward`), LoRA on the host loop:
    one packed row per size, each naming its size and carrying the forward time."""
    out = tmp_path / "p.json"
    run_script("bench_packing.py", "--model", "tiny", "--seqs", "8", "--budget", "512", "--steps", "1", "--dist",
               "full", "--chunk", "8,64", "--forward", "--no-padded", "--head-remat", "0", "--lora", "2", "--loop",
               "host", "--json-out", str(out))
    rows = json.loads(out.read_text())
    assert [r["logprob_chunk_size"] for r in rows] == [8, 64]
    assert all(r["layout"] == "packed" and r["forward_s"] > 0 and r["lora_rank"] == 2 and r["loop"] == "host"
               and r["logprob_remat"] is False for r in rows)


@pytest.mark.slow
def test_compare_modes_records_each_run_and_the_on_policy_modes_train_alike(tmp_path):
    """scripts/compare_modes.py: a ledger row per run with its phases; the synchronous run and the one with the next
    batch generated during the critic's update (the same computations, reordered) log the same training score and
    actor gradient norms."""
    from tests.train_helpers import FAST

    led = tmp_path / "l.jsonl"
    for earlier in ("sync_0", "sync_2"):  # an earlier comparison's run directories: never trained into again
        (tmp_path / "w" / earlier).mkdir(parents=True)
    res = run_script("compare_modes.py", "--steps", "3", "--skip", "1", "--modes", "sync,critic", "--workdir",
                     str(tmp_path / "w"), "--ledger", str(led), *FAST,
                     "actor.optim.lr=1e-2")
    rows = ledger.read(led)
    assert [r["mode"] for r in rows] == ["sync", "critic"] and "critic" in res.stdout
    for r in rows:
        check_row(r, "step_modes")
        assert r["figures"]["timing_s/step"] > 0 and r["samples"]["timing_s"] == 2
    assert rows[1]["overrides"][0] == "trainer.rollout_during_critic_update=true"
    assert rows[0]["figures"]["score_mean"] == rows[1]["figures"]["score_mean"]
    assert rows[0]["figures"]["actor_grad_norm_mean"] == rows[1]["figures"]["actor_grad_norm_mean"] > 0
    assert (tmp_path / "w" / "sync_1" / "metrics.jsonl").is_file()
    assert not any((tmp_path / "w" / earlier / "metrics.jsonl").exists() for earlier in ("sync_0", "sync_2"))


def test_bench_vllm_sampling_refuses_an_unknown_way_before_starting_an_engine(capsys):
    from scripts import bench_vllm_sampling

    with pytest.raises(SystemExit) as e:
        bench_vllm_sampling.main(["--shape", "tiny", "--ways", "one_seed,fast"])
    assert e.value.code == 2 and "--ways: unknown way 'fast'" in capsys.readouterr().err
    with pytest.raises(SystemExit) as e:
        bench_vllm_sampling.main(["--shape", "tiny", "--profile-way", "no_logprobs,slow"])
    assert e.value.code == 2 and "--profile-way: unknown way 'slow'" in capsys.readouterr().err


def test_bench_vllm_sampling_cpus_parse_and_placement_in_a_held_process():
    """`--cpus` as taskset writes it, and `cpu_placement` reports the CPUs a process is held to (in a child that
    holds itself to one CPU, as the benchmark does before vLLM starts its threads)."""
    from scripts.bench_vllm_sampling import parse_cpus

    assert parse_cpus("0-3,8") == {0, 1, 2, 3, 8} and parse_cpus("3") == {3} and parse_cpus("2,3,") == {2, 3}
    cpu = max(os.sched_getaffinity(0))
    code = ("import json, os, sys; sys.path.insert(0, sys.argv[1]); from scripts.bench_vllm_sampling import "
            f"cpu_placement; os.sched_setaffinity(0, {{{cpu}}}); print(json.dumps(cpu_placement()))")
    got = json.loads(subprocess.run([sys.executable, "-c", code, str(ROOT)], capture_output=True, text=True,
                                    timeout=120, check=True).stdout)
    assert got["cpus"] == [cpu] and got["cpu_count"] == os.cpu_count()
    assert set(got["siblings"]) <= {str(cpu)} and all(cpu in parse_cpus(v) for v in got["siblings"].values())


def test_bench_vllm_engines_refuses_a_split_that_is_not_even_before_starting_an_engine(capsys):
    from scripts import bench_vllm_engines

    with pytest.raises(SystemExit) as e:
        bench_vllm_engines.main(["--shape", "tiny", "--prompts", "6", "--engines", "1,4"])
    assert e.value.code == 2 and "4 engines cannot split 6 prompts evenly" in capsys.readouterr().err


def test_bench_sync_runs_on_a_gpu_and_refuses_clearly_elsewhere():
    import torch

    if not torch.cuda.is_available():
        # its CPU-testable parts, the direct push and the Triton cast-copy, are tests/bridge/test_push.py and
        # test_cast_copy.py
        res = run_python(str(ROOT / "scripts" / "bench_sync.py"), "--reps", "1", timeout=300, check=False)
        assert res.returncode == 2 and "needs a CUDA GPU" in res.stderr and "Traceback" not in res.stderr, res.stderr
        return
    res = run_script("bench_sync.py", "--model", "qwen2.5-0.5b", "--reps", "1", "--prompts", "8", "--gen-len", "8",
                     "--mismatch-prompts", "4")
    rows = [json.loads(line[len("RESULT "):]) for line in res.stdout.splitlines() if line.startswith("RESULT ")]
    assert len(rows) == 1 and rows[0]["model"] == "qwen2.5-0.5b", res.stdout[-3000:]


def test_ledger_rows_need_their_provenance(tmp_path):
    row = ledger.make_row("update", {"x": 1.0}, command="python scripts/bench_update.py")
    path = ledger.append(row, tmp_path / "r.jsonl")
    assert ledger.read(path) == [row]
    with pytest.raises(ValueError, match="lacks"):
        ledger.append({"bench": "update", "figures": {}}, tmp_path / "r.jsonl")


def _numbers(value) -> list[float]:
    if isinstance(value, bool):
        return []
    if isinstance(value, (int, float)):
        return [float(value)]
    if isinstance(value, dict):
        return [x for v in value.values() for x in _numbers(v)]
    if isinstance(value, list):
        return [x for v in value for x in _numbers(v)]
    return []


def _performance_rows() -> list[str]:
    readme = (ROOT / "README.md").read_text()
    section = readme[readme.index("## Performance"):]
    end = section.find("\n## ", 1)
    section = section if end < 0 else section[:end]
    return [line for line in section.splitlines() if line.startswith("|") and not line.startswith(("| what", "|---"))]


def test_readme_performance_figures_are_ledger_rows():
    """Every row of README's performance table cites a (bench, date) of the ledger, and each of its bold
    figures is a figure of such a row, as printed (3.70 s, 54.1k tok/s, 48.3%, 1.07x)."""
    import re

    rows = ledger.read()
    assert len(_performance_rows()) >= 8
    for line in _performance_rows():
        cited = re.findall(r"`(\w+)`, (\d{4}-\d{2}-\d{2})", line)
        assert cited, f"README performance row cites no ledger row: {line[:80]}"
        cands = [r for r in rows if (r["bench"], r["date"]) in set(cited)]
        assert cands, f"no ledger row for {cited}: {line[:80]}"
        figures = [x for r in cands for x in _numbers(r["figures"])]
        for num, unit in re.findall(r"\*\*([\d.,]+)(k| s| ms|%|x)?[^*]*\*\*", line):
            shown = float(num.replace(",", ""))
            decimals = len(num.split(".")[1]) if "." in num else 0
            scale = {"k": 1e-3, "%": 100.0, " ms": 1e3}.get(unit, 1.0)
            assert any(round(f * scale, decimals) == shown for f in figures), (
                f"README's **{num}{unit or ''}** is no figure of the ledger rows {cited}")


def test_check_configs_records_the_runs_own_step_row_when_asked(tmp_path, monkeypatch):
    """`check_configs.py --step-rows`: the config's run (bench_ppo_step.py in a fresh process) records its own
    `ppo_step` row in the same ledger as the `config_check` row, so one 10-step run gives both; without the flag
    the run records none."""
    from scripts import check_configs

    seen = []

    def fake_run(cmd, **kw):
        seen.append(cmd)
        return subprocess.CompletedProcess(cmd, 2)

    monkeypatch.setenv("JAXPPO_COMMIT", "abc1234")  # the rows' commit without asking git (subprocess is faked)
    monkeypatch.setattr(check_configs.subprocess, "run", fake_run)
    led = tmp_path / "results.jsonl"
    name = check_configs.CHECKS[0][0]
    for extra in ([], ["--step-rows"]):
        check_configs.main(["--only", name, "--steps", "10", "--workdir", str(tmp_path), "--ledger", str(led), *extra])
    plain, both = seen
    assert "--no-ledger" in plain and "--ledger" not in plain
    assert "--no-ledger" not in both and both[both.index("--ledger") + 1] == str(led)
    assert [r["bench"] for r in ledger.read(led)] == ["config_check", "config_check"]


def test_check_configs_latest_lists_each_checks_newest_row(tmp_path, capsys):
    """`check_configs.py --latest`: one table line per check in CHECKS' order, from that check's newest row (an
    older row of the same check is not shown), the plan's total over JAX's peak, a refusal marked, a check with no
    row said never to have run."""
    from scripts import check_configs

    led = tmp_path / "results.jsonl"
    (a, *_), (b, *_), (c, *_) = check_configs.CHECKS[:3]
    fig = {"exit_code": 0, "out_of_memory": False, "plan_gb": 50.0, "plan_margin_gb": 2.0, "jax_peak_gb": 48.0,
           "late_compiles": [], "timing_s/step": 4.5}
    rows = [("old0001", a, fig), ("new0002", a, {**fig, "jax_peak_gb": 40.0}),
            ("ref0003", b, {"exit_code": 2, "out_of_memory": False, "refusal": "no"})]
    for commit, name, f in rows:
        r = ledger.make_row("config_check", f, check=name, samples={"steps": 3})
        ledger.append({**r, "commit": commit}, led)
    assert check_configs.main(["--latest", "--ledger", str(led)]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == 2 + len(check_configs.CHECKS)
    first, second, third = lines[2:5]
    assert first.startswith(f"| {a} |") and "new0002" in first and "old0001" not in first
    assert "| 50.000 + 2.0 | 40.000 | 1.300 | 0 | 4.50 |" in first  # (50 + 2) / 40
    assert second.startswith(f"| {b} |") and "| 2 (refused) |" in second
    assert third.startswith(f"| {c} |") and "never run" in third


def test_make_checkpoint_never_replaces_a_directory_that_holds_something_else(tmp_path, capsys):
    """The checkpoint replaces --out as a whole: a directory of other files (`--out ~/models`) is refused with
    nothing touched, a checkpoint is replaced only with --force, a new or empty directory is written."""
    from scripts import make_checkpoint

    mine = tmp_path / "models"
    (mine / "keep").mkdir(parents=True)
    (mine / "notes.txt").write_text("mine")
    assert make_checkpoint.main(["--shape", "tiny", "--out", str(mine)]) == 2
    assert "holds no checkpoint" in capsys.readouterr().err
    assert sorted(p.name for p in mine.iterdir()) == ["keep", "notes.txt"] and (mine / "keep").is_dir()
    afile = tmp_path / "a_file"
    afile.write_text("x")
    assert make_checkpoint.main(["--shape", "tiny", "--out", str(afile)]) == 2 and afile.read_text() == "x"

    new = tmp_path / "tiny"
    assert make_checkpoint.main(["--shape", "tiny", "--out", str(new), "--seed", "1"]) == 0
    first = (new / "model.safetensors").read_bytes()
    assert make_checkpoint.main(["--shape", "tiny", "--out", str(new), "--seed", "2"]) == 2
    assert "--force" in capsys.readouterr().err and (new / "model.safetensors").read_bytes() == first
    assert make_checkpoint.main(["--shape", "tiny", "--out", str(new), "--seed", "2", "--force"]) == 0
    assert (new / "model.safetensors").read_bytes() != first
