"""MovieLens-100K engagement baselines, scored by the same metric code as GEM (gem_jax/metrics.py) on the same
time-split evaluation rows (gem_jax/data/movielens.py):

  base_rate        predict each task's training rate (AUC 0.5 by definition)
  logreg           logistic regression on the same one-hot features GEM's non-sequence part reads (one weight
                   per table row and task, multi-hot features mean-pooled, the dense features), trained with
                   Adam on the same batches; no history
  gem_no_history   the GEM config with every history emptied (data.history=false): the sequence arch sees
                   only the target token
  gem              the GEM config in full

`run(prepared, out)` trains all four and returns {task: {baseline: {"auc", "ne"}}, "wall_s": {...}}.
"""

from __future__ import annotations

import os
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax

from gem_jax import configs, metrics
from gem_jax.config import apply_overrides
from gem_jax.data import parquet_source


def _eval_arrays(batches, k: int):
  labels = np.concatenate([np.asarray(b.labels_BxK) for b in batches])
  mask = np.concatenate([np.asarray(b.label_mask_BxK) * np.asarray(b.example_mask_B)[:, None] for b in batches])
  return labels, mask


def _scores(labels, mask, probs, names) -> dict:
  return {t: {"auc": metrics.auc(labels[:, i], probs[:, i], mask[:, i]),
              "ne": metrics.normalized_entropy(labels[:, i], probs[:, i], mask[:, i])} for i, t in enumerate(names)}


def _pooled(w_V, jag, batch_size):
  """Mean of w over each row's ids of a multi-hot Jagged (0 for a row without ids)."""
  values, offsets = jnp.asarray(jag.values), jnp.asarray(jag.offsets)
  row = jnp.searchsorted(offsets, jnp.arange(values.shape[0]), side="right") - 1
  live = jnp.arange(values.shape[0]) < offsets[-1]
  total = jax.ops.segment_sum(jnp.where(live[:, None], w_V[values], 0.0), jnp.where(live, row, 0), batch_size)
  count = jnp.maximum(offsets[1:] - offsets[:-1], 1)[:, None]
  return total / count


def logistic_regression(source, epochs: int = 3, learning_rate: float = 0.003, l2: float = 1e-6):
  """(eval probabilities N x K, seconds) of one-hot logistic regression trained on `source`'s batches."""
  spec, K = source.spec, len(source.spec.tasks)
  params = {"w": {t.name: jnp.zeros((t.vocab_size, K), jnp.float32) for t in spec.tables},
            "dense": jnp.zeros((spec.dense_dim, K), jnp.float32), "bias": jnp.zeros((K,), jnp.float32)}
  tx = optax.adam(learning_rate)

  def logits(p, batch):
    B = batch.example_mask_B.shape[0]
    z = p["bias"] + jnp.asarray(batch.dense_BxG) @ p["dense"]
    for f in spec.sparse:
      w = p["w"][f.table]
      z = z + (_pooled(w, batch.multi_hot[f.name], B) if f.multi_hot else w[jnp.asarray(batch.sparse[f.name])])
    return z

  def loss(p, batch):
    z, y = logits(p, batch), jnp.asarray(batch.labels_BxK)
    m = jnp.asarray(batch.label_mask_BxK) * jnp.asarray(batch.example_mask_B)[:, None]
    bce = jnp.maximum(z, 0) - y * z + jnp.log1p(jnp.exp(-jnp.abs(z)))
    reg = l2 * sum(jnp.sum(jnp.square(w)) for w in jax.tree_util.tree_leaves(p["w"]))
    return jnp.sum(bce * m) / jnp.maximum(jnp.sum(m), 1.0) + reg

  @jax.jit
  def step(p, s, batch):
    g = jax.grad(loss)(p, batch)
    u, s = tx.update(g, s, p)
    return optax.apply_updates(p, u), s

  t0 = time.perf_counter()
  state, it = tx.init(params), source.train_iterator()
  for _ in range(epochs * source.steps_per_epoch()):
    params, state = step(params, state, next(it))
  predict = jax.jit(lambda p, b: jax.nn.sigmoid(logits(p, b)))
  probs = np.concatenate([np.asarray(predict(params, b)) for b in source.eval_batches()])
  return probs, time.perf_counter() - t0


def run(prepared: str, out: str, steps: int | None = None) -> dict:
  """All four baselines on the prepared folder `prepared` (GEM runs write to out/gem*, see module docstring)."""
  from gem_jax.train import jobs
  cfg = parquet_source.with_files(configs.get("movielens"), prepared)
  if steps is not None:
    cfg = configs.with_steps(cfg, steps)
  source = parquet_source.ParquetSource(cfg)
  names = source.spec.task_names
  labels, mask = _eval_arrays(source.eval_batches(), len(names))
  # Training rates, over the same label masks the losses use.
  pos = np.zeros(len(names))
  cnt = np.zeros(len(names))
  for i in range(source.steps_per_epoch()):
    b = source.block(i, source.batch_size)
    pos += (b.labels_nxK * b.label_mask_nxK).sum(0)
    cnt += b.label_mask_nxK.sum(0)
  rates = pos / cnt
  results, wall = {t: {} for t in names}, {}
  for t, v in _scores(labels, mask, np.broadcast_to(rates, labels.shape), names).items():
    results[t]["base_rate"] = v
  probs, wall["logreg"] = logistic_regression(source)
  for t, v in _scores(labels, mask, probs, names).items():
    results[t]["logreg"] = v
  for name, sets in (("gem_no_history", ["data.history=false"]), ("gem", [])):
    t0 = time.perf_counter()
    summary = jobs.train_config(apply_overrides(cfg, sets), os.path.join(out, name), progress=False, report=False)
    wall[name] = time.perf_counter() - t0
    for t in names:
      m = summary["tasks"][t]
      results[t][name] = {"auc": m["eval_auc"], "ne": m["eval_ne"]}
  return {**results, "wall_s": wall, "steps": cfg.train.steps, "train_rates": dict(zip(names, rates.tolist()))}


def table(results: dict) -> str:
  rows = ["| model | like AUC | like NE | love AUC | love NE |", "|---|---|---|---|---|"]
  for name in ("base_rate", "logreg", "gem_no_history", "gem"):
    cells = [f"{results[t][name]['auc']:.4f} | {results[t][name]['ne']:.4f}" for t in ("like", "love")]
    rows.append(f"| {name} | " + " | ".join(cells) + " |")
  return "\n".join(rows)
