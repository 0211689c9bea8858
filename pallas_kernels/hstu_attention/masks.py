"""The HSTU mask one tile at a time, shared by the kernels (Pallas, tiled XLA).

reference.attention_mask builds the same mask for whole rows and stays an independent spec: the kernel
tests compare against it, so a bug here cannot hide by appearing on both sides.
"""

from __future__ import annotations

import jax.numpy as jnp


def position(idx, max_pos, *, contextual_seq_len: int, has_targets: bool):
  """p(idx) of reference.py: the contextual tokens share position 0, the targets share max_pos (M)."""
  c = contextual_seq_len
  p = jnp.maximum(idx - c + 1, 0) if c > 0 else idx
  return jnp.minimum(p, max_pos) if has_targets else p


def tile_mask(i_Qx1, j_1xK, n_in, max_pos, *, causal: bool, max_attn_len: int, contextual_seq_len: int,
              has_targets: bool):
  """(mask_QxK, d_QxK = p(i) - p(j)) for local query positions i and key positions j of one row holding
  n_in tokens (positions past n_in are masked)."""
  pos = lambda x: position(x, max_pos, contextual_seq_len=contextual_seq_len, has_targets=has_targets)
  p_i, p_j = pos(i_Qx1), pos(j_1xK)
  d_QxK = p_i - p_j
  in_row_QxK = (i_Qx1 < n_in) & (j_1xK < n_in)
  if not causal:
    return in_row_QxK, d_QxK
  mask_QxK = (i_Qx1 == j_1xK) | (d_QxK > 0)
  if max_attn_len > 0:
    mask_QxK = mask_QxK & (d_QxK <= max_attn_len)
  if contextual_seq_len > 0:
    mask_QxK = mask_QxK | ((p_i == 0) & (p_j < max_pos))
  return mask_QxK & in_row_QxK, d_QxK
