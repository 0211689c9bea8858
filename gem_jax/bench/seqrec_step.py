"""How fast a next-item preset trains and evaluates on this machine, and what a setting changes about it
(experiments/bench_seqrec_step.py is the command).

Each variant is the dataset's preset (gem_jax.configs.seqrec) plus its own --set overrides, built once in this
process. Every variant trains on the same first `steps` batches of the training stream from the same
initial parameters (the source's order depends only on data.seed); rounds alternate the variants' order so
a machine that drifts taxes each alike. Per variant:
  step_s            median time of one train step (compiled; each step waited for)
  tokens_per_s      real target tokens of the timed batches over their total time (median over rounds)
  first_loss        the first step's loss: variants that only change how the same math is computed agree
                    on it to float rounding, which shows a speed setting left the arithmetic alone
  eval_users_per_s  with eval_batches > 0: users ranked per second over that many validation batches
                    (the model's scores for every item and the metrics; compile excluded)
The ratios are to the first variant.
"""

from __future__ import annotations

import statistics
import time

import jax
import numpy as np

from gem_jax import configs
from gem_jax.config import apply_overrides
from gem_jax.run.build import build


def _tokens(batch) -> int:
  return int(np.sum(np.asarray(batch.targets_T) > 0))


def _variant(dataset: str, overrides: list[str], steps: int, quick: bool, tower: str):
  cfg = apply_overrides(configs.seqrec(dataset, quick, tower), overrides)
  run = build(cfg)
  it = run.source.train_iterator()
  host = [next(it) for _ in range(steps)]
  return {"cfg": cfg, "run": run, "host": host, "batches": [run.device_batch(b) for b in host],
          "tokens": sum(_tokens(b) for b in host), "step_s": [], "tokens_per_s": []}


def _shape(batch) -> tuple:
  return tuple(np.shape(x) for x in jax.tree_util.tree_leaves(batch))


def _one_of_each_shape(batches: list) -> list:
  """The first batch of each distinct shape (token capacities round up to token_multiple, so a preset's
  batches come in a few shapes, each its own program): warming up on them keeps compiles out of the timing."""
  seen = {}
  for b in batches:
    seen.setdefault(_shape(b), b)
  return list(seen.values())


def _programs(jitted) -> int | None:
  size = getattr(jitted, "_cache_size", None)
  return size() if callable(size) else None


def _train_round(v: dict) -> None:
  run, state, times = v["run"], v["state"], []
  for batch in v["batches"]:
    t = time.perf_counter()
    state, metrics = run.train_step(state, batch)
    jax.block_until_ready(metrics)
    times.append(time.perf_counter() - t)
  v["state"] = state
  v["step_s"].extend(times)
  v["tokens_per_s"].append(v["tokens"] / sum(times))


def _eval_rate(v: dict, batches: int, rounds: int) -> float:
  run = v["run"]
  params = v["state"].params
  sharded = run.eval_batches("valid")[:batches]
  placed = [run.place(b) for b in sharded]
  users = sum(int(np.sum(np.asarray(b.row_mask_B) > 0)) for b in run.source.eval_batches("valid")[:batches])
  for b in _one_of_each_shape(placed):   # compile every shape the timed passes will run
    jax.block_until_ready(run.eval_step(params, b))
  rates = []
  for _ in range(rounds):
    t = time.perf_counter()
    run.task.evaluate([np.asarray(run.eval_step(params, b)) for b in placed], sharded)
    rates.append(users / (time.perf_counter() - t))
  return statistics.median(rates)


def compare(dataset: str, variants: dict[str, list[str]], *, steps: int = 10, rounds: int = 3,
            eval_batches: int = 0, quick: bool = False, tower: str = "hstu", log=print) -> dict:
  """{name: overrides} of the dataset's preset for `tower` (its --quick one with `quick`), timed side by side
  (module docstring) -> a JSON-able dict."""
  built = {name: _variant(dataset, overrides, steps, quick, tower) for name, overrides in variants.items()}
  for name, v in built.items():   # compile, and the first step's loss from the initial parameters
    state, metrics = v["run"].train_step(v["run"].state, v["batches"][0])
    v["first_loss"] = float(metrics["loss"])
    shapes = _one_of_each_shape(v["batches"])
    for batch in shapes[1:]:   # the other batch shapes' programs, compiled before any timed step
      state, metrics = v["run"].train_step(state, batch)
    jax.block_until_ready(metrics)
    v["state"], v["shapes"] = state, len(shapes)
    log(f"{name}: compiled {len(shapes)} batch shape(s); first loss {v['first_loss']:.6f}")
  names = list(built)
  programs = {name: _programs(v["run"].train_step) for name, v in built.items()}
  for r in range(rounds):
    for name in (names if r % 2 == 0 else names[::-1]):
      _train_round(built[name])
      log(f"{name} round {r}: {built[name]['tokens_per_s'][-1]:,.0f} tokens/s")
  out = {"dataset": dataset, "tower": tower, "steps": steps, "rounds": rounds, "variants": {}}
  for name, v in built.items():
    row = {"overrides": variants[name], "step_s": statistics.median(v["step_s"]),
           "tokens_per_s": statistics.median(v["tokens_per_s"]), "first_loss": v["first_loss"],
           "tokens_per_batch": v["tokens"] / steps, "batch_shapes": v["shapes"],
           # programs jit compiled during the timed rounds (None: this jax does not say): 0 when warm-up worked
           "compiled_while_timed": (None if programs[name] is None
                                    else _programs(v["run"].train_step) - programs[name])}
    if eval_batches:
      row["eval_users_per_s"] = _eval_rate(v, eval_batches, rounds)
    out["variants"][name] = row
  first = out["variants"][names[0]]
  for row in out["variants"].values():
    row["speedup"] = row["tokens_per_s"] / first["tokens_per_s"]
  return out


def table(result: dict) -> str:
  lines = [f"{'variant':24} {'step ms':>9} {'tokens/s':>10} {'speedup':>8} {'first loss':>12} {'eval users/s':>13}"]
  for name, row in result["variants"].items():
    ev = f"{row['eval_users_per_s']:13,.0f}" if "eval_users_per_s" in row else f"{'':13}"
    lines.append(f"{name:24} {1e3 * row['step_s']:9.1f} {row['tokens_per_s']:10,.0f} {row['speedup']:7.2f}x "
                 f"{row['first_loss']:12.6f} {ev}")
  return "\n".join(lines)
