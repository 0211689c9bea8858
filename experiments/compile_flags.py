"""XLA:CPU flag sets side by side: how long a config's train step takes to compile and to run under each.

  python experiments/compile_flags.py                      # tiny: default flags, level 0, level 0 + no fusion emitters
  python experiments/compile_flags.py --config small --repeats 3 --steps 20
  python experiments/compile_flags.py --config small --sets default ynn_dot onednn --steps 20   # run-time options

Each (flag set, repeat) is a fresh process on one CPU device with no compilation cache, run in alternating
order so the machine's drift falls on every set alike. A process builds the run, lowers and compiles its
train step (timed), then runs `--steps` steps and reports their median time, the time to compile 40 small
eager programs (the kind most of the test suite's compiles are), and the last loss, which shows whether a
flag changed the arithmetic. Printed: medians per set and their ratios to the first set. The test suite
(tests/conftest.py) compiles with the flag set that is cheapest to compile; this script is what says so.
"""

import argparse
import json
import os
import statistics
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from gem_jax.bench import xla_flags  # noqa: E402

SETS, ALL_SETS = xla_flags.COMPILE, xla_flags.ALL


def child(config: str, steps: int) -> dict:
  import time

  import jax
  import jax.numpy as jnp

  from gem_jax import configs
  from gem_jax.run.build import build

  run = build(configs.get(config))
  it = run.source.train_iterator()
  batches = [run.device_batch(next(it)) for _ in range(steps + 1)]
  lowered = run.train_step.lower(run.state, batches[0])
  t = time.perf_counter()
  compiled = lowered.compile()
  compile_s = time.perf_counter() - t
  state, times, loss = run.state, [], None
  for b in batches:
    t = time.perf_counter()
    state, metrics = compiled(state, b)
    jax.block_until_ready(metrics)
    times.append(time.perf_counter() - t)
    loss = float(metrics["loss"])
  t = time.perf_counter()
  for n in range(3, 43):  # 40 programs of distinct shapes
    jax.block_until_ready((jnp.arange(n) * 2 + 1).sum())
  eager_s = time.perf_counter() - t
  return {"compile_s": compile_s, "step_s": statistics.median(times[1:]), "eager40_s": eager_s, "loss": loss}


def main(argv=None) -> int:
  p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("--config", default="tiny")
  p.add_argument("--steps", type=int, default=10)
  p.add_argument("--repeats", type=int, default=2)
  p.add_argument("--sets", nargs="+", default=list(SETS), choices=list(ALL_SETS),
                 help="flag sets to compare, the first the baseline (default: the compile-time ones)")
  p.add_argument("--out", default=None, help="JSON of every run and the medians")
  p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
  args = p.parse_args(argv)
  if args.child:
    print(json.dumps(child(args.config, args.steps)))
    return 0
  sets = {name: ALL_SETS[name] for name in args.sets}
  runs = {name: [] for name in sets}
  for r in range(args.repeats):
    for name, flags in (sets.items() if r % 2 == 0 else list(sets.items())[::-1]):
      env = {k: v for k, v in os.environ.items() if not k.startswith("JAX_COMPILATION_CACHE")}
      env.update(JAX_PLATFORMS="cpu", XLA_FLAGS=flags)
      proc = subprocess.run([sys.executable, __file__, "--child", "--config", args.config, "--steps", str(args.steps)],
                            env=env, capture_output=True, text=True)
      if proc.returncode:
        raise SystemExit(f"{name}: the child failed:\n{proc.stderr[-3000:]}")
      runs[name].append(json.loads(proc.stdout.strip().splitlines()[-1]))
  medians = {name: {k: statistics.median(r[k] for r in rs) for k in ("compile_s", "step_s", "eager40_s")}
             for name, rs in runs.items()}
  first = medians[args.sets[0]]
  print(f"{args.config}: median of {args.repeats} fresh processes per flag set ({args.steps} steps each)")
  print(f"{'flags':24s} {'compile_s':>10s} {'x':>6s} {'step_s':>9s} {'x':>6s} {'eager40_s':>10s} {'x':>6s}  last loss")
  for name, m in medians.items():
    print(f"{name:24s} {m['compile_s']:10.2f} {m['compile_s'] / first['compile_s']:6.2f} {m['step_s']:9.4f} "
          f"{m['step_s'] / first['step_s']:6.2f} {m['eager40_s']:10.2f} {m['eager40_s'] / first['eager40_s']:6.2f}  "
          f"{runs[name][-1]['loss']!r}")
  if args.out:
    with open(args.out, "w") as f:
      json.dump({"config": args.config, "sets": sets, "runs": runs, "medians": medians}, f, indent=1)
  return 0


if __name__ == "__main__":
  sys.exit(main())
