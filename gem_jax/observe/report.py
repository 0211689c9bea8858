"""The efficiency report of a training run: what the step should cost, what it executed, and where the rest went.

`build(...)` turns numbers the trainer already has (analytic model FLOPs, the compiled step, step times,
history lengths, the mesh) into one flat dict for `report.json`; `console_table` and `plot` render it.
Definitions (per train step unless said otherwise):
  model FLOPs      analytic, real tokens only: TRAIN_FLOPS_FACTOR x gem_jax/observe/flops.py's forward count;
  executed FLOPs   XLA's cost analysis of the compiled step (padding, pointwise ops and optimizer included);
  optimizer FLOPs  XLA's cost analysis of the optimizer update alone (`optimizer_flops`): it is no padding,
                   and with the dense table updates it can outweigh the model at small batches;
                   a while loop's body counts once, so the tiled attention ("xla" impl) is undercounted:
                   `dynamic_loops` puts a note in the report when the program has one;
  padding_waste    1 - model / (executed - optimizer): padding plus the pointwise work the analytic count
                   leaves out (~5% where matmuls dominate, ~20% at 16-wide heads; tests/test_report.py);
  mfu / hfu        model / executed FLOPs per second over (peak per device x devices); the peak comes from
                   the mesh file or, on CPU, a jitted GEMM measured in the same process;
  rank_imbalance   max / mean per-shard cost (gem_jax.data.shards.py row_costs) for the pipeline's balanced
                   assignment and for a random equal split of the same rows;
  local_mfu        MFU of the same per-device batch on one device (local compute efficiency);
  scaling_efficiency  N-device examples/s / (N x one-device examples/s), same per-device batch.
A missing input gives None and a line in report["notes"]; this module never invents a number, and never
runs inside the step loop (measure_gemm_peak runs a benchmark: call it before or after training).
"""

from __future__ import annotations

import os
import re
import statistics
import time
from typing import Any, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from gem_jax.observe import hlo
from gem_jax.data import shards as data_parallel

TRAIN_FLOPS_FACTOR = 3.0   # forward + two backward GEMMs per forward GEMM (flops.py)

KEYS = ("model_tflops_per_step", "executed_tflops_per_step", "optimizer_tflops_per_step", "padding_waste",
        "mfu", "hfu", "peak_flops_per_device", "peak_source", "num_devices", "step_time_s", "examples_per_s",
        "rank_imbalance", "comm_bytes_per_step", "memory_bytes_per_device", "compile_s", "local_mfu",
        "scaling_efficiency", "notes")


# ------------------------------------------------------------------------------------------- sources

def executed_flops(compiled: Any) -> float | None:
  """XLA's "flops" of a compiled program; None when the backend has no cost analysis.

  cost_analysis() returns a dict on newer jax and a one-element list of dicts on older ones."""
  try:
    cost = compiled.cost_analysis()
  except (NotImplementedError, RuntimeError, AttributeError):
    return None
  if isinstance(cost, (list, tuple)):
    cost = cost[0] if cost else None
  if not cost or cost.get("flops") is None:
    return None
  flops = float(cost["flops"])
  return flops if flops >= 0 else None   # XLA reports -1 for "unknown"


def optimizer_flops(optimizer: Any, params: Any, opt_state: Any) -> float | None:
  """Executed FLOPs of one optimizer update (gradients shaped like params) plus applying it."""
  import optax

  def update(params, opt_state, grads):
    updates, opt_state = optimizer.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state

  return executed_flops(jax.jit(update).lower(params, opt_state, params).compile())


def dynamic_loops(hlo_text: str) -> int:
  """While loops without a known trip count: cost analysis counts their body once."""
  loops = re.findall(r"^.*\swhile\(.*\bbody=.*$", hlo_text, re.M)
  return sum(1 for line in loops if '"known_trip_count"' not in line)


def measure_gemm_peak(dtype=jnp.float32, n: int = 1024, reps: int = 5) -> float:
  """FLOP/s of a jitted n x n x n GEMM on the default device, median of `reps` timed runs (after one
  warm-up), with f32 accumulation: the CPU stand-in for a data-sheet peak."""
  if n <= 0 or reps <= 0:
    raise ValueError(f"measure_gemm_peak: n and reps must be positive, got n={n}, reps={reps}")
  a_NxN = jax.random.normal(jax.random.key(0), (n, n), jnp.float32).astype(dtype)
  b_NxN = jax.random.normal(jax.random.key(1), (n, n), jnp.float32).astype(dtype)
  gemm = jax.jit(lambda a, b: jnp.matmul(a, b, preferred_element_type=jnp.float32))
  gemm(a_NxN, b_NxN).block_until_ready()
  times = []
  for _ in range(reps):
    t = time.perf_counter()
    gemm(a_NxN, b_NxN).block_until_ready()
    times.append(time.perf_counter() - t)
  return 2.0 * n ** 3 / statistics.median(times)


def rank_imbalance(history_lengths: Sequence[int], num_shards: int, seed: int = 0, readers: int = 1) -> dict:
  """{"balanced": max/mean shard cost with the pipeline's assignment, "random": with a random equal split}.

  readers: data readers (data.readers). The rows come in reader order, and each reader balances its own rows
  over its own num_shards / readers shards (gem_jax/data/shards.py shard_part), as the random split does
  here: one pass over every row would pair one reader's long rows with another's short ones, which no
  step does, and so report a better balance than the step has."""
  cost_B = data_parallel.row_costs(np.asarray(history_lengths))
  if readers < 1 or num_shards % readers or cost_B.shape[0] % readers:
    raise ValueError(f"rank_imbalance: {readers} readers must divide the {num_shards} shards and the "
                     f"{cost_B.shape[0]} rows")
  rows, per = cost_B.shape[0] // readers, num_shards // readers
  rng = np.random.default_rng(seed)
  balanced, random = [], []
  for r in range(readers):   # raises if a reader's rows do not split evenly over its shards
    balanced.append(r * rows + data_parallel.assign_rows(cost_B[r * rows:(r + 1) * rows], per))
    random.append(r * rows + rng.permutation(rows).reshape(per, -1))
  return {"balanced": data_parallel.imbalance(cost_B, np.concatenate(balanced)),
          "random": data_parallel.imbalance(cost_B, np.concatenate(random))}


# --------------------------------------------------------------------------------------------- build

def build(*, model_flops_per_step: float, step_times_s: Sequence[float], num_devices: int,
          examples_per_step: int, compiled: Any = None, mesh: Any = None,
          executed_flops_per_step: float | None = None, optimizer_flops_per_step: float | None = None,
          comm: dict | None = None,
          memory: dict | None = None, peak_flops_per_device: float | None = None,
          measure_peak: bool = True, peak_dtype=jnp.float32, history_lengths: Sequence[int] | None = None,
          num_shards: int | None = None, compile_s: float | None = None,
          one_device: dict | None = None, seed: int = 0) -> dict:
  """The report dict (module docstring; every key of KEYS is present).

  model_flops_per_step: analytic train-step FLOPs over the real tokens (TRAIN_FLOPS_FACTOR x forward).
  step_times_s: wall times of steady steps (leave out the compiling one); the report uses their median.
  compiled / mesh: the compiled step; executed FLOPs, collectives and memory are read from it unless
    executed_flops_per_step / comm (hlo.summarize's dict) / memory (hlo.memory's dict) are given.
  optimizer_flops_per_step: `optimizer_flops(...)`, left out of padding_waste (not of HFU).
  peak_flops_per_device: the mesh file's peak; None -> a measured GEMM (if measure_peak) in peak_dtype.
  history_lengths / num_shards: the step's rows, for rank_imbalance (num_shards: data shards).
  one_device: {"step_time_s", "model_flops_per_step", "examples_per_step"[, "peak_flops_per_device"]} of
    the same per-device batch on one device; with num_devices == 1 this run is its own one-device
    measurement.
  """
  notes: list[str] = []
  times = [float(t) for t in step_times_s]
  step_time = statistics.median(times) if times else None
  if step_time is None:
    notes.append("step_time_s: no step times given; every per-second number is None")

  if executed_flops_per_step is None and compiled is not None:
    executed_flops_per_step = executed_flops(compiled)
    if executed_flops_per_step is None:
      notes.append("executed FLOPs: the backend has no cost analysis")
  elif executed_flops_per_step is None:
    notes.append("executed FLOPs: no compiled step given")
  hlo_text = compiled.as_text() if compiled is not None else None
  if hlo_text is not None and (loops := dynamic_loops(hlo_text)):
    notes.append(f"executed FLOPs: {loops} while loop(s) of unknown trip count counted once by XLA "
                 "(e.g. tiled attention); executed FLOPs and HFU are a lower bound, padding_waste too low")

  if peak_flops_per_device is not None:
    peak, source = float(peak_flops_per_device), "mesh file"
  elif measure_peak:
    peak, source = measure_gemm_peak(peak_dtype), "measured GEMM"
  else:
    peak, source = None, None
    notes.append("peak: none in the mesh file and measure_peak=False; MFU/HFU are None")

  per_s = lambda flops: flops / step_time if flops is not None and step_time else None
  util = lambda flops: (per_s(flops) / (peak * num_devices)
                        if per_s(flops) is not None and peak else None)
  if optimizer_flops_per_step is None:
    notes.append("padding_waste: optimizer FLOPs not given, so they count as waste")
  executed_model = (executed_flops_per_step - (optimizer_flops_per_step or 0.0)
                    if executed_flops_per_step else None)
  waste = 1.0 - model_flops_per_step / executed_model if executed_model and executed_model > 0 else None
  if executed_model is not None and executed_model <= 0:
    notes.append(f"padding_waste: None, the optimizer's FLOPs ({optimizer_flops_per_step:.3g}) are not below the "
                 f"step's executed FLOPs ({executed_flops_per_step:.3g})")
  if waste is not None and waste < -0.1:
    notes.append(f"padding_waste {waste:.2f} < 0: XLA counted fewer FLOPs than the analytic model "
                 "(dynamic loops, or work the analytic count does not model)")

  imbalance = None
  if history_lengths is not None and num_shards:
    imbalance = rank_imbalance(history_lengths, num_shards, seed)
  else:
    notes.append("rank_imbalance: history lengths or data shard count not given")

  if comm is None and compiled is not None and mesh is not None:
    comm = hlo.summarize(hlo.collectives(hlo_text, mesh))
  if comm is None:
    notes.append("comm_bytes_per_step: no compiled step and mesh given")
  if memory is None and compiled is not None:
    memory = hlo.memory(compiled) or None
  if memory is None:
    notes.append("memory_bytes_per_device: no memory analysis (no compiled step, or the backend has none)")
  if compile_s is None:
    notes.append("compile_s: not measured")

  examples_per_s = examples_per_step / step_time if step_time else None
  if one_device is None and num_devices == 1 and step_time:
    one_device = {"step_time_s": step_time, "model_flops_per_step": model_flops_per_step,
                  "examples_per_step": examples_per_step}
  local_mfu = scaling = None
  if one_device is not None:
    t1 = float(one_device["step_time_s"])
    one_peak = one_device.get("peak_flops_per_device") or peak   # CPU: the whole host, not a share
    local_mfu = one_device["model_flops_per_step"] / t1 / one_peak if one_peak else None
    if examples_per_s is not None:
      scaling = examples_per_s / (num_devices * one_device["examples_per_step"] / t1)
  else:
    notes.append("local_mfu / scaling_efficiency: no one-device run of the same per-device batch given")

  report = {
      "model_tflops_per_step": model_flops_per_step / 1e12,
      "executed_tflops_per_step": (executed_flops_per_step / 1e12 if executed_flops_per_step is not None
                                   else None),
      "optimizer_tflops_per_step": (optimizer_flops_per_step / 1e12 if optimizer_flops_per_step is not None
                                    else None),
      "padding_waste": waste,
      "mfu": util(model_flops_per_step),
      "hfu": util(executed_flops_per_step),
      "peak_flops_per_device": peak,
      "peak_source": source,
      "num_devices": num_devices,
      "step_time_s": step_time,
      "examples_per_s": examples_per_s,
      "rank_imbalance": imbalance,
      "comm_bytes_per_step": ({"by_kind": dict(comm["by_kind"]), "by_axis": dict(comm["by_axis"]),
                               "total": float(comm.get("total", sum(comm["by_kind"].values())))}
                              if comm is not None else None),
      "memory_bytes_per_device": dict(memory) if memory is not None else None,
      "compile_s": compile_s,
      "local_mfu": local_mfu,
      "scaling_efficiency": scaling,
      "notes": notes,
  }
  return report


# ------------------------------------------------------------------------------------------ rendering

def _fmt(value: Any) -> str:
  if value is None:
    return "-"
  if isinstance(value, float):
    return f"{value:.4g}"
  return str(value)


def console_table(report: dict) -> str:
  """Two columns, one line per number (nested dicts flattened as parent.child); notes at the end."""
  rows: list[tuple[str, str]] = []
  extra = [k for k in report if k not in KEYS and k != "history"]
  for key in [k for k in KEYS if k != "notes"] + extra:
    value = report.get(key)
    if isinstance(value, dict):
      rows.append((key, "" if value else "-"))
      for sub, v in value.items():
        if isinstance(v, dict):
          rows += [(f"  {sub}.{k}", _fmt(x)) for k, x in v.items()] or [(f"  {sub}", "-")]
        else:
          rows.append((f"  {sub}", _fmt(v)))
    else:
      rows.append((key, _fmt(value)))
  width = max(len(k) for k, _ in rows)
  lines = [f"{k:<{width}}  {v}" for k, v in rows]
  lines += [f"note: {n}" for n in report.get("notes", [])]
  return "\n".join(lines)


def plot(report: dict, history: dict, out_dir: str) -> list[str]:
  """PNG files in out_dir: every per-step series of `history` (loss, mfu, ...), rank imbalance, comm bytes
  by axis and memory by kind (the last three only when the report has them). Returns their paths."""
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt

  os.makedirs(out_dir, exist_ok=True)
  paths = []

  def save(fig, name: str) -> None:
    path = os.path.join(out_dir, name)
    fig.tight_layout()
    fig.savefig(path, dpi=80)
    plt.close(fig)
    paths.append(path)

  for name, series in history.items():
    values = [np.nan if v is None else float(v) for v in series]
    if not values:
      continue
    fig, ax = plt.subplots(figsize=(5, 3))
    ax.plot(np.arange(1, len(values) + 1), values)
    ax.set_xlabel("step")
    ax.set_ylabel(name)
    save(fig, f"{re.sub(r'[^A-Za-z0-9_]+', '_', name)}.png")

  bars = {"rank_imbalance.png": (report.get("rank_imbalance"), "max / mean shard cost"),
          "comm_by_axis.png": ((report.get("comm_bytes_per_step") or {}).get("by_axis"), "bytes / device / step"),
          "memory_by_kind.png": (report.get("memory_bytes_per_device"), "bytes / device")}
  for name, (values, label) in bars.items():
    limit = None
    if name == "rank_imbalance.png" and values:   # the ratios, not the shard, reader and step counts
      values = {k: v for k, v in values.items() if k not in ("num_shards", "readers", "steps")}
    if name == "memory_by_kind.png" and values:   # HBM as a line; XLA's bookkeeping kinds left out
      limit = values.get("hbm_bytes")
      values = {k: v for k, v in values.items()
                if k not in ("hbm_bytes", "alias", "generated_code", "peak_reported") and v is not None}
    if not values:
      continue
    fig, ax = plt.subplots(figsize=(5, 3))
    names = list(values)
    colors = None
    if name == "memory_by_kind.png":
      # The train state's parts are inside XLA's argument (and, donated, its output): drawn apart, not summed.
      inside = {"params", "optimizer_state"}
      colors = ["tab:gray" if k in inside else "tab:blue" for k in names]
      names = [f"{k} (in argument)" if k in inside else k for k in names]
    ax.bar(names, [float(v) for v in values.values()], color=colors)
    if limit:
      ax.axhline(float(limit), color="red", linestyle="--", label="HBM")
      ax.legend()
    ax.set_ylabel(label)
    ax.tick_params(axis="x", labelrotation=30)
    plt.setp(ax.get_xticklabels(), ha="right")
    save(fig, name)
  return paths
