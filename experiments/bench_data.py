"""Benchmark of the synthetic ads stream on ONE CPU core: block() throughput and the planted signal.

  python experiments/bench_data.py [--blocks 9] [--size 4096] [--report-examples 200000]

Expected (2-core x86 dev box, one core used): >= 50k examples/s; click NE of the planted model ~0.78.
"""

import os

# One core: pin before numpy starts any thread pool (the stream itself is single-threaded numpy).
for var in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
  os.environ[var] = "1"
if hasattr(os, "sched_setaffinity"):
  os.sched_setaffinity(0, {min(os.sched_getaffinity(0))})

import argparse  # noqa: E402
import json  # noqa: E402
import time  # noqa: E402

import numpy as np  # noqa: E402

from gem_jax.data.spec import ads_feature_spec  # noqa: E402
from gem_jax.data.synthetic import SyntheticAdsStream, SyntheticConfig  # noqa: E402


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--blocks", type=int, default=9)
  parser.add_argument("--size", type=int, default=4096)
  parser.add_argument("--report-examples", type=int, default=200_000)
  parser.add_argument("--seed", type=int, default=0)
  args = parser.parse_args()

  spec = ads_feature_spec(users=100_000, ads=50_000, advertisers=5_000, categories=200, embed_dim=32,
                          max_history=128)
  t0 = time.perf_counter()
  stream = SyntheticAdsStream(spec, SyntheticConfig(seed=args.seed))
  print(f"stream built (bias calibration included) in {time.perf_counter() - t0:.2f}s")

  seconds, tokens = [], []
  for index in range(args.blocks):
    t0 = time.perf_counter()
    ex = stream.block(index, args.size)
    seconds.append(time.perf_counter() - t0)
    tokens.append(int(ex.history[1].sum()))
  sec = float(np.median(seconds))
  print(f"block({args.size}) on 1 core, median of {args.blocks}: {sec * 1e3:.1f} ms ="
        f" {args.size / sec:,.0f} examples/s, {np.median(tokens) / sec:,.0f} history tokens/s"
        f" (mean history length {np.sum(tokens) / (args.blocks * args.size):.1f})")

  t0 = time.perf_counter()
  report = stream.signal_report(args.report_examples)
  print(f"signal_report({args.report_examples}) in {time.perf_counter() - t0:.2f}s")
  print(json.dumps(report, indent=2))


if __name__ == "__main__":
  main()
