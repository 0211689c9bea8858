"""FP8 loss parity over seeds: one config trained under several precision policies (experiments/fp8_parity.py).

For each seed every policy (gem_jax/precision/policy.py) trains from that seed's initial parameters on that
seed's batches (seed_config: the same synthetic world and evaluation set, a disjoint stretch of the training
stream), so within a seed only the Dense sites' matmuls differ. Per seed and policy: final eval NE / AUC per
task and `rel_ne_gap` = (NE - NE_base) / NE_base against the first policy (the baseline, bf16) of the same
seed. Over seeds: the mean and sample standard deviation of NE and of the gap.

One seed's trajectory noise is as large as the effects measured (f32 against bf16 alone moved click NE by
0.3% at 200 steps), so a gap is judged against a noise floor: the baseline's own seed-to-seed spread and the
gap of "none" (the float32 compute dtype of `small`) to bf16. A policy passes a task when its mean gap is
within BOUND and within two standard deviations (over seeds) of the float32 gap. Runs too short or with too
few seeds to say that (--quick, one seed, no "none") are labelled as smoke tests, not parity claims.

Also per policy: the share of the Dense matmul FLOPs under each recipe (rows per site as a probe capture sees
them: tokens for sequence sites, examples for the rest) and, optionally, the train step's compiled memory.
The PNG shows the gap per seed and the loss curves of the first seed. On CPU every FP8 recipe is emulated,
so times say nothing about GPU speed; the numbers that matter are the NE gaps.
"""

from __future__ import annotations

import concurrent.futures
import json
import math
import multiprocessing
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


BOUND = 0.005        # the claim: the policy's mean relative NE gap to bf16 is within 0.5%
SEED_STRIDE = 1 << 20  # seed s trains on the stream's blocks from s * SEED_STRIDE (disjoint for every run length)
PROBE = "probe"      # the policy label of a probe's end-to-end proposal (parity(..., probe=...))


def with_policy(cfg, name: str):
  return apply_overrides(cfg, [f"model.precision.policy={name}"])


def seed_config(cfg, seed: int):
  """cfg for seed `seed` (0: cfg itself): initial parameters and dropout from train.seed + seed, training
  batches from a disjoint stretch of the stream (synthetic: blocks from first_block + seed * SEED_STRIDE;
  Parquet: the shuffle seed). The world, the planted model and the evaluation set stay the same."""
  sets = [f"train.seed={cfg.train.seed + seed}"]
  if hasattr(cfg.data, "synthetic"):
    sets.append(f"data.synthetic.first_block={cfg.data.synthetic.first_block + seed * SEED_STRIDE}")
  elif hasattr(cfg.data, "shuffle_window") and cfg.data.shuffle_window > 1:
    sets.append(f"data.seed={cfg.data.seed + seed}")
  else:
    raise ValueError(f"{type(cfg.data).__name__}: no per-seed training order (an unshuffled file source reads "
                     "the same batches for every seed)")
  return apply_overrides(cfg, sets) if seed else cfg


def probe_policy(probe: dict) -> list[str]:
  """The overrides of a probe JSON's end-to-end proposal (experiments/fp8_probe.py --out): its sites in
  the probed recipe, every other site bf16."""
  e2e = probe.get("end_to_end") or {}
  if "rules" not in e2e:
    raise ValueError("the probe JSON has no end-to-end proposal (end_to_end.rules): rerun fp8_probe.py with "
                     "--end-to-end RECIPE")
  return ["model.precision.policy=bf16", f"model.precision.rules={json.dumps(e2e['rules'])}"]


def policy_config(cfg, name: str, probe: dict | None = None):
  if name == PROBE:
    if probe is None:
      raise ValueError(f"policy {PROBE!r} needs a probe JSON")
    return apply_overrides(cfg, probe_policy(probe))
  return with_policy(cfg, name)


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


def flop_shares(cfg, names, probe: dict | None = None) -> dict:
  """Per policy, the share of Dense matmul FLOPs under each recipe (rows per site from site_rows)."""
  run = build(cfg, abstract=True)
  rows = site_rows(run, run.source.first_batch())
  out = {}
  for name in names:
    model = build(policy_config(cfg, name, probe), abstract=True).model()
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


def _ema(values, decay=0.9):
  out, acc = [], None
  for v in values:
    acc = v if acc is None else decay * acc + (1 - decay) * v
    out.append(acc)
  return np.asarray(out)


def plot(out: dict, curves: dict, path: str) -> None:
  """One panel per task: each policy's relative NE gap to the baseline per seed (dots), its mean and
  standard deviation (bar), the bound (dashed) and the float32 gap's mean +- 2 std (band); last panel: the
  first seed's train loss per policy (EMA 0.9, single-batch losses are noisy)."""
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt

  tasks = list(out["tasks"])
  names = [n for n in out["policies"] if n != out["baseline"]]
  fig, axes = plt.subplots(1, len(tasks) + 1, figsize=(4.2 * (len(tasks) + 1), 4.2))
  floor = out["noise_floor"]
  for ax, task in zip(axes, tasks):
    for x, name in enumerate(names):
      r = out["policies"][name]
      gaps = [100 * s["rel_ne_gap"][task] for s in r["seeds"]]
      ax.scatter([x] * len(gaps), gaps, s=18, alpha=0.7)
      std = r["rel_ne_gap_std"][task]
      ax.errorbar([x + 0.15], [100 * r["rel_ne_gap_mean"][task]], yerr=[100 * (std or 0.0)], fmt="o", color="k",
                  capsize=3)
    if floor.get("f32_gap_std") and floor["f32_gap_std"].get(task) is not None:
      mean, std = floor["f32_gap_mean"][task], floor["f32_gap_std"][task]
      ax.axhspan(100 * (mean - 2 * std), 100 * (mean + 2 * std), color="tab:gray", alpha=0.2,
                 label="float32 gap +- 2 std")
    for y in (-100 * BOUND, 100 * BOUND):
      ax.axhline(y, color="tab:red", linestyle="--", linewidth=0.8)
    ax.axhline(0.0, color="k", linewidth=0.5)
    ax.set_xticks(range(len(names)), names)
    ax.set_title(f"{task}: NE gap to {out['baseline']} (%)")
    ax.grid(alpha=0.3)
  axes[0].legend(loc="best", fontsize=8)
  loss_ax = axes[-1]
  for name, (steps, losses) in curves.items():
    loss_ax.plot(steps, _ema(losses), label=name, linewidth=1.0)
  loss_ax.set_title(f"train loss, seed {out['seeds'][0]}")
  loss_ax.set_xlabel("step")
  loss_ax.legend(fontsize=8)
  loss_ax.grid(alpha=0.3)
  fig.suptitle(f"{out['config']}: {len(out['seeds'])} seeds x {out['steps']} steps"
               + ("" if out["parity_claim"] else " (smoke test, not a parity claim)"))
  fig.tight_layout()
  fig.savefig(path, dpi=120)
  plt.close(fig)


def train_one(cfg, run_dir: str, compile_cache: str | None = None) -> tuple[dict, tuple]:
  """Trains cfg into run_dir: (the record of one seed and policy, its train loss curve). A worker process
  of parity(..., jobs > 1) runs this with the shared persistent compilation cache."""
  if compile_cache:
    jax.config.update("jax_compilation_cache_dir", compile_cache)
  t = time.perf_counter()
  summary = train_config(cfg, run_dir, progress=False, report=False)
  record = {"eval_ne": {task: m["eval_ne"] for task, m in summary["tasks"].items()},
            "eval_auc": {task: m["eval_auc"] for task, m in summary["tasks"].items()},
            "train_s": time.perf_counter() - t, "examples_per_s": summary["examples_per_s"]}
  return record, loss_curve(run_dir)


def _stats(values) -> tuple[float, float | None]:
  """Mean and sample standard deviation (None for one value)."""
  values = np.asarray(values, np.float64)
  return float(values.mean()), (float(values.std(ddof=1)) if len(values) > 1 else None)


def summarize(records: dict, names, seeds, tasks) -> tuple[dict, dict]:
  """records[(seed, policy)] -> (policies, noise_floor) of the module docstring."""
  base = names[0]
  policies = {}
  for name in names:
    per_seed = []
    for seed in seeds:
      r, b = records[(seed, name)], records[(seed, base)]
      per_seed.append({"seed": seed, **r, "rel_ne_gap": {
          task: (r["eval_ne"][task] - b["eval_ne"][task]) / b["eval_ne"][task] for task in tasks}})
    entry = {key: {} for key in ("eval_ne_mean", "eval_ne_std", "rel_ne_gap_mean", "rel_ne_gap_std")}
    for task in tasks:
      entry["eval_ne_mean"][task], entry["eval_ne_std"][task] = _stats([s["eval_ne"][task] for s in per_seed])
      entry["rel_ne_gap_mean"][task], entry["rel_ne_gap_std"][task] = _stats(
          [s["rel_ne_gap"][task] for s in per_seed])
    policies[name] = {**entry, "seeds": per_seed}
  b = policies[base]
  floor = {"baseline_rel_ne_std": {t: (None if b["eval_ne_std"][t] is None else b["eval_ne_std"][t] /
                                       b["eval_ne_mean"][t]) for t in tasks},
           # NE < 1: the model beats the base rate; a task that does not has learned nothing to compare.
           "baseline_beats_base_rate": {t: b["eval_ne_mean"][t] < 1.0 for t in tasks}}
  if "none" in policies:
    floor["f32_gap_mean"] = policies["none"]["rel_ne_gap_mean"]
    floor["f32_gap_std"] = policies["none"]["rel_ne_gap_std"]
  return policies, floor


def verdict(policies: dict, floor: dict, baseline: str) -> dict:
  """Per policy and task: within BOUND, and within two standard deviations of the float32 gap; and whether
  the seeds resolve the bound at all: `half_width`, two standard errors of the mean gap (2 std / sqrt(seeds)),
  is at most BOUND. A task whose gap moves more than that from seed to seed passes or fails by chance."""
  out = {}
  for name, r in policies.items():
    if name in (baseline, "none"):
      continue
    out[name] = {}
    n = len(r["seeds"])
    for task, gap in r["rel_ne_gap_mean"].items():
      f32_std = (floor.get("f32_gap_std") or {}).get(task)
      std = r["rel_ne_gap_std"][task]
      half = None if std is None else 2 * std / math.sqrt(n)
      out[name][task] = {
          "within_bound": abs(gap) <= BOUND,
          "within_2std_of_f32": (None if f32_std is None else abs(gap - floor["f32_gap_mean"][task]) <= 2 * f32_std),
          "half_width": half, "resolved": None if half is None else half <= BOUND}
  return out


def not_a_claim(smoke: bool, seeds: int, names) -> list[str]:
  """Why a run's numbers are not a parity claim (empty: they are)."""
  return [why for why, bad in (("--quick: a short run far from the plateau", smoke),
                               ("one seed: no spread to judge a gap against", seeds < 2),
                               ("no 'none' policy: no float32 noise floor", "none" not in names)) if bad]


def parity(cfg, names, runs: str, out_json: str, *, seeds: int = 1, smoke: bool = False, probe: dict | None = None,
           jobs: int = 1, compile_cache: str | None = None, memory: bool = False, log=print) -> dict:
  """Trains `cfg` for each of `seeds` seeds (seed_config) under each policy of `names` (the first is the
  baseline; PROBE: the probe JSON's proposal) into runs/seed<s>/<policy> and returns the results (module
  docstring); the PNG goes next to out_json. jobs > 1 trains that many runs at a time in spawned processes
  sharing `compile_cache` (same numbers: every run is deterministic on its own). smoke: the run is too short
  to be a parity claim (--quick), and its output says so."""
  if os.path.exists(runs) and os.listdir(runs):
    raise FileExistsError(f"{runs} is not empty: pass another --out or --runs")
  if seeds < 1 or jobs < 1:
    raise ValueError(f"need seeds >= 1 and jobs >= 1, got {seeds}, {jobs}")
  t0 = time.perf_counter()
  if compile_cache and jobs == 1:
    jax.config.update("jax_compilation_cache_dir", compile_cache)
  shares = flop_shares(cfg, names, probe)
  seed_list = list(range(seeds))
  # Seed-major, so that parallel workers compile different policies first and later seeds hit the cache.
  todo = [(s, name, policy_config(seed_config(cfg, s), name, probe), os.path.join(runs, f"seed{s}", name))
          for s in seed_list for name in names]
  records, curves = {}, {}

  def done(s, name, result):
    records[(s, name)], curve = result
    if s == seed_list[0]:
      curves[name] = curve
    r = records[(s, name)]
    log(f"seed {s} {name:>8}: " + "  ".join(f"{task} NE {ne:.4f}" for task, ne in r["eval_ne"].items())
        + f"  ({r['train_s']:.0f} s)")

  if jobs == 1:
    for s, name, run_cfg, run_dir in todo:
      done(s, name, train_one(run_cfg, run_dir))
  else:
    ctx = multiprocessing.get_context("spawn")  # a forked child would inherit a started XLA runtime
    with concurrent.futures.ProcessPoolExecutor(jobs, mp_context=ctx) as pool:
      futures = {pool.submit(train_one, run_cfg, run_dir, compile_cache): (s, name)
                 for s, name, run_cfg, run_dir in todo}
      for future in concurrent.futures.as_completed(futures):
        done(*futures[future], future.result())
  tasks = list(records[(seed_list[0], names[0])]["eval_ne"])
  policies, floor = summarize(records, names, seed_list, tasks)
  for name in names:
    policies[name]["flop_share"] = shares[name]
    if memory:
      policies[name]["step_memory_bytes"] = step_memory(policy_config(cfg, name, probe))
  reasons = not_a_claim(smoke, seeds, names)
  out = {"config": cfg.name, "steps": cfg.train.steps, "eval_examples": cfg.train.eval_examples,
         "baseline": names[0], "backend": jax.default_backend(), "seeds": seed_list, "tasks": tasks,
         "parity_claim": not reasons, "not_a_claim_because": reasons, "bound": BOUND,
         "policies": policies, "noise_floor": floor, "verdict": verdict(policies, floor, names[0])}
  if probe is not None and PROBE in names:
    out["probe_rules"] = probe["end_to_end"]["rules"]
  png = os.path.splitext(out_json)[0] + ".png"
  plot(out, curves, png)
  out["png"] = png
  out["wall_s"] = time.perf_counter() - t0
  return out


def _pct(x, sign: str = "+") -> str:
  return "-" if x is None else f"{100 * x:{sign}.3f}%"


def table(out: dict) -> str:
  """The printed summary: per policy and task, mean NE, mean gap +- std over seeds; the noise floor; the
  verdict (or why this run is not a parity claim)."""
  tasks = out["tasks"]
  lines = [f"{out['config']}, {len(out['seeds'])} seed(s) x {out['steps']} steps, eval on {out['eval_examples']} "
           f"examples" + ("" if out["parity_claim"] else "  -- SMOKE TEST, NOT A PARITY CLAIM: "
                          + "; ".join(out["not_a_claim_because"])),
           f"{'policy':>8} " + " ".join(f"{t + ' NE':>12} {t + ' gap (mean +- std)':>30}" for t in tasks)
           + f" {'fp8 FLOPs':>10} {'temp MB':>8}"]
  for name, r in out["policies"].items():
    fp8_share = sum(v for k, v in r["flop_share"].items() if k not in ("bf16", "none"))
    mem = r.get("step_memory_bytes", {}).get("temp_size_in_bytes")
    cells = [f"{r['eval_ne_mean'][t]:>12.4f} {_pct(r['rel_ne_gap_mean'][t]) + ' +- ' + _pct(r['rel_ne_gap_std'][t], ''):>30}"
             for t in tasks]
    lines.append(f"{name:>8} " + " ".join(cells) + f" {100 * fp8_share:>9.1f}% "
                 + (f"{mem / 2**20:>8.1f}" if mem else f"{'-':>8}"))
  floor = out["noise_floor"]
  lines.append("noise floor: baseline NE spread over seeds " + ", ".join(
      f"{t} {_pct(floor['baseline_rel_ne_std'][t], '')}" for t in tasks) + (
      "; float32 gap " + ", ".join(f"{t} {_pct(floor['f32_gap_mean'][t])} +- {_pct(floor['f32_gap_std'][t], '')}"
                                   for t in tasks) if "f32_gap_mean" in floor else ""))
  for t in tasks:
    if not floor["baseline_beats_base_rate"][t]:
      lines.append(f"note: the baseline's {t} NE is not below 1 (it has not beaten the base rate)")
  yes = {True: "yes", False: "NO", None: "-"}
  for name, by_task in out["verdict"].items():
    lines.append(f"{name}: " + ", ".join(
        f"{t} within {100 * out['bound']:.1f}%: {yes[v['within_bound']]}, within 2 std of float32: "
        f"{yes[v['within_2std_of_f32']]}, resolved: {yes[v['resolved']]} (2 SE {_pct(v['half_width'], '')})"
        for t, v in by_task.items()))
  return "\n".join(lines)
