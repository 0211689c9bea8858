"""The embedding benchmark (experiments/bench_embeddings.py): the train step against table size, dense path
and sparse engine side by side, and the sparse lookup + update on its own at several id skews and widths.

Step against table size: the `small` config, its own batches (ids from its vocabularies), with the
user_id and ad_id tables grown `scale` times (4.8M parameters at 1x). The batch is the same in every
column, so a step whose cost follows the ids it touches costs the same in every column; the dense path
(train.embedding_update=dense: a V x E gradient per table and a row-wise Adagrad pass over every row)
grows with V. Per (path, size): the median step time over `steps` blocked steps after two warm-up steps,
and the compiled step's temporary memory (XLA's memory analysis).

Lookup + update alone (`rows_per_s`): one table of `rows` x E, a batch of `ids` Zipf(a)-distributed ids,
one jitted program that gathers the distinct rows and applies row-wise Adagrad to them with a cotangent per
id (the engine's merge, update and in-place scatter, gem_jax/run/table_update.py): distinct rows per
second.
"""

from __future__ import annotations

import copy
import dataclasses
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np

from gem_jax import configs
from gem_jax.config import apply_overrides
from gem_jax.data import sources
from gem_jax.observe import hlo
from gem_jax.run import table_optim, table_update
from gem_jax.run.build import build

GROWN = ("user_id", "ad_id")


def _grown_spec(spec, scale: int):
  tables = tuple(dataclasses.replace(t, vocab_size=t.vocab_size * scale) if t.name in GROWN else t
                 for t in spec.tables)
  return dataclasses.replace(spec, tables=tables)


def table_params(spec) -> int:
  return sum(t.vocab_size * t.dim for t in spec.tables if t.name in GROWN)


def small_source(sets=()):
  """The small config's source and its first three training batches (built once for every cell)."""
  source = sources.make(apply_overrides(configs.get("small"), list(sets)))
  it = source.train_iterator()
  return source, [next(it) for _ in range(3)]


def step_row(path: str, scale: int, steps: int, source, host_batches, sets=()) -> dict:
  """One (path, size) cell: build, compile, two warm-up steps, the median of `steps` blocked steps."""
  small = apply_overrides(configs.get("small"), [f"train.embedding_update={path}", *sets])
  spec = _grown_spec(small.data.spec, scale)
  cfg = dataclasses.replace(small, data=dataclasses.replace(small.data, spec=spec))
  # The same batches in every column: the small config's stream (ids from its vocabularies, which index the
  # grown tables as well), read through a copy of its source that carries the grown spec.
  grown = copy.copy(source)
  grown.spec = spec
  run = build(cfg, source=grown)
  batches = [run.device_batch(b) for b in host_batches]
  t0 = time.perf_counter()
  compiled = run.train_step.lower(run.state, batches[0]).compile()
  compile_s = time.perf_counter() - t0
  state, times = run.state, []
  for i in range(steps + 2):
    t = time.perf_counter()
    state, m = compiled(state, batches[i % len(batches)])
    jax.block_until_ready(m)
    if i >= 2:
      times.append(time.perf_counter() - t)
  mem = hlo.memory(compiled)
  del state, run, compiled
  return {"path": path, "scale": scale, "table_params": table_params(spec),
          "all_table_params": sum(t.vocab_size * t.dim for t in spec.tables),
          "step_ms_median": statistics.median(times) * 1e3, "temp_bytes": int(mem["temp"]),
          "compile_s": compile_s, "steps": steps, "loss": float(m["loss"])}


def zipf_ids(rng, n: int, rows: int, a: float) -> np.ndarray:
  """n ids in [0, rows) with P(rank k) ~ k^-a, ranks shuffled over the rows."""
  weights = np.arange(1, rows + 1, dtype=np.float64) ** -a
  ranks = rng.choice(rows, size=n, p=weights / weights.sum())
  return rng.permutation(rows)[ranks].astype(np.int32)


def update_rows_per_s(rows: int, dim: int, ids: int, a: float, reps: int, seed: int = 0) -> dict:
  """Distinct rows per second of the engine's lookup + row-wise Adagrad update on one device."""
  rng = np.random.default_rng(seed)
  ids_N = jnp.asarray(zipf_ids(rng, ids, rows, a))
  cot_NxE = jnp.asarray(rng.normal(size=(ids, dim)).astype(np.float32))
  rule = table_optim.RowwiseAdagrad(0.05)
  table = jnp.asarray(rng.normal(size=(rows, dim)).astype(np.float32))
  acc = jnp.zeros((rows,), jnp.float32)

  def step(table, acc, ids_N, cot_NxE):
    uniq_U, g_UxE = table_update.merge_rows(ids_N, cot_NxE, rows)
    looked_up = table[jnp.where(uniq_U < rows, uniq_U, 0)]  # the forward gather of the distinct rows
    touched = (uniq_U < rows) & jnp.any(g_UxE != 0, axis=1)
    table, (acc,) = table_update.apply_rows(rule, table, (acc,), uniq_U, g_UxE, touched, 0)
    return table, acc, jnp.sum(looked_up)  # returned, so the gather is not dead code

  fn = jax.jit(step, donate_argnums=(0, 1))
  table, acc, _ = fn(table, acc, ids_N, cot_NxE)
  jax.block_until_ready(table)
  times = []
  for _ in range(reps):
    t = time.perf_counter()
    table, acc, _ = fn(table, acc, ids_N, cot_NxE)
    jax.block_until_ready(table)
    times.append(time.perf_counter() - t)
  unique = int(np.unique(np.asarray(ids_N)).size)
  ms = statistics.median(times) * 1e3
  return {"rows": rows, "dim": dim, "ids": ids, "zipf_a": a, "unique_rows": unique, "median_ms": ms,
          "unique_rows_per_s": unique / (ms / 1e3)}


def plot(rows: list[dict], path: str) -> str | None:
  """Step time against table parameters, one line per path."""
  try:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
  except ImportError:
    return None
  fig, ax = plt.subplots(figsize=(6, 4))
  for name in ("dense", "sparse"):
    pts = sorted((r["table_params"], r["step_ms_median"]) for r in rows if r["path"] == name)
    if pts:
      ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=name)
  ax.set_xscale("log")
  ax.set_yscale("log")
  ax.set_xlabel("user_id + ad_id table parameters")
  ax.set_ylabel("train step, ms (median)")
  ax.set_title("small config, batch 256: step time against table size")
  ax.legend()
  fig.tight_layout()
  fig.savefig(path, dpi=120)
  plt.close(fig)
  return path
