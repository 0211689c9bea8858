"""gem_jax.ops: impl resolution by name, and every registered impl agrees with the reference."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from gem_jax import ops
from pallas_kernels.hstu_attention import reference as hstu_reference
from pallas_kernels.jagged_softmax_attention import reference as softmax_reference


def _qkv(seed=0, lengths=(3, 0, 5), h=2, d=8):
  rng = np.random.default_rng(seed)
  offsets = jnp.asarray(np.concatenate([[0], np.cumsum(lengths)]), jnp.int32)
  t = int(offsets[-1]) + 2
  q, k, v = (jnp.asarray(rng.normal(size=(t, h, d)), jnp.float32) for _ in range(3))
  return q, k, v, offsets


def test_unknown_impl_names_the_choices():
  q, k, v, off = _qkv()
  with pytest.raises(ValueError, match="unknown impl 'cuda'.*available"):
    ops.hstu_attention(q, k, v, off, max_seq_len=6, alpha=0.5, impl="cuda")


@pytest.mark.parametrize("impl", ["auto", "xla", "reference", "pallas", "cpp"])
def test_hstu_impls_match_the_reference(impl):
  q, k, v, off = _qkv()
  kw = dict(max_seq_len=6, alpha=0.5, num_targets=jnp.array([1, 0, 1], jnp.int32), contextual_seq_len=1)
  ref = hstu_reference.hstu_attention(q, k, v, off, **kw)
  got = ops.hstu_attention(q, k, v, off, impl=impl, **kw)
  np.testing.assert_allclose(got, ref, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("impl", ["auto", "xla", "blocked", "reference", "pallas"])
def test_softmax_impls_match_the_reference(impl):
  q, k, v, off = _qkv(1)
  ref = softmax_reference.jagged_softmax_attention(q, k, v, off, max_seq_len=6, scale=0.3)
  got = jax.jit(lambda q, k, v: ops.jagged_softmax_attention(q, k, v, off, max_seq_len=6, scale=0.3,
                                                              impl=impl))(q, k, v)
  np.testing.assert_allclose(got, ref, rtol=1e-5, atol=1e-6)


def test_triton_impl_is_registered_and_says_it_needs_a_gpu():
  if jax.default_backend() == "gpu":
    pytest.skip("on a GPU the triton impl runs; tests/test_hstu_triton.py checks its math")
  q, k, v, off = _qkv()
  with pytest.raises((RuntimeError, ImportError), match="gpu|triton"):
    ops.hstu_attention(q, k, v, off, max_seq_len=6, alpha=0.5, impl="triton")
