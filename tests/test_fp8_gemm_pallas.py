"""The FP8 GEMM Pallas kernels (interpret mode) against reference.py: MX block-scaled (E4M3/E5M2 elements,
floor/rceil scales, K not a multiple of 32 or of the tile), row-wise and tensor-wise scaled GEMM, NaN
scale propagation (exactly the rows/columns a NaN block touches) and argument errors.

Tolerance: both sides form exact products (float8 values times powers of two fit float32), so they
differ only by float32 summation order (each within K u sum|a||b|, u = 2^-24) plus a few roundings of
the scales: |got - want| <= (2K + 8) u (|A| @ |B|), elementwise, computed in float64.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import mx
from pallas_kernels.fp8_gemm import pallas as fp8_pallas
from pallas_kernels.fp8_gemm import reference

E4M3, E5M2 = jnp.float8_e4m3fn, jnp.float8_e5m2
E4M3_MAX = 448.0

# Jitted once per shape: eager mx.quantize dispatches (and compiles) dozens of small ops.
_quantize = jax.jit(mx.quantize, static_argnames=("axis", "elem_dtype", "scale_mode"))
_dequantize = jax.jit(mx.dequantize, static_argnames=("axis",))
_ref_mx_gemm = jax.jit(reference.mx_gemm)
_ref_scaled_gemm = jax.jit(reference.scaled_gemm)


def _assert_close(got_MxN, want_MxN, a_MxK, b_KxN):
  a64, b64 = np.asarray(a_MxK, np.float64), np.asarray(b_KxN, np.float64)
  bound_MxN = (2 * a64.shape[1] + 8) * 2.0**-24 * (np.abs(a64) @ np.abs(b64))
  err_MxN = np.abs(np.asarray(got_MxN, np.float64) - np.asarray(want_MxN, np.float64))
  assert np.all(np.isfinite(got_MxN))
  worst = np.unravel_index(np.argmax(err_MxN - bound_MxN), err_MxN.shape)
  assert np.all(err_MxN <= bound_MxN), f"error {err_MxN[worst]} > bound {bound_MxN[worst]} at {worst}"


def _mx_operands(m, k, n, a_dtype, b_dtype, scale_mode, seed=0):
  """MX pairs of random A (quantized along axis 1) and B (axis 0); every 32-block has its own binade,
  so a scale applied to the wrong block or row is far outside the tolerance."""
  rng = np.random.default_rng(seed)
  kb = mx.num_blocks(k)
  exp_a = np.repeat(rng.integers(-10, 11, size=(m, kb)), 32, axis=1)[:, :k]
  exp_b = np.repeat(rng.integers(-10, 11, size=(kb, n)), 32, axis=0)[:k]
  a = jnp.asarray(rng.normal(size=(m, k)) * 2.0**exp_a, jnp.float32)
  b = jnp.asarray(rng.normal(size=(k, n)) * 2.0**exp_b, jnp.float32)
  a_pair = _quantize(a, axis=1, elem_dtype=a_dtype, scale_mode=scale_mode)
  b_pair = _quantize(b, axis=0, elem_dtype=b_dtype, scale_mode=scale_mode)
  return a_pair, b_pair


# (M, K, N), a dtype, b dtype, scale mode, (block_m, block_n, block_k) or None for the defaults
MX_CASES = {
    "e4m3_floor_partial_k": ((72, 200, 40), E4M3, E4M3, "floor", (32, 32, 64)),
    "e5m2_rceil_bk32": ((40, 96, 72), E5M2, E5M2, "rceil", (16, 32, 32)),
    "e4m3_rceil_default_blocks": ((33, 45, 50), E4M3, E4M3, "rceil", None),
    "e5m2_x_e4m3_floor": ((64, 160, 48), E5M2, E4M3, "floor", (32, 16, 128)),
}


@pytest.mark.parametrize("case", list(MX_CASES))
def test_mx_gemm_matches_reference(case):
  (m, k, n), a_dtype, b_dtype, scale_mode, blocks = MX_CASES[case]
  (a_e, a_s), (b_e, b_s) = _mx_operands(m, k, n, a_dtype, b_dtype, scale_mode)
  kwargs = dict(zip(("block_m", "block_n", "block_k"), blocks)) if blocks else {}
  got = fp8_pallas.mx_gemm(a_e, a_s, b_e, b_s, interpret=True, **kwargs)
  want = _ref_mx_gemm(a_e, a_s, b_e, b_s)
  assert got.shape == (m, n) and got.dtype == jnp.float32
  a_MxK = _dequantize(a_e, a_s, axis=1)
  b_KxN = _dequantize(b_e, b_s, axis=0)
  _assert_close(got, want, a_MxK, b_KxN)


def _rowwise_operands(m, k, n, b_dtype, tensorwise, seed=1):
  """scale = amax / max_normal per row of A / column of B (or of the whole tensor); elems saturate."""
  rng = np.random.default_rng(seed)
  a = rng.normal(size=(m, k)) * 2.0**rng.integers(-6, 7, size=(m, 1))
  b = rng.normal(size=(k, n)) * 2.0**rng.integers(-6, 7, size=(1, n))
  b_max = float(jnp.finfo(b_dtype).max)
  if tensorwise:
    sa, sb = np.max(np.abs(a), keepdims=True) / E4M3_MAX, np.max(np.abs(b), keepdims=True) / b_max
  else:
    sa = np.max(np.abs(a), axis=1, keepdims=True) / E4M3_MAX
    sb = np.max(np.abs(b), axis=0, keepdims=True) / b_max
  sa, sb = jnp.asarray(sa, jnp.float32), jnp.asarray(sb, jnp.float32)
  a_e = jnp.clip(jnp.asarray(a, jnp.float32) / sa, -E4M3_MAX, E4M3_MAX).astype(E4M3)
  b_e = jnp.clip(jnp.asarray(b, jnp.float32) / sb, -b_max, b_max).astype(b_dtype)
  return a_e, sa, b_e, sb


# (M, K, N), b dtype, tensor-wise, blocks or None
SCALED_CASES = {
    "rowwise_partial_tiles": ((72, 200, 40), E4M3, False, (32, 32, 64)),
    "tensorwise_default_blocks": ((50, 40, 33), E4M3, True, None),
    "rowwise_e4m3_x_e5m2": ((40, 64, 64), E5M2, False, (16, 32, 32)),
}


@pytest.mark.parametrize("case", list(SCALED_CASES))
def test_scaled_gemm_matches_reference(case):
  (m, k, n), b_dtype, tensorwise, blocks = SCALED_CASES[case]
  a_e, sa, b_e, sb = _rowwise_operands(m, k, n, b_dtype, tensorwise)
  assert sa.shape == ((1, 1) if tensorwise else (m, 1))
  kwargs = dict(zip(("block_m", "block_n", "block_k"), blocks)) if blocks else {}
  got = fp8_pallas.scaled_gemm(a_e, sa, b_e, sb, interpret=True, **kwargs)
  want = _ref_scaled_gemm(a_e, sa, b_e, sb)
  assert got.shape == (m, n) and got.dtype == jnp.float32
  _assert_close(got, want, a_e.astype(jnp.float32) * sa, b_e.astype(jnp.float32) * sb)


def test_mx_nan_scale_poisons_exactly_its_rows_and_columns():
  m, k, n = 48, 100, 40
  (a_e, a_s), (b_e, b_s) = _mx_operands(m, k, n, E4M3, E4M3, "floor", seed=3)
  nan = jnp.asarray(mx.E8M0_NAN, jnp.uint8).view(jnp.float8_e8m0fnu)
  a_s = a_s.at[5, 3].set(nan)    # the partial last K block (k 96..99)
  b_s = b_s.at[1, 21].set(nan)   # a column in the second N tile
  got = np.asarray(fp8_pallas.mx_gemm(a_e, a_s, b_e, b_s, block_m=16, block_n=16, block_k=32,
                                      interpret=True))
  want_nan = np.zeros((m, n), bool)
  want_nan[5, :] = True
  want_nan[:, 21] = True
  np.testing.assert_array_equal(np.isnan(got), want_nan)
  np.testing.assert_array_equal(np.isnan(_ref_mx_gemm(a_e, a_s, b_e, b_s)), want_nan)
  assert np.all(np.isfinite(got[~want_nan]))


def _mx_args(m=32, k=64, n=32):
  (a_e, a_s), (b_e, b_s) = _mx_operands(m, k, n, E4M3, E4M3, "floor")
  return dict(a_elems_MxK=a_e, a_scales_MxKb=a_s, b_elems_KxN=b_e, b_scales_KbxN=b_s)


def _scaled_args(m=32, k=64, n=32):
  a_e, sa, b_e, sb = _rowwise_operands(m, k, n, E4M3, tensorwise=False)
  return dict(a_elems_MxK=a_e, a_scale_Mx1=sa, b_elems_KxN=b_e, b_scale_1xN=sb)


def _bad(fn, args_fn, match, **change):
  return pytest.param(fn, args_fn, change, match, id=match.split()[0] + "-" + "-".join(change))


BAD_INPUTS = [
    _bad("mx_gemm", _mx_args, "K differs", b_elems_KxN=jnp.zeros((65, 32), E4M3)),
    _bad("mx_gemm", _mx_args, "a_scales must be", a_scales_MxKb=jnp.zeros((32, 3), jnp.float8_e8m0fnu)),
    _bad("mx_gemm", _mx_args, "b_scales must be float8_e8m0fnu",
         b_scales_KbxN=jnp.zeros((2, 32), jnp.uint8)),
    _bad("mx_gemm", _mx_args, "a_elems must be float8", a_elems_MxK=jnp.zeros((32, 64), jnp.float32)),
    _bad("mx_gemm", _mx_args, "block_k must be a power of two", block_k=48),
    _bad("mx_gemm", _mx_args, "block_k must be a power of two", block_k=16),
    _bad("scaled_gemm", _scaled_args, "a_scale must be", a_scale_Mx1=jnp.ones((32, 2), jnp.float32)),
    _bad("scaled_gemm", _scaled_args, "b_scale must be float32",
         b_scale_1xN=jnp.ones((1, 32), jnp.bfloat16)),
    _bad("scaled_gemm", _scaled_args, "b_elems must be 2-D", b_elems_KxN=jnp.zeros((64,), E4M3)),
    _bad("scaled_gemm", _scaled_args, "block_m must be a power of two", block_m=24),
]


@pytest.mark.parametrize("fn, args_fn, change, match", BAD_INPUTS)
def test_bad_inputs_raise_naming_the_argument(fn, args_fn, change, match):
  with pytest.raises(ValueError, match=match):
    getattr(fp8_pallas, fn)(**{**args_fn(), **change}, interpret=True)


@pytest.mark.parametrize("fn, b_dtype", [("mx_gemm", E5M2), ("scaled_gemm", E4M3), ("scaled_gemm", E5M2)])
def test_kernels_lower_to_triton(fn, b_dtype):
  """Lowering for CUDA runs on CPU: the kernels must produce a Triton call (not Mosaic GPU) with the
  default 128 tiles, including an E4M3 x E5M2 scaled GEMM (Pallas-Triton dots take one element type)."""
  m, k, n = 256, 384, 256
  if fn == "mx_gemm":
    scales = (jax.ShapeDtypeStruct((m, k // 32), jnp.float8_e8m0fnu),
              jax.ShapeDtypeStruct((k // 32, n), jnp.float8_e8m0fnu))
  else:
    scales = (jax.ShapeDtypeStruct((m, 1), jnp.float32), jax.ShapeDtypeStruct((1, 1), jnp.float32))
  args = (jax.ShapeDtypeStruct((m, k), E4M3), scales[0], jax.ShapeDtypeStruct((k, n), b_dtype), scales[1])
  triton_call = "__gpu$xla.gpu.triton"
  exported = jax.export.export(
      getattr(fp8_pallas, fn), platforms=["cuda"],
      disabled_checks=[jax.export.DisabledSafetyCheck.custom_call(triton_call)])(*args)
  assert triton_call in exported.mlir_module()
