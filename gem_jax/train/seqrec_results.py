"""Summaries of next-item runs (experiments/seqrec.py's results.json files): the mean and spread over seeds,
and an ablation table that says what each run changed against its dataset's preset.

  seed_summary(per_seed)        mean, sample std and per-seed HR@10 / NDCG@10 of validation and test
  ablation_rows(run_dirs)       one row per run folder: the config fields that differ from its tower's preset, the
                                kept evaluation's validation metrics, epochs and wall time
  markdown(rows)                the rows as a README table
  curves(runs)                  validation metrics at every evaluated epoch of labelled run folders, finished or
                                not (curves_markdown: an epoch x run table), to compare runs cut short for time

Ablations are compared on validation only (the test split of each run is read once, at its end); a row
carries its test metrics so that the chosen run's can be reported, not to choose by.
"""

from __future__ import annotations

import dataclasses
import json
import os

import numpy as np

SEED_METRICS = ("HR@10", "NDCG@10")


def seed_summary(per_seed: list[dict], splits=("valid", "test"), metrics=SEED_METRICS) -> dict:
  """Mean, sample standard deviation (ddof 1; 0 for one seed) and the per-seed values of `metrics` in each
  split, from train_next_item results ({"seed", "valid": {...}, "test": {...}} each). Keys are lower case
  ("hr@10"), as results/seqrec/*.json holds them. A split some run has no metrics of (validation, for runs
  trained through it) is left out."""
  out = {}
  for split in splits:
    if any(r.get(split) is None for r in per_seed):
      continue
    rows = [{"seed": r["seed"], **{m.lower(): float(r[split][m]) for m in metrics}} for r in per_seed]
    values = {m.lower(): np.array([row[m.lower()] for row in rows]) for m in metrics}
    out[split] = {"mean": {m: float(v.mean()) for m, v in values.items()},
                  "std": {m: float(v.std(ddof=1)) if v.size > 1 else 0.0 for m, v in values.items()},
                  "seeds": rows}
  return out


def _flat(tree, prefix=""):
  out = {}
  for key, value in tree.items():
    if isinstance(value, dict):
      out.update(_flat(value, f"{prefix}{key}."))
    else:
      out[f"{prefix}{key}"] = value
  return out


IGNORED = ("name", "data.data_dir", "train.log_every", "train.checkpoint_every", "train.keep_checkpoints")


def field_defaults(cfg) -> dict:
  """"section.field": the dataclass default of every field of a config (dataclasses.asdict's JSON form; fields
  without a default are left out): what a run written before a field existed ran with, by this project's rule
  that a new field's default keeps the old behaviour."""
  out = {}
  for f in dataclasses.fields(cfg):
    value = getattr(cfg, f.name)
    if dataclasses.is_dataclass(value):
      out.update({f"{f.name}.{k}": v for k, v in field_defaults(value).items()})
    elif f.default is not dataclasses.MISSING:
      out[f.name] = json.loads(json.dumps(f.default, default=str))
    elif f.default_factory is not dataclasses.MISSING:
      out[f.name] = json.loads(json.dumps(f.default_factory(), default=str))
  return out


def changes(config: dict, preset: dict, defaults: dict | None = None) -> dict:
  """The fields of a run's config (dataclasses.asdict form) that differ from its preset, as "section.field":
  value; paths and logging cadences are left out. A field the run's config lacks (written before the field
  existed) counts with its default (`defaults`, field_defaults of the preset): a run from before
  train.ema_decay differs from a preset that averages. Without a default it counts as None."""
  flat, base = _flat(config), _flat(preset)
  defaults = defaults or {}
  as_list = lambda v: list(v) if isinstance(v, tuple) else v
  differ = {k: v for k, v in flat.items()
            if k not in IGNORED and (k not in base or as_list(base[k]) != as_list(v))}
  for k in base.keys() - flat.keys() - set(IGNORED):
    old = defaults.get(k)
    if as_list(old) != as_list(base[k]):
      differ[k] = old
  return differ


def ablation_rows(run_dirs: list[str], metrics=SEED_METRICS) -> list[dict]:
  """One row per run folder holding results.json (a folder without one, an unfinished run, raises)."""
  from gem_jax import configs
  rows = []
  for run_dir in run_dirs:
    path = os.path.join(run_dir, "results.json")
    if not os.path.exists(path):
      raise FileNotFoundError(f"{path}: no results.json (is the run finished?)")
    with open(path) as f:
      res = json.load(f)
    dataset = res["config"]["data"]["dataset"]
    towers = {configs.seqrec(dataset, tower=t).name: t for t in configs.TOWERS}
    tower = towers.get(res["config"]["name"], "hstu")
    preset_cfg = configs.seqrec(dataset, tower=tower)
    preset = json.loads(json.dumps(dataclasses.asdict(preset_cfg), default=str))
    kept = [h["epoch"] for h in res["history"] if h.get("eval_step") == res["best_step"] and "epoch" in h]
    kept_epoch = kept[0] if kept else None   # the epoch of the kept evaluation, as it was recorded
    epochs = res["history"][-1].get("epoch") if res["history"] else None
    if res.get("valid") is None:  # trained through validation: no evaluation before the fixed last epoch
      epochs = kept_epoch = res["config"]["train"]["epochs"]
    rows.append({"run": os.path.basename(os.path.normpath(run_dir)), "dataset": dataset, "tower": tower,
                 "changes": changes(res["config"], preset, field_defaults(preset_cfg)),
                 "valid": {m: res["valid"][m] for m in metrics} if res.get("valid") else None,
                 "test": {m: res["test"][m] for m in metrics},
                 "epochs": epochs, "kept_epoch": kept_epoch,
                 "stop_reason": res["stop_reason"], "wall_s": round(res["wall_s"]["total"])})
  return rows


def markdown(rows: list[dict], metrics=SEED_METRICS) -> str:
  """Validation metrics only: the columns ablations are chosen by."""
  head = "| run | tower | changes against its preset | " + " | ".join(f"valid {m}" for m in metrics) + \
      " | epochs (kept) | wall s |"
  lines = [head, "|" + "---|" * (head.count("|") - 1)]
  for r in rows:
    change = ", ".join(f"{k}={v}" for k, v in r["changes"].items()) or "(the preset)"
    valid = [f"{r['valid'][m]:.4f}" if r["valid"] else "-" for m in metrics]  # "-": trained through validation
    lines.append(f"| {r['run']} | {r['tower']} | {change} | " + " | ".join(valid) +
                 f" | {r['epochs']} ({r['kept_epoch']}) | {r['wall_s']} |")
  return "\n".join(lines)


def curves(runs: dict[str, str], metrics=SEED_METRICS) -> dict[str, dict[int, dict[str, float]]]:
  """label -> {epoch: {metric: validation value}} from each run folder's metrics.jsonl (every evaluation the
  run logged, so an unfinished or stopped run counts too): runs cut short for time are compared at equal
  epochs. A folder without metrics.jsonl, or without any evaluation in it, raises."""
  out = {}
  for label, run_dir in runs.items():
    path = os.path.join(run_dir, "metrics.jsonl")
    if not os.path.exists(path):
      raise FileNotFoundError(f"{path}: no metrics.jsonl")
    points = {}
    with open(path) as f:
      for line_no, line in enumerate(f, 1):
        record = json.loads(line)
        if "epoch" in record and all(f"valid/{m}" in record for m in metrics):
          points[int(record["epoch"])] = {m: float(record[f"valid/{m}"]) for m in metrics}
    if not points:
      raise ValueError(f"{path}: no validation records ({', '.join('valid/' + m for m in metrics)} with an epoch)")
    out[label] = points
  return out


def curves_markdown(curves_by_label: dict[str, dict[int, dict[str, float]]], metric: str) -> str:
  """One row per evaluated epoch, one column per run ("" where a run has no evaluation at that epoch)."""
  labels = list(curves_by_label)
  epochs = sorted({e for points in curves_by_label.values() for e in points})
  lines = [f"| epoch | " + " | ".join(labels) + " |", "|" + "---|" * (len(labels) + 1)]
  for e in epochs:
    cells = [f"{curves_by_label[k][e][metric]:.4f}" if e in curves_by_label[k] else "" for k in labels]
    lines.append(f"| {e} | " + " | ".join(cells) + " |")
  return "\n".join(lines)
