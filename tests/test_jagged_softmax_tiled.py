"""The tiled (tile list + dynamic two-pass softmax loops, several tiles a step) jagged softmax attention
against the jnp reference: forward and d q/k/v on jagged rows with empty and single-token rows, lengths off
the block grid, targets, windows, contextual tokens and non-causal rows, in f32 and bf16, at several tiles
per step; other rows and tail slots never leak in; and on a heavy-tailed batch the executed pairs stay
within 1.5x the jagged causal pairs.

max_rel_err(got, want) = max|got - want| / max|want| (normwise, so near-zero entries do not dominate).
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.hstu_attention.reference import attention_mask
from pallas_kernels.jagged_softmax_attention import reference
from pallas_kernels.jagged_softmax_attention import tiled
from tests.kernel_helpers import max_rel_err as _max_rel_err

TAIL = 3  # token slots past offsets[B]
BLOCK = 8
SCALE = 0.6

# name: (lengths, N, D, Dv, attention kwargs)
CASES = {
    "plain": ([0, 1, 19, 8], 24, 8, 4, {}),
    "targets_window": ([11, 0, 24], 24, 4, 8, {"num_targets": [3, 0, 2], "max_attn_len": 5}),
    "contextual_targets": ([17, 1, 6], 20, 4, 4, {"num_targets": [2, 0, 1], "contextual_seq_len": 3}),
    "contextual_window": ([0, 25, 9, 1], 32, 8, 8, {"contextual_seq_len": 10, "max_attn_len": 4}),
    "noncausal": ([5, 0, 12, 1], 16, 4, 4, {"causal": False}),
    "head_dims_32_128": ([9, 1, 13], 16, 32, 128, {"num_targets": [1, 1, 2]}),
}


def _inputs(case, dtype, seed=0):
  lengths, n, d, dv, kwargs = CASES[case]
  rng = np.random.default_rng(seed)
  offsets_Bp1 = jnp.asarray(np.concatenate([[0], np.cumsum(lengths)]), jnp.int32)
  capacity = int(offsets_Bp1[-1]) + TAIL
  heads = 2
  # Spread logits (x 2) so the softmax is far from uniform and a wrong max/sum shows.
  q, k = (jnp.asarray(2.0 * rng.normal(size=(capacity, heads, d)), dtype) for _ in range(2))
  v = jnp.asarray(rng.normal(size=(capacity, heads, dv)), dtype)
  cot = jnp.asarray(rng.normal(size=(capacity, heads, dv)), jnp.float32)
  kwargs = dict(kwargs, max_seq_len=n, scale=SCALE)
  if "num_targets" in kwargs:
    kwargs["num_targets"] = jnp.asarray(kwargs["num_targets"], jnp.int32)
  return (q, k, v), offsets_Bp1, cot, kwargs


def _value_and_grads(fn, args, offsets_Bp1, cot, kwargs):
  """(out, grads of sum(out * cot) w.r.t. q, k, v), jitted with traced offsets."""

  def loss(q, k, v, offsets_Bp1):
    out = fn(q, k, v, offsets_Bp1, **kwargs)
    return jnp.sum(out.astype(jnp.float32) * cot), out

  # offsets go in as a traced argument: the tile list must be built on device.
  (_, out), grads = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True))(*args, offsets_Bp1)
  return out, grads


def tiled_fn(*args, group=tiled.GROUP, **kwargs):
  return tiled.jagged_softmax_attention(*args, block=BLOCK, group=group, **kwargs)


# 3 leaves the last step partial (padding tiles, all masked) on five of the six cases; 8 is the default.
@pytest.mark.parametrize("group", [3, tiled.GROUP])
@pytest.mark.parametrize("case", sorted(CASES))
def test_f32_forward_and_grads_match_reference(case, group):
  args, offsets_Bp1, cot, kwargs = _inputs(case, jnp.float32)
  want_out, want_grads = _value_and_grads(reference.jagged_softmax_attention, args, offsets_Bp1, cot, kwargs)
  got_out, got_grads = _value_and_grads(functools.partial(tiled_fn, group=group), args, offsets_Bp1, cot, kwargs)
  assert float(jnp.max(jnp.abs(want_out))) > 0
  assert got_out.shape == want_out.shape and got_out.dtype == want_out.dtype
  assert _max_rel_err(got_out, want_out) <= 1e-5
  np.testing.assert_array_equal(np.asarray(got_out[-TAIL:]), 0.0)
  for name, got, want in zip("qkv", got_grads, want_grads):
    assert got.shape == want.shape and got.dtype == want.dtype, name
    assert float(jnp.max(jnp.abs(want))) > 0, name
    assert _max_rel_err(got, want) <= 1e-5, name
    np.testing.assert_array_equal(np.asarray(got[-TAIL:]), 0.0)


@pytest.mark.parametrize("case", ["targets_window", "contextual_targets"])
def test_bf16_forward_and_grads_match_f32_reference(case):
  args, offsets_Bp1, cot, kwargs = _inputs(case, jnp.bfloat16)
  # The f32 reference on the same (bf16-rounded) inputs is the target the bf16 path approximates.
  args_f32 = tuple(x.astype(jnp.float32) for x in args)
  want_out, want_grads = _value_and_grads(reference.jagged_softmax_attention, args_f32, offsets_Bp1, cot,
                                          kwargs)
  got_out, got_grads = _value_and_grads(tiled_fn, args, offsets_Bp1, cot, kwargs)
  assert got_out.dtype == jnp.bfloat16
  assert _max_rel_err(got_out, want_out) <= 2e-2
  for name, got, want in zip("qkv", got_grads, want_grads):
    assert got.dtype == jnp.bfloat16, name
    assert _max_rel_err(got, want) <= 2e-2, name


def test_other_rows_and_tail_never_change_outputs_or_grads():
  (q, k, v), offsets_Bp1, cot, kwargs = _inputs("targets_window", jnp.float32, seed=1)
  # Row 0 is tokens [0, 11): huge (even inf) values everywhere else must leave it bit for bit alone.
  outside = jnp.arange(q.shape[0]) >= 11
  poison = lambda x: jnp.where(outside[:, None, None], jnp.inf, x)
  cot0 = jnp.where(outside[:, None, None], 0.0, cot)

  def loss(q, k, v):
    out = tiled_fn(q, k, v, offsets_Bp1, **kwargs)
    return jnp.sum(out * cot0), out

  run = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True))
  (_, base), base_grads = run(q, k, v)
  (_, got), got_grads = run(poison(q), poison(k), poison(v))
  np.testing.assert_array_equal(np.asarray(got[:11]), np.asarray(base[:11]))
  for got_g, base_g in zip(got_grads, base_grads):
    np.testing.assert_array_equal(np.asarray(got_g[:11]), np.asarray(base_g[:11]))


def test_heavy_tailed_batch_executes_at_most_1p5x_jagged_pairs():
  n, rows, block = 256, 64, 16
  rng = np.random.default_rng(0)
  lengths = np.clip(np.round(rng.lognormal(np.log(60.0) - 0.5, 1.0, rows)), 0, n).astype(np.int32)
  assert lengths.mean() <= n / 4 and lengths.max() > 3 * lengths.mean()  # heavy tail, as meant
  offsets_Bp1 = jnp.asarray(np.concatenate([[0], np.cumsum(lengths)]), jnp.int32)
  mask, _ = attention_mask(jnp.asarray(lengths), n)
  jagged_pairs = int(np.asarray(mask).sum())
  executed = tiled.executed_pairs(offsets_Bp1, n, block)
  assert jagged_pairs <= executed <= 1.5 * jagged_pairs, (executed, jagged_pairs)
  assert executed < 0.5 * rows * n * n / 2  # far below the padded dense causal work


def test_empty_batch_and_bad_arguments():
  (q, k, v), offsets_Bp1, _, _ = _inputs("plain", jnp.float32)
  out = tiled.jagged_softmax_attention(q, k, v, jnp.zeros((1,), jnp.int32), max_seq_len=24, scale=1.0)
  np.testing.assert_array_equal(np.asarray(out), 0.0)
  with pytest.raises(ValueError, match="num_targets"):
    tiled.jagged_softmax_attention(q, k, v, offsets_Bp1, max_seq_len=24, scale=1.0,
                                   num_targets=jnp.zeros((2,)))
  with pytest.raises(ValueError, match="disagree"):
    tiled.jagged_softmax_attention(q, k[:-1], v, offsets_Bp1, max_seq_len=24, scale=1.0)
  with pytest.raises(ValueError, match="row 2"):
    tiled.jagged_softmax_attention(q, k, v, np.asarray(offsets_Bp1), max_seq_len=8, scale=1.0)
