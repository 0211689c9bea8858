"""The dense HSTU attention (rows padded to N, its own recomputing backward) against the spec,
reference.hstu_attention, whose backward is autodiff's: forward, d q/k/v and d rel_bias on the shared kernel
cases (empty and single-token rows, targets, windows, contextual tokens, non-causal rows, wide heads)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.hstu_attention import dense, reference
from tests.kernel_helpers import HSTU_CASES, HSTU_TAIL, hstu_inputs, hstu_value_and_grads, max_rel_err


@pytest.mark.parametrize("case", sorted(HSTU_CASES))
def test_forward_and_grads_match_the_spec(case):
  args, offsets_Bp1, cot, kwargs = hstu_inputs(case, jnp.float32)
  want_out, want_grads = hstu_value_and_grads(reference.hstu_attention, args, offsets_Bp1, cot, kwargs)
  got_out, got_grads = hstu_value_and_grads(dense.hstu_attention, args, offsets_Bp1, cot, kwargs)
  assert got_out.shape == want_out.shape and got_out.dtype == want_out.dtype
  assert max_rel_err(got_out, want_out) <= 1e-5
  np.testing.assert_array_equal(np.asarray(got_out[-HSTU_TAIL:]), 0.0)
  for name, got, want in zip("qkvb", got_grads, want_grads):
    assert got.shape == want.shape and got.dtype == want.dtype, name
    assert float(jnp.max(jnp.abs(want))) > 0, name
    assert max_rel_err(got, want) <= 1e-5, name


def test_other_rows_never_change_a_row():
  (q, k, v, bias), offsets_Bp1, _, kwargs = hstu_inputs("targets_window_bias", jnp.float32, seed=1)
  attend = jax.jit(lambda q, k, v: dense.hstu_attention(q, k, v, offsets_Bp1, rel_bias_HxR=bias, **kwargs))
  base = np.asarray(attend(q, k, v))
  outside = jnp.arange(q.shape[0]) >= 11   # row 0 is tokens [0, 11)
  poison = lambda x: jnp.where(outside[:, None, None], jnp.inf, x)
  np.testing.assert_array_equal(np.asarray(attend(poison(q), poison(k), poison(v)))[:11], base[:11])
