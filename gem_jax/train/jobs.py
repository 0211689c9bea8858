"""Whole jobs over the spine: a config trained with the standard hooks, a checkpoint evaluated on any mesh.

  train_config(cfg, out_dir)        build(cfg) + the standard hooks + train: what experiments/train.py and
                                    experiments/seqrec.py run
  evaluate_checkpoint(cfg, out_dir) the newest usable checkpoint of a run, restored (resharded) onto cfg's
                                    mesh and evaluated
  evaluate_average(cfg, out_dir, steps)  the mean of several training checkpoints' parameters, evaluated
  standard_hooks(run, ...)          the hooks of a training job, by the config's cadences

The run folder: metrics.jsonl, checkpoints/ (best/ with model selection), summary.json, and with the report
report.json, plots/ and profile/ (gem_jax/train/hooks.py, gem_jax/train/efficiency.py).
"""

from __future__ import annotations

import hashlib
import os
from typing import Callable

from gem_jax.run.build import build
from gem_jax.train import hooks as hooks_lib
from gem_jax.train import trainer
from gem_jax.train.checkpoint import Checkpointer, fingerprint
from gem_jax.train.efficiency import Meter


def standard_hooks(run, *, progress: bool = True, report: bool = True) -> list:
  """Checkpoint, the efficiency meter, metrics.jsonl, the non-finite guard and evaluation (in any order:
  gem_jax/train/hooks.py)."""
  tc = run.cfg.train
  per_epoch = run.source.steps_per_epoch()
  every = trainer.eval_every(run)
  out = [hooks_lib.Checkpoint(tc.checkpoint_every, tc.keep_checkpoints)]
  if report:
    out.append(Meter(imbalance_every=tc.log_every))
  out += [hooks_lib.MetricsLog(tc.log_every, progress=progress),
          hooks_lib.Guard(tc.nonfinite_patience, tc.on_nonfinite, tc.max_nonfinite_restores),
          hooks_lib.Evaluate(every, select=tc.select_metric, patience=tc.patience, max_minutes=tc.max_train_minutes,
                             steps_per_epoch=per_epoch)]
  return out


def train_config(cfg, out_dir: str, *, resume: bool = False, progress: bool = True, report: bool = True,
                 stop_after: int | None = None, on_event: Callable[[str, int], None] | None = None) -> dict:
  """Trains `cfg` into out_dir and returns the summary (trainer.train's)."""
  run = build(cfg)
  return trainer.train(run, out_dir, standard_hooks(run, progress=progress, report=report), resume=resume,
                       stop_after=stop_after, on_event=on_event)


def evaluate_checkpoint(cfg, out_dir: str, step: int | None = None, devices=None,
                        folder: str = "checkpoints") -> dict:
  """Evaluates checkpoint `step` (default: the newest usable) of the run in out_dir on cfg's mesh, which
  need not be the mesh that wrote it: the checkpoint is resharded on restore. devices: the mesh's devices
  (default: build's). folder: "checkpoints", or "best" for the parameters model selection kept.

  -> {"step", "mesh", "devices", "evaluation": {split: metrics}, "state_fingerprint"}; the fingerprint
  (hex of the train state's integrity hashes) is the same on every mesh when the restore is bit-exact.
  """
  run = build(cfg, devices=devices)
  target = run.restore_target()
  with Checkpointer(os.path.join(out_dir, folder), keep=cfg.train.keep_checkpoints,
                    save_every=cfg.train.checkpoint_every) as ckpt:
    # host tables whole: evaluate reads them so; best/ holds the parameters alone (gem_jax/train/hooks.py)
    step, state, _ = ckpt.restore(step, abstract_state=target if folder == "checkpoints" else target.params)
    fallbacks = [fb.as_dict() for fb in ckpt.fallbacks]
  # a training checkpoint's evaluation reads what the run's did: the dense average with train.ema_decay
  params = run.optimizer.averaged(state.params, state.opt_state) if folder == "checkpoints" else state
  evaluation = {split: trainer.evaluate(run, params, split) for split in run.source.eval_splits}
  return {"step": step, "mesh": run.mesh_spec.name, "devices": run.mesh_spec.num_devices,
          "evaluation": trainer.jsonable_summary(evaluation),
          "state_fingerprint": hashlib.sha256(fingerprint(state).tobytes()).hexdigest()[:16],
          "checkpoint_fallbacks": fallbacks}


def evaluate_average(cfg, out_dir: str, steps: list[int], devices=None) -> dict:
  """Evaluates the element-wise mean of the parameters of training checkpoints `steps` of the run in out_dir
  (each checkpoint's evaluation parameters: its dense average with train.ema_decay), computed in float32 and
  cast back: checkpoint averaging after the fact, on cfg's mesh.

  -> {"steps", "evaluation": {split: metrics}, "each": {step: {split: metrics}}}: the mean's metrics and
  every checkpoint's own, side by side.
  """
  if len(set(steps)) < 2:
    raise ValueError(f"evaluate_average needs at least two different checkpoint steps, got {steps}")
  run = build(cfg, devices=devices)
  target = run.restore_target()
  each, trees = {}, []
  with Checkpointer(os.path.join(out_dir, "checkpoints"), keep=cfg.train.keep_checkpoints,
                    save_every=cfg.train.checkpoint_every) as ckpt:
    for step in steps:
      _, state, _ = ckpt.restore(step, abstract_state=target, fallback=False)
      params = run.optimizer.averaged(state.params, state.opt_state)
      each[step] = trainer.jsonable_summary({split: trainer.evaluate(run, params, split)
                                             for split in run.source.eval_splits})
      trees.append(params)

  averaged = mean_params(trees, steps)
  evaluation = {split: trainer.evaluate(run, averaged, split) for split in run.source.eval_splits}
  return {"steps": list(steps), "evaluation": trainer.jsonable_summary(evaluation), "each": each}


def mean_params(trees: list, steps: list[int]):
  """The element-wise mean of parameter trees (one per checkpoint step), summed in float32 and cast back to
  each leaf's dtype. A leaf that is not floating point has no mean: it must be equal in every tree."""
  import jax
  import jax.numpy as jnp
  import numpy as np

  def mean(path, *xs):
    if jnp.issubdtype(xs[0].dtype, jnp.floating):
      return (sum(jnp.asarray(x, jnp.float32) for x in xs) / len(xs)).astype(xs[0].dtype)
    for step, x in zip(steps[1:], xs[1:]):
      if not np.array_equal(np.asarray(x), np.asarray(xs[0])):
        raise ValueError(f"parameter {jax.tree_util.keystr(path)} ({xs[0].dtype}) differs between checkpoints "
                         f"{steps[0]} and {step}: a leaf that is not floating point cannot be averaged")
    return xs[0]

  return jax.tree_util.tree_map_with_path(mean, *trees)


def train_next_item(cfg, out_dir: str, *, resume: bool = False, report: bool = True, log=print) -> dict:
  """train_config for a next-item config, and out_dir/results.json in the public benchmarks' format:
  dataset sizes, the config, the kept evaluation's validation and test metrics next to the most-popular
  baseline, every evaluation, and the wall times."""
  import dataclasses
  import json

  import jax

  summary = train_config(cfg, out_dir, resume=resume, progress=False, report=report)
  selected = summary.get("selected", {})
  results = {
      "dataset": summary["stats"]["dataset"],
      "stats": {k: summary["stats"][k] for k in ("users", "items", "interactions", "file", "sha256")},
      "config": dataclasses.asdict(cfg),
      "parameters": summary["params"]["sparse"] + summary["params"]["dense"],
      "best_step": selected.get("step"), "stop_reason": summary["stop_reason"], "steps": summary["steps"],
      # None when the run trained through the validation item (data.train_through_valid: nothing held out)
      "valid": summary.get("valid"), "test": summary["test"],
      "baseline_most_popular": summary["baseline_most_popular"],
      "history": summary["evaluations"],
      # total: every process of a resumed run (Trainer.wall_s); this_process: the one that finished it
      "wall_s": {"total": summary["wall_s"], "this_process": summary["wall_s_this_run"],
                 "compile": summary["compile_s"]},
      "platform": {"backend": jax.default_backend(), "devices": jax.device_count(), "cpus": os.cpu_count(),
                   "jax": jax.__version__}}
  if jax.process_index() == 0:
    with open(os.path.join(out_dir, "results.json"), "w") as f:
      json.dump(trainer.jsonable_summary(results), f, indent=1, default=str)
  log(f"{results['dataset']}: kept step {results['best_step']} ({results['stop_reason']}); test "
      + " ".join(f"{k} {v:.4f}" for k, v in results["test"].items()) + f"; wall {summary['wall_s']:.0f}s")
  return results



def _check_same_file(done: str, stats: dict, data) -> None:
  """A finished seed must have read the file this run would read (a results.json from before files were
  recorded passes): ML-1M's ratings.dat, when present, replaces the sequence file and orders ties otherwise."""
  from gem_jax.data import seqrec
  if not stats.get("sha256"):
    return
  found = seqrec.dataset_path(data.dataset, data.data_dir)
  now = (os.path.relpath(found[0], data.data_dir), seqrec.file_sha256(found[0])) if found else ("(none)", "")
  if (stats.get("file"), stats["sha256"]) != now:
    raise ValueError(f"{done} was trained on {stats.get('file')} (sha256 {stats['sha256'][:12]}), but this run would "
                     f"read {now[0]} (sha256 {now[1][:12]}) under {data.data_dir}: its seeds would mix two datasets; "
                     "remove the folder, use another --out or restore the file it read")


def train_next_item_seeds(cfg, out_dir: str, seeds: list[int], *, resume: bool = False, report: bool = True,
                          command: str = "", log=print) -> dict:
  """train_next_item once per seed (train.seed and data.seed both set to it) into out_dir/seed-<s>, then
  out_dir/seeds.json: seed_summary of the kept evaluations, the command and every run's folder. A seed whose
  folder already holds results.json of the same config is read, not retrained (so an interrupted sweep goes
  on where it stopped, and seeds can run as separate processes); another config there raises. With resume,
  an unfinished seed continues from its checkpoint."""
  import dataclasses
  import json

  import jax

  from gem_jax.train import seqrec_results

  per_seed = []
  for seed in seeds:
    run_dir = os.path.join(out_dir, f"seed-{seed}")
    done = os.path.join(run_dir, "results.json")
    seeded = dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, seed=seed),
                                 data=dataclasses.replace(cfg.data, seed=seed))
    if os.path.exists(done):
      with open(done) as f:
        results = json.load(f)
      wanted = json.loads(json.dumps(dataclasses.asdict(seeded), default=str))
      differ = seqrec_results.changes(results["config"], wanted, seqrec_results.field_defaults(seeded))
      if differ:
        raise ValueError(f"{done} was trained with another config than seed {seed} of this one: {differ}; "
                         "remove the folder or use another --out")
      _check_same_file(done, results.get("stats", {}), cfg.data)
      log(f"seed {seed}: read {done}")
    else:
      results = train_next_item(seeded, run_dir, resume=resume, report=report, log=log)
    per_seed.append({"seed": seed, "valid": results["valid"], "test": results["test"], "dir": run_dir,
                     "best_step": results["best_step"], "wall_s": results["wall_s"]["total"]})
  summary = {**seqrec_results.seed_summary(per_seed), "command": command, "config": cfg.name,
             "runs": [{k: r[k] for k in ("seed", "dir", "best_step", "wall_s")} for r in per_seed]}
  if jax.process_index() == 0:
    with open(os.path.join(out_dir, "seeds.json"), "w") as f:
      json.dump(summary, f, indent=1)
  for split in ("valid", "test"):
    if split not in summary:
      continue
    s = summary[split]
    log(f"{split} over seeds {seeds}: " + " ".join(f"{m} {s['mean'][m]:.4f} +- {s['std'][m]:.4f}" for m in s["mean"]))
  return summary
