"""gem_jax.precision.fp8: the custom-VJP FP8 matmul against its emulated reference and against float32.

The float32 bound is derived from the formats, element by element: RNE to p mantissa bits is off by at
most 2^-(p+1) relative, a value in the subnormal range by half the smallest subnormal step (times the
scale), floor-mode MX saturation by the amount above max_normal * 2^scale; a dot then errs by at most
sum_k |a| e_b + |b| e_a + e_a e_b, plus float32 accumulation (K * 2^-23 sum |a||b|).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from gem_jax.precision import fp8

HIGHEST = jax.lax.Precision.HIGHEST
ALL = sorted(fp8.RECIPES)
# dtype -> (mantissa bits, min normal exponent, emax, max normal)
FMT = {jnp.dtype(jnp.float8_e4m3fn): (3, -6, 8, 448.0), jnp.dtype(jnp.float8_e5m2): (2, -14, 15, 57344.0)}


def operands(m=48, k=96, n=40, seed=0):
  rng = np.random.default_rng(seed)
  x = (rng.standard_normal((m, k)) * 2.0 ** rng.integers(-3, 3, (m, 1))).astype(np.float32)
  w = (rng.standard_normal((k, n)) * 0.1).astype(np.float32)
  g = (rng.standard_normal((m, n)) * 2.0 ** rng.integers(-4, 4, (1, n))).astype(np.float32)
  return jnp.asarray(x), jnp.asarray(w), jnp.asarray(g)


def vjp(x, w, g, recipe, impl="emulate"):
  y, pullback = jax.vjp(lambda a, b: fp8.matmul(a, b, recipe, impl), x, w)
  return (y,) + pullback(g)


def reference(x, w, g, recipe):
  """The emulation written out: each GEMM's operands quantized along that GEMM's contraction dim."""
  qdq = fp8.quantize_dequantize
  dot = lambda a, b: jnp.dot(a, b, precision=HIGHEST, preferred_element_type=jnp.float32)
  y = dot(qdq(x, 1, recipe), qdq(w, 0, recipe))
  dx = dot(qdq(g, 1, recipe, "grad"), qdq(w, 1, recipe).T)
  dw = dot(qdq(x, 0, recipe).T, qdq(g, 0, recipe, "grad"))
  return y, dx, dw


@pytest.mark.parametrize("recipe", ALL)
def test_forward_and_gradients_equal_the_emulated_reference_exactly(recipe):
  x, w, g = operands()
  got = jax.jit(lambda *a: vjp(*a, recipe))(x, w, g)
  want = jax.jit(lambda *a: reference(*a, recipe))(x, w, g)
  for name, a, b in zip(("y", "dx", "dw"), got, want):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b), err_msg=f"{recipe} {name}")


def error_bound(x, axis, recipe: fp8.Recipe, role):
  """Per element bound on |Q(x) - x| for quantization along `axis` (numpy, from the format alone)."""
  x = np.asarray(x, np.float64)
  ax = np.abs(x)
  if recipe.kind == "bf16":
    return ax * 2.0 ** -8
  mbits, emin, emax, max_normal = FMT[recipe.elem_dtype(role)]
  u = 2.0 ** -(mbits + 1)
  if recipe.kind == "mx":
    xm = np.moveaxis(ax, axis, -1)
    n = xm.shape[-1]
    nb = -(-n // 32)
    pad = np.zeros(xm.shape[:-1] + (nb * 32 - n,))
    amax = np.concatenate([xm, pad], -1).reshape(xm.shape[:-1] + (nb, 32)).max(-1)
    _, e = np.frexp(np.where(amax > 0, amax, 1.0))
    s = (e - 1) - emax
    if recipe.scale_mode == "rceil":
      s = s + (amax > max_normal * 2.0 ** s)
    s = np.clip(s, -127, 127)
    scale = np.moveaxis(np.repeat(2.0 ** s, 32, axis=-1)[..., :n], -1, axis)
    sat = np.maximum(ax - max_normal * scale, 0.0)
  else:
    red = (axis,) if recipe.kind == "rowwise" else None
    scale = np.max(ax, axis=red, keepdims=True) / max_normal
    sat = 0.0
    u += 2.0 ** -22  # the float32 division and product around the cast
  return np.maximum(u * ax + 2.0 ** (emin - mbits - 1) * scale, sat)


def gemm_bound(a, ea, b, eb):
  a, b = np.abs(np.asarray(a, np.float64)), np.abs(np.asarray(b, np.float64))
  k = a.shape[1]
  return a @ eb + ea @ b + ea @ eb + k * 2.0 ** -23 * (a @ b)


@pytest.mark.parametrize("recipe", ALL)
def test_gradients_within_the_format_bound_of_float32(recipe):
  r = fp8.get_recipe(recipe)
  x, w, g = operands(seed=1)
  y, dx, dw = jax.jit(lambda *a: vjp(*a, recipe))(x, w, g)
  exact = lambda a, b: np.asarray(a, np.float64) @ np.asarray(b, np.float64)
  bounds = {
      "y": gemm_bound(x, error_bound(x, 1, r, "fwd"), w, error_bound(w, 0, r, "fwd")),
      "dx": gemm_bound(g, error_bound(g, 1, r, "grad"), w.T, error_bound(w, 1, r, "fwd").T),
      "dw": gemm_bound(x.T, error_bound(x, 0, r, "fwd").T, g, error_bound(g, 0, r, "grad")),
  }
  for name, got, want in (("y", y, exact(x, w)), ("dx", dx, exact(g, w.T)), ("dw", dw, exact(x.T, g))):
    err = np.abs(np.asarray(got, np.float64) - want)
    assert np.all(err <= bounds[name]), (recipe, name, float((err / bounds[name]).max()))
    # The bound is not vacuous: the error is a real fraction of it somewhere, and tiny next to |y|.
    assert (err / np.maximum(bounds[name], 1e-30)).max() > 1e-3, (recipe, name)


def test_backward_quantizes_along_each_gemms_contraction_axis():
  """g's rows (M) span 2^-20..2^20 and its columns (N) too, in separate matrices: quantizing g along N
  is what dx needs and keeps every row; along M (the wrong axis for dx) small rows would collapse to
  zero. The same holds for dw with the roles of the axes swapped."""
  rng = np.random.default_rng(5)
  m, k, n = 64, 64, 64
  x = jnp.asarray(rng.standard_normal((m, k)), jnp.float32)
  w = jnp.asarray(rng.standard_normal((k, n)) * 0.1, jnp.float32)
  rows = jnp.asarray(rng.standard_normal((m, n)) * 2.0 ** rng.integers(-20, 20, (m, 1)), jnp.float32)
  cols = jnp.asarray(rng.standard_normal((m, n)) * 2.0 ** rng.integers(-20, 20, (1, n)), jnp.float32)
  qdq = fp8.quantize_dequantize
  # Worst row's relative error norm: a row that collapses to zero scores 1.
  rel = lambda a, b: float(jnp.max(jnp.linalg.norm(a - b, axis=1) / jnp.linalg.norm(b, axis=1)))
  for recipe in ("mxfp8", "rowwise"):
    _, dx, _ = vjp(x, w, rows, recipe)
    exact_dx = rows @ w.T
    right = jnp.dot(qdq(rows, 1, recipe, "grad"), qdq(w, 1, recipe).T, precision=HIGHEST)
    wrong = jnp.dot(qdq(rows, 0, recipe, "grad"), qdq(w, 1, recipe).T, precision=HIGHEST)
    np.testing.assert_array_equal(np.asarray(dx), np.asarray(right))
    assert rel(dx, exact_dx) < 0.2 < rel(wrong, exact_dx), (recipe, rel(dx, exact_dx), rel(wrong, exact_dx))
    _, _, dw = vjp(x, w, cols, recipe)
    exact_dw = (x.T @ cols).T
    right = jnp.dot(qdq(x, 0, recipe).T, qdq(cols, 0, recipe, "grad"), precision=HIGHEST)
    wrong = jnp.dot(qdq(x, 0, recipe).T, qdq(cols, 1, recipe, "grad"), precision=HIGHEST)
    np.testing.assert_array_equal(np.asarray(dw), np.asarray(right))
    assert rel(dw.T, exact_dw) < 0.2 < rel(wrong.T, exact_dw), (recipe, rel(dw.T, exact_dw), rel(wrong.T, exact_dw))


def test_residuals_saved_for_backward_are_fp8():
  x, w, _ = operands()
  saved = lambda recipe: jax.eval_shape(lambda x, w: fp8._matmul_fwd(x, w, recipe, "emulate", False)[1], x, w)
  for recipe, dt in (("mxfp8", jnp.float8_e4m3fn), ("rowwise", jnp.float8_e4m3fn), ("bf16", jnp.bfloat16)):
    x_along_m, w_along_n, _ = saved(recipe)
    assert x_along_m[0].dtype == dt and w_along_n[0].dtype == dt, recipe
    if recipe == "mxfp8":  # saved along the backward contraction axes: x blocked along M (rows), w along N
      assert x_along_m[1].shape == (2, 96) and w_along_n[1].shape == (96, 2)


@pytest.mark.parametrize("recipe", ["bf16", "rowwise", "tensorwise"])
def test_native_xla_path_matches_emulation(recipe):
  x, w, g = operands(seed=2)
  a = jax.jit(lambda *v: vjp(*v, recipe, "xla"))(x, w, g)
  b = jax.jit(lambda *v: vjp(*v, recipe, "emulate"))(x, w, g)
  for u, v in zip(a, b):
    scale = float(jnp.max(jnp.abs(v)))
    np.testing.assert_allclose(np.asarray(u), np.asarray(v), atol=scale * 96 * 2.0 ** -22)


def test_native_mx_without_mx_hardware_raises():
  x, w, _ = operands()
  with pytest.raises(NotImplementedError, match="MX tensor cores"):
    fp8.matmul(x, w, "mxfp8", "xla")


def test_dot_general_layouts():
  rng = np.random.default_rng(4)
  lhs = jnp.asarray(rng.standard_normal((3, 40, 5)), jnp.float32)   # contract dim 1
  rhs = jnp.asarray(rng.standard_normal((7, 40)), jnp.float32)      # contract dim 1
  got = jax.jit(lambda a, b: fp8.dot_general(a, b, (((1,), (1,)), ((), ())), recipe="mxfp8"))(lhs, rhs)
  want = jax.jit(lambda a, b: fp8.matmul(jnp.moveaxis(a, 1, -1).reshape(15, 40), b.T, "mxfp8"))(lhs, rhs)
  assert got.shape == (3, 5, 7)
  np.testing.assert_array_equal(np.asarray(got), np.asarray(want).reshape(3, 5, 7))
  # Gradients flow back through the layout changes.
  dl, dr = jax.eval_shape(jax.grad(lambda a, b: jnp.sum(fp8.dot_general(a, b, (((1,), (1,)), ((), ())))), (0, 1)),
                          lhs, rhs)
  assert dl.shape == lhs.shape and dr.shape == rhs.shape
  with pytest.raises(NotImplementedError, match="batch dims"):
    fp8.dot_general(lhs, lhs, (((1,), (1,)), ((0,), (0,))))


def test_non_finite_values_stay_non_finite_and_local():
  x, w, _ = operands()
  x = x.at[3, 70].set(jnp.nan)
  for recipe in ("mxfp8", "rowwise", "bf16"):
    y = np.asarray(fp8.matmul(x, w, recipe))
    assert np.isnan(y[3]).all(), recipe
    assert np.isfinite(np.delete(y, 3, axis=0)).all(), recipe
  y = np.asarray(fp8.matmul(x, w, "tensorwise"))
  assert np.isnan(y).all()   # one scale for the whole tensor


@pytest.mark.parametrize("role", ["fwd", "grad"])
def test_a_finite_row_of_tiny_values_stays_finite(role):
  """amax 1e-37 (a zero row but one entry): amax / 448 is subnormal, which XLA:CPU flushes to 0, and the
  row's zeros became 0/0 = NaN; the scale is kept at float32's smallest normal."""
  x = jnp.zeros((2, 64)).at[1, 0].set(1e-37).at[0].set(1.0)
  for recipe in ("rowwise", "tensorwise", "mxfp8"):
    y = np.asarray(jax.jit(lambda x, r=recipe: fp8.quantize_dequantize(x, 1, r, role))(x))
    assert np.isfinite(y).all() and (y[1, 1:] == 0).all(), recipe


def test_bad_arguments():
  x, w, _ = operands()
  with pytest.raises(ValueError, match="unknown FP8 recipe 'fp4'"):
    fp8.matmul(x, w, "fp4")
  with pytest.raises(ValueError, match="unknown FP8 impl"):
    fp8.matmul(x, w, "mxfp8", "cuda")
  with pytest.raises(ValueError, match="M x K and K x N"):
    fp8.matmul(x, w.T, "mxfp8")


@pytest.mark.parametrize("recipe", ["mxfp8_e5m2", "rowwise"])
def test_pallas_impl_runs_all_three_gemms_like_the_emulation(recipe):
  """impl="pallas" (interpret mode on CPU) in the forward and both backward GEMMs agrees with the
  emulation up to float32 summation order."""
  x, w, g = operands(m=40, k=72, n=24, seed=6)
  got = jax.jit(lambda *v: vjp(*v, recipe, "pallas"))(x, w, g)
  want = jax.jit(lambda *v: vjp(*v, recipe, "emulate"))(x, w, g)
  for name, a, b in zip(("y", "dx", "dw"), got, want):
    scale = float(jnp.max(jnp.abs(b)))
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=scale * 100 * 2.0 ** -22, err_msg=name)


@pytest.mark.parametrize("recipe", ["bf16", "rowwise", "mxfp8"])
def test_gradients_inside_shard_map_sum_over_the_axes_an_operand_was_broadcast_on(recipe):
  """In the SPMD step a batch activation (varying over the data axis only) meets a weight marked varying
  over every axis; the forward broadcasts the activation, so its gradient must be summed over the other
  axis (before the fix the custom VJP's cotangent had the weight's axes and JAX refused it). Each data
  shard quantizes its own rows, so the sharded gradients are the per-shard one-device gradients: dx shard by
  shard, dw summed over the shards (data-parallel FP8 quantizes dw's contraction over the local batch)."""
  from jax.sharding import PartitionSpec as P
  x, w, _ = operands(m=64, k=64, n=32)
  mesh = jax.sharding.Mesh(np.array(jax.devices()[:8]).reshape(2, 4), ("data", "model"))

  def local_loss(x_blk, w):
    w = jax.lax.pcast(w, ("data", "model"), to="varying")
    y = fp8.matmul(x_blk, w, recipe)
    # Each data shard's sum once: the model-axis devices hold copies.
    return jax.lax.psum(jnp.sum(y * y), ("data", "model")) / 4

  sharded = jax.shard_map(local_loss, mesh=mesh, in_specs=(P("data"), P()), out_specs=P())
  got_dx, got_dw = jax.jit(jax.grad(sharded, argnums=(0, 1)))(x, w)
  one = jax.jit(jax.grad(lambda x, w: jnp.sum(fp8.matmul(x, w, recipe) ** 2), argnums=(0, 1)))
  per_shard = [one(x_s, w) for x_s in jnp.split(x, 2)]
  want_dx = jnp.concatenate([dx for dx, _ in per_shard])
  want_dw = per_shard[0][1] + per_shard[1][1]
  for name, a, b in (("dx", got_dx, want_dx), ("dw", got_dw, want_dw)):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-5 * float(jnp.max(jnp.abs(b))),
                               err_msg=name)
