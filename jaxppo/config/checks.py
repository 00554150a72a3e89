"""Checks of a config before anything is built: closed sets of values, numeric domains, size relations, the paths
a run reads, and what several processes need. Every failure is a `ConfigError` (exit 2) naming the key."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from jaxppo.config.schema import FSDP_GATHER, GRAD_REDUCE_DTYPES, Config
from jaxppo.errors import ConfigError


def validate_paths(cfg: Config) -> None:
    """The paths a run reads exist (checked by `jaxppo.train` before anything is built; not by `load_config`,
    which also serves configs whose paths are filled in later)."""
    t, d = cfg.trainer, cfg.data
    if d.train_files and not (d.tokenizer or cfg.model.path):
        raise ConfigError("data.train_files is set but no tokenizer is: set data.tokenizer (or model.path) to the "
                          "tokenizer the data's prompts are written for")
    for key, files in (("data.train_files", d.train_files), ("data.val_files", d.val_files)):
        for f in files:
            if not Path(f).is_file():
                raise ConfigError(f"{key}: {f} does not exist")
    run_dir = Path(t.default_local_dir)
    if run_dir.exists() and not run_dir.is_dir():
        raise ConfigError(f"trainer.default_local_dir: {run_dir} is a file, not a directory")
    if t.resume_mode not in ("auto", "disable") and not Path(t.resume_mode).exists():
        raise ConfigError(f"trainer.resume_mode must be auto, disable or an existing checkpoint path; "
                          f"{t.resume_mode!r} does not exist")
    for key, path in (("model.path", cfg.model.path), ("model.critic_path", cfg.model.critic_path),
                      ("model.reward_model_path", cfg.model.reward_model_path)):
        if path is not None and not (Path(path) / "config.json").is_file():
            raise ConfigError(f"{key}: {path}/config.json not found")
    if cfg.custom_reward_function.path:
        from jaxppo.rewards.custom import load_function

        load_function(cfg.custom_reward_function.path, cfg.custom_reward_function.name)  # exits 2 if missing


def uses_critic(cfg: Config) -> bool:
    """A value model is trained for GAE only; the other estimators (GRPO, RLOO, REINFORCE++) have none."""
    return cfg.algorithm.adv_estimator == "gae"


def trained_models(cfg: Config) -> tuple[tuple[str, Any], ...]:
    """(name, config section) of the models a run trains: the actor, and the critic where there is one (its keys
    are not checked otherwise)."""
    if uses_critic(cfg):
        return (("actor", cfg.actor), ("critic", cfg.critic))
    return (("actor", cfg.actor),)


def validate_processes(cfg: Config, processes: int) -> None:
    """What several processes need: every batch splits evenly over them."""
    d = cfg.data
    for key in ("async_rollout", "rollout_during_critic_update"):
        if getattr(cfg.trainer, key) and processes > 1:
            raise ConfigError(f"trainer.{key} runs in one process ({processes} here): its rollout thread and the "
                              "processes' collectives would interleave")
    if d.train_batch_size % processes:
        raise ConfigError(f"data.train_batch_size ({d.train_batch_size}) does not split over {processes} processes")
    if d.gen_batch_size % processes:
        raise ConfigError(f"data.gen_batch_size ({d.gen_batch_size}) does not split over {processes} processes")
    for name, sub in trained_models(cfg):
        if (sub.ppo_mini_batch_size * cfg.rollout.n) % processes:
            raise ConfigError(f"{name}.ppo_mini_batch_size x rollout.n does not split over {processes} processes")


# closed sets of values, by key (one table: validate() checks each; the registries' names are added there)
DTYPE_NAMES = ("float32", "bfloat16", "float16")
LOGGERS = ("console", "jsonl", "tensorboard", "wandb")
ROLLOUT_ENGINES = ("hf", "vllm")  # bridge.engines registers these (a test keeps the two in step)
CUDAGRAPH_MODES = (None, "NONE", "PIECEWISE", "FULL", "FULL_DECODE_ONLY", "FULL_AND_PIECEWISE")  # vLLM's names
CLOSED_SETS: dict[str, tuple] = {
    "data.prompt_format": ("chat", "raw"),
    "model.dtype": DTYPE_NAMES,
    "model.param_dtype": DTYPE_NAMES,
    "model.remat": ("none", "full", "dots", "dots_attn"),
    "model.attention_impl": (None, "xla", "cudnn", "cudnn_mask"),
    "model.micro_batch_loop": ("auto", "scan", "host"),
    "actor.optim.lr_schedule": ("constant", "cosine"),
    "critic.optim.lr_schedule": ("constant", "cosine"),
    "rollout.engine": ROLLOUT_ENGINES,
    "rollout.cudagraph_mode": CUDAGRAPH_MODES,
    "algorithm.kl_ctrl.type": ("fixed", "adaptive"),
    "reward.reward_model_combine": ("replace", "add"),
    "algorithm.filter_groups.metric": ("score", "seq_reward", "acc"),
    "mesh.fsdp_gather": FSDP_GATHER,
    "mesh.grad_reduce_dtype": GRAD_REDUCE_DTYPES,
    "trainer.early_stop_mode": ("max", "min"),
}


def _registry_sets() -> dict[str, tuple]:
    """Closed sets whose values come from registries and module constants."""
    from jaxppo.data import TRUNCATION_MODES
    from jaxppo.health import ACTIONS, SPECS
    from jaxppo.mps import PRIORITIES
    from jaxppo.ppo import ADVANTAGE_ESTIMATORS, KL_ESTIMATORS, LOSS_AGG_MODES
    from jaxppo.ppo.policy_losses import POLICY_LOSSES

    return {"data.truncation": tuple(TRUNCATION_MODES),
            "actor.loss_agg_mode": tuple(LOSS_AGG_MODES), "critic.loss_agg_mode": tuple(LOSS_AGG_MODES),
            "actor.kl_loss_type": tuple(KL_ESTIMATORS.names()),
            "algorithm.kl_penalty": tuple(k for k in KL_ESTIMATORS.names() if k != "full"),
            "algorithm.adv_estimator": tuple(ADVANTAGE_ESTIMATORS.names()),
            "actor.policy_loss.loss_mode": tuple(POLICY_LOSSES.names()),
            "rollout.cuda_mps_trainer_priority": tuple(PRIORITIES),
            **{f"trainer.health.{rule}.action": ACTIONS for rule in SPECS}}


def _get(cfg: Config, key: str) -> Any:
    node = cfg
    for part in key.split("."):
        node = getattr(node, part)
    return node


INF = float("inf")
# every float key's domain: (low, high, low_open, high_open); each must also be finite (NaN / inf refused).
# Optimizer keys are listed once under "optim." and checked for the actor and the critic; health thresholds once
# under "trainer.health.*.threshold". A test keeps this table equal to the float keys of the tree.
FLOAT_DOMAINS: dict[str, tuple[float, float, bool, bool]] = {
    "optim.lr": (0, INF, False, True),
    "optim.min_lr_ratio": (0, 1, False, False),
    "optim.weight_decay": (0, INF, False, True),
    "optim.betas": (0, 1, False, True),
    "optim.eps": (0, INF, True, True),
    "optim.grad_clip": (0, INF, True, True),
    "actor.clip_ratio_low": (0, 1, False, True),  # the ratio's floor 1 - low stays positive
    "actor.clip_ratio_high": (0, INF, False, True),
    "actor.clip_ratio_c": (1, INF, True, True),  # the dual clip bounds the loss of a negative advantage above 1
    "actor.entropy_coeff": (-INF, INF, True, True),  # negative: an entropy penalty
    "actor.kl_loss_coef": (0, INF, False, True),
    "actor.tis_threshold": (0, INF, True, True),
    "actor.loss_scale_factor": (0, INF, True, True),
    "actor.tau_pos": (0, INF, True, True),
    "actor.tau_neg": (0, INF, True, True),
    "actor.policy_loss.clip_cov_ratio": (0, 1, True, False),
    "actor.policy_loss.clip_cov_lb": (-INF, INF, True, True),
    "actor.policy_loss.clip_cov_ub": (-INF, INF, True, True),
    "actor.policy_loss.kl_cov_ratio": (0, 1, True, False),
    "actor.policy_loss.ppo_kl_coef": (0, INF, False, True),
    "actor.policy_loss.dro_beta": (0, INF, True, True),
    "actor.lora_alpha": (0, INF, True, True),
    "critic.cliprange_value": (0, INF, False, True),
    "critic.lora_alpha": (0, INF, True, True),
    "rollout.temperature": (0, INF, False, True),  # 0: greedy
    "rollout.top_p": (0, 1, True, False),
    "rollout.val_kwargs.temperature": (0, INF, False, True),
    "rollout.val_kwargs.top_p": (0, 1, True, False),
    "rollout.gpu_memory_utilization": (0, 0.95, False, True),  # 0: automatic (jaxppo/memory.py)
    "algorithm.gamma": (0, 1, False, False),
    "algorithm.lam": (0, 1, False, False),
    "algorithm.kl_ctrl.kl_coef": (0, INF, False, True),
    "algorithm.kl_ctrl.target_kl": (0, INF, True, True),
    "reward.timeout_s": (0, INF, False, True),  # 0: no limit
    "reward.overlong_buffer.penalty_factor": (0, INF, False, True),
    "trainer.device_memory_gb": (0, INF, False, True),  # 0: the device's own
    "trainer.host_memory_gb": (0, INF, False, True),  # 0: the machine's own
    "trainer.memory_margin_gb": (0, INF, False, True),
    "trainer.sft_lr": (0, INF, True, True),
    "trainer.sft_target_nll": (0, INF, False, True),
    "trainer.early_stop_min_delta": (0, INF, False, True),
    "trainer.health.*.threshold": (-INF, INF, True, True),
}


def float_keys(cls: type = Config, prefix: str = "") -> list[str]:
    """The dotted keys of every float field (float, Optional[float], tuple of floats) of the tree."""
    import dataclasses
    import typing

    out = []
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        t, key = hints[f.name], prefix + f.name
        if dataclasses.is_dataclass(t):
            out += float_keys(t, key + ".")
        elif t is float or float in typing.get_args(t):
            out.append(key)
    return out


def _domain_of(key: str) -> tuple[float, float, bool, bool]:
    parts = key.split(".")
    if "optim" in parts:
        return FLOAT_DOMAINS["optim." + parts[-1]]
    if key.startswith("trainer.health."):
        return FLOAT_DOMAINS["trainer.health.*." + parts[-1]]
    return FLOAT_DOMAINS[key]


def _render(lo: float, hi: float, lo_open: bool, hi_open: bool) -> str:
    num = lambda x: "inf" if x == INF else ("-inf" if x == -INF else f"{x:g}")  # noqa: E731
    return f"{'(' if lo_open else '['}{num(lo)}, {num(hi)}{')' if hi_open else ']'}"


def _check_floats(cfg: Config) -> None:
    import math

    for key in float_keys():
        value = _get(cfg, key)
        if value is None:
            continue
        lo, hi, lo_open, hi_open = _domain_of(key)
        for v in (value if isinstance(value, tuple) else (value,)):
            inside = (v > lo if lo_open else v >= lo) and (v < hi if hi_open else v <= hi)
            if not math.isfinite(v) or not inside:
                raise ConfigError(f"{key} = {value}: must be a finite number in {_render(lo, hi, lo_open, hi_open)}")


def validate(cfg: Config, num_devices: int | None = None) -> None:
    """Every invalid value or combination, caught before any work starts (no directory, data or model is
    touched): closed sets of values, numeric domains, and the size relations the engine would otherwise assert."""
    for key, known in {**CLOSED_SETS, **_registry_sets()}.items():
        value = _get(cfg, key)
        _check(value in known, f"{key} {value!r} unknown; known: {[k for k in known if k is not None]}"
               + (" (or unset)" if None in known else ""))
    for name in cfg.trainer.logger:
        _check(name in LOGGERS, f"trainer.logger entry {name!r} unknown; known: {list(LOGGERS)}")
    _check_floats(cfg)
    _check_batch_sizes(cfg)
    _check_sampling_and_rewards(cfg)
    _check_models(cfg)
    _check_trainer(cfg)
    if num_devices is not None:
        _check_mesh(cfg, num_devices)
    elif all(size > 0 for size in cfg.mesh.axes().values()):  # no devices to resolve -1 against: the sizes as given
        from jaxppo.sharding import parallel_mode

        parallel_mode(cfg.mesh.axes(), cfg.mesh.fsdp_gather, cfg.mesh.grad_reduce_dtype)


def _check(ok: bool, msg: str) -> None:
    if not ok:
        raise ConfigError(msg)


def _check_batch_sizes(cfg: Config) -> None:
    d, r = cfg.data, cfg.rollout
    _check(d.train_batch_size > 0, "data.train_batch_size must be positive")
    _check(d.val_batch_size > 0, "data.val_batch_size must be positive")
    _check(d.max_prompt_length > 0 and d.max_response_length > 0,
           "data.max_prompt_length and data.max_response_length must be positive")
    for name, sub in trained_models(cfg):  # the critic's sizes matter only where there is a critic (GAE)
        _check(sub.ppo_mini_batch_size <= d.train_batch_size,
               f"{name}.ppo_mini_batch_size ({sub.ppo_mini_batch_size}) is larger than data.train_batch_size "
               f"({d.train_batch_size})")
        _check(sub.ppo_mini_batch_size > 0 and d.train_batch_size % sub.ppo_mini_batch_size == 0,
               f"{name}.ppo_mini_batch_size ({sub.ppo_mini_batch_size}) does not divide data.train_batch_size "
               f"({d.train_batch_size})")
        _check(sub.ppo_epochs >= 1, f"{name}.ppo_epochs must be >= 1")
        _check(sub.ppo_micro_batch_size_per_device >= 1 and sub.log_prob_micro_batch_size_per_device >= 1,
               f"{name}'s micro-batch sizes must be >= 1")
    _check(r.n >= 1, "rollout.n must be >= 1")
    fg = cfg.algorithm.filter_groups
    _check(d.gen_batch_size >= 0, "data.gen_batch_size must be >= 0 (0: data.train_batch_size)")
    if fg.enable:
        _check(r.n >= 2, "algorithm.filter_groups.enable needs rollout.n >= 2 (a group's samples are compared)")
        _check(fg.max_num_gen_batches >= 0, "algorithm.filter_groups.max_num_gen_batches must be >= 0 (0: no limit)")
        _check(d.gen_batch_size == 0 or d.gen_batch_size >= d.train_batch_size,
               f"data.gen_batch_size ({d.gen_batch_size}) must be >= data.train_batch_size ({d.train_batch_size}) "
               "(0: equal)")
    else:
        _check(d.gen_batch_size in (0, d.train_batch_size), "data.gen_batch_size is used by "
               "algorithm.filter_groups.enable=true only; set it there or leave it 0")
    seq_len = d.max_prompt_length + d.max_response_length
    budget_keys = {"actor": ("ppo_max_token_len_per_device", "log_prob_max_token_len_per_device"),
                   "critic": ("ppo_max_token_len_per_device", "forward_max_token_len_per_device")}
    for name, sub in trained_models(cfg):
        for key in budget_keys[name]:
            v = getattr(sub, key)
            _check(v == 0 or v >= seq_len, f"{name}.{key} ({v}) is smaller than one sequence (data.max_prompt_length "
                   f"+ data.max_response_length = {seq_len}); 0 picks the largest budget that fits")


def _check_vllm_scheduler(cfg: Config) -> None:
    """vLLM's scheduler limits, refused here as vLLM would refuse them at its start, naming jaxppo's keys."""
    d, r = cfg.data, cfg.rollout
    _check(r.max_num_seqs >= 0 and r.max_num_batched_tokens >= 0,
           "rollout.max_num_seqs and rollout.max_num_batched_tokens must be >= 0 (0: vLLM's default)")
    _check(r.engine_processes >= 1, f"rollout.engine_processes must be >= 1, got {r.engine_processes}")
    _check(r.engine_processes == 1 or r.engine == "vllm",
           f"rollout.engine_processes={r.engine_processes} needs rollout.engine=vllm (the {r.engine} engine runs in "
           "the trainer's process)")
    _check(r.engine_in_trainer or r.engine == "vllm",
           f"rollout.engine_in_trainer=false needs rollout.engine=vllm (the {r.engine} engine runs in the trainer's "
           "process)")
    _check(not r.cuda_mps or (r.engine == "vllm" and (not r.engine_in_trainer or r.engine_processes > 1)),
           "rollout.cuda_mps=true needs vLLM in a helper process (rollout.engine=vllm with "
           "rollout.engine_in_trainer=false or rollout.engine_processes > 1): with one process there is nothing "
           "for MPS to run side by side")
    _check(r.cuda_mps_trainer_priority == "normal" or (r.cuda_mps and not r.engine_in_trainer),
           "rollout.cuda_mps_trainer_priority=below_normal needs rollout.cuda_mps=true and every engine in a helper "
           "process (rollout.engine_in_trainer=false): it is the priority of the trainer's process among the MPS "
           "daemon's clients, and an engine in that process would take it too")
    _check(r.cudagraph_capture_sizes is None or all(int(b) >= 1 for b in r.cudagraph_capture_sizes),
           f"rollout.cudagraph_capture_sizes: decode batch sizes >= 1, got {r.cudagraph_capture_sizes}")
    from jaxppo.rollout import own_engine_arg

    refusal = own_engine_arg(r.engine_kwargs.vllm)
    if refusal:
        raise ConfigError(refusal)
    tokens, longest = r.max_num_batched_tokens, d.max_prompt_length + d.max_response_length
    if tokens:
        from jaxppo.plan import vllm_max_seqs  # what the plan sizes vLLM for: the key, else vLLM's default

        _check(tokens >= vllm_max_seqs(cfg),
               f"rollout.max_num_batched_tokens ({tokens}) must be >= the sequences vLLM runs at once: "
               + (f"rollout.max_num_seqs ({r.max_num_seqs})" if r.max_num_seqs else
                  "vLLM's default, up to 1024; set rollout.max_num_seqs too"))
        _check(r.enable_chunked_prefill or tokens >= longest,
               f"rollout.max_num_batched_tokens ({tokens}) below the longest sequence ({longest}, "
               "data.max_prompt_length + data.max_response_length) needs rollout.enable_chunked_prefill=true")


def _check_sampling_and_rewards(cfg: Config) -> None:
    d, r, ob = cfg.data, cfg.rollout, cfg.reward.overlong_buffer
    if ob.enable:
        _check(0 < ob.len < d.max_response_length, f"reward.overlong_buffer.len ({ob.len}) must be in "
               f"(0, data.max_response_length = {d.max_response_length})")
    v = r.val_kwargs
    _check(v.n >= 1, "rollout.val_kwargs.n must be >= 1")
    _check(not v.do_sample or v.temperature > 0, "rollout.val_kwargs.do_sample=true needs "
           "rollout.val_kwargs.temperature > 0 (do_sample=false is greedy)")
    _check(v.top_k == -1 or v.top_k > 0, "rollout.val_kwargs.top_k must be -1 (off) or positive")
    _check(r.top_k == -1 or r.top_k > 0, f"rollout.top_k must be -1 (off) or positive, got {r.top_k}")
    _check_vllm_scheduler(cfg)
    _check(cfg.actor.logprob_chunk_size >= 1, "actor.logprob_chunk_size must be >= 1")
    from jaxppo.ppo.advantages import compares_groups

    if compares_groups(cfg.algorithm.adv_estimator):
        _check(r.n >= 2, f"algorithm.adv_estimator={cfg.algorithm.adv_estimator} compares each prompt's responses: "
               "set rollout.n >= 2")
    rc = cfg.algorithm.rollout_correction
    if rc.rollout_is is not None or rc.rollout_rs is not None:
        from jaxppo.ppo import rollout_correction as corr

        _check(rc.rollout_is is None or rc.rollout_is in corr.IS_LEVELS, f"algorithm.rollout_correction.rollout_is "
               f"{rc.rollout_is!r} unknown; known: {list(corr.IS_LEVELS)}")
        corr.parse_is_threshold(rc.rollout_is_threshold)
        if rc.rollout_rs is not None:
            corr.parse_rs(rc.rollout_rs, rc.rollout_rs_threshold)
        _check(cfg.actor.tis_threshold is None, "actor.tis_threshold and algorithm.rollout_correction both weight the "
               "loss: use one (rollout_is=token with rollout_is_threshold is the same truncation)")
    if rc.bypass_mode:
        from jaxppo.ppo import rollout_correction as corr

        _check(rc.loss_type in corr.BYPASS_LOSSES, f"algorithm.rollout_correction.loss_type {rc.loss_type!r} unknown; "
               f"known: {list(corr.BYPASS_LOSSES)}")
        _check(not (rc.rollout_is is not None and rc.rollout_is_batch_normalize), "algorithm.rollout_correction."
               "rollout_is_batch_normalize in bypass mode (verl normalises each micro-batch's weights inside the "
               "loss) is not built; it is in the decoupled mode (bypass_mode=false)")
        _check(cfg.actor.tis_threshold is None, "actor.tis_threshold with algorithm.rollout_correction.bypass_mode: "
               "the old policy is the rollout's, so there is no gap left to weight; drop one")
        _check(cfg.actor.policy_loss.loss_mode == "vanilla", "algorithm.rollout_correction.bypass_mode replaces the "
               f"policy loss (verl: loss_mode=bypass_mode, PPO-clip for loss_type=ppo_clip); actor.policy_loss."
               f"loss_mode={cfg.actor.policy_loss.loss_mode} would be ignored: set it to vanilla")
    pl = cfg.actor.policy_loss
    _check(pl.loss_mode != "dro" or pl.dro_beta is not None,
           "actor.policy_loss.loss_mode=dro needs actor.policy_loss.dro_beta > 0")
    _check(pl.clip_cov_lb < pl.clip_cov_ub, "actor.policy_loss.clip_cov_lb must be below clip_cov_ub")
    _check(cfg.reward.num_workers >= -1, "reward.num_workers must be >= 0, or -1 (automatic)")
    rule = cfg.reward.default_rule
    if rule is not None:
        from jaxppo.rewards.registry import REWARD_FUNCTIONS

        _check(rule in REWARD_FUNCTIONS, f"reward.default_rule {rule!r} unknown; known: {REWARD_FUNCTIONS.names()}")


def _check_models(cfg: Config) -> None:
    from jaxppo.models.lora import parse_targets

    _check(cfg.model.scan_unroll >= 0, f"model.scan_unroll must be >= 0 (0: all layers), got {cfg.model.scan_unroll}")
    for name, sub in trained_models(cfg):
        _check(sub.lora_rank >= 0, f"{name}.lora_rank must be >= 0 (0: full fine-tuning)")
        if sub.lora_rank:
            try:
                parse_targets(sub.target_modules)
            except ValueError as e:
                _check(False, f"{name}.{e}")
            _check(cfg.mesh.fsdp_gather == "layer", f"{name}.lora_rank > 0 needs mesh.fsdp_gather=layer (the frozen "
                   "base weights live outside the train state)")


def _check_trainer(cfg: Config) -> None:
    t = cfg.trainer
    from jaxppo import health

    for msg in health.validate(t.health):
        _check(False, msg)
    _check(t.total_epochs >= 1, "trainer.total_epochs must be >= 1")
    _check(t.total_training_steps is None or t.total_training_steps >= 1, "trainer.total_training_steps must be >= 1")
    _check(t.critic_warmup >= 0, "trainer.critic_warmup must be >= 0")
    _check(t.max_to_keep >= 1, "trainer.max_to_keep must be >= 1")
    _check(t.max_bad_steps >= 1, "trainer.max_bad_steps must be >= 1")
    _check(t.early_stop_patience == 0 or t.test_freq > 0,
           "trainer.early_stop_patience needs validation: set trainer.test_freq > 0")
    _check(t.early_stop_patience >= 0, "trainer.early_stop_patience must be >= 0")
    _check(all(s >= 1 for s in t.profile_steps), "trainer.profile_steps are 1-based step numbers")
    _check(bool(t.profile_tools) and set(t.profile_tools) <= {"jax", "torch", "python"},
           f"trainer.profile_tools: one or more of jax, torch, python; got {list(t.profile_tools)}")
    for key in ("async_rollout", "rollout_during_critic_update"):
        _check(not (getattr(t, key) and cfg.algorithm.filter_groups.enable),
               f"trainer.{key} with algorithm.filter_groups.enable: dynamic sampling's further generation rounds "
               "depend on the step's scores; use one or the other")
    _check(not (t.async_rollout and t.rollout_during_critic_update),
           "trainer.async_rollout and trainer.rollout_during_critic_update: the next batch is generated either one "
           "step ahead (off-policy) or while the critic updates (on-policy); set one")
    _check(not t.rollout_during_critic_update or uses_critic(cfg),
           f"trainer.rollout_during_critic_update needs a critic to update beside the generation; "
           f"algorithm.adv_estimator={cfg.algorithm.adv_estimator} has none (trainer.async_rollout overlaps the "
           "generation with the actor's update, one step off-policy)")


def _check_mesh(cfg: Config, num_devices: int) -> None:
    from jaxppo.sharding import parallel_mode, resolve_mesh_shape

    d, r = cfg.data, cfg.rollout
    sizes = resolve_mesh_shape(cfg.mesh.axes(), num_devices)
    # the engines' own rule: refuses what cannot run on this mesh (the bf16 reduction where devices hold shards)
    batch_shards, _, _ = parallel_mode(sizes, cfg.mesh.fsdp_gather, cfg.mesh.grad_reduce_dtype)
    seqs_step = d.train_batch_size * r.n
    for name, sub in trained_models(cfg):
        micro = sub.ppo_micro_batch_size_per_device * batch_shards
        seqs = sub.ppo_mini_batch_size * r.n
        _check(sub.use_dynamic_bsz or seqs % micro == 0,
               f"{name}.ppo_micro_batch_size_per_device ({sub.ppo_micro_batch_size_per_device}) x {batch_shards} "
               f"batch shards = {micro} sequences does not divide the mini-batch of {seqs} sequences "
               f"({name}.ppo_mini_batch_size x rollout.n)")
        fwd = sub.log_prob_micro_batch_size_per_device * batch_shards
        _check(sub.use_dynamic_bsz or seqs_step % fwd == 0,
               f"{name}.log_prob_micro_batch_size_per_device ({sub.log_prob_micro_batch_size_per_device}) x "
               f"{batch_shards} batch shards = {fwd} sequences does not divide the step's {seqs_step} sequences "
               f"(data.train_batch_size x rollout.n)")
