"""The ablation table of next-item runs: for each run folder of experiments/seqrec.py, what its config changed
against the dataset's preset and the kept evaluation's validation HR@10 / NDCG@10 (gem_jax/train/seqrec_results.py).

  python experiments/seqrec_ablations.py runs/abl-beauty-* --out results/seqrec/ablations-beauty.json

Prints a markdown table (validation only: ablations are chosen on it) and writes the rows, test metrics
included, as JSON.
"""

import argparse
import json
import sys


def main(argv=None) -> int:
  p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("runs", nargs="+", help="run folders holding results.json")
  p.add_argument("--out", default=None, help="write the rows to this JSON file")
  args = p.parse_args(argv)

  from gem_jax.train import seqrec_results
  rows = seqrec_results.ablation_rows(args.runs)
  print(seqrec_results.markdown(rows))
  if args.out:
    with open(args.out, "w") as f:
      json.dump({"rows": rows, "command": "python experiments/seqrec_ablations.py " + " ".join(args.runs)}, f,
                indent=1)
  return 0


if __name__ == "__main__":
  sys.exit(main())
