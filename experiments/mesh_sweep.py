"""Runs one config on several mesh files and reports, per mesh, what the compiled step moves and holds
(gem_jax/observe/mesh_sweep.py: losses, memory, comm by kind and axis, dense traffic vs the analytic HSDP
volume, embedding all-to-all vs ideal bytes).

  python experiments/mesh_sweep.py --meshes meshes/cpu_*.yaml --out sweep.json
  python experiments/mesh_sweep.py --meshes meshes/cpu_1.yaml meshes/cpu_16_5d.yaml --steps 5 --batch-size 64

CPU meshes run on virtual devices (as many as the largest mesh needs, set before jax starts). Every mesh
trains the same model from the same seed on the same batches; `max_rel_loss_diff` compares each one's
losses with the first mesh's.
"""

import argparse
import glob
import json
import math
import sys


def _mesh_devices(path: str) -> int:
  import yaml
  with open(path) as f:
    axes = (yaml.safe_load(f) or {}).get("axes") or {}
  return math.prod(int(v) for v in axes.values()) if isinstance(axes, dict) and axes else 1


def main(argv=None) -> int:
  p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("--meshes", nargs="+", default=sorted(glob.glob("meshes/cpu_*.yaml")))
  p.add_argument("--config", default="tiny")
  p.add_argument("--steps", type=int, default=20)
  p.add_argument("--batch-size", type=int, default=256,
                 help="global batch (must divide over every mesh's data shards); larger batches make the "
                      "per-shard id counts, and so the all-to-all capacity, less noisy")
  p.add_argument("--capacity-slack", type=float, default=1.05,
                 help="all-to-all slots per destination = slack x the first batch's largest need")
  p.add_argument("--capacity-multiple", type=int, default=1, help="round capacities up to this")
  p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
  p.add_argument("--out", default="sweep.json")
  args = p.parse_args(argv)

  from gem_jax.parallel import distributed
  distributed.setup(distributed.ProcessSetup(cpu_devices=max(_mesh_devices(m) for m in args.meshes)))

  from gem_jax import configs
  from gem_jax.config import apply_overrides
  from gem_jax.observe import mesh_sweep
  result = mesh_sweep.sweep(apply_overrides(configs.get(args.config), args.set), args.meshes, steps=args.steps,
                            batch_size=args.batch_size, capacity_slack=args.capacity_slack,
                            capacity_multiple=args.capacity_multiple)
  with open(args.out, "w") as f:
    json.dump(result, f, indent=2)
  print("\n" + mesh_sweep.table(result))
  return 0


if __name__ == "__main__":
  sys.exit(main())
