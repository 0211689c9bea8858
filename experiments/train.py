"""The main job: train a named GEM config on the synthetic ads stream.

  python experiments/train.py                          # small config, CPU, ~4 minutes on 2 cores
  python experiments/train.py --config tiny --out runs/tiny --set train.steps=50
  python experiments/train.py --out runs/default --resume   # continue from the last checkpoint
"""

import argparse
import json
import sys

from gem_jax import configs
from gem_jax.config import apply_overrides
from gem_jax.train.loop import train


def main(argv=None) -> int:
  p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("--config", default="small", choices=sorted(configs.CONFIGS), help="named config")
  p.add_argument("--out", default="runs/default", help="run folder (metrics.jsonl, checkpoints/, summary.json)")
  p.add_argument("--resume", action="store_true", help="continue from the last checkpoint in --out")
  p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                 help="override a config field, e.g. --set train.steps=200 (repeatable)")
  p.add_argument("--no-progress", action="store_true", help="no progress bar")
  args = p.parse_args(argv)
  cfg = apply_overrides(configs.get(args.config), args.set)
  summary = train(cfg, args.out, resume=args.resume, progress=not args.no_progress)
  print(json.dumps({"steps": summary["steps"], "examples_per_s": summary["examples_per_s"],
                    "tasks": summary["tasks"]}, indent=2))
  return 0


if __name__ == "__main__":
  sys.exit(main())
