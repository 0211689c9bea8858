"""The main job in this tree and in another checkout (say the previous commit), side by side on this machine:
results (click NE, gap closed), examples/s and MFU/HFU, medians over alternating runs (gem_jax/bench/ab_trees.py).

  git worktree add /tmp/prev HEAD~1
  python experiments/ab_default_job.py --baseline /tmp/prev --repeats 3 --out runs/ab
  python experiments/ab_default_job.py --baseline /tmp/prev -- --config tiny --set train.steps=50
  python experiments/ab_default_job.py --baseline /tmp/prev /tmp/older --repeats 2   # ratios against the last
"""

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from gem_jax.bench import ab_trees  # noqa: E402


def main(argv=None) -> int:
  p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("--baseline", nargs="+", required=True,
                 help="other checkouts' roots (e.g. git worktrees); ratios are against the last one")
  p.add_argument("--repeats", type=int, default=3, help="runs per tree (alternating order)")
  p.add_argument("--out", default="runs/ab", help="run folders and ab.json")
  p.add_argument("job_args", nargs="*", help="experiments/train.py arguments (after --); default: the main job")
  args = p.parse_args(argv)
  here = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  names = ["baseline"] if len(args.baseline) == 1 else [f"baseline{i}" for i in range(len(args.baseline))]
  trees = {"this": here, **dict(zip(names, args.baseline))}
  result = ab_trees.compare(trees, args.job_args, repeats=args.repeats, out_dir=args.out)
  os.makedirs(args.out, exist_ok=True)
  with open(os.path.join(args.out, "ab.json"), "w") as f:
    json.dump(result, f, indent=1)
  print(ab_trees.table(result))
  return 0


if __name__ == "__main__":
  sys.exit(main())
