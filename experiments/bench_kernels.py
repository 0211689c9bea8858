"""Kernel benchmark: jagged attention impls side by side with a padded dense softmax baseline.

  python experiments/bench_kernels.py --quick --out bench.json      # CPU, under 2 minutes
  python experiments/bench_kernels.py --out bench.json              # the full grid (GPU)

For every shape (uniform and heavy-tailed lengths, max length N, heads, head dim) and every impl it prints
a row and writes one JSON record per (kernel, impl, shape, pass) with median_ms, real_tflops (FLOPs of the
unmasked causal pairs only / time), pct_of_peak (against a GEMM measured in the same run) and max_rel_err
against the reference (max|got - ref| / max|ref|). The padded baseline is dense softmax attention over
B x N x N, what a recommender without jagged kernels runs.
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

from gem_jax import ops
from pallas_kernels.hstu_attention import reference as hstu_reference
from pallas_kernels.jagged_softmax_attention import reference as softmax_reference


@dataclasses.dataclass(frozen=True)
class Shape:
  batch: int
  max_len: int
  heads: int
  head_dim: int
  lengths: str  # "uniform": every row max_len long; "heavy": log-normal, mean <= max_len / 4

  @property
  def name(self) -> str:
    return f"B{self.batch}_N{self.max_len}_H{self.heads}_D{self.head_dim}_{self.lengths}"


def _lengths(shape: Shape, rng) -> np.ndarray:
  if shape.lengths == "uniform":
    return np.full(shape.batch, shape.max_len)
  # Heavy tail: log-normal with sigma 1, median max_len / 10 -> mean ~ max_len / 6, capped at max_len.
  n = rng.lognormal(np.log(shape.max_len / 10), 1.0, shape.batch).astype(np.int64)
  return np.clip(n, 1, shape.max_len)


def _timeit(fn, *args, reps: int) -> float:
  jax.block_until_ready(fn(*args))
  times = []
  for _ in range(reps):
    t0 = time.perf_counter()
    jax.block_until_ready(fn(*args))
    times.append(time.perf_counter() - t0)
  return statistics.median(times) * 1e3


def measured_gemm_peak(dtype, n: int) -> float:
  """FLOP/s of one n x n x n matmul on this device, median of 5: the CPU's stand-in for a peak."""
  a = jnp.ones((n, n), dtype)
  mm = jax.jit(lambda a: jnp.dot(a, a, preferred_element_type=jnp.float32))
  return 2 * n ** 3 / (_timeit(mm, a, reps=5) / 1e3)


def _rel_err(got, ref) -> float:
  got, ref = np.asarray(got, np.float32), np.asarray(ref, np.float32)
  return float(np.max(np.abs(got - ref)) / max(np.max(np.abs(ref)), 1e-30))


def hstu_impls(on_gpu: bool) -> dict:
  impls = {"reference": ops._HSTU_IMPLS["reference"], "xla": ops._HSTU_IMPLS["xla"]}
  for name in ("pallas", "triton"):
    if name in ops._HSTU_IMPLS and (on_gpu or name != "triton"):
      impls[name] = ops._HSTU_IMPLS[name]
  return impls


def bench_shape(shape: Shape, *, reps: int, peak: float, impls: dict, interpret_pallas: bool, rng) -> list[dict]:
  lengths = _lengths(shape, rng)
  offsets = jnp.asarray(np.concatenate([[0], np.cumsum(lengths)]), jnp.int32)
  t = int(offsets[-1])
  h, d = shape.heads, shape.head_dim
  q, k, v = (jnp.asarray(rng.normal(size=(t, h, d)), jnp.float32) for _ in range(3))
  n = shape.max_len
  causal_pairs = float(np.sum(lengths * (lengths + 1) // 2))
  flops_fwd = causal_pairs * h * 4 * d  # q.k and w.v per unmasked pair
  records = []

  def add(kernel, impl, pass_, ms, err, flops):
    records.append({"kernel": kernel, "impl": impl, "shape": shape.name, "pass": pass_, "median_ms": ms,
                    "real_tflops": flops / (ms / 1e3) / 1e12, "pct_of_peak": 100 * flops / (ms / 1e3) / peak,
                    "max_rel_err": err, "mean_length": float(lengths.mean()), "tokens": t})

  kw = dict(max_seq_len=n, alpha=1.0 / d, causal=True)
  ref = jax.jit(lambda q, k, v: hstu_reference.hstu_attention(q, k, v, offsets, **kw))(q, k, v)
  for name, fn in impls.items():
    if name == "pallas" and not interpret_pallas:
      continue
    fwd = jax.jit(lambda q, k, v, fn=fn: fn(q, k, v, offsets, **kw))
    got = fwd(q, k, v)
    add("hstu_attention", name, "fwd", _timeit(fwd, q, k, v, reps=reps), _rel_err(got, ref), flops_fwd)
    grad = jax.jit(jax.grad(lambda q, k, v, fn=fn: jnp.sum(fn(q, k, v, offsets, **kw)), argnums=(0, 1, 2)))
    add("hstu_attention", name, "fwd+bwd", _timeit(grad, q, k, v, reps=reps), float("nan"), 3.5 * flops_fwd)

  skw = dict(max_seq_len=n, scale=d ** -0.5, causal=True)
  sref = jax.jit(lambda q, k, v: softmax_reference.jagged_softmax_attention(q, k, v, offsets, **skw))
  sref_out = sref(q, k, v)
  # The padded baseline: dense softmax attention over B x N x N, what runs without jagged kernels.
  add("padded_softmax_baseline", "dense", "fwd", _timeit(sref, q, k, v, reps=reps), 0.0, flops_fwd)
  for name in ("xla", "blocked", "pallas"):
    if name == "pallas" and not interpret_pallas:
      continue
    sfn = jax.jit(lambda q, k, v, name=name: ops.jagged_softmax_attention(q, k, v, offsets, impl=name, **skw))
    add("jagged_softmax_attention", name, "fwd", _timeit(sfn, q, k, v, reps=reps), _rel_err(sfn(q, k, v), sref_out),
        flops_fwd)
  return records


def grid(quick: bool) -> list[Shape]:
  if quick:
    return [Shape(16, 256, 2, 64, "uniform"), Shape(32, 512, 2, 64, "heavy"), Shape(64, 256, 2, 32, "heavy")]
  shapes = []
  for n in (256, 1024, 4096, 8192):
    batch = max(4, 16384 // n)
    for lengths in ("uniform", "heavy"):
      for h, d in ((2, 64), (4, 128)):
        shapes.append(Shape(batch, n, h, d, lengths))
  return shapes


def main(argv=None) -> int:
  p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("--quick", action="store_true", help="a CPU-sized grid, under 2 minutes")
  p.add_argument("--out", default="bench.json")
  p.add_argument("--reps", type=int, default=None)
  args = p.parse_args(argv)
  on_gpu = jax.default_backend() == "gpu"
  reps = args.reps or (3 if args.quick else 10)
  peak = measured_gemm_peak(jnp.bfloat16 if on_gpu else jnp.float32, 4096 if on_gpu else 1024)
  impls = hstu_impls(on_gpu)
  rng = np.random.default_rng(0)
  records = []
  print(f"backend {jax.default_backend()}, measured GEMM peak {peak / 1e12:.3f} TFLOP/s, impls {list(impls)}")
  print(f"{'kernel':26s} {'impl':9s} {'pass':8s} {'shape':28s} {'ms':>9s} {'TFLOP/s':>8s} {'%peak':>6s} {'rel_err':>8s}")
  for shape in grid(args.quick):
    # Pallas in interpret mode is an emulator: only its smallest quick shape is timed on CPU.
    interpret_pallas = on_gpu or shape.max_len <= 256 and shape.batch <= 16
    for r in bench_shape(shape, reps=reps, peak=peak, impls=impls, interpret_pallas=interpret_pallas, rng=rng):
      records.append(r)
      print(f"{r['kernel']:26s} {r['impl']:9s} {r['pass']:8s} {r['shape']:28s} {r['median_ms']:9.2f} "
            f"{r['real_tflops']:8.4f} {r['pct_of_peak']:6.1f} {r['max_rel_err']:8.1e}")
  ratios = []
  for shape in {r["shape"] for r in records if r["shape"].endswith("heavy")}:
    base = next(r for r in records if r["shape"] == shape and r["kernel"] == "padded_softmax_baseline")
    for r in records:
      if r["shape"] == shape and r["pass"] == "fwd" and r["kernel"] != "padded_softmax_baseline":
        ratios.append({"shape": shape, "kernel": r["kernel"], "impl": r["impl"],
                       "speedup_vs_padded": base["median_ms"] / r["median_ms"]})
  for x in sorted(ratios, key=lambda x: (x["shape"], x["kernel"], x["impl"])):
    print(f"heavy-tailed {x['shape']}: {x['kernel']}/{x['impl']} is {x['speedup_vs_padded']:.2f}x the padded baseline")
  with open(args.out, "w") as f:
    json.dump({"backend": jax.default_backend(), "peak_flops": peak, "peak_source": "measured GEMM",
               "records": records, "speedups_heavy": ratios}, f, indent=2)
  return 0


if __name__ == "__main__":
  sys.exit(main())
