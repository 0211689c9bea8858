"""Jagged softmax attention in pure jnp: the specification every softmax-attention kernel is tested against.

InterFormer-style sequence arches attend with an ordinary softmax over each jagged row (rows packed back to
back, see gem_jax/jagged.py) under exactly the HSTU masks:

  out_i = sum_j softmax_j(scale * q_i . k_j  over the j with m_ij) v_j

with m_ij the HSTU mask (positions with contextual tokens, num_targets, max_attn_len window, causal flag),
taken from pallas_kernels/hstu_attention/reference.py `attention_mask` so the two never drift apart.
Softmax and accumulation are f32; the output is in v's dtype; slots past offsets[B] are zero. With causal
masks the diagonal is always allowed, so every real token has at least one key.

Letters: T token capacity, B rows, H heads, D q/k width per head, Dv value width per head, N the static
max_seq_len.

Rows must be no longer than N (gem_jax truncates with jagged.keep_last). For host (numpy) offsets
`check_offsets` says which row breaks that; device or traced offsets cannot raise, and tokens past N of a
longer row would get wrong outputs.
This reference pads to dense B x N and materializes B x H x N x N: a spec, never what a kernel should do.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

# The dense <-> jagged conversions are the HSTU reference's own; reusing them keeps both specs on one layout.
from pallas_kernels.hstu_attention.reference import to_dense, to_jagged, attention_mask


def check_offsets(offsets_Bp1, capacity: int, max_seq_len: int, name: str) -> None:
  """Raises ValueError naming the row if host offsets are malformed or a row is longer than N.

  Only host offsets (numpy, lists) are checked: a traced value cannot raise, and reading a device array
  back would be a hidden device-to-host sync. Device code trusts its offsets (the pipeline validated them).
  """
  if isinstance(offsets_Bp1, jax.Array):
    return
  o = np.asarray(offsets_Bp1)
  if o.ndim != 1 or o.shape[0] < 1:
    raise ValueError(f"{name}: offsets must be 1-D (B + 1,), got shape {o.shape}")
  if o.shape[0] == 1:
    return
  if o[0] != 0:
    raise ValueError(f"{name}: offsets[0] must be 0, got {o[0]}")
  lengths = np.diff(o)
  bad = np.flatnonzero(lengths < 0)
  if bad.size:
    raise ValueError(f"{name}: offsets decrease at row {bad[0]} ({o[bad[0]]} -> {o[bad[0] + 1]})")
  if o[-1] > capacity:
    raise ValueError(f"{name}: offsets[B] = {o[-1]} exceeds the token capacity {capacity}")
  long = np.flatnonzero(lengths > max_seq_len)
  if long.size:
    raise ValueError(f"{name}: row {long[0]} has length {lengths[long[0]]} > max_seq_len {max_seq_len}")


def check_shapes(q_TxHxD, k_TxHxD, v_TxHxDv, name: str) -> None:
  if q_TxHxD.ndim != 3 or k_TxHxD.shape != q_TxHxD.shape or v_TxHxDv.ndim != 3 \
      or v_TxHxDv.shape[:2] != q_TxHxD.shape[:2]:
    raise ValueError(f"{name}: q {q_TxHxD.shape}, k {k_TxHxD.shape}, v {v_TxHxDv.shape} disagree "
                     "(want q, k: T x H x D and v: T x H x Dv)")


def masked_softmax_weights(logits, mask):
  """softmax over the last axis restricted to `mask`; rows with no allowed entry get all-zero weights.

  f32 in, f32 out. Masked logits go through `where` (never a multiply) so they cannot become NaN, and
  the max is a stop_gradient shift: softmax is shift invariant, so the gradient is unchanged.
  """
  masked = jnp.where(mask, logits, -jnp.inf)
  max_ = jnp.max(masked, axis=-1, keepdims=True)
  max_ = jax.lax.stop_gradient(jnp.where(jnp.isfinite(max_), max_, 0.0))
  p = jnp.exp(masked - max_)
  denom = jnp.sum(p, axis=-1, keepdims=True)
  return p / jnp.where(denom > 0, denom, 1.0)


def jagged_softmax_attention(q_TxHxD, k_TxHxD, v_TxHxDv, offsets_Bp1, *, max_seq_len: int, scale: float,
                             causal: bool = True, num_targets=None, max_attn_len: int = 0,
                             contextual_seq_len: int = 0):
  """Softmax attention over jagged rows under the HSTU mask; returns out_TxHxDv in v's dtype.

  num_targets: (B,) int or None. scale multiplies q . k (typically D ** -0.5).
  """
  check_shapes(q_TxHxD, k_TxHxD, v_TxHxDv, "jagged_softmax_attention")
  capacity = q_TxHxD.shape[0]
  check_offsets(offsets_Bp1, capacity, max_seq_len, "jagged_softmax_attention")
  offsets_Bp1 = jnp.asarray(offsets_Bp1, jnp.int32)
  if capacity == 0 or offsets_Bp1.shape[0] == 1:  # no tokens or no rows: nothing to attend
    return jnp.zeros_like(v_TxHxDv)
  n = max_seq_len
  q_BxNxHxD = to_dense(q_TxHxD, offsets_Bp1, n)
  k_BxNxHxD = to_dense(k_TxHxD, offsets_Bp1, n)
  v_BxNxHxDv = to_dense(v_TxHxDv, offsets_Bp1, n)
  mask_BxNxN, _ = attention_mask(
      offsets_Bp1[1:] - offsets_Bp1[:-1], n, causal=causal, num_targets_B=num_targets,
      max_attn_len=max_attn_len, contextual_seq_len=contextual_seq_len)

  logits_BxHxNxN = scale * jnp.einsum("bihd,bjhd->bhij", q_BxNxHxD, k_BxNxHxD,
                                      preferred_element_type=jnp.float32)
  weights_BxHxNxN = masked_softmax_weights(logits_BxHxNxN, mask_BxNxN[:, None])
  out_BxNxHxDv = jnp.einsum("bhij,bjhd->bihd", weights_BxHxNxN, v_BxNxHxDv.astype(jnp.float32),
                            preferred_element_type=jnp.float32)
  return to_jagged(out_BxNxHxDv, offsets_Bp1, capacity).astype(v_TxHxDv.dtype)
