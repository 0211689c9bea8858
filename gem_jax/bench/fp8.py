"""FP8 benchmarks: bf16 vs row-wise FP8 vs MXFP8 GEMMs, every implementation side by side, and the train step.

  gemm    the forward GEMM alone on pre-quantized operands (what the tensor cores see): TFLOP/s per impl,
          each result checked against the emulated reference (max |got - ref| / max |ref|)
  train   fp8.matmul forward + both backward GEMMs, quantization included (what a Dense site costs)
  step    the train step of a config under several precision policies
  check   one GEMM against the emulation under the float32 summation bound (the GPU check's correctness)

On CPU every FP8 recipe is emulated (no FP8 units): CPU numbers measure the emulation's overhead, not FP8
speed; the Pallas and Triton kernels run only on GPU (Pallas also in interpret mode, for checks).
Letters: M x K @ K x N.
"""

from __future__ import annotations

import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np

from gem_jax.bench.timing import median_ms
from gem_jax.precision import fp8


def gemm_impls(on_gpu: bool) -> list[tuple[str, str]]:
  """The (recipe, impl) rows of the forward-GEMM table on this backend."""
  rows = [("bf16", "xla"), ("rowwise", "emulate"), ("mxfp8", "emulate"), ("rowwise", "xla")]
  if on_gpu:
    rows += [("rowwise", "pallas"), ("rowwise", "triton"), ("mxfp8", "pallas"), ("mxfp8", "triton")]
    if fp8._has_native_mx():
      rows.append(("mxfp8", "xla"))
  return rows


def _operands(m, k, n, rng):
  x = jnp.asarray(rng.standard_normal((m, k)), jnp.float32)
  w = jnp.asarray(rng.standard_normal((k, n)) * k ** -0.5, jnp.float32)
  return x, w


def bench_gemm(m, k, n, *, reps: int, rows, rng, peaks: dict | None = None) -> list[dict]:
  """One record per (recipe, impl) in `rows`; peaks {"bf16": FLOP/s, "fp8": FLOP/s} add pct_of_peak."""
  x, w = _operands(m, k, n, rng)
  flops = 2.0 * m * k * n
  records, ref_cache = [], {}
  for recipe_name, impl in rows:
    recipe = fp8.get_recipe(recipe_name)
    a, b = fp8.quantize(x, 1, recipe), fp8.quantize(w, 0, recipe)
    if recipe_name not in ref_cache:
      ref_cache[recipe_name] = np.asarray(fp8.gemm(a, b, recipe, "emulate"))
    fn = jax.jit(lambda a, b, recipe=recipe, impl=impl: fp8.gemm(a, b, recipe, impl))
    rec = {"table": "gemm", "shape": [m, k, n], "recipe": recipe_name, "impl": impl, "median_ms": None,
           "tflops": None, "pct_of_peak": None, "max_rel_err": None, "error": None}
    try:
      ms = median_ms(fn, a, b, reps=reps)
      got = np.asarray(fn(a, b))
    except Exception as e:  # a kernel that does not lower here is reported, not fatal
      rec["error"] = f"{type(e).__name__}: {str(e)[:300]}"
      records.append(rec)
      continue
    ref = ref_cache[recipe_name]
    peak = (peaks or {}).get("bf16" if recipe_name == "bf16" else "fp8")
    rec.update(median_ms=ms, tflops=flops / (ms / 1e3) / 1e12,
               pct_of_peak=100 * flops / (ms / 1e3) / peak if peak else None,
               max_rel_err=float(np.max(np.abs(got - ref)) / max(np.max(np.abs(ref)), 1e-30)))
    records.append(rec)
  return records


def bench_train_gemm(m, k, n, *, reps: int, rng,
                     recipes=("bf16", "rowwise", "mxfp8", "mxfp8_rceil")) -> list[dict]:
  x, w = _operands(m, k, n, rng)
  g = jnp.asarray(rng.standard_normal((m, n)), jnp.float32)
  records = []
  for recipe in recipes:
    def fwd_bwd(x, w, g, recipe=recipe):
      y, pullback = jax.vjp(lambda a, b: fp8.matmul(a, b, recipe), x, w)
      return (y,) + pullback(g)
    ms = median_ms(jax.jit(fwd_bwd), x, w, g, reps=reps)
    records.append({"table": "train", "shape": [m, k, n], "recipe": recipe, "impl": "auto",
                    "median_ms": ms, "tflops": 3 * 2.0 * m * k * n / (ms / 1e3) / 1e12})
  return records


def bench_step(config: str, policies, *, reps: int, sets=()) -> list[dict]:
  """Median ms of the train step of `config` (with the overrides `sets`) on one batch under each precision
  policy."""
  from gem_jax import configs
  from gem_jax.config import apply_overrides
  from gem_jax.run.build import build

  records = []
  for name in policies:
    run = build(apply_overrides(configs.get(config), [*sets, f"model.precision.policy={name}"]))
    batch = run.device_batch(run.source.first_batch())
    state = run.state
    for _ in range(3):   # compile, then let allocations settle before timing
      state, metrics = run.train_step(state, batch)
    jax.block_until_ready(metrics)
    times = []
    for _ in range(reps):
      t = time.perf_counter()
      state, metrics = run.train_step(state, batch)
      jax.block_until_ready(metrics)
      times.append(time.perf_counter() - t)
    records.append({"table": "step", "config": config, "policy": name,
                    "median_ms": statistics.median(times) * 1e3})
  return records


def with_ratios(records: list[dict]) -> list[dict]:
  """Adds speedup_vs_bf16 (bf16 time / this time) within each table and shape."""
  key = lambda r: (r["table"], str(r.get("shape", r.get("config"))))
  base = {key(r): r["median_ms"] for r in records
          if r.get("median_ms") and r.get("recipe", r.get("policy")) == "bf16"}
  for r in records:
    if base.get(key(r)) and r.get("median_ms"):
      r["speedup_vs_bf16"] = base[key(r)] / r["median_ms"]
  return records


def _spread(rng, shape, block_shape):
  """Normal values times 2^e, e in [-6, 6] drawn per block of block_shape: a scale applied to the wrong
  row, column or MX block is far outside the bound."""
  reps = [-(-s // b) for s, b in zip(shape, block_shape)]
  exps = rng.integers(-6, 7, size=reps)
  for axis, b in enumerate(block_shape):
    exps = np.repeat(exps, b, axis=axis)
  return (rng.normal(size=shape) * np.exp2(exps[:shape[0], :shape[1]])).astype(np.float32)


def check_gemm(m, k, n, recipe_name: str, impl: str, rng) -> dict:
  """fp8.gemm(impl) against the emulation on operands whose magnitudes vary per row / column / 32-block.

  Float8 products are exact in float32 and the dequantization is exact, so a kernel and the emulation
  differ only in summation order (and, row-wise, in where the scales are applied): elementwise within
  factor * 2^-24 * (|A| @ |B|), factor 2K for MX and 2(K + 3) for row-wise (tests/test_fp8_gemm_triton.py).
  -> {"max_rel_err", "bound_ratio" (max of |err| / bound; <= 1 passes), "passed", "error"}.
  """
  recipe = fp8.get_recipe(recipe_name)
  block = (1, 32) if recipe.kind == "mx" else (1, k)
  x = jnp.asarray(_spread(rng, (m, k), block))
  w = jnp.asarray(_spread(rng, (k, n), block[::-1]))
  a, b = fp8.quantize(x, 1, recipe), fp8.quantize(w, 0, recipe)
  rec = {"check": "fp8_gemm", "recipe": recipe_name, "impl": impl, "shape": [m, k, n], "max_rel_err": None,
         "bound_ratio": None, "passed": False, "error": None}
  try:
    got = np.asarray(jax.jit(lambda a, b: fp8.gemm(a, b, recipe, impl))(a, b), np.float64)
  except Exception as e:
    rec["error"] = f"{type(e).__name__}: {str(e)[:300]}"
    return rec
  want = np.asarray(fp8.gemm(a, b, recipe, "emulate"), np.float64)
  a_deq = np.asarray(fp8.dequantize(a, 1, recipe), np.float64)
  b_deq = np.asarray(fp8.dequantize(b, 0, recipe), np.float64)
  factor = 2 * k if recipe.kind == "mx" else 2 * (k + 3)
  bound = factor * 2.0 ** -24 * (np.abs(a_deq) @ np.abs(b_deq)) + 1e-30
  err = np.abs(got - want)
  rec["max_rel_err"] = float(err.max() / max(np.abs(want).max(), 1e-30))
  rec["bound_ratio"] = float(np.max(err / bound)) if np.all(np.isfinite(got)) else float("inf")
  rec["passed"] = bool(rec["bound_ratio"] <= 1.0)
  return rec
