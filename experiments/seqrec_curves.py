"""Validation curves of next-item runs side by side, at equal epochs: runs stopped early for time (no
results.json) compare here, where experiments/seqrec_ablations.py needs finished runs.

  python experiments/seqrec_curves.py preset=runs/sports-seed0 t0.07=runs/sports-t007 --out curves.json
  python experiments/seqrec_curves.py a=runs/x b=runs/y --metric HR@10

Each argument is LABEL=RUN_FOLDER (experiments/seqrec.py's --out); the label says what the run changed.
Printed: an epoch x run table of the validation metric; written (--out): every run's HR@10 and NDCG@10 at
every evaluated epoch, with this command.
"""

import argparse
import json
import os
import shlex
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def main(argv=None) -> int:
  p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("runs", nargs="+", metavar="LABEL=RUN_FOLDER")
  p.add_argument("--metric", default="NDCG@10", choices=("HR@10", "NDCG@10"))
  p.add_argument("--out", default=None, help="write the curves to this JSON file")
  args = p.parse_args(argv)
  runs = {}
  for item in args.runs:
    label, sep, folder = item.partition("=")
    if not sep or not label or not folder:
      p.error(f"expected LABEL=RUN_FOLDER, got {item!r}")
    if label in runs:
      p.error(f"label {label!r} given twice")
    runs[label] = folder

  from gem_jax.train import seqrec_results
  found = seqrec_results.curves(runs)
  print(seqrec_results.curves_markdown(found, args.metric))
  if args.out:
    with open(args.out, "w") as f:
      json.dump({"runs": {k: {"folder": runs[k],
                              "valid": {str(e): v for e, v in sorted(points.items())}} for k, points in found.items()},
                 "command": shlex.join(["python", "experiments/seqrec_curves.py", *args.runs])}, f, indent=1)
  return 0


if __name__ == "__main__":
  sys.exit(main())
