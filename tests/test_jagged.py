"""Jagged arrays: round trips (zero-length rows, truncation), per-row concat/split, validation, jit."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from gem_jax import jagged
from gem_jax.jagged import Jagged


def _rows(lengths, dim=3, seed=0):
  rng = np.random.default_rng(seed)
  return [rng.normal(size=(n, dim)).astype(np.float32) for n in lengths]


def test_lengths_segments_positions_with_empty_rows():
  x = Jagged.from_rows(_rows([2, 0, 3, 0]), capacity=8)
  np.testing.assert_array_equal(x.offsets, [0, 2, 2, 5, 5])
  np.testing.assert_array_equal(x.lengths(), [2, 0, 3, 0])
  np.testing.assert_array_equal(x.segment_ids(), [0, 0, 2, 2, 2, 4, 4, 4])
  np.testing.assert_array_equal(x.positions(), [0, 1, 0, 1, 2, 0, 0, 0])
  np.testing.assert_array_equal(x.valid_mask(), [1, 1, 1, 1, 1, 0, 0, 0])


@pytest.mark.parametrize("use_jit", [False, True])
def test_dense_round_trip_and_truncation(use_jit):
  rows = _rows([4, 0, 1, 6])
  x = Jagged.from_rows(rows, capacity=16)
  to_dense = jax.jit(lambda x: x.to_dense(5, pad_value=-7.0, keep="first")) if use_jit else (
      lambda x: x.to_dense(5, pad_value=-7.0, keep="first"))
  dense, kept = to_dense(x)
  np.testing.assert_array_equal(kept, [4, 0, 1, 5])
  for b, r in enumerate(rows):
    np.testing.assert_array_equal(dense[b, :kept[b]], r[:5])
    assert np.all(np.asarray(dense[b, kept[b]:]) == -7.0)
  last, _ = x.to_dense(5, keep="last")
  np.testing.assert_array_equal(last[3], rows[3][-5:])
  back = Jagged.from_dense(dense, kept, capacity=16)
  for b, r in enumerate(back.rows()):
    np.testing.assert_array_equal(r, rows[b][:5])
  assert np.all(np.asarray(back.values[int(back.offsets[-1]):]) == 0)


def test_all_rows_empty_and_zero_capacity():
  x = Jagged.from_rows([np.zeros((0, 2), np.float32)] * 3, capacity=4)
  dense, kept = x.to_dense(3)
  assert dense.shape == (3, 3, 2) and np.all(np.asarray(dense) == 0) and np.all(np.asarray(kept) == 0)
  np.testing.assert_array_equal(jagged.last_token(x, fill=-1.0), -np.ones((3, 2)))
  np.testing.assert_array_equal(jagged.segment_sum(x.values, x), np.zeros((3, 2)))


def test_from_dense_keeps_at_most_a_row_of_tokens_when_a_length_says_more():
  """A length past the dense row's N tokens packs the row's N tokens, and the next row starts after them (an
  unclamped length would read past the row and shift every later row)."""
  dense = jnp.arange(2 * 3 * 1, dtype=jnp.float32).reshape(2, 3, 1) + 1.0
  x = Jagged.from_dense(dense, jnp.array([5, 2]), capacity=8)
  np.testing.assert_array_equal(x.offsets, [0, 3, 5])
  assert [r.reshape(-1).tolist() for r in x.rows()] == [[1.0, 2.0, 3.0], [4.0, 5.0]]


def test_split_rows_cuts_a_row_shorter_than_its_first_length_after_its_last_token():
  """first_lengths longer than a row: the first part takes the whole row and the second part's row is empty,
  not the next row's tokens."""
  x = Jagged.from_rows(_rows([2, 3]), capacity=6)
  a, b = jagged.split_rows(x, jnp.array([4, 1]), 6, 6)
  np.testing.assert_array_equal(a.lengths(), [2, 1])
  np.testing.assert_array_equal(b.lengths(), [0, 2])
  whole = x.rows()
  np.testing.assert_array_equal(a.rows()[0], whole[0])
  np.testing.assert_array_equal(a.rows()[1], whole[1][:1])
  np.testing.assert_array_equal(b.rows()[1], whole[1][1:])


def test_concat_then_split_restores_both_parts():
  a = Jagged.from_rows(_rows([1, 0, 2], seed=1), capacity=5)
  b = Jagged.from_rows(_rows([3, 1, 0], seed=2), capacity=6)
  c = jax.jit(jagged.concat_rows)(a, b)
  for r, ra, rb in zip(c.rows(), a.rows(), b.rows()):
    np.testing.assert_array_equal(r, np.concatenate([ra, rb]))
  a2, b2 = jagged.split_rows(c, a.lengths(), 5, 6)
  for x, y in ((a, a2), (b, b2)):
    np.testing.assert_array_equal(x.offsets, y.offsets)
    np.testing.assert_array_equal(x.values, y.values)


def test_three_way_concat_context_history_target():
  ctx = jagged.dense_to_jagged(jnp.full((3, 2, 1), 9.0))
  hist = Jagged.from_rows([np.ones((n, 1), np.float32) * n for n in (0, 2, 1)], capacity=4)
  tgt = jagged.dense_to_jagged(jnp.full((3, 1, 1), -1.0))
  seq = jagged.concat_rows(jagged.concat_rows(ctx, hist), tgt)
  np.testing.assert_array_equal(seq.lengths(), [3, 5, 4])
  np.testing.assert_array_equal(seq.rows()[1][:, 0], [9, 9, 2, 2, -1])
  np.testing.assert_array_equal(jagged.last_token(seq)[:, 0], [-1, -1, -1])


def test_keep_last_is_the_pyramid_truncation():
  rows = _rows([5, 0, 2])
  x = jagged.keep_last(Jagged.from_rows(rows, capacity=8), 3)
  assert x.capacity == min(8, 3 * 3)
  for r, full in zip(x.rows(), rows):
    np.testing.assert_array_equal(r, full[-3:])


def test_a_capacity_too_small_for_the_tokens_is_refused_not_cut_on_device():
  """Rows [1, 2, 3] and [4, 5, 6] kept to 3 in 4 slots would lose 6 while the offsets still count it (the
  last token read would be another row's)."""
  x = Jagged(jnp.arange(1.0, 7.0), jnp.array([0, 3, 6], jnp.int32))
  with pytest.raises(ValueError, match=r"keep_last: capacity 4 < 6"):
    jagged.keep_last(x, 3, capacity=4)
  assert jagged.keep_last(x, 2, capacity=4).capacity == 4          # 2 rows x 2 fit
  with pytest.raises(ValueError, match=r"concat_rows: capacity 10 < 6 \+ 6"):
    jagged.concat_rows(x, x, capacity=10)
  with pytest.raises(ValueError, match=r"split_rows: capacities 2 \+ 3 < 6"):
    jagged.split_rows(x, jnp.array([1, 1]), 2, 3)


def _plain_take(values, src, valid):
  # What take_rows replaces: a gather whose gradient autodiff derives (a scatter-add into zeros).
  return jnp.where(valid.reshape(valid.shape + (1,) * (values.ndim - 1)), values[src], 0.0)


@pytest.mark.parametrize("lengths_a,lengths_b", [([1, 0, 2, 4], [3, 1, 0, 2]), ([0, 0, 0, 0], [2, 0, 1, 3])])
def test_row_moves_have_the_gradients_of_plain_gathers(monkeypatch, lengths_a, lengths_b):
  """concat_rows, split_rows and keep_last (GEM's layer plumbing) under take_rows' own backward: the same
  gradients as autodiff through plain gathers, padding slots of the inputs included (they get zero)."""
  a, b = (jax.tree.map(jnp.asarray, Jagged.from_rows(_rows(n, seed=s), capacity=sum(n) + extra))
          for n, s, extra in ((lengths_a, 1, 3), (lengths_b, 2, 2)))
  weights = jnp.asarray(np.random.default_rng(3).normal(size=(64, 3)), jnp.float32)

  def loss(va, vb):
    c = jagged.concat_rows(a.replace_values(va), b.replace_values(vb))
    head, tail = jagged.split_rows(c, jnp.full((4,), 2, jnp.int32), 8, c.capacity)
    kept = jagged.keep_last(tail, 2)
    return sum(jnp.sum(x.values * weights[:x.capacity]) for x in (c, head, kept))

  got = jax.jit(jax.grad(loss, argnums=(0, 1)))(a.values, b.values)
  monkeypatch.setattr(jagged, "take_rows", _plain_take)
  want = jax.jit(jax.grad(loss, argnums=(0, 1)))(a.values, b.values)
  for g, w in zip(got, want):
    np.testing.assert_allclose(g, w, rtol=1e-6, atol=1e-6)
  assert np.any(np.asarray(got[1]) != 0)


def test_segment_mean_ignores_padding():
  x = Jagged.from_rows(_rows([2, 0, 1]), capacity=6)
  x = x.replace_values(jnp.asarray(x.values).at[3:].set(1e9))  # garbage in the tail padding
  rows = x.rows()
  got = jagged.segment_mean(x.values, x)
  np.testing.assert_allclose(got[0], rows[0].mean(0), rtol=1e-6)
  np.testing.assert_array_equal(got[1], np.zeros(3))


@pytest.mark.parametrize("offsets,capacity,match", [
    ([1, 2, 3], 4, r"offsets\[0\]"),
    ([0, 3, 2], 4, "decrease at row 1"),
    ([0, 2, 5], 4, "exceeds the capacity"),
    ([[0, 1]], 4, "1-D"),
    ([0.0, 1.0], 4, "integers"),
])
def test_validate_names_the_feature(offsets, capacity, match):
  x = Jagged(np.zeros((capacity,), np.float32), np.asarray(offsets))
  with pytest.raises(ValueError, match=match) as e:
    x.validate("history")
  assert "history" in str(e.value)


@settings(max_examples=40, deadline=None)
@given(st.lists(st.integers(0, 6), min_size=1, max_size=6), st.integers(1, 7), st.integers(0, 3))
def test_round_trip_property(lengths, max_len, slack):
  rows = _rows(lengths, dim=2)
  x = Jagged.from_rows(rows, capacity=sum(lengths) + slack)
  x.validate()
  dense, kept = x.to_dense(max_len, keep="last")
  back = Jagged.from_dense(dense, kept, capacity=x.capacity)
  for r, full in zip(back.rows(), rows):
    np.testing.assert_array_equal(r, full[len(full) - min(len(full), max_len):])
