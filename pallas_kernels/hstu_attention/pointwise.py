"""HSTU's pointwise attention weights and their gradient, shared by the jnp kernels (tiled.py, dense.py).

w = SiLU(logits) / N where the mask keeps a pair, else 0 (`where`, not a multiply, so that masked-out logits
can never turn into NaN); the backward takes dw = dL/dw and gives dl = dL/dlogits with the same mask.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def weights(logits, mask, max_seq_len: int):
  return jnp.where(mask, jax.nn.silu(logits), 0.0) / max_seq_len


def weights_and_dlogits(logits, mask, dw, max_seq_len: int):
  """(w, dl): the forward's weights (recomputed) and the gradient of the logits, sigmoid computed once."""
  sig = jax.nn.sigmoid(logits)
  w = jnp.where(mask, logits * sig, 0.0) / max_seq_len
  dl = jnp.where(mask, dw * sig * (1.0 + logits * (1.0 - sig)), 0.0) / max_seq_len
  return w, dl
