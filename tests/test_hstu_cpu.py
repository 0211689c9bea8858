"""The C++ HSTU attention kernel (pallas_kernels/hstu_attention/cpu.py, impl "cpp") against the jnp reference:
forward, d q/k/v and d rel_bias on the conformance cases and on long rows that cross the kernel's 64-token
blocks and 16-lane chunks, with every mask option; rows past N; many rows shared among threads; errors."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import conformance
from pallas_kernels.hstu_attention import cpu, reference

CASES = conformance.HSTU_CASES
TAIL = conformance.TAIL

pytestmark = pytest.mark.skipif(jax.default_backend() != "cpu", reason="the C++ kernel is a CPU kernel")


def test_the_kernel_builds_here():
  ok, why = cpu.available()
  assert ok, why


def _check(args, offsets_Bp1, cot, kwargs, tol=1e-5):
  want_out, want_grads = conformance.value_and_grads(reference.hstu_attention, args, offsets_Bp1, cot, kwargs)
  got_out, got_grads = conformance.value_and_grads(cpu.hstu_attention, args, offsets_Bp1, cot, kwargs)
  assert float(jnp.max(jnp.abs(want_out))) > 0
  assert got_out.dtype == args[2].dtype
  assert conformance.max_rel_err(got_out, want_out) <= tol
  np.testing.assert_array_equal(np.asarray(got_out[int(offsets_Bp1[-1]):]), 0.0)
  assert len(got_grads) == len(want_grads)
  for name, got, want in zip("qkvb", got_grads, want_grads):
    assert got.shape == want.shape and got.dtype == want.dtype, name
    assert float(jnp.max(jnp.abs(want))) > 0, name
    assert conformance.max_rel_err(got, want) <= tol, (name, conformance.max_rel_err(got, want))


@pytest.mark.parametrize("case", sorted(CASES))
def test_f32_forward_and_grads_match_reference(case):
  _check(*conformance.inputs("hstu", case, jnp.float32))


@pytest.mark.parametrize("case", conformance.BF16_CASES["hstu"])
def test_bf16_forward_and_grads_match_f32_reference(case):
  args, offsets_Bp1, cot, kwargs = conformance.inputs("hstu", case, jnp.bfloat16)
  args_f32 = tuple(None if x is None else x.astype(jnp.float32) for x in args)
  want_out, want_grads = conformance.value_and_grads(reference.hstu_attention, args_f32, offsets_Bp1, cot, kwargs)
  got_out, got_grads = conformance.value_and_grads(cpu.hstu_attention, args, offsets_Bp1, cot, kwargs)
  assert got_out.dtype == jnp.bfloat16
  assert conformance.max_rel_err(got_out, want_out) <= 2e-2
  for name, got, want, arg in zip("qkvb", got_grads, want_grads, args):
    assert got.dtype == arg.dtype, name
    assert conformance.max_rel_err(got, want) <= 2e-2, name


def _long_rows(lengths, n, d, dv, buckets, seed=0, heads=2):
  rng = np.random.default_rng(seed)
  offsets_Bp1 = jnp.asarray(np.concatenate([[0], np.cumsum(lengths)]), jnp.int32)
  t = int(offsets_Bp1[-1]) + 5
  q, k = (jnp.asarray(rng.normal(size=(t, heads, d)), jnp.float32) for _ in range(2))
  v = jnp.asarray(rng.normal(size=(t, heads, dv)), jnp.float32)
  bias = jnp.asarray(rng.normal(size=(heads, buckets)), jnp.float32) if buckets else None
  cot = jnp.asarray(rng.normal(size=(t, heads, dv)), jnp.float32)
  return (q, k, v, bias), offsets_Bp1, cot


# Rows of 150 and 200 tokens cross three and four 64-token blocks, 70 ends one token into a 16-lane chunk's
# successor; widths off the 16-lane multiple (D 20, Dv 24) exercise the padded panels.
LONG = {
    "plain": dict(),
    "window_targets": dict(max_attn_len=40, num_targets=(3, 0, 1, 2, 5)),
    "contextual_targets": dict(contextual_seq_len=20, num_targets=(3, 0, 1, 2, 5)),
    "contextual_window": dict(contextual_seq_len=70, max_attn_len=33),
    "noncausal": dict(causal=False),
}


@pytest.mark.parametrize("name", sorted(LONG))
@pytest.mark.parametrize("widths", [(32, 32), (20, 24)])
def test_long_rows_match_reference(name, widths):
  args, offsets_Bp1, cot = _long_rows((150, 0, 1, 70, 200), 200, *widths, buckets=24)
  kwargs = dict(LONG[name], max_seq_len=200, alpha=0.2)
  if "num_targets" in kwargs:
    kwargs["num_targets"] = jnp.asarray(kwargs["num_targets"], jnp.int32)
  _check(args, offsets_Bp1, cot, kwargs)


def test_many_rows_shared_among_threads_match_reference():
  lengths = np.random.default_rng(3).integers(0, 90, size=97)
  args, offsets_Bp1, cot = _long_rows(tuple(lengths), 96, 16, 16, buckets=8, seed=3, heads=3)
  _check(args, offsets_Bp1, cot, dict(max_seq_len=96, alpha=0.3))


def test_tokens_past_max_seq_len_get_zeros_and_the_rest_is_unchanged():
  n = 40
  args, offsets_Bp1, cot = _long_rows((10, n + 9, 5), n, 16, 16, buckets=8)
  kwargs = dict(max_seq_len=n, alpha=0.5)
  out, grads = conformance.value_and_grads(cpu.hstu_attention, args, offsets_Bp1, cot, kwargs)
  # The long row's first N tokens see only each other: the same as a row cut at N.
  cut = jnp.asarray([0, 10, 10 + n, 10 + n + 5], jnp.int32)
  q, k, v, bias = args
  keep = np.r_[0:10 + n, 10 + n + 9:q.shape[0]]
  drop_tail = lambda x: jnp.asarray(np.asarray(x)[keep])
  want = reference.hstu_attention(drop_tail(q), drop_tail(k), drop_tail(v), cut, rel_bias_HxR=bias, **kwargs)
  assert conformance.max_rel_err(drop_tail(out), want) <= 1e-5
  past = slice(10 + n, 10 + n + 9)
  np.testing.assert_array_equal(np.asarray(out[past]), 0.0)
  for g in grads[:3]:
    np.testing.assert_array_equal(np.asarray(g[past]), 0.0)


def test_other_rows_and_tail_never_change_outputs():
  (q, k, v, bias), offsets_Bp1, _ = _long_rows((70, 33, 0, 12), 80, 32, 32, buckets=8)
  attend = jax.jit(lambda q, k, v: cpu.hstu_attention(q, k, v, offsets_Bp1, max_seq_len=80, alpha=0.3,
                                                      rel_bias_HxR=bias))
  base = np.asarray(attend(q, k, v))
  outside = jnp.arange(q.shape[0]) >= 70
  poison = lambda x: jnp.where(outside[:, None, None], jnp.inf, x)
  np.testing.assert_array_equal(np.asarray(attend(poison(q), poison(k), poison(v)))[:70], base[:70])


def test_empty_batch_bad_arguments_and_bad_offsets():
  (q, k, v, _), offsets_Bp1, _ = _long_rows((5, 7), 8, 16, 16, buckets=0)
  out = cpu.hstu_attention(q, k, v, jnp.zeros((1,), jnp.int32), max_seq_len=8, alpha=1.0)
  np.testing.assert_array_equal(np.asarray(out), 0.0)
  with pytest.raises(ValueError, match="rel_bias"):
    cpu.hstu_attention(q, k, v, offsets_Bp1, max_seq_len=8, alpha=1.0, rel_bias_HxR=jnp.zeros((3, 4)))
  with pytest.raises(ValueError, match="num_targets"):
    cpu.hstu_attention(q, k, v, offsets_Bp1, max_seq_len=8, alpha=1.0, num_targets=jnp.zeros((3,)))
  with pytest.raises(ValueError, match="disagree"):
    cpu.hstu_attention(q, k[:-1], v, offsets_Bp1, max_seq_len=8, alpha=1.0)
  # Offsets past the token capacity would read out of bounds: the kernel refuses them.
  with pytest.raises(Exception, match="offsets"):
    jax.block_until_ready(cpu.hstu_attention(q, k, v, jnp.asarray([0, 5, q.shape[0] + 1], jnp.int32),
                                             max_seq_len=8, alpha=1.0))


def test_a_missing_compiler_is_named(monkeypatch, tmp_path):
  monkeypatch.setenv("CXX", "no-such-compiler-here")
  monkeypatch.setenv("GEM_JAX_KERNEL_CACHE", str(tmp_path))
  with pytest.raises(RuntimeError, match="no-such-compiler-here"):
    cpu._build()


def test_gradients_repeat_bit_for_bit_whichever_thread_takes_which_row():
  """The bias gradient sums over rows that different threads compute: it must come out the same every call
  (a resumed run repeats an uninterrupted one bit for bit)."""
  lengths = tuple(np.random.default_rng(5).integers(1, 120, size=64))
  args, offsets_Bp1, cot = _long_rows(lengths, 128, 32, 32, buckets=16, seed=5)
  grad = jax.jit(jax.grad(lambda q, k, v, b: jnp.sum(cpu.hstu_attention(
      q, k, v, offsets_Bp1, max_seq_len=128, alpha=0.2, rel_bias_HxR=b) * cot), argnums=(0, 1, 2, 3)))
  first = [np.asarray(g) for g in grad(*args)]
  for _ in range(6):
    for a, b in zip(first, grad(*args)):
      np.testing.assert_array_equal(a, np.asarray(b))
