"""Pallas kernels of the scaled FP8 GEMMs: C = dequant(A) @ dequant(B) in float32 (reference.py is the spec).

Letters: M rows of A, K the contraction, N columns of B, Kb = ceil(K / 32) MX blocks along K; Mp, Kp,
Np, Kbp the same padded to whole tiles; bm, bn, bk the tile sizes (block_m, block_n, block_k); S the
scale columns of A / rows of B as the kernels get them (Kbp for MX, 1 for row-/tensor-wise).
Layouts (as reference.py):

  MX (block-scaled)  A: elems M x K (float8), scales M x Kb (float8_e8m0fnu)
                     B: elems K x N,          scales Kb x N
  row-wise           A: elems M x K, scale M x 1 (float32); B: elems K x N, scale 1 x N (float32)
  tensor-wise        the same with 1 x 1 scales.

Both kernels run on the grid (Mp / bm, Np / bn); each program loops over the K tiles in-kernel with a
float32 accumulator (Pallas-Triton has no scratch memory and no ordered grid axis to accumulate over).

  mx_gemm      per 32-wide MX block along K: one float8 x float8 -> f32 dot of the block (the FP8 tensor
               cores on Hopper, which have no block-scaled MMA), promoted into the float32 accumulator
               times the block's two scales: acc += (A_blk @ B_blk) * 2^sa * 2^sb. Hopper's FP8 MMA keeps
               fewer accumulator bits than float32, so partial sums are promoted often (every 128
               elements in DeepSeek-V3's FP8 GEMMs, arXiv 2412.19437 sec. 3.3.2; every 32 here, the MX
               block). Scales enter the kernel as their uint8 bit patterns (bitcast in the wrapper; Triton
               has no E8M0 type) and 2^scale is built from the bits: exponent field = the e8m0 byte,
               0 -> 2^-127 (a float32 subnormal), 0xFF -> NaN. Operands of two float8 types (E4M3 x E5M2)
               go through bf16, which holds either exactly.
  scaled_gemm  per K tile: one float8 x float8 -> f32 dot (the FP8 tensor cores on Hopper; upcast to
               float32 in interpret mode, where XLA:CPU has no float8 dot); the row/column scales
               multiply the accumulator once in the epilogue: (A_e @ B_e) * sa * sb.

Shapes that are not whole tiles are padded in the wrapper with zero elements and, for MX, the e8m0 byte
0 (2^-127); the output is sliced back. Tiles shrink to the problem for small shapes (to a power of two,
at least 16 rows/columns and 32 along K: the smallest Triton/wgmma FP8 tiles).

Must never: turn a NaN scale (0xFF) into a number, pad with a NaN scale, let a tile read another
tile's scales, or accept a shape/dtype mismatch silently. Dequantized values below 2^-126 may be
flushed to zero on a backend that flushes subnormals (XLA:CPU does); the reference keeps them.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pl_triton

from pallas_kernels import mx
from pallas_kernels import vma

_FP8_DTYPES = (jnp.dtype(jnp.float8_e4m3fn), jnp.dtype(jnp.float8_e5m2))
_MIN_TILE_MN = 16
_MIN_TILE_K = 32
_F32_QUIET_NAN_BITS = 0x7FC00000
_F32_POW2_M127_BITS = 0x00400000  # 2^-127: below float32's normal range


def _next_pow2(n: int) -> int:
  return 1 if n <= 1 else 1 << (n - 1).bit_length()


def _round_up(n: int, multiple: int) -> int:
  return -(-n // multiple) * multiple


def _check_block(name: str, size: int, multiple: int = 1):
  if size < 1 or size & (size - 1) or size % multiple:
    extra = f" and a multiple of {multiple} (the MX block)" if multiple > 1 else ""
    raise ValueError(f"{name} must be a power of two (Triton tiles are){extra}, got {size}")


def _tile(block: int, dim: int, minimum: int) -> int:
  """The tile for one dim: `block`, shrunk to the dim's next power of two (not below `minimum`)."""
  return min(block, max(minimum, _next_pow2(dim)))


def _check_operands(who: str, a_elems_MxK, b_elems_KxN):
  for name, x in (("a_elems", a_elems_MxK), ("b_elems", b_elems_KxN)):
    if x.ndim != 2:
      raise ValueError(f"{who}: {name} must be 2-D, got shape {tuple(x.shape)}")
    if jnp.dtype(x.dtype) not in _FP8_DTYPES:
      raise ValueError(f"{who}: {name} must be float8_e4m3fn or float8_e5m2, got {x.dtype}")
    if 0 in x.shape:
      raise ValueError(f"{who}: {name} must not be empty, got shape {tuple(x.shape)}")
  (m, k), (k_b, n) = a_elems_MxK.shape, b_elems_KxN.shape
  if k != k_b:
    raise ValueError(f"{who}: a_elems is M x K = {tuple(a_elems_MxK.shape)} but b_elems is K x N = "
                     f"{tuple(b_elems_KxN.shape)}: K differs")
  return m, k, n


def _pad2(x, rows: int, cols: int, fill):
  return jnp.pad(x, ((0, rows - x.shape[0]), (0, cols - x.shape[1])), constant_values=fill)


def _dot_f32(a, b):
  # HIGHEST: an f32 dot stays IEEE (no TF32); bf16/fp8 operands get Triton's plain dot.
  return lax.dot_general(a, b, (((1,), (0,)), ((), ())), precision=lax.Precision.HIGHEST,
                         preferred_element_type=jnp.float32)


def _pow2_from_e8m0(bits_u8):
  """2^(bits - 127) as float32 from e8m0 bytes, built from the bit pattern; 0xFF -> NaN."""
  e = bits_u8.astype(jnp.int32)
  f32_bits = jnp.where(e == mx.E8M0_NAN, _F32_QUIET_NAN_BITS,
                       jnp.where(e == 0, _F32_POW2_M127_BITS, e << 23))
  return lax.bitcast_convert_type(f32_bits, jnp.float32)


def _mx_kernel(a_ref, sa_ref, b_ref, sb_ref, out_ref, *, block_k: int, upcast: bool):
  bm, bn = out_ref.shape
  kb = block_k // mx.BLOCK_SIZE

  def body(t, acc_MxN):
    k0 = pl.multiple_of(t * block_k, block_k)
    for j in range(kb):  # unrolled: kb dots per K tile keep Triton's pipeline fed
      at = pl.multiple_of(k0 + j * mx.BLOCK_SIZE, mx.BLOCK_SIZE)
      a_MxB, b_BxN = a_ref[:, pl.ds(at, mx.BLOCK_SIZE)], b_ref[pl.ds(at, mx.BLOCK_SIZE), :]
      if upcast:  # float8 products are exact in float32, so this changes nothing but the backend
        a_MxB, b_BxN = a_MxB.astype(jnp.float32), b_BxN.astype(jnp.float32)
      elif a_MxB.dtype != b_BxN.dtype:  # Pallas-Triton's dot takes one element type; bf16 is exact
        a_MxB, b_BxN = a_MxB.astype(jnp.bfloat16), b_BxN.astype(jnp.bfloat16)
      sa_Mx1 = _pow2_from_e8m0(sa_ref[:, pl.ds(t * kb + j, 1)])
      sb_1xN = _pow2_from_e8m0(sb_ref[pl.ds(t * kb + j, 1), :])
      # Scaled one side at a time: sa * sb alone may underflow where the product with the sum does not.
      acc_MxN = acc_MxN + (_dot_f32(a_MxB, b_BxN) * sa_Mx1) * sb_1xN
    return acc_MxN

  num_k_tiles = a_ref.shape[1] // block_k
  out_ref[...] = lax.fori_loop(0, num_k_tiles, body, jnp.zeros((bm, bn), jnp.float32))


def _scaled_kernel(a_ref, sa_ref, b_ref, sb_ref, out_ref, *, block_k: int, upcast: bool):
  bm, bn = out_ref.shape

  def body(t, acc_MxN):
    k0 = pl.multiple_of(t * block_k, block_k)
    a_Mxk = a_ref[:, pl.ds(k0, block_k)]
    b_kxN = b_ref[pl.ds(k0, block_k), :]
    if upcast:  # float8 products are exact in float32, so this changes nothing but the backend
      a_Mxk, b_kxN = a_Mxk.astype(jnp.float32), b_kxN.astype(jnp.float32)
    elif a_Mxk.dtype != b_kxN.dtype:  # Pallas-Triton's dot takes one element type; bf16 is exact
      a_Mxk, b_kxN = a_Mxk.astype(jnp.bfloat16), b_kxN.astype(jnp.bfloat16)
    return acc_MxN + _dot_f32(a_Mxk, b_kxN)

  num_k_tiles = a_ref.shape[1] // block_k
  acc_MxN = lax.fori_loop(0, num_k_tiles, body, jnp.zeros((bm, bn), jnp.float32))
  out_ref[...] = acc_MxN * sa_ref[...] * sb_ref[...]


def _gemm_call(kernel, a_MpxKp, sa_MpxS, b_KpxNp, sb_SxNp, bm: int, bn: int, name: str, interpret: bool):
  """Grid (Mp / bm, Np / bn); A, B and their scales as full-K slabs of the tile's rows / columns, which
  the kernel slices along K (slab sizes need not be powers of two; every load is a bm/bn x bk tile)."""
  (mp, kp), np_ = a_MpxKp.shape, b_KpxNp.shape[1]
  in_specs = [pl.BlockSpec((bm, kp), lambda i, j: (i, 0)),
              pl.BlockSpec((bm, sa_MpxS.shape[1]), lambda i, j: (i, 0)),
              pl.BlockSpec((kp, bn), lambda i, j: (0, j)),
              pl.BlockSpec((sb_SxNp.shape[0], bn), lambda i, j: (0, j))]
  return vma.interpretable(pl.pallas_call(
      kernel, grid=(mp // bm, np_ // bn), in_specs=in_specs,
      out_specs=pl.BlockSpec((bm, bn), lambda i, j: (i, j)),
      out_shape=vma.shape_dtype((mp, np_), jnp.float32, a_MpxKp, sa_MpxS, b_KpxNp, sb_SxNp),
      # Triton by name: without it jax >= 0.10 lowers pallas_call to Mosaic GPU on NVIDIA.
      # 8 warps from 128 x 128 tiles keep the f32 accumulator out of local memory.
      compiler_params=pl_triton.CompilerParams(num_warps=8 if bm * bn >= 128 * 128 else 4,
                                               num_stages=3),
      interpret=interpret, name=name), a_MpxKp, sa_MpxS, b_KpxNp, sb_SxNp, interpret=interpret)


@functools.partial(jax.jit, static_argnames=("block_m", "block_n", "block_k", "interpret"))
def mx_gemm(a_elems_MxK, a_scales_MxKb, b_elems_KxN, b_scales_KbxN, *, block_m: int = 128,
            block_n: int = 128, block_k: int = 128, interpret: bool = False):
  """float32 M x N = mx.dequantize(A, axis=1) @ mx.dequantize(B, axis=0), MX scales along K."""
  m, k, n = _check_operands("fp8_gemm.mx_gemm", a_elems_MxK, b_elems_KxN)
  _check_block("block_m", block_m)
  _check_block("block_n", block_n)
  _check_block("block_k", block_k, mx.BLOCK_SIZE)
  kb = mx.num_blocks(k)
  for name, s, want in (("a_scales", a_scales_MxKb, (m, kb)), ("b_scales", b_scales_KbxN, (kb, n))):
    if tuple(s.shape) != want:
      raise ValueError(f"fp8_gemm.mx_gemm: {name} must be {want} for a_elems {tuple(a_elems_MxK.shape)}"
                       f" and b_elems {tuple(b_elems_KxN.shape)} (one scale per 32 along K), got "
                       f"{tuple(s.shape)}")
    if jnp.dtype(s.dtype) != jnp.dtype(jnp.float8_e8m0fnu):
      raise ValueError(f"fp8_gemm.mx_gemm: {name} must be float8_e8m0fnu, got {s.dtype}")
  bm, bn = _tile(block_m, m, _MIN_TILE_MN), _tile(block_n, n, _MIN_TILE_MN)
  bk = _tile(block_k, k, _MIN_TILE_K)
  mp, np_, kp = _round_up(m, bm), _round_up(n, bn), _round_up(k, bk)
  kbp = kp // mx.BLOCK_SIZE
  # Padded scales are the e8m0 byte 0 (2^-127) times zero elements: they add exact zeros, never NaN.
  sa_MpxKbp = _pad2(lax.bitcast_convert_type(a_scales_MxKb, jnp.uint8), mp, kbp, 0)
  sb_KbpxNp = _pad2(lax.bitcast_convert_type(b_scales_KbxN, jnp.uint8), kbp, np_, 0)
  out_MpxNp = _gemm_call(
      functools.partial(_mx_kernel, block_k=bk, upcast=interpret), _pad2(a_elems_MxK, mp, kp, 0), sa_MpxKbp,
      _pad2(b_elems_KxN, kp, np_, 0), sb_KbpxNp, bm, bn, "fp8_mx_gemm", interpret)
  return out_MpxNp[:m, :n]


@functools.partial(jax.jit, static_argnames=("block_m", "block_n", "block_k", "interpret"))
def scaled_gemm(a_elems_MxK, a_scale_Mx1, b_elems_KxN, b_scale_1xN, *, block_m: int = 128,
                block_n: int = 128, block_k: int = 128, interpret: bool = False):
  """float32 M x N = (A_e @ B_e) * a_scale * b_scale; scales row-wise (M x 1, 1 x N) or 1 x 1."""
  m, k, n = _check_operands("fp8_gemm.scaled_gemm", a_elems_MxK, b_elems_KxN)
  _check_block("block_m", block_m)
  _check_block("block_n", block_n)
  _check_block("block_k", block_k)
  for name, s, want in (("a_scale", a_scale_Mx1, ((m, 1), (1, 1))),
                        ("b_scale", b_scale_1xN, ((1, n), (1, 1)))):
    if tuple(s.shape) not in want:
      raise ValueError(f"fp8_gemm.scaled_gemm: {name} must be {want[0]} (row-wise) or (1, 1) "
                       f"(tensor-wise) for a_elems {tuple(a_elems_MxK.shape)} and b_elems "
                       f"{tuple(b_elems_KxN.shape)}, got {tuple(s.shape)}")
    if jnp.dtype(s.dtype) != jnp.dtype(jnp.float32):
      raise ValueError(f"fp8_gemm.scaled_gemm: {name} must be float32, got {s.dtype}")
  bm, bn = _tile(block_m, m, _MIN_TILE_MN), _tile(block_n, n, _MIN_TILE_MN)
  bk = _tile(block_k, k, _MIN_TILE_K)
  mp, np_, kp = _round_up(m, bm), _round_up(n, bn), _round_up(k, bk)
  # A tensor-wise scale becomes a (tiny) vector so that one kernel serves both modes.
  sa_Mpx1 = _pad2(jnp.broadcast_to(a_scale_Mx1, (m, 1)), mp, 1, 1.0)
  sb_1xNp = _pad2(jnp.broadcast_to(b_scale_1xN, (1, n)), 1, np_, 1.0)
  out_MpxNp = _gemm_call(
      functools.partial(_scaled_kernel, block_k=bk, upcast=interpret), _pad2(a_elems_MxK, mp, kp, 0),
      sa_Mpx1, _pad2(b_elems_KxN, kp, np_, 0), sb_1xNp, bm, bn, "fp8_scaled_gemm", interpret)
  return out_MpxNp[:m, :n]
