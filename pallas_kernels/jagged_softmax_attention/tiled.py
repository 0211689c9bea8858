"""Jagged softmax attention in plain jnp/lax: the HSTU tile list walked by dynamic loops, `group` tiles a step.

Same contract as reference.jagged_softmax_attention (the spec), plus `block` and `group`. The (row, query
block, key block) tiles the HSTU mask needs come from pallas_kernels/hstu_attention/tiled.py (same masks,
same tile list, same batched gathers and scatter-adds); lax.fori_loops with the dynamic group count walk
them, `group` tiles per step, so that tiles of many rows and query blocks share each step's fixed costs
(on a CPU a 16 x 16 tile alone is mostly loop, gather and mask). Tiles of one query block then land in
the same step, which an online softmax (one running max per query, updated tile after tile) cannot
take, so the forward makes two passes: each query's max logit (scatter-max), then the sum of
exp(logit - max) and the weighted values (scatter-add). Executed work is n_tiles * block^2 pairs per
pass, which follows the real lengths (executed_pairs reports it).

The backward is a custom_vjp (reverse mode cannot go through a dynamic-trip-count loop): the forward
saves lse = m + log(l) per token, the backward recomputes p = exp(s - lse) tile by tile, with
Delta = sum(dout * out) per token, to accumulate dq, dk and dv in one loop.

Letters: T token capacity, Tp = T + block (padded so a tile starting inside a row is always in
bounds), B rows, H heads, D q/k width, Dv value width, N max_seq_len, Q = K = block, G = group.
This module must never build a T x T or B x N x N array, and imports only jax and sibling kernel modules.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax

# The tile list, tile masks and row loads are the HSTU tiled path's own: one construction, one mask.
from pallas_kernels.hstu_attention import tiled as hstu_tiled
from pallas_kernels.hstu_attention.tiled import (Ctx, Static, dot, gather_blocks, head_major, scatter_add_blocks,
                                                 token_major)
from pallas_kernels.jagged_softmax_attention.reference import check_offsets, check_shapes

BLOCK = 16   # the default tile edge
GROUP = 8    # the default tiles per loop step


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


def _scatter_max_blocks(x_HxTp, start_G, value_GxHxQ):
  """x[:, start : start + Q] = max(x, value) for each start (starts may repeat)."""
  dims = lax.ScatterDimensionNumbers(update_window_dims=(1, 2), inserted_window_dims=(),
                                     scatter_dims_to_operand_dims=(1,))
  return lax.scatter_max(x_HxTp, start_G[:, None], value_GxHxQ, dims, mode=lax.GatherScatterMode.CLIP)


def _gather_rows(x_HxTp, start_G, size: int):
  """x[:, start : start + size] for each start, as G x H x size x 1."""
  return gather_blocks(x_HxTp[:, :, None], start_G, jnp.ones((start_G.shape[0], size), bool), size)


def _forward(s: Static, q_TxHxD, k_TxHxD, v_TxHxDv, offsets_Bp1, targets_B):
  """(out_TxHxDv f32, lse_TxH f32); tokens with no allowed key (padding) get out 0 and lse 0.

  Two passes over the tile list, `group` tiles per step: the first takes each query's max logit
  (scatter-max), the second sums exp(logit - max) and the weighted values (scatter-add). The logits are
  computed twice, where an online softmax would compute them once but must walk a query block's tiles one
  after another; batching tiles is what pays on a CPU (module docstring)."""
  capacity, num_heads, _ = q_TxHxD.shape
  ctx = Ctx(offsets_Bp1, targets_B, None, capacity, s)
  q_p, k_p, v_p = (head_major(x, s.block) for x in (q_TxHxD, k_TxHxD, v_TxHxDv))
  padded = capacity + s.block

  def max_body(g, m_HxTp):
    q_at_G, _, _, _, _, _, mask_Gx1xQxK, _, logits_GxHxQxK = ctx.step_tiles(g, q_p, k_p, v_p)
    tile_max_GxHxQ = jnp.max(jnp.where(mask_Gx1xQxK, logits_GxHxQxK, -jnp.inf), axis=3)
    return _scatter_max_blocks(m_HxTp, q_at_G, tile_max_GxHxQ)

  m_HxTp = jnp.full((num_heads, padded), -jnp.inf, jnp.float32)
  m_HxTp = lax.fori_loop(0, ctx.n_groups, max_body, m_HxTp)
  # A query with no allowed key keeps m = -inf; shift by 0 there so nothing computes inf - inf.
  shift_HxTp = jnp.where(jnp.isfinite(m_HxTp), m_HxTp, 0.0)

  def sum_body(g, carry):
    l_HxTp, acc_HxTpxDv = carry
    q_at_G, _, _, _, _, v_GxHxKxDv, mask_Gx1xQxK, _, logits_GxHxQxK = ctx.step_tiles(g, q_p, k_p, v_p)
    # `where`, not a multiply, so that masked-out logits can never turn into NaN.
    p_GxHxQxK = jnp.where(mask_Gx1xQxK, jnp.exp(logits_GxHxQxK - _gather_rows(shift_HxTp, q_at_G, s.block)), 0.0)
    l_HxTp = scatter_add_blocks(l_HxTp[:, :, None], q_at_G, jnp.sum(p_GxHxQxK, axis=3, keepdims=True))[:, :, 0]
    pv_GxHxQxDv = dot("ghqk,ghkd->ghqd", p_GxHxQxK, v_GxHxKxDv.astype(jnp.float32))
    return l_HxTp, scatter_add_blocks(acc_HxTpxDv, q_at_G, pv_GxHxQxDv)

  init = (jnp.zeros((num_heads, padded), jnp.float32),
          jnp.zeros((num_heads, padded, v_TxHxDv.shape[2]), jnp.float32))
  l_HxTp, acc_HxTpxDv = lax.fori_loop(0, ctx.n_groups, sum_body, init)
  m_TxH, l_TxH = m_HxTp[:, :capacity].T, l_HxTp[:, :capacity].T
  acc_TxHxDv = token_major(acc_HxTpxDv, capacity, jnp.float32)
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
  q_p, k_p, v_p, do_p = (head_major(x, s.block) for x in (q_TxHxD, k_TxHxD, v_TxHxDv, dout_TxHxDv))
  lse_p, delta_p = (jnp.pad(x, ((0, s.block), (0, 0))).T for x in (lse_TxH, delta_TxH))

  def body(g, carry):
    dq_HxTpxD, dk_HxTpxD, dv_HxTpxDv = carry
    q_at_G, k_at_G, q_valid_GxQ, q_GxHxQxD, k_GxHxKxD, v_GxHxKxDv, mask, _, logits_GxHxQxK = ctx.step_tiles(
        g, q_p, k_p, v_p)
    # Query rows past the row's end (maybe the next row's tokens, or tail padding) read as zero.
    do_GxHxQxDv = gather_blocks(do_p, q_at_G, q_valid_GxQ, s.block)
    p_GxHxQxK = jnp.where(mask, jnp.exp(logits_GxHxQxK - _gather_rows(lse_p, q_at_G, s.block)), 0.0)
    dp_GxHxQxK = dot("ghqd,ghkd->ghqk", do_GxHxQxDv, v_GxHxKxDv.astype(jnp.float32))
    # `where`: delta of query rows past the row is another row's (maybe NaN), and p = 0 would not stop it.
    dl_GxHxQxK = jnp.where(mask, p_GxHxQxK * (dp_GxHxQxK - _gather_rows(delta_p, q_at_G, s.block)), 0.0)
    dq_HxTpxD = scatter_add_blocks(dq_HxTpxD, q_at_G,
                                   s.alpha * dot("ghqk,ghkd->ghqd", dl_GxHxQxK, k_GxHxKxD.astype(jnp.float32)))
    dk_HxTpxD = scatter_add_blocks(dk_HxTpxD, k_at_G,
                                   s.alpha * dot("ghqk,ghqd->ghkd", dl_GxHxQxK, q_GxHxQxD.astype(jnp.float32)))
    dv_HxTpxDv = scatter_add_blocks(dv_HxTpxDv, k_at_G, dot("ghqk,ghqd->ghkd", p_GxHxQxK, do_GxHxQxDv))
    return dq_HxTpxD, dk_HxTpxD, dv_HxTpxDv

  padded = capacity + s.block
  num_heads = q_TxHxD.shape[1]
  init = (jnp.zeros((num_heads, padded, q_TxHxD.shape[2]), jnp.float32),
          jnp.zeros((num_heads, padded, k_TxHxD.shape[2]), jnp.float32),
          jnp.zeros((num_heads, padded, v_TxHxDv.shape[2]), jnp.float32))
  dq, dk, dv = lax.fori_loop(0, ctx.n_groups, body, init)
  return (token_major(dq, capacity, q_TxHxD.dtype), token_major(dk, capacity, k_TxHxD.dtype),
          token_major(dv, capacity, v_TxHxDv.dtype), None, None)


_attention.defvjp(_attention_fwd, _attention_bwd)


def jagged_softmax_attention(q_TxHxD, k_TxHxD, v_TxHxDv, offsets_Bp1, *, max_seq_len: int, scale: float,
                             causal: bool = True, num_targets=None, max_attn_len: int = 0,
                             contextual_seq_len: int = 0, block: int = BLOCK, group: int = GROUP):
  """Softmax attention over jagged rows (reference.jagged_softmax_attention's contract), tiled.

  block: tile edge in tokens (queries and keys); executed work is n_tiles * block^2 pairs (plus the padding
  tiles of a last partial group, which are all masked). group: tiles per loop step.
  Returns out_TxHxDv in v's dtype; slots past offsets[B] are zero.
  """
  check_shapes(q_TxHxD, k_TxHxD, v_TxHxDv, _NAME)
  capacity = q_TxHxD.shape[0]
  check_offsets(offsets_Bp1, capacity, max_seq_len, _NAME)
  if block < 1 or group < 1 or max_seq_len < 1:
    raise ValueError(f"{_NAME}: block ({block}), group ({group}) and max_seq_len ({max_seq_len}) must be >= 1")
  offsets_Bp1 = jnp.asarray(offsets_Bp1, jnp.int32)
  num_rows = offsets_Bp1.shape[0] - 1
  targets_B = _targets(num_targets, num_rows)
  if capacity == 0 or num_rows == 0:  # no tokens or no rows: nothing to attend
    return jnp.zeros_like(v_TxHxDv)
  # Static.alpha is the logit multiplier: for softmax attention that is `scale`; there is no bias.
  s = Static(max_seq_len, float(scale), causal, num_targets is not None, max_attn_len,
              contextual_seq_len, block, False, group)
  return _attention(s, q_TxHxD, k_TxHxD, v_TxHxDv, offsets_Bp1, targets_B)


__all__ = ["executed_pairs", "jagged_softmax_attention"]
