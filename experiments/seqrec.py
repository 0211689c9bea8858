"""Sequential recommendation on public data: gem-jax's HSTU tower trained as a next-item model, evaluated
by full ranking (HR@K, NDCG@K over every item, history excluded) under the leave-one-out protocol.

  python experiments/seqrec.py --dataset ml-1m --out runs/seqrec-ml-1m       # ~67 min on 2 CPU cores
  python experiments/seqrec.py --dataset beauty --out runs/seqrec-beauty     # ~14 min
  python experiments/seqrec.py --dataset ml-100k --quick --out runs/seqrec-quick   # CI-sized check
  python experiments/seqrec.py --dataset ml-1m --set epochs=20 --set model.num_layers=4

Datasets (--data-dir, default ../shared/data; the files are never copied into this repository):
  ml-1m    ml-1m/ratings.dat (GroupLens) if present, else ml-1m/ml-1m_sequences_orig_ids.txt
  ml-100k  ml-100k/u.data
  beauty, sports, toys   amazon-s3rec/{Beauty,Sports_and_Outdoors,Toys_and_Games}.txt (S3-Rec format)
Writes DIR/results.json: validation and test metrics of the kept epoch, a most-popular baseline, the
per-evaluation history, the config and the wall times.
"""

import argparse
import os
import sys


def main(argv=None) -> int:
  p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("--dataset", required=True, choices=["ml-1m", "ml-100k", "beauty", "sports", "toys"])
  p.add_argument("--data-dir", default=os.path.join(os.path.dirname(__file__), "..", "..", "shared", "data"),
                 help="root holding ml-1m/, ml-100k/, amazon-s3rec/ (default: ../shared/data)")
  p.add_argument("--out", default=None, help="run folder for results.json (default runs/seqrec-DATASET)")
  p.add_argument("--quick", action="store_true", help="small model, few epochs (ml-100k only; for tests)")
  p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                 help="override a SeqRecConfig field, e.g. --set epochs=20 --set model.dim=64 (repeatable)")
  args = p.parse_args(argv)

  from gem_jax.config import apply_overrides
  from gem_jax.data import seqrec as data
  from gem_jax.train import seqrec

  cfg = apply_overrides(seqrec.preset(args.dataset, quick=args.quick), args.set)
  ds = data.load(args.dataset, os.path.normpath(args.data_dir))
  seqrec.train_and_evaluate(cfg, ds, out_dir=args.out or f"runs/seqrec-{args.dataset}")
  return 0


if __name__ == "__main__":
  sys.exit(main())
