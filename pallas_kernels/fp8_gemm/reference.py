"""The spec of the scaled FP8 GEMMs: dequantize both operands to float32, one float32 dot.

Canonical layout (gem_jax/precision/fp8.py brings every GEMM to it): lhs A is M x K and rhs B is K x N,
both quantized along K, the contraction dim.

  MX (block-scaled)  A: elems M x K (float8), scales M x Kb (float8_e8m0fnu, Kb = ceil(K / 32))
                     B: elems K x N,          scales Kb x N
  row-wise           A: elems M x K, scale M x 1 (float32, one per row of A)
                     B: elems K x N, scale 1 x N (float32, one per column of B)
  tensor-wise        the same with 1 x 1 scales.

Every kernel in this folder computes C = dequant(A) @ dequant(B) in float32 (M x N) and is tested
against these functions. Row-wise scales factor out of the sum, so a kernel may apply them to the
float32 accumulator instead (C = (A_e @ B_e) * sa * sb): equal up to float32 rounding.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from pallas_kernels import mx


def mx_gemm(a_elems_MxK, a_scales_MxKb, b_elems_KxN, b_scales_KbxN, block_size: int = mx.BLOCK_SIZE):
  a_MxK = mx.dequantize(a_elems_MxK, a_scales_MxKb, axis=1, block_size=block_size)
  b_KxN = mx.dequantize(b_elems_KxN, b_scales_KbxN, axis=0, block_size=block_size)
  return jnp.dot(a_MxK, b_KxN, precision=jax.lax.Precision.HIGHEST, preferred_element_type=jnp.float32)


def scaled_gemm(a_elems_MxK, a_scale_Mx1, b_elems_KxN, b_scale_1xN):
  """Row-wise (M x 1 and 1 x N scales) or tensor-wise (1 x 1) scaled FP8 GEMM."""
  a_MxK = a_elems_MxK.astype(jnp.float32) * a_scale_Mx1.astype(jnp.float32)
  b_KxN = b_elems_KxN.astype(jnp.float32) * b_scale_1xN.astype(jnp.float32)
  return jnp.dot(a_MxK, b_KxN, precision=jax.lax.Precision.HIGHEST, preferred_element_type=jnp.float32)
