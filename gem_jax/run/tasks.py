"""Tasks: everything a run does that depends on what is being predicted, behind one interface.

A Task builds its model and owns its loss and its metrics; the step, the trainer, the meter and the
simulator never look inside. Registered by the type of its config (Config.task), so a new head type is a
new config dataclass, a Task class and `@register(ThatConfig)` in one new file (tests/test_run.py adds one
in the test itself):

  build_model(cfg, source, rngs)     the nnx model (GEM, the next-item tower, ...)
  train_key(seed)                    the key the step folds each step's dropout key from
  sums(model, batch, dropout_rng)    per data shard, additive: {name: array}; the step sums them over the mesh
  loss(totals)                       (scalar loss, {metric: scalar}) from the summed totals, on device
  predict(model, batch)              what evaluation needs per example, leading dim b (on device)
  eval_example(train_batch)          a host batch of the kind predict reads (default: the training batch;
                                     what compile_for lowers the eval program on)
  count(batch)                       host counters of a training batch ({name: np.ndarray}, summed by the trainer)
  evaluate(predictions, batches)     host metrics of one evaluation split
  summarize(evaluations, counters)   the task's part of summary.json from the final evaluation of every
                                     split ({split: evaluate(...)}) and the training counters

AdsMultiTask, below: GEM with per-domain towers and weighted BCE over click / conversion-style tasks with
label masks and parent tasks (gem_jax/model/heads.py), NE / AUC / calibration per task, the planted model's
NE where the data has one. NextItem (gem_jax/run/next_item.py): next-item prediction with a sampled or
full softmax and HR@K / NDCG@K full ranking.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from gem_jax import metrics as metrics_lib
from gem_jax.model.gem import GEM
from gem_jax.model.heads import loss_from_sums, multitask_sums
from gem_jax.registry import Registry

RNG_STREAM = 0x64726F70  # folded into the seed for the training key, apart from nnx's parameter streams

_TASKS = Registry("task")
register, names = _TASKS.register, _TASKS.names


def make(task_cfg, source):
  """The Task for `task_cfg` (any registered config dataclass) reading `source`."""
  return _TASKS.lookup(task_cfg)(task_cfg, source)


class Task:
  """Base class with the defaults a task may keep (see the module docstring for the interface)."""
  name = "task"

  def __init__(self, config, source):
    self.config, self.source = config, source

  def train_key(self, seed: int):
    return jax.random.fold_in(jax.random.key(seed), RNG_STREAM)

  def count(self, batch) -> dict[str, np.ndarray]:
    return {}

  def eval_example(self, train_batch):
    """A host batch of the kind `predict` reads. Most tasks evaluate on batches like their training ones."""
    return train_batch

  def summarize(self, evaluation: dict, counters: dict) -> dict:
    return {"eval": evaluation}

  def selectable(self) -> dict[str, int]:
    """The metrics train.select_metric may name ("task/metric" for nested evaluations), each with its
    direction: +1 when higher is better, -1 when lower is."""
    return {}


# ---- ads: GEM, weighted multi-task BCE ---------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class AdsMultiTaskConfig:
  """No options: the tasks, their weights and parent tasks come from the feature spec."""


@register(AdsMultiTaskConfig)
class AdsMultiTask(Task):
  name = "ads_multitask"

  def __init__(self, config, source):
    super().__init__(config, source)
    self.spec = source.spec

  def build_model(self, cfg, source, rngs):
    return GEM(self.spec, cfg.model, rngs=rngs)

  def sums(self, model, batch, dropout_rng):
    bce_K, examples, counts_K = multitask_sums(model(batch, dropout_rng=dropout_rng), batch, self.spec)
    return {"bce_K": bce_K, "examples": examples, "counts_K": counts_K}

  def loss(self, totals):
    return loss_from_sums(totals["bce_K"], totals["examples"], totals["counts_K"], self.spec)

  def predict(self, model, batch):
    return jax.nn.sigmoid(model(batch).astype(jnp.float32))

  def selectable(self) -> dict[str, int]:
    return {f"{t}/{m}": sign for t in self.spec.task_names for m, sign in (("ne", -1), ("auc", 1))}

  def count(self, batch) -> dict[str, np.ndarray]:
    """Label positives and counted labels per task over the real rows: the base rates of baseline NE."""
    mask_BxK = np.asarray(batch.label_mask_BxK) * np.asarray(batch.example_mask_B)[:, None]
    return {"label_positives": (np.asarray(batch.labels_BxK) * np.asarray(batch.label_mask_BxK)).sum(0),
            "label_counts": mask_BxK.sum(0)}

  def evaluate(self, predictions, batches) -> dict:
    """NE / AUC / calibration per task of `predictions` (one array per sharded host batch), and the planted
    model's metrics under "optimal/<task>" when every counted example has a planted logit."""
    model_acc, planted_acc, has_planted = metrics_lib.TaskMetrics(), metrics_lib.TaskMetrics(), True
    k = len(self.spec.tasks)
    rows = lambda x: np.asarray(x).reshape(-1, k)
    for probs, batch in zip(predictions, batches):
      mask = rows(batch.label_mask_BxK) * np.asarray(batch.example_mask_B).reshape(-1)[:, None]
      model_acc.add(rows(batch.labels_BxK), rows(probs), mask)
      planted = rows(batch.planted_logits_BxK)
      if has_planted and np.all(np.isfinite(planted[mask > 0])):
        planted_acc.add(rows(batch.labels_BxK), 1.0 / (1.0 + np.exp(-planted)), mask)
      else:
        has_planted = False
    out = dict(model_acc.result(self.spec.task_names))
    if has_planted:
      out.update({f"optimal/{t}": m for t, m in planted_acc.result(self.spec.task_names).items()})
    return out

  def summarize(self, evaluation: dict, counters: dict) -> dict:
    """Per task: eval NE / AUC / calibration next to baseline_ne (predicting the training base rate) and
    optimal_ne (the planted model), and the share of that gap the model closed."""
    split = self.source.eval_splits[0]
    evaluation = evaluation[split]
    labels_K, mask_K = _labels(self.source.eval_batches(split), len(self.spec.tasks))
    base_rates = counters["label_positives"] / np.maximum(counters["label_counts"], 1)
    tasks = {}
    for i, task in enumerate(self.spec.task_names):
      m, planted = evaluation[task], evaluation.get(f"optimal/{task}", {})
      baseline = metrics_lib.normalized_entropy(labels_K[:, i], np.full(labels_K.shape[0], base_rates[i]),
                                                mask_K[:, i])
      optimal = planted.get("ne", float("nan"))
      tasks[task] = {"eval_ne": m["ne"], "eval_auc": m["auc"], "eval_calibration": m["calibration"],
                     "eval_base_rate": m["base_rate"], "eval_count": m["count"],
                     "train_base_rate": float(base_rates[i]), "baseline_ne": baseline,
                     "optimal_ne": optimal, "optimal_auc": planted.get("auc", float("nan")),
                     "gap_closed": (baseline - m["ne"]) / (baseline - optimal) if baseline > optimal else None}
    return {"tasks": tasks}


def _labels(batches, k: int):
  """Every eval label and its mask (real rows, counted labels), task-major columns: (N x K, N x K)."""
  labels = np.concatenate([np.asarray(b.labels_BxK).reshape(-1, k) for b in batches])
  mask = np.concatenate([np.asarray(b.label_mask_BxK).reshape(-1, k) * np.asarray(b.example_mask_B).reshape(-1)[:, None]
                         for b in batches])
  return labels, mask

