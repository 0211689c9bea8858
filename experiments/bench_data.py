"""Benchmark of the input path on ONE CPU core: the synthetic stream's block() throughput, Parquet files of
that stream read back into packed jagged batches, and the planted signal.

  python experiments/bench_data.py [--blocks 9] [--size 4096] [--parquet-examples 131072] [--report-examples 200000]

Expected (2-core x86 dev box, one core used): >= 50k examples/s for both; click NE of the planted model ~0.78.
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


def bench_parquet(spec, stream, size: int, examples: int) -> None:
  """Writes `examples` rows of the stream as Parquet (row groups of 16384), then times one pass of a fresh
  Parquet source over them: every row group read, checked and converted, every block packed to a Batch."""
  import dataclasses
  import tempfile

  from gem_jax.data import export, pipeline
  from gem_jax.data.parquet_source import ParquetDataConfig, ParquetSource
  with tempfile.TemporaryDirectory() as out:
    t0 = time.perf_counter()
    export.write_dataset(out, spec, (stream.block(i, size) for i in range(-(-examples // size))),
                         [stream.block(1 << 30, size)], row_group_rows=16384)
    print(f"wrote {examples:,} rows as Parquet in {time.perf_counter() - t0:.1f}s")
    pipe = pipeline.PipelineConfig(batch_size=size)
    cfg = dataclasses.make_dataclass("Cfg", ["data"])(ParquetDataConfig(out, pipe))
    for shuffle in (0, 65536):
      source = ParquetSource(dataclasses.replace(cfg, data=dataclasses.replace(cfg.data, shuffle_window=shuffle)))
      t0, rows = time.perf_counter(), 0
      for i in range(source.steps_per_epoch()):
        batch = pipeline.pack(source.block(i, size), spec, pipe)
        rows += int(batch.example_mask_B.sum())
      sec = time.perf_counter() - t0
      print(f"Parquet -> packed batches of {size}, shuffle window {shuffle}, 1 core: {rows:,} rows in {sec:.2f}s ="
            f" {rows / sec:,.0f} examples/s")


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--blocks", type=int, default=9)
  parser.add_argument("--size", type=int, default=4096)
  parser.add_argument("--report-examples", type=int, default=200_000)
  parser.add_argument("--seed", type=int, default=0)
  parser.add_argument("--parquet-examples", type=int, default=131_072, help="rows of the Parquet part (0: skip)")
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

  if args.parquet_examples:
    bench_parquet(spec, stream, args.size, args.parquet_examples)

  t0 = time.perf_counter()
  report = stream.signal_report(args.report_examples)
  print(f"signal_report({args.report_examples}) in {time.perf_counter() - t0:.2f}s")
  print(json.dumps(report, indent=2))


if __name__ == "__main__":
  main()
