"""Plans the mesh of a config on N devices: ranks every 5D layout by simulated step time among those that
fit in HBM, compares the best with naive layouts, and writes it as a mesh file (gem_jax/observe/plan.py).

  python experiments/plan_mesh.py --config large --devices 1024 --hardware h200 \\
      --out-mesh meshes/plan_large_1024.yaml --json plan.json          # ~35 s on one CPU core
  python experiments/plan_mesh.py --config base --devices 64 --hardware h100 --top 5

Hand-written mesh files of the same device count and device (meshes/*.yaml, not the planned ones) are
compared too, or the ones given with --baseline-mesh. Nothing is compiled: the numbers are the cluster simulator's.
"""

import argparse
import glob
import json
import os
import shlex
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


PLANNED = "# Planned by experiments/plan_mesh.py"  # the first line of a mesh file this script wrote


def _matching_meshes(devices: int, device_name: str) -> list[str]:
  """Hand-written mesh files (meshes/*.yaml, not ones this script wrote) for this many devices of this
  device type."""
  from gem_jax.parallel import mesh as mesh_lib
  out = []
  for path in sorted(glob.glob(os.path.join(ROOT, "meshes", "*.yaml"))):
    with open(path) as f:
      if f.readline().startswith(PLANNED):
        continue
    spec = mesh_lib.load(path)
    if spec.num_devices == devices and spec.hardware.device == device_name:
      out.append(path)
  return out


def main(argv=None) -> dict:
  p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("--config", required=True, help="named config (gem_jax/configs.py)")
  p.add_argument("--devices", type=int, required=True, help="how many devices (a multiple of a node)")
  p.add_argument("--hardware", default="h200", help="hardware preset (gem_jax/observe/plan.py HARDWARE)")
  p.add_argument("--out-mesh", default=None, help="write the best layout here as a mesh file")
  p.add_argument("--json", default=None, help="write the ranked table, baselines and counts here")
  p.add_argument("--top", type=int, default=10, help="rows of the ranked table")
  p.add_argument("--baseline-mesh", action="append", default=None, metavar="PATH",
                 help="hand-written mesh file to compare with (repeatable; default: meshes/*.yaml of the same "
                      "device count and device)")
  p.add_argument("--batch-size", type=int, default=None, help="global batch (default: the config's)")
  p.add_argument("--mean-history", type=float, default=None, help="one history length for every row")
  p.add_argument("--overlap", type=float, default=0.9, help="share of compute parameter traffic hides behind")
  p.add_argument("--efficiency", type=float, default=0.5, help="share of peak FLOP/s the compute reaches")
  p.add_argument("--max-tensor", type=int, default=8)
  p.add_argument("--max-context", type=int, default=8)
  args = p.parse_args(argv)

  t0 = time.perf_counter()
  from gem_jax import configs
  from gem_jax.observe import plan as plan_lib
  from gem_jax.parallel import mesh as mesh_lib

  try:  # bad input: a usage error that names it, not a traceback
    cfg = configs.get(args.config)
    preset = plan_lib.get_preset(args.hardware)
    paths = (args.baseline_mesh if args.baseline_mesh is not None
             else _matching_meshes(args.devices, preset.hardware.device))
    result = plan_lib.plan(cfg, args.devices, preset, batch_size=args.batch_size, mean_history=args.mean_history,
                           overlap=args.overlap, efficiency=args.efficiency, max_tensor=args.max_tensor,
                           max_context=args.max_context, baseline_meshes=[mesh_lib.load(x) for x in paths])
  except (KeyError, ValueError) as e:
    p.error(str(e).strip('"'))
  c = result.counts
  print(f"{cfg.name} on {args.devices} x {preset.hardware.device} ({args.devices // preset.devices_per_node} nodes "
        f"of {preset.devices_per_node}), global batch {result.batch_size}: {c['axis_sizes']} axis sizes x table "
        f"rules = {c['sizes_and_rules']}, {c['pruned_tables_exceed_hbm']} pruned (tables alone exceed HBM), "
        f"{c['simulated']} simulated, {c['layouts_timed']} layouts timed with their node placements, "
        f"{c['fitting']} fit.")
  print()
  print("\n".join(plan_lib.table(result, args.top)))
  print()
  if result.ranked:
    print("\n".join(plan_lib.explain(result)))
  else:
    print(f"No layout fits in {preset.hardware.hbm_bytes / 1e9:.0f} GB per device.")
    for name, why in result.baseline_errors.items():
      print(f"{name}: cannot run this config: {why}.")
  command = "python experiments/plan_mesh.py " + " ".join(shlex.quote(a) for a in (argv or sys.argv[1:]))
  if args.out_mesh and result.ranked:
    name = os.path.splitext(os.path.basename(args.out_mesh))[0]
    text = plan_lib.to_yaml(result, result.best, name, command)
    os.makedirs(os.path.dirname(os.path.abspath(args.out_mesh)), exist_ok=True)
    with open(args.out_mesh, "w") as f:
      f.write(text)
    mesh_lib.load(args.out_mesh)  # what we wrote must load
    print(f"\nwrote {args.out_mesh}")
  out = plan_lib.to_json(result, args.top)
  out["command"], out["wall_s"] = command, time.perf_counter() - t0
  if args.json:
    with open(args.json, "w") as f:
      json.dump(out, f, indent=1)
    print(f"wrote {args.json}")
  print(f"wall time {out['wall_s']:.1f} s")
  return out


if __name__ == "__main__":
  main()
