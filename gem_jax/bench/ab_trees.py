"""The same job in two source trees, side by side on one machine: does a change keep a run's results and speed?

`compare({"new": ".", "old": "/tmp/old_tree"}, ["--config", "small"], repeats=3)` runs
`experiments/train.py ARGS` in each tree (its own checkout first on PYTHONPATH, so its own gem_jax is the one
imported), `repeats` times, alternating which tree goes first in each round so that a machine that slows
down over the session taxes both alike. Each run's summary.json gives examples/s (steady-state training
throughput, the trainer's own measure) and per task eval NE and the share of the planted-model gap it closed.
The result holds every run and, per tree, the median of each number; `ratios` is each tree's median
examples/s over the reference tree's (the last one named).

Runs are never concurrent: on a 2-core machine two jobs at once would measure each other.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import time

from gem_jax import malloc_env
from gem_jax.parallel import distributed


def run_job(tree: str, args: list[str], out_dir: str, timeout: float = 1800) -> dict:
  """experiments/train.py ARGS --out out_dir in `tree`; the numbers of its summary.json."""
  tree = os.path.abspath(tree)
  # The tree's job picks its own device count; any other XLA flag of this process is kept.
  # Started as a user would start it: the tree's train.py asks for huge pages itself if it does (malloc_env).
  env = dict(malloc_env.without_huge_pages(), PYTHONPATH=tree, JAX_PLATFORMS="cpu",
             XLA_FLAGS=distributed.cpu_device_flags(os.environ.get("XLA_FLAGS")))
  t0 = time.perf_counter()
  proc = subprocess.run([sys.executable, "experiments/train.py", *args, "--out", out_dir, "--no-progress"],
                        cwd=tree, env=env, capture_output=True, text=True, timeout=timeout)
  if proc.returncode:
    raise RuntimeError(f"{tree}: experiments/train.py {' '.join(args)} failed ({proc.returncode}):\n"
                       f"{proc.stderr[-3000:]}")
  with open(os.path.join(out_dir, "summary.json")) as f:
    summary = json.load(f)
  # MFU / HFU from the run's efficiency report (model / XLA-counted FLOPs over a GEMM measured in that run);
  # None where the tree's job has no report.
  efficiency = summary.get("efficiency") or {}
  out = {"examples_per_s": summary["examples_per_s"], "mfu": efficiency.get("mfu"), "hfu": efficiency.get("hfu"),
         "wall_s": time.perf_counter() - t0}
  for task, m in summary["tasks"].items():
    out[f"{task}/eval_ne"] = m["eval_ne"]
    out[f"{task}/gap_closed"] = m["gap_closed"]
  return out


def compare(trees: dict[str, str], args: list[str], *, repeats: int = 3, out_dir: str = "runs/ab",
            log=print) -> dict:
  """Every tree's job `repeats` times, alternating the order (module docstring)."""
  names = list(trees)
  runs: dict[str, list[dict]] = {n: [] for n in names}
  for r in range(repeats):
    for name in (names if r % 2 == 0 else names[::-1]):
      result = run_job(trees[name], args, os.path.join(os.path.abspath(out_dir), f"{name}_{r}"))
      runs[name].append(result)
      log(f"round {r} {name}: " + ", ".join(f"{k} {v:.4g}" for k, v in result.items() if v is not None))
  medians = {}
  for n in names:  # a number a run could not give (None) is left out of that tree's median
    values = {k: [run[k] for run in runs[n] if run.get(k) is not None] for k in runs[n][0]}
    medians[n] = {k: statistics.median(v) for k, v in values.items() if v}
  reference = names[-1]
  ratios = {n: medians[n]["examples_per_s"] / medians[reference]["examples_per_s"] for n in names}
  hfu_ratios = {n: (medians[n]["hfu"] / medians[reference]["hfu"]
                    if medians[n].get("hfu") and medians[reference].get("hfu") else None) for n in names}
  notes = []
  if repeats < 2:
    notes.append(f"one run per tree, {' then '.join(names)} in that order: nothing alternates and no median "
                 "smooths the machine's drift (runs of one tree here differ by ~5%); use --repeats 2 or more")
  return {"args": args, "trees": {n: os.path.abspath(p) for n, p in trees.items()}, "repeats": repeats,
          "reference": reference, "runs": runs, "medians": medians, "examples_per_s_ratio": ratios,
          "hfu_ratio": hfu_ratios, "notes": notes}


def table(result: dict) -> str:
  """Medians per tree, one row per number, and the throughput ratio to the reference tree."""
  names = list(result["medians"])
  keys = list(result["medians"][names[0]])
  lines = ["| median over %d runs | %s |" % (result["repeats"], " | ".join(names)),
           "|---|" + "---|" * len(names)]
  for k in keys:
    lines.append(f"| {k} | " + " | ".join(f"{result['medians'][n].get(k, float('nan')):.4f}" for n in names) + " |")
  lines.append(f"| examples/s vs {result['reference']} | "
               + " | ".join(f"{result['examples_per_s_ratio'][n]:.3f}x" for n in names) + " |")
  hfu = result.get("hfu_ratio") or {}
  lines.append(f"| HFU vs {result['reference']} | "
               + " | ".join("-" if hfu.get(n) is None else f"{hfu[n]:.3f}x" for n in names) + " |")
  lines += [f"note: {n}" for n in result.get("notes", [])]
  return "\n".join(lines)
