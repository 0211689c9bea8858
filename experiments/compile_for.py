"""Compiles a config's train and eval steps for the GPU cluster of a mesh file, on a machine without a GPU
("deviceless AOT"), and writes what XLA:GPU made of them: per-device memory against HBM and the simulator,
collectives by mesh axis, the Pallas kernels as compiled Triton, FP8 GEMMs, scatter atomics
(gem_jax/observe/gpu_compile.py).

  python experiments/compile_for.py --config small --mesh meshes/h200_1.yaml --out runs/compile_small
  python experiments/compile_for.py --config base --mesh meshes/h200_8.yaml --set model.precision.policy=fp8

Needs the CUDA plugin of the installed jax: pip install -e '.[aot]' (about 4 GB). Compiled is not run: no
timings. The mesh file names the target (gem_jax/parallel/targets/); --target compiles for another one.
"""

import argparse
import os

# Before jax starts: without a GPU the CUDA plugin registers its compiler only when the CPU is the platform.
os.environ.setdefault("JAX_PLATFORMS", "cpu")


def main(argv=None) -> dict:
  p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("--config", required=True, help="named config (gem_jax/configs.py)")
  p.add_argument("--mesh", required=True, help="mesh file naming a GPU target (meshes/h200_8.yaml)")
  p.add_argument("--out", default=None, help="folder for compile.json (default: runs/compile_<config>_<mesh>, then "
                 "_<target> and a digest of the --set overrides when given)")
  p.add_argument("--target", default=None, help="compile for this target instead of the mesh file's")
  p.add_argument("--programs", default="train,eval", help="comma-separated: train, eval")
  p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="config override")
  p.add_argument("--no-simulate", action="store_true", help="skip the simulator's prediction")
  p.add_argument("--keep-dump", action="store_true", help="keep XLA's dump of the train step in OUT/xla_dump")
  args = p.parse_args(argv)

  import dataclasses
  import json

  from gem_jax import configs
  from gem_jax.config import apply_overrides
  from gem_jax.observe import gpu_compile

  out = args.out or gpu_compile.default_out(args.config, args.mesh, args.target, args.set)
  try:  # bad input (config, mesh file, target, no CUDA plugin): a usage error that names it, not a traceback
    cfg = apply_overrides(dataclasses.replace(configs.get(args.config), mesh=args.mesh), args.set)
    os.makedirs(out, exist_ok=True)
    report = gpu_compile.compile_for(cfg, target=args.target, programs=tuple(args.programs.split(",")),
                                     simulate=not args.no_simulate,
                                     keep_dump=os.path.join(out, "xla_dump") if args.keep_dump else None)
  except (KeyError, ValueError) as e:
    p.error(str(e).strip('"'))
  with open(os.path.join(out, "compile.json"), "w") as f:
    json.dump(report, f, indent=1, default=str)
  print(gpu_compile.table(report))
  print(f"wrote {os.path.join(out, 'compile.json')}")
  return report


if __name__ == "__main__":
  main()
