"""One typed config tree: frozen dataclasses, YAML files, dotted CLI overrides (OmegaConf structured configs).

Leaf names follow verl's where the meaning is the same (docs/verl_keys.md maps them). The tree is
never mutated at run time: sizes derived from it are computed by functions, not written back.
"""

from __future__ import annotations

import dataclasses
import difflib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

from jaxppo.errors import ConfigError
from jaxppo.health import HealthConfig, HealthRule  # noqa: F401  (HealthRule: resolved by get_type_hints)


@dataclass(frozen=True)
class DataConfig:
    train_files: list[str] = field(default_factory=list)  # parquet files in verl's schema; empty: synthetic task
    val_files: list[str] = field(default_factory=list)  # validation split; empty: synthetic task's test split
    tokenizer: Optional[str] = None  # HF tokenizer dir; None: the model dir (or the synthetic tokenizer)
    prompt_key: str = "prompt"  # column holding the prompt
    prompt_format: str = "chat"  # chat (messages + chat template) | raw (a text column)
    max_prompt_length: int = 512  # tokens, after the chat template
    max_response_length: int = 256  # tokens generated per response
    truncation: str = "filter"  # filter | truncate_left | error, for longer prompts
    train_batch_size: int = 256  # prompts per PPO step
    # prompts per generation round under algorithm.filter_groups (DAPO's dynamic sampling); 0: train_batch_size
    gen_batch_size: int = 0
    val_batch_size: int = 512  # prompts per validation generate call
    shuffle: bool = True  # shuffle the training prompts each epoch (seeded)
    seed: int = 0  # shuffling seed
    # synthetic task (used when train_files is empty)
    synthetic_train_size: int = 4000  # generated training problems
    synthetic_val_size: int = 128  # generated validation problems
    synthetic_num_operands: int = 2  # numbers per problem
    synthetic_max_digits: int = 1  # digits per operand
    synthetic_operators: str = "+-"  # drawn from + - *
    synthetic_instruction: bool = True  # append GSM8K's "Let's think step by step ..." instruction


@dataclass(frozen=True)
class ModelConfig:
    path: Optional[str] = None  # actor HF checkpoint dir; None: the embedded default's tiny random model
    critic_path: Optional[str] = None  # critic checkpoint (token-classification layout); None: actor + new head
    reward_model_path: Optional[str] = None  # optional reward model (token-classification) scoring responses
    random_init: bool = False  # benchmarks: read only config.json from model.path, random weights of that shape
    dtype: str = "bfloat16"  # compute dtype
    param_dtype: str = "float32"  # master weights
    remat: str = "full"  # none | full | dots | dots_attn (dots + cuDNN attention outputs)
    # None: XLA (CPU) / cudnn (GPU) chosen automatically; or xla | cudnn | cudnn_mask (cuDNN with a [t, t] mask
    # as a bias: the layout before cuDNN's packed one, kept for comparison)
    attention_impl: Optional[str] = None
    # decoder layers per iteration of the layer loop; 0: all of them: no loop at run time, so no copies of
    # saved activations into per-layer stacks (1.5B update on an H200: 1.08x faster; compiles ~2x longer)
    scan_unroll: int = 1
    # embedded default model shape (when path is None)
    tiny_hidden_size: int = 128  # hidden size of the embedded default model
    tiny_num_layers: int = 2  # layers of the embedded default model
    tiny_num_heads: int = 4  # attention heads of the embedded default model


@dataclass(frozen=True)
class OptimConfig:
    lr: float = 1e-6  # peak learning rate
    lr_warmup_steps: int = 0  # linear warmup (optimizer steps) from 0 to lr
    lr_schedule: str = "constant"  # constant | cosine (after warmup)
    min_lr_ratio: float = 0.0  # cosine floor as a fraction of lr
    weight_decay: float = 0.01  # AdamW decoupled weight decay
    betas: tuple[float, float] = (0.9, 0.999)  # AdamW betas
    eps: float = 1e-8  # AdamW epsilon
    grad_clip: float = 1.0  # global-norm gradient clipping
    total_steps: int = 0  # optimizer steps for the cosine schedule; 0: derived from the run length


@dataclass(frozen=True)
class ActorConfig:
    ppo_mini_batch_size: int = 64  # prompts per mini-batch (x rollout.n sequences)
    ppo_micro_batch_size_per_device: int = 4  # sequences per device per micro-batch
    ppo_epochs: int = 1  # passes over the batch per PPO step
    shuffle: bool = True  # shuffle sequences into mini-batches
    clip_ratio_low: float = 0.2  # PPO clip: ratio >= 1 - low
    clip_ratio_high: float = 0.2  # PPO clip: ratio <= 1 + high
    clip_ratio_c: float = 3.0  # dual clip bound for negative advantages
    loss_agg_mode: str = "token-mean"  # token-mean | seq-mean-token-sum | seq-mean-token-mean | seq-mean-token-sum-norm
    entropy_coeff: float = 0.0  # entropy bonus
    use_kl_loss: bool = False  # KL to the reference as a loss term (GRPO style)
    kl_loss_coef: float = 0.001  # weight of the KL loss
    kl_loss_type: str = "low_var_kl"  # KL estimator for the loss
    tis_threshold: Optional[float] = None  # truncated IS on rollout-vs-trainer mismatch; None: off
    logprob_chunk_size: int = 256  # response tokens per chunk of the [tokens, vocab] head
    logprob_remat: bool = True  # recompute each chunk's logits in the backward pass (false: keep them, ~4 bytes x vocab per response token)
    log_prob_micro_batch_size_per_device: int = 8  # sequences per device per forward-only micro-batch
    use_dynamic_bsz: bool = False  # pack sequences into token-budget rows instead of padding (jaxppo/packing.py)
    # packed: at most this many tokens per device per update micro-batch; 0: the largest that fits the memory
    # plan (jaxppo/memory.py; 16384 when the card is unknown)
    ppo_max_token_len_per_device: int = 0
    log_prob_max_token_len_per_device: int = 0  # packed: the same for forward micro-batches; 0: auto
    lora_rank: int = 0  # LoRA adapters of this rank on the target projections, the base frozen (0: full fine-tuning)
    lora_alpha: float = 16.0  # LoRA scale alpha / rank
    target_modules: str = "all-linear"  # all-linear (every decoder projection) or a comma list, e.g. q_proj,v_proj
    optim: OptimConfig = field(default_factory=lambda: OptimConfig(lr=1e-6))


@dataclass(frozen=True)
class CriticConfig:
    ppo_mini_batch_size: int = 64  # prompts per mini-batch
    ppo_micro_batch_size_per_device: int = 4  # sequences per device per micro-batch
    ppo_epochs: int = 1  # passes over the batch per PPO step
    shuffle: bool = True  # shuffle sequences into mini-batches
    cliprange_value: float = 0.5  # value clipping around the old values
    loss_agg_mode: str = "token-mean"  # as actor.loss_agg_mode
    log_prob_micro_batch_size_per_device: int = 8  # sequences per device per forward-only micro-batch
    use_dynamic_bsz: bool = False  # pack sequences into token-budget rows instead of padding
    ppo_max_token_len_per_device: int = 0  # packed: tokens per device per update micro-batch; 0: auto (as the actor's)
    forward_max_token_len_per_device: int = 0  # packed: tokens per device per forward micro-batch; 0: auto
    lora_rank: int = 0  # LoRA on the critic's backbone (the value head is trained in full); 0: full fine-tuning
    lora_alpha: float = 16.0
    target_modules: str = "all-linear"
    optim: OptimConfig = field(default_factory=lambda: OptimConfig(lr=1e-5))


@dataclass(frozen=True)
class ValKwargsConfig:
    """Sampling for validation (verl's `rollout.val_kwargs`): n responses per prompt, greedy unless do_sample."""

    n: int = 1  # responses per validation prompt (mean@n, best@n, maj@n)
    do_sample: bool = False  # false: greedy (temperature, top_p and top_k are not used)
    temperature: float = 0.0  # with do_sample
    top_p: float = 1.0  # with do_sample
    top_k: int = -1  # with do_sample; -1: off


@dataclass(frozen=True)
class RolloutConfig:
    engine: str = "hf"  # hf | vllm
    n: int = 1  # responses per prompt
    temperature: float = 1.0  # sampling temperature
    top_p: float = 1.0  # nucleus sampling
    top_k: int = -1  # -1: off
    val_kwargs: ValKwargsConfig = field(default_factory=ValKwargsConfig)  # validation sampling
    gpu_memory_utilization: float = 0.5  # vLLM's share of the card (GPU memory plan)
    enforce_eager: bool = False  # vLLM: no CUDA graphs
    cudagraph_mode: Optional[str] = None  # vLLM's compilation_config.cudagraph_mode (e.g. PIECEWISE); None: vLLM's
    free_cache_engine: bool = True  # put the engine to sleep (KV cache and weights freed) outside generation
    # the engine's log-prob of every sampled token on every step (verl's key; actor.tis_threshold turns it on).
    # Off: on every 8th step only, for the rollout/* mismatch metrics and the health rule (jaxppo/step.py)
    calculate_log_probs: bool = False


@dataclass(frozen=True)
class KLCtrlConfig:
    type: str = "fixed"  # fixed | adaptive
    kl_coef: float = 0.001  # beta (initial for adaptive)
    target_kl: float = 0.1  # adaptive target
    horizon: int = 10000  # adaptive horizon (samples)


@dataclass(frozen=True)
class AlgorithmConfig:
    adv_estimator: str = "gae"  # gae | grpo | rloo | reinforce_plus_plus
    gamma: float = 1.0  # discount
    lam: float = 1.0  # GAE lambda
    norm_adv_by_std_in_grpo: bool = True  # False: Dr.GRPO
    use_kl_in_reward: bool = False  # KL penalty in the token rewards
    kl_penalty: str = "kl"  # estimator for the in-reward KL
    kl_ctrl: KLCtrlConfig = field(default_factory=KLCtrlConfig)
    filter_groups: FilterGroupsConfig = field(default_factory=lambda: FilterGroupsConfig())


@dataclass(frozen=True)
class FilterGroupsConfig:
    """DAPO's dynamic sampling: groups whose samples all got the same `metric` (no learning signal under a group
    baseline) are dropped and the batch is refilled from further prompts, `data.gen_batch_size` per round."""

    enable: bool = False
    metric: str = "score"  # score (the reward function's) | seq_reward (after overlong shaping) | acc (a dict key)
    max_num_gen_batches: int = 10  # generation rounds per step at most (0: no limit); then the batch is filled
    # with dropped groups (no signal, but the step's shapes hold) and `batch/filled_groups` says how many


@dataclass(frozen=True)
class OverlongBufferConfig:
    """DAPO's overlong reward shaping: a response longer than max_response_length - len loses up to
    penalty_factor, linearly over the last `len` tokens: min(-(length - (R - len)) / len * penalty_factor, 0)."""

    enable: bool = False
    len: int = 0  # tokens of the buffer at the end of max_response_length
    penalty_factor: float = 1.0


@dataclass(frozen=True)
class RewardConfig:
    num_workers: int = 0  # processes scoring rule rewards (0: in the trainer's process)
    timeout_s: float = 30.0  # per sample: past it the sample scores 0, counted in reward/errors (0: no limit)
    # with model.reward_model_path: replace (the reward model's score is the reward, as verl does) | add (rule + model)
    reward_model_combine: str = "replace"
    overlong_buffer: OverlongBufferConfig = field(default_factory=OverlongBufferConfig)


@dataclass(frozen=True)
class CustomRewardFunctionConfig:
    """verl's `custom_reward_function`: a reward function from a Python file, used for every data source."""

    path: str | None = None  # a .py file (None: the rule registered for each row's data_source)
    name: str = "compute_score"  # compute_score(data_source, solution_str, ground_truth, extra_info) -> float | dict


FSDP_GATHER = ("layer", "update")  # mesh.fsdp_gather
GRAD_REDUCE_DTYPES = ("float32", "bfloat16")  # mesh.grad_reduce_dtype


@dataclass(frozen=True)
class MeshConfig:
    data: int = -1  # data-parallel replicas (-1: fill)
    fsdp: int = 1  # parameter sharding (ZeRO-3)
    tensor: int = 1  # tensor parallel
    fsdp_gather: str = "layer"  # layer: gather fsdp shards per layer when used (ZeRO-3) | update: once per
    # update / forward pass, in the compute dtype (whole bf16 parameters + fp32 gradients per device, fewer collectives)
    grad_reduce_dtype: str = "float32"  # float32 | bfloat16: gradients summed across devices in this dtype
    # (bf16: half the bytes, each device's sum rounded to bf16 first); needs whole parameters per device
    # (pure data parallelism, or fsdp_gather=update)

    def axes(self) -> dict[str, int]:
        """The axis sizes, as `jaxppo.sharding.make_mesh` takes them."""
        return {"data": self.data, "fsdp": self.fsdp, "tensor": self.tensor}


@dataclass(frozen=True)
class TrainerConfig:
    total_epochs: int = 1  # passes over the training prompts
    total_training_steps: Optional[int] = None  # overrides total_epochs when set
    save_freq: int = -1  # checkpoint every N steps (-1: only at the end)
    test_freq: int = -1  # validate every N steps (-1: never)
    val_before_train: bool = True  # validate before the first step
    # validate (the newest checkpoint of the run dir, trainer.resume_mode's checkpoint, or the model) and exit;
    # no training state is built and nothing is trained or checkpointed
    val_only: bool = False
    max_to_keep: int = 2  # checkpoints kept
    resume_mode: str = "auto"  # auto | disable | <checkpoint path>
    default_local_dir: str = "runs/default"  # run directory (checkpoints, metrics, config)
    project_name: str = "jaxppo"  # for loggers
    experiment_name: str = "default"  # for loggers
    logger: list[str] = field(default_factory=lambda: ["console", "jsonl", "tensorboard"])  # + wandb
    seed: int = 0  # rollout sampling and init seed
    device_memory_gb: float = 0.0  # accelerator memory the memory plan is checked against (0: the device's own)
    compilation_cache_dir: str = "~/.cache/jaxppo/xla"  # JAX's persistent compilation cache ("": off)
    critic_warmup: int = 0  # steps updating only the critic
    sft_warmup_steps: int = 0  # supervised warm start steps on extra_info.answer (synthetic task)
    sft_lr: float = 1e-3  # learning rate of the warm start
    profile_steps: list[int] = field(default_factory=list)  # JAX (+ torch) profiler trace of these steps
    profile_dir: str = ""  # where traces go ("" = <run dir>/profile)
    health: HealthConfig = field(default_factory=HealthConfig)  # healthy ranges and actions (jaxppo/health.py)
    max_bad_steps: int = 3  # consecutive steps with NaN/inf losses, gradients or rewards that end the run
    early_stop_patience: int = 0  # validations without improvement that end the run (0: off)
    early_stop_metric: str = "val/score"  # validation metric watched by early stopping
    early_stop_mode: str = "max"  # max | min
    early_stop_min_delta: float = 0.0  # an improvement must exceed this


@dataclass(frozen=True)
class Config:
    data: DataConfig = field(default_factory=DataConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    actor: ActorConfig = field(default_factory=ActorConfig)
    critic: CriticConfig = field(default_factory=CriticConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    algorithm: AlgorithmConfig = field(default_factory=AlgorithmConfig)
    reward: RewardConfig = field(default_factory=RewardConfig)
    custom_reward_function: CustomRewardFunctionConfig = field(default_factory=CustomRewardFunctionConfig)
    mesh: MeshConfig = field(default_factory=MeshConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)


# ---------------------------------------------------------------- loading


def _key_list() -> list[str]:
    import typing

    def walk(cls, prefix):
        hints = typing.get_type_hints(cls)
        for f in dataclasses.fields(cls):
            name = prefix + f.name
            yield name
            if dataclasses.is_dataclass(hints[f.name]):
                yield from walk(hints[f.name], name + ".")

    return list(walk(Config, ""))


def _suggest(key: str) -> str:
    keys = _key_list()
    close = difflib.get_close_matches(key, keys, n=3, cutoff=0.5)
    leaf = key.rsplit(".", 1)[-1]
    close += [k for k in keys if k.rsplit(".", 1)[-1] == leaf and k not in close]
    return f"; did you mean {', '.join(close[:3])}?" if close else ""


def _to_dataclass(cls, data: Any):
    import typing

    hints = typing.get_type_hints(cls)
    kwargs = {}
    for f in dataclasses.fields(cls):
        if f.name not in data:
            continue
        value = data[f.name]
        if dataclasses.is_dataclass(hints[f.name]):
            value = _to_dataclass(hints[f.name], value)
        elif isinstance(value, list) and typing.get_origin(hints[f.name]) is tuple:
            value = tuple(value)
        kwargs[f.name] = value
    return cls(**kwargs)


def _writable(node) -> None:
    """Frozen dataclasses make omegaconf 2.3 nodes read-only one by one, and merging into them fails;
    clear the flag everywhere (the dataclass built from the merge is frozen again)."""
    from omegaconf import DictConfig, ListConfig, OmegaConf

    OmegaConf.set_readonly(node, None)
    if isinstance(node, DictConfig):
        for k in node.keys():
            child = node._get_node(k)
            if isinstance(child, (DictConfig, ListConfig)):
                _writable(child)


def load_config(path: str | Path | None = None, overrides: list[str] | tuple[str, ...] = ()) -> Config:
    """Defaults <- YAML file <- dotted `key=value` overrides, type-checked; errors are `ConfigError`."""
    from omegaconf import OmegaConf
    from omegaconf.errors import ConfigKeyError, OmegaConfBaseException, ValidationError

    base = OmegaConf.structured(Config)
    _writable(base)
    try:
        layers = [base]
        if path is not None:
            p = Path(path)
            if not p.is_file():
                raise ConfigError(f"{p}: config file not found")
            layers.append(OmegaConf.load(p))
        for item in overrides:
            if "=" not in item:
                raise ConfigError(f"override {item!r} is not key=value")
        if overrides:
            layers.append(OmegaConf.from_dotlist(list(overrides)))
        merged = OmegaConf.merge(*layers)
    except (ConfigKeyError, AttributeError) as e:
        key = getattr(e, "full_key", None) or str(e)
        raise ConfigError(f"unknown config key {key!r}{_suggest(str(key))}") from None
    except ValidationError as e:
        raise ConfigError(f"config key {e.full_key!r}: {str(e.msg).splitlines()[0]}") from None
    except OmegaConfBaseException as e:
        raise ConfigError(f"config: {e}") from None
    cfg = _to_dataclass(Config, OmegaConf.to_container(merged, resolve=True))
    validate(cfg)
    return cfg


def validate_paths(cfg: Config) -> None:
    """The paths a run reads exist (checked by `jaxppo.train` before anything is built; not by `load_config`,
    which also serves configs whose paths are filled in later)."""
    t = cfg.trainer
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
    if d.train_batch_size % processes:
        raise ConfigError(f"data.train_batch_size ({d.train_batch_size}) does not split over {processes} processes")
    if d.gen_batch_size % processes:
        raise ConfigError(f"data.gen_batch_size ({d.gen_batch_size}) does not split over {processes} processes")
    for name, sub in trained_models(cfg):
        if (sub.ppo_mini_batch_size * cfg.rollout.n) % processes:
            raise ConfigError(f"{name}.ppo_mini_batch_size x rollout.n does not split over {processes} processes")


def to_yaml(cfg: Config) -> str:
    from omegaconf import OmegaConf

    return OmegaConf.to_yaml(OmegaConf.structured(cfg))


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
    from jaxppo.ppo import ADVANTAGE_ESTIMATORS, KL_ESTIMATORS, LOSS_AGG_MODES

    return {"data.truncation": tuple(TRUNCATION_MODES),
            "actor.loss_agg_mode": tuple(LOSS_AGG_MODES), "critic.loss_agg_mode": tuple(LOSS_AGG_MODES),
            "actor.kl_loss_type": tuple(KL_ESTIMATORS.names()),
            "algorithm.kl_penalty": tuple(k for k in KL_ESTIMATORS.names() if k != "full"),
            "algorithm.adv_estimator": tuple(ADVANTAGE_ESTIMATORS.names())}


def _get(cfg: Config, key: str) -> Any:
    node = cfg
    for part in key.split("."):
        node = getattr(node, part)
    return node


def validate(cfg: Config, num_devices: int | None = None) -> None:
    """Every invalid value or combination, caught before any work starts (no directory, data or model is
    touched): closed sets of values, ranges, and the size relations the engine would otherwise assert."""
    def check(ok: bool, msg: str):
        if not ok:
            raise ConfigError(msg)

    for key, known in {**CLOSED_SETS, **_registry_sets()}.items():
        value = _get(cfg, key)
        check(value in known, f"{key} {value!r} unknown; known: {[k for k in known if k is not None]}"
              + (" (or unset)" if None in known else ""))
    for name in cfg.trainer.logger:
        check(name in LOGGERS, f"trainer.logger entry {name!r} unknown; known: {list(LOGGERS)}")
    a, c, d, r = cfg.actor, cfg.critic, cfg.data, cfg.rollout
    check(d.train_batch_size > 0, "data.train_batch_size must be positive")
    check(d.val_batch_size > 0, "data.val_batch_size must be positive")
    check(d.max_prompt_length > 0 and d.max_response_length > 0,
          "data.max_prompt_length and data.max_response_length must be positive")
    trained = trained_models(cfg)  # the critic's sizes matter only where there is a critic (GAE)
    for name, sub in trained:
        check(sub.ppo_mini_batch_size <= d.train_batch_size,
              f"{name}.ppo_mini_batch_size ({sub.ppo_mini_batch_size}) is larger than data.train_batch_size "
              f"({d.train_batch_size})")
        check(sub.ppo_mini_batch_size > 0 and d.train_batch_size % sub.ppo_mini_batch_size == 0,
              f"{name}.ppo_mini_batch_size ({sub.ppo_mini_batch_size}) does not divide data.train_batch_size "
              f"({d.train_batch_size})")
        check(sub.ppo_epochs >= 1, f"{name}.ppo_epochs must be >= 1")
        check(sub.ppo_micro_batch_size_per_device >= 1 and sub.log_prob_micro_batch_size_per_device >= 1,
              f"{name}'s micro-batch sizes must be >= 1")
        check(sub.optim.lr >= 0 and sub.optim.grad_clip > 0, f"{name}.optim.lr must be >= 0 and grad_clip > 0")
    check(r.n >= 1, "rollout.n must be >= 1")
    fg, ob = cfg.algorithm.filter_groups, cfg.reward.overlong_buffer
    check(d.gen_batch_size >= 0, "data.gen_batch_size must be >= 0 (0: data.train_batch_size)")
    if fg.enable:
        check(r.n >= 2, "algorithm.filter_groups.enable needs rollout.n >= 2 (a group's samples are compared)")
        check(fg.max_num_gen_batches >= 0, "algorithm.filter_groups.max_num_gen_batches must be >= 0 (0: no limit)")
        check(d.gen_batch_size == 0 or d.gen_batch_size >= d.train_batch_size,
              f"data.gen_batch_size ({d.gen_batch_size}) must be >= data.train_batch_size ({d.train_batch_size}) "
              "(0: equal)")
    else:
        check(d.gen_batch_size in (0, d.train_batch_size), "data.gen_batch_size is used by "
              "algorithm.filter_groups.enable=true only; set it there or leave it 0")
    if ob.enable:
        check(0 < ob.len < d.max_response_length, f"reward.overlong_buffer.len ({ob.len}) must be in "
              f"(0, data.max_response_length = {d.max_response_length})")
        check(ob.penalty_factor >= 0, "reward.overlong_buffer.penalty_factor must be >= 0")
    v = r.val_kwargs
    check(v.n >= 1, "rollout.val_kwargs.n must be >= 1")
    check(not v.do_sample or v.temperature > 0, "rollout.val_kwargs.do_sample=true needs "
          "rollout.val_kwargs.temperature > 0 (do_sample=false is greedy)")
    check(0 < v.top_p <= 1 and (v.top_k == -1 or v.top_k > 0),
          "rollout.val_kwargs.top_p must be in (0, 1] and top_k -1 (off) or positive")
    check(r.temperature >= 0, "rollout.temperature must be >= 0 (0: greedy)")
    check(0 < r.top_p <= 1, f"rollout.top_p must be in (0, 1], got {r.top_p}")
    check(r.top_k == -1 or r.top_k > 0, f"rollout.top_k must be -1 (off) or positive, got {r.top_k}")
    check(0 < r.gpu_memory_utilization < 0.95, f"rollout.gpu_memory_utilization must be in (0, 0.95), got "
          f"{r.gpu_memory_utilization}")
    check(a.logprob_chunk_size >= 1, "actor.logprob_chunk_size must be >= 1")
    check(a.tis_threshold is None or a.tis_threshold > 0, "actor.tis_threshold must be positive (or unset)")
    if cfg.algorithm.adv_estimator in ("grpo", "rloo"):
        check(r.n >= 2, f"algorithm.adv_estimator={cfg.algorithm.adv_estimator} compares each prompt's responses: "
              "set rollout.n >= 2")
    check(cfg.reward.num_workers >= 0 and cfg.reward.timeout_s >= 0,
          "reward.num_workers and reward.timeout_s must be >= 0")
    check(cfg.model.scan_unroll >= 0, f"model.scan_unroll must be >= 0 (0: all layers), got {cfg.model.scan_unroll}")
    from jaxppo.models.lora import parse_targets

    for name, sub in trained:
        check(sub.lora_rank >= 0, f"{name}.lora_rank must be >= 0 (0: full fine-tuning)")
        if sub.lora_rank:
            try:
                parse_targets(sub.target_modules)
            except ValueError as e:
                check(False, f"{name}.{e}")
            check(sub.lora_alpha > 0, f"{name}.lora_alpha must be positive")
            check(cfg.mesh.fsdp_gather == "layer", f"{name}.lora_rank > 0 needs mesh.fsdp_gather=layer (the frozen "
                  "base weights live outside the train state)")
    seq_len = d.max_prompt_length + d.max_response_length
    budget_keys = {"actor": ("ppo_max_token_len_per_device", "log_prob_max_token_len_per_device"),
                   "critic": ("ppo_max_token_len_per_device", "forward_max_token_len_per_device")}
    for name, sub in trained:
        for key in budget_keys[name]:
            v = getattr(sub, key)
            check(v == 0 or v >= seq_len, f"{name}.{key} ({v}) is smaller than one sequence (data.max_prompt_length "
                  f"+ data.max_response_length = {seq_len}); 0 picks the largest budget that fits")
    t = cfg.trainer
    from jaxppo import health

    for msg in health.validate(t.health):
        check(False, msg)
    check(t.total_epochs >= 1, "trainer.total_epochs must be >= 1")
    check(t.total_training_steps is None or t.total_training_steps >= 1, "trainer.total_training_steps must be >= 1")
    check(t.critic_warmup >= 0, "trainer.critic_warmup must be >= 0")
    check(t.max_to_keep >= 1, "trainer.max_to_keep must be >= 1")
    check(t.max_bad_steps >= 1, "trainer.max_bad_steps must be >= 1")
    check(t.device_memory_gb >= 0, "trainer.device_memory_gb must be >= 0 (0: the device's own)")
    check(t.early_stop_patience == 0 or t.test_freq > 0,
          "trainer.early_stop_patience needs validation: set trainer.test_freq > 0")
    check(t.early_stop_patience >= 0, "trainer.early_stop_patience must be >= 0")
    check(all(s >= 1 for s in t.profile_steps), "trainer.profile_steps are 1-based step numbers")
    check(cfg.mesh.fsdp_gather == "layer" or cfg.mesh.tensor == 1, "mesh.fsdp_gather=update needs mesh.tensor=1")
    if num_devices is not None:
        from jaxppo.sharding import resolve_mesh_shape

        sizes = resolve_mesh_shape(cfg.mesh.axes(), num_devices)
        batch_shards = sizes["data"] * sizes["fsdp"]
        check(cfg.mesh.grad_reduce_dtype == "float32" or sizes["tensor"] == 1 and (
            sizes["fsdp"] == 1 or cfg.mesh.fsdp_gather == "update") and batch_shards > 1,
            f"mesh.grad_reduce_dtype={cfg.mesh.grad_reduce_dtype} applies where each device holds whole parameters "
            f"(mesh.data > 1 with fsdp = tensor = 1, or mesh.fsdp_gather=update); this mesh is {sizes}")
        seqs_step = d.train_batch_size * r.n
        for name, sub in trained:
            micro = sub.ppo_micro_batch_size_per_device * batch_shards
            seqs = sub.ppo_mini_batch_size * r.n
            check(sub.use_dynamic_bsz or seqs % micro == 0,
                  f"{name}.ppo_micro_batch_size_per_device ({sub.ppo_micro_batch_size_per_device}) x {batch_shards} "
                  f"batch shards = {micro} sequences does not divide the mini-batch of {seqs} sequences "
                  f"({name}.ppo_mini_batch_size x rollout.n)")
            fwd = sub.log_prob_micro_batch_size_per_device * batch_shards
            check(sub.use_dynamic_bsz or seqs_step % fwd == 0,
                  f"{name}.log_prob_micro_batch_size_per_device ({sub.log_prob_micro_batch_size_per_device}) x "
                  f"{batch_shards} batch shards = {fwd} sequences does not divide the step's {seqs_step} sequences "
                  f"(data.train_batch_size x rollout.n)")
