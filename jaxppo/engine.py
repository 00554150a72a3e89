"""Jitted, sharded steps: response log-probs / values, and actor / critic updates.

A batch is a dict of arrays with a leading batch axis, sharded over (data, fsdp):
  input_ids, attention_mask, positions   [b, p + r]  prompt (left-padded) + response (right-padded);
                                          attention_mask holds segment ids (0 = padding)
  response_mask                          [b, r]      1 on generated tokens
  old_logprobs, advantages, ref_logprobs, is_weights, values, returns   [b, r]  as each step needs
Log-prob and value of response token j are read at position p + j - 1 (the state before the token).

One update = one mini-batch: micro-batches are accumulated inside a `lax.scan` of one compiled program, or by the
host, one program per micro-batch (`model.micro_batch_loop`, jaxppo/accumulate.py), every micro-batch loss
normalised by the mini-batch's token / sequence counts so their sum is the mini-batch loss for every
`loss_agg_mode`; then global-norm clipping and AdamW.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Callable

import flax.linen as nn
import flax.struct
import jax
import jax.numpy as jnp
import optax
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
from jaxtyping import Array, Float, Int

from jaxppo import offload, ppo
from jaxppo.config import ActorConfig, CriticConfig, OptimConfig
from jaxppo.accumulate import HostLoop, _without, minibatch_gradients, optimizer_step
from jaxppo.device_batches import DeviceBatches, merge_micro, split_micro
from jaxppo.errors import ConfigError
from jaxppo.models.lora import LoraSpec
from jaxppo.models.transformer import head_logits, head_weight
from jaxppo.ppo.bypass import bypass_policy_loss
from jaxppo.ppo.policy_losses import compute_policy_loss
from jaxppo.programs import Memory, Program
from jaxppo.sharding import activation_rules, parallel_mode

Batch = dict[str, jax.Array]


@flax.struct.dataclass
class TrainState:
    params: Any
    opt_state: Any
    step: jax.Array  # optimizer steps taken


def lr_schedule(cfg: OptimConfig, total_steps: int) -> optax.Schedule:
    """Linear warmup from 0 to lr over lr_warmup_steps, then constant or cosine down to min_lr_ratio * lr."""
    warm = max(cfg.lr_warmup_steps, 0)
    if cfg.lr_schedule == "constant":
        after = optax.constant_schedule(cfg.lr)
    elif cfg.lr_schedule == "cosine":
        after = optax.cosine_decay_schedule(cfg.lr, max(total_steps - warm, 1), alpha=cfg.min_lr_ratio)
    else:
        raise ValueError(f"lr_schedule {cfg.lr_schedule!r} unknown; known: ['constant', 'cosine']")
    if warm == 0:
        return after
    return optax.join_schedules([optax.linear_schedule(0.0, cfg.lr, warm), after], [warm])


def optimizer_parts(cfg: OptimConfig, total_steps: int
                    ) -> tuple[tuple[optax.GradientTransformation, optax.GradientTransformation], optax.Schedule]:
    """(clip by the global norm, AdamW) and the learning-rate schedule: the optimizer is their chain."""
    schedule = lr_schedule(cfg, total_steps)
    return (optax.clip_by_global_norm(cfg.grad_clip),
            optax.adamw(schedule, b1=cfg.betas[0], b2=cfg.betas[1], eps=cfg.eps, weight_decay=cfg.weight_decay)), schedule


def make_optimizer(cfg: OptimConfig, total_steps: int) -> tuple[optax.GradientTransformation, optax.Schedule]:
    parts, schedule = optimizer_parts(cfg, total_steps)
    return optax.chain(*parts), schedule


def _chunks(x: jax.Array, size: int) -> jax.Array:
    """[b, r, ...] -> [n, b, c, ...] in n = ceil(r / size) equal chunks of c = ceil(r / n) <= size, zero-padded at
    the end (by fewer than n: a size above r is one chunk of r, not a chunk of `size` mostly padding)."""
    b, r = x.shape[:2]
    n = -(-r // size)
    size = -(-r // n)
    x = jnp.pad(x, [(0, 0), (0, n * size - r)] + [(0, 0)] * (x.ndim - 2))
    return jnp.moveaxis(x.reshape((b, n, size) + x.shape[2:]), 1, 0)


def response_head(module: nn.Module, params: Any, batch: Batch, response_length: int, chunk_size: int,
                  with_entropy: bool = True, temperature: float = 1.0, remat: bool = True,
                  truncation: tuple[int, float] | None = None, ref_params: Any = None,
                  ref_module: nn.Module | None = None) -> dict[str, jax.Array]:
    """Per response token, [b, r] float32 (packed: [rows, slots]), under softmax(logits / temperature) over
    the full vocabulary (the policy being trained; the rollout engine samples from it):
      logprobs      log-prob of the token;
      entropy       the distribution's entropy (zeros unless `with_entropy`);
      sampling_logprobs  (with `truncation=(top_k, top_p)`) the token's log-prob under the distribution the
                    engines sample from: top-k, then top-p of the renormalised rest, renormalised (vLLM's
                    `processed_logprobs`, transformers' warpers; the sampled token is always in it);
      kl_full       (with `ref_params`) the exact KL(policy || reference) over the vocabulary, the reference
                    (`ref_module`, else `module`) run on the same batch with no gradient.
    The vocabulary projection runs over chunks of `chunk_size` response tokens (under remat unless
    `remat=False`, which keeps each chunk's logits for the backward pass), so no [b, r, vocab] float32 tensor
    exists beyond one chunk."""
    r = response_length
    ref_module = ref_module or module
    run = lambda m, p: m.apply({"params": p}, batch["input_ids"], batch["positions"],  # noqa: E731
                               batch["attention_mask"], batch.get("segment_starts"))
    hidden = run(module, params)
    ref_hidden = None if ref_params is None else jax.lax.stop_gradient(run(ref_module, ref_params))
    if "gather_idx" in batch:  # packed rows (jaxppo/packing.py): the states before each response-token slot
        r = batch["gather_idx"].shape[-1]
        pick = lambda h: _chunks(_gather_packed(h, batch["gather_idx"]), chunk_size)  # noqa: E731
        targets = _chunks(batch["targets"], chunk_size)
    else:
        pick = lambda h: _chunks(h[:, -r - 1:-1], chunk_size)  # noqa: E731
        targets = _chunks(batch["input_ids"][:, -r:], chunk_size)
    xs = (pick(hidden), targets) + (() if ref_hidden is None else (pick(ref_hidden),))
    # the head's weights cast to the compute dtype once here, not once per chunk inside the loop (`head_logits`)
    weights = lambda m, p: (jax.lax.stop_gradient(head_weight(m.cfg, p).astype(m.dtype)),  # noqa: E731
                            head_weight(m.cfg, p))
    head_w = weights(module, params)
    ref_w = None if ref_params is None else jax.tree.map(jax.lax.stop_gradient, weights(ref_module, ref_params))

    def scaled_logits(w, h_c):
        logits = head_logits(h_c.astype(w[0].dtype), *w)
        logits = logits.astype(jnp.promote_types(logits.dtype, jnp.float32))  # float64 in a float64 model
        return logits / temperature if temperature != 1.0 else logits

    def one(h_c, t_c, *ref_c):
        logits = scaled_logits(head_w, h_c)
        lse = jax.nn.logsumexp(logits, axis=-1)
        out = {"logprobs": jnp.take_along_axis(logits, t_c[..., None], axis=-1)[..., 0] - lse}
        out["entropy"] = (lse - jnp.sum(jax.nn.softmax(logits, axis=-1) * logits, axis=-1) if with_entropy
                          else jnp.zeros_like(out["logprobs"]))
        if truncation is not None:
            out["sampling_logprobs"] = jax.lax.stop_gradient(truncated_logprobs(logits, t_c, *truncation))
        if ref_c:
            lp_all = logits - lse[..., None]
            ref_all = jax.nn.log_softmax(jax.lax.stop_gradient(scaled_logits(ref_w, ref_c[0])), -1)
            out["kl_full"] = jnp.sum(jnp.exp(lp_all) * (lp_all - ref_all), axis=-1)
        return out

    head = jax.checkpoint(one) if remat else one
    out = jax.lax.map(lambda x: head(*x), xs)
    unchunk = lambda x: jnp.moveaxis(x, 0, 1).reshape(x.shape[1], -1)[:, :r]  # noqa: E731
    return {k: unchunk(v) for k, v in out.items()}


def response_logprobs(module: nn.Module, params: Any, batch: Batch, response_length: int, chunk_size: int,
                      with_entropy: bool = True, temperature: float = 1.0, remat: bool = True) -> tuple[jax.Array, jax.Array]:
    """(log-probs, entropies) of the response tokens, [b, r] float32: see `response_head`."""
    out = response_head(module, params, batch, response_length, chunk_size, with_entropy, temperature, remat)
    return out["logprobs"], out["entropy"]


def truncated_logprobs(logits: Float[Array, "... v"], targets: Int[Array, "..."], top_k: int = -1,
                       top_p: float = 1.0) -> jax.Array:
    """log-prob of `targets` under softmax(logits) restricted to the top-k tokens, then to the top-p nucleus of
    the renormalised rest, renormalised: the rule of vLLM's sampler and transformers' TopK / TopP warpers
    (sort ascending; drop while the cumulative probability is <= 1 - top_p; the most likely token always
    stays). The target is always kept: it was sampled, so it was in the sampler's support."""
    v = logits.shape[-1]
    is_target = jnp.arange(v) == targets[..., None]
    z = logits
    if 0 < top_k < v:
        kth = jax.lax.top_k(z, top_k)[0][..., -1:]
        z = jnp.where((z >= kth) | is_target, z, -jnp.inf)
    if top_p < 1.0:
        zs = jnp.sort(z, axis=-1)
        cum = jnp.cumsum(jax.nn.softmax(zs, axis=-1), axis=-1)
        drop = (cum <= 1.0 - top_p).at[..., -1].set(False)
        threshold = jnp.min(jnp.where(drop, jnp.inf, zs), axis=-1, keepdims=True)
        z = jnp.where((z >= threshold) | is_target, z, -jnp.inf)
    return jnp.take_along_axis(z, targets[..., None], axis=-1)[..., 0] - jax.nn.logsumexp(z, axis=-1)


def _gather_packed(x: jax.Array, gather_idx: jax.Array) -> jax.Array:
    """[rows, budget, ...] row states, [rows, slots] in-row positions -> [rows, slots, ...]: each row's
    gather stays on the device that holds the row."""
    idx = gather_idx.reshape(gather_idx.shape + (1,) * (x.ndim - 2))
    return jnp.take_along_axis(x, idx, axis=1)


def response_values(module: nn.Module, params: Any, batch: Batch, response_length: int) -> jax.Array:
    """Critic values at the states before each response token, [b, r] float32."""
    values = module.apply({"params": params}, batch["input_ids"], batch["positions"], batch["attention_mask"],
                          batch.get("segment_starts"))
    if "gather_idx" in batch:
        return _gather_packed(values, batch["gather_idx"])
    return values[:, -response_length - 1:-1]


@dataclasses.dataclass
class _Base(DeviceBatches):
    """What the actor and critic engines share: mesh, jit plumbing, train state, micro-batch scans."""

    module: nn.Module
    mesh: Mesh
    response_length: int
    optim: OptimConfig
    total_steps: int
    micro_batch_per_device: int
    forward_micro_batch_per_device: int
    fsdp_gather: str = "layer"  # "layer": fsdp-sharded parameters gathered per layer when used (ZeRO-3);
    # "update": gathered once per update / forward pass in the compute dtype (ZeRO-2 memory, fewer collectives)
    grad_reduce_dtype: str = "float32"  # dtype of the cross-device gradient reduction (bfloat16: half the bytes)
    # LoRA: which parameter paths are trained; the rest (the base weights) stay frozen in `self.frozen`, outside
    # the train state (no gradients, no optimizer state) and passed to every program as an argument
    trainable: Callable[[tuple[str, ...]], bool] | None = None

    def __post_init__(self):
        # {metric: ("max"|"min", bound)}: a mini-batch breaking one is not applied (jaxppo/health.py);
        # NaN/inf in the loss or the gradient never is
        self.guards: dict[str, tuple[str, float]] = {}
        self.compiled_shapes: set[tuple[int, ...]] = set()  # packed (micro-batches, slots, row length) shapes seen
        self._packed_shapes: dict[str, set] = {}  # shape keys packed so far, per budget (what), reused by `pack`
        self._shape_caps: dict[str, Any] = {}  # per budget: the most a row holds (the plan's shape, `hold_to_plan`)
        # the chain's parts: the offloaded step runs them itself, one parameter at a time (jaxppo/offload.py)
        self.tx_parts, self.schedule = optimizer_parts(self.optim, self.total_steps)
        self.tx = optax.chain(*self.tx_parts)
        self.batch_shards, self.gather_once, self.local_accumulation = parallel_mode(
            self.mesh.shape, self.fsdp_gather, self.grad_reduce_dtype)
        self._param_specs = None  # PartitionSpecs of the parameter tree (from the first params seen)
        # AdamW's moments in host memory between updates (jaxppo/offload.py); set before the state is made
        self.optimizer_offload = False
        self.micro_batch_loop = "scan"  # model.micro_batch_loop: the update's micro-batches in a scan or from the host
        self.opt_shardings: Any = None  # the optimizer state's shardings (memory kinds included), for the update
        self._update_jit: Program | HostLoop | None = None
        self._forward_jit: Program | None = None
        self.frozen = None  # LoRA: the base weights (compute dtype), set by init_state
        if self.trainable is not None and self.gather_once:
            raise ConfigError("LoRA (lora_rank > 0) keeps the base weights outside the train state: use "
                              "mesh.fsdp_gather=layer")

    def _ctx(self):
        """Mesh + logical rules for the activation constraints inside the model (needed at trace time)."""
        return _Ctx(self.mesh)

    def init_state(self, params: Any) -> TrainState:
        """Optimizer state created in the parameters' shardings (Adam's moments sharded like their
        parameters: left to the partitioner, zeros that depend on no input come out replicated). With LoRA the
        state holds the trainable parameters only; the base weights become `self.frozen`."""
        if self.trainable is not None:
            from jaxppo.models.lora import split

            params, self.frozen = split(params, self.trainable)
        shardings = self._opt_state_shardings(params)
        with self._ctx():
            opt_state = jax.jit(self.tx.init, out_shardings=shardings)(params)
        step = jax.device_put(jnp.zeros((), jnp.int32), NamedSharding(self.mesh, P()))  # on the mesh, like outputs
        return TrainState(params, opt_state, step)

    def _remember_specs(self, params: Any) -> None:
        if self._param_specs is None:
            spec = lambda x: x.sharding.spec if isinstance(x.sharding, NamedSharding) else P()  # one device: whole
            self._param_specs = jax.tree.map(spec, params)

    def _compute_copy(self, params: Any) -> Any:
        """Parameters in the module's compute dtype, still sharded: what gather-once mode gathers (every
        use casts to that dtype anyway, so the values the model sees are unchanged)."""
        return jax.tree.map(lambda p: p.astype(self.module.dtype), params)

    def _gathered(self, params: Any) -> Any:
        """Forward passes in gather-once mode: one all-gather of the compute-dtype parameters before the
        micro-batch loop instead of one per layer per micro-batch."""
        if not self.gather_once:
            return params
        whole = lambda p, s: jax.lax.with_sharding_constraint(p, NamedSharding(self.mesh, _without(s, "fsdp")))
        return jax.tree.map(whole, self._compute_copy(params), self._param_specs)

    def _forward_map(self, fn: Callable, params: Any, batch: Batch) -> Any:
        """`fn(params, micro_batch)` over forward micro-batches with lax.map; outputs re-merged [b, ...]
        (packed: left per micro-batch, [n_micro, rows, slots], for `Packed.unpack`)."""
        params = self._gathered(params)
        out = jax.lax.map(lambda mb: fn(params, mb), self._micro_batches(batch, self.forward_micro_batch_per_device))
        return out if "gather_idx" in batch else jax.tree.map(merge_micro, out)

    def programs(self) -> list[Program]:
        """This engine's programs made so far: its forward and update (and the actor's LoRA reference)."""
        update = self._update_jit.programs() if isinstance(self._update_jit, HostLoop) else [self._update_jit]
        return [p for p in [self._forward_jit, *update] if p is not None]

    def compiles(self) -> int:
        """Programs compiled so far by this engine, ahead of time for the memory plan or at a call with a new
        signature (the `perf/compiles` metric)."""
        return sum(p.compiles() for p in self.programs())

    def _extra(self, ref: Any = None) -> dict:
        """What every loss reads besides the trainable parameters and the batch: the frozen base weights
        (LoRA) and the reference policy (the exact-KL loss)."""
        return {"frozen": self.frozen, "ref": ref}

    def full(self, params: Any, frozen: Any) -> Any:
        """The whole parameter tree the module applies: trainable + frozen (LoRA), or `params` itself."""
        if frozen is None:
            return params
        from jaxppo.models.lora import merge

        return merge(params, frozen)

    def gradients(self, params: Any, minibatch: Batch, ref: Any = None) -> Any:
        """The gradient `update` would apply to `params` for this mini-batch, before clipping (for
        cross-framework comparison; not on the training path)."""
        self._remember_specs(params)
        fn = jax.jit(lambda p, b, e: minibatch_gradients(self, self._loss, p, b, e)[0])
        with self._ctx():
            return fn(params, minibatch, self._extra(ref if getattr(self, "full_kl", False) else None))

    def update(self, state: TrainState, minibatch: Batch, ref: Any = None) -> tuple[TrainState, dict]:
        """One optimizer step on a mini-batch (the state's buffers are donated)."""
        program = self.update_program(state)
        with self._ctx():
            return program(state, minibatch, self._extra(ref))

    def update_program(self, state: TrainState) -> Program | HostLoop:
        """The mini-batch update's program, or the host loop's programs called as one (built from `state`'s
        shardings, abstract or concrete, on first use)."""
        if self._update_jit is None:
            self._update_jit = self._jit_step(self._loss, state, f"{self.role} update")
        return self._update_jit

    def compile_update(self, state: TrainState, minibatch: Batch, frozen: Any = None, ref: Any = None,
                       probe: bool = False) -> Memory:
        """Compile the update for these (abstract) arguments and return XLA's memory for it; the executable is
        kept for the run (`probe`: not kept, `Program.probe`)."""
        return self._compile(self.update_program(state), probe, state, minibatch, {"frozen": frozen, "ref": ref})

    def _compile(self, program: Program, probe: bool, *args: Any) -> Memory:
        """XLA's memory for `program` compiled for these (abstract) arguments in this engine's mesh context; the
        executable kept for the run (`Program.memory`) unless `probe` (`Program.probe`)."""
        with self._ctx():
            return (program.probe if probe else program.memory)(*args)

    def _jit_step(self, loss_fn: Callable, state: TrainState, name: str) -> Program | HostLoop:
        # the new state keeps exactly the input state's shardings: otherwise jit normalises them (P() vs
        # P(None, None)) and the second call, seeing "different" input shardings, compiles again
        shardings = jax.tree.map(lambda x: x.sharding, state)
        self.opt_shardings = shardings.opt_state
        self._remember_specs(state.params)
        if self.micro_batch_loop == "host":
            return HostLoop(self, loss_fn, shardings, name)
        return Program(lambda s, b, e: optimizer_step(self, loss_fn, s, b, e), name=name, donate_argnums=(0,),
                       out_shardings=(shardings, None))

    def abstract_state(self, params: Any) -> tuple[TrainState, Any]:
        """(train state, frozen base) as ShapeDtypeStructs in the shardings `init_state` creates, from abstract
        parameters with their shardings: what the memory plan compiles against before anything is allocated."""
        frozen = None
        if self.trainable is not None:
            from jaxppo.models.lora import split

            params, frozen = split(params, self.trainable)
        whole = NamedSharding(self.mesh, P())
        abstract_opt = jax.eval_shape(self.tx.init, params)
        shardings = self._opt_state_shardings(params, abstract_opt)
        opt = jax.tree.map(lambda x, sh: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sh), abstract_opt, shardings)
        return TrainState(params, opt, jax.ShapeDtypeStruct((), jnp.int32, sharding=whole)), frozen

    def _opt_state_shardings(self, params: Any, abstract_opt: Any = None) -> Any:
        """The optimizer state's shardings: Adam's moments like their parameters (in pinned host memory with
        `optimizer_offload`), its scalars whole on the mesh. `abstract_opt`: the state's shapes, if known."""
        whole = NamedSharding(self.mesh, P())
        abstract_opt = jax.eval_shape(self.tx.init, params) if abstract_opt is None else abstract_opt
        shardings = optax.tree_map_params(self.tx, lambda _, p: p.sharding, abstract_opt, params,
                                          transform_non_params=lambda _: whole)
        if self.optimizer_offload:
            param_like = optax.tree_map_params(self.tx, lambda _, p: True, abstract_opt, params,
                                               transform_non_params=lambda _: False)
            shardings = offload.to_host(shardings, param_like)
        return shardings


class _Ctx:
    def __init__(self, mesh: Mesh):
        self.mesh = mesh

    def __enter__(self):
        self._rules = nn.logical_axis_rules(activation_rules(self.mesh))
        self._mesh = jax.set_mesh(self.mesh)
        self._rules.__enter__()
        self._mesh.__enter__()

    def __exit__(self, *exc):
        self._mesh.__exit__(*exc)
        self._rules.__exit__(*exc)


class ActorEngine(_Base):
    """The policy: response log-probs (old / ref / current) and the PPO actor update."""

    role = "actor"

    def __init__(self, module: nn.Module, mesh: Mesh, cfg: ActorConfig, response_length: int, total_steps: int = 1,
                 temperature: float = 1.0, fsdp_gather: str = "layer", grad_reduce_dtype: str = "float32",
                 trainable: Callable | None = None):
        self.cfg = cfg
        self.temperature = temperature if temperature > 0 else 1.0  # greedy rollouts: plain log-probs
        self.bypass = None  # algorithm.rollout_correction in verl's bypass mode: the loss of jaxppo/ppo/bypass.py
        self.old_from_update = False  # the old log-probs are this update's own, detached (jaxppo/step.py)
        super().__init__(module, mesh, response_length, cfg.optim, total_steps, cfg.ppo_micro_batch_size_per_device,
                         cfg.log_prob_micro_batch_size_per_device, fsdp_gather, grad_reduce_dtype, trainable)
        self._base_jit: Program | None = None  # LoRA: the reference's log-probs from the base module alone

    def _head(self, params, batch, with_entropy=True, truncation=None, ref_params=None, module=None, ref_module=None):
        return response_head(module or self.module, params, batch, self.response_length, self.cfg.logprob_chunk_size,
                             with_entropy, self.temperature, self.cfg.logprob_remat, truncation, ref_params, ref_module)

    @functools.cached_property
    def base_module(self) -> nn.Module:
        """The module without adapters: LoRA's reference, run on the frozen weights alone."""
        return self.module.clone(lora=LoraSpec())

    def logprobs(self, params: Any, batch: Batch, with_entropy: bool = False,
                 truncation: tuple[int, float] | None = None) -> tuple[jax.Array, ...]:
        """(log-probs, entropies (zeros unless asked)) of the response tokens, [b, r]; with
        `truncation=(top_k, top_p)` a third array: the log-probs under the distribution the rollout engine
        samples from (`response_head`). For a packed batch (`shard_packed`), [n_micro, slots, r]
        (`Packed.unpack` restores the order)."""
        with self._ctx():
            return self.forward_program(params)(params, self.frozen, batch, with_entropy, truncation)

    def forward_program(self, params: Any) -> Program:
        self._remember_specs(params)
        if self._forward_jit is None:
            def fwd(p, f, b, e, trunc):
                out = self._forward_map(lambda pp, mb: self._head(self.full(pp, f), mb, e, trunc), p, b)
                return (out["logprobs"], out["entropy"]) + ((out["sampling_logprobs"],) if trunc else ())

            self._forward_jit = Program(fwd, name="actor log-probs", static_argnums=(3, 4))
        return self._forward_jit

    def compile_logprobs(self, params: Any, frozen: Any, batch: Batch, with_entropy: bool = False,
                         truncation: tuple[int, float] | None = None, probe: bool = False) -> Memory:
        """Compile `logprobs` for these (abstract) arguments; XLA's memory for it (the executable is kept unless
        `probe`)."""
        return self._compile(self.forward_program(params), probe, params, frozen, batch, with_entropy, truncation)

    def ref_logprobs(self, ref_params: Any, batch: Batch) -> jax.Array:
        """The reference policy's response log-probs, as `logprobs(ref_params, batch)[0]`. Under LoRA the reference
        is the base (`ref_params` unread: the run passes {}), so it runs the module without adapters on the frozen
        weights alone: the log-probs of the adapters zeroed, without every projection's two rank-r matmuls and add
        on zeros."""
        if self.frozen is None:
            return self.logprobs(ref_params, batch)[0]
        with self._ctx():
            return self.base_program()(ref_params, self.frozen, batch)

    def base_program(self) -> Program:
        """The base module's log-probs (LoRA's reference): `fn(adapters, frozen, batch)`, the adapters unread (the
        run passes {}; XLA drops any)."""
        if self._base_jit is None:
            self._base_jit = Program(lambda p, f, b: self._forward_map(
                lambda _, mb: self._head(f, mb, with_entropy=False, module=self.base_module)["logprobs"], p, b),
                name="reference log-probs (the base)")
        return self._base_jit

    def compile_ref_logprobs(self, ref_params: Any, frozen: Any, batch: Batch, probe: bool = False) -> Memory:
        """Compile `ref_logprobs` for these (abstract) arguments, as `compile_logprobs` does."""
        if frozen is None:
            return self.compile_logprobs(ref_params, None, batch, probe=probe)
        return self._compile(self.base_program(), probe, ref_params, frozen, batch)

    def programs(self) -> list[Program]:
        return super().programs() + ([self._base_jit] if self._base_jit is not None else [])

    def update(self, state: TrainState, minibatch: Batch, ref_params: Any = None) -> tuple[TrainState, dict]:
        """One optimizer step on a mini-batch; `ref_params`: the reference policy (the exact-KL loss,
        `actor.kl_loss_type=full`, runs it on the mini-batch)."""
        if self.cfg.use_kl_loss and self.cfg.kl_loss_type == "full" and ref_params is None:
            raise ValueError("actor.kl_loss_type=full needs the reference parameters in the update")
        return super().update(state, minibatch, ref_params if self.full_kl else None)

    def gradients(self, params: Any, minibatch: Batch, ref_params: Any = None) -> Any:
        return super().gradients(params, minibatch, ref_params)

    @property
    def full_kl(self) -> bool:
        return self.cfg.use_kl_loss and self.cfg.kl_loss_type == "full"

    def _loss(self, params, mb, num_tokens, num_seqs, extra=None):
        c = self.cfg
        mask = mb["response_mask"]
        norm = dict(num_tokens=num_tokens, num_seqs=num_seqs, horizon=c.loss_scale_factor or self.response_length,
                    token_weight=mb.get("token_weight"))
        frozen, ref = (extra or {}).get("frozen"), (extra or {}).get("ref")
        ref_full, ref_module = None, None
        if self.full_kl and ref is not None:  # LoRA: the reference is the base module on the frozen weights
            ref_full, ref_module = (frozen, self.base_module) if frozen is not None else (ref, None)
        out = self._head(self.full(params, frozen), mb, ref_params=ref_full, ref_module=ref_module)
        logprob, entropy = out["logprobs"], out["entropy"]
        old = jax.lax.stop_gradient(logprob) if self.old_from_update else mb["old_logprobs"]
        if self.bypass is not None:  # old_logprobs are the rollout's; the correction is computed here
            pg_loss, metrics = bypass_policy_loss(self.bypass, old, logprob, mb["advantages"], mask, c,
                                                  c.loss_agg_mode, segment=mb.get("slot_segment"), **norm)
        else:
            pg_loss, metrics = compute_policy_loss(c.policy_loss.loss_mode, old, logprob,
                                                   mb["advantages"], mask, c, c.loss_agg_mode,
                                                   is_weights=mb.get("is_weights"), segment=mb.get("slot_segment"),
                                                   **norm)
        if c.entropy_coeff == 0:
            entropy = jax.lax.stop_gradient(entropy)
        entropy_loss = ppo.agg_loss(entropy, mask, c.loss_agg_mode, **norm)
        loss = pg_loss - c.entropy_coeff * entropy_loss
        metrics = dict(metrics, pg_loss=pg_loss,
                       entropy=ppo.agg_loss(jax.lax.stop_gradient(entropy), mask, "token-mean", num_tokens=num_tokens))
        if c.use_kl_loss:
            kl = out["kl_full"] if self.full_kl else ppo.kl_penalty(logprob, mb["ref_logprobs"], c.kl_loss_type)
            kl_loss = ppo.agg_loss(kl, mask, c.loss_agg_mode, **norm)
            loss = loss + c.kl_loss_coef * kl_loss
            metrics["kl_loss"] = jax.lax.stop_gradient(kl_loss)
        return loss, metrics

    def _sft_loss(self, params, mb, num_tokens, num_seqs, extra=None):
        """Supervised warm start: token-mean negative log-likelihood of the response tokens."""
        logprob = self._head(self.full(params, (extra or {}).get("frozen")), mb, with_entropy=False)["logprobs"]
        loss = -ppo.agg_loss(logprob, mb["response_mask"], "token-mean", num_tokens=num_tokens)
        return loss, {"nll": jax.lax.stop_gradient(loss)}

    def sft_update(self, state: TrainState, minibatch: Batch) -> tuple[TrainState, dict]:
        if getattr(self, "_sft_jit", None) is None:
            self._sft_jit = self._jit_step(self._sft_loss, state, "actor sft update")
        with self._ctx():
            return self._sft_jit(state, minibatch, self._extra())


class CriticEngine(_Base):
    """The value model: values of the response states and the clipped value-loss update."""

    role = "critic"

    def __init__(self, module: nn.Module, mesh: Mesh, cfg: CriticConfig, response_length: int, total_steps: int = 1,
                 fsdp_gather: str = "layer", grad_reduce_dtype: str = "float32", trainable: Callable | None = None):
        self.cfg = cfg
        super().__init__(module, mesh, response_length, cfg.optim, total_steps, cfg.ppo_micro_batch_size_per_device,
                         cfg.log_prob_micro_batch_size_per_device, fsdp_gather, grad_reduce_dtype, trainable)

    def values(self, params: Any, batch: Batch) -> jax.Array:
        with self._ctx():
            return self.forward_program(params)(params, self.frozen, batch)

    def forward_program(self, params: Any) -> Program:
        self._remember_specs(params)
        if self._forward_jit is None:
            self._forward_jit = Program(lambda p, f, b: self._forward_map(
                lambda pp, mb: response_values(self.module, self.full(pp, f), mb, self.response_length), p, b),
                name="critic values")
        return self._forward_jit

    def compile_values(self, params: Any, frozen: Any, batch: Batch, probe: bool = False) -> Memory:
        return self._compile(self.forward_program(params), probe, params, frozen, batch)

    def _loss(self, params, mb, num_tokens, num_seqs, extra=None):
        vpreds = response_values(self.module, self.full(params, (extra or {}).get("frozen")), mb, self.response_length)
        mask = mb["response_mask"]
        loss, metrics = ppo.value_loss(vpreds, mb["values"], mb["returns"], mask, self.cfg.cliprange_value,
                                       self.cfg.loss_agg_mode, num_tokens=num_tokens, num_seqs=num_seqs,
                                       horizon=self.response_length, token_weight=mb.get("token_weight"))
        metrics = dict(metrics, vf_loss=loss,
                       vpred_mean=ppo.agg_loss(jax.lax.stop_gradient(vpreds), mask, "token-mean", num_tokens=num_tokens))
        return loss, metrics


__all__ = ["TrainState", "ActorEngine", "CriticEngine", "make_optimizer", "lr_schedule", "response_logprobs",
           "response_head", "truncated_logprobs",
           "response_values", "split_micro", "merge_micro"]
