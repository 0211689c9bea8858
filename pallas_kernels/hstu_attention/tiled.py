"""HSTU jagged attention in plain jnp/lax for CPU and TPU: a tile list walked by a dynamic loop.

Same contract as reference.hstu_attention (the spec), plus `block`. Instead of padding every row to N,
the needed (row, query block, key block) tiles of block x block row-local tokens are enumerated on
device into a static-capacity int32 table; a lax.fori_loop with the dynamic tile count then gathers
each tile's q/k/v with dynamic_slice on the packed token axis and accumulates into a T x H x Dv output.
Executed work is n_tiles * block^2 pairs, which follows the real lengths (executed_pairs reports it).
The backward is a custom_vjp with its own tile loop (reverse mode cannot go through a dynamic-trip-count
loop), giving dq, dk, dv and d rel_bias.

Letters: T token capacity, Tp = T + block (padded so a tile starting inside a row is always in
bounds), B rows, H heads, D q/k width, Dv value width, N max_seq_len, R bias buckets, C tile capacity
(a static upper bound on the tile count), Q = K = block, NB = ceil(N / block).
This module must never build a T x T or B x N x N array, and imports only jax/numpy and the reference.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from pallas_kernels import vma
from pallas_kernels.hstu_attention import masks
from pallas_kernels.hstu_attention.reference import relative_position_bucket


@dataclasses.dataclass(frozen=True)
class Static:
  """Trace-time facts of one call (hashable: custom_vjp takes it as a non-differentiable argument)."""
  max_seq_len: int
  alpha: float
  causal: bool
  has_targets: bool
  max_attn_len: int
  contextual_seq_len: int
  block: int
  has_bias: bool


def _cdiv(a, b: int):
  return (a + b - 1) // b


def dot(spec, a, b):
  # HIGHEST keeps f32 in IEEE f32 on TPU (the f32 tests compare at 1e-5); bf16 products are exact in f32.
  return jnp.einsum(spec, a, b, precision=lax.Precision.HIGHEST, preferred_element_type=jnp.float32)


def _pos(idx, max_pos, s: Static):
  return masks.position(idx, max_pos, contextual_seq_len=s.contextual_seq_len, has_targets=s.has_targets)


def _rows(offsets_Bp1, targets_B, s: Static):
  """(start_B, n_in_B, max_pos_B); n_in = length clipped to N (the reference pads rows to N)."""
  start_B = offsets_Bp1[:-1]
  length_B = offsets_Bp1[1:] - start_B
  c = s.contextual_seq_len
  max_pos_B = length_B - (c - 1 if c > 0 else 0) - targets_B
  return start_B, jnp.clip(length_B, 0, s.max_seq_len), max_pos_B


def _key_block_range(q0, n_in, max_pos, s: Static):
  """[lo, hi) of the key blocks that queries [q0, q0 + block) of a row can see (a superset)."""
  num = _cdiv(n_in, s.block)
  if not s.causal:
    return jnp.zeros_like(num), num
  c = s.contextual_seq_len
  # Non-contextual queries see keys j <= i only: p is non-decreasing, so d > 0 needs j < i.
  hi = (jnp.minimum(q0 + s.block, n_in) - 1) // s.block + 1
  lo = jnp.zeros_like(num)
  if s.max_attn_len > 0:
    # Keys need p(j) >= p(q0) - w (p(q0) is the block's smallest); invert p to a first key index.
    p_lo = _pos(q0, max_pos, s) - s.max_attn_len
    lo = jnp.where(p_lo > 0, p_lo + (c - 1 if c > 0 else 0), 0) // s.block
  if c > 0:  # contextual queries see every history key
    lo = jnp.where(q0 < c, 0, lo)
    hi = jnp.where(q0 < c, num, hi)
  return lo, hi


def tile_capacity(capacity: int, num_rows: int, s: Static) -> int:
  """C: a static upper bound on the tile count for any offsets with offsets[B] <= T.

  Tiles per row are g(nb) for nb = ceil(n / block) query blocks, g convex with g(0) = 0, so the sum is
  largest when the sum of nb (<= (T + B (block - 1)) / block, each <= NB) is packed into full rows.
  """
  nbmax = _cdiv(s.max_seq_len, s.block)
  ctx_blocks = _cdiv(s.contextual_seq_len, s.block) if s.causal and s.contextual_seq_len > 0 else 0

  def g(nb):
    return nb * nb if not s.causal else nb * (nb + 1) // 2 + ctx_blocks * nb

  total_nb = min(num_rows * nbmax, (capacity + num_rows * (s.block - 1)) // s.block)
  full, rest = divmod(total_nb, nbmax)
  return max(full * g(nbmax) + g(rest), 1)


def _tiles(offsets_Bp1, targets_B, num_tiles_cap: int, s: Static):
  """(tiles_Cx3 int32 of (row, q0, k0), n_tiles): tiles ordered by row, query block, key block."""
  num_rows = offsets_Bp1.shape[0] - 1
  nbmax = _cdiv(s.max_seq_len, s.block)
  _, n_in_B, max_pos_B = _rows(offsets_Bp1, targets_B, s)
  q0_BxNB = (jnp.arange(nbmax, dtype=jnp.int32) * s.block)[None, :]
  n_in_Bx1, max_pos_Bx1 = n_in_B[:, None], max_pos_B[:, None]
  lo_BxNB, hi_BxNB = _key_block_range(q0_BxNB, n_in_Bx1, max_pos_Bx1, s)
  count_BxNB = jnp.where(q0_BxNB < n_in_Bx1, jnp.maximum(hi_BxNB - lo_BxNB, 0), 0)
  # F = B * NB (row, query block) pairs, flattened; each owns a run of consecutive tile slots.
  lo_F = jnp.broadcast_to(lo_BxNB, (num_rows, nbmax)).reshape(-1)
  count_F = count_BxNB.reshape(-1)
  end_F = jnp.cumsum(count_F)
  # Cannot bind for valid offsets (tile_capacity is a proven bound); it only keeps the table in range.
  n_tiles = jnp.minimum(end_F[-1], num_tiles_cap)
  t_C = jnp.arange(num_tiles_cap, dtype=jnp.int32)
  f_C = jnp.minimum(jnp.searchsorted(end_F, t_C, side="right"), end_F.shape[0] - 1).astype(jnp.int32)
  first_C = end_F[f_C] - count_F[f_C]
  k0_C = (lo_F[f_C] + t_C - first_C) * s.block
  tiles_Cx3 = jnp.stack([f_C // nbmax, (f_C % nbmax) * s.block, k0_C], axis=1).astype(jnp.int32)
  return tiles_Cx3, n_tiles.astype(jnp.int32)


def _targets(num_targets, num_rows: int):
  if num_targets is None:
    return jnp.zeros((num_rows,), jnp.int32)
  num_targets = jnp.asarray(num_targets, jnp.int32)
  if num_targets.shape != (num_rows,):
    raise ValueError(f"hstu_attention: num_targets has shape {num_targets.shape}, expected ({num_rows},)")
  return num_targets


def executed_pairs(offsets_Bp1, max_seq_len: int, block: int = 16, *, causal: bool = True,
                   num_targets=None, max_attn_len: int = 0, contextual_seq_len: int = 0) -> int:
  """n_tiles * block^2: the (query, key) pairs the tiled kernel computes for these offsets (host int)."""
  offsets_Bp1 = jnp.asarray(offsets_Bp1, jnp.int32)
  num_rows = offsets_Bp1.shape[0] - 1
  s = Static(max_seq_len, 1.0, causal, num_targets is not None, max_attn_len, contextual_seq_len,
              block, False)
  cap = tile_capacity(int(offsets_Bp1[-1]), num_rows, s)
  _, n_tiles = _tiles(offsets_Bp1, _targets(num_targets, num_rows), cap, s)
  return int(n_tiles) * block * block


def _tile_mask(q0, k0, n_in, max_pos, s: Static):
  """(mask_QxK, d_QxK) exactly as reference.attention_mask, for one tile of one row."""
  i_Qx1 = q0 + jnp.arange(s.block, dtype=jnp.int32)[:, None]
  j_1xK = k0 + jnp.arange(s.block, dtype=jnp.int32)[None, :]
  return masks.tile_mask(i_Qx1, j_1xK, n_in, max_pos, causal=s.causal, max_attn_len=s.max_attn_len,
                         contextual_seq_len=s.contextual_seq_len, has_targets=s.has_targets)


def load(x_TpxHxW, start, first, n_in, size: int):
  """Rows [first, first + size) of the row at `start`, zero past the row (they may be the next row)."""
  x = lax.dynamic_slice_in_dim(x_TpxHxW, start + first, size, axis=0)
  valid_Qx1x1 = (first + jnp.arange(size, dtype=jnp.int32) < n_in)[:, None, None]
  return jnp.where(valid_Qx1x1, x, jnp.zeros((), x.dtype))


def add_rows(acc_TpxHxW, start, value_QxHxW):
  # Rows past the row's end get exact zeros (their weights are masked), so touching them is harmless.
  old = lax.dynamic_slice_in_dim(acc_TpxHxW, start, value_QxHxW.shape[0], axis=0)
  return lax.dynamic_update_slice_in_dim(acc_TpxHxW, old + value_QxHxW, start, axis=0)


class Ctx:
  """Per-call tile table and row metadata shared by the forward and backward loops."""

  def __init__(self, offsets_Bp1, targets_B, bias_HxR, capacity: int, s: Static):
    self.s = s
    self.start_B, self.n_in_B, self.max_pos_B = _rows(offsets_Bp1, targets_B, s)
    cap = tile_capacity(capacity, offsets_Bp1.shape[0] - 1, s)
    self.tiles_Cx3, self.n_tiles = _tiles(offsets_Bp1, targets_B, cap, s)
    if s.has_bias:
      # |d| < N inside a row; the bucket per distance is a small N table gathered per tile.
      self.bucket_N = relative_position_bucket(jnp.arange(s.max_seq_len), bias_HxR.shape[1])
      self.bias_HxN = bias_HxR.astype(jnp.float32)[:, self.bucket_N]

  def tile(self, t, q_TpxHxD, k_TpxHxD, v_TpxHxDv):
    """Everything one tile needs: (q_start, k_start, q, k, v, mask, bucket index or None, logits)."""
    s = self.s
    b, q0, k0 = self.tiles_Cx3[t, 0], self.tiles_Cx3[t, 1], self.tiles_Cx3[t, 2]
    start, n_in, max_pos = self.start_B[b], self.n_in_B[b], self.max_pos_B[b]
    q_QxHxD = load(q_TpxHxD, start, q0, n_in, s.block)
    k_KxHxD = load(k_TpxHxD, start, k0, n_in, s.block)
    v_KxHxDv = load(v_TpxHxDv, start, k0, n_in, s.block)
    mask_QxK, d_QxK = _tile_mask(q0, k0, n_in, max_pos, s)
    logits_HxQxK = s.alpha * dot("qhd,khd->hqk", q_QxHxD, k_KxHxD)
    dist_QxK = None
    if s.has_bias:
      # Masked pairs may lie past the row (|d| >= N): clip so they index, their weight is zero anyway.
      dist_QxK = jnp.minimum(jnp.abs(d_QxK), s.max_seq_len - 1)
      logits_HxQxK = logits_HxQxK + self.bias_HxN[:, dist_QxK]
    return start + q0, start + k0, q_QxHxD, k_KxHxD, v_KxHxDv, mask_QxK, dist_QxK, logits_HxQxK


def pad(x_TxHxW, block: int):
  return jnp.pad(x_TxHxW, ((0, block), (0, 0), (0, 0)))


def _forward(s: Static, q_TxHxD, k_TxHxD, v_TxHxDv, offsets_Bp1, targets_B, bias_HxR):
  capacity = q_TxHxD.shape[0]
  ctx = Ctx(offsets_Bp1, targets_B, bias_HxR, capacity, s)
  q_p, k_p, v_p = (pad(x, s.block) for x in (q_TxHxD, k_TxHxD, v_TxHxDv))

  def body(t, acc_TpxHxDv):
    q_at, _, _, _, v_KxHxDv, mask_QxK, _, logits_HxQxK = ctx.tile(t, q_p, k_p, v_p)
    # `where`, not a multiply, so that masked-out logits can never turn into NaN.
    w_HxQxK = jnp.where(mask_QxK[None], jax.nn.silu(logits_HxQxK), 0.0) / s.max_seq_len
    return add_rows(acc_TpxHxDv, q_at, dot("hqk,khd->qhd", w_HxQxK, v_KxHxDv.astype(jnp.float32)))

  acc = jnp.zeros((capacity + s.block,) + v_TxHxDv.shape[1:], jnp.float32)
  acc = vma.like(acc, q_TxHxD, k_TxHxD, v_TxHxDv, offsets_Bp1, targets_B, bias_HxR)
  acc = lax.fori_loop(0, ctx.n_tiles, body, acc)
  return acc[:capacity].astype(v_TxHxDv.dtype)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _attention(s, q_TxHxD, k_TxHxD, v_TxHxDv, offsets_Bp1, targets_B, bias_HxR):
  return _forward(s, q_TxHxD, k_TxHxD, v_TxHxDv, offsets_Bp1, targets_B, bias_HxR)


def _attention_fwd(s, q_TxHxD, k_TxHxD, v_TxHxDv, offsets_Bp1, targets_B, bias_HxR):
  out = _forward(s, q_TxHxD, k_TxHxD, v_TxHxDv, offsets_Bp1, targets_B, bias_HxR)
  return out, (q_TxHxD, k_TxHxD, v_TxHxDv, offsets_Bp1, targets_B, bias_HxR)


def _attention_bwd(s, residuals, dout_TxHxDv):
  q_TxHxD, k_TxHxD, v_TxHxDv, offsets_Bp1, targets_B, bias_HxR = residuals
  capacity = q_TxHxD.shape[0]
  ctx = Ctx(offsets_Bp1, targets_B, bias_HxR, capacity, s)
  q_p, k_p, v_p, do_p = (pad(x, s.block) for x in (q_TxHxD, k_TxHxD, v_TxHxDv, dout_TxHxDv))
  num_buckets = bias_HxR.shape[1]

  def body(t, carry):
    dq_TpxHxD, dk_TpxHxD, dv_TpxHxDv, dbias_HxR = carry
    q_at, k_at, q_QxHxD, k_KxHxD, v_KxHxDv, mask_QxK, dist_QxK, logits_HxQxK = ctx.tile(t, q_p, k_p, v_p)
    # Same row clip as q: rows past the row's end (or tail padding) read as zero.
    rows_left = ctx.n_in_B[ctx.tiles_Cx3[t, 0]] - ctx.tiles_Cx3[t, 1]
    do_QxHxDv = load(do_p, q_at, 0, rows_left, s.block).astype(jnp.float32)
    sig_HxQxK = jax.nn.sigmoid(logits_HxQxK)
    w_HxQxK = jnp.where(mask_QxK[None], jax.nn.silu(logits_HxQxK), 0.0) / s.max_seq_len
    dw_HxQxK = dot("qhd,khd->hqk", do_QxHxDv, v_KxHxDv.astype(jnp.float32))
    dsilu_HxQxK = sig_HxQxK * (1.0 + logits_HxQxK * (1.0 - sig_HxQxK))
    dl_HxQxK = jnp.where(mask_QxK[None], dw_HxQxK * dsilu_HxQxK, 0.0) / s.max_seq_len
    dq_QxHxD = s.alpha * dot("hqk,khd->qhd", dl_HxQxK, k_KxHxD.astype(jnp.float32))
    dk_KxHxD = s.alpha * dot("hqk,qhd->khd", dl_HxQxK, q_QxHxD.astype(jnp.float32))
    dq_TpxHxD = add_rows(dq_TpxHxD, q_at, dq_QxHxD)
    dk_TpxHxD = add_rows(dk_TpxHxD, k_at, dk_KxHxD)
    dv_TpxHxDv = add_rows(dv_TpxHxDv, k_at, dot("hqk,qhd->khd", w_HxQxK, do_QxHxDv))
    if s.has_bias:
      # Masked pairs carry dl = 0, so their (clipped) bucket receives nothing.
      dbias_HxR = dbias_HxR.at[:, ctx.bucket_N[dist_QxK]].add(dl_HxQxK)
    return dq_TpxHxD, dk_TpxHxD, dv_TpxHxDv, dbias_HxR

  padded = capacity + s.block
  init = (jnp.zeros((padded,) + q_TxHxD.shape[1:], jnp.float32),
          jnp.zeros((padded,) + k_TxHxD.shape[1:], jnp.float32),
          jnp.zeros((padded,) + v_TxHxDv.shape[1:], jnp.float32),
          jnp.zeros((q_TxHxD.shape[1], num_buckets), jnp.float32))
  init = vma.like(init, q_TxHxD, k_TxHxD, v_TxHxDv, dout_TxHxDv, offsets_Bp1, targets_B, bias_HxR)
  dq, dk, dv, dbias_HxR = lax.fori_loop(0, ctx.n_tiles, body, init)
  return (dq[:capacity].astype(q_TxHxD.dtype), dk[:capacity].astype(k_TxHxD.dtype),
          dv[:capacity].astype(v_TxHxDv.dtype), None, None, dbias_HxR.astype(bias_HxR.dtype))


_attention.defvjp(_attention_fwd, _attention_bwd)


def hstu_attention(q_TxHxD, k_TxHxD, v_TxHxDv, offsets_Bp1, *, max_seq_len: int, alpha: float,
                   causal: bool = True, num_targets=None, max_attn_len: int = 0,
                   contextual_seq_len: int = 0, rel_bias_HxR=None, block: int = 16):
  """HSTU attention over jagged rows (reference.hstu_attention's contract); out_TxHxDv in v's dtype.

  block: tile edge in tokens (queries and keys); executed work is n_tiles * block^2 pairs.
  Rows longer than N are outside the contract (as in the reference); here their tokens past N get 0.
  """
  capacity, num_heads, _ = q_TxHxD.shape
  if k_TxHxD.shape != q_TxHxD.shape or v_TxHxDv.shape[:2] != (capacity, num_heads):
    raise ValueError(f"hstu_attention: q {q_TxHxD.shape}, k {k_TxHxD.shape}, v {v_TxHxDv.shape} disagree")
  if block < 1 or max_seq_len < 1:
    raise ValueError(f"hstu_attention: block ({block}) and max_seq_len ({max_seq_len}) must be >= 1")
  num_rows = offsets_Bp1.shape[0] - 1
  if rel_bias_HxR is not None and (rel_bias_HxR.ndim != 2 or rel_bias_HxR.shape[0] != num_heads):
    raise ValueError(f"hstu_attention: rel_bias has shape {rel_bias_HxR.shape}, expected ({num_heads}, R)")
  targets_B = _targets(num_targets, num_rows)
  if capacity == 0 or num_rows == 0:  # no tokens or no rows: nothing to attend
    return jnp.zeros_like(v_TxHxDv)
  s = Static(max_seq_len, float(alpha), causal, num_targets is not None, max_attn_len,
              contextual_seq_len, block, rel_bias_HxR is not None)
  # Without a bias the loops never read it; a 1-bucket stand-in keeps one custom_vjp signature.
  bias_HxR = rel_bias_HxR if rel_bias_HxR is not None else jnp.zeros((num_heads, 1), jnp.float32)
  out = _attention(s, q_TxHxD, k_TxHxD, v_TxHxDv, jnp.asarray(offsets_Bp1, jnp.int32), targets_B, bias_HxR)
  return out


__all__ = ["executed_pairs", "hstu_attention", "tile_capacity"]
