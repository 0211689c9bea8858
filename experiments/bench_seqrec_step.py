"""A next-item preset's train step (and optionally its full-ranking evaluation) under several settings, side by
side in one process (gem_jax/bench/seqrec_step.py says what is measured):

  python experiments/bench_seqrec_step.py --dataset ml-1m --variant unchunked task.loss_chunk=0 \\
      --variant chunk512 task.loss_chunk=512 --steps 10 --rounds 3
  python experiments/bench_seqrec_step.py --dataset beauty --variant preset --variant tokens256 \\
      data.token_multiple=256 --eval-batches 8

A --variant is a name followed by its KEY=VALUE overrides of the preset (none: the preset itself); the first
is the baseline of the speedup column. Written to --out (JSON); printed: a table.
"""

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from gem_jax.bench import seqrec_step  # noqa: E402


def main(argv=None) -> int:
  p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("--dataset", required=True, choices=["ml-1m", "ml-100k", "beauty", "sports", "toys"])
  p.add_argument("--variant", nargs="+", action="append", required=True, metavar=("NAME", "KEY=VALUE"),
                 help="a name and its overrides of the preset; repeat for each variant")
  p.add_argument("--steps", type=int, default=10, help="timed train steps per round (the same batches each)")
  p.add_argument("--rounds", type=int, default=3)
  p.add_argument("--eval-batches", type=int, default=0, help="also time this many validation batches")
  p.add_argument("--tower", default="hstu", choices=["hstu", "sasrec-ss", "sasrec-bce"],
                 help="the preset's tower (gem_jax.configs.seqrec)")
  p.add_argument("--quick", action="store_true", help="the --quick preset (ml-100k only; for tests)")
  p.add_argument("--out", default="runs/bench_seqrec_step.json")
  args = p.parse_args(argv)
  variants = {}
  for name, *overrides in args.variant:
    if name in variants or "=" in name:
      p.error(f"--variant {name!r}: each variant starts with a new name (no '='), then its KEY=VALUE overrides")
    variants[name] = overrides
  result = seqrec_step.compare(args.dataset, variants, steps=args.steps, rounds=args.rounds,
                               eval_batches=args.eval_batches, quick=args.quick, tower=args.tower,
                               log=lambda line: print(line, flush=True))
  os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
  with open(args.out, "w") as f:
    json.dump(result, f, indent=1)
  print(seqrec_step.table(result))
  return 0


if __name__ == "__main__":
  sys.exit(main())
