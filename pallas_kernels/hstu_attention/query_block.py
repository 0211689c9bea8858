"""HSTU attention for a contiguous block of query tokens against all keys: context parallelism's kernel.

Under context parallelism (gem_jax/model/hstu.py) a device holds the queries of token slots
[q_start, q_start + Q) of the jagged layout (a slice that may cut rows anywhere) and the keys and values
of every slot (all-gathered). Each query i of row r reads the keys of its own row only. The block is
worked in chunks of C consecutive query slots: the keys any query of a chunk can read lie in one
contiguous window of slots that starts at the row start of the chunk's first query, W = N + C slots long
for causal attention (a key never follows its query) and 2N + C where a query may read its whole row
(bidirectional, or the contextual tokens of HSTU's mask), so a chunk is one dynamic
slice of k and v and two einsums on C x W x H. The chunks run in a scan whose body is rematerialized
in the backward: memory is one chunk's C x W x H logits, never Q x N x H x D (what gathering every
query's N keys costs: 35 GB per device for `large` with context 2, found by compiling its train step for
an H200 topology, experiments/compile_for.py), T x T or B x N x N. Work is Q x W x H x (D + Dv), about
(N + C) / N times the causal pairs of the block's rows. The mask, the relative-position bias and the 1/N
normalization are those of reference.py (via masks.py), so a block computes exactly the rows of the
whole-layout attention it covers, up to the order of f32 additions.

Letters: Q query slots in the block, C chunk, W key window, T key capacity, B rows, H heads, D q/k width,
Dv value width, N max_seq_len, R bias buckets.

This path is XLA only; a Pallas version with the same signature is future work. Query slots past
offsets[B] (tail padding) give zeros.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from pallas_kernels.hstu_attention import masks
from pallas_kernels.hstu_attention.reference import relative_position_bucket

CHUNK = 256


def hstu_attention_query_block(q_QxHxD, k_TxHxD, v_TxHxDv, offsets_Bp1, q_start, *, max_seq_len: int,
                               alpha: float, causal: bool = True, num_targets=None, max_attn_len: int = 0,
                               contextual_seq_len: int = 0, rel_bias_HxR=None, chunk: int = CHUNK):
  """out_QxHxDv (v's dtype, f32 accumulation) for queries at slots q_start + [0, Q) of the jagged layout
  whose keys and values are k_TxHxD / v_TxHxDv (all T slots). q_start may be traced."""
  nq, num_heads, _ = q_QxHxD.shape
  capacity = k_TxHxD.shape[0]
  if k_TxHxD.shape[1:] != q_QxHxD.shape[1:] or v_TxHxDv.shape[:2] != (capacity, num_heads):
    raise ValueError(f"hstu_attention_query_block: q {q_QxHxD.shape}, k {k_TxHxD.shape}, "
                     f"v {v_TxHxDv.shape} disagree")
  if rel_bias_HxR is not None and rel_bias_HxR.shape[0] != num_heads:
    raise ValueError(f"hstu_attention_query_block: rel_bias has {rel_bias_HxR.shape[0]} heads, q has {num_heads}")
  if chunk < 1:
    raise ValueError(f"hstu_attention_query_block: chunk must be >= 1, got {chunk}")
  if nq == 0:
    return jnp.zeros((0, num_heads, v_TxHxDv.shape[2]), v_TxHxDv.dtype)
  n = max_seq_len
  c_len = min(chunk, nq)
  num_chunks = -(-nq // c_len)
  # Causal queries read keys up to themselves; contextual ones (the first c of a row) and every query of a
  # bidirectional mask read their whole row, up to N - 1 slots past their own.
  width = n + c_len if causal and contextual_seq_len == 0 else 2 * n + c_len
  offsets_Bp1 = jnp.asarray(offsets_Bp1, jnp.int32)
  num_rows = offsets_Bp1.shape[0] - 1
  targets_B = None if num_targets is None else jnp.asarray(num_targets, jnp.int32)
  # Zero rows past the end: a window starting near T stays in bounds instead of being shifted back.
  q_pad = jnp.pad(q_QxHxD, ((0, num_chunks * c_len - nq), (0, 0), (0, 0)))
  k_pad = jnp.pad(jnp.asarray(k_TxHxD), ((0, width), (0, 0), (0, 0)))
  v_pad = jnp.pad(jnp.asarray(v_TxHxDv), ((0, width), (0, 0), (0, 0)))
  c = contextual_seq_len

  @jax.checkpoint
  def one_chunk(q_pad, k_pad, v_pad, bias_HxR, first):
    slot_C = jnp.asarray(q_start, jnp.int32) + first + jnp.arange(c_len, dtype=jnp.int32)
    valid_C = (slot_C < offsets_Bp1[-1]) & (first + jnp.arange(c_len) < nq)
    row_C = jnp.clip(jnp.searchsorted(offsets_Bp1, slot_C, side="right").astype(jnp.int32) - 1, 0, num_rows - 1)
    start_C = offsets_Bp1[row_C]
    n_in_Cx1 = (offsets_Bp1[row_C + 1] - start_C)[:, None]
    i_Cx1 = (slot_C - start_C)[:, None]
    t_Cx1 = jnp.zeros_like(n_in_Cx1) if targets_B is None else targets_B[row_C][:, None]
    max_pos_Cx1 = n_in_Cx1 - (c - 1 if c > 0 else 0) - t_Cx1
    window0 = jnp.minimum(start_C[0], capacity)
    j_CxW = window0 + jnp.arange(width, dtype=jnp.int32)[None, :] - start_C[:, None]  # key position in its row
    mask_CxW, dist_CxW = masks.tile_mask(i_Cx1, j_CxW, n_in_Cx1, max_pos_Cx1, causal=causal,
                                         max_attn_len=max_attn_len, contextual_seq_len=c,
                                         has_targets=targets_B is not None)
    mask_CxW = mask_CxW & (j_CxW >= 0) & valid_C[:, None]
    q_CxHxD = jax.lax.dynamic_slice_in_dim(q_pad, first, c_len)
    k_WxHxD = jax.lax.dynamic_slice_in_dim(k_pad, window0, width)
    v_WxHxDv = jax.lax.dynamic_slice_in_dim(v_pad, window0, width)
    logits_CxHxW = alpha * jnp.einsum("chd,whd->chw", q_CxHxD, k_WxHxD, preferred_element_type=jnp.float32)
    if bias_HxR is not None:
      bias_HxCxW = jnp.asarray(bias_HxR, jnp.float32)[:, relative_position_bucket(dist_CxW, bias_HxR.shape[1])]
      logits_CxHxW = logits_CxHxW + jnp.transpose(bias_HxCxW, (1, 0, 2))
    # `where`, not a multiply, so that masked-out logits can never turn into NaN.
    weights_CxHxW = jnp.where(mask_CxW[:, None, :], jax.nn.silu(logits_CxHxW), 0.0) / n
    return jnp.einsum("chw,whd->chd", weights_CxHxW, v_WxHxDv.astype(jnp.float32),
                      preferred_element_type=jnp.float32)

  firsts = jnp.arange(num_chunks, dtype=jnp.int32) * c_len
  out = jax.lax.map(lambda first: one_chunk(q_pad, k_pad, v_pad, rel_bias_HxR, first), firsts)
  return out.reshape((num_chunks * c_len,) + out.shape[2:])[:nq].astype(v_TxHxDv.dtype)
