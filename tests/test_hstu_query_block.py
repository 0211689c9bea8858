"""HSTU attention for a block of query slots (context parallelism) equals the same slots of the
whole-layout reference, for blocks that cut rows anywhere; its gradients too."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.hstu_attention import reference as ref
from pallas_kernels.hstu_attention.query_block import hstu_attention_query_block

H, D, DV, N = 2, 8, 4, 12


def _case(seed, lengths, capacity):
  rng = np.random.default_rng(seed)
  offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)
  q, k = (rng.standard_normal((capacity, H, D)).astype(np.float32) for _ in range(2))
  v = rng.standard_normal((capacity, H, DV)).astype(np.float32)
  bias = rng.standard_normal((H, 8)).astype(np.float32)
  return q, k, v, offsets, bias


# chunk: query slots per step of the block's scan; 3 and 5 cut the block (and rows) into several windows.
@pytest.mark.parametrize("chunk", [256, 3, 5])
@pytest.mark.parametrize("blocks", [2, 3, 4])
@pytest.mark.parametrize("kw", [dict(), dict(contextual_seq_len=2, targets=True), dict(max_attn_len=3, causal=True),
                                dict(causal=False)], ids=["plain", "ctx_targets", "window", "bidirectional"])
def test_blocks_reproduce_the_whole_layout(blocks, kw, chunk):
  kw = dict(kw)
  lengths = np.array([5, 0, 12, 3, 7, 1])
  capacity = 36  # 28 real tokens + tail padding
  q, k, v, offsets, bias = _case(blocks, lengths, capacity)
  targets = np.array([1, 0, 2, 1, 1, 0], np.int32) if kw.pop("targets", False) else None
  args = dict(max_seq_len=N, alpha=0.3, num_targets=targets, rel_bias_HxR=bias, **kw)
  want = np.asarray(ref.hstu_attention(q, k, v, offsets, **args))
  size = capacity // blocks
  got = np.concatenate([np.asarray(hstu_attention_query_block(q[b * size:(b + 1) * size], k, v, offsets,
                                                              b * size, chunk=chunk, **args)) for b in range(blocks)])
  np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
  assert np.all(got[offsets[-1]:] == 0)


@pytest.mark.parametrize("chunk", [256, 2])
def test_gradients_match_the_reference(chunk):
  lengths = np.array([4, 9, 6])
  q, k, v, offsets, bias = _case(7, lengths, 20)
  args = dict(max_seq_len=N, alpha=0.5, contextual_seq_len=1, rel_bias_HxR=None)
  w = np.random.default_rng(1).standard_normal((20, H, DV)).astype(np.float32)

  def whole(q, k, v):
    return jnp.sum(ref.hstu_attention(q, k, v, offsets, **args) * w)

  def blocked(q, k, v):
    outs = [hstu_attention_query_block(q[s:s + 5], k, v, offsets, s, chunk=chunk, **args) for s in range(0, 20, 5)]
    return jnp.sum(jnp.concatenate(outs) * w)

  for a, b in zip(jax.grad(whole, (0, 1, 2))(q, k, v), jax.grad(blocked, (0, 1, 2))(q, k, v)):
    np.testing.assert_allclose(np.asarray(b), np.asarray(a), rtol=1e-5, atol=1e-6)


def test_traced_start_under_jit():
  lengths = np.array([6, 6])
  q, k, v, offsets, bias = _case(3, lengths, 12)
  f = jax.jit(lambda s: hstu_attention_query_block(jax.lax.dynamic_slice_in_dim(q, s, 6), k, v, offsets, s,
                                                   max_seq_len=N, alpha=0.2, rel_bias_HxR=bias))
  want = np.asarray(ref.hstu_attention(q, k, v, offsets, max_seq_len=N, alpha=0.2, rel_bias_HxR=bias))
  np.testing.assert_allclose(np.asarray(f(6)), want[6:], rtol=1e-5, atol=1e-6)
