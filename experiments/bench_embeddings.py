"""Embedding benchmark: train step time against table size, dense path and sparse engine in one run, and
the sparse lookup + update's distinct rows per second at several id skews and widths
(gem_jax/bench/embeddings.py says what each number is).

  python experiments/bench_embeddings.py --quick --out emb.json     # 4 sizes, few steps (CPU, < 8 min)
  python experiments/bench_embeddings.py --out emb.json             # 12 steps per cell, the full skew grid

Writes the JSON (`rows`: one per (path, size); `throughput`: one per (zipf a, width)) and a PNG of step time
against table size beside it.
"""

import argparse
import json
import os
import sys

from gem_jax.bench import embeddings

SCALES = (1, 10, 40, 160)   # user_id + ad_id table parameters 4.8M .. 768M


def main(argv=None) -> int:
  p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("--quick", action="store_true", help="few steps per cell and a small skew grid")
  p.add_argument("--out", default="bench_embeddings.json")
  p.add_argument("--steps", type=int, default=None, help="timed steps per cell (default 12, quick 4)")
  p.add_argument("--scales", type=int, nargs="*", default=list(SCALES))
  args = p.parse_args(argv)
  steps = args.steps or (4 if args.quick else 12)
  rows = []
  source, batches = embeddings.small_source()
  for scale in args.scales:
    for path in ("dense", "sparse"):
      r = embeddings.step_row(path, scale, steps, source, batches)
      rows.append(r)
      print(f"{path:6s} {r['table_params'] / 1e6:7.1f}M table params  step {r['step_ms_median']:8.1f} ms  "
            f"temp {r['temp_bytes'] / 2**20:8.1f} MB  compile {r['compile_s']:.1f} s", flush=True)
  by = {(r["path"], r["scale"]): r for r in rows}
  lo, hi = min(args.scales), max(args.scales)
  growth = {path: by[(path, hi)]["step_ms_median"] / by[(path, lo)]["step_ms_median"] for path in ("dense", "sparse")}
  temp_growth = {path: by[(path, hi)]["temp_bytes"] / max(by[(path, lo)]["temp_bytes"], 1) for path in ("dense", "sparse")}
  print(f"step time at {hi}x over {lo}x: dense {growth['dense']:.2f}x, sparse {growth['sparse']:.2f}x; "
        f"temp memory: dense {temp_growth['dense']:.2f}x, sparse {temp_growth['sparse']:.2f}x")
  throughput = []
  skews = (0.8, 1.2) if args.quick else (0.8, 1.0, 1.2)
  for dim in (32, 128):
    for a in skews:
      t = embeddings.update_rows_per_s(rows=1_000_000, dim=dim, ids=16384, a=a, reps=3 if args.quick else 10)
      throughput.append(t)
      print(f"lookup+update  E={dim:3d}  zipf {a:.1f}: {t['unique_rows']:6d} distinct of {t['ids']} ids, "
            f"{t['median_ms']:7.2f} ms, {t['unique_rows_per_s'] / 1e6:6.2f} M rows/s", flush=True)
  out = {"rows": rows, "step_growth": growth, "temp_growth": temp_growth, "throughput": throughput,
         "quick": args.quick}
  png = embeddings.plot(rows, os.path.splitext(args.out)[0] + ".png")
  out["png"] = png
  with open(args.out, "w") as f:
    json.dump(out, f, indent=2)
  print(f"wrote {args.out}" + (f" and {png}" if png else ""))
  return 0


if __name__ == "__main__":
  sys.exit(main())
