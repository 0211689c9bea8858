"""The FP8 GEMM Triton kernels, run by Triton's interpreter on CPU, against pallas_kernels.fp8_gemm.reference.

Shapes are off the tile sizes in every dimension (ragged M, N and K tiles, one K off the 32-value MX
block). Operand magnitudes vary by powers of two per row, column and MX block, so a scale applied to the
wrong row, column or block is far outside the bounds.

Error bounds (u = 2^-24, float32 unit roundoff). The float8 products are exact in float32 and MX
dequantization is exact (bf16 too, for values of at least 2^-126, as here), so kernel and reference
differ only in summation order: each is within (K - 1) u sum_k |a_mk b_kn| of the exact sum, hence
|kernel - reference| <= 2 K u (|A| @ |B|). Row-wise scaling adds two roundings per side (the reference
rounds a * sa and b * sb, the kernel acc * sa * sb): (K + 3) * 2^-23 (|A| @ |B|), A and B dequantized.

Triton 3.9's interpreter gets bf16 dots and some float8 codes wrong; run_interpreted_* patch its
decoders while they run (see the module), and test_interpreter_decoding_is_exact checks that the
patched kernels read every E4M3 / E5M2 code and bf16 exactly.
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

from pallas_kernels import mx  # noqa: E402
from pallas_kernels.fp8_gemm import reference  # noqa: E402
from pallas_kernels.fp8_gemm import triton as fp8_triton  # noqa: E402

_HAVE_TORCH = importlib.util.find_spec("torch") is not None
_HAVE_TRITON = importlib.util.find_spec("triton") is not None
needs_interpreter = pytest.mark.skipif(
    not (_HAVE_TORCH and _HAVE_TRITON),
    reason="the Triton interpreter test needs `pip install torch==2.13.0 triton` (CI installs them)")

# numpy warns while the kernels make NaN / Inf on purpose.
allows_nan_inf = pytest.mark.filterwarnings("ignore:(overflow|invalid value) encountered:RuntimeWarning")

E4M3, E5M2 = jnp.float8_e4m3fn, jnp.float8_e5m2
TILES = dict(block_m=32, block_n=32)


def _interpreted_module():
  """The kernel module with interpreted kernels (reloaded if someone imported it before the env)."""
  from triton.runtime.interpreter import InterpretedFunction
  if not isinstance(fp8_triton._scaled_gemm_kernel, InterpretedFunction):
    importlib.reload(fp8_triton)
  return fp8_triton


def _spread(rng, shape, block_shape):
  """Normal values times 2^e with e in [-6, 6] drawn per block of block_shape (edges cut off)."""
  reps = [-(-s // b) for s, b in zip(shape, block_shape)]
  exps = rng.integers(-6, 7, size=reps)
  for axis, b in enumerate(block_shape):
    exps = np.repeat(exps, b, axis=axis)
  return (rng.normal(size=shape) * np.exp2(exps[:shape[0], :shape[1]])).astype(np.float32)


def _bound(a_MxK, b_KxN, factor):
  """factor * 2^-24 * (|A| @ |B|) in float64, from the dequantized (float32) operands."""
  abs_dot = np.abs(np.asarray(a_MxK, np.float64)) @ np.abs(np.asarray(b_KxN, np.float64))
  return factor * 2.0**-24 * abs_dot


def _scaled_operands(m, k, n, row_wise, a_dtype, b_dtype, seed=0):
  rng = np.random.default_rng(seed)
  # float8 via ml_dtypes (rounds to nearest)
  a_MxK = np.asarray(_spread(rng, (m, k), (1, k)), a_dtype)
  b_KxN = np.asarray(_spread(rng, (k, n), (k, 1)), b_dtype)
  # Scales are not powers of two, so the kernel's and the reference's scaling round differently.
  a_scale = np.exp2(rng.uniform(-4, 4, size=(m if row_wise else 1, 1))).astype(np.float32)
  b_scale = np.exp2(rng.uniform(-4, 4, size=(1, n if row_wise else 1))).astype(np.float32)
  return a_MxK, a_scale, b_KxN, b_scale


@needs_interpreter
@pytest.mark.parametrize("row_wise", [True, False], ids=["row_wise", "tensor_wise"])
@pytest.mark.parametrize("m,k,n,block_k", [(72, 96, 40, 32), (33, 136, 65, 64)])
def test_scaled_gemm_matches_reference(row_wise, m, k, n, block_k):
  a, sa, b, sb = _scaled_operands(m, k, n, row_wise, E4M3, E4M3)
  got = _interpreted_module().run_interpreted_scaled_gemm(a, sa, b, sb, block_k=block_k, **TILES)
  want = np.asarray(_scaled_reference(a, sa, b, sb))
  assert got.shape == (m, n) and got.dtype == np.float32
  bound = _bound(a.astype(np.float32) * sa, b.astype(np.float32) * sb, 2 * (k + 3))
  assert np.all(np.isfinite(got)) and np.all(np.abs(got - want) <= bound), \
      f"max excess {np.max(np.abs(got - want) - bound):.3g}"


@needs_interpreter
def test_scaled_gemm_mixed_e4m3_e5m2():
  a, sa, b, sb = _scaled_operands(40, 64, 48, True, E4M3, E5M2, seed=1)
  got = _interpreted_module().run_interpreted_scaled_gemm(a, sa, b, sb, block_k=32, **TILES)
  want = np.asarray(_scaled_reference(a, sa, b, sb))
  bound = _bound(a.astype(np.float32) * sa, b.astype(np.float32) * sb, 2 * (64 + 3))
  assert np.all(np.abs(got - want) <= bound)


# Jitted: one compile per shape instead of one per primitive keeps the file fast.
_quantize = jax.jit(mx.quantize, static_argnames=("axis", "elem_dtype"))
_mx_reference = jax.jit(reference.mx_gemm)
_scaled_reference = jax.jit(reference.scaled_gemm)


def _mx_operands(m, k, n, a_dtype, b_dtype, seed=0):
  rng = np.random.default_rng(seed)
  # Magnitudes change per 32-block along K, so every block gets its own scale byte.
  a_elems, a_scales = _quantize(_spread(rng, (m, k), (1, 32)), axis=1, elem_dtype=a_dtype)
  b_elems, b_scales = _quantize(_spread(rng, (k, n), (32, 1)), axis=0, elem_dtype=b_dtype)
  return tuple(np.asarray(x) for x in (a_elems, a_scales, b_elems, b_scales))


def _dequantized(elems, scales, axis):
  """elems * 2^(scale byte - 127) per 32-block along axis, in float64 (exact; bounds only)."""
  exps = np.repeat(scales.view(np.uint8).astype(np.int32) - mx.E8M0_BIAS, 32, axis=axis)
  return np.ldexp(elems.astype(np.float64), exps[:elems.shape[0], :elems.shape[1]])


def _tiny_mx_operands():
  """A valid 16 x 32 @ 32 x 16 MX pair without any JAX work (for the error tests)."""
  unit = np.full((1, 1), mx.E8M0_BIAS, np.uint8)
  elems = np.ones((16, 32), np.float32).astype(E4M3)
  return elems, np.repeat(unit, 16, axis=0), elems.T.copy(), np.repeat(unit, 16, axis=1)


# name: (M, K, N, A dtype, B dtype, block_k); K = 80 ends on a 16-wide partial block.
MX_CASES = {
    "e4m3": (72, 96, 40, E4M3, E4M3, 32),
    "e5m2": (40, 128, 72, E5M2, E5M2, 64),
    "mixed_partial_block": (33, 80, 65, E4M3, E5M2, 64),
}
MX_VARIANTS = {
    "portable_bf16": dict(use_dot_scaled=False, dequant_dtype="bfloat16"),
    "portable_f32": dict(use_dot_scaled=False, dequant_dtype="float32"),
    "dot_scaled": dict(use_dot_scaled=True),
}


@needs_interpreter
@pytest.mark.parametrize("variant", sorted(MX_VARIANTS))
@pytest.mark.parametrize("case", sorted(MX_CASES))
def test_mx_gemm_matches_reference(case, variant):
  m, k, n, a_dtype, b_dtype, block_k = MX_CASES[case]
  a, sa, b, sb = _mx_operands(m, k, n, a_dtype, b_dtype)
  assert len(np.unique(sa.view(np.uint8))) > 5  # the case exercises many scales
  got = _interpreted_module().run_interpreted_mx_gemm(a, sa, b, sb, block_k=block_k, **TILES,
                                                      **MX_VARIANTS[variant])
  want = np.asarray(_mx_reference(a, sa, b, sb))
  assert got.shape == (m, n) and got.dtype == np.float32
  bound = _bound(_dequantized(a, sa, 1), _dequantized(b, sb, 0), 2 * k)
  assert np.all(np.isfinite(got)) and np.all(np.abs(got - want) <= bound), \
      f"max excess {np.max(np.abs(got - want) - bound):.3g}"


@needs_interpreter
@allows_nan_inf
@pytest.mark.parametrize("variant", sorted(MX_VARIANTS))
def test_mx_nan_scale_poisons_exactly_its_row_and_column(variant):
  m, k, n, a_dtype, b_dtype, block_k = MX_CASES["mixed_partial_block"]
  a, sa, b, sb = _mx_operands(m, k, n, a_dtype, b_dtype, seed=2)
  sa_bits, sb_bits = sa.view(np.uint8).copy(), sb.view(np.uint8).copy()
  sa_bits[5, 2] = mx.E8M0_NAN  # the partial last block of row 5
  sb_bits[0, 40] = mx.E8M0_NAN  # the first block of column 40 (second column tile)
  got = _interpreted_module().run_interpreted_mx_gemm(a, sa_bits, b, sb_bits, block_k=block_k, **TILES,
                                                      **MX_VARIANTS[variant])
  e8m0 = jnp.float8_e8m0fnu
  want = np.asarray(_mx_reference(a, sa_bits.view(e8m0), b, sb_bits.view(e8m0)))
  poisoned = np.zeros((m, n), bool)
  poisoned[5, :] = True
  poisoned[:, 40] = True
  np.testing.assert_array_equal(np.isnan(want), poisoned)  # the spec agrees on which outputs
  np.testing.assert_array_equal(np.isnan(got), poisoned)
  bound = _bound(_dequantized(a, sa, 1), _dequantized(b, sb, 0), 2 * k)
  assert np.all(np.abs(got - want)[~poisoned] <= bound[~poisoned])


@needs_interpreter
@pytest.mark.parametrize("path", ["scaled"] + sorted(MX_VARIANTS))
@pytest.mark.parametrize("dtype", [E4M3, E5M2], ids=["e4m3", "e5m2"])
def test_interpreter_decoding_is_exact(dtype, path):
  """Every finite float8 code (subnormals too) times an identity B comes back exactly."""
  codes = np.arange(256, dtype=np.uint8).view(dtype)
  codes = np.where(np.isfinite(codes.astype(np.float32)), codes, np.zeros((), dtype))
  a_MxK = codes.reshape(8, 32)
  b_KxN = np.eye(32, dtype=np.float32).astype(dtype)
  module = _interpreted_module()
  if path == "scaled":
    ones_1x1 = np.ones((1, 1), np.float32)
    got = module.run_interpreted_scaled_gemm(a_MxK, ones_1x1, b_KxN, ones_1x1, block_m=16, block_n=32,
                                             block_k=32)
  else:
    unit = np.full((1, 1), mx.E8M0_BIAS, np.uint8)  # 2^0
    got = module.run_interpreted_mx_gemm(a_MxK, np.repeat(unit, 8, axis=0), b_KxN,
                                         np.repeat(unit, 32, axis=1), block_m=16, block_n=32,
                                         block_k=32, **MX_VARIANTS[path])
  np.testing.assert_array_equal(got, a_MxK.astype(np.float32))


@needs_interpreter
@allows_nan_inf
@pytest.mark.parametrize("variant", sorted(MX_VARIANTS))
def test_every_scale_byte_decodes_exactly(variant):
  """Row m of A is all ones with scale byte m: C[m, :] = 32 * 2^(m - 127), byte 255 NaN (not Inf)."""
  a_MxK = np.ones((256, 32), np.float32).astype(E4M3)
  a_scales = np.arange(256, dtype=np.uint8)[:, None]
  b_KxN = np.ones((32, 16), np.float32).astype(E4M3)
  b_scales = np.full((1, 16), mx.E8M0_BIAS, np.uint8)
  got = _interpreted_module().run_interpreted_mx_gemm(a_MxK, a_scales, b_KxN, b_scales, block_m=64,
                                                      block_n=16, block_k=32, **MX_VARIANTS[variant])
  want_M = np.ldexp(32.0, np.arange(256) - mx.E8M0_BIAS).astype(np.float32)  # byte 254 overflows to Inf
  want_M[255] = np.nan
  if variant == "portable_bf16":
    # 2^-127 (byte 0) is under bf16's normal range: the documented exception, flushed or kept.
    assert np.all((got[0] == 0) | (got[0] == want_M[0]))
    got, want_M = got[1:], want_M[1:]
  np.testing.assert_array_equal(got, np.repeat(want_M[:, None], 16, axis=1))


@needs_interpreter
def test_empty_contraction_gives_zeros():
  module = _interpreted_module()
  a_MxK, b_KxN = np.zeros((16, 0), E4M3), np.zeros((0, 8), E4M3)
  got = module.run_interpreted_scaled_gemm(a_MxK, np.ones((16, 1), np.float32), b_KxN,
                                           np.ones((1, 8), np.float32))
  np.testing.assert_array_equal(got, np.zeros((16, 8), np.float32))
  got = module.run_interpreted_mx_gemm(a_MxK, np.zeros((16, 0), np.uint8), b_KxN, np.zeros((0, 8), np.uint8))
  np.testing.assert_array_equal(got, np.zeros((16, 8), np.float32))


@needs_interpreter
def test_bad_arguments_are_named():
  module = _interpreted_module()
  a, sa, b, sb = _scaled_operands(40, 64, 48, True, E4M3, E4M3)
  with pytest.raises(ValueError, match=r"a_scale must be float32 of shape \(40, 1\)"):
    module.run_interpreted_scaled_gemm(a, sa[:8], b, sb)
  with pytest.raises(ValueError, match="b_scale must be float32"):
    module.run_interpreted_scaled_gemm(a, sa, b, sb.astype(np.float16))
  with pytest.raises(ValueError, match="b_elems must be a 2-D float8_e4m3fn or float8_e5m2"):
    module.run_interpreted_scaled_gemm(a, sa, b.astype(np.float32), sb)
  with pytest.raises(ValueError, match="K must agree"):
    module.run_interpreted_scaled_gemm(a, sa, b[:32], sb)
  with pytest.raises(ValueError, match="block_n must be a power of two"):
    module.run_interpreted_scaled_gemm(a, sa, b, sb, block_n=48)
  ma, msa, mb, msb = _tiny_mx_operands()
  with pytest.raises(ValueError, match="block_k must be a power of two >= 32"):
    module.run_interpreted_mx_gemm(ma, msa, mb, msb, block_k=16)
  with pytest.raises(ValueError, match=r"b_scales must be float8_e8m0fnu .* of shape \(1, 16\)"):
    module.run_interpreted_mx_gemm(ma, msa, mb, np.repeat(msb, 2, axis=0))
  with pytest.raises(ValueError, match="a_scales must be float8_e8m0fnu"):
    module.run_interpreted_mx_gemm(ma, msa.astype(np.float32), mb, msb)
  with pytest.raises(ValueError, match="dequant_dtype"):
    module.run_interpreted_mx_gemm(ma, msa, mb, msb, dequant_dtype="float16")


def test_available_reports_whether_triton_imports():
  assert fp8_triton.AVAILABLE == _HAVE_TRITON


def test_module_imports_without_triton(monkeypatch):
  # A None entry in sys.modules makes `import triton` raise ImportError, as on a CPU-only install.
  monkeypatch.setitem(sys.modules, "triton", None)
  monkeypatch.setitem(sys.modules, "triton.language", None)
  spec = importlib.util.spec_from_file_location("_fp8_triton_without_triton", fp8_triton.__file__)
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  assert module.AVAILABLE is False
  a, sa, b, sb = _scaled_operands(16, 32, 16, True, E4M3, E4M3)
  with pytest.raises(ImportError, match="pip install torch==2.13.0 triton"):
    module.run_interpreted_scaled_gemm(a, sa, b, sb)
  with pytest.raises(ImportError, match="pip install torch==2.13.0 triton"):
    module.run_interpreted_mx_gemm(*_tiny_mx_operands())


@pytest.mark.skipif(jax.default_backend() == "gpu", reason="checks the error off GPU")
def test_gpu_entries_raise_clearly_on_cpu():
  a, sa, b, sb = (jnp.asarray(x) for x in _scaled_operands(16, 32, 16, True, E4M3, E4M3))
  with pytest.raises(RuntimeError, match="scaled_gemm runs only on the JAX 'gpu' backend.*'cpu'"):
    fp8_triton.scaled_gemm(a, sa, b, sb)
  with pytest.raises(RuntimeError, match="mx_gemm runs only on the JAX 'gpu' backend.*'cpu'"):
    fp8_triton.mx_gemm(*(jnp.asarray(x) for x in _tiny_mx_operands()), use_dot_scaled=True)
