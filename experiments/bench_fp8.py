"""FP8 GEMM and train-step benchmark: bf16 vs row-wise FP8 vs MXFP8, every implementation side by side.

  python experiments/bench_fp8.py --quick --out bench_fp8.json     # CPU (emulation), about a minute
  python experiments/bench_fp8.py --out bench_fp8.json             # GPU: M=16k, K=N=512..4096

Three tables (gem_jax/bench/fp8.py), each a median over --reps runs with ratios against bf16 from the same
run: gemm (the forward GEMM on pre-quantized operands, checked against the emulation), train (fp8.matmul
forward + both backward GEMMs) and step (the train step of --step-config per policy). On CPU every FP8
recipe is emulated: the numbers measure the emulation's overhead, not FP8 speed.
"""

import argparse
import json
import sys

import jax
import numpy as np

from gem_jax.bench import fp8 as bench


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
  rng = np.random.default_rng(0)
  records = []
  for m, k, n in shapes:
    records += bench.bench_gemm(m, k, n, reps=reps, rows=bench.gemm_impls(on_gpu), rng=rng)
    records += bench.bench_train_gemm(m, k, n, reps=reps, rng=rng)
  policies = [n.strip() for n in args.step_policies.split(",") if n.strip()]
  records += bench.bench_step(args.step_config or ("tiny" if args.quick or not on_gpu else "base"), policies,
                              reps=reps)
  records = bench.with_ratios(records)
  print(f"backend {jax.default_backend()} ({jax.devices()[0].device_kind}), median of {reps}")
  for r in records:
    shape = "x".join(map(str, r["shape"])) if "shape" in r else r["config"]
    what = f"{r['table']:<6} {shape:<20} {r.get('recipe', r.get('policy')):<14} {r.get('impl', ''):<8}"
    if r.get("error"):
      print(f"{what} failed: {r['error']}")
      continue
    print(f"{what} {r['median_ms']:>9.3f} ms {r.get('tflops') or float('nan'):>9.3f} TFLOP/s "
          f"{r.get('speedup_vs_bf16', float('nan')):>6.2f}x bf16  rel err {r.get('max_rel_err') or 0:.1e}")
  if args.out:
    with open(args.out, "w") as f:
      json.dump({"backend": jax.default_backend(), "device": jax.devices()[0].device_kind, "reps": reps,
                 "records": records}, f, indent=2)
  return 0


if __name__ == "__main__":
  sys.exit(main())
