"""MovieLens-100K -> Parquet impression rows for the GEM trainer (gem_jax/data/movielens.py says how).

  python experiments/prepare_movielens.py --data-dir ../shared/data --out runs/movielens-100k
  python experiments/train.py --config movielens --data runs/movielens-100k --out runs/movielens

The data stays where it is and in --out: its terms forbid redistribution, so never commit either.
"""

import argparse
import json


def main(argv=None) -> int:
  p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("--data-dir", default="../shared/data", help="the folder that holds ml-100k/")
  p.add_argument("--out", default="runs/movielens-100k", help="folder for spec.yaml, train/, eval/")
  args = p.parse_args(argv)
  from gem_jax.data import movielens
  print(json.dumps(movielens.prepare(args.data_dir, args.out), indent=2))
  return 0


if __name__ == "__main__":
  raise SystemExit(main())
