"""Properties every attention impl must have, checked through gem_jax.ops for each registered impl:
no gradient crosses rows, and a key the mask excludes never changes an output."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from gem_jax import ops
from pallas_kernels.hstu_attention.reference import attention_mask

LENGTHS = (5, 0, 9, 1)
N, H = 12, 2
KW = dict(max_seq_len=N, num_targets=jnp.array([1, 0, 2, 1], jnp.int32), contextual_seq_len=2, max_attn_len=4)


def _call(kernel, impl, q, k, v, offsets):
  if kernel == "hstu":
    return ops.hstu_attention(q, k, v, offsets, alpha=0.4, impl=impl, **KW)
  return ops.jagged_softmax_attention(q, k, v, offsets, scale=0.4, impl=impl, **KW)


def _inputs(d):
  rng = np.random.default_rng(0)
  offsets = jnp.asarray(np.concatenate([[0], np.cumsum(LENGTHS)]), jnp.int32)
  t = int(offsets[-1]) + 2
  return [jnp.asarray(rng.normal(size=(t, H, d)), jnp.float32) for _ in range(3)], offsets


CASES = [("hstu", impl, d) for impl in ("reference", "xla", "pallas", "cpp") for d in (32, 128)] + [
    ("softmax", impl, d) for impl in ("reference", "xla", "blocked", "pallas") for d in (32, 128)]


@pytest.mark.parametrize("kernel,impl,d", CASES)
def test_no_gradient_crosses_rows(kernel, impl, d):
  (q, k, v), offsets = _inputs(d)
  start, end = int(offsets[2]), int(offsets[3])  # row 2
  loss = lambda q, k, v: jnp.sum(_call(kernel, impl, q, k, v, offsets)[start:end])
  grads = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))(q, k, v)
  for g in grads:
    g = np.asarray(g)
    assert np.all(g[:start] == 0) and np.all(g[end:] == 0)
    assert np.any(g[start:end] != 0)


@pytest.mark.parametrize("kernel,impl,d", [c for c in CASES if c[2] == 32])
def test_masked_out_keys_change_nothing(kernel, impl, d):
  (q, k, v), offsets = _inputs(d)
  mask_BxNxN, _ = attention_mask(jnp.asarray(LENGTHS), N, causal=True, num_targets_B=KW["num_targets"],
                                 max_attn_len=KW["max_attn_len"], contextual_seq_len=KW["contextual_seq_len"])
  mask = np.asarray(mask_BxNxN)
  start = int(offsets[2])
  base = np.asarray(jax.jit(lambda k, v: _call(kernel, impl, q, k, v, offsets))(k, v))
  for j in range(LENGTHS[2]):  # perturb key/value j of row 2
    k2, v2 = k.at[start + j].add(100.0), v.at[start + j].add(100.0)
    out = np.asarray(jax.jit(lambda k, v: _call(kernel, impl, q, k, v, offsets))(k2, v2))
    changed = np.any(out != base, axis=(1, 2))
    allowed = np.zeros(len(changed), bool)
    allowed[start:start + LENGTHS[2]] = mask[2, :LENGTHS[2], j]
    assert not np.any(changed & ~allowed), (j, np.flatnonzero(changed & ~allowed))
    assert changed[start + j]  # a token always sees itself
