"""OCP Microscaling (MX) v1.0 quantization: MXFP8 (E4M3 / E5M2 elements, one E8M0 scale per 32 values).

  quantize(x, axis=-1)           -> (elems, scales)   elems: x's shape in the element dtype,
                                                      scales: x's shape with `axis` cut to ceil(n / 32)
  dequantize(elems, scales, axis=-1) -> x's values at the MX precision (float32 by default)

The conversion is the spec's (section 6.3): for every block of 32 consecutive values along `axis`,

  shared_exp = floor(log2(amax of the block)) - emax_elem      (E4M3: emax 8, E5M2: emax 15)
  scale      = 2^shared_exp, stored as E8M0 (biased exponent shared_exp + 127)
  elem_i     = RNE(x_i / scale), saturated to the element format's max normal (448 / 57344)

`scale_mode="rceil"` is the round-up variant of cuBLAS and torchao: the smallest shared_exp with
amax <= max_normal * 2^shared_exp, so no element ever saturates (one binade of headroom is spent).

Defined behaviour where the spec leaves room:
  - shared_exp is clamped to the E8M0 range [-127, 127]; an all-zero block gets -127 and zero elements.
  - A block holding any NaN or +-Inf becomes NaN: scale 0xFF (the E8M0 NaN) and every element NaN. A
    non-finite input is never turned into a finite number.
  - An axis whose length n is not a multiple of 32: the last block is a partial block, logically padded
    with zeros (zeros never raise a block's amax). elems keep x's shape; scales have ceil(n / 32) entries
    along the axis; dequantize accepts the same pair.
  - Exponents are read from the float32 bit patterns and scaled values are built by integer exponent
    arithmetic, so the result is exact even for float32 subnormals (XLA:CPU flushes subnormals in float
    arithmetic, which would otherwise lose them).

  - dequantize to float32 is exact, except that a value of 2^128 or more becomes +-Inf: only elements
    that rounded up at the very top of float32's range can get there.

This module never rounds anything but the elements: dequantize(quantize(x)) differs from x only by the
element format's rounding (and saturation in "floor" mode).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

BLOCK_SIZE = 32
E8M0_BIAS = 127
E8M0_NAN = 0xFF
SCALE_EXP_MIN, SCALE_EXP_MAX = -127, 127

# element dtype -> (emax: exponent of the largest normal, largest normal value)
ELEMENT_FORMATS = {
    jnp.dtype(jnp.float8_e4m3fn): (8, 448.0),
    jnp.dtype(jnp.float8_e5m2): (15, 57344.0),
}
SCALE_MODES = ("floor", "rceil")

_F32_EXP_MASK = 0x7F800000
_F32_MANT_MASK = 0x007FFFFF
_F32_ABS_MASK = 0x7FFFFFFF
_F32_SIGN = np.int32(-0x80000000)


def _element_format(elem_dtype):
  dt = jnp.dtype(elem_dtype)
  if dt not in ELEMENT_FORMATS:
    raise ValueError(f"MX element dtype must be float8_e4m3fn or float8_e5m2, got {dt}")
  return ELEMENT_FORMATS[dt]


def _check_axis(shape, axis: int, block_size: int, who: str) -> int:
  if block_size < 1:
    raise ValueError(f"{who}: block_size must be >= 1, got {block_size}")
  if not shape:
    raise ValueError(f"{who}: needs an array with at least one dimension, got a scalar")
  if not -len(shape) <= axis < len(shape):
    raise ValueError(f"{who}: axis {axis} is out of range for shape {tuple(shape)}")
  return axis % len(shape)


def num_blocks(n: int, block_size: int = BLOCK_SIZE) -> int:
  return -(-n // block_size)


def _to_blocks(x, axis: int, block_size: int):
  """Moves `axis` last, zero-pads it to a multiple of block_size and splits it: (..., nb, block_size)."""
  x = jnp.moveaxis(x, axis, -1)
  n = x.shape[-1]
  pad = num_blocks(n, block_size) * block_size - n
  if pad:
    x = jnp.pad(x, [(0, 0)] * (x.ndim - 1) + [(0, pad)])
  return x.reshape(x.shape[:-1] + (x.shape[-1] // block_size, block_size)), n


def _from_blocks(x_blocks, axis: int, n: int):
  # The block axes by size, not -1: with a zero-size dim elsewhere (an empty batch) -1 is ambiguous.
  x = x_blocks.reshape(x_blocks.shape[:-2] + (x_blocks.shape[-2] * x_blocks.shape[-1],))[..., :n]
  return jnp.moveaxis(x, -1, axis)


def _pow2_f32(e):
  """2^e as float32 built from its bits, for int32 e in [-126, 127] (always a normal number)."""
  return jax.lax.bitcast_convert_type((e + 127) << 23, jnp.float32)


def _floor_log2_and_mantissa(mag):
  """For float32 magnitudes given as int32 bits (finite, > 0): floor(log2 |x|) and the 23 fraction bits
  of |x| normalized to [1, 2) (subnormals are normalized first)."""
  exp_field = mag >> 23
  mant = mag & _F32_MANT_MASK
  bitlen = 32 - jax.lax.clz(mant)          # subnormal: |x| = mant * 2^-149
  sub_log2 = bitlen - 1 - 149
  sub_frac = (mant << jnp.clip(24 - bitlen, 0, 31)) & _F32_MANT_MASK
  is_normal = exp_field > 0
  return jnp.where(is_normal, exp_field - 127, sub_log2), jnp.where(is_normal, mant, sub_frac)


def shared_exponents(amax_bits, elem_dtype, scale_mode: str):
  """The unbiased E8M0 exponent per block from the block's amax given as float32 bits (int32)."""
  emax, max_normal = _element_format(elem_dtype)
  if scale_mode not in SCALE_MODES:
    raise ValueError(f"scale_mode must be one of {SCALE_MODES}, got {scale_mode!r}")
  safe = jnp.maximum(amax_bits, 1)
  floor_log2, frac = _floor_log2_and_mantissa(safe)
  exp = floor_log2 - emax
  if scale_mode == "rceil":
    # amax <= max_normal * 2^exp  <=>  frac(amax) <= frac(max_normal) at the same binade.
    max_frac = int(np.float32(max_normal).view(np.int32)) & _F32_MANT_MASK
    exp = exp + (frac > max_frac).astype(jnp.int32)
  exp = jnp.clip(exp, SCALE_EXP_MIN, SCALE_EXP_MAX)
  return jnp.where(amax_bits == 0, SCALE_EXP_MIN, exp)


def _scale_down(bits, exp):
  """x * 2^-exp exactly for float32 x given as bits, exp in [-127, 127] (broadcast), in float32.

  Results below float32's normal range are far below the smallest E4M3/E5M2 subnormal (2^-9 / 2^-16
  after scaling), so they are returned as signed zeros, as the element cast would round them.
  """
  mag = bits & _F32_ABS_MASK
  sign = bits & _F32_SIGN
  exp_field = mag >> 23
  x = jax.lax.bitcast_convert_type(bits, jnp.float32)
  # Normal x: one multiply by a normal power of two, exact unless the result is subnormal (then zero).
  # For float32 input exp <= 127 - emax, so -exp >= -120 and the clip never bites; it keeps 2^-exp normal.
  normal = x * _pow2_f32(jnp.clip(-exp, -126, 127))
  # Subnormal x = mant * 2^-149: the product mant * 2^(-149 - exp) is normal when -149 - exp >= -126.
  mant = (mag & _F32_MANT_MASK).astype(jnp.float32)
  sub_exp = -149 - exp
  subnormal = jnp.where(sub_exp >= -126, mant * _pow2_f32(jnp.clip(sub_exp, -126, 127)), 0.0)
  value = jnp.where(exp_field > 0, normal, subnormal)
  # Reattach the sign (subnormal path built a magnitude; a flushed product may have lost a -0).
  value_bits = jax.lax.bitcast_convert_type(jnp.abs(value), jnp.int32) | sign
  return jax.lax.bitcast_convert_type(value_bits, jnp.float32)


def quantize(x, *, axis: int = -1, block_size: int = BLOCK_SIZE, elem_dtype=jnp.float8_e4m3fn,
             scale_mode: str = "floor"):
  """MX-quantizes x along `axis`: returns (elems in elem_dtype, shape of x; scales in float8_e8m0fnu)."""
  _, max_normal = _element_format(elem_dtype)
  axis = _check_axis(jnp.shape(x), axis, block_size, "mx.quantize")
  x = jnp.asarray(x)
  if not jnp.issubdtype(x.dtype, jnp.floating):
    raise ValueError(f"mx.quantize: x must be a floating array, got {x.dtype}")
  bits_blocks, n = _to_blocks(jax.lax.bitcast_convert_type(x.astype(jnp.float32), jnp.int32), axis,
                              block_size)
  mag = bits_blocks & _F32_ABS_MASK
  # Non-negative float32 bit patterns order like their values, and NaN/Inf sort above every finite one.
  amax_bits = jnp.max(mag, axis=-1)
  nonfinite = amax_bits >= _F32_EXP_MASK
  exp = shared_exponents(jnp.where(nonfinite, 0, amax_bits), elem_dtype, scale_mode)
  scaled = _scale_down(bits_blocks, exp[..., None])
  scaled = jnp.clip(scaled, -max_normal, max_normal)
  scaled = jnp.where(nonfinite[..., None], jnp.nan, scaled)
  elems = _from_blocks(scaled.astype(elem_dtype), axis, n)
  scale_bits = jnp.where(nonfinite, E8M0_NAN, exp + E8M0_BIAS).astype(jnp.uint8)
  scales = jnp.moveaxis(jax.lax.bitcast_convert_type(scale_bits, jnp.float8_e8m0fnu), -1, axis)
  return elems, scales


def scale_exponents(scales):
  """float8_e8m0fnu scales -> (int32 unbiased exponents, bool NaN mask)."""
  if jnp.dtype(scales.dtype) != jnp.dtype(jnp.float8_e8m0fnu):
    raise ValueError(f"MX scales must be float8_e8m0fnu, got {scales.dtype}")
  bits = jax.lax.bitcast_convert_type(scales, jnp.uint8).astype(jnp.int32)
  return bits - E8M0_BIAS, bits == E8M0_NAN


def _scale_up(elem_f32, exp):
  """elem * 2^exp built from bits (exact, subnormal results included), elem a float32 from a float8
  element (so a normal float32 or zero), exp int32 in [-127, 127]."""
  bits = jax.lax.bitcast_convert_type(elem_f32, jnp.int32)
  sign = bits & _F32_SIGN
  mag = bits & _F32_ABS_MASK
  new_exp = (mag >> 23) + exp
  normal_bits = mag + (exp << 23)
  # Subnormal result: shift the 24-bit significand right, rounding to nearest even (exact for float8
  # inputs, whose 4 significant bits never reach 2^-149; the rounding keeps the helper correct anyway).
  shift = jnp.clip(1 - new_exp, 1, 31)
  sig = (mag & _F32_MANT_MASK) | 0x00800000
  half = (1 << (shift - 1)) - 1
  sub_bits = (sig + half + ((sig >> shift) & 1)) >> shift
  sub_bits = jnp.where(1 - new_exp > 25, 0, sub_bits)
  out = jnp.where(new_exp >= 255, _F32_EXP_MASK, jnp.where(new_exp >= 1, normal_bits, sub_bits))
  out = jnp.where(mag == 0, 0, out) | sign
  return jax.lax.bitcast_convert_type(out, jnp.float32)


def dequantize(elems, scales, *, axis: int = -1, block_size: int = BLOCK_SIZE, dtype=jnp.float32):
  """The values an MX pair stands for: elems * 2^scale per block, in `dtype` (exact in float32)."""
  axis = _check_axis(jnp.shape(elems), axis, block_size, "mx.dequantize")
  elem_dt = jnp.dtype(elems.dtype)
  _element_format(elem_dt)
  n = elems.shape[axis]
  want = elems.shape[:axis] + (num_blocks(n, block_size),) + elems.shape[axis + 1:]
  if tuple(scales.shape) != want:
    raise ValueError(f"mx.dequantize: elems {tuple(elems.shape)} with block_size {block_size} along axis "
                     f"{axis} need scales of shape {want}, got {tuple(scales.shape)}")
  exp, is_nan = scale_exponents(scales)
  e_blocks, _ = _to_blocks(elems.astype(jnp.float32), axis, block_size)
  exp_last = jnp.moveaxis(exp, axis, -1)[..., None]
  nan_last = jnp.moveaxis(is_nan, axis, -1)[..., None]
  values = jnp.where(nan_last, jnp.nan, _scale_up(e_blocks, exp_last))
  return _from_blocks(values, axis, n).astype(dtype)


def quantize_dequantize(x, *, axis: int = -1, block_size: int = BLOCK_SIZE, elem_dtype=jnp.float8_e4m3fn,
                        scale_mode: str = "floor", dtype=jnp.float32):
  """x rounded to MX precision along `axis` (the emulation path's operand)."""
  elems, scales = quantize(x, axis=axis, block_size=block_size, elem_dtype=elem_dtype,
                           scale_mode=scale_mode)
  return dequantize(elems, scales, axis=axis, block_size=block_size, dtype=dtype)
