"""One mini-batch's update: the micro-batches' gradients summed (each micro-batch loss already normalised by the
mini-batch's token / sequence counts, so the sum is the mini-batch loss for every `loss_agg_mode`), then one
global-norm-clipped AdamW step unless the loss or gradients are not finite or a health guard fires.

Two ways to run the micro-batch loop (`model.micro_batch_loop`):
- scan: one program a mini-batch, the micro-batches in a `lax.scan` inside it; where each device holds whole
  parameters the gradients are summed per device and reduced across devices once, after the loop.
- host: one program a micro-batch (its gradients, loss and metrics added to a donated sum), called by the host once
  per micro-batch, then one program for the optimizer step: no loop inside XLA's program. In a loop XLA keeps
  per-iteration copies a single micro-batch's program does not (on the GPU, the 7B LoRA update at four
  micro-batches sliced every layer's weights out of the stacked arrays into buffers of their own, ~12 GiB; on the
  CPU it hoists float32 copies of them out of the loop); the host loop compiles what one micro-batch needs. Where
  each device holds whole parameters the sum is kept per device between the programs (a leading axis over the
  devices) and reduced across devices once, in the optimizer step's program, as the scan does after its loop;
  gather-once fsdp gathers the compute-dtype copy once, in the empty sum's program, and hands it to every
  micro-batch's.
"""

from __future__ import annotations

from typing import Any, Callable

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import NamedSharding, PartitionSpec as P

from jaxppo import offload
from jaxppo.programs import Memory, Program

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


def _norms(minibatch: Batch) -> tuple[jax.Array, jax.Array]:
    """The mini-batch's response tokens and sequences, which every micro-batch's loss is normalised by."""
    mask = minibatch["response_mask"]
    if "seq_count" in minibatch:  # packed rows are not sequences
        return jnp.sum(mask), jnp.sum(minibatch["seq_count"])
    return jnp.sum(mask), jnp.sum(jnp.any(mask > 0, axis=-1))


def minibatch_gradients(engine: Any, loss_fn: Callable, params: Any, minibatch: Batch, extra: Any = None):
    """(gradients, per-micro-batch losses, per-micro-batch metrics) of a mini-batch: micro-batch losses
    (already normalised by mini-batch counts) summed in one scan. A packed mini-batch (jaxppo/packing.py)
    arrives already split into micro-batches. `extra` (e.g. the reference parameters of the exact-KL loss)
    reaches every micro-batch's loss unchanged."""
    micro = engine._micro_batches(minibatch, engine.micro_batch_per_device)
    num_tokens, num_seqs = _norms(minibatch)
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
    """The mini-batch's summed gradients (`minibatch_gradients`), then `apply_step`. Metrics are summed over
    micro-batches (they are normalised alike)."""
    grads, (losses, metrics) = minibatch_gradients(engine, loss_fn, state.params, minibatch, extra)
    return apply_step(engine, state, (grads, jnp.sum(losses), jax.tree.map(jnp.sum, metrics)))


def apply_step(engine: Any, state: Any, sums: tuple[Any, jax.Array, dict]) -> tuple[Any, dict]:
    """One clipped AdamW step with a mini-batch's summed (gradients, loss, metrics), unless the loss or gradients
    are not finite or a guard fires."""
    grads, loss, metrics = sums
    metrics = dict(metrics)
    grad_norm = optax.global_norm(grads)
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


def _micro_value_and_grad(engine: Any, loss_fn: Callable, params: Any, minibatch: Batch, i: Any, extra: Any):
    """((loss, metrics), gradients) of micro-batch `i` of `minibatch`, normalised by the mini-batch's counts."""
    micro = engine._micro_batches(minibatch, engine.micro_batch_per_device)
    num_tokens, num_seqs = _norms(minibatch)
    mb = jax.tree.map(lambda x: jax.lax.dynamic_index_in_dim(x, i, keepdims=False), micro)
    return jax.value_and_grad(loss_fn, has_aux=True)(params, mb, num_tokens, num_seqs, extra)


PER_DEVICE = P(("data", "fsdp"))  # the host loop's per-device sums: a leading axis, one entry per device


def zero_sums(engine: Any, loss_fn: Callable, state: Any, minibatch: Batch, extra: Any = None):
    """The host loop's start: (empty sum, the parameters it computes with). The sum is zeros shaped as one
    micro-batch's (gradients, loss, metrics), with a leading axis over the devices where each sums its own
    (`engine.local_accumulation`); the parameters are the gathered compute-dtype copy under gather-once fsdp, else
    None (the state's own are used)."""
    shapes = jax.eval_shape(lambda: _micro_value_and_grad(engine, loss_fn, state.params, minibatch, 0, extra))
    lead = (engine.batch_shards,) if engine.local_accumulation else ()
    (loss, metrics), grads = jax.tree.map(lambda s: jnp.zeros(lead + s.shape, s.dtype), shapes)
    return (grads, loss, metrics), (engine._gathered(state.params) if engine.gather_once else None)


def add_micro_batch(engine: Any, loss_fn: Callable, state: Any, sums: Any, copy: Any, minibatch: Batch, i: jax.Array,
                    extra: Any = None):
    """The host loop's body: micro-batch `i`'s (gradients, loss, metrics) added to `sums` (donated); where each
    device sums its own, inside shard_map as the scan's loop is (`minibatch_gradients`)."""
    if not engine.local_accumulation:
        (loss, metrics), grads = _micro_value_and_grad(engine, loss_fn, state.params, minibatch, i, extra)
        return jax.tree.map(jnp.add, sums, (grads, loss, metrics))
    micro = engine._micro_batches(minibatch, engine.micro_batch_per_device)
    num_tokens, num_seqs = _norms(minibatch)
    dtypes = jax.tree.map(lambda p: p.dtype, state.params)

    def local(params, micro, num_tokens, num_seqs, extra, sums, i):
        params = jax.tree.map(lambda p, d: p.astype(d), params, dtypes)  # as the scan: gradients in the master dtype
        mb = jax.tree.map(lambda x: jax.lax.dynamic_index_in_dim(x, i, keepdims=False), micro)
        with nn.logical_axis_rules(()):  # inside: per-device arrays, no sharding constraints
            (loss, metrics), grads = jax.value_and_grad(loss_fn, has_aux=True)(params, mb, num_tokens, num_seqs,
                                                                               extra)
        return jax.tree.map(lambda acc, x: acc + x[None], sums, (grads, loss, metrics))

    per_device = jax.tree.map(lambda _: PER_DEVICE, sums)
    micro_specs = jax.tree.map(lambda x: P(None, ("data", "fsdp")), micro)
    return jax.shard_map(
        local, mesh=engine.mesh, in_specs=(P(), micro_specs, P(), P(), P(), per_device, P()), out_specs=per_device,
        check_vma=False,
    )(state.params if copy is None else copy, micro, num_tokens, num_seqs, extra, sums, i)


def reduce_sums(engine: Any, sums: Any) -> tuple[Any, jax.Array, dict]:
    """The host loop's per-device sums -> the mini-batch's (gradients in the parameters' shardings, loss, metrics):
    each device's gradient sum reduced across devices once (`_reduce_grad`, as after the scan's loop)."""
    if not engine.local_accumulation:
        return sums
    grads, loss, metrics = sums
    specs, dtype = engine._param_specs, jnp.dtype(engine.grad_reduce_dtype)
    reduce = lambda g: jax.tree.map(lambda x, s: _reduce_grad(x[0], s, dtype), g, specs)  # noqa: E731
    grads = jax.shard_map(reduce, mesh=engine.mesh, in_specs=(jax.tree.map(lambda _: PER_DEVICE, grads),),
                          out_specs=specs, check_vma=False)(grads)
    return grads, jnp.sum(loss, axis=0), jax.tree.map(lambda m: jnp.sum(m, axis=0), metrics)


def micro_batch_count(engine: Any, minibatch: dict) -> int:
    """How many micro-batches `minibatch` splits into (a packed one arrives split)."""
    if "gather_idx" in minibatch:
        return int(minibatch["input_ids"].shape[0])
    return engine._n_micro(int(minibatch["input_ids"].shape[0]), engine.micro_batch_per_device)


class HostLoop:
    """The update with the micro-batch loop on the host (`model.micro_batch_loop=host`), called as the scan's one
    program is: the empty sum (and, under gather-once fsdp, the gathered parameters), then one program per
    micro-batch adding its (gradients, loss, metrics) into the sum (donated), then the optimizer step (the devices'
    sums reduced first where each sums its own). Every program takes the whole state, the mini-batch's arguments and
    the loss's extra arguments, read or not, so XLA's memory of each counts the same resident arguments."""

    def __init__(self, engine: Any, loss_fn: Callable, shardings: Any, name: str):
        mesh, whole = engine.mesh, NamedSharding(engine.mesh, P())
        self.engine, self.loss_fn = engine, loss_fn
        if engine.local_accumulation:  # prefixes: every leaf of the sum per device
            per_device = NamedSharding(mesh, PER_DEVICE)
            self.sum_shardings = (per_device, per_device, per_device)
        else:
            self.sum_shardings = (shardings.params, whole, whole)
        self.copy_shardings = (jax.tree.map(lambda s: NamedSharding(mesh, _without(s, "fsdp")), engine._param_specs)
                               if engine.gather_once else None)
        kw = dict(keep_unused=True)
        self.zeros = Program(lambda s, b, e: zero_sums(engine, loss_fn, s, b, e), name=f"{name} (empty sum)",
                             out_shardings=(self.sum_shardings, self.copy_shardings), **kw)
        # named as the scan's program: the one that runs at the phase's token budget
        self.micro = Program(lambda s, acc, c, b, i, e: add_micro_batch(engine, loss_fn, s, acc, c, b, i, e),
                             name=name, donate_argnums=(1,), out_shardings=self.sum_shardings, **kw)
        self.apply = Program(lambda s, acc, e: apply_step(engine, s, reduce_sums(engine, acc)),
                             name=f"{name} (optimizer step)", donate_argnums=(0,), out_shardings=(shardings, None),
                             **kw)

    def programs(self) -> list[Program]:
        return [self.zeros, self.micro, self.apply]

    def __call__(self, state: Any, minibatch: Batch, extra: Any) -> tuple[Any, dict]:
        sums, copy = self.zeros(state, minibatch, extra)
        for i in range(micro_batch_count(self.engine, minibatch)):
            sums = self.micro(state, sums, copy, minibatch, np.int32(i), extra)
        return self.apply(state, sums, extra)

    def _memories(self, how: str, state: Any, minibatch: Batch, extra: Any) -> Memory:
        # (sums, copy) as the empty sum's program gives them: shapes in its output shardings
        sums, copy = self.zeros.jitted.eval_shape(state, minibatch, extra)
        i = jax.ShapeDtypeStruct((), np.int32)
        mems = [getattr(self.zeros, how)(state, minibatch, extra),
                getattr(self.micro, how)(state, sums, copy, minibatch, i, extra),
                getattr(self.apply, how)(state, sums, extra)]
        # each program's arguments hold the same resident ones (keep_unused): the largest beside them is the phase's
        return max(mems, key=lambda m: m.beside(0))

    def memory(self, state: Any, minibatch: Batch, extra: Any) -> Memory:
        """XLA's memory for the largest of the three programs, each compiled and kept."""
        return self._memories("memory", state, minibatch, extra)

    def probe(self, state: Any, minibatch: Batch, extra: Any) -> Memory:
        return self._memories("probe", state, minibatch, extra)

    def compiles(self) -> int:
        return sum(p.compiles() for p in self.programs())


__all__ = ["HostLoop", "minibatch_gradients", "optimizer_step", "apply_step", "zero_sums", "add_micro_batch",
           "reduce_sums", "micro_batch_count"]
