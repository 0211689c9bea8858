"""Public entry of the HSTU attention Pallas kernel: same signature and semantics as reference.py,
differentiable through a custom_vjp whose backward is the Pallas dq and dk/dv/d rel_bias kernels.

This module pads and unpads (a few token rows, the offsets, the bias buckets) and checks arguments;
it must never compute attention itself and imports only jax, numpy and this package.
Letters as in pallas.py (T capacity, Tp padded capacity, B rows, H heads, R buckets, G bias segments).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels import vma
from pallas_kernels.hstu_attention import pallas as hstu_pallas
from pallas_kernels.hstu_attention.config import HSTUBlockConfig


def _next_pow2(n: int) -> int:
  return 1 if n <= 1 else 1 << (n - 1).bit_length()


def _pad_to_pow2(x, fill):
  """Triton tiles have power-of-two sizes, so the small metadata arrays are padded to one."""
  widths = [(0, _next_pow2(x.shape[0]) - x.shape[0])] + [(0, 0)] * (x.ndim - 1)
  return jnp.pad(x, widths, constant_values=fill)


def owned_mask_T(offsets_Bp1, capacity: int, max_seq_len: int):
  """Token slots some row owns within its first N positions; the kernels write nothing elsewhere."""
  t_T = jnp.arange(capacity, dtype=jnp.int32)
  row_T = jnp.clip(jnp.searchsorted(offsets_Bp1, t_T, side="right").astype(jnp.int32) - 1,
                   0, offsets_Bp1.shape[0] - 2)
  return (t_T < offsets_Bp1[-1]) & (t_T - offsets_Bp1[row_T] < max_seq_len)


def unpad(x_TpxHxW, owned_T):
  capacity = owned_T.shape[0]
  return jnp.where(owned_T[:, None, None], x_TpxHxW[:capacity], jnp.zeros((), x_TpxHxW.dtype))


def prepare(s, block, q, k, v, offsets_Bp1, targets_B, bias_HxR):
  """Kernel operands: token arrays padded by one block (tiles starting in a row stay in bounds)."""
  pad = max(block.block_q, block.block_k)
  q, k, v = (jnp.pad(x, ((0, pad), (0, 0), (0, 0))) for x in (q, k, v))
  offsets_Bp = _pad_to_pow2(offsets_Bp1, offsets_Bp1[-1])
  targets_Bp = _pad_to_pow2(targets_B, 0)
  bias_HxRp = (jnp.zeros((q.shape[1], 1), jnp.float32) if bias_HxR is None else
               jnp.pad(bias_HxR, ((0, 0), (0, _next_pow2(bias_HxR.shape[1]) - bias_HxR.shape[1]))))
  return q, k, v, offsets_Bp, targets_Bp, bias_HxRp


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1, 2))
def _attention(s, block, interpret, q, k, v, bias_HxR, offsets_Bp1, targets_B):
  out, _ = _attention_fwd(s, block, interpret, q, k, v, bias_HxR, offsets_Bp1, targets_B)
  return out


def _attention_fwd(s, block, interpret, q, k, v, bias_HxR, offsets_Bp1, targets_B):
  operands = prepare(s, block, q, k, v, offsets_Bp1, targets_B, bias_HxR)
  out = hstu_pallas.hstu_attention_fwd_pallas(*operands, offsets_Bp1.shape[0] - 1, s, interpret)
  owned_T = owned_mask_T(offsets_Bp1, q.shape[0], s.max_seq_len)
  return unpad(out, owned_T), (q, k, v, bias_HxR, offsets_Bp1, targets_B)


def _attention_bwd(s, block, interpret, residuals, do_TxHxDv):
  q, k, v, bias_HxR, offsets_Bp1, targets_B = residuals
  q_p, k_p, v_p, offsets_Bp, targets_Bp, bias_HxRp = prepare(s, block, q, k, v, offsets_Bp1,
                                                              targets_B, bias_HxR)
  pad = q_p.shape[0] - q.shape[0]
  do_p = jnp.pad(do_TxHxDv, ((0, pad), (0, 0), (0, 0)))
  dq, dk, dv, dbias_HxG = hstu_pallas.hstu_attention_bwd_pallas(
      q_p, k_p, v_p, do_p, offsets_Bp, targets_Bp, bias_HxRp, offsets_Bp1.shape[0] - 1, s, interpret)
  owned_T = owned_mask_T(offsets_Bp1, q.shape[0], s.max_seq_len)
  dbias_HxR = None
  if bias_HxR is not None:
    buckets_G = np.array([bucket for bucket, _, _ in s.segments], np.int32)
    dbias_HxR = jnp.zeros(bias_HxR.shape, jnp.float32).at[:, buckets_G].add(dbias_HxG)
    dbias_HxR = dbias_HxR.astype(bias_HxR.dtype)
  # Integer inputs (offsets, targets) get float0 zero cotangents.
  int_zero = lambda x: np.zeros(x.shape, jax.dtypes.float0)
  # Under shard_map each cotangent takes its input's varying axes (summed over the ones the kernel's
  # operands added, e.g. the batch axes of the offsets).
  grads = [vma.sum_to(unpad(g, owned_T), x) for g, x in ((dq, q), (dk, k), (dv, v))]
  if dbias_HxR is not None:
    dbias_HxR = vma.sum_to(dbias_HxR, bias_HxR)
  return (*grads, dbias_HxR, int_zero(offsets_Bp1), int_zero(targets_B))


_attention.defvjp(_attention_fwd, _attention_bwd)


def hstu_attention(q_TxHxD, k_TxHxD, v_TxHxDv, offsets_Bp1, *, max_seq_len: int, alpha: float,
                   causal: bool = True, num_targets=None, max_attn_len: int = 0,
                   contextual_seq_len: int = 0, rel_bias_HxR=None,
                   block: HSTUBlockConfig = HSTUBlockConfig(), interpret: bool | None = None):
  """HSTU attention over jagged rows with the Pallas kernels; see reference.hstu_attention.

  interpret: run the kernels in Pallas interpret mode (default: everywhere but on GPU).
  Rows must be no longer than max_seq_len (as for the reference); slots past offsets[B] are zero.
  """
  capacity, num_heads, _ = q_TxHxD.shape
  if k_TxHxD.shape != q_TxHxD.shape or v_TxHxDv.shape[:2] != (capacity, num_heads):
    raise ValueError(f"hstu_attention: q {q_TxHxD.shape}, k {k_TxHxD.shape}, v {v_TxHxDv.shape} disagree")
  if offsets_Bp1.ndim != 1 or offsets_Bp1.shape[0] < 1:
    raise ValueError(f"hstu_attention: offsets must be 1-D with B + 1 >= 1 entries, got {offsets_Bp1.shape}")
  if max_seq_len < 1:
    raise ValueError(f"hstu_attention: max_seq_len must be >= 1, got {max_seq_len}")
  if max_attn_len < 0 or contextual_seq_len < 0:
    raise ValueError(f"hstu_attention: max_attn_len {max_attn_len} and contextual_seq_len "
                     f"{contextual_seq_len} must be >= 0")
  num_rows = offsets_Bp1.shape[0] - 1
  if num_targets is not None and jnp.shape(num_targets) != (num_rows,):
    raise ValueError(f"hstu_attention: num_targets shape {jnp.shape(num_targets)}, expected ({num_rows},)")
  if rel_bias_HxR is not None and (rel_bias_HxR.ndim != 2 or rel_bias_HxR.shape[0] != num_heads):
    raise ValueError(f"hstu_attention: rel_bias shape {rel_bias_HxR.shape}, expected ({num_heads}, R)")
  if capacity == 0 or num_rows == 0:  # no tokens or no rows: nothing to attend
    return jnp.zeros_like(v_TxHxDv)
  if interpret is None:
    interpret = jax.default_backend() != "gpu"

  segments = (() if rel_bias_HxR is None else
              hstu_pallas.bucket_segments(max_seq_len, rel_bias_HxR.shape[1]))
  s = hstu_pallas.HSTUStatic(
      max_seq_len=max_seq_len, alpha=float(alpha), causal=causal, has_targets=num_targets is not None,
      max_attn_len=max_attn_len, contextual_seq_len=contextual_seq_len, block_q=block.block_q,
      block_k=block.block_k, segments=segments)
  offsets_Bp1 = jnp.asarray(offsets_Bp1, jnp.int32)
  targets_B = (jnp.zeros((num_rows,), jnp.int32) if num_targets is None
               else jnp.asarray(num_targets, jnp.int32))
  return _attention(s, block, bool(interpret), q_TxHxD, k_TxHxD, v_TxHxDv, rel_bias_HxR,
                    offsets_Bp1, targets_B)
