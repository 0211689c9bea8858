"""One HSTU layer over jagged token rows: the sequence arch of a GEM layer.

  x -> LayerNorm -> Linear to (u, v, q, k) -> SiLU -> HSTU attention (SiLU, no softmax, / max_seq_len)
    -> LayerNorm(attn) * u -> dropout -> Linear -> + x

That is the form of HSTU's research code (layer_form "research", the default). layer_form "stu" is
generative-recommenders' production STU layer: SiLU on u only (q, k, v stay linear), and the output
projection, without bias, reads the concatenation [u, attn, LayerNorm(attn) * u].

Dropout (cfg.hstu.dropout_rate, HSTU's "linear dropout") applies only when the caller passes a
`dropout_rng`; without one the layer is deterministic (evaluation). GEM's train step passes one, so a
positive rate acts in training; its default is 0.

Tensor parallel over heads (gem_jax/model/layers.py): the (u, v, q, k) projection is column parallel
with head-major columns, attention runs on this device's heads, the norm sums its statistics over the
head slices and the output projection is row parallel.

Context parallel over tokens: each device projects and attends for one slice of the token slots, with
the keys and values of all slices gathered (so attention still covers each query's whole row; the
query-block attention in pallas_kernels/hstu_attention/query_block.py handles rows cut by a slice), and
the outputs are gathered back. The rest of the GEM layer runs on the full layout.

Each row is [C contextual tokens] ++ history ++ [num_targets candidate tokens]: the attention mask keeps
history causal, lets contextual tokens see (and be seen by) the history, and lets the targets see
everything before them but not each other (pallas_kernels/hstu_attention/reference.py has the exact
mask). Tokens of different rows never meet. The attention goes through gem_jax.ops, so the kernel
(xla / pallas / triton) is chosen by cfg.hstu.attn_impl; this module never pads to B x N itself.

Letters: T token capacity, B rows, D model width, H heads, Dh q/k width, Dv value width, R buckets.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from gem_jax import ops, runtime
from gem_jax.jagged import Jagged
from gem_jax.model.config import ModelConfig
from gem_jax.model import layers
from gem_jax.model.layers import Dense, LayerNorm, sharded


class HSTULayer(nnx.Module):
  """`max_seq_len`: the static bound on every row's length (C + kept history + targets); `site`: this
  layer's path in the model (its Dense layers are `site`.uvqk and `site`.out)."""

  def __init__(self, cfg: ModelConfig, max_seq_len: int, *, site: str, rngs: nnx.Rngs):
    h = cfg.hstu
    self.num_heads, self.head_dim, self.value_dim = h.num_heads, h.head_dim, h.value_dim
    self.max_seq_len = max_seq_len
    self.qk_scale = h.qk_scale or h.head_dim ** -0.5
    self.num_contextual = h.num_contextual
    self.attn_impl = h.attn_impl
    tiles = h.tiles()
    self.attn_tiles = ops.TileConfig(*tiles) if isinstance(tiles, tuple) else tiles
    self.dropout_rate = h.dropout_rate
    self.stu = h.layer_form == "stu"
    d, hdv = cfg.model_dim, h.num_heads * h.value_dim
    self.norm_in = LayerNorm(d, cfg, rngs=rngs)
    self.uvqk = Dense(d, 2 * hdv + 2 * h.num_heads * h.head_dim, ("embed", "mlp"), cfg, site=f"{site}.uvqk",
                      rngs=rngs)
    # Normalizes across heads; under tensor parallelism its statistics are summed over the head slices.
    self.norm_attn = LayerNorm(hdv, cfg, rngs=rngs, tensor_parallel=True)
    # "stu": the output projection reads [u, attn, u * LN(attn)] per head (head-major, so a tensor-parallel
    # slice of its rows is still a whole number of heads) and has no bias.
    self.out = Dense(3 * hdv if self.stu else hdv, d, ("mlp", "embed"), cfg, site=f"{site}.out", rngs=rngs,
                     use_bias=not self.stu)
    # Zero init: the layer starts position-agnostic and learns how much recency matters. With no buckets
    # (rel_pos_buckets=0) the layer has no bias at all, and the attention adds none.
    self.rel_bias_HxR = nnx.Param(
        sharded(nnx.initializers.zeros_init(), ("heads", None))(
            rngs.params(), (h.num_heads, h.rel_pos_buckets), cfg.params_dtype)) if h.rel_pos_buckets else None

  def __call__(self, x: Jagged, num_targets_B=None, *, dropout_rng=None) -> Jagged:
    """x: Jagged(T x D) rows laid out as in the module docstring -> Jagged(T x D), same offsets.
    Padding slots of the output hold no meaning (callers read real tokens only)."""
    cp = runtime.current().context
    if cp is not None and cp.size > 1:
      return self._context_parallel(x, num_targets_B, cp, dropout_rng)
    values_TxD = x.values
    cap = x.capacity
    u_TxHxDv, v_TxHxDv, q_TxHxDh, k_TxHxDh = self._project(values_TxD)
    attn_TxHxDv = ops.hstu_attention(
        q_TxHxDh, k_TxHxDh, v_TxHxDv, x.offsets, max_seq_len=self.max_seq_len, alpha=self.qk_scale,
        causal=True, num_targets=num_targets_B, contextual_seq_len=self.num_contextual,
        rel_bias_HxR=self._rel_bias(), impl=self.attn_impl, tiles=self.attn_tiles)
    return x.replace_values(values_TxD + self._output(attn_TxHxDv, u_TxHxDv, dropout_rng))

  def _rel_bias(self):
    return None if self.rel_bias_HxR is None else self.rel_bias_HxR[...]

  def _project(self, values_TxD):
    """-> (u, v, q, k), T x H x (Dv | Dh), H the heads this device holds."""
    dh, dv = self.head_dim, self.value_dim
    cap = values_TxD.shape[0]
    uvqk_TxP = self.uvqk(self.norm_in(values_TxD))
    if not self.stu:
      uvqk_TxP = jax.nn.silu(uvqk_TxP)
    # Head-major columns ([u v q k] of head 0, then head 1, ...), so a tensor-parallel slice of the
    # columns is a whole number of heads; hh is the number of heads this device holds.
    if uvqk_TxP.shape[-1] % (2 * dv + 2 * dh):
      raise ValueError(f"HSTU: this device's slice of uvqk has {uvqk_TxP.shape[-1]} columns, not a whole number "
                       f"of heads ({2 * dv + 2 * dh} each): num_heads={self.num_heads} must divide over the "
                       "mesh's tensor axis")
    hh = uvqk_TxP.shape[-1] // (2 * dv + 2 * dh)
    u, v, q, k = jnp.split(uvqk_TxP.reshape(cap, hh, 2 * dv + 2 * dh), [dv, 2 * dv, 2 * dv + dh], axis=-1)
    return (jax.nn.silu(u), v, q, k) if self.stu else (u, v, q, k)

  def _output(self, attn_TxHxDv, u_TxHxDv, dropout_rng=None):
    cap, hh, dv = attn_TxHxDv.shape
    gated_TxHDv = self.norm_attn(attn_TxHxDv.reshape(cap, hh * dv)) * u_TxHxDv.reshape(cap, hh * dv)
    if self.stu:
      parts = (u_TxHxDv, attn_TxHxDv.astype(gated_TxHDv.dtype), gated_TxHDv.reshape(cap, hh, dv))
      gated_TxHDv = jnp.concatenate(parts, axis=-1).reshape(cap, hh * 3 * dv)
    return self.out(layers.dropout(gated_TxHDv, self.dropout_rate, dropout_rng))

  def _context_parallel(self, x: Jagged, num_targets_B, cp, dropout_rng=None) -> Jagged:
    """This device projects and attends for one contiguous slice of the token slots (rows may straddle
    slices); keys and values of all slices are gathered so every query sees its whole row, and the
    outputs of all slices are gathered back into the full layout."""
    values_TxD, cap = x.values, x.capacity
    s = -(-cap // cp.size)  # slots per slice; the layout is padded at the tail to size * s
    padded_TxD = jnp.pad(values_TxD, ((0, s * cp.size - cap), (0, 0)))
    start = cp.index() * s
    local_SxD = jax.lax.dynamic_slice_in_dim(padded_TxD, start, s)
    u_SxHxDv, v_SxHxDv, q_SxHxDh, k_SxHxDh = self._project(local_SxD)
    attn_SxHxDv = ops.hstu_attention_query_block(
        q_SxHxDh, cp.all_gather(k_SxHxDh), cp.all_gather(v_SxHxDv), x.offsets, start,
        max_seq_len=self.max_seq_len, alpha=self.qk_scale, causal=True, num_targets=num_targets_B,
        contextual_seq_len=self.num_contextual, rel_bias_HxR=self._rel_bias())
    if dropout_rng is not None:  # each slice draws its own mask
      dropout_rng = jax.random.fold_in(dropout_rng, cp.index())
    out_TxD = cp.all_gather(self._output(attn_SxHxDv, u_SxHxDv, dropout_rng))[:cap]
    return x.replace_values(values_TxD + out_TxD)
