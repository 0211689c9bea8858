"""FP8 GEMM and train-step benchmark: bf16 vs row-wise FP8 vs MXFP8, every implementation side by side.

  python experiments/bench_fp8.py --quick --out bench_fp8.json     # CPU (emulation), about a minute
  python experiments/bench_fp8.py --out bench_fp8.json             # GPU: M=16k, K=N=512..4096

Three tables, every time a median over --reps runs, ratios against bf16 measured in the same run:
  gemm   the forward GEMM alone on pre-quantized operands (what the tensor cores see): TFLOP/s per impl.
  train  fp8.matmul forward + both backward GEMMs, quantization included (what a Dense site costs).
  step   the train step of --step-config under policies bf16 / fp8 / rowwise / mxfp8: median ms.
Each GEMM result is checked against the emulated reference (max |got - ref| / max |ref|), so a fast
wrong kernel cannot win. On CPU every FP8 recipe is emulated (no FP8 units): the CPU numbers measure the
overhead of emulation, not FP8 speed; the Pallas/Triton kernels run only on GPU.
"""

import argparse
import dataclasses
import json
import statistics
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from gem_jax import configs
from gem_jax.data import pipeline
from gem_jax.data.synthetic import SyntheticAdsStream
from gem_jax.model.gem import GEM
from gem_jax.precision import fp8
from gem_jax.precision.policy import PrecisionConfig
from gem_jax.train.optim import make_optimizer
from gem_jax.train.step import init_state, make_train_step


def timeit(fn, *args, reps: int) -> float:
  """Median milliseconds of fn(*args) after one warm-up (compile) call."""
  jax.block_until_ready(fn(*args))
  times = []
  for _ in range(reps):
    t = time.perf_counter()
    jax.block_until_ready(fn(*args))
    times.append(time.perf_counter() - t)
  return statistics.median(times) * 1e3


def gemm_impls(on_gpu: bool) -> dict:
  """{(recipe, impl): available} for the forward-GEMM table."""
  rows = {("bf16", "xla"): True, ("rowwise", "emulate"): True, ("mxfp8", "emulate"): True,
          ("rowwise", "xla"): True}
  if on_gpu:
    rows.update({("rowwise", "pallas"): True, ("rowwise", "triton"): True, ("mxfp8", "pallas"): True,
                 ("mxfp8", "triton"): True, ("mxfp8", "xla"): fp8._has_native_mx()})
  return {k: v for k, v in rows.items() if v}


def bench_gemm(m, k, n, *, reps, on_gpu, rng) -> list[dict]:
  x = jnp.asarray(rng.standard_normal((m, k)), jnp.float32)
  w = jnp.asarray(rng.standard_normal((k, n)) * k ** -0.5, jnp.float32)
  flops = 2.0 * m * k * n
  records, ref_cache = [], {}
  for recipe_name, impl in gemm_impls(on_gpu):
    recipe = fp8.get_recipe(recipe_name)
    a, b = fp8.quantize(x, 1, recipe), fp8.quantize(w, 0, recipe)
    if recipe_name not in ref_cache:
      ref_cache[recipe_name] = np.asarray(fp8.gemm(a, b, recipe, "emulate"))
    fn = jax.jit(lambda a, b, recipe=recipe, impl=impl: fp8.gemm(a, b, recipe, impl))
    try:
      ms = timeit(fn, a, b, reps=reps)
      got = np.asarray(fn(a, b))
    except Exception as e:  # a kernel that does not lower here is reported, not fatal
      records.append({"table": "gemm", "shape": [m, k, n], "recipe": recipe_name, "impl": impl,
                      "error": f"{type(e).__name__}: {str(e)[:200]}"})
      continue
    ref = ref_cache[recipe_name]
    records.append({"table": "gemm", "shape": [m, k, n], "recipe": recipe_name, "impl": impl,
                    "median_ms": ms, "tflops": flops / (ms / 1e3) / 1e12,
                    "max_rel_err": float(np.max(np.abs(got - ref)) / max(np.max(np.abs(ref)), 1e-30))})
  return records


def bench_train_gemm(m, k, n, *, reps, rng) -> list[dict]:
  x = jnp.asarray(rng.standard_normal((m, k)), jnp.float32)
  w = jnp.asarray(rng.standard_normal((k, n)) * k ** -0.5, jnp.float32)
  g = jnp.asarray(rng.standard_normal((m, n)), jnp.float32)
  records = []
  for recipe in ("bf16", "rowwise", "mxfp8", "mxfp8_rceil"):
    def fwd_bwd(x, w, g, recipe=recipe):
      y, pullback = jax.vjp(lambda a, b: fp8.matmul(a, b, recipe), x, w)
      return (y,) + pullback(g)
    ms = timeit(jax.jit(fwd_bwd), x, w, g, reps=reps)
    records.append({"table": "train", "shape": [m, k, n], "recipe": recipe, "impl": "auto",
                    "median_ms": ms, "tflops": 3 * 2.0 * m * k * n / (ms / 1e3) / 1e12})
  return records


def bench_step(config: str, policies, *, reps: int) -> list[dict]:
  cfg = configs.get(config)
  spec = cfg.data.spec
  batch = pipeline.eval_batches(SyntheticAdsStream(spec, cfg.data.synthetic), spec, cfg.data.pipeline,
                                num_examples=cfg.data.pipeline.batch_size, start_index=0)[0]
  batch = jax.tree_util.tree_map(jnp.asarray, batch)
  records = []
  for name in policies:
    model_cfg = dataclasses.replace(cfg.model, precision=PrecisionConfig(policy=name))
    model = GEM(spec, model_cfg, rngs=nnx.Rngs(0))
    optimizer = make_optimizer(cfg.train, nnx.state(model, nnx.Param))
    graphdef, rest, state = init_state(model, optimizer)
    step = make_train_step(graphdef, rest, optimizer, spec)
    for _ in range(3):   # compile, then let allocations settle before timing
      state, metrics = step(state, batch)
    jax.block_until_ready(metrics)
    times = []
    for _ in range(reps):
      t = time.perf_counter()
      state, metrics = step(state, batch)
      jax.block_until_ready(metrics)
      times.append(time.perf_counter() - t)
    records.append({"table": "step", "config": config, "policy": name,
                    "median_ms": statistics.median(times) * 1e3})
  return records


def with_ratios(records: list[dict]) -> list[dict]:
  """Adds speedup_vs_bf16 (bf16 time / this time) within each table and shape."""
  base = {}
  for r in records:
    if "median_ms" in r and r.get("recipe", r.get("policy")) == "bf16":
      base[(r["table"], str(r.get("shape", r.get("config"))))] = r["median_ms"]
  for r in records:
    b = base.get((r["table"], str(r.get("shape", r.get("config")))))
    if b and "median_ms" in r:
      r["speedup_vs_bf16"] = b / r["median_ms"]
  return records


def main(argv=None) -> int:
  p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("--quick", action="store_true", help="small shapes and the tiny config (CPU)")
  p.add_argument("--reps", type=int, default=None, help="timed runs per case (default 5 quick, 20 full)")
  p.add_argument("--step-config", default=None, help="config for the train-step table (default tiny / base)")
  p.add_argument("--shape", action="append", default=None, metavar="MxKxN",
                 help="GEMM shape instead of the default grid (repeatable)")
  p.add_argument("--step-policies", default="bf16,fp8,rowwise,mxfp8", help="policies of the step table")
  p.add_argument("--out", default=None, help="JSON output path")
  args = p.parse_args(argv)
  on_gpu = jax.default_backend() == "gpu"
  reps = args.reps or (5 if args.quick else 20)
  shapes = ([(2048, 256, 256), (2048, 512, 512)] if args.quick else
            [(16384, d, d) for d in (512, 1024, 2048, 4096)])
  if args.shape:
    try:
      shapes = [tuple(int(v) for v in s.lower().split("x")) for s in args.shape]
    except ValueError:
      p.error(f"--shape takes MxKxN, e.g. 16384x1024x1024, got {args.shape}")
    if any(len(s) != 3 or min(s) < 1 for s in shapes):
      p.error(f"--shape takes three positive sizes MxKxN, got {args.shape}")
  step_policies = [n.strip() for n in args.step_policies.split(",") if n.strip()]
  rng = np.random.default_rng(0)
  records = []
  for m, k, n in shapes:
    records += bench_gemm(m, k, n, reps=reps, on_gpu=on_gpu, rng=rng)
    records += bench_train_gemm(m, k, n, reps=reps, rng=rng)
  records += bench_step(args.step_config or ("tiny" if args.quick or not on_gpu else "base"), step_policies,
                        reps=reps)
  records = with_ratios(records)
  print(f"backend {jax.default_backend()} ({jax.devices()[0].device_kind}), median of {reps}")
  print(f"{'table':<6} {'shape / config':<20} {'recipe/policy':<14} {'impl':<8} {'ms':>9} {'TFLOP/s':>9} "
        f"{'vs bf16':>8} {'rel err':>9}")
  for r in records:
    shape = "x".join(map(str, r["shape"])) if "shape" in r else r["config"]
    if "error" in r:
      print(f"{r['table']:<6} {shape:<20} {r['recipe']:<14} {r['impl']:<8} failed: {r['error']}")
      continue
    print(f"{r['table']:<6} {shape:<20} {r.get('recipe', r.get('policy')):<14} {r.get('impl', ''):<8} "
          f"{r['median_ms']:>9.3f} {r.get('tflops', float('nan')):>9.3f} {r.get('speedup_vs_bf16', float('nan')):>8.2f} "
          f"{r.get('max_rel_err', float('nan')):>9.1e}")
  if args.out:
    with open(args.out, "w") as f:
      json.dump({"backend": jax.default_backend(), "device": jax.devices()[0].device_kind, "reps": reps,
                 "records": records}, f, indent=2)
  return 0


if __name__ == "__main__":
  sys.exit(main())
