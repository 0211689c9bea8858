"""FP8 sensitivity probe: SNR of every matmul site under every FP8 recipe, and a proposed policy.

  python experiments/fp8_probe.py --out probe.json                      # small config at init, CPU ~2 min
  python experiments/fp8_probe.py --run runs/default --out probe.json   # the trained model of a run
  python experiments/fp8_probe.py --config tiny --batches 1 --threshold 24 --sites '*hstu*' 

Prints (gem_jax/bench/fp8_probe.py) one row per Dense site (rows M, widths K x N, bf16's SNR against float32, each recipe's worst SNR
over y / dx / dw against bf16, and "e2e": the whole-model gradient SNR with only that site in FP8) and
two proposals:
  per site     the first recipe of gem_jax.precision.probe.PREFERENCE whose worst local SNR clears
               --threshold, else bf16;
  end to end   the set of sites in --end-to-end's recipe with the most Dense FLOPs whose combined noise
               keeps the whole-model gradient above --target-db (checked by a second measurement).
The JSON holds the rows, both proposals and the `--set` flags that train with them.
"""

import argparse
import json
import sys


def main(argv=None) -> int:
  from gem_jax import configs

  p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("--config", default="small", choices=sorted(configs.CONFIGS))
  p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="config override")
  p.add_argument("--run", default=None, help="probe the parameters of this run folder's last checkpoint")
  p.add_argument("--batches", type=int, default=2, help="training-stream batches to probe on")
  p.add_argument("--threshold", type=float, default=25.0, help="min SNR (dB) of y, dx and dw to allow a recipe")
  p.add_argument("--sites", default="*",
                 help="fnmatch pattern: probe only the matching sites (the end-to-end 'every site' row still "
                      "switches all of them)")
  p.add_argument("--end-to-end", default="mxfp8_rceil", metavar="RECIPE",
                 help="recipe of the whole-model gradient probe ('none' to skip)")
  p.add_argument("--target-db", type=float, default=20.0,
                 help="whole-model gradient SNR the end-to-end proposal must keep")
  p.add_argument("--out", default=None, help="JSON output path")
  args = p.parse_args(argv)
  if args.batches < 1:
    p.error(f"--batches must be >= 1, got {args.batches}")
  from gem_jax.bench import fp8_probe
  from gem_jax.config import apply_overrides
  try:
    out = fp8_probe.probe_run(apply_overrides(configs.get(args.config), args.set), run_dir=args.run,
                              batches=args.batches, threshold=args.threshold, sites=args.sites,
                              recipe=None if args.end_to_end == "none" else args.end_to_end, target_db=args.target_db)
  except ValueError as e:
    p.error(str(e))
  if args.out:
    with open(args.out, "w") as f:
      json.dump(out, f, indent=2, default=str)
  return 0


if __name__ == "__main__":
  sys.exit(main())
