"""Conformance cases of the jagged attention kernels: the inputs every implementation of a family must match
its reference on, forward and gradients.

The CPU tests (tests/test_hstu_pallas.py, tests/test_jagged_softmax_pallas.py) and the GPU check
(gem_jax/bench/gpu_sections.py) run these same cases, so a case added here is checked in both places.
Each case has empty and single-token rows, lengths off every block size, and one mask option or a mix
(targets, a window, contextual tokens, non-causal); head widths 32, 64 and 128.

This module holds inputs and error measures only: it must never compute attention itself, and it
imports only jax and numpy.

Letters: T token capacity (the real tokens plus TAIL padding slots), B rows, H heads, D q/k width,
Dv value width, N max_seq_len, R relative-bias buckets.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

TAIL = 3          # token slots past offsets[B]: a kernel must leave them zero
HEADS = 2
HSTU_ALPHA = 0.7
SOFTMAX_SCALE = 0.3
# max_rel_err bounds: f32 kernels against the f32 reference; bf16 kernels against the f32 reference on
# the same (bf16-rounded) inputs.
TOLERANCE = {"float32": 1e-5, "bfloat16": 2e-2}


@dataclasses.dataclass(frozen=True)
class Case:
  lengths: tuple[int, ...]
  max_seq_len: int
  d: int                     # q/k width per head
  dv: int                    # value width per head
  buckets: int = 0           # relative-position bias buckets (HSTU only; 0: no bias)
  num_targets: tuple[int, ...] | None = None
  max_attn_len: int = 0
  contextual_seq_len: int = 0
  causal: bool = True


HSTU_CASES = {
    "plain_d32": Case((0, 1, 19), 24, 32, 32),
    "targets_window_bias_d64": Case((11, 0, 24), 24, 64, 32, 16, num_targets=(3, 0, 2), max_attn_len=5),
    "contextual_targets_bias": Case((17, 1, 6), 20, 32, 32, 8, num_targets=(2, 0, 1), contextual_seq_len=3),
    "contextual_window_d64": Case((0, 25, 9), 32, 64, 64, contextual_seq_len=2, max_attn_len=4),
    "noncausal_bias": Case((5, 0, 12), 16, 32, 32, 6, causal=False),
    "targets_d128": Case((9, 1, 13), 16, 128, 128, 8, num_targets=(1, 1, 2)),
}

SOFTMAX_CASES = {
    "plain_d32": Case((0, 1, 19), 24, 32, 32),
    "targets_window_d64": Case((11, 0, 24), 24, 64, 32, num_targets=(3, 0, 2), max_attn_len=5),
    "contextual_targets": Case((17, 1, 6), 20, 32, 32, num_targets=(2, 0, 1), contextual_seq_len=3),
    "contextual_window_d64": Case((0, 29, 9), 32, 64, 64, contextual_seq_len=2, max_attn_len=4),
    "noncausal": Case((5, 0, 12), 16, 32, 16, causal=False),
    "targets_d128": Case((9, 1, 13), 16, 128, 128, num_targets=(1, 1, 2)),
}

CASES = {"hstu": HSTU_CASES, "softmax": SOFTMAX_CASES}
# The cases the CPU tests also run in bf16 (every case runs in f32).
BF16_CASES = {"hstu": ("targets_window_bias_d64", "contextual_targets_bias"),
              "softmax": ("targets_window_d64", "contextual_targets")}


def inputs(family: str, case: str, dtype, seed: int = 0):
  """-> (args, offsets_Bp1, cot_TxHxDv, kwargs): args are (q, k, v, rel_bias or None) for "hstu" and
  (q, k, v) for "softmax"; cot is the cotangent the gradients are taken against (sum(out * cot))."""
  c = CASES[family][case]
  rng = np.random.default_rng(seed)
  offsets_Bp1 = jnp.asarray(np.concatenate([[0], np.cumsum(c.lengths)]), jnp.int32)
  capacity = int(offsets_Bp1[-1]) + TAIL
  q, k = (jnp.asarray(rng.normal(size=(capacity, HEADS, c.d)), dtype) for _ in range(2))
  v = jnp.asarray(rng.normal(size=(capacity, HEADS, c.dv)), dtype)
  kwargs = dict(max_seq_len=c.max_seq_len, causal=c.causal, max_attn_len=c.max_attn_len,
                contextual_seq_len=c.contextual_seq_len)
  if c.num_targets is not None:
    kwargs["num_targets"] = jnp.asarray(c.num_targets, jnp.int32)
  if family == "hstu":
    bias = jnp.asarray(rng.normal(size=(HEADS, c.buckets)), jnp.float32) if c.buckets else None
    args = (q, k, v, bias)
    kwargs["alpha"] = HSTU_ALPHA
  else:
    args = (q, k, v)
    kwargs["scale"] = SOFTMAX_SCALE
  cot = jnp.asarray(rng.normal(size=(capacity, HEADS, c.dv)), jnp.float32)
  return args, offsets_Bp1, cot, kwargs


def value_and_grads(fn, args, offsets_Bp1, cot, kwargs):
  """(out, grads of sum(out * cot) w.r.t. q, k, v and, when present, rel_bias), jitted. `fn` takes
  (q, k, v, offsets, **kwargs) and, for HSTU, rel_bias_HxR=."""
  hstu = len(args) == 4
  argnums = tuple(range(len(args) if not hstu or args[3] is not None else 3))

  def loss(*xs):
    q, k, v = xs[:3]
    extra = {"rel_bias_HxR": xs[3]} if hstu else {}
    out = fn(q, k, v, offsets_Bp1, **extra, **kwargs)
    return jnp.sum(out.astype(jnp.float32) * cot), out

  (_, out), grads = jax.jit(jax.value_and_grad(loss, argnums=argnums, has_aux=True))(*args)
  return out, grads


def max_rel_err(got, want) -> float:
  """max|got - want| / max|want| in f32 (normwise, so near-zero entries do not dominate): the error
  measure of every kernel bound."""
  got, want = np.asarray(got, np.float32), np.asarray(want, np.float32)
  return float(np.max(np.abs(got - want)) / max(np.max(np.abs(want)), 1e-30))
