"""Pallas kernels of HSTU jagged attention: forward, dq, and dk/dv/d rel_bias (reference.py is the spec).

Letters: Tp padded token capacity (T + the larger block, so a tile that starts inside a row can always
be read whole), B rows, H heads, D q/k width, Dv value width, N max_seq_len, Rp bias buckets padded
to a power of two, G bias segments (distances [lo, hi) sharing one bucket), Gp G padded to a power of
two, Q block_q, K block_k. Row-local token positions are i (queries) and j (keys).

Every kernel runs on the grid (B, H, ceil(N / block)) over the jagged arrays as stored: a program
reads its row's offsets from a small int32 input, skips blocks past the row's end, and loops only over
the tiles that the causal band, the window and the contextual prefix can reach. Tiles are masked with
the exact mask of the reference and stores are masked to the row, so rows never touch each other.
This module must never build a T x T or B x N x N array, and never imports anything but jax/numpy.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pl_triton

from pallas_kernels import vma
from pallas_kernels.hstu_attention import masks

_MAX_BUCKET_DISTANCE = 1 << 15  # must match reference.relative_position_bucket


@dataclasses.dataclass(frozen=True)
class HSTUStatic:
  """Everything about one call that is known at trace time (hashable: it keys compiled kernels)."""
  max_seq_len: int
  alpha: float
  causal: bool
  has_targets: bool
  max_attn_len: int
  contextual_seq_len: int
  block_q: int
  block_k: int
  # (bucket, lo, hi): distances lo <= |d| < hi use bias bucket `bucket`; empty without rel_bias.
  segments: tuple[tuple[int, int, int], ...] = ()


def bucket_segments(max_seq_len: int, num_buckets: int) -> tuple[tuple[int, int, int], ...]:
  """Runs of equal relative_position_bucket over distances [0, N), computed in numpy at trace time.

  The bucket is non-decreasing in distance, so each bucket is one run and the in-kernel bias is G
  compares against static bounds instead of a gather.
  """
  e = max(num_buckets // 2, 1)
  d = np.minimum(np.arange(max_seq_len, dtype=np.int64), _MAX_BUCKET_DISTANCE)
  ratio = np.maximum((d * d) // (e * e), 1)
  far = e + np.floor(np.log2(ratio)).astype(np.int64)  # exact: ratio is a small positive integer
  bucket = np.where(d < e, d, np.minimum(far, num_buckets - 1))
  segments, lo = [], 0
  for dist in range(1, max_seq_len + 1):
    if dist == max_seq_len or bucket[dist] != bucket[lo]:
      segments.append((int(bucket[lo]), lo, dist))
      lo = dist
  return tuple(segments)


def dot(a, b, contract_a: int, contract_b: int):
  # HIGHEST keeps f32 inputs in IEEE f32 on GPU (no TF32): the f32 tests compare at 1e-5.
  return lax.dot_general(a, b, (((contract_a,), (contract_b,)), ((), ())),
                         precision=lax.Precision.HIGHEST, preferred_element_type=jnp.float32)


def _pos(idx, max_pos, s: HSTUStatic):
  return masks.position(idx, max_pos, contextual_seq_len=s.contextual_seq_len, has_targets=s.has_targets)


def row_span(offsets_ref, targets_ref, s: HSTUStatic):
  """(start, n_in, max_pos) of this program's row; n_in = length clipped to N (reference pads to N)."""
  b = pl.program_id(0)
  start = offsets_ref[b]
  length = offsets_ref[b + 1] - start
  c = s.contextual_seq_len
  max_pos = length - (c - 1 if c > 0 else 0) - (targets_ref[b] if s.has_targets else 0)
  return start, jnp.minimum(length, s.max_seq_len), max_pos


def tile_mask(i_Qx1, j_1xK, n_in, max_pos, s: HSTUStatic):
  """(mask_QxK, d_QxK) exactly as reference.attention_mask, for one tile."""
  return masks.tile_mask(i_Qx1, j_1xK, n_in, max_pos, causal=s.causal, max_attn_len=s.max_attn_len,
                         contextual_seq_len=s.contextual_seq_len, has_targets=s.has_targets)


def _logits(q_QxD, k_KxD, d_QxK, bias_ref, s: HSTUStatic):
  logits_QxK = s.alpha * dot(q_QxD, k_KxD, 1, 1)
  dist_QxK = jnp.abs(d_QxK)
  for bucket, lo, hi in s.segments:
    logits_QxK = logits_QxK + jnp.where((dist_QxK >= lo) & (dist_QxK < hi),
                                        bias_ref[bucket].astype(jnp.float32), 0.0)
  return logits_QxK


def _sigmoid(x):
  return 1.0 / (1.0 + jnp.exp(-x))


def cdiv(a, b: int):
  return (a + b - 1) // b


def key_blocks(q0, n_in, max_pos, s: HSTUStatic):
  """[lo, hi) of the key blocks that queries [q0, q0 + Q) of this row can see (a superset)."""
  num = cdiv(n_in, s.block_k)
  if not s.causal:
    return jnp.int32(0), num
  c = s.contextual_seq_len
  # Non-contextual queries see keys j <= i only: p is non-decreasing and d > 0 needs p(j) < p(i).
  hi = (jnp.minimum(q0 + s.block_q, n_in) - 1) // s.block_k + 1
  lo = jnp.int32(0)
  if s.max_attn_len > 0:
    # Keys need p(j) >= p(q0) - w; invert p (p(j) >= P > 0 <=> j >= P + c - 1 when c > 0).
    p_lo = _pos(q0, max_pos, s) - s.max_attn_len
    j_lo = jnp.where(p_lo > 0, p_lo + (c - 1 if c > 0 else 0), 0)
    lo = j_lo // s.block_k
  if c > 0:  # contextual queries see every history key
    lo = jnp.where(q0 < c, 0, lo)
    hi = jnp.where(q0 < c, num, hi)
  return lo, hi


def query_blocks(k0, n_in, max_pos, s: HSTUStatic):
  """(ctx, lo, hi): query blocks [0, ctx) (contextual prefix) and [lo, hi) can see keys [k0, k0 + K)."""
  num = cdiv(n_in, s.block_q)
  if not s.causal:
    return jnp.int32(0), jnp.int32(0), num
  c = s.contextual_seq_len
  ctx = cdiv(jnp.minimum(c, n_in), s.block_q) if c > 0 else jnp.int32(0)
  hi = num
  if s.max_attn_len > 0:
    # Queries need p(i) <= p(last key) + w; targets all share max_pos.
    p_hi = _pos(jnp.minimum(k0 + s.block_k, n_in) - 1, max_pos, s) + s.max_attn_len
    i_hi = p_hi + (c - 1 if c > 0 else 0)
    if s.has_targets:
      i_hi = jnp.where(max_pos <= p_hi, n_in - 1, i_hi)
    hi = jnp.minimum(i_hi, n_in - 1) // s.block_q + 1
  return ctx, jnp.maximum(k0 // s.block_q, ctx), hi


def load_rows(ref, start, first, size: int, n_in):
  """Rows [first, first + size) of the row at `start`, zero past the row (they may be the next row)."""
  x = ref[pl.ds(start + first, size), :]
  valid = (first + jnp.arange(size, dtype=jnp.int32) < n_in)[:, None]
  return jnp.where(valid, x, jnp.zeros((), x.dtype)), valid


def store_rows(ref, start, first, value, valid):
  pl_triton.store(ref.at[pl.ds(start + first, value.shape[0]), :], value.astype(ref.dtype),
                  mask=valid & jnp.ones(value.shape, jnp.bool_))


def _split_refs(refs, num_inputs: int, has_bias: bool):
  inputs = list(refs[:num_inputs])
  bias_ref = refs[num_inputs] if has_bias else None
  return inputs, bias_ref, refs[num_inputs + int(has_bias):]


def _fwd_kernel(offsets_ref, targets_ref, *refs, s: HSTUStatic):
  (q_ref, k_ref, v_ref), bias_ref, (out_ref,) = _split_refs(refs, 3, bool(s.segments))
  start, n_in, max_pos = row_span(offsets_ref, targets_ref, s)
  q0 = pl.program_id(2) * s.block_q

  @pl.when(q0 < n_in)
  def _():
    q_QxD, valid_Qx1 = load_rows(q_ref, start, q0, s.block_q, n_in)
    i_Qx1 = q0 + jnp.arange(s.block_q, dtype=jnp.int32)[:, None]

    def body(kb, acc_QxDv):
      k0 = kb * s.block_k
      k_KxD, _ = load_rows(k_ref, start, k0, s.block_k, n_in)
      v_KxDv, _ = load_rows(v_ref, start, k0, s.block_k, n_in)
      j_1xK = k0 + jnp.arange(s.block_k, dtype=jnp.int32)[None, :]
      mask_QxK, d_QxK = tile_mask(i_Qx1, j_1xK, n_in, max_pos, s)
      logits_QxK = _logits(q_QxD, k_KxD, d_QxK, bias_ref, s)
      # `where`, not a multiply: masked logits may be inf and must not become NaN.
      w_QxK = jnp.where(mask_QxK, logits_QxK * _sigmoid(logits_QxK), 0.0) / s.max_seq_len
      return acc_QxDv + dot(w_QxK.astype(v_KxDv.dtype), v_KxDv, 1, 0)

    lo, hi = key_blocks(q0, n_in, max_pos, s)
    acc_QxDv = lax.fori_loop(lo, hi, body, jnp.zeros((s.block_q, out_ref.shape[-1]), jnp.float32))
    store_rows(out_ref, start, q0, acc_QxDv, valid_Qx1)


def _dlogits(q_QxD, k_KxD, v_KxDv, do_QxDv, i_Qx1, j_1xK, n_in, max_pos, bias_ref, s):
  """(weights_QxK, dlogits_QxK) of one tile: the forward weights and d loss / d logits."""
  mask_QxK, d_QxK = tile_mask(i_Qx1, j_1xK, n_in, max_pos, s)
  logits_QxK = _logits(q_QxD, k_KxD, d_QxK, bias_ref, s)
  sig_QxK = _sigmoid(logits_QxK)
  w_QxK = jnp.where(mask_QxK, logits_QxK * sig_QxK, 0.0) / s.max_seq_len
  dw_QxK = dot(do_QxDv, v_KxDv, 1, 1)
  dsilu_QxK = sig_QxK * (1.0 + logits_QxK * (1.0 - sig_QxK))
  return w_QxK, jnp.where(mask_QxK, dw_QxK * dsilu_QxK, 0.0) / s.max_seq_len, d_QxK


def _dq_kernel(offsets_ref, targets_ref, *refs, s: HSTUStatic):
  (q_ref, k_ref, v_ref, do_ref), bias_ref, (dq_ref,) = _split_refs(refs, 4, bool(s.segments))
  start, n_in, max_pos = row_span(offsets_ref, targets_ref, s)
  q0 = pl.program_id(2) * s.block_q

  @pl.when(q0 < n_in)
  def _():
    q_QxD, valid_Qx1 = load_rows(q_ref, start, q0, s.block_q, n_in)
    do_QxDv, _ = load_rows(do_ref, start, q0, s.block_q, n_in)
    i_Qx1 = q0 + jnp.arange(s.block_q, dtype=jnp.int32)[:, None]

    def body(kb, acc_QxD):
      k0 = kb * s.block_k
      k_KxD, _ = load_rows(k_ref, start, k0, s.block_k, n_in)
      v_KxDv, _ = load_rows(v_ref, start, k0, s.block_k, n_in)
      j_1xK = k0 + jnp.arange(s.block_k, dtype=jnp.int32)[None, :]
      _, dl_QxK, _ = _dlogits(q_QxD, k_KxD, v_KxDv, do_QxDv, i_Qx1, j_1xK, n_in, max_pos, bias_ref, s)
      return acc_QxD + dot(dl_QxK.astype(k_KxD.dtype), k_KxD, 1, 0)

    lo, hi = key_blocks(q0, n_in, max_pos, s)
    acc_QxD = lax.fori_loop(lo, hi, body, jnp.zeros((s.block_q, dq_ref.shape[-1]), jnp.float32))
    store_rows(dq_ref, start, q0, s.alpha * acc_QxD, valid_Qx1)


def _dkv_kernel(offsets_ref, targets_ref, *refs, s: HSTUStatic):
  has_bias = bool(s.segments)
  (q_ref, k_ref, v_ref, do_ref), bias_ref, out_refs = _split_refs(refs, 4, has_bias)
  dk_ref, dv_ref = out_refs[:2]
  start, n_in, max_pos = row_span(offsets_ref, targets_ref, s)
  k0 = pl.program_id(2) * s.block_k
  num_seg = out_refs[2].shape[-1] if has_bias else 1

  if has_bias:  # every program writes its partial d bias, even when it has no keys
    out_refs[2][...] = jnp.zeros((num_seg,), out_refs[2].dtype)

  @pl.when(k0 < n_in)
  def _():
    k_KxD, valid_Kx1 = load_rows(k_ref, start, k0, s.block_k, n_in)
    v_KxDv, _ = load_rows(v_ref, start, k0, s.block_k, n_in)
    j_1xK = k0 + jnp.arange(s.block_k, dtype=jnp.int32)[None, :]
    seg_G = jnp.arange(num_seg, dtype=jnp.int32)

    def body(step, carry):
      dk_KxD, dv_KxDv, dbias_G = carry
      q0 = jnp.where(step < ctx, step, step - ctx + lo) * s.block_q
      q_QxD, _ = load_rows(q_ref, start, q0, s.block_q, n_in)
      do_QxDv, _ = load_rows(do_ref, start, q0, s.block_q, n_in)
      i_Qx1 = q0 + jnp.arange(s.block_q, dtype=jnp.int32)[:, None]
      w_QxK, dl_QxK, d_QxK = _dlogits(q_QxD, k_KxD, v_KxDv, do_QxDv, i_Qx1, j_1xK, n_in, max_pos,
                                      bias_ref, s)
      dk_KxD = dk_KxD + dot(dl_QxK.astype(q_QxD.dtype), q_QxD, 0, 0)
      dv_KxDv = dv_KxDv + dot(w_QxK.astype(do_QxDv.dtype), do_QxDv, 0, 0)
      dist_QxK = jnp.abs(d_QxK)
      for g, (_, seg_lo, seg_hi) in enumerate(s.segments):
        total = jnp.sum(jnp.where((dist_QxK >= seg_lo) & (dist_QxK < seg_hi), dl_QxK, 0.0))
        dbias_G = dbias_G + jnp.where(seg_G == g, total, 0.0)
      return dk_KxD, dv_KxDv, dbias_G

    ctx, lo, hi = query_blocks(k0, n_in, max_pos, s)
    init = (jnp.zeros((s.block_k, dk_ref.shape[-1]), jnp.float32),
            jnp.zeros((s.block_k, dv_ref.shape[-1]), jnp.float32),
            jnp.zeros((num_seg,), jnp.float32))
    dk_KxD, dv_KxDv, dbias_G = lax.fori_loop(0, ctx + jnp.maximum(hi - lo, 0), body, init)
    store_rows(dk_ref, start, k0, s.alpha * dk_KxD, valid_Kx1)
    store_rows(dv_ref, start, k0, dv_KxDv, valid_Kx1)
    if has_bias:
      out_refs[2][...] = dbias_G


def compiler_params(s: HSTUStatic, num_stages: int):
  """Pallas-Triton by name: without compiler params jax >= 0.10 lowers pallas_call to Mosaic GPU on
  NVIDIA, which these kernels (Triton masked stores, tiles at dynamic row offsets) were not written for
  and which rejects them (e.g. the 16-byte offsets block). Interpret mode ignores the params.

  8 warps from 128 x 64 tiles keep the f32 Q x K logits and the accumulators out of local memory. The
  forward streams only k/v tiles through its loop (3 stages); the backward loops also hold a second pair
  of tiles and two accumulators, so they take 2 to leave shared memory for them.
  """
  return pl_triton.CompilerParams(num_warps=8 if s.block_q * s.block_k >= 128 * 64 else 4,
                                  num_stages=num_stages)


def slab_spec(x_shape):
  return pl.BlockSpec((x_shape[0], None, x_shape[2]), lambda b, h, i: (0, h, 0))


def common_specs(s: HSTUStatic, offsets_Bp, targets_Bp, arrays, bias_HxRp):
  """in_specs and operands: row metadata whole, each Tp x H x W array as its head's Tp x W slab."""
  specs = [pl.BlockSpec(offsets_Bp.shape, lambda b, h, i: (0,)),
           pl.BlockSpec(targets_Bp.shape, lambda b, h, i: (0,))]
  specs += [slab_spec(x.shape) for x in arrays]
  operands = [offsets_Bp, targets_Bp, *arrays]
  if s.segments:
    specs.append(pl.BlockSpec((None, bias_HxRp.shape[1]), lambda b, h, i: (h, 0)))
    operands.append(bias_HxRp)
  return specs, operands


def hstu_attention_fwd_pallas(q_TpxHxD, k_TpxHxD, v_TpxHxDv, offsets_Bp, targets_Bp, bias_HxRp,
                              num_rows: int, s: HSTUStatic, interpret: bool):
  """out_TpxHxDv; slots no row owns (past offsets[B], or past N inside a row) are left unwritten.

  offsets_Bp / targets_Bp: int32, padded to a power of two (Triton tiles), offsets_Bp[:B+1] real.
  bias_HxRp: rel_bias padded to a power of two of buckets (ignored when s.segments is empty).
  """
  specs, operands = common_specs(s, offsets_Bp, targets_Bp, (q_TpxHxD, k_TpxHxD, v_TpxHxDv), bias_HxRp)
  grid = (num_rows, q_TpxHxD.shape[1], cdiv(s.max_seq_len, s.block_q))
  return vma.interpretable(pl.pallas_call(
      lambda *refs: _fwd_kernel(*refs, s=s), grid=grid, in_specs=specs,
      out_specs=slab_spec(v_TpxHxDv.shape),
      out_shape=vma.shape_dtype(v_TpxHxDv.shape, v_TpxHxDv.dtype, *operands),
      compiler_params=compiler_params(s, num_stages=3), interpret=interpret,
      name="hstu_attention_fwd"), *operands, interpret=interpret)


def hstu_attention_bwd_pallas(q_TpxHxD, k_TpxHxD, v_TpxHxDv, do_TpxHxDv, offsets_Bp, targets_Bp,
                              bias_HxRp, num_rows: int, s: HSTUStatic, interpret: bool):
  """(dq_TpxHxD, dk_TpxHxD, dv_TpxHxDv, dbias_HxG or None); unowned slots unwritten as in forward.

  dbias_HxG is per bias segment (s.segments[g]); the caller adds it into its bucket.
  """
  arrays = (q_TpxHxD, k_TpxHxD, v_TpxHxDv, do_TpxHxDv)
  specs, operands = common_specs(s, offsets_Bp, targets_Bp, arrays, bias_HxRp)
  num_heads = q_TpxHxD.shape[1]
  dq_TpxHxD = vma.interpretable(pl.pallas_call(
      lambda *refs: _dq_kernel(*refs, s=s),
      grid=(num_rows, num_heads, cdiv(s.max_seq_len, s.block_q)), in_specs=specs,
      out_specs=slab_spec(q_TpxHxD.shape),
      out_shape=vma.shape_dtype(q_TpxHxD.shape, q_TpxHxD.dtype, *operands),
      compiler_params=compiler_params(s, num_stages=2), interpret=interpret,
      name="hstu_attention_dq"), *operands, interpret=interpret)

  num_kb = cdiv(s.max_seq_len, s.block_k)
  out_specs = [slab_spec(k_TpxHxD.shape), slab_spec(v_TpxHxDv.shape)]
  out_shape = [vma.shape_dtype(k_TpxHxD.shape, k_TpxHxD.dtype, *operands),
               vma.shape_dtype(v_TpxHxDv.shape, v_TpxHxDv.dtype, *operands)]
  if s.segments:
    num_seg = pl.next_power_of_2(len(s.segments))
    out_specs.append(pl.BlockSpec((None, None, None, num_seg), lambda b, h, i: (b, h, i, 0)))
    out_shape.append(vma.shape_dtype((num_rows, num_heads, num_kb, num_seg), jnp.float32, *operands))
  outs = vma.interpretable(pl.pallas_call(
      lambda *refs: _dkv_kernel(*refs, s=s), grid=(num_rows, num_heads, num_kb), in_specs=specs,
      out_specs=out_specs, out_shape=out_shape, compiler_params=compiler_params(s, num_stages=2),
      interpret=interpret, name="hstu_attention_dkv"), *operands, interpret=interpret)
  dbias_HxG = outs[2].sum(axis=(0, 2))[:, :len(s.segments)] if s.segments else None
  return dq_TpxHxD, outs[0], outs[1], dbias_HxG
