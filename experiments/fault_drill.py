"""Fault drill: SIGKILL the trainer at random points, resume it each time, compare with an unbroken run
(gem_jax/train/fault_drill.py says how).

  python experiments/fault_drill.py --kills 5 --out drill.json           # ~2 min on 2 CPU cores
  python experiments/fault_drill.py --kills 3 --steps 12 --out drill.json   # the CI size
  python experiments/fault_drill.py --processes 2 --mesh meshes/cpu_8.yaml --kills 3 \
      --set train.host_tables=user_id,ad_id --out drill_2p.json   # 2 processes x 4 devices, host tables

Writes --out (JSON): `identical` (every per-step loss, the final train state and the final evaluation bit
for bit equal), the kill points, the steps lost per kill and wall times. Exit status 0 only when identical.
"""

import argparse
import json
import sys


def main(argv=None) -> int:
  p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("--kills", type=int, default=5, help="how many times to SIGKILL the trainer")
  p.add_argument("--out", default="drill.json", help="where to write the result (JSON)")
  p.add_argument("--steps", type=int, default=30)
  p.add_argument("--checkpoint-every", type=int, default=4)
  p.add_argument("--seed", type=int, default=0, help="seeds the choice of kill points")
  p.add_argument("--config", default="tiny")
  p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="config override (repeatable)")
  p.add_argument("--workdir", default=None, help="where the two runs go (default: a temporary folder, deleted "
                 "when the drill passes)")
  p.add_argument("--keep-runs", action="store_true", help="keep the temporary run folders")
  p.add_argument("--timeout", type=float, default=900, help="seconds one start of the trainer may take")
  p.add_argument("--processes", type=int, default=1, help="trainer processes per start (multi-process mode: each "
                 "kill takes one of them, the others are killed --grace seconds later, all restart)")
  p.add_argument("--mesh", default=None, help="mesh file the processes split (default: one device per process)")
  p.add_argument("--grace", type=float, default=5.0, help="multi-process: seconds the other processes may run on "
                 "after one is killed")
  p.add_argument("--reference", choices=("group", "one"), default="group", help="multi-process: the unbroken "
                 "run as a group of --processes (default), or one process holding all of the mesh's devices (one "
                 "compile instead of one per process; also claims the group trains what one process trains)")
  args = p.parse_args(argv)
  from gem_jax.train import fault_drill
  try:
    spec = fault_drill.Drill(args.kills, args.steps, args.checkpoint_every, args.seed, args.config, tuple(args.set),
                             args.workdir, args.keep_runs, args.timeout, args.processes, args.mesh, args.grace,
                             args.reference)
  except ValueError as e:
    p.error(str(e))
  result = fault_drill.drill(spec)
  with open(args.out, "w") as f:
    json.dump(result, f, indent=2)
  print(json.dumps({k: result[k] for k in ("identical", "steps_lost", "total_steps_lost", "wall_s")}), flush=True)
  print(f"wrote {args.out}", flush=True)
  return 0 if result["identical"] else 1


if __name__ == "__main__":
  sys.exit(main())
