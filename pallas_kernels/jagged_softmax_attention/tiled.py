"""Jagged softmax attention in plain jnp/lax: the HSTU tile list walked by a dynamic online-softmax loop.

Same contract as reference.jagged_softmax_attention (the spec), plus `block`. The (row, query block, key
block) tiles the HSTU mask needs come from pallas_kernels/hstu_attention/tiled.py (same masks, so the
same tile list); a lax.fori_loop with the dynamic tile count walks them. The list is ordered by (row,
query block), so every query row sees its key tiles back to back and an online softmax can keep its
running max m, sum l and accumulator acc per token in the loop carry (f32). Executed work is
n_tiles * block^2 pairs, which follows the real lengths (executed_pairs reports it).

The backward is a custom_vjp (reverse mode cannot go through a dynamic-trip-count loop): the forward
saves lse = m + log(l) per token, the backward recomputes p = exp(s - lse) tile by tile, with
Delta = sum(dout * out) per token, to accumulate dq, dk and dv in one loop.

Letters: T token capacity, Tp = T + block (padded so a tile starting inside a row is always in
bounds), B rows, H heads, D q/k width, Dv value width, N max_seq_len, Q = K = block.
This module must never build a T x T or B x N x N array, and imports only jax and sibling kernel modules.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax

# The tile list, tile masks and row loads are the HSTU tiled path's own: one construction, one mask.
from pallas_kernels.hstu_attention import tiled as hstu_tiled
from pallas_kernels.hstu_attention.tiled import Ctx, Static, add_rows, dot, load, pad
from pallas_kernels.jagged_softmax_attention.reference import check_offsets, check_shapes

BLOCK = 16   # this loop's default tile edge (one tile per step: the online softmax is kept per query block)


def executed_pairs(offsets_Bp1, max_seq_len: int, block: int = BLOCK, **mask):
  """n_tiles * block^2 of this loop (hstu_attention/tiled.py enumerates the same tiles)."""
  return hstu_tiled.executed_pairs(offsets_Bp1, max_seq_len, block, **mask)


_NAME = "jagged_softmax_attention"


def _targets(num_targets, num_rows: int):
  if num_targets is None:
    return jnp.zeros((num_rows,), jnp.int32)
  num_targets = jnp.asarray(num_targets, jnp.int32)
  if num_targets.shape != (num_rows,):
    raise ValueError(f"{_NAME}: num_targets has shape {num_targets.shape}, expected ({num_rows},)")
  return num_targets


def _set_rows(x_TpxW, start, value_QxW):
  return lax.dynamic_update_slice_in_dim(x_TpxW, value_QxW, start, axis=0)


def _get_rows(x_TpxW, start, size: int):
  return lax.dynamic_slice_in_dim(x_TpxW, start, size, axis=0)


def _forward(s: Static, q_TxHxD, k_TxHxD, v_TxHxDv, offsets_Bp1, targets_B):
  """(out_TxHxDv f32, lse_TxH f32); tokens with no allowed key (padding) get out 0 and lse 0."""
  capacity, num_heads, _ = q_TxHxD.shape
  ctx = Ctx(offsets_Bp1, targets_B, None, capacity, s)
  q_p, k_p, v_p = (pad(x, s.block) for x in (q_TxHxD, k_TxHxD, v_TxHxDv))

  def body(t, carry):
    m_TpxH, l_TpxH, acc_TpxHxDv = carry
    q_at, _, _, _, v_KxHxDv, mask_QxK, _, logits_HxQxK = ctx.tile(t, q_p, k_p, v_p)
    # Query rows past the row's end (maybe the next rows, not yet visited) have an all-False mask:
    # below, their m, l and acc come back bit for bit unchanged (alpha is exactly 1 or l, acc are 0).
    mask_1xQxK = mask_QxK[None]
    m_old_QxH = _get_rows(m_TpxH, q_at, s.block)
    tile_max_QxH = jnp.max(jnp.where(mask_1xQxK, logits_HxQxK, -jnp.inf), axis=2).T
    m_new_QxH = jnp.maximum(m_old_QxH, tile_max_QxH)
    # A query with no key yet keeps m = -inf; shift by 0 there so nothing computes inf - inf.
    shift_QxH = jnp.where(jnp.isfinite(m_new_QxH), m_new_QxH, 0.0)
    rescale_QxH = jnp.where(jnp.isfinite(m_old_QxH), jnp.exp(m_old_QxH - shift_QxH), 0.0)
    # `where`, not a multiply, so that masked-out logits can never turn into NaN.
    p_HxQxK = jnp.where(mask_1xQxK, jnp.exp(logits_HxQxK - shift_QxH.T[:, :, None]), 0.0)
    l_QxH = _get_rows(l_TpxH, q_at, s.block) * rescale_QxH + jnp.sum(p_HxQxK, axis=2).T
    pv_QxHxDv = dot("hqk,khd->qhd", p_HxQxK, v_KxHxDv.astype(jnp.float32))
    acc_QxHxDv = _get_rows(acc_TpxHxDv, q_at, s.block) * rescale_QxH[:, :, None] + pv_QxHxDv
    return (_set_rows(m_TpxH, q_at, m_new_QxH), _set_rows(l_TpxH, q_at, l_QxH),
            _set_rows(acc_TpxHxDv, q_at, acc_QxHxDv))

  padded = capacity + s.block
  init = (jnp.full((padded, num_heads), -jnp.inf, jnp.float32), jnp.zeros((padded, num_heads), jnp.float32),
          jnp.zeros((padded,) + v_TxHxDv.shape[1:], jnp.float32))
  m_TpxH, l_TpxH, acc_TpxHxDv = lax.fori_loop(0, ctx.n_tiles, body, init)
  m_TxH, l_TxH, acc_TxHxDv = m_TpxH[:capacity], l_TpxH[:capacity], acc_TpxHxDv[:capacity]
  seen_TxH = l_TxH > 0
  safe_l_TxH = jnp.where(seen_TxH, l_TxH, 1.0)
  out_TxHxDv = jnp.where(seen_TxH[:, :, None], acc_TxHxDv / safe_l_TxH[:, :, None], 0.0)
  lse_TxH = jnp.where(seen_TxH, m_TxH + jnp.log(safe_l_TxH), 0.0)
  return out_TxHxDv, lse_TxH


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _attention(s, q_TxHxD, k_TxHxD, v_TxHxDv, offsets_Bp1, targets_B):
  out_TxHxDv, _ = _forward(s, q_TxHxD, k_TxHxD, v_TxHxDv, offsets_Bp1, targets_B)
  return out_TxHxDv.astype(v_TxHxDv.dtype)


def _attention_fwd(s, q_TxHxD, k_TxHxD, v_TxHxDv, offsets_Bp1, targets_B):
  out_TxHxDv, lse_TxH = _forward(s, q_TxHxD, k_TxHxD, v_TxHxDv, offsets_Bp1, targets_B)
  # Delta uses the f32 output, not its v-dtype rounding: the exact softmax Jacobian needs the exact out.
  residuals = (q_TxHxD, k_TxHxD, v_TxHxDv, offsets_Bp1, targets_B, out_TxHxDv, lse_TxH)
  return out_TxHxDv.astype(v_TxHxDv.dtype), residuals


def _attention_bwd(s, residuals, dout_TxHxDv):
  q_TxHxD, k_TxHxD, v_TxHxDv, offsets_Bp1, targets_B, out_TxHxDv, lse_TxH = residuals
  capacity = q_TxHxD.shape[0]
  ctx = Ctx(offsets_Bp1, targets_B, None, capacity, s)
  dout_TxHxDv = dout_TxHxDv.astype(jnp.float32)
  delta_TxH = jnp.sum(dout_TxHxDv * out_TxHxDv, axis=2)
  q_p, k_p, v_p, do_p = (pad(x, s.block) for x in (q_TxHxD, k_TxHxD, v_TxHxDv, dout_TxHxDv))
  lse_p, delta_p = (jnp.pad(x, ((0, s.block), (0, 0))) for x in (lse_TxH, delta_TxH))

  def body(t, carry):
    dq_TpxHxD, dk_TpxHxD, dv_TpxHxDv = carry
    q_at, k_at, q_QxHxD, k_KxHxD, v_KxHxDv, mask_QxK, _, logits_HxQxK = ctx.tile(t, q_p, k_p, v_p)
    # Same row clip as q: rows past the row's end (or tail padding) read as zero.
    rows_left = ctx.n_in_B[ctx.tiles_Cx3[t, 0]] - ctx.tiles_Cx3[t, 1]
    do_QxHxDv = load(do_p, q_at, 0, rows_left, s.block)
    lse_HxQx1 = _get_rows(lse_p, q_at, s.block).T[:, :, None]
    delta_HxQx1 = _get_rows(delta_p, q_at, s.block).T[:, :, None]
    p_HxQxK = jnp.where(mask_QxK[None], jnp.exp(logits_HxQxK - lse_HxQx1), 0.0)
    dp_HxQxK = dot("qhd,khd->hqk", do_QxHxDv, v_KxHxDv.astype(jnp.float32))
    # `where`: delta of query rows past the row is another row's (maybe NaN), and p = 0 would not stop it.
    dl_HxQxK = jnp.where(mask_QxK[None], p_HxQxK * (dp_HxQxK - delta_HxQx1), 0.0)
    dq_QxHxD = s.alpha * dot("hqk,khd->qhd", dl_HxQxK, k_KxHxD.astype(jnp.float32))
    dk_KxHxD = s.alpha * dot("hqk,qhd->khd", dl_HxQxK, q_QxHxD.astype(jnp.float32))
    return (add_rows(dq_TpxHxD, q_at, dq_QxHxD), add_rows(dk_TpxHxD, k_at, dk_KxHxD),
            add_rows(dv_TpxHxDv, k_at, dot("hqk,qhd->khd", p_HxQxK, do_QxHxDv)))

  padded = capacity + s.block
  init = (jnp.zeros((padded,) + q_TxHxD.shape[1:], jnp.float32),
          jnp.zeros((padded,) + k_TxHxD.shape[1:], jnp.float32),
          jnp.zeros((padded,) + v_TxHxDv.shape[1:], jnp.float32))
  dq, dk, dv = lax.fori_loop(0, ctx.n_tiles, body, init)
  return (dq[:capacity].astype(q_TxHxD.dtype), dk[:capacity].astype(k_TxHxD.dtype),
          dv[:capacity].astype(v_TxHxDv.dtype), None, None)


_attention.defvjp(_attention_fwd, _attention_bwd)


def jagged_softmax_attention(q_TxHxD, k_TxHxD, v_TxHxDv, offsets_Bp1, *, max_seq_len: int, scale: float,
                             causal: bool = True, num_targets=None, max_attn_len: int = 0,
                             contextual_seq_len: int = 0, block: int = BLOCK):
  """Softmax attention over jagged rows (reference.jagged_softmax_attention's contract), tiled.

  block: tile edge in tokens (queries and keys); executed work is n_tiles * block^2 pairs.
  Returns out_TxHxDv in v's dtype; slots past offsets[B] are zero.
  """
  check_shapes(q_TxHxD, k_TxHxD, v_TxHxDv, _NAME)
  capacity = q_TxHxD.shape[0]
  check_offsets(offsets_Bp1, capacity, max_seq_len, _NAME)
  if block < 1 or max_seq_len < 1:
    raise ValueError(f"{_NAME}: block ({block}) and max_seq_len ({max_seq_len}) must be >= 1")
  offsets_Bp1 = jnp.asarray(offsets_Bp1, jnp.int32)
  num_rows = offsets_Bp1.shape[0] - 1
  targets_B = _targets(num_targets, num_rows)
  if capacity == 0 or num_rows == 0:  # no tokens or no rows: nothing to attend
    return jnp.zeros_like(v_TxHxDv)
  # Static.alpha is the logit multiplier: for softmax attention that is `scale`; there is no bias.
  s = Static(max_seq_len, float(scale), causal, num_targets is not None, max_attn_len,
              contextual_seq_len, block, False)
  return _attention(s, q_TxHxD, k_TxHxD, v_TxHxDv, offsets_Bp1, targets_B)


__all__ = ["executed_pairs", "jagged_softmax_attention"]
