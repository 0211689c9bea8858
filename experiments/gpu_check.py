"""The prepared GPU check: every GPU-only claim of gem-jax measured in one short run (gem_jax/bench/gpu_check.py).

On the GPU machine (one H200; Python 3.12, jax 0.11.2 with the CUDA 13 plugin, triton 3.6, no grain, no
jax-triton), from the repository root, with the wheels below carried in .whl/:

    PYTHONPATH=$PWD python3 experiments/gpu_check.py --wheels .whl --out $OUT

It finishes within its 480 s budget (sections are skipped or cut short, with a note, when time runs out)
and writes $OUT/gpu_check.json, $OUT/gpu_check.md and $OUT/gpu_check.log as it goes.

Preparation on this (CPU) machine, once, from the repository root:

    echo /.whl/ >> .git/info/exclude                  # the wheels travel untracked, never committed
    python experiments/gpu_check.py --prepare-wheels .whl
    # -> grain 0.2.18, array-record 0.8.6, portpicker 1.6.0, jax-triton 0.4.1 and 0.3.1 (about 4.5 MB) for
    #    CPython 3.12 / manylinux x86_64; the device call names `.whl` in carry

Rehearsal here (CPU backend, tiny shapes, interpret-mode Pallas; the same sections and keys, under 3 min):

    python experiments/gpu_check.py --rehearse --out runs/gpu_check_rehearsal
"""

import argparse
import sys


def main(argv=None) -> int:
  p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("--out", help="folder for gpu_check.json / .md (the device tool's $OUT on the GPU machine)")
  p.add_argument("--rehearse", action="store_true", help="CPU rehearsal: tiny shapes, interpret mode")
  p.add_argument("--wheels", default=None, help="folder of wheels to install offline first (--prepare-wheels)")
  p.add_argument("--work", default=None, help="scratch folder (default /tmp/gem_jax_gpu_check)")
  p.add_argument("--budget-s", type=float, default=None, help="total time budget (default 480 GPU, 175 rehearsal)")
  p.add_argument("--sections", default=None, help="comma-separated subset of the sections")
  p.add_argument("--prepare-wheels", metavar="DIR", default=None,
                 help="download the wheels the GPU image lacks into DIR and exit")
  args = p.parse_args(argv)
  from gem_jax.bench import gpu_check
  if args.prepare_wheels:
    print("\n".join(gpu_check.prepare_wheels(args.prepare_wheels)))
    return 0
  if not args.out:
    p.error("--out is required")
  result = gpu_check.run(args.out, rehearse=args.rehearse, wheels=args.wheels, work=args.work,
                         budget_s=args.budget_s, sections=tuple(args.sections.split(",")) if args.sections else None)
  print(f"gpu_check: {result['elapsed_s']:.0f} s; " + ", ".join(f"{k} {v['status']}" for k, v in result["sections"].items()))
  return 0


if __name__ == "__main__":
  sys.exit(main())
