"""HSTU attention in pure jnp: the specification every HSTU kernel (Pallas, Triton) is tested against.

HSTU replaces softmax attention with a pointwise SiLU of the logits, normalized by the static max length:

  out_i = sum_j m_ij * silu(alpha * q_i . k_j + bias_h(bucket(|p(i) - p(j)|))) / N * v_j

over jagged q/k/v (rows packed back to back, see gem_jax/jagged.py for the layout; this package imports
only jax, so the few jagged helpers it needs are re-done privately here).

Letters: T token capacity, B rows, H heads, D q/k width per head, Dv value width per head, N the static
max_seq_len, R relative-position buckets. For one row of length n (local positions i, j), with
c = contextual_seq_len, t = num_targets[b] (0 when None) and w = max_attn_len:

  p(i) = max(i - c + 1, 0) if c > 0 else i          (the c contextual tokens share position 0)
  M    = n - (c - 1 if c > 0 else 0) - t
  p(i) = min(p(i), M) when targets are given         (the t targets share position M: they see the
                                                      history but not each other)
  d    = p(i) - p(j)
  m_ij = [i == j] or [d > 0];  and [d <= w] if w > 0;  or ([p(i) == 0] and [p(j) < M]) if c > 0
         (causal=False: every pair inside the row)

This reference pads to dense B x N x H x D and back, so it needs rows no longer than N: the caller
guarantees it (gem_jax truncates histories with jagged.keep_last); tokens past N of a longer row would
get wrong outputs, and a traced length cannot raise here.
It materializes B x H x N x N: fine as a spec and on CPU, never what a kernel should do.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

# Bucket distances are clipped here so that d * d stays inside int32 (see relative_position_bucket).
_MAX_BUCKET_DISTANCE = 1 << 15


def relative_position_bucket(distance, num_buckets: int):
  """Maps a relative distance (any int array; its absolute value is used) to a bucket in [0, R).

  With E = max(R // 2, 1): distances below E get their own bucket (bucket = d); from E on the buckets
  are half-octave log-spaced, bucket = E + floor(2 * log2(d / E)), saturating at R - 1. The log is
  computed exactly in integers (floor(2 log2(d / E)) = floor(log2(d^2 // E^2)) = 31 - clz(d^2 // E^2)),
  so a kernel reproduces it bit for bit. Distances are clipped at 2^15 first (only matters when
  E + 2 * log2(2^15 / E) < R - 1, i.e. for more than ~60 buckets).
  """
  if num_buckets < 1:
    raise ValueError(f"relative_position_bucket: num_buckets must be >= 1, got {num_buckets}")
  e = max(num_buckets // 2, 1)
  d = jnp.minimum(jnp.abs(jnp.asarray(distance, jnp.int32)), _MAX_BUCKET_DISTANCE)
  ratio = jnp.maximum((d * d) // (e * e), 1)
  far = e + (31 - jax.lax.clz(ratio))
  return jnp.where(d < e, d, jnp.minimum(far, num_buckets - 1)).astype(jnp.int32)


def _row_of_token(offsets_Bp1, capacity: int):
  """(row, valid) of every token slot; row is clipped into [0, B) so it can index."""
  t_T = jnp.arange(capacity, dtype=jnp.int32)
  row_T = jnp.searchsorted(offsets_Bp1, t_T, side="right").astype(jnp.int32) - 1
  num_rows = offsets_Bp1.shape[0] - 1
  return jnp.clip(row_T, 0, num_rows - 1), t_T < offsets_Bp1[-1]


def to_dense(x_TxHxD, offsets_Bp1, max_len: int):
  """B x N x H x D, zero past each row's end."""
  lengths_B = offsets_Bp1[1:] - offsets_Bp1[:-1]
  pos_N = jnp.arange(max_len, dtype=jnp.int32)
  src_BxN = jnp.clip(offsets_Bp1[:-1, None] + pos_N[None, :], 0, x_TxHxD.shape[0] - 1)
  valid_BxN = pos_N[None, :] < lengths_B[:, None]
  return jnp.where(valid_BxN[:, :, None, None], x_TxHxD[src_BxN], jnp.zeros((), x_TxHxD.dtype))


def to_jagged(x_BxNxHxD, offsets_Bp1, capacity: int):
  """Inverse of to_dense on the same offsets; tail padding slots are zero."""
  row_T, valid_T = _row_of_token(offsets_Bp1, capacity)
  pos_T = jnp.where(valid_T, jnp.arange(capacity, dtype=jnp.int32) - offsets_Bp1[row_T], 0)
  pos_T = jnp.minimum(pos_T, x_BxNxHxD.shape[1] - 1)
  return jnp.where(valid_T[:, None, None], x_BxNxHxD[row_T, pos_T], jnp.zeros((), x_BxNxHxD.dtype))


def attention_mask(lengths_B, max_seq_len: int, *, causal: bool = True, num_targets_B=None,
                   max_attn_len: int = 0, contextual_seq_len: int = 0):
  """(mask_BxNxN bool, dist_BxNxN int32 = p(i) - p(j)) for rows of the given lengths (module docstring)."""
  n_B = jnp.asarray(lengths_B, jnp.int32)
  c = contextual_seq_len
  idx_N = jnp.arange(max_seq_len, dtype=jnp.int32)
  pos_BxN = jnp.broadcast_to(jnp.maximum(idx_N - c + 1, 0) if c > 0 else idx_N, (n_B.shape[0], max_seq_len))
  t_B = jnp.zeros_like(n_B) if num_targets_B is None else jnp.asarray(num_targets_B, jnp.int32)
  max_pos_B = n_B - (c - 1 if c > 0 else 0) - t_B
  if num_targets_B is not None:
    pos_BxN = jnp.minimum(pos_BxN, max_pos_B[:, None])
  dist_BxNxN = pos_BxN[:, :, None] - pos_BxN[:, None, :]
  in_row_BxN = idx_N[None, :] < n_B[:, None]
  in_row_BxNxN = in_row_BxN[:, :, None] & in_row_BxN[:, None, :]
  if not causal:
    return in_row_BxNxN, dist_BxNxN
  mask = (idx_N[:, None] == idx_N[None, :])[None] | (dist_BxNxN > 0)
  if max_attn_len > 0:
    mask = mask & (dist_BxNxN <= max_attn_len)
  if c > 0:
    mask = mask | ((pos_BxN[:, :, None] == 0) & (pos_BxN[:, None, :] < max_pos_B[:, None, None]))
  return mask & in_row_BxNxN, dist_BxNxN


def hstu_attention(q_TxHxD, k_TxHxD, v_TxHxDv, offsets_Bp1, *, max_seq_len: int, alpha: float,
                   causal: bool = True, num_targets=None, max_attn_len: int = 0,
                   contextual_seq_len: int = 0, rel_bias_HxR=None):
  """HSTU attention over jagged rows; returns out_TxHxDv in v's dtype (f32 accumulation).

  num_targets: (B,) int or None; rel_bias_HxR: optional (H, R) bias added to the logits per head and
  relative_position_bucket(|p(i) - p(j)|, R). Output slots past offsets[B] are zero.
  """
  capacity, num_heads, _ = q_TxHxD.shape
  if k_TxHxD.shape != q_TxHxD.shape or v_TxHxDv.shape[:2] != (capacity, num_heads):
    raise ValueError(f"hstu_attention: q {q_TxHxD.shape}, k {k_TxHxD.shape}, v {v_TxHxDv.shape} disagree")
  if capacity == 0 or offsets_Bp1.shape[0] == 1:  # no tokens or no rows: nothing to attend
    return jnp.zeros_like(v_TxHxDv)
  offsets_Bp1 = jnp.asarray(offsets_Bp1, jnp.int32)
  n = max_seq_len
  q_BxNxHxD = to_dense(q_TxHxD, offsets_Bp1, n)
  k_BxNxHxD = to_dense(k_TxHxD, offsets_Bp1, n)
  v_BxNxHxDv = to_dense(v_TxHxDv, offsets_Bp1, n)
  mask_BxNxN, dist_BxNxN = attention_mask(
      offsets_Bp1[1:] - offsets_Bp1[:-1], n, causal=causal, num_targets_B=num_targets,
      max_attn_len=max_attn_len, contextual_seq_len=contextual_seq_len)

  logits_BxHxNxN = alpha * jnp.einsum("bihd,bjhd->bhij", q_BxNxHxD, k_BxNxHxD,
                                      preferred_element_type=jnp.float32)
  if rel_bias_HxR is not None:
    if rel_bias_HxR.shape[0] != num_heads:
      raise ValueError(f"hstu_attention: rel_bias has {rel_bias_HxR.shape[0]} heads, q has {num_heads}")
    # |p(i) - p(j)| < N, so the bias per distance is a small H x N table gathered once per pair (no
    # per-pair bucketing arithmetic).
    bias_HxN = rel_bias_HxR.astype(jnp.float32)[:, relative_position_bucket(jnp.arange(n), rel_bias_HxR.shape[1])]
    bias_HxBxNxN = bias_HxN[:, jnp.abs(dist_BxNxN)]
    logits_BxHxNxN = logits_BxHxNxN + jnp.transpose(bias_HxBxNxN, (1, 0, 2, 3))
  # `where`, not a multiply, so that masked-out logits can never turn into NaN.
  weights_BxHxNxN = jnp.where(mask_BxNxN[:, None], jax.nn.silu(logits_BxHxNxN), 0.0) / n
  out_BxNxHxDv = jnp.einsum("bhij,bjhd->bihd", weights_BxHxNxN, v_BxNxHxDv.astype(jnp.float32),
                            preferred_element_type=jnp.float32)
  return to_jagged(out_BxNxHxDv, offsets_Bp1, capacity).astype(v_TxHxDv.dtype)
