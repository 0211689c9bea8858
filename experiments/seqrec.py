"""Sequential recommendation on public data: gem-jax's HSTU tower trained as a next-item model through the
trainer (checkpoints, --resume, any --mesh, report.json), evaluated by full ranking (HR@K, NDCG@K over every
item, history excluded) under the leave-one-out protocol (gem_jax/run/next_item.py).

  python experiments/seqrec.py --dataset ml-1m --out runs/seqrec-ml-1m       # ~88 min on 2 CPU cores
  python experiments/seqrec.py --dataset beauty --out runs/seqrec-beauty     # 22-41 min next to other runs
  python experiments/seqrec.py --dataset ml-100k --quick --out runs/seqrec-quick   # CI-sized check
  python experiments/seqrec.py --dataset ml-1m --set train.epochs=20 --set model.num_layers=4
  python experiments/seqrec.py --dataset ml-100k --quick --out runs/seqrec-quick --resume
  python experiments/seqrec.py --dataset beauty --tower sasrec-ss --out runs/seqrec-beauty-sasrec
  python experiments/seqrec.py --dataset beauty --seeds 3 --out runs/seqrec-beauty --results results/seqrec/beauty.json
  python experiments/seqrec.py --dataset ml-1m --train-through-valid 45 --out runs/seqrec-ml-1m-hstu-protocol
  python experiments/seqrec.py --dataset ml-1m --evaluate runs/seqrec-ml-1m --average 4500,4750,4800

Datasets (--data-dir, default ../shared/data or $GEM_JAX_DATA_DIR; the files are never copied here):
  ml-1m    ml-1m/ratings.dat (GroupLens) if present, else ml-1m/ml-1m_sequences_orig_ids.txt
  ml-100k  ml-100k/u.data
  beauty, sports, toys   amazon-s3rec/{Beauty,Sports_and_Outdoors,Toys_and_Games}.txt (S3-Rec format)
Writes the run folder (metrics.jsonl, checkpoints/, best/, summary.json, report.json) and results.json:
validation and test metrics of the kept evaluation, a most-popular baseline, every evaluation, the config
and the wall times. With --seeds N: one such folder per seed (OUT/seed-0, ...; train.seed and data.seed set
to it) and OUT/seeds.json with the mean, standard deviation and per-seed HR@10 / NDCG@10 of validation and
test; --results also writes that summary (the file format of results/seqrec/*.json).
--train-through-valid EPOCHS is HSTU's protocol: the validation item is trained on as well, nothing is
evaluated during training and the test split is read once after EPOCHS epochs (no validation metrics).
"""

import argparse
import json
import os
import sys


def main(argv=None) -> int:
  p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("--dataset", required=True, choices=["ml-1m", "ml-100k", "beauty", "sports", "toys"])
  p.add_argument("--data-dir", default=None, help="root holding ml-1m/, ml-100k/, amazon-s3rec/")
  p.add_argument("--out", default=None, help="run folder (default runs/seqrec-DATASET)")
  p.add_argument("--quick", action="store_true", help="small model, few epochs (ml-100k only; for tests)")
  p.add_argument("--tower", default="hstu", choices=["hstu", "sasrec-ss", "sasrec-bce"],
                 help="the sequence tower's recipe: gem-jax's HSTU, or SASRec with sampled softmax (eSASRec's "
                      "SASRec+SS) or with BCE (the original SASRec) on the same code (gem_jax/configs.py)")
  p.add_argument("--mesh", default=None, help="mesh file (meshes/*.yaml); default: one device")
  p.add_argument("--resume", action="store_true", help="continue from the last checkpoint in --out")
  p.add_argument("--no-report", action="store_true", help="skip the efficiency report")
  p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                 help="override a config field, e.g. --set train.epochs=20 --set model.dim=64 (repeatable)")
  p.add_argument("--evaluate", default=None, metavar="RUN_DIR",
                 help="no training: evaluate the kept (best/) parameters of a finished run under this command's "
                      "config, e.g. --set data.exclude_history=false, and print the metrics as JSON")
  p.add_argument("--average", default=None, metavar="STEPS",
                 help="with --evaluate: evaluate the mean of the parameters of these training checkpoints (e.g. "
                      "4500,4750,4800; checkpoint averaging after the fact) next to each one's own metrics")
  p.add_argument("--train-through-valid", type=int, default=0, metavar="EPOCHS",
                 help="HSTU's protocol: train on the validation item too and test the parameters after EPOCHS "
                      "epochs (data.train_through_valid; no periodic evaluation, no model selection)")
  p.add_argument("--seeds", type=int, default=0, help="train seeds 0..N-1, one folder each, and summarize them")
  p.add_argument("--results", default=None, help="with --seeds: also write the seed summary to this JSON file")
  args = p.parse_args(argv)
  if args.results and not args.seeds:
    p.error("--results needs --seeds")
  if args.average and not args.evaluate:
    p.error("--average needs --evaluate RUN_DIR")
  if args.evaluate:   # nothing is trained or written: flags about a training run would be ignored
    ignored = [f for f, on in (("--out", args.out), ("--seeds", args.seeds), ("--resume", args.resume),
                               ("--train-through-valid", args.train_through_valid)) if on]
    if ignored:
      p.error(f"--evaluate trains nothing, so {', '.join(ignored)} would be ignored")
  set_keys = {kv.split("=", 1)[0] for kv in args.set}
  seeded = sorted(set_keys & {"train.seed", "data.seed"})
  if args.seeds and seeded:
    p.error(f"--seeds sets train.seed and data.seed per run; drop --set {' '.join(seeded)}")
  fixed = {"train.epochs", "train.select_metric", "train.patience", "train.eval_every_epochs"}
  if args.train_through_valid and set_keys & fixed:
    p.error(f"--train-through-valid sets {sorted(fixed)}; drop --set {' '.join(sorted(set_keys & fixed))}")

  from gem_jax import configs
  from gem_jax.config import apply_overrides
  from gem_jax.train import jobs

  sets = list(args.set) + ([f"data.data_dir={os.path.normpath(args.data_dir)}"] if args.data_dir else []) + \
      ([f"mesh={args.mesh}"] if args.mesh else [])
  if args.train_through_valid:
    sets += ["data.train_through_valid=true", f"train.epochs={args.train_through_valid}", "train.select_metric=",
             "train.patience=0", "train.eval_every_epochs=0"]
  cfg = apply_overrides(configs.seqrec(args.dataset, quick=args.quick, tower=args.tower), sets)
  if args.evaluate and args.average:
    try:
      steps = [int(s) for s in args.average.split(",")]
    except ValueError:
      p.error(f"--average takes checkpoint steps separated by commas, got {args.average!r}")
    print(json.dumps({"run": args.evaluate, **jobs.evaluate_average(cfg, args.evaluate, steps)}, indent=1))
    return 0
  if args.evaluate:
    # A run trained through validation selected nothing: its parameters are the last checkpoint's.
    result = jobs.evaluate_checkpoint(cfg, args.evaluate,
                                      folder="checkpoints" if cfg.data.train_through_valid else "best")
    print(json.dumps({"run": args.evaluate, "step": result["step"], **result["evaluation"]}, indent=1))
    return 0
  out = args.out or f"runs/seqrec-{args.dataset}"
  if not args.seeds:
    jobs.train_next_item(cfg, out, resume=args.resume, report=not args.no_report)
    return 0
  command = " ".join(["python experiments/seqrec.py"] + [a for a in (argv if argv is not None else sys.argv[1:])])
  summary = jobs.train_next_item_seeds(cfg, out, list(range(args.seeds)), resume=args.resume,
                                       report=not args.no_report, command=command)
  if args.results:
    os.makedirs(os.path.dirname(os.path.abspath(args.results)), exist_ok=True)
    with open(args.results, "w") as f:
      json.dump({"dataset": args.dataset, **summary}, f, indent=1)
  return 0


if __name__ == "__main__":
  from gem_jax import malloc_env
  malloc_env.relaunch_with_huge_pages()   # glibc reads its huge-page tunable only when a process starts
  sys.exit(main())
