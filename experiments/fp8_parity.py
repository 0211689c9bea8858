"""FP8 loss parity: the same config and seed trained in bf16, under the default FP8 policy and all-MXFP8.

  python experiments/fp8_parity.py --quick --out parity.json       # CPU, under 5 minutes on 2 cores
  python experiments/fp8_parity.py --config small --out parity.json
  python experiments/fp8_parity.py --policies bf16,none,fp8,mxfp8 --quick --out p.json   # "none": the float32 noise floor

Each policy (gem_jax/precision/policy.py) trains from the same initial parameters on the same batches;
only the Dense sites' matmuls differ. Writes --out JSON with, per policy: final eval NE / AUC per task,
`rel_ne_gap` = (NE - NE_bf16) / NE_bf16 per task, the share of the Dense matmul FLOPs under each recipe
(rows per site as a probe capture sees them: tokens for sequence sites, examples for the rest), the
train step's compiled memory (temp bytes: activations saved for backward and workspace) and the wall
time; and a PNG of the train loss curves next to it. On CPU every FP8 recipe is emulated, so times say
nothing about GPU speed; the numbers that matter here are the NE gaps.
"""

import argparse
import dataclasses
import json
import math
import os
import sys
import time

import jax
import numpy as np
from flax import nnx

from gem_jax import configs
from gem_jax.config import apply_overrides
from gem_jax.data import pipeline
from gem_jax.data.synthetic import SyntheticAdsStream
from gem_jax.model.gem import GEM
from gem_jax.precision import policy
from gem_jax.precision.policy import POLICIES, PrecisionConfig
from gem_jax.train.loop import train
from gem_jax.train.optim import make_optimizer
from gem_jax.train.step import init_state, make_train_step

# --quick: the small model on fewer steps and eval examples (3 policies in under 5 minutes on 2 cores).
QUICK = ("train.steps=200", "train.warmup_steps=20", "train.eval_examples=32768", "train.log_every=1",
         "train.checkpoint_every=1000")


def with_policy(cfg, name: str):
  return dataclasses.replace(cfg, model=dataclasses.replace(
      cfg.model, precision=dataclasses.replace(cfg.model.precision, policy=name)))


def step_memory(cfg, batch) -> dict:
  """Compiled memory analysis (bytes) of the config's train step on `batch`."""
  model = GEM(cfg.data.spec, cfg.model, rngs=nnx.Rngs(cfg.train.seed))
  optimizer = make_optimizer(cfg.train, nnx.state(model, nnx.Param))
  graphdef, rest, state = init_state(model, optimizer)
  step = make_train_step(graphdef, rest, optimizer, cfg.data.spec)
  mem = step.lower(state, batch).compile().memory_analysis()
  if mem is None:
    return {}
  return {k: int(getattr(mem, k)) for k in ("temp_size_in_bytes", "argument_size_in_bytes",
                                            "output_size_in_bytes") if hasattr(mem, k)}


def site_rows(model, batch) -> dict[str, int]:
  """{site: rows of its input on `batch`} (tokens for sequence sites, examples for the rest): the rows of a
  probe capture, read from shapes alone. The forward is traced abstractly (jax.eval_shape), so nothing
  is compiled or run."""
  graphdef, state = nnx.split(model)

  def site_inputs(state, batch):
    inputs = {}
    with policy.probing(inputs):
      nnx.merge(graphdef, state)(batch)
    return inputs

  shapes = jax.eval_shape(site_inputs, state, batch)
  return {site: math.prod(x.shape[:-1]) for site, x in shapes.items()}


def flop_shares(cfg, names, batch) -> dict:
  """Per policy, the share of Dense matmul FLOPs under each recipe (rows per site from site_rows)."""
  model = GEM(cfg.data.spec, cfg.model, rngs=nnx.Rngs(cfg.train.seed))
  rows = site_rows(model, batch)
  out = {}
  for name in names:
    policy.apply(model, dataclasses.replace(cfg.model.precision, policy=name))
    out[name] = policy.flop_share(model, rows)
  return out


def loss_curve(run_dir: str):
  steps, losses = [], []
  with open(os.path.join(run_dir, "metrics.jsonl")) as f:
    for line in f:
      rec = json.loads(line)
      if "loss" in rec and "step" in rec:
        steps.append(rec["step"])
        losses.append(rec["loss"])
  return steps, losses


def plot(curves: dict, path: str, title: str, baseline: str) -> None:
  """Top: train loss per policy (EMA over steps, single-batch losses are noisy). Bottom: each policy's
  smoothed loss minus the baseline's."""
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt

  def ema(values, decay=0.9):
    out, acc = [], None
    for v in values:
      acc = v if acc is None else decay * acc + (1 - decay) * v
      out.append(acc)
    return np.asarray(out)

  fig, (top, bottom) = plt.subplots(2, 1, figsize=(7, 6), sharex=True, height_ratios=(2, 1))
  base_steps, base_losses = curves[baseline]
  base = ema(base_losses)
  for name, (steps, losses) in curves.items():
    smooth = ema(losses)
    top.plot(steps, smooth, label=name, linewidth=1.2)
    n = min(len(smooth), len(base))
    bottom.plot(steps[:n], smooth[:n] - base[:n], label=name, linewidth=1.0)
  top.set_ylabel("train loss (EMA 0.9)")
  top.set_title(title)
  top.legend()
  bottom.set_ylabel(f"minus {baseline}")
  bottom.set_xlabel("step")
  for ax in (top, bottom):
    ax.grid(alpha=0.3)
  fig.tight_layout()
  fig.savefig(path, dpi=120)
  plt.close(fig)


def main(argv=None) -> int:
  p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("--config", default="small", choices=sorted(configs.CONFIGS))
  p.add_argument("--quick", action="store_true", help="200 steps, 32k eval examples (CPU, < 5 min)")
  p.add_argument("--policies", default="bf16,fp8,mxfp8", help="comma-separated; the first is the baseline")
  p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="config override")
  p.add_argument("--memory", action="store_true",
                 help="also compile each policy's train step for its memory analysis (~20 s per policy)")
  p.add_argument("--out", default="fp8_parity.json", help="JSON path; the PNG goes next to it")
  p.add_argument("--runs", default=None, help="folder for the runs (default: <out without .json>_runs)")
  args = p.parse_args(argv)
  names = [n.strip() for n in args.policies.split(",") if n.strip()]
  unknown = [n for n in names if n not in POLICIES]
  if unknown or len(names) < 2:
    p.error(f"--policies needs >= 2 of {sorted(POLICIES)}, got {args.policies!r}")
  cfg = apply_overrides(configs.get(args.config), (list(QUICK) if args.quick else []) + args.set)
  runs = args.runs or os.path.splitext(args.out)[0] + "_runs"
  if os.path.exists(runs) and os.listdir(runs):
    raise FileExistsError(f"{runs} is not empty: pass another --out or --runs")
  t0 = time.perf_counter()
  spec = cfg.data.spec
  batch = pipeline.eval_batches(SyntheticAdsStream(spec, cfg.data.synthetic), spec, cfg.data.pipeline,
                                num_examples=cfg.data.pipeline.batch_size, start_index=0)[0]
  shares = flop_shares(cfg, names, batch)
  results, curves = {}, {}
  for name in names:
    run_cfg = with_policy(cfg, name)
    t = time.perf_counter()
    summary = train(run_cfg, os.path.join(runs, name), progress=False, report=False)
    record = {"tasks": {task: {"eval_ne": m["eval_ne"], "eval_auc": m["eval_auc"]}
                        for task, m in summary["tasks"].items()},
              "train_s": time.perf_counter() - t, "examples_per_s": summary["examples_per_s"],
              "flop_share": shares[name]}
    if args.memory:
      record["step_memory_bytes"] = step_memory(run_cfg, batch)
    results[name] = record
    curves[name] = loss_curve(os.path.join(runs, name))
    print(f"{name:>12}: " + "  ".join(f"{task} NE {m['eval_ne']:.4f}" for task, m in record["tasks"].items())
          + f"  ({record['train_s']:.0f} s)", flush=True)
  base = names[0]
  for name in names:
    results[name]["rel_ne_gap"] = {
        task: (m["eval_ne"] - results[base]["tasks"][task]["eval_ne"]) / results[base]["tasks"][task]["eval_ne"]
        for task, m in results[name]["tasks"].items()}
  png = os.path.splitext(args.out)[0] + ".png"
  plot(curves, png, f"{cfg.name}: train loss by precision policy ({cfg.train.steps} steps)", base)
  out = {"config": cfg.name, "steps": cfg.train.steps, "eval_examples": cfg.train.eval_examples,
         "baseline": base, "backend": jax.default_backend(), "policies": results, "png": png,
         "wall_s": time.perf_counter() - t0}
  with open(args.out, "w") as f:
    json.dump(out, f, indent=2)
  print(f"\n{'policy':>12} " + " ".join(f"{t + ' gap':>16}" for t in spec.task_names)
        + f" {'fp8 FLOP share':>15} {'temp MB':>9}")
  for name in names:
    r = results[name]
    fp8_share = sum(v for k, v in r["flop_share"].items() if k not in ("bf16", "none"))
    mem = r.get("step_memory_bytes", {}).get("temp_size_in_bytes")
    print(f"{name:>12} " + " ".join(f"{100 * r['rel_ne_gap'][t]:>15.3f}%" for t in spec.task_names)
          + f" {100 * fp8_share:>14.1f}% {mem / 2**20 if mem else float('nan'):>9.1f}")
  print(f"wrote {args.out} and {png} in {out['wall_s']:.0f} s")
  return 0


if __name__ == "__main__":
  sys.exit(main())
