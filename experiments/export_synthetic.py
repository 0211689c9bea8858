"""Write a named config's synthetic ads stream as Parquet files with their feature-spec file.

  python experiments/export_synthetic.py --config tiny --examples 20000 --out runs/tiny_parquet
  python experiments/train.py --config tiny --data runs/tiny_parquet --out runs/tiny_from_files

The second command trains on the files the first wrote: same batches, same losses as the stream itself.
With --readers R the rows are laid out so that a run with data.readers=R (R processes, one reader each, or
one process with --set data.readers=R) reads the stream's batches too.
"""

import argparse
import json


def main(argv=None) -> int:
  p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("--config", default="small", help="named config with the synthetic source (gem_jax/configs.py)")
  p.add_argument("--examples", type=int, required=True, help="training examples (rounded up to whole batches)")
  p.add_argument("--out", required=True, help="folder for spec.yaml, train/ and eval/")
  p.add_argument("--rows-per-file", type=int, default=1 << 20)
  p.add_argument("--row-group-rows", type=int, default=65536)
  p.add_argument("--readers", type=int, default=1, help="lay the rows out for this many readers (data.readers)")
  p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="config override (repeatable)")
  args = p.parse_args(argv)
  from gem_jax import configs
  from gem_jax.config import apply_overrides
  from gem_jax.data import export
  cfg = apply_overrides(configs.get(args.config), args.set)
  rows = export.export_synthetic(cfg, args.out, args.examples, readers=args.readers, rows_per_file=args.rows_per_file,
                                 row_group_rows=args.row_group_rows)
  print(json.dumps({"out": args.out, "rows": rows}))
  return 0


if __name__ == "__main__":
  raise SystemExit(main())
