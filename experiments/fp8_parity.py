"""FP8 loss parity: the same config and seed trained in bf16, under the default FP8 policy and all-MXFP8
(gem_jax/bench/fp8_parity.py).

  python experiments/fp8_parity.py --quick --out parity.json       # CPU, under 5 minutes on 2 cores
  python experiments/fp8_parity.py --config small --out parity.json
  python experiments/fp8_parity.py --policies bf16,none,fp8,mxfp8 --quick --out p.json   # "none": the float32 noise floor

Writes --out JSON with, per policy: final eval NE / AUC per task, `rel_ne_gap` against the first policy, the
share of Dense matmul FLOPs under each recipe, optionally the step's compiled memory (--memory), the wall
time; and a PNG of the train loss curves next to it.
"""

import argparse
import json
import os
import sys


def main(argv=None) -> int:
  from gem_jax import configs
  from gem_jax.precision.policy import POLICIES

  p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("--config", default="small", choices=sorted(configs.CONFIGS))
  p.add_argument("--quick", action="store_true", help="200 steps, 32k eval examples (CPU, < 5 min)")
  p.add_argument("--policies", default="bf16,fp8,mxfp8", help="comma-separated; the first is the baseline")
  p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="config override")
  p.add_argument("--memory", action="store_true",
                 help="also compile each policy's train step for its memory analysis (~20 s per policy)")
  p.add_argument("--out", default="fp8_parity.json", help="JSON path; the PNG goes next to it")
  p.add_argument("--runs", default=None, help="folder for the runs (default: <out without .json>_runs)")
  args = p.parse_args(argv)
  names = [n.strip() for n in args.policies.split(",") if n.strip()]
  if any(n not in POLICIES for n in names) or len(names) < 2:
    p.error(f"--policies needs >= 2 of {sorted(POLICIES)}, got {args.policies!r}")

  from gem_jax.bench import fp8_parity
  from gem_jax.config import apply_overrides
  cfg = apply_overrides(configs.get(args.config), (list(fp8_parity.QUICK) if args.quick else []) + args.set)
  runs = args.runs or os.path.splitext(args.out)[0] + "_runs"
  out = fp8_parity.parity(cfg, names, runs, args.out, memory=args.memory)
  with open(args.out, "w") as f:
    json.dump(out, f, indent=2)
  print("\n" + fp8_parity.table(out, cfg.data.spec.task_names))
  print(f"wrote {args.out} and {out['png']} in {out['wall_s']:.0f} s")
  return 0


if __name__ == "__main__":
  sys.exit(main())
