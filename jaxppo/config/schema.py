"""The config tree: one frozen dataclass per section, one field per knob, each with a one-line comment."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

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
    # the update's micro-batch loop: scan (inside the update's one program) | host (one program per micro-batch
    # called from the host, then the optimizer step: a loop in XLA's program can hold per-iteration copies of the
    # weights that one micro-batch's program does not; every mesh: where each device sums its own gradients the
    # sum kept between the programs is per device, reduced in the optimizer step's) | auto: host for an engine that
    # trains LoRA adapters on frozen weights, scan under full fine-tuning (jaxppo.build.resolve_micro_batch_loop)
    micro_batch_loop: str = "auto"
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
class PolicyLossConfig:
    """The policy loss by verl's name (jaxppo/ppo/policy_losses.py) and the settings some of them read."""

    loss_mode: str = "vanilla"  # vanilla | gspo | gpg | cispo | sapo | geo_mean | kl_cov | clip_cov | dro
    clip_cov_ratio: float = 0.0002  # clip_cov: share of the micro-batch's tokens whose gradient may be dropped
    clip_cov_lb: float = 1.0  # clip_cov: covariance window (lb, ub) of the tokens it may drop
    clip_cov_ub: float = 5.0
    kl_cov_ratio: float = 0.0002  # kl_cov: share of the tokens (largest covariance) that get the |log ratio| penalty
    ppo_kl_coef: float = 0.1  # kl_cov: that penalty's weight
    dro_beta: Optional[float] = None  # dro: the quadratic log-ratio penalty (required, > 0)


@dataclass(frozen=True)
class ActorConfig:
    ppo_mini_batch_size: int = 64  # prompts per mini-batch (x rollout.n sequences)
    ppo_micro_batch_size_per_device: int = 4  # sequences per device per micro-batch
    ppo_epochs: int = 1  # passes over the batch per PPO step
    shuffle: bool = True  # shuffle sequences into mini-batches
    clip_ratio_low: float = 0.2  # PPO clip: ratio >= 1 - low
    clip_ratio_high: float = 0.2  # PPO clip: ratio <= 1 + high
    clip_ratio_c: float = 3.0  # dual clip bound for negative advantages
    policy_loss: PolicyLossConfig = field(default_factory=PolicyLossConfig)
    tau_pos: float = 1.0  # sapo: the gate's temperature for positive advantages
    tau_neg: float = 1.05  # sapo: for the others
    loss_agg_mode: str = "token-mean"  # token-mean | seq-mean-token-sum | seq-mean-token-mean | seq-mean-token-sum-norm
    # seq-mean-token-sum-norm (Dr. GRPO) divides the sequences' token sums by this constant (verl's key); None: the
    # response length (data.max_response_length)
    loss_scale_factor: Optional[float] = None
    entropy_coeff: float = 0.0  # entropy bonus
    use_kl_loss: bool = False  # KL to the reference as a loss term (GRPO style)
    kl_loss_coef: float = 0.001  # weight of the KL loss
    kl_loss_type: str = "low_var_kl"  # KL estimator for the loss
    tis_threshold: Optional[float] = None  # truncated IS on rollout-vs-trainer mismatch; None: off
    # response tokens of a row per chunk of the [tokens, vocab] head; a packed row's chunk is that many of its response
    # tokens, and each chunk reads the head's whole weight matrix: packed configs want thousands (2048 at 0.5B on an
    # H100: the update 15 % and the log-prob pass 28 % faster than at 256, docs/benchmarks.md)
    logprob_chunk_size: int = 256
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
    optimizer_offload: bool = False  # AdamW's moments in pinned host memory between updates (jaxppo/offload.py)


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
    optimizer_offload: bool = False  # as actor.optimizer_offload


@dataclass(frozen=True)
class ValKwargsConfig:
    """Sampling for validation (verl's `rollout.val_kwargs`): n responses per prompt, greedy unless do_sample."""

    n: int = 1  # responses per validation prompt (mean@n, best@n, maj@n)
    do_sample: bool = False  # false: greedy (temperature, top_p and top_k are not used)
    temperature: float = 0.0  # with do_sample
    top_p: float = 1.0  # with do_sample
    top_k: int = -1  # with do_sample; -1: off


@dataclass(frozen=True)
class EngineKwargsConfig:
    """verl's `rollout.engine_kwargs`: further arguments of the rollout engine (vLLM's `EngineArgs`, e.g.
    `async_scheduling: false`). The arguments jaxppo sets from its own keys or its plan are refused there, naming
    the key to set instead (`jaxppo.rollout.VLLM_OWN_ARGS`); ignored by the transformers engine."""

    vllm: dict = field(default_factory=dict)


@dataclass(frozen=True)
class RolloutConfig:
    engine: str = "hf"  # hf | vllm
    n: int = 1  # responses per prompt
    temperature: float = 1.0  # sampling temperature
    top_p: float = 1.0  # nucleus sampling
    top_k: int = -1  # -1: off
    val_kwargs: ValKwargsConfig = field(default_factory=ValKwargsConfig)  # validation sampling
    gpu_memory_utilization: float = 0.0  # vLLM's share of the card; 0: automatic (JAX its compiled need, vLLM the rest)
    enforce_eager: bool = False  # vLLM: no CUDA graphs
    cudagraph_mode: Optional[str] = None  # vLLM's compilation_config.cudagraph_mode (e.g. PIECEWISE); None: vLLM's
    # vLLM's decode batch sizes captured as CUDA graphs (None: vLLM's, up to 512 sequences on an H100/H200; a decode
    # step of more sequences runs without a graph)
    cudagraph_capture_sizes: Optional[list[int]] = None
    # vLLM's scheduler: sequences at once at most, and tokens in one engine step at most (0: vLLM's defaults, 1024
    # and 16384 on an H100/H200; verl's are 256 and 8192); the memory plan sizes vLLM's KV cache for at most
    # max_num_seqs sequences at once
    max_num_seqs: int = 0
    max_num_batched_tokens: int = 0
    enable_chunked_prefill: bool = True  # vLLM: a prompt's prefill may span engine steps (always off on CPU)
    enable_prefix_caching: bool = True  # vLLM: KV blocks of a shared prefix computed once (verl's key and default)
    engine_kwargs: EngineKwargsConfig = field(default_factory=EngineKwargsConfig)  # verl's key
    # vLLM engines on the card, each in a process of its own (the first the trainer's): a generation call's prompts
    # split between them, so vLLM's host work runs side by side (bridge/engines/vllm_processes.py); the memory plan
    # counts each engine's weights, graphs and CUDA context and one shared copy of the pushed weights
    engine_processes: int = 1
    # false: none of those engines in the trainer's process, every one in a helper process of its own (its weights
    # loaded from the shared copy): vLLM's host work then never shares the trainer's interpreter (rollouts one step
    # ahead generate while JAX trains); true: the first engine is the trainer's, its weights DLPack views;
    # null: false for vLLM one step ahead (trainer.async_rollout: in the trainer's process its generation makes
    # almost no progress while JAX trains, docs/benchmarks.md), else true (jaxppo/config/loading.py)
    engine_in_trainer: Optional[bool] = None
    # a CUDA MPS daemon of the run's own, so the trainer's and its helper engines' kernels share the card at once
    # instead of in time slices (jaxppo/mps.py): vLLM with a helper process only; needs nvidia-cuda-mps-control
    cuda_mps: bool = False
    # under that daemon, the trainer's process a client of this priority (CUDA_MPS_CLIENT_PRIORITY; the helper
    # engines always normal): below_normal lets the decode's small kernels be scheduled ahead of XLA's large ones,
    # which starve it at 0.5B under plain MPS (jaxppo/mps.py); normal | below_normal
    cuda_mps_trainer_priority: str = "normal"
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
class RolloutCorrectionConfig:
    """verl's `algorithm.rollout_correction` (jaxppo/ppo/rollout_correction.py): importance weights and rejection
    for the gap between the policy that sampled (the rollout engine) and the trainer's; off unless set."""

    rollout_is: Optional[str] = None  # token | sequence: importance weights pi_trainer / pi_rollout; None: none
    rollout_is_threshold: str = "2.0"  # upper bound (truncate), or "lower_upper" (zero outside: IcePop)
    rollout_is_batch_normalize: bool = False  # rescale the weights to mean 1 over the batch
    # rejection: comma-separated token_k1|k2|k3, seq_sum_k1|k2|k3, seq_mean_k1|k2|k3, seq_max_k2|k3; None: none
    rollout_rs: Optional[str] = None
    rollout_rs_threshold: Optional[str] = None  # one per option or one for all (k1: "lower_upper" ratio bounds)
    # the rollout engine's log-probs are the old policy's: no recomputation (verl's bypass_ppo_clip preset)
    bypass_mode: bool = False
    loss_type: str = "ppo_clip"  # bypass mode's loss: ppo_clip (the PPO ratio against the rollout policy)


@dataclass(frozen=True)
class AlgorithmConfig:
    adv_estimator: str = "gae"  # gae | grpo | grpo_passk | rloo | opo | gpg | reinforce_plus_plus(_baseline) | remax
    gamma: float = 1.0  # discount
    lam: float = 1.0  # GAE lambda
    norm_adv_by_std_in_grpo: bool = True  # False: Dr.GRPO
    use_kl_in_reward: bool = False  # KL penalty in the token rewards
    kl_penalty: str = "kl"  # estimator for the in-reward KL
    kl_ctrl: KLCtrlConfig = field(default_factory=KLCtrlConfig)
    filter_groups: FilterGroupsConfig = field(default_factory=lambda: FilterGroupsConfig())
    rollout_correction: RolloutCorrectionConfig = field(default_factory=RolloutCorrectionConfig)


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
    # worker processes scoring rewards, each sample under its own time limit there (a stuck or dying worker is
    # replaced); -1: min(4, CPUs); 0: in the trainer's process, where os._exit or a loop in C cannot be stopped
    num_workers: int = -1
    # the rule scoring data sources that no rule is registered for (e.g. "lighteval/MATH": \boxed{} math,
    # "math_dapo": DAPO's "Answer:" rule, "openai/gsm8k"); None: such a
    # source is an error at dataset load unless custom_reward_function is set
    default_rule: Optional[str] = None
    timeout_s: float = 30.0  # per sample: past it the sample scores 0, counted in reward/errors (0: no limit)
    # with model.reward_model_path: replace (the reward model's score is the reward, as verl does) | add (rule + model)
    reward_model_combine: str = "replace"
    overlong_buffer: OverlongBufferConfig = field(default_factory=OverlongBufferConfig)


@dataclass(frozen=True)
class CustomRewardFunctionConfig:
    """verl's `custom_reward_function`: a reward function from a Python file, used for every data source."""

    path: str | None = None  # a .py file (None: the rule registered for each row's data_source)
    name: str = "compute_score"  # compute_score(data_source, solution_str, ground_truth, extra_info) -> float | dict
    reward_kwargs: dict = field(default_factory=dict)  # further keyword arguments of the function (verl's key)


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
    host_memory_gb: float = 0.0  # host RAM the plan counts offloaded states against (0: the machine's own)
    memory_margin_gb: float = 2.0  # per device, kept free beside JAX's compiled peak (the plan's stated margin)
    # compile the step's programs, print the memory plan and exit (0 fits, 2 does not) without starting the
    # rollout engine, allocating states or creating the run directory
    plan_only: bool = False
    # rollouts one step ahead (jaxppo/ahead.py): the engine, kept awake, generates step k+1's batch with the weights
    # of step k while JAX trains on step k's; the data is one step off-policy, corrected by
    # algorithm.rollout_correction (when none is set: bypass mode, or token-level truncated IS at 2.0 for a policy
    # loss that is not PPO's; jaxppo/config/loading.py)
    async_rollout: bool = False
    # the next step's batch generated while the critic updates (jaxppo/ahead.py): the actor updates first, its new
    # weights are pushed and the engine, kept awake, samples step k+1's batch in the background while the critic
    # trains on step k's. The two updates read the same batch and not each other's results, so this is the
    # synchronous step exactly (on-policy), reordered; it needs a critic, and excludes trainer.async_rollout
    rollout_during_critic_update: bool = False
    compilation_cache_dir: str = "~/.cache/jaxppo/xla"  # JAX's persistent compilation cache ("": off)
    critic_warmup: int = 0  # steps updating only the critic
    sft_warmup_steps: int = 0  # supervised warm start steps on extra_info.answer (synthetic task); with
    # sft_target_nll, the most it takes
    # stop the warm start once its training nll (smoothed over ~5 steps) reaches this (0: run every step): the same
    # model quality whatever the machine's float rounding, where a fixed step count lands anywhere on a steep curve
    sft_target_nll: float = 0.0
    sft_lr: float = 1e-3  # learning rate of the warm start
    profile_steps: list[int] = field(default_factory=list)  # JAX (+ torch) profiler trace of these steps
    profile_dir: str = ""  # where traces go ("" = <run dir>/profile)
    # the profilers of those steps: jax (XLA's programs, their phases) and / or torch (the rollout engine; on a GPU
    # its CUPTI trace has every kernel of the process, XLA's too). On a GPU, CUPTI takes one subscriber at a time:
    # name one of them there to be sure of its kernels; python: cProfile of the step's thread (the host's functions)
    profile_tools: list[str] = field(default_factory=lambda: ["jax", "torch"])
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
