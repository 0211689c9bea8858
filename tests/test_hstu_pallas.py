"""The HSTU attention Pallas kernels (interpret mode) against the jnp reference: forward, d q/k/v and
d rel_bias on jagged rows with empty and single-token rows, targets, windows and contextual tokens,
plus mask isolation: a masked-out key (or a token of another row, or tail padding) changes nothing.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import conformance
from pallas_kernels.hstu_attention import api
from pallas_kernels.hstu_attention import pallas as hstu_pallas
from pallas_kernels.hstu_attention import reference
from pallas_kernels.hstu_attention.config import CPU_TEST_BLOCKS, HSTUBlockConfig

TAIL = conformance.TAIL
CASES = conformance.HSTU_CASES


def _inputs(case, dtype, seed=0):
  return conformance.inputs("hstu", case, dtype, seed)


_value_and_grads = conformance.value_and_grads


pallas_fn = functools.partial(api.hstu_attention, block=CPU_TEST_BLOCKS, interpret=True)


@pytest.mark.parametrize("case", sorted(CASES))
def test_f32_forward_and_grads_match_reference(case):
  args, offsets_Bp1, cot, kwargs = _inputs(case, jnp.float32)
  want_out, want_grads = _value_and_grads(reference.hstu_attention, args, offsets_Bp1, cot, kwargs)
  got_out, got_grads = _value_and_grads(pallas_fn, args, offsets_Bp1, cot, kwargs)
  assert float(jnp.max(jnp.abs(want_out))) > 0
  assert conformance.max_rel_err(got_out, want_out) <= 1e-5
  np.testing.assert_array_equal(np.asarray(got_out[-TAIL:]), 0.0)
  for name, got, want in zip("qkvb", got_grads, want_grads):
    assert got.shape == want.shape and got.dtype == want.dtype, name
    assert conformance.max_rel_err(got, want) <= 1e-5, name


@pytest.mark.parametrize("case", conformance.BF16_CASES["hstu"])
def test_bf16_forward_and_grads_match_f32_reference(case):
  args, offsets_Bp1, cot, kwargs = _inputs(case, jnp.bfloat16)
  # The f32 reference on the same (bf16-rounded) inputs is the target the bf16 kernel approximates.
  args_f32 = tuple(None if x is None else x.astype(jnp.float32) for x in args)
  want_out, want_grads = _value_and_grads(reference.hstu_attention, args_f32, offsets_Bp1, cot, kwargs)
  got_out, got_grads = _value_and_grads(pallas_fn, args, offsets_Bp1, cot, kwargs)
  assert got_out.dtype == jnp.bfloat16
  assert conformance.max_rel_err(got_out, want_out) <= 2e-2
  for name, got, want in zip("qkvb", got_grads, want_grads):
    assert conformance.max_rel_err(got, want) <= 2e-2, name


def test_masked_out_keys_never_change_outputs():
  case = "contextual_targets_bias"
  (q, k, v, bias), offsets_Bp1, _, kwargs = _inputs(case, jnp.float32, seed=1)
  # Two keys per row on top of the window/target/contextual structure: add a window too.
  kwargs = dict(kwargs, max_attn_len=3)
  lengths = np.diff(np.asarray(offsets_Bp1))
  mask_BxNxN, _ = reference.attention_mask(
      jnp.asarray(lengths), kwargs["max_seq_len"], num_targets_B=kwargs["num_targets"],
      max_attn_len=3, contextual_seq_len=kwargs["contextual_seq_len"])
  mask_BxNxN = np.asarray(mask_BxNxN)
  attend = jax.jit(lambda k, v: pallas_fn(q, k, v, offsets_Bp1, rel_bias_HxR=bias, **kwargs))
  base = np.asarray(attend(k, v))
  offsets = np.asarray(offsets_Bp1)
  for token in range(k.shape[0]):
    big = jnp.full(k.shape[1:], 1e3, jnp.float32)
    got = np.asarray(attend(k.at[token].set(big), v.at[token].set(-big)))
    changed_T = np.any(got != base, axis=(1, 2))
    # Queries that may see `token`: those of its row whose mask column is set.
    may_see_T = np.zeros(k.shape[0], bool)
    if token < offsets[-1]:
      row = int(np.searchsorted(offsets, token, side="right") - 1)
      col = token - offsets[row]
      may_see_T[offsets[row]:offsets[row + 1]] = mask_BxNxN[row, :lengths[row], col]
      assert changed_T[token], f"token {token} does not change its own output"
    assert not np.any(changed_T & ~may_see_T), f"masked-out key {token} changed {np.nonzero(changed_T & ~may_see_T)}"


@pytest.mark.parametrize("max_seq_len,num_buckets", [(40, 16), (40, 1), (7, 32), (300, 100), (5000, 20)])
def test_bucket_segments_reproduce_relative_position_bucket(max_seq_len, num_buckets):
  want = np.asarray(reference.relative_position_bucket(jnp.arange(max_seq_len), num_buckets))
  got = np.full(max_seq_len, -1)
  for bucket, lo, hi in hstu_pallas.bucket_segments(max_seq_len, num_buckets):
    got[lo:hi] = bucket
  np.testing.assert_array_equal(got, want)


def test_bad_arguments_raise():
  (q, k, v, _), offsets_Bp1, _, _ = _inputs("plain_d32", jnp.float32)
  with pytest.raises(ValueError, match="rel_bias"):
    api.hstu_attention(q, k, v, offsets_Bp1, max_seq_len=24, alpha=1.0, rel_bias_HxR=jnp.zeros((3, 4)))
  with pytest.raises(ValueError, match="num_targets"):
    api.hstu_attention(q, k, v, offsets_Bp1, max_seq_len=24, alpha=1.0, num_targets=jnp.zeros((2,)))
  with pytest.raises(ValueError, match="power of two"):
    HSTUBlockConfig(block_q=12)
