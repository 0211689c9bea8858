"""Predicts what one train step of a config costs on a mesh file, without compiling or running it: comm bytes
by collective and mesh axes, step time and MFU, memory per device against HBM (gem_jax/observe/simulate.py).

  python experiments/simulate_cluster.py --config large --mesh meshes/h200_1024_5d.yaml --out sim.json
  python experiments/simulate_cluster.py --config tiny --mesh meshes/cpu_8.yaml --out sim.json --batch-size 256
  python experiments/simulate_cluster.py --config large --mesh meshes/h200_8.yaml --out sim.json \
      --set train.host_tables=user_id,ad_id     # two tables in host memory behind device caches

CPU mesh files give no peak FLOP/s or bandwidths: bytes and memory only, no times.
"""

import argparse


def main(argv=None) -> dict:
  p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("--config", required=True, help="named config (gem_jax/configs.py)")
  p.add_argument("--mesh", required=True, help="mesh file (meshes/*.yaml)")
  p.add_argument("--out", required=True, help="write the simulation here (JSON)")
  p.add_argument("--batch-size", type=int, default=None, help="global batch (default: the config's)")
  p.add_argument("--mean-history", type=float, default=None, help="one history length for every row")
  p.add_argument("--overlap", type=float, default=0.9, help="share of compute parameter traffic hides behind")
  p.add_argument("--efficiency", type=float, default=0.5, help="share of peak FLOP/s the compute reaches")
  p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                 help="override a config field, e.g. --set train.host_tables=user_id,ad_id (repeatable)")
  args = p.parse_args(argv)

  from gem_jax import configs
  from gem_jax.config import apply_overrides
  from gem_jax.observe import cluster_text
  from gem_jax.parallel import mesh as mesh_lib

  return cluster_text.simulate_cluster(
      apply_overrides(configs.get(args.config), args.set), mesh_lib.load(args.mesh), args.out, mesh_file=args.mesh, batch_size=args.batch_size,
      mean_history=args.mean_history, overlap=args.overlap, efficiency=args.efficiency)


if __name__ == "__main__":
  main()
