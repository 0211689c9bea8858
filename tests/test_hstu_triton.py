"""The HSTU attention Triton forward kernel, run by Triton's interpreter on CPU, against the reference.

Cases cover empty and single-token rows, lengths off the block size, targets (also a row that is all
targets), windows, contextual tokens, rel_bias, non-causal rows and head widths 32 and 64. Also: the
module imports without triton, the GPU entry refuses CPU clearly, and its custom_vjp backward is the
reference's gradient.
"""

import os

# Before triton is imported anywhere: triton.jit picks the interpreter when it decorates a kernel.
os.environ["TRITON_INTERPRET"] = "1"

import importlib  # noqa: E402
import importlib.util  # noqa: E402
import sys  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402

from pallas_kernels.hstu_attention import reference  # noqa: E402
from pallas_kernels.hstu_attention import triton as hstu_triton  # noqa: E402

_HAVE_TORCH = importlib.util.find_spec("torch") is not None
_HAVE_TRITON = importlib.util.find_spec("triton") is not None
needs_interpreter = pytest.mark.skipif(
    not (_HAVE_TORCH and _HAVE_TRITON),
    reason="the Triton interpreter test needs `pip install torch==2.13.0 triton` (CI installs them)")

TAIL = 3  # token slots past offsets[B]
HEADS = 2

# name: (lengths, N, D, Dv, R or 0, block_n, attention kwargs); block_m is 16 everywhere.
CASES = {
    "plain_d32": ([0, 1, 19], 24, 32, 32, 0, 16, {}),
    "targets_window_bias_d64": ([11, 0, 37], 40, 64, 32, 16, 16,
                                {"num_targets": [3, 0, 2], "max_attn_len": 5}),
    "all_targets_row": ([3, 17], 20, 32, 32, 0, 16, {"num_targets": [3, 4]}),
    "contextual_targets_bias": ([17, 1, 6], 20, 32, 32, 8, 16,
                                {"num_targets": [2, 0, 1], "contextual_seq_len": 3}),
    "contextual_window_d64": ([0, 40, 9], 40, 64, 64, 0, 16, {"contextual_seq_len": 2, "max_attn_len": 4}),
    "window_wide_key_block": ([33, 1, 40], 40, 32, 32, 6, 32,
                              {"num_targets": [4, 1, 0], "max_attn_len": 3, "contextual_seq_len": 5}),
    "noncausal_bias_d64": ([5, 0, 33], 40, 64, 64, 6, 16, {"causal": False}),
}


def _inputs(case, seed=0):
  lengths, n, d, dv, r, _, kwargs = CASES[case]
  rng = np.random.default_rng(seed)
  offsets_Bp1 = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)
  capacity = int(offsets_Bp1[-1]) + TAIL
  q, k = (rng.normal(size=(capacity, HEADS, d)).astype(np.float32) for _ in range(2))
  v = rng.normal(size=(capacity, HEADS, dv)).astype(np.float32)
  bias = rng.normal(size=(HEADS, r)).astype(np.float32) if r else None
  kwargs = dict(kwargs, max_seq_len=n, alpha=0.7, rel_bias_HxR=bias)
  if "num_targets" in kwargs:
    kwargs["num_targets"] = np.asarray(kwargs["num_targets"], np.int32)
  return q, k, v, offsets_Bp1, kwargs


def _reference(q, k, v, offsets_Bp1, kwargs):
  kw = {name: (None if x is None else jnp.asarray(x)) if name in ("num_targets", "rel_bias_HxR") else x
        for name, x in kwargs.items()}
  return np.asarray(reference.hstu_attention(jnp.asarray(q), jnp.asarray(k), jnp.asarray(v),
                                             jnp.asarray(offsets_Bp1), **kw))


def _interpreted_module():
  """The kernel module with an interpreted kernel (reloaded if someone imported it before the env)."""
  from triton.runtime.interpreter import InterpretedFunction
  if not isinstance(hstu_triton._hstu_fwd_kernel, InterpretedFunction):
    importlib.reload(hstu_triton)
  return hstu_triton


@needs_interpreter
@pytest.mark.parametrize("case", sorted(CASES))
def test_interpreted_kernel_matches_reference(case):
  q, k, v, offsets_Bp1, kwargs = _inputs(case)
  block_n = CASES[case][5]
  got = _interpreted_module().run_interpreted(q, k, v, offsets_Bp1, block_m=16, block_n=block_n, **kwargs)
  want = _reference(q, k, v, offsets_Bp1, kwargs)
  assert got.shape == want.shape and got.dtype == np.float32
  assert np.abs(want).max() > 1e-3  # the case attends to something
  max_rel_err = np.abs(got - want).max() / np.abs(want).max()
  assert max_rel_err <= 1e-5, f"{case}: max_rel_err {max_rel_err:.3g}"
  np.testing.assert_array_equal(got[offsets_Bp1[-1]:], 0.0)  # tail slots untouched


@needs_interpreter
def test_interpreted_kernel_rejects_bad_arguments():
  q, k, v, offsets_Bp1, kwargs = _inputs("plain_d32")
  module = _interpreted_module()
  with pytest.raises(ValueError, match="block_m"):
    module.run_interpreted(q, k, v, offsets_Bp1, block_m=24, block_n=16, **kwargs)
  with pytest.raises(ValueError, match="non-decreasing"):
    module.run_interpreted(q, k, v, offsets_Bp1[::-1].copy(), block_m=16, block_n=16, **kwargs)
  with pytest.raises(ValueError, match="num_targets"):
    module.run_interpreted(q, k, v, offsets_Bp1, block_m=16, block_n=16,
                           **dict(kwargs, num_targets=np.zeros((2,), np.int32)))


def test_available_reports_whether_triton_imports():
  assert hstu_triton.AVAILABLE == _HAVE_TRITON


def test_module_imports_without_triton(monkeypatch):
  # A None entry in sys.modules makes `import triton` raise ImportError, as on a CPU-only install.
  monkeypatch.setitem(sys.modules, "triton", None)
  monkeypatch.setitem(sys.modules, "triton.language", None)
  spec = importlib.util.spec_from_file_location("_hstu_triton_without_triton", hstu_triton.__file__)
  module = importlib.util.module_from_spec(spec)
  monkeypatch.setitem(sys.modules, spec.name, module)  # dataclasses look their module up there
  spec.loader.exec_module(module)
  assert module.AVAILABLE is False
  q, k, v, offsets_Bp1, kwargs = _inputs("plain_d32")
  with pytest.raises(ImportError, match="pip install torch==2.13.0 triton"):
    module.run_interpreted(q, k, v, offsets_Bp1, **kwargs)


@pytest.mark.skipif(jax.default_backend() == "gpu", reason="checks the error off GPU")
def test_gpu_entry_raises_clearly_on_cpu():
  q, k, v, offsets_Bp1, kwargs = _inputs("plain_d32")
  with pytest.raises(RuntimeError, match="'gpu' backend.*'cpu'"):
    hstu_triton.hstu_attention_triton(jnp.asarray(q), jnp.asarray(k), jnp.asarray(v),
                                      jnp.asarray(offsets_Bp1), **kwargs)


def test_custom_vjp_backward_is_the_reference_gradient(monkeypatch):
  """With the launch swapped for the reference (no GPU here), grads through _attention match it."""
  q, k, v, offsets_Bp1, kwargs = _inputs("contextual_targets_bias")
  s = hstu_triton._Static(max_seq_len=kwargs["max_seq_len"], alpha=kwargs["alpha"], causal=True,
                          has_targets=True, max_attn_len=0, contextual_seq_len=3, block_m=16, block_n=16)

  def fake_launch(s, q, k, v, bias, offsets, targets):
    return reference.hstu_attention(q, k, v, offsets, max_seq_len=s.max_seq_len, alpha=s.alpha,
                                    num_targets=targets, contextual_seq_len=s.contextual_seq_len,
                                    rel_bias_HxR=bias)

  monkeypatch.setattr(hstu_triton, "_launch", fake_launch)
  w = jnp.asarray(np.random.default_rng(1).normal(size=v.shape), jnp.float32)
  offsets, targets = jnp.asarray(offsets_Bp1), jnp.asarray(kwargs["num_targets"])
  args = tuple(jnp.asarray(x) for x in (q, k, v, kwargs["rel_bias_HxR"]))

  def loss_kernel(q, k, v, bias):
    return jnp.sum(hstu_triton._attention(s, q, k, v, bias, offsets, targets) * w)

  def loss_reference(q, k, v, bias):
    out = reference.hstu_attention(q, k, v, offsets, max_seq_len=s.max_seq_len, alpha=s.alpha,
                                   num_targets=targets, contextual_seq_len=3, rel_bias_HxR=bias)
    return jnp.sum(out * w)

  got = jax.grad(loss_kernel, argnums=(0, 1, 2, 3))(*args)
  want = jax.grad(loss_reference, argnums=(0, 1, 2, 3))(*args)
  for name, g, r in zip(("dq", "dk", "dv", "dbias"), got, want):
    assert float(jnp.abs(r).max()) > 0, name
    np.testing.assert_allclose(np.asarray(g), np.asarray(r), rtol=1e-6, atol=1e-7, err_msg=name)
