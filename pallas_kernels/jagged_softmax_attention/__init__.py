"""Jagged softmax attention (InterFormer-style sequence arches) under the HSTU masks.

  reference.py  the pure-jnp spec (dense B x N per row; materializes B x H x N x N)
  blocked.py    the XLA path: query blocks over a key band with an online softmax, no B x N x N / T x T
  tiled.py      the XLA path whose work follows the lengths: a dynamic loop over the needed tiles
  pallas.py     Pallas kernels (flash forward, dq, dk/dv) with custom_vjp; adds block= and interpret=

All expose jagged_softmax_attention(q_TxHxD, k_TxHxD, v_TxHxDv, offsets_Bp1, *, max_seq_len, scale,
causal=True, num_targets=None, max_attn_len=0, contextual_seq_len=0) -> out_TxHxDv; blocked.py adds
block_q / block_k. This package imports only jax and numpy.
"""

from pallas_kernels.jagged_softmax_attention import blocked, pallas, reference, tiled

__all__ = ["blocked", "pallas", "reference", "tiled"]
