"""The run's health monitor: the field's healthy ranges for PPO metrics, checked every step.

A rule watches one metric against one threshold. When it starts firing it is reported once (the value
and a suggested action) and stays quiet until the metric has been healthy for `recover_steps` steps in
a row (one report per episode of trouble). Every step writes `health/<rule>` (1.0 while firing) and
`health/findings` (episodes so far). Each rule's action is one of

  warn         report only;
  skip_update  the update does not reach the parameters: rules known before the updates (rewards,
               rollout mismatch, truncation, explained variance) skip the step's critic and actor
               updates; rules known inside an update (KL, grad norm, entropy, NaN/inf) skip the
               optimizer step of each offending mini-batch, inside the compiled step;
  stop         the trainer writes a checkpoint and ends the run (exit code 3).

NaN/inf in a loss or a gradient never reaches the parameters, whatever the action (`nonfinite` may be
skip_update or stop); `trainer.max_bad_steps` consecutive steps with one end the run without writing
over the last good checkpoint.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass, field
from typing import Any

log = logging.getLogger(__name__)

ACTIONS = ("warn", "skip_update", "stop")


@dataclass(frozen=True)
class HealthRule:
    threshold: float = 0.0
    action: str = "warn"  # warn | skip_update | stop


def _rule(threshold: float, action: str = "warn"):
    return field(default_factory=lambda: HealthRule(threshold, action))


@dataclass(frozen=True)
class HealthConfig:
    enable: bool = True
    recover_steps: int = 3  # healthy steps in a row that end an episode of trouble
    ppo_kl_high: HealthRule = _rule(0.05)  # actor/ppo_kl above: the policy moves too far per step
    ppo_kl_low: HealthRule = _rule(0.005)  # actor/ppo_kl below: the policy is barely moving (warn | stop)
    grad_norm: HealthRule = _rule(100.0)  # actor/grad_norm or critic/grad_norm above (before clipping)
    nonfinite: HealthRule = _rule(0.0, "skip_update")  # NaN/inf in rewards, losses or gradients
    response_clip: HealthRule = _rule(0.9)  # response_length/clip_ratio above: responses are truncated
    explained_var: HealthRule = _rule(-0.5)  # critic/vf_explained_var below, once it has been >= 0.2
    logprob_mismatch: HealthRule = _rule(0.1)  # rollout/logprob_diff_mean above
    entropy: HealthRule = _rule(0.02)  # actor/entropy below: entropy collapse
    # reward/error_ratio above: the reward function failed on most samples (a bug, not noise: stop by default)
    reward_errors: HealthRule = _rule(0.5, "stop")


@dataclass(frozen=True)
class _Spec:
    metrics: tuple[str, ...]
    above: bool  # fires when the value is above (True) or below (False) the threshold
    stage: str  # "pre": known before the updates; "update": computed inside each mini-batch update
    advice: str


SPECS: dict[str, _Spec] = {
    "ppo_kl_high": _Spec(("actor/ppo_kl",), True, "update",
                         "the policy moves too far per step: raise the KL coefficient, lower actor.optim.lr or "
                         "the clip ratios, or use fewer ppo_epochs"),
    "ppo_kl_low": _Spec(("actor/ppo_kl",), False, "update",
                        "the policy is barely moving: raise actor.optim.lr or ppo_epochs, or check the advantages"),
    "grad_norm": _Spec(("actor/grad_norm", "critic/grad_norm"), True, "update",
                       "gradients are large: lower the learning rate or optim.grad_clip, check rewards' scale"),
    "nonfinite": _Spec(("critic/score/mean", "critic/rewards/mean", "actor/pg_loss", "actor/grad_norm",
                        "critic/vf_loss", "critic/grad_norm"), True, "update",
                       "NaN/inf: check the reward function, lower the learning rate, use float32"),
    "response_clip": _Spec(("response_length/clip_ratio",), True, "pre",
                           "most responses hit max_response_length: raise data.max_response_length"),
    "explained_var": _Spec(("critic/vf_explained_var",), False, "pre",
                           "the critic stopped explaining returns: lower critic.optim.lr, check reward scale"),
    "logprob_mismatch": _Spec(("rollout/logprob_diff_mean",), True, "pre",
                              "the rollout engine samples from a different distribution than the trainer scores: "
                              "check the weight sync, dtypes, or enable actor.tis_threshold"),
    "entropy": _Spec(("actor/entropy",), False, "update",
                     "entropy collapse: raise actor.entropy_coeff or the rollout temperature"),
    "reward_errors": _Spec(("reward/error_ratio",), True, "pre",
                           "the reward function failed on most samples (raised, returned no number, or ran past "
                           "reward.timeout_s; the warnings above name the first): fix it, or raise reward.timeout_s "
                           "(trainer.health.reward_errors.action=warn trains on the zeros)"),
}

# rules whose skip_update runs inside the compiled update, and the metric each bounds there
IN_UPDATE = {"ppo_kl_high": ("ppo_kl", "max"), "grad_norm": ("grad_norm", "max"), "entropy": ("entropy", "min")}


def validate(cfg: HealthConfig) -> list[str]:
    errors = []
    for name in SPECS:
        rule = getattr(cfg, name)
        if rule.action not in ACTIONS:
            errors.append(f"trainer.health.{name}.action {rule.action!r} unknown; known: {list(ACTIONS)}")
    if cfg.ppo_kl_low.action == "skip_update":
        errors.append("trainer.health.ppo_kl_low.action cannot be skip_update (skipping would freeze the policy)")
    if cfg.nonfinite.action == "warn":
        errors.append("trainer.health.nonfinite.action must be skip_update or stop: NaN/inf never reaches the "
                      "parameters")
    return errors


def update_guards(cfg: HealthConfig, engine: str) -> dict[str, tuple[str, float]]:
    """{metric: ("max"|"min", bound)} the compiled update of `engine` ("actor"|"critic") enforces per
    mini-batch (NaN/inf is always enforced)."""
    out = {}
    if not cfg.enable:
        return out
    for name, (metric, kind) in IN_UPDATE.items():
        rule = getattr(cfg, name)
        if rule.action == "skip_update" and (engine == "actor" or metric == "grad_norm"):
            out[metric] = (kind, rule.threshold)
    return out


@dataclass
class Finding:
    rule: str
    metric: str
    value: float
    action: str
    message: str


@dataclass
class HealthMonitor:
    cfg: HealthConfig
    single_update: bool = False  # one actor update a step: its actor/ppo_kl is taken before its only gradient
    firing: dict[str, bool] = field(default_factory=dict)
    healthy_run: dict[str, int] = field(default_factory=dict)
    findings: int = 0
    explained_var_seen: bool = False

    def _fires(self, name: str, metrics: dict[str, float]) -> tuple[str, float] | None:
        spec, rule = SPECS[name], getattr(self.cfg, name)
        for key in spec.metrics:
            v = metrics.get(key)
            if v is None:
                continue
            v = float(v)
            if name == "nonfinite":
                if not math.isfinite(v):
                    return key, v
                continue
            if not math.isfinite(v):
                continue  # reported by `nonfinite`
            if name == "explained_var" and not self.explained_var_seen:
                continue  # a critic that never explained the returns has nothing to collapse from
            if name == "ppo_kl_low" and self.single_update:
                continue  # the KL between the weights that sampled and themselves: 0 whether the policy moves or not
            if (v > rule.threshold) if spec.above else (v < rule.threshold):
                return key, v
        return None

    def decide(self, metrics: dict[str, float], stage: str | None = None) -> list[Finding]:
        """The rules of `stage` ("pre" | "update" | None: all; `nonfinite` is in every stage) firing on
        `metrics` now. No side effects: the trainer acts on these before the updates."""
        if not self.cfg.enable:
            return []
        out = []
        for name, spec in SPECS.items():
            if stage is not None and spec.stage != stage and name != "nonfinite":
                continue
            hit = self._fires(name, metrics)
            if hit is not None:
                out.append(Finding(name, hit[0], hit[1], getattr(self.cfg, name).action, spec.advice))
        return out

    def report(self, metrics: dict[str, float]) -> list[Finding]:
        """Once per step, on all of the step's metrics: logs each new episode of trouble, writes
        `health/<rule>` and `health/findings` into `metrics`, returns the rules firing."""
        if not self.cfg.enable:
            return []
        found = self.decide(metrics)
        if metrics.get("critic/vf_explained_var", -math.inf) >= 0.2:  # a value this high never fires
            self.explained_var_seen = True
        hit = {f.rule: f for f in found}
        for name, spec in SPECS.items():
            rule = getattr(self.cfg, name)
            if name not in hit and not any(k in metrics for k in spec.metrics):
                continue  # not measured this step (rollout/* on every 8th step): no evidence either way
            metrics[f"health/{name}"] = 1.0 if name in hit else 0.0
            if name not in hit:
                if self.firing.get(name):
                    self.healthy_run[name] = self.healthy_run.get(name, 0) + 1
                    if self.healthy_run[name] >= self.cfg.recover_steps:
                        self.firing[name] = False
                continue
            self.healthy_run[name] = 0
            if not self.firing.get(name):
                self.firing[name] = True
                self.findings += 1
                f = hit[name]
                bound = "" if name == "nonfinite" else f" ({'>' if spec.above else '<'} {rule.threshold:g})"
                log.warning("health: %s = %.4g%s -> %s; %s", f.metric, f.value, bound, rule.action, spec.advice)
        metrics["health/findings"] = float(self.findings)
        return found

    def state(self) -> dict[str, Any]:
        return {"firing": dict(self.firing), "healthy_run": dict(self.healthy_run), "findings": self.findings,
                "explained_var_seen": self.explained_var_seen}

    def load_state(self, s: dict[str, Any]) -> None:
        self.firing, self.healthy_run = dict(s["firing"]), dict(s["healthy_run"])
        self.findings, self.explained_var_seen = int(s["findings"]), bool(s["explained_var_seen"])


__all__ = ["HealthConfig", "HealthRule", "HealthMonitor", "Finding", "SPECS", "ACTIONS", "validate", "update_guards"]
