"""MovieLens-100K: base rate, logistic regression, GEM without history and GEM, AUC and NE per task on the
time-split evaluation set (gem_jax/bench/movielens.py), written to results/movielens-100k.json.

  python experiments/prepare_movielens.py --data-dir ../shared/data --out runs/movielens-100k
  python experiments/movielens_baselines.py --data runs/movielens-100k     # ~15 minutes on 2 cores
"""

import argparse
import json
import os


def main(argv=None) -> int:
  p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("--data", default="runs/movielens-100k", help="a folder prepare_movielens.py wrote")
  p.add_argument("--out", default="runs/movielens_baselines", help="run folders of the two GEM runs")
  p.add_argument("--results", default="results/movielens-100k.json")
  p.add_argument("--steps", type=int, default=None, help="GEM steps (default: the movielens config's)")
  args = p.parse_args(argv)
  from gem_jax.bench import movielens
  results = movielens.run(args.data, args.out, args.steps)
  os.makedirs(os.path.dirname(args.results) or ".", exist_ok=True)
  with open(args.results, "w") as f:
    json.dump(results, f, indent=2)
  print(movielens.table(results))
  print(json.dumps({"wall_s": results["wall_s"], "steps": results["steps"]}))
  return 0


if __name__ == "__main__":
  raise SystemExit(main())
