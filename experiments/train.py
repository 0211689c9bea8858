"""The main job: train a named config (GEM on the synthetic ads stream by default) through gem_jax/train/jobs.py.

  python experiments/train.py                          # small config, CPU, ~4 minutes on 2 cores
  python experiments/train.py --config tiny --out runs/tiny --set train.steps=50
  python experiments/train.py --out runs/default --resume   # continue from the last checkpoint
  python experiments/train.py --config tiny --data runs/tiny_parquet --out runs/tiny_files
      # the same model on Parquet files (experiments/export_synthetic.py writes a sample)
  python experiments/train.py --config tiny --mesh meshes/cpu_16_5d.yaml --out runs/5d   # 16 CPU devices
  python experiments/train.py --config tiny --mesh meshes/cpu_1.yaml --out runs/5d --eval-only
      # evaluate the newest checkpoint of runs/5d on another mesh (restored resharded)

Multi-process (one command per process; on SLURM or Open MPI, JAX finds the coordinator itself):
  python experiments/train.py --mesh meshes/cpu_8.yaml --coordinator localhost:12355 \\
      --num-processes 2 --process-id 0 ...      # and --process-id 1; each process gets 4 of the 8 devices
"""

import argparse
import json
import os
import sys


def _mesh_devices(path: str) -> int:
  """Devices a mesh file needs, read without jax (the CPU device count must be set before jax starts)."""
  import math

  import yaml
  with open(path) as f:
    data = yaml.safe_load(f) or {}
  axes = data.get("axes") or {}
  return math.prod(int(v) for v in axes.values()) if isinstance(axes, dict) and axes else 1


def main(argv=None) -> int:
  p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("--config", default="small", help="named config (gem_jax/configs.py)")
  p.add_argument("--out", default="runs/default", help="run folder (metrics.jsonl, checkpoints/, summary.json)")
  p.add_argument("--resume", action="store_true", help="continue from the last checkpoint in --out")
  p.add_argument("--mesh", default=None, help="mesh file (meshes/*.yaml); default: one device")
  p.add_argument("--data", default=None, metavar="DIR",
                 help="train on the Parquet files of DIR (spec.yaml, train/, eval/; see the README) instead of the "
                      "config's own data")
  p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                 help="override a config field, e.g. --set train.steps=200 (repeatable)")
  p.add_argument("--coordinator", default=None, help="host:port of process 0 (multi-process runs)")
  p.add_argument("--num-processes", type=int, default=None)
  p.add_argument("--process-id", type=int, default=None)
  p.add_argument("--local-devices", type=int, default=None,
                 help="CPU devices of this process (default: all the mesh needs, in one process)")
  p.add_argument("--eval-only", action="store_true",
                 help="evaluate the newest usable checkpoint in --out on this --mesh (any mesh) and print the "
                      "metrics as JSON; no training")
  p.add_argument("--step", type=int, default=None, help="with --eval-only: the checkpoint step")
  p.add_argument("--no-progress", action="store_true", help="no progress bar")
  p.add_argument("--no-report", action="store_true",
                 help="skip the efficiency report (report.json, plots/, profile/ and the table)")
  args = p.parse_args(argv)
  if args.step is not None and not args.eval_only:
    p.error("--step picks the checkpoint --eval-only evaluates; it needs --eval-only")
  if args.eval_only and (args.resume or args.no_report):
    p.error("--eval-only trains nothing, so --resume and --no-report would be ignored")
  if args.mesh and any(kv.split("=", 1)[0] == "mesh" for kv in args.set):
    p.error("--mesh and --set mesh=... name the mesh twice; use one")

  from gem_jax.parallel import distributed
  cpu_devices = args.local_devices
  if cpu_devices is None and args.mesh and os.environ.get("JAX_PLATFORMS", "cpu").startswith("cpu"):
    # The mesh's devices, split evenly over the processes of the run.
    processes = args.num_processes or int(os.environ.get("JAX_NUM_PROCESSES", "1"))
    cpu_devices = _mesh_devices(args.mesh) // processes
  distributed.setup(distributed.ProcessSetup.from_env(
      coordinator=args.coordinator, num_processes=args.num_processes, process_id=args.process_id,
      cpu_devices=cpu_devices))

  from gem_jax import configs
  from gem_jax.config import apply_overrides
  from gem_jax.train import jobs
  cfg = configs.get(args.config)
  if args.data:
    from gem_jax.data import parquet_source
    cfg = parquet_source.with_files(cfg, args.data)
  cfg = apply_overrides(cfg, args.set + ([f"mesh={args.mesh}"] if args.mesh else []))
  import jax
  if args.eval_only:
    result = jobs.evaluate_checkpoint(cfg, args.out, args.step)
    if jax.process_index() == 0:
      print(json.dumps(result, indent=2))
    return 0
  summary = jobs.train_config(cfg, args.out, resume=args.resume, progress=not args.no_progress,
                              report=not args.no_report)
  if jax.process_index() == 0:
    print(json.dumps({"steps": summary["steps"], "examples_per_s": summary["examples_per_s"],
                      "tasks": summary.get("tasks")}, indent=2))
  return 0


if __name__ == "__main__":
  from gem_jax import malloc_env
  malloc_env.relaunch_with_huge_pages()   # glibc reads its huge-page tunable only when a process starts
  sys.exit(main())
