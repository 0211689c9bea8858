"""pallas_kernels.mx against a scalar OCP MX v1.0 reference written here with exact rational arithmetic.

The reference never touches float8 dtypes or float arithmetic: amax, the shared exponent, the rounding
of each element (nearest, ties to even, saturating) and the decoding of float8 bit patterns are done on
integers and Fractions, one value at a time.
"""

from __future__ import annotations

import math
from fractions import Fraction

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import mx

# name -> (dtype, mantissa bits, min normal exponent, emax, max normal)
FORMATS = {
    "e4m3": (jnp.float8_e4m3fn, 3, -6, 8, Fraction(448)),
    "e5m2": (jnp.float8_e5m2, 2, -14, 15, Fraction(57344)),
}


def floor_log2(q: Fraction) -> int:
  """floor(log2 q) for q > 0, on integers."""
  n, d = q.numerator, q.denominator
  k = n.bit_length() - d.bit_length()
  # 2^k <= n/d < 2^(k+1) after at most one correction either way.
  if k >= 0:
    k = k if n >= d << k else k - 1
  else:
    k = k if n << -k >= d else k - 1
  return k


def round_element(q: Fraction, fmt: str) -> Fraction:
  """Nearest element-format value to q >= 0, ties to even, saturating at the max normal."""
  _, mbits, emin, _, max_normal = FORMATS[fmt]
  if q == 0:
    return Fraction(0)
  e = max(floor_log2(q), emin)
  ulp = Fraction(2) ** (e - mbits)
  t = q / ulp
  n = t.numerator // t.denominator
  r = t - n
  if r > Fraction(1, 2) or (r == Fraction(1, 2) and n % 2 == 1):
    n += 1
  return min(n * ulp, max_normal)


def reference_block(values: list[float], fmt: str, mode: str):
  """-> (scale exponent or None for NaN, [(sign, Fraction | None for NaN)] per element)."""
  _, _, _, emax, max_normal = FORMATS[fmt]
  if any(math.isnan(v) or math.isinf(v) for v in values):
    return None, [(0, None)] * len(values)
  mags = [abs(Fraction(v)) for v in values]
  amax = max(mags)
  if amax == 0:
    s = -127
  else:
    s = floor_log2(amax) - emax
    if mode == "rceil" and amax > max_normal * Fraction(2) ** s:
      s += 1
    s = min(max(s, -127), 127)
  elems = [(1 if math.copysign(1.0, v) < 0 else 0, round_element(m / Fraction(2) ** s, fmt))
           for v, m in zip(values, mags)]
  return s, elems


def decode(bits: int, fmt: str):
  """A float8 bit pattern -> (sign, Fraction | None for NaN / Inf), integer arithmetic only."""
  if fmt == "e4m3":
    sign, e, m = bits >> 7, (bits >> 3) & 0xF, bits & 0x7
    if e == 0xF and m == 0x7:
      return sign, None
    return sign, (Fraction(m, 8) * Fraction(2) ** -6 if e == 0 else Fraction(8 + m, 8) * Fraction(2) ** (e - 7))
  sign, e, m = bits >> 7, (bits >> 2) & 0x1F, bits & 0x3
  if e == 0x1F:
    return sign, None
  return sign, (Fraction(m, 4) * Fraction(2) ** -14 if e == 0 else Fraction(4 + m, 4) * Fraction(2) ** (e - 15))


def f32_bits_to_fraction(b: int):
  b &= 0xFFFFFFFF
  sign, e, m = b >> 31, (b >> 23) & 0xFF, b & 0x7FFFFF
  if e == 0xFF:
    return sign, None
  return sign, (Fraction(m) * Fraction(2) ** -149 if e == 0 else Fraction(0x800000 + m) * Fraction(2) ** (e - 150))


def random_values(n: int, seed: int) -> np.ndarray:
  """Blocks of mixed character: wide dynamic range, tiny and huge values together, and edge cases."""
  rng = np.random.default_rng(seed)
  x = (rng.standard_normal(n) * 2.0 ** rng.integers(-40, 40, n)).astype(np.float32)
  blocks = x.reshape(-1, 32)
  nb = blocks.shape[0]
  kinds = rng.integers(0, 10, nb)
  for i in range(nb):
    k = kinds[i]
    if k == 0:    # tiny and huge in one block: the tiny ones flush to zero or subnormal elements
      blocks[i] = (rng.standard_normal(32) * 2.0 ** rng.choice([-30, 0, 20], 32)).astype(np.float32)
    elif k == 1:  # float32 subnormals (and near the bottom of the E8M0 range)
      blocks[i] = (rng.standard_normal(32) * 2.0 ** rng.integers(-149, -115, 32)).astype(np.float32)
    elif k == 2:  # powers of two and exact element-grid values around the max normal
      blocks[i] = (rng.choice([1.0, -1.0], 32) * 2.0 ** rng.integers(-20, 20, 32)).astype(np.float32)
      blocks[i, 0] = 448.0 * 2.0 ** rng.integers(-5, 5)
    elif k == 3:  # values that saturate in floor mode: amax/2^s in (448, 512)
      blocks[i] = rng.uniform(449.0, 511.9, 32).astype(np.float32) * rng.choice([1.0, -1.0], 32)
    elif k == 4:  # zeros, signed zeros, a few values
      blocks[i] = np.where(rng.random(32) < 0.7, 0.0, rng.standard_normal(32)).astype(np.float32)
      blocks[i, :3] = [0.0, -0.0, 0.0]
    elif k == 5:  # the float32 extremes
      blocks[i] = rng.choice([3.4e38, -3.4e38, 1.0, 1e-38, -2.0 ** -149], 32).astype(np.float32)
    elif k == 6 and rng.random() < 0.3:  # non-finite
      blocks[i, rng.integers(0, 32)] = rng.choice([np.nan, np.inf, -np.inf])
    elif k == 7:  # exact ties in the element grid after scaling
      s = rng.integers(-10, 10)
      blocks[i] = ((rng.integers(16, 32, 32) + 0.5) * 2.0 ** (s - 4) * rng.choice([1.0, -1.0], 32)).astype(np.float32)
  blocks[0] = 0.0
  return blocks.reshape(-1)


@pytest.mark.parametrize("fmt,mode,n", [("e4m3", "floor", 102_400), ("e4m3", "rceil", 51_200),
                                        ("e5m2", "floor", 51_200), ("e5m2", "rceil", 25_600)])
def test_quantize_dequantize_bit_exact_against_scalar_reference(fmt, mode, n):
  dtype = FORMATS[fmt][0]
  x = random_values(n, seed=hash((fmt, mode)) % 1000)
  elems, scales = jax.jit(lambda v: mx.quantize(v.reshape(-1, 64), elem_dtype=dtype, scale_mode=mode))(x)
  deq = jax.jit(lambda e, s: mx.dequantize(e, s))(elems, scales)
  elem_bits = np.asarray(jax.lax.bitcast_convert_type(elems, jnp.uint8)).reshape(-1)
  scale_bits = np.asarray(jax.lax.bitcast_convert_type(scales, jnp.uint8)).reshape(-1)
  deq_bits = np.asarray(deq).view(np.uint32).reshape(-1)
  bad = []
  for b in range(n // 32):
    vals = [float(v) for v in x[32 * b:32 * b + 32]]
    s, ref = reference_block(vals, fmt, mode)
    if s is None:
      if scale_bits[b] != 0xFF:
        bad.append((b, "scale", "NaN", int(scale_bits[b])))
      for i in range(32):
        if decode(int(elem_bits[32 * b + i]), fmt)[1] is not None:
          bad.append((b, i, "elem should be NaN"))
        if not np.isnan(np.asarray(deq).reshape(-1)[32 * b + i]):
          bad.append((b, i, "dequantized value should be NaN"))
      continue
    if int(scale_bits[b]) != s + 127:
      bad.append((b, "scale", s + 127, int(scale_bits[b])))
    for i, (sign, value) in enumerate(ref):
      got_sign, got = decode(int(elem_bits[32 * b + i]), fmt)
      if (got_sign, got) != (sign, value):
        bad.append((b, i, vals[i], (sign, value), (got_sign, got)))
      dsign, dval = f32_bits_to_fraction(int(deq_bits[32 * b + i]))
      want = value * Fraction(2) ** s
      if want >= Fraction(2) ** 128:   # rounding up at the top of float32's range: +-Inf in float32
        want = None
      if (dsign, dval) != (sign, want):
        bad.append((b, i, "dequantize", vals[i], dval))
    if len(bad) > 10:
      break
  assert not bad, bad[:10]


@pytest.mark.parametrize("elem,max_normal", [(jnp.float8_e4m3fn, 448.0), (jnp.float8_e5m2, 57344.0)])
@pytest.mark.parametrize("k", [-20, -3, 0, 5, 30])
def test_round_up_scale_of_an_amax_of_exactly_max_normal_times_a_power_of_two(elem, max_normal, k):
  """rceil's boundary: amax = max_normal x 2^k fits 2^k exactly (the smallest scale with amax <= max_normal x
  scale), so the scale is 2^k, not 2^(k+1), and the block's largest element is max_normal itself; one ulp
  more needs the next scale."""
  for amax, want_exp, want_elem in ((max_normal * 2.0 ** k, k, max_normal),
                                    (float(np.nextafter(np.float32(max_normal * 2.0 ** k), np.float32(np.inf))),
                                     k + 1, None)):
    x = np.zeros(32, np.float32)
    x[3], x[7] = amax, -amax / 4
    elems, scales = mx.quantize(x, elem_dtype=elem, scale_mode="rceil")
    exp = int(np.asarray(jax.lax.bitcast_convert_type(scales, jnp.uint8))[0]) - 127
    assert exp == want_exp, (amax, exp)
    if want_elem is not None:
      values = np.asarray(elems.astype(jnp.float32))
      assert values[3] == want_elem and values[7] == -want_elem / 4


def test_edge_cases_one_by_one():
  e4 = jnp.float8_e4m3fn
  def q(vals, mode="floor"):
    x = np.zeros(32, np.float32)
    x[:len(vals)] = vals
    elems, scales = mx.quantize(x, elem_dtype=e4, scale_mode=mode)
    return (np.asarray(elems.astype(jnp.float32))[:len(vals)],
            int(np.asarray(jax.lax.bitcast_convert_type(scales, jnp.uint8))[0]))
  assert q([0.0]) == (pytest.approx([0.0]), 0)                       # all-zero block: scale 2^-127
  elems, sbits = q([1.0])
  assert sbits == 127 - 8 and elems[0] == 256.0                      # floor: amax lands in [256, 512)
  elems, sbits = q([1.0], "rceil")
  assert sbits == 127 - 8 and elems[0] == 256.0                      # 1 <= 448 * 2^-8
  elems, sbits = q([1.9], "rceil")
  assert sbits == 127 - 7 and elems[0] == pytest.approx(1.9 * 128, rel=2 ** -4)   # 1.9 > 1.75: round up
  elems, sbits = q([1.9, 1.0])
  assert sbits == 127 - 8 and elems[0] == 448.0 and elems[1] == 256.0  # 486.4 saturates to 448
  elems, sbits = q([1.0, 2.0 ** -20])
  assert elems[1] == 0.0                                             # far below the block's range
  elems, sbits = q([1.0, 2.0 ** -17])
  assert elems[1] == 2.0 ** -9                                       # the smallest E4M3 subnormal
  elems, sbits = q([1.0, np.nan])
  assert sbits == 0xFF and np.isnan(elems).all()
  elems, sbits = q([1.0, -np.inf])
  assert sbits == 0xFF and np.isnan(elems).all()


def test_partial_block_and_axis():
  rng = np.random.default_rng(3)
  x = rng.standard_normal((5, 70)).astype(np.float32) * 2.0 ** rng.integers(-8, 8, (5, 70))
  elems, scales = mx.quantize(x, axis=1)
  assert elems.shape == (5, 70) and scales.shape == (5, 3)
  # The padded tail block equals quantizing the same 6 values zero-padded to a full block.
  tail = np.zeros((5, 32), np.float32)
  tail[:, :6] = x[:, 64:]
  e_tail, s_tail = mx.quantize(tail, axis=1)
  np.testing.assert_array_equal(np.asarray(elems[:, 64:].astype(jnp.float32)),
                                np.asarray(e_tail[:, :6].astype(jnp.float32)))
  np.testing.assert_array_equal(np.asarray(scales[:, 2:].astype(jnp.float32)), np.asarray(s_tail.astype(jnp.float32)))
  # axis=0 is axis=-1 of the transpose.
  e0, s0 = mx.quantize(x.T, axis=0)
  np.testing.assert_array_equal(np.asarray(e0.astype(jnp.float32)).T, np.asarray(elems.astype(jnp.float32)))
  np.testing.assert_array_equal(np.asarray(s0.astype(jnp.float32)).T, np.asarray(scales.astype(jnp.float32)))
  back = mx.dequantize(e0, s0, axis=0)
  assert back.shape == x.T.shape
  # Half an element ulp relative (or up to 1/8 where floor mode saturates (448, 512) to 448), or half
  # the smallest subnormal step (2^-10 at amax >= 2^8) absolute.
  err = np.abs(np.asarray(back).T - x)
  amax = np.abs(x).max()
  assert np.all(err <= 2 ** -3 * np.abs(x) + amax * 2.0 ** -18), err.max()
  e_r, s_r = mx.quantize(x, axis=1, scale_mode="rceil")
  err = np.abs(np.asarray(mx.dequantize(e_r, s_r, axis=1)) - x)
  assert np.all(err <= 2 ** -4 * np.abs(x) + amax * 2.0 ** -17), err.max()


def test_bad_inputs_are_named():
  x = jnp.ones((4, 64))
  with pytest.raises(ValueError, match="element dtype"):
    mx.quantize(x, elem_dtype=jnp.bfloat16)
  with pytest.raises(ValueError, match="scale_mode"):
    mx.quantize(x, scale_mode="ceil")
  with pytest.raises(ValueError, match="axis 2"):
    mx.quantize(x, axis=2)
  with pytest.raises(ValueError, match="floating"):
    mx.quantize(jnp.ones((4, 64), jnp.int32))
  elems, scales = mx.quantize(x)
  with pytest.raises(ValueError, match="need scales of shape"):
    mx.dequantize(elems, scales[:, :1])
  with pytest.raises(ValueError, match="float8_e8m0fnu"):
    mx.dequantize(elems, scales.astype(jnp.float32))


def test_bfloat16_input_is_exact_widening():
  x = jnp.asarray(np.random.default_rng(0).standard_normal((3, 64)), jnp.bfloat16)
  a = mx.quantize(x)
  b = mx.quantize(x.astype(jnp.float32))
  for u, v in zip(a, b):
    np.testing.assert_array_equal(np.asarray(u.astype(jnp.float32)), np.asarray(v.astype(jnp.float32)))


def test_an_empty_batch_quantizes_to_empty_blocks():
  """A count-only trace (observe/flops.py) runs the model on zero rows: quantizing M = 0 along K must give
  0 x K elements and 0 x K/32 scales, not a reshape error."""
  x = jnp.zeros((0, 70), jnp.float32)
  elems, scales = mx.quantize(x, axis=1)
  assert elems.shape == (0, 70) and scales.shape == (0, 3)
  assert mx.dequantize(elems, scales, axis=1).shape == (0, 70)
  elems, scales = mx.quantize(x, axis=0)
  assert elems.shape == (0, 70) and scales.shape == (0, 70)
