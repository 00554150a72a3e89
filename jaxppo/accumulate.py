"""One mini-batch's update inside the jitted step: the micro-batches' gradients summed in one `lax.scan` (each
micro-batch loss already normalised by the mini-batch's token / sequence counts, so the sum is the mini-batch
loss for every `loss_agg_mode`), reduced across devices once where each device holds whole parameters, then one
global-norm-clipped AdamW step unless the loss or gradients are not finite or a health guard fires."""

from __future__ import annotations

from typing import Any, Callable

import flax.linen as nn
import jax
import jax.numpy as jnp
import optax
from jax.sharding import PartitionSpec as P

from jaxppo import offload

Batch = dict[str, jax.Array]


def _without(spec: P, axis: str) -> P:
    """`spec` with mesh axis `axis` removed (that dimension whole on each device)."""
    def drop(e):
        if isinstance(e, tuple):
            return tuple(a for a in e if a != axis) or None
        return None if e == axis else e

    return P(*(drop(e) for e in spec))


def _reduce_grad(g: jax.Array, spec: P, dtype: Any) -> jax.Array:
    """Inside shard_map: one device's whole-parameter gradient sum -> the global sum of this device's shard
    (reduce-scatter over fsdp along the dimension the parameter is sharded on; all-reduce over data),
    communicated in `dtype` (float32 carries a float64 gradient as float64)."""
    out = g.dtype
    g = g.astype(jnp.promote_types(dtype, g.dtype) if dtype == jnp.float32 else dtype)
    dims = [i for i, e in enumerate(spec) if e == "fsdp" or (isinstance(e, tuple) and "fsdp" in e)]
    g = jax.lax.psum_scatter(g, "fsdp", scatter_dimension=dims[0], tiled=True) if dims else jax.lax.psum(g, "fsdp")
    return jax.lax.psum(g, "data").astype(out)


def _norms(mask: jax.Array) -> tuple[jax.Array, jax.Array]:
    return jnp.sum(mask), jnp.sum(jnp.any(mask > 0, axis=-1))


def minibatch_gradients(engine: Any, loss_fn: Callable, params: Any, minibatch: Batch, extra: Any = None):
    """(gradients, per-micro-batch losses, per-micro-batch metrics) of a mini-batch: micro-batch losses
    (already normalised by mini-batch counts) summed in one scan. A packed mini-batch (jaxppo/packing.py)
    arrives already split into micro-batches. `extra` (e.g. the reference parameters of the exact-KL loss)
    reaches every micro-batch's loss unchanged."""
    micro = engine._micro_batches(minibatch, engine.micro_batch_per_device)
    num_tokens, num_seqs = _norms(minibatch["response_mask"])
    if "seq_count" in minibatch:  # packed rows are not sequences
        num_seqs = jnp.sum(minibatch["seq_count"])
    # jitted inside the program: the first micro-batch's call and the scan's body share one trace of the model's
    # forward and backward (jit keeps traces by argument types) and one lowered function (XLA inlines it)
    grad_fn = jax.jit(jax.value_and_grad(loss_fn, has_aux=True))

    def scan_grads(params, micro, num_tokens, num_seqs, extra):
        # the first micro-batch's gradients start the sum (no zero-filled accumulator to write and add)
        (loss, metrics), grads = grad_fn(params, jax.tree.map(lambda x: x[0], micro), num_tokens, num_seqs, extra)
        if jax.tree.leaves(micro)[0].shape[0] == 1:
            return grads, jax.tree.map(lambda x: x[None], (loss, metrics))

        def body(acc, mb):
            (loss, metrics), grads = grad_fn(params, mb, num_tokens, num_seqs, extra)
            return jax.tree.map(jnp.add, acc, grads), (loss, metrics)

        grads, rest = jax.lax.scan(body, grads, jax.tree.map(lambda x: x[1:], micro))
        return grads, jax.tree.map(lambda a, b: jnp.concatenate([a[None], b]), (loss, metrics), rest)

    if engine.local_accumulation:
        # each device sums the gradients of its own rows over all micro-batches; the devices combine
        # their sums once, after the scan (left to the partitioner, the accumulator would be reduced
        # after every micro-batch: seen in the compiled HLO). Gather-once fsdp: the compute-dtype copy is
        # gathered on entry, gradients are reduce-scattered back to the parameters' shards on exit.
        specs, dtypes = engine._param_specs, jax.tree.map(lambda p: p.dtype, params)

        def local(params, micro, num_tokens, num_seqs, extra):
            # upcast: differentiate with respect to parameters of the master dtype, exactly as without
            # the gather (bf16 -> fp32 -> bf16 is exact, and each use's cotangent is summed in fp32)
            params = jax.tree.map(lambda p, d: p.astype(d), params, dtypes)
            with nn.logical_axis_rules(()):  # inside: per-device arrays, no sharding constraints
                grads, aux = scan_grads(params, micro, num_tokens, num_seqs, extra)
            reduce = lambda g, s: _reduce_grad(g, s, jnp.dtype(engine.grad_reduce_dtype))
            return jax.tree.map(reduce, grads, specs), jax.lax.psum(aux, ("data", "fsdp"))

        micro_specs = jax.tree.map(lambda x: P(None, ("data", "fsdp")), micro)
        shipped = engine._compute_copy(params) if engine.gather_once else params
        return jax.shard_map(
            local, mesh=engine.mesh, in_specs=(P(), micro_specs, P(), P(), P()), out_specs=(specs, P()),
            check_vma=False,
        )(shipped, micro, num_tokens, num_seqs, extra)
    return scan_grads(params, micro, num_tokens, num_seqs, extra)


def optimizer_step(engine: Any, loss_fn: Callable, state: Any, minibatch: Batch, extra: Any = None
                   ) -> tuple[Any, dict]:
    """The mini-batch's summed gradients (`minibatch_gradients`), then one clipped AdamW step unless the loss or
    gradients are not finite or a guard fires. Metrics are summed over micro-batches (they are
    normalised alike)."""
    grads, (losses, metrics) = minibatch_gradients(engine, loss_fn, state.params, minibatch, extra)
    grad_norm = optax.global_norm(grads)
    metrics = jax.tree.map(jnp.sum, metrics)
    loss = jnp.sum(losses)
    finite = jnp.isfinite(loss) & jnp.isfinite(grad_norm)
    ok = finite
    for name, (kind, bound) in engine.guards.items():
        v = grad_norm if name == "grad_norm" else metrics[name]
        ok &= (v <= bound) if kind == "max" else (v >= bound)

    def apply(_):
        if engine.optimizer_offload:  # the moments through the device one parameter at a time (jaxppo/offload.py)
            return offload.step(engine.tx_parts, grads, state.opt_state, state.params, engine.opt_shardings)
        updates, opt_state = engine.tx.update(grads, state.opt_state, state.params)
        return optax.apply_updates(state.params, updates), opt_state

    # a branch, not a select over the new and old trees: a healthy step reads and writes the
    # parameters and optimizer state once
    params, opt_state = jax.lax.cond(ok, apply, lambda _: (state.params, state.opt_state), None)
    metrics.update(loss=loss, grad_norm=grad_norm, lr=engine.schedule(state.step),
                   skipped=1.0 - ok.astype(jnp.float32), nonfinite=1.0 - finite.astype(jnp.float32))
    return state.replace(params=params, opt_state=opt_state, step=state.step + ok.astype(state.step.dtype)), metrics


__all__ = ["minibatch_gradients", "optimizer_step"]
