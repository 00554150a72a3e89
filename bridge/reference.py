"""Plain torch / transformers references for cross-framework comparison (written to be read, not fast)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

TORCH_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16,
                "float64": torch.float64}


def wide(x: torch.Tensor) -> torch.Tensor:
    """`x` in float32 (what the references compute losses in), or as it is when it is float64."""
    return x if x.dtype == torch.float64 else x.float()


def load_hf_model(model_dir: str | Path, dtype: str = "float32", device: str = "cpu", inv_freq=None):
    """The checkpoint as transformers loads it (causal LM or token classification), in eval mode. float64: see
    `all_float64` (`inv_freq`: RoPE's inverse frequencies in float64, required there)."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForTokenClassification

    cfg = AutoConfig.from_pretrained(model_dir)
    is_score = any(a.endswith("ForTokenClassification") for a in (cfg.architectures or []))
    cls = AutoModelForTokenClassification if is_score else AutoModelForCausalLM
    if is_score:
        cfg.classifier_dropout = 0.0  # a value head without dropout, as verl's critic
    model = cls.from_pretrained(model_dir, config=cfg, dtype=TORCH_DTYPES[dtype], attn_implementation="sdpa")
    if dtype == "float64":
        all_float64(model, inv_freq)
    return model.to(device).eval()


def all_float64(model, inv_freq) -> None:
    """Make a float64 transformers model compute in float64 throughout: its RMSNorms and rotary embedding cast to
    float32 inside whatever the model's dtype (transformers' own choice for half precision), which alone moves
    the logits by ~1e-7. The norms are replaced by the same formula in float64, and the rotary tables are
    computed in float64 from `inv_freq` (transformers computes those frequencies in float32 at load: the float64
    comparison takes jaxppo's, from the config in float64; the float32 comparisons check them against
    transformers' own)."""
    if inv_freq is None:
        raise ValueError("a float64 model needs RoPE's inverse frequencies in float64 (inv_freq)")
    freq = torch.as_tensor(np.asarray(inv_freq, np.float64))

    def norm(self, x):
        x = x.double()
        return self.weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.variance_epsilon))

    @torch.no_grad()
    def rotary(self, x, position_ids):
        freqs = position_ids[..., None].double() * freq.to(x.device)
        emb = torch.cat((freqs, freqs), dim=-1)
        return (emb.cos() * self.attention_scaling).to(x.dtype), (emb.sin() * self.attention_scaling).to(x.dtype)

    import types

    seen = {"norm": 0, "rotary": 0}
    for m in model.modules():
        kind = type(m).__name__
        if kind.endswith("RMSNorm"):
            m.forward, seen["norm"] = types.MethodType(norm, m), seen["norm"] + 1
        elif kind.endswith("RotaryEmbedding"):
            m.forward, seen["rotary"] = types.MethodType(rotary, m), seen["rotary"] + 1
    if not all(seen.values()):
        raise ValueError(f"{type(model).__name__}: no RMSNorm or rotary embedding module found ({seen})")


@torch.no_grad()
def hf_logits(model, input_ids: np.ndarray, attention_mask: np.ndarray, positions: np.ndarray) -> np.ndarray:
    """Float32 logits [b, t, vocab] (or [b, t, num_labels]) of a transformers model."""
    device = next(model.parameters()).device
    out = model(input_ids=torch.as_tensor(input_ids, device=device),
                attention_mask=torch.as_tensor(attention_mask, device=device),
                position_ids=torch.as_tensor(positions, device=device))
    return wide(out.logits).cpu().numpy()


# ---------------------------------------------------------------- LoRA through the `peft` library

PEFT_PREFIX = "base_model.model."


def peft_to_hf(name: str) -> str:
    """A peft model's parameter name -> jaxppo's HF-style name: `base_model.model.X.lora_A.default.weight` ->
    `X.lora_A` (how jaxppo names an adapter), `base_model.model.score.weight` -> `score.weight`."""
    name = name.removeprefix(PEFT_PREFIX)
    for key in ("lora_A", "lora_B"):
        name = name.replace(f".{key}.default.weight", f".{key}")
    return name


def wrap_lora(model, rank: int, alpha: float, targets: tuple[str, ...], adapters: dict[str, np.ndarray],
              train_head: bool = False):
    """`model` wrapped by peft's LoRA (no dropout, no bias), its adapters set to `adapters` (jaxppo's names:
    `model.layers.<i>.<module>.<proj>.lora_A` / `lora_B`, float32); only the adapters (and, with `train_head`,
    the value head `score`) require gradients."""
    from peft import LoraConfig, get_peft_model

    model = get_peft_model(model, LoraConfig(r=rank, lora_alpha=alpha, target_modules=list(targets),
                                             lora_dropout=0.0, bias="none"))
    seen = set()
    with torch.no_grad():
        for name, p in model.named_parameters():
            key = peft_to_hf(name)
            if key in adapters:
                p.copy_(torch.tensor(np.array(adapters[key]), dtype=p.dtype))
                seen.add(key)
            if train_head and key.startswith("score."):
                p.requires_grad_(True)
    missing = set(adapters) - seen
    if missing or not seen:
        raise ValueError(f"peft model has no parameter for adapters {sorted(missing)[:4]} (of {len(adapters)})")
    return model


class AdaptersOff:
    """A peft model called with its adapters disabled: the base model, which is the reference policy under LoRA."""

    def __init__(self, model):
        self.model = model

    def __call__(self, **kwargs):
        with self.model.disable_adapter():
            return self.model(**kwargs)


def trainable_state(model, name=lambda n: n) -> dict[str, torch.Tensor]:
    """float32 (float64 model: float64) copies of the parameters that require gradients, keyed by
    `name(parameter name)`."""
    return {name(n): wide(p.detach()).clone() for n, p in model.named_parameters() if p.requires_grad}


# ---------------------------------------------------------------- one PPO step in plain torch
#
# The same formulas as jaxppo.ppo / jaxppo.engine, written out directly over a transformers model so
# the two can be compared number by number (python -m jaxppo.compare ppo-step). A batch is a dict of
# torch tensors in jaxppo's layout: input_ids / attention_mask (1 = token) / positions [b, p + r],
# response_mask and per-token arrays [b, r]; response token j is predicted at position p + j - 1.


def masked_mean(x: torch.Tensor, mask: torch.Tensor, dim=None) -> torch.Tensor:
    if dim is None:
        return (x * mask).sum() / mask.sum().clamp(min=1)
    return (x * mask).sum(dim) / mask.sum(dim).clamp(min=1)


def masked_whiten(x: torch.Tensor, mask: torch.Tensor, eps: float = 1e-8) -> torch.Tensor:
    mean = masked_mean(x, mask)
    n = mask.sum()
    var = masked_mean((x - mean) ** 2, mask) * n / (n - 1).clamp(min=1)
    return (x - mean) * torch.rsqrt(var + eps) * mask


def agg_loss(loss_mat: torch.Tensor, mask: torch.Tensor, mode: str, num_tokens: torch.Tensor,
             num_seqs: torch.Tensor, horizon: int) -> torch.Tensor:
    """verl's four aggregation modes, normalised by the mini-batch's token / sequence counts."""
    token_sum = (loss_mat * mask).sum(-1)
    if mode == "token-mean":
        return token_sum.sum() / num_tokens
    if mode == "seq-mean-token-sum":
        return token_sum.sum() / num_seqs
    if mode == "seq-mean-token-mean":
        return (token_sum / mask.sum(-1).clamp(min=1)).sum() / num_seqs
    if mode == "seq-mean-token-sum-norm":
        return token_sum.sum() / (num_seqs * horizon)
    raise ValueError(mode)


def kl_estimate(logprob: torch.Tensor, ref_logprob: torch.Tensor, kind: str) -> torch.Tensor:
    if kind in ("k1", "kl"):
        return logprob - ref_logprob
    if kind == "abs":
        return (logprob - ref_logprob).abs()
    if kind in ("k2", "mse"):
        return 0.5 * (logprob - ref_logprob) ** 2
    if kind in ("k3", "low_var_kl"):
        kl = (ref_logprob - logprob).clamp(-20, 20)
        return (kl.exp() - kl - 1).clamp(-10, 10)
    raise ValueError(kind)


def _forward(model, batch: dict, response_length: int, autocast: torch.dtype | None, lm: bool = True):
    """Outputs at the r positions that predict / value the response tokens (p - 1 .. p + r - 2)."""
    device = batch["input_ids"].device
    extra = {"logits_to_keep": response_length + 1} if lm else {}  # only the head rows the loss reads
    with torch.autocast(device.type, dtype=autocast, enabled=autocast is not None):
        out = model(input_ids=batch["input_ids"], attention_mask=(batch["attention_mask"] > 0).long(),
                    position_ids=batch["positions"], **extra).logits
    return out[:, -response_length - 1:-1]


def response_logprobs(model, batch: dict, response_length: int, temperature: float = 1.0,
                      autocast: torch.dtype | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Log-probs and entropies of the response tokens under softmax(logits / temperature), float32."""
    r = response_length
    logits = wide(_forward(model, batch, r, autocast)) / temperature
    logp = torch.log_softmax(logits, -1)
    lp = logp.gather(-1, batch["input_ids"][:, -r:, None])[..., 0]
    entropy = -(logp.exp() * logp).sum(-1)
    return lp, entropy


def response_values(critic, batch: dict, response_length: int, autocast: torch.dtype | None = None) -> torch.Tensor:
    return wide(_forward(critic, batch, response_length, autocast, lm=False)[..., 0])


def gae(rewards: torch.Tensor, values: torch.Tensor, mask: torch.Tensor, gamma: float, lam: float):
    """Token-level GAE (masked positions pass the running value through), whitened advantages, returns."""
    b, t = rewards.shape
    adv = torch.zeros_like(rewards)
    next_value = torch.zeros(b, dtype=rewards.dtype, device=rewards.device)
    last_gae = torch.zeros_like(next_value)
    for j in reversed(range(t)):
        valid = mask[:, j] > 0
        delta = rewards[:, j] + gamma * next_value - values[:, j]
        g = delta + gamma * lam * last_gae
        next_value = torch.where(valid, values[:, j], next_value)
        last_gae = torch.where(valid, g, last_gae)
        adv[:, j] = last_gae
    returns = (adv + values) * mask
    return masked_whiten(adv, mask), returns


def _micro_batches(batch: dict, n_micro: int) -> list[dict]:
    """Strided split (sequence i goes to micro-batch i % n_micro), as jaxppo's split_micro does."""
    return [{k: v[i::n_micro] for k, v in batch.items()} for i in range(n_micro)]


def full_kl(model, ref_model, batch: dict, response_length: int, temperature: float = 1.0,
            autocast: torch.dtype | None = None) -> torch.Tensor:
    """Exact KL(policy || reference) over the vocabulary at each response position, both at the temperature."""
    r = response_length
    logp = torch.log_softmax(wide(_forward(model, batch, r, autocast)) / temperature, -1)
    with torch.no_grad():
        logq = torch.log_softmax(wide(_forward(ref_model, batch, r, autocast)) / temperature, -1)
    return (logp.exp() * (logp - logq)).sum(-1)


def actor_update(model, optimizer, minibatch: dict, cfg, response_length: int, lr: float, n_micro: int = 1,
                 temperature: float = 1.0, autocast: torch.dtype | None = None, ref_model=None,
                 grads: dict | None = None) -> dict[str, float]:
    """One optimizer step of the PPO actor on a mini-batch (micro-batch gradients accumulated): the
    dual-clip surrogate, entropy bonus, optional KL-to-reference loss (per-token estimator of the reference
    log-probs, or `kl_loss_type=full`: the exact KL against `ref_model`); global-norm clipping; AdamW.
    `grads`: filled with each parameter's gradient before clipping (float64 copies)."""
    c = cfg  # jaxppo.config.ActorConfig
    mask = minibatch["response_mask"]
    num_tokens, num_seqs = mask.sum().clamp(min=1), (mask.sum(-1) > 0).sum().clamp(min=1)
    optimizer.zero_grad(set_to_none=True)
    totals = {k: torch.zeros((), dtype=mask.dtype, device=mask.device)
              for k in ("pg_loss", "pg_clipfrac", "ppo_kl", "entropy", "kl_loss")}
    for mb in _micro_batches(minibatch, n_micro):
        m = mb["response_mask"]
        norm = dict(num_tokens=num_tokens, num_seqs=num_seqs, horizon=response_length)
        logprob, entropy = response_logprobs(model, mb, response_length, temperature, autocast)
        adv = mb["advantages"]
        log_ratio = (logprob - mb["old_logprobs"]).clamp(-20, 20)
        ratio = log_ratio.exp()
        l1 = -adv * ratio
        l2 = -adv * ratio.clamp(1 - c.clip_ratio_low, 1 + c.clip_ratio_high)
        clipped1 = torch.maximum(l1, l2)
        pg_losses = torch.where(adv < 0, torch.minimum(-adv * c.clip_ratio_c, clipped1), clipped1)
        pg_loss = agg_loss(pg_losses, m, c.loss_agg_mode, **norm)
        if c.entropy_coeff == 0:
            entropy = entropy.detach()
        loss = pg_loss - c.entropy_coeff * agg_loss(entropy, m, c.loss_agg_mode, **norm)
        if c.use_kl_loss:
            kl = (full_kl(model, ref_model, mb, response_length, temperature, autocast) if c.kl_loss_type == "full"
                  else kl_estimate(logprob, mb["ref_logprobs"], c.kl_loss_type))
            kl_loss = agg_loss(kl, m, c.loss_agg_mode, **norm)
            loss = loss + c.kl_loss_coef * kl_loss
            totals["kl_loss"] += kl_loss.detach()
        loss.backward()
        totals["pg_loss"] += pg_loss.detach()
        totals["pg_clipfrac"] += ((l2 > l1).to(m.dtype) * m).sum().detach() / num_tokens
        totals["ppo_kl"] += (-log_ratio * m).sum().detach() / num_tokens
        totals["entropy"] += (entropy.detach() * m).sum() / num_tokens
    _keep_grads(model, grads)
    grad_norm = _clip_and_step(model, optimizer, c.optim.grad_clip, lr)
    return {k: v.item() for k, v in totals.items()} | {"grad_norm": grad_norm.item()}


def _keep_grads(model, grads: dict | None) -> None:
    if grads is not None:
        grads.update({n: p.grad.detach().double().cpu().clone() for n, p in model.named_parameters()
                      if p.grad is not None})


def critic_update(critic, optimizer, minibatch: dict, cfg, response_length: int, lr: float, n_micro: int = 1,
                  autocast: torch.dtype | None = None, grads: dict | None = None) -> dict[str, float]:
    """One optimizer step of the clipped value loss 0.5 * agg(max((v - R)^2, (clip(v, v_old +- c) - R)^2))."""
    mask = minibatch["response_mask"]
    num_tokens, num_seqs = mask.sum().clamp(min=1), (mask.sum(-1) > 0).sum().clamp(min=1)
    optimizer.zero_grad(set_to_none=True)
    totals = {k: torch.zeros((), dtype=mask.dtype, device=mask.device) for k in ("vf_loss", "vf_clipfrac")}
    for mb in _micro_batches(minibatch, n_micro):
        m = mb["response_mask"]
        v = response_values(critic, mb, response_length, autocast)
        clipped = torch.clamp(v, mb["values"] - cfg.cliprange_value, mb["values"] + cfg.cliprange_value)
        l1, l2 = (v - mb["returns"]) ** 2, (clipped - mb["returns"]) ** 2
        loss = 0.5 * agg_loss(torch.maximum(l1, l2), m, cfg.loss_agg_mode, num_tokens, num_seqs, response_length)
        loss.backward()
        totals["vf_loss"] += loss.detach()
        totals["vf_clipfrac"] += ((l2 > l1).to(m.dtype) * m).sum().detach() / num_tokens
    _keep_grads(critic, grads)
    grad_norm = _clip_and_step(critic, optimizer, cfg.optim.grad_clip, lr)
    return {k: v.item() for k, v in totals.items()} | {"grad_norm": grad_norm.item()}


def make_adamw(model, optim_cfg, fused: bool = False) -> torch.optim.AdamW:
    """AdamW with jaxppo's settings (decoupled weight decay on every parameter, like optax.adamw)."""
    return torch.optim.AdamW(model.parameters(), lr=optim_cfg.lr, betas=tuple(optim_cfg.betas), eps=optim_cfg.eps,
                             weight_decay=optim_cfg.weight_decay, fused=fused)


def _clip_and_step(model, optimizer, grad_clip: float, lr: float) -> torch.Tensor:
    params = [p for p in model.parameters() if p.grad is not None]
    grad_norm = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(wide(p.grad)) for p in params]))
    scale = torch.clamp(grad_clip / grad_norm, max=1.0)  # optax.clip_by_global_norm: no epsilon
    for p in params:
        p.grad.mul_(scale.to(p.grad.dtype))
    for group in optimizer.param_groups:
        group["lr"] = lr
    optimizer.step()
    return grad_norm
