"""Softmax-attention sequence layers over jagged rows: SASRec's block and eSASRec's gated (LiGR) block, the
comparison towers of the next-item benchmarks (gem_jax/model/seqrec.py picks one by `arch`).

  sasrec   (Kang & McAuley, ICDM 2018, as RecTools' SASRecTransformerLayer computes it)
             q = LN(x);  x = q + Dropout(MHA(q, x, x))
             z = LN(x);  x = z + Dropout(W2 Dropout(ReLU(W1 z)))          hidden = ffn_multiplier * D
           the tower ends with one more LayerNorm. The residuals start from the normalized input, as in the
           original code (not x + f(LN(x))).
  esasrec  (Tikhonovich et al., RecSys 2025, arXiv 2508.06450; the LiGR layer of Gu et al. 2025)
             x = x + sigmoid(Wg1 x + b1) * Dropout(MHA(LN(x)))
             x = x + sigmoid(Wg2 x + b2) * Dropout(W2 Dropout(SiLU(W1 LN(x)) * W3 LN(x)))   W1-3 without bias
           and no final LayerNorm.

Attention is causal softmax attention inside each row through gem_jax.ops.jagged_softmax_attention (no
B x N padding here); heads split D evenly. Dropout on the attention probabilities, which RecTools also
applies, is not done (the jagged kernels have none).

Letters: T token capacity, D model width, H heads, F feed-forward width.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from gem_jax import ops
from gem_jax.jagged import Jagged
from gem_jax.model.config import ModelConfig
from gem_jax.model.layers import Dense, LayerNorm, dropout

ARCHS = ("sasrec", "esasrec")


class SoftmaxBlock(nnx.Module):
  """One SASRec or eSASRec block (module docstring); `site` names its Dense layers."""

  def __init__(self, arch: str, cfg: ModelConfig, max_seq_len: int, *, ffn_multiplier: int, dropout_rate: float,
               attn_impl: str, site: str, rngs: nnx.Rngs, attn_block: int = 0, attn_group: int = 0):
    """attn_block, attn_group: the xla softmax loop's tile edge and tiles per step (0: its defaults)."""
    if arch not in ARCHS:
      raise ValueError(f"SoftmaxBlock: arch must be one of {ARCHS}, got {arch!r}")
    d, h = cfg.model_dim, cfg.hstu.num_heads
    if d % h:
      raise ValueError(f"SoftmaxBlock: {h} heads do not divide the width {d}")
    self.arch, self.num_heads, self.max_seq_len = arch, h, max_seq_len
    self.dropout_rate, self.attn_impl = dropout_rate, attn_impl
    self.attn_block, self.attn_group = attn_block or None, attn_group or None
    f = ffn_multiplier * d
    dense = lambda n_in, n_out, name, **kw: Dense(n_in, n_out, ("embed", "mlp"), cfg, site=f"{site}.{name}",
                                                  rngs=rngs, **kw)
    self.norm_attn = LayerNorm(d, cfg, rngs=rngs)
    self.q, self.kv, self.attn_out = dense(d, d, "q"), dense(d, 2 * d, "kv"), dense(d, d, "attn_out")
    self.norm_ffn = LayerNorm(d, cfg, rngs=rngs)
    if arch == "sasrec":
      self.ffn_in, self.ffn_out = dense(d, f, "ffn_in"), dense(f, d, "ffn_out")
    else:
      self.ffn_in = dense(d, 2 * f, "ffn_in", use_bias=False)   # [W1 | W3]
      self.ffn_out = dense(f, d, "ffn_out", use_bias=False)
      self.gate_attn, self.gate_ffn = dense(d, d, "gate_attn"), dense(d, d, "gate_ffn")

  def _attention(self, q_TxD, kv_TxD, offsets):
    t, d = q_TxD.shape
    h = self.num_heads
    k_TxD, v_TxD = jnp.split(self.kv(kv_TxD), 2, axis=-1)
    heads = lambda x: x.reshape(t, h, d // h)
    out = ops.jagged_softmax_attention(heads(self.q(q_TxD)), heads(k_TxD), heads(v_TxD), offsets,
                                       max_seq_len=self.max_seq_len, scale=(d // h) ** -0.5, causal=True,
                                       impl=self.attn_impl, block=self.attn_block, group=self.attn_group)
    return self.attn_out(out.reshape(t, d))

  def __call__(self, x: Jagged, *, dropout_rng=None) -> Jagged:
    rngs = [None] * 3 if dropout_rng is None else list(jax.random.split(dropout_rng, 3))
    drop = lambda y, i: dropout(y, self.dropout_rate, rngs[i])
    x_TxD = x.values
    if self.arch == "sasrec":
      q_TxD = self.norm_attn(x_TxD)
      x_TxD = q_TxD + drop(self._attention(q_TxD, x_TxD, x.offsets), 0)
      z_TxD = self.norm_ffn(x_TxD)
      return x.replace_values(z_TxD + drop(self.ffn_out(drop(jax.nn.relu(self.ffn_in(z_TxD)), 1)), 2))
    normed_TxD = self.norm_attn(x_TxD)
    attn_TxD = drop(self._attention(normed_TxD, normed_TxD, x.offsets), 0)
    x_TxD = x_TxD + jax.nn.sigmoid(self.gate_attn(x_TxD)) * attn_TxD
    return x.replace_values(_gated_ffn(self, x_TxD, lambda y, i: drop(y, i + 1)))


def _gated_ffn(layers, x_TxD, drop):
  """x + sigmoid(Wg x + b) * Dropout(W2 Dropout(SiLU(W1 LN(x)) * W3 LN(x))) with `layers`' norm_ffn, ffn_in
  ([W1 | W3]), ffn_out and gate_ffn; drop(y, i) is the i-th dropout (0, 1)."""
  a_TxF, b_TxF = jnp.split(layers.ffn_in(layers.norm_ffn(x_TxD)), 2, axis=-1)
  ffn_TxD = drop(layers.ffn_out(drop(jax.nn.silu(a_TxF) * b_TxF, 0)), 1)
  return x_TxD + jax.nn.sigmoid(layers.gate_ffn(x_TxD)) * ffn_TxD


class GatedFFN(nnx.Module):
  """eSASRec's gated feed-forward half on its own (module docstring, esasrec's second line), width
  ffn_multiplier * D: what the next-item model's `hstu_ffn` puts after each HSTU layer, which has none."""

  def __init__(self, cfg: ModelConfig, *, ffn_multiplier: int, dropout_rate: float, site: str, rngs: nnx.Rngs):
    d = cfg.model_dim
    f = ffn_multiplier * d
    dense = lambda n_in, n_out, name, **kw: Dense(n_in, n_out, ("embed", "mlp"), cfg, site=f"{site}.{name}",
                                                  rngs=rngs, **kw)
    self.dropout_rate = dropout_rate
    self.norm_ffn = LayerNorm(d, cfg, rngs=rngs)
    self.ffn_in = dense(d, 2 * f, "ffn_in", use_bias=False)   # [W1 | W3]
    self.ffn_out = dense(f, d, "ffn_out", use_bias=False)
    self.gate_ffn = dense(d, d, "gate_ffn")

  def __call__(self, x: Jagged, *, dropout_rng=None) -> Jagged:
    rngs = [None] * 2 if dropout_rng is None else list(jax.random.split(dropout_rng, 2))
    return x.replace_values(_gated_ffn(self, x.values, lambda y, i: dropout(y, self.dropout_rate, rngs[i])))
