"""Flax decoder-only LM of the Qwen2 / Qwen3 / Llama family, and its critic (the same backbone + a scalar head).

Weights are stored in Hugging Face's layout ([out, in] for projections) under Hugging Face's names,
so checkpoint I/O and the torch bridge are a rename plus a layer index, never a transpose
(XLA contracts either layout at the same speed). Layers are stacked on a leading `layers` axis and
run with `nn.scan`. Every parameter carries logical axis names; the model never mentions a mesh.
"""

from __future__ import annotations

from typing import Any, Callable

import flax.linen as nn
import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, Int

from jaxppo.models.config import ModelConfig
from jaxppo.models.lora import LoraSpec, kaiming_a

def _dots_and_attention(prim, *avals, **params) -> bool:
    """`dots` plus the fused attention's forward outputs (its output and softmax statistics): cuDNN's
    attention is a custom call, not a dot, so under `dots` the backward pass runs it forward again."""
    return prim.name.startswith("dot_product_attention_fwd") or \
        jax.checkpoint_policies.dots_with_no_batch_dims_saveable(prim, *avals, **params)


REMAT_POLICIES: dict[str, Callable | None] = {
    "none": None,
    "full": jax.checkpoint_policies.nothing_saveable,
    "dots": jax.checkpoint_policies.dots_with_no_batch_dims_saveable,
    "dots_attn": _dots_and_attention,
}


def wide(dtype: Any) -> Any:
    """The dtype norms, rotary tables, adapters and outputs are computed in: float32, or float64 in a float64
    model (`compare ppo-step --dtype float64`, under JAX's x64 mode)."""
    return jnp.promote_types(dtype, jnp.float32)


def _normal(std: float = 0.02) -> Callable:
    return nn.initializers.normal(stddev=std)


def _param(module: nn.Module, name: str, init: Callable, shape: tuple[int, ...], dtype: Any) -> jax.Array:
    """`module.param(name, init, shape, dtype)` less flax's check at every apply, where it traces the initializer
    (`jax.eval_shape`) to compare shapes each time a parameter is read: 4 ms a parameter at each trace of the model,
    ~0.8 s of a CPU run's start. The shape is compared here directly."""
    if module.has_variable("params", name):
        value = nn.meta.unbox(module.get_variable("params", name))
        if tuple(value.shape) != tuple(shape):
            raise ValueError(f"parameter {'/'.join(module.path)}/{name} has shape {tuple(value.shape)}; the model's "
                             f"config makes it {tuple(shape)}")
        return value
    return module.param(name, init, shape, dtype)


def _dense(x: jax.Array, w: jax.Array) -> jax.Array:
    """x [..., i] times w [o, i] -> [..., o]: jnp.einsum's program, without its path search at each trace."""
    return jax.lax.dot_general(x, w, (((x.ndim - 1,), (1,)), ((), ())))


@jax.custom_vjp
def head_logits(h: Float[Array, "... d"], w_c: Float[Array, "v d"], w: Float[Array, "v d"]) -> Float[Array, "... v"]:
    """Logits h w_c^T in the compute dtype, where `w_c` is the head's weights `w` cast to it once, outside the
    loop over the head's chunks (no cast of the whole [vocab, d] matrix per chunk), and the gradient goes to the
    master weights `w` straight from the GEMM in `w`'s dtype (float32: no rounding of a chunk's [vocab, d]
    gradient to the compute dtype before it is summed). Forward and the gradient w.r.t. `h` are `_dense`'s;
    `w_c` gets none (hold it under `stop_gradient`)."""
    return _dense(h, w_c)


def _head_logits_fwd(h, w_c, w):
    return _dense(h, w_c), (h, w_c, jnp.zeros((), w.dtype))


def _head_logits_bwd(res, g):
    h, w_c, w_dtype = res
    lead = tuple(range(h.ndim - 1))
    dh = jax.lax.dot_general(g, w_c, (((g.ndim - 1,), (0,)), ((), ())))
    dw = jax.lax.dot_general(g, h, ((lead, lead), ((), ())), preferred_element_type=w_dtype.dtype)
    return dh.astype(h.dtype), None, dw


head_logits.defvjp(_head_logits_fwd, _head_logits_bwd)


def head_weight(cfg: ModelConfig, params: Any) -> jax.Array:
    """`CausalLM`'s vocabulary head [vocab, d] in `params`: the token embedding when tied, else `lm_head`."""
    if cfg.tie_word_embeddings:
        return params["model"]["embed_tokens"]["weight"]
    return params["lm_head"]["weight"]


def positions_from_mask(attention_mask: Int[Array, "b t"]) -> Int[Array, "b t"]:
    """Position ids as transformers derives them for left-padded rows: 0 at the first valid token."""
    return jnp.maximum(jnp.cumsum(attention_mask, axis=-1) - 1, 0).astype(jnp.int32)


class Linear(nn.Module):
    """y = x W^T (+ b) with W stored as [out, in] like torch.nn.Linear; with `lora_rank` > 0, plus
    (alpha / r) (x A^T) B^T from float32 adapters `lora_A` [r, in] and `lora_B` [out, r] (PEFT's layout; float64
    with float64 parameters)."""

    features: int
    axes: tuple[str, str]  # logical names of (out, in)
    use_bias: bool = False
    dtype: Any = jnp.float32
    param_dtype: Any = jnp.float32
    lora_rank: int = 0
    lora_scale: float = 0.0

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        w = _param(self, "weight", nn.with_logical_partitioning(_normal(), self.axes),
                   (self.features, x.shape[-1]), self.param_dtype)
        y = _dense(x.astype(self.dtype), w.astype(self.dtype))
        if self.use_bias:
            b = _param(self, "bias", nn.with_logical_partitioning(nn.initializers.zeros, self.axes[:1]),
                       (self.features,), self.param_dtype)
            y = y + b.astype(self.dtype)
        if self.lora_rank:
            a = _param(self, "lora_A", nn.with_logical_partitioning(kaiming_a, ("lora", self.axes[1])),
                       (self.lora_rank, x.shape[-1]), wide(self.param_dtype))
            bb = _param(self, "lora_B", nn.with_logical_partitioning(nn.initializers.zeros, (self.axes[0], "lora")),
                        (self.features, self.lora_rank), wide(self.param_dtype))
            xa = _dense(x.astype(self.dtype), a.astype(self.dtype))
            y = y + (self.lora_scale * _dense(xa, bb.astype(self.dtype))).astype(y.dtype)
        return y


class RMSNorm(nn.Module):
    """RMSNorm computed in float32 (float64 in a float64 model), as transformers does, then cast back to the
    compute dtype."""

    eps: float
    dtype: Any = jnp.float32
    param_dtype: Any = jnp.float32

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        w = _param(self, "weight", nn.with_logical_partitioning(nn.initializers.ones, ("norm",)),
                   (x.shape[-1],), self.param_dtype)
        xf = x.astype(wide(x.dtype))
        xf = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + self.eps)
        return w.astype(self.dtype) * xf.astype(self.dtype)


class Embed(nn.Module):
    """Token embedding [vocab, embed] named `weight` (HF's `embed_tokens.weight`)."""

    num_embeddings: int
    features: int
    dtype: Any = jnp.float32
    param_dtype: Any = jnp.float32

    def setup(self):
        self.weight = _param(self, "weight", nn.with_logical_partitioning(_normal(), ("vocab", "embed")),
                             (self.num_embeddings, self.features), self.param_dtype)

    def __call__(self, ids: jax.Array) -> jax.Array:
        return jnp.take(self.weight, ids, axis=0).astype(self.dtype)

    def attend(self, x: jax.Array) -> jax.Array:
        return _dense(x.astype(self.dtype), self.weight.astype(self.dtype))


def rope_tables(positions: Int[Array, "b t"], inv_freq: jax.Array) -> tuple[jax.Array, jax.Array]:
    """cos/sin [b, t, head_dim] in `inv_freq`'s dtype (float32; float64 in a float64 model) (transformers'
    non-interleaved layout)."""
    freqs = positions.astype(inv_freq.dtype)[..., None] * inv_freq[None, None, :]
    emb = jnp.concatenate([freqs, freqs], axis=-1)
    return jnp.cos(emb), jnp.sin(emb)


def apply_rope(x: Float[Array, "b t n d"], cos: jax.Array, sin: jax.Array) -> jax.Array:
    half = x.shape[-1] // 2
    rotated = jnp.concatenate([-x[..., half:], x[..., :half]], axis=-1)
    return (x * cos[:, :, None, :].astype(x.dtype) + rotated * sin[:, :, None, :].astype(x.dtype))


def attention_mask_4d(segment_ids: Int[Array, "b t"]) -> jax.Array:
    """[b, 1, t, t] boolean: causal, within one segment, never to padding (segment 0).

    The diagonal is always allowed so padded query rows are not empty (their outputs are ignored).
    """
    t = segment_ids.shape[-1]
    causal = jnp.tril(jnp.ones((t, t), dtype=bool))
    same = segment_ids[:, :, None] == segment_ids[:, None, :]
    valid_key = (segment_ids > 0)[:, None, :]
    mask = (causal[None] & same & valid_key) | jnp.eye(t, dtype=bool)[None]
    return mask[:, None, :, :]


def segment_runs(segment_ids: Int[Array, "b t"]) -> Int[Array, "b 3"]:
    """Start columns of the runs of an unpacked row (left padding, the sequence, right padding), -1 for an
    empty run. The engine's rows are one contiguous sequence (prompt left-padded, response right-padded);
    a row with more runs than that has its starts poisoned (-2), which the decoder turns into NaN states."""
    t = segment_ids.shape[-1]
    valid = segment_ids > 0
    n = jnp.sum(valid, axis=-1)
    first = jnp.where(n > 0, jnp.argmax(valid, axis=-1), 0)
    changes = jnp.sum(segment_ids[:, 1:] != segment_ids[:, :-1], axis=-1)
    starts = jnp.stack([jnp.zeros_like(first), first, first + n], axis=-1)
    ends = jnp.stack([first, first + n, jnp.full_like(first, t)], axis=-1)
    starts = jnp.where(ends > starts, starts, -1).astype(jnp.int32)
    expected = jnp.where(n > 0, (first > 0).astype(jnp.int32) + (first + n < t), 0)  # id changes of one run
    return jnp.where((changes != expected)[:, None], -2, starts)


def ragged_layout(starts: Int[Array, "b k m"], t: int) -> tuple[jax.Array, jax.Array]:
    """Run starts in the row, by attention window ([b, k, m]: the k windows of t / k columns, -1: none; [b, m]: one
    window) -> cuDNN's packed layout of the rows cut into their windows ([b * k, t / k]): (seqlen [b * k, m], offsets
    [b * k, m + 1]), -1 filled. A run ends where the row's next one starts, which may lie in a later window: cuDNN
    reads each run from its offset in the flat buffer, so a run may go on past its window's end (never past the
    window's length). Every column of a row must lie in some run (padding runs included), so no output is left
    unwritten."""
    if starts.ndim == 2:
        starts = starts[:, None, :]
    b, k, m = starts.shape
    flat = starts.reshape(b, k * m)
    # each run's end: the smallest valid start after it in the row (starts ascend through the windows), else t
    later = jax.lax.cummin(jnp.where(flat >= 0, flat, t), axis=1, reverse=True)
    end = jnp.concatenate([later[:, 1:], jnp.full_like(later[:, :1], t)], axis=-1)
    lens = jnp.where(flat >= 0, end - flat, -1).astype(jnp.int32).reshape(b * k, m)
    first = (jnp.arange(k, dtype=starts.dtype) * (t // k))[None, :, None]  # each window's first column
    local = jnp.where(starts >= 0, starts - first, -1).astype(jnp.int32).reshape(b * k, m)
    return lens, jnp.concatenate([local, jnp.full_like(local[:, :1], -1)], axis=-1)


def cudnn_segment_attention(q, k, v, seqlen, offsets):
    """Causal attention within each run of a row through cuDNN's packed (ragged) layout: work is the sum of
    the runs' squared lengths, not the row's, and no [t, t] mask or bias exists (a bias would also make
    cuDNN compute its gradient). The rows are cut into the windows `seqlen` / `offsets` describe
    (`ragged_layout`: [b * windows, runs]), a free reshape. JAX exposes the offsets only in its cuDNN module."""
    from jax._src.cudnn.fused_attention_stablehlo import MaskType, dot_product_attention

    b, t = q.shape[:2]
    cut = lambda x: x.reshape((seqlen.shape[0], b * t // seqlen.shape[0]) + x.shape[2:])  # noqa: E731
    out = dot_product_attention(cut(q), cut(k), cut(v), q_seqlen=seqlen, kv_seqlen=seqlen, q_offsets=offsets,
                                kv_offsets=offsets, scale=q.shape[-1] ** -0.5, mask_type=MaskType.PADDING_CAUSAL,
                                qkv_layout="BTNH")
    return out.reshape(q.shape)


def _lora(spec: LoraSpec, name: str) -> dict:
    return dict(lora_rank=spec.on(name), lora_scale=spec.scale)


def float64_attention(q, k, v, mask: jax.Array, window: tuple[int, int] | None) -> jax.Array:
    """Causal attention (GQA, `mask` [b, 1, t, t], an optional left window) with the softmax in float64:
    jax.nn.dot_product_attention computes its softmax in float32 whatever the inputs (1e-7 off in a float64
    model: `compare ppo-step --dtype float64`)."""
    t, rep = q.shape[1], q.shape[2] // k.shape[2]
    k, v = jnp.repeat(k, rep, axis=2), jnp.repeat(v, rep, axis=2)
    scores = jnp.einsum("btnh,bsnh->bnts", q, k) * jnp.asarray(q.shape[-1] ** -0.5, q.dtype)
    i, j = jnp.arange(t)[:, None], jnp.arange(t)[None, :]
    allowed = (j <= i) & mask if window is None else (j <= i) & (i - j <= window[0]) & mask
    probs = jax.nn.softmax(jnp.where(allowed, scores, jnp.finfo(q.dtype).min), axis=-1)
    return jnp.einsum("bnts,bsnh->btnh", probs, v)


class Attention(nn.Module):
    cfg: ModelConfig
    dtype: Any
    param_dtype: Any
    attention_impl: str | None
    window: int | None = None  # longest sequence: no token attends further back (packed rows are longer)
    lora: LoraSpec = LoraSpec()

    @nn.compact
    def __call__(self, x, mask, cos, sin):
        """`mask`: [b, 1, t, t] boolean (XLA), or (seqlen, offsets) of the runs (cuDNN)."""
        c = self.cfg
        b, t, _ = x.shape
        lin = dict(dtype=self.dtype, param_dtype=self.param_dtype)
        q = Linear(c.num_attention_heads * c.head_dim, ("heads", "embed"), c.attention_bias, name="q_proj", **lin,
                   **_lora(self.lora, "q_proj"))(x)
        k = Linear(c.num_key_value_heads * c.head_dim, ("kv_heads", "embed"), c.attention_bias, name="k_proj", **lin,
                   **_lora(self.lora, "k_proj"))(x)
        v = Linear(c.num_key_value_heads * c.head_dim, ("kv_heads", "embed"), c.attention_bias, name="v_proj", **lin,
                   **_lora(self.lora, "v_proj"))(x)
        q = q.reshape(b, t, c.num_attention_heads, c.head_dim)
        k = k.reshape(b, t, c.num_key_value_heads, c.head_dim)
        if c.qk_norm:  # Qwen3: RMSNorm over head_dim on every head, before RoPE
            norm = dict(eps=c.rms_norm_eps, dtype=self.dtype, param_dtype=self.param_dtype)
            q, k = RMSNorm(name="q_norm", **norm)(q), RMSNorm(name="k_norm", **norm)(k)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        v = v.reshape(b, t, c.num_key_value_heads, c.head_dim)
        q = nn.with_logical_constraint(q, ("batch", "seq", "act_heads", None))
        # cuDNN's packed layout attends within each run; with a mask (XLA, cudnn_mask), is_causal + a left
        # window let cuDNN skip whole blocks and the mask keeps segments and padding apart within them
        if isinstance(mask, tuple):
            out = cudnn_segment_attention(q, k, v, *mask)
        else:
            window = (self.window - 1, 0) if self.window is not None and self.window < t else None
            impl = "cudnn" if self.attention_impl == "cudnn_mask" else self.attention_impl
            if q.dtype == jnp.float64:
                out = float64_attention(q, k, v, mask, window)
            else:
                out = jax.nn.dot_product_attention(q, k, v, mask=mask, is_causal=True, local_window_size=window,
                                                   implementation=impl)
        out = out.reshape(b, t, c.num_attention_heads * c.head_dim)
        return Linear(c.hidden_size, ("embed", "heads"), c.o_bias, name="o_proj", **lin, **_lora(self.lora, "o_proj"))(out)


class MLP(nn.Module):
    cfg: ModelConfig
    dtype: Any
    param_dtype: Any
    lora: LoraSpec = LoraSpec()

    @nn.compact
    def __call__(self, x):
        c = self.cfg
        lin = dict(dtype=self.dtype, param_dtype=self.param_dtype, use_bias=c.mlp_bias)
        gate = Linear(c.intermediate_size, ("mlp", "embed"), name="gate_proj", **lin, **_lora(self.lora, "gate_proj"))(x)
        up = Linear(c.intermediate_size, ("mlp", "embed"), name="up_proj", **lin, **_lora(self.lora, "up_proj"))(x)
        h = nn.with_logical_constraint(jax.nn.silu(gate) * up, ("batch", "seq", "act_mlp"))
        return Linear(c.hidden_size, ("embed", "mlp"), name="down_proj", **lin, **_lora(self.lora, "down_proj"))(h)


class DecoderLayer(nn.Module):
    cfg: ModelConfig
    dtype: Any
    param_dtype: Any
    attention_impl: str | None
    window: int | None = None
    lora: LoraSpec = LoraSpec()

    @nn.compact
    def __call__(self, x, mask, cos, sin):
        c = self.cfg
        norm = dict(eps=c.rms_norm_eps, dtype=self.dtype, param_dtype=self.param_dtype)
        h = RMSNorm(name="input_layernorm", **norm)(x)
        x = x + Attention(c, self.dtype, self.param_dtype, self.attention_impl, self.window, self.lora,
                          name="self_attn")(h, mask, cos, sin)
        h = RMSNorm(name="post_attention_layernorm", **norm)(x)
        x = x + MLP(c, self.dtype, self.param_dtype, self.lora, name="mlp")(h)
        return nn.with_logical_constraint(x, ("batch", "seq", "act_embed")), None


class Decoder(nn.Module):
    """Embedding -> scanned decoder layers -> final norm. Returns hidden states [b, t, hidden]."""

    cfg: ModelConfig
    dtype: Any = jnp.float32
    param_dtype: Any = jnp.float32
    remat: str = "none"
    attention_impl: str | None = None
    attention_window: int | None = None
    scan_unroll: int = 1  # layers per iteration of the layer loop; 0: all (no loop at run time)
    lora: LoraSpec = LoraSpec()
    prevent_cse: bool = False  # the layers' remat: keep the backward's recomputation apart from the forward

    def setup(self):
        c = self.cfg
        self.embed_tokens = Embed(c.vocab_size, c.hidden_size, self.dtype, self.param_dtype)
        block = DecoderLayer
        if self.remat != "none":
            block = nn.remat(block, prevent_cse=self.prevent_cse, policy=REMAT_POLICIES[self.remat])
        self.layers = nn.scan(
            block, variable_axes={"params": 0}, split_rngs={"params": True},
            in_axes=(nn.broadcast, nn.broadcast, nn.broadcast), length=c.num_hidden_layers,
            unroll=self.scan_unroll or c.num_hidden_layers,
            metadata_params={nn.PARTITION_NAME: "layers"},
        )(c, self.dtype, self.param_dtype, self.attention_impl, self.attention_window, self.lora)
        self.norm = RMSNorm(c.rms_norm_eps, self.dtype, self.param_dtype)

    def __call__(self, input_ids: Int[Array, "b t"], positions: Int[Array, "b t"],
                 segment_ids: Int[Array, "b t"], segment_starts: Int[Array, "b k m"] | None = None
                 ) -> Float[Array, "b t d"]:
        """`segment_ids`: 0 for padding, k > 0 for the k-th sequence of a row (1 everywhere unpacked).
        `segment_starts`: the start column of every run of equal segment ids in a row, padding runs
        included, by the attention window it starts in, -1 after a window's last (packed rows,
        jaxppo/packing.py); None: one sequence per row (the engine's padded layout). With
        `attention_impl="cudnn"` the runs are attended to as cuDNN's packed layout; otherwise through a [t, t]
        mask (XLA, or `"cudnn_mask"`: cuDNN with the mask as a bias, the former layout, kept to compare
        against)."""
        x = nn.with_logical_constraint(self.embed_tokens(input_ids), ("batch", "seq", "act_embed"))
        cos, sin = rope_tables(positions, jnp.asarray(self.cfg.inv_freq(), wide(self.dtype)))
        if self.attention_impl == "cudnn":
            starts = segment_runs(segment_ids) if segment_starts is None else segment_starts
            mask = ragged_layout(starts, segment_ids.shape[-1])
            # a poisoned row (not the layout its starts describe) is NaN from its first state on: the
            # residual stream carries the NaN through every layer, and nothing crosses rows
            poisoned = jnp.any((starts < -1).reshape(starts.shape[0], -1), axis=-1)
            x = jnp.where(poisoned[:, None, None], jnp.nan, x)
        else:
            mask = attention_mask_4d(segment_ids)
        x, _ = self.layers(x, mask, cos, sin)
        return self.norm(x)


class CausalLM(nn.Module):
    """Qwen2ForCausalLM / LlamaForCausalLM. `__call__` returns hidden states; `logits` applies the head,
    so callers can chunk the [b, t, vocab] projection."""

    cfg: ModelConfig
    dtype: Any = jnp.float32
    param_dtype: Any = jnp.float32
    remat: str = "none"
    attention_impl: str | None = None
    attention_window: int | None = None
    scan_unroll: int = 1
    lora: LoraSpec = LoraSpec()
    prevent_cse: bool = False

    def setup(self):
        self.model = Decoder(self.cfg, self.dtype, self.param_dtype, self.remat, self.attention_impl,
                             self.attention_window, self.scan_unroll, self.lora, self.prevent_cse)
        if not self.cfg.tie_word_embeddings:
            self.lm_head = Linear(self.cfg.vocab_size, ("vocab", "embed"), dtype=self.dtype,
                                  param_dtype=self.param_dtype)

    def __call__(self, input_ids, positions, segment_ids, segment_starts=None):
        return self.model(input_ids, positions, segment_ids, segment_starts)

    def logits(self, hidden: Float[Array, "... d"]) -> Float[Array, "... v"]:
        if self.cfg.tie_word_embeddings:
            return self.model.embed_tokens.attend(hidden)
        return self.lm_head(hidden)

    def forward_logits(self, input_ids, positions, segment_ids, segment_starts=None):
        return self.logits(self(input_ids, positions, segment_ids, segment_starts))


class ValueModel(nn.Module):
    """Critic / reward model: the backbone with HF's token-classification head `score` (num_labels=1)."""

    cfg: ModelConfig
    dtype: Any = jnp.float32
    param_dtype: Any = jnp.float32
    remat: str = "none"
    attention_impl: str | None = None
    score_bias: bool = True
    attention_window: int | None = None
    scan_unroll: int = 1
    lora: LoraSpec = LoraSpec()
    prevent_cse: bool = False

    def setup(self):
        self.model = Decoder(self.cfg, self.dtype, self.param_dtype, self.remat, self.attention_impl,
                             self.attention_window, self.scan_unroll, self.lora, self.prevent_cse)
        # under LoRA the head is trained in full while the base is frozen in the compute dtype: keep it float32
        score_dtype = wide(self.param_dtype) if self.lora.rank else self.param_dtype
        self.score = Linear(1, ("score", "embed"), self.score_bias, dtype=self.dtype, param_dtype=score_dtype)

    def __call__(self, input_ids, positions, segment_ids, segment_starts=None) -> Float[Array, "b t"]:
        hidden = self.model(input_ids, positions, segment_ids, segment_starts)
        out = self.score(hidden)[..., 0]
        return out.astype(wide(out.dtype))
