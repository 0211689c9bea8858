"""The pure-jnp HSTU attention reference against a brute-force per-row numpy loop written from the spec."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.hstu_attention import reference as ref

H, D, DV = 2, 4, 3


def _silu(x):
  return x / (1.0 + np.exp(-x))


def _bucket_np(d: int, num_buckets: int) -> int:
  """The documented bucketing, scalar by scalar (float log2 is exact enough away from the boundaries)."""
  e = max(num_buckets // 2, 1)
  d = abs(d)
  if d < e:
    return d
  return min(e + int(np.floor(2 * np.log2(d / e) + 1e-9)), num_buckets - 1)


def _brute_force(q, k, v, lengths, *, max_seq_len, alpha, causal=True, num_targets=None, max_attn_len=0,
                 contextual_seq_len=0, rel_bias=None):
  """out for every real token, one row and one (i, j) pair at a time, straight from the spec."""
  out = np.zeros((q.shape[0], H, DV), np.float64)
  start = 0
  c, w = contextual_seq_len, max_attn_len
  for b, n in enumerate(lengths):
    t = 0 if num_targets is None else int(num_targets[b])
    big_m = n - (c - 1 if c > 0 else 0) - t

    def p(i):
      pi = max(i - c + 1, 0) if c > 0 else i
      return min(pi, big_m) if num_targets is not None else pi

    for i in range(n):
      for j in range(n):
        d = p(i) - p(j)
        if causal:
          m = i == j or d > 0
          if w > 0:
            m = m and d <= w
          if c > 0:
            m = m or (p(i) == 0 and p(j) < big_m)
        else:
          m = True
        if not m:
          continue
        for h in range(H):
          logit = alpha * float(np.dot(q[start + i, h], k[start + j, h]))
          if rel_bias is not None:
            logit += float(rel_bias[h, _bucket_np(d, rel_bias.shape[1])])
          out[start + i, h] += _silu(logit) / max_seq_len * v[start + j, h]
    start += n
  return out


def _inputs(lengths, capacity, seed=0):
  rng = np.random.default_rng(seed)
  q = rng.normal(size=(capacity, H, D)).astype(np.float32)
  k = rng.normal(size=(capacity, H, D)).astype(np.float32)
  v = rng.normal(size=(capacity, H, DV)).astype(np.float32)
  offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)
  return q, k, v, offsets


CASES = {
    "plain": dict(),
    "non_causal": dict(causal=False),
    "targets": dict(num_targets=[1, 0, 2, 1, 1]),
    "window": dict(max_attn_len=2),
    "contextual": dict(contextual_seq_len=2),
    "ctx_targets_window_bias": dict(contextual_seq_len=2, num_targets=[1, 0, 2, 1, 2], max_attn_len=3,
                                    rel_bias=True),
    "bias": dict(rel_bias=True),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_reference_matches_brute_force(case):
  kwargs = dict(CASES[case])
  lengths = [3, 0, 7, 1, 5]  # a zero-length row and a single-token row
  n, capacity = 8, 20        # tail padding past offsets[B] = 16
  q, k, v, offsets = _inputs(lengths, capacity)
  rel_bias = None
  if kwargs.pop("rel_bias", False):
    rel_bias = np.random.default_rng(1).normal(size=(H, 6)).astype(np.float32)
  if "num_targets" in kwargs:
    kwargs["num_targets"] = np.array(kwargs["num_targets"], np.int32)
  alpha = 0.7
  bias = None if rel_bias is None else jnp.asarray(rel_bias)
  got = ref.hstu_attention(jnp.asarray(q), jnp.asarray(k), jnp.asarray(v), jnp.asarray(offsets),
                           max_seq_len=n, alpha=alpha, rel_bias_HxR=bias, **kwargs)
  want = _brute_force(q, k, v, lengths, max_seq_len=n, alpha=alpha, rel_bias=rel_bias, **kwargs)
  assert got.shape == (capacity, H, DV) and got.dtype == jnp.float32
  np.testing.assert_allclose(np.asarray(got), want, rtol=1e-5, atol=1e-6)
  assert np.all(np.asarray(got)[offsets[-1]:] == 0), "tail padding must stay zero"


def test_relative_position_bucket():
  r = 8  # E = 4: exact buckets 0..3, then 4 + floor(2 log2(d / 4)) up to 7
  d = np.arange(-70, 70)
  got = np.asarray(ref.relative_position_bucket(jnp.asarray(d), r))
  want = np.array([_bucket_np(int(x), r) for x in d])
  np.testing.assert_array_equal(got, want)
  assert list(got[70:80]) == [0, 1, 2, 3, 4, 4, 5, 5, 6, 6]  # d = 0..9: 4->4, 5->4, 6->5, 8->6
  assert np.all(np.diff(got[70:]) >= 0) and got.max() == r - 1 and got.min() == 0
  assert int(ref.relative_position_bucket(jnp.int32(10**6), 32)) == 31  # saturates, no int32 overflow
  assert np.all(np.asarray(ref.relative_position_bucket(jnp.arange(5), 1)) == 0)


def test_causality():
  """Perturbing q/k/v of later positions leaves earlier (non-target, non-contextual) outputs unchanged."""
  lengths, c = [6, 7], 2
  q, k, v, offsets = _inputs(lengths, 13, seed=3)
  targets = jnp.array([1, 1], jnp.int32)
  bias = jnp.asarray(np.random.default_rng(2).normal(size=(H, 8)), jnp.float32)
  attn = jax.jit(lambda q_, k_, v_: ref.hstu_attention(
      q_, k_, v_, jnp.asarray(offsets), max_seq_len=8, alpha=0.5, num_targets=targets,
      contextual_seq_len=c, rel_bias_HxR=bias))
  run = lambda q_, k_, v_: np.asarray(attn(q_, k_, v_))
  base = run(q, k, v)
  for row, n in enumerate(lengths):
    start = offsets[row]
    for i in range(c, n - 1):  # history positions of this row
      q2, k2, v2 = q.copy(), k.copy(), v.copy()
      later = slice(start + i + 1, start + n)
      q2[later] += 3.0
      k2[later] -= 2.0
      v2[later] *= -4.0
      pert = run(q2, k2, v2)
      # Contextual tokens (positions < c) see the whole history by design, so they are not compared.
      np.testing.assert_allclose(pert[start + c:start + i + 1], base[start + c:start + i + 1], rtol=0, atol=1e-6)
      if i < n - 2:  # later history tokens changed (not only the target, which context does not see)
        assert not np.allclose(pert[start], base[start]), "contextual tokens must see the history"
      assert not np.allclose(pert[start + n - 1], base[start + n - 1]), "the target must see the history"
      other = slice(offsets[1 - row], offsets[2 - row])
      np.testing.assert_array_equal(pert[other], base[other])


def test_gradients_finite_and_row_local():
  lengths = [0, 4, 1, 5]
  q, k, v, offsets = _inputs(lengths, 12, seed=5)
  bias = jnp.zeros((H, 4), jnp.float32)

  def loss(q_, k_, v_, bias_):
    out = ref.hstu_attention(q_, k_, v_, jnp.asarray(offsets), max_seq_len=6, alpha=0.3,
                             num_targets=jnp.array([0, 1, 1, 1]), contextual_seq_len=1, rel_bias_HxR=bias_)
    return jnp.sum(out[1:5] ** 2)  # row 1 only

  grads = jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3)))(jnp.asarray(q), jnp.asarray(k), jnp.asarray(v), bias)
  for g in grads:
    assert np.all(np.isfinite(np.asarray(g)))
  gq = np.asarray(grads[0])
  assert np.abs(gq[1:5]).sum() > 0
  assert np.all(gq[:1] == 0) and np.all(gq[5:] == 0), "gradient leaked out of row 1"
  assert np.abs(np.asarray(grads[3])).sum() > 0


def test_bf16_inputs_accumulate_in_f32():
  lengths = [5, 3]
  q, k, v, offsets = _inputs(lengths, 8, seed=7)
  attn = jax.jit(lambda q_, k_, v_: ref.hstu_attention(q_, k_, v_, jnp.asarray(offsets), max_seq_len=5,
                                                       alpha=0.5, num_targets=jnp.array([1, 1])))
  bf16 = lambda x: jnp.asarray(x, jnp.bfloat16)
  got = attn(bf16(q), bf16(k), bf16(v))
  want = attn(jnp.asarray(q), jnp.asarray(k), jnp.asarray(v))
  assert got.dtype == jnp.bfloat16
  np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(want), atol=3e-2, rtol=3e-2)


def test_empty_batch_and_jit():
  q = jnp.zeros((0, H, D))
  out = ref.hstu_attention(q, q, jnp.zeros((0, H, DV)), jnp.array([0, 0]), max_seq_len=4, alpha=1.0)
  assert out.shape == (0, H, DV)
  _, _, _, offsets = _inputs([2, 2], 4)
  f = jax.jit(lambda x: ref.hstu_attention(x, x, x[..., :DV], jnp.asarray(offsets), max_seq_len=3, alpha=1.0))
  assert f(jnp.ones((4, H, D))).shape == (4, H, DV)
