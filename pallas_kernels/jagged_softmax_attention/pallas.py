"""Pallas kernels of jagged softmax attention (flash-style forward, dq, dk/dv) and their custom_vjp entry.

reference.py is the spec: softmax(scale * q . k) over the keys the HSTU mask allows, f32 softmax and
accumulation, output in v's dtype, slots past offsets[B] zero. The jagged layout, grid, block ranges and
tile mask are the HSTU Pallas kernel's (pallas_kernels/hstu_attention/pallas.py), imported, not copied:
every kernel runs on the grid (B, H, ceil(N / block)), reads its row's offsets, skips blocks past the row
end and loops only over the tiles the causal band, the window and the contextual prefix can reach.

The forward keeps an online softmax (running max m, sum l, f32 accumulator) over the key blocks and saves
the per-row logsumexp lse = m + log l; the backward recomputes p = exp(scale * q . k - lse) from it, with
delta_i = sum(do_i * out_i), ds = p * (do . v - delta):  dq = scale ds k,  dk = scale ds^T q,  dv = p^T do.

Letters as in the HSTU kernel: Tp padded token capacity, B rows, H heads, D q/k width, Dv value width,
N max_seq_len, Q block_q, K block_k. Row statistics (lse, delta) are stored H x Tp (one f32 per token).
This module must never build a T x T or B x N x N array, and never imports anything but jax/numpy and
the HSTU kernel package.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pl_triton

from pallas_kernels import vma
from pallas_kernels.hstu_attention import api as hstu_api
from pallas_kernels.hstu_attention import pallas as hp
from pallas_kernels.hstu_attention.config import HSTUBlockConfig
from pallas_kernels.jagged_softmax_attention.reference import check_offsets, check_shapes

# Finite "minus infinity" for the running max: exp(x - m) stays 0 (never NaN) while a query block has
# seen no allowed key yet, and padded query rows (which never see one) stay finite.
_NEG = -1e30


def _stat_spec(stat_shape):
  return pl.BlockSpec((None, stat_shape[1]), lambda b, h, i: (h, 0))


def _load_stat(ref, start, first, size: int, valid_Qx1):
  """One f32 per token for tokens [first, first + size) of the row; 0 past the row (never read there)."""
  x_Q = ref[pl.ds(start + first, size)]
  return jnp.where(valid_Qx1, x_Q[:, None], 0.0)


def _logits(q_QxD, k_KxD, s: hp.HSTUStatic):
  return s.alpha * hp.dot(q_QxD, k_KxD, 1, 1)  # HSTUStatic.alpha carries `scale` here


def _fwd_kernel(offsets_ref, targets_ref, q_ref, k_ref, v_ref, out_ref, lse_ref, *, s: hp.HSTUStatic):
  start, n_in, max_pos = hp.row_span(offsets_ref, targets_ref, s)
  q0 = pl.program_id(2) * s.block_q

  @pl.when(q0 < n_in)
  def _():
    q_QxD, valid_Qx1 = hp.load_rows(q_ref, start, q0, s.block_q, n_in)
    i_Qx1 = q0 + jnp.arange(s.block_q, dtype=jnp.int32)[:, None]

    def body(kb, carry):
      m_Qx1, l_Qx1, acc_QxDv = carry
      k0 = kb * s.block_k
      k_KxD, _ = hp.load_rows(k_ref, start, k0, s.block_k, n_in)
      v_KxDv, _ = hp.load_rows(v_ref, start, k0, s.block_k, n_in)
      j_1xK = k0 + jnp.arange(s.block_k, dtype=jnp.int32)[None, :]
      mask_QxK, _ = hp.tile_mask(i_Qx1, j_1xK, n_in, max_pos, s)
      logits_QxK = _logits(q_QxD, k_KxD, s)
      m_new_Qx1 = jnp.maximum(m_Qx1, jnp.max(jnp.where(mask_QxK, logits_QxK, _NEG), axis=1, keepdims=True))
      # `where`, not a multiply: a masked logit must contribute exactly 0, never inf * 0.
      p_QxK = jnp.where(mask_QxK, jnp.exp(logits_QxK - m_new_Qx1), 0.0)
      corr_Qx1 = jnp.exp(m_Qx1 - m_new_Qx1)
      l_Qx1 = corr_Qx1 * l_Qx1 + jnp.sum(p_QxK, axis=1, keepdims=True)
      acc_QxDv = corr_Qx1 * acc_QxDv + hp.dot(p_QxK.astype(v_KxDv.dtype), v_KxDv, 1, 0)
      return m_new_Qx1, l_Qx1, acc_QxDv

    lo, hi = hp.key_blocks(q0, n_in, max_pos, s)
    init = (jnp.full((s.block_q, 1), _NEG, jnp.float32), jnp.zeros((s.block_q, 1), jnp.float32),
            jnp.zeros((s.block_q, out_ref.shape[-1]), jnp.float32))
    m_Qx1, l_Qx1, acc_QxDv = lax.fori_loop(lo, hi, body, init)
    # Every real query sees at least its own key (causal) or its whole row; l == 0 only on padded rows.
    l_Qx1 = jnp.where(l_Qx1 > 0, l_Qx1, 1.0)
    hp.store_rows(out_ref, start, q0, acc_QxDv / l_Qx1, valid_Qx1)
    lse_Qx1 = m_Qx1 + jnp.log(l_Qx1)
    pl_triton.store(lse_ref.at[pl.ds(start + q0, s.block_q)], lse_Qx1[:, 0], mask=valid_Qx1[:, 0])


def _probs_and_dlogits(q_QxD, k_KxD, v_KxDv, do_QxDv, lse_Qx1, delta_Qx1, i_Qx1, j_1xK, n_in, max_pos, s):
  """(p_QxK, ds_QxK): the forward probabilities of one tile (from the saved lse) and d loss / d logits."""
  mask_QxK, _ = hp.tile_mask(i_Qx1, j_1xK, n_in, max_pos, s)
  p_QxK = jnp.where(mask_QxK, jnp.exp(_logits(q_QxD, k_KxD, s) - lse_Qx1), 0.0)
  dp_QxK = hp.dot(do_QxDv, v_KxDv, 1, 1)
  return p_QxK, p_QxK * (dp_QxK - delta_Qx1)


def _dq_kernel(offsets_ref, targets_ref, q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref, dq_ref, *,
               s: hp.HSTUStatic):
  start, n_in, max_pos = hp.row_span(offsets_ref, targets_ref, s)
  q0 = pl.program_id(2) * s.block_q

  @pl.when(q0 < n_in)
  def _():
    q_QxD, valid_Qx1 = hp.load_rows(q_ref, start, q0, s.block_q, n_in)
    do_QxDv, _ = hp.load_rows(do_ref, start, q0, s.block_q, n_in)
    lse_Qx1 = _load_stat(lse_ref, start, q0, s.block_q, valid_Qx1)
    delta_Qx1 = _load_stat(delta_ref, start, q0, s.block_q, valid_Qx1)
    i_Qx1 = q0 + jnp.arange(s.block_q, dtype=jnp.int32)[:, None]

    def body(kb, acc_QxD):
      k0 = kb * s.block_k
      k_KxD, _ = hp.load_rows(k_ref, start, k0, s.block_k, n_in)
      v_KxDv, _ = hp.load_rows(v_ref, start, k0, s.block_k, n_in)
      j_1xK = k0 + jnp.arange(s.block_k, dtype=jnp.int32)[None, :]
      _, ds_QxK = _probs_and_dlogits(q_QxD, k_KxD, v_KxDv, do_QxDv, lse_Qx1, delta_Qx1, i_Qx1, j_1xK,
                                     n_in, max_pos, s)
      return acc_QxD + hp.dot(ds_QxK.astype(k_KxD.dtype), k_KxD, 1, 0)

    lo, hi = hp.key_blocks(q0, n_in, max_pos, s)
    acc_QxD = lax.fori_loop(lo, hi, body, jnp.zeros((s.block_q, dq_ref.shape[-1]), jnp.float32))
    hp.store_rows(dq_ref, start, q0, s.alpha * acc_QxD, valid_Qx1)


def _dkv_kernel(offsets_ref, targets_ref, q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref, dk_ref, dv_ref,
                *, s: hp.HSTUStatic):
  start, n_in, max_pos = hp.row_span(offsets_ref, targets_ref, s)
  k0 = pl.program_id(2) * s.block_k

  @pl.when(k0 < n_in)
  def _():
    k_KxD, valid_Kx1 = hp.load_rows(k_ref, start, k0, s.block_k, n_in)
    v_KxDv, _ = hp.load_rows(v_ref, start, k0, s.block_k, n_in)
    j_1xK = k0 + jnp.arange(s.block_k, dtype=jnp.int32)[None, :]

    def body(step, carry):
      dk_KxD, dv_KxDv = carry
      # Steps [0, ctx) walk the contextual prefix, the rest the band [lo, hi) (see hp.query_blocks).
      q0 = jnp.where(step < ctx, step, step - ctx + lo) * s.block_q
      q_QxD, valid_Qx1 = hp.load_rows(q_ref, start, q0, s.block_q, n_in)
      do_QxDv, _ = hp.load_rows(do_ref, start, q0, s.block_q, n_in)
      lse_Qx1 = _load_stat(lse_ref, start, q0, s.block_q, valid_Qx1)
      delta_Qx1 = _load_stat(delta_ref, start, q0, s.block_q, valid_Qx1)
      i_Qx1 = q0 + jnp.arange(s.block_q, dtype=jnp.int32)[:, None]
      p_QxK, ds_QxK = _probs_and_dlogits(q_QxD, k_KxD, v_KxDv, do_QxDv, lse_Qx1, delta_Qx1, i_Qx1, j_1xK,
                                         n_in, max_pos, s)
      dk_KxD = dk_KxD + hp.dot(ds_QxK.astype(q_QxD.dtype), q_QxD, 0, 0)
      dv_KxDv = dv_KxDv + hp.dot(p_QxK.astype(do_QxDv.dtype), do_QxDv, 0, 0)
      return dk_KxD, dv_KxDv

    ctx, lo, hi = hp.query_blocks(k0, n_in, max_pos, s)
    init = (jnp.zeros((s.block_k, dk_ref.shape[-1]), jnp.float32),
            jnp.zeros((s.block_k, dv_ref.shape[-1]), jnp.float32))
    dk_KxD, dv_KxDv = lax.fori_loop(0, ctx + jnp.maximum(hi - lo, 0), body, init)
    hp.store_rows(dk_ref, start, k0, s.alpha * dk_KxD, valid_Kx1)
    hp.store_rows(dv_ref, start, k0, dv_KxDv, valid_Kx1)


def softmax_attention_fwd_pallas(q_TpxHxD, k_TpxHxD, v_TpxHxDv, offsets_Bp, targets_Bp, num_rows: int,
                                 s: hp.HSTUStatic, interpret: bool):
  """(out_TpxHxDv, lse_HxTp); slots no row owns are left unwritten (the caller zeroes them)."""
  specs, operands = hp.common_specs(s, offsets_Bp, targets_Bp, (q_TpxHxD, k_TpxHxD, v_TpxHxDv), None)
  lse_shape = (q_TpxHxD.shape[1], q_TpxHxD.shape[0])
  return vma.interpretable(pl.pallas_call(
      functools.partial(_fwd_kernel, s=s),
      grid=(num_rows, q_TpxHxD.shape[1], hp.cdiv(s.max_seq_len, s.block_q)), in_specs=specs,
      out_specs=[hp.slab_spec(v_TpxHxDv.shape), _stat_spec(lse_shape)],
      out_shape=[vma.shape_dtype(v_TpxHxDv.shape, v_TpxHxDv.dtype, *operands),
                 vma.shape_dtype(lse_shape, jnp.float32, *operands)],
      compiler_params=hp.compiler_params(s, num_stages=3), interpret=interpret,
      name="jagged_softmax_attention_fwd"), *operands, interpret=interpret)


def softmax_attention_bwd_pallas(q_TpxHxD, k_TpxHxD, v_TpxHxDv, do_TpxHxDv, lse_HxTp, delta_HxTp, offsets_Bp,
                                 targets_Bp, num_rows: int, s: hp.HSTUStatic, interpret: bool):
  """(dq_TpxHxD, dk_TpxHxD, dv_TpxHxDv); unowned slots unwritten as in the forward."""
  specs, operands = hp.common_specs(s, offsets_Bp, targets_Bp,
                                     (q_TpxHxD, k_TpxHxD, v_TpxHxDv, do_TpxHxDv), None)
  specs += [_stat_spec(lse_HxTp.shape), _stat_spec(delta_HxTp.shape)]
  operands += [lse_HxTp, delta_HxTp]
  num_heads = q_TpxHxD.shape[1]
  dq_TpxHxD = vma.interpretable(pl.pallas_call(
      functools.partial(_dq_kernel, s=s),
      grid=(num_rows, num_heads, hp.cdiv(s.max_seq_len, s.block_q)), in_specs=specs,
      out_specs=hp.slab_spec(q_TpxHxD.shape),
      out_shape=vma.shape_dtype(q_TpxHxD.shape, q_TpxHxD.dtype, *operands),
      compiler_params=hp.compiler_params(s, num_stages=2), interpret=interpret,
      name="jagged_softmax_attention_dq"), *operands, interpret=interpret)
  dk_TpxHxD, dv_TpxHxDv = vma.interpretable(pl.pallas_call(
      functools.partial(_dkv_kernel, s=s),
      grid=(num_rows, num_heads, hp.cdiv(s.max_seq_len, s.block_k)), in_specs=specs,
      out_specs=[hp.slab_spec(k_TpxHxD.shape), hp.slab_spec(v_TpxHxDv.shape)],
      out_shape=[vma.shape_dtype(k_TpxHxD.shape, k_TpxHxD.dtype, *operands),
                 vma.shape_dtype(v_TpxHxDv.shape, v_TpxHxDv.dtype, *operands)],
      compiler_params=hp.compiler_params(s, num_stages=2), interpret=interpret,
      name="jagged_softmax_attention_dkv"), *operands, interpret=interpret)
  return dq_TpxHxD, dk_TpxHxD, dv_TpxHxDv


def _prepare(block, q, k, v, offsets_Bp1, targets_B):
  """The HSTU entry's padding (one block of token rows, power-of-two metadata); no bias here."""
  q_p, k_p, v_p, offsets_Bp, targets_Bp, _ = hstu_api.prepare(None, block, q, k, v, offsets_Bp1,
                                                               targets_B, None)
  return q_p, k_p, v_p, offsets_Bp, targets_Bp


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1, 2))
def _attention(s, block, interpret, q, k, v, offsets_Bp1, targets_B):
  out, _ = _attention_fwd(s, block, interpret, q, k, v, offsets_Bp1, targets_B)
  return out


def _attention_fwd(s, block, interpret, q, k, v, offsets_Bp1, targets_B):
  operands = _prepare(block, q, k, v, offsets_Bp1, targets_B)
  out_p, lse_HxTp = softmax_attention_fwd_pallas(*operands, offsets_Bp1.shape[0] - 1, s, interpret)
  out = hstu_api.unpad(out_p, hstu_api.owned_mask_T(offsets_Bp1, q.shape[0], s.max_seq_len))
  return out, (q, k, v, out, lse_HxTp, offsets_Bp1, targets_B)


def _attention_bwd(s, block, interpret, residuals, do_TxHxDv):
  q, k, v, out, lse_HxTp, offsets_Bp1, targets_B = residuals
  q_p, k_p, v_p, offsets_Bp, targets_Bp = _prepare(block, q, k, v, offsets_Bp1, targets_B)
  pad = q_p.shape[0] - q.shape[0]
  do_p = jnp.pad(do_TxHxDv, ((0, pad), (0, 0), (0, 0)))
  # delta_i = sum_j p_ij dp_ij = do_i . out_i: O(T H Dv), cheaper outside the kernels than inside.
  delta_TxH = jnp.sum(do_TxHxDv.astype(jnp.float32) * out.astype(jnp.float32), axis=-1)
  delta_HxTp = jnp.pad(delta_TxH, ((0, pad), (0, 0))).T
  dq, dk, dv = softmax_attention_bwd_pallas(q_p, k_p, v_p, do_p.astype(v.dtype), lse_HxTp, delta_HxTp,
                                            offsets_Bp, targets_Bp, offsets_Bp1.shape[0] - 1, s, interpret)
  owned_T = hstu_api.owned_mask_T(offsets_Bp1, q.shape[0], s.max_seq_len)
  # Integer inputs (offsets, targets) get float0 zero cotangents.
  int_zero = lambda x: np.zeros(x.shape, jax.dtypes.float0)
  # Under shard_map each cotangent takes its input's varying axes (summed over the ones the kernel's
  # operands added, e.g. the batch axes of the offsets).
  grads = (vma.sum_to(hstu_api.unpad(g, owned_T), x) for g, x in ((dq, q), (dk, k), (dv, v)))
  return (*grads, int_zero(offsets_Bp1), int_zero(targets_B))


_attention.defvjp(_attention_fwd, _attention_bwd)


def jagged_softmax_attention(q_TxHxD, k_TxHxD, v_TxHxDv, offsets_Bp1, *, max_seq_len: int, scale: float,
                             causal: bool = True, num_targets=None, max_attn_len: int = 0,
                             contextual_seq_len: int = 0, block: HSTUBlockConfig = HSTUBlockConfig(),
                             interpret: bool | None = None):
  """Softmax attention over jagged rows with the Pallas kernels; see reference.jagged_softmax_attention.

  interpret: run the kernels in Pallas interpret mode (default: everywhere but on GPU).
  Rows must be no longer than max_seq_len (checked for host offsets); slots past offsets[B] are zero.
  """
  name = "jagged_softmax_attention"
  check_shapes(q_TxHxD, k_TxHxD, v_TxHxDv, name)
  capacity = q_TxHxD.shape[0]
  if max_seq_len < 1:
    raise ValueError(f"{name}: max_seq_len must be >= 1, got {max_seq_len}")
  if max_attn_len < 0 or contextual_seq_len < 0:
    raise ValueError(f"{name}: max_attn_len {max_attn_len} and contextual_seq_len {contextual_seq_len} "
                     "must be >= 0")
  check_offsets(offsets_Bp1, capacity, max_seq_len, name)
  if jnp.ndim(offsets_Bp1) != 1 or jnp.shape(offsets_Bp1)[0] < 1:
    raise ValueError(f"{name}: offsets must be 1-D with B + 1 >= 1 entries, got {jnp.shape(offsets_Bp1)}")
  num_rows = jnp.shape(offsets_Bp1)[0] - 1
  if num_targets is not None and jnp.shape(num_targets) != (num_rows,):
    raise ValueError(f"{name}: num_targets shape {jnp.shape(num_targets)}, expected ({num_rows},)")
  if capacity == 0 or num_rows == 0:  # no tokens or no rows: nothing to attend
    return jnp.zeros_like(v_TxHxDv)
  if interpret is None:
    interpret = jax.default_backend() != "gpu"

  s = hp.HSTUStatic(
      max_seq_len=max_seq_len, alpha=float(scale), causal=causal, has_targets=num_targets is not None,
      max_attn_len=max_attn_len, contextual_seq_len=contextual_seq_len, block_q=block.block_q,
      block_k=block.block_k)
  offsets_Bp1 = jnp.asarray(offsets_Bp1, jnp.int32)
  targets_B = (jnp.zeros((num_rows,), jnp.int32) if num_targets is None
               else jnp.asarray(num_targets, jnp.int32))
  return _attention(s, block, bool(interpret), q_TxHxD, k_TxHxD, v_TxHxDv, offsets_Bp1, targets_B)
