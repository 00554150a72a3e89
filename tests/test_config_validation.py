"""Bad configuration exits with code 2 before anything is built: every key with a closed set of values, every
size relation the engine would otherwise assert, and a run that cannot fit the card's memory."""

from __future__ import annotations

import subprocess
import sys

import pytest

from jaxppo.config import CLOSED_SETS, _registry_sets
from jaxppo.train import main
from tests.train_helpers import ROOT, train_env

BAD = {"model.dtype": "fp8", "model.param_dtype": "fp8"}  # the value the audit found slipping through
CLOSED = [(key, BAD.get(key, "bogus")) for key in sorted({**CLOSED_SETS, **_registry_sets()})]
CLOSED.append(("trainer.logger", "[console,bogus]"))


def run_main(tmp_path, *overrides) -> tuple[int, str]:
    return main([f"trainer.default_local_dir={tmp_path / 'run'}", *overrides]), str(tmp_path / "run")


@pytest.mark.parametrize("key,value", CLOSED, ids=[k for k, _ in CLOSED])
def test_a_closed_set_key_with_an_unknown_value_exits_2(key, value, tmp_path, capsys):
    rc, run = run_main(tmp_path, f"{key}={value}")
    err = capsys.readouterr().err
    assert rc == 2, err
    assert key in err and "known" in err and "Traceback" not in err, err
    assert not (tmp_path / "run").exists()  # no run directory, data or model written


# the audit's example: 8 prompts x 4 samples, and the default's forward micro-batch of 256 sequences per device
SMALL_BATCH = ["data.train_batch_size=8", "actor.ppo_mini_batch_size=8", "critic.ppo_mini_batch_size=8",
               "actor.ppo_micro_batch_size_per_device=32", "critic.ppo_micro_batch_size_per_device=32"]
RELATIONS = [
    # the default's forward micro-batch (256 sequences per device) does not divide 8 prompts x 4 samples
    (SMALL_BATCH, "log_prob_micro_batch_size_per_device"),
    (["actor.ppo_micro_batch_size_per_device=3"], "actor.ppo_micro_batch_size_per_device (3)"),
    (["actor.ppo_mini_batch_size=24"], "does not divide data.train_batch_size"),
    (["rollout.top_p=1.5"], "rollout.top_p"),
    (["rollout.top_k=0"], "rollout.top_k"),
    (["algorithm.adv_estimator=grpo", "rollout.n=1"], "rollout.n >= 2"),
    (["algorithm.adv_estimator=grpo_passk", "rollout.n=1"], "rollout.n >= 2"),
    (["algorithm.adv_estimator=remix"], "'remix' unknown; known: ['gae', 'gpg', 'grpo', 'grpo_passk', 'opo'"),
    (["actor.use_dynamic_bsz=true", "actor.ppo_max_token_len_per_device=16"], "smaller than one sequence"),
    (["rollout.gpu_memory_utilization=0.97"], "rollout.gpu_memory_utilization"),
    (["reward.timeout_s=-1"], "reward.timeout_s"),
    (["actor.tis_threshold=-1"], "actor.tis_threshold"),
    (["reward.num_workers=-2"], "reward.num_workers"),
    (["reward.default_rule=gsm8k"], "reward.default_rule 'gsm8k' unknown"),
    (["trainer.max_to_keep=0"], "trainer.max_to_keep"),
    (["trainer.resume_mode=/no/such/checkpoint"], "trainer.resume_mode"),
    (["model.path=/no/such/model"], "model.path"),
    (["mesh.data=4"], "needs 4 devices"),
    (["custom_reward_function.path=/no/such/reward.py"], "custom_reward_function.path: /no/such/reward.py does not"),
    ([f"custom_reward_function.path={ROOT / 'tests' / 'rewards' / 'user_reward.py'}", "custom_reward_function.name=nope"],
     "custom_reward_function.name:"),
    (["actor.lora_rank=-1"], "actor.lora_rank must be >= 0"),
    (["actor.lora_rank=8", "actor.target_modules=q_proj,lm_head"], "actor.target_modules 'q_proj,lm_head': unknown"),
    (["critic.lora_rank=8", "critic.lora_alpha=0"], "critic.lora_alpha = 0.0: must be a finite number in (0, inf)"),
    (["actor.lora_rank=8", "mesh.fsdp_gather=update"], "needs mesh.fsdp_gather=layer"),
]


@pytest.mark.parametrize("overrides,message", RELATIONS, ids=[r[1][:40] for r in RELATIONS])
def test_impossible_sizes_and_paths_exit_2_before_the_run_directory_exists(overrides, message, tmp_path, capsys,
                                                                          monkeypatch):
    """What `jaxppo.train` checks before building anything, for one device as a user's CPU run has (this test
    process has eight)."""
    import jax

    monkeypatch.setattr(jax, "device_count", lambda *a: 1)
    rc, run = run_main(tmp_path, *overrides)
    err = capsys.readouterr().err
    assert rc == 2 and message in err and "Traceback" not in err, err
    assert len(err.strip().splitlines()) == 1, err  # one line
    assert not (tmp_path / "run").exists()


def _outside(key: str) -> list[str]:
    """Values outside the domain of float key `key`: NaN (inf takes the same check), and one past each finite
    bound."""
    from jaxppo.config.checks import _domain_of

    lo, hi, lo_open, hi_open = _domain_of(key)
    out = ["nan"] if lo != -float("inf") else ["nan", "-inf"]
    if lo != -float("inf"):
        out.append(str(lo if lo_open else lo - 0.5))
    if hi != float("inf"):
        out.append(str(hi if hi_open else hi + 0.5))
    return out


def _float_cases() -> list[tuple[str, str]]:
    from jaxppo.config.checks import float_keys

    cases = []
    for key in float_keys():
        for value in _outside(key):
            v = f"[{value},0.99]" if key.endswith("betas") else value
            cases.append((key, v))
    return cases


FLOATS = _float_cases()


@pytest.mark.parametrize("key,value", FLOATS, ids=[f"{k}={v}" for k, v in FLOATS])
def test_a_float_outside_its_domain_exits_2_before_the_run_directory_exists(key, value, tmp_path, capsys):
    rc, _ = run_main(tmp_path, f"{key}={value}")
    err = capsys.readouterr().err
    assert rc == 2 and key in err and "must be a finite number in" in err, err
    assert not (tmp_path / "run").exists()


def test_every_float_key_has_a_domain():
    """A new float knob must say its domain (FLOAT_DOMAINS), so NaN or a negative clip ratio never starts a run."""
    from jaxppo.config.checks import FLOAT_DOMAINS, _domain_of, float_keys

    keys = float_keys()
    used = set()
    for key in keys:
        _domain_of(key)  # KeyError: no domain
        parts = key.split(".")
        used.add("optim." + parts[-1] if "optim" in parts else
                 "trainer.health.*." + parts[-1] if key.startswith("trainer.health.") else key)
    assert used == set(FLOAT_DOMAINS), set(FLOAT_DOMAINS) ^ used
    assert {"actor.clip_ratio_low", "actor.clip_ratio_high", "actor.clip_ratio_c", "critic.cliprange_value",
            "algorithm.gamma", "algorithm.lam", "actor.entropy_coeff"} <= set(keys)


@pytest.mark.parametrize("text,what", [("data:\n  train_batch_size: [1,\n", "not valid YAML: did not find expected"),
                                       ("data: !!python/object/apply:os.system [ls]\n", "not valid YAML: could not "
                                        "determine a constructor"),
                                       ("- 1\n- 2\n", "the top level must be a mapping"),
                                       ("data: 3\n", "is not a subclass of DataConfig")])
def test_a_broken_yaml_file_exits_2_naming_the_file_and_the_line(text, what, tmp_path, capsys):
    bad = tmp_path / "bad.yaml"
    bad.write_text(text)
    rc = main(["--config", str(bad), f"trainer.default_local_dir={tmp_path / 'run'}"])
    err = capsys.readouterr().err
    assert rc == 2 and str(bad) in err and what in err and "Traceback" not in err, err
    if "line" in what or "YAML" in what:
        assert "line" in err
    assert not (tmp_path / "run").exists()


def run_cli(tmp_path, *overrides) -> subprocess.CompletedProcess:
    """`python -m jaxppo.train` as a user runs it: one device."""
    return subprocess.run([sys.executable, "-m", "jaxppo.train", f"trainer.default_local_dir={tmp_path / 'run'}",
                           *overrides], capture_output=True, text=True, timeout=300, env=train_env(), cwd=ROOT)


def test_a_size_relation_exits_2_from_the_command_line(tmp_path):
    res = run_cli(tmp_path, *SMALL_BATCH)
    assert res.returncode == 2 and "log_prob_micro_batch_size_per_device" in res.stderr, res.stderr[-2000:]
    assert "Traceback" not in res.stderr and not (tmp_path / "run").exists()


@pytest.fixture(scope="module")
def shapes(tmp_path_factory):
    from scripts.shapes import write_config_dir

    d = tmp_path_factory.mktemp("shapes")
    return {name: write_config_dir(name, d / name) for name in ("qwen2.5-0.5b", "qwen2.5-7b")}


def test_a_run_that_cannot_fit_the_card_exits_2_and_says_what_to_change(shapes, tokenizer_dir, tmp_path):
    """Qwen2.5-7B trained in full (actor, critic, reference) on one H200: the states alone do not fit, so nothing is
    compiled; the message names the states and the sharding that would fit (tests/test_memory_plan.py has the
    compiled plan's own refusals)."""
    res = run_cli(tmp_path, f"model.path={shapes['qwen2.5-7b']}", "model.random_init=true", f"data.tokenizer={tokenizer_dir}",
                  "trainer.device_memory_gb=141", "actor.use_kl_loss=true")
    err = res.stderr
    assert res.returncode == 2, err[-3000:]
    assert "does not fit the card" in err and "mesh.fsdp=" in err and "memory plan per device" in err
    assert "actor (weights + AdamW)" in err and "states alone" in err and "Traceback" not in err
    assert "actor.optimizer_offload=true, critic.optimizer_offload=true" in err  # the host can hold the moments
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("key, value", [
    ("algorithm.rollout_correction.rollout_rs_threshold", "0.5_2"),  # verl's lower_upper bounds, not 0.52
    ("algorithm.rollout_correction.rollout_rs_threshold", "1_3"),  # not 13
    ("algorithm.rollout_correction.rollout_is_threshold", "0.5_2"),
    ("trainer.experiment_name", "007"),
])
def test_a_text_key_takes_its_value_as_written(key, value, tmp_path):
    """YAML 1.1 reads '0.5_2' as 0.52 and '1_3' as 13 ('_' a digit separator): a text key keeps what was typed, on
    the command line and in a config file."""
    import yaml

    from jaxppo.config import load_config

    rs = ["algorithm.rollout_correction.rollout_rs=token_k1"] if key.endswith("rs_threshold") else []
    section, _, leaf = key.rpartition(".")

    def value_in(cfg):
        node = cfg
        for part in section.split("."):
            node = getattr(node, part)
        return getattr(node, leaf)

    assert value_in(load_config(ROOT / "configs" / "default.yaml", [*rs, f"{key}={value}"])) == value
    # and in a YAML file (key: 0.5_2, unquoted)
    nested: dict = {}
    node = nested
    for part in section.split("."):
        node = node.setdefault(part, {})
    node[leaf] = "VALUE"
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump(nested).replace("VALUE", value))
    assert value_in(load_config(path, rs)) == value


def test_a_config_file_builds_on_the_files_its_defaults_list_names(tmp_path):
    """`defaults: [...]` (Hydra's key): the named files' keys first, in order, then the file's own, then the command
    line's; each name relative to the file that names it, `.yaml` optional, files named inside named files too."""
    from jaxppo.config import load_config

    (tmp_path / "base.yaml").write_text("data:\n  train_batch_size: 32\n  max_response_length: 24\n"
                                        "actor:\n  ppo_mini_batch_size: 16\ncritic:\n  ppo_mini_batch_size: 16\n")
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "mid.yaml").write_text("defaults: [../base.yaml]\ndata:\n  max_response_length: 20\n"
                                               "trainer:\n  experiment_name: mid\n")
    (tmp_path / "other.yaml").write_text("trainer:\n  experiment_name: other\n  total_training_steps: 7\n")
    top = tmp_path / "top.yaml"
    top.write_text("defaults:\n  - sub/mid\n  - other.yaml\ndata:\n  train_batch_size: 48\n")
    cfg = load_config(top, ["trainer.total_training_steps=9"])
    assert cfg.data.train_batch_size == 48  # the file's own key over its defaults'
    assert cfg.data.max_response_length == 20  # mid's over base's
    assert cfg.actor.ppo_mini_batch_size == 16  # from base, two files down
    assert cfg.trainer.experiment_name == "other"  # the later of two defaults wins
    assert cfg.trainer.total_training_steps == 9  # the command line over every file


@pytest.mark.parametrize("files, message", [
    ({"top.yaml": "defaults: [missing]\n"}, "top.yaml: `defaults` names 'missing', and there is no"),
    ({"top.yaml": "defaults: [a]\n", "a.yaml": "defaults: [top.yaml]\n"},
     "a.yaml: `defaults` names 'top.yaml', which includes a.yaml again: top.yaml -> a.yaml -> top.yaml"),
    ({"top.yaml": "defaults: {a: 1}\n"}, "top.yaml: `defaults` must list config files"),
    ({"top.yaml": "defaults: [a]\n", "a.yaml": "actor:\n  ppo_mini_batchsize: 4\n"},
     "a.yaml: unknown config key 'actor.ppo_mini_batchsize'; did you mean actor.ppo_mini_batch_size"),
    ({"top.yaml": "defaults: [a]\n", "a.yaml": "data:\n  train_batch_size: [1,\n"}, "a.yaml: not valid YAML"),
    ({"top.yaml": "defaults: [a]\n", "a.yaml": "actor:\n  ppo_epochs: two\n"}, "a.yaml: config key 'actor.ppo_epochs'"),
])
def test_a_bad_defaults_list_exits_2_naming_the_file_and_the_entry(files, message, tmp_path, capsys):
    for name, text in files.items():
        (tmp_path / name).write_text(text)
    rc = main(["--config", str(tmp_path / "top.yaml"), f"trainer.default_local_dir={tmp_path / 'run'}"])
    err = capsys.readouterr().err
    assert rc == 2 and message in err and "Traceback" not in err, err
    assert not (tmp_path / "run").exists()


def test_the_committed_configs_built_on_others_differ_from_them_in_what_they_set_only():
    """The 1.5B configs are the 0.5B ones with the 1.5B model, the one-step-ahead configs the synchronous ones one
    step ahead (each with its own run directory): every other key resolves alike (but for the rollout correction
    one step ahead implies), and each file sets nothing its defaults already set to the same value."""
    import dataclasses

    import yaml

    from jaxppo.config import load_config

    built = [p for p in sorted((ROOT / "configs").glob("*.yaml")) if "defaults" in (yaml.safe_load(p.read_text()))]
    assert {p.name for p in built} >= {"gsm8k_qwen2.5_1.5b.yaml", "gsm8k_grpo_qwen2.5_1.5b.yaml"}
    for path in built:
        own = yaml.safe_load(path.read_text())
        names = own.pop("defaults")
        base = dataclasses.asdict(load_config(path.parent / names[-1]))
        cfg = dataclasses.asdict(load_config(path))

        def drop_set(own: dict, cfg: dict, base: dict, where: tuple) -> None:
            """Each key the file sets (nested sections too: `algorithm.rollout_correction.bypass_mode`) resolves
            to the file's value and differs from the defaults'; then it is left out of the comparison."""
            for key, value in own.items():
                if isinstance(value, dict):
                    drop_set(value, cfg[key], base[key], (*where, key))
                    continue
                assert cfg[key] == value and base[key] != value, (path.name, *where, key)
                cfg.pop(key), base.pop(key)

        drop_set(own, cfg, base, ())
        if own.get("trainer", {}).get("async_rollout"):  # and the correction it implies (jaxppo/config/loading.py)
            cfg["algorithm"].pop("rollout_correction"), base["algorithm"].pop("rollout_correction")
        assert cfg == base, path.name


@pytest.mark.parametrize("mesh, refused", [
    (["mesh.data=8", "mesh.grad_reduce_dtype=bfloat16"], None),
    (["mesh.data=1", "mesh.fsdp=8", "mesh.grad_reduce_dtype=bfloat16"], "mesh.grad_reduce_dtype=bfloat16 applies"),
    (["mesh.data=8", "mesh.grad_reduce_dtype=bfloat16", "model.micro_batch_loop=host"], None),
    (["mesh.data=1", "mesh.fsdp=8", "mesh.fsdp_gather=update", "model.micro_batch_loop=host"], None),
    (["mesh.data=1", "mesh.fsdp=8", "model.micro_batch_loop=host"], None)])
def test_what_needs_per_device_gradient_sums_is_checked_against_the_mesh(mesh, refused):
    """On eight devices: the bf16 gradient reduction needs each device to sum its own gradients (whole parameters
    per device); the host's micro-batch loop runs on every mesh (tests/test_engine.py)."""
    from jaxppo.config import load_config
    from jaxppo.config.checks import validate
    from jaxppo.errors import ConfigError

    micro = [f"{m}.{k}=4" for m in ("actor", "critic")
             for k in ("ppo_micro_batch_size_per_device", "log_prob_micro_batch_size_per_device")]
    if refused is None:
        validate(load_config(ROOT / "configs" / "default.yaml", micro + mesh), 8)
    else:  # (refused as the config loads: every size is given)
        with pytest.raises(ConfigError, match=refused):
            validate(load_config(ROOT / "configs" / "default.yaml", micro + mesh), 8)


@pytest.mark.parametrize("mesh, refused", [
    (["mesh.tensor=2", "mesh.fsdp_gather=update"], "mesh.fsdp_gather=update needs mesh.tensor=1"),
    (["mesh.fsdp=2", "mesh.grad_reduce_dtype=bfloat16"], "mesh.grad_reduce_dtype=bfloat16 applies"),
    (["mesh.tensor=-1", "mesh.fsdp_gather=update"], None)])
def test_a_mesh_given_in_sizes_is_checked_when_the_config_loads(mesh, refused):
    """Loading checks the engines' own rule (jaxppo.sharding.parallel_mode) on a mesh whose sizes are all given, before
    any device is asked; an axis of -1 waits for the device count (the start checks it then)."""
    from jaxppo.config import load_config
    from jaxppo.errors import ConfigError

    if refused is None:
        load_config(ROOT / "configs" / "default.yaml", mesh)
    else:
        with pytest.raises(ConfigError, match=refused):
            load_config(ROOT / "configs" / "default.yaml", mesh)
