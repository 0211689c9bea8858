"""HSTU attention with every row padded to N, one row per loop step, with its own backward: the dense padded
work of reference.hstu_attention (every row computes all N x N pairs), done the fast way in plain jnp/lax.

The spec (reference.py) computes all rows at once and leaves the backward to autodiff: its B x H x N x N
logits, weights and their gradients each make a pass through memory, and the relative bias gather turns into a
B x H x N x N scatter. Here a lax.map walks the rows: one row's H x N x N arrays stay in cache between the dots
and the elementwise work, the mask comes from iotas and two per-row scalars, and the backward recomputes the
row's logits from q and k instead of keeping them. Same values as the spec up to float rounding
(tests/test_hstu_dense.py holds it to the kernels' tolerance); same padded work, so it is the like-for-like
dense baseline, where the `xla` impl (tiled.py) computes only the tiles the mask needs.

Letters: T token capacity, B rows, H heads, D q/k width, Dv value width, N max_seq_len, R bias buckets.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax

from pallas_kernels.hstu_attention import masks, pointwise
from pallas_kernels.hstu_attention.reference import relative_position_bucket, to_jagged


@dataclasses.dataclass(frozen=True)
class Static:
  """Trace-time facts of one call (hashable: custom_vjp takes it as a non-differentiable argument)."""
  max_seq_len: int
  alpha: float
  causal: bool
  has_targets: bool
  max_attn_len: int
  contextual_seq_len: int
  has_bias: bool


def _dot(spec, a, b):
  return jnp.einsum(spec, a, b, precision=lax.Precision.HIGHEST, preferred_element_type=jnp.float32)


def _dense(x_TxHxW, offsets_Bp1, n: int):
  """B x H x N x W in f32, zero past each row's end (head-major: the per-head dots need no transposes)."""
  lengths_B = offsets_Bp1[1:] - offsets_Bp1[:-1]
  pos_N = jnp.arange(n, dtype=jnp.int32)
  src_BxN = jnp.clip(offsets_Bp1[:-1, None] + pos_N[None, :], 0, x_TxHxW.shape[0] - 1)
  valid_BxN = pos_N[None, :] < lengths_B[:, None]
  x_BxNxHxW = jnp.where(valid_BxN[:, :, None, None], x_TxHxW[src_BxN], jnp.zeros((), x_TxHxW.dtype))
  return jnp.swapaxes(x_BxNxHxW, 1, 2).astype(jnp.float32)


def _jagged(x_BxHxNxW, offsets_Bp1, capacity: int, dtype):
  return to_jagged(jnp.swapaxes(x_BxHxNxW, 1, 2), offsets_Bp1, capacity).astype(dtype)


def _rows(s: Static, offsets_Bp1, targets_B):
  """(n_in_B, max_pos_B): each row's length clipped to N, and its targets' shared position."""
  length_B = offsets_Bp1[1:] - offsets_Bp1[:-1]
  c = s.contextual_seq_len
  return jnp.clip(length_B, 0, s.max_seq_len), length_B - (c - 1 if c > 0 else 0) - targets_B


def _logits(s: Static, q_HxNxD, k_HxNxD, n_in, max_pos, bias_HxR):
  """(mask_NxN, bucket_NxN or None, logits_HxNxN) of one row."""
  idx_N = jnp.arange(s.max_seq_len, dtype=jnp.int32)
  mask_NxN, d_NxN = masks.tile_mask(idx_N[:, None], idx_N[None, :], n_in, max_pos, causal=s.causal,
                                    max_attn_len=s.max_attn_len, contextual_seq_len=s.contextual_seq_len,
                                    has_targets=s.has_targets)
  logits_HxNxN = s.alpha * _dot("hid,hjd->hij", q_HxNxD, k_HxNxD)
  if not s.has_bias:
    return mask_NxN, None, logits_HxNxN
  bucket_NxN = relative_position_bucket(jnp.minimum(jnp.abs(d_NxN), s.max_seq_len - 1), bias_HxR.shape[1])
  return mask_NxN, bucket_NxN, logits_HxNxN + bias_HxR.astype(jnp.float32)[:, bucket_NxN]


def _forward(s: Static, q_TxHxD, k_TxHxD, v_TxHxDv, offsets_Bp1, targets_B, bias_HxR):
  n_in_B, max_pos_B = _rows(s, offsets_Bp1, targets_B)

  def row(xs):
    q_HxNxD, k_HxNxD, v_HxNxDv, n_in, max_pos = xs
    mask_NxN, _, logits_HxNxN = _logits(s, q_HxNxD, k_HxNxD, n_in, max_pos, bias_HxR)
    w_HxNxN = pointwise.weights(logits_HxNxN, mask_NxN[None], s.max_seq_len)
    return _dot("hij,hjd->hid", w_HxNxN, v_HxNxDv)

  dense = [_dense(x, offsets_Bp1, s.max_seq_len) for x in (q_TxHxD, k_TxHxD, v_TxHxDv)]
  out_BxHxNxDv = lax.map(row, (*dense, n_in_B, max_pos_B))
  return _jagged(out_BxHxNxDv, offsets_Bp1, q_TxHxD.shape[0], v_TxHxDv.dtype)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _attention(s, q_TxHxD, k_TxHxD, v_TxHxDv, offsets_Bp1, targets_B, bias_HxR):
  return _forward(s, q_TxHxD, k_TxHxD, v_TxHxDv, offsets_Bp1, targets_B, bias_HxR)


def _attention_fwd(s, q_TxHxD, k_TxHxD, v_TxHxDv, offsets_Bp1, targets_B, bias_HxR):
  out = _forward(s, q_TxHxD, k_TxHxD, v_TxHxDv, offsets_Bp1, targets_B, bias_HxR)
  return out, (q_TxHxD, k_TxHxD, v_TxHxDv, offsets_Bp1, targets_B, bias_HxR)


def _attention_bwd(s, residuals, dout_TxHxDv):
  q_TxHxD, k_TxHxD, v_TxHxDv, offsets_Bp1, targets_B, bias_HxR = residuals
  n_in_B, max_pos_B = _rows(s, offsets_Bp1, targets_B)
  num_heads, num_buckets = q_TxHxD.shape[1], bias_HxR.shape[1]

  def row(xs):
    q_HxNxD, k_HxNxD, v_HxNxDv, do_HxNxDv, n_in, max_pos = xs
    mask_NxN, bucket_NxN, logits_HxNxN = _logits(s, q_HxNxD, k_HxNxD, n_in, max_pos, bias_HxR)
    dw_HxNxN = _dot("hid,hjd->hij", do_HxNxDv, v_HxNxDv)
    w_HxNxN, dl_HxNxN = pointwise.weights_and_dlogits(logits_HxNxN, mask_NxN[None], dw_HxNxN, s.max_seq_len)
    dq_HxNxD = s.alpha * _dot("hij,hjd->hid", dl_HxNxN, k_HxNxD)
    dk_HxNxD = s.alpha * _dot("hij,hid->hjd", dl_HxNxN, q_HxNxD)
    dv_HxNxDv = _dot("hij,hid->hjd", w_HxNxN, do_HxNxDv)
    dbias_HxR = jnp.zeros((num_heads, num_buckets), jnp.float32)
    if s.has_bias:
      # Masked pairs carry dl = 0, so their (clipped) bucket receives nothing.
      dbias_HxR = dbias_HxR.at[:, bucket_NxN].add(dl_HxNxN)
    return dq_HxNxD, dk_HxNxD, dv_HxNxDv, dbias_HxR

  dense = [_dense(x, offsets_Bp1, s.max_seq_len) for x in (q_TxHxD, k_TxHxD, v_TxHxDv, dout_TxHxDv)]
  dq, dk, dv, dbias_BxHxR = lax.map(row, (*dense, n_in_B, max_pos_B))
  capacity = q_TxHxD.shape[0]
  return (_jagged(dq, offsets_Bp1, capacity, q_TxHxD.dtype), _jagged(dk, offsets_Bp1, capacity, k_TxHxD.dtype),
          _jagged(dv, offsets_Bp1, capacity, v_TxHxDv.dtype), None, None,
          jnp.sum(dbias_BxHxR, axis=0).astype(bias_HxR.dtype))


_attention.defvjp(_attention_fwd, _attention_bwd)


def hstu_attention(q_TxHxD, k_TxHxD, v_TxHxDv, offsets_Bp1, *, max_seq_len: int, alpha: float,
                   causal: bool = True, num_targets=None, max_attn_len: int = 0,
                   contextual_seq_len: int = 0, rel_bias_HxR=None):
  """reference.hstu_attention's contract and values; out_TxHxDv in v's dtype (f32 accumulation)."""
  capacity, num_heads, _ = q_TxHxD.shape
  if k_TxHxD.shape != q_TxHxD.shape or v_TxHxDv.shape[:2] != (capacity, num_heads):
    raise ValueError(f"hstu_attention: q {q_TxHxD.shape}, k {k_TxHxD.shape}, v {v_TxHxDv.shape} disagree")
  num_rows = offsets_Bp1.shape[0] - 1
  if rel_bias_HxR is not None and (rel_bias_HxR.ndim != 2 or rel_bias_HxR.shape[0] != num_heads):
    raise ValueError(f"hstu_attention: rel_bias has shape {rel_bias_HxR.shape}, expected ({num_heads}, R)")
  if capacity == 0 or num_rows == 0:  # no tokens or no rows: nothing to attend
    return jnp.zeros_like(v_TxHxDv)
  if num_targets is None:
    targets_B = jnp.zeros((num_rows,), jnp.int32)
  else:
    targets_B = jnp.asarray(num_targets, jnp.int32)
    if targets_B.shape != (num_rows,):
      raise ValueError(f"hstu_attention: num_targets has shape {targets_B.shape}, expected ({num_rows},)")
  s = Static(max_seq_len, float(alpha), causal, num_targets is not None, max_attn_len, contextual_seq_len,
             rel_bias_HxR is not None)
  # Without a bias the rows never read it; a 1-bucket stand-in keeps one custom_vjp signature.
  bias_HxR = rel_bias_HxR if rel_bias_HxR is not None else jnp.zeros((num_heads, 1), jnp.float32)
  return _attention(s, q_TxHxD, k_TxHxD, v_TxHxDv, jnp.asarray(offsets_Bp1, jnp.int32), targets_B, bias_HxR)


__all__ = ["hstu_attention"]
