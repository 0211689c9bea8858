"""Jagged softmax attention: the reference against a per-row numpy loop, the blocked XLA path against the
reference (forward and gradients, f32 and bf16), row isolation of gradients, masked keys never mattering,
and the blocked path never building a T x T array.

max_rel_err(got, want) = max|got - want| / max|want| (normwise, so near-zero entries do not dominate).
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.jagged_softmax_attention import blocked, reference as ref

H, D, DV = 2, 4, 3
SCALE = 0.6
LENGTHS = [3, 0, 7, 1, 5, 8, 2, 0, 6, 1]  # zero-length and single-token rows; N = 8 is hit
N, CAPACITY = 8, 40                        # 33 tokens: tail padding past offsets[B]

CASES = {
    "plain": dict(),
    "non_causal": dict(causal=False),
    "targets": dict(num_targets=[1, 0, 2, 1, 1, 3, 1, 0, 2, 1]),
    "window": dict(max_attn_len=2),
    "contextual": dict(contextual_seq_len=2),
    "ctx_targets_window": dict(contextual_seq_len=2, num_targets=[1, 0, 2, 1, 2, 1, 1, 0, 3, 1], max_attn_len=3),
}


def _kwargs(case):
  kwargs = dict(CASES[case])
  if "num_targets" in kwargs:
    kwargs["num_targets"] = jnp.asarray(kwargs["num_targets"], jnp.int32)
  return kwargs


def _allowed_np(n, *, causal=True, num_targets=None, max_attn_len=0, contextual_seq_len=0, row=0):
  """n x n bool: may local query i see local key j, straight from the spec (hstu reference docstring)."""
  c, w = contextual_seq_len, max_attn_len
  t = 0 if num_targets is None else int(num_targets[row])
  big_m = n - (c - 1 if c > 0 else 0) - t

  def p(i):
    pi = max(i - c + 1, 0) if c > 0 else i
    return min(pi, big_m) if num_targets is not None else pi

  out = np.zeros((n, n), bool)
  for i in range(n):
    for j in range(n):
      d = p(i) - p(j)
      m = True
      if causal:
        m = i == j or d > 0
        if w > 0:
          m = m and d <= w
        if c > 0:
          m = m or (p(i) == 0 and p(j) < big_m)
      out[i, j] = m
  return out


def _brute_force(q, k, v, lengths, **kwargs):
  out = np.zeros((q.shape[0], H, DV), np.float64)
  start = 0
  for b, n in enumerate(lengths):
    allowed = _allowed_np(n, row=b, **kwargs)
    for i in range(n):
      js = np.flatnonzero(allowed[i])
      for h in range(H):
        logits = SCALE * np.array([np.dot(q[start + i, h].astype(np.float64), k[start + j, h]) for j in js])
        w = np.exp(logits - logits.max())
        out[start + i, h] = (w / w.sum()) @ v[start + js, h].astype(np.float64)
    start += n
  return out


def _inputs(lengths, capacity, seed=0):
  rng = np.random.default_rng(seed)
  q = rng.normal(size=(capacity, H, D)).astype(np.float32)
  k = rng.normal(size=(capacity, H, D)).astype(np.float32)
  v = rng.normal(size=(capacity, H, DV)).astype(np.float32)
  offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)
  return q, k, v, offsets


def _max_rel_err(got, want):
  got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
  return float(np.max(np.abs(got - want)) / np.max(np.abs(want)))


def _attn(impl, offsets, *, block_q=4, block_k=4, max_seq_len=N, **kwargs):
  """jitted q, k, v -> out for impl in {"ref", "blocked"}."""
  if impl == "ref":
    fn = functools.partial(ref.jagged_softmax_attention, max_seq_len=max_seq_len, scale=SCALE, **kwargs)
  else:
    fn = functools.partial(blocked.jagged_softmax_attention, max_seq_len=max_seq_len, scale=SCALE,
                           block_q=block_q, block_k=block_k, **kwargs)
  return jax.jit(lambda q, k, v: fn(q, k, v, jnp.asarray(offsets)))


def _out_and_grads(impl, offsets, q, k, v, cot, **kwargs):
  """(out, (dq, dk, dv)) of sum(out * cot) in one jitted call."""
  attn = _attn(impl, offsets, **kwargs)
  loss = lambda q_, k_, v_: (lambda out: (jnp.sum((out * cot).astype(jnp.float32)), out))(attn(q_, k_, v_))
  (_, out), grads = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True))(q, k, v)
  return out, grads


@pytest.mark.parametrize("case", sorted(CASES))
def test_reference_matches_brute_force(case):
  kwargs = _kwargs(case)
  q, k, v, offsets = _inputs(LENGTHS, CAPACITY)
  got = np.asarray(_attn("ref", offsets, **kwargs)(q, k, v))
  np_kwargs = {key: (np.asarray(val) if key == "num_targets" else val) for key, val in kwargs.items()}
  want = _brute_force(q, k, v, LENGTHS, **np_kwargs)
  assert got.shape == (CAPACITY, H, DV) and got.dtype == np.float32
  np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
  assert np.all(got[offsets[-1]:] == 0), "tail padding must stay zero"


@pytest.mark.parametrize("case", sorted(CASES))
def test_blocked_matches_reference_forward_and_grad_f32(case):
  kwargs = _kwargs(case)
  q, k, v, offsets = _inputs(LENGTHS, CAPACITY, seed=1)
  cot = np.random.default_rng(2).normal(size=(CAPACITY, H, DV)).astype(np.float32)
  # bq = 4, bk = 4: K = 20 < T = 40, so the band really is narrower than the packed axis.
  assert blocked.band_length(CAPACITY, N, 4, 4) < CAPACITY
  outs, grads = {}, {}
  for impl in ("ref", "blocked"):
    outs[impl], grads[impl] = _out_and_grads(impl, offsets, q, k, v, cot, **kwargs)
  assert _max_rel_err(outs["blocked"], outs["ref"]) <= 1e-5
  assert np.all(outs["blocked"][offsets[-1]:] == 0)
  for g_blocked, g_ref in zip(grads["blocked"], grads["ref"]):
    assert np.all(np.isfinite(np.asarray(g_blocked)))
    assert _max_rel_err(g_blocked, g_ref) <= 1e-5


@pytest.mark.parametrize("block_q,block_k", [(1, 1), (3, 5), (8, 2), (64, 64)])
def test_blocked_block_sizes_do_not_change_the_result(block_q, block_k):
  kwargs = _kwargs("ctx_targets_window")
  q, k, v, offsets = _inputs(LENGTHS, CAPACITY, seed=3)
  want = np.asarray(_attn("ref", offsets, **kwargs)(q, k, v))
  got = np.asarray(_attn("blocked", offsets, block_q=block_q, block_k=block_k, **kwargs)(q, k, v))
  assert _max_rel_err(got, want) <= 1e-5


@pytest.mark.parametrize("case", ["non_causal", "contextual"])
def test_blocked_band_bound_is_tight(case):
  """Block [14, 16) starts on the last token of a full row and ends on the first of the next: its band
  [7, 23) is exactly bq + 2N - 2 = 16 keys, so a band one key shorter must get this block wrong."""
  lengths, capacity = [7, 8, 8, 1], 26
  assert blocked.band_length(capacity, N, 2, 1) == 16
  q, k, v, offsets = _inputs(lengths, capacity, seed=9)
  want = np.asarray(_attn("ref", offsets, **_kwargs(case))(q, k, v))
  got = np.asarray(_attn("blocked", offsets, block_q=2, block_k=1, **_kwargs(case))(q, k, v))
  assert _max_rel_err(got, want) <= 1e-5


def test_blocked_matches_reference_bf16():
  kwargs = _kwargs("ctx_targets_window")
  q, k, v, offsets = _inputs(LENGTHS, CAPACITY, seed=4)
  bf = lambda x: jnp.asarray(x, jnp.bfloat16)
  cot = bf(np.random.default_rng(5).normal(size=(CAPACITY, H, DV)))
  res = {}
  for impl in ("ref", "blocked"):
    out, grads = _out_and_grads(impl, offsets, bf(q), bf(k), bf(v), cot, **kwargs)
    assert out.dtype == jnp.bfloat16 and all(g.dtype == jnp.bfloat16 for g in grads)
    res[impl] = (out,) + tuple(grads)
  for got, want in zip(res["blocked"], res["ref"]):
    assert _max_rel_err(got, want) <= 2e-2
  f32 = np.asarray(_attn("ref", offsets, **kwargs)(q, k, v))
  assert _max_rel_err(res["blocked"][0], f32) <= 2e-2, "bf16 inputs must still accumulate in f32"


@pytest.mark.parametrize("impl", ["ref", "blocked"])
def test_no_gradient_crosses_rows(impl):
  q, k, v, offsets = _inputs(LENGTHS, CAPACITY, seed=6)
  attn = _attn(impl, offsets, **_kwargs("ctx_targets_window"))
  row = 5  # tokens 16..23, the full-length row
  lo, hi = int(offsets[row]), int(offsets[row + 1])
  loss = lambda q_, k_, v_: jnp.sum(attn(q_, k_, v_)[lo:hi] ** 2)
  for g in jax.jit(jax.grad(loss, argnums=(0, 1, 2)))(q, k, v):
    g = np.asarray(g)
    assert np.abs(g[lo:hi]).sum() > 0
    assert np.all(g[:lo] == 0) and np.all(g[hi:] == 0), "gradient leaked out of the row"


@pytest.mark.parametrize("impl", ["ref", "blocked"])
@pytest.mark.parametrize("case", ["ctx_targets_window", "targets"])
def test_masked_out_keys_never_change_an_output(impl, case):
  kwargs = _kwargs(case)
  lengths = [4, 1, 7, 0, 6]
  kwargs["num_targets"] = jnp.array([1, 1, 2, 0, 1], jnp.int32)
  q, k, v, offsets = _inputs(lengths, 20, seed=7)
  attn = _attn(impl, offsets, block_q=3, block_k=2, max_seq_len=7, **kwargs)
  base = np.asarray(attn(q, k, v))
  np_kwargs = {key: (np.asarray(val) if key == "num_targets" else val) for key, val in kwargs.items()}
  for b, n in enumerate(lengths):
    start = int(offsets[b])
    allowed = _allowed_np(n, row=b, **np_kwargs)
    for j in range(n):
      k2, v2 = k.copy(), v.copy()
      k2[start + j] = 50.0
      v2[start + j] *= -1e3
      pert = np.asarray(attn(q, k2, v2))
      changed = np.any(pert != base, axis=(1, 2))
      for i in range(n):
        # Allowed keys must matter (else this test could not fail); masked keys must not, bit for bit.
        assert changed[start + i] == allowed[i, j], (b, i, j)
      assert not np.any(np.delete(changed, np.arange(start, start + n))), "another row saw the key"


def test_blocked_builds_no_txt_array():
  """Every intermediate of the blocked forward and backward stays below T x T and the reference's B x H x N x N."""
  lengths = [1, 2, 1, 16, 3, 1, 1, 5] * 10  # skewed: mostly short rows under N = 16; 300 tokens
  capacity, n = 320, 16
  q, k, v, offsets = _inputs(lengths, capacity, seed=8)
  fn = functools.partial(blocked.jagged_softmax_attention, offsets_Bp1=jnp.asarray(offsets), max_seq_len=n,
                         scale=SCALE, block_q=8, block_k=8, num_targets=jnp.ones(len(lengths), jnp.int32))
  loss = lambda q_, k_, v_: jnp.sum(fn(q_, k_, v_) ** 2)
  jaxpr = jax.make_jaxpr(jax.value_and_grad(loss, argnums=(0, 1, 2)))(q, k, v)

  def sizes(jpr):
    for eqn in jpr.eqns:
      for var in eqn.outvars:
        yield int(np.prod(var.aval.shape))
      for param in eqn.params.values():
        for sub in (param if isinstance(param, (tuple, list)) else [param]):
          inner = getattr(sub, "jaxpr", sub)
          if hasattr(inner, "eqns"):
            yield from sizes(inner)

  counts = blocked.pair_counts(offsets, capacity, max_seq_len=n, block_q=8, block_k=8)
  biggest = max(sizes(jaxpr.jaxpr))
  # The T x H x K residuals are the largest arrays: K = 40 keys per query, not T = 320 or N^2 per row.
  assert biggest <= capacity * H * blocked.band_length(capacity, n, 8, 8), biggest
  assert biggest < capacity * capacity and biggest < len(lengths) * H * n * n
  assert counts["executed"] == capacity * 40 and counts["executed"] < counts["dense"]


def test_pair_counts():
  counts = blocked.pair_counts(np.array([0, 3, 3, 10]), 12, max_seq_len=8, block_q=4, block_k=4)
  # K = round_up(min(4 + 14, 12), 4) = 12; 3 blocks x 4 queries x 12 keys.
  assert counts == dict(executed=144, jagged=9 + 0 + 49, dense=3 * 64)


@pytest.mark.parametrize("fn", [ref.jagged_softmax_attention, blocked.jagged_softmax_attention])
def test_bad_input_raises_and_empty_input(fn):
  q, k, v, offsets = _inputs([3, 9], 12)
  with pytest.raises(ValueError, match="row 1 has length 9 > max_seq_len 8"):
    fn(q, k, v, offsets, max_seq_len=8, scale=1.0)
  with pytest.raises(ValueError, match="exceeds the token capacity"):
    fn(q, k, v, np.array([0, 3, 13], np.int32), max_seq_len=13, scale=1.0)
  with pytest.raises(ValueError, match="disagree"):
    fn(q, k[:, :1], v, offsets, max_seq_len=9, scale=1.0)
  good = [0, 3, 11]  # host offsets as a list are checked and accepted
  np.testing.assert_array_equal(np.asarray(fn(q, k, v, good, max_seq_len=8, scale=1.0)),
                                np.asarray(fn(q, k, v, jnp.asarray(good), max_seq_len=8, scale=1.0)))
  out = fn(jnp.zeros((0, H, D)), jnp.zeros((0, H, D)), jnp.zeros((0, H, DV)), jnp.array([0, 0]),
           max_seq_len=4, scale=1.0)
  assert out.shape == (0, H, DV)
