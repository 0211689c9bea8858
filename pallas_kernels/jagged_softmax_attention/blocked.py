"""Jagged softmax attention in XLA without a B x N x N or T x T array: the "xla" path for skewed lengths.

Same function, arguments and mask as reference.py (which is the spec); this file only changes how it is
computed. The packed token axis is cut into G = ceil(T / bq) query blocks of bq tokens. A query can only
see keys of its own row, and rows are at most N long, so block g (tokens s .. s + bq - 1) needs only the
band of keys from the row start of token s to the row end of its last token:

  row_start(s) >= s - (N - 1)   and   row_end(last) <= s + bq - 1 + N   =>   band <= bq + 2N - 2 keys,

so every block reads a static K = round_up(min(bq + 2N - 2, T), bk) keys starting at row_start(s). The
band is walked in K / bk chunks of bk keys with an online (flash-style) softmax: a running max m, sum l and
f32 accumulator per query, so the largest live array is G x H x bq x bk = T x H x bk per step, and plain
autodiff through the lax.scan keeps T x H x K residuals: O(T x (bq + 2N)), never B x N x N or T x T.

Pair accounting (per head; `pair_counts` computes it on the host):
  executed = G * bq * K              every block pays for its whole static band
  jagged   = sum_b n_b^2             the in-row pairs a perfect jagged kernel would touch (the causal
                                     mask keeps about half of them)
  dense    = B * N^2                 the padded reference
executed / jagged is about (bq + 2N) / mean(n): the win over dense padding is large when lengths are
skewed (many short rows under a long N) and gone when every row is near N (then dense is as good).

Letters: T capacity, B rows, H heads, D q/k width, Dv value width, N max_seq_len, G query blocks, Q = bq
queries per block, C = bk keys per chunk, K band length, S = key slots after padding (every band in bounds).

Must never: build a T x T, B x N x N or G x K x K array, or read keys outside the band (the band bound
relies on rows <= N, checked for host offsets, trusted for device / traced ones).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels.jagged_softmax_attention.reference import check_offsets, check_shapes


def _round_up(x: int, m: int) -> int:
  return -(-x // m) * m


def band_length(capacity: int, max_seq_len: int, block_q: int, block_k: int) -> int:
  """K: the static number of keys every query block reads (a multiple of block_k)."""
  return _round_up(max(min(block_q + 2 * max_seq_len - 2, capacity), 1), block_k)


def pair_counts(offsets_Bp1, capacity: int, *, max_seq_len: int, block_q: int, block_k: int) -> dict:
  """Host-side q.k pair counts per head: executed by this file, jagged (sum n^2) and dense (B N^2)."""
  lengths_B = np.diff(np.asarray(offsets_Bp1, np.int64))
  num_blocks = -(-capacity // block_q)
  return dict(executed=num_blocks * block_q * band_length(capacity, max_seq_len, block_q, block_k),
              jagged=int(np.sum(lengths_B ** 2)),
              dense=int(lengths_B.shape[0] * max_seq_len ** 2))


def _token_meta(offsets_Bp1, capacity: int, num_targets, contextual_seq_len: int):
  """Per token slot: (row or -1 for padding, local index i, position p(i), row max position M)."""
  t_T = jnp.arange(capacity, dtype=jnp.int32)
  num_rows = offsets_Bp1.shape[0] - 1
  row_T = jnp.clip(jnp.searchsorted(offsets_Bp1, t_T, side="right").astype(jnp.int32) - 1, 0, num_rows - 1)
  idx_T = t_T - offsets_Bp1[row_T]
  n_T = offsets_Bp1[row_T + 1] - offsets_Bp1[row_T]
  c = contextual_seq_len
  pos_T = jnp.maximum(idx_T - c + 1, 0) if c > 0 else idx_T
  tgt_T = 0 if num_targets is None else jnp.asarray(num_targets, jnp.int32)[row_T]
  max_pos_T = n_T - (c - 1 if c > 0 else 0) - tgt_T
  if num_targets is not None:
    pos_T = jnp.minimum(pos_T, max_pos_T)
  row_T = jnp.where(t_T < offsets_Bp1[-1], row_T, -1)
  return row_T, idx_T, pos_T, max_pos_T


def _pair_mask(q_meta, k_meta, *, causal: bool, max_attn_len: int, contextual_seq_len: int):
  """The HSTU mask (hstu reference `attention_mask`) on packed per-token facts; broadcasts q against k."""
  q_row, q_idx, q_pos, q_max_pos = q_meta
  k_row, k_idx, k_pos, _ = k_meta
  same_row = (q_row == k_row) & (q_row >= 0)
  if not causal:
    return same_row
  d = q_pos - k_pos
  mask = (q_idx == k_idx) | (d > 0)
  if max_attn_len > 0:
    mask = mask & (d <= max_attn_len)
  if contextual_seq_len > 0:
    mask = mask | ((q_pos == 0) & (k_pos < q_max_pos))
  return mask & same_row


def jagged_softmax_attention(q_TxHxD, k_TxHxD, v_TxHxDv, offsets_Bp1, *, max_seq_len: int, scale: float,
                             causal: bool = True, num_targets=None, max_attn_len: int = 0,
                             contextual_seq_len: int = 0, block_q: int = 64, block_k: int = 64):
  """reference.jagged_softmax_attention computed blockwise over a key band (module docstring).

  block_q / block_k: queries per block and keys per online-softmax step; they change speed and memory,
  never the result (up to f32 summation order).
  """
  name = "blocked.jagged_softmax_attention"
  check_shapes(q_TxHxD, k_TxHxD, v_TxHxDv, name)
  if block_q < 1 or block_k < 1:
    raise ValueError(f"{name}: block_q ({block_q}) and block_k ({block_k}) must be >= 1")
  capacity, num_heads, _ = q_TxHxD.shape
  check_offsets(offsets_Bp1, capacity, max_seq_len, name)
  offsets_Bp1 = jnp.asarray(offsets_Bp1, jnp.int32)
  if capacity == 0 or offsets_Bp1.shape[0] == 1:
    return jnp.zeros_like(v_TxHxDv)
  bq, bk = block_q, block_k
  band = band_length(capacity, max_seq_len, bq, bk)
  num_blocks = -(-capacity // bq)
  q_pad = num_blocks * bq - capacity
  # Block g's band starts at or before g * bq, so this many key slots cover every band in bounds.
  k_pad = (num_blocks - 1) * bq + band - capacity

  meta_T = _token_meta(offsets_Bp1, capacity, num_targets, contextual_seq_len)
  pad_meta = lambda x_T, n, fill: jnp.pad(x_T, (0, max(n, 0)), constant_values=fill)
  q_meta_GxQ = tuple(pad_meta(x, q_pad, -1).reshape(num_blocks, bq) for x in meta_T)
  # Padded key slots get row -2: they never match a query's row, padding queries (-1) included.
  k_meta_T = tuple(pad_meta(x, k_pad, -2 if i == 0 else 0) for i, x in enumerate(meta_T))
  q_GxQxHxD = jnp.pad(q_TxHxD, ((0, q_pad), (0, 0), (0, 0))).reshape(num_blocks, bq, num_heads, -1)
  k_SxHxD = jnp.pad(k_TxHxD, ((0, max(k_pad, 0)), (0, 0), (0, 0)))
  v_SxHxDv = jnp.pad(v_TxHxDv, ((0, max(k_pad, 0)), (0, 0), (0, 0)))

  # Band start = row start of each block's first token (padding blocks: any in-bounds start).
  first_G = jnp.arange(num_blocks, dtype=jnp.int32) * bq
  row_G = jnp.clip(jnp.searchsorted(offsets_Bp1, first_G, side="right").astype(jnp.int32) - 1,
                   0, offsets_Bp1.shape[0] - 2)
  band_start_G = jnp.minimum(offsets_Bp1[row_G], first_G)

  def step(carry, chunk):
    max_GxHxQ, sum_GxHxQ, acc_GxQxHxDv = carry
    key_GxC = band_start_G[:, None] + chunk * bk + jnp.arange(bk, dtype=jnp.int32)[None, :]
    k_meta_GxC = tuple(x[key_GxC] for x in k_meta_T)
    mask_GxQxC = _pair_mask(tuple(x[:, :, None] for x in q_meta_GxQ), tuple(x[:, None, :] for x in k_meta_GxC),
                            causal=causal, max_attn_len=max_attn_len, contextual_seq_len=contextual_seq_len)
    logits_GxHxQxC = scale * jnp.einsum("gqhd,gchd->ghqc", q_GxQxHxD, k_SxHxD[key_GxC],
                                        preferred_element_type=jnp.float32)
    logits_GxHxQxC = jnp.where(mask_GxQxC[:, None], logits_GxHxQxC, -jnp.inf)
    # The running max is a shift only (softmax is shift invariant): stop_gradient keeps autodiff exact
    # and cheap. A query with no allowed key so far keeps max -inf; shift by 0 then so exp never sees
    # -inf - -inf.
    new_max_GxHxQ = jax.lax.stop_gradient(jnp.maximum(max_GxHxQ, jnp.max(logits_GxHxQxC, axis=-1)))
    shift_GxHxQ = jnp.where(jnp.isfinite(new_max_GxHxQ), new_max_GxHxQ, 0.0)
    p_GxHxQxC = jnp.exp(logits_GxHxQxC - shift_GxHxQ[..., None])
    rescale_GxHxQ = jnp.exp(max_GxHxQ - shift_GxHxQ)
    sum_GxHxQ = rescale_GxHxQ * sum_GxHxQ + jnp.sum(p_GxHxQxC, axis=-1)
    pv_GxQxHxDv = jnp.einsum("ghqc,gchd->gqhd", p_GxHxQxC, v_SxHxDv[key_GxC].astype(jnp.float32),
                             preferred_element_type=jnp.float32)
    acc_GxQxHxDv = jnp.transpose(rescale_GxHxQ, (0, 2, 1))[..., None] * acc_GxQxHxDv + pv_GxQxHxDv
    return (new_max_GxHxQ, sum_GxHxQ, acc_GxQxHxDv), None

  dv = v_TxHxDv.shape[-1]
  init = (jnp.full((num_blocks, num_heads, bq), -jnp.inf, jnp.float32),
          jnp.zeros((num_blocks, num_heads, bq), jnp.float32),
          jnp.zeros((num_blocks, bq, num_heads, dv), jnp.float32))
  (_, sum_GxHxQ, acc_GxQxHxDv), _ = jax.lax.scan(step, init, jnp.arange(band // bk, dtype=jnp.int32))
  sum_GxQxH = jnp.transpose(sum_GxHxQ, (0, 2, 1))
  # Padding queries have no allowed key (sum 0): divide by 1 instead and they stay exactly zero.
  out_GxQxHxDv = acc_GxQxHxDv / jnp.where(sum_GxQxH > 0, sum_GxQxH, 1.0)[..., None]
  out_TxHxDv = out_GxQxHxDv.reshape(num_blocks * bq, num_heads, dv)[:capacity]
  valid_T = meta_T[0] >= 0
  return jnp.where(valid_T[:, None, None], out_TxHxDv, 0.0).astype(v_TxHxDv.dtype)
