"""Plans the mesh of a config on N devices: ranks every 5D layout by simulated step time among those that
fit in HBM, compares the best with naive layouts, and writes it as a mesh file (gem_jax/observe/plan.py).

  python experiments/plan_mesh.py --config large --devices 1024 --hardware h200 \\
      --out-mesh meshes/plan_large_1024.yaml --json plan.json          # 100-160 s on 2 CPU cores
  python experiments/plan_mesh.py --config base --devices 64 --hardware h100 --top 5
  python experiments/plan_mesh.py --config large --smallest 1024 --set train.host_tables=user_id,ad_id
      # the fewest devices (whole nodes, doubling) on which large fits with those tables in host memory

Hand-written mesh files of the same device count and device (meshes/*.yaml, not the planned ones) are
compared too, or the ones given with --baseline-mesh. Nothing is compiled: the numbers are the cluster simulator's.
"""

import argparse
import shlex
import sys


def main(argv=None) -> dict:
  p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("--config", required=True, help="named config (gem_jax/configs.py)")
  p.add_argument("--devices", type=int, default=None, help="how many devices (a multiple of a node)")
  p.add_argument("--smallest", type=int, default=None, metavar="MAX_DEVICES",
                 help="instead of --devices: plan on the fewest whole nodes (1, 2, 4, ...) up to MAX_DEVICES on "
                      "which a layout fits")
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
  p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                 help="config override, e.g. train.embedding_update=sparse")
  p.add_argument("--compile-top", type=int, default=0, metavar="K",
                 help="compile the first K layouts' train steps for the GPU target (needs the [aot] extra, minutes "
                      "each) and rank by the compiled memory")
  p.add_argument("--max-tensor", type=int, default=8)
  p.add_argument("--max-context", type=int, default=8)
  args = p.parse_args(argv)

  from gem_jax import configs
  from gem_jax.config import apply_overrides
  from gem_jax.observe import cluster_text, plan as plan_lib

  if (args.devices is None) == (args.smallest is None):
    p.error("give --devices N or --smallest MAX_DEVICES")
  try:
    cfg = apply_overrides(configs.get(args.config), args.set)
  except (KeyError, ValueError) as e:
    p.error(str(e).strip('"'))
  if args.smallest is not None:
    args.devices = _smallest(p, cfg, args)
  command = "python experiments/plan_mesh.py " + " ".join(shlex.quote(a) for a in (argv or sys.argv[1:]))
  try:  # bad input: a usage error that names it, not a traceback
    return cluster_text.plan_mesh(
        cfg, args.devices, plan_lib.get_preset(args.hardware), baseline_paths=args.baseline_mesh,
        out_mesh=args.out_mesh, json_path=args.json, top=args.top, command=command, batch_size=args.batch_size,
        mean_history=args.mean_history, overlap=args.overlap, efficiency=args.efficiency,
        max_tensor=args.max_tensor, max_context=args.max_context, compile_top=args.compile_top)
  except (KeyError, ValueError) as e:
    p.error(str(e).strip('"'))


def _smallest(p, cfg, args) -> int:
  """The device count --smallest finds (each count tried is printed), or a usage error when none fits."""
  from gem_jax.observe import cluster_text, plan as plan_lib

  def say(devices, what):
    print(f"{devices} devices: " + (f"{what} layouts fit" if isinstance(what, int) else f"no layout ({what})"),
          file=sys.stderr, flush=True)

  try:
    found, _ = plan_lib.smallest(cfg, args.hardware, max_devices=args.smallest, on_count=say,
                                 progress=cluster_text.progress_printer(),
                                 batch_size=args.batch_size, mean_history=args.mean_history, overlap=args.overlap,
                                 efficiency=args.efficiency, max_tensor=args.max_tensor, max_context=args.max_context)
  except (KeyError, ValueError) as e:
    p.error(str(e).strip('"'))
  if found is None:
    p.error(f"{cfg.name} fits on no layout of up to {args.smallest} {args.hardware} devices")
  return found.devices


if __name__ == "__main__":
  main()
