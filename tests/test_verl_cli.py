"""verl's command line as it is (jaxppo/config/verl_keys.py): verl's own example overrides for PPO, GRPO, DAPO and
Dr. GRPO, pasted after `python -m jaxppo.train` with only the paths changed (the embedded default's task and
model) and the batch scaled to a CPU, run a step each; the table and docs/verl_keys_table.md stay equal; a verl key
with no jaxppo meaning exits 2 naming it."""

from __future__ import annotations

import dataclasses
import typing

import pytest

from jaxppo.config import Config, load_config
from jaxppo.config.verl_keys import IGNORED, TABLE, UNSUPPORTED, markdown
from tests.train_helpers import ON_EMBEDDED_TASK, ROOT, read_metrics, run_train

# verl's examples (verl 0.9: docs' quick start, examples/grpo_trainer/run_qwen2-7b_math.sh, recipe/dapo's
# run_dapo_qwen2.5_32b.sh, docs' Dr. GRPO page), their overrides as written there
VERL_PPO = """data.train_files=$HOME/data/gsm8k/train.parquet data.val_files=$HOME/data/gsm8k/test.parquet
 data.train_batch_size=256 data.max_prompt_length=512 data.max_response_length=256
 actor_rollout_ref.model.path=Qwen/Qwen2.5-0.5B-Instruct actor_rollout_ref.actor.optim.lr=1e-6
 actor_rollout_ref.actor.ppo_mini_batch_size=64 actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=4
 actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=8 actor_rollout_ref.rollout.tensor_model_parallel_size=1
 actor_rollout_ref.rollout.gpu_memory_utilization=0.4 actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu=4
 critic.optim.lr=1e-5 critic.model.path=Qwen/Qwen2.5-0.5B-Instruct critic.ppo_micro_batch_size_per_gpu=4
 algorithm.kl_ctrl.kl_coef=0.001 trainer.logger=console trainer.val_before_train=False trainer.n_gpus_per_node=1
 trainer.nnodes=1 trainer.save_freq=10 trainer.test_freq=10 trainer.total_epochs=15"""
VERL_GRPO = """algorithm.adv_estimator=grpo data.train_files=$HOME/data/gsm8k/train.parquet
 data.val_files=$HOME/data/gsm8k/test.parquet data.train_batch_size=1024 data.max_prompt_length=512
 data.max_response_length=1024 data.filter_overlong_prompts=True data.truncation=error
 actor_rollout_ref.model.path=Qwen/Qwen2-7B-Instruct actor_rollout_ref.actor.optim.lr=1e-6
 actor_rollout_ref.model.use_remove_padding=True actor_rollout_ref.actor.ppo_mini_batch_size=256
 actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=40 actor_rollout_ref.actor.use_kl_loss=True
 actor_rollout_ref.actor.kl_loss_coef=0.001 actor_rollout_ref.actor.kl_loss_type=low_var_kl
 actor_rollout_ref.actor.entropy_coeff=0 actor_rollout_ref.model.enable_gradient_checkpointing=True
 actor_rollout_ref.actor.fsdp_config.param_offload=False actor_rollout_ref.actor.fsdp_config.optimizer_offload=False
 actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=40 actor_rollout_ref.rollout.tensor_model_parallel_size=2
 actor_rollout_ref.rollout.name=vllm actor_rollout_ref.rollout.gpu_memory_utilization=0.6
 actor_rollout_ref.rollout.n=5 actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu=40
 actor_rollout_ref.ref.fsdp_config.param_offload=True algorithm.use_kl_in_reward=False trainer.critic_warmup=0
 trainer.logger=["console","wandb"] trainer.project_name=verl_grpo_example_gsm8k
 trainer.experiment_name=qwen2_7b_function_rm trainer.n_gpus_per_node=8 trainer.nnodes=1 trainer.save_freq=20
 trainer.test_freq=5 trainer.total_epochs=15"""
VERL_DAPO = """data.train_files=$HOME/data/dapo-math-17k.parquet data.val_files=$HOME/data/aime-2024.parquet
 data.prompt_key=prompt data.truncation=left data.max_prompt_length=2048 data.max_response_length=20480
 data.gen_batch_size=1536 data.train_batch_size=512 actor_rollout_ref.rollout.n=16
 algorithm.adv_estimator=grpo algorithm.use_kl_in_reward=False algorithm.kl_ctrl.kl_coef=0.0
 actor_rollout_ref.actor.use_kl_loss=False actor_rollout_ref.actor.kl_loss_coef=0.0
 actor_rollout_ref.actor.clip_ratio_low=0.2 actor_rollout_ref.actor.clip_ratio_high=0.28
 actor_rollout_ref.actor.clip_ratio_c=10.0 algorithm.filter_groups.enable=True algorithm.filter_groups.metric=acc
 algorithm.filter_groups.max_num_gen_batches=10 actor_rollout_ref.model.use_remove_padding=True
 actor_rollout_ref.actor.use_dynamic_bsz=True actor_rollout_ref.ref.log_prob_use_dynamic_bsz=True
 actor_rollout_ref.rollout.log_prob_use_dynamic_bsz=True actor_rollout_ref.actor.ppo_max_token_len_per_gpu=22528
 actor_rollout_ref.ref.log_prob_max_token_len_per_gpu=22528
 actor_rollout_ref.rollout.log_prob_max_token_len_per_gpu=22528 actor_rollout_ref.model.path=Qwen/Qwen2.5-32B
 actor_rollout_ref.model.enable_gradient_checkpointing=True actor_rollout_ref.actor.optim.lr=1e-6
 actor_rollout_ref.actor.optim.lr_warmup_steps=10 actor_rollout_ref.actor.optim.weight_decay=0.1
 actor_rollout_ref.actor.ppo_mini_batch_size=32 actor_rollout_ref.actor.fsdp_config.param_offload=False
 actor_rollout_ref.actor.fsdp_config.optimizer_offload=False actor_rollout_ref.actor.entropy_coeff=0
 actor_rollout_ref.actor.grad_clip=1.0 actor_rollout_ref.actor.loss_agg_mode=token-mean
 actor_rollout_ref.actor.ulysses_sequence_parallel_size=1 actor_rollout_ref.rollout.gpu_memory_utilization=0.80
 actor_rollout_ref.rollout.tensor_model_parallel_size=4 actor_rollout_ref.rollout.temperature=1.0
 actor_rollout_ref.rollout.top_p=1.0 actor_rollout_ref.rollout.top_k=-1
 actor_rollout_ref.rollout.val_kwargs.temperature=1.0 actor_rollout_ref.rollout.val_kwargs.top_p=0.7
 actor_rollout_ref.rollout.val_kwargs.top_k=-1 actor_rollout_ref.rollout.val_kwargs.do_sample=True
 actor_rollout_ref.rollout.val_kwargs.n=1 actor_rollout_ref.ref.fsdp_config.param_offload=False
 reward_model.reward_manager=dapo reward_model.overlong_buffer.enable=True reward_model.overlong_buffer.len=4096
 reward_model.overlong_buffer.penalty_factor=1.0 trainer.logger=["console","wandb"] trainer.project_name=DAPO
 trainer.experiment_name=DAPO-Qwen2.5-32B trainer.n_gpus_per_node=8 trainer.nnodes=16 trainer.val_before_train=True
 trainer.test_freq=5 trainer.save_freq=5 trainer.total_epochs=1"""
VERL_DRGRPO = """algorithm.adv_estimator=grpo actor_rollout_ref.actor.loss_agg_mode=seq-mean-token-sum-norm
 actor_rollout_ref.actor.use_kl_loss=False algorithm.norm_adv_by_std_in_grpo=False
 actor_rollout_ref.model.path=Qwen/Qwen2.5-0.5B-Instruct actor_rollout_ref.rollout.n=5"""
RECIPES = {"ppo": VERL_PPO, "grpo": VERL_GRPO, "dapo": VERL_DAPO, "drgrpo": VERL_DRGRPO}

# the only changes: the paths (the embedded default's task and model), the engine, the logger and the scale
LOCAL = [*ON_EMBEDDED_TASK, "model.critic_path=null", "data.truncation=filter", "actor.ppo_micro_batch_size_per_device=4",
         "actor.log_prob_micro_batch_size_per_device=8", "critic.log_prob_micro_batch_size_per_device=8",
         "rollout.n=2", "reward.overlong_buffer.len=4",
         "algorithm.filter_groups.max_num_gen_batches=2", "trainer.total_training_steps=1",
         "trainer.val_before_train=false", "rollout.val_kwargs.do_sample=false"]


def verl_overrides(name: str) -> list[str]:
    return RECIPES[name].split()


def test_verl_keys_become_jaxppo_keys():
    ppo, grpo, dapo, dr = (load_config(None, verl_overrides(n) + ["data.train_files=[]", "data.val_files=[]"])
                           for n in ("ppo", "grpo", "dapo", "drgrpo"))
    assert ppo.actor.ppo_micro_batch_size_per_device == 4 and ppo.critic.optim.lr == 1e-5
    assert ppo.model.path == ppo.model.critic_path == "Qwen/Qwen2.5-0.5B-Instruct" and ppo.trainer.logger == ["console"]
    assert (grpo.rollout.engine, grpo.rollout.n, grpo.actor.kl_loss_type, grpo.trainer.logger) == (
        "vllm", 5, "low_var_kl", ["console", "wandb"])
    a = dapo.actor
    assert (a.clip_ratio_low, a.clip_ratio_high, a.clip_ratio_c, a.optim.lr_warmup_steps) == (0.2, 0.28, 10.0, 10)
    assert dapo.algorithm.filter_groups.metric == "acc" and dapo.reward.overlong_buffer.len == 4096
    assert dapo.rollout.val_kwargs.top_p == 0.7 and dapo.data.gen_batch_size == 1536
    assert dapo.data.truncation == "truncate_left"
    assert dr.actor.loss_agg_mode == "seq-mean-token-sum-norm" and not dr.algorithm.norm_adv_by_std_in_grpo


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(RECIPES))
def test_verls_example_command_line_runs_on_the_embedded_default(name, tmp_path):
    run_train(tmp_path / "run", *verl_overrides(name), *LOCAL, *(["data.gen_batch_size=16"] if name == "dapo" else []),
              config=None)
    m = read_metrics(tmp_path / "run")
    assert 1 in m and m[1]["actor/pg_loss"] == m[1]["actor/pg_loss"]
    assert ("critic/vf_loss" in m[1]) == (name == "ppo")


def test_verls_vllm_scheduler_keys_set_the_engines_and_its_limits_are_checked_at_load():
    """The vLLM keys verl's recipes set (its DAPO scripts: max_num_batched_tokens = prompt + response length, chunked
    prefill on) become rollout.*; those jaxppo already does are accepted and ignored. What vLLM would refuse at its
    start is refused when the config loads, naming jaxppo's keys."""
    from jaxppo.errors import ConfigError

    R = "actor_rollout_ref.rollout."
    base = ["data.train_files=[]", "data.val_files=[]"]
    cfg = load_config(None, [*base, f"{R}max_num_seqs=256", f"{R}max_num_batched_tokens=8192",
                             f"{R}enable_chunked_prefill=False", f"{R}cudagraph_capture_sizes=[1,2,4,8]",
                             f"{R}max_model_len=3073", f"{R}enable_sleep_mode=True", f"{R}enable_prefix_caching=True",
                             f"{R}disable_log_stats=True"])
    r = cfg.rollout
    assert (r.max_num_seqs, r.max_num_batched_tokens, r.enable_chunked_prefill, list(r.cudagraph_capture_sizes)) == (
        256, 8192, False, [1, 2, 4, 8])
    assert load_config(None, base).rollout.max_num_seqs == 0  # vLLM's own default unless set
    with pytest.raises(ConfigError, match=r"rollout.max_num_batched_tokens \(768\) must be >= .* set rollout.max_num_seqs"):
        load_config(None, [*base, f"{R}max_num_batched_tokens=768"])  # below vLLM's default of 1024 at once
    load_config(None, [*base, f"{R}max_num_batched_tokens=768", f"{R}max_num_seqs=256"])
    with pytest.raises(ConfigError, match=r"below the longest sequence \(768, .*enable_chunked_prefill=true"):
        load_config(None, [*base, "data.max_prompt_length=512", "data.max_response_length=256",
                           "rollout.max_num_seqs=64", "rollout.max_num_batched_tokens=512",
                           "rollout.enable_chunked_prefill=false"])


def test_verls_engine_kwargs_and_prefix_caching_reach_the_rollout_keys():
    """verl's `rollout.engine_kwargs.vllm.<arg>` (any vLLM EngineArgs name) and `enable_prefix_caching` become
    jaxppo's keys of the same names, typed as YAML reads them; sglang's are ignored; an argument jaxppo sets from a
    key of its own is refused at load, naming that key."""
    from jaxppo.errors import ConfigError

    R = "actor_rollout_ref.rollout."
    base = ["data.train_files=[]", "data.val_files=[]"]
    cfg = load_config(None, [*base, f"{R}enable_prefix_caching=False", f"{R}engine_kwargs.vllm.async_scheduling=false",
                             f"+{R}engine_kwargs.vllm.block_size=32", f"{R}engine_kwargs.sglang.attention_backend=fa3"])
    assert cfg.rollout.enable_prefix_caching is False
    assert cfg.rollout.engine_kwargs.vllm == {"async_scheduling": False, "block_size": 32}
    assert load_config(None, base).rollout.engine_kwargs.vllm == {}
    assert load_config(None, base).rollout.enable_prefix_caching is True  # verl's default
    for key, own in (("gpu_memory_utilization=0.5", "rollout.gpu_memory_utilization"),
                     ("enable_sleep_mode=false", "rollout.free_cache_engine"), ("seed=3", "trainer.seed")):
        with pytest.raises(ConfigError, match=rf"rollout.engine_kwargs.vllm.{key.split('=')[0]}: jaxppo sets it; "
                                              rf"set {own}"):
            load_config(None, [*base, f"rollout.engine_kwargs.vllm.{key}"])
    with pytest.raises(ConfigError, match=r"vllm.tensor_parallel_size: jaxppo sets it; vLLM runs on the trainer's"):
        load_config(None, [*base, f"{R}engine_kwargs.vllm.tensor_parallel_size=2"])


def test_a_verl_key_without_a_jaxppo_meaning_exits_2_naming_it(tmp_path, capsys):
    from jaxppo.train import main

    for key, why in [("actor_rollout_ref.actor.fsdp_config.param_offload=True", "no parameter offload"),
                     ("actor_rollout_ref.actor.ulysses_sequence_parallel_size=4", "no sequence parallelism"),
                     ("actor_rollout_ref.model.use_shm=True", "no jaxppo meaning")]:
        rc = main([f"trainer.default_local_dir={tmp_path / 'run'}", key])
        err = capsys.readouterr().err
        assert rc == 2 and key.split("=")[0] in err and why in err, err
        assert not (tmp_path / "run").exists()


def _keys(cls: type = Config, prefix: str = "") -> set[str]:
    out, hints = set(), typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        t = hints[f.name]
        out |= _keys(t, prefix + f.name + ".") if dataclasses.is_dataclass(t) else {prefix + f.name}
    return out


def test_every_alias_names_a_jaxppo_key_and_the_doc_is_the_table():
    keys = _keys()
    for verl, target, _ in TABLE:
        if target not in (IGNORED, UNSUPPORTED):  # `x.{}`: any key below the dict-valued key x
            assert all(t.removesuffix(".{}") in keys for t in target.split(" + ")), (verl, target)
            assert verl.endswith(".{}") == target.endswith(".{}"), (verl, target)
    assert len({v for v, _, _ in TABLE}) == len(TABLE)
    doc = (ROOT / "docs" / "verl_keys_table.md").read_text()
    assert doc == markdown(), "regenerate: python -m jaxppo.config.verl_keys > docs/verl_keys_table.md"


def test_a_list_key_takes_one_value_and_a_path_takes_the_home_directory(tmp_path, monkeypatch, capsys):
    """verl's `data.train_files=$HOME/data/gsm8k/train.parquet` (one path, not a list) and its YAML's
    `train_files: ~/data/rlhf/gsm8k/train.parquet` load as a list of that path, `~` expanded as a shell would; a
    list key's list form, `[]` and the other list keys (`trainer.logger=console`, `trainer.profile_steps=5`) as
    before; a missing file named that way exits 2 naming the expanded path, before the run directory exists."""
    import jax

    from jaxppo.train import main

    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.setattr(jax, "device_count", lambda *a: 1)  # one device, as a user's CPU run (this process has 8)
    cfg = load_config(None, ["data.train_files=/data/gsm8k/train.parquet", "data.val_files=[/a.parquet,/b.parquet]",
                             "trainer.logger=console", "trainer.profile_steps=5", "model.path=~/models/qwen"])
    assert cfg.data.train_files == ["/data/gsm8k/train.parquet"] and cfg.data.val_files == ["/a.parquet", "/b.parquet"]
    assert cfg.trainer.logger == ["console"] and cfg.trainer.profile_steps == [5]
    assert cfg.model.path == f"{tmp_path}/models/qwen"
    assert load_config(None, ["data.train_files=[]", "data.val_files="]).data.val_files == []
    yml = tmp_path / "verl_style.yaml"
    yml.write_text("data:\n  train_files: ~/data/rlhf/gsm8k/train.parquet\n  val_files: ~/data/rlhf/gsm8k/1_3.parquet\n"
                   "trainer:\n  logger: console\n  profile_steps: 7\n  default_local_dir: ~/runs/x\n")
    cfg = load_config(yml)
    assert cfg.data.train_files == [f"{tmp_path}/data/rlhf/gsm8k/train.parquet"]
    assert cfg.data.val_files == [f"{tmp_path}/data/rlhf/gsm8k/1_3.parquet"]  # as written, not YAML's number 13
    assert (cfg.trainer.logger, cfg.trainer.profile_steps) == (["console"], [7])
    assert cfg.trainer.default_local_dir == f"{tmp_path}/runs/x"
    rc = main([f"trainer.default_local_dir={tmp_path / 'run'}", "data.tokenizer=~/tok",
               "data.train_files=~/data/gsm8k/train.parquet"])
    err = capsys.readouterr().err
    assert rc == 2 and f"data.train_files: {tmp_path}/data/gsm8k/train.parquet does not exist" in err, err
    assert not (tmp_path / "run").exists()
    assert main(["--config", str(tmp_path)]) == 2 and "a directory, not a config file" in capsys.readouterr().err
