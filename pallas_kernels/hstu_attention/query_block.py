"""HSTU attention for a contiguous block of query tokens against all keys: context parallelism's kernel.

Under context parallelism (gem_jax/model/hstu.py) a device holds the queries of token slots
[q_start, q_start + Q) of the jagged layout (a slice that may cut rows anywhere) and the keys and values
of every slot (all-gathered). Each query i of row r reads the keys of its own row only, so this path
gathers, per query, the N = max_seq_len key slots starting at offsets[r]: Q x N x H work and memory, never
T x T or B x N x N. The mask, the relative-position bias and the 1/N normalization are those of
reference.py (via masks.py), so a block computes exactly the rows of the whole-layout attention it
covers, up to the order of f32 additions.

Letters: Q query slots in the block, T key capacity, B rows, H heads, D q/k width, Dv value width,
N max_seq_len, R bias buckets.

This path is XLA only (a gather plus two einsums); a tiled Pallas version with the same signature is
future work. Query slots past offsets[B] (tail padding) give zeros.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from pallas_kernels.hstu_attention import masks
from pallas_kernels.hstu_attention.reference import relative_position_bucket


def hstu_attention_query_block(q_QxHxD, k_TxHxD, v_TxHxDv, offsets_Bp1, q_start, *, max_seq_len: int,
                               alpha: float, causal: bool = True, num_targets=None, max_attn_len: int = 0,
                               contextual_seq_len: int = 0, rel_bias_HxR=None):
  """out_QxHxDv (v's dtype, f32 accumulation) for queries at slots q_start + [0, Q) of the jagged layout
  whose keys and values are k_TxHxD / v_TxHxDv (all T slots). q_start may be traced."""
  nq, num_heads, _ = q_QxHxD.shape
  capacity = k_TxHxD.shape[0]
  if k_TxHxD.shape[1:] != q_QxHxD.shape[1:] or v_TxHxDv.shape[:2] != (capacity, num_heads):
    raise ValueError(f"hstu_attention_query_block: q {q_QxHxD.shape}, k {k_TxHxD.shape}, "
                     f"v {v_TxHxDv.shape} disagree")
  n = max_seq_len
  k_TxHxD, v_TxHxDv = jnp.asarray(k_TxHxD), jnp.asarray(v_TxHxDv)
  offsets_Bp1 = jnp.asarray(offsets_Bp1, jnp.int32)
  num_rows = offsets_Bp1.shape[0] - 1
  slot_Q = jnp.asarray(q_start, jnp.int32) + jnp.arange(nq, dtype=jnp.int32)
  valid_Q = slot_Q < offsets_Bp1[-1]
  row_Q = jnp.clip(jnp.searchsorted(offsets_Bp1, slot_Q, side="right").astype(jnp.int32) - 1, 0, num_rows - 1)
  start_Q = offsets_Bp1[row_Q]
  n_in_Qx1 = (offsets_Bp1[row_Q + 1] - start_Q)[:, None]
  i_Qx1 = (slot_Q - start_Q)[:, None]
  j_1xN = jnp.arange(n, dtype=jnp.int32)[None, :]
  if num_targets is None:
    t_Qx1 = jnp.zeros_like(n_in_Qx1)
  else:
    t_Qx1 = jnp.asarray(num_targets, jnp.int32)[row_Q][:, None]
  c = contextual_seq_len
  max_pos_Qx1 = n_in_Qx1 - (c - 1 if c > 0 else 0) - t_Qx1
  mask_QxN, dist_QxN = masks.tile_mask(i_Qx1, j_1xN, n_in_Qx1, max_pos_Qx1, causal=causal,
                                       max_attn_len=max_attn_len, contextual_seq_len=c,
                                       has_targets=num_targets is not None)
  mask_QxN = mask_QxN & valid_Q[:, None]

  key_QxN = jnp.clip(start_Q[:, None] + j_1xN, 0, capacity - 1)
  k_QxNxHxD = k_TxHxD[key_QxN]
  v_QxNxHxDv = v_TxHxDv[key_QxN]
  logits_QxHxN = alpha * jnp.einsum("qhd,qnhd->qhn", q_QxHxD, k_QxNxHxD, preferred_element_type=jnp.float32)
  if rel_bias_HxR is not None:
    if rel_bias_HxR.shape[0] != num_heads:
      raise ValueError(f"hstu_attention_query_block: rel_bias has {rel_bias_HxR.shape[0]} heads, q has {num_heads}")
    bias_HxQxN = jnp.asarray(rel_bias_HxR, jnp.float32)[:, relative_position_bucket(dist_QxN, rel_bias_HxR.shape[1])]
    logits_QxHxN = logits_QxHxN + jnp.transpose(bias_HxQxN, (1, 0, 2))
  # `where`, not a multiply, so that masked-out logits can never turn into NaN.
  weights_QxHxN = jnp.where(mask_QxN[:, None, :], jax.nn.silu(logits_QxHxN), 0.0) / n
  out_QxHxDv = jnp.einsum("qhn,qnhd->qhd", weights_QxHxN, v_QxNxHxDv.astype(jnp.float32),
                          preferred_element_type=jnp.float32)
  return out_QxHxDv.astype(v_TxHxDv.dtype)
