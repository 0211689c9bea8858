"""FP8 loss parity: the same config and seed trained under several precision policies (experiments/fp8_parity.py).

Each policy (gem_jax/precision/policy.py) trains from the same initial parameters on the same batches; only
the Dense sites' matmuls differ. Per policy: final eval NE / AUC per task, `rel_ne_gap` = (NE - NE_base) /
NE_base per task against the first policy, the share of the Dense matmul FLOPs under each recipe (rows per
site as a probe capture sees them: tokens for sequence sites, examples for the rest), optionally the train
step's compiled memory (temp bytes: activations saved for backward and workspace), the wall time, and a PNG
of the train loss curves. On CPU every FP8 recipe is emulated, so times say nothing about GPU speed; the
numbers that matter are the NE gaps.
"""

from __future__ import annotations

import json
import math
import os
import time

import jax
import numpy as np

from gem_jax.config import apply_overrides
from gem_jax.model.layers import dense_sites
from gem_jax.precision import policy
from gem_jax.run.build import build
from gem_jax.train.jobs import train_config

# --quick: the small model on fewer steps and eval examples (3 policies in under 5 minutes on 2 cores).
QUICK = ("train.steps=200", "train.warmup_steps=20", "train.eval_examples=32768", "train.log_every=1",
         "train.checkpoint_every=1000")


def with_policy(cfg, name: str):
  return apply_overrides(cfg, [f"model.precision.policy={name}"])


def step_memory(cfg) -> dict:
  """Compiled memory analysis (bytes) of the config's train step on its first batch."""
  run = build(cfg)
  mem = run.train_step.lower(run.state, run.device_batch(run.source.first_batch())).compile().memory_analysis()
  if mem is None:
    return {}
  return {k: int(getattr(mem, k)) for k in ("temp_size_in_bytes", "argument_size_in_bytes",
                                            "output_size_in_bytes") if hasattr(mem, k)}


def site_rows(run, batch) -> dict[str, int]:
  """{site: rows of its input on `batch`} (tokens for sequence sites, examples for the rest): the rows of a
  probe capture, read from shapes alone (jax.eval_shape: nothing is compiled or run)."""
  def site_inputs(params, batch):
    inputs = {}
    with policy.probing(inputs):
      run.task.sums(run.model(params), batch, None)
    return inputs

  shapes = jax.eval_shape(site_inputs, run.state.params, batch)
  return {site: math.prod(x.shape[:-1]) for site, x in shapes.items()}


def flop_shares(cfg, names) -> dict:
  """Per policy, the share of Dense matmul FLOPs under each recipe (rows per site from site_rows)."""
  run = build(cfg, abstract=True)
  rows = site_rows(run, run.source.first_batch())
  out = {}
  for name in names:
    model = build(with_policy(cfg, name), abstract=True).model()
    out[name] = policy.flop_share(dense_sites(model), rows)
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
  base = ema(curves[baseline][1])
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


def parity(cfg, names, runs: str, out_json: str, *, memory: bool = False, log=print) -> dict:
  """Trains `cfg` once per policy of `names` (the first is the baseline) into runs/<policy> and returns the
  results (module docstring); the PNG goes next to out_json."""
  if os.path.exists(runs) and os.listdir(runs):
    raise FileExistsError(f"{runs} is not empty: pass another --out or --runs")
  t0 = time.perf_counter()
  shares = flop_shares(cfg, names)
  results, curves = {}, {}
  for name in names:
    run_cfg = with_policy(cfg, name)
    t = time.perf_counter()
    summary = train_config(run_cfg, os.path.join(runs, name), progress=False, report=False)
    record = {"tasks": {task: {"eval_ne": m["eval_ne"], "eval_auc": m["eval_auc"]}
                        for task, m in summary["tasks"].items()},
              "train_s": time.perf_counter() - t, "examples_per_s": summary["examples_per_s"],
              "flop_share": shares[name]}
    if memory:
      record["step_memory_bytes"] = step_memory(run_cfg)
    results[name] = record
    curves[name] = loss_curve(os.path.join(runs, name))
    log(f"{name:>12}: " + "  ".join(f"{task} NE {m['eval_ne']:.4f}" for task, m in record["tasks"].items())
        + f"  ({record['train_s']:.0f} s)")
  base = names[0]
  for name in names:
    results[name]["rel_ne_gap"] = {
        task: (m["eval_ne"] - results[base]["tasks"][task]["eval_ne"]) / results[base]["tasks"][task]["eval_ne"]
        for task, m in results[name]["tasks"].items()}
  png = os.path.splitext(out_json)[0] + ".png"
  plot(curves, png, f"{cfg.name}: train loss by precision policy ({cfg.train.steps} steps)", base)
  return {"config": cfg.name, "steps": cfg.train.steps, "eval_examples": cfg.train.eval_examples,
          "baseline": base, "backend": jax.default_backend(), "policies": results, "png": png,
          "wall_s": time.perf_counter() - t0}


def table(out: dict, task_names) -> str:
  lines = [f"{'policy':>12} " + " ".join(f"{t + ' gap':>16}" for t in task_names) + f" {'fp8 FLOP share':>15} "
           f"{'temp MB':>9}"]
  for name, r in out["policies"].items():
    fp8_share = sum(v for k, v in r["flop_share"].items() if k not in ("bf16", "none"))
    mem = r.get("step_memory_bytes", {}).get("temp_size_in_bytes")
    lines.append(f"{name:>12} " + " ".join(f"{100 * r['rel_ne_gap'][t]:>15.3f}%" for t in task_names)
                 + f" {100 * fp8_share:>14.1f}% {mem / 2**20 if mem else float('nan'):>9.1f}")
  return "\n".join(lines)

