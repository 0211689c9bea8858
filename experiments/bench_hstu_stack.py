"""HSTU layer stacks, one training step each (forward, backward, AdamW; float32) over heavy-tailed jagged rows
(gem_jax/bench/hstu_stack.py says what is measured and how).

  python experiments/bench_hstu_stack.py                          # stacks S and M, impls xla, cpp, dense, reference
  python experiments/bench_hstu_stack.py --stacks S --impls xla --reps 20
  python experiments/bench_hstu_stack.py --no-rel-bias              # the layers without the relative bias
  python experiments/bench_hstu_stack.py --tiles --reps 10          # the attention alone at each tile config
  python experiments/bench_hstu_stack.py --dense-dots --reps 5      # the dense attention's dots alone: a floor
  git worktree add /tmp/prev HEAD~1
  python experiments/bench_hstu_stack.py --baseline /tmp/prev     # the same stacks in another checkout, side by side
  python experiments/bench_hstu_stack.py --impls xla --flag-sets default ynn_dot onednn   # XLA:CPU options

Written to --out: every run and the medians (JSON); printed: a table with each tree's median step time,
tokens/s and share of the GEMM, and with --baseline the tokens/s ratio.
"""

import argparse
import json
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _bench_module():
  """This tree's gem_jax/bench/hstu_stack.py, loaded from its file with the measured tree's gem_jax first on the
  path (GEM_JAX_TREE, set for a child process; this tree by default): the bench is this tree's, the model the
  measured tree's, so an older checkout without the bench can be measured too."""
  import importlib.util
  sys.path.insert(0, os.environ.get("GEM_JAX_TREE", ROOT))
  spec = importlib.util.spec_from_file_location("gem_jax_bench_hstu_stack",
                                                os.path.join(ROOT, "gem_jax", "bench", "hstu_stack.py"))
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module


def main(argv=None) -> int:
  hstu_stack = _bench_module()
  p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("--stacks", nargs="+", default=list(hstu_stack.STACKS), choices=list(hstu_stack.STACKS))
  p.add_argument("--impls", nargs="+", default=list(hstu_stack.DEFAULT_IMPLS), choices=list(hstu_stack.IMPLS))
  p.add_argument("--reps", type=int, default=10, help="timed steps per process (after one compile step)")
  p.add_argument("--rounds", type=int, default=3, help="fresh processes per (stack, impl, tree)")
  p.add_argument("--seed", type=int, default=0)
  p.add_argument("--no-rel-bias", action="store_true", help="layers without the relative position bias "
                 "(model.hstu.rel_pos_buckets=0): what the bias costs")
  p.add_argument("--baseline", default=None, help="another checkout's root (e.g. a git worktree of HEAD~1)")
  p.add_argument("--flag-sets", nargs="+", default=None, metavar="NAME",
                 help="compare XLA_FLAGS sets of gem_jax/bench/xla_flags.py (the first the baseline) in this tree")
  p.add_argument("--tiles", action="store_true", help="instead: each stack's attention alone at every tile config "
                 "of the xla impl (pallas_kernels/hstu_attention/tiled.py CANDIDATES), in this process")
  p.add_argument("--dense-dots", action="store_true", help="instead: the batched dots of the dense padded attention "
                 "(impl reference) alone at each stack's shapes, and their total per step: a floor for that impl")
  p.add_argument("--out", default="runs/bench_hstu_stack.json")
  p.add_argument("--child", nargs=2, metavar=("STACK", "IMPL"), help=argparse.SUPPRESS)
  args = p.parse_args(argv)
  if args.tiles and args.dense_dots:
    p.error("--tiles and --dense-dots are two different measurements; pick one")
  if (args.tiles or args.dense_dots) and (args.baseline or args.flag_sets):
    p.error("--baseline and --flag-sets compare whole stacks; --tiles / --dense-dots do not read them")
  if args.dense_dots and args.no_rel_bias:
    p.error("--dense-dots times the attention's dots, which have no relative bias; --no-rel-bias means nothing there")
  if args.child:
    print(json.dumps(hstu_stack.child(*args.child, args.reps, args.seed, not args.no_rel_bias)))
    return 0
  if args.dense_dots:
    rows = [hstu_stack.dense_dots(stack, reps=args.reps, seed=args.seed) for stack in args.stacks]
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
      json.dump(rows, f, indent=1)
    print("\n".join(hstu_stack.dense_dots_table(r) for r in rows))
    return 0
  if args.tiles:
    rows = [r for stack in args.stacks
            for r in hstu_stack.tile_configs(stack, reps=args.reps, seed=args.seed, rel_bias=not args.no_rel_bias)]
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
      json.dump(rows, f, indent=1)
    print(hstu_stack.tiles_table(rows))
    return 0
  trees = {"this": ROOT, **({"baseline": args.baseline} if args.baseline else {})}
  flag_sets = None
  if args.flag_sets:
    sys.path.insert(0, ROOT)
    from gem_jax.bench import xla_flags
    unknown = [n for n in args.flag_sets if n not in xla_flags.ALL]
    if unknown or args.baseline:
      p.error(f"--flag-sets: unknown {unknown}, known {sorted(xla_flags.ALL)}" if unknown
              else "--flag-sets compares within this tree; drop --baseline")
    flag_sets = {n: xla_flags.ALL[n] for n in args.flag_sets}
  result = hstu_stack.compare(trees, args.stacks, args.impls, reps=args.reps, rounds=args.rounds, seed=args.seed,
                              rel_bias=not args.no_rel_bias, flag_sets=flag_sets,
                              log=lambda line: print(line, flush=True))
  os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
  with open(args.out, "w") as f:
    json.dump(result, f, indent=1)
  print(hstu_stack.table(result))
  return 0


if __name__ == "__main__":
  if "--child" in sys.argv:   # the measured tree's allocator settings, huge pages included, if it has them
    sys.path.insert(0, os.environ.get("GEM_JAX_TREE", ROOT))
    try:
      from gem_jax import malloc_env
    except ImportError:
      malloc_env = None
    if malloc_env is not None:
      malloc_env.relaunch_with_huge_pages()
  sys.exit(main())
