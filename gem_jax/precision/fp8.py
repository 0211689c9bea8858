"""FP8 matmuls for training: a dot_general with its own VJP, one recipe per call site.

  dot_general(lhs, rhs, dimension_numbers, recipe="mxfp8", impl="auto") -> float32

Recipes (RECIPES) say how each of the three GEMMs of a training step is quantized. With y = x @ w
(x: M x K, w: K x N, g = dL/dy: M x N):

  forward   y  = Q(x along K) @ Q(w along K)
  backward  dx = Q(g along N) @ Q(w along N)^T
            dw = Q(x along M)^T @ Q(g along M)

Every operand is quantized from high precision along the contraction dim of the GEMM that consumes it;
blocks made along one axis are never reused along another (for MX the blocks of x along K say nothing
about its columns). x along M and w along N are quantized in the forward pass and saved as the
residuals, so the activations kept for backward are FP8 (elems + scales) instead of float32: the
values are the same as quantizing in the backward pass, the memory is ~4x smaller.

  "bf16"        operands and gradients rounded to bfloat16, float32 accumulation (the baseline).
  "mxfp8"       OCP MXFP8 (pallas_kernels/mx.py): E4M3 elements for activations, weights and
                gradients, E8M0 scale per 32 values, floor scales (the spec's rule).
  "mxfp8_rceil" the same with round-up scales (cuBLAS / torchao): no saturation, one binade less range.
  "mxfp8_e5m2"  MXFP8 with E5M2 gradients.
  "rowwise"     one float32 scale per row of the operand along the contraction dim (amax / max normal),
                E4M3 forward, E5M2 gradients: the Hopper recipe (scales factor out of the sum, so the
                FP8 tensor cores apply them in the epilogue).
  "tensorwise"  one float32 scale per tensor, E4M3 forward, E5M2 gradients (the classic FP8 recipe of
                Micikevicius et al., 2022, "FP8 Formats for Deep Learning").

Implementations (`impl`): "emulate" (dequantize, one float32 dot at HIGHEST precision: the CPU path
and the numerical reference), "xla" (native: float8 x float8 dot_general with float32 accumulation
for row/tensor-wise, which XLA lowers to cuBLASLt FP8 on Hopper; jax.nn.scaled_matmul for MX, cuDNN on
Blackwell only), "pallas" and "triton" (pallas_kernels/fp8_gemm). "auto" is emulate on CPU and an FP8
tensor-core GEMM on GPU: native for row/tensor-wise and for MX on Blackwell, the Pallas MX kernel (one FP8
dot per 32-block, promoted to float32 with its scales) on Hopper, which has no MX tensor cores. "GPU" is
the platform of the program being built (gem_jax/runtime.py), not the host's backend.

Non-finite inputs stay non-finite: a NaN or Inf in a block (MX), row (row-wise) or tensor makes its
scale NaN and every value it scales NaN. Nothing is clamped except the format's saturation.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp

from gem_jax import runtime
from pallas_kernels import mx
from pallas_kernels import vma

E4M3, E5M2 = jnp.dtype(jnp.float8_e4m3fn), jnp.dtype(jnp.float8_e5m2)
MAX_NORMAL = {E4M3: 448.0, E5M2: 57344.0}


@dataclasses.dataclass(frozen=True)
class Recipe:
  name: str
  kind: str                 # "bf16" | "mx" | "rowwise" | "tensorwise"
  fwd_dtype: jnp.dtype      # elements of x and w
  grad_dtype: jnp.dtype     # elements of g
  scale_mode: str = "floor"  # MX only

  def elem_dtype(self, role: str):
    return self.grad_dtype if role == "grad" else self.fwd_dtype


RECIPES = {r.name: r for r in (
    Recipe("bf16", "bf16", jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.bfloat16)),
    Recipe("mxfp8", "mx", E4M3, E4M3, "floor"),
    Recipe("mxfp8_rceil", "mx", E4M3, E4M3, "rceil"),
    Recipe("mxfp8_e5m2", "mx", E4M3, E5M2, "floor"),
    Recipe("rowwise", "rowwise", E4M3, E5M2),
    Recipe("tensorwise", "tensorwise", E4M3, E5M2),
)}
IMPLS = ("auto", "emulate", "xla", "pallas", "triton")


def get_recipe(name: str) -> Recipe:
  if name not in RECIPES:
    raise ValueError(f"unknown FP8 recipe {name!r}; known: {sorted(RECIPES)}")
  return RECIPES[name]


# --- quantized operands -------------------------------------------------------------------------------
# A quantized 2-D operand is (elems, scales): MX scales are E8M0 with the quantized axis cut to blocks;
# row/tensor-wise scales are float32 with the quantized axis (or both axes) of size 1; bf16 has no scales
# (an empty float32 array, so the pair is always two arrays).

def quantize(x, axis: int, recipe: Recipe, role: str = "fwd"):
  """x (2-D, any float dtype) quantized along `axis` for `role` ("fwd" operands or "grad")."""
  dt = recipe.elem_dtype(role)
  x = x.astype(jnp.float32)
  if recipe.kind == "bf16":
    return x.astype(jnp.bfloat16), jnp.zeros((0,), jnp.float32)
  if recipe.kind == "mx":
    return mx.quantize(x, axis=axis, elem_dtype=dt, scale_mode=recipe.scale_mode)
  reduce_axes = (axis,) if recipe.kind == "rowwise" else tuple(range(x.ndim))
  finite = jnp.isfinite(x)
  # NaN/Inf are tested explicitly: XLA:CPU's vectorized max reductions may drop a NaN.
  all_finite = jnp.all(finite, axis=reduce_axes, keepdims=True)
  amax = jnp.max(jnp.where(finite, jnp.abs(x), 0.0), axis=reduce_axes, keepdims=True)
  # A zero row keeps scale 1 (any scale gives zeros); NaN/Inf make the scale NaN, hence all NaN. The scale is
  # kept at float32's smallest normal or above: a row whose amax is under MAX_NORMAL x that (5e-36 for E4M3)
  # would get a subnormal scale, which XLA:CPU flushes to 0 (0/0: NaN for a finite row).
  scale = jnp.where(amax == 0, 1.0, jnp.maximum(amax / MAX_NORMAL[dt], jnp.finfo(jnp.float32).tiny))
  scale = jnp.where(all_finite, scale, jnp.nan)
  max_normal = MAX_NORMAL[dt]
  elems = jnp.clip(x / scale, -max_normal, max_normal).astype(dt)
  return elems, scale


def dequantize(q, axis: int, recipe: Recipe):
  elems, scales = q
  if recipe.kind == "bf16":
    return elems.astype(jnp.float32)
  if recipe.kind == "mx":
    return mx.dequantize(elems, scales, axis=axis)
  return elems.astype(jnp.float32) * scales


def quantize_dequantize(x, axis: int, recipe: Recipe | str, role: str = "fwd"):
  """x at the recipe's precision along `axis`, in float32 (what the emulation multiplies)."""
  recipe = get_recipe(recipe) if isinstance(recipe, str) else recipe
  return dequantize(quantize(x, axis, recipe, role), axis, recipe)


def _transpose(q, recipe: Recipe):
  elems, scales = q
  return elems.T, (scales if recipe.kind == "bf16" else scales.T)


# --- the GEMM on canonical operands: a (M x K, quantized along K) @ b (K x N, quantized along K) --------

def _on_gpu() -> bool:
  """The program being built is for a GPU (the step's target, gem_jax/runtime.py; not the host's backend)."""
  return runtime.platform() == "gpu"


def _has_native_mx() -> bool:
  """Blackwell (compute capability >= 10) has MX tensor cores; Hopper does not."""
  if not _on_gpu():
    return False
  target = runtime.compute_target()
  if target is not None:
    return target.has_mx_tensor_cores
  cc = getattr(jax.devices()[0], "compute_capability", "0")  # a live GPU, outside a step
  return float(cc) >= 10.0


def resolve_impl(impl: str, recipe: Recipe) -> str:
  if impl not in IMPLS:
    raise ValueError(f"unknown FP8 impl {impl!r}; known: {IMPLS}")
  if impl != "auto":
    return impl
  if not _on_gpu():
    return "emulate"
  if recipe.kind == "mx" and not _has_native_mx():
    return "pallas"
  return "xla"


def _emulate(a, b, recipe: Recipe):
  a_MxK, b_KxN = dequantize(a, 1, recipe), dequantize(b, 0, recipe)
  return jnp.dot(a_MxK, b_KxN, precision=jax.lax.Precision.HIGHEST, preferred_element_type=jnp.float32)


def _native(a, b, recipe: Recipe):
  (ae, asc), (be, bsc) = a, b
  if recipe.kind == "mx":
    if not _has_native_mx():
      raise NotImplementedError("impl='xla' for MX recipes needs MX tensor cores (jax.nn.scaled_matmul on "
                                "Blackwell); use impl='emulate', 'pallas' or 'triton' here")
    out = jax.nn.scaled_matmul(ae[None], be.T[None], asc[None], bsc.T[None],
                               preferred_element_type=jnp.float32)[0]
    return out
  out = jax.lax.dot_general(ae, be, (((1,), (0,)), ((), ())), preferred_element_type=jnp.float32)
  return out if recipe.kind == "bf16" else out * asc * bsc


def _kernel(a, b, recipe: Recipe, impl: str, on_gpu: bool):
  (ae, asc), (be, bsc) = a, b
  if recipe.kind == "bf16":
    return _native(a, b, recipe)
  if impl == "pallas":
    from pallas_kernels.fp8_gemm import pallas as kernels
    interpret = not on_gpu
  else:
    from pallas_kernels.fp8_gemm import triton as kernels
    interpret = None
  kw = {} if interpret is None else {"interpret": interpret}
  if recipe.kind == "mx":
    return kernels.mx_gemm(ae, asc, be, bsc, **kw)
  return kernels.scaled_gemm(ae, jnp.broadcast_to(asc, (ae.shape[0], 1)), be,
                             jnp.broadcast_to(bsc, (1, be.shape[1])), **kw)


def gemm(a, b, recipe: Recipe, impl: str, on_gpu: bool | None = None):
  """float32 (M x N) = a @ b for quantized a (M x K along K) and b (K x N along K). on_gpu: whether the
  program is built for a GPU (default: the current platform, gem_jax/runtime.py)."""
  on_gpu = _on_gpu() if on_gpu is None else on_gpu
  impl = resolve_impl(impl, recipe)
  if impl == "emulate":
    return _emulate(a, b, recipe)
  if impl == "xla":
    return _native(a, b, recipe)
  return _kernel(a, b, recipe, impl, on_gpu)


# --- the custom-VJP matmul --------------------------------------------------------------------------------

# `impl` arrives resolved and `on_gpu` decided in the forward: the backward is traced when the gradient is
# transposed, after the step's runtime (and its target) has been uninstalled.
@functools.partial(jax.custom_vjp, nondiff_argnums=(2, 3, 4))
def _matmul(x_MxK, w_KxN, recipe_name: str, impl: str, on_gpu: bool):
  recipe = get_recipe(recipe_name)
  return gemm(quantize(x_MxK, 1, recipe), quantize(w_KxN, 0, recipe), recipe, impl, on_gpu)


def _matmul_fwd(x_MxK, w_KxN, recipe_name, impl, on_gpu):
  recipe = get_recipe(recipe_name)
  y_MxN = gemm(quantize(x_MxK, 1, recipe), quantize(w_KxN, 0, recipe), recipe, impl, on_gpu)
  # Residuals for backward, already quantized along the axis their backward GEMM contracts.
  x_along_m = quantize(x_MxK, 0, recipe)
  w_along_n = quantize(w_KxN, 1, recipe)
  dtypes = (jnp.zeros((0,), x_MxK.dtype), jnp.zeros((0,), w_KxN.dtype))
  return y_MxN, (x_along_m, w_along_n, dtypes)


def _matmul_bwd(recipe_name, impl, on_gpu, residuals, g_MxN):
  recipe = get_recipe(recipe_name)
  x_along_m, w_along_n, (x_dt, w_dt) = residuals
  dx_MxK = gemm(quantize(g_MxN, 1, recipe, "grad"), _transpose(w_along_n, recipe), recipe, impl, on_gpu)
  dw_KxN = gemm(_transpose(x_along_m, recipe), quantize(g_MxN, 0, recipe, "grad"), recipe, impl, on_gpu)
  # Under shard_map an operand that varies over fewer mesh axes than the other (a batch activation
  # against a weight that is varying everywhere) was broadcast in the forward; its cotangent is the sum
  # over those axes. The residuals carry each operand's own axes.
  dx_MxK = vma.sum_to(dx_MxK, x_along_m[0])
  dw_KxN = vma.sum_to(dw_KxN, w_along_n[0])
  return dx_MxK.astype(x_dt.dtype), dw_KxN.astype(w_dt.dtype)


_matmul.defvjp(_matmul_fwd, _matmul_bwd)


def matmul(x_MxK, w_KxN, recipe: str = "mxfp8", impl: str = "auto"):
  """float32 x @ w under `recipe` for 2-D operands (forward and both gradients quantized)."""
  if x_MxK.ndim != 2 or w_KxN.ndim != 2 or x_MxK.shape[1] != w_KxN.shape[0]:
    raise ValueError(f"fp8.matmul needs M x K and K x N operands, got {x_MxK.shape} and {w_KxN.shape}")
  return _matmul(x_MxK, w_KxN, recipe, resolve_impl(impl, get_recipe(recipe)), _on_gpu())


def dot_general(lhs, rhs, dimension_numbers, *, recipe: str = "mxfp8", impl: str = "auto",
                preferred_element_type=jnp.float32, precision=None):
  """lax.dot_general with one contracting dim per side and no batch dims, under an FP8 recipe.

  The operands are brought to the canonical M x K @ K x N (moving the contracting dims and flattening
  the free ones), so the result has lax.dot_general's layout: lhs free dims, then rhs free dims.
  `precision` is accepted for drop-in use and ignored (the recipe fixes the precision).
  """
  del precision
  (lc, rc), (lb, rb) = dimension_numbers
  if lb or rb:
    raise NotImplementedError(f"fp8.dot_general: batch dims are not supported, got {dimension_numbers}")
  if len(lc) != 1 or len(rc) != 1:
    raise NotImplementedError(f"fp8.dot_general needs exactly one contracting dim per side, got {lc}, {rc}")
  lc, rc = lc[0] % lhs.ndim, rc[0] % rhs.ndim
  if lhs.shape[lc] != rhs.shape[rc]:
    raise ValueError(f"fp8.dot_general: contracting dims differ: lhs {lhs.shape}[{lc}] vs rhs {rhs.shape}[{rc}]")
  k = lhs.shape[lc]
  lhs_MxK = jnp.moveaxis(lhs, lc, -1)
  lhs_free = lhs_MxK.shape[:-1]
  rhs_KxN = jnp.moveaxis(rhs, rc, 0)
  rhs_free = rhs_KxN.shape[1:]
  out = matmul(lhs_MxK.reshape(-1, k), rhs_KxN.reshape(k, -1), recipe, impl)
  return out.reshape(lhs_free + rhs_free).astype(preferred_element_type or jnp.float32)
