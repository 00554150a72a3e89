"""The pure, mask-aware math of PPO with KL regularisation: no I/O, no state, jit- and vmap-friendly."""

from jaxppo.ppo.advantages import (ADVANTAGE_ESTIMATORS, compute_advantages, compute_gae, grpo_estimator,
                                   reinforce_plus_plus_estimator, rloo_estimator)
from jaxppo.ppo.agg import LOSS_AGG_MODES, agg_loss, masked_mean, masked_sum, masked_var, masked_whiten
from jaxppo.ppo.kl import (KL_ESTIMATORS, KLControlConfig, apply_kl_penalty, full_kl, kl_penalty,
                           scores_to_token_level, update_kl_coef)
from jaxppo.ppo.losses import (entropy_from_logits, policy_loss, rollout_mismatch_metrics, truncated_is_weights,
                               value_loss)

__all__ = [
    "ADVANTAGE_ESTIMATORS", "compute_advantages", "compute_gae", "grpo_estimator", "rloo_estimator",
    "reinforce_plus_plus_estimator", "LOSS_AGG_MODES", "agg_loss", "masked_mean", "masked_sum", "masked_var",
    "masked_whiten", "KL_ESTIMATORS", "KLControlConfig", "apply_kl_penalty", "full_kl", "kl_penalty",
    "scores_to_token_level", "update_kl_coef", "entropy_from_logits", "policy_loss", "rollout_mismatch_metrics",
    "truncated_is_weights", "value_loss",
]
