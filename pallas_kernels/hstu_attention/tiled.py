"""HSTU jagged attention in plain jnp/lax for CPU and TPU: a tile list walked by a dynamic loop.

Same contract as reference.hstu_attention (the spec), plus `block` and `group`. Instead of padding every
row to N, the needed (row, query block, key block) tiles of block x block row-local tokens are enumerated
on device into a static-capacity int32 table; a lax.fori_loop with a dynamic trip count then takes
`group` tiles per step: one gather of their q/k/v blocks, batched dots over (tile, head), and one
scatter-add of their outputs into the accumulator. Tiles of many rows and query blocks thus share each
step's fixed costs (the loop, the gathers, the mask), where one tile per step spent most of its time on
them. Inside the loops q/k/v live head-major (H x Tp x D), so a gathered block is (G, H, block, D) and the
dots need no transposes. Executed work is n_tiles * block^2 pairs, which follows the real lengths
(executed_pairs reports it); a last partial group runs padding tiles whose rows are empty (all masked).
The backward is a custom_vjp with its own loop (reverse mode cannot go through a dynamic-trip-count
loop), giving dq, dk, dv and d rel_bias.

Letters: T token capacity, Tp = T + block (padded so a tile starting inside a row is always in
bounds), B rows, H heads, D q/k width, Dv value width, N max_seq_len, R bias buckets, C tile capacity
(a static upper bound on the tile count, a multiple of the group), Q = K = block, NB = ceil(N / block),
G = group (tiles per loop step).
This module must never build a T x T or B x N x N array, and imports only jax/numpy and the reference.
"""

from __future__ import annotations

import copy
import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from pallas_kernels import vma
from pallas_kernels.hstu_attention import masks, pointwise
from pallas_kernels.hstu_attention.reference import relative_position_bucket


@dataclasses.dataclass(frozen=True)
class TileConfig:
  """The loop's shape: `block` tokens per tile edge (queries and keys), `group` tiles per loop step."""
  block: int = 32
  group: int = 16

  def __post_init__(self):
    if self.block < 1 or self.group < 1:
      raise ValueError(f"TileConfig: block ({self.block}) and group ({self.group}) must be >= 1")


# The default on CPU. Against one 16-token tile per loop step, `experiments/bench_hstu_stack.py --baseline`
# (2 rounds, 2026-12-04, this project's 2-core machine) gave whole training steps 1.16x the tokens/s on stack S
# and 1.15x on M; timing the attention alone, 32-token tiles with 8-32 tiles per step were within 10% of each
# other, and 64-token tiles were slower on rows of about 32 tokens.
DEFAULT_TILES = TileConfig()
# The configs a caller may reasonably pick from (tests/test_hstu_tiled.py holds every one to the reference).
CANDIDATES = tuple(TileConfig(b, g) for b in (16, 32, 64) for g in (1, 8, 16, 32))


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
  group: int = 1


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


def executed_pairs(offsets_Bp1, max_seq_len: int, block: int = DEFAULT_TILES.block, *, causal: bool = True,
                   num_targets=None, max_attn_len: int = 0, contextual_seq_len: int = 0) -> int:
  """n_tiles * block^2: the (query, key) pairs the tiled kernel computes for these offsets (host int)."""
  offsets_Bp1 = jnp.asarray(offsets_Bp1, jnp.int32)
  num_rows = offsets_Bp1.shape[0] - 1
  s = Static(max_seq_len, 1.0, causal, num_targets is not None, max_attn_len, contextual_seq_len,
              block, False)
  cap = tile_capacity(int(offsets_Bp1[-1]), num_rows, s)
  _, n_tiles = _tiles(offsets_Bp1, _targets(num_targets, num_rows), cap, s)
  return int(n_tiles) * block * block


class Ctx:
  """Per-call tile table and row metadata shared by the forward and backward loops."""

  def __init__(self, offsets_Bp1, targets_B, bias_HxR, capacity: int, s: Static):
    self.s = s
    self.start_B, self.n_in_B, self.max_pos_B = _rows(offsets_Bp1, targets_B, s)
    cap = _cdiv(tile_capacity(capacity, offsets_Bp1.shape[0] - 1, s), s.group) * s.group
    self.tiles_Cx3, self.n_tiles = _tiles(offsets_Bp1, targets_B, cap, s)
    self.n_groups = _cdiv(self.n_tiles, s.group)
    # A pair's bias follows its distance d = p(i) - p(j). With c contextual tokens p(i) = i - max(c - 1, 0)
    # for every token of a row but the first c - 1 (they share position 0) and, with two or more targets, the
    # targets after the first (they share max_pos). So when c - 1 <= block, the bias tile of a row's tiles
    # depends only on the tile's diagonal offset (q0 - k0) / block and on whether its query and key blocks are
    # the row's first ones (holding the contextual tokens): step_tiles reads one of these precomputed
    # H x Q x K tiles per tile (a window gather), and the backward sums the gradient per such slot and
    # buckets it once after the loop. A call with a row whose targets share a position goes per pair
    # instead (switch); with more than block + 1 contextual tokens every call does: that path gathers and
    # scatters each pair's bucket.
    self.by_offset = s.has_bias and s.contextual_seq_len - 1 <= s.block
    self.targets_B = targets_B
    if s.has_bias:
      # |d| < N inside a row; the bucket per distance is a small N table gathered per tile.
      self.bucket_N = relative_position_bucket(jnp.arange(s.max_seq_len), bias_HxR.shape[1])
      self.bias_HxN = bias_HxR.astype(jnp.float32)[:, self.bucket_N]
    if self.by_offset:
      nb = _cdiv(s.max_seq_len, s.block)
      self.first_offset, self.num_offsets = -(nb - 1), 2 * nb - 1
      self.special = max(s.contextual_seq_len - 1, 0)   # the leading tokens sharing position 0
      local = jnp.arange(s.block, dtype=jnp.int32)
      offset_O = jnp.arange(self.first_offset, nb, dtype=jnp.int32) * s.block
      pos = lambda idx, first: jnp.maximum(idx - self.special, 0) if first else idx - self.special
      d = []
      # Slots: (q first, k first) = (no, no), (no, yes), (yes, no), (yes, yes), each with every offset; a
      # first block starts at 0, the other one at the offset from it (combinations no tile has are unused).
      kinds = ((False, False), (False, True), (True, False), (True, True)) if self.special else ((False, False),)
      for q_first, k_first in kinds:
        k0_O = -offset_O if q_first else jnp.zeros_like(offset_O)
        i_OxQxK = (offset_O + k0_O)[:, None, None] + local[None, :, None]
        j_OxQxK = k0_O[:, None, None] + local[None, None, :]
        d.append(pos(i_OxQxK, q_first) - pos(j_OxQxK, k_first))
      self.bucket_SxQxK = self.bucket_N[jnp.minimum(jnp.abs(jnp.concatenate(d)), s.max_seq_len - 1)]
      self.bias_SxHxQxK = jnp.moveaxis(bias_HxR.astype(jnp.float32)[:, self.bucket_SxQxK], 0, 1)
      self.bias_SxHxKxQ = jnp.swapaxes(self.bias_SxHxQxK, 2, 3)   # the backward's key-major tiles

  def step_tiles(self, g, q_HxTpxD, k_HxTpxD, v_HxTpxDv, key_major: bool = False):
    """Tiles [g G, g G + G) at once: (q_at_G, k_at_G, q_valid_GxQ, q_GxHxQxD, k_GxHxKxD, v_GxHxKxDv,
    mask_Gx1xQxK, bias_at (the bias tiles' offsets, or each pair's clipped distance; None without a bias),
    logits_GxHxQxK). Rows past a row's end read as zero; padding tiles
    past n_tiles see an empty row, so everything they compute is masked.

    key_major: the pair arrays (mask, distances, logits) come K x Q instead. The backward wants them so: its
    dk and dv dots then contract their operands' last axes, which XLA:CPU hands to its fast dot library,
    where a contraction over the leading pair axis (A^T B) falls back to the generic dot emitter (the
    profile of `experiments/profile_step.py` shows which: `dot` rather than a library fusion)."""
    s, size = self.s, self.s.block
    t_G = g * s.group + jnp.arange(s.group, dtype=jnp.int32)
    tiles_Gx3 = lax.dynamic_slice_in_dim(self.tiles_Cx3, g * s.group, s.group, axis=0)
    b_G, q0_G, k0_G = tiles_Gx3[:, 0], tiles_Gx3[:, 1], tiles_Gx3[:, 2]
    start_G, max_pos_G = self.start_B[b_G], self.max_pos_B[b_G]
    n_in_G = jnp.where(t_G < self.n_tiles, self.n_in_B[b_G], 0)
    i_GxQx1 = q0_G[:, None, None] + jnp.arange(size, dtype=jnp.int32)[None, :, None]
    j_Gx1xK = k0_G[:, None, None] + jnp.arange(size, dtype=jnp.int32)[None, None, :]
    q_valid_GxQ, k_valid_GxK = i_GxQx1[:, :, 0] < n_in_G[:, None], j_Gx1xK[:, 0, :] < n_in_G[:, None]
    q_at_G, k_at_G = start_G + q0_G, start_G + k0_G
    q_GxHxQxD = gather_blocks(q_HxTpxD, q_at_G, q_valid_GxQ, size)
    k_GxHxKxD = gather_blocks(k_HxTpxD, k_at_G, k_valid_GxK, size)
    v_GxHxKxDv = gather_blocks(v_HxTpxDv, k_at_G, k_valid_GxK, size)
    n_in, max_pos = n_in_G[:, None, None], max_pos_G[:, None, None]
    if key_major:  # from here on the pair arrays named Q x K (mask, distances, logits) are K x Q
      i_GxQx1, j_Gx1xK = jnp.swapaxes(i_GxQx1, 1, 2), jnp.swapaxes(j_Gx1xK, 1, 2)
    mask_GxQxK, d_GxQxK = masks.tile_mask(i_GxQx1, j_Gx1xK, n_in, max_pos, causal=s.causal,
                                          max_attn_len=s.max_attn_len, contextual_seq_len=s.contextual_seq_len,
                                          has_targets=s.has_targets)
    if key_major:
      logits_GxHxQxK = s.alpha * dot("ghkd,ghqd->ghkq", k_GxHxKxD, q_GxHxQxD)
    else:
      logits_GxHxQxK = s.alpha * dot("ghqd,ghkd->ghqk", q_GxHxQxD, k_GxHxKxD)
    bias_at = None
    if self.by_offset:
      # Padding tiles may list offsets past the table; they are masked, so clip them into it.
      bias_at = jnp.clip((q0_G - k0_G) // size - self.first_offset, 0, self.num_offsets - 1)
      if self.special:
        bias_at = bias_at + self.num_offsets * (2 * (q0_G == 0) + (k0_G == 0)).astype(jnp.int32)
      logits_GxHxQxK = logits_GxHxQxK + (self.bias_SxHxKxQ if key_major else self.bias_SxHxQxK)[bias_at]
    elif s.has_bias:
      bias_at = jnp.minimum(jnp.abs(d_GxQxK), s.max_seq_len - 1)
      logits_GxHxQxK = logits_GxHxQxK + jnp.moveaxis(self.bias_HxN[:, bias_at], 0, 1)
    return (q_at_G, k_at_G, q_valid_GxQ, q_GxHxQxD, k_GxHxKxD, v_GxHxKxDv, mask_GxQxK[:, None], bias_at,
            logits_GxHxQxK)

  def dbias_init(self, num_heads: int, num_buckets: int):
    """The backward loop's bias-gradient carry: per slot (by_offset, key-major like the backward's tiles),
    else per bucket."""
    if self.by_offset:
      return jnp.zeros(self.bias_SxHxKxQ.shape, jnp.float32)
    return jnp.zeros((num_heads, num_buckets), jnp.float32)

  def add_dbias(self, acc, bias_at, dl_GxHxKxQ):
    """The loop's carry plus one step's key-major logit gradients (masked pairs carry dl = 0, so their
    clipped bucket or slot receives nothing)."""
    if not self.by_offset:
      return acc.at[:, self.bucket_N[bias_at]].add(jnp.moveaxis(dl_GxHxKxQ, 1, 0))
    return acc.at[bias_at].add(dl_GxHxKxQ)

  def dbias(self, acc, num_buckets: int):
    """d rel_bias_HxR from the loop's carry."""
    if not self.by_offset:
      return acc
    acc_HxSxQxK = jnp.swapaxes(jnp.moveaxis(acc, 1, 0), 2, 3)
    return jnp.zeros((acc.shape[1], num_buckets), jnp.float32).at[:, self.bucket_SxQxK].add(acc_HxSxQxK)

  def switch(self, loop):
    """loop(ctx): with the bias read per slot, or per pair where some row's targets share a position (one
    lax.cond per call; a cond per loop step cost more than the bias itself on the main job's attention)."""
    if not (self.by_offset and self.s.has_targets):
      return loop(self)
    per_pair = copy.copy(self)
    per_pair.by_offset = False
    return lax.cond(jnp.any(self.targets_B >= 2), lambda: loop(per_pair), lambda: loop(self))


def pad(x_TxHxW, block: int):
  return jnp.pad(x_TxHxW, ((0, block), (0, 0), (0, 0)))


def head_major(x_TxHxW, block: int):
  """x padded by `block` token rows and laid out H x Tp x W, the loops' layout."""
  return jnp.moveaxis(pad(x_TxHxW, block), 1, 0)


def token_major(x_HxTpxW, capacity: int, dtype):
  return jnp.moveaxis(x_HxTpxW[:, :capacity], 0, 1).astype(dtype)


def gather_blocks(x_HxTpxW, start_G, valid_GxQ, size: int):
  """x[:, start : start + size] for each start, as G x H x size x W, rows where valid is False zeroed."""
  dims = lax.GatherDimensionNumbers(offset_dims=(1, 2, 3), collapsed_slice_dims=(), start_index_map=(1,))
  x = lax.gather(x_HxTpxW, start_G[:, None], dims, (x_HxTpxW.shape[0], size, x_HxTpxW.shape[2]),
                 mode=lax.GatherScatterMode.CLIP)
  return jnp.where(valid_GxQ[:, None, :, None], x, jnp.zeros((), x.dtype))


def scatter_add_blocks(acc_HxTpxW, start_G, value_GxHxQxW):
  """acc[:, start : start + Q] += value for each start (starts may repeat; the adds accumulate)."""
  dims = lax.ScatterDimensionNumbers(update_window_dims=(1, 2, 3), inserted_window_dims=(),
                                     scatter_dims_to_operand_dims=(1,))
  return lax.scatter_add(acc_HxTpxW, start_G[:, None], value_GxHxQxW, dims, mode=lax.GatherScatterMode.CLIP)


def _forward(s: Static, q_TxHxD, k_TxHxD, v_TxHxDv, offsets_Bp1, targets_B, bias_HxR):
  """(out_TxHxDv, (q, k, v) head-major): the backward keeps the loops' layout instead of redoing it."""
  capacity = q_TxHxD.shape[0]
  ctx = Ctx(offsets_Bp1, targets_B, bias_HxR, capacity, s)
  q_p, k_p, v_p = (head_major(x, s.block) for x in (q_TxHxD, k_TxHxD, v_TxHxDv))

  def body(ctx, g, acc_HxTpxDv):
    q_at_G, _, _, _, _, v_GxHxKxDv, mask, _, logits_GxHxQxK = ctx.step_tiles(g, q_p, k_p, v_p)
    w_GxHxQxK = pointwise.weights(logits_GxHxQxK, mask, s.max_seq_len)
    out_GxHxQxDv = dot("ghqk,ghkd->ghqd", w_GxHxQxK, v_GxHxKxDv.astype(jnp.float32))
    return scatter_add_blocks(acc_HxTpxDv, q_at_G, out_GxHxQxDv)

  acc = jnp.zeros((v_TxHxDv.shape[1], capacity + s.block, v_TxHxDv.shape[2]), jnp.float32)
  acc = vma.like(acc, q_TxHxD, k_TxHxD, v_TxHxDv, offsets_Bp1, targets_B, bias_HxR)
  acc = ctx.switch(lambda ctx: lax.fori_loop(0, ctx.n_groups, functools.partial(body, ctx), acc))
  return token_major(acc, capacity, v_TxHxDv.dtype), (q_p, k_p, v_p)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _attention(s, q_TxHxD, k_TxHxD, v_TxHxDv, offsets_Bp1, targets_B, bias_HxR):
  return _forward(s, q_TxHxD, k_TxHxD, v_TxHxDv, offsets_Bp1, targets_B, bias_HxR)[0]


def _attention_fwd(s, q_TxHxD, k_TxHxD, v_TxHxDv, offsets_Bp1, targets_B, bias_HxR):
  out, (q_p, k_p, v_p) = _forward(s, q_TxHxD, k_TxHxD, v_TxHxDv, offsets_Bp1, targets_B, bias_HxR)
  return out, (q_p, k_p, v_p, offsets_Bp1, targets_B, bias_HxR)


def _attention_bwd(s, residuals, dout_TxHxDv):
  q_p, k_p, v_p, offsets_Bp1, targets_B, bias_HxR = residuals
  capacity = dout_TxHxDv.shape[0]
  ctx = Ctx(offsets_Bp1, targets_B, bias_HxR, capacity, s)
  do_p = head_major(dout_TxHxDv, s.block)
  num_buckets = bias_HxR.shape[1]

  def body(ctx, g, carry):
    dq_HxTpxD, dk_HxTpxD, dv_HxTpxDv, dbias = carry
    # Key-major pair arrays (step_tiles): only dq's dot contracts the leading pair axis.
    q_at_G, k_at_G, q_valid_GxQ, q_GxHxQxD, k_GxHxKxD, v_GxHxKxDv, mask, bias_at, logits_GxHxKxQ = ctx.step_tiles(
        g, q_p, k_p, v_p, key_major=True)
    do_GxHxQxDv = gather_blocks(do_p, q_at_G, q_valid_GxQ, s.block).astype(jnp.float32)
    dw_GxHxKxQ = dot("ghkd,ghqd->ghkq", v_GxHxKxDv.astype(jnp.float32), do_GxHxQxDv)
    w_GxHxKxQ, dl_GxHxKxQ = pointwise.weights_and_dlogits(logits_GxHxKxQ, mask, dw_GxHxKxQ, s.max_seq_len)
    # dq's dot wants the logit gradient query-major. Transposed in place XLA folds the transpose back into the
    # dot, which then contracts the leading pair axis and goes to the generic emitter; behind the barrier the
    # transpose is one small copy and the dot a library one (the same numbers: forward + backward 1.10-1.13x
    # on bench_kernels' B32_N512_H2_D64 heavy-tailed shape, 0.99-1.02x on B64_N256_H2_D32, 1.03-1.07x on
    # stack M's layers; 2026-12-07, one process, 30-40 interleaved reps).
    # alpha goes on the logit gradient, in the fusion that makes it, rather than on dq's and dk's dot outputs,
    # where it cost two more passes over G x H x block x D a step (backward 1.04-1.05x on the main job's and
    # B64_N256_H2_D32's attention, 0.95-1.02x on D64 shapes; 2026-12-07, one process, 40 interleaved reps).
    dla_GxHxKxQ = s.alpha * dl_GxHxKxQ
    dla_GxHxQxK = lax.optimization_barrier(jnp.swapaxes(dla_GxHxKxQ, 2, 3))
    dq_HxTpxD = scatter_add_blocks(dq_HxTpxD, q_at_G,
                                   dot("ghqk,ghkd->ghqd", dla_GxHxQxK, k_GxHxKxD.astype(jnp.float32)))
    dk_HxTpxD = scatter_add_blocks(dk_HxTpxD, k_at_G,
                                   dot("ghkq,ghqd->ghkd", dla_GxHxKxQ, q_GxHxQxD.astype(jnp.float32)))
    dv_HxTpxDv = scatter_add_blocks(dv_HxTpxDv, k_at_G, dot("ghkq,ghqd->ghkd", w_GxHxKxQ, do_GxHxQxDv))
    if s.has_bias:
      dbias = ctx.add_dbias(dbias, bias_at, dl_GxHxKxQ)
    return dq_HxTpxD, dk_HxTpxD, dv_HxTpxDv, dbias

  def loop(ctx):
    init = (jnp.zeros(q_p.shape, jnp.float32), jnp.zeros(k_p.shape, jnp.float32),
            jnp.zeros(v_p.shape, jnp.float32), ctx.dbias_init(q_p.shape[0], num_buckets))
    init = vma.like(init, q_p, k_p, v_p, dout_TxHxDv, offsets_Bp1, targets_B, bias_HxR)
    dq, dk, dv, dbias = lax.fori_loop(0, ctx.n_groups, functools.partial(body, ctx), init)
    return dq, dk, dv, ctx.dbias(dbias, num_buckets)

  dq, dk, dv, dbias = ctx.switch(loop)
  return (token_major(dq, capacity, q_p.dtype), token_major(dk, capacity, k_p.dtype),
          token_major(dv, capacity, v_p.dtype), None, None, dbias.astype(bias_HxR.dtype))


_attention.defvjp(_attention_fwd, _attention_bwd)


def hstu_attention(q_TxHxD, k_TxHxD, v_TxHxDv, offsets_Bp1, *, max_seq_len: int, alpha: float,
                   causal: bool = True, num_targets=None, max_attn_len: int = 0,
                   contextual_seq_len: int = 0, rel_bias_HxR=None, block: int = DEFAULT_TILES.block,
                   group: int = DEFAULT_TILES.group):
  """HSTU attention over jagged rows (reference.hstu_attention's contract); out_TxHxDv in v's dtype.

  block: tile edge in tokens (queries and keys); executed work is n_tiles * block^2 pairs (plus the
  padding tiles of a last partial group, which are all masked). group: tiles per loop step.
  Rows longer than N are outside the contract (as in the reference); here their tokens past N get 0.
  """
  capacity, num_heads, _ = q_TxHxD.shape
  if k_TxHxD.shape != q_TxHxD.shape or v_TxHxDv.shape[:2] != (capacity, num_heads):
    raise ValueError(f"hstu_attention: q {q_TxHxD.shape}, k {k_TxHxD.shape}, v {v_TxHxDv.shape} disagree")
  if block < 1 or group < 1 or max_seq_len < 1:
    raise ValueError(f"hstu_attention: block ({block}), group ({group}) and max_seq_len ({max_seq_len}) must be "
                     ">= 1")
  num_rows = offsets_Bp1.shape[0] - 1
  if rel_bias_HxR is not None and (rel_bias_HxR.ndim != 2 or rel_bias_HxR.shape[0] != num_heads):
    raise ValueError(f"hstu_attention: rel_bias has shape {rel_bias_HxR.shape}, expected ({num_heads}, R)")
  targets_B = _targets(num_targets, num_rows)
  if capacity == 0 or num_rows == 0:  # no tokens or no rows: nothing to attend
    return jnp.zeros_like(v_TxHxDv)
  s = Static(max_seq_len, float(alpha), causal, num_targets is not None, max_attn_len,
              contextual_seq_len, block, rel_bias_HxR is not None, group)
  # Without a bias the loops never read it; a 1-bucket stand-in keeps one custom_vjp signature.
  bias_HxR = rel_bias_HxR if rel_bias_HxR is not None else jnp.zeros((num_heads, 1), jnp.float32)
  out = _attention(s, q_TxHxD, k_TxHxD, v_TxHxDv, jnp.asarray(offsets_Bp1, jnp.int32), targets_B, bias_HxR)
  return out


__all__ = ["CANDIDATES", "DEFAULT_TILES", "TileConfig", "executed_pairs", "hstu_attention", "tile_capacity"]
