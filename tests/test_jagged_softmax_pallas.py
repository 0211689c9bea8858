"""The jagged softmax attention Pallas kernels (interpret mode, blocks of 8) against the jnp reference:
forward and d q/k/v in f32 and bf16 on jagged rows with empty and single-token rows, lengths that are not
a multiple of the block, targets, a window, contextual tokens, non-causal masks and D = 32 / 64.

max_rel_err(got, want) = max|got - want| / max|want| (normwise, so near-zero entries do not dominate).
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import conformance
from pallas_kernels.hstu_attention.config import CPU_TEST_BLOCKS
from pallas_kernels.jagged_softmax_attention import pallas as softmax_pallas
from pallas_kernels.jagged_softmax_attention import reference

TAIL = conformance.TAIL
CASES = conformance.SOFTMAX_CASES


def _inputs(case, dtype, seed=0):
  return conformance.inputs("softmax", case, dtype, seed)


_value_and_grads = conformance.value_and_grads


pallas_fn = functools.partial(softmax_pallas.jagged_softmax_attention, block=CPU_TEST_BLOCKS, interpret=True)


@pytest.mark.parametrize("case", sorted(CASES))
def test_f32_forward_and_grads_match_reference(case):
  args, offsets_Bp1, cot, kwargs = _inputs(case, jnp.float32)
  want_out, want_grads = _value_and_grads(reference.jagged_softmax_attention, args, offsets_Bp1, cot, kwargs)
  got_out, got_grads = _value_and_grads(pallas_fn, args, offsets_Bp1, cot, kwargs)
  assert float(jnp.max(jnp.abs(want_out))) > 0
  assert got_out.shape == want_out.shape and got_out.dtype == jnp.float32
  assert conformance.max_rel_err(got_out, want_out) <= 1e-5
  np.testing.assert_array_equal(np.asarray(got_out[-TAIL:]), 0.0)
  for name, got, want in zip("qkv", got_grads, want_grads):
    assert got.shape == want.shape and got.dtype == want.dtype, name
    assert float(jnp.max(jnp.abs(want))) > 0, name
    assert conformance.max_rel_err(got, want) <= 1e-5, name
    np.testing.assert_array_equal(np.asarray(got[-TAIL:]), 0.0)


@pytest.mark.parametrize("case", conformance.BF16_CASES["softmax"])
def test_bf16_forward_and_grads_match_f32_reference(case):
  args, offsets_Bp1, cot, kwargs = _inputs(case, jnp.bfloat16)
  # The f32 reference on the same (bf16-rounded) inputs is the target the bf16 kernel approximates.
  args_f32 = tuple(x.astype(jnp.float32) for x in args)
  want_out, want_grads = _value_and_grads(reference.jagged_softmax_attention, args_f32, offsets_Bp1, cot,
                                          kwargs)
  got_out, got_grads = _value_and_grads(pallas_fn, args, offsets_Bp1, cot, kwargs)
  assert got_out.dtype == jnp.bfloat16
  assert conformance.max_rel_err(got_out, want_out) <= 2e-2
  for name, got, want in zip("qkv", got_grads, want_grads):
    assert got.dtype == jnp.bfloat16, name
    assert conformance.max_rel_err(got, want) <= 2e-2, name


def test_rows_are_isolated():
  """Changing one row's tokens changes no other row's output (a kernel reading past its row would)."""
  (q, k, v), offsets_Bp1, _, kwargs = _inputs("plain_d32", jnp.float32, seed=1)
  attend = jax.jit(lambda q, k, v: pallas_fn(q, k, v, offsets_Bp1, **kwargs))
  base = np.asarray(attend(q, k, v))
  # Row 2 holds tokens [1, 20); perturb row 1's single token 0 and the tail past offsets[B].
  for token in (0, int(offsets_Bp1[-1])):
    got = np.asarray(attend(q.at[token].add(5.0), k.at[token].add(5.0), v.at[token].add(5.0)))
    changed_T = np.any(got != base, axis=(1, 2))
    assert np.array_equal(np.flatnonzero(changed_T), [token] if token < int(offsets_Bp1[-1]) else []), token


def test_bad_arguments_raise():
  (q, k, v), offsets_Bp1, _, _ = _inputs("plain_d32", jnp.float32)
  with pytest.raises(ValueError, match="num_targets"):
    pallas_fn(q, k, v, offsets_Bp1, max_seq_len=24, scale=1.0, num_targets=jnp.zeros((2,), jnp.int32))
  with pytest.raises(ValueError, match="row 2 has length 19"):
    pallas_fn(q, k, v, np.asarray(offsets_Bp1), max_seq_len=16, scale=1.0)
  with pytest.raises(ValueError, match="disagree"):
    pallas_fn(q, k[:, :1], v, offsets_Bp1, max_seq_len=24, scale=1.0)


def test_traced_offsets_and_targets_match_reference():
  """Offsets and num_targets as jit arguments (device values, as in training) give the same result."""
  (q, k, v), offsets_Bp1, _, kwargs = _inputs("contextual_targets", jnp.float32)
  targets_B = kwargs.pop("num_targets")
  got = jax.jit(lambda o, t: pallas_fn(q, k, v, o, num_targets=t, **kwargs))(offsets_Bp1, targets_B)
  want = reference.jagged_softmax_attention(q, k, v, offsets_Bp1, num_targets=targets_B, **kwargs)
  assert conformance.max_rel_err(got, want) <= 1e-5
