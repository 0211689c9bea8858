"""FP8 loss parity over seeds: bf16, float32 ("none"), the default FP8 policy and all-MXFP8 trained from each
seed's initial parameters on each seed's batches (gem_jax/bench/fp8_parity.py).

  python experiments/fp8_parity.py --seeds 3 --jobs 2 --out parity.json   # the claim: small, 900 steps (~30 min)
  python experiments/fp8_parity.py --seeds 3 --jobs 2 --policies bf16,none,fp8 --set train.steps=1800 \
      --out p1800.json                                                     # nearer the plateau (~49 min)
  python experiments/fp8_parity.py --quick --out parity.json              # smoke test (~5 min), not a claim
  python experiments/fp8_parity.py --seeds 3 --probe probe.json --policies bf16,none,fp8,probe --out p.json
      # also the policy experiments/fp8_probe.py --out probe.json proposed ("probe")

Writes --out JSON: per policy the mean and std over seeds of eval NE and of the relative NE gap to the first
policy (the same seed's), every seed's numbers, the noise floor (bf16's spread over seeds, the float32 gap),
the verdict against the 0.5% bound and 2 std of the float32 gap, FLOP shares, optionally the compiled memory
(--memory); and a PNG of the gap per seed next to it.
"""

import argparse
import json
import os
import sys


def main(argv=None) -> int:
  from gem_jax import configs
  from gem_jax.bench import fp8_parity
  from gem_jax.precision.policy import POLICIES

  p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("--config", default="small", choices=sorted(configs.CONFIGS))
  p.add_argument("--quick", action="store_true", help="smoke test: 200 steps, 32k eval examples, not a claim")
  p.add_argument("--seeds", type=int, default=1, help="seeds 0..N-1 (a claim needs >= 2; 3 for the README's)")
  p.add_argument("--jobs", type=int, default=1, help="runs trained at a time, each in its own process")
  p.add_argument("--policies", default="bf16,none,fp8,mxfp8", help="comma-separated; the first is the baseline")
  p.add_argument("--probe", default=None, help="fp8_probe.py JSON whose end-to-end proposal is policy 'probe'")
  p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="config override")
  p.add_argument("--memory", action="store_true", help="also each policy's compiled train-step memory")
  p.add_argument("--out", default="fp8_parity.json", help="JSON path; the PNG goes next to it")
  p.add_argument("--runs", default=None, help="folder for the runs (default: <out without .json>_runs)")
  args = p.parse_args(argv)
  names = [n.strip() for n in args.policies.split(",") if n.strip()]
  if any(n not in POLICIES and n != fp8_parity.PROBE for n in names) or len(names) < 2:
    p.error(f"--policies needs >= 2 of {sorted(POLICIES) + [fp8_parity.PROBE]}, got {args.policies!r}")
  probe = None
  if args.probe:
    with open(args.probe) as f:
      probe = json.load(f)

  from gem_jax.config import apply_overrides
  cfg = apply_overrides(configs.get(args.config), (list(fp8_parity.QUICK) if args.quick else []) + args.set)
  runs = args.runs or os.path.splitext(args.out)[0] + "_runs"
  out = fp8_parity.parity(cfg, names, runs, args.out, seeds=args.seeds, smoke=args.quick, probe=probe,
                          jobs=args.jobs, compile_cache=os.path.join(runs, "compile_cache"), memory=args.memory)
  with open(args.out, "w") as f:
    json.dump(out, f, indent=2)
  print("\n" + fp8_parity.table(out))
  print(f"wrote {args.out} and {out['png']} in {out['wall_s']:.0f} s")
  return 0


if __name__ == "__main__":
  sys.exit(main())
