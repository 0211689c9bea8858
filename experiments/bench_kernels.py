"""Kernel benchmark: jagged attention impls side by side with padded baselines (gem_jax/bench/attention.py).

  python experiments/bench_kernels.py --quick --out bench.json      # CPU, a few minutes
  python experiments/bench_kernels.py --out bench.json              # the full grid (GPU)

One JSON record per (kernel, impl, shape, pass): median_ms, real_tflops (FLOPs of the unmasked causal pairs
only / time), pct_of_peak (against the fastest of three GEMM sizes measured in the same run) and max_rel_err
of the forward against the reference. The baselines: dense softmax and dense HSTU attention over B x N x N,
and jax.nn.dot_product_attention on the padded layout (cuDNN flash attention on GPU); `speedups` gives each
impl against the padded softmax baseline (vs_padded), the padded baseline of its own operation
(vs_padded_same_op) and cuDNN's (vs_cudnn).
"""

import argparse
import json
import sys

import jax
import jax.numpy as jnp
import numpy as np

from gem_jax.bench import attention
from gem_jax.bench.timing import best_gemm_peak


def main(argv=None) -> int:
  p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("--quick", action="store_true", help="a CPU-sized grid")
  p.add_argument("--out", default="bench.json")
  p.add_argument("--reps", type=int, default=None)
  args = p.parse_args(argv)
  on_gpu = jax.default_backend() == "gpu"
  reps = args.reps or (3 if args.quick else 10)
  dtype = jnp.bfloat16 if on_gpu else jnp.float32
  sizes = (2048, 4096, 8192) if on_gpu else (512, 1024, 2048)
  peak, peak_n = best_gemm_peak(dtype, sizes)
  rng = np.random.default_rng(0)
  print(f"backend {jax.default_backend()}, measured GEMM peak {peak / 1e12:.3f} TFLOP/s (the best of n = "
        f"{', '.join(map(str, sizes))}: n = {peak_n})")
  records = []
  for shape in attention.quick_grid() if args.quick else attention.full_grid():
    # Pallas in interpret mode is an emulator: off GPU it is timed on the smallest shape only.
    impls = attention.registered_impls(on_gpu=on_gpu, pallas=on_gpu or shape.batch * shape.max_len <= 4096)
    for r in attention.bench_shape(shape, impls=impls, reps=reps, peak=peak, dtype=dtype, rng=rng):
      records.append(r)
      timing = (f"{r['median_ms']:9.2f} ms {r['real_tflops']:8.4f} TFLOP/s {r['pct_of_peak']:5.1f}%"
                if r["median_ms"] else f"skipped: {r['skipped'] or r['error']}")
      print(f"{r['kernel']:26s} {r['impl']:9s} {r['pass']:8s} {r['shape']:28s} {timing}")
  ratios = attention.speedups(records)
  for x in ratios:
    if x["vs_padded"] and x["shape"].endswith("heavy") and x["pass"] == "fwd":
      print(f"heavy-tailed {x['shape']}: {x['kernel']}/{x['impl']} is {x['vs_padded']:.2f}x the padded softmax "
            "baseline")
    if x["vs_padded_same_op"] and x["shape"].endswith("full") and x["pass"] == "fwd":
      print(f"full-length {x['shape']}: {x['kernel']}/{x['impl']} takes {1 / x['vs_padded_same_op']:.2f}x the time "
            "of the padded baseline of its own operation")
  with open(args.out, "w") as f:
    json.dump({"backend": jax.default_backend(), "peak_flops": peak, "peak_source": "measured GEMM",
               "peak_gemm_n": peak_n, "peak_gemm_sizes": list(sizes), "records": records, "speedups": ratios},
              f, indent=2)
  return 0


if __name__ == "__main__":
  sys.exit(main())
