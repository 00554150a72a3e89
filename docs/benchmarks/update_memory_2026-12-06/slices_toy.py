"""Why an unrolled update keeps every layer's weight slice live at once (CPU): a toy stack of dense layers, stacked
weights [L, D, D] frozen, the gradient with respect to the input only, each layer under `jax.checkpoint` with the
`dots` policy, compiled four ways; XLA's temporaries against the weights' size. From the repo root:

    JAX_PLATFORMS=cpu .venv/bin/python docs/benchmarks/update_memory_2026-12-06/slices_toy.py [D]

  outside  the slice taken outside the checkpoint, unrolled (what a fully unrolled nn.scan does)
  inside   the stacked weights enter the checkpoint and the slice is taken inside it (prevent_cse: the backward's
           recomputation slices again, apart from the forward's slice)
  tied     inside, and the slice tied to the layer's input by an optimisation barrier (it cannot be taken before
           the layer runs)
  scan     a layer loop (lax.scan)
  unstacked  unrolled over weights held as L arrays of their own instead of one stacked [L, D, D]: no slice to take
"""

import sys

import jax
import jax.numpy as jnp

L, T = 8, 256
D = int(sys.argv[1]) if len(sys.argv) > 1 else 2048
POLICY = jax.checkpoint_policies.dots_with_no_batch_dims_saveable


def layer(x, w):
    return jnp.tanh(x @ w) + x


def outside(W, x):
    for i in range(L):
        x = jax.checkpoint(layer, policy=POLICY, prevent_cse=False)(x, W[i])
    return jnp.sum(x)


def inside(W, x):
    for i in range(L):
        x = jax.checkpoint(lambda x, W, i=i: layer(x, W[i]), policy=POLICY, prevent_cse=True)(x, W)
    return jnp.sum(x)


def tied(W, x):
    def one(x, W, i):
        x, W = jax.lax.optimization_barrier((x, W))
        return layer(x, W[i])

    for i in range(L):
        x = jax.checkpoint(lambda x, W, i=i: one(x, W, i), policy=POLICY, prevent_cse=True)(x, W)
    return jnp.sum(x)


def scan(W, x):
    def body(x, w):
        return jax.checkpoint(layer, policy=POLICY, prevent_cse=False)(x, w), None

    return jnp.sum(jax.lax.scan(body, x, W)[0])


def unstacked(Ws, x):
    for w in Ws:
        x = jax.checkpoint(layer, policy=POLICY, prevent_cse=False)(x, w)
    return jnp.sum(x)


W = jax.ShapeDtypeStruct((L, D, D), jnp.float32)
Ws = tuple(jax.ShapeDtypeStruct((D, D), jnp.float32) for _ in range(L))
x = jax.ShapeDtypeStruct((T, D), jnp.float32)
print(f"L={L} D={D} T={T}: the weights {L * D * D * 4 / 2**20:.0f} MiB, one layer's {D * D * 4 / 2**20:.0f} MiB")
for name, f, weights in [("outside", outside, W), ("inside", inside, W), ("tied", tied, W), ("scan", scan, W),
                         ("unstacked", unstacked, Ws)]:
    compiled = jax.jit(jax.grad(f, argnums=1)).lower(weights, x).compile()
    print(f"{name:9s} temporaries {compiled.memory_analysis().temp_size_in_bytes / 2**20:.0f} MiB")
