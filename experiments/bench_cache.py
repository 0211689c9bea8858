"""Host-table benchmark: the device row cache's hit rate against its size (LRU and LFU, Zipf ids and the
synthetic stream's own), the train step with host tables against the same tables on the device in one run,
and the largest table a fixed device budget trains (gem_jax/bench/cache.py says what each number is).

  python experiments/bench_cache.py --quick --out cache.json     # CPU, under 10 minutes
  python experiments/bench_cache.py --out cache.json             # longer streams, three skews timed

Writes the JSON (`hit_rate`, `step`, `budget`) and a PNG beside it.
"""

import argparse
import json
import os
import sys

from gem_jax.bench import cache

FRACTIONS = (0.01, 0.05, 0.2, 1.0)


def main(argv=None) -> int:
  p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("--quick", action="store_true", help="shorter streams, one timed skew, a smaller budget table")
  p.add_argument("--out", default="bench_cache.json")
  args = p.parse_args(argv)
  steps = 60 if args.quick else 200
  rows = 1_000_000
  streams = {a: (rows, cache.zipf_stream(rows, 8192, a, steps)) for a in (0.8, 1.0, 1.2)}
  streams["synthetic"] = cache.synthetic_stream(steps // 2)
  rates = cache.hit_rates(streams, FRACTIONS)
  for r in rates:
    rate = "does not fit a batch" if r["hit_rate"] is None else f"{r['hit_rate']:.3f}"
    print(f"hit rate  {str(r['zipf_a']):9s} {r['policy']}  cache {r['cache_fraction']:5.0%} of {r['rows']} rows: {rate}"
          f"  ({r['distinct_per_step']:.0f} distinct rows per step)", flush=True)
  steps_out = []
  for a in ((1.0,) if args.quick else (0.8, 1.0, 1.2)):
    s = cache.step_pair(zipf_a=a, fraction=0.2, chunks=4 if args.quick else 8)
    steps_out.append(s)
    print(f"step      zipf {a}: 20% cache {s['step_ms_median']:.1f} ms, tables on the device "
          f"{s['device_step_ms_median']:.1f} ms ({s['ratio']:.2f}x), host waited {s['wait_fraction']:.1%}", flush=True)
  budget = cache.budget_run(budget_bytes=4 << 20 if args.quick else 16 << 20, scale=10 if args.quick else 40)
  mb = {k: budget[k] / 2**20 for k in ("budget_bytes", "cache_bytes", "step_argument_bytes",
                                       "device_tier_step_argument_bytes", "host_store_bytes")}
  print(f"budget    {mb['budget_bytes']:.0f} MB: {budget['device_tier_rows']} ad rows on the device, "
        f"{budget['host_tier_rows']} trained on the host with a {mb['cache_bytes']:.1f} MB cache (step arguments "
        f"{mb['step_argument_bytes']:.2f} MB, {mb['device_tier_step_argument_bytes']:.2f} MB with the budget's table "
        f"on the device; host store {mb['host_store_bytes']:.0f} MB)", flush=True)
  out = {"hit_rate": rates, "step": steps_out, "budget": budget, "quick": args.quick}
  out["png"] = cache.plot(rates, steps_out, os.path.splitext(args.out)[0] + ".png")
  with open(args.out, "w") as f:
    json.dump(out, f, indent=2)
  print(f"wrote {args.out}" + (f" and {out['png']}" if out["png"] else ""))
  return 0


if __name__ == "__main__":
  sys.exit(main())
