"""Helpers shared by the kernel tests."""

import jax
import jax.numpy as jnp
import numpy as np


def max_rel_err(got, want) -> float:
  """max|got - want| / max|want| in f32: the error measure of every kernel acceptance bound."""
  got, want = np.asarray(got, np.float32), np.asarray(want, np.float32)
  return float(np.max(np.abs(got - want)) / max(np.max(np.abs(want)), 1e-30))


# HSTU attention cases shared by the kernel tests that compare against reference.hstu_attention: jagged rows with
# empty and single-token rows, lengths off any block grid, targets, windows, contextual tokens, non-causal rows.
HSTU_TAIL = 3  # token slots past offsets[B]

# name: (lengths, N, D, Dv, R or 0, attention kwargs)
HSTU_CASES = {
    "plain": ([0, 1, 19, 8], 24, 16, 8, 0, {}),
    "targets_window_bias": ([11, 0, 24], 24, 8, 16, 12, {"num_targets": [3, 0, 2], "max_attn_len": 5}),
    "contextual_targets_bias": ([17, 1, 6], 20, 8, 8, 8, {"num_targets": [2, 0, 1], "contextual_seq_len": 3}),
    "contextual_window": ([0, 25, 9, 1], 32, 16, 16, 0, {"contextual_seq_len": 10, "max_attn_len": 4}),
    "noncausal_bias": ([5, 0, 12], 16, 8, 8, 6, {"causal": False}),
    "causal_bias": ([13, 0, 30, 7], 32, 8, 8, 10, {}),
    "head_dims_32_128": ([9, 1, 13], 16, 32, 128, 8, {"num_targets": [1, 1, 2]}),
}


def hstu_inputs(case, dtype, seed=0):
  """((q, k, v, rel_bias or None), offsets, output cotangent, attention kwargs) of HSTU_CASES[case]."""
  lengths, n, d, dv, r, kwargs = HSTU_CASES[case]
  rng = np.random.default_rng(seed)
  offsets_Bp1 = jnp.asarray(np.concatenate([[0], np.cumsum(lengths)]), jnp.int32)
  capacity = int(offsets_Bp1[-1]) + HSTU_TAIL
  heads = 2
  q, k = (jnp.asarray(rng.normal(size=(capacity, heads, d)), dtype) for _ in range(2))
  v = jnp.asarray(rng.normal(size=(capacity, heads, dv)), dtype)
  bias = jnp.asarray(rng.normal(size=(heads, r)), jnp.float32) if r else None
  cot = jnp.asarray(rng.normal(size=(capacity, heads, dv)), jnp.float32)
  kwargs = dict(kwargs, max_seq_len=n, alpha=0.7)
  if "num_targets" in kwargs:
    kwargs["num_targets"] = jnp.asarray(kwargs["num_targets"], jnp.int32)
  return (q, k, v, bias), offsets_Bp1, cot, kwargs


def hstu_value_and_grads(fn, args, offsets_Bp1, cot, kwargs):
  """(out, grads of sum(out * cot) w.r.t. q, k, v and, when present, rel_bias), jitted."""
  argnums = (0, 1, 2, 3) if args[3] is not None else (0, 1, 2)

  def loss(q, k, v, bias, offsets_Bp1):
    out = fn(q, k, v, offsets_Bp1, rel_bias_HxR=bias, **kwargs)
    return jnp.sum(out.astype(jnp.float32) * cot), out

  # offsets go in as a traced argument: the tile list must be built on device.
  (_, out), grads = jax.jit(jax.value_and_grad(loss, argnums=argnums, has_aux=True))(*args, offsets_Bp1)
  return out, grads
