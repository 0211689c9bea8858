"""The host-table benchmark (experiments/bench_cache.py): the device row cache's hit rate, the train step with
a host table against the same table on the device, and the largest table a fixed device budget trains.

Hit rate (`hit_rates`): one RowCache (gem_jax/run/host_tables.py) of a fraction of `rows` slots, fed one
batch of ids per step as the trainer feeds it (the batch's distinct rows planned, then released); the rate
is hits over distinct rows read, after a warm-up of a quarter of the steps. Streams: Zipf(a) ids over
`rows` (bounded Zipf, the synthetic stream's own sampler), and the ad_id table's ids of the `small`
config's synthetic stream (history items and candidates). A fraction too small for one batch's distinct
rows has no rate (None): the step could not run.

Step time (`step_pair`): the `small` config with its ids drawn Zipf(a) (data.synthetic.zipf_exponent), built
twice, its user_id and ad_id tables on the device and on the host with a cache of `fraction` of their rows,
fed the same batches. Steps run as the trainer runs them (the next batch fed and its rows swapped in while
the step before it computes; metrics fetched one step late) in alternating chunks of both runs, so machine
noise hits both alike; a chunk's step time is its wall time over its steps; medians over chunks.
`wait_fraction`: the share of the host-table chunks' wall time the host spent waiting for evicted rows
to come back before filling the cache for the next step.

Budget (`budget_run`): a device budget of `budget_bytes` for the ad_id table (rows and row-wise Adagrad
state): on the device it holds budget / row bytes rows; on the host, a table `scale` times that trains with
a cache of that many rows. The compiled step's argument bytes (XLA's memory analysis) say what the device
holds: the same as for the step of a device table that fits the budget.
"""

from __future__ import annotations

import dataclasses
import math
import statistics
import time

import numpy as np

from gem_jax import configs
from gem_jax.config import apply_overrides
from gem_jax.data.counter_hash import zipf_rank
from gem_jax.run import host_tables
from gem_jax.run.build import build

HOST = ("user_id", "ad_id")


def zipf_stream(rows: int, ids_per_step: int, a: float, steps: int, seed: int = 0) -> list[np.ndarray]:
  rng = np.random.default_rng(seed)
  return [zipf_rank(rng.random(ids_per_step), rows, a) for _ in range(steps)]


def synthetic_stream(steps: int, table: str = "ad_id", sets=()) -> tuple[int, list[np.ndarray]]:
  """(rows of `table`, its ids in each of `steps` training batches of the small config's stream)."""
  cfg = apply_overrides(configs.get("small"), list(sets))
  run = build(cfg, abstract=True)
  it = run.source.train_iterator()
  out = []
  for _ in range(steps):
    sharded = run.source.shard(next(it), 1)
    ids = []
    for t, where, valid in host_tables.id_fields(sharded, run.source.spec):
      if t == table:
        a = host_tables.field_values(sharded, where)
        ids.append(np.reshape(a if valid is None else a[valid], -1))
    out.append(np.concatenate(ids))
  return cfg.data.spec.table(table).vocab_size, out


def hit_rate(stream: list[np.ndarray], rows: int, fraction: float, policy: str) -> float | None:
  cache = host_tables.RowCache(rows, max(1, math.ceil(fraction * rows)), policy)
  warm = len(stream) // 4
  hits = reads = 0
  for i, ids in enumerate(stream):
    rows_U = np.unique(ids)
    try:
      slots, _, filled, _ = cache.plan(rows_U)
    except host_tables.CacheTooSmall:
      return None
    cache.unpin(slots)
    if i >= warm:
      hits += len(rows_U) - len(filled)
      reads += len(rows_U)
  return hits / reads if reads else None


def hit_rates(streams: dict, fractions, policies=("lru", "lfu")) -> list[dict]:
  """streams: {zipf_a or "synthetic": (rows, [ids per step])}."""
  out = []
  for a, (rows, stream) in streams.items():
    for policy in policies:
      for f in fractions:
        out.append({"policy": policy, "zipf_a": a, "cache_fraction": f, "hit_rate": hit_rate(stream, rows, f, policy),
                    "rows": rows, "distinct_per_step": float(np.mean([len(np.unique(s)) for s in stream]))})
  return out


def _small(*sets):
  return apply_overrides(configs.get("small"), list(sets))


def _chunk(run, state, batches, i0: int, n: int):
  """n steps from batches[i0:] as the trainer runs them; -> (state, wall seconds)."""
  t0 = time.perf_counter()
  pending = None
  for i in range(i0, i0 + n):
    batch, _ = run.feed(batches[i % len(batches)])
    state, metrics = run.train_step(state, batch)
    if pending is not None:
      float(pending["loss"])
    pending = metrics
  float(pending["loss"])
  return state, time.perf_counter() - t0


def step_pair(zipf_a: float = 1.0, fraction: float = 0.2, chunks: int = 6, chunk_steps: int = 5) -> dict:
  sets = [f"data.synthetic.zipf_exponent={zipf_a}", "train.steps=1000"]
  device = build(_small(*sets))
  host = build(_small(*sets, f"train.host_tables={list(HOST)}".replace("'", '"'),
                      f"train.host_cache_fraction={fraction}"))
  it = device.source.train_iterator()
  batches = [next(it) for _ in range(2 + chunks * chunk_steps)]   # no batch twice: repeats would be hits
  states = {"device": device.state, "host": host.state}
  runs = {"device": device, "host": host}
  for name, run in runs.items():   # compile, and fill the cache
    states[name], _ = _chunk(run, states[name], batches, 0, 2)
  times = {"device": [], "host": []}
  wait = wall = 0.0
  at = 2
  for _ in range(chunks):
    for name, run in runs.items():
      w0 = host.tables.wait_s
      states[name], dt = _chunk(run, states[name], batches, at, chunk_steps)
      times[name].append(dt / chunk_steps)
      if name == "host":
        wait += host.tables.wait_s - w0
        wall += dt
    at += chunk_steps
  device_ms, host_ms = (1e3 * statistics.median(times[n]) for n in ("device", "host"))
  stats = host.tables.stats()["tables"]
  return {"zipf_a": zipf_a, "cache_fraction": fraction, "step_ms_median": host_ms, "device_step_ms_median": device_ms,
          "ratio": host_ms / device_ms, "wait_fraction": wait / wall if wall else None,
          "hit_rate": {n: s["hit_rate"] for n, s in stats.items()}, "chunks": chunks, "chunk_steps": chunk_steps,
          "step_ms": {n: [1e3 * t for t in ts] for n, ts in times.items()}}


def budget_run(budget_bytes: int, scale: int, steps: int = 3) -> dict:
  """The small config's ad_id table `scale` x what `budget_bytes` hold on the device, trained on the host with
  a cache of what the budget holds."""
  cfg = _small()
  e = cfg.data.spec.table("ad_id").dim
  row_bytes = 4 * e + 4                        # f32 row + row-wise Adagrad's accumulator
  device_rows = budget_bytes // row_bytes
  rows = device_rows * scale
  spec = cfg.data.spec
  tables = tuple(dataclasses.replace(t, vocab_size=rows) if t.name == "ad_id" else t for t in spec.tables)
  cfg = dataclasses.replace(cfg, data=dataclasses.replace(cfg.data, spec=dataclasses.replace(spec, tables=tables)))
  t0 = time.perf_counter()
  # The same config with an ad table that fits the budget, on the device: what its step holds.
  fits = dataclasses.replace(spec, tables=tuple(dataclasses.replace(t, vocab_size=device_rows) if t.name == "ad_id"
                                                else t for t in spec.tables))
  small = build(dataclasses.replace(cfg, data=dataclasses.replace(cfg.data, spec=fits)))
  first, _ = small.feed(small.source.first_batch())
  device_args = small.train_step.lower(small.state, first).compile().memory_analysis().argument_size_in_bytes
  del small, first
  cfg = apply_overrides(cfg, ['train.host_tables=["ad_id"]', f"train.host_cache_rows={device_rows}"])
  run = build(cfg)
  it = run.train_iterator()
  batch, _ = run.feed(next(it))
  memory = run.train_step.lower(run.state, batch).compile().memory_analysis()
  state, losses = run.state, []
  state, metrics = run.train_step(state, batch)
  losses.append(float(metrics["loss"]))
  for _ in range(steps - 1):
    batch, _ = run.feed(next(it))
    state, metrics = run.train_step(state, batch)
    losses.append(float(metrics["loss"]))
  cache = host_tables.host_leaves(run.state, ["ad_id"])["ad_id"]
  return {"budget_bytes": budget_bytes, "device_tier_rows": device_rows, "host_tier_rows": rows, "scale": scale,
          "host_store_bytes": sum(s.nbytes for s in run.tables.tables["ad_id"].store),
          "cache_bytes": sum(math.prod(c.shape) * c.dtype.itemsize for c in cache),
          "step_argument_bytes": memory.argument_size_in_bytes, "device_tier_step_argument_bytes": device_args,
          "losses": losses,
          "all_finite": bool(np.all(np.isfinite(losses))), "wall_s": time.perf_counter() - t0}


def plot(rates: list[dict], steps: list[dict], path: str) -> str | None:
  try:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
  except ImportError:
    return None
  fig, (ax, bx) = plt.subplots(1, 2, figsize=(11, 4))
  for a in sorted({r["zipf_a"] for r in rates}, key=str):
    for policy, style in (("lru", "-"), ("lfu", "--")):
      pts = [(r["cache_fraction"], r["hit_rate"]) for r in rates
             if r["zipf_a"] == a and r["policy"] == policy and r["hit_rate"] is not None]
      if pts:
        ax.plot(*zip(*pts), style, marker="o", label=f"{a} {policy}")
  ax.set_xscale("log")
  ax.set_xlabel("cache fraction of the table's rows")
  ax.set_ylabel("hit rate (distinct rows per step)")
  ax.legend(fontsize=7)
  labels = [f"a={s['zipf_a']}, {s['cache_fraction']:.0%}" for s in steps]
  x = np.arange(len(steps))
  bx.bar(x - 0.2, [s["device_step_ms_median"] for s in steps], 0.4, label="tables on the device")
  bx.bar(x + 0.2, [s["step_ms_median"] for s in steps], 0.4, label="host tables + cache")
  bx.set_xticks(x, labels)
  bx.set_ylabel("step ms (median)")
  bx.legend(fontsize=7)
  fig.tight_layout()
  fig.savefig(path, dpi=110)
  plt.close(fig)
  return path
