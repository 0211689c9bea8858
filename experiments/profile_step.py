"""Where a config's train step spends its time, by place in the code (gem_jax/observe/op_profile.py).

  python experiments/profile_step.py                                   # the main job (small), 3 traced steps
  python experiments/profile_step.py --config tiny --steps 5 --top 40
  python experiments/profile_step.py --config seqrec_ml-1m --set model.num_layers=4 --out prof.json
  python experiments/profile_step.py --config small --by opcode        # per HLO opcode instead
  python experiments/profile_step.py --config small --ops 30           # and the 30 slowest instructions
  python experiments/profile_step.py --stack S                         # bench_hstu_stack.py's stack S

The step is compiled once and run `--warmup` steps, then `--steps` steps under jax.profiler; each executed
HLO instruction's exclusive busy time goes to the source line that made it (a Dense layer's GEMMs to its
site). Printed: the `--top` places with ms per step, share of all traced busy time, pass (fwd/bwd) and their
main opcodes, and the wall time per step. On the CPU busy time is summed over XLA's worker threads, so read
shares; what the time is worth comes from benchmarks that compare side by side.
"""

import argparse
import collections
import json
import os
import statistics
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)


def main(argv=None) -> int:
  p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("--config", default=None, help="named config (gem_jax/configs.py; default small)")
  p.add_argument("--stack", choices=("S", "M"), default=None,
                 help="profile an HSTU stack of experiments/bench_hstu_stack.py instead of a config")
  p.add_argument("--impl", default=None, help="with --stack: the attention impl (default xla)")
  p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="config override (repeatable)")
  p.add_argument("--warmup", type=int, default=2, help="untraced steps after the compile")
  p.add_argument("--steps", type=int, default=3, help="traced steps")
  p.add_argument("--top", type=int, default=25, help="rows printed")
  p.add_argument("--by", choices=("place", "opcode"), default="place")
  p.add_argument("--ops", type=int, default=0, metavar="N", help="also print the N slowest single instructions")
  p.add_argument("--trace-dir", default=None, help="keep the trace here (default: a temporary folder)")
  p.add_argument("--out", default=None, help="write every row (JSON)")
  args = p.parse_args(argv)
  if args.steps < 1 or args.warmup < 0:
    p.error("--steps must be >= 1 and --warmup >= 0")
  if args.stack and (args.config or args.set):
    p.error("--stack profiles a stack of bench_hstu_stack.py, which --config and --set do not change")
  if args.impl and not args.stack:
    p.error("--impl goes with --stack; a config's attention impl is --set model.hstu.attn_impl=...")

  from gem_jax import configs   # first: gem_jax sets up XLA's environment before jax starts (gem_jax/xla_env.py)
  import jax
  from gem_jax.config import apply_overrides
  from gem_jax.observe import op_profile, profile
  from gem_jax.run.build import build

  if args.stack:
    from gem_jax.bench import hstu_stack
    impl = args.impl or "xla"
    name = f"stack {args.stack} ({impl})"
    step, args_in, _ = hstu_stack.build_step(args.stack, impl, seed=0)
    compiled = step.lower(*args_in).compile()
    carry = list(args_in)

    def run_step(_):
      carry[0], carry[1], loss = compiled(*carry)
      return loss
  else:
    name = args.config or "small"
    run = build(apply_overrides(configs.get(name), args.set))
    batches = op_profile.same_shape_batches(run, args.warmup + args.steps + 1)
    compiled = run.train_step.lower(run.state, batches[0]).compile()
    carry = [run.state]

    def run_step(i):
      carry[0], metrics = compiled(carry[0], batches[i % len(batches)])
      return metrics

  ops = op_profile.hlo_ops(op_profile.module_text(compiled))
  for i in range(args.warmup + 1):
    jax.block_until_ready(run_step(i))
  trace_dir = args.trace_dir or tempfile.mkdtemp(prefix="gem_jax_profile_")
  jax.profiler.start_trace(trace_dir, profiler_options=profile.trace_options())
  walls = []
  for i in range(args.warmup + 1, args.warmup + 1 + args.steps):
    t = time.perf_counter()
    jax.block_until_ready(run_step(i))
    walls.append(time.perf_counter() - t)
  jax.profiler.stop_trace()
  path = profile.latest_trace(trace_dir)
  if path is None:
    print(f"no trace written under {trace_dir}", file=sys.stderr)
    return 1
  busy = op_profile.exclusive_busy(jax.profiler.ProfileData.from_file(path).planes)
  if not busy:
    print(f"{path}: the trace has no XLA op events for this backend", file=sys.stderr)
    return 1
  if args.by == "opcode":
    ops = {n: op_profile.HloOp(op.name, op.opcode, "", f"({op.opcode})", op.backward) for n, op in ops.items()}
  rows = op_profile.attribute(busy, ops, args.steps)
  unmatched = sum(1 for name in busy if name not in ops)
  print(f"{name} on {jax.default_backend()}: wall {1e3 * statistics.median(walls):.1f} ms/step (median of "
        f"{args.steps}), traced busy {sum(r['ms_per_step'] for r in rows):.1f} ms/step over "
        f"{len(busy)} instructions ({unmatched} not found in the program)")
  print(op_profile.table(rows, args.top))
  if args.ops:
    print(f"\nthe {args.ops} slowest instructions (ms/step, opcode, name, place, op_name):")
    for n, ns in sorted(busy.items(), key=lambda kv: -kv[1])[:args.ops]:
      op = ops.get(n)
      print(f"{ns / 1e6 / args.steps:9.2f}  {op.opcode if op else '?':<14} {n:<28} {op_profile.place_of(op, n)}  "
            f"{op.op_name if op else ''}")
  by_pass = collections.Counter()
  for r in rows:
    by_pass[r["pass"]] += r["share"]
  print("by pass: " + ", ".join(f"{k} {100 * v:.1f}%" for k, v in by_pass.most_common()))
  if args.out:
    with open(args.out, "w") as f:
      json.dump({"profiled": name, "sets": args.set, "backend": jax.default_backend(),
                 "wall_ms_per_step": [1e3 * w for w in walls], "rows": rows}, f, indent=1)
  return 0


if __name__ == "__main__":
  sys.exit(main())
