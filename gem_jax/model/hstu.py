"""One HSTU layer over jagged token rows: the sequence arch of a GEM layer.

  x -> LayerNorm -> Linear to (u, v, q, k) -> SiLU -> HSTU attention (SiLU, no softmax, / max_seq_len)
    -> LayerNorm(attn) * u -> Linear -> + x

Tensor parallel over heads (gem_jax/model/layers.py): the (u, v, q, k) projection is column parallel
with head-major columns, attention runs on this device's heads, the norm sums its statistics over the
head slices and the output projection is row parallel.

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

from gem_jax import ops
from gem_jax.jagged import Jagged
from gem_jax.model.config import ModelConfig
from gem_jax.model.layers import Dense, LayerNorm, sharded


class HSTULayer(nnx.Module):
  """`max_seq_len`: the static bound on every row's length (C + kept history + targets)."""

  def __init__(self, cfg: ModelConfig, max_seq_len: int, *, rngs: nnx.Rngs):
    h = cfg.hstu
    self.num_heads, self.head_dim, self.value_dim = h.num_heads, h.head_dim, h.value_dim
    self.max_seq_len = max_seq_len
    self.num_contextual = h.num_contextual
    self.attn_impl = h.attn_impl
    d, hdv = cfg.model_dim, h.num_heads * h.value_dim
    self.norm_in = LayerNorm(d, cfg, rngs=rngs)
    self.uvqk = Dense(d, 2 * hdv + 2 * h.num_heads * h.head_dim, ("embed", "mlp"), cfg, rngs=rngs)
    # Normalizes across heads; under tensor parallelism its statistics are summed over the head slices.
    self.norm_attn = LayerNorm(hdv, cfg, rngs=rngs, tensor_parallel=True)
    self.out = Dense(hdv, d, ("mlp", "embed"), cfg, rngs=rngs)
    # Zero init: the layer starts position-agnostic and learns how much recency matters.
    self.rel_bias_HxR = nnx.Param(
        sharded(nnx.initializers.zeros_init(), ("heads", None))(
            rngs.params(), (h.num_heads, h.rel_pos_buckets), cfg.params_dtype))

  def __call__(self, x: Jagged, num_targets_B=None) -> Jagged:
    """x: Jagged(T x D) rows laid out as in the module docstring -> Jagged(T x D), same offsets.
    Padding slots of the output hold no meaning (callers read real tokens only)."""
    values_TxD = x.values
    cap = x.capacity
    dh, dv = self.head_dim, self.value_dim
    uvqk_TxP = jax.nn.silu(self.uvqk(self.norm_in(values_TxD)))
    # Head-major columns ([u v q k] of head 0, then head 1, ...), so a tensor-parallel slice of the
    # columns is a whole number of heads; hh is the number of heads this device holds.
    hh = uvqk_TxP.shape[-1] // (2 * dv + 2 * dh)
    u_TxHxDv, v_TxHxDv, q_TxHxDh, k_TxHxDh = jnp.split(uvqk_TxP.reshape(cap, hh, 2 * dv + 2 * dh),
                                                      [dv, 2 * dv, 2 * dv + dh], axis=-1)
    attn_TxHxDv = ops.hstu_attention(
        q_TxHxDh, k_TxHxDh, v_TxHxDv, x.offsets, max_seq_len=self.max_seq_len, alpha=dh ** -0.5, causal=True,
        num_targets=num_targets_B, contextual_seq_len=self.num_contextual, rel_bias_HxR=self.rel_bias_HxR[...],
        impl=self.attn_impl)
    gated_TxHDv = self.norm_attn(attn_TxHxDv.reshape(cap, hh * dv)) * u_TxHxDv.reshape(cap, hh * dv)
    return x.replace_values(values_TxD + self.out(gated_TxHDv))
