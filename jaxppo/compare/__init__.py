"""`python -m jaxppo.compare`: the same checkpoint and batch in jaxppo (JAX) and transformers (torch).

Subcommands:
  logits (default)  forward pass parity on random left-padded batches.
  ppo-step          one PPO step (old / ref log-probs, values, advantages, critic and actor updates) in
                    jaxppo and in the plain torch reference (bridge/reference.py), same weights, same
                    batch, same config; per quantity both values and their relative difference, and with
                    --time the median time of each phase in each framework.

The last line printed is one JSON object (machine-readable); a table precedes it.
"""

from jaxppo.compare.cli import main
from jaxppo.compare.logits import logits_report, random_left_padded_batch
from jaxppo.compare.ppo_step import CRITERIA, ppo_step_report

__all__ = ["CRITERIA", "logits_report", "main", "ppo_step_report", "random_left_padded_batch"]
